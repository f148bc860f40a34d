//! PPO losses, built only from candle ops that have a backward pass so the
//! caller can backpropagate into the policy (through `logp`) and the critic
//! (through `vpreds`). Diagnostics are returned as plain `f64`s.

use candle_core::{DType, Tensor};

use crate::config::{PolicyLossConfig, ValueLossConfig};
use crate::error::Result;
use crate::fused::{self, PgParams};
use crate::kl::kl_penalty_unchecked;
use crate::masked::{masked_mean_n, scalar};
use crate::names::{ImportanceSamplingLevel, KlPenalty, LossAggMode, PolicyLoss};
use crate::objective::objective_terms;
use crate::validate::{check_mask, check_token_tensor, clamp, HostMask, HostSlice};

/// Reduces a `[batch, len]` loss matrix to a scalar over the mask
/// (verl `agg_loss`). The `seq-mean-*` modes average over the sequences that
/// have at least one valid token; `seq-mean-token-sum-norm` divides each
/// sequence's token sum by the response width (see [`agg_loss_scaled`]).
pub fn agg_loss(loss_mat: &Tensor, mask: &Tensor, mode: LossAggMode) -> Result<Tensor> {
    agg_loss_scaled(loss_mat, mask, mode, None)
}

/// [`agg_loss`] with the constant of `seq-mean-token-sum-norm` (TRL's
/// `max_completion_length`) given; `None` uses the response width. Any other mode
/// refuses a factor.
pub fn agg_loss_scaled(
    loss_mat: &Tensor,
    mask: &Tensor,
    mode: LossAggMode,
    loss_scale_factor: Option<f64>,
) -> Result<Tensor> {
    crate::config::check_scale_factor(loss_scale_factor, mode)?;
    let n = check_mask("response_mask", mask)?;
    check_token_tensor("loss_mat", loss_mat, mask)?;
    agg_loss_scaled_n(loss_mat, mask, n, mode, loss_scale_factor)
}

pub(crate) fn agg_loss_n(
    loss_mat: &Tensor,
    mask: &Tensor,
    n: usize,
    mode: LossAggMode,
) -> Result<Tensor> {
    agg_loss_scaled_n(loss_mat, mask, n, mode, None)
}

pub(crate) fn agg_loss_scaled_n(
    loss_mat: &Tensor,
    mask: &Tensor,
    n: usize,
    mode: LossAggMode,
    loss_scale_factor: Option<f64>,
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
    let mean = seq_losses
        .mul(&seq_mask)?
        .sum_all()?
        .div(&seq_mask.sum_all()?)?;
    if mode == LossAggMode::SeqMeanTokenSumNorm {
        let width = mask.dim(1)? as f64;
        return Ok(mean.affine(1.0 / loss_scale_factor.unwrap_or(width), 0.0)?);
    }
    Ok(mean)
}

/// Sizes of the whole (global) batch a micro-batch belongs to, for gradient
/// accumulation and data parallelism (verl's `batch_num_tokens`,
/// `global_batch_size`, `dp_size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalBatch {
    /// Valid tokens in the global batch (all micro-batches, all ranks).
    pub num_tokens: usize,
    /// Sequences with at least one valid token in the global batch.
    pub num_seqs: usize,
    /// Data-parallel ranks whose gradients are averaged (1 without DP).
    pub dp_size: usize,
}

/// Factor to multiply a micro-batch loss by (from [`agg_loss`], [`policy_loss`],
/// [`value_loss`], ...) so that the losses of all micro-batches, summed over
/// gradient-accumulation steps and averaged over `dp_size` ranks, equal the loss
/// aggregated over the global batch at once: the micro-batch's own denominator
/// (valid tokens, or non-empty sequences) times `dp_size` over the global one.
///
/// With TRL's names: `token-mean` scaled this way is `dapo` (tokens of the whole
/// accumulated batch), while the `seq-mean-*` modes give `grpo` and `dr_grpo` with
/// equal-sized micro-batches (TRL divides each micro-batch's loss by the accumulation
/// steps). TRL's `bnpo` is `token-mean` of one micro-batch, unscaled.
pub fn micro_batch_scale(mask: &Tensor, mode: LossAggMode, global: &GlobalBatch) -> Result<f64> {
    let n = check_mask("response_mask", mask)?;
    let (local, total, key) = match mode {
        LossAggMode::TokenMean => (n as f64, global.num_tokens, "num_tokens"),
        LossAggMode::SeqMeanTokenSum
        | LossAggMode::SeqMeanTokenMean
        | LossAggMode::SeqMeanTokenSumNorm => {
            let seqs = mask.sum(1)?.gt(0f32)?.to_dtype(mask.dtype())?.sum_all()?;
            (scalar(&seqs)?, global.num_seqs, "num_seqs")
        }
    };
    if total == 0 || global.dp_size == 0 {
        return Err(crate::error::AlgoError::InvalidInput {
            input: "global_batch",
            reason: format!("{key} and dp_size must be > 0, got {global:?}"),
        });
    }
    Ok(local * global.dp_size as f64 / total as f64)
}

/// Output of [`policy_loss`].
#[derive(Debug, Clone)]
pub struct PolicyLossOutput {
    /// Scalar loss; differentiable w.r.t. `logp`.
    pub loss: Tensor,
    /// Fraction of valid tokens where the clipped surrogate was active (TRL GRPO's
    /// `clip_ratio/region_mean`); for `cispo` the fraction of positive-advantage tokens
    /// whose weight was capped (`cispo_clip_ratio`); 0 for `sapo`. At the sequence level,
    /// a fraction of sequences.
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
///
/// The gradient flows to `logp` only: `old_logp` and `advantages` are rollout
/// constants. Diagnostics are masked means (TRL averages `approxkl` and the
/// ratio over padding too).
///
/// `cfg.policy_loss` and `cfg.importance_sampling_level` choose the GRPO family's
/// other objectives as TRL 1.16's GRPOTrainer computes them: the ratio per sequence
/// (GSPO: `exp` of the mean log-ratio over the response tokens, shared by its tokens),
/// `cispo` (`-sg(min(r, cispo_clip_max)) * A * logp`) and `sapo` (the soft gate
/// `-A * sigmoid(tau (r - 1)) * 4 / tau`); `clip_ratio_c` applies to `ppo` only.
pub fn policy_loss(
    old_logp: &Tensor,
    logp: &Tensor,
    advantages: &Tensor,
    response_mask: &Tensor,
    cfg: &PolicyLossConfig,
) -> Result<PolicyLossOutput> {
    cfg.validate()?;
    Ok(policy_and_entropy(old_logp, logp, advantages, response_mask, None, cfg)?.0)
}

/// [`policy_loss`] and, when `entropy` is given, its aggregation the same way (a value, no
/// gradient). On the CPU both come from one pass of the fused kernel; elsewhere, or when an
/// input fails a check there, from the checked op chains (which name the fault).
fn policy_and_entropy(
    old_logp: &Tensor,
    logp: &Tensor,
    advantages: &Tensor,
    response_mask: &Tensor,
    entropy: Option<&Tensor>,
    cfg: &PolicyLossConfig,
) -> Result<(PolicyLossOutput, Option<f64>)> {
    let tensors = [old_logp, logp, advantages, response_mask];
    if tensors.iter().chain(&entropy).all(|t| t.device().is_cpu()) {
        if let Some(out) = policy_loss_cpu(old_logp, logp, advantages, response_mask, entropy, cfg)?
        {
            return Ok(out);
        }
    }
    policy_and_entropy_ops(old_logp, logp, advantages, response_mask, entropy, cfg)
}

/// The fused CPU kernel, or `None` when an input is not of the expected dtype and shape or
/// fails a value check.
fn policy_loss_cpu(
    old_logp: &Tensor,
    logp: &Tensor,
    advantages: &Tensor,
    response_mask: &Tensor,
    entropy: Option<&Tensor>,
    cfg: &PolicyLossConfig,
) -> Result<Option<(PolicyLossOutput, Option<f64>)>> {
    let dims = response_mask.dims();
    let &[_, width] = dims else {
        return Ok(None);
    };
    let tensors = [old_logp, logp, advantages, response_mask];
    let fits = |t: &&Tensor| t.dtype() == DType::F32 && t.dims() == dims;
    if width == 0 || !tensors.iter().chain(&entropy).all(fits) {
        return Ok(None);
    }
    let out = {
        // borrowed views: dropped before any op runs on these tensors
        let mask = HostSlice::new(response_mask)?;
        let old = HostSlice::new(old_logp)?;
        let lp = HostSlice::new(logp)?;
        let adv = HostSlice::new(advantages)?;
        let ent = entropy.map(HostSlice::new).transpose()?;
        let inputs = fused::Inputs {
            logp: &lp,
            old: &old,
            adv: &adv,
            mask: &mask,
            entropy: ent.as_deref(),
            width,
        };
        fused::policy_loss_host(&inputs, cfg)
    };
    let Some(out) = out else {
        return Ok(None);
    };
    let grad = Tensor::from_vec(out.grad, dims, response_mask.device())?;
    let loss = logp.apply_op1(fused::LossWithGrad {
        loss: out.loss as f32,
        grad,
    })?;
    let [clipfrac, clipfrac_lower, approxkl, ppo_kl, ratio_mean] = out.stats;
    let policy = PolicyLossOutput {
        loss,
        clipfrac,
        clipfrac_lower,
        approxkl,
        ppo_kl,
        ratio_mean,
    };
    Ok(Some((policy, out.entropy)))
}

/// [`policy_and_entropy`] from checked, differentiable candle ops (any device).
pub(crate) fn policy_and_entropy_ops(
    old_logp: &Tensor,
    logp: &Tensor,
    advantages: &Tensor,
    response_mask: &Tensor,
    entropy: Option<&Tensor>,
    cfg: &PolicyLossConfig,
) -> Result<(PolicyLossOutput, Option<f64>)> {
    let n = check_policy_inputs(old_logp, logp, advantages, response_mask)?;
    let (pg, stats) = if cfg.policy_loss == PolicyLoss::Ppo
        && cfg.importance_sampling_level == ImportanceSamplingLevel::Token
    {
        let params = PgParams {
            lo: (1.0 - cfg.low()) as f32,
            hi: (1.0 + cfg.high()) as f32,
            dual: cfg.clip_ratio_c.map(|c| c as f32),
        };
        policy_terms_ops(old_logp, logp, advantages, response_mask, n, params)?
    } else {
        // the GRPO family's other objectives and ratio levels (`objective.rs`)
        objective_terms(old_logp, logp, advantages, response_mask, n, cfg)?
    };
    let policy = policy_output(&pg, response_mask, n, stats, cfg)?;
    let (mode, factor) = (cfg.loss_agg_mode, cfg.loss_scale_factor);
    let entropy = entropy
        .map(|h| scalar(&agg_loss_scaled(&h.detach(), response_mask, mode, factor)?))
        .transpose()?;
    Ok((policy, entropy))
}

/// The mask's valid-token count, once the three token tensors are checked against it.
fn check_policy_inputs(
    old_logp: &Tensor,
    logp: &Tensor,
    advantages: &Tensor,
    response_mask: &Tensor,
) -> Result<usize> {
    let n = check_mask("response_mask", response_mask)?;
    check_token_tensor("old_logp", old_logp, response_mask)?;
    check_token_tensor("logp", logp, response_mask)?;
    check_token_tensor("advantages", advantages, response_mask)?;
    Ok(n)
}

fn policy_output(
    pg: &Tensor,
    response_mask: &Tensor,
    n: usize,
    stats: [f64; 5],
    cfg: &PolicyLossConfig,
) -> Result<PolicyLossOutput> {
    let [clipfrac, clipfrac_lower, approxkl, ppo_kl, ratio_mean] = stats;
    let (mode, factor) = (cfg.loss_agg_mode, cfg.loss_scale_factor);
    Ok(PolicyLossOutput {
        loss: agg_loss_scaled_n(pg, response_mask, n, mode, factor)?,
        clipfrac,
        clipfrac_lower,
        approxkl,
        ppo_kl,
        ratio_mean,
    })
}

/// [`policy_loss`]'s per-token matrix and diagnostics from generic candle ops,
/// for devices without the fused kernel.
pub(crate) fn policy_terms_ops(
    old_logp: &Tensor,
    logp: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    n: usize,
    p: PgParams,
) -> Result<(Tensor, [f64; 5])> {
    let diff = logp.sub(old_logp)?;
    let neg_kl = clamp(&diff, -20.0, 20.0)?;
    let ratio = neg_kl.exp()?;
    let neg_adv = advantages.neg()?;
    let pg1 = neg_adv.mul(&ratio)?;
    let pg2 = neg_adv.mul(&clamp(&ratio, p.lo, p.hi)?)?;
    let clip1 = pg1.maximum(&pg2)?;
    let clipfrac = frac(&pg2.gt(&pg1)?, mask, n)?;
    let (pg, clipfrac_lower) = match p.dual {
        Some(c) => {
            let pg3 = neg_adv.affine(c as f64, 0.0)?;
            let clip2 = clip1.minimum(&pg3)?;
            let negative = advantages.lt(0f32)?;
            let lower = clip1.gt(&pg3)?.mul(&negative)?;
            (negative.where_cond(&clip2, &clip1)?, frac(&lower, mask, n)?)
        }
        None => (clip1, 0.0),
    };
    let diff_d = diff.detach();
    let approxkl = scalar(&masked_mean_n(&diff_d.sqr()?.affine(0.5, 0.0)?, mask, n)?)?;
    let ppo_kl = -scalar(&masked_mean_n(&neg_kl.detach(), mask, n)?)?;
    let ratio_mean = scalar(&masked_mean_n(&ratio.detach(), mask, n)?)?;
    Ok((pg, [clipfrac, clipfrac_lower, approxkl, ppo_kl, ratio_mean]))
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
    /// `vf_coef * loss`, the term added to the policy loss when policy and
    /// value are trained together (TRL: `loss = pg_loss + vf_coef * vf_loss`).
    pub weighted_loss: Tensor,
    /// Fraction of valid tokens where the clipped term was larger.
    pub clipfrac: f64,
}

/// Clipped value loss (TRL / verl `compute_value_loss`): predictions are
/// clipped to `old_values ± cliprange_value`. The gradient flows to `vpreds`
/// only; `old_values` and `returns` are rollout constants.
pub fn value_loss(
    vpreds: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    response_mask: &Tensor,
    cfg: &ValueLossConfig,
) -> Result<ValueLossOutput> {
    cfg.validate()?;
    let (n, lmax, clipfrac) = if vpreds.device().is_cpu() && response_mask.device().is_cpu() {
        let m = HostMask::new("response_mask", response_mask)?;
        let v = m.token("vpreds", vpreds)?;
        let old = m.token("old_values", old_values)?;
        let ret = m.token("returns", returns)?;
        let c = cfg.cliprange_value as f32;
        let (l, cf) = fused::value_terms(vpreds, &v, &old, &ret, &m.data, c)?;
        (m.n, l, cf)
    } else {
        let n = check_mask("response_mask", response_mask)?;
        check_token_tensor("vpreds", vpreds, response_mask)?;
        check_token_tensor("old_values", old_values, response_mask)?;
        check_token_tensor("returns", returns, response_mask)?;
        let c = cfg.cliprange_value;
        let (l, cf) = value_terms_ops(vpreds, old_values, returns, response_mask, n, c)?;
        (n, l, cf)
    };
    let loss = agg_loss_n(&lmax, response_mask, n, cfg.loss_agg_mode)?.affine(0.5, 0.0)?;
    let weighted_loss = loss.affine(cfg.vf_coef, 0.0)?;
    Ok(ValueLossOutput {
        loss,
        weighted_loss,
        clipfrac,
    })
}

/// [`value_loss`]'s unhalved per-token matrix and clip fraction from generic
/// candle ops, for devices without the fused kernel.
pub(crate) fn value_terms_ops(
    vpreds: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    mask: &Tensor,
    n: usize,
    c: f64,
) -> Result<(Tensor, f64)> {
    let lo = old_values.affine(1.0, -c)?;
    let hi = old_values.affine(1.0, c)?;
    let vclipped = vpreds.minimum(&hi)?.maximum(&lo)?;
    let l1 = vpreds.sub(returns)?.sqr()?;
    let l2 = vclipped.sub(returns)?.sqr()?;
    let clipfrac = frac(&l2.gt(&l1)?, mask, n)?;
    Ok((l1.maximum(&l2)?, clipfrac))
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
    kl_loss_scaled(logp, ref_logp, response_mask, kl_type, mode, None)
}

fn kl_loss_scaled(
    logp: &Tensor,
    ref_logp: &Tensor,
    response_mask: &Tensor,
    kl_type: KlPenalty,
    mode: LossAggMode,
    loss_scale_factor: Option<f64>,
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
    agg_loss_scaled_n(&kl, response_mask, n, mode, loss_scale_factor)
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
    cfg.validate()?;
    // Without a bonus the entropy is only reported: the policy loss's pass aggregates it.
    let report_only = entropy.filter(|_| cfg.entropy_coeff == 0.0);
    let (policy, mut entropy_value) =
        policy_and_entropy(old_logp, logp, advantages, response_mask, report_only, cfg)?;
    let mut loss = policy.loss.clone();
    if let Some(h) = entropy.filter(|_| cfg.entropy_coeff != 0.0) {
        let agg = agg_loss_scaled(h, response_mask, cfg.loss_agg_mode, cfg.loss_scale_factor)?;
        entropy_value = Some(scalar(&agg)?);
        loss = loss.sub(&agg.affine(cfg.entropy_coeff, 0.0)?)?;
    }
    let mut kl_value = None;
    if cfg.use_kl_loss {
        let ref_logp = ref_logp.ok_or_else(|| crate::error::AlgoError::InvalidInput {
            input: "ref_logp",
            reason: "use_kl_loss is on, so the reference log-probs are needed".into(),
        })?;
        let kl = kl_loss_scaled(
            logp,
            ref_logp,
            response_mask,
            cfg.kl_loss_type,
            cfg.loss_agg_mode,
            cfg.loss_scale_factor,
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn scaled_micro_batches_sum_to_the_global_loss() {
        let dev = Device::Cpu;
        let loss: Vec<f32> = (0..24).map(|i| ((i * 5) % 7) as f32 - 2.5).collect();
        let mask: Vec<f32> = [4usize, 1, 6, 0, 3, 2]
            .iter()
            .flat_map(|&n| (0..4).map(move |t| if t < n { 1.0 } else { 0.0 }))
            .collect();
        let full_l = Tensor::from_vec(loss.clone(), (6, 4), &dev).unwrap();
        let full_m = Tensor::from_vec(mask.clone(), (6, 4), &dev).unwrap();
        let global = GlobalBatch {
            num_tokens: mask.iter().filter(|&&m| m != 0.0).count(),
            num_seqs: 5,
            dp_size: 1,
        };
        for mode in LossAggMode::ALL {
            let want = agg_loss(&full_l, &full_m, *mode)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let mut got = 0f64;
            for rows in [0..2usize, 2..4, 4..6] {
                let l = full_l.narrow(0, rows.start, 2).unwrap();
                let m = full_m.narrow(0, rows.start, 2).unwrap();
                let part = agg_loss(&l, &m, *mode).unwrap().to_scalar::<f32>().unwrap();
                got += part as f64 * micro_batch_scale(&m, *mode, &global).unwrap();
            }
            assert!((got - want as f64).abs() < 1e-5, "{mode}: {got} vs {want}");
        }
        let bad = GlobalBatch {
            num_tokens: 0,
            ..global
        };
        let err = micro_batch_scale(&full_m, LossAggMode::TokenMean, &bad).unwrap_err();
        assert!(err
            .to_string()
            .starts_with("global_batch: num_tokens and dp_size must be > 0"));
    }

    fn pseudo(n: usize, seed: u32, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u32)
                    .wrapping_mul(2654435761)
                    .wrapping_add(seed.wrapping_mul(40503));
                ((x >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect()
    }

    fn host(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    fn assert_close(what: &str, a: &[f32], b: &[f32]) {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-6 * y.abs().max(1.0),
                "{what}[{i}]: {x} vs {y}"
            );
        }
    }

    #[test]
    fn fused_cpu_kernels_match_the_op_chains() {
        fused_matches_ops(6, 40);
        // rows that end inside a lane, large enough for the pass to split across threads
        fused_matches_ops(6, 30_001);
    }

    /// Every objective at both ratio levels under every aggregation, with clip settings
    /// that make each branch fire on the data of `fused_matches_ops`.
    fn fused_configs(t: usize) -> Vec<PolicyLossConfig> {
        let base = PolicyLossConfig::default();
        let mut objectives = Vec::new();
        for c in [Some(3.0), Some(1.5), None] {
            for (low, high) in [(0.2, 0.2), (0.1, 0.28)] {
                objectives.push(PolicyLossConfig {
                    clip_ratio: low,
                    clip_ratio_high: Some(high),
                    clip_ratio_c: c,
                    ..base.clone()
                });
            }
        }
        // GSPO's narrow range clips whole sequences
        objectives.push(PolicyLossConfig {
            clip_ratio: 3e-4,
            clip_ratio_high: Some(4e-4),
            clip_ratio_c: None,
            ..base.clone()
        });
        objectives.push(PolicyLossConfig {
            policy_loss: PolicyLoss::Cispo,
            cispo_clip_max: 1.5,
            ..base.clone()
        });
        for (pos, neg) in [(1.0, 1.05), (0.5, 2.0)] {
            objectives.push(PolicyLossConfig {
                policy_loss: PolicyLoss::Sapo,
                sapo_temperature_pos: pos,
                sapo_temperature_neg: neg,
                ..base.clone()
            });
        }
        let mut out = Vec::new();
        for o in objectives {
            for level in ImportanceSamplingLevel::ALL {
                for mode in LossAggMode::ALL {
                    let factor =
                        (*mode == LossAggMode::SeqMeanTokenSumNorm).then_some(1.5 * t as f64);
                    out.push(PolicyLossConfig {
                        importance_sampling_level: *level,
                        loss_agg_mode: *mode,
                        loss_scale_factor: factor,
                        ..o.clone()
                    });
                }
            }
        }
        out
    }

    fn fused_matches_ops(b: usize, t: usize) {
        let dev = Device::Cpu;
        let tok = |v: Vec<f32>| Tensor::from_vec(v, (b, t), &dev).unwrap();
        let old_v = pseudo(b * t, 1, 2.0);
        let mut new_v: Vec<f32> = old_v
            .iter()
            .zip(pseudo(b * t, 2, 1.2))
            .map(|(o, d)| o + d)
            .collect();
        // exact ratio-1 ties and a few extreme log-ratios beyond the +-20 clamp
        new_v[..10].copy_from_slice(&old_v[..10]);
        new_v[5 * t + 1] = old_v[5 * t + 1] + 25.0;
        new_v[5 * t + 2] = old_v[5 * t + 2] - 25.0;
        // ratios around e^1.6 so that the dual clip fires for negative advantages
        for k in 0..20 {
            new_v[3 * t + k] = old_v[3 * t + k] + 1.6;
        }
        let (old, adv) = (tok(old_v), tok(pseudo(b * t, 3, 2.0)));
        let mask = tok((0..b * t)
            .map(|i| f32::from(u8::from(i % t <= t * (1 + i / t) / (b + 1))))
            .collect());
        let n = host(&mask).iter().filter(|&&m| m != 0.0).count();
        let entropy = tok(pseudo(b * t, 7, 1.0).iter().map(|x| x + 1.0).collect());
        for cfg in fused_configs(t) {
            let run = |fused_path: bool| {
                let var = candle_core::Var::from_tensor(&tok(new_v.clone())).unwrap();
                let lp = var.as_tensor();
                let (out, ent) = if fused_path {
                    policy_loss_cpu(&old, lp, &adv, &mask, Some(&entropy), &cfg)
                        .unwrap()
                        .expect("the fused kernel takes these inputs")
                } else {
                    policy_and_entropy_ops(&old, lp, &adv, &mask, Some(&entropy), &cfg).unwrap()
                };
                let grads = out.loss.backward().unwrap();
                let stats = [
                    out.clipfrac,
                    out.clipfrac_lower,
                    out.approxkl,
                    out.ppo_kl,
                    out.ratio_mean,
                ];
                let loss = out.loss.to_scalar::<f32>().unwrap();
                (loss, stats, ent.unwrap(), host(grads.get(&var).unwrap()))
            };
            let token = cfg.importance_sampling_level == ImportanceSamplingLevel::Token;
            let (l_f, st_f, e_f, g_f) = run(true);
            let (l_o, st_o, e_o, g_o) = run(false);
            let what = format!(
                "{} {} {} c={:?} ({}, {:?})",
                cfg.policy_loss,
                cfg.importance_sampling_level,
                cfg.loss_agg_mode,
                cfg.clip_ratio_c,
                cfg.clip_ratio,
                cfg.clip_ratio_high
            );
            // At the sequence level one f32 ratio scales a whole row's sum: with 30,001-token
            // rows whose sums mostly cancel, its rounding alone moves the loss by ~1e-5 (an
            // f64 reference for the worst case here: 2.1383611, the kernel 2.1383760, the op
            // chain 2.1383517).
            let loss_tol = if token { 1e-5 } else { 5e-5 };
            assert!(
                (l_f - l_o).abs() <= loss_tol * l_o.abs().max(1.0),
                "{what}: loss {l_f} vs {l_o}"
            );
            assert!(
                (e_f - e_o).abs() <= 1e-5 * e_o.abs().max(1.0),
                "{what}: entropy {e_f} vs {e_o}"
            );
            // At the sequence level each gradient sums a whole row's token derivatives, which
            // the op chain adds up in f32 one after another (up to 6e-5 off on 30,001 tokens).
            let tol = if token { 1e-5 } else { 2e-4 };
            let scale = g_o.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (i, (x, y)) in g_f.iter().zip(&g_o).enumerate() {
                assert!(
                    (x - y).abs() <= tol * scale,
                    "{what}: grad[{i}] {x} vs {y} (largest {scale})"
                );
            }
            // the op chains sum ~10^5 tokens in f32 one after another (2e-5 off at most
            // here); the kernel sums in f64
            for (x, y) in st_f.iter().zip(&st_o) {
                assert!(
                    (x - y).abs() < 1e-4 * y.abs().max(1.0),
                    "{what}: stats {st_f:?} vs {st_o:?}"
                );
            }
            // every clip fires on per-token ratios; sequence means stay near 1 but for
            // GSPO's narrow range
            if cfg.policy_loss == PolicyLoss::Ppo && (token || cfg.clip_ratio < 0.01) {
                let dual = token && cfg.clip_ratio_c.is_some_and(|c| c < 2.0);
                assert!(
                    st_f[0] > 0.0 && (!dual || st_f[1] > 0.0),
                    "{what}: {st_f:?}"
                );
            }
        }
        let vals = tok(pseudo(b * t, 4, 1.0));
        let mut vp: Vec<f32> = host(&vals)
            .iter()
            .zip(pseudo(b * t, 5, 0.6))
            .map(|(v, d)| v + d)
            .collect();
        vp[..8].copy_from_slice(&host(&vals)[..8]);
        let ret = tok(pseudo(b * t, 6, 2.0));
        for c in [0.2f32, 0.05, 0.4] {
            let run = |fused_path: bool| {
                let var = candle_core::Var::from_tensor(&tok(vp.clone())).unwrap();
                let (l, cf) = if fused_path {
                    let v = host(var.as_tensor());
                    let (o, r, m) = (host(&vals), host(&ret), host(&mask));
                    fused::value_terms(var.as_tensor(), &v, &o, &r, &m, c).unwrap()
                } else {
                    value_terms_ops(var.as_tensor(), &vals, &ret, &mask, n, c as f64).unwrap()
                };
                let grads = l.mul(&mask).unwrap().sum_all().unwrap().backward().unwrap();
                (host(&l), cf, host(grads.get(&var).unwrap()))
            };
            let (l_f, cf_f, g_f) = run(true);
            let (l_o, cf_o, g_o) = run(false);
            assert_close(&format!("value c={c}"), &l_f, &l_o);
            assert_close(&format!("value grad c={c}"), &g_f, &g_o);
            assert!(
                (cf_f - cf_o).abs() < 1e-6 && cf_f > 0.0,
                "clipfrac {cf_f} vs {cf_o}"
            );
        }
    }

    #[test]
    fn a_non_finite_input_anywhere_is_named() {
        // The kernel finds non-finite inputs through its sums; each objective, level, input,
        // kind and place (a valid and a masked token) must end in the checked path's error.
        let dev = Device::Cpu;
        let (b, t) = (3usize, 37usize);
        let tok = |v: Vec<f32>| Tensor::from_vec(v, (b, t), &dev).unwrap();
        let mask: Vec<f32> = (0..b * t)
            .map(|i| f32::from(u8::from(i % t < 20)))
            .collect();
        let base = [
            pseudo(b * t, 1, 2.0),
            pseudo(b * t, 2, 2.0),
            pseudo(b * t, 3, 1.0),
        ];
        let entropy = pseudo(b * t, 4, 1.0);
        let configs: Vec<PolicyLossConfig> = fused_configs(t)
            .into_iter()
            .filter(|c| c.loss_agg_mode == LossAggMode::TokenMean)
            .collect();
        for cfg in &configs {
            for (input, name) in ["old_logp", "logp", "advantages", "loss_mat"]
                .iter()
                .enumerate()
            {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    // a valid token, a masked one
                    for at in [t + 5, 2 * t + 30] {
                        let mut v = base.clone();
                        let mut h = entropy.clone();
                        if input < 3 {
                            v[input][at] = bad;
                        } else {
                            h[at] = bad;
                        }
                        let [old, lp, adv] = v.map(tok);
                        let err = actor_loss(
                            &old,
                            &lp,
                            &adv,
                            &tok(mask.clone()),
                            Some(&tok(h)),
                            None,
                            cfg,
                        )
                        .err()
                        .unwrap_or_else(|| panic!("{name} = {bad} at {at} passed: {cfg:?}"))
                        .to_string();
                        assert!(err.starts_with(&format!("{name}: contains")), "{err}");
                    }
                }
            }
        }
    }

    #[test]
    fn value_loss_weight_is_vf_coef() {
        let dev = Device::Cpu;
        let v = Tensor::new(&[[0.5f32, 1.0], [2.0, -1.0]], &dev).unwrap();
        let r = Tensor::new(&[[1.0f32, 0.0], [1.0, 1.0]], &dev).unwrap();
        let m = Tensor::new(&[[1f32, 1.0], [1.0, 0.0]], &dev).unwrap();
        let out = value_loss(&v, &v, &r, &m, &ValueLossConfig::default()).unwrap();
        let l = out.loss.to_scalar::<f32>().unwrap();
        // 0.5 * mean(0.25, 1, 1) = 0.375
        assert!((l - 0.375).abs() < 1e-6);
        assert!((out.weighted_loss.to_scalar::<f32>().unwrap() - 0.1 * l).abs() < 1e-7);
    }
}
