//! tracing setup: `RUST_LOG` filters, stderr for people, one log file per process.

use std::path::Path;

use tracing_subscriber::{fmt, layer::SubscriberExt, util::SubscriberInitExt, EnvFilter, Layer};

/// Keep the returned guard alive for the life of the process, or file logs are lost.
pub fn init(log_file: Option<&Path>) -> Option<tracing_appender::non_blocking::WorkerGuard> {
    let filter = || EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let stderr = fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_filter(filter());
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
