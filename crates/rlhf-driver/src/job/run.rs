//! A job from the config to its summary, restarting by itself when a role process dies
//! (`fault_tolerance`): each attempt places every role, reloads the newest complete
//! checkpoint of this run (or the one it resumed from, or none), rewinds the prompt cursor and
//! goes on; the metrics and samples files drop the lines of the steps after that checkpoint,
//! so every step ends up written once. A seeded run recovered this way gives the same metrics
//! as an uninterrupted one (exact resume).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rlhf_config::data::PromptSampler;
use rlhf_config::PpoConfig;
use rlhf_core::{Error, FailureKind};
use rlhf_tokenizer::Tokenizer;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::{self, TrainerState};
use crate::cluster::{self, HeadClient};
use crate::prompts::{self, FixedResponses, Prompt};
use crate::report::{DatasetReport, Event, Reporter, Reporters};
use crate::snapshot;
use rlhf_proto::v1 as pb;

use super::algorithm::{self, Algorithm};
use super::ppo::Ppo;
use super::{
    local_tokenizer_dir, rollout, sync, DriverOptions, Failed, JobSummary, Loop, Res, RunError,
};

/// What outlives one attempt: every step's metrics and the newest checkpoint written.
#[derive(Default)]
pub(super) struct Carry {
    pub history: Vec<(u64, BTreeMap<String, f64>)>,
    pub last_checkpoint: Option<PathBuf>,
    /// The checkpoint being written in the background, if any.
    pub pending: Option<sync::PendingSave>,
    /// The memory snapshots of the newest checkpoint (`checkpoint.memory_snapshot`).
    pub snapshots: snapshot::Held,
}

impl Carry {
    /// Waits for the checkpoint being written and records it as the newest.
    pub async fn settle(&mut self) -> Res<()> {
        if let Some(p) = self.pending.take() {
            let c = p.finish().await?;
            self.last_checkpoint = Some(c.dir);
            if let Some((plan, record)) = c.snapshot {
                self.snapshots.replace(&plan, record);
            }
        }
        Ok(())
    }

    /// What LoadCheckpoint fetches for `part` of the checkpoint of `step`, when its memory
    /// snapshot is whole and on workers among `alive`.
    pub fn snapshot_source(
        &self,
        job_id: &str,
        step: u64,
        part: &str,
        alive: &snapshot::Peers,
    ) -> Option<pb::SnapshotSource> {
        self.snapshots
            .record
            .as_ref()
            .and_then(|r| r.source(job_id, step, part, alive))
    }

    /// After a failed attempt, before its roles are stopped: a checkpoint still being
    /// written by live trainers is the newest to restart from, so it gets `limit` to finish;
    /// else it is dropped and the previous one stays the newest.
    pub async fn settle_after_failure(&mut self, limit: Duration) {
        match tokio::time::timeout(limit, self.settle()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("the checkpoint in flight is lost: {e}"),
            Err(_) => {
                self.pending = None;
                tracing::warn!("the checkpoint in flight did not finish in time; it is dropped")
            }
        }
    }

    /// The job's summary once an attempt reached `global_step`.
    fn summary(self, cfg: &PpoConfig, first_step: u64, global_step: u64) -> JobSummary {
        JobSummary {
            global_step,
            steps_run: global_step.saturating_sub(first_step),
            metrics_file: PathBuf::from(&cfg.logging.metrics_file),
            history: self.history.into_iter().map(|(_, m)| m).collect(),
            last_checkpoint: self.last_checkpoint,
        }
    }
}

/// A resume point: the checkpoint directory and its state.
pub(super) type ResumePoint = Option<(PathBuf, TrainerState)>;

/// One attempt of a job, for [`with_restarts`]: places the roles, runs, and frees them;
/// returns the last completed step. A trait with a boxed future rather than an async
/// closure, so that the whole job is a `Send` future the runtime can run on a task.
pub(super) trait Attempts {
    fn attempt<'a>(
        &'a mut self,
        resumed: ResumePoint,
        report: &'a mut Reporters,
        carry: &'a mut Carry,
    ) -> futures::future::BoxFuture<'a, Result<u64, RunError>>;
}

/// A job's attempts: what every attempt needs besides the resume point.
pub(super) struct Attempter<'x, I> {
    pub head: &'x mut HeadClient,
    pub inputs: &'x I,
    pub shutdown: &'x CancellationToken,
}

/// Where a job's checkpoints are and how a restart checks the one it reloads.
#[derive(Clone, Copy)]
pub(super) struct Checkpoints<'a> {
    pub root: &'a Path,
    pub seal: checkpoint::Seal<'a>,
}

/// Runs attempts of a job (PPO's or another stage's) until one ends, restarting after a role
/// process or node dies as `fault_tolerance` allows: each new attempt starts from the newest
/// checkpoint of this run (or the one it resumed from, or the beginning), after
/// `restart_backoff_s`; the steps after that checkpoint leave the history (the attempt's
/// reporters drop them from the files). `attempts` places the roles, runs, and frees them.
pub(super) async fn with_restarts(
    cfg: &PpoConfig,
    ckpts: Checkpoints<'_>,
    resumed: ResumePoint,
    report: &mut Reporters,
    shutdown: &CancellationToken,
    attempts: &mut impl Attempts,
) -> std::result::Result<JobSummary, RunError> {
    let first_step = resumed.as_ref().map_or(0, |(_, st)| st.global_step);
    let mut carry = Carry {
        last_checkpoint: resumed.as_ref().map(|(d, _)| d.clone()),
        ..Carry::default()
    };
    let out = restart_loop(cfg, ckpts, resumed, report, shutdown, attempts, &mut carry).await;
    // However the job ends (done, failed, stopped), the workers drop its memory snapshots.
    carry.snapshots.release().await;
    out.map(|global_step| carry.summary(cfg, first_step, global_step))
}

/// [`with_restarts`]' attempts and restarts; returns the last completed step.
async fn restart_loop(
    cfg: &PpoConfig,
    ckpts: Checkpoints<'_>,
    mut resumed: ResumePoint,
    report: &mut Reporters,
    shutdown: &CancellationToken,
    attempts: &mut impl Attempts,
    carry: &mut Carry,
) -> std::result::Result<u64, RunError> {
    let ft = &cfg.fault_tolerance;
    let mut restarts = 0;
    loop {
        let error = match attempts.attempt(resumed.take(), report, carry).await {
            Ok(global_step) => return Ok(global_step),
            Err(e) => e,
        };
        if error.error.kind() != FailureKind::ActorDied || restarts >= ft.max_restarts {
            return Err(error);
        }
        restarts += 1;
        // The newest checkpoint this run wrote or resumed from; none: from the start.
        resumed = match &carry.last_checkpoint {
            Some(dir) => Some(restart_point(ckpts, dir, carry)?),
            None => None,
        };
        let from = resumed.as_ref().map_or(0, |(_, st)| st.global_step);
        carry.history.retain(|(step, _)| *step <= from);
        report.report(&Event::Restart {
            error: &error.error.to_string(),
            restart: restarts,
            max: ft.max_restarts,
            from: resumed.as_ref().map(|(d, _)| d.as_path()),
            backoff_s: ft.restart_backoff_s,
        })?;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs_f64(ft.restart_backoff_s)) => {}
            _ = shutdown.cancelled() => return Err(error),
        }
    }
}

/// The checkpoint `dir` with its trainer state: from disk, or, when that is gone, from the
/// memory snapshot of the same step.
fn restart_point(
    ckpts: Checkpoints<'_>,
    dir: &Path,
    carry: &Carry,
) -> rlhf_core::Result<(PathBuf, TrainerState)> {
    let e = match checkpoint::resolve(ckpts.root, &dir.to_string_lossy(), ckpts.seal) {
        Ok(r) => return Ok(r),
        Err(e) => e,
    };
    let record = carry.snapshots.record.as_ref();
    match record.filter(|r| checkpoint::step_dir(ckpts.root, r.step) == dir) {
        Some(r) => {
            tracing::warn!(
                "{e}; restarting from the memory snapshot of step {}",
                r.step
            );
            Ok((dir.to_path_buf(), r.state.clone()))
        }
        None => Err(e),
    }
}

/// The job's inputs that do not change between attempts.
struct Inputs<'a> {
    opts: &'a DriverOptions,
    tok: &'a Tokenizer,
    prompts: &'a [Prompt],
    fixed: Option<&'a FixedResponses>,
    ckpt_root: &'a Path,
}

/// Runs the job to its end (or to `stop_after`), restarting after role deaths as
/// `fault_tolerance` allows, then frees the actors and devices.
///
/// The job runs on a task of the runtime, not on the thread that awaits this: a runtime's
/// `block_on` thread is none of its workers, so every role call made there crosses threads
/// twice on its way to the connection's task and back (`cluster_bench` measures both).
pub async fn run(
    head: HeadClient,
    opts: DriverOptions,
    shutdown: CancellationToken,
) -> std::result::Result<JobSummary, RunError> {
    match tokio::spawn(run_here(head, opts, shutdown)).await {
        Ok(r) => r,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(RunError::from(Error::internal(format!(
            "the job's task ended before the job: {e}"
        )))),
    }
}

async fn run_here(
    mut head: HeadClient,
    mut opts: DriverOptions,
    shutdown: CancellationToken,
) -> std::result::Result<JobSummary, RunError> {
    if opts.config.trainer != rlhf_config::TrainerKind::Ppo {
        return super::stage::run(head, opts, shutdown).await;
    }
    let extra = std::mem::take(&mut opts.reporters);
    let cfg = &opts.config;
    Ppo::new(cfg)?;
    let tok_dir = local_tokenizer_dir(cfg).await?;
    let tok = Tokenizer::from_dir(&tok_dir).map_err(|e| {
        Error::invalid(format!(
            "loading the tokenizer from {} (training.tokenizer_name_or_path): {e}",
            tok_dir.display()
        ))
    })?;
    let ckpt_root = PathBuf::from(&cfg.checkpoint.dir);
    let resumed = super::resume_point(&opts, &ckpt_root)?;
    let first_step = resumed.as_ref().map_or(0, |(_, st)| st.global_step);
    let mut report = Reporters::console(cfg, first_step);
    report.extend(extra);

    let data = prompts::load(cfg, &tok)?;
    report.report(&Event::Dataset(&DatasetReport {
        path: cfg.data.path.clone(),
        rows: data.rows,
        prompts: data.prompts.len(),
        kept: data.length.kept,
        truncated: data.length.truncated,
        skipped: data.length.skipped,
        max_prompt_length: cfg.actor_rollout.max_prompt_length,
        bad_rows: data.bad_rows.clone(),
        packed_rows: None,
    }))?;
    let fixed = match &cfg.actor_rollout.fixed_responses_file {
        Some(p) if !p.is_empty() => Some(prompts::load_fixed_responses(
            Path::new(p),
            tok.vocab_size(),
        )?),
        _ => None,
    };
    let inputs = Inputs {
        opts: &opts,
        tok: &tok,
        prompts: &data.prompts,
        fixed: fixed.as_ref(),
        ckpt_root: &ckpt_root,
    };
    let mut attempts = Attempter {
        head: &mut head,
        inputs: &inputs,
        shutdown: &shutdown,
    };
    let key = opts.checkpoint_key();
    with_restarts(
        cfg,
        Checkpoints {
            root: &ckpt_root,
            seal: opts.seal(&key),
        },
        resumed,
        &mut report,
        &shutdown,
        &mut attempts,
    )
    .await
}

impl Attempts for Attempter<'_, Inputs<'_>> {
    fn attempt<'a>(
        &'a mut self,
        resumed: ResumePoint,
        report: &'a mut Reporters,
        carry: &'a mut Carry,
    ) -> futures::future::BoxFuture<'a, Result<u64, RunError>> {
        Box::pin(attempt(
            self.head,
            self.inputs,
            resumed,
            report,
            carry,
            self.shutdown,
        ))
    }
}

/// One attempt: placement, the roles loaded (from `resumed` when given), the loop, and the
/// actors freed however it ends. Returns the last completed step.
async fn attempt(
    head: &mut HeadClient,
    inputs: &Inputs<'_>,
    resumed: Option<(PathBuf, TrainerState)>,
    report: &mut Reporters,
    carry: &mut Carry,
    shutdown: &CancellationToken,
) -> std::result::Result<u64, RunError> {
    let opts = inputs.opts;
    let cfg = &opts.config;
    let mut algo = Ppo::new(cfg)?;
    let mut sampler = PromptSampler::for_config(cfg, inputs.prompts.len())
        .map_err(|e| Error::invalid(e.to_string()))?;
    if let Some((dir, st)) = &resumed {
        sampler
            .restore(st.data_cursor)
            .map_err(|e| Error::invalid(format!("{}: {e}", dir.display())))?;
        algorithm::check_resume::<Ppo>(st, dir)?;
        algo.resume(st)?;
        report.report(&Event::Resumed {
            dir,
            step: st.global_step,
        })?;
    }
    let start_step = resumed.as_ref().map_or(0, |(_, st)| st.global_step);
    let total = cfg.training.train_iters;
    if start_step >= total {
        report.report(&Event::NothingToDo {
            step: start_step,
            total,
        })?;
        return Ok(start_step);
    }

    let roles = super::place(head, opts, shutdown, report).await?;
    let (sync_path, why) = sync::SyncPath::choose(
        &roles,
        opts.comm_backend.unwrap_or_default(),
        opts.weight_sync_backend,
    );
    report.report(&Event::WeightSync {
        path: &sync_path.describe(),
        why: &why,
    })?;
    let mut ctx = Loop {
        cfg,
        opts,
        roles: &roles,
        sync_path,
        ckpt_root: inputs.ckpt_root,
        report,
    };
    let mut src = rollout::RolloutSource {
        cfg,
        opts,
        tok: inputs.tok,
        prompts: inputs.prompts,
        fixed: inputs.fixed,
        sampler: &mut sampler,
        roles: &roles,
    };
    let drive = ctx.drive(&mut algo, &mut src, start_step, total, resumed, carry);
    let result = until_stopped(drive, shutdown).await;
    conclude(head, &roles, result, carry, opts.call_timeout).await
}

/// An attempt's loop, or the stop a signal asks for.
pub(super) async fn until_stopped(
    drive: impl std::future::Future<Output = Res<u64>>,
    shutdown: &CancellationToken,
) -> Res<u64> {
    tokio::select! {
        r = drive => r,
        _ = shutdown.cancelled() => Err(Failed::Other(Error::new(FailureKind::Unavailable, "stopped by a signal; continue with --resume latest"))),
    }
}

/// The end of an attempt however its loop ended: after a failure the checkpoint in flight
/// gets its chance and the head is asked what died (and why); then the roles are freed.
pub(super) async fn conclude(
    head: &mut HeadClient,
    roles: &cluster::Roles,
    result: Res<u64>,
    carry: &mut Carry,
    call_timeout: Duration,
) -> std::result::Result<u64, RunError> {
    if result.is_err() {
        carry.settle_after_failure(call_timeout).await;
    }
    let result = match result {
        Ok(step) => Ok(step),
        Err(Failed::Call(e)) => {
            let (error, at) = cluster::diagnose(head, roles, e).await;
            Err(RunError { error, at })
        }
        Err(Failed::Other(e)) => Err(RunError::from(e)),
    };
    cluster::shutdown(head, roles).await;
    result
}
