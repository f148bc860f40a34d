//! Grouped-query attention for training as one autograd node: the core
//! `softmax(s q k^T + mask) v` ([`attention`]), or the whole block from the projections'
//! outputs to the output projection's input, RoPE and the head transposes included
//! ([`attention_block`]).
//!
//! Composed from candle's ops, the core is a scaling, two matmuls, the fused masked softmax
//! and three reshapes, and the block adds per projection a reshape, a transpose, a copy and
//! RoPE, and a transpose and a copy on the way out. candle's backward adds a zero-filled
//! gradient and an add for the input of each node: four of them the size of the attention
//! scores (`[B, H, T, S]`, the largest activations of a layer), and the graph keeps both the
//! scores and the probabilities alive. Here the forward runs with no graph and keeps the
//! probabilities and the rotated q, k and v, and the backward is written out:
//! `dv = p^T g`, `dp = g v^T`, `ds = p (dp - sum(dp p))` (the fused softmax backward),
//! `dq = s ds k`, `dk = ds^T (s q)` for the scale `s`, then RoPE's inverse rotation and the
//! transposes back.

use super::elementwise::Rope;
use super::layers::SoftmaxBwd;
use super::*;
use crate::replay;

/// What the core's backward needs: the probabilities `[B, G, R*T, S]`, the scaled queries
/// and the keys and values, all without a graph.
struct Core {
    p: Tensor,
    q_scaled: Tensor,
    k: Tensor,
    v: Tensor,
    scale: f64,
}

impl Core {
    /// `q` `[B, G, R*T, D]`, `k`, `v` `[B, G, S, D]`, `mask` `[B, T, S]`; returns the core and
    /// its output `[B, G, R*T, D]`.
    fn forward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        scale: f64,
    ) -> CResult<(Self, Tensor)> {
        let (b, g, rt, d) = q.dims4()?;
        let s = k.dim(2)?;
        let (mb, t, ms) = mask.dims3()?;
        if mb != b
            || ms != s
            || t == 0
            || !rt.is_multiple_of(t)
            || k.dims() != v.dims()
            || k.dim(3)? != d
        {
            return Err(err(format!(
                "attention: q {:?}, k {:?}, v {:?} and mask {:?} do not fit together",
                q.dims(),
                k.dims(),
                v.dims(),
                mask.dims()
            )));
        }
        let q_scaled = (q.detach() * scale)?;
        let (k, v) = (k.detach().contiguous()?, v.detach().contiguous()?);
        let scores = q_scaled.matmul(&k.t()?)?.reshape((b, g, rt / t, t, s))?;
        let p = masked_softmax(&scores, mask)?.reshape((b, g, rt, s))?;
        let y = p.matmul(&v)?;
        Ok((
            Self {
                p,
                q_scaled,
                k,
                v,
                scale,
            },
            y,
        ))
    }

    /// `(dq, dk, dv)` from the output's gradient `gy` `[B, G, R*T, D]`.
    fn backward(&self, gy: &Tensor) -> CResult<(Tensor, Tensor, Tensor)> {
        let gy = gy.detach().contiguous()?;
        let dv = self.p.t()?.matmul(&gy)?;
        let dp = gy.matmul(&self.v.t()?)?;
        let ds = self.p.apply_op2_no_bwd(&dp, &SoftmaxBwd)?;
        let dq = (ds.matmul(&self.k)? * self.scale)?;
        let dk = ds.t()?.matmul(&self.q_scaled)?;
        Ok((dq, dk, dv))
    }
}

/// `softmax(scale q k^T + mask) v` per head group: `q` `[B, G, R*T, D]` (the `R` query heads
/// sharing a KV head stacked along the sequence), `k` and `v` `[B, G, S, D]`, `mask`
/// `[B, T, S]` (additive). Returns `[B, G, R*T, D]`, differentiable in `q`, `k`, `v`.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
) -> CResult<Tensor> {
    let (core, y) = Core::forward(q, k, v, mask, scale)?;
    replay::attach3("fused-attention", q, k, v, &y, move |_, _, _, gy| {
        let (dq, dk, dv) = core.backward(gy)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    })
    .map_err(|e| err(e.to_string()))
}

/// The heads of a projection's output: `[B, T, N*D]` to `[B, N, T, D]`, contiguous.
fn heads(x: &Tensor, n: usize, d: usize) -> CResult<Tensor> {
    let (b, t, _) = x.dims3()?;
    x.reshape((b, t, n, d))?.transpose(1, 2)?.contiguous()
}

/// `[B, N, T, D]` back to `[B, T, N*D]`, contiguous.
fn unheads(x: &Tensor) -> CResult<Tensor> {
    let (b, n, t, d) = x.dims4()?;
    x.transpose(1, 2)?.reshape((b, t, n * d))
}

fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> CResult<Tensor> {
    x.contiguous()?
        .apply_op3_no_bwd(cos, sin, &Rope { inverse })
}

/// Self-attention from the projections' outputs: `q` `[B, T, H*D]`, `k`, `v` `[B, T, G*D]`
/// (`H` query heads, `G` KV heads), RoPE with the half-width tables `cos`, `sin`
/// `[B, T, D/2]`, the additive `mask` `[B, T, T]`. Returns `[B, T, H*D]` (the output
/// projection's input), differentiable in `q`, `k` and `v`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_block(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    mask: &Tensor,
    heads_q: usize,
    heads_kv: usize,
    scale: f64,
) -> CResult<Tensor> {
    let (b, t, hq) = q.dims3()?;
    if heads_q == 0
        || heads_kv == 0
        || !hq.is_multiple_of(heads_q)
        || !heads_q.is_multiple_of(heads_kv)
    {
        return Err(err(format!(
            "attention_block: {heads_q} query heads and {heads_kv} KV heads for q {:?}",
            q.dims()
        )));
    }
    let d = hq / heads_q;
    let n_rep = heads_q / heads_kv;
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let qr = rotate(&heads(&q.detach(), heads_q, d)?, &cos, &sin, false)?;
    let kr = rotate(&heads(&k.detach(), heads_kv, d)?, &cos, &sin, false)?;
    let vh = heads(&v.detach(), heads_kv, d)?;
    let qg = qr.reshape((b, heads_kv, n_rep * t, d))?;
    let (core, y) = Core::forward(&qg, &kr, &vh, mask, scale)?;
    let out = unheads(&y.reshape((b, heads_q, t, d))?)?;
    replay::attach3(
        "fused-attention-block",
        q,
        k,
        v,
        &out,
        move |_, _, _, gy| {
            let gy = heads(gy, heads_q, d)?.reshape((b, heads_kv, n_rep * t, d))?;
            let (dq, dk, dv) = core.backward(&gy)?;
            let dq = rotate(&dq.reshape((b, heads_q, t, d))?, &cos, &sin, true)?;
            let dk = rotate(&dk, &cos, &sin, true)?;
            Ok((
                Some(unheads(&dq)?),
                Some(unheads(&dk)?),
                Some(unheads(&dv)?),
            ))
        },
    )
    .map_err(|e| err(e.to_string()))
}
