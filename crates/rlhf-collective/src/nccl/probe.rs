//! Before cudarc is touched: whether the CUDA driver and NCCL libraries can be loaded (cudarc
//! panics when they cannot, so [`probe`] asks `dlopen` first and names the fix), a guard that
//! turns a panic inside cudarc into an error, and NCCL unique ids as the bytes a rank ships
//! to the others.

use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::nccl::Id;

use super::{BACKEND, ID_BYTES};
use crate::error::{Error, Op, Result};

pub(super) fn unavailable(reason: impl Into<String>) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        reason: reason.into(),
    }
}

/// Whether `dlopen` can load `name` (the handle is closed again).
fn can_dlopen(name: &str) -> bool {
    let Ok(c) = CString::new(name) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call; dlopen
    // has no other preconditions. Loading runs the library's initialisers, which
    // is what cudarc would do next anyway.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return false;
    }
    // SAFETY: `handle` came from a successful dlopen and is closed exactly once.
    unsafe { libc::dlclose(handle) };
    true
}

/// Checks that the CUDA driver and an NCCL library cudarc can load are present.
pub fn probe() -> Result<()> {
    if !can_dlopen("libcuda.so.1") && !can_dlopen("libcuda.so") {
        return Err(unavailable(
            "the CUDA driver library libcuda.so.1 was not found: this machine has no NVIDIA \
             driver (or it is not on the loader path); use the TCP communicator on CPU-only machines",
        ));
    }
    if can_dlopen("libnccl.so") {
        return Ok(());
    }
    if can_dlopen("libnccl.so.2") {
        return Err(unavailable(
            "found libnccl.so.2 but not libnccl.so, the name cudarc loads (the pip package \
             nvidia-nccl-cu* ships only libnccl.so.2): in its directory run \
             `ln -s libnccl.so.2 libnccl.so` and add that directory to LD_LIBRARY_PATH",
        ));
    }
    Err(unavailable(
        "libnccl.so was not found: install NCCL (e.g. the libnccl2 and libnccl-dev packages, or \
         `pip install nvidia-nccl-cu12` then symlink its libnccl.so.2 to libnccl.so) and add its \
         directory to LD_LIBRARY_PATH",
    ))
}

/// Runs `f`, turning a panic inside cudarc into [`Error::Unavailable`].
pub(super) fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(unavailable(format!("{what} panicked inside cudarc: {msg}")))
        }
    }
}

/// A new NCCL unique id (call on one rank, ship the bytes to the others).
pub fn unique_id() -> Result<[u8; ID_BYTES]> {
    probe()?;
    guarded("creating the NCCL unique id", || {
        let id =
            Id::new().map_err(|e| unavailable(format!("ncclGetUniqueId failed: {:?}", e.0)))?;
        Ok(id_to_bytes(&id))
    })
}

/// The 128 bytes of an id, for a KV store.
pub fn id_to_bytes(id: &Id) -> [u8; ID_BYTES] {
    let mut out = [0u8; ID_BYTES];
    for (o, c) in out.iter_mut().zip(id.internal()) {
        *o = *c as u8;
    }
    out
}

/// An id from its 128 bytes.
pub fn id_from_bytes(bytes: &[u8]) -> Result<Id> {
    if bytes.len() != ID_BYTES {
        return Err(Error::InvalidArgument {
            op: Op::Rendezvous,
            detail: format!(
                "an NCCL unique id is {ID_BYTES} bytes, got {}: pass the bytes from unique_id() unchanged",
                bytes.len()
            ),
        });
    }
    let mut internal = [0 as c_char; ID_BYTES];
    for (i, b) in internal.iter_mut().zip(bytes) {
        *i = *b as c_char;
    }
    Ok(Id::uninit(internal))
}
