//! Start-up of the head: binds the gRPC port (and the heartbeat datagrams beside it), opens
//! the state, starts the job manager, the health check and the dashboard, and serves until
//! shutdown.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rlhf_core::{Error, Result};
use rlhf_proto::v1::head_service_server::HeadServiceServer;
use rlhf_proto::MAX_MESSAGE_BYTES;
use tokio_util::sync::CancellationToken;

use super::state::HeadState;
use super::store::Store;
use super::{jobs, liveness, Head, HeadHandle, HeadOptions, Inner};
use crate::auth::CheckToken;
use crate::clock::Clock;
use crate::dashboard::JobFiles;
use crate::net;
use crate::prom::{RpcMetrics, RpcTimerLayer};

/// What the dashboard reads of the head.
struct DashSource {
    head: Head,
    rpc: Arc<RpcMetrics>,
}

impl crate::dashboard::Source for DashSource {
    fn status(&self) -> rlhf_proto::v1::ClusterStatusResponse {
        self.head.status()
    }
    fn job_files(&self, job_id: &str) -> Option<JobFiles> {
        self.head.0.jobs.files(job_id)
    }
    fn rpc(&self) -> &RpcMetrics {
        &self.rpc
    }
}

/// The address a job driver on this machine uses to reach the head.
fn local_head_address(host: &str, addr: SocketAddr) -> String {
    match host {
        "0.0.0.0" | "" => format!("127.0.0.1:{}", addr.port()),
        "::" | "[::]" => format!("[::1]:{}", addr.port()),
        _ => addr.to_string(),
    }
}

/// How long a stopping head waits for open calls to end.
const DRAIN: Duration = Duration::from_secs(5);

/// Builds, binds and serves the head. Port 0 picks a free port (see `HeadHandle::addr`).
pub async fn start(
    opts: HeadOptions,
    clock: Arc<dyn Clock>,
    shutdown: CancellationToken,
) -> Result<HeadHandle> {
    // TLS files are checked before anything binds.
    let builder = opts.tls.server()?;
    let listener = net::bind(&opts.host, opts.port, "--port").await?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("reading the bound address", e))?;
    let dash_listener = match &opts.dashboard {
        Some((h, p)) => Some(net::bind(h, *p, "--dashboard-port").await?),
        None => None,
    };
    let store = Store::open(&opts.state_dir)?;
    let job_exe = match &opts.job_exe {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .map_err(|e| Error::io("finding this program's path (the job driver)", e))?,
    };
    let jobs = jobs::Jobs::open(
        jobs::JobsConfig {
            state_dir: opts.state_dir.clone(),
            exe: job_exe,
            head_address: local_head_address(&opts.host, addr),
            tls_ca: opts.cluster_ca(),
            token: opts.token.clone(),
            stop_grace: opts.job_stop_grace,
            max_running: opts.max_running_jobs,
            keep_for: opts.job_ttl,
            keep_last: opts.jobs_kept,
        },
        Some(store.clone()),
        clock.clone(),
    )?;
    let state = HeadState::open(store, clock.now_ms())?;
    let udp = match opts.udp_heartbeats {
        true => liveness::bind_udp(&opts.host, addr.port()),
        false => None,
    };
    let beats = Arc::new(liveness::Beats::default());
    let head = Head(Arc::new(Inner {
        state: Mutex::new(state),
        clock: clock.clone(),
        opts: opts.clone(),
        kv_changed: tokio::sync::Notify::new(),
        workers: Mutex::new(HashMap::new()),
        shutdown: shutdown.clone(),
        jobs: jobs.clone(),
        beats: beats.clone(),
        udp_port: udp.as_ref().map_or(0, |_| addr.port()),
    }));
    if let Some(socket) = udp {
        liveness::spawn_receiver(socket, beats, clock.clone(), shutdown.clone())?;
    }

    // Health: mark silent nodes dead. Checked often relative to the threshold so detection
    // lands within threshold + a quarter of it, and at most half a second late.
    let threshold = opts.dead_threshold;
    let period = (threshold / 4).clamp(Duration::from_millis(50), Duration::from_millis(500));
    let h = head.clone();
    let sd = shutdown.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tokio::select! {
                _ = sd.cancelled() => break,
                _ = tick.tick() => {
                    let now = h.0.clock.now_ms();
                    // Nodes marked dead (here or by any other path) are told to register again.
                    let mut s = h.lock();
                    if let Err(e) = h.0.beats.check(&mut s, now, threshold.as_millis() as i64) {
                        tracing::error!("health check: {e}");
                    }
                }
            }
        }
    });

    let rpc = Arc::new(RpcMetrics::default());
    let dashboard = match dash_listener {
        Some(l) => {
            let h = head.clone();
            let access = crate::dashboard::Access {
                token: h.0.opts.token.clone(),
                bound_host: opts
                    .dashboard
                    .as_ref()
                    .map(|(host, _)| host.clone())
                    .unwrap_or_default(),
            };
            Some(crate::dashboard::serve(
                l,
                Arc::new(DashSource {
                    head: h,
                    rpc: rpc.clone(),
                }),
                access,
                shutdown.clone(),
            )?)
        }
        None => None,
    };

    let svc = tonic::service::interceptor::InterceptedService::new(
        HeadServiceServer::new(head.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
        CheckToken::new(&opts.token, "head"),
    );
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let sd = shutdown.clone();
    let router = builder.layer(RpcTimerLayer(rpc)).add_service(svc);
    let server = tokio::spawn(async move {
        let serve = router.serve_with_incoming_shutdown(incoming, sd.clone().cancelled_owned());
        tokio::pin!(serve);
        // The graceful stop waits for every open call; one that does not end (a client's
        // stream) gets DRAIN after the shutdown, then the server is dropped.
        let served = tokio::select! {
            r = &mut serve => Some(r),
            _ = async {
                sd.cancelled().await;
                tokio::time::sleep(DRAIN).await;
            } => None,
        };
        match served {
            Some(Err(e)) => tracing::error!("head server: {}", net::error_chain(&e)),
            Some(Ok(())) => {}
            None => tracing::warn!(
                "calls still open {} s after the shutdown were cut off",
                DRAIN.as_secs()
            ),
        }
        // Drivers would lose their head: stop them, so none is left running unwatched.
        jobs.shutdown().await;
    });
    tracing::info!(%addr, "head listening");
    Ok(HeadHandle {
        addr,
        dashboard,
        shutdown,
        server,
    })
}
