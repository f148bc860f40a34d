//! AdamW's step on a GPU in two fused kernels per parameter (CUDA builds only): new moments
//! out of place, then the f32 parameter in place, with the host loop's maths
//! (train/step.rs). The composite device path it replaces launches ~15 kernels per parameter.

use super::*;

/// `[m'; v']` from the gradient and the old moments (`[k]` f32 each).
struct Moments {
    beta1: f32,
    beta2: f32,
    omb1: f32,
    omb2: f32,
    grad_scale: f32,
}

impl CustomOp3 for Moments {
    fn name(&self) -> &'static str {
        "adamw-device-moments"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        Err(err(format!("{}: CUDA only", self.name())))
    }

    fn cuda_fwd(
        &self,
        s1: &Cs,
        l1: &Layout,
        s2: &Cs,
        l2: &Layout,
        s3: &Cs,
        l3: &Layout,
    ) -> CResult<(Cs, Shape)> {
        cuda::adamw_moments(
            (s1, l1),
            (s2, l2),
            (s3, l3),
            [
                self.beta1,
                self.beta2,
                self.omb1,
                self.omb2,
                self.grad_scale,
            ],
        )
    }
}

/// Updates the owned values of an f32 parameter in place from `[m'; v']`.
struct Apply {
    owned: std::ops::Range<usize>,
    k: cuda::ApplyScalars,
}

impl candle_core::InplaceOp2 for Apply {
    fn name(&self) -> &'static str {
        "adamw-device-apply"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> CResult<()> {
        Err(err(format!("{}: CUDA only", self.name())))
    }

    fn cuda_fwd(&self, s1: &mut Cs, l1: &Layout, s2: &Cs, l2: &Layout) -> CResult<()> {
        cuda::adamw_apply((s1, l1), (s2, l2), self.owned.clone(), self.k)
    }
}

/// The scalars of one step, as `train/step.rs` computes them.
#[derive(Clone, Copy)]
pub(crate) struct AdamWScalars {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub one_minus_beta1: f32,
    pub one_minus_beta2: f32,
    pub eps: f32,
    pub decay_factor: f32,
    pub inv_bc1: f32,
    pub inv_sqrt_bc2: f32,
    pub grad_scale: f32,
}

/// One AdamW step of `param`'s `owned` values (an f32 parameter on a CUDA GPU) from their
/// gradient `g` (`[owned.len()]` f32) and moments `m`, `v`: writes the parameter in place and
/// returns the new moments. The old moments are only read (they may share storage, as fresh
/// zeros do, or be held by a checkpoint being written).
pub(crate) fn adamw_device_step(
    param: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    owned: std::ops::Range<usize>,
    k: AdamWScalars,
) -> CResult<(Tensor, Tensor)> {
    let n = owned.len();
    let mv = g.contiguous()?.apply_op3_no_bwd(
        &m.contiguous()?,
        &v.contiguous()?,
        &Moments {
            beta1: k.beta1,
            beta2: k.beta2,
            omb1: k.one_minus_beta1,
            omb2: k.one_minus_beta2,
            grad_scale: k.grad_scale,
        },
    )?;
    param.inplace_op2(
        &mv,
        &Apply {
            owned,
            k: cuda::ApplyScalars {
                lr: k.lr,
                eps: k.eps,
                decay_factor: k.decay_factor,
                inv_bc1: k.inv_bc1,
                inv_sqrt_bc2: k.inv_sqrt_bc2,
            },
        },
    )?;
    Ok((mv.narrow(0, 0, n)?, mv.narrow(0, n, n)?))
}
