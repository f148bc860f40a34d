//! The RPC side of a role process: a tonic `RoleService` that hands every call to the
//! compute thread and awaits its reply.
//!
//! Why a thread: model forward/backward passes and collectives block for seconds to
//! minutes, and the communicators block their caller by design. Running them on the
//! tokio runtime would stall every other RPC, including the Ping the worker's health
//! checks rely on. One dedicated OS thread owns the model, optimizer and communicators
//! (none of which need to be shared), fed through a bounded channel; handlers only
//! (de)serialize and wait on a oneshot. A panic on that thread ends the process with the
//! message on stderr, so the worker sees an exit instead of a hang.

use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::time::Duration;

use rlhf_core::batch::{encode, to_chunks, Assembler, DataBatch, CHUNK_BYTES};
use rlhf_core::CommGroup;
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::role_service_server::{RoleService, RoleServiceServer};
use rlhf_proto::MAX_MESSAGE_BYTES;
use rlhf_runtime::actor::{HEAD_ADDRESS_ENV, HEAD_TLS_DOMAIN_ENV, MAX_BATCH_BYTES};
use rlhf_runtime::auth::CheckToken;
use rlhf_runtime::frames::FramedBatch;
use rlhf_runtime::net;
use rlhf_runtime::shared_batch;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::host::{BatchCall, RoleHost};
use crate::rendezvous::{HeadKv, Rendezvous};
use crate::saves::{Push, Saves};

type Job = Box<dyn FnOnce(&mut RoleHost) + Send>;

/// Jobs waiting for the compute thread; callers wait (asynchronously) beyond this.
const QUEUE: usize = 16;

/// Sends jobs to the compute thread.
#[derive(Clone)]
pub struct Compute {
    tx: mpsc::Sender<Job>,
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}

impl Compute {
    /// Starts the compute thread owning `actor`.
    pub fn spawn(mut actor: RoleHost) -> rlhf_core::Result<Self> {
        let (tx, mut rx) = mpsc::channel::<Job>(QUEUE);
        std::thread::Builder::new()
            .name("rlhf-compute".into())
            .spawn(move || {
                while let Some(job) = rx.blocking_recv() {
                    if let Err(p) = std::panic::catch_unwind(AssertUnwindSafe(|| job(&mut actor))) {
                        eprintln!(
                            "error: the {} compute thread panicked: {}; exiting",
                            actor.kind,
                            panic_message(p.as_ref())
                        );
                        std::process::exit(101);
                    }
                }
            })
            .map_err(|e| rlhf_core::Error::io("starting the compute thread", e))?;
        Ok(Self { tx })
    }

    /// Runs `f` on the compute thread and returns its result.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut RoleHost) -> crate::Result<T> + Send + 'static,
    ) -> Result<T, Status> {
        let (reply, rx) = oneshot::channel();
        let job: Job = Box::new(move |a: &mut RoleHost| {
            let _ = reply.send(f(a));
        });
        self.tx
            .send(job)
            .await
            .map_err(|_| Status::internal("the compute thread is gone"))?;
        match rx.await {
            Ok(r) => r.map_err(|e| {
                tracing::warn!("role call failed: {e}");
                Status::from(e)
            }),
            Err(_) => Err(Status::internal("the compute thread dropped the call")),
        }
    }
}

/// The tonic service: a thin adapter over [`RoleHost`].
pub struct RoleServer {
    compute: Compute,
    saves: Saves,
    /// Token and TLS for reaching workers (checkpoint snapshots).
    client: net::ClientOptions,
    /// Communicator rendezvous through the head's KV store (relayed when served without
    /// a head).
    rendezvous: Rendezvous,
}

type ChunkStream = Pin<Box<dyn futures::Stream<Item = Result<pb::BatchChunk, Status>> + Send>>;

impl RoleServer {
    pub fn new(compute: Compute, client: net::ClientOptions, kv: Option<HeadKv>) -> Self {
        Self {
            compute,
            saves: Saves::default(),
            client,
            rendezvous: Rendezvous::new(kv),
        }
    }

    async fn load_from_disk(&self, dir: &str) -> Result<u64, Status> {
        let dir = dir.to_string();
        self.compute.run(move |a| a.load_checkpoint(&dir)).await
    }

    async fn batch(
        &self,
        call: BatchCall,
        mut req: Request<Streaming<pb::BatchChunk>>,
    ) -> Result<Response<ChunkStream>, Status> {
        if let Some(batch) = FramedBatch::take(req.extensions_mut()) {
            // Over control frames: the answer goes back the same way.
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::info!(
                    "{FRAMED_LOG} (the driver is on another host, or --batch-path frames)"
                )
            });
            let out = self.compute.run(move |a| a.batch(call, &batch)).await?;
            let mut resp: Response<ChunkStream> =
                Response::new(Box::pin(tokio_stream::iter(Vec::new())));
            resp.extensions_mut().insert(FramedBatch(out));
            return Ok(resp);
        }
        let mut stream = req.into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("empty batch stream"))?;
        if first.shared.is_some() {
            return self.batch_shared(call, first, stream).await;
        }
        let mut asm = Assembler::new(MAX_BATCH_BYTES);
        asm.push(first)?;
        while let Some(chunk) = stream.message().await? {
            asm.push(chunk)?;
        }
        // Decoding copies the whole batch: off the async workers, which also serve Ping.
        let batch: DataBatch = tokio::task::spawn_blocking(move || asm.finish())
            .await
            .map_err(|e| Status::internal(format!("batch decoder: {e}")))??;
        let chunks = self
            .compute
            .run(move |a| {
                let out = a.batch(call, &batch)?;
                Ok(to_chunks(encode(&out)?, CHUNK_BYTES))
            })
            .await?;
        Ok(streamed(chunks))
    }

    /// A batch the caller put in shared memory on this host ([`shared_batch`]): read as
    /// views of its mapping, and answered the same way. The caller keeps its request stream
    /// open until it has mapped the answer; the answer's file is held until then (or
    /// [`SHARED_ANSWER_HOLD`]), so its memory is never gone before it is read.
    async fn batch_shared(
        &self,
        call: BatchCall,
        first: pb::BatchChunk,
        mut stream: Streaming<pb::BatchChunk>,
    ) -> Result<Response<ChunkStream>, Status> {
        let opened =
            tokio::task::spawn_blocking(move || shared_batch::open(&first, MAX_BATCH_BYTES))
                .await
                .map_err(|e| Status::internal(format!("shared batch reader: {e}")))??;
        let batch = opened.map_err(|u| shared_batch::unreachable_status(&u))?;
        let out = self.compute.run(move |a| a.batch(call, &batch)).await?;
        let written =
            tokio::task::spawn_blocking(move || match shared_batch::SharedFile::write(&out) {
                Ok(f) => Ok(f),
                Err(e) => Err((e, out)),
            })
            .await
            .map_err(|e| Status::internal(format!("shared batch writer: {e}")))?;
        match written {
            Ok(file) => {
                let chunk = file.chunk();
                tokio::spawn(async move {
                    let drained = async { while let Ok(Some(_)) = stream.message().await {} };
                    let _ = tokio::time::timeout(SHARED_ANSWER_HOLD, drained).await;
                    drop(file);
                });
                Ok(Response::new(Box::pin(tokio_stream::iter([Ok(chunk)]))))
            }
            Err((e, out)) => {
                tracing::warn!("answering through shared memory failed ({e}); streaming instead");
                Ok(streamed(to_chunks(encode(&out)?, CHUNK_BYTES)))
            }
        }
    }
}

/// What a role process logs, once, when its first batch arrives as control frames.
pub const FRAMED_LOG: &str = "batches arrive as raw control frames over TCP";

/// An answer streamed in `chunks`.
fn streamed(chunks: Vec<pb::BatchChunk>) -> Response<ChunkStream> {
    Response::new(Box::pin(tokio_stream::iter(chunks.into_iter().map(Ok))))
}

/// Longest a shared-memory answer is held for a caller that does not say it has mapped it.
const SHARED_ANSWER_HOLD: Duration = Duration::from_secs(60);

#[tonic::async_trait]
impl RoleService for RoleServer {
    async fn init_role(
        &self,
        req: Request<pb::InitRoleRequest>,
    ) -> Result<Response<pb::InitRoleResponse>, Status> {
        let req = req.into_inner();
        let out = self.compute.run(move |a| a.init(&req)).await?;
        Ok(Response::new(out))
    }

    async fn prepare_comm(
        &self,
        req: Request<pb::PrepareCommRequest>,
    ) -> Result<Response<pb::PrepareCommResponse>, Status> {
        let req = req.into_inner();
        let key = req.kv_key.clone();
        let group = CommGroup::from_wire(req.group, "PrepareCommRequest.group")?;
        let p = self.compute.run(move |a| a.prepare_comm(&req)).await?;
        let out = self.rendezvous.publish_or_relay(group, &key, p).await?;
        Ok(Response::new(out))
    }

    async fn join_comm(
        &self,
        req: Request<pb::JoinCommRequest>,
    ) -> Result<Response<pb::JoinCommResponse>, Status> {
        let compute = self.compute.clone();
        self.rendezvous
            .join(req.into_inner(), move |req| async move {
                compute.run(move |a| a.join_comm(&req)).await
            })
            .await?;
        Ok(Response::new(pb::JoinCommResponse {}))
    }

    type GenerateStream = ChunkStream;
    async fn generate(
        &self,
        req: Request<Streaming<pb::BatchChunk>>,
    ) -> Result<Response<ChunkStream>, Status> {
        self.batch(BatchCall::Generate, req).await
    }

    type ComputeLogProbsStream = ChunkStream;
    async fn compute_log_probs(
        &self,
        req: Request<Streaming<pb::BatchChunk>>,
    ) -> Result<Response<ChunkStream>, Status> {
        self.batch(BatchCall::ComputeLogProbs, req).await
    }

    type ComputeValuesStream = ChunkStream;
    async fn compute_values(
        &self,
        req: Request<Streaming<pb::BatchChunk>>,
    ) -> Result<Response<ChunkStream>, Status> {
        self.batch(BatchCall::ComputeValues, req).await
    }

    type ComputeScoresStream = ChunkStream;
    async fn compute_scores(
        &self,
        req: Request<Streaming<pb::BatchChunk>>,
    ) -> Result<Response<ChunkStream>, Status> {
        self.batch(BatchCall::ComputeScores, req).await
    }

    type UpdateActorStream = ChunkStream;
    async fn update_actor(
        &self,
        req: Request<Streaming<pb::BatchChunk>>,
    ) -> Result<Response<ChunkStream>, Status> {
        self.batch(BatchCall::UpdateActor, req).await
    }

    type UpdateCriticStream = ChunkStream;
    async fn update_critic(
        &self,
        req: Request<Streaming<pb::BatchChunk>>,
    ) -> Result<Response<ChunkStream>, Status> {
        self.batch(BatchCall::UpdateCritic, req).await
    }

    type UpdateSftStream = ChunkStream;
    async fn update_sft(
        &self,
        req: Request<Streaming<pb::BatchChunk>>,
    ) -> Result<Response<ChunkStream>, Status> {
        self.batch(BatchCall::UpdateSft, req).await
    }

    type UpdatePreferenceStream = ChunkStream;
    async fn update_preference(
        &self,
        req: Request<Streaming<pb::BatchChunk>>,
    ) -> Result<Response<ChunkStream>, Status> {
        self.batch(BatchCall::UpdatePreference, req).await
    }

    type UpdateRewardModelStream = ChunkStream;
    async fn update_reward_model(
        &self,
        req: Request<Streaming<pb::BatchChunk>>,
    ) -> Result<Response<ChunkStream>, Status> {
        self.batch(BatchCall::UpdateRewardModel, req).await
    }

    async fn sync_weights(
        &self,
        req: Request<pb::SyncWeightsRequest>,
    ) -> Result<Response<pb::SyncWeightsResponse>, Status> {
        let req = req.into_inner();
        let out = self.compute.run(move |a| a.sync_weights(&req)).await?;
        Ok(Response::new(out))
    }

    async fn weights_checksum(
        &self,
        _req: Request<pb::WeightsChecksumRequest>,
    ) -> Result<Response<pb::WeightsChecksumResponse>, Status> {
        let out = self.compute.run(|a| a.weights_checksum()).await?;
        Ok(Response::new(out))
    }

    async fn save_checkpoint(
        &self,
        req: Request<pb::SaveCheckpointRequest>,
    ) -> Result<Response<pb::SaveCheckpointResponse>, Status> {
        let req = req.into_inner();
        let dir = crate::host::checkpoint_dir(&req.dir)
            .map_err(Status::from)?
            .to_path_buf();
        let push = match req.snapshot {
            Some(t) if !t.address.is_empty() => {
                rlhf_runtime::head::validate::name(&t.job_id, "SnapshotTarget.job_id", false)?;
                Some(Push {
                    target: t,
                    client: self.client.clone(),
                })
            }
            _ => None,
        };
        let image = self
            .compute
            .run(move |a| a.capture_checkpoint(Some(&dir)))
            .await?;
        if req.background {
            self.saves.start(req.dir, image, push).await;
            return Ok(Response::new(pb::SaveCheckpointResponse::default()));
        }
        let saved = self.saves.write_now(req.dir, image, push).await?;
        Ok(Response::new(saved.into()))
    }

    async fn wait_checkpoint(
        &self,
        req: Request<pb::WaitCheckpointRequest>,
    ) -> Result<Response<pb::SaveCheckpointResponse>, Status> {
        let req = req.into_inner();
        let timeout = (req.timeout_ms > 0).then(|| Duration::from_millis(req.timeout_ms));
        let saved = self.saves.wait(&req.dir, timeout).await?;
        Ok(Response::new(saved.into()))
    }

    async fn load_checkpoint(
        &self,
        req: Request<pb::LoadCheckpointRequest>,
    ) -> Result<Response<pb::LoadCheckpointResponse>, Status> {
        let req = req.into_inner();
        let restored = match req.snapshot.filter(|s| !s.parts.is_empty()) {
            None => Err(None),
            Some(src) => crate::restore::fetch(&self.client, &src, &req.dir)
                .await
                .map_err(Some),
        };
        let (weights_checksum, source) = match restored {
            Ok(r) => {
                let dir = r.dir();
                match self.compute.run(move |a| a.load_checkpoint(&dir)).await {
                    Ok(sum) => (sum, r.describe()),
                    // Whatever is wrong with the copy, the files on disk may be fine.
                    Err(e) => {
                        let why =
                            format!("disk (loading the memory snapshot failed: {})", e.message());
                        tracing::warn!("{why}");
                        (self.load_from_disk(&req.dir).await?, why)
                    }
                }
            }
            Err(why) => {
                let source = match why {
                    None => "disk".to_string(),
                    Some(e) => {
                        tracing::warn!(
                            "the memory snapshot was not available ({e}); loading {} from disk",
                            req.dir
                        );
                        format!("disk (the memory snapshot was not available: {e})")
                    }
                };
                (self.load_from_disk(&req.dir).await?, source)
            }
        };
        Ok(Response::new(pb::LoadCheckpointResponse {
            weights_checksum,
            source,
        }))
    }
}

/// How a role process serves.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub actor_id: String,
    pub kind: rlhf_core::RoleKind,
    /// IP other ranks reach this process on (the TCP rendezvous binds here).
    pub host: String,
    pub token: String,
    /// TLS identity (the worker's); plain TCP without one.
    pub tls: net::ServerTls,
    /// The head (host:port), whose KV store carries communicator rendezvous; `None` serves
    /// without one (the driver then relays them).
    pub head_address: Option<String>,
    /// The name the head's TLS certificate is checked against, when it is not the host of
    /// `head_address` (the worker's `--tls-domain`).
    pub head_tls_domain: Option<String>,
}

impl ServeOptions {
    /// How this process reaches other cluster services: the cluster token, and the cluster
    /// CA when it serves TLS.
    fn client(&self) -> net::ClientOptions {
        net::ClientOptions {
            tls_ca: self.tls.ca.clone(),
            ..net::ClientOptions::new(self.token.clone())
        }
    }
}

/// Serves RoleService and ActorService (Ping) on `listener` until `shutdown`.
pub async fn serve(
    opts: ServeOptions,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> rlhf_core::Result<()> {
    let host = advertised_host(&opts.host);
    let mut role_host = RoleHost::new(opts.kind, &host);
    // The collectives between role processes use TLS whenever the cluster does.
    if let (Some(cert), Some(key), Some(ca)) = (&opts.tls.cert, &opts.tls.key, &opts.tls.ca) {
        role_host.groups.tls = Some(
            rlhf_collective::CommTls::from_pem_files(cert, key, ca)
                .map_err(rlhf_core::Error::invalid)?,
        );
    }
    let compute = Compute::spawn(role_host)?;
    let kv = match &opts.head_address {
        Some(a) if !a.is_empty() => {
            let mut client = opts.client();
            client.tls_domain = opts.head_tls_domain.clone();
            Some(HeadKv::new(a, &client)?)
        }
        _ => None,
    };
    let role = tonic::service::interceptor::InterceptedService::new(
        RoleServiceServer::new(RoleServer::new(compute, opts.client(), kv))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
        CheckToken::new(&opts.token, "role"),
    );
    let routes = tonic::service::Routes::new(rlhf_runtime::actor::actor_service(
        &opts.actor_id,
        &opts.token,
    ))
    .add_service(role);
    // HTTP/2 for the batch streams, control frames for the driver's unary calls.
    rlhf_runtime::frames::server::serve(&opts.tls, routes, listener, shutdown, "role", &opts.token)
        .await
}

/// The worker's entry point for `rlhf-worker actor --kind <role>`: binds, writes the ready
/// file and serves until `shutdown`.
pub async fn run(
    opts: rlhf_runtime::actor::ActorOptions,
    shutdown: CancellationToken,
) -> rlhf_core::Result<()> {
    let kind: rlhf_core::RoleKind = opts.kind.parse()?;
    let (listener, addr) = rlhf_runtime::actor::bind_ready(&opts.host, &opts.ready_file).await?;
    eprintln!("actor {} ({kind}) serving on {addr}", opts.actor_id);
    serve(
        ServeOptions {
            actor_id: opts.actor_id,
            kind,
            host: opts.host,
            token: opts.token,
            tls: opts.tls,
            // The worker names its head to every process it starts.
            head_address: std::env::var(HEAD_ADDRESS_ENV).ok(),
            head_tls_domain: std::env::var(HEAD_TLS_DOMAIN_ENV)
                .ok()
                .filter(|d| !d.is_empty()),
        },
        listener,
        shutdown,
    )
    .await
}

/// A wildcard bind address is not something a peer can connect to: use the primary IP.
fn advertised_host(host: &str) -> String {
    match host.parse::<std::net::IpAddr>() {
        Ok(ip) if ip.is_unspecified() => net::primary_ip().to_string(),
        _ => host.to_string(),
    }
}
