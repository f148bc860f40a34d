//! The cluster runtime: the head's services (registry, health, placement, actors, KV,
//! persisted state), the worker agent that supervises actor processes, the actor-side
//! server, and the clients, auth and TLS they share. Binaries are thin shells over this.

pub mod actor;
pub mod args;
pub mod auth;
pub mod beat;
pub mod clock;
pub mod convert;
pub mod dashboard;
pub mod direct;
pub mod frames;
pub mod head;
pub mod logging;
pub mod net;
pub mod prom;
/// Gang placement (in rlhf-core, shared with `check`).
pub use rlhf_core::placement;
pub mod resources;
pub mod shared_batch;
pub mod snapshot;
pub mod status;
pub mod tls;
pub mod worker;

/// A DataBatch as a gRPC request stream of chunks well under the message limit.
pub fn batch_stream(
    b: &rlhf_core::DataBatch,
) -> rlhf_core::Result<impl tokio_stream::Stream<Item = rlhf_proto::v1::BatchChunk>> {
    // Chunks are views of the tensors' storage: nothing is copied before the first send.
    Ok(tokio_stream::iter(rlhf_core::batch::encode_chunks(
        b,
        rlhf_core::batch::CHUNK_BYTES,
    )?))
}

use tokio_util::sync::CancellationToken;

/// Whether process `pid` still runs on this host: it exists and is not a zombie (or dead).
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit_once(") ").and_then(|(_, r)| r.chars().next()),
            Some('Z' | 'X')
        ),
        Err(_) => false,
    }
}

/// Cancels `token` on SIGINT or SIGTERM.
pub fn cancel_on_signals(token: CancellationToken) {
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!("cannot install SIGTERM handler: {e}");
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received; shutting down"),
            _ = term.recv() => tracing::info!("SIGTERM received; shutting down"),
        }
        token.cancel();
    });
}

/// Default per-user state directory: `RLHF_STATE_DIR`, else `$XDG_STATE_HOME/rlhf`, else
/// `~/.local/state/rlhf`; a per-user directory under the temp dir only without a home.
/// `--state-dir` overrides it.
pub fn default_state_dir() -> std::path::PathBuf {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(d) = env("RLHF_STATE_DIR") {
        return d.into();
    }
    if let Some(d) = env("XDG_STATE_HOME") {
        return std::path::PathBuf::from(d).join("rlhf");
    }
    if let Some(h) = env("HOME") {
        return std::path::PathBuf::from(h).join(".local/state/rlhf");
    }
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    std::env::temp_dir().join(format!("rlhf-{uid}"))
}

/// Makes the state directory private: created with mode 0700; an existing one must belong
/// to this user (else it may have been planted) and is narrowed to 0700 if others could
/// enter it.
pub fn prepare_state_dir(dir: &std::path::Path) -> rlhf_core::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let shown = dir.display();
    if std::fs::symlink_metadata(dir).is_err() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| rlhf_core::Error::io(format!("creating state directory {shown}"), e))?;
    }
    let meta = std::fs::metadata(dir)
        .map_err(|e| rlhf_core::Error::io(format!("reading state directory {shown}"), e))?;
    if !meta.is_dir() {
        return Err(rlhf_core::Error::invalid(format!(
            "state directory {shown} is not a directory; pass --state-dir DIR"
        )));
    }
    // SAFETY: getuid has no preconditions and cannot fail.
    let me = unsafe { libc::getuid() };
    if meta.uid() != me {
        return Err(rlhf_core::Error::invalid(format!(
            "state directory {shown} belongs to user {} and this process runs as {me}; pass --state-dir with a directory of your own",
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| {
            rlhf_core::Error::io(
                format!("making state directory {shown} private (chmod 700)"),
                e,
            )
        })?;
    }
    Ok(())
}

/// Raises the open-file soft limit to the hard limit: a head holds one connection per node,
/// and the common default soft limit of 1,024 is below a large cluster.
pub fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit only read and write the local struct passed to them.
    unsafe {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// Locks a mutex, recovering the data if a panicking thread poisoned it: the guarded maps
/// stay consistent between statements, so a poisoned lock is still usable.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// [`lock`] for the read side of an `RwLock`.
pub(crate) fn lock_read<T>(m: &std::sync::RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|p| p.into_inner())
}

/// [`lock`] for the write side of an `RwLock`.
pub(crate) fn lock_write<T>(m: &std::sync::RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn state_dirs_are_made_private() {
        let root = tempfile::tempdir().unwrap();
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let fresh = root.path().join("a/b/state");
        super::prepare_state_dir(&fresh).unwrap();
        assert_eq!(mode(&fresh), 0o700);
        let open = root.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        super::prepare_state_dir(&open).unwrap();
        assert_eq!(mode(&open), 0o700);
        let file = root.path().join("file");
        std::fs::write(&file, "x").unwrap();
        let e = super::prepare_state_dir(&file).unwrap_err().to_string();
        assert!(
            e.contains("not a directory") && e.contains("--state-dir"),
            "{e}"
        );
    }
}
