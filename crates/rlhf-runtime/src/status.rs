//! `rlhf-head status` rendering, in the shape of `ray status`, and its JSON form (also
//! served by the dashboard).

use rlhf_core::resources::fmt_amount;
use rlhf_core::Resources;
use rlhf_proto::v1 as pb;
use serde_json::json;

fn res(r: &Option<pb::Resources>) -> Resources {
    Resources::from(r.as_ref())
}

/// Resource amounts by name, as JSON.
pub(crate) fn resources_json(r: Option<&pb::Resources>) -> serde_json::Value {
    json!(Resources::from(r).0)
}

pub(crate) fn node_state(v: i32) -> &'static str {
    match pb::NodeState::try_from(v) {
        Ok(pb::NodeState::Alive) => "ALIVE",
        Ok(pb::NodeState::Dead) => "DEAD",
        Ok(pb::NodeState::Rejoining) => "REJOINING",
        _ => "UNKNOWN",
    }
}

pub(crate) fn actor_state(v: i32) -> &'static str {
    match pb::ActorState::try_from(v) {
        Ok(pb::ActorState::Pending) => "PENDING",
        Ok(pb::ActorState::Alive) => "ALIVE",
        Ok(pb::ActorState::Dead) => "DEAD",
        _ => "UNKNOWN",
    }
}

fn pg_state(v: i32) -> &'static str {
    match pb::PlacementGroupState::try_from(v) {
        Ok(pb::PlacementGroupState::Pending) => "PENDING",
        Ok(pb::PlacementGroupState::Created) => "CREATED",
        Ok(pb::PlacementGroupState::Removed) => "REMOVED",
        _ => "UNKNOWN",
    }
}

fn strategy(v: i32) -> &'static str {
    crate::convert::strategy_from_proto(v).as_str()
}

/// A node's resources for people, one entry per resource: `used/total` (memory in GiB), and
/// for GPUs the indices its running actors hold.
pub(crate) fn node_usage(n: &pb::NodeInfo, actors: &[pb::ActorInfo]) -> Vec<String> {
    let total = res(&n.total);
    let avail = res(&n.available);
    total
        .0
        .iter()
        .map(|(k, t)| {
            let used = (t - avail.get(k)).max(0.0);
            let mut line = if rlhf_core::resources::is_memory(k) {
                format!(
                    "{k} {:.1}/{:.1} GiB",
                    used / (1u64 << 30) as f64,
                    t / (1u64 << 30) as f64
                )
            } else {
                format!("{k} {}/{}", fmt_amount(k, used), fmt_amount(k, *t))
            };
            if k == "GPU" {
                let mut held: Vec<u32> = actors
                    .iter()
                    .filter(|a| a.node_id == n.node_id && a.state == pb::ActorState::Alive as i32)
                    .flat_map(|a| a.devices.iter().copied())
                    .collect();
                held.sort_unstable();
                held.dedup();
                if !held.is_empty() {
                    let ids: Vec<String> = held.iter().map(u32::to_string).collect();
                    line.push_str(&format!(" (in use: {})", ids.join(",")));
                }
            }
            line
        })
        .collect()
}

pub fn to_json(s: &pb::ClusterStatusResponse) -> serde_json::Value {
    let nodes: Vec<_> = s
        .nodes
        .iter()
        .map(|n| {
            json!({
                "node_id": n.node_id, "hostname": n.hostname, "address": n.address,
                "state": node_state(n.state), "total": res(&n.total).0, "available": res(&n.available).0,
                "usage": node_usage(n, &s.actors),
                "last_heartbeat_ms": n.last_heartbeat_ms, "death_reason": n.death_reason, "death_ms": n.death_ms,
            })
        })
        .collect();
    let pgs: Vec<_> = s
        .placement_groups
        .iter()
        .map(|p| {
            json!({
                "pg_id": p.pg_id, "name": p.name, "strategy": strategy(p.strategy), "state": pg_state(p.state),
                "bundles": p.bundles.iter().map(|b| res(&b.resources).0).collect::<Vec<_>>(),
                "bundle_nodes": p.bundle_nodes,
            })
        })
        .collect();
    let actors: Vec<_> = s
        .actors
        .iter()
        .map(|a| {
            let spec = a.spec.clone().unwrap_or_default();
            json!({
                "actor_id": a.actor_id, "name": spec.name, "role": spec.role, "node_id": a.node_id,
                "address": a.address, "state": actor_state(a.state), "pid": a.pid, "reason": a.reason,
                "devices": a.devices, "log_file": a.log_file, "rss_bytes": a.rss_bytes,
                "exit": a.exit.as_ref().map(|e| json!({"exit_code": e.exit_code, "signal": e.signal, "log_tail": e.log_tail})),
            })
        })
        .collect();
    let jobs: Vec<_> = s.jobs.iter().map(job_json).collect();
    let (used, total) = usage(s);
    json!({
        "protocol_version": s.protocol_version,
        "now_ms": s.now_ms,
        "nodes": nodes,
        "resources": {"used": used.0, "total": total.0},
        "placement_groups": pgs,
        "actors": actors,
        "jobs": jobs,
    })
}

/// One job as JSON (`status --format json`, `job ... --format json`, the dashboard).
pub fn job_json(j: &pb::JobInfo) -> serde_json::Value {
    json!({
        "job_id": j.job_id, "state": job_state(j.state), "config_name": j.config_name,
        "overrides": j.overrides, "submit_ms": j.submit_ms, "start_ms": j.start_ms,
        "end_ms": j.end_ms, "exit_code": j.has_exit_code.then_some(j.exit_code),
        "signal": j.signal, "error": j.error, "pid": j.pid, "job_dir": j.job_dir,
        "log_file": j.log_file, "last_metrics": j.last_metrics,
        "queue_position": (j.queue_position > 0).then_some(j.queue_position),
        "failure": (!j.failure_kind.is_empty()).then(|| json!({
            "kind": j.failure_kind,
            "role": (!j.failure_role.is_empty()).then_some(&j.failure_role),
            "rank": (j.failure_rank >= 0).then_some(j.failure_rank),
            "retryable": j.retryable,
        })),
    })
}

/// Jobs shown by the text status (the newest).
const STATUS_JOBS: usize = 10;

pub(crate) fn job_state(v: i32) -> &'static str {
    crate::head::jobs::state_name(v)
}

/// `YYYY-MM-DD HH:MM:SS` UTC, or `-` for a time not reached yet.
pub fn job_time(ms: i64) -> String {
    if ms <= 0 {
        "-".into()
    } else {
        crate::head::jobs::fmt_utc_ms(ms)
    }
}

/// Used and total resources over alive nodes.
pub(crate) fn usage(s: &pb::ClusterStatusResponse) -> (Resources, Resources) {
    let mut total = Resources::new();
    let mut used = Resources::new();
    for n in s
        .nodes
        .iter()
        .filter(|n| n.state == pb::NodeState::Alive as i32)
    {
        let t = res(&n.total);
        let mut u = t.clone();
        u.sub(&res(&n.available));
        total.add(&t);
        used.add(&u);
    }
    (used, total)
}

pub fn to_text(s: &pb::ClusterStatusResponse) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let rule = "-".repeat(64);
    let _ = writeln!(
        o,
        "======== Cluster status (protocol v{}) ========",
        s.protocol_version
    );
    let _ = writeln!(o, "Node status\n{rule}");
    let alive: Vec<_> = s
        .nodes
        .iter()
        .filter(|n| n.state == pb::NodeState::Alive as i32)
        .collect();
    let rejoining: Vec<_> = s
        .nodes
        .iter()
        .filter(|n| n.state == pb::NodeState::Rejoining as i32)
        .collect();
    let dead: Vec<_> = s
        .nodes
        .iter()
        .filter(|n| {
            n.state != pb::NodeState::Alive as i32 && n.state != pb::NodeState::Rejoining as i32
        })
        .collect();
    let _ = writeln!(o, "Active:");
    if alive.is_empty() {
        let _ = writeln!(o, " (no active nodes)");
    }
    let up_line = |o: &mut String, n: &pb::NodeInfo| {
        let _ = writeln!(
            o,
            " 1 {} {} ({}) [{}]",
            n.node_id,
            n.hostname,
            n.address,
            res(&n.total).display()
        );
    };
    for n in &alive {
        up_line(&mut o, n);
    }
    if !rejoining.is_empty() {
        let _ = writeln!(
            o,
            "Rejoining (the head restarted; nothing is placed on these until their workers register again):"
        );
    }
    for n in &rejoining {
        up_line(&mut o, n);
    }
    let _ = writeln!(o, "Dead:");
    if dead.is_empty() {
        let _ = writeln!(o, " (no dead nodes)");
    }
    for n in &dead {
        let _ = writeln!(
            o,
            " 1 {} {} ({}): {}",
            n.node_id, n.hostname, n.address, n.death_reason
        );
    }
    let (used, total) = usage(s);
    let _ = writeln!(o, "\nResources\n{rule}\nUsage:");
    for (k, t) in &total.0 {
        let _ = writeln!(
            o,
            " {}/{} {k}",
            fmt_amount(k, used.get(k)),
            fmt_amount(k, *t)
        );
    }
    let live_pgs: Vec<_> = s
        .placement_groups
        .iter()
        .filter(|p| p.state != pb::PlacementGroupState::Removed as i32)
        .collect();
    let _ = writeln!(o, "\nPlacement groups\n{rule}");
    if live_pgs.is_empty() {
        let _ = writeln!(o, " (none)");
    }
    for p in live_pgs {
        let b: Vec<String> = p
            .bundles
            .iter()
            .zip(
                p.bundle_nodes
                    .iter()
                    .chain(std::iter::repeat(&String::new())),
            )
            .map(|(b, n)| format!("{{{}}}@{}", res(&b.resources).display(), n))
            .collect();
        let _ = writeln!(
            o,
            " {} {:?} {} {} [{}]",
            p.pg_id,
            p.name,
            strategy(p.strategy),
            pg_state(p.state),
            b.join(", ")
        );
    }
    let _ = writeln!(o, "\nActors\n{rule}");
    if s.actors.is_empty() {
        let _ = writeln!(o, " (none)");
    }
    for a in &s.actors {
        let spec = a.spec.clone().unwrap_or_default();
        let _ = write!(
            o,
            " {} {} role={} node={} {} pid={}",
            a.actor_id,
            actor_state(a.state),
            spec.role,
            a.node_id,
            a.address,
            a.pid
        );
        if !a.devices.is_empty() {
            let d: Vec<String> = a.devices.iter().map(u32::to_string).collect();
            let _ = write!(o, " devices={}", d.join(","));
        }
        // A fractional bundle: the actor shares its device(s) with the job's other roles.
        let bundle = s
            .placement_groups
            .iter()
            .find(|p| p.pg_id == spec.pg_id)
            .and_then(|p| p.bundles.get(usize::try_from(spec.bundle_index).ok()?));
        if let Some(b) = bundle {
            let r = res(&b.resources);
            if r.0.values().any(|v| *v > 0.0 && *v < 1.0) {
                let _ = write!(o, " shares {{{}}}", r.display());
            }
        }
        if !a.reason.is_empty() {
            let _ = write!(o, " reason: {}", a.reason);
        }
        let _ = writeln!(o);
    }
    let _ = writeln!(o, "\nJobs\n{rule}");
    if s.jobs.is_empty() {
        let _ = writeln!(o, " (none)");
    }
    // Jobs accumulate over the head's life; the newest few are what status is for.
    let older = s.jobs.len().saturating_sub(STATUS_JOBS);
    if older > 0 {
        let _ = writeln!(o, " ... {older} older (rlhf-head job list)");
    }
    for j in &s.jobs[older..] {
        let _ = write!(
            o,
            " {} {} {} submitted {} UTC",
            j.job_id,
            job_state(j.state),
            j.config_name,
            job_time(j.submit_ms)
        );
        if !j.error.is_empty() {
            let _ = write!(o, ": {}", j.error);
        }
        let _ = writeln!(o);
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_jobs_with_state_time_and_error() {
        let s = pb::ClusterStatusResponse {
            jobs: vec![pb::JobInfo {
                job_id: "job-20231114-221320-ab12".into(),
                state: pb::JobState::Failed as i32,
                config_name: "ppo_tiny".into(),
                submit_ms: 1_700_000_000_000,
                has_exit_code: true,
                exit_code: 3,
                error: "no worker has 2 CPU free".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let t = to_text(&s);
        assert!(
            t.contains(" job-20231114-221320-ab12 FAILED ppo_tiny submitted 2023-11-14 22:13:20 UTC: no worker has 2 CPU free"),
            "{t}"
        );
        let j = to_json(&s);
        assert_eq!(j["jobs"][0]["state"], "FAILED");
        let many = pb::ClusterStatusResponse {
            jobs: (0..12)
                .map(|i| pb::JobInfo {
                    job_id: format!("job-{i:02}"),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let t = to_text(&many);
        assert!(t.contains(" ... 2 older (rlhf-head job list)"), "{t}");
        assert!(
            !t.contains("job-01 ") && t.contains("job-02 ") && t.contains("job-11 "),
            "{t}"
        );
        assert_eq!(j["jobs"][0]["exit_code"], 3);
        assert_eq!(j["jobs"][0]["start_ms"], 0);
    }

    #[test]
    fn renders_nodes_usage_and_dead_reasons() {
        let node = |id: &str, state: pb::NodeState, gpu_avail: f64| pb::NodeInfo {
            node_id: id.into(),
            hostname: "h".into(),
            address: "a:1".into(),
            total: Some((&Resources::new().with("GPU", 8.0)).into()),
            available: Some((&Resources::new().with("GPU", gpu_avail)).into()),
            state: state as i32,
            death_reason: if state == pb::NodeState::Dead {
                "no heartbeat for 6.0s".into()
            } else {
                String::new()
            },
            ..Default::default()
        };
        let s = pb::ClusterStatusResponse {
            nodes: vec![
                node("n1", pb::NodeState::Alive, 6.0),
                node("n2", pb::NodeState::Alive, 8.0),
                node("n3", pb::NodeState::Dead, 8.0),
                node("n4", pb::NodeState::Rejoining, 8.0),
            ],
            protocol_version: 1,
            ..Default::default()
        };
        let t = to_text(&s);
        assert!(t.contains(" 2/16 GPU"), "{t}");
        assert!(t.contains("n3 h (a:1): no heartbeat for 6.0s"), "{t}");
        let (rejoining, dead) = (t.find("Rejoining (").unwrap(), t.find("Dead:").unwrap());
        let n4 = t.find(" 1 n4 h (a:1) [GPU: 8]").unwrap();
        assert!(rejoining < n4 && n4 < dead, "n4 listed as rejoining:\n{t}");
        assert!(t.contains("Jobs\n") && t.contains(" (none)"), "{t}");
        let j = to_json(&s);
        assert_eq!(j["jobs"].as_array().unwrap().len(), 0);
        assert_eq!(j["resources"]["used"]["GPU"], 2.0);
        assert_eq!(j["nodes"].as_array().unwrap().len(), 4);
        assert_eq!(j["nodes"][2]["state"], "DEAD");
        assert_eq!(j["nodes"][0]["usage"], json!(["GPU 2/8"]));
        assert_eq!(j["nodes"][3]["state"], "REJOINING");
    }

    #[test]
    fn actors_in_fractional_bundles_show_their_shared_device() {
        let bundle = |gpu: f64| pb::Bundle {
            resources: Some((&Resources::new().with("GPU", gpu)).into()),
        };
        let actor = |id: &str, role: &str, pg: &str| pb::ActorInfo {
            actor_id: id.into(),
            state: pb::ActorState::Alive as i32,
            node_id: "n1".into(),
            devices: vec![0],
            spec: Some(pb::ActorSpec {
                role: role.into(),
                pg_id: pg.into(),
                bundle_index: 0,
                ..Default::default()
            }),
            ..Default::default()
        };
        let s = pb::ClusterStatusResponse {
            placement_groups: vec![
                pb::PlacementGroupInfo {
                    pg_id: "pg-a".into(),
                    bundles: vec![bundle(0.333)],
                    bundle_nodes: vec!["n1".into()],
                    ..Default::default()
                },
                pb::PlacementGroupInfo {
                    pg_id: "pg-w".into(),
                    bundles: vec![bundle(1.0)],
                    bundle_nodes: vec!["n1".into()],
                    ..Default::default()
                },
            ],
            actors: vec![
                actor("a1", "actor_rollout", "pg-a"),
                actor("w1", "ref", "pg-w"),
            ],
            ..Default::default()
        };
        let t = to_text(&s);
        let line = |id: &str| {
            t.lines()
                .find(|l| l.contains(id))
                .unwrap_or_default()
                .to_string()
        };
        assert!(line(" a1 ").contains("devices=0 shares {GPU: 0.33}"), "{t}");
        assert!(line(" w1 ").contains("devices=0"), "{t}");
        assert!(
            !line(" w1 ").contains("shares"),
            "a whole device is not shared: {t}"
        );
    }
}
