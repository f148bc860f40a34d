//! Fused CPU kernels for the per-token policy and value losses.
//!
//! On the CPU every candle op is a separate pass over memory (and scalar clamps
//! take a strided path), so the clipped surrogate's ~30 ops cost more than the
//! math. These custom ops compute the per-token loss matrix in one pass and
//! give candle the exact derivative in `bwd`, so the result stays in the
//! autograd graph. Ties in `max`/`min`/`clamp` split the gradient in half, as
//! candle's own ops (and PyTorch's) do, so both paths agree to rounding; the
//! op-chain versions in `loss.rs` remain the path for other devices and are
//! tested against these.

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

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

fn slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    let data = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{what}: the fused loss needs contiguous inputs"),
    }
}

fn host(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

/// Per-token clipped surrogate; inputs `(logp, old_logp, advantages)`.
struct PgOp(PgParams);

impl CustomOp3 for PgOp {
    fn name(&self) -> &'static str {
        "rlhf-algo-policy-loss"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let lp = slice(s1, l1, "logp")?;
        let old = slice(s2, l2, "old_logp")?;
        let adv = slice(s3, l3, "advantages")?;
        let out: Vec<f32> = lp
            .iter()
            .zip(old)
            .zip(adv)
            .map(|((&lp, &o), &a)| pg_elem(lp, o, a, &self.0).0)
            .collect();
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        logp: &Tensor,
        old: &Tensor,
        adv: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (lp, o, a, g) = (host(logp)?, host(old)?, host(adv)?, host(grad_res)?);
        let grad: Vec<f32> = (0..lp.len())
            .map(|i| g[i] * pg_elem(lp[i], o[i], a[i], &self.0).1)
            .collect();
        // Old log-probs and advantages are rollout constants in PPO.
        let grad = Tensor::from_vec(grad, logp.shape(), logp.device())?;
        Ok((Some(grad), None, None))
    }
}

/// Per-token clipped value loss; inputs `(vpreds, old_values, returns)`.
struct VfOp(f32);

impl CustomOp3 for VfOp {
    fn name(&self) -> &'static str {
        "rlhf-algo-value-loss"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let v = slice(s1, l1, "vpreds")?;
        let old = slice(s2, l2, "old_values")?;
        let r = slice(s3, l3, "returns")?;
        let out: Vec<f32> = v
            .iter()
            .zip(old)
            .zip(r)
            .map(|((&v, &o), &r)| vf_elem(v, o, r, self.0).0)
            .collect();
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        vpreds: &Tensor,
        old: &Tensor,
        ret: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (v, o, r, g) = (host(vpreds)?, host(old)?, host(ret)?, host(grad_res)?);
        let grad: Vec<f32> = (0..v.len())
            .map(|i| g[i] * vf_elem(v[i], o[i], r[i], self.0).1)
            .collect();
        let grad = Tensor::from_vec(grad, vpreds.shape(), vpreds.device())?;
        Ok((Some(grad), None, None))
    }
}

/// Per-token policy loss matrix and the masked diagnostics
/// `(clipfrac, clipfrac_lower, approxkl, ppo_kl, ratio_mean)`.
pub(crate) fn policy_terms(
    old_logp: &Tensor,
    logp: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    p: PgParams,
) -> Result<(Tensor, [f64; 5])> {
    let (lp, o, a, m) = (
        host(&logp.detach())?,
        host(old_logp)?,
        host(advantages)?,
        host(mask)?,
    );
    let mut acc = [0f64; 5];
    let mut n = 0f64;
    for i in 0..lp.len() {
        if m[i] == 0.0 {
            continue;
        }
        n += 1.0;
        let diff = lp[i] - o[i];
        let nk = diff.clamp(-20.0, 20.0);
        let ratio = nk.exp();
        let na = -a[i];
        let pg1 = na * ratio;
        let pg2 = na * ratio.max(p.lo).min(p.hi);
        let c1 = pg1.max(pg2);
        acc[0] += f64::from(u8::from(pg2 > pg1));
        if let Some(c) = p.dual {
            acc[1] += f64::from(u8::from(a[i] < 0.0 && c1 > na * c));
        }
        acc[2] += 0.5 * f64::from(diff) * f64::from(diff);
        acc[3] -= f64::from(nk);
        acc[4] += f64::from(ratio);
    }
    let stats = acc.map(|s| s / n);
    let pg = logp.contiguous()?.apply_op3(
        &old_logp.contiguous()?,
        &advantages.contiguous()?,
        PgOp(p),
    )?;
    Ok((pg, stats))
}

/// Per-token (unhalved) value loss matrix and the masked clip fraction.
pub(crate) fn value_terms(
    vpreds: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    mask: &Tensor,
    cliprange_value: f32,
) -> Result<(Tensor, f64)> {
    let (v, o, r, m) = (
        host(&vpreds.detach())?,
        host(old_values)?,
        host(returns)?,
        host(mask)?,
    );
    let (mut clipped, mut n) = (0f64, 0f64);
    for i in 0..v.len() {
        if m[i] != 0.0 {
            n += 1.0;
            clipped += f64::from(u8::from(vf_elem(v[i], o[i], r[i], cliprange_value).2));
        }
    }
    let l = vpreds.contiguous()?.apply_op3(
        &old_values.contiguous()?,
        &returns.contiguous()?,
        VfOp(cliprange_value),
    )?;
    Ok((l, clipped / n))
}
