//! The calls of a role process that reach past one batch: the trainer → rollout weight sync
//! (a ZeRO-3 trainer's ranks gather the policy a layer at a time, rank 0 sending each as it
//! comes), the weights' checksum,
//! and checkpoints of the trainable engine, with its data-parallel group's communicator
//! lent to a sharded model.

use std::path::Path;

use rlhf_core::CommGroup;
use rlhf_proto::v1 as pb;

use super::{is_collective, RoleHost};
use crate::engine::Engine;
use crate::error::{Ctx, Error, Result};

impl RoleHost {
    pub fn sync_weights(
        &mut self,
        req: &pb::SyncWeightsRequest,
    ) -> Result<pb::SyncWeightsResponse> {
        let label = self.label();
        let group = CommGroup::from_wire(req.group, "SyncWeightsRequest.group")?;
        let bucket = req.bucket_bytes as usize;
        // ZeRO-3: every rank of the trainer's group gathers the whole weights (one layer at
        // a time); rank 0 sends each layer as it comes, the others only take part in the
        // gathers (the driver calls them with the actor's data-parallel group).
        if group == CommGroup::ActorDp {
            let Some(seconds) = self.gather_for_sync(req.version, &label)? else {
                return Err(Error::invalid(format!(
                    "{label} SyncWeights: the actor's data-parallel group takes part in a sync only when the trainer's parameters are sharded (training.zero_stage 3)"
                )));
            };
            return Ok(pb::SyncWeightsResponse {
                checksum: 0,
                bytes: 0,
                buckets: 0,
                seconds,
                version: req.version,
                cuda_ipc: false,
            });
        }
        let mut res = Err(Error::invalid(format!(
            "SyncWeights is served by actor_rollout ranks only, not by {label}"
        )));
        let mut cuda_ipc = None;
        // A trainer sends; a rollout (without a trainer on this host) receives. The weights
        // group has the trainer and at least one rollout rank: never a group of one made on
        // the spot (world 2 below), so a missing JoinComm is reported.
        if let Some((t, world)) = self.engines.iter_mut().find_map(|h| match &mut h.engine {
            Engine::Trainer(t) => Some((t, h.spec.slot.world_size as usize)),
            _ => None,
        }) {
            if t.state.model.zero3().is_some() {
                let dp = (CommGroup::ActorDp, world);
                let (dp_comm, comm) = match self.groups.pair(dp, (group, 2)) {
                    Ok(pair) => pair,
                    Err(e) => {
                        // No weights group (or no data-parallel one): the other trainer
                        // ranks are gathering all the same, so take part before failing.
                        if let Ok(c) = self.groups.get(dp.0, dp.1) {
                            let model = t.state.model.clone();
                            if let Err(g) = crate::weights::gather_for_others(&model, c) {
                                tracing::warn!("{label} SyncWeights: {g}");
                                self.groups.forget(dp.0);
                            }
                        }
                        return Err(e).with_ctx(|| format!("{label} SyncWeights"));
                    }
                };
                match t.send_weights_sharded(dp_comm, comm, req.version, bucket) {
                    Ok(sent) => {
                        if sent.is_err() {
                            // The receivers may be mid-sync: the weights group is done.
                            self.groups.forget(group);
                        }
                        res = sent;
                    }
                    Err(e) => {
                        // A gather failed: the group is broken, and the sync half sent.
                        self.groups.forget(dp.0);
                        self.groups.forget(group);
                        return Err(e).with_ctx(|| format!("{label} SyncWeights"));
                    }
                }
            } else {
                let comm = self.groups.get(group, 2)?;
                res = t.send_weights(comm, req.version, bucket);
            }
            cuda_ipc = t.ipc.last_was_ipc();
        } else if let Some(r) = self.engines.iter_mut().find_map(|h| match &mut h.engine {
            Engine::Rollout(r) => Some(r),
            _ => None,
        }) {
            let comm = self.groups.get(group, 2)?;
            res = r.recv_weights(comm, req.version, bucket);
            cuda_ipc = r.ipc.last_was_ipc();
        }
        if matches!(&res, Err(e) if is_collective(e)) {
            self.groups.forget(group);
        }
        let (stats, checksum) = res.with_ctx(|| format!("{label} SyncWeights"))?;
        Ok(pb::SyncWeightsResponse {
            checksum,
            bytes: stats.bytes,
            buckets: stats.buckets as u32,
            seconds: stats.elapsed.as_secs_f64(),
            version: req.version,
            cuda_ipc: cuda_ipc == Some(true),
        })
    }

    /// A ZeRO-3 trainer rank's part in the gathers of a weight sync that rank 0 of its
    /// data-parallel group sends ([`crate::weights::gather_for_others`]). Returns the seconds
    /// it took (`None`: not a ZeRO-3 trainer); the rank counts the sync's version as its own.
    fn gather_for_sync(&mut self, version: u64, label: &str) -> Result<Option<f64>> {
        let Some((t, world)) = self.engines.iter_mut().find_map(|h| match &mut h.engine {
            Engine::Trainer(t) => Some((t, h.spec.slot.world_size as usize)),
            _ => None,
        }) else {
            return Ok(None);
        };
        let model = t.state.model.clone();
        if model.zero3().is_none() {
            return Ok(None);
        }
        let start = std::time::Instant::now();
        let comm = self.groups.get(CommGroup::ActorDp, world)?;
        let res = crate::weights::gather_for_others(&model, comm)
            .with_ctx(|| format!("{label} SyncWeights"));
        if res.is_err() {
            // A gather failed: the group is broken.
            self.groups.forget(CommGroup::ActorDp);
        }
        res?;
        // Rank 0 counts the version once its send went through.
        t.state.version = version;
        Ok(Some(start.elapsed().as_secs_f64()))
    }

    /// Checksum and version of the first engine with a model (rule and HTTP rewards: 0).
    pub fn weights_checksum(&mut self) -> Result<pb::WeightsChecksumResponse> {
        let h = self
            .engines
            .first()
            .ok_or_else(|| Error::invalid("not initialised; call InitRole first"))?;
        let checksum = match h.engine.model() {
            Some(m) => crate::weights::weights_checksum(m)?,
            None => 0,
        };
        Ok(pb::WeightsChecksumResponse {
            checksum,
            version: h.engine.version(),
        })
    }

    /// The trainable engine's state and, when its model is sharded (ZeRO-3), the
    /// communicator of its data-parallel group, which saves and loads borrow.
    fn trainable_in_group(
        &mut self,
        what: &str,
    ) -> Result<(
        &mut crate::train::TrainState,
        Option<&mut dyn rlhf_collective::Communicator>,
    )> {
        let label = self.label();
        let (state, world) = self
            .engines
            .iter_mut()
            .find_map(|h| {
                let world = h.spec.slot.world_size as usize;
                h.engine.train_state_mut().map(|s| (s, world))
            })
            .ok_or_else(|| {
                Error::invalid(format!(
                    "{what} is for trainable roles (actor_rollout train, critic, a reward model in training), not {label}"
                ))
            })?;
        if state.model.zero3().is_none() {
            return Ok((state, None));
        }
        let group = dp_group(state.who.role);
        Ok((state, Some(self.groups.get(group, world)?)))
    }

    /// The trainable engine's checkpoint, copied out for a writer thread (this rank's
    /// shard of a sharded optimizer, see `crate::checkpoint`).
    /// `dir`: the checkpoint part it will be written to (see
    /// [`crate::train::TrainState::capture_checkpoint`]).
    pub fn capture_checkpoint(&mut self, dir: Option<&Path>) -> Result<crate::checkpoint::Image> {
        let label = self.label();
        let (state, comm) = self.trainable_in_group("SaveCheckpoint")?;
        match comm {
            Some(c) => state.capture_checkpoint_in(c, dir),
            None => state.capture_checkpoint(dir),
        }
        .with_ctx(|| format!("{label} SaveCheckpoint"))
    }

    pub fn load_checkpoint(&mut self, dir: &str) -> Result<u64> {
        let label = self.label();
        let dir = checkpoint_dir(dir)?;
        let (state, comm) = self.trainable_in_group("LoadCheckpoint")?;
        match comm {
            Some(c) => state.load_checkpoint_in(dir, c),
            None => state.load_checkpoint(dir),
        }
        .with_ctx(|| format!("{label} LoadCheckpoint"))
    }
}

/// The data-parallel group of a trained role: whose communicator its updates, and a ZeRO-3
/// model's gathers, go through.
pub(super) fn dp_group(role: rlhf_core::RoleKind) -> CommGroup {
    match role {
        rlhf_core::RoleKind::Critic => CommGroup::CriticDp,
        rlhf_core::RoleKind::Reward => CommGroup::RewardDp,
        _ => CommGroup::ActorDp,
    }
}

pub(crate) fn checkpoint_dir(dir: &str) -> Result<&Path> {
    if dir.is_empty() {
        return Err(Error::invalid("checkpoint dir is empty"));
    }
    Ok(Path::new(dir))
}
