//! The DPO family's losses (DPO with optional cDPO label smoothing, IPO, SimPO, KTO on paired
//! rows) and their metrics under TRL's names, from per-token log-probs of the chosen and the
//! rejected completions. Built from differentiable candle ops only: the gradient reaches the
//! policy through `chosen_logp` and `rejected_logp`; reference log-probs and KTO's KL estimate
//! are constants. `scripts/preference_reference.py` runs TRL's trainers' loss code on fixed
//! inputs; `tests/preference.rs` compares.

use std::collections::BTreeMap;

use candle_core::Tensor;

use crate::error::{AlgoError, Result};
use crate::masked::scalar;
use crate::metric;
use crate::names::PreferenceLoss;
use crate::validate::{
    check_batch_vec, check_finite, check_mask, check_non_negative, check_positive,
    check_token_tensor, host_vec,
};

/// The loss and its constants (`algorithm.*` of a DPO-family job). Defaults are TRL's.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PreferenceConfig {
    pub loss_type: PreferenceLoss,
    /// Inverse temperature of the implicit reward (TRL's `beta`; IPO's `tau`).
    pub beta: f64,
    /// cDPO / conservative SimPO: the assumed share of flipped labels, in `[0, 0.5)`.
    /// `sigmoid` and `simpo` only.
    pub label_smoothing: f64,
    /// SimPO's target reward margin (`gamma`; TRL's `simpo_gamma`).
    pub simpo_gamma: f64,
    /// KTO's weight of the desirable (chosen) and undesirable (rejected) completions.
    pub desirable_weight: f64,
    pub undesirable_weight: f64,
}

impl Default for PreferenceConfig {
    fn default() -> Self {
        Self {
            loss_type: PreferenceLoss::Sigmoid,
            beta: 0.1,
            label_smoothing: 0.0,
            simpo_gamma: 0.5,
            desirable_weight: 1.0,
            undesirable_weight: 1.0,
        }
    }
}

impl PreferenceConfig {
    /// Refuses values the losses are undefined for, naming the config key.
    pub fn validate(&self) -> Result<()> {
        check_positive("algorithm.beta", self.beta)?;
        check_non_negative("algorithm.simpo_gamma", self.simpo_gamma)?;
        check_non_negative("algorithm.desirable_weight", self.desirable_weight)?;
        check_non_negative("algorithm.undesirable_weight", self.undesirable_weight)?;
        let ls = self.label_smoothing;
        if !(ls.is_finite() && (0.0..0.5).contains(&ls)) {
            return Err(AlgoError::InvalidConfig {
                key: "algorithm.label_smoothing",
                value: ls.to_string(),
                reason: "must lie in [0, 0.5)".into(),
            });
        }
        if ls > 0.0 && matches!(self.loss_type, PreferenceLoss::Ipo | PreferenceLoss::Kto) {
            return Err(AlgoError::InvalidConfig {
                key: "algorithm.label_smoothing",
                value: ls.to_string(),
                reason: format!(
                    "loss_type {} has no label smoothing; set it to 0 or use sigmoid or simpo",
                    self.loss_type
                ),
            });
        }
        Ok(())
    }
}

/// One micro-batch of pairs. Token tensors are `f32 [pairs, len]` (chosen and rejected may
/// differ in length), masks select each completion's tokens.
pub struct PairBatch<'a> {
    /// The policy's per-token log-probs of the chosen completions (carries the gradient).
    pub chosen_logp: &'a Tensor,
    pub chosen_mask: &'a Tensor,
    pub rejected_logp: &'a Tensor,
    pub rejected_mask: &'a Tensor,
    /// The reference model's summed log-probs `[pairs]`; every loss but SimPO needs them.
    pub ref_chosen: Option<&'a Tensor>,
    pub ref_rejected: Option<&'a Tensor>,
    /// KTO's KL estimate `mean(logp - ref_logp)` over mismatched prompt/completion pairs,
    /// clamped at 0 (TRL's `kl`); KTO only.
    pub kto_kl: Option<f64>,
}

/// Sums over pairs, merged over micro-batches and ranks, averaged by [`Self::metrics`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PreferenceStats {
    pub pairs: usize,
    pub loss_sum: f64,
    pub chosen_rewards_sum: f64,
    pub rejected_rewards_sum: f64,
    /// Pairs whose chosen reward is above the rejected one.
    pub correct: f64,
    pub logps_chosen_sum: f64,
    pub logps_rejected_sum: f64,
    /// KTO's KL estimate, weighted by pairs (so merged batches average it).
    pub kl_sum: Option<f64>,
}

impl PreferenceStats {
    pub fn merge(&mut self, o: &PreferenceStats) {
        self.pairs += o.pairs;
        self.loss_sum += o.loss_sum;
        self.chosen_rewards_sum += o.chosen_rewards_sum;
        self.rejected_rewards_sum += o.rejected_rewards_sum;
        self.correct += o.correct;
        self.logps_chosen_sum += o.logps_chosen_sum;
        self.logps_rejected_sum += o.logps_rejected_sum;
        self.kl_sum = match (self.kl_sum, o.kl_sum) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
        };
    }

    /// Means over the pairs under TRL's metric names (plus `train/loss`).
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        let n = self.pairs.max(1) as f64;
        let chosen = self.chosen_rewards_sum / n;
        let rejected = self.rejected_rewards_sum / n;
        let mut m = BTreeMap::from([
            (metric::TRAIN_LOSS.to_string(), self.loss_sum / n),
            (metric::REWARDS_CHOSEN.to_string(), chosen),
            (metric::REWARDS_REJECTED.to_string(), rejected),
            (metric::REWARDS_ACCURACIES.to_string(), self.correct / n),
            (metric::REWARDS_MARGINS.to_string(), chosen - rejected),
            (metric::LOGPS_CHOSEN.to_string(), self.logps_chosen_sum / n),
            (
                metric::LOGPS_REJECTED.to_string(),
                self.logps_rejected_sum / n,
            ),
        ]);
        if let Some(kl) = self.kl_sum {
            m.insert(metric::KTO_KL.to_string(), kl / n);
        }
        m
    }
}

/// The loss of one micro-batch (the mean over its pairs, a scalar with a gradient) and its
/// statistics.
pub struct PreferenceLossOutput {
    pub loss: Tensor,
    pub stats: PreferenceStats,
}

/// `log(sigmoid(x))` from ops with a backward pass, stable for large `|x|`:
/// `min(x, 0) - log(1 + exp(-|x|))`.
pub(crate) fn log_sigmoid(x: &Tensor) -> Result<Tensor> {
    let zero = x.zeros_like()?;
    let tail = x.abs()?.neg()?.exp()?.affine(1.0, 1.0)?.log()?;
    Ok(x.minimum(&zero)?.sub(&tail)?)
}

/// `-(1 - eps) log sigmoid(b x) - eps log sigmoid(-b x)` (cDPO's smoothed logistic loss).
fn smoothed_logistic(x: &Tensor, beta: f64, eps: f64) -> Result<Tensor> {
    let bx = x.affine(beta, 0.0)?;
    let mut loss = log_sigmoid(&bx)?.affine(-(1.0 - eps), 0.0)?;
    if eps > 0.0 {
        loss = loss.add(&log_sigmoid(&bx.neg()?)?.affine(-eps, 0.0)?)?;
    }
    Ok(loss)
}

struct Side {
    /// Summed log-probs `[pairs]` (with the gradient).
    sum: Tensor,
    /// Token counts `[pairs]`, at least 1.
    tokens: Tensor,
}

fn side(name: &'static str, mask_name: &'static str, logp: &Tensor, mask: &Tensor) -> Result<Side> {
    check_mask(mask_name, mask)?;
    check_token_tensor(name, logp, mask)?;
    check_finite(name, logp)?;
    let tokens = mask.sum(1)?;
    if let Some(i) = host_vec(&tokens)?.iter().position(|&n| n == 0.0) {
        return Err(AlgoError::InvalidInput {
            input: mask_name,
            reason: format!("pair {i} has an empty completion; every completion needs a token"),
        });
    }
    Ok(Side {
        sum: logp.mul(mask)?.sum(1)?,
        tokens,
    })
}

fn reference(
    name: &'static str,
    t: Option<&Tensor>,
    pairs: usize,
    loss: PreferenceLoss,
) -> Result<Tensor> {
    let t = t.ok_or_else(|| AlgoError::InvalidInput {
        input: name,
        reason: format!("loss_type {loss} needs reference log-probs (a reference role)"),
    })?;
    check_batch_vec(name, t, pairs)?;
    check_finite(name, t)?;
    Ok(t.detach())
}

fn sum_host(t: &Tensor) -> Result<f64> {
    Ok(host_vec(t)?.iter().map(|&v| f64::from(v)).sum())
}

/// The DPO-family loss of one micro-batch of pairs, as TRL computes it: `DPOTrainer`
/// (`sigmoid`, `ipo`), `CPOTrainer` (`simpo`, and cDPO's smoothing), `KTOTrainer` (`kto`, each
/// pair's chosen row desirable and its rejected row undesirable).
pub fn preference_loss(b: &PairBatch<'_>, cfg: &PreferenceConfig) -> Result<PreferenceLossOutput> {
    cfg.validate()?;
    let c = side("chosen_logp", "chosen_mask", b.chosen_logp, b.chosen_mask)?;
    let r = side(
        "rejected_logp",
        "rejected_mask",
        b.rejected_logp,
        b.rejected_mask,
    )?;
    let pairs = c.sum.dims1()?;
    if r.sum.dims1()? != pairs {
        return Err(AlgoError::ShapeMismatch {
            tensor: "rejected_logp",
            got: b.rejected_logp.dims().to_vec(),
            other: "chosen_logp's pair count",
            expected: vec![pairs],
        });
    }
    let beta = cfg.beta;
    let lt = cfg.loss_type;
    // Implicit rewards (TRL logs beta times these) and the logged log-probs.
    let (c_score, r_score, logged_c, logged_r, per_pair, kl) = match lt {
        PreferenceLoss::Simpo => {
            let (ca, ra) = (c.sum.div(&c.tokens)?, r.sum.div(&r.tokens)?);
            let delta = ca.sub(&ra)?.affine(1.0, -cfg.simpo_gamma / beta)?;
            let loss = smoothed_logistic(&delta, beta, cfg.label_smoothing)?;
            (ca.clone(), ra.clone(), ca, ra, loss, None)
        }
        _ => {
            let rc = reference("ref_chosen", b.ref_chosen, pairs, lt)?;
            let rr = reference("ref_rejected", b.ref_rejected, pairs, lt)?;
            let (clr, rlr) = (c.sum.sub(&rc)?, r.sum.sub(&rr)?);
            let (loss, kl) = match lt {
                PreferenceLoss::Sigmoid => (
                    smoothed_logistic(&clr.sub(&rlr)?, beta, cfg.label_smoothing)?,
                    None,
                ),
                PreferenceLoss::Ipo => {
                    let delta = clr.div(&c.tokens)?.sub(&rlr.div(&r.tokens)?)?;
                    (delta.affine(1.0, -1.0 / (2.0 * beta))?.sqr()?, None)
                }
                PreferenceLoss::Kto => {
                    let kl = b.kto_kl.ok_or_else(|| AlgoError::InvalidInput {
                        input: "kto_kl",
                        reason: "loss_type kto needs the KL estimate of mismatched pairs".into(),
                    })?;
                    if !kl.is_finite() {
                        return Err(AlgoError::InvalidInput {
                            input: "kto_kl",
                            reason: format!("{kl} is not finite"),
                        });
                    }
                    let kl = kl.max(0.0);
                    // 1 - sigmoid(x) = sigmoid(-x) = exp(log sigmoid(-x)).
                    let desirable = log_sigmoid(&clr.affine(-beta, beta * kl)?)?.exp()?;
                    let undesirable = log_sigmoid(&rlr.affine(beta, -beta * kl)?)?.exp()?;
                    // TRL averages the 2 x pairs unpaired losses; per pair that is the mean of two.
                    let loss = desirable
                        .affine(cfg.desirable_weight, 0.0)?
                        .add(&undesirable.affine(cfg.undesirable_weight, 0.0)?)?
                        .affine(0.5, 0.0)?;
                    (loss, Some(kl))
                }
                PreferenceLoss::Simpo => unreachable!("handled above"),
            };
            (clr, rlr, c.sum.clone(), r.sum.clone(), loss, kl)
        }
    };
    let loss = per_pair.mean_all()?;
    let (cr, rr) = (
        c_score.detach().affine(beta, 0.0)?,
        r_score.detach().affine(beta, 0.0)?,
    );
    let correct = cr.gt(&rr)?.to_dtype(candle_core::DType::F32)?;
    let stats = PreferenceStats {
        pairs,
        loss_sum: scalar(&loss)? * pairs as f64,
        chosen_rewards_sum: sum_host(&cr)?,
        rejected_rewards_sum: sum_host(&rr)?,
        correct: sum_host(&correct)?,
        logps_chosen_sum: sum_host(&logged_c.detach())?,
        logps_rejected_sum: sum_host(&logged_r.detach())?,
        kl_sum: kl.map(|k| k * pairs as f64),
    };
    Ok(PreferenceLossOutput { loss, stats })
}

/// KTO's KL estimate from the mismatched pairs' summed log-probs under the policy and the
/// reference: `max(0, mean(logp - ref_logp))` (TRL's `kl`, detached).
pub fn kto_kl_estimate(kl_logps: &[f64], ref_kl_logps: &[f64]) -> Result<f64> {
    if kl_logps.is_empty() || kl_logps.len() != ref_kl_logps.len() {
        return Err(AlgoError::InvalidInput {
            input: "kl_logps",
            reason: format!(
                "{} policy and {} reference log-probs; need the same nonzero count",
                kl_logps.len(),
                ref_kl_logps.len()
            ),
        });
    }
    let mean = kl_logps
        .iter()
        .zip(ref_kl_logps)
        .map(|(a, b)| a - b)
        .sum::<f64>()
        / kl_logps.len() as f64;
    Ok(mean.max(0.0))
}
