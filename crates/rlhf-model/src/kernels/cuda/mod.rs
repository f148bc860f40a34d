//! The CUDA side of the fused differentiable kernels (src/kernels/): launches the kernels of
//! src/kernels.cu (built to PTX by build.rs) for f32, f64 and bf16 tensors on a GPU.
//!
//! Why: on a GPU the composite formulation of RMSNorm, RoPE, the masked softmax, SwiGLU and
//! the log-softmax launches one kernel per primitive op forward and several backward, plus a
//! zero-filled gradient and an add per op; a 0.5B model's training step was launch- and
//! bandwidth-bound on them. Each op here is one kernel forward and one or three backward, with
//! the CPU kernels' maths (the gradient and finite-difference tests run through both).
//! AdamW's device path gets the same treatment: two kernels per parameter instead of ~15.
//! Inputs must be contiguous (the wrappers in src/kernels/ make them so); outputs are new
//! buffers, except the AdamW update, which writes the parameter in place as the CPU step does.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Shape, WithDType};

use crate::train::StepScalars;

use super::{err, CResult};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rlhf_kernels.ptx"));
/// The name candle caches the loaded module under (one per device).
const MODULE: &str = "rlhf-model-fused-kernels";
/// Threads per block; the kernels' block reductions assume a multiple of 32.
pub(super) const BLOCK: u32 = 256;

/// Element types the kernels are built for.
pub(super) trait Elem: DeviceRepr + WithDType + CudaDType {
    /// The kernels' accumulator type, which per-row results (log-probs, entropies) leave in:
    /// f32 for bf16.
    type Wide: Elem;
}
impl Elem for f32 {
    type Wide = f32;
}
impl Elem for f64 {
    type Wide = f64;
}
impl Elem for half::bf16 {
    type Wide = f32;
}

macro_rules! by_dtype {
    ($dtype:expr, $op:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            d => Err(err(format!("{}: {d:?} is not supported on CUDA (f32, f64, bf16)", $op))),
        }
    };
}

/// The name of `base`'s kernel for `dtype` in kernels.cu (`rms_norm_bf16`, ...).
pub(super) fn kname(base: &str, dtype: DType) -> String {
    format!("{base}_{}", dtype.as_str())
}

pub(super) fn view<'a, T: Elem>(
    s: &'a CudaStorage,
    l: &Layout,
    op: &str,
) -> CResult<CudaView<'a, T>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| err(format!("{op}: input must be contiguous")))?;
    Ok(s.as_cuda_slice::<T>()
        .map_err(|_| err(format!("{op}: inputs must share one float dtype")))?
        .slice(a..b))
}

pub(super) fn u32_view<'a>(s: &'a CudaStorage, l: &Layout, op: &str) -> CResult<CudaView<'a, u32>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| err(format!("{op}: index input must be contiguous")))?;
    Ok(s.as_cuda_slice::<u32>()
        .map_err(|_| err(format!("{op}: indices must be u32")))?
        .slice(a..b))
}

/// A new buffer of `n` elements (at least one: a zero-sized allocation is not portable).
pub(super) fn alloc<T: Elem>(dev: &CudaDevice, n: usize) -> CResult<CudaSlice<T>> {
    // SAFETY: every element the result's shape covers is written by the kernel launched next;
    // the spare element of an empty result is never read.
    unsafe { dev.alloc::<T>(n.max(1)) }
}

pub(super) fn wrap<T: Elem>(s: CudaSlice<T>, dev: &CudaDevice) -> CudaStorage {
    CudaStorage::wrap_cuda_slice(s, dev.clone())
}

/// One block per row.
pub(super) fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Grid-stride loops over `n` elements.
pub(super) fn per_elem(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK as usize).clamp(1, 65_535) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn last_dim(l: &Layout) -> usize {
    *l.dims().last().unwrap_or(&1)
}

pub(super) fn u32_of(n: usize, what: &str, op: &str) -> CResult<u32> {
    u32::try_from(n).map_err(|_| err(format!("{op}: {what} {n} exceeds the kernels' u32 range")))
}

pub(crate) mod ipc;
mod layers;
mod logits;

pub(crate) use layers::{
    embedding_bwd, masked_softmax, rms_norm, rms_norm_bwd_w, rms_norm_bwd_x, rope, softmax_bwd,
    swiglu, swiglu_bwd,
};
pub(crate) use logits::{entropy, entropy_bwd, log_probs, log_probs_bwd};

// ---- AdamW (f32 parameters, f32 moments) ---------------------------------------------------

/// New moments `[m; v]` (`2k` f32) from the gradient `g` `[k]` and the old moments.
pub(crate) fn adamw_moments(
    g: (&CudaStorage, &Layout),
    m: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    s: &StepScalars,
) -> CResult<(CudaStorage, Shape)> {
    let op = "adamw_moments";
    let dev = g.0.device();
    let k = g.1.shape().elem_count();
    if m.1.shape().elem_count() != k || v.1.shape().elem_count() != k {
        return Err(err(format!(
            "{op}: gradient of {k} vs moments {:?}, {:?}",
            m.1.dims(),
            v.1.dims()
        )));
    }
    let (gv, mv, vv) = (
        view::<f32>(g.0, g.1, op)?,
        view::<f32>(m.0, m.1, op)?,
        view::<f32>(v.0, v.1, op)?,
    );
    let out = alloc::<f32>(dev, 2 * k)?;
    if k > 0 {
        let f = dev.get_or_load_custom_func("adamw_moments_f32", MODULE, PTX)?;
        let mut a = f.builder();
        a.arg(&gv)
            .arg(&mv)
            .arg(&vv)
            .arg(&out)
            .arg(&k)
            .arg(&s.beta1)
            .arg(&s.beta2)
            .arg(&s.one_minus_beta1)
            .arg(&s.one_minus_beta2)
            .arg(&s.grad_scale);
        // SAFETY: matches adamw_moments_f32 in kernels.cu; inputs hold k values, out 2k.
        unsafe { a.launch(per_elem(k)) }.w()?;
    }
    Ok((wrap(out, dev), Shape::from(2 * k)))
}

/// Updates `p[owned]` (an f32 parameter, in place) from the new moments `[m; v]`.
pub(crate) fn adamw_apply(
    p: (&mut CudaStorage, &Layout),
    mv: (&CudaStorage, &Layout),
    owned: std::ops::Range<usize>,
    k: &StepScalars,
) -> CResult<()> {
    let op = "adamw_apply";
    let (ps, pl) = p;
    let dev = ps.device().clone();
    let n = owned.len();
    if mv.1.shape().elem_count() != 2 * n {
        return Err(err(format!(
            "{op}: moments {:?} for {n} owned values",
            mv.1.dims()
        )));
    }
    let (p0, p1) = pl
        .contiguous_offsets()
        .ok_or_else(|| err(format!("{op}: the parameter must be contiguous")))?;
    if owned.end > p1 - p0 {
        return Err(err(format!(
            "{op}: owned {owned:?} outside {} values",
            p1 - p0
        )));
    }
    let mvv = view::<f32>(mv.0, mv.1, op)?;
    let slice = ps
        .as_cuda_slice_mut::<f32>()
        .map_err(|_| err(format!("{op}: the parameter must be f32")))?;
    let mut pv = slice.slice_mut(p0 + owned.start..p0 + owned.end);
    if n > 0 {
        let f = dev.get_or_load_custom_func("adamw_apply_f32", MODULE, PTX)?;
        let mut a = f.builder();
        a.arg(&mut pv)
            .arg(&mvv)
            .arg(&n)
            .arg(&k.lr)
            .arg(&k.eps)
            .arg(&k.decay_factor)
            .arg(&k.inv_bc1)
            .arg(&k.inv_sqrt_bc2);
        // SAFETY: matches adamw_apply_f32 in kernels.cu; pv holds the n owned values, mvv 2n.
        unsafe { a.launch(per_elem(n)) }.w()?;
    }
    Ok(())
}

// ---- The default memory pool ---------------------------------------------------------------

/// Sets the release threshold of `dev`'s default memory pool (bytes kept across syncs).
pub(crate) fn set_pool_release_threshold(dev: &CudaDevice, bytes: u64) -> CResult<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let cu_dev = dev.cuda_stream().context().cu_device();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer for one handle; the device handle comes from a
    // live context. The default pool lives as long as the device.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, cu_dev) }
        .result()
        .map_err(|e| err(format!("cannot get the device's default memory pool: {e}")))?;
    let mut value: u64 = bytes;
    // SAFETY: the release threshold attribute takes a pointer to a cuuint64_t, which `value`
    // is for the length of the call.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut value as *mut u64 as *mut std::ffi::c_void,
        )
    }
    .result()
    .map_err(|e| {
        err(format!(
            "cannot set the memory pool's release threshold: {e}"
        ))
    })
}
