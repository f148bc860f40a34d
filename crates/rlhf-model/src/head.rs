//! Log-probs and entropies of the LM head in chunks of tokens: the `[N, V]` logits of a whole
//! batch never exist at once, in forward or in backward.
//!
//! With Qwen2.5's vocabulary (151,936) a batch of 8 x 512 tokens has 2.5 GB of f32 logits, and
//! a plain backward holds them, their log-softmax and their gradient together. Here the
//! forward computes `chunk` rows of logits at a time with the same ops as the unchunked path
//! and keeps only the per-token results (log-prob, entropy, log-sum-exp); the backward (see
//! [`crate::replay`]) recomputes the logits tile by tile (tokens x vocabulary), turns each tile
//! into its gradient in closed form and sends it into the hidden states' and the head
//! weight's gradients with two matmuls. The cost is one more `h W^T` product in all; the
//! results equal the unchunked ones to f32 rounding.

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::ops;
use crate::train::add_to;

/// What one call computes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeadOpts {
    pub temperature: f64,
    pub with_entropy: bool,
    /// Tokens per chunk (at least 1).
    pub chunk: usize,
    /// This crate's fused kernels may be used for the log-softmax (where they run).
    pub fused: bool,
    /// Vocabulary columns per backward tile ([`VOCAB_TILE`] outside tests).
    pub vocab_tile: usize,
}

fn spans(n: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..n).step_by(chunk).map(move |s| (s, chunk.min(n - s)))
}

/// Log-probs `[N]` of `targets` `[N]` (u32) and, when asked, entropies `[N]`, of
/// `softmax(h W^T / temperature)`: `h` is `[N, H]` in the compute dtype, `w` the head weight
/// `[V, H]` in any dtype (f32 master weights are cast per chunk).
pub(crate) fn log_probs_entropy(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    o: HeadOpts,
) -> Result<(Tensor, Option<Tensor>)> {
    let n = h.dim(0)?;
    let targets = targets.to_dtype(DType::U32)?.contiguous()?;
    let (out, lse) = forward(h, w, &targets, o)?;
    let saved = Saved {
        targets,
        lse,
        entropy: out.narrow(1, 1, 1)?.squeeze(1)?.contiguous()?,
    };
    let out = crate::replay::attach2("chunked-lm-head", h, w, &out, move |h, w, g| {
        backward(h, w, &saved, g, o)
    })?;
    let lp = out.narrow(1, 0, 1)?.reshape(n)?;
    let ent = if o.with_entropy {
        Some(out.narrow(1, 1, 1)?.reshape(n)?)
    } else {
        None
    };
    Ok((lp, ent))
}

/// What the backward needs besides the inputs: per token, its target, the log-sum-exp of its
/// scaled logits and its entropy (`[N]` each, a few bytes per token).
struct Saved {
    targets: Tensor,
    lse: Tensor,
    entropy: Tensor,
}

/// `[N, 2]` (log-prob, entropy or zeros) and the log-sum-exp `[N]` per token, with no graph.
/// The log-prob and entropy come from the same ops as the unchunked path; the log-sum-exp is
/// recovered exactly from them as `s * z[target] - log_prob`.
fn forward(h: &Tensor, w: &Tensor, targets: &Tensor, o: HeadOpts) -> Result<(Tensor, Tensor)> {
    let h = h.detach();
    let w = w.detach().to_dtype(h.dtype())?;
    let wt = w.t()?;
    let scale = 1.0 / o.temperature;
    let f = ops::wide_dtype(h.dtype());
    let mut rows = Vec::new();
    let mut lses = Vec::new();
    for (s, len) in spans(h.dim(0)?, o.chunk) {
        let logits = h.narrow(0, s, len)?.matmul(&wt)?.to_dtype(f)?;
        let t = targets.narrow(0, s, len)?;
        let lp = ops::log_probs_impl(&logits, &t, o.temperature, o.fused)?;
        let ent = if o.with_entropy {
            ops::entropy_impl(&logits, o.temperature, o.fused)?
        } else {
            lp.zeros_like()?
        };
        let zt = logits.gather(&t.unsqueeze(1)?, 1)?.squeeze(1)?;
        lses.push(((zt * scale)? - &lp)?);
        rows.push(Tensor::stack(&[&lp, &ent], 1)?);
    }
    Ok((Tensor::cat(&rows, 0)?, Tensor::cat(&lses, 0)?))
}

/// Columns of the vocabulary per backward tile: with 512-token chunks, a 32 MiB f32 tile.
pub(crate) const VOCAB_TILE: usize = 16_384;

/// Gradients of `h` and `w` given the gradient `g` `[N, 2]` of the forward's result.
///
/// The logits' gradient of token `n` at vocabulary entry `v`, with `z = s * h W^T` (`s` =
/// 1/temperature), `p = exp(z - lse)` and `H` the entropy, is
/// `s * (g_lp * (1[v = t_n] - p) - g_ent * p * (z - lse + H))`: every tile of tokens x
/// vocabulary can be computed on its own from the saved `lse` and `H`. So the backward walks
/// vocabulary tiles, and in each one token chunks: a tile's logits are recomputed, turned into
/// their gradient, and leave through two matmuls into `dh` (summed over tiles) and the tile's
/// rows of `dW` (summed over chunks, then written in place). No `[N, V]` tensor and no
/// second `[V, H]` buffer.
fn backward(
    h: &Tensor,
    w: &Tensor,
    saved: &Saved,
    g: &Tensor,
    o: HeadOpts,
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
    let h = h.detach();
    let g = g.detach();
    let dev = h.device().clone();
    let f = ops::wide_dtype(h.dtype());
    let scale = 1.0 / o.temperature;
    let wc = w.detach().to_dtype(h.dtype())?;
    let (n, v) = (h.dim(0)?, wc.dim(0)?);
    let chunks: Vec<(usize, usize)> = spans(n, o.chunk).collect();
    let g_lp = g.narrow(1, 0, 1)?.to_dtype(f)?;
    let g_ent = g.narrow(1, 1, 1)?.to_dtype(f)?;
    let lse = saved.lse.to_dtype(f)?.unsqueeze(1)?;
    let ent = saved.entropy.to_dtype(f)?.unsqueeze(1)?;
    let targets = saved.targets.to_dtype(DType::U32)?.unsqueeze(1)?;
    // dW is summed in f32 (f64 for f64 weights) and cast to the weight's dtype once.
    let acc = ops::wide_dtype(w.dtype());
    let mut dh: Vec<Option<Tensor>> = vec![None; chunks.len()];
    // A frozen head (a LoRA model's) gets no gradient: no [V, H] buffer, no dW products.
    let need_w = w.track_op();
    // Written tile by tile in place: no second [V, H] buffer for a concatenation.
    let dw = if need_w {
        Some(Tensor::zeros((v, wc.dim(1)?), acc, &dev)?)
    } else {
        None
    };
    for (v0, vs) in spans(v, o.vocab_tile) {
        let w_tile = wc.narrow(0, v0, vs)?;
        let cols = Tensor::arange(v0 as u32, (v0 + vs) as u32, &dev)?.unsqueeze(0)?;
        let mut dw_tile: Option<Tensor> = None;
        for (k, &(s0, len)) in chunks.iter().enumerate() {
            let hc = h.narrow(0, s0, len)?;
            let z = (hc.matmul(&w_tile.t()?)?.to_dtype(f)? * scale)?;
            let logp = z.broadcast_sub(&lse.narrow(0, s0, len)?)?;
            let p = logp.exp()?;
            let gl = g_lp.narrow(0, s0, len)?;
            let onehot = targets
                .narrow(0, s0, len)?
                .broadcast_eq(&cols)?
                .to_dtype(f)?;
            let mut dz = (onehot - &p)?.broadcast_mul(&gl)?;
            if o.with_entropy {
                let ge = g_ent.narrow(0, s0, len)?;
                let e = logp.broadcast_add(&ent.narrow(0, s0, len)?)?;
                dz = (dz - (p * e)?.broadcast_mul(&ge)?)?;
            }
            let dl = (dz * scale)?.to_dtype(h.dtype())?;
            let dhc = dl.matmul(&w_tile)?;
            dh[k] = Some(add_to(dh[k].take(), dhc)?);
            if need_w {
                let dwc = dl.t()?.matmul(&hc)?.to_dtype(acc)?;
                dw_tile = Some(add_to(dw_tile.take(), dwc)?);
            }
        }
        if let (Some(t), Some(dw)) = (dw_tile, &dw) {
            dw.slice_set(&t.contiguous()?, 0, v0)?;
        }
    }
    let dh: Vec<Tensor> = dh.into_iter().flatten().collect();
    let dh = Tensor::cat(&dh, 0)?;
    let dw = dw.map(|d| d.to_dtype(w.dtype())).transpose()?;
    Ok((Some(dh), dw))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn rand(shape: (usize, usize), seed: u64, dtype: DType) -> Tensor {
        let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        let data: Vec<f32> = (0..shape.0 * shape.1)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 2001) as f32 / 1000.0 - 1.0
            })
            .collect();
        Tensor::from_vec(data, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    type Outputs = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

    /// Log-probs, entropies and the gradients (of `h` and `w`) of a weighted sum of both,
    /// from `head(h, w, targets) -> (log-probs, entropies)`.
    fn outputs(head: impl Fn(&Tensor, &Tensor, &Tensor) -> (Tensor, Tensor)) -> Outputs {
        let (n, hd, v) = (13, 8, 37);
        let h = Var::from_tensor(&rand((n, hd), 1, DType::F32)).unwrap();
        let w = Var::from_tensor(&rand((v, hd), 2, DType::F32)).unwrap();
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 7) % v as u32).collect();
        let targets = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
        let (lp, ent) = head(h.as_tensor(), w.as_tensor(), &targets);
        let weights = rand((1, n), 3, DType::F32).squeeze(0).unwrap();
        let loss = ((&lp * &weights).unwrap().sum_all().unwrap()
            + (&ent * 0.3).unwrap().sum_all().unwrap())
        .unwrap();
        let grads = loss.backward().unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (
            flat(&lp),
            flat(&ent),
            flat(grads.get(h.as_tensor()).unwrap()),
            flat(grads.get(w.as_tensor()).unwrap()),
        )
    }

    /// Chunked over tokens (`chunk`) and, in backward, over the vocabulary (`vocab_tile`).
    fn run(chunk: usize, vocab_tile: usize, fused: bool) -> Outputs {
        outputs(|h, w, targets| {
            let o = HeadOpts {
                temperature: 0.7,
                with_entropy: true,
                chunk,
                fused,
                vocab_tile,
            };
            let (lp, ent) = log_probs_entropy(h, w, targets, o).unwrap();
            (lp, ent.unwrap())
        })
    }

    /// The unchunked reference: the plain differentiable path on full logits.
    fn plain(fused: bool) -> Outputs {
        outputs(|h, w, targets| {
            let logits = h.matmul(&w.t().unwrap()).unwrap();
            (
                ops::log_probs_impl(&logits, targets, 0.7, fused).unwrap(),
                ops::entropy_impl(&logits, 0.7, fused).unwrap(),
            )
        })
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn chunked_results_and_gradients_equal_the_unchunked_ones() {
        for fused in [true, false] {
            let want = plain(fused);
            // 1 row, an uneven split, and one chunk holding everything; vocabulary tiles of
            // 1 column, an uneven split and the whole vocabulary.
            for (chunk, tile) in [(1, 37), (5, 8), (13, 1), (100, 100), (4, 36)] {
                let got = run(chunk, tile, fused);
                for (what, a, b) in [
                    ("log-probs", &got.0, &want.0),
                    ("entropy", &got.1, &want.1),
                    ("grad h", &got.2, &want.2),
                    ("grad w", &got.3, &want.3),
                ] {
                    let d = max_diff(a, b);
                    assert!(
                        d <= 1e-6,
                        "fused={fused} chunk={chunk}: {what} differs by {d:e}"
                    );
                }
                assert!(got.3.iter().any(|x| x.abs() > 1e-3), "grad w is all zeros");
            }
        }
    }
}
