//! The CUDA side of src/ipc.rs: device memory exported to and opened from another process of
//! the node (CUDA IPC), byte copies between it and candle's tensors on candle's stream, and
//! the launch of the `ipc_hash` kernel of kernels.cu.
//!
//! Why raw driver calls: candle allocates from the driver's stream-ordered pool, whose memory
//! `cuIpcGetMemHandle` cannot export, and cudarc has no safe IPC API. Every call binds the
//! device's context to the calling thread first (the compute thread that called it may have
//! another current context, or none).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType};

use super::{err, CResult, BLOCK, MODULE, PTX};

/// Most blocks of one `ipc_hash` launch (a few per SM of an H100).
const HASH_BLOCKS: usize = 1024;

/// Bytes of a CUDA IPC memory handle.
pub(crate) const HANDLE_BYTES: usize = sys::CU_IPC_HANDLE_SIZE as usize;

fn bind(dev: &CudaDevice) -> CResult<()> {
    dev.cuda_stream()
        .context()
        .bind_to_thread()
        .map_err(|e| err(format!("cannot make the GPU's context current: {e}")))
}

fn check(r: sys::CUresult, what: &str) -> CResult<()> {
    r.result().map_err(|e| err(format!("{what}: {e}")))
}

/// Device memory of this process, exported by handle.
pub(crate) struct Export {
    dev: CudaDevice,
    ptr: sys::CUdeviceptr,
}

impl Export {
    /// Allocates `bytes` (at least 1) outside candle's pool and exports them.
    pub(crate) fn new(dev: &CudaDevice, bytes: usize) -> CResult<(Export, [u8; HANDLE_BYTES])> {
        bind(dev)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the context is current on this thread.
        check(
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) },
            &format!("cannot allocate {bytes} bytes of GPU memory for the weight hand-over"),
        )?;
        let export = Export {
            dev: dev.clone(),
            ptr,
        };
        let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
        // SAFETY: `h` is a valid out-pointer for one handle; `ptr` is the base of a live
        // cuMemAlloc allocation of this context (the drop below frees it on error).
        check(
            unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), ptr) },
            "cannot export GPU memory by IPC handle",
        )?;
        // SAFETY: cuIpcGetMemHandle succeeded, so it wrote the whole handle (and zeroed() made
        // every byte initialised anyway).
        let h = unsafe { h.assume_init() };
        Ok((export, h.reserved.map(|b| b as u8)))
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        if bind(&self.dev).is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc_v2 in this context and is freed once. Pending
            // copies on candle's stream are waited for first, so none reads freed memory.
            unsafe {
                let _ = self.dev.cuda_stream().synchronize();
                let _ = sys::cuMemFree_v2(self.ptr);
            }
        }
    }
}

/// Another process's exported memory, mapped into this one.
pub(crate) struct Import {
    dev: CudaDevice,
    ptr: sys::CUdeviceptr,
}

impl Import {
    pub(crate) fn open(dev: &CudaDevice, handle: &[u8; HANDLE_BYTES]) -> CResult<Import> {
        bind(dev)?;
        let h = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the handle is plain bytes the driver checks
        // (a stale or foreign one is an error, not undefined behaviour). Peer access is
        // enabled on demand when the memory is on another GPU of the node.
        check(
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            "cannot open the trainer's GPU memory handle (CUDA IPC needs both processes on \
             GPUs of one node with peer access between them)",
        )?;
        Ok(Import {
            dev: dev.clone(),
            ptr,
        })
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes of the allocation behind the mapping, as the driver knows it (what the
    /// exporting process announced is checked against it).
    pub(crate) fn bytes(&self) -> CResult<usize> {
        bind(&self.dev)?;
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: both out-pointers are valid; `ptr` is this mapping's, open until drop.
        check(
            unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, self.ptr) },
            "cannot query the size of the trainer's GPU memory",
        )?;
        Ok(size.saturating_sub((self.ptr - base) as usize))
    }
}

impl Drop for Import {
    fn drop(&mut self) {
        if bind(&self.dev).is_ok() {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle_v2 and is closed once, after the
            // copies reading it have finished.
            unsafe {
                let _ = self.dev.cuda_stream().synchronize();
                let _ = sys::cuIpcCloseMemHandle(self.ptr);
            }
        }
    }
}

/// Device address of element 0 of `s` and its element size.
pub(crate) fn storage_ptr(s: &CudaStorage) -> (u64, usize) {
    let stream: std::sync::Arc<CudaStream> = s.device.cuda_stream();
    macro_rules! arms {
        ($($v:ident),*) => {
            match &s.slice {
                $(CudaStorageSlice::$v(x) => (x.device_ptr(&stream).0, s.dtype().size_in_bytes()),)*
            }
        };
    }
    arms!(U8, U32, I16, I32, I64, BF16, F16, F32, F64, F8E4M3, F6E2M3, F6E3M2, F4, F8E8M0)
}

/// Enqueues a copy of `len` bytes from `src` to `dst` on `dev`'s stream (candle's, so it is
/// ordered after the kernels that wrote `src`).
pub(crate) fn copy(dev: &CudaDevice, dst: u64, src: u64, len: usize) -> CResult<()> {
    if len == 0 {
        return Ok(());
    }
    bind(dev)?;
    let stream = dev.cuda_stream();
    // SAFETY: the callers check both ranges against their allocations' sizes; the stream is
    // the device's own, live as long as `dev`.
    check(
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream.cu_stream()) },
        "GPU copy of the weight hand-over",
    )
}

/// Waits for everything enqueued on `dev`'s stream.
pub(crate) fn sync(dev: &CudaDevice) -> CResult<()> {
    dev.cuda_stream().synchronize().w()
}

/// A zeroed buffer of `n` elements of `dtype` (one of the float types a model keeps).
pub(crate) fn zeros(dev: &CudaDevice, dtype: DType, n: usize) -> CResult<CudaStorage> {
    let n = n.max(1);
    Ok(match dtype {
        DType::BF16 => CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<half::bf16>(n)?, dev.clone()),
        DType::F16 => CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<half::f16>(n)?, dev.clone()),
        DType::F32 => CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>(n)?, dev.clone()),
        DType::F64 => CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f64>(n)?, dev.clone()),
        d => {
            return Err(err(format!(
                "weight hand-over: {d:?} parameters are not supported"
            )))
        }
    })
}

/// A running `ipc_hash` sum on the GPU: kernels add into one word, read back once.
pub(crate) struct HashAcc {
    dev: CudaDevice,
    out: CudaSlice<u64>,
}

impl HashAcc {
    pub(crate) fn new(dev: &CudaDevice) -> CResult<HashAcc> {
        Ok(HashAcc {
            dev: dev.clone(),
            out: dev.alloc_zeros::<u64>(1)?,
        })
    }

    /// Enqueues `ipc_hash` over `len` bytes (even) at `ptr`, unit indices from `base`.
    pub(crate) fn add(&mut self, ptr: u64, len: usize, base: u64) -> CResult<()> {
        let n = (len / 2) as u64;
        if n > 0 {
            let f = self.dev.get_or_load_custom_func("ipc_hash", MODULE, PTX)?;
            let mut a = f.builder();
            a.arg(&ptr).arg(&n).arg(&base).arg(&mut self.out);
            // Few blocks, each striding over many units: the kernel makes one atomic per block.
            let cfg = LaunchConfig {
                grid_dim: (
                    (n as usize).div_ceil(BLOCK as usize).clamp(1, HASH_BLOCKS) as u32,
                    1,
                    1,
                ),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: matches ipc_hash in kernels.cu; `ptr` holds `n` 16-bit units (the
            // caller checked the range) and `out` one u64.
            unsafe { a.launch(cfg) }.w()?;
        }
        Ok(())
    }

    /// The sum so far (waits for the kernels).
    pub(crate) fn finish(&self) -> CResult<u64> {
        let v = self.dev.cuda_stream().clone_dtoh(&self.out).w()?;
        Ok(v[0])
    }
}
