//! WorkerGroup: the ranks of one role part. Splits a batch across its ranks, calls them
//! concurrently, gathers the answers in rank order and drops the padding rows.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::try_join_all;
use futures::StreamExt;
use rlhf_core::batch::{Assembler, DataBatch};
use rlhf_core::calls::{self, RoleCall, Wire};
use rlhf_core::{BatchRoute, CommGroup, Error, FailureKind, Result, RoleKind, RolePart};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::role_service_client::RoleServiceClient;
pub use rlhf_proto::BatchCall;
// MAX_ANSWER_BYTES: the largest batch a role answer may be, streamed or framed.
use rlhf_runtime::frames::batch::MAX_ANSWER_BYTES;
use rlhf_runtime::frames::FramedBatch;
use rlhf_runtime::net::AuthChannel;
use rlhf_runtime::shared_batch;
use tonic::Streaming;

/// One role process.
#[derive(Clone, Debug)]
pub struct Member {
    pub actor_id: String,
    pub node_id: String,
    pub address: String,
    pub pid: i32,
    pub log_file: String,
    pub client: RoleServiceClient<AuthChannel>,
    /// Shared memory or gRPC, as the first batch call found.
    pub batches: BatchPath,
}

/// How batches reach one member: through shared memory while that works (same host), else
/// as raw control frames over TCP where its connection speaks them, else streamed over
/// gRPC; or the path `--batch-path` asked for. Untried until the first call, which settles
/// it (one log line per member); a member whose address is surely another host's makes no
/// shared-memory attempt at all.
#[derive(Clone, Debug, Default)]
pub struct BatchPath {
    state: Arc<AtomicU8>,
    /// The member's connection speaks control frames ([`FramedBatch`]).
    framed: bool,
    /// `--batch-path`.
    forced: Option<BatchRoute>,
}

const PATH_SHARED: u8 = 1;
const PATH_STREAM: u8 = 2;
/// Not through shared memory (another host), not yet said.
const PATH_REMOTE: u8 = 3;

impl BatchPath {
    /// Untried, chosen per call as the type doc says; `framed`: the member's connection
    /// speaks control frames.
    pub fn new(framed: bool) -> Self {
        Self {
            state: Arc::default(),
            framed,
            forced: None,
        }
    }

    /// [`BatchPath::new`] for the member at `address`: one on another host
    /// ([`shared_batch::on_another_host`]) never gets a batch through shared memory.
    pub fn for_address(framed: bool, address: &str) -> Self {
        let p = Self::new(framed);
        if shared_batch::on_another_host(address) {
            p.state.store(PATH_REMOTE, Ordering::Relaxed);
        }
        p
    }

    /// Always `route` (`--batch-path`); frames on a connection without them is refused.
    pub fn forced(framed: bool, route: BatchRoute, member: &str) -> Result<Self> {
        if route == BatchRoute::Frames && !framed {
            return Err(Error::invalid(format!(
                "--batch-path frames: role process {member} does not speak control frames (a connection whose frames hello or TLS handshake failed falls back to HTTP/2: the driver's debug log says why); use --batch-path stream or leave the flag out"
            )));
        }
        Ok(Self {
            forced: Some(route),
            ..Self::new(framed)
        })
    }

    fn shared_allowed(&self) -> bool {
        match self.forced {
            None => !matches!(
                self.state.load(Ordering::Relaxed),
                PATH_STREAM | PATH_REMOTE
            ),
            Some(r) => r == BatchRoute::Shm,
        }
    }

    /// Whether batches that do not go through shared memory go as control frames.
    pub fn is_framed(&self) -> bool {
        match self.forced {
            None => self.framed,
            Some(r) => r == BatchRoute::Frames,
        }
    }

    fn settle(&self, member: &Member, path: u8, why: &str) {
        if self.state.swap(path, Ordering::Relaxed) != path {
            let why = match self.forced {
                Some(r) => format!("asked for with --batch-path {r}"),
                None if path == PATH_SHARED => "same host".to_string(),
                None => why.to_string(),
            };
            let how = if path == PATH_SHARED {
                format!("through shared memory ({why})")
            } else if self.is_framed() {
                format!("as raw control frames over TCP ({why})")
            } else {
                format!("streamed over gRPC ({why})")
            };
            tracing::info!("batches to actor {} go {how}", member.actor_id);
        }
    }

    /// Shared memory failed for `why`: from now on the other path, unless shared memory
    /// was asked for.
    fn fall_back(&self, member: &Member, why: &str) -> Result<()> {
        if self.forced == Some(BatchRoute::Shm) {
            return Err(Error::invalid(format!(
                "--batch-path shm: batches cannot reach actor {} through shared memory ({why}); leave the flag out to pick the path per role process",
                member.actor_id
            )));
        }
        self.settle(member, PATH_STREAM, why);
        Ok(())
    }

    /// Whether batches to this member have gone through shared memory.
    pub fn is_shared(&self) -> bool {
        self.state.load(Ordering::Relaxed) == PATH_SHARED
    }
}

/// One batch call with the request already a stream of chunks (or a request carrying a
/// [`FramedBatch`]); the answer.
async fn send<R>(
    member: &Member,
    call: BatchCall,
    req: R,
) -> std::result::Result<tonic::Response<Streaming<pb::BatchChunk>>, tonic::Status>
where
    R: tonic::IntoStreamingRequest<Message = pb::BatchChunk>,
{
    let mut c = member.client.clone();
    match call {
        BatchCall::Generate => c.generate(req).await,
        BatchCall::ComputeLogProbs => c.compute_log_probs(req).await,
        BatchCall::ComputeValues => c.compute_values(req).await,
        BatchCall::ComputeScores => c.compute_scores(req).await,
        BatchCall::UpdateActor => c.update_actor(req).await,
        BatchCall::UpdateCritic => c.update_critic(req).await,
        BatchCall::UpdateSft => c.update_sft(req).await,
        BatchCall::UpdatePreference => c.update_preference(req).await,
        BatchCall::UpdateRewardModel => c.update_reward_model(req).await,
    }
}

/// The batch as raw control frames beside the call, the answer the same way.
async fn call_framed(member: &Member, call: BatchCall, batch: &DataBatch) -> Result<DataBatch> {
    let mut req = tonic::Request::new(futures::stream::empty::<pb::BatchChunk>());
    req.extensions_mut().insert(FramedBatch(batch.clone()));
    let mut resp = send(member, call, req).await.map_err(Error::from)?;
    FramedBatch::take(resp.extensions_mut()).ok_or_else(|| {
        Error::internal(format!(
            "{} on actor {} answered a framed batch without one",
            call.name(),
            member.actor_id
        ))
    })
}

/// The answer's first chunk: the shared-memory reference, or the first of a stream.
async fn first_chunk(call: BatchCall, s: &mut Streaming<pb::BatchChunk>) -> Result<pb::BatchChunk> {
    s.message()
        .await
        .map_err(Error::from)?
        .ok_or_else(|| Error::internal(format!("{} answered with no batch", call.name())))
}

/// Reads a streamed answer whose first chunk has arrived.
async fn read_streamed(
    first: pb::BatchChunk,
    mut s: Streaming<pb::BatchChunk>,
) -> Result<DataBatch> {
    let mut asm = Assembler::new(MAX_ANSWER_BYTES);
    asm.push(first)?;
    while let Some(chunk) = s.message().await.map_err(Error::from)? {
        asm.push(chunk)?;
    }
    asm.finish()
}

/// The batch through shared memory ([`shared_batch`]); `None` when the member cannot read
/// this process's memory (another host), so the caller streams it instead.
async fn call_shared(
    member: &Member,
    call: BatchCall,
    batch: &DataBatch,
) -> Result<Option<DataBatch>> {
    let b = batch.clone();
    let file = match tokio::task::spawn_blocking(move || shared_batch::SharedFile::write(&b))
        .await
        .map_err(|e| Error::internal(format!("shared batch writer: {e}")))?
    {
        Ok(f) => f,
        Err(e) => {
            member.batches.fall_back(member, &e.to_string())?;
            return Ok(None);
        }
    };
    // The request stream stays open until the answer is mapped: the member holds the
    // answer's memory until then.
    let (mapped, held) = tokio::sync::oneshot::channel::<()>();
    let stream = futures::stream::iter([file.chunk()]).chain(
        futures::stream::once(async move {
            let _ = held.await;
        })
        .filter_map(|()| std::future::ready(None)),
    );
    let mut answer = match send(member, call, stream).await {
        Ok(s) => s.into_inner(),
        Err(s) if shared_batch::is_unreachable(&s) => {
            member.batches.fall_back(member, s.message())?;
            return Ok(None);
        }
        Err(s) => return Err(Error::from(s)),
    };
    let first = first_chunk(call, &mut answer).await?;
    let out = if first.shared.is_some() {
        tokio::task::spawn_blocking(move || shared_batch::open(&first, MAX_ANSWER_BYTES))
            .await
            .map_err(|e| Error::internal(format!("shared batch reader: {e}")))??
            .map_err(|u| Error::internal(format!("the answer of actor {}: {u}", member.actor_id)))?
    } else {
        read_streamed(first, answer).await?
    };
    drop(mapped);
    drop(file);
    member.batches.settle(member, PATH_SHARED, "");
    Ok(Some(out))
}

/// Sends `batch` to one member and returns its answer batch: through shared memory when the
/// member is on this host, else streamed in chunks.
pub async fn call_batch(
    member: &Member,
    call: BatchCall,
    batch: &DataBatch,
    timeout: Duration,
) -> Result<DataBatch> {
    let fut = async move {
        if member.batches.shared_allowed() {
            if let Some(out) = call_shared(member, call, batch).await? {
                return Ok(out);
            }
        }
        if member.batches.forced.is_some() {
            member.batches.settle(member, PATH_STREAM, "");
        } else if member.batches.state.load(Ordering::Relaxed) == PATH_REMOTE {
            let why = format!("{} is another host's address", member.address);
            member.batches.settle(member, PATH_STREAM, &why);
        }
        if member.batches.is_framed() {
            return call_framed(member, call, batch).await;
        }
        let stream = rlhf_runtime::batch_stream(batch)?;
        let mut s = send(member, call, stream)
            .await
            .map_err(Error::from)?
            .into_inner();
        let first = first_chunk(call, &mut s).await?;
        read_streamed(first, s).await
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(Error::new(
            FailureKind::Timeout,
            format!(
                "{} on actor {} did not answer within {:.0} s",
                call.name(),
                member.actor_id,
                timeout.as_secs_f64()
            ),
        )),
    }
}

/// Which rank of which role failed, carried with the error so the driver can diagnose it.
#[derive(Debug)]
pub struct CallError {
    pub role: String,
    pub rank: usize,
    pub actor_id: String,
    pub error: Error,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} rank {} (actor {}): {}",
            self.role, self.rank, self.actor_id, self.error
        )
    }
}

/// What a worker group is: the ranks of one role part, or a communicator group made of
/// ranks of several parts (trainer rank 0 + the rollout ranks share the weights group).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupId {
    Role(RoleKind, RolePart),
    Comm(CommGroup),
}

impl std::fmt::Display for GroupId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GroupId::Role(k, RolePart::Whole) => write!(f, "{k}"),
            GroupId::Role(k, p) => write!(f, "{k}/{p}"),
            GroupId::Comm(g) => write!(f, "{g}"),
        }
    }
}

/// The ranks of one role part (e.g. actor_rollout/train).
#[derive(Clone, Debug)]
pub struct WorkerGroup {
    pub id: GroupId,
    pub members: Vec<Member>,
}

impl WorkerGroup {
    /// `actor_rollout/train`, `ref`, `weights`: how messages name the group.
    pub fn name(&self) -> String {
        self.id.to_string()
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Splits a request into one shard per rank (padded to a multiple of the rank count by
    /// repeating rows), calls every rank concurrently, concatenates the answers in rank order
    /// and drops the rows that answer the padding. Answers with no rows (metrics) are
    /// returned one per rank by [`WorkerGroup::call_each`] instead.
    pub async fn call_split<R: RoleCall>(
        &self,
        req: &R,
        timeout: Duration,
    ) -> std::result::Result<R::Response, CallError> {
        let n = self.members.len();
        if n == 0 {
            return Err(self.err(0, Error::invalid(format!("role {} has no ranks", self.id))));
        }
        let batch = req.to_batch().map_err(|e| self.err(0, e))?;
        let (padded, pad) = batch.pad_to_multiple(n).map_err(|e| self.err(0, e))?;
        let shards = padded.chunk(n).map_err(|e| self.err(0, e))?;
        let answers = self.fan_out(R::CALL, shards, timeout).await?;
        let whole = DataBatch::concat(&answers)
            .and_then(|w| w.unpad(pad))
            .and_then(|w| R::Response::from_batch(R::CALL, &w))
            .map_err(|e| self.err(0, e))?;
        Ok(whole)
    }

    /// Splits a request evenly (it must divide) and returns every rank's answer.
    pub async fn call_each<R: RoleCall>(
        &self,
        req: &R,
        timeout: Duration,
    ) -> std::result::Result<Vec<R::Response>, CallError> {
        let batch = req.to_batch().map_err(|e| self.err(0, e))?;
        let shards = batch
            .chunk(self.members.len())
            .map_err(|e| self.err(0, e))?;
        let answers = self.fan_out(R::CALL, shards, timeout).await?;
        answers
            .iter()
            .enumerate()
            .map(|(rank, a)| R::Response::from_batch(R::CALL, a).map_err(|e| self.err(rank, e)))
            .collect()
    }

    /// Sends shard `i` to rank `i` concurrently, addressed to this group's role part, and
    /// returns every answer in rank order.
    async fn fan_out(
        &self,
        call: BatchCall,
        mut shards: Vec<DataBatch>,
        timeout: Duration,
    ) -> std::result::Result<Vec<DataBatch>, CallError> {
        if shards.len() != self.members.len() {
            return Err(self.err(
                0,
                Error::internal(format!(
                    "{} shards for {} ranks of {}",
                    shards.len(),
                    self.members.len(),
                    self.id
                )),
            ));
        }
        if let GroupId::Role(kind, part) = self.id {
            for s in &mut shards {
                calls::set_target(s, kind, part);
            }
        }
        let futs =
            self.members
                .iter()
                .zip(&shards)
                .enumerate()
                .map(|(rank, (m, shard))| async move {
                    call_batch(m, call, shard, timeout)
                        .await
                        .map_err(|e| self.err(rank, e))
                });
        try_join_all(futs).await
    }

    /// Runs a unary call on every rank concurrently.
    pub async fn unary<T, F, Fut>(
        &self,
        timeout: Duration,
        what: &str,
        f: F,
    ) -> std::result::Result<Vec<T>, CallError>
    where
        F: Fn(usize, RoleServiceClient<AuthChannel>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    {
        let futs = self.members.iter().enumerate().map(|(rank, m)| {
            let fut = f(rank, m.client.clone());
            async move {
                match tokio::time::timeout(timeout, fut).await {
                    Ok(Ok(r)) => Ok(r.into_inner()),
                    Ok(Err(s)) => Err(self.err(rank, Error::from(s))),
                    Err(_) => Err(self.err(
                        rank,
                        Error::new(
                            FailureKind::Timeout,
                            format!(
                                "{what} did not answer within {:.0} s",
                                timeout.as_secs_f64()
                            ),
                        ),
                    )),
                }
            }
        });
        try_join_all(futs).await
    }

    pub fn err(&self, rank: usize, error: Error) -> CallError {
        CallError {
            role: self.name(),
            rank,
            actor_id: self
                .members
                .get(rank)
                .map(|m| m.actor_id.clone())
                .unwrap_or_default(),
            error,
        }
    }
}

/// Update metrics averaged over the ranks that reported each.
pub fn mean_metrics(answers: &[calls::UpdateResponse]) -> std::collections::BTreeMap<String, f64> {
    let mut sums: std::collections::BTreeMap<String, (f64, usize)> = Default::default();
    for a in answers {
        for (k, &x) in &a.metrics {
            let e = sums.entry(k.clone()).or_default();
            e.0 += x;
            e.1 += 1;
        }
    }
    sums.into_iter()
        .map(|(k, (s, n))| (k, s / n as f64))
        .collect()
}
