//! `checkpoint.memory_snapshot`, the driver's side: which worker holds each saver's copy of a
//! checkpoint in memory, the record of the newest complete one, and the sources a restart's
//! LoadCheckpoint fetches from.
//!
//! A saver on node N pushes to the worker of the next alive node after N (node ids in order),
//! so the copy survives N's death; on a one-node cluster it is N's own worker, which
//! survives the role processes. A part (`actor`, `critic`) is offered to a restart only when
//! every one of its savers pushed (a sharded optimizer needs every rank's shard); otherwise
//! that part loads from disk. A worker a push failed to is not chosen again while the roles
//! stay placed (the next one in order is, or the saver's own): one checkpoint pays for a
//! worker that went away, not every one after it. The workers drop a job's older snapshots
//! when the driver commits a newer checkpoint, and all of them when the job ends.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rlhf_proto::v1 as pb;
use rlhf_proto::v1::worker_service_client::WorkerServiceClient;
use rlhf_runtime::net::{self, ClientOptions};

use crate::checkpoint::TrainerState;
use crate::cluster::HeadClient;

/// Bound on a commit or drop call to one worker.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The alive nodes' worker agents, by node id.
#[derive(Debug, Clone, Default)]
pub struct Peers {
    workers: BTreeMap<String, String>,
    /// The workers (addresses) a push failed to since the roles were placed; shared by the
    /// clones each checkpoint's plan takes, so the next checkpoint leaves them out.
    failed: Arc<Mutex<BTreeSet<String>>>,
}

impl Peers {
    /// Asks the head for the alive nodes and their workers' addresses.
    pub async fn of_cluster(head: &mut HeadClient) -> rlhf_core::Result<Self> {
        let s = tokio::time::timeout(
            CALL_TIMEOUT,
            head.cluster_status(pb::ClusterStatusRequest {}),
        )
        .await
        .map_err(|_| {
            rlhf_core::Error::new(
                rlhf_core::FailureKind::Timeout,
                "ClusterStatus did not answer within 10 s (listing the workers for memory snapshots)",
            )
        })??
        .into_inner();
        let workers = s
            .nodes
            .into_iter()
            .filter(|n| n.state == pb::NodeState::Alive as i32 && !n.address.is_empty())
            .map(|n| (n.node_id, n.address))
            .collect();
        Ok(Self {
            workers,
            failed: Arc::default(),
        })
    }

    /// Whether the worker at `address` is on an alive node.
    pub fn alive(&self, address: &str) -> bool {
        self.workers.values().any(|a| a == address)
    }

    /// The worker that holds the copy of a saver on `node`: the next alive node's (in node
    /// id order, wrapping), or its own when it is the only one; a worker a push failed to
    /// is skipped, and with none left there is no holder (the part loads from disk).
    pub fn holder_for(&self, node: &str) -> Option<(&str, &str)> {
        let failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        let usable = |a: &String| !failed.contains(a);
        let next = self
            .workers
            .range::<str, _>((std::ops::Bound::Excluded(node), std::ops::Bound::Unbounded))
            .chain(self.workers.iter())
            .find(|(id, a)| id.as_str() != node && usable(a))
            .or_else(|| self.workers.get_key_value(node).filter(|(_, a)| usable(a)));
        next.map(|(id, a)| (id.as_str(), a.as_str()))
    }

    /// A push to the worker at `address` failed for `why`: later checkpoints of this
    /// placement push elsewhere (said once per worker).
    pub fn push_failed(&self, address: &str, why: &str) {
        let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        if !address.is_empty() && failed.insert(address.to_string()) {
            tracing::warn!(
                "the worker at {address} did not take a memory snapshot ({why}); this job's next checkpoints push their snapshots to another worker, or to none while the roles stay placed"
            );
        }
    }
}

/// Where a job's savers push: fixed when the roles are placed.
#[derive(Debug, Clone)]
pub struct Plan {
    pub job_id: String,
    pub client: ClientOptions,
    pub peers: Peers,
}

/// One pushed directory of a checkpoint.
#[derive(Debug, Clone)]
pub struct Holder {
    pub address: String,
    pub bytes: u64,
}

/// The snapshots of the newest complete checkpoint.
#[derive(Debug, Clone)]
pub struct Record {
    pub step: u64,
    pub state: TrainerState,
    /// Directory name under the step (`actor`, `actor.rank-1`) → its holder.
    pub dirs: BTreeMap<String, Holder>,
    /// The parts whose every saver pushed.
    pub complete: BTreeSet<String>,
}

impl Record {
    /// What LoadCheckpoint fetches for `part` of step `step`, when this record has all of it
    /// on workers that `alive` lists (a dead node's copy is not waited for).
    pub fn source(
        &self,
        job_id: &str,
        step: u64,
        part: &str,
        alive: &Peers,
    ) -> Option<pb::SnapshotSource> {
        if self.step != step || !self.complete.contains(part) {
            return None;
        }
        let prefix = format!("{part}.rank-");
        let parts = self
            .dirs
            .iter()
            .filter(|(d, _)| *d == part || d.starts_with(&prefix))
            .map(|(d, h)| pb::SnapshotHolder {
                part: d.clone(),
                address: h.address.clone(),
                bytes: h.bytes,
            })
            .collect::<Vec<pb::SnapshotHolder>>();
        if let Some(gone) = parts.iter().find(|h| !alive.alive(&h.address)) {
            tracing::warn!(
                "the memory snapshot of {part} at step {step} is partly on the worker at {}, whose node is gone; {part} loads from disk",
                gone.address
            );
            return None;
        }
        Some(pb::SnapshotSource {
            job_id: job_id.to_string(),
            step,
            parts,
        })
    }
}

/// What a job's snapshots need across attempts: the newest record and every worker that
/// was sent one (to drop them at the end).
#[derive(Debug, Default)]
pub struct Held {
    pub record: Option<Record>,
    workers: BTreeSet<String>,
    owner: Option<(String, ClientOptions)>,
}

impl Held {
    /// A newer checkpoint is complete with `record`'s snapshots.
    pub fn replace(&mut self, plan: &Plan, record: Record) {
        self.workers
            .extend(record.dirs.values().map(|h| h.address.clone()));
        self.owner = Some((plan.job_id.clone(), plan.client.clone()));
        self.record = Some(record);
    }

    /// Asks every worker that got a snapshot of the job to drop them all (best effort).
    pub async fn release(&mut self) {
        let Some((job_id, client)) = self.owner.take() else {
            return;
        };
        self.record = None;
        let calls = std::mem::take(&mut self.workers).into_iter().map(|a| {
            let (job_id, client) = (job_id.clone(), client.clone());
            async move {
                let r = call(&a, &client, |mut c| async move {
                    c.drop_snapshots(pb::DropSnapshotsRequest { job_id })
                        .await
                        .map(|_| ())
                })
                .await;
                if let Err(e) = r {
                    tracing::warn!("dropping the job's snapshots on the worker at {a}: {e}");
                }
            }
        });
        futures::future::join_all(calls).await;
    }
}

async fn call<F, Fut>(address: &str, client: &ClientOptions, f: F) -> rlhf_core::Result<()>
where
    F: FnOnce(WorkerServiceClient<net::AuthChannel>) -> Fut,
    Fut: std::future::Future<Output = Result<(), tonic::Status>>,
{
    let run = async {
        let ch = net::connect(address, client).await?;
        f(WorkerServiceClient::new(ch)).await?;
        Ok(())
    };
    tokio::time::timeout(CALL_TIMEOUT, run).await.map_err(|_| {
        rlhf_core::Error::new(
            rlhf_core::FailureKind::Timeout,
            format!("the worker at {address} did not answer within 10 s"),
        )
    })?
}

/// Builds the record of step `state.global_step` from the savers' answers (per part, each
/// saver's holder address with its answer) and tells those workers the step is complete, so
/// they drop the job's older snapshots. A failed push leaves its part out, with a warning.
pub async fn commit(
    plan: &Plan,
    state: &TrainerState,
    parts: &[(String, Vec<(String, pb::SaveCheckpointResponse)>)],
) -> Record {
    let step = state.global_step;
    let mut record = Record {
        step,
        state: state.clone(),
        dirs: BTreeMap::new(),
        complete: BTreeSet::new(),
    };
    for (part, answers) in parts {
        let mut whole = !answers.is_empty();
        for (address, a) in answers {
            if !a.snapshot_error.is_empty() {
                plan.peers.push_failed(address, &a.snapshot_error);
            }
            if !a.snapshot_error.is_empty() || a.snapshot_part.is_empty() {
                tracing::warn!(
                    "the memory snapshot of {part} at step {step} is incomplete ({}); a restart reads {part} from disk",
                    if a.snapshot_error.is_empty() { "a saver pushed nothing" } else { &a.snapshot_error }
                );
                whole = false;
                continue;
            }
            record.dirs.insert(
                a.snapshot_part.clone(),
                Holder {
                    address: address.clone(),
                    bytes: a.snapshot_bytes,
                },
            );
        }
        if whole {
            record.complete.insert(part.clone());
        }
    }
    let workers: BTreeSet<&String> = record.dirs.values().map(|h| &h.address).collect();
    let calls = workers.into_iter().map(|a| {
        let job_id = plan.job_id.clone();
        async move {
            let r = call(a, &plan.client, |mut c| async move {
                c.commit_snapshot(pb::CommitSnapshotRequest { job_id, step })
                    .await
                    .map(|_| ())
            })
            .await;
            if let Err(e) = r {
                tracing::warn!("committing the snapshots of step {step} on the worker at {a}: {e}");
            }
        }
    });
    futures::future::join_all(calls).await;
    record
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(ids: &[&str]) -> Peers {
        Peers {
            workers: ids
                .iter()
                .map(|i| (i.to_string(), format!("{i}:1")))
                .collect(),
            failed: Arc::default(),
        }
    }

    #[test]
    fn each_node_is_held_by_the_next_one() {
        let p = peers(&["a", "b", "c"]);
        assert_eq!(p.holder_for("a"), Some(("b", "b:1")));
        assert_eq!(p.holder_for("c"), Some(("a", "a:1")), "wraps around");
        // A node the head no longer lists as alive still gets a holder.
        assert_eq!(p.holder_for("bb"), Some(("c", "c:1")));
        let one = peers(&["a"]);
        assert_eq!(
            one.holder_for("a"),
            Some(("a", "a:1")),
            "alone: its own worker"
        );
        assert_eq!(peers(&[]).holder_for("a"), None);
    }

    #[test]
    fn a_part_is_offered_only_with_every_saver_pushed() {
        let st = TrainerState::new("ppo", 4, Default::default(), 1, "j");
        let mut rec = Record {
            step: 4,
            state: st,
            dirs: BTreeMap::new(),
            complete: ["actor".to_string()].into(),
        };
        for d in ["actor", "actor.rank-1", "critic", "actorx"] {
            rec.dirs.insert(
                d.into(),
                Holder {
                    address: format!("{d}:1"),
                    bytes: 7,
                },
            );
        }
        let all = Peers {
            workers: ["actor", "actor.rank-1", "critic", "actorx"]
                .iter()
                .map(|d| (format!("node-{d}"), format!("{d}:1")))
                .collect(),
            ..Default::default()
        };
        let s = rec.source("j", 4, "actor", &all).unwrap();
        let names: Vec<&str> = s.parts.iter().map(|p| p.part.as_str()).collect();
        assert_eq!(names, ["actor", "actor.rank-1"]);
        assert!(rec.source("j", 4, "critic", &all).is_none(), "incomplete");
        assert!(rec.source("j", 2, "actor", &all).is_none(), "another step");
        // The node holding rank 1's shard died: the part loads from disk.
        let mut fewer = all.clone();
        fewer.workers.remove("node-actor.rank-1");
        assert!(rec.source("j", 4, "actor", &fewer).is_none());
    }

    /// A checkpoint whose push to a worker failed: the plan of the next checkpoint (a clone
    /// of the same placement's peers) holds that node's savers elsewhere, then on their own
    /// worker, then nowhere; a saver without a target is no failure of anybody's.
    #[tokio::test]
    async fn a_worker_a_push_failed_to_is_not_chosen_again() {
        let placed = peers(&["a", "b", "c"]);
        let plan = Plan {
            job_id: "j".into(),
            client: ClientOptions::new("t"),
            peers: placed.clone(),
        };
        let failed = |e: &str| pb::SaveCheckpointResponse {
            snapshot_part: "actor".into(),
            snapshot_error: e.into(),
            ..Default::default()
        };
        let st = TrainerState::new("ppo", 2, Default::default(), 1, "j");
        let answers = vec![
            ("b:1".to_string(), failed("cannot reach b:1")),
            (String::new(), pb::SaveCheckpointResponse::default()),
        ];
        let rec = commit(&plan, &st, &[("actor".into(), answers)]).await;
        assert!(rec.complete.is_empty() && rec.dirs.is_empty());
        assert_eq!(placed.holder_for("a"), Some(("c", "c:1")), "b is skipped");
        assert_eq!(placed.holder_for("c"), Some(("a", "a:1")));
        placed.push_failed("c:1", "refused");
        assert_eq!(placed.holder_for("a"), Some(("a", "a:1")), "its own worker");
        placed.push_failed("a:1", "refused");
        assert_eq!(placed.holder_for("a"), None, "nobody left: disk only");
        // A new placement asks the head again and starts with every worker.
        assert_eq!(peers(&["a", "b"]).holder_for("a"), Some(("b", "b:1")));
    }
}
