//! Placing the role actors on the cluster and joining their communicators; diagnosing a dead
//! role and cleaning up are in `teardown`.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::future::try_join_all;
use rlhf_config::{PpoConfig, RoleSpec};
use rlhf_core::{
    BatchRoute, CommBackend, CommGroup, Error, FailureKind, Result, RoleKind, RolePart, RoleSlot,
};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::head_service_client::HeadServiceClient;
use rlhf_proto::v1::role_service_client::RoleServiceClient;
use rlhf_runtime::net::{self, AuthChannel, ClientOptions};

use crate::group::{BatchPath, CallError, GroupId, Member, WorkerGroup};

mod preflight;
mod teardown;
use preflight::preflight;
pub use teardown::{diagnose, release, shutdown, Launched};

pub type HeadClient = HeadServiceClient<AuthChannel>;

/// Every role part of a job.
#[derive(Clone, Debug)]
pub struct Roles {
    /// actor_rollout ranks that train the policy (and compute old log-probs).
    pub train: WorkerGroup,
    /// actor_rollout ranks that generate.
    pub infer: WorkerGroup,
    pub reference: WorkerGroup,
    pub critic: WorkerGroup,
    pub reward: WorkerGroup,
    pub placement_groups: Vec<String>,
    /// The hybrid engine (`resource_pool.colocate` with `actor_rollout.hybrid_engine`): the
    /// rollout ranks are the trainer processes (`infer` has
    /// the same members as `train`), and no weights travel between them.
    pub colocated: bool,
    /// The reference is a LoRA actor's base with the adapters off: its ranks are the
    /// trainer processes (`reference` has the same members as `train`).
    pub ref_in_trainer: bool,
    /// The alive nodes' workers at placement, for `checkpoint.memory_snapshot` (empty
    /// without it).
    pub peers: crate::snapshot::Peers,
}

impl Roles {
    pub fn groups(&self) -> [&WorkerGroup; 5] {
        [
            &self.train,
            &self.infer,
            &self.reference,
            &self.critic,
            &self.reward,
        ]
    }

    /// Whether `g`'s ranks live in other groups' processes: the colocated rollout ranks and
    /// a LoRA actor's reference, which are the trainers'.
    fn hosted_elsewhere(&self, g: &WorkerGroup) -> bool {
        (self.colocated && g.id == self.infer.id)
            || (self.ref_in_trainer && g.id == self.reference.id)
    }

    /// Every role process once, with the group it serves (a colocated rollout rank is its
    /// trainer's process and is not listed twice).
    pub fn all_members(&self) -> impl Iterator<Item = (&WorkerGroup, usize, &Member)> {
        self.groups()
            .into_iter()
            .filter(move |g| !self.hosted_elsewhere(g))
            .flat_map(|g| g.members.iter().enumerate().map(move |(i, m)| (g, i, m)))
    }

    /// The group that broadcasts weights: train rank 0 then the rollout ranks (nobody when
    /// colocated: the rollout generates with the trainer's own weights).
    pub fn weights_group(&self) -> WorkerGroup {
        let mut members = Vec::new();
        if !self.colocated {
            members.extend(self.train.members.first().cloned());
            members.extend(self.infer.members.iter().cloned());
        }
        WorkerGroup {
            id: GroupId::Comm(CommGroup::Weights),
            members,
        }
    }
}

/// What the driver needs to place a job.
pub struct LaunchOptions {
    pub job_id: String,
    pub client: ClientOptions,
    /// How long to wait for devices and for each actor to start.
    pub start_timeout: Duration,
    /// `--batch-path`: one path for every batch; `None` picks per role process.
    pub batch_path: Option<BatchRoute>,
}

struct PartSpec {
    role: RoleKind,
    part: RolePart,
    ranks: usize,
    /// Bundle offset in the role's placement group.
    offset: usize,
}

fn parts(cfg: &PpoConfig) -> Vec<PartSpec> {
    let mut v = Vec::new();
    let ar = &cfg.actor_rollout;
    if cfg.role_enabled(RoleKind::ActorRollout) {
        v.push(PartSpec {
            role: RoleKind::ActorRollout,
            part: RolePart::Train,
            ranks: ar.num_gpus_for_train.max(1) as usize,
            offset: 0,
        });
    }
    // Colocated rollout ranks live in the trainer processes: no processes of their own; the
    // other stages than PPO have none.
    if !cfg.hybrid_engine() && cfg.trainer == rlhf_config::TrainerKind::Ppo {
        v.push(PartSpec {
            role: RoleKind::ActorRollout,
            part: RolePart::Infer,
            ranks: ar.num_gpus_for_infer.max(1) as usize,
            offset: ar.num_gpus_for_train.max(1) as usize,
        });
    }
    for role in [RoleKind::Ref, RoleKind::Critic, RoleKind::Reward] {
        // A LoRA actor's reference lives in the trainer processes.
        if cfg.role_enabled(role) && !(role == RoleKind::Ref && cfg.ref_in_trainer()) {
            v.push(PartSpec {
                role,
                part: RolePart::Whole,
                ranks: (cfg.devices(role) as usize).max(1),
                offset: 0,
            });
        }
    }
    v
}

/// How much longer than the head's own wait the driver waits for its answer.
const HEAD_MARGIN: Duration = Duration::from_secs(30);

fn head_silent(call: &str, wait: Duration) -> Error {
    Error::new(
        FailureKind::Timeout,
        format!(
            "the head did not answer {call} within {} s (its own wait, {} s, plus {} s); is it overloaded or gone? `rlhf-head status` shows it",
            (wait + HEAD_MARGIN).as_secs(),
            wait.as_secs(),
            HEAD_MARGIN.as_secs()
        ),
    )
}

/// Creates the placement groups and actors and connects to them, recording in `made` what
/// it created; on an error the caller releases `made`.
pub async fn launch(
    head: &mut HeadClient,
    cfg: &PpoConfig,
    opts: &LaunchOptions,
    made: &mut Launched,
) -> Result<Roles> {
    let resource = cfg.resource_pool.device.resource().to_string();
    preflight(head, cfg, &resource, opts.start_timeout).await?;
    let mut pgs: BTreeMap<&'static str, String> = BTreeMap::new();
    for role in RoleKind::ALL {
        let (n, amount) = cfg.role_bundles(role);
        if n == 0 {
            continue;
        }
        let bundle = pb::Bundle {
            resources: Some(pb::Resources {
                amounts: [(resource.clone(), amount)].into_iter().collect(),
            }),
        };
        let mut placer = head.clone();
        let placing = tokio::time::timeout(
            opts.start_timeout + HEAD_MARGIN,
            placer.create_placement_group(pb::CreatePlacementGroupRequest {
                name: format!("{}-{}", opts.job_id, role.as_str()),
                strategy: pb::PlacementStrategy::Pack as i32,
                bundles: vec![bundle; n as usize],
                timeout_ms: opts.start_timeout.as_millis() as u64,
                cuda_roles: resource == "GPU",
                vllm_roles: role == RoleKind::ActorRollout
                    && cfg.actor_rollout.engine == rlhf_config::RolloutEngine::Vllm,
            }),
        );
        let r = preflight::report_while_placing(
            head.clone(),
            role,
            n,
            amount,
            &resource,
            &opts.job_id,
            placing,
        )
        .await
        .map_err(|_| head_silent("CreatePlacementGroup", opts.start_timeout))?
        .map_err(|s| {
            let e = Error::from(s);
            Error::new(
                e.kind(),
                format!(
                    "placing role {} ({n} x {amount} {resource}, resource_pool.{}): {e}",
                    role.as_str(),
                    role.as_str()
                ),
            )
        })?
        .into_inner();
        let pg = r.placement_group.unwrap_or_default().pg_id;
        made.placement_groups.push(pg.clone());
        pgs.insert(role.as_str(), pg);
    }

    let specs = parts(cfg);
    let mut creations = Vec::new();
    for p in &specs {
        for rank in 0..p.ranks {
            let (pg_id, bundle_index) = match pgs.get(p.role.as_str()) {
                Some(pg) => (pg.clone(), (p.offset + rank) as i32),
                None => (String::new(), 0),
            };
            let label = match p.part {
                RolePart::Whole => format!("{}{rank}", p.role),
                part => format!("{}-{part}{rank}", p.role),
            };
            let spec = pb::ActorSpec {
                name: format!("{}-{label}", opts.job_id),
                role: p.role.as_str().to_string(),
                kind: p.role.as_str().to_string(),
                args: vec![],
                env: crate::role_env::role_env(&opts.job_id, std::env::vars_os()),
                resources: None,
                pg_id,
                bundle_index,
            };
            let mut h = head.clone();
            let timeout = opts.start_timeout;
            creations.push(async move {
                tokio::time::timeout(
                    timeout + HEAD_MARGIN,
                    h.create_actor(pb::CreateActorRequest {
                        spec: Some(spec),
                        timeout_ms: timeout.as_millis() as u64,
                    }),
                )
                .await
                .map_err(|_| head_silent("CreateActor", timeout))?
                .map(|r| r.into_inner().actor.unwrap_or_default())
                .map_err(|s| {
                    let e = Error::from(s);
                    Error::new(e.kind(), format!("starting role actor {label}: {e}"))
                })
            });
        }
    }
    // Every creation runs to its end, so the actors that did start are known and released
    // when another one fails.
    let mut infos = Vec::new();
    let mut first_err = None;
    for r in futures::future::join_all(creations).await {
        match r {
            Ok(info) => {
                made.actors.push(info.actor_id.clone());
                infos.push(info);
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }

    let mut it = infos.into_iter();
    let mut groups: Vec<WorkerGroup> = Vec::new();
    for p in &specs {
        let mut members = Vec::new();
        for _ in 0..p.ranks {
            let info = it
                .next()
                .ok_or_else(|| Error::internal("fewer actors than ranks"))?;
            let (ch, framed) = net::connect_direct_framed(&info.address, &opts.client).await?;
            members.push(Member {
                actor_id: info.actor_id.clone(),
                node_id: info.node_id.clone(),
                address: info.address.clone(),
                pid: info.pid,
                log_file: info.log_file.clone(),
                client: RoleServiceClient::new(ch)
                    .max_decoding_message_size(rlhf_proto::MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(rlhf_proto::MAX_MESSAGE_BYTES),
                batches: match opts.batch_path {
                    Some(r) => BatchPath::forced(framed, r, &info.actor_id)?,
                    None => BatchPath::for_address(framed, &info.address),
                },
            });
        }
        groups.push(WorkerGroup {
            id: GroupId::Role(p.role, p.part),
            members,
        });
    }
    let mut take = |kind, part| {
        let id = GroupId::Role(kind, part);
        match groups.iter().position(|g| g.id == id) {
            Some(i) => groups.swap_remove(i),
            None => WorkerGroup {
                id,
                members: vec![],
            },
        }
    };
    let train = take(RoleKind::ActorRollout, RolePart::Train);
    let infer = if cfg.hybrid_engine() {
        WorkerGroup {
            id: GroupId::Role(RoleKind::ActorRollout, RolePart::Infer),
            members: train.members.clone(),
        }
    } else {
        take(RoleKind::ActorRollout, RolePart::Infer)
    };
    let reference = if cfg.ref_in_trainer() {
        WorkerGroup {
            id: GroupId::Role(RoleKind::Ref, RolePart::Whole),
            members: train.members.clone(),
        }
    } else {
        take(RoleKind::Ref, RolePart::Whole)
    };
    let roles = Roles {
        train,
        infer,
        reference,
        critic: take(RoleKind::Critic, RolePart::Whole),
        reward: take(RoleKind::Reward, RolePart::Whole),
        placement_groups: made.placement_groups.clone(),
        colocated: cfg.hybrid_engine(),
        ref_in_trainer: cfg.ref_in_trainer(),
        peers: Default::default(),
    };
    Ok(roles)
}

/// Loads every role's model (concurrently).
/// Resolves every rank's `RoleSpec` (the only place role settings are derived) and sends
/// it in InitRole, all ranks at once.
pub async fn init_roles(
    roles: &Roles,
    cfg: &PpoConfig,
    job_id: &str,
    timeout: Duration,
) -> std::result::Result<Vec<(String, pb::InitRoleResponse)>, CallError> {
    let mut out = Vec::new();
    // A colocated rollout rank joins the engine its trainer process built: the trainers
    // first, then the rollout ranks.
    let (first, then): (Vec<&WorkerGroup>, Vec<&WorkerGroup>) = roles
        .groups()
        .into_iter()
        .partition(|g| !roles.hosted_elsewhere(g));
    for phase in [first, then] {
        out.extend(init_groups(&phase, cfg, job_id, timeout).await?);
    }
    Ok(out)
}

async fn init_groups(
    groups: &[&WorkerGroup],
    cfg: &PpoConfig,
    job_id: &str,
    timeout: Duration,
) -> std::result::Result<Vec<(String, pb::InitRoleResponse)>, CallError> {
    let mut out = Vec::new();
    let futs = groups.iter().map(|g| async move {
        let GroupId::Role(role, part) = g.id else {
            return Err(g.err(
                0,
                Error::internal(format!("InitRole sent to communicator group {}", g.id)),
            ));
        };
        let world = g.len() as u32;
        let specs = (0..world)
            .map(|rank| {
                let slot = RoleSlot {
                    kind: role,
                    part,
                    rank,
                    world_size: world,
                };
                RoleSpec::resolve(cfg, slot)
                    .map(|s| s.to_json())
                    .map_err(|e| g.err(rank as usize, Error::invalid(e.to_string())))
            })
            .collect::<std::result::Result<Vec<String>, CallError>>()?;
        let answers = g
            .unary(timeout, "InitRole", |rank, mut c| {
                let req = pb::InitRoleRequest {
                    role: pb::RoleKind::from(role) as i32,
                    spec: specs[rank].clone(),
                    job_id: job_id.to_string(),
                };
                async move { c.init_role(req).await }
            })
            .await?;
        Ok::<_, CallError>(
            answers
                .into_iter()
                .enumerate()
                .map(|(r, a)| (format!("{} rank {r}", g.id), a))
                .collect::<Vec<_>>(),
        )
    });
    for v in try_join_all(futs).await? {
        out.extend(v);
    }
    Ok(out)
}

/// How much longer than the ranks' own join deadline the driver waits for their answers.
const JOIN_SLACK: Duration = Duration::from_secs(5);

/// Forms a communicator group over `group`'s members (rank = position).
///
/// Rank 0 prepares the group and publishes its rendezvous (address or NCCL unique id) in
/// the head's KV store under a fresh key; the other ranks read it from there while they
/// join. A rank 0 served without a head answers the rendezvous instead, and the driver
/// hands it on. Either way the driver makes the group's secret and gives it to each rank
/// in its JoinComm (it never goes to the store).
pub async fn join_comm(
    group: &WorkerGroup,
    name: CommGroup,
    backend: CommBackend,
    timeout: Duration,
) -> std::result::Result<(), CallError> {
    let Some(first) = group.members.first() else {
        return Ok(());
    };
    let mut c = first.client.clone();
    // Fresh per forming: a key is published once, and rank 0 deletes it after its join.
    let kv_key = format!("comm/{name}/{:016x}", rand::random::<u64>());
    let prep = tokio::time::timeout(
        timeout,
        c.prepare_comm(pb::PrepareCommRequest {
            group: pb::CommGroup::from(name) as i32,
            backend: pb::CommBackend::from(backend) as i32,
            kv_key: kv_key.clone(),
        }),
    )
    .await
    .map_err(|_| {
        group.err(
            0,
            Error::new(
                FailureKind::Timeout,
                format!("PrepareComm({name}) timed out"),
            ),
        )
    })?
    .map_err(|s| group.err(0, Error::from(s)))?
    .into_inner();
    let kv_key = if prep.published {
        kv_key
    } else {
        String::new()
    };
    let world = group.len() as u32;
    // A fresh secret per communicator: only the ranks this call reaches can join it.
    let secret: [u8; 32] = rand::random();
    // Each rank's own deadline is `timeout`; the driver waits a little longer, so a rank's
    // precise error (which rank, which wait) reaches the user instead of a bare timeout.
    group
        .unary(timeout + JOIN_SLACK, "JoinComm", |rank, mut c| {
            let req = pb::JoinCommRequest {
                group: pb::CommGroup::from(name) as i32,
                backend: pb::CommBackend::from(backend) as i32,
                rank: rank as u32,
                world_size: world,
                address: prep.address.clone(),
                unique_id: prep.unique_id.clone(),
                timeout_ms: timeout.as_millis() as u64,
                secret: secret.to_vec(),
                kv_key: kv_key.clone(),
            };
            async move { c.join_comm(req).await }
        })
        .await?;
    Ok(())
}
