//! Results computed outside the autograd graph, attached to it with a backward of our own.
//!
//! Two memory savers need this: chunked log-probs (the `[B, T, V]` logits never exist at once,
//! in forward or backward) and activation checkpointing (a decoder layer keeps only its input
//! for backward and recomputes the rest). In both, the forward runs chunk by chunk with no
//! graph kept, and the backward recomputes what it needs. candle has no public way to give a
//! tensor a backward closure, but a custom op may compute its output however it likes: the op
//! here hands back the precomputed result (one copy of the output, which is small next to
//! what is saved) and runs the caller's closure as its `bwd`. Only tensor ops are used on
//! either side, so the same code runs on every device candle has.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Storage, Tensor};

use crate::error::Result;

type Bwd1 = dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Option<Tensor>> + Send + Sync;
type Bwd2 = dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)>
    + Send
    + Sync;

type Grads3 = (Option<Tensor>, Option<Tensor>, Option<Tensor>);
type Bwd3 = dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> candle_core::Result<Grads3> + Send + Sync;

/// The precomputed output, taken by the one forward call candle makes.
struct Out(Mutex<Option<Tensor>>);

impl Out {
    fn new(out: &Tensor) -> Result<Self> {
        // A fresh contiguous copy starting at offset 0: its whole storage is the output.
        let out = out.detach().contiguous()?.copy()?;
        Ok(Self(Mutex::new(Some(out))))
    }

    fn take(&self, op: &str) -> candle_core::Result<Tensor> {
        self.0
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{op}: lock poisoned")))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{op}: forward called twice")))
    }

    fn cpu(&self, op: &str) -> candle_core::Result<(CpuStorage, Shape)> {
        let t = self.take(op)?;
        let (s, l) = t.storage_and_layout();
        match &*s {
            Storage::Cpu(s) => Ok((s.try_clone(l)?, l.shape().clone())),
            _ => Err(candle_core::Error::Msg(format!(
                "{op}: the result is not on the CPU"
            ))),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, op: &str) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let t = self.take(op)?;
        let (s, l) = t.storage_and_layout();
        match &*s {
            Storage::Cuda(s) => Ok((s.try_clone(l)?, l.shape().clone())),
            _ => Err(candle_core::Error::Msg(format!(
                "{op}: the result is not on a CUDA device"
            ))),
        }
    }
}

struct Replay1 {
    name: &'static str,
    out: Out,
    bwd: Box<Bwd1>,
}

impl CustomOp1 for Replay1 {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.out.cpu(self.name)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.out.cuda(self.name)
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        (self.bwd)(arg, grad)
    }
}

struct Replay2 {
    name: &'static str,
    out: Out,
    bwd: Box<Bwd2>,
}

impl CustomOp2 for Replay2 {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.out.cpu(self.name)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.out.cuda(self.name)
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        (self.bwd)(a, b, grad)
    }
}

struct Replay3 {
    name: &'static str,
    out: Out,
    bwd: Box<Bwd3>,
}

impl CustomOp3 for Replay3 {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.out.cpu(self.name)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.out.cuda(self.name)
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Grads3> {
        (self.bwd)(a, b, c, grad)
    }
}

/// `out` (computed from `arg` with no graph) as a tensor whose backward is
/// `bwd(arg, grad_out) -> grad_arg`. Without a graph to join (`arg` tracks nothing), `out`
/// itself.
pub(crate) fn attach1(
    name: &'static str,
    arg: &Tensor,
    out: &Tensor,
    bwd: impl Fn(&Tensor, &Tensor) -> candle_core::Result<Option<Tensor>> + Send + Sync + 'static,
) -> Result<Tensor> {
    if !arg.track_op() {
        return Ok(out.clone());
    }
    let op = Replay1 {
        name,
        out: Out::new(out)?,
        bwd: Box::new(bwd),
    };
    Ok(arg.apply_op1(op)?)
}

/// As [`attach1`] for a result of two tensors.
pub(crate) fn attach2(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    out: &Tensor,
    bwd: impl Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)>
        + Send
        + Sync
        + 'static,
) -> Result<Tensor> {
    if !a.track_op() && !b.track_op() {
        return Ok(out.clone());
    }
    let op = Replay2 {
        name,
        out: Out::new(out)?,
        bwd: Box::new(bwd),
    };
    Ok(a.apply_op2(b, op)?)
}

/// As [`attach1`] for a result of three tensors.
pub(crate) fn attach3(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    out: &Tensor,
    bwd: impl Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> candle_core::Result<Grads3>
        + Send
        + Sync
        + 'static,
) -> Result<Tensor> {
    if !a.track_op() && !b.track_op() && !c.track_op() {
        return Ok(out.clone());
    }
    let op = Replay3 {
        name,
        out: Out::new(out)?,
        bwd: Box::new(bwd),
    };
    Ok(a.apply_op3(b, c, op)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn the_attached_result_carries_the_given_backward() {
        let x = Var::new(&[1.0f32, 2.0, 3.0], &Device::Cpu).unwrap();
        // y = x^2 computed with no graph; backward 2 x g.
        let y_plain = x.as_tensor().detach().sqr().unwrap();
        let y = attach1("square", x.as_tensor(), &y_plain, |x, g| {
            Ok(Some((x * 2.0)?.mul(g)?))
        })
        .unwrap();
        assert_eq!(y.to_vec1::<f32>().unwrap(), vec![1.0, 4.0, 9.0]);
        let grads = (y * 3.0).unwrap().sum_all().unwrap().backward().unwrap();
        let g = grads.get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(g, vec![6.0, 12.0, 18.0]);
    }

    #[test]
    fn without_a_graph_the_result_is_returned_as_is() {
        let x = Tensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
        let y = attach1("id", &x, &x, |_, _| Ok(None)).unwrap();
        assert!(!y.track_op());
        assert_eq!(y.to_vec1::<f32>().unwrap(), vec![1.0, 2.0]);
    }
}
