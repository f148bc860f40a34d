//! Masked reductions and whitening.
//!
//! The tensor versions are built from differentiable candle ops, so they can sit
//! inside a loss. The `host_*` helpers work on flat `f32` slices with `f64`
//! accumulators; the estimators use them because nothing there needs a gradient
//! and one pass over a slice is much cheaper than a chain of tensor ops.

use candle_core::{DType, Tensor};

use crate::error::{AlgoError, Result};
use crate::validate::{check_mask, check_token_tensor};

/// Added to the variance before the reciprocal square root, as in TRL and verl.
pub const WHITEN_EPS: f64 = 1e-8;

/// Sum of `values` over the positions `mask` selects (a scalar tensor).
pub fn masked_sum(values: &Tensor, mask: &Tensor) -> Result<Tensor> {
    check_mask("mask", mask)?;
    check_token_tensor("values", values, mask)?;
    Ok(values.mul(mask)?.sum_all()?)
}

/// Mean of `values` over the positions `mask` selects (a scalar tensor).
pub fn masked_mean(values: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let n = check_mask("mask", mask)?;
    check_token_tensor("values", values, mask)?;
    masked_mean_n(values, mask, n)
}

/// Variance of `values` over the positions `mask` selects, Bessel-corrected when
/// `unbiased` (TRL/verl `masked_var`). Unbiased needs at least two valid positions.
pub fn masked_var(values: &Tensor, mask: &Tensor, unbiased: bool) -> Result<Tensor> {
    let n = check_mask("mask", mask)?;
    check_token_tensor("values", values, mask)?;
    masked_var_n(values, mask, n, unbiased)
}

/// `(values - mean) / sqrt(var + 1e-8)` with masked statistics (unbiased
/// variance), adding the mean back when `shift_mean` is false (TRL/verl
/// `masked_whiten`). Positions outside the mask are set to zero so that padding
/// never leaks into later steps.
pub fn masked_whiten(values: &Tensor, mask: &Tensor, shift_mean: bool) -> Result<Tensor> {
    let n = check_mask("mask", mask)?;
    check_token_tensor("values", values, mask)?;
    let mean = masked_mean_n(values, mask, n)?;
    let var = masked_var_n(values, mask, n, true)?;
    let inv_std = var.affine(1.0, WHITEN_EPS)?.sqrt()?.recip()?;
    let mut out = values.broadcast_sub(&mean)?.broadcast_mul(&inv_std)?;
    if !shift_mean {
        out = out.broadcast_add(&mean)?;
    }
    Ok(out.mul(mask)?)
}

pub(crate) fn masked_mean_n(values: &Tensor, mask: &Tensor, n: usize) -> Result<Tensor> {
    Ok(values.mul(mask)?.sum_all()?.affine(1.0 / n as f64, 0.0)?)
}

pub(crate) fn masked_var_n(
    values: &Tensor,
    mask: &Tensor,
    n: usize,
    unbiased: bool,
) -> Result<Tensor> {
    if unbiased && n < 2 {
        return Err(too_few("mask", n));
    }
    let mean = masked_mean_n(values, mask, n)?;
    let centered = values.broadcast_sub(&mean)?;
    let var = masked_mean_n(&centered.sqr()?, mask, n)?;
    if unbiased {
        Ok(var.affine(n as f64 / (n as f64 - 1.0), 0.0)?)
    } else {
        Ok(var)
    }
}

fn too_few(name: &'static str, n: usize) -> AlgoError {
    AlgoError::InvalidInput {
        input: name,
        reason: format!(
            "the unbiased masked variance needs at least 2 valid positions, found {n}; use a larger (mini)batch"
        ),
    }
}

/// Masked mean and unbiased masked variance of a host slice.
pub(crate) fn host_mean_var(values: &[f32], mask: &[f32]) -> Result<(f64, f64)> {
    let mut n = 0f64;
    let mut sum = 0f64;
    for (&v, &m) in values.iter().zip(mask) {
        if m != 0.0 {
            n += 1.0;
            sum += v as f64;
        }
    }
    if n < 2.0 {
        return Err(too_few("response_mask", n as usize));
    }
    let mean = sum / n;
    let mut ss = 0f64;
    for (&v, &m) in values.iter().zip(mask) {
        if m != 0.0 {
            let d = v as f64 - mean;
            ss += d * d;
        }
    }
    Ok((mean, ss / (n - 1.0)))
}

/// In-place masked whitening of a host slice; masked positions become zero.
pub(crate) fn host_whiten(values: &mut [f32], mask: &[f32], shift_mean: bool) -> Result<()> {
    let (mean, var) = host_mean_var(values, mask)?;
    let inv_std = 1.0 / (var + WHITEN_EPS).sqrt();
    let add = if shift_mean { 0.0 } else { mean };
    for (v, &m) in values.iter_mut().zip(mask) {
        *v = if m != 0.0 {
            ((*v as f64 - mean) * inv_std + add) as f32
        } else {
            0.0
        };
    }
    Ok(())
}

/// Slots per accumulator of [`row_sums`].
const SLOTS: usize = 64;

/// The per-token terms that [`row_sums`] adds up, from one token of each of `M` inputs.
pub(crate) trait Terms<const M: usize, const N: usize> {
    fn terms(&self, token: [f32; M]) -> [f32; N];
}

/// Sums of `N` per-token terms over one row of `M` equally long inputs. Token `k` adds to
/// slot `k % 64` of each sum, so that the loop is element-wise (no reduction, which the
/// compiler may not reorder): it vectorizes reliably, with AVX2 where the CPU has it. The
/// usual form, a few lanes summed per step, was paired across the sums instead of across
/// the tokens by the release build's vectorizer and ran 2-3x slower. Each slot sums at most
/// 8 terms in `f32` before they are added to an `f64` slot.
pub(crate) fn row_sums<const M: usize, const N: usize, T: Terms<M, N>>(
    ins: [&[f32]; M],
    t: &T,
) -> [f64; N] {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { row_sums_avx2(ins, t) };
    }
    row_sums_plain(ins, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn row_sums_avx2<const M: usize, const N: usize, T: Terms<M, N>>(
    ins: [&[f32]; M],
    t: &T,
) -> [f64; N] {
    row_sums_plain(ins, t)
}

// Indexed loops: the index is the accumulator slot as well as the position in each input.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn row_sums_plain<const M: usize, const N: usize, T: Terms<M, N>>(
    ins: [&[f32]; M],
    t: &T,
) -> [f64; N] {
    let n = ins.iter().map(|x| x.len()).min().unwrap_or(0);
    let mut acc = Slots::<N>::new();
    let mut start = 0;
    while start < n {
        let len = (n - start).min(SLOTS);
        let spans = ins.map(|x| &x[start..start + len]);
        for i in 0..len {
            acc.add(i, t.terms(std::array::from_fn(|k| spans[k][i])));
        }
        acc.span_done();
        start += len;
    }
    acc.total()
}

/// `N` sums of [`SLOTS`] slots each, in `f32`, folded into `f64` slots every
/// [`SPANS_PER_FOLD`] spans so that each `f32` slot sums at most 8 terms.
struct Slots<const N: usize> {
    f32s: [[f32; SLOTS]; N],
    f64s: [[f64; SLOTS]; N],
    spans: usize,
}

/// Spans of [`SLOTS`] tokens summed in `f32` before a fold into `f64`.
const SPANS_PER_FOLD: usize = 8;

impl<const N: usize> Slots<N> {
    #[inline(always)]
    fn new() -> Self {
        Self {
            f32s: [[0.0; SLOTS]; N],
            f64s: [[0.0; SLOTS]; N],
            spans: 0,
        }
    }

    #[inline(always)]
    fn add(&mut self, i: usize, v: [f32; N]) {
        for (acc, v) in self.f32s.iter_mut().zip(v) {
            acc[i] += v;
        }
    }

    #[inline(always)]
    fn span_done(&mut self) {
        self.spans += 1;
        if self.spans == SPANS_PER_FOLD {
            self.fold();
        }
    }

    #[inline(always)]
    fn fold(&mut self) {
        for (wide, narrow) in self.f64s.iter_mut().zip(&mut self.f32s) {
            for (w, x) in wide.iter_mut().zip(narrow.iter_mut()) {
                *w += f64::from(*x);
                *x = 0.0;
            }
        }
        self.spans = 0;
    }

    #[inline(always)]
    fn total(mut self) -> [f64; N] {
        self.fold();
        self.f64s.map(|a| a.iter().sum())
    }
}

/// A scalar tensor's value as `f64`.
pub(crate) fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn t(data: &[f32], shape: (usize, usize)) -> Tensor {
        Tensor::from_vec(data.to_vec(), shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn masked_stats_ignore_padding() {
        let v = t(&[1.0, 2.0, 3.0, 100.0], (1, 4));
        let m = t(&[1.0, 1.0, 1.0, 0.0], (1, 4));
        assert!((scalar(&masked_mean(&v, &m).unwrap()).unwrap() - 2.0).abs() < 1e-6);
        assert!((scalar(&masked_var(&v, &m, true).unwrap()).unwrap() - 1.0).abs() < 1e-6);
        assert!((scalar(&masked_var(&v, &m, false).unwrap()).unwrap() - 2.0 / 3.0).abs() < 1e-6);
        let w = masked_whiten(&v, &m, true)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert!((w[0][0] + 1.0).abs() < 1e-4 && w[0][1].abs() < 1e-6 && w[0][3] == 0.0);
    }

    #[test]
    fn host_and_tensor_whitening_agree() {
        let data: Vec<f32> = (0..24).map(|i| ((i * 7) % 11) as f32 * 0.3 - 1.0).collect();
        let mask: Vec<f32> = (0..24).map(|i| if i % 6 < 4 { 1.0 } else { 0.0 }).collect();
        for shift in [true, false] {
            let w = masked_whiten(&t(&data, (4, 6)), &t(&mask, (4, 6)), shift).unwrap();
            let w = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let mut h = data.clone();
            host_whiten(&mut h, &mask, shift).unwrap();
            for (a, b) in w.iter().zip(&h) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn unbiased_variance_of_one_token_is_an_error() {
        let v = t(&[1.0, 2.0], (1, 2));
        let m = t(&[1.0, 0.0], (1, 2));
        let err = masked_var(&v, &m, true).unwrap_err().to_string();
        assert!(err.contains("at least 2 valid positions"), "{err}");
    }
}
