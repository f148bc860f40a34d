//! The role logic as plain synchronous structs: [`Trainer`] (actor_rollout "train"),
//! [`Rollout`] (actor_rollout "infer"), [`RefPolicy`] and [`Critic`]. The RPC layer only
//! moves batches in and out of these; tests drive them directly.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use rlhf_algo::{actor_loss, metric, value_loss, PolicyLossConfig, ValueLossConfig};
use rlhf_collective::{Communicator, SyncStats};
use rlhf_config::{PpoConfig, RoleKind};
use rlhf_core::batch::DataBatch;
use rlhf_model::{generate, Batch, GenerationConfig, LoadOptions, Model, ModelKind, Tokenizer};
use serde_json::json;

use crate::convert::{self, Request};
use crate::error::{Ctx, Error, Result};
use crate::train::{self, EpochPlan, Ident, MicroOut, Optim, RoleState, StepNames};
use crate::weights;

/// Sequence geometry of a job: prompts left-padded to `prompt_len`, responses
/// right-padded to `response_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shapes {
    pub prompt_len: usize,
    pub response_len: usize,
}

impl Shapes {
    pub fn from_config(cfg: &PpoConfig) -> Result<Self> {
        let s = Self {
            prompt_len: cfg.actor_rollout.max_prompt_length as usize,
            response_len: cfg.actor_rollout.max_response_length as usize,
        };
        if s.prompt_len == 0 || s.response_len == 0 {
            return Err(Error::invalid(format!(
                "actor_rollout.max_prompt_length ({}) and max_response_length ({}) must be > 0",
                s.prompt_len, s.response_len
            )));
        }
        Ok(s)
    }

    pub fn seq_len(&self) -> usize {
        self.prompt_len + self.response_len
    }
}

/// The HF directory a role loads.
pub fn model_dir(cfg: &PpoConfig, role: RoleKind) -> Result<PathBuf> {
    let m = cfg.role_model(role).ok_or_else(|| {
        Error::invalid(format!(
            "{role} has no model in the config (set {role}.model, or actor_rollout.model)"
        ))
    })?;
    let dir = m.path.unwrap_or_else(|| PathBuf::from(&m.name));
    if !dir.join("config.json").is_file() {
        return Err(Error::invalid(format!(
            "{role} model '{}' is not an HF model directory ({} has no config.json); the driver \
             must pass absolute model paths",
            m.name,
            dir.display()
        )));
    }
    Ok(dir)
}

/// The tokenizer directory: `training.tokenizer_name_or_path` as the role resolves it,
/// else the model directory.
pub fn tokenizer_dir(cfg: &PpoConfig, role: RoleKind, model_dir: &Path) -> PathBuf {
    cfg.resolved(role)
        .tokenizer_name_or_path
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| model_dir.to_path_buf())
}

/// The actor's sampling temperature as the log-prob divisor (0 means greedy: 1).
fn logprob_temperature(cfg: &PpoConfig) -> f64 {
    let t = cfg.actor_rollout.temperature;
    if t > 0.0 && t.is_finite() {
        t
    } else {
        1.0
    }
}

/// Checks and converts `input_ids` / `attention_mask` `[B, P+R]`.
fn sequences(
    req: &Request<'_>,
    shapes: Shapes,
    device: &Device,
) -> Result<(usize, Tensor, Tensor)> {
    let b = req.rows()?;
    let shape = [b, shapes.seq_len()];
    let ids = req.ids("input_ids", &shape, device)?;
    let mask = req.ids("attention_mask", &shape, device)?;
    Ok((b, ids, mask))
}

/// Log-probs (and entropies) `[B, R]` of the response tokens: response token `t` sits at
/// sequence position `P + t` and is predicted at `P + t - 1`.
fn response_log_probs(
    model: &Model,
    ids: &Tensor,
    mask: &Tensor,
    shapes: Shapes,
    temperature: f64,
    with_entropy: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let batch = Batch::from_mask(ids.clone(), mask.clone())?;
    let (lp, ent) = model.log_probs_and_entropy(&batch, temperature, with_entropy)?;
    let cut = |t: Tensor| t.narrow(1, shapes.prompt_len - 1, shapes.response_len);
    Ok((cut(lp)?, ent.map(cut).transpose()?))
}

/// Runs `f` over row chunks of `chunk` rows and concatenates the outputs along dim 0.
fn chunked(
    b: usize,
    chunk: usize,
    mut f: impl FnMut(&[usize]) -> Result<Vec<Tensor>>,
) -> Result<Vec<Tensor>> {
    let all: Vec<usize> = (0..b).collect();
    let mut parts: Vec<Vec<Tensor>> = Vec::new();
    for idx in all.chunks(chunk.max(1)) {
        parts.push(f(idx)?);
    }
    let n = parts.first().map_or(0, Vec::len);
    (0..n)
        .map(|i| {
            let ts: Vec<&Tensor> = parts.iter().map(|p| &p[i]).collect();
            Ok(Tensor::cat(&ts, 0)?.detach())
        })
        .collect()
}

fn log_probs_batch(
    model: &Model,
    req: &Request<'_>,
    shapes: Shapes,
    temperature: f64,
    micro: usize,
) -> Result<DataBatch> {
    let device = model.device().clone();
    let (b, ids, mask) = sequences(req, shapes, &device)?;
    if let Some(r) = req.meta_u64("response_length")? {
        if r as usize != shapes.response_len {
            return Err(Error::invalid(format!(
                "ComputeLogProbs: meta response_length is {r} but this job's \
                 actor_rollout.max_response_length is {}",
                shapes.response_len
            )));
        }
    }
    let out = chunked(b, micro, |idx| {
        let (lp, ent) = response_log_probs(
            model,
            &convert::rows(&ids, idx)?,
            &convert::rows(&mask, idx)?,
            shapes,
            temperature,
            true,
        )?;
        let ent = ent.ok_or_else(|| Error::internal("entropy was not computed"))?;
        Ok(vec![lp.detach(), ent.detach()])
    })?;
    Ok(DataBatch::new()
        .with_tensor("log_probs", convert::f32_data(&out[0])?)
        .with_tensor("entropy", convert::f32_data(&out[1])?))
}

/// Refuses NaN / inf at valid positions of a token tensor.
fn check_finite_masked(name: &str, t: &Tensor, mask: &[f32], who: &Ident, step: u64) -> Result<()> {
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    if v.iter().zip(mask).any(|(x, &m)| m != 0.0 && !x.is_finite()) {
        return Err(Error::NonFinite {
            tensor: name.to_string(),
            role: who.role,
            rank: who.rank,
            step,
        });
    }
    Ok(())
}

fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

fn metrics_batch(metrics: BTreeMap<String, f64>) -> DataBatch {
    let mut b = DataBatch::new();
    for (k, v) in metrics {
        b.meta.insert(k, json!(v));
    }
    b
}

/// Where an update failed: before its first collective (the group must be told) or after.
enum Failure {
    Before(Error),
    During(Error),
}

/// Training settings one trainable role needs besides its model.
#[derive(Debug, Clone)]
pub struct TrainSettings {
    pub epochs: usize,
    pub mini_batch_rows: usize,
    pub micro_batch_rows: usize,
    pub shuffle: bool,
    pub seed: u64,
    /// See [`EpochPlan::sync_denominators`].
    pub sync_denominators: bool,
}

impl TrainSettings {
    fn plan(&self, step: u64) -> EpochPlan {
        EpochPlan {
            epochs: self.epochs,
            mini_batch_rows: self.mini_batch_rows,
            micro_batch_rows: self.micro_batch_rows,
            shuffle: self.shuffle,
            seed: self.seed,
            step,
            sync_denominators: self.sync_denominators,
        }
    }
}

/// Rows of a rank's share of a global mini-batch.
fn rank_rows(global: u32, world: usize, what: &str) -> Result<usize> {
    let world = world.max(1);
    let g = global as usize;
    if g == 0 || !g.is_multiple_of(world) {
        return Err(Error::invalid(format!(
            "{what} ({g}) must be a positive multiple of the number of ranks ({world})"
        )));
    }
    Ok(g / world)
}

/// The trainable policy of one actor_rollout "train" rank.
pub struct Trainer {
    pub model: Model,
    pub optim: Optim,
    pub who: Ident,
    pub shapes: Shapes,
    pub settings: TrainSettings,
    pub loss: PolicyLossConfig,
    temperature: f64,
    infer_micro: usize,
    tokenizer_dir: PathBuf,
    load_opts: LoadOptions,
    pub version: u64,
}

impl Trainer {
    /// Rank `rank` of `world` trainer ranks, from the job config.
    pub fn from_config(cfg: &PpoConfig, rank: usize, world: usize) -> Result<Self> {
        let t = cfg.resolved(RoleKind::ActorRollout);
        let dir = model_dir(cfg, RoleKind::ActorRollout)?;
        let load_opts = LoadOptions {
            seed: t.seed,
            ..LoadOptions::training(ModelKind::CausalLm)
        };
        let model = Model::load(&dir, &load_opts)
            .with_ctx(|| format!("loading the trainable policy from {}", dir.display()))?;
        let a = &cfg.actor_rollout;
        let rollout = cfg.rollout_batch_size().max(1) as usize;
        let steps_per_iter =
            a.ppo_epochs as usize * (rollout / (a.ppo_mini_batch_size.max(1) as usize)).max(1);
        let optim = Optim::new(model.vars(), &t, steps_per_iter)?;
        Ok(Self {
            optim,
            who: Ident {
                role: RoleKind::ActorRollout,
                rank,
            },
            shapes: Shapes::from_config(cfg)?,
            settings: TrainSettings {
                epochs: a.ppo_epochs as usize,
                mini_batch_rows: rank_rows(
                    a.ppo_mini_batch_size,
                    world,
                    "actor_rollout.ppo_mini_batch_size",
                )?,
                micro_batch_rows: t.micro_batch_size.max(1) as usize,
                shuffle: a.shuffle_minibatch,
                seed: t.seed,
                sync_denominators: true,
            },
            loss: a.policy_loss(),
            temperature: logprob_temperature(cfg),
            infer_micro: t.micro_batch_size.max(1) as usize,
            tokenizer_dir: tokenizer_dir(cfg, RoleKind::ActorRollout, &dir),
            load_opts,
            model,
            version: 0,
        })
    }

    /// Old log-probs: `input_ids`, `attention_mask` -> `log_probs`, `entropy` `[B, R]`.
    pub fn compute_log_probs(&self, batch: &DataBatch) -> Result<DataBatch> {
        let req = Request::new("ComputeLogProbs", batch);
        log_probs_batch(
            &self.model,
            &req,
            self.shapes,
            self.temperature,
            self.infer_micro,
        )
    }

    /// PPO epochs over this rank's shard; returns the metrics in the meta. A shard this
    /// rank refuses (missing tensor, NaN input) fails the whole group's call.
    pub fn update(&mut self, comm: &mut dyn Communicator, batch: &DataBatch) -> Result<DataBatch> {
        self.update_inner(comm, batch)
            .map_err(|e| match e {
                Failure::Before(e) => train::abort_update(comm, e),
                Failure::During(e) => e,
            })
            .with_ctx(|| format!("actor_rollout train rank {} UpdateActor", self.who.rank))
    }

    fn update_inner(
        &mut self,
        comm: &mut dyn Communicator,
        batch: &DataBatch,
    ) -> std::result::Result<DataBatch, Failure> {
        let prep = || -> Result<_> {
            let req = Request::new("UpdateActor", batch);
            let device = self.model.device().clone();
            let step = req.meta_u64("step")?.unwrap_or(0);
            let (b, ids, mask) = sequences(&req, self.shapes, &device)?;
            let r = self.shapes.response_len;
            let tok = [b, r];
            let resp_mask = req.f32("response_mask", &tok, &device)?;
            let old = req.f32("old_log_probs", &tok, &device)?;
            let adv = req.f32("advantages", &tok, &device)?;
            let refp = if self.loss.use_kl_loss {
                Some(req.f32("ref_log_probs", &tok, &device)?)
            } else {
                None
            };
            let mask_host = host_f32(&resp_mask)?;
            check_finite_masked("advantages", &adv, &mask_host, &self.who, step)?;
            check_finite_masked("old_log_probs", &old, &mask_host, &self.who, step)?;
            if let Some(rp) = &refp {
                check_finite_masked("ref_log_probs", rp, &mask_host, &self.who, step)?;
            }
            Ok((step, ids, mask, resp_mask, old, adv, refp, mask_host))
        };
        let (step, ids, mask, resp_mask, old, adv, refp, mask_host) =
            prep().map_err(Failure::Before)?;
        let r = self.shapes.response_len;
        let (shapes, temperature, loss_cfg) = (self.shapes, self.temperature, self.loss.clone());
        let mut micro = |model: &Model, idx: &[usize]| -> Result<MicroOut> {
            let m = convert::rows(&resp_mask, idx)?;
            let (lp, ent) = response_log_probs(
                model,
                &convert::rows(&ids, idx)?,
                &convert::rows(&mask, idx)?,
                shapes,
                temperature,
                true,
            )?;
            let ent = ent.ok_or_else(|| Error::internal("entropy was not computed"))?;
            let ent = if loss_cfg.entropy_coeff == 0.0 {
                ent.detach()
            } else {
                ent
            };
            let rp = refp.as_ref().map(|t| convert::rows(t, idx)).transpose()?;
            let out = actor_loss(
                &convert::rows(&old, idx)?,
                &lp,
                &convert::rows(&adv, idx)?,
                &m,
                Some(&ent),
                rp.as_ref(),
                &loss_cfg,
            )?;
            let p = &out.policy;
            let pg = p.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            let mut stats = vec![
                (metric::POLICY_APPROXKL_AVG, p.approxkl),
                (metric::POLICY_CLIPFRAC_AVG, p.clipfrac),
                (metric::LOSS_POLICY_AVG, pg),
                (metric::VAL_RATIO, p.ratio_mean),
                (metric::ACTOR_PG_CLIPFRAC_LOWER, p.clipfrac_lower),
            ];
            if let Some(e) = out.entropy {
                stats.push((metric::POLICY_ENTROPY_AVG, e));
            }
            if let Some(k) = out.kl_loss {
                stats.push((metric::ACTOR_KL_LOSS, k));
            }
            Ok(MicroOut {
                loss: out.loss,
                stats,
            })
        };
        let names = StepNames {
            grad_norm: metric::ACTOR_GRAD_NORM,
            lr: metric::ACTOR_LR,
            variance: Some((metric::VAL_RATIO, metric::VAL_RATIO_VAR)),
        };
        let metrics = train::run_update(
            &self.model,
            &mut self.optim,
            comm,
            &self.who,
            &self.settings.plan(step),
            &mask_host,
            r,
            self.loss.loss_agg_mode,
            &names,
            &mut micro,
        )
        .map_err(Failure::During)?;
        Ok(metrics_batch(metrics))
    }

    pub fn checksum(&self) -> Result<u64> {
        weights::weights_checksum(&self.model)
    }

    /// Root side of the weight sync.
    pub fn send_weights(
        &mut self,
        comm: &mut dyn Communicator,
        version: u64,
        bucket_bytes: usize,
    ) -> Result<(SyncStats, u64)> {
        let out = weights::send_weights(&self.model, comm, bucket_bytes)?;
        self.version = version;
        Ok(out)
    }

    pub fn save_checkpoint(&self, dir: &Path) -> Result<Vec<String>> {
        let state = RoleState {
            role: RoleKind::ActorRollout,
            scheduler_step: self.optim.steps() as u64,
            weights_version: self.version,
        };
        train::save_checkpoint(
            &self.model,
            &self.optim,
            &state,
            dir,
            Some(&self.tokenizer_dir),
        )
    }

    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<u64> {
        let s = train::load_checkpoint(&self.model, &mut self.optim, dir, &self.load_opts)?;
        self.version = s.weights_version;
        self.checksum()
    }
}

/// The trainable value model of one critic rank.
pub struct Critic {
    pub model: Model,
    pub optim: Optim,
    pub who: Ident,
    pub shapes: Shapes,
    pub settings: TrainSettings,
    pub loss: ValueLossConfig,
    infer_micro: usize,
    tokenizer_dir: PathBuf,
    load_opts: LoadOptions,
    pub version: u64,
}

impl Critic {
    pub fn from_config(cfg: &PpoConfig, rank: usize, world: usize) -> Result<Self> {
        let t = cfg.resolved(RoleKind::Critic);
        let dir = model_dir(cfg, RoleKind::Critic)?;
        let load_opts = LoadOptions {
            seed: t.seed,
            ..LoadOptions::training(ModelKind::Value)
        };
        let model = Model::load(&dir, &load_opts)
            .with_ctx(|| format!("loading the critic from {}", dir.display()))?;
        let c = &cfg.critic;
        let rollout = cfg.rollout_batch_size().max(1) as usize;
        let steps_per_iter = c.critic_update_epochs as usize
            * (rollout / (c.critic_mini_batch_size.max(1) as usize)).max(1);
        let optim = Optim::new(model.vars(), &t, steps_per_iter)?;
        Ok(Self {
            optim,
            who: Ident {
                role: RoleKind::Critic,
                rank,
            },
            shapes: Shapes::from_config(cfg)?,
            settings: TrainSettings {
                epochs: c.critic_update_epochs as usize,
                mini_batch_rows: rank_rows(
                    c.critic_mini_batch_size,
                    world,
                    "critic.critic_mini_batch_size",
                )?,
                micro_batch_rows: t.micro_batch_size.max(1) as usize,
                shuffle: c.shuffle_minibatch,
                seed: t.seed,
                sync_denominators: true,
            },
            loss: c.value_loss(),
            infer_micro: t.micro_batch_size.max(1) as usize,
            tokenizer_dir: tokenizer_dir(cfg, RoleKind::Critic, &dir),
            load_opts,
            model,
            version: 0,
        })
    }

    /// `input_ids`, `attention_mask` -> `values` `[B, R]`.
    pub fn compute_values(&self, batch: &DataBatch) -> Result<DataBatch> {
        let req = Request::new("ComputeValues", batch);
        let device = self.model.device().clone();
        let (b, ids, mask) = sequences(&req, self.shapes, &device)?;
        let out = chunked(b, self.infer_micro, |idx| {
            let v = response_values(
                &self.model,
                self.shapes,
                &convert::rows(&ids, idx)?,
                &convert::rows(&mask, idx)?,
            )?;
            Ok(vec![v.detach()])
        })?;
        Ok(DataBatch::new().with_tensor("values", convert::f32_data(&out[0])?))
    }

    /// Value epochs over this rank's shard; returns the metrics in the meta.
    pub fn update(&mut self, comm: &mut dyn Communicator, batch: &DataBatch) -> Result<DataBatch> {
        self.update_inner(comm, batch)
            .map_err(|e| match e {
                Failure::Before(e) => train::abort_update(comm, e),
                Failure::During(e) => e,
            })
            .with_ctx(|| format!("critic rank {} UpdateCritic", self.who.rank))
    }

    fn update_inner(
        &mut self,
        comm: &mut dyn Communicator,
        batch: &DataBatch,
    ) -> std::result::Result<DataBatch, Failure> {
        let prep = || -> Result<_> {
            let req = Request::new("UpdateCritic", batch);
            let device = self.model.device().clone();
            let step = req.meta_u64("step")?.unwrap_or(0);
            let (b, ids, mask) = sequences(&req, self.shapes, &device)?;
            let r = self.shapes.response_len;
            let tok = [b, r];
            let resp_mask = req.f32("response_mask", &tok, &device)?;
            let old = req.f32("values", &tok, &device)?;
            let ret = req.f32("returns", &tok, &device)?;
            let mask_host = host_f32(&resp_mask)?;
            check_finite_masked("values", &old, &mask_host, &self.who, step)?;
            check_finite_masked("returns", &ret, &mask_host, &self.who, step)?;
            Ok((step, ids, mask, resp_mask, old, ret, mask_host))
        };
        let (step, ids, mask, resp_mask, old, ret, mask_host) = prep().map_err(Failure::Before)?;
        let r = self.shapes.response_len;
        let loss_cfg = self.loss.clone();
        let shapes = self.shapes;
        let mut micro = |model: &Model, idx: &[usize]| -> Result<MicroOut> {
            let m = convert::rows(&resp_mask, idx)?;
            let v = response_values(
                model,
                shapes,
                &convert::rows(&ids, idx)?,
                &convert::rows(&mask, idx)?,
            )?;
            let out = value_loss(
                &v,
                &convert::rows(&old, idx)?,
                &convert::rows(&ret, idx)?,
                &m,
                &loss_cfg,
            )?;
            let vpred = rlhf_algo::masked_mean(&v.detach(), &m)?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
            Ok(MicroOut {
                loss: out.weighted_loss,
                stats: vec![
                    (
                        metric::LOSS_VALUE_AVG,
                        out.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
                    ),
                    (metric::VAL_CLIPFRAC_AVG, out.clipfrac),
                    (metric::VAL_VPRED, vpred),
                ],
            })
        };
        let names = StepNames {
            grad_norm: metric::CRITIC_GRAD_NORM,
            lr: metric::CRITIC_LR,
            variance: None,
        };
        let plan = self.settings.plan(step);
        let metrics = train::run_update(
            &self.model,
            &mut self.optim,
            comm,
            &self.who,
            &plan,
            &mask_host,
            r,
            self.loss.loss_agg_mode,
            &names,
            &mut micro,
        )
        .map_err(Failure::During)?;
        Ok(metrics_batch(metrics))
    }

    pub fn checksum(&self) -> Result<u64> {
        weights::weights_checksum(&self.model)
    }

    pub fn save_checkpoint(&self, dir: &Path) -> Result<Vec<String>> {
        let state = RoleState {
            role: RoleKind::Critic,
            scheduler_step: self.optim.steps() as u64,
            weights_version: self.version,
        };
        train::save_checkpoint(
            &self.model,
            &self.optim,
            &state,
            dir,
            Some(&self.tokenizer_dir),
        )
    }

    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<u64> {
        let s = train::load_checkpoint(&self.model, &mut self.optim, dir, &self.load_opts)?;
        self.version = s.weights_version;
        self.checksum()
    }
}

/// The inference policy of one actor_rollout "infer" rank.
pub struct Rollout {
    pub model: Model,
    pub shapes: Shapes,
    pub gen: GenerationConfig,
    pub version: u64,
}

impl Rollout {
    pub fn from_config(cfg: &PpoConfig) -> Result<Self> {
        let t = cfg.resolved(RoleKind::ActorRollout);
        let dir = model_dir(cfg, RoleKind::ActorRollout)?;
        let model = Model::load(&dir, &LoadOptions::inference())
            .with_ctx(|| format!("loading the rollout policy from {}", dir.display()))?;
        let shapes = Shapes::from_config(cfg)?;
        let a = &cfg.actor_rollout;
        let mut gen = model.generation_config().clone();
        gen.max_new_tokens = shapes.response_len;
        gen.min_new_tokens = 0;
        gen.temperature = if a.do_sample { a.temperature } else { 0.0 };
        gen.top_p = a.top_p;
        gen.top_k = a.top_k as usize;
        gen.n = 1;
        gen.truncate_prompts = false;
        let tok_dir = tokenizer_dir(cfg, RoleKind::ActorRollout, &dir);
        if let Ok(tok) = Tokenizer::from_dir(&tok_dir) {
            if let Some(eos) = tok.eos_token_id() {
                if !gen.eos_token_ids.contains(&eos) {
                    gen.eos_token_ids.push(eos);
                }
            }
            gen.pad_token_id = tok
                .pad_token_id()
                .or(tok.eos_token_id())
                .or(gen.pad_token_id);
        }
        gen.seed = t.seed;
        Ok(Self {
            model,
            shapes,
            gen,
            version: 0,
        })
    }

    /// `prompt_ids`, `prompt_mask` `[B, P]` -> `responses`, `response_mask`,
    /// `rollout_log_probs` `[B, R]`.
    pub fn generate(&self, batch: &DataBatch) -> Result<DataBatch> {
        let req = Request::new("Generate", batch);
        let b = req.rows()?;
        let p = self.shapes.prompt_len;
        let shape = [b, p];
        let ids = req.tensor("prompt_ids")?;
        let mask = req.tensor("prompt_mask")?;
        for (name, t) in [("prompt_ids", ids), ("prompt_mask", mask)] {
            if t.shape != shape {
                return Err(Error::invalid(format!(
                    "Generate: tensor '{name}' has shape {:?}, expected {shape:?} \
                     (rows x actor_rollout.max_prompt_length)",
                    t.shape
                )));
            }
        }
        let ids = ids.to_i64()?;
        let mask = mask.to_i64()?;
        let mut prompts = Vec::with_capacity(b);
        for i in 0..b {
            let row: Vec<u32> = (0..p)
                .filter(|&j| mask[i * p + j] != 0)
                .map(|j| ids[i * p + j] as u32)
                .collect();
            if row.is_empty() {
                return Err(Error::invalid(format!(
                    "Generate: prompt row {i} has no tokens (prompt_mask is all 0)"
                )));
            }
            prompts.push(row);
        }
        let mut gen = self.gen.clone();
        if let Some(seed) = req.meta_u64("seed")? {
            gen.seed = seed;
        }
        let out = generate(&self.model, &prompts, &gen)?;
        let (resp, rmask, lps) = out.response_tensors(&Device::Cpu)?;
        Ok(DataBatch::new()
            .with_tensor("responses", convert::i64_data(&resp)?)
            .with_tensor(
                "response_mask",
                convert::f32_data(&rmask.to_dtype(DType::F32)?)?,
            )
            .with_tensor("rollout_log_probs", convert::f32_data(&lps)?))
    }

    /// Receiver side of the weight sync (the trainer is rank 0 of the group).
    pub fn recv_weights(
        &mut self,
        comm: &mut dyn Communicator,
        version: u64,
        bucket_bytes: usize,
    ) -> Result<(SyncStats, u64)> {
        let out = weights::recv_weights(&self.model, comm, 0, bucket_bytes)?;
        self.version = version;
        Ok(out)
    }

    pub fn checksum(&self) -> Result<u64> {
        weights::weights_checksum(&self.model)
    }
}

/// The frozen reference policy.
pub struct RefPolicy {
    pub model: Model,
    pub shapes: Shapes,
    temperature: f64,
    micro: usize,
}

impl RefPolicy {
    pub fn from_config(cfg: &PpoConfig) -> Result<Self> {
        let t = cfg.resolved(RoleKind::Ref);
        let dir = model_dir(cfg, RoleKind::Ref)?;
        let model = Model::load(&dir, &LoadOptions::inference())
            .with_ctx(|| format!("loading the reference policy from {}", dir.display()))?;
        Ok(Self {
            model,
            shapes: Shapes::from_config(cfg)?,
            temperature: logprob_temperature(cfg),
            micro: t.micro_batch_size.max(1) as usize,
        })
    }

    pub fn compute_log_probs(&self, batch: &DataBatch) -> Result<DataBatch> {
        let req = Request::new("ComputeLogProbs", batch);
        log_probs_batch(&self.model, &req, self.shapes, self.temperature, self.micro)
    }

    pub fn checksum(&self) -> Result<u64> {
        weights::weights_checksum(&self.model)
    }
}

/// Values `[B, R]`: the value of the state before response token `t` (position P+t-1).
fn response_values(model: &Model, shapes: Shapes, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let batch = Batch::from_mask(ids.clone(), mask.clone())?;
    let v = model.values(&batch)?;
    Ok(v.narrow(1, shapes.prompt_len - 1, shapes.response_len)?)
}
