//! Before placing anything: whether the cluster can ever hold the job. A job whose bundles
//! exceed what every live node has in total would otherwise wait out its start timeout in
//! silence; this says so within seconds, with the numbers and the fix. While a placement that
//! can fit waits (resources held by other jobs, nodes rejoining), [`report_while_placing`]
//! says every few seconds what is missing and where.

use std::future::Future;
use std::time::Duration;

use rlhf_config::PpoConfig;
use rlhf_core::{Error, FailureKind, Result, RoleKind};
use rlhf_proto::v1 as pb;

use super::{head_silent, HeadClient};

/// What one node can ever give a job: its total of the pool's resource (free or not), and
/// whether it may host the job's bundles at all.
#[derive(Debug, Clone)]
struct NodeCapacity {
    pub host: String,
    pub total: f64,
    /// ALIVE, or REJOINING after a head restart (it may come back).
    pub usable: bool,
    /// Its worker can run CUDA roles (only asked of GPU bundles).
    pub cuda_roles: bool,
    /// Its worker has a vLLM Python (only asked of `actor_rollout.engine: vllm`).
    pub vllm_roles: bool,
}

/// Why a job that generates with vLLM can never be placed: no usable node's worker has a
/// vLLM Python. `None` for other jobs, or when one does.
fn no_vllm_node(cfg: &PpoConfig, nodes: &[NodeCapacity]) -> Option<String> {
    if cfg.actor_rollout.engine != rlhf_config::RolloutEngine::Vllm
        || nodes.iter().any(|n| n.usable && n.vllm_roles)
    {
        return None;
    }
    Some(
        "actor_rollout.engine=vllm, but no live node's worker has a vLLM Python, so the actor can never be placed: start a worker with `rlhf-worker join --vllm-python PATH` (or RLHF_VLLM_PYTHON=PATH), PATH an interpreter with vLLM installed, or run with actor_rollout.engine=candle"
            .to_string(),
    )
}

/// An amount for a message: whole numbers without decimals, others with three.
fn fmt(x: f64) -> String {
    if x.fract() == 0.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.3}")
    }
}

/// How many of `resource` a node's resource map holds (0 when it has none).
fn amount_in(r: &Option<pb::Resources>, resource: &str) -> f64 {
    r.as_ref()
        .and_then(|r| r.amounts.get(resource).copied())
        .unwrap_or(0.0)
}

/// A node as a message names it: its host name, else its address.
fn host(n: &pb::NodeInfo) -> &str {
    if n.hostname.is_empty() {
        &n.address
    } else {
        &n.hostname
    }
}

/// Why the cluster can never hold the job, whatever is freed: more of `resource` than all the
/// usable nodes have together, or a bundle larger than any one node. `None` when it can
/// (then placement waits for free resources, as before). `needs`: (role, bundles, amount).
fn never_fits(
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
pub(super) async fn preflight(
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
            host: host(n).to_string(),
            total: amount_in(&n.total, resource),
            usable: n.state == pb::NodeState::Alive as i32
                || n.state == pb::NodeState::Rejoining as i32,
            cuda_roles: n.cuda_roles,
            vllm_roles: n.vllm_roles,
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
    let why = never_fits(&needs, &nodes, resource).or_else(|| no_vllm_node(cfg, &nodes));
    Ok((usable, why))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(host: &str, total: f64, cuda: bool) -> NodeCapacity {
        NodeCapacity {
            host: host.into(),
            total,
            usable: true,
            cuda_roles: cuda,
            vllm_roles: false,
        }
    }

    #[test]
    fn a_vllm_job_needs_a_node_with_a_vllm_python() {
        let mut cfg = PpoConfig::default();
        let plain = [node("a", 4.0, false)];
        assert!(no_vllm_node(&cfg, &plain).is_none());
        cfg.actor_rollout.engine = rlhf_config::RolloutEngine::Vllm;
        let e = no_vllm_node(&cfg, &plain).unwrap();
        assert!(
            e.contains("--vllm-python PATH") && e.contains("engine=candle"),
            "{e}"
        );
        let mut with = node("b", 4.0, false);
        with.vllm_roles = true;
        assert!(no_vllm_node(&cfg, &[node("a", 4.0, false), with.clone()]).is_none());
        with.usable = false;
        assert!(no_vllm_node(&cfg, &[with]).is_some());
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

/// How often a waiting placement says what it waits for.
pub(super) const WAIT_REPORT_EVERY: Duration = Duration::from_secs(10);

/// Runs `placing` (the head's CreatePlacementGroup for one role) and, every
/// [`WAIT_REPORT_EVERY`] it is still waiting, logs what the cluster lacks for it
/// ([`waiting_line`]).
pub(super) async fn report_while_placing<F: Future>(
    mut head: HeadClient,
    role: RoleKind,
    bundles: u32,
    amount: f64,
    resource: &str,
    job_id: &str,
    placing: F,
) -> F::Output {
    let started = tokio::time::Instant::now();
    let mut tick = tokio::time::interval_at(started + WAIT_REPORT_EVERY, WAIT_REPORT_EVERY);
    tokio::pin!(placing);
    loop {
        tokio::select! {
            out = &mut placing => return out,
            _ = tick.tick() => {
                let status = tokio::time::timeout(
                    Duration::from_secs(5),
                    head.cluster_status(pb::ClusterStatusRequest {}),
                )
                .await;
                let waited = started.elapsed().as_secs();
                match status {
                    Ok(Ok(s)) => tracing::warn!(
                        "{}",
                        waiting_line(&s.into_inner(), role, bundles, amount, resource, job_id, waited)
                    ),
                    _ => tracing::warn!(
                        "still placing {} after {waited} s; the head does not answer ClusterStatus",
                        role.as_str()
                    ),
                }
            }
        }
    }
}

/// What a placement of `bundles` x `amount` `resource` for `role` waits for, on the cluster
/// `s`: each node's free and total amount (dead ones left out, rejoining and non-CUDA ones
/// marked), and the other jobs' placement groups holding the rest.
pub(super) fn waiting_line(
    s: &pb::ClusterStatusResponse,
    role: RoleKind,
    bundles: u32,
    amount: f64,
    resource: &str,
    job_id: &str,
    waited_s: u64,
) -> String {
    let amount_of = |r: &Option<pb::Resources>| amount_in(r, resource);
    let mut line = format!(
        "still placing {} ({bundles} x {} {resource}) after {waited_s} s: ",
        role.as_str(),
        fmt(amount)
    );
    let nodes: Vec<String> = s
        .nodes
        .iter()
        .filter(|n| n.state != pb::NodeState::Dead as i32)
        .map(|n| {
            let mut d = format!(
                "{} {} of {} free",
                host(n),
                fmt(amount_of(&n.available)),
                fmt(amount_of(&n.total))
            );
            if n.state == pb::NodeState::Rejoining as i32 {
                d.push_str(" (rejoining after a head restart)");
            }
            if resource == "GPU" && !n.cuda_roles {
                d.push_str(" (its worker cannot run CUDA roles)");
            }
            d
        })
        .collect();
    if nodes.is_empty() {
        line.push_str(
            "no live node; start a worker: rlhf-worker join --address HEAD:PORT --token-file FILE",
        );
        return line;
    }
    line.push_str(&format!("{resource} per node: {}", nodes.join(", ")));
    let own = format!("{job_id}-");
    let mut others: Vec<String> = s
        .placement_groups
        .iter()
        .filter(|g| g.state == pb::PlacementGroupState::Created as i32 && !g.name.starts_with(&own))
        .filter_map(|g| {
            let held: f64 = g.bundles.iter().map(|b| amount_of(&b.resources)).sum();
            (held > 0.0).then(|| format!("{} {}", g.name, fmt(held)))
        })
        .collect();
    others.sort();
    if !others.is_empty() {
        line.push_str(&format!(
            "; held by other placement groups: {}",
            others.join(", ")
        ));
    }
    line
}

#[cfg(test)]
mod waiting_tests {
    use super::*;

    fn node(host: &str, total: f64, free: f64, state: pb::NodeState, cuda: bool) -> pb::NodeInfo {
        let res = |x: f64| {
            Some(pb::Resources {
                amounts: [("GPU".to_string(), x)].into_iter().collect(),
            })
        };
        pb::NodeInfo {
            hostname: host.into(),
            total: res(total),
            available: res(free),
            state: state as i32,
            cuda_roles: cuda,
            ..Default::default()
        }
    }

    #[test]
    fn a_waiting_placement_says_what_is_free_where_and_who_holds_the_rest() {
        let held = pb::PlacementGroupInfo {
            name: "job-7-actor_rollout".into(),
            bundles: vec![
                pb::Bundle {
                    resources: Some(pb::Resources {
                        amounts: [("GPU".to_string(), 1.0)].into_iter().collect(),
                    }),
                };
                3
            ],
            state: pb::PlacementGroupState::Created as i32,
            ..Default::default()
        };
        let mut mine = held.clone();
        mine.name = "job-9-ref".into();
        let s = pb::ClusterStatusResponse {
            nodes: vec![
                node("a", 4.0, 1.0, pb::NodeState::Alive, true),
                node("b", 4.0, 4.0, pb::NodeState::Rejoining, true),
                node("c", 2.0, 2.0, pb::NodeState::Alive, false),
                node("d", 8.0, 8.0, pb::NodeState::Dead, true),
            ],
            placement_groups: vec![held, mine],
            ..Default::default()
        };
        let line = waiting_line(&s, RoleKind::Critic, 2, 1.0, "GPU", "job-9", 20);
        assert_eq!(
            line,
            "still placing critic (2 x 1 GPU) after 20 s: GPU per node: a 1 of 4 free, \
             b 4 of 4 free (rejoining after a head restart), c 2 of 2 free (its worker cannot \
             run CUDA roles); held by other placement groups: job-7-actor_rollout 3"
        );
        let empty = pb::ClusterStatusResponse::default();
        let line = waiting_line(&empty, RoleKind::Critic, 2, 1.0, "GPU", "job-9", 10);
        assert!(line.ends_with("no live node; start a worker: rlhf-worker join --address HEAD:PORT --token-file FILE"), "{line}");
    }
}
