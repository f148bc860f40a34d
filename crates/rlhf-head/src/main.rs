//! `rlhf-head`: start a head node, show cluster status, stop the cluster, run PPO jobs
//! (in the foreground, or submitted to a running head).

mod check_cmd;
mod jobs_cli;
mod run_cmd;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use rlhf_core::{Error, Result};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::head_service_client::HeadServiceClient;
use rlhf_runtime::auth;
use rlhf_runtime::head::{self, HeadOptions};
use rlhf_runtime::net::{self, ClientOptions, ServerTls};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "rlhf-head",
    version,
    about = "Head node of an rlhf cluster (like `ray start --head`)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone)]
pub(crate) struct Connect {
    /// Head address HOST:PORT; defaults to the head started from this machine's state dir.
    #[arg(long)]
    pub(crate) address: Option<String>,
    /// File holding the cluster token (default: the state dir's token file, or $RLHF_TOKEN).
    #[arg(long)]
    pub(crate) token_file: Option<PathBuf>,
    /// CA certificate (PEM) to verify a head that serves TLS.
    #[arg(long)]
    pub(crate) tls_ca: Option<PathBuf>,
    /// Seconds to keep retrying an unreachable head.
    #[arg(long, default_value = "10", value_parser = rlhf_runtime::args::parse_seconds)]
    pub(crate) connect_timeout: Duration,
    #[arg(long, env = "RLHF_STATE_DIR")]
    pub(crate) state_dir: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the head node and serve until SIGINT/SIGTERM or `rlhf-head stop`.
    Start {
        /// Port for the cluster gRPC service; 0 picks a free one and prints it.
        #[arg(long, default_value_t = 6344)]
        port: u16,
        /// Interface to bind.
        #[arg(long, default_value = "0.0.0.0")]
        host: String,
        /// Where the state database, token and logs live.
        #[arg(long, env = "RLHF_STATE_DIR")]
        state_dir: Option<PathBuf>,
        /// Use the token in this file instead of generating one.
        #[arg(long)]
        token_file: Option<PathBuf>,
        #[arg(long, requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// CA of the cluster, as `--tls-ca` on workers and clients: it verifies the workers'
        /// certificates when the head calls them, and --tls-cert for the job drivers this
        /// head starts (default: --tls-cert itself, right for one self-signed certificate
        /// shared by every node). `--job-tls-ca` is its old name.
        #[arg(long = "tls-ca", visible_alias = "job-tls-ca", requires = "tls_cert")]
        job_tls_ca: Option<PathBuf>,
        /// Interface for the dashboard (HTTP); local only unless you say otherwise.
        #[arg(long, default_value = "127.0.0.1")]
        dashboard_host: String,
        #[arg(long, default_value_t = 8260)]
        dashboard_port: u16,
        #[arg(long)]
        no_dashboard: bool,
        /// Heartbeat period asked of workers, in milliseconds.
        #[arg(long, default_value_t = 500)]
        heartbeat_ms: u64,
        /// A node silent this long (milliseconds) is marked dead.
        #[arg(long, default_value_t = 3000)]
        dead_after_ms: u64,
        /// No heartbeat datagrams on UDP --port: workers beat on their gRPC streams (costs
        /// the head more CPU per node; for networks that block UDP).
        #[arg(long)]
        no_udp_heartbeats: bool,
        /// Submitted jobs that run at once; later ones wait QUEUED, first in first out
        /// (0 = no limit).
        #[arg(long, default_value_t = 1)]
        max_running_jobs: usize,
        /// Ended jobs (record, directory, log) are removed this long after they ended:
        /// a number with s, m, h or d (`7d`, `12h`).
        #[arg(long, default_value = "7d", value_parser = parse_ttl)]
        job_ttl: Duration,
        /// ...or once this many newer jobs have ended (0 = no count limit).
        #[arg(long, default_value_t = rlhf_runtime::head::jobs::DEFAULT_JOBS_KEPT)]
        jobs_kept: usize,
    },
    /// Show nodes, resources, placement groups and actors (like `ray status`).
    Status {
        #[command(flatten)]
        conn: Connect,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Stop the head and every worker and actor of the cluster.
    Stop {
        #[command(flatten)]
        conn: Connect,
    },
    /// Run a PPO job to the end: on an embedded head + local worker, or on a running cluster
    /// with --address.
    Run(run_cmd::RunArgs),
    /// Validate a job config, print the resolved config, the placement plan and the memory
    /// estimate; run nothing.
    Check(check_cmd::CheckArgs),
    /// Submit a PPO job to a running head, which runs its driver in the background
    /// (like `ray job submit`); follow it with `rlhf-head job logs -f ID`.
    Submit(jobs_cli::SubmitArgs),
    /// List, inspect, follow and stop submitted jobs.
    Job {
        #[command(subcommand)]
        cmd: jobs_cli::JobCmd,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    rlhf_runtime::raise_fd_limit();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn head_info_path(state_dir: &std::path::Path) -> PathBuf {
    state_dir.join("head.json")
}

/// The head's address and how to reach it (token, TLS, connect timeout) from the flags, the
/// environment or the state dir of a head started on this machine.
pub(crate) fn head_connection(conn: &Connect) -> Result<(String, ClientOptions)> {
    let state_dir = conn
        .state_dir
        .clone()
        .unwrap_or_else(rlhf_runtime::default_state_dir);
    let address = match &conn.address {
        Some(a) => a.clone(),
        None => {
            let p = head_info_path(&state_dir);
            let text = std::fs::read_to_string(&p).map_err(|_| {
                Error::invalid(format!(
                    "no --address given and no head started from this machine ({} not found); pass --address HOST:PORT",
                    p.display()
                ))
            })?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::invalid(format!("{}: {e}", p.display())))?;
            v["address"].as_str().unwrap_or_default().to_string()
        }
    };
    let (token, _) = auth::resolve_token(
        conn.token_file.as_deref(),
        &auth::default_token_path(&state_dir),
    )?;
    let mut opts = ClientOptions::new(token);
    opts.tls_ca = conn.tls_ca.clone();
    opts.connect_timeout = conn.connect_timeout;
    Ok((address, opts))
}

pub(crate) async fn client(conn: &Connect) -> Result<HeadServiceClient<net::AuthChannel>> {
    let (address, opts) = head_connection(conn)?;
    let ch = net::connect(&address, &opts).await?;
    Ok(HeadServiceClient::new(ch).max_decoding_message_size(rlhf_proto::MAX_MESSAGE_BYTES))
}

async fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Start {
            port,
            host,
            state_dir,
            token_file,
            tls_cert,
            tls_key,
            job_tls_ca,
            dashboard_host,
            dashboard_port,
            no_dashboard,
            heartbeat_ms,
            dead_after_ms,
            no_udp_heartbeats,
            max_running_jobs,
            job_ttl,
            jobs_kept,
        } => {
            let state_dir = state_dir.unwrap_or_else(rlhf_runtime::default_state_dir);
            rlhf_runtime::prepare_state_dir(&state_dir)?;
            let _guard =
                rlhf_runtime::logging::init(Some(&state_dir.join("logs").join("head.log")));
            let default_token = auth::default_token_path(&state_dir);
            let (token, token_where) = match (&token_file, std::env::var(auth::TOKEN_ENV)) {
                (Some(p), _) => (
                    auth::read_token_file(p, auth::TokenFile::Given)?,
                    p.display().to_string(),
                ),
                (None, Ok(t)) if !t.trim().is_empty() => {
                    // Still written to the default file so local tools find it.
                    auth::write_token_file(&default_token, t.trim())?;
                    (t.trim().to_string(), default_token.display().to_string())
                }
                // A restarted head keeps its token, so its workers can reconnect.
                _ if default_token.symlink_metadata().is_ok() => (
                    auth::read_token_file(&default_token, auth::TokenFile::Found)?,
                    default_token.display().to_string(),
                ),
                _ => {
                    let t = auth::generate_token();
                    auth::write_token_file(&default_token, &t)?;
                    (t, default_token.display().to_string())
                }
            };
            let mut opts = HeadOptions::new(state_dir.clone(), token);
            opts.host = host.clone();
            opts.port = port;
            opts.tls = ServerTls {
                cert: tls_cert,
                key: tls_key,
                ca: None,
            };
            opts.job_tls_ca = job_tls_ca;
            opts.heartbeat_interval = Duration::from_millis(heartbeat_ms.max(10));
            opts.dead_threshold = Duration::from_millis(dead_after_ms.max(50));
            opts.udp_heartbeats = !no_udp_heartbeats;
            opts.max_running_jobs = max_running_jobs;
            opts.job_ttl = job_ttl;
            opts.jobs_kept = jobs_kept;
            opts.dashboard = (!no_dashboard).then_some((dashboard_host, dashboard_port));
            let shutdown = CancellationToken::new();
            rlhf_runtime::cancel_on_signals(shutdown.clone());
            let h = head::start(opts, Arc::new(rlhf_runtime::clock::SystemClock), shutdown).await?;
            let port = h.addr.port();
            let shown = if host == "0.0.0.0" || host == "::" {
                net::primary_ip().to_string()
            } else {
                host.clone()
            };
            let local = if host == "0.0.0.0" || host == "::" {
                "127.0.0.1".to_string()
            } else {
                host
            };
            let info = serde_json::json!({
                "address": format!("{local}:{port}"),
                "advertised_address": format!("{shown}:{port}"),
                "pid": std::process::id(),
                "token_file": token_where,
                "dashboard": h.dashboard.map(|d| format!("http://{d}")),
            });
            let info_path = head_info_path(&state_dir);
            std::fs::write(
                &info_path,
                serde_json::to_string_pretty(&info).unwrap_or_default(),
            )
            .map_err(|e| Error::io(format!("writing {}", info_path.display()), e))?;
            println!("rlhf head started");
            println!("  address:    {shown}:{port}");
            println!("  token file: {token_where} (readable only by you)");
            if let Some(d) = h.dashboard {
                println!("  dashboard:  http://{d} (with the token: http://{d}/#token=<the token file's text>)");
                println!(
                    "  metrics:    http://{d}/metrics (Prometheus; job metrics need the token)"
                );
            }
            println!("  logs:       {}", state_dir.join("logs").display());
            println!("join a node with:\n  rlhf-worker join --address {shown}:{port} --token-file {token_where}");
            h.wait().await;
            let _ = std::fs::remove_file(&info_path);
            println!("rlhf head stopped");
            Ok(())
        }
        Cmd::Status { conn, format } => {
            let mut c = client(&conn).await?;
            let s = c
                .cluster_status(pb::ClusterStatusRequest {})
                .await
                .map_err(Error::from)?
                .into_inner();
            match format {
                Format::Text => print!("{}", rlhf_runtime::status::to_text(&s)),
                Format::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&rlhf_runtime::status::to_json(&s))
                        .unwrap_or_default()
                ),
            }
            Ok(())
        }
        Cmd::Stop { conn } => {
            let mut c = client(&conn).await?;
            c.shutdown(pb::ShutdownRequest { stop_workers: true })
                .await
                .map_err(Error::from)?;
            println!("stopping the cluster");
            Ok(())
        }
        Cmd::Run(args) => run_cmd::run(args).await,
        Cmd::Check(args) => check_cmd::check(args).await,
        Cmd::Submit(args) => jobs_cli::submit(args).await,
        Cmd::Job { cmd } => jobs_cli::job(cmd).await,
    }
}

/// `--job-ttl`: a whole number with a unit, `s`, `m`, `h` or `d`.
fn parse_ttl(s: &str) -> std::result::Result<Duration, String> {
    let s = s.trim();
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = n.parse().map_err(|_| {
        format!("{s:?} is not a duration; write a number and a unit: 7d, 12h, 30m, 90s")
    })?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => {
            return Err(format!(
                "{s:?}: unknown unit {unit:?}; use s, m, h or d (7d, 12h, 30m, 90s)"
            ))
        }
    };
    n.checked_mul(secs)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("{s:?} is too long"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ttl_takes_a_number_and_a_unit() {
        assert_eq!(parse_ttl("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_ttl("12h"), Ok(Duration::from_secs(12 * 3600)));
        assert_eq!(parse_ttl("90s"), Ok(Duration::from_secs(90)));
        assert!(parse_ttl("7").unwrap_err().contains("unknown unit"));
        assert!(parse_ttl("d").unwrap_err().contains("not a duration"));
        assert!(parse_ttl("3w").unwrap_err().contains("use s, m, h or d"));
    }
}
