//! What a failed or finished job leaves behind: the error naming a role process that died
//! (its node, exit and last log lines), and the actors and placement groups to release.

use std::collections::BTreeMap;
use std::time::Duration;

use rlhf_core::{Error, FailureKind};
use rlhf_proto::v1 as pb;

use super::{HeadClient, Roles};
use crate::group::CallError;

/// What a launch has made on the head so far. The caller releases it with [`release`] when
/// the launch fails or is cancelled, so a failed start leaves no actors or placement groups
/// (and none of their devices) behind.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Launched {
    pub placement_groups: Vec<String>,
    pub actors: Vec<String>,
}

/// Stops the actors, then removes the placement groups (each call bounded, errors ignored:
/// this runs on the way out of a failure).
pub async fn release(head: &mut HeadClient, made: &Launched) {
    for id in &made.actors {
        let _ = tokio::time::timeout(
            Duration::from_secs(10),
            head.kill_actor(pb::KillActorRequest {
                actor_id: id.clone(),
            }),
        )
        .await;
    }
    remove_placement_groups(head, &made.placement_groups).await;
}

/// Turns a failed role call into the error the user sees: when a role process of this
/// job died, name it, its node, its exit and its last log lines, whichever call noticed.
/// Also returns the role part and rank to blame.
pub async fn diagnose(
    head: &mut HeadClient,
    roles: &Roles,
    err: CallError,
) -> (Error, Option<(String, u32)>) {
    let ours: BTreeMap<String, (String, usize)> = roles
        .all_members()
        .map(|(g, r, m)| (m.actor_id.clone(), (g.name(), r)))
        .collect();
    // The worker reports an exit within a heartbeat or so; give it a moment.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(6);
    loop {
        let status = tokio::time::timeout(
            Duration::from_secs(2),
            head.cluster_status(pb::ClusterStatusRequest {}),
        );
        if let Ok(Ok(s)) = status.await {
            let s = s.into_inner();
            let dead: Vec<&pb::ActorInfo> = s
                .actors
                .iter()
                .filter(|a| ours.contains_key(&a.actor_id))
                .filter(|a| a.state == pb::ActorState::Dead as i32)
                .collect();
            if let Some(a) = dead.first() {
                let (role, rank) = ours.get(&a.actor_id).cloned().unwrap_or_default();
                let node = s
                    .nodes
                    .iter()
                    .find(|n| n.node_id == a.node_id)
                    .map(|n| format!("{} ({})", n.node_id, n.hostname))
                    .unwrap_or_else(|| a.node_id.clone());
                let mut msg = format!(
                    "role {role} rank {rank} died (actor {}, pid {}, node {node})",
                    a.actor_id, a.pid
                );
                if let Some(exit) = &a.exit {
                    if exit.signal != 0 {
                        msg.push_str(&format!(": signal {}", exit.signal));
                    } else {
                        msg.push_str(&format!(": exit code {}", exit.exit_code));
                    }
                    if !exit.reason.is_empty() {
                        msg.push_str(&format!(" - {}", exit.reason));
                    }
                    if !exit.log_tail.is_empty() {
                        msg.push_str("\nlast log lines:\n");
                        for l in &exit.log_tail {
                            msg.push_str("  ");
                            msg.push_str(l);
                            msg.push('\n');
                        }
                    }
                } else if !a.reason.is_empty() {
                    msg.push_str(&format!(": {}", a.reason));
                }
                if !a.log_file.is_empty() {
                    msg.push_str(&format!("full log: {} on that node", a.log_file));
                }
                return (
                    Error::new(FailureKind::ActorDied, msg),
                    Some((role, rank as u32)),
                );
            }
        }
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let at = Some((err.role.clone(), err.rank as u32));
    (Error::new(err.error.kind(), err.to_string()), at)
}

/// Kills the job's actors and frees its devices; best effort.
pub async fn shutdown(head: &mut HeadClient, roles: &Roles) {
    let made = Launched {
        placement_groups: roles.placement_groups.clone(),
        actors: roles
            .all_members()
            .map(|(_, _, m)| m.actor_id.clone())
            .collect(),
    };
    release(head, &made).await;
}

async fn remove_placement_groups(head: &mut HeadClient, pgs: &[String]) {
    for pg in pgs {
        let _ = tokio::time::timeout(
            Duration::from_secs(10),
            head.remove_placement_group(pb::RemovePlacementGroupRequest { pg_id: pg.clone() }),
        )
        .await;
    }
}
