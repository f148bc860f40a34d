//! `rlhf-head run`: the PPO job from the command line.
//!
//! `run` without `--address` is the embedded default: a head and a worker inside this
//! process on 127.0.0.1 (the worker spawns the role processes from the `rlhf-worker` binary
//! next to this one), the job to its end, then everything stops. With `--address` it drives
//! the job on a running cluster; `submit` makes the head do exactly that in a child process.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rlhf_config::{PpoConfig, RoleKind};
use rlhf_core::resources::Resources;
use rlhf_core::{Error, Result};
use rlhf_driver::{metric, DriverOptions, JobSummary, RunError};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::head_service_client::HeadServiceClient;
use rlhf_runtime::auth;
use rlhf_runtime::head::{self, HeadOptions};
use rlhf_runtime::net::{self, ClientOptions};
use rlhf_runtime::worker::{self, WorkerOptions};
use tokio_util::sync::CancellationToken;

use crate::Connect;

#[derive(clap::Args, Clone)]
pub(crate) struct JobConfigArgs {
    /// Directory of job configs.
    #[arg(long, default_value = "configs")]
    pub(crate) config_dir: PathBuf,
    /// Config name: <config-dir>/<NAME>.yaml (no .yaml).
    #[arg(long, required_unless_present = "bundle")]
    pub(crate) config_name: Option<String>,
    /// A resolved config bundle (what `submit` hands to the head); replaces --config-name.
    #[arg(long, hide = true, conflicts_with = "config_name")]
    pub(crate) bundle: Option<PathBuf>,
    /// key.path=value overrides, e.g. actor_rollout.ppo_epochs=2.
    pub(crate) overrides: Vec<String>,
}

#[derive(clap::Args, Clone)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) config: JobConfigArgs,
    #[command(flatten)]
    pub(crate) conn: Connect,
    /// Continue from a checkpoint: `latest` or a global_step_N directory.
    #[arg(long)]
    pub(crate) resume: Option<String>,
    /// Stop after this many steps of this invocation (a checkpoint is written first).
    #[arg(long)]
    pub(crate) stop_after: Option<u64>,
    /// Seconds any single role call (generation, update, ...) may take.
    #[arg(long, default_value = "3600", value_parser = rlhf_runtime::args::parse_seconds)]
    pub(crate) call_timeout: Duration,
    /// Seconds to wait for devices and for the role processes to start.
    #[arg(long, default_value = "600", value_parser = rlhf_runtime::args::parse_seconds)]
    pub(crate) start_timeout: Duration,
    /// Collective backend of the data-parallel groups (tcp, shm, nccl; nccl needs GPUs and
    /// a build with it). Chosen by default: shm for a group whose ranks are all on one node,
    /// else tcp.
    #[arg(long)]
    pub(crate) comm_backend: Option<rlhf_core::CommBackend>,
    /// Backend of the trainer → rollout weight sync (tcp, shm, nccl); chosen by default:
    /// none when colocated, shm when every rank is on one node, else --comm-backend (tcp
    /// when not given).
    #[arg(long)]
    pub(crate) weight_sync_backend: Option<rlhf_core::CommBackend>,
    /// How experience batches go between the driver and the role processes (shm, frames,
    /// stream). Chosen per role process by default: shm (shared memory) on the driver's
    /// host, else frames (raw TCP beside the call), else stream (gRPC over HTTP/2, the one
    /// path under TLS).
    #[arg(long)]
    pub(crate) batch_path: Option<rlhf_core::BatchRoute>,
    /// Embedded mode only: `rlhf-worker` binary for the local worker (default: next to
    /// this one).
    #[arg(long)]
    pub(crate) worker_exe: Option<PathBuf>,
    /// Job id (set by the head for submitted jobs).
    #[arg(long, hide = true)]
    pub(crate) job_id: Option<String>,
    /// File holding the key checkpoints are signed with and a resume verifies [default: the
    /// cluster token; for an embedded run, `checkpoint-key` in the state directory, made on
    /// first use].
    #[arg(long)]
    pub(crate) checkpoint_key_file: Option<PathBuf>,
    /// Resume from a checkpoint without checking its signature (one written by another
    /// cluster or an older version, or copied from elsewhere). Its files are still checked
    /// against their manifests, which catches accidents but not someone who could write the
    /// directory: use it only for checkpoints you trust.
    #[arg(long)]
    pub(crate) trust_checkpoint: bool,
}

/// The checkpoint key: `--checkpoint-key-file`, else the cluster token (`None` here: the
/// driver derives it), else, for an embedded run whose token lives only as long as it does,
/// a key kept in this user's state directory (made on first use, mode 0600).
fn checkpoint_key(
    args: &RunArgs,
    embedded: bool,
) -> Result<Option<rlhf_core::seal::CheckpointKey>> {
    use rlhf_core::seal::CheckpointKey;
    if let Some(p) = &args.checkpoint_key_file {
        let k = auth::read_token_file(p, auth::TokenFile::Given)
            .map_err(|e| Error::invalid(format!("--checkpoint-key-file: {e}")))?;
        if k.len() < 16 {
            return Err(Error::invalid(format!(
                "--checkpoint-key-file {}: the key is {} bytes; use at least 16 (e.g. `openssl rand -hex 32 > {}`)",
                p.display(),
                k.len(),
                p.display()
            )));
        }
        return Ok(Some(CheckpointKey::from_secret(
            k.as_bytes(),
            p.display().to_string(),
        )));
    }
    if !embedded {
        return Ok(None);
    }
    let dir = args
        .conn
        .state_dir
        .clone()
        .unwrap_or_else(rlhf_runtime::default_state_dir);
    rlhf_runtime::prepare_state_dir(&dir)?;
    let path = dir.join("checkpoint-key");
    if path.symlink_metadata().is_err() {
        // Written whole under another name, then linked into place, which fails if another
        // run made it first: a reader never sees a half-written key, and no run replaces
        // the key another one signs with.
        let tmp = dir.join(format!("checkpoint-key.tmp-{}", std::process::id()));
        auth::write_token_file(&tmp, &auth::generate_token())?;
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io(format!("creating {}", path.display()), e)),
        }
    }
    let k = auth::read_token_file(&path, auth::TokenFile::Found)?;
    Ok(Some(CheckpointKey::from_secret(
        k.as_bytes(),
        path.display().to_string(),
    )))
}

/// Loads the job config from a bundle or from `--config-dir/--config-name` + overrides, with
/// every path made absolute against the current directory.
pub(crate) fn load_config(args: &JobConfigArgs) -> Result<PpoConfig> {
    let mut cfg = match (&args.bundle, &args.config_name) {
        (Some(b), _) => {
            let text = std::fs::read_to_string(b)
                .map_err(|e| Error::io(format!("reading {}", b.display()), e))?;
            rlhf_config::from_bundle(&text)
        }
        (None, Some(name)) => rlhf_config::load(&args.config_dir, name, &args.overrides),
        (None, None) => {
            return Err(Error::invalid(
                "no job config: pass --config-name NAME (and --config-dir DIR)",
            ))
        }
    }
    .map_err(|e| Error::invalid(e.to_string()))?;
    let cwd = std::env::current_dir().map_err(|e| Error::io("reading the current directory", e))?;
    cfg.absolutize_paths(&cwd);
    Ok(cfg)
}

fn job_id() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("run-{t}-{}", std::process::id())
}

/// Devices of the pool's resource the job needs in total.
pub(crate) fn devices_needed(cfg: &PpoConfig) -> f64 {
    RoleKind::ALL
        .iter()
        .filter(|r| cfg.role_enabled(**r))
        .filter(|r| !(**r == RoleKind::Ref && cfg.ref_in_trainer()))
        .map(|r| f64::from(cfg.devices(*r)))
        .sum()
}

fn worker_exe(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    let me = std::env::current_exe().map_err(|e| Error::io("locating rlhf-head", e))?;
    let p = me.with_file_name("rlhf-worker");
    if p.is_file() {
        Ok(p)
    } else {
        Err(Error::invalid(format!(
            "the embedded run starts role processes with rlhf-worker, but {} does not exist; build it (cargo build --release -p rlhf-worker) or pass --worker-exe",
            p.display()
        )))
    }
}

/// A head and one worker inside this process, on loopback, with a throw-away state dir.
struct Embedded {
    shutdown: CancellationToken,
    head: head::HeadHandle,
    worker: tokio::task::JoinHandle<Result<()>>,
    state_dir: PathBuf,
    token: String,
}

/// A new, empty directory under `parent` for an embedded run's head and worker state:
/// `rlhf-run-<pid>-<n>`, the first `n` whose directory does not exist yet. A failed run
/// keeps its directory (its logs are there), and process ids come round again: a run that
/// reused one would open the old head's database and see the old worker as a live node for
/// the head's grace period (memory snapshots were pushed to it, and lost).
fn fresh_state_dir(parent: &Path) -> Result<PathBuf> {
    let pid = std::process::id();
    for n in 0..10_000u32 {
        let dir = parent.join(format!("rlhf-run-{pid}-{n}"));
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(Error::io(format!("creating {}", dir.display()), e)),
        }
    }
    Err(Error::invalid(format!(
        "{} holds 10000 directories rlhf-run-{pid}-*: remove the old embedded runs' state \
         (their logs) there",
        parent.display()
    )))
}

/// How long the embedded head waits before it calls its own worker's node dead.
/// What an embedded run leaves of its state directory: nothing when it succeeded or failed
/// before a role process ran; else all of it (the head's and the run's log, the role
/// processes' logs that explain the failure), and the role logs' directory is returned.
fn leave_state(state_dir: &Path, failed: bool) -> Option<PathBuf> {
    let logs = state_dir.join("worker").join("logs");
    let ran = std::fs::read_dir(&logs).is_ok_and(|mut d| d.next().is_some());
    if failed && ran {
        return Some(logs);
    }
    if let Err(e) = std::fs::remove_dir_all(state_dir) {
        tracing::warn!(
            "removing the run's state directory {}: {e}",
            state_dir.display()
        );
    }
    None
}

const EMBEDDED_DEAD_AFTER: Duration = Duration::from_secs(120);

async fn start_embedded(cfg: &PpoConfig, exe: PathBuf, state_dir: PathBuf) -> Result<Embedded> {
    let token = auth::generate_token();
    let shutdown = CancellationToken::new();
    let mut opts = HeadOptions::new(state_dir.join("head"), token.clone());
    opts.host = "127.0.0.1".into();
    opts.port = 0;
    opts.dashboard = None;
    // The only node is the worker task of this very process: it cannot die without the head,
    // and its role processes are watched by the worker itself, not by heartbeats. A silence
    // verdict could only come from this process being starved (a busy laptop, a loaded test
    // machine: seen to fail a run at placement, the node marked dead and registered again
    // under a new id while an actor was being started on it), so the threshold only guards
    // against a worker task that hangs.
    opts.dead_threshold = EMBEDDED_DEAD_AFTER;
    let head = head::start(
        opts,
        Arc::new(rlhf_runtime::clock::SystemClock),
        shutdown.clone(),
    )
    .await?;
    // The local worker offers at least the devices the job asks for: on CPU each role rank is
    // a CPU slot, not a core, so a 2-core laptop still runs the 4-slot demo.
    let resource = cfg.resource_pool.device.resource();
    let (detected, _) = rlhf_runtime::resources::node_resources(&Resources::new());
    let mut resources = Resources::new();
    if resource == "CPU" {
        resources = resources.with("CPU", detected.get("CPU").max(devices_needed(cfg)));
    }
    let cuda_roles = worker::probe_cuda_roles(&exe).await;
    // The embedded worker takes its vLLM Python from the environment, as `rlhf-worker join`
    // does; only a job that generates with vLLM needs (and checks) it.
    let vllm_python = if cfg.actor_rollout.engine == rlhf_config::RolloutEngine::Vllm {
        let var = std::env::var_os(worker::vllm::VLLM_PYTHON_ENV).map(PathBuf::from);
        let python = worker::vllm::resolve(var.as_deref()).await?.ok_or_else(|| {
            Error::invalid(
                "actor_rollout.engine=vllm: the embedded worker has no vLLM Python; set RLHF_VLLM_PYTHON to an interpreter with vLLM installed (scripts/vllm-cpu-venv.sh makes one for the CPU), or run with actor_rollout.engine=candle",
            )
        })?;
        Some(python)
    } else {
        None
    };
    let wopts = WorkerOptions {
        head_address: head.addr.to_string(),
        resources,
        node_ip: Some("127.0.0.1".into()),
        port: 0,
        state_dir: state_dir.join("worker"),
        client: ClientOptions::new(token.clone()),
        actor_exe: exe,
        hostname: "local".into(),
        tls: Default::default(),
        cuda_roles,
        vllm_python,
        snapshot_memory: worker::snapshots::default_cap(),
    };
    let worker = tokio::spawn(worker::run(wopts, shutdown.clone()));
    Ok(Embedded {
        shutdown,
        head,
        worker,
        state_dir,
        token,
    })
}

async fn wait_for_nodes(
    c: &mut HeadServiceClient<net::AuthChannel>,
    n: usize,
    timeout: Duration,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let s = c
            .cluster_status(pb::ClusterStatusRequest {})
            .await
            .map_err(Error::from)?
            .into_inner();
        let alive = s
            .nodes
            .iter()
            .filter(|x| x.state == pb::NodeState::Alive as i32)
            .count();
        if alive >= n {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::new(
                rlhf_core::FailureKind::Timeout,
                format!("the local worker did not register within {timeout:?}"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Mean of `key` over the first and the last `n` steps of this run.
fn ends(s: &JobSummary, key: &str, n: usize) -> Option<(f64, f64)> {
    let v: Vec<f64> = s
        .history
        .iter()
        .filter_map(|m| m.get(key).copied())
        .collect();
    if v.is_empty() {
        return None;
    }
    let n = n.min(v.len());
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    Some((mean(&v[..n]), mean(&v[v.len() - n..])))
}

fn print_summary(s: &JobSummary, logging: &rlhf_config::LoggingConfig) {
    if !s.history.is_empty() {
        let n = (s.history.len() / 4).clamp(1, 10);
        eprintln!(
            "done: {} step(s) this run, at step {}; mean of the first {n} -> last {n} steps:",
            s.steps_run, s.global_step
        );
        for k in [
            metric::OBJECTIVE_SCORES,
            metric::OBJECTIVE_KL,
            metric::LOSS_POLICY_AVG,
            metric::LOSS_VALUE_AVG,
            metric::RESPONSE_LENGTH_MEAN,
            // The other stages.
            metric::TRAIN_LOSS,
            metric::RM_ACCURACY,
            metric::RM_MARGIN,
            metric::REWARDS_ACCURACIES,
            metric::REWARDS_MARGINS,
            metric::TIMING_S_STEP,
        ] {
            if let Some((a, b)) = ends(s, k, n) {
                eprintln!("  {k:<24} {a:>10.4} -> {b:>10.4}");
            }
        }
    }
    if logging.jsonl() {
        eprintln!("metrics: {}", s.metrics_file.display());
    }
    if logging.tensorboard() {
        eprintln!("tensorboard: {}", logging.tensorboard_dir);
    }
    if let Some(c) = &s.last_checkpoint {
        eprintln!("checkpoint: {}", c.display());
    }
}

pub(crate) async fn run(args: RunArgs) -> Result<()> {
    let cfg = load_config(&args.config)?;
    let checkpoint_key = checkpoint_key(&args, args.conn.address.is_none())?;
    let logging = cfg.logging.clone();
    let shutdown = CancellationToken::new();
    rlhf_runtime::cancel_on_signals(shutdown.clone());
    let mut embedded = None;
    // Warnings (the driver's, and the embedded head's and worker's) on stderr, between the
    // progress lines; everything at `info` in the embedded run's state directory, which
    // stays only after a failure once role processes ran (`leave_state`).
    let state_dir = match &args.conn.address {
        Some(_) => None,
        None => Some(fresh_state_dir(&std::env::temp_dir())?),
    };
    let _log = rlhf_runtime::logging::init_with(
        "warn",
        state_dir
            .as_ref()
            .map(|d| d.join("logs").join("run.log"))
            .as_deref(),
    );
    let (head_client, client_opts) = match state_dir {
        None => {
            let c = crate::client(&args.conn).await?;
            // Role actors: the head's token and CA, the default connect timeout.
            let (_, head_opts) = crate::head_connection(&args.conn)?;
            let mut o = ClientOptions::new(head_opts.token);
            o.tls_ca = head_opts.tls_ca;
            (c, o)
        }
        Some(state_dir) => {
            let started = async {
                let exe = worker_exe(args.worker_exe.as_deref())?;
                let e = start_embedded(&cfg, exe, state_dir.clone()).await?;
                let o = ClientOptions::new(e.token.clone());
                let ch = net::connect(&e.head.addr.to_string(), &o).await?;
                let mut c = HeadServiceClient::new(ch)
                    .max_decoding_message_size(rlhf_proto::MAX_MESSAGE_BYTES);
                wait_for_nodes(&mut c, 1, Duration::from_secs(30)).await?;
                Ok::<_, Error>((e, c, o))
            };
            let (e, c, o) = match started.await {
                Ok(v) => v,
                Err(err) => {
                    // Its reasons were on stderr; no role process ran.
                    leave_state(&state_dir, false);
                    return Err(err);
                }
            };
            eprintln!(
                "embedded cluster: head {} + local worker (logs under {})",
                e.head.addr,
                e.state_dir.display()
            );
            embedded = Some(e);
            (c, o)
        }
    };
    let mut opts = DriverOptions::new(cfg, args.job_id.clone().unwrap_or_else(job_id), client_opts);
    opts.resume = args.resume.clone();
    opts.stop_after = args.stop_after;
    opts.call_timeout = args.call_timeout.max(Duration::from_secs(1));
    opts.start_timeout = args.start_timeout.max(Duration::from_secs(1));
    opts.comm_backend = args.comm_backend;
    opts.weight_sync_backend = args.weight_sync_backend;
    opts.batch_path = args.batch_path;
    opts.trust_checkpoint = args.trust_checkpoint;
    opts.checkpoint_key = checkpoint_key;
    let ckpt_dir = PathBuf::from(&opts.config.checkpoint.dir);
    let result = rlhf_driver::run(head_client, opts, shutdown.clone()).await;
    // A job the head started runs from a bundle in its job directory: say how it ended
    // there, as data, for the head to record.
    if let Some(bundle) = args.config.bundle.as_deref() {
        let dir = bundle
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let outcome = rlhf_core::JobOutcome {
            failure: result.as_ref().err().map(|e| e.failure()),
        };
        if let Err(e) = outcome.write(dir) {
            eprintln!(
                "warning: cannot write {}: {e}",
                dir.join(rlhf_core::outcome::OUTCOME_FILE).display()
            );
        }
    }
    let mut role_logs = None;
    if let Some(e) = embedded {
        e.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(15), e.worker).await;
        e.head.wait().await;
        role_logs = leave_state(&e.state_dir, result.is_err());
    }
    match result {
        Ok(s) => {
            print_summary(&s, &logging);
            Ok(())
        }
        Err(RunError { error: e, .. }) => {
            let mut hint = if rlhf_driver::checkpoint::list(&ckpt_dir).is_empty() {
                String::new()
            } else {
                format!(
                    "\nthe last checkpoint is under {}; continue with the same command plus --resume latest",
                    ckpt_dir.display()
                )
            };
            if let Some(logs) = role_logs {
                hint.push_str(&format!(
                    "\nthe role processes' logs are under {}",
                    logs.display()
                ));
            }
            Err(Error::new(e.kind(), format!("{e}{hint}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run that succeeded, or failed before any role process wrote a log, leaves nothing;
    /// one that failed after role processes ran keeps its state and names the logs.
    #[test]
    fn a_failed_embedded_run_keeps_its_state_only_when_role_processes_ran() {
        let parent = tempfile::tempdir().unwrap();
        let make = |roles: bool| {
            let d = fresh_state_dir(parent.path()).unwrap();
            std::fs::create_dir_all(d.join("head")).unwrap();
            std::fs::create_dir_all(d.join("worker/logs")).unwrap();
            if roles {
                std::fs::write(d.join("worker/logs/actor-1.log"), b"trace").unwrap();
            }
            d
        };
        for (roles, failed) in [(false, false), (true, false), (false, true)] {
            let d = make(roles);
            assert_eq!(leave_state(&d, failed), None);
            assert!(!d.exists(), "roles {roles}, failed {failed}");
        }
        let d = make(true);
        assert_eq!(leave_state(&d, true), Some(d.join("worker/logs")));
        assert!(d.join("worker/logs/actor-1.log").is_file() && d.join("head").is_dir());
    }

    #[test]
    fn an_embedded_run_never_opens_the_state_a_previous_run_left() {
        let parent = tempfile::tempdir().unwrap();
        // A failed run of a process that had this process id kept its state (and its logs).
        let old = parent
            .path()
            .join(format!("rlhf-run-{}-0", std::process::id()));
        std::fs::create_dir_all(old.join("head")).unwrap();
        std::fs::write(old.join("head").join("head.redb"), b"old nodes").unwrap();
        let a = fresh_state_dir(parent.path()).unwrap();
        let b = fresh_state_dir(parent.path()).unwrap();
        for d in [&a, &b] {
            assert_ne!(d, &old);
            assert!(d.starts_with(parent.path()), "{}", d.display());
            assert_eq!(std::fs::read_dir(d).unwrap().count(), 0, "{}", d.display());
        }
        assert_ne!(a, b);
        assert!(
            old.join("head").join("head.redb").is_file(),
            "left as it was"
        );
    }
}
