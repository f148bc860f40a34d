//! Log-probs of target tokens and entropies over the vocabulary, forward and backward.

use super::*;

// ---------------------------------------------------------------------------------------------
// log-probs of target tokens: log_softmax(x * scale)[target]

pub(super) struct LogProbs {
    pub(super) scale: f64,
}

/// log-sum-exp of `row * scale`, accumulated in f64 whatever the element type: summing a
/// 152k-entry vocabulary one f32 term after another loses the small terms (entropy was ~3e-5
/// off on a 512-entry vocabulary), while an f64 sum of terms <= 1 stays within ~1e-11.
fn row_lse<T: Real>(row: &[T], scale: f64) -> f64 {
    let mut m = f64::NEG_INFINITY;
    for &x in row {
        let v = x.to_f64() * scale;
        if v > m {
            m = v;
        }
    }
    let mut s = 0f64;
    for &x in row {
        s += (x.to_f64() * scale - m).exp();
    }
    m + s.ln()
}

fn log_probs_fwd<T: Real>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    scale: f64,
) -> CResult<(CpuStorage, Shape)> {
    let x = data::<T>(s1, l1, "log_probs")?;
    let idx = u32_data(s2, l2, "log_probs")?;
    let v = *l1.dims().last().unwrap_or(&1);
    let n = idx.len();
    if n * v != x.len() {
        return Err(err(format!(
            "log_probs: {n} targets for logits of shape {:?}",
            l1.dims()
        )));
    }
    if let Some(&bad) = idx.iter().find(|&&t| t as usize >= v) {
        return Err(err(format!(
            "log_probs: target {bad} outside vocabulary {v}"
        )));
    }
    let mut out = vec![T::zero(); n];
    par_rows(&mut out, 1, |r, o| {
        let row = &x[r * v..(r + 1) * v];
        o[0] = T::from_f64(row[idx[r] as usize].to_f64() * scale - row_lse(row, scale));
    });
    Ok((T::wrap(out), Shape::from(n)))
}

impl CustomOp2 for LogProbs {
    fn name(&self) -> &'static str {
        "fused-log-probs"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &Cs, l1: &Layout, s2: &Cs, l2: &Layout) -> CResult<(Cs, Shape)> {
        cuda::log_probs(s1, l1, s2, l2, self.scale)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        dispatch!(s1, self.name(), log_probs_fwd, s1, l1, s2, l2, self.scale)
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let g = logits.apply_op3_no_bwd(
            targets,
            &grad.contiguous()?,
            &LogProbsBwd { scale: self.scale },
        )?;
        Ok((Some(g), None))
    }
}

/// d/dx of g * log_softmax(x * s)[t] = g * s * (onehot(t) - softmax(x * s)).
pub(super) struct LogProbsBwd {
    pub(super) scale: f64,
}

fn log_probs_bwd<T: Real>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
    scale: f64,
) -> CResult<(CpuStorage, Shape)> {
    let x = data::<T>(s1, l1, "log_probs_bwd")?;
    let idx = u32_data(s2, l2, "log_probs_bwd")?;
    let g = data::<T>(s3, l3, "log_probs_bwd")?;
    let v = *l1.dims().last().unwrap_or(&1);
    let mut out = vec![T::zero(); x.len()];
    par_rows(&mut out, v, |r, o| {
        let row = &x[r * v..(r + 1) * v];
        let lse = row_lse(row, scale);
        let gs = g[r].to_f64() * scale;
        let t = idx[r] as usize;
        for (j, (oi, &xi)) in o.iter_mut().zip(row).enumerate() {
            let onehot = if j == t { gs } else { 0.0 };
            *oi = T::from_f64(onehot - gs * (xi.to_f64() * scale - lse).exp());
        }
    });
    Ok((T::wrap(out), l1.shape().clone()))
}

impl CustomOp3 for LogProbsBwd {
    fn name(&self) -> &'static str {
        "fused-log-probs-bwd"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &Cs,
        l1: &Layout,
        s2: &Cs,
        l2: &Layout,
        s3: &Cs,
        l3: &Layout,
    ) -> CResult<(Cs, Shape)> {
        cuda::log_probs_bwd(s1, l1, s2, l2, s3, l3, self.scale)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        dispatch!(
            s1,
            self.name(),
            log_probs_bwd,
            s1,
            l1,
            s2,
            l2,
            s3,
            l3,
            self.scale
        )
    }
}

/// `log_softmax(logits * scale)` gathered at `targets`: logits `[.., V]`, targets `[..]`.
pub(crate) fn log_probs(logits: &Tensor, targets: &Tensor, scale: f64) -> CResult<Tensor> {
    let v = logits.dim(candle_core::D::Minus1)?;
    let out_shape = targets.shape().clone();
    let x = logits.contiguous()?.reshape(((), v))?;
    let t = targets.to_dtype(DType::U32)?.contiguous()?.flatten_all()?;
    x.apply_op2(&t, LogProbs { scale })?.reshape(out_shape)
}

// ---------------------------------------------------------------------------------------------
// entropy of softmax(x * scale) per row

pub(super) struct Entropy {
    pub(super) scale: f64,
}

/// (lse, entropy) of softmax(row * scale), in f64 (see [`row_lse`]).
fn row_entropy<T: Real>(row: &[T], scale: f64) -> (f64, f64) {
    let lse = row_lse(row, scale);
    let mut pz = 0f64;
    for &x in row {
        let z = x.to_f64() * scale;
        pz += (z - lse).exp() * z;
    }
    (lse, lse - pz)
}

fn entropy_fwd<T: Real>(s1: &CpuStorage, l1: &Layout, scale: f64) -> CResult<(CpuStorage, Shape)> {
    let x = data::<T>(s1, l1, "entropy")?;
    let v = *l1.dims().last().unwrap_or(&1);
    let n = x.len() / v.max(1);
    let mut out = vec![T::zero(); n];
    par_rows(&mut out, 1, |r, o| {
        o[0] = T::from_f64(row_entropy(&x[r * v..(r + 1) * v], scale).1);
    });
    Ok((T::wrap(out), Shape::from(n)))
}

impl CustomOp1 for Entropy {
    fn name(&self) -> &'static str {
        "fused-entropy"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &Cs, l1: &Layout) -> CResult<(Cs, Shape)> {
        cuda::entropy(s1, l1, self.scale)
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout) -> CResult<(CpuStorage, Shape)> {
        dispatch!(s1, self.name(), entropy_fwd, s1, l1, self.scale)
    }

    fn bwd(&self, logits: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let g = logits.apply_op2_no_bwd(&grad.contiguous()?, &EntropyBwd { scale: self.scale })?;
        Ok(Some(g))
    }
}

/// dH/dx_j = -g * s * p_j * (log p_j + H).
pub(super) struct EntropyBwd {
    pub(super) scale: f64,
}

fn entropy_bwd<T: Real>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    scale: f64,
) -> CResult<(CpuStorage, Shape)> {
    let x = data::<T>(s1, l1, "entropy_bwd")?;
    let g = data::<T>(s2, l2, "entropy_bwd")?;
    let v = *l1.dims().last().unwrap_or(&1);
    let mut out = vec![T::zero(); x.len()];
    par_rows(&mut out, v, |r, o| {
        let row = &x[r * v..(r + 1) * v];
        let (lse, h) = row_entropy(row, scale);
        let gs = g[r].to_f64() * scale;
        for (oi, &xi) in o.iter_mut().zip(row) {
            let logp = xi.to_f64() * scale - lse;
            *oi = T::from_f64(-gs * logp.exp() * (logp + h));
        }
    });
    Ok((T::wrap(out), l1.shape().clone()))
}

impl CustomOp2 for EntropyBwd {
    fn name(&self) -> &'static str {
        "fused-entropy-bwd"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &Cs, l1: &Layout, s2: &Cs, l2: &Layout) -> CResult<(Cs, Shape)> {
        cuda::entropy_bwd(s1, l1, s2, l2, self.scale)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        dispatch!(s1, self.name(), entropy_bwd, s1, l1, s2, l2, self.scale)
    }
}

/// Entropy of softmax(logits * scale) over the last axis: logits `[.., V]`, result `[..]`.
pub(crate) fn entropy(logits: &Tensor, scale: f64) -> CResult<Tensor> {
    let dims = logits.dims();
    let out_shape: Vec<usize> = dims[..dims.len().saturating_sub(1)].to_vec();
    let v = logits.dim(candle_core::D::Minus1)?;
    logits
        .contiguous()?
        .reshape(((), v))?
        .apply_op1(Entropy { scale })?
        .reshape(out_shape)
}
