//! Fused, differentiable kernels for training (f32 and f64 on the CPU; f32, f64 and bf16 on
//! CUDA GPUs).
//!
//! candle's own fused kernels have no backward pass, and composing the same maths from
//! primitive ops costs one tensor (and in backward, one zero-filled gradient plus an add) per
//! primitive. These custom ops do each computation in one pass over memory and implement
//! `bwd`, so a trainable model gets both speed and gradients: the CPU loops live next to each
//! op (`logits.rs`, `layers.rs`, `elementwise.rs`), the CUDA launches in `cuda/` (kernels in
//! ../kernels.cu).
//! Every op is checked against the composite formulation (values and gradients) in the tests;
//! the model's gradient and finite-difference tests run through them on every device present.
//! Models on other devices or dtypes use the composite path.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

type CResult<T> = candle_core::Result<T>;

/// Whether the fused kernels can run on this tensor: f32/f64 on the CPU; f32, f64 and bf16
/// on a CUDA GPU in a build with the `cuda` feature.
pub(crate) fn supported(t: &Tensor) -> bool {
    supported_on(t.device(), t.dtype())
}

/// [`supported`] by device and dtype.
pub(crate) fn supported_on(device: &candle_core::Device, dtype: DType) -> bool {
    match device {
        candle_core::Device::Cpu => matches!(dtype, DType::F32 | DType::F64),
        candle_core::Device::Cuda(_) => {
            cfg!(feature = "cuda") && matches!(dtype, DType::F32 | DType::F64 | DType::BF16)
        }
        _ => false,
    }
}

#[cfg(feature = "cuda")]
type Cs = candle_core::CudaStorage;

trait Real: Copy + Send + Sync + PartialOrd + 'static {
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn zero() -> Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
    fn neg_infinity() -> Self;
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    fn wrap(v: Vec<Self>) -> CpuStorage;
}

macro_rules! impl_real {
    ($t:ty, $variant:ident) => {
        impl Real for $t {
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn zero() -> Self {
                0.0
            }
            fn add(self, o: Self) -> Self {
                self + o
            }
            fn sub(self, o: Self) -> Self {
                self - o
            }
            fn mul(self, o: Self) -> Self {
                self * o
            }
            fn div(self, o: Self) -> Self {
                self / o
            }
            fn neg_infinity() -> Self {
                <$t>::NEG_INFINITY
            }
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn wrap(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(v)
            }
        }
    };
}

impl_real!(f32, F32);
impl_real!(f64, F64);

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

fn data<'a, T: Real>(s: &'a CpuStorage, l: &Layout, op: &str) -> CResult<&'a [T]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| err(format!("{op}: input must be contiguous")))?;
    let all = T::slice(s).ok_or_else(|| err(format!("{op}: inputs must share one float dtype")))?;
    Ok(&all[a..b])
}

fn u32_data<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> CResult<&'a [u32]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| err(format!("{op}: index input must be contiguous")))?;
    match s {
        CpuStorage::U32(v) => Ok(&v[a..b]),
        _ => Err(err(format!("{op}: indices must be u32"))),
    }
}

/// Runs `f(row_index, row)` over `out` split into rows of `row_len`, on candle's thread count.
fn par_rows<T: Send>(out: &mut [T], row_len: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    if row_len == 0 {
        return;
    }
    let rows = out.len() / row_len;
    let threads = candle_core::utils::get_num_threads().clamp(1, rows.max(1));
    if threads == 1 || out.len() < 16 * 1024 {
        for (r, row) in out.chunks_mut(row_len).enumerate() {
            f(r, row);
        }
        return;
    }
    let rows_per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        for (ci, block) in out.chunks_mut(rows_per * row_len).enumerate() {
            let f = &f;
            s.spawn(move || {
                for (j, row) in block.chunks_mut(row_len).enumerate() {
                    f(ci * rows_per + j, row);
                }
            });
        }
    });
}

macro_rules! dispatch {
    ($s:expr, $op:expr, $f:ident $(, $arg:expr)*) => {
        match $s {
            CpuStorage::F32(_) => $f::<f32>($($arg),*),
            CpuStorage::F64(_) => $f::<f64>($($arg),*),
            _ => Err(err(format!("{}: only f32 and f64 are supported", $op))),
        }
    };
}

#[cfg(feature = "cuda")]
mod adamw;
mod attention;
#[cfg(feature = "cuda")]
mod cuda;
mod elementwise;
mod embedding;
mod layers;
mod linear;
mod lm_head;
mod logits;
mod mlp;

pub(crate) use attention::{attention, attention_block};
pub(crate) use elementwise::{rope, swiglu};
pub(crate) use embedding::embedding;
pub(crate) use layers::{masked_softmax, rms_norm};
pub(crate) use linear::linear;
pub(crate) use lm_head::lm_head;
pub(crate) use logits::{entropy, log_probs};
pub(crate) use mlp::gate_up_swiglu;

#[cfg(feature = "cuda")]
pub(crate) use adamw::adamw_device_step;
#[cfg(feature = "cuda")]
pub(crate) use cuda::ipc as cuda_ipc;
#[cfg(feature = "cuda")]
pub(crate) use cuda::set_pool_release_threshold;

#[cfg(test)]
mod tests;
