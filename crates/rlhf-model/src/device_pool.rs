//! How much freed GPU memory a process keeps for its next allocations.
//!
//! candle allocates through the CUDA driver's stream-ordered allocator, whose default pool
//! hands every freed byte back to the driver at the next synchronisation (a release threshold
//! of 0). A training step frees gigabytes of activations and ends with a read back to the
//! host, so the next step maps all of it again. PyTorch's caching allocator keeps such memory;
//! [`keep_freed_device_memory`] lets a process do the same (`model_bench` measures a step
//! both ways).

use candle_core::Device;

use crate::error::Result;

/// Keeps up to `bytes` of freed memory in `device`'s default pool across synchronisations
/// (`u64::MAX`: all of it). Nothing to do on the CPU or in a build without `cuda`.
pub fn keep_freed_device_memory(device: &Device, bytes: u64) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        crate::kernels::set_pool_release_threshold(d, bytes)?;
    }
    let _ = (device, bytes);
    Ok(())
}
