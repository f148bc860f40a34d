//! The GRPO family's per-token objectives other than the token-level clipped surrogate:
//! GSPO's sequence-level importance ratio, CISPO and SAPO, as TRL 1.16's GRPOTrainer
//! forms them before aggregation (`tests/grpo_losses.rs` checks them against its code).
//!
//! These run as chains of differentiable candle ops on every device: a sequence-level
//! ratio ties each token's loss to every log-prob of its sequence, which the fused
//! per-token kernel of `fused.rs` cannot express. The token-level `ppo` objective, the
//! default, stays on that kernel. Diagnostics are computed from host copies.

use candle_core::Tensor;

use crate::config::PolicyLossConfig;
use crate::error::Result;
use crate::masked::{masked_mean_n, scalar};
use crate::names::{ImportanceSamplingLevel, PolicyLoss};
use crate::validate::{clamp, host_vec};

/// The log-ratio is clamped before `exp`, as the token-level loss does; TRL does not
/// clamp, which only matters past `exp(20)`.
const LOG_RATIO_BOUND: f32 = 20.0;

/// Per-token loss matrix (differentiable w.r.t. `logp`) and the diagnostics
/// `(clipfrac, clipfrac_lower, approxkl, ppo_kl, ratio_mean)` of `cfg.policy_loss` at
/// `cfg.importance_sampling_level`. Inputs are already validated; `n` is the number of
/// valid tokens.
pub(crate) fn objective_terms(
    old_logp: &Tensor,
    logp: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    n: usize,
    cfg: &PolicyLossConfig,
) -> Result<(Tensor, [f64; 5])> {
    let diff = logp.sub(old_logp)?;
    let log_w = match cfg.importance_sampling_level {
        ImportanceSamplingLevel::Token => clamp(&diff, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)?,
        ImportanceSamplingLevel::Sequence => {
            // TRL: (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            let len = mask.sum_keepdim(1)?.maximum(1f32)?;
            let mean = diff.mul(mask)?.sum_keepdim(1)?.div(&len)?;
            clamp(&mean, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)?.broadcast_as(diff.shape())?
        }
    };
    let ratio = log_w.exp()?;
    let adv = host_vec(advantages)?;
    let (pg, lower_bound) = match cfg.policy_loss {
        PolicyLoss::Ppo => clipped_surrogate(&ratio, advantages, cfg)?,
        PolicyLoss::Cispo => {
            // TRL: -clamp(coef_1, max=epsilon_high).detach() * advantages * per_token_logps
            let cap = Tensor::full(cfg.cispo_clip_max as f32, ratio.shape(), ratio.device())?;
            let weight = ratio.minimum(&cap)?.detach();
            (weight.mul(advantages)?.neg()?.mul(logp)?, None)
        }
        PolicyLoss::Sapo => {
            // TRL: -sigmoid(tau * (coef_1 - 1)) * 4 / tau * advantages, tau by the sign of A;
            // sigmoid(x) = (1 + tanh(x / 2)) / 2 has no overflow for large |x|.
            let tau: Vec<f32> = adv
                .iter()
                .map(|&a| {
                    if a > 0.0 {
                        cfg.sapo_temperature_pos as f32
                    } else {
                        cfg.sapo_temperature_neg as f32
                    }
                })
                .collect();
            let tau = Tensor::from_vec(tau, ratio.shape(), ratio.device())?;
            let half_x = ratio.affine(1.0, -1.0)?.mul(&tau)?.affine(0.5, 0.0)?;
            let gate = half_x
                .tanh()?
                .affine(1.0, 1.0)?
                .mul(&tau.recip()?.affine(2.0, 0.0)?)?;
            (gate.mul(advantages)?.neg()?, None)
        }
    };
    let stats = diagnostics(&diff, &ratio, &adv, mask, n, cfg, lower_bound)?;
    Ok((pg, stats))
}

/// `max(-A r, -A clip(r, 1 - low, 1 + high))`, bounded by `-A c` for negative
/// advantages when the dual clip `c` is set; returns the dual bound for the diagnostics.
fn clipped_surrogate(
    ratio: &Tensor,
    advantages: &Tensor,
    cfg: &PolicyLossConfig,
) -> Result<(Tensor, Option<f32>)> {
    let (lo, hi) = ((1.0 - cfg.low()) as f32, (1.0 + cfg.high()) as f32);
    let neg_adv = advantages.neg()?;
    let pg1 = neg_adv.mul(ratio)?;
    let pg2 = neg_adv.mul(&clamp(ratio, lo, hi)?)?;
    let clip1 = pg1.maximum(&pg2)?;
    match cfg.clip_ratio_c {
        Some(c) => {
            let pg3 = neg_adv.affine(c, 0.0)?;
            let negative = advantages.lt(0f32)?;
            let clip2 = clip1.minimum(&pg3)?;
            Ok((negative.where_cond(&clip2, &clip1)?, Some(c as f32)))
        }
        None => Ok((clip1, None)),
    }
}

/// The diagnostics, with TRL's meaning of the clip fraction: for `ppo` the share where the
/// clipped surrogate is active (`clip_ratio/region_mean`), for `cispo` the share of
/// positive-advantage tokens whose weight was capped (`cispo_clip_ratio`), for `sapo` 0
/// (nothing is clipped). At the sequence level a share counts sequences (each sequence's
/// token share, averaged over the non-empty sequences), as TRL's one value per sequence
/// does.
#[allow(clippy::too_many_arguments)]
fn diagnostics(
    diff: &Tensor,
    ratio: &Tensor,
    adv: &[f32],
    mask: &Tensor,
    n: usize,
    cfg: &PolicyLossConfig,
    dual: Option<f32>,
) -> Result<[f64; 5]> {
    let r = host_vec(&ratio.detach().contiguous()?)?;
    let m = host_vec(mask)?;
    let (lo, hi) = ((1.0 - cfg.low()) as f32, (1.0 + cfg.high()) as f32);
    let cap = cfg.cispo_clip_max as f32;
    let flags = |r: f32, a: f32| -> (bool, bool) {
        match cfg.policy_loss {
            PolicyLoss::Ppo => {
                let clipped = (a < 0.0 && r < lo) || (a > 0.0 && r > hi);
                // for A < 0 the loss is -A * max(r, clip(r)); the dual clip caps it at -A * c
                let lower = dual.is_some_and(|c| a < 0.0 && r.max(r.clamp(lo, hi)) > c);
                (clipped, lower)
            }
            PolicyLoss::Cispo => (a > 0.0 && r > cap, false),
            PolicyLoss::Sapo => (false, false),
        }
    };
    let width = mask.dim(1)?;
    let (mut clipped, mut lower, mut units) = (0f64, 0f64, 0f64);
    for ((rr, aa), mm) in r
        .chunks_exact(width)
        .zip(adv.chunks_exact(width))
        .zip(m.chunks_exact(width))
    {
        let (mut c, mut l, mut k) = (0f64, 0f64, 0f64);
        for ((&r, &a), &m) in rr.iter().zip(aa).zip(mm) {
            if m != 0.0 {
                let (fc, fl) = flags(r, a);
                c += f64::from(u8::from(fc));
                l += f64::from(u8::from(fl));
                k += 1.0;
            }
        }
        match cfg.importance_sampling_level {
            ImportanceSamplingLevel::Token => {
                clipped += c;
                lower += l;
                units += k;
            }
            ImportanceSamplingLevel::Sequence if k > 0.0 => {
                clipped += c / k;
                lower += l / k;
                units += 1.0;
            }
            ImportanceSamplingLevel::Sequence => {}
        }
    }
    let diff = diff.detach();
    let approxkl = scalar(&masked_mean_n(&diff.sqr()?.affine(0.5, 0.0)?, mask, n)?)?;
    let neg_kl = clamp(&diff, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)?;
    let ppo_kl = -scalar(&masked_mean_n(&neg_kl, mask, n)?)?;
    let ratio_mean = scalar(&masked_mean_n(&ratio.detach(), mask, n)?)?;
    Ok([clipped / units, lower / units, approxkl, ppo_kl, ratio_mean])
}
