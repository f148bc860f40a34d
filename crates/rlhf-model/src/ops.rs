//! Differentiable log-prob and entropy helpers on logits.

use candle_core::{DType, Tensor, D};

use crate::error::{Error, Result};

/// The dtype the composite log-softmax works in. Its vocabulary sums are where precision is
/// lost: candle's CPU reduction adds one term after another, so a 152k-entry f32 row drops the
/// small terms; on the CPU the composite path therefore works in f64. GPU reductions are
/// trees of partial sums (error growing with log V, not V), so f32 is kept there.
fn internal_dtype(logits: &Tensor) -> DType {
    if logits.dtype() == DType::F64 || logits.device().is_cpu() {
        DType::F64
    } else {
        DType::F32
    }
}

/// The dtype precision-sensitive work is done and returned in for activations of `dtype`:
/// f32 (bf16 and f16 are widened), f64 kept for precision tests. One rule for log-probs,
/// entropies, values, scores, norms and softmaxes.
pub(crate) fn wide_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// f32 results (f64 for f64 logits) whatever the internal dtype.
fn output(t: Tensor, logits: &Tensor) -> Result<Tensor> {
    Ok(t.to_dtype(wide_dtype(logits.dtype()))?)
}

fn scaled_log_softmax(logits: &Tensor, temperature: f64) -> Result<Tensor> {
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "temperature must be positive for log-probs, got {temperature}"
        )));
    }
    let x = logits.to_dtype(internal_dtype(logits))?;
    let x = if temperature == 1.0 {
        x
    } else {
        (x / temperature)?
    };
    Ok(candle_nn::ops::log_softmax(&x, D::Minus1)?)
}

/// `log softmax(logits / temperature)[target]`: logits `[.., V]`, targets `[..]` (integer ids);
/// result `[..]` in f32 (f64 for f64 logits).
pub fn log_probs_from_logits(
    logits: &Tensor,
    targets: &Tensor,
    temperature: f64,
) -> Result<Tensor> {
    log_probs_impl(logits, targets, temperature, true)
}

/// `fused` allows the one-pass kernel where it applies (see [`crate::kernels::supported`]).
pub(crate) fn log_probs_impl(
    logits: &Tensor,
    targets: &Tensor,
    temperature: f64,
    fused: bool,
) -> Result<Tensor> {
    if fused && crate::kernels::supported(logits) {
        if !(temperature > 0.0 && temperature.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "temperature must be positive for log-probs, got {temperature}"
            )));
        }
        // The kernels return f32 for bf16 logits (see `wide_dtype`).
        return Ok(crate::kernels::log_probs(
            logits,
            targets,
            1.0 / temperature,
        )?);
    }
    let lsm = scaled_log_softmax(logits, temperature)?;
    let idx = targets
        .to_dtype(DType::U32)?
        .unsqueeze(D::Minus1)?
        .contiguous()?;
    output(lsm.gather(&idx, D::Minus1)?.squeeze(D::Minus1)?, logits)
}

/// Entropy `-sum p log p` of softmax(logits / temperature) over the last axis.
pub fn entropy_from_logits(logits: &Tensor, temperature: f64) -> Result<Tensor> {
    entropy_impl(logits, temperature, true)
}

/// `fused` allows the one-pass kernel where it applies (see [`crate::kernels::supported`]).
pub(crate) fn entropy_impl(logits: &Tensor, temperature: f64, fused: bool) -> Result<Tensor> {
    if fused && crate::kernels::supported(logits) {
        if !(temperature > 0.0 && temperature.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "temperature must be positive for entropy, got {temperature}"
            )));
        }
        return Ok(crate::kernels::entropy(logits, 1.0 / temperature)?);
    }
    let lsm = scaled_log_softmax(logits, temperature)?;
    let p = lsm.exp()?;
    output((p * lsm)?.sum(D::Minus1)?.neg()?, logits)
}

/// Log-probs `[N]` of `targets` `[N]` under an LM head: `log softmax(hidden W^T /
/// temperature)[target]` for `hidden` `[N, H]` and the head weight `W` `[V, H]`. With
/// `chunk`, the logits are computed `chunk` tokens at a time in forward and tile by tile in
/// backward, so the `[N, V]` logits never exist at once (what [`crate::Model`] does with
/// `LoadOptions::logits_chunk`); without, the plain differentiable path on full logits.
pub fn lm_head_log_probs(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    temperature: f64,
    chunk: Option<usize>,
) -> Result<Tensor> {
    // The fused kernels where they run (log_probs_impl checks the device and dtype).
    let fused = true;
    match chunk {
        Some(0) => Err(Error::InvalidArgument(
            "the LM-head chunk must be at least 1 token".to_string(),
        )),
        Some(chunk) => {
            let o = crate::head::HeadOpts {
                temperature,
                with_entropy: false,
                chunk,
                fused,
                vocab_tile: crate::head::VOCAB_TILE,
            };
            Ok(crate::head::log_probs_entropy(hidden, weight, targets, o)?.0)
        }
        None => {
            let w = weight.to_dtype(hidden.dtype())?;
            let logits = hidden.matmul(&w.t()?)?;
            log_probs_impl(&logits, targets, temperature, fused)
        }
    }
}

/// Sum of `xs * mask` divided by the number of unmasked entries (0 when there are none).
pub fn masked_mean(xs: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let mask = mask.to_dtype(xs.dtype())?;
    let n = mask.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let s = (xs * &mask)?.sum_all()?;
    Ok((s / n.max(1.0))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// f32 logits over Qwen2.5's vocabulary (151,936): a peaked distribution (a few large
    /// logits, a long tail of small probabilities) as a trained LM produces.
    fn big_vocab_logits(rows: usize) -> Vec<f32> {
        let v = 151_936usize;
        let mut x = 0x2545F4914F6CDD1Du64;
        (0..rows * v)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let u = (x % 1_000_000) as f32 / 1_000_000.0;
                // Row r has its mass spread over a few hundred tokens, the rest in the tail.
                let hot = (i % v) % 487 == (i / v) % 487;
                if hot {
                    8.0 + 4.0 * u
                } else {
                    -4.0 + 6.0 * u
                }
            })
            .collect()
    }

    /// Entropy and log-probs of every row computed independently in f64 from the same values.
    fn exact(logits: &[f32], v: usize, targets: &[u32], temp: f64) -> (Vec<f64>, Vec<f64>) {
        let mut ent = Vec::new();
        let mut lp = Vec::new();
        for (r, row) in logits.chunks_exact(v).enumerate() {
            let z: Vec<f64> = row.iter().map(|&x| f64::from(x) / temp).collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            // Pairwise-free but exact enough: sort ascending so small terms are added first.
            let mut terms: Vec<f64> = z.iter().map(|&zi| (zi - m).exp()).collect();
            terms.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let lse = m + terms.iter().sum::<f64>().ln();
            let mut pz: Vec<f64> = z.iter().map(|&zi| (zi - lse).exp() * (zi - lse)).collect();
            pz.sort_by(|a, b| b.partial_cmp(a).unwrap());
            ent.push(-pz.iter().sum::<f64>());
            lp.push(z[targets[r] as usize] - lse);
        }
        (ent, lp)
    }

    #[test]
    fn entropy_and_log_probs_keep_small_terms_on_a_large_vocabulary() {
        let (rows, v, temp) = (4usize, 151_936usize, 0.7);
        let data = big_vocab_logits(rows);
        let targets: Vec<u32> = vec![3, 151_935, 487 * 7 + 1, 100_000];
        let (want_ent, want_lp) = exact(&data, v, &targets, temp);
        let logits = Tensor::from_vec(data, (rows, v), &Device::Cpu).unwrap();
        let t = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
        for fused in [true, false] {
            let ent: Vec<f32> = entropy_impl(&logits, temp, fused)
                .unwrap()
                .to_vec1()
                .unwrap();
            let lp: Vec<f32> = log_probs_impl(&logits, &t, temp, fused)
                .unwrap()
                .to_vec1()
                .unwrap();
            for r in 0..rows {
                // The result is rounded to f32 once: ~6e-8 relative. A sequential f32 sum over
                // this vocabulary is off by ~1e-4 relative, so 1e-6 separates the two.
                let e_err = (f64::from(ent[r]) - want_ent[r]).abs() / want_ent[r].abs();
                let l_err = (f64::from(lp[r]) - want_lp[r]).abs() / want_lp[r].abs();
                assert!(
                    e_err < 1e-6,
                    "fused={fused} row {r}: entropy {} vs exact {} (rel {e_err:e})",
                    ent[r],
                    want_ent[r]
                );
                assert!(
                    l_err < 1e-6,
                    "fused={fused} row {r}: log-prob {} vs exact {} (rel {l_err:e})",
                    lp[r],
                    want_lp[r]
                );
            }
        }
    }
}
