//! tracing setup: `RUST_LOG` filters, stderr for people, one log file per process.
//! A daemon (head, worker) shows `info` on stderr; a command that prints its own progress
//! (`rlhf-head run`) shows only warnings and errors there, and keeps `info` for its file.

use std::io::IsTerminal;
use std::path::Path;

use tracing_subscriber::{fmt, layer::SubscriberExt, util::SubscriberInitExt, EnvFilter, Layer};

/// Keep the returned guard alive for the life of the process, or file logs are lost.
pub fn init(log_file: Option<&Path>) -> Option<tracing_appender::non_blocking::WorkerGuard> {
    init_with("info", log_file)
}

/// [`init`] with `stderr_level` the level shown on stderr when `RUST_LOG` is not set.
pub fn init_with(
    stderr_level: &str,
    log_file: Option<&Path>,
) -> Option<tracing_appender::non_blocking::WorkerGuard> {
    let level = |default: &str| {
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default))
    };
    let filter = || level("info");
    let stderr = fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .with_filter(level(stderr_level));
    let appender = log_file.and_then(|p| {
        let dir = p.parent()?;
        std::fs::create_dir_all(dir).ok()?;
        Some(tracing_appender::rolling::never(dir, p.file_name()?))
    });
    let (file_layer, guard) = match appender {
        Some(a) => {
            let (w, g) = tracing_appender::non_blocking(a);
            let layer = fmt::layer()
                .with_writer(w)
                .with_ansi(false)
                .with_filter(filter());
            (Some(layer), Some(g))
        }
        None => (None, None),
    };
    let _ = tracing_subscriber::registry()
        .with(stderr)
        .with(file_layer)
        .try_init();
    guard
}
