//! Fused CPU kernels for the policy and value losses.
//!
//! On the CPU every candle op is a separate pass over memory (and scalar clamps
//! take a strided path), so the clipped surrogate's ~30 ops cost more than the
//! math. Here one pass over host data computes the loss, its exact derivative and
//! the diagnostics; a custom op hands the loss to candle and the derivative to its
//! backward pass, so the result stays in the autograd graph. Ties in
//! `max`/`min`/`clamp` split the gradient in half, as candle's own ops (and
//! PyTorch's) do, so both paths agree to rounding; the op-chain versions in
//! `loss.rs` and `objective.rs` remain the path for other devices and are tested
//! against these. The policy loss of every objective, ratio level and aggregation
//! is in `fused/policy.rs`; the value loss's per-token kernel is here.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use crate::error::Result;

mod policy;

pub(crate) use policy::{policy_loss_host, Inputs, LossWithGrad};

// The per-token helpers are written as plain selects on precomputed values,
// not nested branches: on random data the branches mispredict half the time and
// cost more than the arithmetic, while selects compile to conditional moves.

#[inline(always)]
fn sel(c: bool, a: f32, b: f32) -> f32 {
    if c {
        a
    } else {
        b
    }
}

/// `clamp(x, lo, hi)` as `min(max(x, lo), hi)` with candle's tie rule (a tie
/// splits the gradient in half); `dx` is the derivative of `x`.
#[inline(always)]
fn pick_clamp(x: f32, lo: f32, hi: f32, dx: f32) -> (f32, f32) {
    let m = sel(x < lo, lo, x);
    let dm = sel(x > lo, dx, sel(x < lo, 0.0, 0.5 * dx));
    let v = sel(m > hi, hi, m);
    let dv = sel(m < hi, dm, sel(m > hi, 0.0, 0.5 * dm));
    (v, dv)
}

/// `max(a, b)` of (value, derivative) pairs with candle's tie rule.
#[inline(always)]
fn pick_max(a: (f32, f32), b: (f32, f32)) -> (f32, f32) {
    let v = sel(b.0 > a.0, b.0, a.0);
    let d = sel(a.0 > b.0, a.1, sel(b.0 > a.0, b.1, 0.5 * (a.1 + b.1)));
    (v, d)
}

/// Unreduced value loss `max((v - R)^2, (clip(v, old ± c) - R)^2)` for one token,
/// its derivative w.r.t. `v`, and whether the clipped term was larger.
#[inline(always)]
fn vf_elem(v: f32, old: f32, r: f32, c: f32) -> (f32, f32, bool) {
    let lo = old - c;
    let hi = old + c;
    // verl clip_by_value: max(min(v, hi), lo)
    let m = sel(v > hi, hi, v);
    let dm = sel(v < hi, 1.0, sel(v > hi, 0.0, 0.5));
    let vc = sel(m < lo, lo, m);
    let dvc = sel(m > lo, dm, sel(m < lo, 0.0, 0.5 * dm));
    let e1 = v - r;
    let e2 = vc - r;
    let l1 = e1 * e1;
    let l2 = e2 * e2;
    let (l, d) = pick_max((l1, 2.0 * e1), (l2, 2.0 * e2 * dvc));
    (l, d, l2 > l1)
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct PgParams {
    pub lo: f32,
    pub hi: f32,
    pub dual: Option<f32>,
}

/// A precomputed per-token function of one input and its derivative: the
/// forward pass hands out the values, the backward pass multiplies the incoming
/// gradient by the derivative. Computing both in the caller's single pass
/// avoids evaluating `exp` twice per token.
struct Precomputed {
    name: &'static str,
    values: Vec<f32>,
    derivative: Vec<f32>,
}

impl CustomOp1 for Precomputed {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(self.values.clone()), l.shape().clone()))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let d = Tensor::from_vec(self.derivative.clone(), arg.shape(), arg.device())?;
        Ok(Some(grad_res.mul(&d)?))
    }
}

/// Tokens per worker thread below which splitting the pass does not pay for
/// the thread start-up.
const MIN_CHUNK: usize = 1 << 16;

/// Runs `f(range, values, derivative)` over `len` tokens split into contiguous
/// chunks, one scoped thread per chunk when the batch is large enough, and
/// returns the per-chunk results in order (so reductions are deterministic for
/// a given machine).
fn split_pass<R: Send>(
    len: usize,
    values: &mut [f32],
    derivative: &mut [f32],
    f: impl Fn(std::ops::Range<usize>, &mut [f32], &mut [f32]) -> R + Sync,
) -> Vec<R> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunks = (len / MIN_CHUNK).clamp(1, threads);
    if chunks == 1 {
        return vec![f(0..len, values, derivative)];
    }
    let size = len.div_ceil(chunks);
    std::thread::scope(|scope| {
        let handles: Vec<_> = values
            .chunks_mut(size)
            .zip(derivative.chunks_mut(size))
            .enumerate()
            .map(|(k, (v, d))| {
                let f = &f;
                let start = k * size;
                scope.spawn(move || f(start..start + v.len(), v, d))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(r) => r,
                Err(panic) => std::panic::resume_unwind(panic),
            })
            .collect()
    })
}

/// Runs `f(first_row, part)` over `out`, rows of `width` values, split into contiguous parts
/// of whole rows: one scoped thread per part when the batch is large enough, each part at
/// least [`MIN_CHUNK`] values. Returns the parts' results in order (so reductions are
/// deterministic for a given machine). `out` may be empty when there is nothing to write
/// (`rows` then gives the batch's size).
pub(crate) fn split_rows<R: Send>(
    rows: usize,
    width: usize,
    out: &mut [f32],
    f: impl Fn(std::ops::Range<usize>, &mut [f32]) -> R + Sync,
) -> Vec<R> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let parts = (rows * width / MIN_CHUNK)
        .clamp(1, threads)
        .min(rows.max(1));
    if parts == 1 {
        return vec![f(0..rows, out)];
    }
    let per = rows.div_ceil(parts);
    let writes = !out.is_empty();
    std::thread::scope(|scope| {
        let mut rest = out;
        let handles: Vec<_> = (0..rows)
            .step_by(per)
            .map(|first| {
                let span = first..(first + per).min(rows);
                let take = if writes { span.len() * width } else { 0 };
                let (part, tail) = std::mem::take(&mut rest).split_at_mut(take);
                rest = tail;
                let f = &f;
                scope.spawn(move || f(span, part))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(r) => r,
                Err(panic) => std::panic::resume_unwind(panic),
            })
            .collect()
    })
}

/// Per-token (unhalved) value loss matrix (in the autograd graph of
/// `vpreds_t`) and the masked clip fraction, from host copies of the inputs.
pub(crate) fn value_terms(
    vpreds_t: &Tensor,
    v: &[f32],
    old: &[f32],
    ret: &[f32],
    mask: &[f32],
    cliprange_value: f32,
) -> Result<(Tensor, f64)> {
    let mut values = vec![0f32; v.len()];
    let mut derivative = vec![0f32; v.len()];
    let parts = split_pass(v.len(), &mut values, &mut derivative, |r, ls, ds| {
        let (mut clipped, mut n) = (0f64, 0f64);
        let tokens = v[r.clone()]
            .iter()
            .zip(&old[r.clone()])
            .zip(&ret[r.clone()]);
        let outs = ls.iter_mut().zip(ds.iter_mut());
        for (((&v, &o), &rt), ((l, d), &m)) in tokens.zip(outs.zip(&mask[r])) {
            let (loss, deriv, c) = vf_elem(v, o, rt, cliprange_value);
            *l = loss;
            *d = deriv;
            clipped += f64::from(m) * f64::from(u8::from(c));
            n += f64::from(m);
        }
        (clipped, n)
    });
    let (clipped, n) = parts
        .into_iter()
        .fold((0f64, 0f64), |(c, n), (c2, n2)| (c + c2, n + n2));
    let op = Precomputed {
        name: "rlhf-algo-value-loss",
        values,
        derivative,
    };
    Ok((vpreds_t.apply_op1(op)?, clipped / n))
}
