//! The losses of the two supervised stages before RL: SFT (the mean negative log-likelihood of
//! the completion tokens, TRL's `SFTTrainer` with completion-only loss) and the reward model
//! (Bradley–Terry over chosen/rejected scores with an optional margin and reward centering,
//! TRL's `RewardTrainer`). Differentiable candle ops; metrics under TRL's names.

use std::collections::BTreeMap;

use candle_core::Tensor;

use crate::error::{AlgoError, Result};
use crate::loss::agg_loss;
use crate::masked::scalar;
use crate::metric;
use crate::names::LossAggMode;
use crate::preference::log_sigmoid;
use crate::validate::{check_batch_vec, check_finite, host_vec};

/// SFT's loss over one micro-batch: `-mean(logp)` over the tokens `mask` selects (the
/// completion or assistant tokens), and the token count (for [`crate::micro_batch_scale`]).
pub fn sft_loss(logp: &Tensor, mask: &Tensor) -> Result<(Tensor, usize)> {
    check_finite("logp", logp)?;
    let loss = agg_loss(&logp.neg()?, mask, LossAggMode::TokenMean)?;
    let tokens = host_vec(mask)?.iter().filter(|&&m| m > 0.0).count();
    Ok((loss, tokens))
}

/// Reward-model statistics: sums over pairs, merged over micro-batches and ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardStats {
    pub pairs: usize,
    pub loss_sum: f64,
    pub correct: f64,
    pub margin_sum: f64,
    pub reward_sum: f64,
    pub min_reward: f64,
    pub max_reward: f64,
}

impl Default for RewardStats {
    fn default() -> Self {
        Self {
            pairs: 0,
            loss_sum: 0.0,
            correct: 0.0,
            margin_sum: 0.0,
            reward_sum: 0.0,
            min_reward: f64::INFINITY,
            max_reward: f64::NEG_INFINITY,
        }
    }
}

impl RewardStats {
    pub fn merge(&mut self, o: &RewardStats) {
        self.pairs += o.pairs;
        self.loss_sum += o.loss_sum;
        self.correct += o.correct;
        self.margin_sum += o.margin_sum;
        self.reward_sum += o.reward_sum;
        self.min_reward = self.min_reward.min(o.min_reward);
        self.max_reward = self.max_reward.max(o.max_reward);
    }

    /// Means over the pairs under TRL's `RewardTrainer` names (plus `train/loss`); every
    /// name gets `prefix` (`eval/` for the eval split).
    pub fn metrics(&self, prefix: &str) -> BTreeMap<String, f64> {
        let n = self.pairs.max(1) as f64;
        [
            (metric::TRAIN_LOSS, self.loss_sum / n),
            (metric::RM_ACCURACY, self.correct / n),
            (metric::RM_MARGIN, self.margin_sum / n),
            (metric::RM_MEAN_REWARD, self.reward_sum / (2.0 * n)),
            (metric::RM_MIN_REWARD, self.min_reward),
            (metric::RM_MAX_REWARD, self.max_reward),
        ]
        .into_iter()
        .map(|(k, v)| {
            let k = if prefix.is_empty() {
                k.to_string()
            } else {
                format!("{prefix}{}", k.rsplit('/').next().unwrap_or(k))
            };
            (k, v)
        })
        .collect()
    }
}

/// Bradley–Terry loss of one micro-batch: `-mean(log sigmoid(chosen - rejected - margin))`
/// plus `center_coef * mean((chosen + rejected)^2)` (TRL's `center_rewards_coefficient`), and
/// its statistics. `chosen`, `rejected` and `margin` are `f32 [pairs]`.
pub fn reward_loss(
    chosen: &Tensor,
    rejected: &Tensor,
    margin: Option<&Tensor>,
    center_coef: Option<f64>,
) -> Result<(Tensor, RewardStats)> {
    let pairs = chosen.dims1().map_err(|_| AlgoError::BadRank {
        tensor: "chosen_scores",
        expected: "a 1-D tensor [pairs]",
        got: chosen.dims().to_vec(),
    })?;
    check_batch_vec("chosen_scores", chosen, pairs)?;
    check_batch_vec("rejected_scores", rejected, pairs)?;
    check_finite("chosen_scores", chosen)?;
    check_finite("rejected_scores", rejected)?;
    let mut diff = chosen.sub(rejected)?;
    if let Some(m) = margin {
        check_batch_vec("margin", m, pairs)?;
        check_finite("margin", m)?;
        diff = diff.sub(&m.detach())?;
    }
    let mut loss = log_sigmoid(&diff)?.mean_all()?.neg()?;
    if let Some(coef) = center_coef {
        if !(coef.is_finite() && coef >= 0.0) {
            return Err(AlgoError::InvalidConfig {
                key: "reward.center_rewards_coefficient",
                value: coef.to_string(),
                reason: "must be a finite number >= 0".into(),
            });
        }
        let center = chosen.add(rejected)?.sqr()?.mean_all()?.affine(coef, 0.0)?;
        loss = loss.add(&center)?;
    }
    let c = host_vec(chosen)?;
    let r = host_vec(rejected)?;
    let all = c.iter().chain(&r).map(|&v| f64::from(v));
    let stats = RewardStats {
        pairs,
        loss_sum: scalar(&loss)? * pairs as f64,
        correct: c.iter().zip(&r).filter(|(a, b)| a > b).count() as f64,
        margin_sum: c.iter().zip(&r).map(|(a, b)| f64::from(a - b)).sum(),
        reward_sum: all.clone().sum(),
        min_reward: all.clone().fold(f64::INFINITY, f64::min),
        max_reward: all.fold(f64::NEG_INFINITY, f64::max),
    };
    Ok((loss, stats))
}
