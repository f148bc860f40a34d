//! Fused CPU kernels for the per-token policy and value losses.
//!
//! On the CPU every candle op is a separate pass over memory (and scalar clamps
//! take a strided path), so the clipped surrogate's ~30 ops cost more than the
//! math. Here one pass over host copies computes the per-token loss, its exact
//! derivative and the diagnostics; a custom op hands the loss to candle and the
//! derivative to its backward pass, so the result stays in the autograd graph. Ties in `max`/`min`/`clamp` split the gradient in half, as
//! candle's own ops (and PyTorch's) do, so both paths agree to rounding; the
//! op-chain versions in `loss.rs` remain the path for other devices and are
//! tested against these.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use crate::error::Result;

/// Loss and its derivative w.r.t. `logp` for one token of the clipped surrogate.
#[inline]
fn pg_elem(lp: f32, old: f32, a: f32, p: &PgParams) -> (f32, f32) {
    let diff = lp - old;
    let (nk, dnk) = pick_clamp(diff, -20.0, 20.0, 1.0);
    let ratio = nk.exp();
    let dratio = ratio * dnk;
    let na = -a;
    let pg1 = na * ratio;
    let d1 = na * dratio;
    let (cr, dcr) = pick_clamp(ratio, p.lo, p.hi, dratio);
    let pg2 = na * cr;
    let d2 = na * dcr;
    let (c1, dc1) = pick_max((pg1, d1), (pg2, d2));
    match p.dual {
        Some(c) if a < 0.0 => {
            let pg3 = na * c;
            // min(c1, pg3) where pg3 does not depend on logp.
            if c1 < pg3 {
                (c1, dc1)
            } else if c1 > pg3 {
                (pg3, 0.0)
            } else {
                (c1, 0.5 * dc1)
            }
        }
        _ => (c1, dc1),
    }
}

/// `clamp(x, lo, hi)` as `min(max(x, lo), hi)` with candle's tie rule; `dx` is
/// the derivative of `x`.
#[inline]
fn pick_clamp(x: f32, lo: f32, hi: f32, dx: f32) -> (f32, f32) {
    let (m, dm) = if x > lo {
        (x, dx)
    } else if x < lo {
        (lo, 0.0)
    } else {
        (x, 0.5 * dx)
    };
    if m < hi {
        (m, dm)
    } else if m > hi {
        (hi, 0.0)
    } else {
        (m, 0.5 * dm)
    }
}

#[inline]
fn pick_max(a: (f32, f32), b: (f32, f32)) -> (f32, f32) {
    if a.0 > b.0 {
        a
    } else if b.0 > a.0 {
        b
    } else {
        (a.0, 0.5 * (a.1 + b.1))
    }
}

/// Unreduced value loss `max((v - R)^2, (clip(v, old ± c) - R)^2)` for one token,
/// its derivative w.r.t. `v`, and whether the clipped term was larger.
#[inline]
fn vf_elem(v: f32, old: f32, r: f32, c: f32) -> (f32, f32, bool) {
    let lo = old - c;
    let hi = old + c;
    // verl clip_by_value: max(min(v, hi), lo)
    let (m, dm) = if v < hi {
        (v, 1.0)
    } else if v > hi {
        (hi, 0.0)
    } else {
        (v, 0.5)
    };
    let (vc, dvc) = if m > lo {
        (m, dm)
    } else if m < lo {
        (lo, 0.0)
    } else {
        (m, 0.5 * dm)
    };
    let e1 = v - r;
    let e2 = vc - r;
    let l1 = e1 * e1;
    let l2 = e2 * e2;
    let (l, d) = pick_max((l1, 2.0 * e1), (l2, 2.0 * e2 * dvc));
    (l, d, l2 > l1)
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct PgParams {
    pub lo: f32,
    pub hi: f32,
    pub dual: Option<f32>,
}

/// A precomputed per-token function of one input and its derivative: the
/// forward pass hands out the values, the backward pass multiplies the incoming
/// gradient by the derivative. Computing both in the caller's single pass
/// avoids evaluating `exp` twice per token.
struct Precomputed {
    name: &'static str,
    values: Vec<f32>,
    derivative: Vec<f32>,
}

impl CustomOp1 for Precomputed {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(self.values.clone()), l.shape().clone()))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let d = Tensor::from_vec(self.derivative.clone(), arg.shape(), arg.device())?;
        Ok(Some(grad_res.mul(&d)?))
    }
}

/// Per-token policy loss matrix (in the autograd graph of `logp_t`) and the
/// masked diagnostics `(clipfrac, clipfrac_lower, approxkl, ppo_kl, ratio_mean)`
/// from host copies of the inputs. Old log-probs and advantages are constants.
pub(crate) fn policy_terms(
    logp_t: &Tensor,
    lp: &[f32],
    old: &[f32],
    adv: &[f32],
    mask: &[f32],
    p: PgParams,
) -> Result<(Tensor, [f64; 5])> {
    let mut values = vec![0f32; lp.len()];
    let mut derivative = vec![0f32; lp.len()];
    let mut acc = [0f64; 5];
    let mut n = 0f64;
    for i in 0..lp.len() {
        let (v, d) = pg_elem(lp[i], old[i], adv[i], &p);
        values[i] = v;
        derivative[i] = d;
        if mask[i] == 0.0 {
            continue;
        }
        n += 1.0;
        let diff = lp[i] - old[i];
        let nk = diff.clamp(-20.0, 20.0);
        let ratio = nk.exp();
        let na = -adv[i];
        let pg1 = na * ratio;
        let pg2 = na * ratio.max(p.lo).min(p.hi);
        acc[0] += f64::from(u8::from(pg2 > pg1));
        if let Some(c) = p.dual {
            acc[1] += f64::from(u8::from(adv[i] < 0.0 && pg1.max(pg2) > na * c));
        }
        acc[2] += 0.5 * f64::from(diff) * f64::from(diff);
        acc[3] -= f64::from(nk);
        acc[4] += f64::from(ratio);
    }
    let op = Precomputed {
        name: "rlhf-algo-policy-loss",
        values,
        derivative,
    };
    Ok((logp_t.apply_op1(op)?, acc.map(|s| s / n)))
}

/// Per-token (unhalved) value loss matrix (in the autograd graph of
/// `vpreds_t`) and the masked clip fraction, from host copies of the inputs.
pub(crate) fn value_terms(
    vpreds_t: &Tensor,
    v: &[f32],
    old: &[f32],
    ret: &[f32],
    mask: &[f32],
    cliprange_value: f32,
) -> Result<(Tensor, f64)> {
    let mut values = vec![0f32; v.len()];
    let mut derivative = vec![0f32; v.len()];
    let (mut clipped, mut n) = (0f64, 0f64);
    for i in 0..v.len() {
        let (l, d, c) = vf_elem(v[i], old[i], ret[i], cliprange_value);
        values[i] = l;
        derivative[i] = d;
        if mask[i] != 0.0 {
            n += 1.0;
            clipped += f64::from(u8::from(c));
        }
    }
    let op = Precomputed {
        name: "rlhf-algo-value-loss",
        values,
        derivative,
    };
    Ok((vpreds_t.apply_op1(op)?, clipped / n))
}
