//! Differentiable log-prob and entropy helpers on logits.

use candle_core::{DType, Tensor, D};

use crate::error::{Error, Result};

fn scaled_log_softmax(logits: &Tensor, temperature: f64) -> Result<Tensor> {
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "temperature must be positive for log-probs, got {temperature}"
        )));
    }
    let internal = if logits.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let x = logits.to_dtype(internal)?;
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

/// `fused` allows the one-pass CPU kernel where it applies (f32/f64 on CPU).
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
    Ok(lsm.gather(&idx, D::Minus1)?.squeeze(D::Minus1)?)
}

/// Entropy `-sum p log p` of softmax(logits / temperature) over the last axis.
pub fn entropy_from_logits(logits: &Tensor, temperature: f64) -> Result<Tensor> {
    entropy_impl(logits, temperature, true)
}

/// `fused` allows the one-pass CPU kernel where it applies (f32/f64 on CPU).
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
    Ok((p * lsm)?.sum(D::Minus1)?.neg()?)
}

/// Sum of `xs * mask` divided by the number of unmasked entries (0 when there are none).
pub fn masked_mean(xs: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let mask = mask.to_dtype(xs.dtype())?;
    let n = mask.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let s = (xs * &mask)?.sum_all()?;
    Ok((s / n.max(1.0))?)
}
