//! CUDA launches of the decoder's ops: masked softmax, RMSNorm, SwiGLU, RoPE.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg, ValidAsZeroBits};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Shape};

use super::*;

// ---- softmax(scores + mask) and its backward ---------------------------------------------

pub(crate) fn masked_softmax(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    b: usize,
    t: usize,
) -> CResult<(CudaStorage, Shape)> {
    by_dtype!(
        s1.dtype(),
        "masked_softmax",
        masked_softmax_t(s1, l1, s2, l2, b, t)
    )
}

fn masked_softmax_t<T: Elem>(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    b: usize,
    t: usize,
) -> CResult<(CudaStorage, Shape)> {
    let op = "masked_softmax";
    let dev = s1.device();
    let s = last_dim(l1);
    let n = l1.shape().elem_count();
    let rows = n / s.max(1);
    if b == 0 || t == 0 || !rows.is_multiple_of(b * t) || l2.shape().elem_count() != b * t * s {
        return Err(err(format!(
            "{op}: scores {:?} do not match mask {:?}",
            l1.dims(),
            l2.dims()
        )));
    }
    let x = view::<T>(s1, l1, op)?;
    let mask = view::<T>(s2, l2, op)?;
    let out = alloc::<T>(dev, n)?;
    if rows > 0 {
        let (s32, pb, t32) = (
            u32_of(s, "row", op)?,
            u32_of(rows / b, "rows", op)?,
            t as u32,
        );
        let f = dev.get_or_load_custom_func(&kname(op, T::DTYPE), MODULE, PTX)?;
        let mut a = f.builder();
        a.arg(&x).arg(&mask).arg(&out).arg(&s32).arg(&pb).arg(&t32);
        // SAFETY: the argument list matches masked_softmax_* in kernels.cu; every row index
        // the grid covers lies inside x and out ([rows, s]) and the mask ([b * t, s]).
        unsafe { a.launch(per_row(rows)) }.w()?;
    }
    Ok((wrap(out, dev), l1.shape().clone()))
}

pub(crate) fn softmax_bwd(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> CResult<(CudaStorage, Shape)> {
    by_dtype!(s1.dtype(), "softmax_bwd", softmax_bwd_t(s1, l1, s2, l2))
}

fn softmax_bwd_t<T: Elem>(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> CResult<(CudaStorage, Shape)> {
    let op = "softmax_bwd";
    let dev = s1.device();
    let (s, n) = (last_dim(l1), l1.shape().elem_count());
    if l2.shape().elem_count() != n {
        return Err(err(format!("{op}: {:?} vs {:?}", l1.dims(), l2.dims())));
    }
    let (y, g) = (view::<T>(s1, l1, op)?, view::<T>(s2, l2, op)?);
    let out = alloc::<T>(dev, n)?;
    let rows = n / s.max(1);
    if rows > 0 {
        let s32 = u32_of(s, "row", op)?;
        let f = dev.get_or_load_custom_func(&kname(op, T::DTYPE), MODULE, PTX)?;
        let mut a = f.builder();
        a.arg(&y).arg(&g).arg(&out).arg(&s32);
        // SAFETY: matches softmax_bwd_* in kernels.cu; all three buffers are [rows, s].
        unsafe { a.launch(per_row(rows)) }.w()?;
    }
    Ok((wrap(out, dev), l1.shape().clone()))
}

// ---- RMSNorm -------------------------------------------------------------------------------

fn rms_dims(l1: &Layout, h: usize, op: &str) -> CResult<usize> {
    let n = l1.shape().elem_count();
    if h == 0 || !n.is_multiple_of(h) {
        return Err(err(format!("{op}: input {:?} vs weight of {h}", l1.dims())));
    }
    Ok(n / h)
}

pub(crate) fn rms_norm(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    eps: f64,
) -> CResult<(CudaStorage, Shape)> {
    by_dtype!(s1.dtype(), "rms_norm", rms_norm_t(s1, l1, s2, l2, eps))
}

fn rms_norm_t<T: Elem>(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    eps: f64,
) -> CResult<(CudaStorage, Shape)> {
    let op = "rms_norm";
    let dev = s1.device();
    let h = l2.shape().elem_count();
    let rows = rms_dims(l1, h, op)?;
    let (x, w) = (view::<T>(s1, l1, op)?, view::<T>(s2, l2, op)?);
    let out = alloc::<T>(dev, rows * h)?;
    if rows > 0 {
        let h32 = u32_of(h, "width", op)?;
        let f = dev.get_or_load_custom_func(&kname(op, T::DTYPE), MODULE, PTX)?;
        let mut a = f.builder();
        a.arg(&x).arg(&w).arg(&out).arg(&h32).arg(&eps);
        // SAFETY: matches rms_norm_* in kernels.cu; x and out are [rows, h], w is [h].
        unsafe { a.launch(per_row(rows)) }.w()?;
    }
    Ok((wrap(out, dev), l1.shape().clone()))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_bwd_x(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
    eps: f64,
) -> CResult<(CudaStorage, Shape)> {
    by_dtype!(
        s1.dtype(),
        "rms_norm_bwd_x",
        rms_norm_bwd_x_t(s1, l1, s2, l2, s3, l3, eps)
    )
}

#[allow(clippy::too_many_arguments)]
fn rms_norm_bwd_x_t<T: Elem>(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
    eps: f64,
) -> CResult<(CudaStorage, Shape)> {
    let op = "rms_norm_bwd_x";
    let dev = s1.device();
    let h = l2.shape().elem_count();
    let rows = rms_dims(l1, h, op)?;
    if l3.shape().elem_count() != rows * h {
        return Err(err(format!(
            "{op}: grad {:?} vs x {:?}",
            l3.dims(),
            l1.dims()
        )));
    }
    let (x, w, g) = (
        view::<T>(s1, l1, op)?,
        view::<T>(s2, l2, op)?,
        view::<T>(s3, l3, op)?,
    );
    let out = alloc::<T>(dev, rows * h)?;
    if rows > 0 {
        let h32 = u32_of(h, "width", op)?;
        let f = dev.get_or_load_custom_func(&kname(op, T::DTYPE), MODULE, PTX)?;
        let mut a = f.builder();
        a.arg(&x).arg(&w).arg(&g).arg(&out).arg(&h32).arg(&eps);
        // SAFETY: matches rms_norm_bwd_x_* in kernels.cu; x, g and out are [rows, h], w [h].
        unsafe { a.launch(per_row(rows)) }.w()?;
    }
    Ok((wrap(out, dev), l1.shape().clone()))
}

pub(crate) fn rms_norm_bwd_w(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    eps: f64,
) -> CResult<(CudaStorage, Shape)> {
    by_dtype!(
        s1.dtype(),
        "rms_norm_bwd_w",
        rms_norm_bwd_w_t(s1, l1, s2, l2, eps)
    )
}

/// Rows summed by one block column of the weight-gradient reduction (at least; more when
/// the rows would need more splits than a grid's y dimension holds).
const ROWS_PER_SPLIT: usize = 32;
/// The largest grid y dimension CUDA launches.
const MAX_GRID_Y: usize = 65_535;

fn rms_norm_bwd_w_t<T: Elem>(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    eps: f64,
) -> CResult<(CudaStorage, Shape)> {
    let op = "rms_norm_bwd_w";
    let dev = s1.device();
    let h = last_dim(l1);
    let rows = rms_dims(l1, h, op)?;
    if l2.shape().elem_count() != rows * h {
        return Err(err(format!(
            "{op}: grad {:?} vs x {:?}",
            l2.dims(),
            l1.dims()
        )));
    }
    let (x, g) = (view::<T>(s1, l1, op)?, view::<T>(s2, l2, op)?);
    let out = alloc::<T>(dev, h)?;
    // Sums in the kernels' accumulator type: double for f64, float otherwise.
    let acc = if T::DTYPE == DType::F64 { 8 } else { 4 };
    let per_split = ROWS_PER_SPLIT.max(rows.div_ceil(MAX_GRID_Y));
    let splits = rows.div_ceil(per_split).max(1);
    // SAFETY: scratch written in full (invs by rms_inv, partial by the partial sums) before it
    // is read; both are u8 buffers sized for `rows` and `splits * h` accumulator values.
    let invs = unsafe { dev.alloc::<u8>(rows.max(1) * acc)? };
    let partial = unsafe { dev.alloc::<u8>(splits * h.max(1) * acc)? };
    let (h32, rows32) = (u32_of(h, "width", op)?, u32_of(rows, "rows", op)?);
    let (rps, splits32) = (u32_of(per_split, "rows per split", op)?, splits as u32);
    if rows > 0 {
        let f = dev.get_or_load_custom_func(&kname("rms_inv", T::DTYPE), MODULE, PTX)?;
        let mut a = f.builder();
        a.arg(&x).arg(&invs).arg(&h32).arg(&eps);
        // SAFETY: matches rms_inv_* in kernels.cu: x [rows, h], invs [rows].
        unsafe { a.launch(per_row(rows)) }.w()?;
    }
    let cols = h.div_ceil(BLOCK as usize) as u32;
    let f = dev.get_or_load_custom_func(&kname("rms_norm_bwd_w_partial", T::DTYPE), MODULE, PTX)?;
    let mut a = f.builder();
    a.arg(&x)
        .arg(&g)
        .arg(&invs)
        .arg(&partial)
        .arg(&rows32)
        .arg(&h32)
        .arg(&rps);
    let cfg = LaunchConfig {
        grid_dim: (cols.max(1), splits32, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: matches rms_norm_bwd_w_partial_* in kernels.cu; split y covers rows
    // [y * rps, min(rows, (y + 1) * rps)) and writes partial[y, 0..h].
    unsafe { a.launch(cfg) }.w()?;
    let f = dev.get_or_load_custom_func(&kname("sum_partials", T::DTYPE), MODULE, PTX)?;
    let mut a = f.builder();
    a.arg(&partial).arg(&out).arg(&splits32).arg(&h32);
    // SAFETY: matches sum_partials_* in kernels.cu: partial [splits, h] into out [h].
    unsafe { a.launch(per_elem(h)) }.w()?;
    Ok((wrap(out, dev), Shape::from(h)))
}

// ---- SwiGLU --------------------------------------------------------------------------------

pub(crate) fn swiglu(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> CResult<(CudaStorage, Shape)> {
    by_dtype!(s1.dtype(), "swiglu", swiglu_t(s1, l1, s2, l2))
}

fn swiglu_t<T: Elem>(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> CResult<(CudaStorage, Shape)> {
    let op = "swiglu";
    let dev = s1.device();
    let n = l1.shape().elem_count();
    if l2.shape().elem_count() != n {
        return Err(err(format!(
            "{op}: gate {:?} vs up {:?}",
            l1.dims(),
            l2.dims()
        )));
    }
    let (g, u) = (view::<T>(s1, l1, op)?, view::<T>(s2, l2, op)?);
    let out = alloc::<T>(dev, n)?;
    if n > 0 {
        let f = dev.get_or_load_custom_func(&kname(op, T::DTYPE), MODULE, PTX)?;
        let mut a = f.builder();
        a.arg(&g).arg(&u).arg(&out).arg(&n);
        // SAFETY: matches swiglu_* in kernels.cu; all three buffers hold n elements.
        unsafe { a.launch(per_elem(n)) }.w()?;
    }
    Ok((wrap(out, dev), l1.shape().clone()))
}

pub(crate) fn swiglu_bwd(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
) -> CResult<(CudaStorage, Shape)> {
    by_dtype!(
        s1.dtype(),
        "swiglu_bwd",
        swiglu_bwd_t(s1, l1, s2, l2, s3, l3)
    )
}

fn swiglu_bwd_t<T: Elem>(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
) -> CResult<(CudaStorage, Shape)> {
    let op = "swiglu_bwd";
    let dev = s1.device();
    let n = l1.shape().elem_count();
    if l2.shape().elem_count() != n || l3.shape().elem_count() != n {
        return Err(err(format!(
            "{op}: gate {:?}, up {:?}, grad {:?}",
            l1.dims(),
            l2.dims(),
            l3.dims()
        )));
    }
    let (g, u, d) = (
        view::<T>(s1, l1, op)?,
        view::<T>(s2, l2, op)?,
        view::<T>(s3, l3, op)?,
    );
    let out = alloc::<T>(dev, 2 * n)?;
    if n > 0 {
        let f = dev.get_or_load_custom_func(&kname(op, T::DTYPE), MODULE, PTX)?;
        let mut a = f.builder();
        a.arg(&g).arg(&u).arg(&d).arg(&out).arg(&n);
        // SAFETY: matches swiglu_bwd_* in kernels.cu; inputs hold n elements, out 2n.
        unsafe { a.launch(per_elem(n)) }.w()?;
    }
    Ok((wrap(out, dev), Shape::from(2 * n)))
}

// ---- RoPE ----------------------------------------------------------------------------------

#[allow(clippy::too_many_arguments)]
pub(crate) fn rope(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
    inverse: bool,
) -> CResult<(CudaStorage, Shape)> {
    by_dtype!(s1.dtype(), "rope", rope_t(s1, l1, s2, l2, s3, l3, inverse))
}

#[allow(clippy::too_many_arguments)]
fn rope_t<T: Elem>(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
    inverse: bool,
) -> CResult<(CudaStorage, Shape)> {
    let op = "rope";
    let dev = s1.device();
    let dims = l1.dims();
    let [b, h, t, d] = dims else {
        return Err(err(format!("{op}: expected [B, H, T, D], got {dims:?}")));
    };
    let (b, h, t, d) = (*b, *h, *t, *d);
    let half = d / 2;
    let tab = l2.shape().elem_count();
    if tab != b * t * half || l3.shape().elem_count() != tab || d % 2 != 0 {
        return Err(err(format!("{op}: x {dims:?} vs cos {:?}", l2.dims())));
    }
    let (x, cos, sin) = (
        view::<T>(s1, l1, op)?,
        view::<T>(s2, l2, op)?,
        view::<T>(s3, l3, op)?,
    );
    let n = b * h * t * d;
    let out = alloc::<T>(dev, n)?;
    let pairs = n / 2;
    if pairs > 0 {
        let (h32, t32, d32) = (u32_of(h, "heads", op)?, u32_of(t, "length", op)?, d as u32);
        let inv: i32 = inverse.into();
        let f = dev.get_or_load_custom_func(&kname(op, T::DTYPE), MODULE, PTX)?;
        let mut a = f.builder();
        a.arg(&x)
            .arg(&cos)
            .arg(&sin)
            .arg(&out)
            .arg(&h32)
            .arg(&t32)
            .arg(&d32)
            .arg(&pairs)
            .arg(&inv);
        // SAFETY: matches rope_* in kernels.cu; x and out are [b, h, t, d], cos and sin
        // [b, t, d / 2], and each pair index maps inside them.
        unsafe { a.launch(per_elem(pairs)) }.w()?;
    }
    Ok((wrap(out, dev), l1.shape().clone()))
}

// ---- Embedding backward --------------------------------------------------------------------

/// The `[v, h]` table gradient (in the accumulator dtype: f32 for bf16) from the rows' ids
/// `[n]` (u32) and their gradients `g` `[n, h]`.
pub(crate) fn embedding_bwd(
    ids: (&CudaStorage, &Layout),
    g: (&CudaStorage, &Layout),
    v: usize,
) -> CResult<(CudaStorage, Shape)> {
    by_dtype!(g.0.dtype(), "embedding_bwd", embedding_bwd_t(ids, g, v))
}

fn embedding_bwd_t<T: Elem>(
    ids: (&CudaStorage, &Layout),
    g: (&CudaStorage, &Layout),
    v: usize,
) -> CResult<(CudaStorage, Shape)>
where
    T::Wide: ValidAsZeroBits,
{
    let op = "embedding_bwd";
    let dev = g.0.device();
    let n = ids.1.shape().elem_count();
    let total = g.1.shape().elem_count();
    if n == 0 || !total.is_multiple_of(n) {
        return Err(err(format!(
            "{op}: {n} ids for gradients of shape {:?}",
            g.1.dims()
        )));
    }
    let h = total / n;
    let (iv, gv) = (u32_view(ids.0, ids.1, op)?, view::<T>(g.0, g.1, op)?);
    let out = dev.alloc_zeros::<T::Wide>((v * h).max(1))?;
    let (n32, h32, v32) = (
        u32_of(n, "row count", op)?,
        u32_of(h, "row width", op)?,
        u32_of(v, "vocabulary", op)?,
    );
    let f = dev.get_or_load_custom_func(&kname(op, T::DTYPE), MODULE, PTX)?;
    let mut a = f.builder();
    a.arg(&iv).arg(&gv).arg(&out).arg(&n32).arg(&h32).arg(&v32);
    // SAFETY: matches embedding_bwd_* in kernels.cu; ids hold n values, g n x h, out v x h
    // (ids >= v are skipped by the kernel).
    unsafe { a.launch(per_row(n)) }.w()?;
    Ok((wrap(out, dev), Shape::from((v, h))))
}
