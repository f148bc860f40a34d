//! Log-probs and entropies of the LM head in chunks of tokens: the `[N, V]` logits of a whole
//! batch never exist at once, in forward or in backward.
//!
//! With Qwen2.5's vocabulary (151,936) a batch of 8 x 512 tokens has 2.5 GB of f32 logits, and
//! a plain backward holds them, their log-softmax and their gradient together. Here the
//! forward computes `chunk` rows of logits at a time and keeps only the per-token results; the
//! backward (see [`crate::replay`]) recomputes each chunk's logits, differentiates the
//! log-prob and entropy of that chunk with the same ops as the unchunked path, and turns the
//! logits' gradient into the hidden states' and the head weight's gradients with two matmuls.
//! The cost is one more matmul per chunk; the result equals the unchunked one row for row.

use candle_core::{DType, Tensor, Var};

use crate::error::Result;
use crate::ops;

/// What one call computes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeadOpts {
    pub temperature: f64,
    pub with_entropy: bool,
    /// Tokens per chunk (at least 1).
    pub chunk: usize,
    /// This crate's fused CPU kernels may be used for the log-softmax.
    pub fused: bool,
}

fn candle_err(e: crate::Error) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// Results leave in f32 (f64 for f64 activations, for precision tests).
fn out_dtype(h: &Tensor) -> DType {
    if h.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
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
    let out = forward(h, w, &targets, o)?;
    let bwd_targets = targets.clone();
    let out = crate::replay::attach2("chunked-lm-head", h, w, &out, move |h, w, g| {
        backward(h, w, &bwd_targets, g, o)
    })?;
    let lp = out.narrow(1, 0, 1)?.reshape(n)?;
    let ent = if o.with_entropy {
        Some(out.narrow(1, 1, 1)?.reshape(n)?)
    } else {
        None
    };
    Ok((lp, ent))
}

/// `[N, 2]`: log-prob and entropy (zeros when not asked) per token, with no graph.
fn forward(h: &Tensor, w: &Tensor, targets: &Tensor, o: HeadOpts) -> Result<Tensor> {
    let h = h.detach();
    let w = w.detach().to_dtype(h.dtype())?;
    let wt = w.t()?;
    let mut rows = Vec::new();
    for (s, len) in spans(h.dim(0)?, o.chunk) {
        let logits = h.narrow(0, s, len)?.matmul(&wt)?.to_dtype(out_dtype(&h))?;
        let t = targets.narrow(0, s, len)?;
        let lp = ops::log_probs_impl(&logits, &t, o.temperature, o.fused)?;
        let ent = if o.with_entropy {
            ops::entropy_impl(&logits, o.temperature, o.fused)?
        } else {
            lp.zeros_like()?
        };
        rows.push(Tensor::stack(&[&lp, &ent], 1)?);
    }
    Ok(Tensor::cat(&rows, 0)?)
}

/// Gradients of `h` and `w` given the gradient `g` `[N, 2]` of the forward's result.
fn backward(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    g: &Tensor,
    o: HeadOpts,
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
    let h = h.detach();
    let g = g.detach();
    let wc = w.detach().to_dtype(h.dtype())?;
    let wt = wc.t()?;
    let mut dh = Vec::new();
    // The head weight's gradient is summed over chunks in f32 (f64 for f64 weights).
    let acc_dtype = if w.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let mut dw: Option<Tensor> = None;
    for (s, len) in spans(h.dim(0)?, o.chunk) {
        let hc = h.narrow(0, s, len)?;
        let logits = Var::from_tensor(&hc.matmul(&wt)?.to_dtype(out_dtype(&h))?)?;
        let t = targets.narrow(0, s, len)?;
        let gc = g.narrow(0, s, len)?;
        let lp = ops::log_probs_impl(logits.as_tensor(), &t, o.temperature, o.fused)
            .map_err(candle_err)?;
        let mut surrogate = (lp * gc.narrow(1, 0, 1)?.squeeze(1)?)?.sum_all()?;
        if o.with_entropy {
            let ent = ops::entropy_impl(logits.as_tensor(), o.temperature, o.fused)
                .map_err(candle_err)?;
            surrogate = (surrogate + (ent * gc.narrow(1, 1, 1)?.squeeze(1)?)?.sum_all()?)?;
        }
        let grads = surrogate.backward()?;
        let dl = grads
            .get(logits.as_tensor())
            .ok_or_else(|| candle_core::Error::Msg("chunked LM head: no logits gradient".into()))?
            .to_dtype(h.dtype())?;
        dh.push(dl.matmul(&wc)?);
        let dwc = dl.t()?.matmul(&hc)?.to_dtype(acc_dtype)?;
        dw = Some(match dw {
            Some(a) => (a + dwc)?,
            None => dwc,
        });
    }
    let dh = Tensor::cat(&dh, 0)?;
    let dw = dw.map(|d| d.to_dtype(w.dtype())).transpose()?;
    Ok((Some(dh), dw))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

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

    /// Log-probs, entropies and the gradients of a weighted sum of both, chunked and not.
    fn run(chunk: usize, fused: bool) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (n, hd, v) = (13, 8, 37);
        let h = Var::from_tensor(&rand((n, hd), 1, DType::F32)).unwrap();
        let w = Var::from_tensor(&rand((v, hd), 2, DType::F32)).unwrap();
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 7) % v as u32).collect();
        let targets = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
        let o = HeadOpts {
            temperature: 0.7,
            with_entropy: true,
            chunk,
            fused,
        };
        let (lp, ent) = log_probs_entropy(h.as_tensor(), w.as_tensor(), &targets, o).unwrap();
        let ent = ent.unwrap();
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

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// The unchunked reference: the plain differentiable path on full logits.
    fn plain(fused: bool) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (n, hd, v) = (13, 8, 37);
        let h = Var::from_tensor(&rand((n, hd), 1, DType::F32)).unwrap();
        let w = Var::from_tensor(&rand((v, hd), 2, DType::F32)).unwrap();
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 7) % v as u32).collect();
        let targets = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
        let logits = h.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
        let lp = ops::log_probs_impl(&logits, &targets, 0.7, fused).unwrap();
        let ent = ops::entropy_impl(&logits, 0.7, fused).unwrap();
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

    #[test]
    fn chunked_results_and_gradients_equal_the_unchunked_ones() {
        for fused in [true, false] {
            let want = plain(fused);
            // 1 row, an uneven split, and one chunk holding everything.
            for chunk in [1, 5, 13, 100] {
                let got = run(chunk, fused);
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
