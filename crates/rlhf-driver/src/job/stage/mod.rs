//! The jobs of the other stages (`trainer: sft | reward | dpo`): the dataset tokenized once,
//! the trainer ranks placed and loaded like PPO's, then one optimizer step per step over
//! `training.global_batch_size` examples or pairs dealt evenly to the ranks; DPO's reference
//! log-probs come from the ref role each step (KTO's KL estimate from mismatched pairs, under
//! the policy and the reference). Checkpoints, exact resume (the data cursor), the metrics
//! files, TensorBoard, the progress line and the automatic restarts (`fault_tolerance`) are
//! PPO's (`super::sync`, `super::run::with_restarts`, `crate::report`).

mod encode;
mod eval;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rlhf_algo::metric;
use rlhf_config::data::stage::{load_eval_pairs, load_pairs, load_sft};
use rlhf_config::data::PromptSampler;
use rlhf_config::{PpoConfig, TrainerKind};
use rlhf_core::calls::{
    LogProbsRequest, Mat, PreferenceUpdateRequest, RewardModelUpdateRequest, Sequences,
    SftUpdateRequest, UpdateResponse,
};
use rlhf_core::{CommGroup, Error};
use rlhf_tokenizer::Tokenizer;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::TrainerState;
use crate::cluster::{self, HeadClient, Roles};
use crate::group::{mean_metrics, WorkerGroup};
use crate::report::{DatasetReport, Event, Reporter, Reporters};

use super::run::{self, Carry, ResumePoint};
use super::{sync, DriverOptions, JobSummary, Res, RunError};
use encode::{pack, Cuts, Encoded, Encoder};

/// The stage's examples in tokens.
enum Data {
    Sft(Vec<Encoded>),
    /// `data.packing`: the examples and the packed rows the sampler draws (example indices).
    Packed {
        examples: Vec<Encoded>,
        rows: Vec<Vec<usize>>,
    },
    Pairs(Pairs),
}

impl Data {
    /// What the sampler draws from: examples, packed rows or pairs.
    fn len(&self) -> usize {
        match self {
            Data::Sft(v) => v.len(),
            Data::Packed { rows, .. } => rows.len(),
            Data::Pairs(v) => v.len(),
        }
    }

    /// Examples or pairs in the dataset.
    fn examples(&self) -> usize {
        match self {
            Data::Packed { examples, .. } => examples.len(),
            _ => self.len(),
        }
    }
}

/// The trained role: its directory in checkpoints, its group, its communicator, and whether
/// its optimizer state is sharded (`training.zero_stage` as that role resolves it).
fn trained(cfg: &PpoConfig, roles: &Roles) -> (&'static str, WorkerGroup, CommGroup, bool) {
    let (part, group, comm, role) = match cfg.trainer {
        TrainerKind::Reward => (
            "reward",
            roles.reward.clone(),
            CommGroup::RewardDp,
            rlhf_core::RoleKind::Reward,
        ),
        _ => (
            "actor",
            roles.train.clone(),
            CommGroup::ActorDp,
            rlhf_core::RoleKind::ActorRollout,
        ),
    };
    (part, group, comm, cfg.resolved(role).zero_stage >= 1)
}

/// The job's tokenizer (a Hugging Face repo id resolves through this machine's HF cache).
async fn tokenizer(cfg: &PpoConfig) -> Result<Tokenizer, Error> {
    let dir = super::local_tokenizer_dir(cfg).await?;
    Tokenizer::from_dir(&dir).map_err(|e| {
        Error::invalid(format!(
            "loading the tokenizer from {} (training.tokenizer_name_or_path): {e}",
            dir.display()
        ))
    })
}

type Pairs = Vec<(Encoded, Encoded, Option<f64>)>;

fn encode_pairs(
    enc: &Encoder<'_>,
    ds: &rlhf_config::data::stage::PairDataset,
) -> Result<Pairs, Error> {
    ds.records
        .iter()
        .map(|(row, p)| {
            Ok((
                enc.answer(*row, &p.prompt, &p.chosen)?,
                enc.answer(*row, &p.prompt, &p.rejected)?,
                p.margin,
            ))
        })
        .collect()
}

/// `data.eval_path`'s pairs in tokens (reward and DPO jobs).
fn load_eval(cfg: &PpoConfig, tok: &Tokenizer) -> Result<Option<Pairs>, Error> {
    if !matches!(cfg.trainer, TrainerKind::Reward | TrainerKind::Dpo) {
        return Ok(None);
    }
    let Some(ds) = load_eval_pairs(&cfg.data).map_err(|e| Error::invalid(e.to_string()))? else {
        return Ok(None);
    };
    let enc = Encoder {
        tok,
        apply_chat_template: cfg.data.apply_chat_template,
        chat_template_kwargs: cfg.data.chat_template_vars(),
        origin: &ds.path,
    };
    encode_pairs(&enc, &ds).map(Some)
}

fn load_data(cfg: &PpoConfig, tok: &Tokenizer) -> Result<(Data, DatasetReport), Error> {
    let enc = Encoder {
        tok,
        apply_chat_template: cfg.data.apply_chat_template,
        chat_template_kwargs: cfg.data.chat_template_vars(),
        origin: &cfg.data.path,
    };
    let bad = |b: &[rlhf_config::data::BadRow]| {
        b.iter()
            .map(|b| format!("{}: {}", b.location, b.reason))
            .collect::<Vec<_>>()
    };
    let invalid = |e: rlhf_config::ConfigError| Error::invalid(e.to_string());
    let (data, rows, bad_rows) = match cfg.trainer {
        TrainerKind::Sft => {
            let ds = load_sft(&cfg.data).map_err(invalid)?;
            let v = ds
                .records
                .iter()
                .map(|(row, ex)| enc.sft(*row, ex))
                .collect::<Result<Vec<_>, _>>()?;
            let data = if cfg.data.packing {
                let lens: Vec<usize> = v.iter().map(|e| encode::fitted_len(e, cfg)).collect();
                let len = (cfg.actor_rollout.max_prompt_length
                    + cfg.actor_rollout.max_response_length) as usize;
                let rows = encode::plan_packing(&lens, len);
                Data::Packed { examples: v, rows }
            } else {
                Data::Sft(v)
            };
            (data, ds.report.rows, bad(&ds.report.bad))
        }
        _ => {
            let ds = load_pairs(&cfg.data).map_err(invalid)?;
            let v = encode_pairs(&enc, &ds)?;
            (Data::Pairs(v), ds.report.rows, bad(&ds.report.bad))
        }
    };
    let report = DatasetReport {
        path: cfg.data.path.clone(),
        rows,
        prompts: data.examples(),
        kept: data.examples(),
        truncated: 0,
        skipped: 0,
        max_prompt_length: cfg.actor_rollout.max_prompt_length,
        bad_rows,
        packed_rows: match &data {
            Data::Packed { rows, .. } => Some(rows.len()),
            _ => None,
        },
    };
    Ok((data, report))
}

/// The job's inputs that do not change between attempts.
struct Inputs<'a> {
    opts: &'a DriverOptions,
    tok: &'a Tokenizer,
    data: &'a Data,
    eval: Option<&'a Pairs>,
    ckpt_root: &'a Path,
}

/// Runs a stage job to its end (or to `stop_after`), restarting after role deaths as
/// `fault_tolerance` allows (PPO's loop: [`run::with_restarts`]), and frees its actors.
pub(super) async fn run(
    mut head: HeadClient,
    mut opts: DriverOptions,
    shutdown: CancellationToken,
) -> std::result::Result<JobSummary, RunError> {
    let extra = std::mem::take(&mut opts.reporters);
    let cfg = &opts.config;
    let tok = tokenizer(cfg).await?;
    let ckpt_root = PathBuf::from(&cfg.checkpoint.dir);
    let resumed = super::resume_point(&opts, &ckpt_root)?;
    let start_step = resumed.as_ref().map_or(0, |(_, st)| st.global_step);
    let mut report = Reporters::console(cfg, start_step);
    report.extend(extra);
    let (data, dataset) = load_data(cfg, &tok)?;
    let eval = load_eval(cfg, &tok)?;
    report.report(&Event::Dataset(&dataset))?;
    let inputs = Inputs {
        opts: &opts,
        tok: &tok,
        data: &data,
        eval: eval.as_ref(),
        ckpt_root: &ckpt_root,
    };
    let mut attempts = run::Attempter {
        head: &mut head,
        inputs: &inputs,
        shutdown: &shutdown,
    };
    let key = opts.checkpoint_key();
    run::with_restarts(
        cfg,
        run::Checkpoints {
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

impl run::Attempts for run::Attempter<'_, Inputs<'_>> {
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

/// One attempt: the data cursor restored, the roles placed and loaded (from `resumed` when
/// given), the loop, and the actors freed however it ends. Returns the last completed step.
async fn attempt(
    head: &mut HeadClient,
    inputs: &Inputs<'_>,
    resumed: ResumePoint,
    report: &mut Reporters,
    carry: &mut Carry,
    shutdown: &CancellationToken,
) -> std::result::Result<u64, RunError> {
    let opts = inputs.opts;
    let cfg = &opts.config;
    let data = inputs.data;
    let batch = cfg.training.global_batch_size as usize;
    let mut sampler = PromptSampler::new(data.len(), batch, cfg.data.shuffle, cfg.data_seed())
        .map_err(|e| Error::invalid(format!("{} ({}): {e}", cfg.data.path, cfg.trainer)))?;
    if let Some((dir, st)) = &resumed {
        if st.algorithm != cfg.trainer.as_str() {
            return Err(Error::invalid(format!(
                "{} was written by {:?}, and this job is trainer {}; resume it with the config that wrote it, or start without --resume",
                dir.display(),
                st.algorithm,
                cfg.trainer
            ))
            .into());
        }
        sampler
            .restore(st.data_cursor)
            .map_err(|e| Error::invalid(format!("{}: {e}", dir.display())))?;
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
    let mut lp = StageLoop {
        cfg,
        opts,
        roles: &roles,
        tok: inputs.tok,
        data,
        eval: inputs.eval,
        ckpt_root: inputs.ckpt_root,
        report,
        carry: &mut *carry,
    };
    let result =
        run::until_stopped(lp.drive(&mut sampler, start_step, total, resumed), shutdown).await;
    run::conclude(head, &roles, result, carry, opts.call_timeout).await
}

struct StageLoop<'a> {
    cfg: &'a PpoConfig,
    opts: &'a DriverOptions,
    roles: &'a Roles,
    tok: &'a Tokenizer,
    data: &'a Data,
    eval: Option<&'a Pairs>,
    ckpt_root: &'a Path,
    report: &'a mut Reporters,
    carry: &'a mut Carry,
}

/// Summed log-probs of each row's masked tokens.
fn sums(log_probs: &Mat<f32>, mask: &Mat<f32>) -> Vec<f32> {
    log_probs
        .data
        .chunks(mask.cols.max(1))
        .zip(mask.data.chunks(mask.cols.max(1)))
        .map(|(l, m)| l.iter().zip(m).map(|(a, b)| a * b).sum())
        .collect()
}

impl StageLoop<'_> {
    fn pad(&self) -> u32 {
        self.tok
            .pad_token_id()
            .or_else(|| self.tok.eos_token_id())
            .unwrap_or(0)
    }

    async fn drive(
        &mut self,
        sampler: &mut PromptSampler,
        start_step: u64,
        total: u64,
        resumed: ResumePoint,
    ) -> Res<u64> {
        let (cfg, opts) = (self.cfg, self.opts);
        let t = opts.start_timeout;
        super::init_and_report(self.roles, cfg, &opts.job_id, t, self.report).await?;
        let (part, group, comm, sharded) = trained(cfg, self.roles);
        let backend = sync::dp_backend(self.report, part, &group, opts.comm_backend)?;
        cluster::join_comm(&group, comm, backend, t).await?;
        if let Some((dir, st)) = &resumed {
            let source =
                self.carry
                    .snapshot_source(&opts.job_id, st.global_step, part, &self.roles.peers);
            let answers = sync::load_part(&group, opts.call_timeout, dir, part, source).await?;
            sync::loaded_from(self.report, part, &answers)?;
            sync::check_loaded(dir, part, st.checksum(part), &answers)?;
        }
        self.report
            .add_files(cfg, resumed.as_ref().map(|_| start_step))?;
        let mut step = start_step;
        let mut last_end = Instant::now();
        while step < total {
            step += 1;
            let idx = sampler.next_batch();
            let (answers, tokens, mut metrics) = self.step(&group, &idx, step).await?;
            metrics.extend(mean_metrics(&answers));
            let now = Instant::now();
            let elapsed = (now - last_end).as_secs_f64();
            last_end = now;
            metrics.insert(metric::TIMING_S_STEP.into(), elapsed);
            metrics.insert(metric::PERF_THROUGHPUT.into(), tokens / elapsed.max(1e-9));
            metrics.insert(metric::EPOCH.into(), sampler.cursor().epoch as f64);
            let every = cfg.data.eval_every;
            if self.eval.is_some() && ((every > 0 && step.is_multiple_of(every)) || step == total) {
                metrics.extend(self.evaluate(&group).await?);
            }
            let stopping = opts.stop_after.is_some_and(|n| step - start_step >= n);
            let save_steps = cfg.checkpoint.save_steps;
            if save_steps > 0 && (step.is_multiple_of(save_steps) || step == total || stopping) {
                self.carry.settle().await?;
                let state = TrainerState::new(
                    cfg.trainer.as_str(),
                    step,
                    sampler.cursor(),
                    cfg.training.seed,
                    &opts.job_id,
                );
                self.carry.pending = Some(
                    sync::save_parts(
                        &[(part, &group, sharded)],
                        state,
                        self.ckpt_root,
                        cfg.checkpoint.keep_last,
                        opts.call_timeout,
                        sync::snapshot_plan(cfg, opts, self.roles),
                        opts.checkpoint_key(),
                    )
                    .await?,
                );
            }
            self.report.report(&Event::Step {
                step,
                metrics: &metrics,
                samples: None,
                ledger: None,
            })?;
            self.carry.history.push((step, metrics));
            if stopping {
                self.report.report(&Event::Stopped {
                    steps_run: step - start_step,
                })?;
                break;
            }
        }
        self.carry.settle().await?;
        Ok(step)
    }

    /// One step's calls: the answers of every trainer rank, the batch's tokens, and the
    /// driver's own metrics (reference timing, KTO's KL pass).
    async fn step(
        &mut self,
        group: &WorkerGroup,
        idx: &[usize],
        step: u64,
    ) -> Res<(Vec<UpdateResponse>, f64, BTreeMap<String, f64>)> {
        let (cfg, t) = (self.cfg, self.opts.call_timeout);
        let pad = self.pad();
        let mut cuts = Cuts::default();
        let mut extra = BTreeMap::new();
        let tokens = |s: &Sequences| s.attention_mask.data.iter().filter(|&&m| m != 0).count();
        match self.data {
            Data::Sft(_) | Data::Packed { .. } => {
                let (seq, loss_mask) = match self.data {
                    Data::Packed { examples, rows } => {
                        let rows: Vec<&[usize]> = idx.iter().map(|&i| &rows[i][..]).collect();
                        encode::pack_rows(&rows, examples, cfg, pad, &mut cuts)?
                    }
                    Data::Sft(v) => {
                        let rows: Vec<&Encoded> = idx.iter().map(|&i| &v[i]).collect();
                        pack(&rows, cfg, pad, &mut cuts)?
                    }
                    Data::Pairs(_) => unreachable!("matched above"),
                };
                let n = tokens(&seq) as f64;
                let trained: f32 = loss_mask.data.iter().sum();
                let started = Instant::now();
                let req = SftUpdateRequest {
                    seq,
                    loss_mask,
                    step,
                };
                let answers = group.call_each(&req, t).await?;
                extra.insert(
                    metric::TRAIN_TOKENS_PER_S.into(),
                    f64::from(trained) / started.elapsed().as_secs_f64().max(1e-9),
                );
                Ok((answers, n, extra))
            }
            Data::Pairs(v) => {
                let chosen: Vec<&Encoded> = idx.iter().map(|&i| &v[i].0).collect();
                let rejected: Vec<&Encoded> = idx.iter().map(|&i| &v[i].1).collect();
                let (cs, cm) = pack(&chosen, cfg, pad, &mut cuts)?;
                let (rs, rm) = pack(&rejected, cfg, pad, &mut cuts)?;
                let n = (tokens(&cs) + tokens(&rs)) as f64;
                if cfg.trainer == TrainerKind::Reward {
                    let margin = idx
                        .iter()
                        .map(|&i| v[i].2.map(|m| m as f32))
                        .collect::<Option<Vec<f32>>>();
                    let req = RewardModelUpdateRequest {
                        chosen: cs,
                        rejected: rs,
                        margin,
                        step,
                    };
                    return Ok((group.call_each(&req, t).await?, n, extra));
                }
                let loss = cfg.algorithm.preference();
                let (mut ref_chosen, mut ref_rejected, mut kto_kl) = (None, None, None);
                if loss.loss_type.needs_reference() {
                    let started = Instant::now();
                    let r = &self.roles.reference;
                    let (qa, qb) = (LogProbsRequest(cs.clone()), LogProbsRequest(rs.clone()));
                    let (a, b) = tokio::try_join!(r.call_split(&qa, t), r.call_split(&qb, t))?;
                    ref_chosen = Some(sums(&a.log_probs, &cm));
                    ref_rejected = Some(sums(&b.log_probs, &rm));
                    extra.insert(metric::TIMING_S_REF.into(), started.elapsed().as_secs_f64());
                }
                if loss.loss_type == rlhf_algo::PreferenceLoss::Kto {
                    kto_kl = Some(self.kto_kl(&chosen, &rejected, pad, &mut cuts).await?);
                }
                let req = PreferenceUpdateRequest {
                    chosen: cs,
                    chosen_mask: cm,
                    rejected: rs,
                    rejected_mask: rm,
                    ref_chosen,
                    ref_rejected,
                    kto_kl,
                    step,
                };
                Ok((group.call_each(&req, t).await?, n, extra))
            }
        }
    }
}
