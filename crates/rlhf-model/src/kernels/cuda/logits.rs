//! CUDA launches of the log-probs and entropy ops over the vocabulary.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Shape};

use super::*;

// ---- log-probs and entropy -----------------------------------------------------------------

pub(crate) fn log_probs(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    scale: f64,
) -> CResult<(CudaStorage, Shape)> {
    by_dtype!(s1.dtype(), "log_probs", log_probs_t(s1, l1, s2, l2, scale))
}

fn log_probs_t<T: Elem>(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    scale: f64,
) -> CResult<(CudaStorage, Shape)> {
    let op = "log_probs";
    let dev = s1.device();
    let v = last_dim(l1);
    let n = l2.shape().elem_count();
    if n * v != l1.shape().elem_count() {
        return Err(err(format!(
            "{op}: {n} targets for logits of shape {:?}",
            l1.dims()
        )));
    }
    let (x, idx) = (view::<T>(s1, l1, op)?, u32_view(s2, l2, op)?);
    let out = alloc::<T::Wide>(dev, n)?;
    if n > 0 {
        let v32 = u32_of(v, "vocabulary", op)?;
        let f = dev.get_or_load_custom_func(&kname(op, T::DTYPE), MODULE, PTX)?;
        let mut a = f.builder();
        a.arg(&x).arg(&idx).arg(&out).arg(&v32).arg(&scale);
        // SAFETY: matches log_probs_* in kernels.cu; x is [n, v], idx and out [n]; a target
        // outside the vocabulary yields NaN instead of being read.
        unsafe { a.launch(per_row(n)) }.w()?;
    }
    Ok((wrap(out, dev), Shape::from(n)))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn log_probs_bwd(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
    scale: f64,
) -> CResult<(CudaStorage, Shape)> {
    by_dtype!(
        s1.dtype(),
        "log_probs_bwd",
        log_probs_bwd_t(s1, l1, s2, l2, s3, l3, scale)
    )
}

#[allow(clippy::too_many_arguments)]
fn log_probs_bwd_t<T: Elem>(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
    scale: f64,
) -> CResult<(CudaStorage, Shape)> {
    let op = "log_probs_bwd";
    let dev = s1.device();
    let v = last_dim(l1);
    let n = l2.shape().elem_count();
    if n * v != l1.shape().elem_count() || l3.shape().elem_count() != n {
        return Err(err(format!(
            "{op}: logits {:?} vs targets {:?}",
            l1.dims(),
            l2.dims()
        )));
    }
    let (x, idx, g) = (
        view::<T>(s1, l1, op)?,
        u32_view(s2, l2, op)?,
        view::<T::Wide>(s3, l3, op)?,
    );
    let out = alloc::<T>(dev, n * v)?;
    if n > 0 {
        let v32 = u32_of(v, "vocabulary", op)?;
        let f = dev.get_or_load_custom_func(&kname(op, T::DTYPE), MODULE, PTX)?;
        let mut a = f.builder();
        a.arg(&x).arg(&idx).arg(&g).arg(&out).arg(&v32).arg(&scale);
        // SAFETY: matches log_probs_bwd_* in kernels.cu; x and out are [n, v], idx and g [n].
        unsafe { a.launch(per_row(n)) }.w()?;
    }
    Ok((wrap(out, dev), l1.shape().clone()))
}

pub(crate) fn entropy(s1: &CudaStorage, l1: &Layout, scale: f64) -> CResult<(CudaStorage, Shape)> {
    by_dtype!(s1.dtype(), "entropy", entropy_t(s1, l1, scale))
}

fn entropy_t<T: Elem>(s1: &CudaStorage, l1: &Layout, scale: f64) -> CResult<(CudaStorage, Shape)> {
    let op = "entropy";
    let dev = s1.device();
    let v = last_dim(l1);
    let n = l1.shape().elem_count() / v.max(1);
    let x = view::<T>(s1, l1, op)?;
    let out = alloc::<T::Wide>(dev, n)?;
    if n > 0 {
        let v32 = u32_of(v, "vocabulary", op)?;
        let f = dev.get_or_load_custom_func(&kname(op, T::DTYPE), MODULE, PTX)?;
        let mut a = f.builder();
        a.arg(&x).arg(&out).arg(&v32).arg(&scale);
        // SAFETY: matches entropy_* in kernels.cu; x is [n, v], out [n].
        unsafe { a.launch(per_row(n)) }.w()?;
    }
    Ok((wrap(out, dev), Shape::from(n)))
}

pub(crate) fn entropy_bwd(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    scale: f64,
) -> CResult<(CudaStorage, Shape)> {
    by_dtype!(
        s1.dtype(),
        "entropy_bwd",
        entropy_bwd_t(s1, l1, s2, l2, scale)
    )
}

fn entropy_bwd_t<T: Elem>(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    scale: f64,
) -> CResult<(CudaStorage, Shape)> {
    let op = "entropy_bwd";
    let dev = s1.device();
    let v = last_dim(l1);
    let n = l1.shape().elem_count() / v.max(1);
    if l2.shape().elem_count() != n {
        return Err(err(format!(
            "{op}: logits {:?} vs grad {:?}",
            l1.dims(),
            l2.dims()
        )));
    }
    let (x, g) = (view::<T>(s1, l1, op)?, view::<T::Wide>(s2, l2, op)?);
    let out = alloc::<T>(dev, n * v)?;
    if n > 0 {
        let v32 = u32_of(v, "vocabulary", op)?;
        let f = dev.get_or_load_custom_func(&kname(op, T::DTYPE), MODULE, PTX)?;
        let mut a = f.builder();
        a.arg(&x).arg(&g).arg(&out).arg(&v32).arg(&scale);
        // SAFETY: matches entropy_bwd_* in kernels.cu; x and out are [n, v], g [n].
        unsafe { a.launch(per_row(n)) }.w()?;
    }
    Ok((wrap(out, dev), l1.shape().clone()))
}
