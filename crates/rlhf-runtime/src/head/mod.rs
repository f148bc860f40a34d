//! The head node: node registry, health, placement groups, actor directory, KV store,
//! all persisted under `--state-dir`. `start` builds and binds the service so the binary,
//! the embedded mode and tests share it.

mod actors;
mod job_driver;
mod job_state;
pub mod jobs;
mod liveness;
mod options;
mod records;
mod start;
pub mod state;
pub mod store;
pub mod validate;

pub use options::HeadOptions;
pub use start::start;

use std::collections::HashMap;
use std::net::SocketAddr;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rlhf_core::{Error, FailureKind, Resources, Result};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::head_service_server::HeadService;
use rlhf_proto::v1::worker_service_client::WorkerServiceClient;
use rlhf_proto::{MAX_MESSAGE_BYTES, PROTOCOL_VERSION};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::clock::Clock;
use crate::convert;
use crate::net::{self, AuthChannel, ClientOptions};
use state::{ActorExit, HeadState, LiveActor, Needs, NewNode};

/// How long KillActor waits for the worker to stop the process.
const KILL_TIMEOUT: Duration = Duration::from_secs(30);

pub struct HeadHandle {
    pub addr: SocketAddr,
    pub dashboard: Option<SocketAddr>,
    pub shutdown: CancellationToken,
    server: tokio::task::JoinHandle<()>,
}

impl HeadHandle {
    /// Waits until the head has stopped (after `shutdown` is cancelled or a Shutdown RPC).
    pub async fn wait(self) {
        let _ = self.server.await;
    }
}

struct Inner {
    state: Mutex<HeadState>,
    clock: Arc<dyn Clock>,
    opts: HeadOptions,
    kv_changed: tokio::sync::Notify,
    workers: Mutex<HashMap<String, WorkerServiceClient<AuthChannel>>>,
    shutdown: CancellationToken,
    jobs: jobs::Jobs,
    beats: Arc<liveness::Beats>,
    /// The heartbeat datagram port; 0 without one.
    udp_port: u16,
}

#[derive(Clone)]
pub struct Head(Arc<Inner>);

fn check_version(theirs: u32) -> Result<()> {
    if theirs != PROTOCOL_VERSION {
        return Err(Error::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs,
        });
    }
    Ok(())
}

impl Head {
    fn lock(&self) -> std::sync::MutexGuard<'_, HeadState> {
        // A panic while holding the lock would be a bug; the state itself stays usable.
        crate::lock(&self.0.state)
    }

    fn worker_client(&self, address: &str) -> Result<WorkerServiceClient<AuthChannel>> {
        let mut w = crate::lock(&self.0.workers);
        if let Some(c) = w.get(address) {
            return Ok(c.clone());
        }
        // A TLS head reaches TLS workers, verified by the CA it gives its job drivers.
        let mut client = ClientOptions::new(self.0.opts.token.clone());
        client.tls_ca = self.0.opts.cluster_ca();
        let ch = net::connect_lazy(address, &client)?;
        let c = WorkerServiceClient::new(ch).max_decoding_message_size(MAX_MESSAGE_BYTES);
        w.insert(address.to_string(), c.clone());
        Ok(c)
    }

    pub fn status(&self) -> pb::ClusterStatusResponse {
        let s = self.lock();
        pb::ClusterStatusResponse {
            nodes: s
                .nodes
                .values()
                .map(|n| convert::node_to_proto(n, &s.available(&n.node_id)))
                .collect(),
            placement_groups: s.pgs.values().map(convert::pg_to_proto).collect(),
            actors: s.actors.values().map(convert::actor_to_proto).collect(),
            protocol_version: PROTOCOL_VERSION,
            now_ms: self.0.clock.now_ms(),
            jobs: self
                .0
                .jobs
                .list()
                .iter()
                .map(|j| self.0.jobs.to_proto(j))
                .collect(),
        }
    }

    /// The job manager (submitted PPO jobs).
    pub fn jobs(&self) -> &jobs::Jobs {
        &self.0.jobs
    }
}

#[tonic::async_trait]
impl HeadService for Head {
    async fn register_node(
        &self,
        req: Request<pb::RegisterNodeRequest>,
    ) -> std::result::Result<Response<pb::RegisterNodeResponse>, Status> {
        let peer = req.remote_addr();
        let r = req.into_inner();
        check_version(r.protocol_version)?;
        validate::name(&r.node_id, "RegisterNodeRequest.node_id", true)?;
        validate::hostname(&r.hostname, "RegisterNodeRequest.hostname")?;
        validate::address(&r.address, "RegisterNodeRequest.address", false)?;
        let resources = validate::resources(r.resources.as_ref(), "RegisterNodeRequest.resources")?;
        for a in &r.live_actors {
            validate::name(
                &a.actor_id,
                "RegisterNodeRequest.live_actors.actor_id",
                false,
            )?;
            validate::address(&a.address, "RegisterNodeRequest.live_actors.address", true)?;
        }
        let live = r
            .live_actors
            .iter()
            .map(|a| LiveActor {
                actor_id: a.actor_id.clone(),
                address: a.address.clone(),
                pid: a.pid,
                devices: a.devices.clone(),
                log_file: a.log_file.clone(),
            })
            .collect();
        let now = self.0.clock.now_ms();
        let node = NewNode {
            hostname: r.hostname.clone(),
            address: r.address.clone(),
            total: resources.clone(),
            cuda_roles: r.cuda_roles,
            vllm_roles: r.vllm_roles,
        };
        let (id, commit) =
            self.lock()
                .register_deferred(Some(r.node_id.clone()), node, live, now)?;
        // The record goes to disk with the next group commit; the answer does not wait for
        // it: a registration is not durable when answered anyway (a restarted head has every
        // node register again), and in a storm of joins that wait was most of the latency.
        let node_id = id.clone();
        tokio::spawn(async move {
            if let Err(e) = commit.wait().await {
                tracing::warn!(node = %node_id, "saving the node's registration: {e}; it registers again after a head restart");
            }
        });
        let heartbeat_key = self.0.beats.register(&id, now)?;
        tracing::info!(node = %id, host = %r.hostname, address = %r.address, peer = ?peer, resources = %resources.display(), cuda_roles = r.cuda_roles, vllm_roles = r.vllm_roles, "node registered");
        Ok(Response::new(pb::RegisterNodeResponse {
            node_id: id,
            heartbeat_interval_ms: self.0.opts.heartbeat_interval.as_millis() as u64,
            session_dir: self.0.opts.state_dir.display().to_string(),
            heartbeat_udp_port: u32::from(self.0.udp_port),
            heartbeat_key,
        }))
    }

    async fn heartbeat(
        &self,
        req: Request<pb::HeartbeatRequest>,
    ) -> std::result::Result<Response<pb::HeartbeatResponse>, Status> {
        let r = req.into_inner();
        check_version(r.protocol_version)?;
        let known = self.lock().heartbeat(&r.node_id, self.0.clock.now_ms());
        Ok(Response::new(pb::HeartbeatResponse {
            known,
            udp_confirmed: false,
        }))
    }

    type HeartbeatStreamStream = liveness::BeatStream;

    async fn heartbeat_stream(
        &self,
        req: Request<tonic::Streaming<pb::HeartbeatRequest>>,
    ) -> std::result::Result<Response<Self::HeartbeatStreamStream>, Status> {
        let mut inbound = req.into_inner();
        let first = liveness::first(&mut inbound).await?;
        check_version(first.protocol_version)?;
        let now = self.0.clock.now_ms();
        // Known to the registry and registered since this head started (a restarted head
        // has no keys: the node registers again, and its actors come back with it).
        let known = self.lock().heartbeat(&first.node_id, now);
        let attached = known
            .then(|| self.0.beats.attach(&first.node_id, now))
            .flatten();
        Ok(Response::new(liveness::serve(
            inbound,
            attached,
            self.0.clock.clone(),
            self.0.shutdown.clone(),
        )))
    }

    async fn report_actor_exit(
        &self,
        req: Request<pb::ReportActorExitRequest>,
    ) -> std::result::Result<Response<pb::ReportActorExitResponse>, Status> {
        let r = req.into_inner();
        let exit: ActorExit = r
            .exit
            .as_ref()
            .map(convert::exit_from_proto)
            .unwrap_or_default();
        if exit.reason == crate::worker::STOPPED_ON_REQUEST {
            tracing::info!(actor = %r.actor_id, node = %r.node_id, "actor exited: {}", exit.reason);
        } else {
            tracing::warn!(actor = %r.actor_id, node = %r.node_id, code = exit.exit_code, signal = exit.signal, "actor exited: {}", exit.reason);
        }
        self.lock()
            .actor_died(&r.actor_id, exit.reason.clone(), Some(exit))?;
        Ok(Response::new(pb::ReportActorExitResponse {}))
    }

    async fn report_actor_usage(
        &self,
        req: Request<pb::ReportActorUsageRequest>,
    ) -> std::result::Result<Response<pb::ReportActorUsageResponse>, Status> {
        let r = req.into_inner();
        validate::name(&r.node_id, "ReportActorUsageRequest.node_id", false)?;
        if r.actors.len() > validate::MAX_ACTORS_PER_NODE {
            return Err(Status::invalid_argument(format!(
                "ReportActorUsageRequest.actors: {} entries, at most {} allowed",
                r.actors.len(),
                validate::MAX_ACTORS_PER_NODE
            )));
        }
        self.lock().actor_usage(
            &r.node_id,
            r.actors.iter().map(|a| (a.actor_id.as_str(), a.rss_bytes)),
        );
        Ok(Response::new(pb::ReportActorUsageResponse {}))
    }

    async fn cluster_status(
        &self,
        _req: Request<pb::ClusterStatusRequest>,
    ) -> std::result::Result<Response<pb::ClusterStatusResponse>, Status> {
        Ok(Response::new(self.status()))
    }

    async fn create_placement_group(
        &self,
        req: Request<pb::CreatePlacementGroupRequest>,
    ) -> std::result::Result<Response<pb::CreatePlacementGroupResponse>, Status> {
        let r = req.into_inner();
        let strategy = convert::strategy_from_proto(r.strategy);
        validate::name(&r.name, "CreatePlacementGroupRequest.name", true)?;
        let bundles: Vec<Resources> = r
            .bundles
            .iter()
            .map(|b| {
                validate::resources(b.resources.as_ref(), "CreatePlacementGroupRequest.bundles")
            })
            .collect::<Result<_>>()?;
        let wait = validate::wait_ms(
            r.timeout_ms,
            "CreatePlacementGroupRequest.timeout_ms",
            Duration::ZERO,
        )?;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let res = self.lock().create_pg_needing(
                &r.name,
                strategy,
                bundles.clone(),
                Needs {
                    cuda_roles: r.cuda_roles,
                    vllm_roles: r.vllm_roles,
                },
            );
            match res {
                Ok(pg) => {
                    tracing::info!(pg = %pg.pg_id, name = %pg.name, nodes = ?pg.bundle_nodes, "placement group created");
                    return Ok(Response::new(pb::CreatePlacementGroupResponse {
                        placement_group: Some(convert::pg_to_proto(&pg)),
                    }));
                }
                Err(e)
                    if e.kind() == FailureKind::InsufficientResources
                        && tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => {
                    let e = if r.timeout_ms > 0 && e.kind() == FailureKind::InsufficientResources {
                        Error::new(e.kind(), format!("{e} (waited {} ms)", r.timeout_ms))
                    } else {
                        e
                    };
                    return Err(e.into());
                }
            }
        }
    }

    async fn remove_placement_group(
        &self,
        req: Request<pb::RemovePlacementGroupRequest>,
    ) -> std::result::Result<Response<pb::RemovePlacementGroupResponse>, Status> {
        self.lock().remove_pg(&req.into_inner().pg_id)?;
        Ok(Response::new(pb::RemovePlacementGroupResponse {}))
    }

    async fn create_actor(
        &self,
        req: Request<pb::CreateActorRequest>,
    ) -> std::result::Result<Response<pb::CreateActorResponse>, Status> {
        let r = req.into_inner();
        let wire = r
            .spec
            .as_ref()
            .ok_or_else(|| Error::invalid("CreateActor needs a spec"))?;
        validate::name(&wire.name, "ActorSpec.name", true)?;
        validate::name(&wire.role, "ActorSpec.role", true)?;
        validate::name(&wire.kind, "ActorSpec.kind", true)?;
        validate::name(&wire.pg_id, "ActorSpec.pg_id", true)?;
        validate::resources(wire.resources.as_ref(), "ActorSpec.resources")?;
        validate::actor_env(wire.env.keys(), "ActorSpec.env")?;
        let spec = convert::spec_from_proto(wire);
        let timeout = validate::wait_ms(
            r.timeout_ms,
            "CreateActorRequest.timeout_ms",
            Duration::from_secs(30),
        )?;
        let actor = Head::create_actor(self, spec, timeout).await?;
        Ok(Response::new(pb::CreateActorResponse {
            actor: Some(actor),
        }))
    }

    async fn kill_actor(
        &self,
        req: Request<pb::KillActorRequest>,
    ) -> std::result::Result<Response<pb::KillActorResponse>, Status> {
        let id = req.into_inner().actor_id;
        let address = {
            let s = self.lock();
            let a = s
                .actors
                .get(&id)
                .ok_or_else(|| Error::not_found(format!("no actor {id}")))?;
            s.nodes
                .get(&a.node_id)
                .map(|n| n.address.clone())
                .unwrap_or_default()
        };
        let mut c = self.worker_client(&address)?;
        tokio::time::timeout(
            KILL_TIMEOUT,
            c.stop_actor(pb::StopActorRequest {
                actor_id: id.clone(),
            }),
        )
        .await
        .map_err(|_| {
            Error::new(
                FailureKind::Timeout,
                format!(
                    "the worker at {address} did not stop actor {id} within {} s",
                    KILL_TIMEOUT.as_secs()
                ),
            )
        })??;
        Ok(Response::new(pb::KillActorResponse {}))
    }

    async fn kv_put(
        &self,
        req: Request<pb::KvPutRequest>,
    ) -> std::result::Result<Response<pb::KvPutResponse>, Status> {
        let r = req.into_inner();
        let stored = self.lock().kv_put(&r.key, r.value, r.overwrite)?;
        self.0.kv_changed.notify_waiters();
        Ok(Response::new(pb::KvPutResponse { stored }))
    }

    async fn kv_get(
        &self,
        req: Request<pb::KvGetRequest>,
    ) -> std::result::Result<Response<pb::KvGetResponse>, Status> {
        let key = req.into_inner().key;
        let v = self.lock().kv.get(&key).cloned();
        Ok(Response::new(pb::KvGetResponse {
            found: v.is_some(),
            value: v.unwrap_or_default(),
        }))
    }

    async fn kv_wait(
        &self,
        req: Request<pb::KvWaitRequest>,
    ) -> std::result::Result<Response<pb::KvGetResponse>, Status> {
        let r = req.into_inner();
        let wait = validate::wait_ms(r.timeout_ms, "KvWaitRequest.timeout_ms", Duration::ZERO)?;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Register interest before checking, so a put between check and wait is not missed.
            let notified = self.0.kv_changed.notified();
            if let Some(v) = self.lock().kv.get(&r.key).cloned() {
                return Ok(Response::new(pb::KvGetResponse {
                    found: true,
                    value: v,
                }));
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(Error::new(
                    FailureKind::Timeout,
                    format!("key '{}' did not appear within {} ms", r.key, r.timeout_ms),
                )
                .into());
            }
        }
    }

    async fn kv_delete(
        &self,
        req: Request<pb::KvDeleteRequest>,
    ) -> std::result::Result<Response<pb::KvDeleteResponse>, Status> {
        let key = req.into_inner().key;
        let deleted = self.lock().kv_delete(&key)?;
        Ok(Response::new(pb::KvDeleteResponse { deleted }))
    }

    async fn shutdown(
        &self,
        req: Request<pb::ShutdownRequest>,
    ) -> std::result::Result<Response<pb::ShutdownResponse>, Status> {
        tracing::info!(peer = ?req.remote_addr(), "shutdown requested");
        if req.into_inner().stop_workers {
            self.stop_workers().await;
        }
        let token = self.0.shutdown.clone();
        tokio::spawn(async move {
            // Let the response reach the caller first.
            tokio::time::sleep(Duration::from_millis(100)).await;
            token.cancel();
        });
        Ok(Response::new(pb::ShutdownResponse {}))
    }

    async fn submit_job(
        &self,
        req: Request<pb::SubmitJobRequest>,
    ) -> std::result::Result<Response<pb::SubmitJobResponse>, Status> {
        let jobs = &self.0.jobs;
        let rec = jobs.submit(req.into_inner())?;
        Ok(Response::new(pb::SubmitJobResponse {
            job: Some(jobs.to_proto(&rec)),
        }))
    }

    async fn list_jobs(
        &self,
        _req: Request<pb::ListJobsRequest>,
    ) -> std::result::Result<Response<pb::ListJobsResponse>, Status> {
        let jobs = &self.0.jobs;
        Ok(Response::new(pb::ListJobsResponse {
            jobs: jobs.list().iter().map(|j| jobs.to_proto(j)).collect(),
        }))
    }

    async fn get_job(
        &self,
        req: Request<pb::GetJobRequest>,
    ) -> std::result::Result<Response<pb::GetJobResponse>, Status> {
        let job = self.0.jobs.info_with_metrics(&req.into_inner().job_id)?;
        Ok(Response::new(pb::GetJobResponse { job: Some(job) }))
    }

    async fn job_logs(
        &self,
        req: Request<pb::JobLogsRequest>,
    ) -> std::result::Result<Response<pb::JobLogsResponse>, Status> {
        let r = req.into_inner();
        Ok(Response::new(self.0.jobs.logs(
            &r.job_id,
            r.offset,
            r.max_bytes,
        )?))
    }

    async fn stop_job(
        &self,
        req: Request<pb::StopJobRequest>,
    ) -> std::result::Result<Response<pb::StopJobResponse>, Status> {
        let jobs = &self.0.jobs;
        let rec = jobs.stop(&req.into_inner().job_id, "stopped by `rlhf-head job stop`")?;
        Ok(Response::new(pb::StopJobResponse {
            job: Some(jobs.to_proto(&rec)),
        }))
    }
}
