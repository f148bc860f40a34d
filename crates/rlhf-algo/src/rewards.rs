//! Per-token rewards: the KL penalty on every response token plus the sequence
//! score on the last valid one.

use candle_core::Tensor;

use crate::config::AlgorithmConfig;
use crate::error::{AlgoError, Result};
use crate::kl::kl_elem;
use crate::masked::host_whiten;
use crate::names::{KlPenalty, ScorePlacement};
use crate::validate::{check_batch_vec, check_finite, HostMask};

/// Result of [`compute_token_rewards`]. All `[batch, len]` tensors are zero
/// outside the response mask.
#[derive(Debug, Clone)]
pub struct TokenRewards {
    /// Per-token rewards fed to the advantage estimator.
    pub rewards: Tensor,
    /// Per-token KL estimate (masked), before the coefficient.
    pub kl: Tensor,
    /// `-kl_coef * kl` (zero when `use_kl_in_reward` is off).
    pub non_score_reward: Tensor,
    /// `[batch]` scores after the missing-EOS penalty and clipping.
    pub scores: Tensor,
    /// `[batch, len]` where values, GAE and the value loss run: the response mask, or with
    /// [`ScorePlacement::Trl`] the response mask plus the slot the score sits on.
    pub value_mask: Tensor,
}

/// Index of the last valid token of each row, or an error naming the empty row.
pub(crate) fn last_valid(mask: &[f32], batch: usize, len: usize) -> Result<Vec<usize>> {
    (0..batch)
        .map(|i| {
            mask[i * len..(i + 1) * len]
                .iter()
                .rposition(|&m| m != 0.0)
                .ok_or_else(|| AlgoError::InvalidInput {
                    input: "response_mask",
                    reason: format!(
                        "row {i} has no valid token, so its score has nowhere to go; drop empty responses first"
                    ),
                })
        })
        .collect()
}

/// Builds per-token rewards as TRL's PPOTrainer does, with the score placed on
/// the last valid response token (verl), or with `score_placement: trl` one slot past
/// it as TRL does (the last slot when the response fills the row):
///
/// 1. `score -= missing_eos_penalty` for rows whose `has_eos` is false;
/// 2. `score = clamp(score, -reward_clip, reward_clip)` when set;
/// 3. `kl = kl_penalty(logp, ref_logp) * mask`, `non_score_reward = -kl_coef * kl`
///    (or zero when `use_kl_in_reward` is off);
/// 4. `rewards = non_score_reward`, plus the score at each row's last valid token;
/// 5. when `whiten_rewards`, masked whitening that keeps the mean (TRL).
///
/// `scores` is `[batch]`; `logp` (rollout policy), `ref_logp` and `response_mask`
/// are `[batch, len]` with responses right-padded; `has_eos[i]` tells whether row
/// `i` ends with the stop token; `kl_coef` is the controller's current value.
pub fn compute_token_rewards(
    scores: &Tensor,
    logp: &Tensor,
    ref_logp: &Tensor,
    response_mask: &Tensor,
    has_eos: &[bool],
    kl_coef: f64,
    cfg: &AlgorithmConfig,
) -> Result<TokenRewards> {
    cfg.validate()?;
    let m = HostMask::new("response_mask", response_mask)?;
    let (batch, len) = (response_mask.dims()[0], response_mask.dims()[1]);
    check_batch_vec("scores", scores, batch)?;
    check_finite("scores", scores)?;
    let lp = m.token("logp", logp)?;
    let rf = m.token("ref_logp", ref_logp)?;
    let mask = &m.data;
    if has_eos.len() != batch {
        return Err(AlgoError::InvalidInput {
            input: "has_eos",
            reason: format!("has {} entries for a batch of {batch}", has_eos.len()),
        });
    }
    if !kl_coef.is_finite() {
        return Err(AlgoError::InvalidInput {
            input: "kl_coef",
            reason: format!("must be finite, got {kl_coef}"),
        });
    }
    if cfg.kl_penalty == KlPenalty::Full {
        return Err(AlgoError::InvalidConfig {
            key: "algorithm.kl_penalty",
            value: "full".into(),
            reason: "per-token rewards see only the sampled tokens' log-probs; \
                     choose kl, abs, mse or low_var_kl"
                .into(),
        });
    }

    let mut sc = scores.to_vec1::<f32>()?;
    for (s, &eos) in sc.iter_mut().zip(has_eos) {
        if !eos {
            if let Some(p) = cfg.missing_eos_penalty {
                *s -= p as f32;
            }
        }
        if let Some(c) = cfg.reward_clip {
            *s = s.clamp(-c as f32, c as f32);
        }
    }

    let coef = if cfg.use_kl_in_reward {
        kl_coef as f32
    } else {
        0.0
    };
    let mut kl = vec![0f32; lp.len()];
    let mut nsr = vec![0f32; lp.len()];
    for i in 0..lp.len() {
        if mask[i] != 0.0 {
            // Full was rejected above, so the estimator is per-token.
            kl[i] = kl_elem(lp[i], rf[i], cfg.kl_penalty).unwrap_or(0.0);
            nsr[i] = -coef * kl[i];
        }
    }
    let mut rewards = nsr.clone();
    let mut value_mask = mask.to_vec();
    for (i, t) in last_valid(mask, batch, len)?.into_iter().enumerate() {
        // TRL: `actual_end = where(seq_len + 1 < len, seq_len + 1, seq_len)`, and values are
        // kept up to `seq_len + 1` (`padding_mask_p1`).
        let t = match cfg.score_placement {
            ScorePlacement::LastToken => t,
            ScorePlacement::Trl if t + 1 < len => {
                value_mask[i * len + t + 1] = 1.0;
                t + 1
            }
            ScorePlacement::Trl => t,
        };
        rewards[i * len + t] += sc[i];
    }
    if cfg.whiten_rewards {
        host_whiten(&mut rewards, mask, false)?;
    }

    let dev = response_mask.device();
    Ok(TokenRewards {
        rewards: Tensor::from_vec(rewards, (batch, len), dev)?,
        kl: Tensor::from_vec(kl, (batch, len), dev)?,
        non_score_reward: Tensor::from_vec(nsr, (batch, len), dev)?,
        scores: Tensor::from_vec(sc, batch, dev)?,
        value_mask: Tensor::from_vec(value_mask, (batch, len), dev)?,
    })
}
