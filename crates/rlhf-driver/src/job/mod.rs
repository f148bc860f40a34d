//! One job from placement to the last checkpoint: options, the run (placement, resume,
//! the loop, summary) and the loop's state. What a step does is an [`Algorithm`]
//! (`algorithm`; PPO in `ppo`); the loop's services live beside it: `rollout` (prompts and
//! responses), `pipeline` (the rollout lane that makes them ahead of the trainers in async
//! modes), `sync` (weights and checkpoints). Everything the user sees goes out as events
//! through `crate::report`.

mod algorithm;
mod pipeline;
mod ppo;
mod rollout;
mod run;
mod stage;
mod sync;

pub use run::run;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rlhf_algo::metric;
use rlhf_config::{PpoConfig, RoleKind};
use rlhf_core::{CommBackend, CommGroup, Error, Result};
use rlhf_runtime::net::ClientOptions;

use crate::checkpoint::{self};
use crate::cluster::{self, Roles};
use crate::group::CallError;
use crate::output::LedgerEntry;
use crate::report::{Event, Reporter, Reporters};

use algorithm::{Algorithm, StepOutput};

/// How to run a job.
pub struct DriverOptions {
    /// The job config with every path absolute.
    pub config: PpoConfig,
    pub job_id: String,
    /// `--resume`: `latest` or a checkpoint directory (overrides `checkpoint.resume`).
    pub resume: Option<String>,
    /// Token and TLS for talking to role actors.
    pub client: ClientOptions,
    /// Collective backend of the data-parallel groups (`--comm-backend`); `None` chooses per
    /// group (see `sync::dp_backend`).
    pub comm_backend: Option<CommBackend>,
    /// The trainer → rollout weights backend; `None` chooses (see `SyncPath::choose`).
    pub weight_sync_backend: Option<CommBackend>,
    /// How batches go to role processes (`--batch-path`); `None` chooses per process
    /// (see `group::BatchPath`).
    pub batch_path: Option<rlhf_core::BatchRoute>,
    /// Bound on every role call (a generation, an update, ...).
    pub call_timeout: Duration,
    /// Bound on placement and actor start-up (model loading included).
    pub start_timeout: Duration,
    /// Stop (after checkpointing) once this many steps ran in this invocation.
    pub stop_after: Option<u64>,
    /// Reporters besides the console and the JSONL files (a tracker, a test's recorder).
    pub reporters: Vec<Box<dyn Reporter>>,
    /// The key checkpoints are signed with and a resume verifies (`--checkpoint-key-file`);
    /// `None`: derived from the cluster token in `client`.
    pub checkpoint_key: Option<rlhf_core::seal::CheckpointKey>,
    /// Resume from a checkpoint without checking its signature (`--trust-checkpoint`).
    pub trust_checkpoint: bool,
}

impl DriverOptions {
    pub fn new(config: PpoConfig, job_id: impl Into<String>, client: ClientOptions) -> Self {
        Self {
            config,
            job_id: job_id.into(),
            resume: None,
            client,
            comm_backend: None,
            weight_sync_backend: None,
            batch_path: None,
            call_timeout: Duration::from_secs(3600),
            start_timeout: Duration::from_secs(600),
            stop_after: None,
            reporters: Vec::new(),
            checkpoint_key: None,
            trust_checkpoint: false,
        }
    }

    /// The key this run signs its checkpoints with.
    pub fn checkpoint_key(&self) -> rlhf_core::seal::CheckpointKey {
        self.checkpoint_key.clone().unwrap_or_else(|| {
            rlhf_core::seal::CheckpointKey::from_secret(
                self.client.token.as_bytes(),
                "the cluster token",
            )
        })
    }

    /// How a resume or a restart treats a checkpoint's signature, given [`Self::checkpoint_key`].
    pub(crate) fn seal<'k>(&self, key: &'k rlhf_core::seal::CheckpointKey) -> checkpoint::Seal<'k> {
        if self.trust_checkpoint {
            checkpoint::Seal::Trust
        } else {
            checkpoint::Seal::Verify(key)
        }
    }
}

/// How a job ended.
#[derive(Debug, Clone)]
pub struct JobSummary {
    /// Completed steps overall (including steps before a resume).
    pub global_step: u64,
    /// Steps run by this invocation.
    pub steps_run: u64,
    pub metrics_file: PathBuf,
    /// Metrics of every step of this invocation.
    pub history: Vec<BTreeMap<String, f64>>,
    /// Newest checkpoint written, if any.
    pub last_checkpoint: Option<PathBuf>,
}

/// The job's tokenizer, by the rule every role uses: `training.tokenizer_name_or_path`, else
/// the trained model's (the actor's, the one the rollout samples with; the reward model's in
/// `trainer: reward`).
fn tokenizer_dir(cfg: &PpoConfig) -> Result<PathBuf> {
    let (role, key) = match cfg.trainer {
        rlhf_config::TrainerKind::Reward => (RoleKind::Reward, "reward.model"),
        _ => (RoleKind::ActorRollout, "actor_rollout.model"),
    };
    match rlhf_config::spec::tokenizer_dir(cfg, None) {
        Some(dir) => Ok(dir),
        None => rlhf_config::spec::model_dir(cfg, role).map_err(|e| {
            Error::invalid(format!(
                "no tokenizer: set training.tokenizer_name_or_path, or make {key} an HF directory or a Hugging Face repo id ({e})"
            ))
        }),
    }
}

/// The actor's tokenizer directory on this machine: a Hugging Face repo id (the actor's model
/// or `training.tokenizer_name_or_path`) resolves through this machine's HF cache, and only
/// the tokenizer files are downloaded when it lacks them (the roles fetch the weights on
/// their own nodes).
async fn local_tokenizer_dir(cfg: &PpoConfig) -> Result<PathBuf> {
    let dir = tokenizer_dir(cfg)?;
    let Some(id) = dir
        .to_str()
        .filter(|s| rlhf_config::spec::is_repo_id_not_dir(s))
        .map(str::to_string)
    else {
        return Ok(dir);
    };
    tokio::task::spawn_blocking(move || rlhf_hub::resolve_tokenizer(&id))
        .await
        .map_err(|e| Error::internal(format!("resolving the tokenizer: {e}")))?
        .map_err(|e| Error::invalid(format!("the driver's tokenizer: {e}")))
}

/// Why a run failed: the error, and the role part and rank to blame when there is one.
#[derive(Debug)]
pub struct RunError {
    pub error: Error,
    pub at: Option<(String, u32)>,
}

impl From<Error> for RunError {
    fn from(error: Error) -> Self {
        RunError { error, at: None }
    }
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl RunError {
    /// The structured outcome the head records for a submitted job.
    pub fn failure(&self) -> rlhf_core::JobFailure {
        rlhf_core::JobFailure::new(&self.error, self.at.clone())
    }
}

#[derive(Debug)]
enum Failed {
    Call(CallError),
    Other(Error),
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failed::Call(e) => e.fmt(f),
            Failed::Other(e) => e.fmt(f),
        }
    }
}

impl From<CallError> for Failed {
    fn from(e: CallError) -> Self {
        Failed::Call(e)
    }
}

impl From<Error> for Failed {
    fn from(e: Error) -> Self {
        Failed::Other(e)
    }
}

impl From<rlhf_algo::AlgoError> for Failed {
    fn from(e: rlhf_algo::AlgoError) -> Self {
        Failed::Other(Error::invalid(e.to_string()))
    }
}

type Res<T> = std::result::Result<T, Failed>;

struct Loop<'a> {
    cfg: &'a PpoConfig,
    opts: &'a DriverOptions,
    roles: &'a Roles,
    sync_path: sync::SyncPath,
    ckpt_root: &'a std::path::Path,
    report: &'a mut Reporters,
}

/// The checkpoint a run continues from: `--resume` (`latest` or a directory), else
/// `checkpoint.resume`; `None` starts fresh.
fn resume_point(
    opts: &DriverOptions,
    ckpt_root: &std::path::Path,
) -> Result<Option<(PathBuf, checkpoint::TrainerState)>> {
    let cfg = &opts.config;
    let spec = opts
        .resume
        .clone()
        .or_else(|| cfg.checkpoint.resume.clone().filter(|s| !s.is_empty()));
    let key = opts.checkpoint_key();
    let Some(spec) = spec else {
        return Ok(None);
    };
    let (dir, state) = checkpoint::resolve(ckpt_root, &spec, opts.seal(&key))?;
    if opts.trust_checkpoint {
        tracing::warn!(
            "--trust-checkpoint: resuming from {} without checking its signature; its files are \
             still checked against their manifests, but whoever could write the directory \
             could have rewritten those too",
            dir.display()
        );
    }
    Ok(Some((dir, state)))
}

/// Places every role of the job on the cluster and reports it; a failed or stopped launch
/// leaves nothing it made behind.
async fn place(
    head: &mut cluster::HeadClient,
    opts: &DriverOptions,
    shutdown: &tokio_util::sync::CancellationToken,
    report: &mut Reporters,
) -> std::result::Result<Roles, RunError> {
    let launch = cluster::LaunchOptions {
        job_id: opts.job_id.clone(),
        client: opts.client.clone(),
        start_timeout: opts.start_timeout,
        batch_path: opts.batch_path,
    };
    let started = Instant::now();
    let mut made = cluster::Launched::default();
    let launched = tokio::select! {
        r = cluster::launch(head, &opts.config, &launch, &mut made) => r,
        _ = shutdown.cancelled() => Err(Error::new(rlhf_core::FailureKind::Unavailable, "stopped before the roles started")),
    };
    let mut roles = match launched {
        Ok(roles) => roles,
        Err(e) => {
            // Nothing a failed or stopped launch made stays on the cluster.
            cluster::release(head, &made).await;
            return Err(e.into());
        }
    };
    if opts.config.checkpoint.memory_snapshot {
        match crate::snapshot::Peers::of_cluster(head).await {
            Ok(p) => roles.peers = p,
            Err(e) => {
                cluster::release(head, &made).await;
                return Err(e.into());
            }
        }
    }
    report.report(&Event::Placed {
        processes: roles.all_members().count(),
        secs: started.elapsed().as_secs_f64(),
    })?;
    Ok(roles)
}

/// Loads every role's model (`InitRole`) and reports each rank as ready, with its device.
async fn init_and_report(
    roles: &Roles,
    cfg: &PpoConfig,
    job_id: &str,
    timeout: Duration,
    report: &mut Reporters,
) -> Res<()> {
    for (who, info) in cluster::init_roles(roles, cfg, job_id, timeout).await? {
        let device =
            rlhf_core::DeviceSpec::from_wire(info.device.as_ref(), "InitRoleResponse.device")
                .map(|d| d.to_string())
                .unwrap_or_else(|e| e.to_string());
        report.report(&Event::RoleReady {
            who: &who,
            model: &info.model,
            params: info.num_params,
            device: &device,
            note: &info.note,
        })?;
    }
    Ok(())
}

async fn timed<T>(f: impl std::future::Future<Output = T>) -> (T, f64) {
    let t = Instant::now();
    let v = f.await;
    (v, t.elapsed().as_secs_f64())
}

impl Loop<'_> {
    async fn drive<A: Algorithm>(
        &mut self,
        algo: &mut A,
        src: &mut rollout::RolloutSource<'_>,
        start_step: u64,
        total: u64,
        resumed: Option<(PathBuf, checkpoint::TrainerState)>,
        carry: &mut run::Carry,
    ) -> Res<u64> {
        let cfg = self.cfg;
        let t = self.opts.start_timeout;
        init_and_report(self.roles, cfg, &self.opts.job_id, t, self.report).await?;
        let forced = self.opts.comm_backend;
        let weights = self.roles.weights_group();
        let weights_backend = match self.sync_path {
            sync::SyncPath::Comm(b) => b,
            sync::SyncPath::None => forced.unwrap_or_default(),
        };
        let actor = sync::dp_backend(self.report, "actor", &self.roles.train, forced)?;
        let critic = sync::dp_backend(self.report, "critic", &self.roles.critic, forced)?;
        tokio::try_join!(
            cluster::join_comm(&self.roles.train, CommGroup::ActorDp, actor, t),
            cluster::join_comm(&self.roles.critic, CommGroup::CriticDp, critic, t),
            async {
                if weights.members.is_empty() {
                    Ok(())
                } else {
                    cluster::join_comm(&weights, CommGroup::Weights, weights_backend, t).await
                }
            },
        )?;
        let resume_dir = resumed.as_ref().map(|(d, _)| d.clone());
        if let Some((dir, st)) = &resumed {
            let job = &self.opts.job_id;
            let (source_a, source_c) = (
                carry.snapshot_source(job, st.global_step, "actor", &self.roles.peers),
                carry.snapshot_source(job, st.global_step, "critic", &self.roles.peers),
            );
            // Loading reads files: under the call timeout, as every other role call.
            let tl = self.opts.call_timeout;
            let (actor, critic) = tokio::try_join!(
                sync::load_part(&self.roles.train, tl, dir, "actor", source_a),
                sync::load_part(&self.roles.critic, tl, dir, "critic", source_c),
            )?;
            sync::loaded_from(self.report, "actor", &actor)?;
            sync::loaded_from(self.report, "critic", &critic)?;
            // The weights every rank loaded are the ones the checkpoint recorded.
            sync::check_loaded(dir, "actor", st.checksum("actor"), &actor)?;
            sync::check_loaded(dir, "critic", st.checksum("critic"), &critic)?;
        }
        if self.sync_weights(start_step).await?.cuda_ipc {
            // The roles found every rank of the sync on a GPU of this node.
            self.report.report(&Event::WeightSync {
                path: "CUDA IPC",
                why: "every rank of the sync on a GPU of one node: the rollouts map the trainer's GPU buffer by handle, shared memory carries the control",
            })?;
        }

        self.report
            .add_files(cfg, resume_dir.as_ref().map(|_| start_step))?;
        let schedule = pipeline::Schedule::new(&cfg.actor_rollout.async_);
        let (mut lanes, lane_end) = pipeline::channels();
        let lane = pipeline::rollout_lane(src, schedule, start_step, total, lane_end);
        let trainer = self.train_lane(algo, &mut lanes, schedule, start_step, total, carry);
        tokio::select! {
            r = trainer => r,
            () = lane => Err(Failed::Other(Error::internal("the rollout lane returned"))),
        }
    }

    /// The trainers' side of the loop: each step's batch from the rollout lane, admission,
    /// the algorithm's step, the weight sync on the schedule, checkpoints and reports.
    async fn train_lane<A: Algorithm>(
        &mut self,
        algo: &mut A,
        lanes: &mut pipeline::LoopEnd,
        schedule: pipeline::Schedule,
        start_step: u64,
        total: u64,
        carry: &mut run::Carry,
    ) -> Res<u64> {
        let cfg = self.cfg;
        let max_staleness = u64::from(cfg.actor_rollout.async_.max_staleness);
        let mut step = start_step;
        // A batch takes at most a generation and a log-prob pass (each within the call
        // timeout) after the lane gets the weights it waits for.
        let lane_deadline = self.opts.call_timeout * 3;
        let mut last_end = Instant::now();
        while step < total {
            step += 1;
            let (ro, waited) = timed(lanes.next_batch(step, lane_deadline)).await;
            let mut ro = ro?;
            let admitted = pipeline::admit(&mut ro, step, max_staleness)?;
            let (gen_s, tokens, cursor) = (ro.gen_s, ro.tokens, ro.cursor);
            let ledger = LedgerEntry {
                epoch: cursor.epoch,
                position: cursor.position,
                trained: std::mem::take(&mut ro.prompt_rows),
                dropped: std::mem::take(&mut ro.dropped_rows),
                surplus: std::mem::take(&mut ro.surplus_rows),
            };
            let generated = ro.response_mask.data.iter().filter(|&&m| m != 0.0).count();
            let StepOutput {
                mut metrics,
                samples,
            } = algo.step(self, step, ro).await?;
            metrics.insert(metric::TIMING_S_GEN.into(), gen_s);
            metrics.insert(
                metric::PERF_ROLLOUT_TOKENS_PER_S.into(),
                generated as f64 / gen_s.max(1e-9),
            );
            metrics.insert(metric::TIMING_S_WAIT_ROLLOUT.into(), waited);
            metrics.insert(
                metric::ROLLOUT_STALENESS_MEAN.into(),
                admitted.staleness_mean,
            );
            metrics.insert(metric::ROLLOUT_STALENESS_MAX.into(), admitted.staleness_max);
            metrics.insert(metric::ROLLOUT_DROPPED.into(), admitted.dropped as f64);
            metrics.insert(metric::EPOCH.into(), cursor.epoch as f64);
            let stopping = self.opts.stop_after.is_some_and(|n| step - start_step >= n);
            let mut synced = sync::Synced::default();
            if schedule.syncs_after(step, total) {
                lanes.await_want(step, lane_deadline).await?;
                synced = self.sync_weights(step).await?;
                // The lane is gone only when it failed; its error comes with the next batch.
                let _ = lanes.synced.send(step);
            }
            metrics.insert(metric::TIMING_S_SYNC_WEIGHTS.into(), synced.secs);
            metrics.insert(metric::PERF_WEIGHT_SYNC_S.into(), synced.secs);
            metrics.insert(metric::PERF_WEIGHT_SYNC_BYTES.into(), synced.bytes as f64);
            // Wall time from the previous step's end, its checkpoint and report included: in
            // async modes generation overlaps.
            let now = Instant::now();
            let elapsed = (now - last_end).as_secs_f64();
            last_end = now;
            metrics.insert(metric::TIMING_S_STEP.into(), elapsed);
            metrics.insert(
                metric::PERF_THROUGHPUT.into(),
                tokens as f64 / elapsed.max(1e-9),
            );
            let t0 = Instant::now();
            let save_steps = cfg.checkpoint.save_steps;
            if save_steps > 0 && (step.is_multiple_of(save_steps) || step == total || stopping) {
                // One checkpoint in flight: the previous one is committed first.
                carry.settle().await?;
                carry.pending = Some(self.start_save(step, algo, cursor).await?);
                // The time the step waited for it (the files are written during the next step).
                metrics.insert(
                    metric::TIMING_S_CHECKPOINT.into(),
                    t0.elapsed().as_secs_f64(),
                );
            }
            let every = cfg.logging.sample_every;
            // Due for the console and every file that keeps them (JSONL, TensorBoard).
            let samples_due = every > 0 && (step.is_multiple_of(every) || step == start_step + 1);
            self.report.report(&Event::Step {
                step,
                metrics: &metrics,
                samples: samples_due.then_some(samples.as_slice()),
                ledger: Some(&ledger),
            })?;
            carry.history.push((step, metrics));
            if stopping {
                self.report.report(&Event::Stopped {
                    steps_run: step - start_step,
                })?;
                break;
            }
        }
        // The last checkpoint is on disk before the run counts as done.
        carry.settle().await?;
        Ok(step)
    }
}
