//! The LM head of a training step, `log_softmax(scale h W^T)` at the targets (and the
//! entropy), as one autograd node.
//!
//! Composed, the `[N, V]` logits are a graph node between the product and the log-prob
//! kernel, and candle's backward gives them a zero-filled gradient plus an add (and one more
//! for each reshape on the way): at a 152k vocabulary each such pass moves gigabytes, more
//! than the kernels themselves. Here the forward keeps the logits outside the graph, and the
//! backward turns the incoming gradients into the logits' gradient with the fused kernels,
//! then into `dh = dz W` and `dW = dz^T h` with two matmuls.

use super::linear::weight_grad;
use super::logits::{Entropy, EntropyBwd, LogProbs, LogProbsBwd};
use super::*;
use crate::replay;

/// Log-probs of `targets` `[..]` (and, with `with_entropy`, entropies) under the head `w`
/// `[V, H]` (cast to `h`'s dtype) for hidden states `h` `[.., H]`, at `scale` (1 /
/// temperature); in f32 for bf16 `h`. Differentiable in `h` and `w`.
pub(crate) fn lm_head(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    scale: f64,
    with_entropy: bool,
) -> CResult<(Tensor, Option<Tensor>)> {
    let dims = h.dims();
    let hd = *dims
        .last()
        .ok_or_else(|| err("lm_head: the hidden states are a scalar".into()))?;
    let lead = dims[..dims.len() - 1].to_vec();
    let n: usize = lead.iter().product();
    if targets.elem_count() != n || w.dim(1)? != hd {
        return Err(err(format!(
            "lm_head: hidden {dims:?}, head {:?} and targets {:?} do not fit together",
            w.dims(),
            targets.dims()
        )));
    }
    let h2 = h.detach().contiguous()?.reshape((n, hd))?;
    let wc = w.detach().to_dtype(h.dtype())?;
    let logits = h2.matmul(&wc.t()?)?;
    let t = targets.to_dtype(DType::U32)?.contiguous()?.flatten_all()?;
    let lp = logits.apply_op2_no_bwd(&t, &LogProbs { scale })?;
    let ent = if with_entropy {
        Some(logits.apply_op1_no_bwd(&Entropy { scale })?)
    } else {
        None
    };
    let out = match &ent {
        Some(e) => Tensor::stack(&[&lp, e], 1)?,
        None => lp.unsqueeze(1)?,
    };
    let out = replay::attach2("fused-lm-head", h, w, &out, move |h, w, g| {
        let g = g.detach();
        let g_lp = g.narrow(1, 0, 1)?.flatten_all()?.contiguous()?;
        let mut dz = logits.apply_op3_no_bwd(&t, &g_lp, &LogProbsBwd { scale })?;
        if with_entropy {
            let g_ent = g.narrow(1, 1, 1)?.flatten_all()?.contiguous()?;
            dz = (dz + logits.apply_op2_no_bwd(&g_ent, &EntropyBwd { scale })?)?;
        }
        let dh = if h.track_op() {
            Some(dz.matmul(&wc)?.reshape(h.shape())?)
        } else {
            None
        };
        Ok((dh, weight_grad(&dz, &h2, w)?))
    })
    .map_err(|e| err(e.to_string()))?;
    let lp = out.narrow(1, 0, 1)?.reshape(lead.as_slice())?;
    let ent = if with_entropy {
        Some(out.narrow(1, 1, 1)?.reshape(lead.as_slice())?)
    } else {
        None
    };
    Ok((lp, ent))
}
