//! What a head is started with (`rlhf-head start` flags, the embedded mode, tests).

use std::path::PathBuf;
use std::time::Duration;

use super::jobs;
use crate::net::ServerTls;

#[derive(Clone, Debug)]
pub struct HeadOptions {
    /// Address the gRPC service binds (all interfaces by default, like `ray start --head`).
    pub host: String,
    pub port: u16,
    pub state_dir: PathBuf,
    pub token: String,
    pub tls: ServerTls,
    pub heartbeat_interval: Duration,
    /// A node silent this long is marked dead.
    pub dead_threshold: Duration,
    /// Heartbeat datagrams on UDP `port` (else beats come on the nodes' gRPC streams).
    pub udp_heartbeats: bool,
    /// None disables the dashboard.
    pub dashboard: Option<(String, u16)>,
    /// Executable run as a submitted job's driver (`<exe> run ...`); None = this program.
    pub job_exe: Option<PathBuf>,
    /// Between SIGTERM and SIGKILL when a job is stopped.
    pub job_stop_grace: Duration,
    /// Submitted jobs that run at once (0 = no limit); later ones queue.
    pub max_running_jobs: usize,
    /// Ended jobs are removed this long after they ended, or beyond the newest `jobs_kept`.
    pub job_ttl: Duration,
    pub jobs_kept: usize,
    /// CA that verifies this head's TLS certificate, for the job drivers it starts; None =
    /// the certificate itself (right for a self-signed one).
    pub job_tls_ca: Option<PathBuf>,
}

impl HeadOptions {
    /// The cluster CA clients of this head's making verify with (job drivers, calls to
    /// workers): `job_tls_ca`, else the certificate itself; None without TLS.
    pub fn cluster_ca(&self) -> Option<PathBuf> {
        self.tls
            .cert
            .as_ref()
            .map(|cert| self.job_tls_ca.clone().unwrap_or_else(|| cert.clone()))
    }

    pub fn new(state_dir: PathBuf, token: String) -> Self {
        Self {
            host: "0.0.0.0".into(),
            port: 6344,
            state_dir,
            token,
            tls: ServerTls::default(),
            heartbeat_interval: Duration::from_millis(500),
            dead_threshold: Duration::from_secs(3),
            udp_heartbeats: true,
            dashboard: Some(("127.0.0.1".into(), 8260)),
            job_exe: None,
            job_stop_grace: Duration::from_secs(10),
            max_running_jobs: 1,
            job_ttl: jobs::DEFAULT_JOB_TTL,
            jobs_kept: jobs::DEFAULT_JOBS_KEPT,
            job_tls_ca: None,
        }
    }
}
