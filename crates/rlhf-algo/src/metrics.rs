//! Training metrics under TRL's PPOTrainer names, plus verl's critic and
//! response-length families.
//!
//! TRL averages some statistics over every position of the padded batch
//! (`ratio.mean()`, `entropy.mean()`, `approxkl`); here every per-token average
//! is taken over the response mask, so padding never dilutes a metric.

use std::collections::BTreeMap;

use candle_core::Tensor;

use crate::error::{AlgoError, Result};
use crate::loss::{PolicyLossOutput, ValueLossOutput};
use crate::rewards::TokenRewards;
use crate::validate::{check_2d, check_mask_host, check_same_shape, find_non_finite, host_vec};

/// Every metric name [`compute_metrics`] can produce.
pub const METRIC_NAMES: &[&str] = &[
    crate::metric::OBJECTIVE_KL,
    crate::metric::OBJECTIVE_ENTROPY,
    crate::metric::OBJECTIVE_NON_SCORE_REWARD,
    crate::metric::OBJECTIVE_RLHF_REWARD,
    crate::metric::OBJECTIVE_SCORES,
    crate::metric::POLICY_APPROXKL_AVG,
    crate::metric::POLICY_CLIPFRAC_AVG,
    crate::metric::LOSS_POLICY_AVG,
    crate::metric::LOSS_VALUE_AVG,
    crate::metric::VAL_CLIPFRAC_AVG,
    crate::metric::POLICY_ENTROPY_AVG,
    crate::metric::VAL_RATIO,
    crate::metric::VAL_RATIO_VAR,
    crate::metric::VAL_NUM_EOS_TOKENS,
    crate::metric::CRITIC_ADVANTAGES_MEAN,
    crate::metric::CRITIC_RETURNS_MEAN,
    crate::metric::CRITIC_VALUES_MEAN,
    crate::metric::CRITIC_VF_EXPLAINED_VAR,
    crate::metric::RESPONSE_LENGTH_MEAN,
];

/// Rollout-level tensors, all `[batch, len]` except where noted.
#[derive(Debug, Clone, Copy)]
pub struct RolloutMetricsInputs<'a> {
    /// Output of [`crate::compute_token_rewards`].
    pub rewards: &'a TokenRewards,
    /// Rollout policy log-probs of the sampled tokens.
    pub logp: &'a Tensor,
    /// 1.0 on response tokens.
    pub response_mask: &'a Tensor,
    /// Whether each row ends with the stop token (`[batch]`). Responses are
    /// truncated after their stop token, so `val/num_eos_tokens` (TRL counts EOS
    /// tokens in the responses) is the number of rows with `true`.
    pub has_eos: &'a [bool],
    /// Advantages used for the update.
    pub advantages: &'a Tensor,
    /// Returns (critic targets).
    pub returns: &'a Tensor,
    /// Critic values at rollout time; without them the `critic/values/mean` and
    /// `critic/vf_explained_var` entries are left out.
    pub values: Option<&'a Tensor>,
}

/// Rollout metrics: `objective/*` (TRL: per-sequence sums averaged over the
/// batch), `val/num_eos_tokens`, `critic/*` and `response_length/mean` (verl).
pub fn rollout_metrics(inp: &RolloutMetricsInputs<'_>) -> Result<BTreeMap<String, f64>> {
    let (batch, _) = check_2d("response_mask", inp.response_mask)?;
    let dims = inp.response_mask.dims();
    let mask = host_vec(inp.response_mask)?;
    check_mask_host("response_mask", &mask, dims)?;
    let token = |name: &'static str, t: &Tensor| -> Result<Vec<f32>> {
        check_same_shape(name, t, "response_mask", inp.response_mask)?;
        let v = host_vec(t)?;
        find_non_finite(name, &v, dims)?;
        Ok(v)
    };
    let kl = token("kl", &inp.rewards.kl)?;
    let nsr = token("non_score_reward", &inp.rewards.non_score_reward)?;
    let logp = token("logp", inp.logp)?;
    let adv = token("advantages", inp.advantages)?;
    let ret = token("returns", inp.returns)?;
    let scores = inp.rewards.scores.to_vec1::<f32>()?;
    if scores.len() != batch || inp.has_eos.len() != batch {
        return Err(AlgoError::InvalidInput {
            input: "has_eos",
            reason: format!(
                "scores has {} and has_eos {} entries for a batch of {batch}",
                scores.len(),
                inp.has_eos.len()
            ),
        });
    }

    let b = batch as f64;
    let seq_sum_mean = |v: &[f32]| -> f64 {
        v.iter()
            .zip(&mask)
            .map(|(&x, &m)| (x * m) as f64)
            .sum::<f64>()
            / b
    };
    let mean_kl = seq_sum_mean(&kl);
    let mean_entropy = -seq_sum_mean(&logp);
    let mean_nsr = seq_sum_mean(&nsr);
    let mean_score = scores.iter().map(|&s| s as f64).sum::<f64>() / b;
    let n_valid: f64 = mask.iter().map(|&m| m as f64).sum();

    let mut out = BTreeMap::new();
    out.insert(crate::metric::OBJECTIVE_KL.into(), mean_kl);
    out.insert(crate::metric::OBJECTIVE_ENTROPY.into(), mean_entropy);
    out.insert(crate::metric::OBJECTIVE_NON_SCORE_REWARD.into(), mean_nsr);
    out.insert(
        crate::metric::OBJECTIVE_RLHF_REWARD.into(),
        mean_nsr + mean_score,
    );
    out.insert(crate::metric::OBJECTIVE_SCORES.into(), mean_score);
    out.insert(
        crate::metric::VAL_NUM_EOS_TOKENS.into(),
        inp.has_eos.iter().filter(|&&e| e).count() as f64,
    );
    let masked_mean = |v: &[f32]| -> f64 {
        v.iter()
            .zip(&mask)
            .map(|(&x, &m)| (x * m) as f64)
            .sum::<f64>()
            / n_valid
    };
    out.insert(
        crate::metric::CRITIC_ADVANTAGES_MEAN.into(),
        masked_mean(&adv),
    );
    out.insert(crate::metric::CRITIC_RETURNS_MEAN.into(), masked_mean(&ret));
    out.insert(crate::metric::RESPONSE_LENGTH_MEAN.into(), n_valid / b);
    if let Some(values) = inp.values {
        let val = token("values", values)?;
        out.insert(crate::metric::CRITIC_VALUES_MEAN.into(), masked_mean(&val));
        // verl: 1 - var(returns - values) / (var(returns) + 1e-5), unbiased variances.
        let diff: Vec<f32> = ret.iter().zip(&val).map(|(r, v)| r - v).collect();
        let var = |v: &[f32]| -> f64 {
            let mu = masked_mean(v);
            let ss: f64 = v
                .iter()
                .zip(&mask)
                .filter(|(_, &m)| m != 0.0)
                .map(|(&x, _)| (x as f64 - mu).powi(2))
                .sum();
            if n_valid > 1.0 {
                ss / (n_valid - 1.0)
            } else {
                0.0
            }
        };
        out.insert(
            crate::metric::CRITIC_VF_EXPLAINED_VAR.into(),
            1.0 - var(&diff) / (var(&ret) + 1e-5),
        );
    }
    Ok(out)
}

/// Collects per-micro-batch statistics over the PPO epochs of one step and
/// averages them as TRL does.
#[derive(Debug, Clone, Default)]
pub struct TrainStats {
    approxkl: Vec<f64>,
    clipfrac: Vec<f64>,
    pg_loss: Vec<f64>,
    ratio: Vec<f64>,
    vf_loss: Vec<f64>,
    vf_clipfrac: Vec<f64>,
    entropy: Vec<f64>,
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

impl TrainStats {
    /// An empty collector.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one policy update.
    pub fn push_policy(&mut self, out: &PolicyLossOutput) -> Result<()> {
        self.approxkl.push(out.approxkl);
        self.clipfrac.push(out.clipfrac);
        self.pg_loss.push(crate::masked::scalar(&out.loss)?);
        self.ratio.push(out.ratio_mean);
        Ok(())
    }

    /// Records one value update.
    pub fn push_value(&mut self, out: &ValueLossOutput) -> Result<()> {
        self.vf_loss.push(crate::masked::scalar(&out.loss)?);
        self.vf_clipfrac.push(out.clipfrac);
        Ok(())
    }

    /// Records the masked mean token entropy of one update.
    pub fn push_entropy(&mut self, entropy: f64) {
        self.entropy.push(entropy);
    }

    /// The averaged metrics; entries with no recorded update are left out.
    /// `val/ratio_var` is the unbiased variance of the per-update ratio means
    /// (TRL), 0 with fewer than two updates.
    pub fn finish(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        let mut put = |k: &str, v: Option<f64>| {
            if let Some(v) = v {
                out.insert(k.to_string(), v);
            }
        };
        put(crate::metric::POLICY_APPROXKL_AVG, mean(&self.approxkl));
        put(crate::metric::POLICY_CLIPFRAC_AVG, mean(&self.clipfrac));
        put(crate::metric::LOSS_POLICY_AVG, mean(&self.pg_loss));
        put(crate::metric::LOSS_VALUE_AVG, mean(&self.vf_loss));
        put(crate::metric::VAL_CLIPFRAC_AVG, mean(&self.vf_clipfrac));
        put(crate::metric::POLICY_ENTROPY_AVG, mean(&self.entropy));
        put(crate::metric::VAL_RATIO, mean(&self.ratio));
        let ratio_var = mean(&self.ratio).map(|mu| {
            let n = self.ratio.len();
            if n < 2 {
                0.0
            } else {
                self.ratio.iter().map(|r| (r - mu).powi(2)).sum::<f64>() / (n - 1) as f64
            }
        });
        put(crate::metric::VAL_RATIO_VAR, ratio_var);
        out
    }
}

/// Rollout metrics merged with the averaged training statistics.
pub fn compute_metrics(
    rollout: &RolloutMetricsInputs<'_>,
    train: &TrainStats,
) -> Result<BTreeMap<String, f64>> {
    let mut out = rollout_metrics(rollout)?;
    out.extend(train.finish());
    Ok(out)
}
