//! `rlhf-worker`: join a node to a cluster (like `ray start --address`), and the hidden
//! `actor` subcommand the worker uses to start actor processes.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use rlhf_core::{Resources, Result};
use rlhf_runtime::actor::{self, ActorOptions};
use rlhf_runtime::auth;
use rlhf_runtime::net::ClientOptions;
use rlhf_runtime::worker::{self, WorkerOptions};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "rlhf-worker",
    version,
    about = "Worker node of an rlhf cluster"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Contribute this node's resources to the cluster at --address and serve until stopped.
    Join {
        /// Head address HOST:PORT.
        #[arg(long)]
        address: String,
        /// JSON object that adds or overrides resources, e.g. '{"GPU": 8, "my_res": 1}'.
        #[arg(long)]
        resources: Option<String>,
        /// File holding the cluster token (or set $RLHF_TOKEN).
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// CA certificate (PEM) to verify the head's TLS certificate.
        #[arg(long)]
        tls_ca: Option<PathBuf>,
        /// Name expected in the head's certificate (default: the host of --address).
        #[arg(long)]
        tls_domain: Option<String>,
        /// This node's certificate (PEM): with TLS, the agent and every role process it
        /// starts serve with it. It must name the node's IP (see --node-ip).
        #[arg(long, requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// Key of --tls-cert.
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// IP this node is reached on (default: the interface that routes to the head).
        #[arg(long)]
        node_ip: Option<String>,
        /// Port of this node's agent service; 0 picks a free one.
        #[arg(long, default_value_t = 0)]
        port: u16,
        /// Seconds to keep retrying an unreachable head before giving up.
        #[arg(long, default_value = "30", value_parser = rlhf_runtime::args::parse_seconds)]
        connect_timeout: Duration,
        #[arg(long, env = "RLHF_STATE_DIR")]
        state_dir: Option<PathBuf>,
        /// Memory for other nodes' checkpoint snapshots (jobs with
        /// `checkpoint.memory_snapshot`), in GiB [default: a quarter of this node's memory].
        #[arg(long)]
        snapshot_memory_gb: Option<f64>,
        /// A Python interpreter with vLLM installed: this worker's rollout ranks may then
        /// generate with vLLM (`actor_rollout.engine: vllm`). Checked at join.
        #[arg(long, env = "RLHF_VLLM_PYTHON")]
        vllm_python: Option<PathBuf>,
    },
    /// Internal: run one actor process (started by the worker). Kinds: `test`, and the PPO
    /// roles `actor_rollout`, `ref`, `critic`, `reward`.
    #[command(hide = true)]
    Actor {
        #[arg(long)]
        actor_id: String,
        #[arg(long, default_value = "test")]
        kind: String,
        #[arg(long)]
        ready_file: PathBuf,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        #[arg(long, requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        #[arg(long, requires = "tls_cert")]
        tls_ca: Option<PathBuf>,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        rest: Vec<String>,
    },
    /// Internal: print what this build's role actors can run, as JSON (asked by
    /// `rlhf-head run`, whose embedded worker starts this executable's actors).
    #[command(hide = true)]
    Capabilities,
}

/// Whether this build's actors can compute on CUDA GPUs.
const CUDA_ROLES: bool = cfg!(feature = "cuda");

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

async fn run(cli: Cli) -> Result<()> {
    let shutdown = CancellationToken::new();
    rlhf_runtime::cancel_on_signals(shutdown.clone());
    match cli.cmd {
        Cmd::Join {
            address,
            resources,
            token_file,
            tls_ca,
            tls_domain,
            tls_cert,
            tls_key,
            node_ip,
            port,
            connect_timeout,
            state_dir,
            snapshot_memory_gb,
            vllm_python,
        } => {
            let vllm_python = worker::vllm::resolve(vllm_python.as_deref()).await?;
            let snapshot_memory = match snapshot_memory_gb {
                None => rlhf_runtime::worker::snapshots::default_cap(),
                Some(g) if g.is_finite() && g >= 0.0 => (g * (1u64 << 30) as f64) as u64,
                Some(g) => {
                    return Err(rlhf_core::Error::invalid(format!(
                        "--snapshot-memory-gb {g}: give a size in GiB, 0 or more (0 holds no snapshots)"
                    )))
                }
            };
            // A cluster speaks TLS everywhere or nowhere: the head would refuse to reach a
            // plain agent, and drivers could not reach plain role processes.
            if tls_ca.is_some() != tls_cert.is_some() {
                return Err(rlhf_core::Error::invalid(if tls_ca.is_some() {
                    "the head speaks TLS (--tls-ca): give this worker --tls-cert and --tls-key too (a certificate for this node's IP, signed by the cluster CA), so its role processes serve TLS as well"
                } else {
                    "--tls-cert without --tls-ca: a TLS worker joins a TLS head; pass --tls-ca with the CA that signed the head's certificate"
                }));
            }
            let overrides = match resources {
                Some(r) => Resources::parse_json("--resources", &r)?,
                None => Resources::new(),
            };
            rlhf_runtime::resources::check_overrides("--resources", &overrides)?;
            let state_dir = state_dir.unwrap_or_else(rlhf_runtime::default_state_dir);
            rlhf_runtime::prepare_state_dir(&state_dir)?;
            let _guard = rlhf_runtime::logging::init(Some(
                &state_dir
                    .join("logs")
                    .join(format!("worker-{}.log", std::process::id())),
            ));
            let (token, _) =
                auth::resolve_token(token_file.as_deref(), &auth::default_token_path(&state_dir))?;
            let mut client = ClientOptions::new(token);
            client.tls_ca = tls_ca.clone();
            client.tls_domain = tls_domain;
            client.connect_timeout = connect_timeout;
            let hostname = nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_else(|| "unknown".into());
            let actor_exe = std::env::current_exe()
                .map_err(|e| rlhf_core::Error::io("locating the rlhf-worker executable", e))?;
            let opts = WorkerOptions {
                head_address: address,
                resources: overrides,
                node_ip,
                port,
                state_dir,
                client,
                actor_exe,
                hostname,
                tls: rlhf_runtime::net::ServerTls {
                    cert: tls_cert,
                    key: tls_key,
                    ca: tls_ca,
                },
                cuda_roles: CUDA_ROLES,
                vllm_python: vllm_python.clone(),
                snapshot_memory,
            };
            if let Some(p) = &vllm_python {
                eprintln!(
                    "this worker's rollout ranks may run vLLM with {}",
                    p.display()
                );
            }
            if CUDA_ROLES {
                eprintln!("this worker runs CUDA roles (built with the `cuda` feature)");
            } else {
                eprintln!(
                    "this worker runs roles on the CPU only (built without the `cuda` feature); \
                     GPU roles are placed elsewhere"
                );
            }
            worker::run(opts, shutdown).await
        }
        Cmd::Capabilities => {
            println!("{}", serde_json::json!({ "cuda_roles": CUDA_ROLES }));
            Ok(())
        }
        Cmd::Actor {
            actor_id,
            kind,
            ready_file,
            host,
            tls_cert,
            tls_key,
            tls_ca,
            rest: _,
        } => {
            let _guard = rlhf_runtime::logging::init(None);
            let token = std::env::var(auth::TOKEN_ENV).map_err(|_| {
                rlhf_core::Error::invalid(format!(
                    "the actor needs the cluster token in ${}",
                    auth::TOKEN_ENV
                ))
            })?;
            let opts = ActorOptions {
                actor_id,
                kind,
                ready_file,
                host,
                token,
                tls: rlhf_runtime::net::ServerTls {
                    cert: tls_cert,
                    key: tls_key,
                    ca: tls_ca,
                },
            };
            if opts.kind.parse::<rlhf_core::RoleKind>().is_ok() {
                rlhf_roles::run(opts, shutdown).await
            } else if actor::ACTOR_KINDS.contains(&opts.kind.as_str()) {
                actor::run(opts, shutdown).await
            } else {
                let roles: Vec<&str> = rlhf_core::RoleKind::ALL
                    .iter()
                    .map(|k| k.as_str())
                    .collect();
                Err(rlhf_core::Error::invalid(format!(
                    "unknown actor kind '{}'; known kinds: {}, {}",
                    opts.kind,
                    actor::ACTOR_KINDS.join(", "),
                    roles.join(", ")
                )))
            }
        }
    }
}
