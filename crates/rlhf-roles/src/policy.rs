//! The policy engines: [`Trainer`] (actor_rollout "train": old log-probs and the PPO update),
//! [`Rollout`] (actor_rollout "infer": generation, receives weights) and [`RefPolicy`]
//! (frozen reference log-probs). Each is built from its rank's `RoleSpec`; the RPC layer
//! only hands them typed requests, and tests drive them directly.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use rlhf_algo::{actor_loss, metric, LossAggMode, PolicyLossConfig};
use rlhf_collective::{Communicator, SyncStats};
use rlhf_config::{EngineSpec, RoleSpec, Shapes};
use rlhf_core::calls::candle::mat_f32;
use rlhf_core::calls::{
    stream_seed, ActorUpdateRequest, GenerateRequest, GenerateResponse, LogProbsRequest,
    LogProbsResponse,
};
use rlhf_model::{generate, Batch, GenerationConfig, LoadOptions, Model, ModelKind, Tokenizer};

use crate::convert::{self, check_finite_masked, chunked, sequences, tokens};
use crate::engine::{Generate, LogProbs};
use crate::error::{Ctx, Error, Result};
use crate::train::{self, MicroOut, Prepared, StepNames, Train, TrainState};
use crate::vllm::rollout::VllmRollout;
use crate::weights;

/// The engine a spec asks for was not the one being built.
pub(crate) fn wrong_engine(spec: &RoleSpec, want: &str) -> Error {
    Error::invalid(format!(
        "{}: the spec is for a {:?} engine, not {want}",
        spec.slot.label(),
        spec.engine
    ))
}

/// Log-probs (and entropies) `[B, R]` of the response tokens: response token `t` sits at
/// sequence position `P + t` and is predicted at `P + t - 1`.
pub(crate) fn response_log_probs(
    model: &Model,
    ids: &Tensor,
    mask: &Tensor,
    shapes: Shapes,
    temperature: f64,
) -> Result<(Tensor, Tensor)> {
    let batch = Batch::from_mask(ids.clone(), mask.clone())?;
    let (lp, ent) = model.log_probs_and_entropy(&batch, temperature, true)?;
    let ent = ent.ok_or_else(|| Error::internal("entropy was not computed"))?;
    let cut = |t: Tensor| t.narrow(1, shapes.prompt_len - 1, shapes.response_len);
    Ok((cut(lp)?, cut(ent)?))
}

/// Log-probs and entropies of a request's responses, `micro` rows per forward.
pub(crate) fn log_probs(
    model: &Model,
    req: &LogProbsRequest,
    shapes: Shapes,
    temperature: f64,
    micro: usize,
) -> Result<LogProbsResponse> {
    let (ids, mask) = sequences("ComputeLogProbs", &req.0, shapes, model.device())?;
    let out = chunked(req.0.rows(), micro, |idx| {
        let (lp, ent) = response_log_probs(
            model,
            &convert::rows(&ids, idx)?,
            &convert::rows(&mask, idx)?,
            shapes,
            temperature,
        )?;
        Ok(vec![lp.detach(), ent.detach()])
    })?;
    Ok(LogProbsResponse {
        log_probs: mat_f32(&out[0], "log_probs")?,
        entropy: mat_f32(&out[1], "entropy")?,
    })
}

/// The trainable policy of one actor_rollout "train" rank.
pub struct Trainer {
    pub state: TrainState,
    pub shapes: Shapes,
    pub loss: PolicyLossConfig,
    temperature: f64,
    /// The weight sync's exported GPU buffer, kept between syncs.
    pub ipc: weights::ipc::IpcState,
}

/// An actor update's tensors on the device.
pub struct ActorBatch {
    ids: Tensor,
    mask: Tensor,
    response_mask: Tensor,
    old: Tensor,
    adv: Tensor,
    refp: Option<Tensor>,
}

impl Trainer {
    pub fn new(spec: &RoleSpec, device: &Device) -> Result<Self> {
        let EngineSpec::Trainer {
            train,
            loss,
            temperature,
        } = &spec.engine
        else {
            return Err(wrong_engine(spec, "a trainer"));
        };
        let load_opts =
            convert::load_options(spec, device, LoadOptions::training(ModelKind::CausalLm));
        Ok(Self {
            state: TrainState::load(
                &spec.slot,
                spec.model_dir()?,
                load_opts,
                train,
                spec.micro_batch_rows,
                spec.seed,
                spec.tokenizer_dir.clone(),
            )?,
            shapes: spec.shapes,
            loss: loss.clone(),
            temperature: *temperature,
            ipc: Default::default(),
        })
    }

    /// Root side of the weight sync (of a model that is not sharded).
    pub fn send_weights(
        &mut self,
        comm: &mut dyn Communicator,
        version: u64,
        bucket_bytes: usize,
    ) -> Result<(SyncStats, u64)> {
        let out = weights::send_weights(&self.state.model, comm, bucket_bytes, &mut self.ipc)?;
        self.state.version = version;
        Ok(out)
    }

    /// Root side of the weight sync of a ZeRO-3 policy: its data-parallel group (`dp`)
    /// gathers the whole weights a layer at a time and each is sent before the next is
    /// gathered ([`weights::send_weights_sharded`], which says what the two errors mean).
    pub fn send_weights_sharded(
        &mut self,
        dp: &mut dyn Communicator,
        comm: &mut dyn Communicator,
        version: u64,
        bucket_bytes: usize,
    ) -> Result<Result<(SyncStats, u64)>> {
        let out = weights::send_weights_sharded(
            &self.state.model,
            dp,
            comm,
            bucket_bytes,
            &mut self.ipc,
        )?;
        if out.is_ok() {
            self.state.version = version;
        }
        Ok(out)
    }

    /// PPO epochs over this rank's shard.
    pub fn update(
        &mut self,
        comm: &mut dyn Communicator,
        req: &ActorUpdateRequest,
    ) -> Result<rlhf_core::calls::UpdateResponse> {
        train::update(self, comm, req)
    }
}

impl LogProbs for Trainer {
    fn log_probs(&self, req: &LogProbsRequest) -> Result<LogProbsResponse> {
        log_probs(
            &self.state.model,
            req,
            self.shapes,
            self.temperature,
            self.state.settings.micro_batch_rows,
        )
    }
}

impl Train for Trainer {
    type Request = ActorUpdateRequest;
    type Batch = ActorBatch;
    const NAMES: StepNames = StepNames {
        grad_norm: metric::ACTOR_GRAD_NORM,
        lr: metric::ACTOR_LR,
        variance: Some((metric::VAL_RATIO, metric::VAL_RATIO_VAR)),
    };

    fn state(&self) -> &TrainState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut TrainState {
        &mut self.state
    }

    fn agg_mode(&self) -> LossAggMode {
        self.loss.loss_agg_mode
    }

    fn prepare(&self, req: &ActorUpdateRequest) -> Result<Prepared<ActorBatch>> {
        const CALL: &str = "UpdateActor";
        let device = self.state.model.device();
        let (who, step, shapes) = (&self.state.who, req.step, self.shapes);
        let (ids, mask) = sequences(CALL, &req.seq, shapes, device)?;
        let b = req.seq.rows();
        let host_mask = req.response_mask.data.clone();
        let response_mask = tokens(CALL, "response_mask", &req.response_mask, b, shapes, device)?;
        check_finite_masked("advantages", &req.advantages, &host_mask, who, step)?;
        check_finite_masked("old_log_probs", &req.old_log_probs, &host_mask, who, step)?;
        let refp = match (&req.ref_log_probs, self.loss.use_kl_loss) {
            (Some(rp), true) => {
                check_finite_masked("ref_log_probs", rp, &host_mask, who, step)?;
                Some(tokens(CALL, "ref_log_probs", rp, b, shapes, device)?)
            }
            (None, true) => {
                return Err(Error::invalid(
                    "UpdateActor: actor_rollout.use_kl_loss is on but the request has no \
                     ref_log_probs",
                ))
            }
            (_, false) => None,
        };
        Ok(Prepared {
            batch: ActorBatch {
                ids,
                mask,
                response_mask,
                old: tokens(CALL, "old_log_probs", &req.old_log_probs, b, shapes, device)?,
                adv: tokens(CALL, "advantages", &req.advantages, b, shapes, device)?,
                refp,
            },
            mask: host_mask,
            width: shapes.response_len,
            step,
        })
    }

    fn micro_loss(&self, model: &Model, b: &ActorBatch, idx: &[usize]) -> Result<MicroOut> {
        let m = convert::rows(&b.response_mask, idx)?;
        let (lp, ent) = response_log_probs(
            model,
            &convert::rows(&b.ids, idx)?,
            &convert::rows(&b.mask, idx)?,
            self.shapes,
            self.temperature,
        )?;
        let ent = if self.loss.entropy_coeff == 0.0 {
            ent.detach()
        } else {
            ent
        };
        let rp = b.refp.as_ref().map(|t| convert::rows(t, idx)).transpose()?;
        let out = actor_loss(
            &convert::rows(&b.old, idx)?,
            &lp,
            &convert::rows(&b.adv, idx)?,
            &m,
            Some(&ent),
            rp.as_ref(),
            &self.loss,
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
    }
}

/// The inference policy of one actor_rollout "infer" rank.
pub struct Rollout {
    pub model: Arc<Model>,
    pub shapes: Shapes,
    pub gen: GenerationConfig,
    pub version: u64,
    /// Rows per forward of the teacher-forced log-prob pass.
    micro: usize,
    /// Its temperature (the trainer's).
    logprob_temperature: f64,
    /// The weight sync's mapping of the trainer's GPU buffer, kept between syncs.
    pub ipc: weights::ipc::IpcState,
    /// `actor_rollout.engine: vllm`: the server that generates; `model` is then the copy
    /// the weight sync fills, which each sync publishes to it.
    vllm: Option<VllmRollout>,
}

impl Rollout {
    /// Loads its own copy of the policy for inference (and starts its vLLM server when the
    /// spec asks for one).
    pub fn new(spec: &RoleSpec, device: &Device) -> Result<Self> {
        let dir = spec.model_dir()?;
        let opts = convert::load_options(spec, device, LoadOptions::inference());
        let model = Model::load(dir, &opts)
            .with_ctx(|| format!("loading the rollout policy from {}", dir.display()))?;
        let mut r = Self::sharing(spec, Arc::new(model))?;
        if let EngineSpec::Rollout { vllm: Some(v), .. } = &spec.engine {
            r.vllm = Some(VllmRollout::start(spec, v, &r.model)?);
        }
        Ok(r)
    }

    /// Generates with `model`, which may be another engine's (the hybrid engine: a rollout
    /// over the trainer's weights needs no sync).
    pub fn sharing(spec: &RoleSpec, model: Arc<Model>) -> Result<Self> {
        let EngineSpec::Rollout {
            sampling,
            temperature,
            ..
        } = &spec.engine
        else {
            return Err(wrong_engine(spec, "a rollout"));
        };
        let mut gen = model.generation_config().clone();
        gen.max_new_tokens = spec.shapes.response_len;
        gen.min_new_tokens = 0;
        gen.temperature = sampling.temperature;
        gen.top_p = sampling.top_p;
        gen.top_k = sampling.top_k;
        gen.n = 1;
        gen.truncate_prompts = false;
        if let Some(tok) = spec
            .tokenizer_dir
            .as_ref()
            .and_then(|d| Tokenizer::from_dir(d).ok())
        {
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
        gen.seed = spec.seed;
        Ok(Self {
            model,
            shapes: spec.shapes,
            gen,
            version: 0,
            micro: spec.micro_batch_rows,
            logprob_temperature: *temperature,
            ipc: Default::default(),
            vllm: None,
        })
    }

    pub fn checksum(&self) -> Result<u64> {
        weights::weights_checksum(&self.model)
    }

    /// Receiver side of the weight sync (the trainer is rank 0 of the group).
    pub fn recv_weights(
        &mut self,
        comm: &mut dyn Communicator,
        version: u64,
        bucket_bytes: usize,
    ) -> Result<(SyncStats, u64)> {
        let out = weights::recv_weights(&self.model, comm, bucket_bytes, &mut self.ipc)?;
        if let Some(v) = &self.vllm {
            let p = v.publish(&self.model)?;
            tracing::info!(
                "weights v{version} published to vLLM: {:.1} MB written in {:.3} s, reloaded \
                 in {:.3} s, probe gap {:.2e}",
                p.bytes as f64 / 1e6,
                p.write.as_secs_f64(),
                p.reload.as_secs_f64(),
                p.probe_gap
            );
        }
        self.version = version;
        Ok(out)
    }
}

impl Generate for Rollout {
    fn generate(&self, rank: u32, req: &GenerateRequest) -> Result<GenerateResponse> {
        let p = self.shapes.prompt_len;
        let (ids, mask) = (&req.prompt_ids, &req.prompt_mask);
        for (name, m) in [("prompt_ids", ids), ("prompt_mask", mask)] {
            if m.cols != p || m.rows != ids.rows {
                return Err(Error::invalid(format!(
                    "Generate: tensor '{name}' has shape {:?}, expected [{}, {p}] \
                     (rows x actor_rollout.max_prompt_length)",
                    m.shape(),
                    ids.rows
                )));
            }
        }
        let mut prompts = Vec::with_capacity(ids.rows);
        for i in 0..ids.rows {
            let row: Vec<u32> = (0..p)
                .filter(|&j| mask.row(i)[j] != 0)
                .map(|j| {
                    let id = ids.row(i)[j];
                    // A negative or huge id must not wrap onto a real token.
                    u32::try_from(id).map_err(|_| {
                        Error::invalid(format!(
                            "Generate: prompt row {i} position {j} has token id {id}, which is no token id"
                        ))
                    })
                })
                .collect::<Result<_>>()?;
            if row.is_empty() {
                return Err(Error::invalid(format!(
                    "Generate: prompt row {i} has no tokens (prompt_mask is all 0)"
                )));
            }
            prompts.push(row);
        }
        let mut gen = self.gen.clone();
        gen.seed = stream_seed(req.seed, req.step, u64::from(rank));
        let out = match &self.vllm {
            Some(v) => v.generate(&prompts, &gen)?,
            None => generate(&self.model, &prompts, &gen)?,
        };
        let (resp, rmask, lps) = out.response_tensors(&Device::Cpu)?;
        Ok(GenerateResponse {
            responses: rlhf_core::calls::candle::mat_i64(&resp, "responses")?,
            response_mask: mat_f32(&rmask, "response_mask")?,
            behaviour_log_probs: mat_f32(&lps, "behaviour_log_probs")?,
            policy_version: vec![self.version; ids.rows],
        })
    }
}

/// The rollout engine's own log-probs of given responses (teacher-forced, its weights, its
/// dtype, the sampling temperature): async runs compare them with the trainer's on the same
/// weights (`training/rollout_logprob_gap_*`).
impl LogProbs for Rollout {
    fn log_probs(&self, req: &LogProbsRequest) -> Result<LogProbsResponse> {
        // vLLM's teacher-forced log-probs are at temperature 1 only; at another temperature
        // the received copy (the same weights, what vLLM was last given) computes them.
        if let Some(v) = self
            .vllm
            .as_ref()
            .filter(|_| self.logprob_temperature == 1.0)
        {
            return v.response_log_probs(req, self.shapes);
        }
        log_probs(
            &self.model,
            req,
            self.shapes,
            self.logprob_temperature,
            self.micro.max(1),
        )
    }
}

/// The frozen reference policy: its own copy, or a LoRA actor trainer's model with the
/// adapters switched off (the same base weights, no second copy).
pub struct RefPolicy {
    pub model: Arc<Model>,
    pub shapes: Shapes,
    temperature: f64,
    micro: usize,
    /// Computes with `model`'s adapters off (the base of a LoRA actor).
    adapter_off: bool,
}

impl RefPolicy {
    pub fn new(spec: &RoleSpec, device: &Device) -> Result<Self> {
        let dir = spec.model_dir()?;
        let opts = convert::load_options(spec, device, LoadOptions::inference());
        let model = Model::load(dir, &opts)
            .with_ctx(|| format!("loading the reference policy from {}", dir.display()))?;
        Self::build(spec, Arc::new(model), false)
    }

    /// The reference as the base of a LoRA trainer's `model`: its adapters are off while
    /// this engine computes.
    pub fn sharing(spec: &RoleSpec, model: Arc<Model>) -> Result<Self> {
        if model.lora().is_none() {
            return Err(Error::invalid(format!(
                "{}: a reference that shares the actor's weights needs the actor to train \
                 LoRA adapters (actor_rollout.lora.rank > 0); without them it needs its own \
                 copy",
                spec.slot.label()
            )));
        }
        Self::build(spec, model, true)
    }

    fn build(spec: &RoleSpec, model: Arc<Model>, adapter_off: bool) -> Result<Self> {
        let EngineSpec::Ref { temperature } = &spec.engine else {
            return Err(wrong_engine(spec, "a reference policy"));
        };
        Ok(Self {
            model,
            shapes: spec.shapes,
            temperature: *temperature,
            micro: spec.micro_batch_rows,
            adapter_off,
        })
    }
}

impl LogProbs for RefPolicy {
    fn log_probs(&self, req: &LogProbsRequest) -> Result<LogProbsResponse> {
        let run = |m: &Model| log_probs(m, req, self.shapes, self.temperature, self.micro);
        if self.adapter_off {
            self.model.with_adapter_disabled(run)
        } else {
            run(&self.model)
        }
    }
}
