//! PPO losses, built only from candle ops that have a backward pass so the
//! caller can backpropagate into the policy (through `logp`) and the critic
//! (through `vpreds`). Diagnostics are returned as plain `f64`s.

use candle_core::Tensor;

use crate::config::{PolicyLossConfig, ValueLossConfig};
use crate::error::Result;
use crate::kl::kl_penalty_unchecked;
use crate::masked::{masked_mean_n, scalar};
use crate::names::{KlPenalty, LossAggMode};
use crate::validate::{check_mask, check_token_tensor, clamp};

/// Reduces a `[batch, len]` loss matrix to a scalar over the mask
/// (verl `agg_loss`). The `seq-mean-*` modes average over the sequences that
/// have at least one valid token.
pub fn agg_loss(loss_mat: &Tensor, mask: &Tensor, mode: LossAggMode) -> Result<Tensor> {
    let n = check_mask("response_mask", mask)?;
    check_token_tensor("loss_mat", loss_mat, mask)?;
    agg_loss_n(loss_mat, mask, n, mode)
}

pub(crate) fn agg_loss_n(
    loss_mat: &Tensor,
    mask: &Tensor,
    n: usize,
    mode: LossAggMode,
) -> Result<Tensor> {
    if mode == LossAggMode::TokenMean {
        return masked_mean_n(loss_mat, mask, n);
    }
    let tokens = mask.sum(1)?;
    let mut seq_losses = loss_mat.mul(mask)?.sum(1)?;
    if mode == LossAggMode::SeqMeanTokenMean {
        seq_losses = seq_losses.div(&tokens.affine(1.0, 1e-8)?)?;
    }
    let seq_mask = tokens.gt(0f32)?.to_dtype(mask.dtype())?;
    Ok(seq_losses
        .mul(&seq_mask)?
        .sum_all()?
        .div(&seq_mask.sum_all()?)?)
}

/// Output of [`policy_loss`].
#[derive(Debug, Clone)]
pub struct PolicyLossOutput {
    /// Scalar loss; differentiable w.r.t. `logp`.
    pub loss: Tensor,
    /// Fraction of valid tokens where the clipped surrogate was active.
    pub clipfrac: f64,
    /// Fraction of valid tokens where the dual clip bounded a negative advantage.
    pub clipfrac_lower: f64,
    /// TRL's `approxkl`: masked mean of `0.5 * (logp - old_logp)^2`.
    pub approxkl: f64,
    /// verl's `ppo_kl`: masked mean of `old_logp - logp`.
    pub ppo_kl: f64,
    /// Masked mean of the importance ratio.
    pub ratio_mean: f64,
}

/// Clipped PPO surrogate (verl `compute_policy_loss`, which adapts TRL's):
///
/// `ratio = exp(clamp(logp - old_logp, -20, 20))`,
/// `l = max(-A * ratio, -A * clamp(ratio, 1 - low, 1 + high))`, and with dual clip
/// `l = min(l, -A * clip_ratio_c)` where `A < 0`; then aggregated over the mask.
/// With `clip_ratio_c: None` this is TRL's loss exactly.
pub fn policy_loss(
    old_logp: &Tensor,
    logp: &Tensor,
    advantages: &Tensor,
    response_mask: &Tensor,
    cfg: &PolicyLossConfig,
) -> Result<PolicyLossOutput> {
    cfg.validate()?;
    let n = check_mask("response_mask", response_mask)?;
    check_token_tensor("old_logp", old_logp, response_mask)?;
    check_token_tensor("logp", logp, response_mask)?;
    check_token_tensor("advantages", advantages, response_mask)?;
    let mask = response_mask;

    let diff = logp.sub(old_logp)?;
    let neg_kl = clamp(&diff, -20.0, 20.0)?;
    let ratio = neg_kl.exp()?;
    let neg_adv = advantages.neg()?;
    let pg1 = neg_adv.mul(&ratio)?;
    let clipped_ratio = clamp(&ratio, (1.0 - cfg.low()) as f32, (1.0 + cfg.high()) as f32)?;
    let pg2 = neg_adv.mul(&clipped_ratio)?;
    let clip1 = pg1.maximum(&pg2)?;
    let clipfrac = frac(&pg2.gt(&pg1)?, mask, n)?;

    let (pg, clipfrac_lower) = match cfg.clip_ratio_c {
        Some(c) => {
            let pg3 = neg_adv.affine(c, 0.0)?;
            let clip2 = clip1.minimum(&pg3)?;
            let negative = advantages.lt(0f32)?;
            let lower = clip1.gt(&pg3)?.mul(&negative)?;
            (negative.where_cond(&clip2, &clip1)?, frac(&lower, mask, n)?)
        }
        None => (clip1, 0.0),
    };
    let loss = agg_loss_n(&pg, mask, n, cfg.loss_agg_mode)?;

    let diff_d = diff.detach();
    let approxkl = scalar(&masked_mean_n(&diff_d.sqr()?.affine(0.5, 0.0)?, mask, n)?)?;
    let ppo_kl = -scalar(&masked_mean_n(&neg_kl.detach(), mask, n)?)?;
    let ratio_mean = scalar(&masked_mean_n(&ratio.detach(), mask, n)?)?;
    Ok(PolicyLossOutput {
        loss,
        clipfrac,
        clipfrac_lower,
        approxkl,
        ppo_kl,
        ratio_mean,
    })
}

fn frac(indicator: &Tensor, mask: &Tensor, n: usize) -> Result<f64> {
    let ind = indicator.to_dtype(mask.dtype())?;
    scalar(&masked_mean_n(&ind, mask, n)?)
}

/// Output of [`value_loss`].
#[derive(Debug, Clone)]
pub struct ValueLossOutput {
    /// Scalar loss `0.5 * agg(max((v - R)^2, (v_clip - R)^2))`, not yet
    /// multiplied by `vf_coef`; differentiable w.r.t. `vpreds`.
    pub loss: Tensor,
    /// Fraction of valid tokens where the clipped term was larger.
    pub clipfrac: f64,
}

/// Clipped value loss (TRL / verl `compute_value_loss`): predictions are
/// clipped to `old_values ± cliprange_value`.
pub fn value_loss(
    vpreds: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    response_mask: &Tensor,
    cfg: &ValueLossConfig,
) -> Result<ValueLossOutput> {
    cfg.validate()?;
    let n = check_mask("response_mask", response_mask)?;
    check_token_tensor("vpreds", vpreds, response_mask)?;
    check_token_tensor("old_values", old_values, response_mask)?;
    check_token_tensor("returns", returns, response_mask)?;
    let c = cfg.cliprange_value;
    let lo = old_values.affine(1.0, -c)?;
    let hi = old_values.affine(1.0, c)?;
    let vclipped = vpreds.minimum(&hi)?.maximum(&lo)?;
    let l1 = vpreds.sub(returns)?.sqr()?;
    let l2 = vclipped.sub(returns)?.sqr()?;
    let lmax = l1.maximum(&l2)?;
    let loss = agg_loss_n(&lmax, response_mask, n, cfg.loss_agg_mode)?.affine(0.5, 0.0)?;
    let clipfrac = frac(&l2.gt(&l1)?, response_mask, n)?;
    Ok(ValueLossOutput { loss, clipfrac })
}

/// Aggregated KL-to-reference loss (verl actor with `use_kl_loss`),
/// differentiable w.r.t. `logp`.
pub fn kl_loss(
    logp: &Tensor,
    ref_logp: &Tensor,
    response_mask: &Tensor,
    kl_type: KlPenalty,
    mode: LossAggMode,
) -> Result<Tensor> {
    let n = check_mask("response_mask", response_mask)?;
    check_token_tensor("logp", logp, response_mask)?;
    check_token_tensor("ref_logp", ref_logp, response_mask)?;
    if kl_type == KlPenalty::Full {
        return Err(crate::error::AlgoError::InvalidConfig {
            key: "kl_loss_type",
            value: "full".into(),
            reason: "kl_loss works on the sampled tokens' log-probs; use kl_penalty with full \
                     log-distributions and agg_loss instead"
                .into(),
        });
    }
    let kl = kl_penalty_unchecked(logp, ref_logp, kl_type)?;
    agg_loss_n(&kl, response_mask, n, mode)
}

/// Output of [`actor_loss`].
#[derive(Debug, Clone)]
pub struct ActorLossOutput {
    /// `pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss`.
    pub loss: Tensor,
    /// The policy-gradient part and its diagnostics.
    pub policy: PolicyLossOutput,
    /// Aggregated entropy, when token entropies were given.
    pub entropy: Option<f64>,
    /// Aggregated KL loss, when `use_kl_loss`.
    pub kl_loss: Option<f64>,
}

/// The full actor loss of verl's actor update: clipped surrogate, minus the
/// entropy bonus (when `entropy` `[batch, len]` is given and `entropy_coeff` is
/// non-zero), plus the KL loss (when `use_kl_loss`; then `ref_logp` is needed).
pub fn actor_loss(
    old_logp: &Tensor,
    logp: &Tensor,
    advantages: &Tensor,
    response_mask: &Tensor,
    entropy: Option<&Tensor>,
    ref_logp: Option<&Tensor>,
    cfg: &PolicyLossConfig,
) -> Result<ActorLossOutput> {
    let policy = policy_loss(old_logp, logp, advantages, response_mask, cfg)?;
    let mut loss = policy.loss.clone();
    let mut entropy_value = None;
    if let Some(h) = entropy {
        let agg = agg_loss(h, response_mask, cfg.loss_agg_mode)?;
        entropy_value = Some(scalar(&agg)?);
        if cfg.entropy_coeff != 0.0 {
            loss = loss.sub(&agg.affine(cfg.entropy_coeff, 0.0)?)?;
        }
    }
    let mut kl_value = None;
    if cfg.use_kl_loss {
        let ref_logp = ref_logp.ok_or_else(|| crate::error::AlgoError::InvalidInput {
            input: "ref_logp",
            reason: "use_kl_loss is on, so the reference log-probs are needed".into(),
        })?;
        let kl = kl_loss(
            logp,
            ref_logp,
            response_mask,
            cfg.kl_loss_type,
            cfg.loss_agg_mode,
        )?;
        kl_value = Some(scalar(&kl)?);
        loss = loss.add(&kl.affine(cfg.kl_loss_coef, 0.0)?)?;
    }
    Ok(ActorLossOutput {
        loss,
        policy,
        entropy: entropy_value,
        kl_loss: kl_value,
    })
}
