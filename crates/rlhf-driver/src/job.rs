//! One PPO job from placement to the last checkpoint.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rlhf_algo::{
    compute_advantage, compute_token_rewards, rollout_metrics, AdvEstimator, AdvantageInputs,
    KlController, RolloutMetricsInputs,
};
use rlhf_config::data::PromptSampler;
use rlhf_config::{PpoConfig, Role};
use rlhf_core::batch::DataBatch;
use rlhf_core::{Error, FailureKind, Result};
use rlhf_proto::v1 as pb;
use rlhf_runtime::net::ClientOptions;
use rlhf_tokenizer::Tokenizer;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::{self, TrainerState};
use crate::cluster::{self, HeadClient, LaunchOptions, Roles};
use crate::group::{mean_meta_metrics, BatchCall, CallError, WorkerGroup};
use crate::output::{sample_table, MetricsLog, Progress, Sample, SampleLog};
use crate::prompts::{self, FixedResponse, FixedResponses, Prompt};
use crate::tensors::{candle, f32_1d, f32_2d, get, host, wire_f32, wire_i64};

/// How to run a job.
pub struct DriverOptions {
    /// The job config with every path absolute.
    pub config: PpoConfig,
    pub job_id: String,
    /// `--resume`: `latest` or a checkpoint directory (overrides `checkpoint.resume`).
    pub resume: Option<String>,
    /// Token and TLS for talking to role actors.
    pub client: ClientOptions,
    /// Collective backend between role processes: `tcp` (CPU) or `nccl`.
    pub comm_backend: String,
    /// Bound on every role call (a generation, an update, ...).
    pub call_timeout: Duration,
    /// Bound on placement and actor start-up (model loading included).
    pub start_timeout: Duration,
    /// Stop (after checkpointing) once this many steps ran in this invocation.
    pub stop_after: Option<u64>,
}

impl DriverOptions {
    pub fn new(config: PpoConfig, job_id: impl Into<String>, client: ClientOptions) -> Self {
        Self {
            config,
            job_id: job_id.into(),
            resume: None,
            client,
            comm_backend: "tcp".into(),
            call_timeout: Duration::from_secs(3600),
            start_timeout: Duration::from_secs(600),
            stop_after: None,
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

fn mix(seed: u64, step: u64, rank: u64) -> u64 {
    // splitmix64 over the three inputs: independent streams per (step, rank).
    let mut z =
        seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ rank.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn tokenizer_dir(cfg: &PpoConfig) -> Result<PathBuf> {
    if let Some(t) = cfg
        .training
        .tokenizer_name_or_path
        .as_deref()
        .filter(|t| !t.is_empty())
    {
        return Ok(PathBuf::from(t));
    }
    cfg.role_model(Role::ActorRollout)
        .and_then(|m| m.path)
        .ok_or_else(|| {
            Error::invalid(
                "no tokenizer: set training.tokenizer_name_or_path or actor_rollout.model to an HF directory",
            )
        })
}

/// Runs the job to its end (or to `stop_after`), then frees the actors and devices.
pub async fn run(
    mut head: HeadClient,
    opts: DriverOptions,
    shutdown: CancellationToken,
) -> Result<JobSummary> {
    let cfg = &opts.config;
    if cfg.algorithm.adv_estimator == AdvEstimator::Remax {
        return Err(Error::invalid(
            "algorithm.adv_estimator=remax needs a greedy baseline rollout per prompt, which the driver does not run yet; use gae, grpo, rloo, reinforce_plus_plus or reinforce_plus_plus_baseline",
        ));
    }
    let tok_dir = tokenizer_dir(cfg)?;
    let tok = Tokenizer::from_dir(&tok_dir).map_err(|e| {
        Error::invalid(format!(
            "loading the tokenizer from {} (training.tokenizer_name_or_path): {e}",
            tok_dir.display()
        ))
    })?;
    let data = prompts::load(cfg, &tok)?;
    eprintln!(
        "dataset {}: {} rows, {} prompts ({} kept, {} truncated, {} skipped by actor_rollout.max_prompt_length={})",
        cfg.data.path,
        data.rows,
        data.prompts.len(),
        data.length.kept,
        data.length.truncated,
        data.length.skipped,
        cfg.actor_rollout.max_prompt_length
    );
    if !data.bad_rows.is_empty() {
        eprintln!(
            "{} bad row(s) skipped (data.bad_rows: skip):",
            data.bad_rows.len()
        );
        for b in data.bad_rows.iter().take(20) {
            eprintln!("  {b}");
        }
        if data.bad_rows.len() > 20 {
            eprintln!("  ... and {} more", data.bad_rows.len() - 20);
        }
    }
    let fixed = match &cfg.actor_rollout.fixed_responses_file {
        Some(p) if !p.is_empty() => Some(prompts::load_fixed_responses(
            std::path::Path::new(p),
            tok.vocab_size(),
        )?),
        _ => None,
    };
    let mut sampler = PromptSampler::for_config(cfg, data.prompts.len())
        .map_err(|e| Error::invalid(e.to_string()))?;
    let mut kl_ctl = KlController::from_config(&cfg.algorithm.kl_ctrl)
        .map_err(|e| Error::invalid(format!("algorithm.kl_ctrl: {e}")))?;
    let ckpt_root = PathBuf::from(&cfg.checkpoint.dir);
    let resume_spec = opts
        .resume
        .clone()
        .or_else(|| cfg.checkpoint.resume.clone().filter(|s| !s.is_empty()));
    let resumed = match &resume_spec {
        Some(s) => Some(checkpoint::resolve(&ckpt_root, s)?),
        None => None,
    };
    let mut start_step = 0;
    if let Some((dir, st)) = &resumed {
        sampler
            .restore(st.data_cursor)
            .map_err(|e| Error::invalid(format!("{}: {e}", dir.display())))?;
        kl_ctl = st.kl_ctl.clone();
        start_step = st.global_step;
        eprintln!("resuming from {} (step {})", dir.display(), st.global_step);
    }
    let total = cfg.training.train_iters;
    let metrics_file = PathBuf::from(&cfg.logging.metrics_file);
    if start_step >= total {
        eprintln!(
            "nothing to do: the checkpoint is at step {start_step} of training.train_iters={total}"
        );
        return Ok(JobSummary {
            global_step: start_step,
            steps_run: 0,
            metrics_file,
            history: vec![],
            last_checkpoint: resumed.map(|(d, _)| d),
        });
    }

    let launch = LaunchOptions {
        job_id: opts.job_id.clone(),
        client: opts.client.clone(),
        start_timeout: opts.start_timeout,
    };
    let started = Instant::now();
    let roles = tokio::select! {
        r = cluster::launch(&mut head, cfg, &launch) => r?,
        _ = shutdown.cancelled() => return Err(Error::new(FailureKind::Unavailable, "stopped before the roles started")),
    };
    eprintln!(
        "placed {} role processes in {:.1} s",
        roles.all_members().count(),
        started.elapsed().as_secs_f64()
    );
    let mut ctx = Loop {
        cfg,
        opts: &opts,
        tok: &tok,
        prompts: &data.prompts,
        fixed: fixed.as_ref(),
        sampler: &mut sampler,
        kl_ctl: &mut kl_ctl,
        roles: &roles,
        ckpt_root: &ckpt_root,
    };
    let result = tokio::select! {
        r = ctx.drive(start_step, total, resumed.as_ref().map(|(d, _)| d.clone())) => r,
        _ = shutdown.cancelled() => Err(Failed::Other(Error::new(FailureKind::Unavailable, "stopped by a signal; continue with --resume latest"))),
    };
    let result = match result {
        Ok(s) => Ok(s),
        Err(Failed::Call(e)) => Err(cluster::diagnose(&mut head, &roles, e).await),
        Err(Failed::Other(e)) => Err(e),
    };
    cluster::shutdown(&mut head, &roles).await;
    result
}

enum Failed {
    Call(CallError),
    Other(Error),
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
    tok: &'a Tokenizer,
    prompts: &'a [Prompt],
    fixed: Option<&'a FixedResponses>,
    sampler: &'a mut PromptSampler,
    kl_ctl: &'a mut KlController,
    roles: &'a Roles,
    ckpt_root: &'a std::path::Path,
}

/// One step's rollout, kept on the driver.
struct Rollout {
    rows: usize,
    p: usize,
    r: usize,
    input_ids: Vec<i64>,
    attention_mask: Vec<i64>,
    responses: Vec<i64>,
    response_mask: Vec<f32>,
    prompt_text: Vec<String>,
    response_text: Vec<String>,
    ground_truth: Option<Vec<String>>,
    has_eos: Vec<bool>,
    group_ids: Vec<usize>,
    tokens: usize,
}

impl Rollout {
    fn sequences(&self) -> Result<DataBatch> {
        let t = self.p + self.r;
        let mut b = DataBatch::new()
            .with_tensor("input_ids", wire_i64(&self.input_ids, &[self.rows, t])?)
            .with_tensor(
                "attention_mask",
                wire_i64(&self.attention_mask, &[self.rows, t])?,
            );
        b.meta.insert("response_length".into(), json!(self.r));
        Ok(b)
    }
}

/// A step's prompts: dataset index per row, the batch for the rollout ranks and its
/// `[rows, P]` ids and mask on the host.
struct PromptBatch {
    which: Vec<usize>,
    batch: DataBatch,
    ids: Vec<i64>,
    mask: Vec<i64>,
}

async fn timed<T>(f: impl std::future::Future<Output = T>) -> (T, f64) {
    let t = Instant::now();
    let v = f.await;
    (v, t.elapsed().as_secs_f64())
}

impl Loop<'_> {
    async fn drive(
        &mut self,
        start_step: u64,
        total: u64,
        resume_dir: Option<PathBuf>,
    ) -> Res<JobSummary> {
        let cfg = self.cfg;
        let t = self.opts.start_timeout;
        let bundle = cfg.to_bundle();
        for (who, info) in cluster::init_roles(self.roles, &bundle, &self.opts.job_id, t).await? {
            tracing::info!(
                "{who}: {} ({} parameters, {})",
                info.model,
                info.num_params,
                info.device
            );
        }
        let backend = self.opts.comm_backend.as_str();
        let weights = self.roles.weights_group();
        tokio::try_join!(
            cluster::join_comm(&self.roles.train, "actor_dp", backend, t),
            cluster::join_comm(&self.roles.critic, "critic_dp", backend, t),
            cluster::join_comm(&weights, "weights", backend, t),
        )?;
        if let Some(dir) = &resume_dir {
            let actor_dir = dir.join("actor").to_string_lossy().into_owned();
            let critic_dir = dir.join("critic").to_string_lossy().into_owned();
            tokio::try_join!(
                self.roles.train.unary(t, "LoadCheckpoint", |_, mut c| {
                    let d = actor_dir.clone();
                    async move {
                        c.load_checkpoint(pb::LoadCheckpointRequest { dir: d })
                            .await
                    }
                }),
                self.roles.critic.unary(t, "LoadCheckpoint", |_, mut c| {
                    let d = critic_dir.clone();
                    async move {
                        c.load_checkpoint(pb::LoadCheckpointRequest { dir: d })
                            .await
                    }
                }),
            )?;
        }
        self.sync_weights(start_step).await?;

        let mut metrics_log = MetricsLog::open(
            std::path::Path::new(&cfg.logging.metrics_file),
            resume_dir.as_ref().map(|_| start_step),
        )?;
        let mut samples_log = if cfg.logging.samples_file.is_empty() {
            None
        } else {
            Some(SampleLog::open(
                std::path::Path::new(&cfg.logging.samples_file),
                resume_dir.is_some(),
            )?)
        };
        let progress = Progress::new(cfg.logging.progress, start_step, total);
        let mut history = Vec::new();
        let mut last_checkpoint = resume_dir.clone();
        let mut step = start_step;
        while step < total {
            step += 1;
            let (mut metrics, samples) = self.step(step).await?;
            let t0 = Instant::now();
            let save_steps = cfg.checkpoint.save_steps;
            let stopping = self.opts.stop_after.is_some_and(|n| step - start_step >= n);
            if save_steps > 0 && (step.is_multiple_of(save_steps) || step == total || stopping) {
                last_checkpoint = Some(self.save(step).await?);
                metrics.insert("timing_s/checkpoint".into(), t0.elapsed().as_secs_f64());
            }
            metrics_log.write(step, &metrics)?;
            progress.update(step, &metrics);
            if let Some(log) = samples_log.as_mut() {
                let every = cfg.logging.sample_every;
                if every > 0 && (step.is_multiple_of(every) || step == start_step + 1) {
                    log.write(step, &samples)?;
                    progress.println(&sample_table(step, &samples));
                }
            }
            history.push(metrics);
            if stopping {
                eprintln!(
                    "stopping after {} step(s) as asked (--stop-after)",
                    step - start_step
                );
                break;
            }
        }
        Ok(JobSummary {
            global_step: step,
            steps_run: step - start_step,
            metrics_file: PathBuf::from(&cfg.logging.metrics_file),
            history,
            last_checkpoint,
        })
    }

    /// Broadcasts the trainer's weights to the rollout ranks and checks that every rank
    /// ends with the trainer's checksum.
    async fn sync_weights(&self, version: u64) -> Res<f64> {
        let g = self.roles.weights_group();
        let (answers, secs) = timed(g.unary(
            self.opts.call_timeout,
            "SyncWeights",
            |_, mut c| async move {
                c.sync_weights(pb::SyncWeightsRequest {
                    group: "weights".into(),
                    version,
                    bucket_bytes: 0,
                })
                .await
            },
        ))
        .await;
        let answers = answers?;
        if let Some(first) = answers.first() {
            for (rank, a) in answers.iter().enumerate().skip(1) {
                if a.checksum != first.checksum {
                    return Err(Failed::Other(Error::internal(format!(
                        "weight sync at version {version}: rollout rank {} has checksum {:016x}, the trainer {:016x}",
                        rank - 1,
                        a.checksum,
                        first.checksum
                    ))));
                }
            }
        }
        Ok(secs)
    }

    async fn save(&self, step: u64) -> Res<PathBuf> {
        let dir = checkpoint::step_dir(self.ckpt_root, step);
        let t = self.opts.call_timeout;
        let actor_dir = dir.join("actor").to_string_lossy().into_owned();
        let critic_dir = dir.join("critic").to_string_lossy().into_owned();
        let first = |g: &WorkerGroup| WorkerGroup {
            name: g.name.clone(),
            members: g.members.iter().take(1).cloned().collect(),
        };
        let (train0, critic0) = (first(&self.roles.train), first(&self.roles.critic));
        let (_, _) = tokio::try_join!(
            train0.unary(t, "SaveCheckpoint", |_, mut c| {
                let d = actor_dir.clone();
                async move {
                    c.save_checkpoint(pb::SaveCheckpointRequest { dir: d })
                        .await
                }
            }),
            critic0.unary(t, "SaveCheckpoint", |_, mut c| {
                let d = critic_dir.clone();
                async move {
                    c.save_checkpoint(pb::SaveCheckpointRequest { dir: d })
                        .await
                }
            }),
        )?;
        let sums = |g: WorkerGroup| async move {
            g.unary(t, "WeightsChecksum", |_, mut c| async move {
                c.weights_checksum(pb::WeightsChecksumRequest {}).await
            })
            .await
        };
        let (a, c) = tokio::try_join!(sums(train0), sums(critic0))?;
        let mut state = TrainerState::new(
            step,
            self.sampler.cursor(),
            self.kl_ctl.clone(),
            self.cfg.training.seed,
            &self.opts.job_id,
        );
        state.actor_checksum = a.first().map(|x| x.checksum).unwrap_or(0);
        state.critic_checksum = c.first().map(|x| x.checksum);
        let dir = checkpoint::commit(self.ckpt_root, &state)?;
        checkpoint::prune(self.ckpt_root, self.cfg.checkpoint.keep_last)?;
        Ok(dir)
    }

    fn prompt_batch(&mut self) -> Result<PromptBatch> {
        let cfg = self.cfg;
        let n = cfg.actor_rollout.num_samples_per_step.max(1) as usize;
        let p = cfg.actor_rollout.max_prompt_length as usize;
        let pad = i64::from(self.pad_id());
        let idx = self.sampler.next_batch();
        let rows = idx.len() * n;
        let mut ids = vec![pad; rows * p];
        let mut mask = vec![0i64; rows * p];
        let mut which = Vec::with_capacity(rows);
        for (g, &i) in idx.iter().enumerate() {
            let prompt = &self.prompts[i].ids;
            for k in 0..n {
                let row = g * n + k;
                let off = row * p + (p - prompt.len());
                for (j, &t) in prompt.iter().enumerate() {
                    ids[off + j] = i64::from(t);
                    mask[off + j] = 1;
                }
                which.push(i);
            }
        }
        let batch = DataBatch::new()
            .with_tensor("prompt_ids", wire_i64(&ids, &[rows, p])?)
            .with_tensor("prompt_mask", wire_i64(&mask, &[rows, p])?);
        Ok(PromptBatch {
            which,
            batch,
            ids,
            mask,
        })
    }

    fn pad_id(&self) -> u32 {
        self.tok
            .pad_token_id()
            .or_else(|| self.tok.eos_token_id())
            .unwrap_or(0)
    }

    async fn generate(
        &self,
        batch: &DataBatch,
        step: u64,
    ) -> std::result::Result<DataBatch, CallError> {
        let g = &self.roles.infer;
        let n = g.len().max(1);
        let (padded, pad) = batch.pad_to_multiple(n).map_err(|e| g.err(0, e))?;
        let mut shards = padded.chunk(n).map_err(|e| g.err(0, e))?;
        for (rank, s) in shards.iter_mut().enumerate() {
            s.meta.insert(
                "seed".into(),
                json!(mix(self.cfg.training.seed, step, rank as u64)),
            );
            s.meta.insert("step".into(), json!(step));
        }
        let answers = g
            .fan_out(BatchCall::Generate, &shards, self.opts.call_timeout)
            .await?;
        let whole = DataBatch::concat(&answers).map_err(|e| g.err(0, e))?;
        whole.unpad(pad).map_err(|e| g.err(0, e))
    }

    /// Responses from the fixed-responses file instead of generation.
    fn fixed_responses(&self, fixed: &FixedResponses, which: &[usize]) -> Result<DataBatch> {
        let r = self.cfg.actor_rollout.max_response_length as usize;
        let pad = i64::from(self.pad_id());
        let eos = self.tok.eos_token_id();
        let rows = which.len();
        let mut ids = vec![pad; rows * r];
        let mut mask = vec![0f32; rows * r];
        for (row, &i) in which.iter().enumerate() {
            let p = &self.prompts[i];
            let toks = match fixed.get(p) {
                Some(FixedResponse::Ids(toks)) => {
                    if toks.len() > r {
                        return Err(Error::invalid(format!(
                            "actor_rollout.fixed_responses_file: the response_ids for prompt {:?} \
                             (data row {}) have {} tokens, more than \
                             actor_rollout.max_response_length={r}; raise it or shorten the response",
                            p.display,
                            p.source_row,
                            toks.len()
                        )));
                    }
                    toks
                }
                Some(FixedResponse::Text(text)) => {
                    let mut toks = self
                        .tok
                        .encode(&text, false)
                        .map_err(|e| Error::invalid(format!("tokenizing a fixed response: {e}")))?;
                    toks.truncate(r);
                    if let Some(e) = eos {
                        if toks.len() < r {
                            toks.push(e);
                        }
                    }
                    toks
                }
                None => {
                    return Err(Error::invalid(format!(
                        "actor_rollout.fixed_responses_file has no response for prompt {:?} \
                         (data row {}, token ids {:?})",
                        p.display, p.source_row, p.ids
                    )))
                }
            };
            for (j, &t) in toks.iter().enumerate() {
                ids[row * r + j] = i64::from(t);
                mask[row * r + j] = 1.0;
            }
        }
        Ok(DataBatch::new()
            .with_tensor("responses", wire_i64(&ids, &[rows, r])?)
            .with_tensor("response_mask", wire_f32(&mask, &[rows, r])?))
    }

    async fn rollout(&mut self, step: u64, timing: &mut BTreeMap<String, f64>) -> Res<Rollout> {
        let cfg = self.cfg;
        let PromptBatch {
            which,
            batch: prompt_batch,
            ids: prompt_ids,
            mask: prompt_mask,
        } = self.prompt_batch()?;
        let rows = which.len();
        let p = cfg.actor_rollout.max_prompt_length as usize;
        let r = cfg.actor_rollout.max_response_length as usize;
        let t = Instant::now();
        let gen = match self.fixed {
            Some(f) => self.fixed_responses(f, &which)?,
            None => self.generate(&prompt_batch, step).await?,
        };
        timing.insert("timing_s/gen".into(), t.elapsed().as_secs_f64());
        let from = "actor_rollout/infer Generate";
        let responses = get(&gen, "responses", from)?.to_i64()?;
        let response_mask = f32_2d(&gen, "response_mask", rows, r, from)?;
        if responses.len() != rows * r {
            return Err(Failed::Other(Error::internal(format!(
                "{from}: 'responses' has {} values, expected {rows} x {r}",
                responses.len()
            ))));
        }
        let eos = self.tok.eos_token_id().map(i64::from);
        let mut input_ids = Vec::with_capacity(rows * (p + r));
        let mut attention_mask = Vec::with_capacity(rows * (p + r));
        let mut prompt_text = Vec::with_capacity(rows);
        let mut response_text = Vec::with_capacity(rows);
        let mut has_eos = Vec::with_capacity(rows);
        let mut tokens = 0usize;
        for row in 0..rows {
            input_ids.extend_from_slice(&prompt_ids[row * p..(row + 1) * p]);
            input_ids.extend_from_slice(&responses[row * r..(row + 1) * r]);
            attention_mask.extend_from_slice(&prompt_mask[row * p..(row + 1) * p]);
            attention_mask.extend(
                response_mask[row * r..(row + 1) * r]
                    .iter()
                    .map(|&m| i64::from(m > 0.5)),
            );
            let valid: Vec<u32> = (0..r)
                .filter(|&j| response_mask[row * r + j] > 0.5)
                .map(|j| responses[row * r + j] as u32)
                .collect();
            has_eos.push(match (valid.last(), eos) {
                (Some(&last), Some(e)) => i64::from(last) == e,
                _ => false,
            });
            tokens += valid.len()
                + prompt_mask[row * p..(row + 1) * p]
                    .iter()
                    .filter(|&&m| m == 1)
                    .count();
            prompt_text.push(self.prompts[which[row]].display.clone());
            response_text.push(
                self.tok
                    .decode(&valid, true)
                    .map_err(|e| Error::internal(format!("decoding a response: {e}")))?,
            );
        }
        let n = cfg.actor_rollout.num_samples_per_step.max(1) as usize;
        let ground_truth = which
            .iter()
            .map(|&i| self.prompts[i].ground_truth.clone())
            .collect::<Option<Vec<String>>>();
        Ok(Rollout {
            rows,
            p,
            r,
            input_ids,
            attention_mask,
            responses,
            response_mask,
            prompt_text,
            response_text,
            ground_truth,
            has_eos,
            group_ids: (0..rows).map(|i| i / n).collect(),
            tokens,
        })
    }

    async fn step(&mut self, step: u64) -> Res<(BTreeMap<String, f64>, Vec<Sample>)> {
        let cfg = self.cfg;
        let step_start = Instant::now();
        let mut timing = BTreeMap::new();
        let ro = self.rollout(step, &mut timing).await?;
        let (rows, r) = (ro.rows, ro.r);
        let seq = ro.sequences()?;
        let mut score_batch = seq.clone();
        score_batch
            .tensors
            .insert("responses".into(), wire_i64(&ro.responses, &[rows, r])?);
        score_batch.tensors.insert(
            "response_mask".into(),
            wire_f32(&ro.response_mask, &[rows, r])?,
        );
        score_batch.columns.insert(
            "prompt_text".into(),
            ro.prompt_text.iter().map(|s| json!(s)).collect(),
        );
        score_batch.columns.insert(
            "response_text".into(),
            ro.response_text.iter().map(|s| json!(s)).collect(),
        );
        if let Some(gt) = &ro.ground_truth {
            score_batch
                .columns
                .insert("ground_truth".into(), gt.iter().map(|s| json!(s)).collect());
        }
        let tmo = self.opts.call_timeout;
        let roles = self.roles;
        let t = Instant::now();
        let ((old, t_old), (refl, t_ref), (vals, t_val), (scores, t_score)) = tokio::join!(
            timed(
                roles
                    .train
                    .call_split(BatchCall::ComputeLogProbs, &seq, tmo)
            ),
            timed(async {
                if roles.reference.is_empty() {
                    Ok(None)
                } else {
                    roles
                        .reference
                        .call_split(BatchCall::ComputeLogProbs, &seq, tmo)
                        .await
                        .map(Some)
                }
            }),
            timed(async {
                if roles.critic.is_empty() {
                    Ok(None)
                } else {
                    roles
                        .critic
                        .call_split(BatchCall::ComputeValues, &seq, tmo)
                        .await
                        .map(Some)
                }
            }),
            timed(
                roles
                    .reward
                    .call_split(BatchCall::ComputeScores, &score_batch, tmo)
            ),
        );
        timing.insert("timing_s/old_log_prob".into(), t_old);
        timing.insert("timing_s/ref".into(), t_ref);
        timing.insert("timing_s/values".into(), t_val);
        timing.insert("timing_s/reward".into(), t_score);
        timing.insert("timing_s/experience".into(), t.elapsed().as_secs_f64());
        let old = f32_2d(
            &old?,
            "log_probs",
            rows,
            r,
            "actor_rollout/train ComputeLogProbs",
        )?;
        let refl = match refl? {
            Some(b) => f32_2d(&b, "log_probs", rows, r, "ref ComputeLogProbs")?,
            None => old.clone(),
        };
        let vals = match vals? {
            Some(b) => Some(f32_2d(&b, "values", rows, r, "critic ComputeValues")?),
            None => None,
        };
        let scores = f32_1d(&scores?, "scores", rows, "reward ComputeScores")?;
        if let Some(i) = scores.iter().position(|s| !s.is_finite()) {
            return Err(Failed::Other(Error::invalid(format!(
                "reward returned a non-finite score ({}) for row {i} at step {step}",
                scores[i]
            ))));
        }

        // Rewards and advantages on the driver.
        let t = Instant::now();
        let shape = [rows, r];
        let mask_t = candle(&ro.response_mask, &shape)?;
        let old_t = candle(&old, &shape)?;
        let ref_t = candle(&refl, &shape)?;
        let scores_t = candle(&scores, &[rows])?;
        let vals_t = match &vals {
            Some(v) => Some(candle(v, &shape)?),
            None => None,
        };
        let rewards = compute_token_rewards(
            &scores_t,
            &old_t,
            &ref_t,
            &mask_t,
            &ro.has_eos,
            self.kl_ctl.value(),
            &cfg.algorithm,
        )?;
        let adv = compute_advantage(
            &AdvantageInputs {
                token_rewards: &rewards.rewards,
                response_mask: &mask_t,
                values: vals_t.as_ref(),
                value_mask: Some(&rewards.value_mask),
                group_ids: Some(&ro.group_ids),
                baseline_scores: None,
            },
            &cfg.algorithm,
        )?;
        let mut metrics = rollout_metrics(&RolloutMetricsInputs {
            rewards: &rewards,
            logp: &old_t,
            response_mask: &mask_t,
            has_eos: &ro.has_eos,
            advantages: &adv.advantages,
            returns: &adv.returns,
            values: vals_t.as_ref(),
        })?;
        let advantages = host(&adv.advantages)?;
        let returns = host(&adv.returns)?;
        // The critic fits values where GAE ran: the response, plus the score's slot with
        // TRL's placement.
        let value_mask = host(&rewards.value_mask)?;
        timing.insert("timing_s/adv".into(), t.elapsed().as_secs_f64());

        // Updates: critic and actor at once.
        let mut actor_batch = seq.clone();
        actor_batch.meta.insert("step".into(), json!(step));
        for (name, v) in [
            ("response_mask", &ro.response_mask),
            ("old_log_probs", &old),
            ("advantages", &advantages),
        ] {
            actor_batch
                .tensors
                .insert(name.into(), wire_f32(v, &shape)?);
        }
        if cfg.actor_rollout.use_kl_loss {
            actor_batch
                .tensors
                .insert("ref_log_probs".into(), wire_f32(&refl, &shape)?);
        }
        let critic_batch = match &vals {
            Some(v) => {
                let mut b = seq.clone();
                b.meta.insert("step".into(), json!(step));
                b.tensors
                    .insert("response_mask".into(), wire_f32(&value_mask, &shape)?);
                b.tensors.insert("values".into(), wire_f32(v, &shape)?);
                b.tensors
                    .insert("returns".into(), wire_f32(&returns, &shape)?);
                Some(b)
            }
            None => None,
        };
        let ((actor_out, t_actor), (critic_out, t_critic)) = tokio::join!(
            timed(
                roles
                    .train
                    .call_each(BatchCall::UpdateActor, &actor_batch, tmo)
            ),
            timed(async {
                match &critic_batch {
                    Some(b) => roles
                        .critic
                        .call_each(BatchCall::UpdateCritic, b, tmo)
                        .await
                        .map(Some),
                    None => Ok(None),
                }
            }),
        );
        timing.insert("timing_s/update_actor".into(), t_actor);
        timing.insert("timing_s/update_critic".into(), t_critic);
        metrics.extend(mean_meta_metrics(&actor_out?));
        // TRL logs the policy's learning rate as `lr`.
        if let Some(&lr) = metrics.get("actor/lr") {
            metrics.insert("lr".into(), lr);
        }
        if let Some(c) = critic_out? {
            metrics.extend(mean_meta_metrics(&c));
        }
        for (k, v) in &metrics {
            if !v.is_finite() && k.starts_with("loss/") {
                return Err(Failed::Other(Error::invalid(format!(
                    "non-finite {k} ({v}) at step {step}: the update diverged; lower training.lr or check the reward scale"
                ))));
            }
        }

        let t_sync = self.sync_weights(step).await?;
        timing.insert("timing_s/sync_weights".into(), t_sync);

        let kl = metrics.get("objective/kl").copied().unwrap_or(0.0);
        metrics.insert("objective/kl_coef".into(), self.kl_ctl.value());
        self.kl_ctl.update(kl, rows)?;
        let elapsed = step_start.elapsed().as_secs_f64();
        timing.insert("timing_s/step".into(), elapsed);
        metrics.extend(timing);
        metrics.insert(
            "perf/throughput".into(),
            ro.tokens as f64 / elapsed.max(1e-9),
        );
        metrics.insert("perf/total_num_tokens".into(), ro.tokens as f64);
        metrics.insert("episode".into(), (step * rows as u64) as f64);
        metrics.insert("epoch".into(), self.sampler.cursor().epoch as f64);

        let k = (cfg.logging.sample_rows as usize).min(rows);
        let samples = (0..k)
            .map(|i| Sample {
                prompt: ro.prompt_text[i].clone(),
                response: ro.response_text[i].clone(),
                score: f64::from(scores[i]),
            })
            .collect();
        Ok((metrics, samples))
    }
}
