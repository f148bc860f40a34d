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

/// The soname of NCCL 2: the file the distribution's libnccl2 package and NVIDIA's
/// `nvidia-nccl-cu*` wheels ship (only the -dev package adds the `libnccl.so` link), and
/// the name a binary linked against NCCL records as needed.
pub(crate) const NCCL_SONAME: &str = "libnccl.so.2";

/// The names cudarc 0.19 tries, in order, when it loads NCCL at run time
/// (`get_lib_name_candidates("nccl")` for the `cuda-13000` feature, duplicates removed).
/// `libnccl.so.2` is not among them.
pub(crate) const CUDARC_LOAD_NAMES: &[&str] = &[
    "libnccl.so",
    "libnccl64.so",
    "libnccl64_13.so",
    "libnccl64_130.so",
    "libnccl64_130_0.so",
    "libnccl64_10.so",
    "libnccl64_11.so",
    "libnccl64_12.so",
    "libnccl64_9.so",
    "libnccl.so.13",
    "libnccl.so.12",
    "libnccl.so.11",
    "libnccl.so.10",
    "libnccl.so.9",
    "libnccl.so.1",
];

/// How this build reaches libnccl, which cudarc's build decides: with candle's `cuda`
/// feature on, cudarc links NCCL (`-lnccl`, recorded as needing [`NCCL_SONAME`]); without
/// it, cudarc `dlopen`s one of [`CUDARC_LOAD_NAMES`] on first use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NcclLinkage {
    /// NCCL's symbols are already in the process: the loader mapped the linked library
    /// when the program started.
    Linked,
    /// cudarc will load NCCL by name.
    Loaded,
}

impl NcclLinkage {
    /// This process's linkage: `Linked` when `ncclGetUniqueId` already resolves in the
    /// global scope (a cudarc that loads NCCL itself opens it `RTLD_LOCAL`, so its symbols
    /// never show there).
    fn of_this_process() -> Self {
        // SAFETY: RTLD_DEFAULT is a valid pseudo-handle for dlsym and the name is a
        // NUL-terminated literal; dlsym only looks the symbol up.
        let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"ncclGetUniqueId".as_ptr()) };
        if sym.is_null() {
            NcclLinkage::Loaded
        } else {
            NcclLinkage::Linked
        }
    }
}

/// The NCCL library this build will use, by name, or why there is none: `can_load` says
/// whether a library name loads (`dlopen` in [`probe`]; file existence in tests).
pub(crate) fn find_nccl(
    linkage: NcclLinkage,
    can_load: impl Fn(&str) -> bool,
) -> std::result::Result<&'static str, String> {
    let names: &[&'static str] = match linkage {
        NcclLinkage::Linked => &[NCCL_SONAME, "libnccl.so"],
        NcclLinkage::Loaded => CUDARC_LOAD_NAMES,
    };
    if let Some(found) = names.iter().find(|n| can_load(n)) {
        return Ok(found);
    }
    if linkage == NcclLinkage::Loaded && can_load(NCCL_SONAME) {
        return Err(format!(
            "found {NCCL_SONAME} but this build loads NCCL at run time by the names \
             {CUDARC_LOAD_NAMES:?}, which do not include it: build with the `cuda` feature \
             (it links {NCCL_SONAME} directly), or in its directory run \
             `ln -s {NCCL_SONAME} libnccl.so` and add that directory to LD_LIBRARY_PATH"
        ));
    }
    Err(format!(
        "{NCCL_SONAME} was not found: install NCCL (the libnccl2 package, or \
         `pip install nvidia-nccl-cu13`, whose lib directory holds {NCCL_SONAME}) and add its \
         directory to LD_LIBRARY_PATH"
    ))
}

/// Checks that the CUDA driver and an NCCL library this build can use are present.
pub fn probe() -> Result<()> {
    if !can_dlopen("libcuda.so.1") && !can_dlopen("libcuda.so") {
        return Err(unavailable(
            "the CUDA driver library libcuda.so.1 was not found: this machine has no NVIDIA \
             driver (or it is not on the loader path); use the TCP communicator on CPU-only machines",
        ));
    }
    find_nccl(NcclLinkage::of_this_process(), can_dlopen)
        .map(|_| ())
        .map_err(unavailable)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of fake library files standing in for the loader's search path.
    fn libs(names: &[&str]) -> (tempfile::TempDir, impl Fn(&str) -> bool) {
        let dir = tempfile::tempdir().expect("tempdir");
        for n in names {
            std::fs::write(dir.path().join(n), b"not an ELF file").expect("fake lib");
        }
        let path = dir.path().to_path_buf();
        (dir, move |n: &str| path.join(n).exists())
    }

    /// What libnccl2 and the NCCL wheels ship, alone, is what a linked (`cuda`) build needs.
    #[test]
    fn a_linked_build_accepts_the_soname_alone() {
        let (_d, can) = libs(&[NCCL_SONAME]);
        assert_eq!(find_nccl(NcclLinkage::Linked, &can), Ok(NCCL_SONAME));
    }

    /// A build that loads NCCL by cudarc's names finds `libnccl.so` (the -dev link), and
    /// with only the soname names the two fixes instead of letting cudarc panic later.
    #[test]
    fn a_loading_build_needs_one_of_cudarcs_names() {
        let (_d, can) = libs(&["libnccl.so", NCCL_SONAME]);
        assert_eq!(find_nccl(NcclLinkage::Loaded, &can), Ok("libnccl.so"));
        let (_d, can) = libs(&["libnccl.so.12"]);
        assert_eq!(find_nccl(NcclLinkage::Loaded, &can), Ok("libnccl.so.12"));
        let (_d, can) = libs(&[NCCL_SONAME]);
        let e = find_nccl(NcclLinkage::Loaded, &can).unwrap_err();
        assert!(e.contains("ln -s libnccl.so.2 libnccl.so"), "{e}");
        assert!(e.contains("`cuda` feature"), "{e}");
    }

    #[test]
    fn no_nccl_at_all_names_the_soname_and_the_packages() {
        for linkage in [NcclLinkage::Linked, NcclLinkage::Loaded] {
            let (_d, can) = libs(&["libcuda.so.1"]);
            let e = find_nccl(linkage, &can).unwrap_err();
            assert!(e.contains("libnccl.so.2 was not found"), "{e}");
            assert!(
                e.contains("libnccl2") && e.contains("LD_LIBRARY_PATH"),
                "{e}"
            );
        }
    }
}
