//! The gate and up projections of the SwiGLU MLP with the activation,
//! `silu(x Wg^T) * (x Wu^T)`, as one autograd node.
//!
//! As two fused linears and the fused SwiGLU, `gate` and `up` (`[N, I]`, the widest
//! activations of a layer) are graph nodes, and candle's backward gives each a zero-filled
//! gradient plus an add, and `x` one more for its second consumer. Here the forward runs both
//! products and the activation through candle's storage API, keeps `gate` and `up` for the
//! backward, and the backward goes from the incoming gradient to `dgate`, `dup` (the fused
//! SwiGLU backward), `dx = dgate Wg + dup Wu` and the weights' gradients `dgate^T x`,
//! `dup^T x` (in the weights' dtype).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::Storage;

use super::elementwise::{SwiGlu, SwiGluBwd};
use super::linear::{linear_fwd, weight_grad};
use super::*;

struct GateUp {
    /// `gate` and `up`, kept by the forward for the backward.
    saved: Mutex<Option<(Tensor, Tensor)>>,
}

impl GateUp {
    fn keep(&self, gate: Storage, up: Storage, shape: &Shape) -> CResult<()> {
        let t = |s| Tensor::from_storage(s, shape.clone(), BackpropOp::none(), false);
        *self
            .saved
            .lock()
            .map_err(|_| err("gate_up: lock poisoned".into()))? = Some((t(gate), t(up)));
        Ok(())
    }
}

/// `(h, gate, up, shape)`: both products through candle's storage API, then `swiglu` of
/// them (the device's SwiGLU kernel).
fn gate_up_fwd<S: BackendStorage>(
    x: (&S, &Layout),
    wg: (&S, &Layout),
    wu: (&S, &Layout),
    swiglu: impl Fn(&S, &Layout, &S) -> CResult<(S, Shape)>,
) -> CResult<(S, S, S, Shape)> {
    let (gate, shape) = linear_fwd(x.0, x.1, wg.0, wg.1)?;
    let (up, _) = linear_fwd(x.0, x.1, wu.0, wu.1)?;
    let (h, _) = swiglu(&gate, &Layout::contiguous(shape.clone()), &up)?;
    Ok((h, gate, up, shape))
}

impl CustomOp3 for GateUp {
    fn name(&self) -> &'static str {
        "fused-gate-up-swiglu"
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
        let (h, gate, up, shape) = gate_up_fwd((s1, l1), (s2, l2), (s3, l3), |g, l, u| {
            CustomOp2::cpu_fwd(&SwiGlu, g, l, u, l)
        })?;
        self.keep(Storage::Cpu(gate), Storage::Cpu(up), &shape)?;
        Ok((h, shape))
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
        let (h, gate, up, shape) = gate_up_fwd((s1, l1), (s2, l2), (s3, l3), |g, l, u| {
            CustomOp2::cuda_fwd(&SwiGlu, g, l, u, l)
        })?;
        self.keep(Storage::Cuda(gate), Storage::Cuda(up), &shape)?;
        Ok((h, shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        wg: &Tensor,
        wu: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (gate, up) = self
            .saved
            .lock()
            .map_err(|_| err("gate_up: lock poisoned".into()))?
            .clone()
            .ok_or_else(|| err("gate_up: backward without a forward".into()))?;
        let g = grad.detach().contiguous()?;
        let both = gate.apply_op3_no_bwd(&up, &g, &SwiGluBwd)?.flatten_all()?;
        let n = gate.elem_count();
        let (i, hd) = wg.dims2()?;
        let rows = n / i.max(1);
        let dg = both.narrow(0, 0, n)?.reshape((rows, i))?;
        let du = both.narrow(0, n, n)?.reshape((rows, i))?;
        let dx = if x.track_op() {
            let wgc = wg.detach().to_dtype(g.dtype())?;
            let wuc = wu.detach().to_dtype(g.dtype())?;
            Some((dg.matmul(&wgc)? + du.matmul(&wuc)?)?.reshape(x.shape())?)
        } else {
            None
        };
        let x2 = x.detach().reshape((rows, hd))?;
        Ok((dx, weight_grad(&dg, &x2, wg)?, weight_grad(&du, &x2, wu)?))
    }
}

/// `silu(x Wg^T) * (x Wu^T)` for `x` `[.., H]` and `wg`, `wu` `[I, H]` (cast to `x`'s dtype),
/// one graph node with its own backward (see the module's doc).
pub(crate) fn gate_up_swiglu(x: &Tensor, wg: &Tensor, wu: &Tensor) -> CResult<Tensor> {
    if wg.dims() != wu.dims() {
        return Err(err(format!(
            "gate_up: gate {:?} and up {:?} projections differ",
            wg.dims(),
            wu.dims()
        )));
    }
    x.contiguous()?.apply_op3(
        wg,
        wu,
        GateUp {
            saved: Mutex::new(None),
        },
    )
}
