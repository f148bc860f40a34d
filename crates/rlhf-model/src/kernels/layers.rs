//! The decoder's row-wise ops: masked softmax and RMSNorm, forward and backward (SwiGLU and
//! RoPE, which work element by element, are in `elementwise.rs`).

use super::*;

// ---------------------------------------------------------------------------------------------
// softmax over the last axis with an additive mask shared by groups of rows

/// `x` is `[B, G, T, S]` (any G), `mask` is `[B, T, S]`.
struct MaskedSoftmax {
    b: usize,
    t: usize,
}

fn masked_softmax_fwd<T: Real>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    b: usize,
    t: usize,
) -> CResult<(CpuStorage, Shape)> {
    let x = data::<T>(s1, l1, "masked_softmax")?;
    let mask = data::<T>(s2, l2, "masked_softmax")?;
    let s = *l1.dims().last().unwrap_or(&1);
    let rows = x.len() / s.max(1);
    if b == 0 || t == 0 || !rows.is_multiple_of(b * t) || mask.len() != b * t * s {
        return Err(err(format!(
            "masked_softmax: scores {:?} do not match mask {:?}",
            l1.dims(),
            l2.dims()
        )));
    }
    let per_batch = rows / b;
    let mut out = vec![T::zero(); x.len()];
    par_rows(&mut out, s, |r, o| {
        let row = &x[r * s..(r + 1) * s];
        let mr = (r / per_batch) * t + r % t;
        let m = &mask[mr * s..(mr + 1) * s];
        let mut mx = T::neg_infinity();
        for (oi, (&xi, &mi)) in o.iter_mut().zip(row.iter().zip(m)) {
            *oi = xi.add(mi);
            if *oi > mx {
                mx = *oi;
            }
        }
        let mut sum = T::zero();
        for oi in o.iter_mut() {
            *oi = oi.sub(mx).exp();
            sum = sum.add(*oi);
        }
        for oi in o.iter_mut() {
            *oi = oi.div(sum);
        }
    });
    Ok((T::wrap(out), l1.shape().clone()))
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "fused-masked-softmax"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &Cs, l1: &Layout, s2: &Cs, l2: &Layout) -> CResult<(Cs, Shape)> {
        cuda::masked_softmax(s1, l1, s2, l2, self.b, self.t)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        dispatch!(
            s1,
            self.name(),
            masked_softmax_fwd,
            s1,
            l1,
            s2,
            l2,
            self.b,
            self.t
        )
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _mask: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let g = res.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxBwd)?;
        Ok((Some(g), None))
    }
}

/// grad_x = y * (g - sum(g * y)) per row.
pub(super) struct SoftmaxBwd;

fn softmax_bwd<T: Real>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> CResult<(CpuStorage, Shape)> {
    let y = data::<T>(s1, l1, "softmax_bwd")?;
    let g = data::<T>(s2, l2, "softmax_bwd")?;
    let s = *l1.dims().last().unwrap_or(&1);
    let mut out = vec![T::zero(); y.len()];
    par_rows(&mut out, s, |r, o| {
        let yr = &y[r * s..(r + 1) * s];
        let gr = &g[r * s..(r + 1) * s];
        let mut dot = T::zero();
        for (&a, &b) in yr.iter().zip(gr) {
            dot = dot.add(a.mul(b));
        }
        for (oi, (&a, &b)) in o.iter_mut().zip(yr.iter().zip(gr)) {
            *oi = a.mul(b.sub(dot));
        }
    });
    Ok((T::wrap(out), l1.shape().clone()))
}

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "fused-softmax-bwd"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &Cs, l1: &Layout, s2: &Cs, l2: &Layout) -> CResult<(Cs, Shape)> {
        cuda::softmax_bwd(s1, l1, s2, l2)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        dispatch!(s1, self.name(), softmax_bwd, s1, l1, s2, l2)
    }
}

/// Softmax of `scores + mask` over the last axis; scores `[B, G, T, S]`, mask `[B, T, S]`.
pub(crate) fn masked_softmax(scores: &Tensor, mask: &Tensor) -> CResult<Tensor> {
    let (b, t, _) = mask.dims3()?;
    scores
        .contiguous()?
        .apply_op2(&mask.contiguous()?, MaskedSoftmax { b, t })
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: y = x / sqrt(mean(x^2) + eps) * w

struct RmsNorm {
    eps: f64,
}

fn inv_rms<T: Real>(row: &[T], eps: f64) -> T {
    let mut ss = 0.0f64;
    for &x in row {
        let v = x.to_f64();
        ss += v * v;
    }
    T::from_f64(1.0 / (ss / row.len() as f64 + eps).sqrt())
}

fn rms_norm_fwd<T: Real>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    eps: f64,
) -> CResult<(CpuStorage, Shape)> {
    let x = data::<T>(s1, l1, "rms_norm")?;
    let w = data::<T>(s2, l2, "rms_norm")?;
    let h = w.len();
    if h == 0 || !x.len().is_multiple_of(h) {
        return Err(err(format!(
            "rms_norm: input {:?} vs weight {:?}",
            l1.dims(),
            l2.dims()
        )));
    }
    let mut out = vec![T::zero(); x.len()];
    par_rows(&mut out, h, |r, o| {
        let row = &x[r * h..(r + 1) * h];
        let inv = inv_rms(row, eps);
        for ((oi, &xi), &wi) in o.iter_mut().zip(row).zip(w) {
            *oi = xi.mul(inv).mul(wi);
        }
    });
    Ok((T::wrap(out), l1.shape().clone()))
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &Cs, l1: &Layout, s2: &Cs, l2: &Layout) -> CResult<(Cs, Shape)> {
        cuda::rms_norm(s1, l1, s2, l2, self.eps)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        dispatch!(s1, self.name(), rms_norm_fwd, s1, l1, s2, l2, self.eps)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.contiguous()?;
        let gx = x.apply_op3_no_bwd(w, &g, &RmsNormBwdX { eps: self.eps })?;
        let gw = x.apply_op2_no_bwd(&g, &RmsNormBwdW { eps: self.eps })?;
        Ok((Some(gx), Some(gw)))
    }
}

/// grad_x = r * (g*w - xhat * mean(g*w*xhat)), xhat = x * r.
struct RmsNormBwdX {
    eps: f64,
}

fn rms_norm_bwd_x<T: Real>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
    eps: f64,
) -> CResult<(CpuStorage, Shape)> {
    let x = data::<T>(s1, l1, "rms_norm_bwd")?;
    let w = data::<T>(s2, l2, "rms_norm_bwd")?;
    let g = data::<T>(s3, l3, "rms_norm_bwd")?;
    let h = w.len();
    let mut out = vec![T::zero(); x.len()];
    par_rows(&mut out, h, |r, o| {
        let xr = &x[r * h..(r + 1) * h];
        let gr = &g[r * h..(r + 1) * h];
        let inv = inv_rms(xr, eps);
        let mut dot = 0.0f64;
        for ((&xi, &gi), &wi) in xr.iter().zip(gr).zip(w) {
            dot += gi.mul(wi).mul(xi.mul(inv)).to_f64();
        }
        let mean = T::from_f64(dot / h as f64);
        for (((oi, &xi), &gi), &wi) in o.iter_mut().zip(xr).zip(gr).zip(w) {
            *oi = inv.mul(gi.mul(wi).sub(xi.mul(inv).mul(mean)));
        }
    });
    Ok((T::wrap(out), l1.shape().clone()))
}

impl CustomOp3 for RmsNormBwdX {
    fn name(&self) -> &'static str {
        "fused-rms-norm-bwd-x"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &Cs,
        l1: &Layout,
        s2: &Cs,
        l2: &Layout,
        s3: &Cs,
        l3: &Layout,
    ) -> CResult<(Cs, Shape)> {
        cuda::rms_norm_bwd_x(s1, l1, s2, l2, s3, l3, self.eps)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        dispatch!(
            s1,
            self.name(),
            rms_norm_bwd_x,
            s1,
            l1,
            s2,
            l2,
            s3,
            l3,
            self.eps
        )
    }
}

/// grad_w = sum over rows of g * xhat.
struct RmsNormBwdW {
    eps: f64,
}

fn rms_norm_bwd_w<T: Real>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    eps: f64,
) -> CResult<(CpuStorage, Shape)> {
    let x = data::<T>(s1, l1, "rms_norm_bwd_w")?;
    let g = data::<T>(s2, l2, "rms_norm_bwd_w")?;
    let h = *l1.dims().last().unwrap_or(&1);
    let mut acc = vec![0.0f64; h];
    for (xr, gr) in x.chunks(h).zip(g.chunks(h)) {
        let inv = inv_rms(xr, eps).to_f64();
        for ((a, &xi), &gi) in acc.iter_mut().zip(xr).zip(gr) {
            *a += gi.to_f64() * xi.to_f64() * inv;
        }
    }
    let out: Vec<T> = acc.into_iter().map(T::from_f64).collect();
    Ok((T::wrap(out), Shape::from(h)))
}

impl CustomOp2 for RmsNormBwdW {
    fn name(&self) -> &'static str {
        "fused-rms-norm-bwd-w"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &Cs, l1: &Layout, s2: &Cs, l2: &Layout) -> CResult<(Cs, Shape)> {
        cuda::rms_norm_bwd_w(s1, l1, s2, l2, self.eps)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        dispatch!(s1, self.name(), rms_norm_bwd_w, s1, l1, s2, l2, self.eps)
    }
}

/// RMSNorm over the last axis with weight `w`.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> CResult<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps })
}
