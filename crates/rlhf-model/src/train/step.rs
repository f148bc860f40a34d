//! One AdamW step of one parameter's owned elements, the kernels `super::adamw` dispatches
//! to: a fused host loop written straight into an f32 CPU parameter (from its whole gradient
//! or from this rank's share of it under ZeRO stage 2), the same loop on copies for other
//! dtypes and devices when the moments live on the host, two fused kernels for an f32
//! parameter on a CUDA GPU (`crate::kernels::adamw_device_step`), and tensor ops otherwise.

use candle_core::{DType, Tensor};

use super::adamw::{AdamWConfig, Moments, Slot};
use crate::error::Result;

/// Scalars of one AdamW step (the host loop's and the CUDA kernels' alike).
#[derive(Clone, Copy)]
pub(crate) struct StepScalars {
    pub(crate) lr: f32,
    pub(crate) beta1: f32,
    pub(crate) beta2: f32,
    /// `1 - beta` taken in f64 before rounding: `1 - (0.999 as f32)` is 1.3e-5 away from
    /// 0.001, which scaled every step by 6e-6 against PyTorch (that computes it in f64).
    pub(crate) one_minus_beta1: f32,
    pub(crate) one_minus_beta2: f32,
    pub(crate) eps: f32,
    pub(crate) decay_factor: f32,
    pub(crate) inv_bc1: f32,
    pub(crate) inv_sqrt_bc2: f32,
    /// Gradient multiplier (global-norm clipping), 1 for none.
    pub(crate) grad_scale: f32,
}

fn host_update(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: StepScalars) {
    for (((pi, &gi), mi), vi) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let gi = gi * k.grad_scale;
        *mi = k.beta1 * *mi + k.one_minus_beta1 * gi;
        *vi = k.beta2 * *vi + k.one_minus_beta2 * gi * gi;
        let denom = vi.sqrt() * k.inv_sqrt_bc2 + k.eps;
        *pi = *pi * k.decay_factor - k.lr * k.inv_bc1 * *mi / denom;
    }
}

/// One parameter's host step written straight into its storage (an f32 parameter on the
/// CPU with an f32 gradient): no copy of the parameter or its gradient is made, where the
/// general path copies both out and the result back in.
struct InPlaceStep<'a> {
    moments: std::cell::RefCell<(&'a mut [f32], &'a mut [f32])>,
    owned: std::ops::Range<usize>,
    k: StepScalars,
}

impl candle_core::InplaceOp2 for InPlaceStep<'_> {
    fn name(&self) -> &'static str {
        "adamw-host-step"
    }

    fn cpu_fwd(
        &self,
        s1: &mut candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        use candle_core::CpuStorage as S;
        let (S::F32(p), S::F32(g)) = (s1, s2) else {
            candle_core::bail!("adamw-host-step: f32 parameter and gradient expected");
        };
        let (Some((p0, p1)), Some((g0, g1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("adamw-host-step: contiguous parameter and gradient expected");
        };
        let (p, g) = (&mut p[p0..p1], &g[g0..g1]);
        let mut mv = self.moments.borrow_mut();
        let (m, v) = &mut *mv;
        let r = self.owned.clone();
        host_update(&mut p[r.clone()], &g[r], m, v, self.k);
        Ok(())
    }
}

/// [`InPlaceStep`] with the gradient of the owned elements only, given as a host slice.
struct OwnedStep<'a> {
    moments: std::cell::RefCell<(&'a mut [f32], &'a mut [f32])>,
    owned: std::ops::Range<usize>,
    grad: &'a [f32],
    k: StepScalars,
}

impl candle_core::InplaceOp1 for OwnedStep<'_> {
    fn name(&self) -> &'static str {
        "adamw-host-step-owned"
    }

    fn cpu_fwd(
        &self,
        s: &mut candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let candle_core::CpuStorage::F32(p) = s else {
            candle_core::bail!("adamw-host-step-owned: f32 parameter expected");
        };
        let Some((p0, p1)) = l.contiguous_offsets() else {
            candle_core::bail!("adamw-host-step-owned: contiguous parameter expected");
        };
        let mut mv = self.moments.borrow_mut();
        let (m, v) = &mut *mv;
        host_update(&mut p[p0..p1][self.owned.clone()], self.grad, m, v, self.k);
        Ok(())
    }
}

/// One parameter's gradient for a step: the whole of it (a tensor shaped like the
/// parameter), or its owned elements only (ZeRO stage 2).
pub(super) enum Grad<'a> {
    Full(&'a Tensor),
    Owned(&'a [f32]),
}

/// Steps one parameter's owned elements.
pub(super) fn step_slot(
    s: &mut Slot,
    g: Grad<'_>,
    k: StepScalars,
    c: &AdamWConfig,
    decay: f64,
    (bc1, bc2): (f64, f64),
    grad_scale: f64,
) -> Result<()> {
    let (a, b) = (s.owned.start, s.owned.end);
    let host_f32 = s.var.device().is_cpu() && s.var.dtype() == DType::F32;
    match (&mut s.moments, g) {
        (Moments::Host { m, v }, Grad::Full(g)) if host_f32 && g.device().is_cpu() => {
            // Straight into the parameter's storage: no copies.
            let g = g.to_dtype(DType::F32)?.contiguous()?;
            let op = InPlaceStep {
                moments: std::cell::RefCell::new((m.as_mut_slice(), v.as_mut_slice())),
                owned: a..b,
                k,
            };
            s.var.as_tensor().inplace_op2(&g, &op)?;
        }
        (Moments::Host { m, v }, Grad::Owned(g)) if host_f32 => {
            let op = OwnedStep {
                moments: std::cell::RefCell::new((m.as_mut_slice(), v.as_mut_slice())),
                owned: a..b,
                grad: g,
                k,
            };
            s.var.as_tensor().inplace_op1(&op)?;
        }
        (Moments::Host { m, v }, g) => {
            // f32 on the host whatever the parameter's dtype and device (a no-op for f32 on
            // the CPU).
            let mut p = s
                .var
                .as_tensor()
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            match g {
                Grad::Full(g) => {
                    let g = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    host_update(&mut p[a..b], &g[a..b], m, v, k);
                }
                Grad::Owned(g) => host_update(&mut p[a..b], g, m, v, k),
            }
            let shape = s.var.shape().clone();
            let p = Tensor::from_vec(p, shape, &candle_core::Device::Cpu)?;
            s.var
                .set(&p.to_dtype(s.var.dtype())?.to_device(s.var.device())?)?;
        }
        (Moments::Device { m, v }, g) => {
            let n = s.var.elem_count();
            let g = match g {
                Grad::Full(g) => g.to_dtype(DType::F32)?.flatten_all()?.narrow(0, a, b - a)?,
                Grad::Owned(g) => Tensor::from_slice(g, b - a, s.var.device())?,
            };
            #[cfg(feature = "cuda")]
            if s.var.device().is_cuda()
                && s.var.dtype() == DType::F32
                && m.device().same_device(s.var.device())
            {
                // Two fused kernels: new moments, then the parameter in place.
                let (nm, nv) =
                    crate::kernels::adamw_device_step(s.var.as_tensor(), &g, m, v, a..b, k)?;
                *m = nm;
                *v = nv;
                return Ok(());
            }
            let g = if grad_scale == 1.0 {
                g
            } else {
                (g * grad_scale)?
            };
            *m = ((&*m * c.beta1)? + (&g * (1.0 - c.beta1))?)?;
            *v = ((&*v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let all = s.var.as_tensor().detach().flatten_all()?;
            let p = all.narrow(0, a, b - a)?.to_dtype(DType::F32)?;
            let p = if decay != 0.0 {
                (p * (1.0 - c.lr * decay))?
            } else {
                p
            };
            let denom = ((v.sqrt()? / bc2.sqrt())? + c.eps)?;
            let update = ((&*m / denom)? * (c.lr / bc1))?;
            let mine = (p - update)?.to_dtype(s.var.dtype())?;
            let flat = if b - a == n {
                mine
            } else {
                Tensor::cat(
                    &[&all.narrow(0, 0, a)?, &mine, &all.narrow(0, b, n - b)?],
                    0,
                )?
            };
            s.var.set(&flat.reshape(s.var.shape())?)?;
        }
    }
    Ok(())
}
