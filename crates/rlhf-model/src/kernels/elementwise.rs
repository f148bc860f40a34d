//! The decoder's element-wise ops: SwiGLU and RoPE (rotate-half), forward and backward.

use super::*;

// ---------------------------------------------------------------------------------------------
// SwiGLU: silu(gate) * up

pub(super) struct SwiGlu;

fn sigmoid<T: Real>(a: T) -> T {
    T::from_f64(1.0).div(T::from_f64(1.0).add(T::zero().sub(a).exp()))
}

fn swiglu_fwd<T: Real>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> CResult<(CpuStorage, Shape)> {
    let a = data::<T>(s1, l1, "swiglu")?;
    let u = data::<T>(s2, l2, "swiglu")?;
    if a.len() != u.len() {
        return Err(err(format!(
            "swiglu: gate {:?} vs up {:?}",
            l1.dims(),
            l2.dims()
        )));
    }
    let mut out = vec![T::zero(); a.len()];
    par_rows(&mut out, 4096.min(a.len().max(1)), |r, o| {
        let base = r * 4096.min(a.len().max(1));
        for (k, oi) in o.iter_mut().enumerate() {
            let ai = a[base + k];
            *oi = ai.mul(sigmoid(ai)).mul(u[base + k]);
        }
    });
    Ok((T::wrap(out), l1.shape().clone()))
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "fused-swiglu"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &Cs, l1: &Layout, s2: &Cs, l2: &Layout) -> CResult<(Cs, Shape)> {
        cuda::swiglu(s1, l1, s2, l2)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        dispatch!(s1, self.name(), swiglu_fwd, s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.contiguous()?;
        let both = gate.apply_op3_no_bwd(up, &g, &SwiGluBwd)?;
        let n = gate.elem_count();
        let flat = both.flatten_all()?;
        let dg = flat.narrow(0, 0, n)?.reshape(gate.shape())?;
        let du = flat.narrow(0, n, n)?.reshape(up.shape())?;
        Ok((Some(dg), Some(du)))
    }
}

/// Gradients of gate and up, stacked: `[2, ..]`.
pub(super) struct SwiGluBwd;

fn swiglu_bwd<T: Real>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> CResult<(CpuStorage, Shape)> {
    let a = data::<T>(s1, l1, "swiglu_bwd")?;
    let u = data::<T>(s2, l2, "swiglu_bwd")?;
    let g = data::<T>(s3, l3, "swiglu_bwd")?;
    let n = a.len();
    let mut out = vec![T::zero(); 2 * n];
    let (dg, du) = out.split_at_mut(n);
    let chunk = 4096.min(n.max(1));
    par_rows(dg, chunk, |r, o| {
        let base = r * chunk;
        for (k, oi) in o.iter_mut().enumerate() {
            let ai = a[base + k];
            let s = sigmoid(ai);
            let ds = s.mul(T::from_f64(1.0).add(ai.mul(T::from_f64(1.0).sub(s))));
            *oi = g[base + k].mul(u[base + k]).mul(ds);
        }
    });
    par_rows(du, chunk, |r, o| {
        let base = r * chunk;
        for (k, oi) in o.iter_mut().enumerate() {
            let ai = a[base + k];
            *oi = g[base + k].mul(ai.mul(sigmoid(ai)));
        }
    });
    Ok((T::wrap(out), Shape::from(2 * n)))
}

impl CustomOp3 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "fused-swiglu-bwd"
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
        cuda::swiglu_bwd(s1, l1, s2, l2, s3, l3)
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
        dispatch!(s1, self.name(), swiglu_bwd, s1, l1, s2, l2, s3, l3)
    }
}

/// `silu(gate) * up`.
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

// ---------------------------------------------------------------------------------------------
// RoPE (rotate-half convention): x [B, H, T, D], cos/sin [B, T, D/2]

pub(super) struct Rope {
    /// Rotate by -theta (the transpose), for the backward pass.
    pub(super) inverse: bool,
}

#[allow(clippy::too_many_arguments)]
fn rope_fwd<T: Real>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
    inverse: bool,
) -> CResult<(CpuStorage, Shape)> {
    let x = data::<T>(s1, l1, "rope")?;
    let cos = data::<T>(s2, l2, "rope")?;
    let sin = data::<T>(s3, l3, "rope")?;
    let dims = l1.dims();
    let [b, h, t, d] = dims else {
        return Err(err(format!("rope: expected [B, H, T, D], got {dims:?}")));
    };
    let (b, h, t, d) = (*b, *h, *t, *d);
    let half = d / 2;
    if cos.len() != b * t * half || sin.len() != cos.len() || d % 2 != 0 {
        return Err(err(format!("rope: x {dims:?} vs cos {:?}", l2.dims())));
    }
    let mut out = vec![T::zero(); x.len()];
    par_rows(&mut out, d, |r, o| {
        let ti = r % t;
        let bi = r / (h * t);
        let cs = &cos[(bi * t + ti) * half..(bi * t + ti + 1) * half];
        let sn = &sin[(bi * t + ti) * half..(bi * t + ti + 1) * half];
        let xr = &x[r * d..(r + 1) * d];
        for i in 0..half {
            let (x1, x2) = (xr[i], xr[i + half]);
            let (c, s) = (cs[i], sn[i]);
            if inverse {
                o[i] = x1.mul(c).add(x2.mul(s));
                o[i + half] = x2.mul(c).sub(x1.mul(s));
            } else {
                o[i] = x1.mul(c).sub(x2.mul(s));
                o[i + half] = x2.mul(c).add(x1.mul(s));
            }
        }
    });
    Ok((T::wrap(out), l1.shape().clone()))
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "fused-rope"
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
        cuda::rope(s1, l1, s2, l2, s3, l3, self.inverse)
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
            rope_fwd,
            s1,
            l1,
            s2,
            l2,
            s3,
            l3,
            self.inverse
        )
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = grad.contiguous()?.apply_op3_no_bwd(
            cos,
            sin,
            &Rope {
                inverse: !self.inverse,
            },
        )?;
        Ok((Some(g), None, None))
    }
}

/// Rotary embedding with half-width tables `cos`, `sin` `[B, T, D/2]`.
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> CResult<Tensor> {
    x.contiguous()?.apply_op3(
        &cos.contiguous()?,
        &sin.contiguous()?,
        Rope { inverse: false },
    )
}
