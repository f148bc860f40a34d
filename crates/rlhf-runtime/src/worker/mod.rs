//! The worker agent (one per node, like Ray's raylet): registers with the head and keeps
//! heartbeating (re-registering with its live actors after a head restart), serves the
//! WorkerService the head calls to start and stop actors, and supervises those actor
//! processes, reporting each exit (code, signal, last log lines) to the head.

mod exits;
mod heartbeat;
pub mod snapshots;
mod usage;
pub mod vllm;

use exits::{check_actor_id, log_tail};
pub use exits::{exit_reason, STOPPED_ON_REQUEST};

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rlhf_core::{Error, FailureKind, Resources, Result};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::head_service_client::HeadServiceClient;
use rlhf_proto::v1::worker_service_server::{WorkerService, WorkerServiceServer};
use rlhf_proto::{MAX_MESSAGE_BYTES, PROTOCOL_VERSION};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::auth::{CheckToken, TOKEN_ENV};
use crate::convert;
use crate::net::{self, AuthChannel, ClientOptions};
use crate::resources::{grant_ids, node_resources, DevicePool, Grant};

#[derive(Clone, Debug)]
pub struct WorkerOptions {
    pub head_address: String,
    /// `--resources` overrides on top of what is detected.
    pub resources: Resources,
    /// Address other nodes reach this one on; detected from the route to the head.
    pub node_ip: Option<String>,
    pub port: u16,
    /// Logs and actor ready-files go under here.
    pub state_dir: PathBuf,
    pub client: ClientOptions,
    /// Program started for actors, as `<exe> actor ...`.
    pub actor_exe: PathBuf,
    pub hostname: String,
    /// This node's TLS identity: its own service and every actor it starts serve with it.
    pub tls: net::ServerTls,
    /// `actor_exe` can run roles on CUDA GPUs (built with the `cuda` feature); told to the
    /// head at join, which places no GPU bundle here otherwise.
    pub cuda_roles: bool,
    /// The interpreter its rollout ranks run vLLM with (`--vllm-python`, checked at join);
    /// told to the head, which places vLLM rollout ranks only on workers that have one.
    pub vllm_python: Option<PathBuf>,
    /// Bytes of checkpoint snapshots this worker holds in memory at most
    /// (`--snapshot-memory-gb`; `checkpoint.memory_snapshot`).
    pub snapshot_memory: u64,
}

struct ActorProc {
    info: pb::ActorInfo,
    stop_requested: bool,
}

struct Agent {
    opts: WorkerOptions,
    node_ip: String,
    node_id: Mutex<String>,
    actors: Mutex<HashMap<String, ActorProc>>,
    /// GPUs and NPUs.
    free: Mutex<(DevicePool, DevicePool)>,
    head: HeadServiceClient<AuthChannel>,
    shutdown: CancellationToken,
    snapshots: snapshots::Store,
}

#[derive(Clone)]
struct WorkerSvc(Arc<Agent>);

impl Agent {
    fn take_devices(&self, amount: f64, key: &str) -> Result<Grant> {
        let mut pools = crate::lock(&self.free);
        let pool = if key == "GPU" {
            &mut pools.0
        } else {
            &mut pools.1
        };
        pool.take(amount).ok_or_else(|| {
            Error::new(
                FailureKind::InsufficientResources,
                format!(
                    "node has {} free whole {key} device(s) and no share with room, the actor needs {amount}",
                    pool.free()
                ),
            )
        })
    }

    fn give_back(&self, gpus: &[(u32, f64)], npus: &[(u32, f64)]) {
        let mut pools = crate::lock(&self.free);
        pools.0.give_back(gpus);
        pools.1.give_back(npus);
    }

    async fn start_actor(
        self: &Arc<Self>,
        actor_id: String,
        spec: pb::ActorSpec,
        timeout: Duration,
    ) -> Result<pb::ActorInfo> {
        // The head checked it too; a worker trusts no caller with its process environment.
        crate::head::validate::actor_env(spec.env.keys(), "ActorSpec.env")?;
        // It names the actor's log and ready files under the state directory.
        check_actor_id(&actor_id)?;
        let domain = convert::spec_from_proto(&spec);
        let gpus = self.take_devices(domain.resources.get("GPU"), "GPU")?;
        let npus = match self.take_devices(domain.resources.get("NPU"), "NPU") {
            Ok(n) => n,
            Err(e) => {
                self.give_back(&gpus, &[]);
                return Err(e);
            }
        };
        match self
            .spawn_actor(&actor_id, &spec, &gpus, &npus, timeout)
            .await
        {
            Ok(info) => Ok(info),
            Err(e) => {
                self.give_back(&gpus, &npus);
                Err(e)
            }
        }
    }

    async fn spawn_actor(
        self: &Arc<Self>,
        actor_id: &str,
        spec: &pb::ActorSpec,
        gpus: &[(u32, f64)],
        npus: &[(u32, f64)],
        timeout: Duration,
    ) -> Result<pb::ActorInfo> {
        let (gpu_ids, npu_ids) = (grant_ids(gpus), grant_ids(npus));
        let log_dir = self.opts.state_dir.join("logs");
        let run_dir = self.opts.state_dir.join("run");
        for d in [&log_dir, &run_dir] {
            std::fs::create_dir_all(d)
                .map_err(|e| Error::io(format!("creating {}", d.display()), e))?;
        }
        let log_file = log_dir.join(format!("{actor_id}.log"));
        let ready_file = run_dir.join(format!("{actor_id}.ready"));
        let _ = std::fs::remove_file(&ready_file);
        let log = std::fs::File::create(&log_file)
            .map_err(|e| Error::io(format!("creating {}", log_file.display()), e))?;
        let log2 = log.try_clone().map_err(|e| Error::io("log file", e))?;
        let join = |v: &[u32]| {
            v.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        let mut cmd = tokio::process::Command::new(&self.opts.actor_exe);
        cmd.arg("actor")
            .arg("--actor-id")
            .arg(actor_id)
            .arg("--kind")
            .arg(if spec.kind.is_empty() {
                "test"
            } else {
                &spec.kind
            })
            .arg("--ready-file")
            .arg(&ready_file)
            .arg("--host")
            .arg(&self.node_ip)
            // Before the caller's arguments, which the actor takes as a trailing list.
            .args(self.opts.tls.args())
            .args(&spec.args)
            // The caller's variables first, so the worker's own always win.
            .envs(&spec.env)
            // The token travels in the environment, never on a command line.
            .env(TOKEN_ENV, &self.opts.client.token)
            .env("RLHF_ACTOR_ID", actor_id)
            .env(crate::actor::HEAD_ADDRESS_ENV, &self.opts.head_address)
            .env(
                crate::actor::HEAD_TLS_DOMAIN_ENV,
                self.opts.client.tls_domain.as_deref().unwrap_or_default(),
            )
            .env("CUDA_VISIBLE_DEVICES", join(&gpu_ids))
            .env("ASCEND_RT_VISIBLE_DEVICES", join(&npu_ids))
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log2);
        // The worker's vLLM Python, never one from the job's variables.
        match &self.opts.vllm_python {
            Some(p) => cmd.env(vllm::VLLM_PYTHON_ENV, p),
            None => cmd.env_remove(vllm::VLLM_PYTHON_ENV),
        };
        // SAFETY: prctl is async-signal-safe and touches only the child's own state; it makes
        // the kernel kill the actor if this worker dies, so no actor outlives its supervisor.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| {
            Error::io(
                format!("starting actor program {}", self.opts.actor_exe.display()),
                e,
            )
        })?;
        let pid = child.id().unwrap_or(0) as i32;
        let deadline = tokio::time::Instant::now() + timeout;
        let address = loop {
            if let Ok(a) = std::fs::read_to_string(&ready_file) {
                if !a.trim().is_empty() {
                    break a.trim().to_string();
                }
            }
            if let Ok(Some(st)) = child.try_wait() {
                use std::os::unix::process::ExitStatusExt;
                return Err(Error::new(
                    FailureKind::ActorDied,
                    format!(
                        "actor {actor_id} {} before it was ready; last log lines:\n{}",
                        exit_reason(st.code(), st.signal(), false),
                        log_tail(&log_file, 20).join("\n")
                    ),
                ));
            }
            if tokio::time::Instant::now() > deadline {
                let _ = child.start_kill();
                return Err(Error::new(
                    FailureKind::Timeout,
                    format!(
                        "actor {actor_id} was not ready within {timeout:?}; see {}",
                        log_file.display()
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let info = pb::ActorInfo {
            actor_id: actor_id.to_string(),
            spec: Some(spec.clone()),
            node_id: crate::lock(&self.node_id).clone(),
            address,
            state: pb::ActorState::Alive as i32,
            pid,
            devices: gpu_ids.iter().chain(&npu_ids).copied().collect(),
            log_file: log_file.display().to_string(),
            ..Default::default()
        };
        crate::lock(&self.actors).insert(
            actor_id.to_string(),
            ActorProc {
                info: info.clone(),
                stop_requested: false,
            },
        );
        tracing::info!(actor = actor_id, pid, address = %info.address, "actor started");
        let agent = self.clone();
        let (id, gpus, npus) = (actor_id.to_string(), gpus.to_vec(), npus.to_vec());
        tokio::spawn(async move {
            use std::os::unix::process::ExitStatusExt;
            let st = child.wait().await;
            let proc = crate::lock(&agent.actors).remove(&id);
            agent.give_back(&gpus, &npus);
            let stop_requested = proc.as_ref().map(|p| p.stop_requested).unwrap_or(false);
            let (code, sig) = match &st {
                Ok(s) => (s.code(), s.signal()),
                Err(_) => (None, None),
            };
            let exit = pb::ActorExit {
                exit_code: code.unwrap_or(-1),
                signal: sig.unwrap_or(0),
                log_tail: log_tail(&log_file, 20),
                reason: exit_reason(code, sig, stop_requested),
            };
            tracing::info!(actor = %id, reason = %exit.reason, "actor exited");
            agent.report_exit(id, exit).await;
        });
        Ok(info)
    }

    /// Reports an exit, retrying while the head is unreachable (it may be restarting).
    async fn report_exit(&self, actor_id: String, exit: pb::ActorExit) {
        let mut head = self.head.clone();
        for _ in 0..120 {
            let req = pb::ReportActorExitRequest {
                node_id: crate::lock(&self.node_id).clone(),
                actor_id: actor_id.clone(),
                exit: Some(exit.clone()),
            };
            match tokio::time::timeout(Duration::from_secs(2), head.report_actor_exit(req)).await {
                Ok(Ok(_)) => return,
                _ if self.shutdown.is_cancelled() => return,
                _ => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
        tracing::warn!(actor = %actor_id, "could not report the actor's exit to the head");
    }

    fn signal_actor(&self, actor_id: &str, sig: nix::sys::signal::Signal, mark_stop: bool) -> bool {
        let mut actors = crate::lock(&self.actors);
        let Some(p) = actors.get_mut(actor_id) else {
            return false;
        };
        if mark_stop {
            p.stop_requested = true;
        }
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p.info.pid), sig);
        true
    }

    /// SIGTERM every actor, then SIGKILL whatever is left after a grace period.
    async fn stop_all(&self, grace: Duration) {
        let ids: Vec<String> = crate::lock(&self.actors).keys().cloned().collect();
        for id in &ids {
            self.signal_actor(id, nix::sys::signal::Signal::SIGTERM, true);
        }
        let deadline = tokio::time::Instant::now() + grace;
        while tokio::time::Instant::now() < deadline && !crate::lock(&self.actors).is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let left: Vec<String> = crate::lock(&self.actors).keys().cloned().collect();
        for id in &left {
            tracing::warn!(actor = %id, "actor ignored SIGTERM; killing it");
            self.signal_actor(id, nix::sys::signal::Signal::SIGKILL, true);
        }
        while !crate::lock(&self.actors).is_empty()
            && tokio::time::Instant::now() < deadline + Duration::from_secs(2)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn live_actors(&self) -> Vec<pb::ActorInfo> {
        crate::lock(&self.actors)
            .values()
            .map(|p| p.info.clone())
            .collect()
    }

    async fn register(
        &self,
        resources: &Resources,
        address: &str,
    ) -> Result<pb::RegisterNodeResponse> {
        let req = pb::RegisterNodeRequest {
            protocol_version: PROTOCOL_VERSION,
            node_id: crate::lock(&self.node_id).clone(),
            hostname: self.opts.hostname.clone(),
            address: address.to_string(),
            resources: Some(resources.into()),
            live_actors: self.live_actors(),
            cuda_roles: self.opts.cuda_roles,
            vllm_roles: self.opts.vllm_python.is_some(),
        };
        let mut head = self.head.clone();
        let r = tokio::time::timeout(Duration::from_secs(5), head.register_node(req))
            .await
            .map_err(|_| {
                Error::new(
                    FailureKind::Timeout,
                    "register: the head did not answer within 5s",
                )
            })??
            .into_inner();
        *crate::lock(&self.node_id) = r.node_id.clone();
        Ok(r)
    }
}

#[tonic::async_trait]
impl WorkerService for WorkerSvc {
    async fn start_actor(
        &self,
        req: Request<pb::StartActorRequest>,
    ) -> std::result::Result<Response<pb::StartActorResponse>, Status> {
        let r = req.into_inner();
        let spec = r.spec.unwrap_or_default();
        let timeout = Duration::from_millis(if r.timeout_ms == 0 {
            30_000
        } else {
            r.timeout_ms
        });
        let info = self.0.start_actor(r.actor_id, spec, timeout).await?;
        Ok(Response::new(pb::StartActorResponse { actor: Some(info) }))
    }

    async fn stop_actor(
        &self,
        req: Request<pb::StopActorRequest>,
    ) -> std::result::Result<Response<pb::StopActorResponse>, Status> {
        let id = req.into_inner().actor_id;
        if !self
            .0
            .signal_actor(&id, nix::sys::signal::Signal::SIGTERM, true)
        {
            return Err(Error::not_found(format!("actor {id} is not running on this node")).into());
        }
        Ok(Response::new(pb::StopActorResponse {}))
    }

    async fn shutdown_worker(
        &self,
        _req: Request<pb::ShutdownWorkerRequest>,
    ) -> std::result::Result<Response<pb::ShutdownWorkerResponse>, Status> {
        tracing::info!("shutdown requested by the head");
        self.0.shutdown.cancel();
        Ok(Response::new(pb::ShutdownWorkerResponse {}))
    }

    async fn put_snapshot(
        &self,
        req: Request<tonic::Streaming<pb::SnapshotChunk>>,
    ) -> std::result::Result<Response<pb::PutSnapshotResponse>, Status> {
        let bytes = self.0.snapshots.receive(req.into_inner()).await?;
        Ok(Response::new(pb::PutSnapshotResponse { bytes }))
    }

    type GetSnapshotStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = std::result::Result<pb::SnapshotChunk, Status>> + Send>,
    >;

    async fn get_snapshot(
        &self,
        req: Request<pb::GetSnapshotRequest>,
    ) -> std::result::Result<Response<Self::GetSnapshotStream>, Status> {
        let key = req
            .into_inner()
            .key
            .ok_or_else(|| Error::invalid("GetSnapshotRequest.key is missing"))?;
        let chunks = self.0.snapshots.chunks(key)?;
        Ok(Response::new(Box::pin(tokio_stream::iter(
            chunks.into_iter().map(Ok),
        ))))
    }

    async fn commit_snapshot(
        &self,
        req: Request<pb::CommitSnapshotRequest>,
    ) -> std::result::Result<Response<pb::CommitSnapshotResponse>, Status> {
        let r = req.into_inner();
        crate::head::validate::name(&r.job_id, "CommitSnapshotRequest.job_id", false)?;
        self.0.snapshots.commit(&r.job_id, r.step);
        Ok(Response::new(pb::CommitSnapshotResponse {}))
    }

    async fn drop_snapshots(
        &self,
        req: Request<pb::DropSnapshotsRequest>,
    ) -> std::result::Result<Response<pb::DropSnapshotsResponse>, Status> {
        let r = req.into_inner();
        crate::head::validate::name(&r.job_id, "DropSnapshotsRequest.job_id", false)?;
        let bytes_freed = self.0.snapshots.drop_job(&r.job_id);
        Ok(Response::new(pb::DropSnapshotsResponse { bytes_freed }))
    }
}

fn fatal(e: &Error) -> bool {
    matches!(
        e.kind(),
        FailureKind::Unauthenticated | FailureKind::VersionMismatch
    )
}

/// Joins the cluster and serves until `shutdown`; then stops every actor and returns.
/// Fails after `client.connect_timeout` if the head cannot be reached at first.
pub async fn run(opts: WorkerOptions, shutdown: CancellationToken) -> Result<()> {
    let (resources, devices) = node_resources(&opts.resources);
    let node_ip = opts
        .node_ip
        .clone()
        .or_else(|| net::local_ip_towards(&opts.head_address).map(|ip| ip.to_string()))
        .unwrap_or_else(|| "127.0.0.1".into());
    let listener = net::bind(&node_ip, opts.port, "--port").await?;
    let address = format!(
        "{node_ip}:{}",
        listener
            .local_addr()
            .map_err(|e| Error::io("local address", e))?
            .port()
    );

    // Pings on this long-lived channel are much of what 10,000 idle nodes cost the head; the
    // head's own pings (every 30 s) find a node that vanished, and a head that vanished
    // without closing the connection is found within 80 s (a restarted one at once).
    let head_client = ClientOptions {
        keepalive: Duration::from_secs(60),
        ..opts.client.clone()
    };
    let channel = net::connect(&opts.head_address, &head_client).await?;
    let head = HeadServiceClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES);
    let agent = Arc::new(Agent {
        opts: opts.clone(),
        node_ip,
        node_id: Mutex::new(String::new()),
        actors: Mutex::new(HashMap::new()),
        free: Mutex::new((DevicePool::new(devices.gpus), DevicePool::new(devices.npus))),
        head,
        shutdown: shutdown.clone(),
        snapshots: snapshots::Store::new(opts.snapshot_memory),
    });

    let svc = tonic::service::interceptor::InterceptedService::new(
        WorkerServiceServer::new(WorkerSvc(agent.clone()))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
        CheckToken::new(&opts.client.token, "worker"),
    );
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let sd = shutdown.clone();
    let mut builder = opts.tls.server()?;
    let server = tokio::spawn(async move {
        if let Err(e) = builder
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming, sd.cancelled_owned())
            .await
        {
            tracing::error!("worker server: {}", net::error_chain(&e));
        }
    });

    let reg = match agent.register(&resources, &address).await {
        Ok(r) => r,
        Err(e) => {
            shutdown.cancel();
            let _ = server.await;
            return Err(e);
        }
    };
    println!(
        "node {} joined the cluster at {} (serving on {address}; resources {})",
        reg.node_id,
        opts.head_address,
        resources.display()
    );
    tracing::info!(node = %reg.node_id, "registered");
    let interval = Duration::from_millis(reg.heartbeat_interval_ms.clamp(50, 10_000));

    tokio::spawn(usage::run(agent.clone(), shutdown.clone()));
    let result = heartbeat::run(&agent, &resources, &address, interval, reg, &shutdown).await;
    agent.stop_all(Duration::from_secs(3)).await;
    shutdown.cancel();
    let _ = server.await;
    result
}

/// Asks an rlhf-worker executable whether its role actors can run on CUDA GPUs (its hidden
/// `capabilities` subcommand), within 30 s. Any failure answers false, with a warning: the
/// head then places no GPU role on the node, which is the safe side.
pub async fn probe_cuda_roles(exe: &std::path::Path) -> bool {
    let run = tokio::process::Command::new(exe)
        .arg("capabilities")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(Duration::from_secs(30), run).await {
        Ok(Ok(out)) if out.status.success() => {
            serde_json::from_slice::<serde_json::Value>(&out.stdout)
                .ok()
                .and_then(|v| v["cuda_roles"].as_bool())
                .unwrap_or(false)
        }
        other => {
            tracing::warn!(exe = %exe.display(), result = ?other.map(|r| r.map(|o| o.status)), "could not ask the worker executable for its capabilities; assuming it cannot run CUDA roles");
            false
        }
    }
}
