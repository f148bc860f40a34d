//! AdamW's step on a GPU in two fused kernels per parameter (CUDA builds only): new moments
//! out of place, then the f32 parameter in place, with the host loop's maths
//! (train/step.rs). The composite device path it replaces launches ~15 kernels per parameter.

use super::*;
use crate::train::StepScalars;

/// `[m'; v']` from the gradient and the old moments (`[k]` f32 each).
struct Moments {
    k: StepScalars,
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
        cuda::adamw_moments((s1, l1), (s2, l2), (s3, l3), &self.k)
    }
}

/// Updates the owned values of an f32 parameter in place from `[m'; v']`.
struct Apply {
    owned: std::ops::Range<usize>,
    k: StepScalars,
}

impl candle_core::InplaceOp2 for Apply {
    fn name(&self) -> &'static str {
        "adamw-device-apply"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> CResult<()> {
        Err(err(format!("{}: CUDA only", self.name())))
    }

    fn cuda_fwd(&self, s1: &mut Cs, l1: &Layout, s2: &Cs, l2: &Layout) -> CResult<()> {
        cuda::adamw_apply((s1, l1), (s2, l2), self.owned.clone(), &self.k)
    }
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
    k: StepScalars,
) -> CResult<(Tensor, Tensor)> {
    let n = owned.len();
    let mv =
        g.contiguous()?
            .apply_op3_no_bwd(&m.contiguous()?, &v.contiguous()?, &Moments { k })?;
    param.inplace_op2(&mv, &Apply { owned, k })?;
    Ok((mv.narrow(0, 0, n)?, mv.narrow(0, n, n)?))
}
