//! The cluster runtime: the head's services (registry, health, placement, actors, KV,
//! persisted state), the worker agent that supervises actor processes, the actor-side
//! server, and the clients, auth and TLS they share. Binaries are thin shells over this.

pub mod actor;
pub mod auth;
pub mod clock;
pub mod convert;
pub mod dashboard;
pub mod head;
pub mod logging;
pub mod net;
/// Gang placement (in rlhf-core, shared with `check`).
pub use rlhf_core::placement;
pub mod resources;
pub mod status;
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

/// Default per-user state directory (like Ray's /tmp/ray), overridable with `--state-dir`
/// or `RLHF_STATE_DIR`.
pub fn default_state_dir() -> std::path::PathBuf {
    if let Ok(d) = std::env::var("RLHF_STATE_DIR") {
        return d.into();
    }
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    std::env::temp_dir().join(format!("rlhf-{uid}"))
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
