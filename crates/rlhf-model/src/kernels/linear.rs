//! A trainable dense layer's product `y = x W^T` as one autograd node.
//!
//! Composed from candle's ops, the product is a reshape, a cast of the master weight, a
//! transpose, the matmul and a reshape back: five graph nodes, and candle's backward adds a
//! zero-filled gradient and an add for the input of each, three of them weight-sized and two
//! activation-sized (for an MLP projection or the LM head, the largest tensors of a step).
//! This op runs the same matmul through candle's storage API (the cast included, so no copy
//! of the output is kept for the graph) and computes both gradients itself with two matmuls:
//! `dx = g W` and `dW = g^T x`, the weight's gradient cast to the weight's dtype (f32 master
//! weights under mixed precision). It needs no kernel of its own, so every device and dtype
//! candle's matmul takes runs it.

use candle_core::backend::BackendStorage;

use super::*;

struct LinearOp;

/// `y = x W^T` for `x` `[.., in]` (contiguous) and `w` `[out, in]` in any float dtype: the
/// weight is cast to `x`'s dtype on the way.
pub(super) fn linear_fwd<S: BackendStorage>(
    x: &S,
    xl: &Layout,
    w: &S,
    wl: &Layout,
) -> CResult<(S, Shape)> {
    let dims = xl.dims();
    let in_dim = *dims
        .last()
        .ok_or_else(|| err("linear: the input is a scalar".into()))?;
    let rows: usize = dims[..dims.len() - 1].iter().product();
    let (out_dim, w_in) = wl.shape().dims2()?;
    if w_in != in_dim {
        return Err(err(format!(
            "linear: input {dims:?} does not match weight [{out_dim}, {w_in}]"
        )));
    }
    let (x_start, _) = xl
        .contiguous_offsets()
        .ok_or_else(|| err("linear: the input must be contiguous".into()))?;
    let x2 = Layout::contiguous_with_offset((rows, in_dim), x_start);
    let y = if w.dtype() == x.dtype() {
        let (w_start, _) = wl
            .contiguous_offsets()
            .ok_or_else(|| err("linear: the weight must be contiguous".into()))?;
        let wt = Layout::contiguous_with_offset((out_dim, in_dim), w_start).transpose(0, 1)?;
        x.matmul(w, (1, rows, out_dim, in_dim), &x2, &wt)?
    } else {
        let wc = w.to_dtype(wl, x.dtype())?;
        let wt = Layout::contiguous((out_dim, in_dim)).transpose(0, 1)?;
        x.matmul(&wc, (1, rows, out_dim, in_dim), &x2, &wt)?
    };
    let mut out = dims.to_vec();
    let last = out.len() - 1;
    out[last] = out_dim;
    Ok((y, Shape::from(out)))
}

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "fused-linear"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &Cs, l1: &Layout, s2: &Cs, l2: &Layout) -> CResult<(Cs, Shape)> {
        linear_fwd(s1, l1, s2, l2)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        linear_fwd(s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let in_dim = w.dim(1)?;
        let out_dim = w.dim(0)?;
        let rows = x.elem_count() / in_dim.max(1);
        let g = grad.detach().reshape((rows, out_dim))?;
        let dx = if x.track_op() {
            let wc = w.detach().to_dtype(g.dtype())?;
            Some(g.matmul(&wc)?.reshape(x.shape())?)
        } else {
            None
        };
        let dw = weight_grad(&g, &x.detach().reshape((rows, in_dim))?, w)?;
        Ok((dx, dw))
    }
}

/// The gradient of a trainable weight `w` `[out, in]` of a product `x W^T`, from the output's
/// gradient `d` `[rows, out]` and the input `x` `[rows, in]`: `d^T x` in `w`'s dtype (f32
/// master weights under mixed precision). `None` for a frozen weight.
pub(super) fn weight_grad(d: &Tensor, x: &Tensor, w: &Tensor) -> CResult<Option<Tensor>> {
    if !w.track_op() {
        return Ok(None);
    }
    Ok(Some(d.t()?.matmul(x)?.to_dtype(w.dtype())?))
}

/// `x W^T` for `x` `[.., in]` and `w` `[out, in]` (cast to `x`'s dtype), one graph node with
/// its own backward (see the module's doc).
pub(crate) fn linear(x: &Tensor, w: &Tensor) -> CResult<Tensor> {
    x.contiguous()?.apply_op2(w, LinearOp)
}
