//! Weight sync trainer -> rollout and checkpoints, for the loop. The sync path is chosen
//! once per job from where the ranks run: the same process moves nothing, one node goes
//! through shared memory, several nodes through the job's communicator backend; so is each
//! data-parallel group's backend ([`dp_backend`]).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use rlhf_config::data::DataCursor;
use rlhf_core::Error;
use rlhf_core::{CommBackend, CommGroup, RoleKind};
use rlhf_proto::v1 as pb;

use crate::checkpoint::{self, TrainerState};
use crate::cluster::Roles;
use crate::group::WorkerGroup;
use crate::report::Reporter;
use crate::snapshot;

use super::algorithm::Algorithm;
use super::{timed, Failed, Loop, Res};

/// How trainer → rollout weights travel in one job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncPath {
    /// Colocated: the rollout generates with the trainer's own weights in one process.
    None,
    /// A `weights` communicator of this backend.
    Comm(CommBackend),
}

impl SyncPath {
    /// Picks the path for `roles`: same process → none; `forced` (`--weight-sync-backend`)
    /// when given; shared memory when every rank of the weights group is on one node (on GPUs
    /// the roles then hand the weights over by CUDA IPC, with the segment as control
    /// channel; the first sync reports it); NCCL across nodes when the job's backend is NCCL;
    /// else the job's backend. Returns the path and the reason, for the one log line.
    pub fn choose(
        roles: &Roles,
        backend: CommBackend,
        forced: Option<CommBackend>,
    ) -> (SyncPath, String) {
        if roles.colocated {
            return (
                SyncPath::None,
                "colocated: the rollout generates with the trainer's weights in the same process, nothing moves".into(),
            );
        }
        let g = roles.weights_group();
        let nodes = nodes_of(&g);
        let on = ranks_on(&nodes);
        if let Some(b) = forced {
            return (
                SyncPath::Comm(b),
                format!("asked for with --weight-sync-backend; {on}"),
            );
        }
        match backend {
            _ if nodes.len() <= 1 && cfg!(target_os = "linux") => (
                SyncPath::Comm(CommBackend::Shm),
                format!("{on}: one shared-memory segment, no sockets (GPU weights go by CUDA IPC)"),
            ),
            CommBackend::Nccl => (
                SyncPath::Comm(backend),
                format!("the job's NCCL backend (staged through host memory on each rank, issue #56); {on}"),
            ),
            _ => (
                SyncPath::Comm(backend),
                format!("the job's {backend} backend; {on}"),
            ),
        }
    }

    /// How the path reads in the log.
    pub fn describe(self) -> String {
        match self {
            SyncPath::None => "none".into(),
            SyncPath::Comm(CommBackend::Shm) => "shared memory".into(),
            SyncPath::Comm(b) => b.to_string(),
        }
    }
}

/// The nodes `group`'s ranks run on.
fn nodes_of(group: &WorkerGroup) -> BTreeSet<&str> {
    group.members.iter().map(|m| m.node_id.as_str()).collect()
}

/// Where the ranks on `nodes` run, for a log line.
fn ranks_on(nodes: &BTreeSet<&str>) -> String {
    match nodes.len() {
        0 | 1 => format!("every rank on node {}", nodes.iter().next().unwrap_or(&"?")),
        n => format!("ranks on {n} nodes"),
    }
}

/// The backend of the data-parallel group of `part` (`actor`, `critic`, `reward`), logged
/// once when the group has several ranks: `forced` (`--comm-backend`) when given; shared
/// memory when every rank is on one node (Linux: an anonymous memfd ring, no sockets;
/// weight_sync_bench moves 64-512 MiB 1.9-3.5x faster through it than through the TCP
/// communicator); else TCP.
pub(super) fn dp_backend(
    report: &mut crate::report::Reporters,
    part: &str,
    group: &WorkerGroup,
    forced: Option<CommBackend>,
) -> Res<CommBackend> {
    let (backend, why) = dp_backend_on(&nodes_of(group), forced);
    if group.len() > 1 {
        report.report(&crate::report::Event::DataParallel {
            part,
            backend: &backend.to_string(),
            why: &why,
        })?;
    }
    Ok(backend)
}

fn dp_backend_on(nodes: &BTreeSet<&str>, forced: Option<CommBackend>) -> (CommBackend, String) {
    let on = ranks_on(nodes);
    match forced {
        Some(b) => (b, format!("asked for with --comm-backend; {on}")),
        None if nodes.len() <= 1 && cfg!(target_os = "linux") => (
            CommBackend::Shm,
            format!("{on}: one shared-memory segment, no sockets"),
        ),
        None => (
            CommBackend::Tcp,
            format!("{on}; --comm-backend nccl for GPUs across nodes"),
        ),
    }
}

/// What one sync did, for the step's metrics.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Synced {
    /// Wall time of the whole sync as the driver saw it.
    pub secs: f64,
    /// Bytes delivered to rollout ranks (the payload times the receivers; 0 when colocated).
    pub bytes: u64,
    /// The bytes went through the trainer's GPU memory, mapped by handle (CUDA IPC).
    pub cuda_ipc: bool,
}

impl Loop<'_> {
    /// Broadcasts the trainer's weights to the rollout ranks and checks that every rank
    /// ends with the trainer's checksum.
    pub(super) async fn sync_weights(&self, version: u64) -> Res<Synced> {
        if self.sync_path == SyncPath::None {
            // The rollout ranks generate with the trainers' own weights: nothing to move.
            return Ok(Synced::default());
        }
        let g = self.roles.weights_group();
        let t = self.opts.call_timeout;
        let request = move |group: CommGroup| pb::SyncWeightsRequest {
            group: pb::CommGroup::from(group) as i32,
            version,
            bucket_bytes: 0,
        };
        let send = g.unary(t, "SyncWeights", |_, mut c| async move {
            c.sync_weights(request(CommGroup::Weights)).await
        });
        // ZeRO-3: the trainer's other ranks take part in gathering its weights.
        let helpers = self.cfg.resolved(RoleKind::ActorRollout).zero_stage >= 3
            && self.roles.train.members.len() > 1;
        let (answers, secs) = timed(async {
            if !helpers {
                return send.await;
            }
            let help = self
                .roles
                .train
                .unary(t, "SyncWeights", |rank, mut c| async move {
                    if rank == 0 {
                        // Rank 0 sends, in the weights group above.
                        return Ok(tonic::Response::new(pb::SyncWeightsResponse::default()));
                    }
                    c.sync_weights(request(CommGroup::ActorDp)).await
                });
            let (sent, helped) = tokio::join!(send, help);
            helped?;
            sent
        })
        .await;
        let answers = answers?;
        if let Some(first) = answers.first() {
            for (rank, a) in answers.iter().enumerate().skip(1) {
                if a.checksum != first.checksum {
                    return Err(Failed::Other(Error::internal(format!(
                        "weight sync at version {version}: rollout rank {} has checksum {:016x}, the trainer {:016x}",
                        rank - 1,
                        a.checksum,
                        first.checksum
                    ))));
                }
            }
        }
        let receivers = answers.len().saturating_sub(1) as u64;
        Ok(Synced {
            secs,
            bytes: answers
                .first()
                .map_or(0, |a| a.bytes)
                .saturating_mul(receivers),
            cuda_ipc: answers.first().is_some_and(|a| a.cuda_ipc),
        })
    }

    /// Starts the checkpoint of the trainers after `step`; `cursor` is the sampler's right
    /// after that step's prompts (the rollout lane may have drawn further ahead). The
    /// trainers copy their state out and answer; their files are written while the next step
    /// runs, and the checkpoint is committed (`trainer_state.json`, the marker of a complete
    /// checkpoint) once both are on disk.
    pub(super) async fn start_save<A: Algorithm>(
        &self,
        step: u64,
        algo: &A,
        cursor: DataCursor,
    ) -> Res<PendingSave> {
        let mut state = TrainerState::new(
            A::NAME,
            step,
            cursor,
            self.cfg.training.seed,
            &self.opts.job_id,
        );
        algo.save(&mut state);
        let sharded = |role| self.cfg.resolved(role).zero_stage >= 1;
        let parts = [
            ("actor", &self.roles.train, sharded(RoleKind::ActorRollout)),
            ("critic", &self.roles.critic, sharded(RoleKind::Critic)),
        ];
        save_parts(
            &parts,
            state,
            self.ckpt_root,
            self.cfg.checkpoint.keep_last,
            self.opts.call_timeout,
            snapshot_plan(self.cfg, self.opts, self.roles),
            self.opts.checkpoint_key(),
        )
        .await
    }
}

/// Loads part `part` (`actor`, `critic`) of the checkpoint `dir` into every rank of `group`,
/// from the memory snapshot `snapshot` when given (a rank falls back to disk by itself when
/// it cannot fetch it). [`loaded_from`] then tells where the files came from.
pub(super) async fn load_part(
    group: &WorkerGroup,
    t: Duration,
    dir: &std::path::Path,
    part: &str,
    snapshot: Option<pb::SnapshotSource>,
) -> Res<Vec<pb::LoadCheckpointResponse>> {
    if group.members.is_empty() {
        return Ok(Vec::new());
    }
    let d = dir.join(part).to_string_lossy().into_owned();
    let answers = group
        .unary(t, "LoadCheckpoint", |_, mut c| {
            let (dir, snapshot) = (d.clone(), snapshot.clone());
            async move {
                c.load_checkpoint(pb::LoadCheckpointRequest { dir, snapshot })
                    .await
            }
        })
        .await?;
    Ok(answers)
}

/// Checks that every rank of `part` loaded the weights whose checksum the trainer state
/// recorded at the save (`want`; none recorded: nothing to check). The error names the
/// part, not the checksum either side has.
pub(super) fn check_loaded(
    dir: &std::path::Path,
    part: &str,
    want: Option<u64>,
    answers: &[pb::LoadCheckpointResponse],
) -> Res<()> {
    let Some(want) = want else { return Ok(()) };
    if answers.iter().any(|a| a.weights_checksum != want) {
        return Err(Failed::Other(Error::invalid(format!(
            "{}: the loaded weights are not the ones {} recorded at the save; the checkpoint \
             is damaged, resume from another one",
            dir.join(part).display(),
            checkpoint::STATE_FILE
        ))));
    }
    Ok(())
}

/// Reports where rank 0 of part `part` loaded its checkpoint from.
pub(super) fn loaded_from(
    report: &mut crate::report::Reporters,
    part: &str,
    answers: &[pb::LoadCheckpointResponse],
) -> Res<()> {
    if let Some(first) = answers.first() {
        report.report(&crate::report::Event::Restored {
            part,
            source: &first.source,
        })?;
    }
    Ok(())
}

/// Where this job's savers push their memory snapshots, when `checkpoint.memory_snapshot`.
pub(super) fn snapshot_plan(
    cfg: &rlhf_config::PpoConfig,
    opts: &super::DriverOptions,
    roles: &Roles,
) -> Option<snapshot::Plan> {
    cfg.checkpoint.memory_snapshot.then(|| snapshot::Plan {
        job_id: opts.job_id.clone(),
        client: opts.client.clone(),
        peers: roles.peers.clone(),
    })
}

/// Starts a checkpoint of `state.global_step`: rank 0 of each group copies its state out and
/// answers, then writes it under the role directory named beside it while the job goes on;
/// the checkpoint is committed (`trainer_state.json`, the marker of a complete checkpoint,
/// with each part's checksum) once every part is on disk. An empty group saves nothing.
/// With a snapshot `plan`, each saver also pushes its directory into the memory of the
/// worker the plan names for its node, and the committed checkpoint comes with the record
/// of those copies.
pub(super) async fn save_parts(
    parts: &[(&str, &WorkerGroup, bool)],
    mut state: TrainerState,
    root: &std::path::Path,
    keep: u32,
    t: Duration,
    plan: Option<snapshot::Plan>,
    key: rlhf_core::seal::CheckpointKey,
) -> Res<PendingSave> {
    let step = state.global_step;
    let dir = checkpoint::step_dir(root, step);
    // Saving a step again (after a resume from an earlier one): the old state and signature
    // go first, so a crash before the commit leaves an incomplete step, not a stale state
    // under a new signature.
    checkpoint::uncommit(&dir)?;
    // A part whose optimizer state is sharded (`training.zero_stage` 1 or 2) is saved by every
    // rank (rank 0 the weights and its shard, the others their shards); otherwise rank 0
    // saves it all. The checkpoint is committed once every saver has its files on disk.
    let parts: Vec<(String, WorkerGroup, String)> = parts
        .iter()
        .map(|(name, g, sharded)| {
            let savers = WorkerGroup {
                id: g.id,
                members: g
                    .members
                    .iter()
                    .take(if *sharded { usize::MAX } else { 1 })
                    .cloned()
                    .collect(),
            };
            let d = dir.join(name).to_string_lossy().into_owned();
            (name.to_string(), savers, d)
        })
        .collect();
    // Each saver's snapshot holder (the worker of the next node), in rank order.
    let holders: Vec<Vec<String>> = parts
        .iter()
        .map(|(_, g, _)| {
            g.members
                .iter()
                .map(|m| {
                    plan.as_ref()
                        .and_then(|p| p.peers.holder_for(&m.node_id))
                        .map(|(_, a)| a.to_string())
                        .unwrap_or_default()
                })
                .collect()
        })
        .collect();
    let saves = parts.iter().zip(&holders).map(|((_, g, dir), holders)| {
        let job_id = plan.as_ref().map(|p| p.job_id.clone()).unwrap_or_default();
        g.unary(t, "SaveCheckpoint", move |rank, mut c| {
            let dir = dir.clone();
            let snapshot =
                holders
                    .get(rank)
                    .filter(|a| !a.is_empty())
                    .map(|a| pb::SnapshotTarget {
                        address: a.clone(),
                        job_id: job_id.clone(),
                        step,
                    });
            async move {
                c.save_checkpoint(pb::SaveCheckpointRequest {
                    dir,
                    background: true,
                    snapshot,
                })
                .await
            }
        })
    });
    futures::future::try_join_all(saves).await?;
    let root = root.to_path_buf();
    let task = tokio::spawn(async move {
        let waits = parts.iter().map(|(_, g, dir)| {
            // The role's own deadline answers first, with its reason.
            g.unary(
                t + Duration::from_secs(5),
                "WaitCheckpoint",
                move |_, mut c| {
                    let dir = dir.clone();
                    async move {
                        c.wait_checkpoint(pb::WaitCheckpointRequest {
                            dir,
                            timeout_ms: t.as_millis() as u64,
                        })
                        .await
                    }
                },
            )
        });
        let answers = futures::future::try_join_all(waits).await?;
        for ((name, _, _), a) in parts.iter().zip(&answers) {
            // Rank 0 saved the weights.
            if let Some(first) = a.first() {
                state.set_checksum(name, first.weights_checksum);
            }
        }
        let dir = checkpoint::commit(&root, &state, &key)?;
        let names: Vec<&str> = parts.iter().map(|(n, _, _)| n.as_str()).collect();
        let unseen = checkpoint::parts_without_manifest(&dir, &names);
        if !unseen.is_empty() {
            tracing::warn!(
                "checkpoint {}: the driver sees no manifest of {} under checkpoint.dir (a \
                 directory local to each node?), so its signature does not cover them; a \
                 resume still checks their files against their own manifests",
                dir.display(),
                unseen.join(", ")
            );
        }
        checkpoint::prune(&root, keep)?;
        let snapshot = match plan {
            Some(plan) => {
                let pushed: Vec<(String, Vec<(String, pb::SaveCheckpointResponse)>)> = parts
                    .iter()
                    .zip(answers)
                    .zip(holders)
                    .map(|(((name, _, _), a), h)| (name.clone(), h.into_iter().zip(a).collect()))
                    .collect();
                let record = snapshot::commit(&plan, &state, &pushed).await;
                Some((plan, record))
            }
            None => None,
        };
        Ok(Committed { dir, snapshot })
    });
    Ok(PendingSave {
        step,
        task: Some(task),
    })
}

/// A committed checkpoint: its directory, and its memory snapshots when the job keeps them.
pub(super) struct Committed {
    pub dir: PathBuf,
    pub snapshot: Option<(snapshot::Plan, snapshot::Record)>,
}

/// A checkpoint whose files the trainers are writing. Dropped unfinished, it is abandoned:
/// nothing is committed, and the previous checkpoint stays the newest.
pub(super) struct PendingSave {
    step: u64,
    task: Option<tokio::task::JoinHandle<Res<Committed>>>,
}

impl PendingSave {
    /// Waits for both trainers' files and the commit; returns the checkpoint.
    pub(super) async fn finish(mut self) -> Res<Committed> {
        let Some(task) = self.task.take() else {
            return Err(Failed::Other(Error::internal("checkpoint finished twice")));
        };
        task.await.map_err(|e| {
            Failed::Other(Error::internal(format!(
                "the checkpoint of step {}: its writer task ended: {e}",
                self.step
            )))
        })?
    }
}

impl Drop for PendingSave {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_parallel_group_on_one_node_takes_shared_memory_unless_told() {
        let nodes = |n: &[&'static str]| n.iter().copied().collect::<BTreeSet<&str>>();
        let (b, why) = dp_backend_on(&nodes(&["n1", "n1"]), None);
        assert_eq!(b, CommBackend::Shm);
        assert!(why.contains("every rank on node n1"), "{why}");
        let (b, why) = dp_backend_on(&nodes(&["n1", "n2", "n1"]), None);
        assert_eq!(b, CommBackend::Tcp);
        assert!(why.contains("ranks on 2 nodes"), "{why}");
        for forced in CommBackend::ALL {
            let (b, why) = dp_backend_on(&nodes(&["n1", "n1"]), Some(forced));
            assert_eq!(b, forced);
            assert!(why.contains("--comm-backend"), "{why}");
        }
    }
}
