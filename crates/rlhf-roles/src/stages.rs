//! The engines of the stages before and beside PPO, each a [`Train`] over the shared update
//! loop (data parallelism, accumulation, clipping, checkpoints): [`SftTrainer`] (the policy
//! on completion tokens), [`PreferenceTrainer`] (the policy on preference pairs with a
//! DPO-family loss) and [`RewardModelTrainer`] (a score head on preference pairs,
//! Bradley–Terry). One call is one optimizer step over the rank's rows: the global batch is
//! the mini-batch. The math is `rlhf_algo`'s; here are only the forwards and the rows.

use candle_core::{Device, Tensor};
use rlhf_algo::{metric, preference_loss, reward_loss, sft_loss, LossAggMode, PairBatch};
use rlhf_algo::{PreferenceConfig, PreferenceStats};
use rlhf_collective::Communicator;
use rlhf_config::{EngineSpec, RoleSpec, Shapes};
use rlhf_core::calls::{
    LogProbsRequest, LogProbsResponse, PreferenceUpdateRequest, RewardModelUpdateRequest,
    ScoresRequest, ScoresResponse, Sequences, SftUpdateRequest, UpdateResponse,
};
use rlhf_model::{Batch, LoadOptions, Model, ModelKind};

use crate::convert::{self, chunked, sequences, tokens};
use crate::engine::{LogProbs, Score};
use crate::error::{Error, Result};
use crate::policy::wrong_engine;
use crate::train::{self, MicroOut, Prepared, StepNames, Train, TrainState};

fn load(spec: &RoleSpec, device: &Device, kind: ModelKind, what: &str) -> Result<TrainState> {
    let train = match &spec.engine {
        EngineSpec::Sft { train }
        | EngineSpec::Preference { train, .. }
        | EngineSpec::RewardModel { train, .. } => train,
        _ => return Err(wrong_engine(spec, what)),
    };
    let load_opts = convert::load_options(spec, device, LoadOptions::training(kind));
    TrainState::load(
        &spec.slot,
        spec.model_dir()?,
        load_opts,
        train,
        spec.micro_batch_rows,
        spec.seed,
        spec.tokenizer_dir.clone(),
    )
}

/// Log-probs `[B, width]` of the last `width` tokens of each row at temperature 1 (no
/// entropy): the response columns, or every token after the first in a packed row.
fn completion_log_probs(
    model: &Model,
    ids: &Tensor,
    mask: &Tensor,
    width: usize,
) -> Result<Tensor> {
    let batch = Batch::from_mask(ids.clone(), mask.clone())?;
    let (lp, _) = model.log_probs_and_entropy(&batch, 1.0, false)?;
    let cols = lp.dim(1)?;
    Ok(lp.narrow(1, cols - width, width)?)
}

/// Log-probs of a request's completions for the driver (reference passes, KTO's KL pairs,
/// eval) at temperature 1, `micro` rows per forward.
fn log_probs_of(
    model: &Model,
    req: &LogProbsRequest,
    shapes: Shapes,
    micro: usize,
) -> Result<LogProbsResponse> {
    crate::policy::log_probs(model, req, shapes, 1.0, micro)
}

/// `f` (a model call on `(ids, mask)`) of rows `idx` of both sides of the pairs, in one call
/// of the chosen rows then the rejected ones (TRL's concatenated forward), split back: one
/// call of 2n rows is faster than two of n, and a ZeRO-3 training pass makes exactly one.
fn both_sides(
    chosen: &(Tensor, Tensor),
    rejected: &(Tensor, Tensor),
    idx: &[usize],
    f: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<(Tensor, Tensor)> {
    let n = idx.len();
    let cat = |c: &Tensor, r: &Tensor| -> Result<Tensor> {
        Ok(Tensor::cat(
            &[convert::rows(c, idx)?, convert::rows(r, idx)?],
            0,
        )?)
    };
    let out = f(&cat(&chosen.0, &rejected.0)?, &cat(&chosen.1, &rejected.1)?)?;
    Ok((out.narrow(0, 0, n)?, out.narrow(0, n, n)?))
}

/// A pair request's per-pair weight mask (`[pairs, 1]` of ones): the loss denominators and
/// the metric weights count pairs.
fn pair_mask(pairs: usize) -> Vec<f32> {
    vec![1.0; pairs]
}

fn same_rows(call: &str, a: &Sequences, b: &Sequences) -> Result<usize> {
    if a.rows() != b.rows() {
        return Err(Error::invalid(format!(
            "{call}: {} chosen rows but {} rejected rows; every pair needs both",
            a.rows(),
            b.rows()
        )));
    }
    Ok(a.rows())
}

fn checked_vec(call: &str, name: &str, v: &[f32], rows: usize, device: &Device) -> Result<Tensor> {
    if v.len() != rows {
        return Err(Error::invalid(format!(
            "{call}: '{name}' has {} values for {rows} pairs",
            v.len()
        )));
    }
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(Error::invalid(format!(
            "{call}: '{name}' is not finite at pair {i}"
        )));
    }
    Ok(Tensor::from_slice(v, rows, device)?)
}

/// `trainer: sft`: the policy on its completion tokens.
pub struct SftTrainer {
    pub state: TrainState,
    pub shapes: Shapes,
}

/// An SFT update's tensors on the device.
pub struct SftBatch {
    ids: Tensor,
    mask: Tensor,
    loss_mask: Tensor,
    /// The loss mask's columns: R, or P + R - 1 for packed rows.
    width: usize,
}

impl SftTrainer {
    pub fn new(spec: &RoleSpec, device: &Device) -> Result<Self> {
        Ok(Self {
            state: load(spec, device, ModelKind::CausalLm, "an SFT trainer")?,
            shapes: spec.shapes,
        })
    }

    pub fn update(
        &mut self,
        comm: &mut dyn Communicator,
        req: &SftUpdateRequest,
    ) -> Result<UpdateResponse> {
        train::update(self, comm, req)
    }
}

impl LogProbs for SftTrainer {
    fn log_probs(&self, req: &LogProbsRequest) -> Result<LogProbsResponse> {
        log_probs_of(
            &self.state.model,
            req,
            self.shapes,
            self.state.settings.micro_batch_rows,
        )
    }
}

impl Train for SftTrainer {
    type Request = SftUpdateRequest;
    type Batch = SftBatch;
    const NAMES: StepNames = StepNames {
        grad_norm: metric::ACTOR_GRAD_NORM,
        lr: metric::ACTOR_LR,
        variance: None,
    };

    fn state(&self) -> &TrainState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut TrainState {
        &mut self.state
    }

    fn agg_mode(&self) -> LossAggMode {
        LossAggMode::TokenMean
    }

    /// Two geometries: prompt + completion rows (`response_len` R, the job's shapes), and
    /// packed rows (`data.packing`: several examples back to back, their segment ids in the
    /// attention mask, `response_len` P + R - 1 so that every token after the first can be
    /// trained).
    fn prepare(&self, req: &SftUpdateRequest) -> Result<Prepared<SftBatch>> {
        const CALL: &str = "UpdateSft";
        let device = self.state.model.device();
        let packed = req.seq.response_len + 1 == self.shapes.seq_len();
        let shapes = if packed {
            Shapes {
                prompt_len: 1,
                response_len: self.shapes.seq_len() - 1,
            }
        } else {
            self.shapes
        };
        let (ids, mask) = sequences(CALL, &req.seq, shapes, device)?;
        let b = req.seq.rows();
        let loss_mask = tokens(CALL, "loss_mask", &req.loss_mask, b, shapes, device)?;
        if req.loss_mask.data.iter().any(|&m| m != 0.0 && m != 1.0) {
            return Err(Error::invalid(format!(
                "{CALL}: loss_mask holds values other than 0 and 1"
            )));
        }
        if !packed
            && req
                .seq
                .attention_mask
                .data
                .iter()
                .any(|&m| m != 0 && m != 1)
        {
            return Err(Error::invalid(format!(
                "{CALL}: attention_mask holds segment ids, but the rows are not packed \
                 (response_length {} is not max_prompt_length + max_response_length - 1 = {})",
                req.seq.response_len,
                self.shapes.seq_len() - 1
            )));
        }
        Ok(Prepared {
            batch: SftBatch {
                ids,
                mask,
                loss_mask,
                width: shapes.response_len,
            },
            mask: req.loss_mask.data.clone(),
            width: shapes.response_len,
            step: req.step,
        })
    }

    fn micro_loss(&self, model: &Model, b: &SftBatch, idx: &[usize]) -> Result<MicroOut> {
        let m = convert::rows(&b.loss_mask, idx)?;
        let lp = completion_log_probs(
            model,
            &convert::rows(&b.ids, idx)?,
            &convert::rows(&b.mask, idx)?,
            b.width,
        )?;
        let (loss, _) = sft_loss(&lp, &m)?;
        let value = loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        Ok(MicroOut {
            loss,
            stats: vec![(metric::TRAIN_LOSS, value)],
        })
    }
}

/// `trainer: dpo`: the policy on preference pairs.
pub struct PreferenceTrainer {
    pub state: TrainState,
    pub shapes: Shapes,
    pub loss: PreferenceConfig,
}

/// A preference update's tensors on the device.
pub struct PairTensors {
    chosen: (Tensor, Tensor),
    rejected: (Tensor, Tensor),
    chosen_mask: Tensor,
    rejected_mask: Tensor,
    ref_chosen: Option<Tensor>,
    ref_rejected: Option<Tensor>,
    kto_kl: Option<f64>,
}

impl PreferenceTrainer {
    pub fn new(spec: &RoleSpec, device: &Device) -> Result<Self> {
        let EngineSpec::Preference { loss, .. } = &spec.engine else {
            return Err(wrong_engine(spec, "a preference trainer"));
        };
        Ok(Self {
            state: load(spec, device, ModelKind::CausalLm, "a preference trainer")?,
            shapes: spec.shapes,
            loss: *loss,
        })
    }

    pub fn update(
        &mut self,
        comm: &mut dyn Communicator,
        req: &PreferenceUpdateRequest,
    ) -> Result<UpdateResponse> {
        train::update(self, comm, req)
    }
}

impl LogProbs for PreferenceTrainer {
    fn log_probs(&self, req: &LogProbsRequest) -> Result<LogProbsResponse> {
        log_probs_of(
            &self.state.model,
            req,
            self.shapes,
            self.state.settings.micro_batch_rows,
        )
    }
}

/// The mean over the pairs of each statistic, under its metric name.
fn preference_stats(s: &PreferenceStats) -> Vec<(&'static str, f64)> {
    let n = s.pairs.max(1) as f64;
    let mut v = vec![
        (metric::TRAIN_LOSS, s.loss_sum / n),
        (metric::REWARDS_CHOSEN, s.chosen_rewards_sum / n),
        (metric::REWARDS_REJECTED, s.rejected_rewards_sum / n),
        (metric::REWARDS_ACCURACIES, s.correct / n),
        (
            metric::REWARDS_MARGINS,
            (s.chosen_rewards_sum - s.rejected_rewards_sum) / n,
        ),
        (metric::LOGPS_CHOSEN, s.logps_chosen_sum / n),
        (metric::LOGPS_REJECTED, s.logps_rejected_sum / n),
    ];
    if let Some(kl) = s.kl_sum {
        v.push((metric::KTO_KL, kl / n));
    }
    v
}

impl Train for PreferenceTrainer {
    type Request = PreferenceUpdateRequest;
    type Batch = PairTensors;
    const NAMES: StepNames = StepNames {
        grad_norm: metric::ACTOR_GRAD_NORM,
        lr: metric::ACTOR_LR,
        variance: None,
    };

    fn state(&self) -> &TrainState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut TrainState {
        &mut self.state
    }

    fn agg_mode(&self) -> LossAggMode {
        LossAggMode::TokenMean
    }

    fn prepare(&self, req: &PreferenceUpdateRequest) -> Result<Prepared<PairTensors>> {
        const CALL: &str = "UpdatePreference";
        let device = self.state.model.device();
        let shapes = self.shapes;
        let pairs = same_rows(CALL, &req.chosen, &req.rejected)?;
        let reference = |name: &str, v: &Option<Vec<f32>>| -> Result<Option<Tensor>> {
            match v {
                Some(v) => Ok(Some(checked_vec(CALL, name, v, pairs, device)?)),
                None if self.loss.loss_type.needs_reference() => Err(Error::invalid(format!(
                    "{CALL}: algorithm.loss_type {} needs reference log-probs, and the request has no '{name}'",
                    self.loss.loss_type
                ))),
                None => Ok(None),
            }
        };
        Ok(Prepared {
            batch: PairTensors {
                chosen: sequences(CALL, &req.chosen, shapes, device)?,
                rejected: sequences(CALL, &req.rejected, shapes, device)?,
                chosen_mask: tokens(CALL, "chosen_mask", &req.chosen_mask, pairs, shapes, device)?,
                rejected_mask: tokens(
                    CALL,
                    "rejected_mask",
                    &req.rejected_mask,
                    pairs,
                    shapes,
                    device,
                )?,
                ref_chosen: reference("ref_chosen", &req.ref_chosen)?,
                ref_rejected: reference("ref_rejected", &req.ref_rejected)?,
                kto_kl: req.kto_kl,
            },
            mask: pair_mask(pairs),
            width: 1,
            step: req.step,
        })
    }

    fn micro_loss(&self, model: &Model, b: &PairTensors, idx: &[usize]) -> Result<MicroOut> {
        let (chosen, rejected) = both_sides(&b.chosen, &b.rejected, idx, |ids, mask| {
            completion_log_probs(model, ids, mask, self.shapes.response_len)
        })?;
        let rows = |t: &Option<Tensor>| t.as_ref().map(|t| convert::rows(t, idx)).transpose();
        let (ref_c, ref_r) = (rows(&b.ref_chosen)?, rows(&b.ref_rejected)?);
        let out = preference_loss(
            &PairBatch {
                chosen_logp: &chosen,
                chosen_mask: &convert::rows(&b.chosen_mask, idx)?,
                rejected_logp: &rejected,
                rejected_mask: &convert::rows(&b.rejected_mask, idx)?,
                ref_chosen: ref_c.as_ref(),
                ref_rejected: ref_r.as_ref(),
                kto_kl: b.kto_kl,
            },
            &self.loss,
        )?;
        Ok(MicroOut {
            loss: out.loss,
            stats: preference_stats(&out.stats),
        })
    }
}

/// `trainer: reward`: a reward model (a score read at each sequence's last token) on
/// preference pairs.
pub struct RewardModelTrainer {
    pub state: TrainState,
    pub shapes: Shapes,
    pub center: Option<f64>,
}

/// A reward-model update's tensors on the device.
pub struct RewardPairs {
    chosen: (Tensor, Tensor),
    rejected: (Tensor, Tensor),
    margin: Option<Tensor>,
}

impl RewardModelTrainer {
    pub fn new(spec: &RoleSpec, device: &Device) -> Result<Self> {
        let EngineSpec::RewardModel {
            center_rewards_coefficient,
            ..
        } = &spec.engine
        else {
            return Err(wrong_engine(spec, "a reward-model trainer"));
        };
        Ok(Self {
            state: load(spec, device, ModelKind::Reward, "a reward-model trainer")?,
            shapes: spec.shapes,
            center: *center_rewards_coefficient,
        })
    }

    pub fn update(
        &mut self,
        comm: &mut dyn Communicator,
        req: &RewardModelUpdateRequest,
    ) -> Result<UpdateResponse> {
        train::update(self, comm, req)
    }

    fn scores_of(model: &Model, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let batch = Batch::from_mask(ids.clone(), mask.clone())?;
        Ok(model.scores(&batch)?.to_dtype(candle_core::DType::F32)?)
    }
}

impl Score for RewardModelTrainer {
    /// The current model's scores (for the eval split).
    fn score(&self, req: &ScoresRequest) -> Result<ScoresResponse> {
        let model = &self.state.model;
        let seqs = sequences("ComputeScores", &req.seq, self.shapes, model.device())?;
        let out = chunked(
            req.seq.rows(),
            self.state.settings.micro_batch_rows,
            |idx| {
                let (ids, mask) = (convert::rows(&seqs.0, idx)?, convert::rows(&seqs.1, idx)?);
                Ok(vec![Self::scores_of(model, &ids, &mask)?.detach()])
            },
        )?;
        Ok(ScoresResponse {
            scores: out[0].to_vec1::<f32>()?,
            verdicts: None,
        })
    }
}

impl Train for RewardModelTrainer {
    type Request = RewardModelUpdateRequest;
    type Batch = RewardPairs;
    const NAMES: StepNames = StepNames {
        grad_norm: metric::REWARD_MODEL_GRAD_NORM,
        lr: metric::REWARD_MODEL_LR,
        variance: None,
    };

    fn state(&self) -> &TrainState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut TrainState {
        &mut self.state
    }

    fn agg_mode(&self) -> LossAggMode {
        LossAggMode::TokenMean
    }

    fn prepare(&self, req: &RewardModelUpdateRequest) -> Result<Prepared<RewardPairs>> {
        const CALL: &str = "UpdateRewardModel";
        let device = self.state.model.device();
        let pairs = same_rows(CALL, &req.chosen, &req.rejected)?;
        Ok(Prepared {
            batch: RewardPairs {
                chosen: sequences(CALL, &req.chosen, self.shapes, device)?,
                rejected: sequences(CALL, &req.rejected, self.shapes, device)?,
                margin: req
                    .margin
                    .as_ref()
                    .map(|m| checked_vec(CALL, "margin", m, pairs, device))
                    .transpose()?,
            },
            mask: pair_mask(pairs),
            width: 1,
            step: req.step,
        })
    }

    fn micro_loss(&self, model: &Model, b: &RewardPairs, idx: &[usize]) -> Result<MicroOut> {
        let margin = b
            .margin
            .as_ref()
            .map(|m| convert::rows(m, idx))
            .transpose()?;
        let (chosen, rejected) = both_sides(&b.chosen, &b.rejected, idx, |ids, mask| {
            Self::scores_of(model, ids, mask)
        })?;
        let (loss, s) = reward_loss(&chosen, &rejected, margin.as_ref(), self.center)?;
        let n = s.pairs.max(1) as f64;
        Ok(MicroOut {
            loss,
            stats: vec![
                (metric::TRAIN_LOSS, s.loss_sum / n),
                (metric::RM_ACCURACY, s.correct / n),
                (metric::RM_MARGIN, s.margin_sum / n),
                (metric::RM_MEAN_REWARD, s.reward_sum / (2.0 * n)),
            ],
        })
    }
}
