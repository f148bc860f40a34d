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

mod teardown;
pub use teardown::{diagnose, release, shutdown, Launched};

pub type HeadClient = HeadServiceClient<AuthChannel>;

/// What one node can ever give a job: its total of the pool's resource (free or not), and
/// whether it may host the job's bundles at all.
#[derive(Debug, Clone)]
pub(crate) struct NodeCapacity {
    pub host: String,
    pub total: f64,
    /// ALIVE, or REJOINING after a head restart (it may come back).
    pub usable: bool,
    /// Its worker can run CUDA roles (only asked of GPU bundles).
    pub cuda_roles: bool,
}

/// Why the cluster can never hold the job, whatever is freed: more of `resource` than all the
/// usable nodes have together, or a bundle larger than any one node. `None` when it can
/// (then placement waits for free resources, as before). `needs`: (role, bundles, amount).
pub(crate) fn never_fits(
    needs: &[(RoleKind, u32, f64)],
    nodes: &[NodeCapacity],
    resource: &str,
) -> Option<String> {
    let gpu = resource == "GPU";
    let counted: Vec<&NodeCapacity> = nodes
        .iter()
        .filter(|n| n.usable && (!gpu || n.cuda_roles))
        .collect();
    // (Folds from +0: an empty f64 sum is -0, which would print as "-0".)
    let need = needs
        .iter()
        .map(|(_, n, a)| f64::from(*n) * a)
        .fold(0.0, |x, y| x + y);
    let have = counted.iter().map(|n| n.total).fold(0.0, |x, y| x + y);
    let largest = counted.iter().map(|n| n.total).fold(0.0, f64::max);
    let bundle = needs.iter().map(|(_, _, a)| *a).fold(0.0, f64::max);
    let fmt = |x: f64| {
        if x.fract() == 0.0 {
            format!("{x:.0}")
        } else {
            format!("{x:.3}")
        }
    };
    if need <= have + 1e-9 && bundle <= largest + 1e-9 {
        return None;
    }
    let per_role: Vec<String> = needs
        .iter()
        .map(|(r, n, a)| format!("{} {}", r.as_str(), fmt(f64::from(*n) * a)))
        .collect();
    let unit = if gpu { "GPUs" } else { "CPU slots" };
    let nodes_said = match counted.len() {
        0 if gpu => "no live node whose worker runs CUDA roles".to_string(),
        0 => "no live node".to_string(),
        1 => format!("1 node ({} {})", counted[0].host, fmt(counted[0].total)),
        k => format!("{k} nodes"),
    };
    let mut msg = if need > have + 1e-9 {
        format!(
            "the job needs {} {unit} ({}); the cluster has {} in total ({nodes_said}), so it \
             can never be placed",
            fmt(need),
            per_role.join(", "),
            fmt(have)
        )
    } else {
        format!(
            "a bundle of the job needs {} {resource} on one node, and the largest node has {} \
             ({nodes_said}), so it can never be placed",
            fmt(bundle),
            fmt(largest)
        )
    };
    if gpu {
        let without: Vec<&str> = nodes
            .iter()
            .filter(|n| n.usable && !n.cuda_roles && n.total > 0.0)
            .map(|n| n.host.as_str())
            .collect();
        if !without.is_empty() {
            msg.push_str(&format!(
                "; the GPUs of {} do not count: their worker cannot run CUDA roles (built \
                 without CUDA; rebuild it with `cargo build --release -p rlhf-worker \
                 --features cuda`)",
                without.join(", ")
            ));
        }
        msg.push_str(": add GPU nodes, or lower the roles' device counts (resource_pool.*)");
    } else {
        msg.push_str(&format!(
            ": start the worker with more slots, e.g. --resources '{{\"CPU\": {}}}' (a CPU \
             slot is a share of a node for one role process, not a core, so a node may offer \
             more slots than it has cores), or set resource_pool.colocate=true",
            fmt(need.ceil())
        ));
    }
    Some(msg)
}

/// How long a job the cluster cannot hold waits for more nodes to register (workers that
/// were started with the head may still be joining) before it fails.
const PREFLIGHT_GRACE: Duration = Duration::from_secs(10);

/// Fails within [`PREFLIGHT_GRACE`] when the cluster can never hold the job
/// ([`never_fits`]), instead of letting the placement wait out the start timeout in
/// silence; nodes that register meanwhile count.
async fn preflight(
    head: &mut HeadClient,
    cfg: &PpoConfig,
    resource: &str,
    timeout: Duration,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout.min(PREFLIGHT_GRACE);
    let mut said = false;
    loop {
        let (usable, why) = never_fits_now(head, cfg, resource, timeout).await?;
        if usable == 0 {
            // A cluster with no node yet (a head just started, its workers on their way):
            // the placement waits for them, as long as the start timeout allows.
            tracing::warn!(
                "no live node in the cluster yet: the job waits up to --start-timeout ({timeout:?}) for workers to join"
            );
            return Ok(());
        }
        match why {
            None => return Ok(()),
            Some(why) if tokio::time::Instant::now() >= deadline => {
                return Err(Error::new(FailureKind::InvalidArgument, why))
            }
            Some(why) => {
                if !said {
                    tracing::warn!("waiting up to {PREFLIGHT_GRACE:?} for more nodes: {why}");
                    said = true;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// The usable nodes (alive or rejoining) and [`never_fits`] on the cluster as the head
/// reports it now.
async fn never_fits_now(
    head: &mut HeadClient,
    cfg: &PpoConfig,
    resource: &str,
    timeout: Duration,
) -> Result<(usize, Option<String>)> {
    let status = tokio::time::timeout(
        timeout.min(Duration::from_secs(30)),
        head.cluster_status(pb::ClusterStatusRequest {}),
    )
    .await
    .map_err(|_| head_silent("ClusterStatus", timeout))?
    .map_err(Error::from)?
    .into_inner();
    let nodes: Vec<NodeCapacity> = status
        .nodes
        .iter()
        .map(|n| NodeCapacity {
            host: if n.hostname.is_empty() {
                n.address.clone()
            } else {
                n.hostname.clone()
            },
            total: n
                .total
                .as_ref()
                .and_then(|t| t.amounts.get(resource).copied())
                .unwrap_or(0.0),
            usable: n.state == pb::NodeState::Alive as i32
                || n.state == pb::NodeState::Rejoining as i32,
            cuda_roles: n.cuda_roles,
        })
        .collect();
    let needs: Vec<(RoleKind, u32, f64)> = RoleKind::ALL
        .iter()
        .map(|&r| {
            let (n, a) = cfg.role_bundles(r);
            (r, n, a)
        })
        .filter(|(_, n, _)| *n > 0)
        .collect();
    let usable = nodes.iter().filter(|n| n.usable).count();
    Ok((usable, never_fits(&needs, &nodes, resource)))
}

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
        let r = tokio::time::timeout(
            opts.start_timeout + HEAD_MARGIN,
            head.create_placement_group(pb::CreatePlacementGroupRequest {
                name: format!("{}-{}", opts.job_id, role.as_str()),
                strategy: pb::PlacementStrategy::Pack as i32,
                bundles: vec![bundle; n as usize],
                timeout_ms: opts.start_timeout.as_millis() as u64,
                cuda_roles: resource == "GPU",
            }),
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
                env: [("RLHF_JOB_ID".to_string(), opts.job_id.clone())]
                    .into_iter()
                    .collect(),
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

#[cfg(test)]
mod preflight_tests {
    use super::*;

    fn node(host: &str, total: f64, cuda: bool) -> NodeCapacity {
        NodeCapacity {
            host: host.into(),
            total,
            usable: true,
            cuda_roles: cuda,
        }
    }

    #[test]
    fn a_cluster_too_small_in_total_is_named_with_the_numbers() {
        let needs = [
            (RoleKind::ActorRollout, 2, 1.0),
            (RoleKind::Ref, 1, 1.0),
            (RoleKind::Critic, 1, 1.0),
            (RoleKind::Reward, 1, 1.0),
        ];
        let e = never_fits(&needs, &[node("laptop", 2.0, false)], "CPU").unwrap();
        assert!(
            e.contains("needs 5 CPU slots (actor_rollout 2, ref 1, critic 1, reward 1)")
                && e.contains("has 2 in total (1 node (laptop 2))")
                && e.contains(r#"--resources '{"CPU": 5}'"#)
                && e.contains("resource_pool.colocate=true"),
            "{e}"
        );
        // Enough in total, even if busy now: placement waits as before.
        assert!(never_fits(
            &needs,
            &[node("a", 3.0, false), node("b", 2.0, false)],
            "CPU"
        )
        .is_none());
        // A dead node gives nothing; a rejoining one may come back.
        let mut gone = node("b", 8.0, false);
        gone.usable = false;
        assert!(never_fits(&needs, &[node("a", 2.0, false), gone.clone()], "CPU").is_some());
        // Colocated fractional bundles add up to what they are.
        let shared = [(RoleKind::ActorRollout, 2, 0.4), (RoleKind::Ref, 2, 0.4)];
        assert!(never_fits(&shared, &[node("a", 2.0, false)], "CPU").is_none());
    }

    #[test]
    fn gpus_of_a_worker_without_cuda_do_not_count() {
        let needs = [(RoleKind::ActorRollout, 2, 1.0)];
        let e = never_fits(&needs, &[node("gpu-box", 4.0, false)], "GPU").unwrap();
        assert!(
            e.contains("the cluster has 0 in total (no live node whose worker runs CUDA roles)")
                && e.contains("gpu-box do not count")
                && e.contains("--features cuda"),
            "{e}"
        );
        assert!(never_fits(&needs, &[node("gpu-box", 4.0, true)], "GPU").is_none());
        // A bundle larger than any one node.
        let big = [(RoleKind::ActorRollout, 1, 3.0)];
        let e = never_fits(&big, &[node("a", 2.0, true), node("b", 2.0, true)], "GPU").unwrap();
        assert!(
            e.contains("needs 3 GPU on one node") && e.contains("largest node has 2"),
            "{e}"
        );
    }
}
