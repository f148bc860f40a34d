//! One role process's state as the compute thread owns it: the loaded role and its
//! communicator groups, driven by plain method calls (the RPC adapter in `server` only
//! converts messages).

use std::path::Path;

use rlhf_config::PpoConfig;
use rlhf_core::batch::DataBatch;
use rlhf_core::{CommBackend, CommGroup, RoleKind, RolePart, RoleSlot};
use rlhf_proto::v1 as pb;
pub use rlhf_proto::BatchCall;

use crate::comm::{Groups, JoinSpec, Prepared};
use crate::error::{Ctx, Error, Result};
use crate::reward::Reward;
use crate::roles::{Critic, RefPolicy, Rollout, Trainer};

/// The loaded role.
pub enum Role {
    Trainer(Box<Trainer>),
    Rollout(Box<Rollout>),
    Ref(Box<RefPolicy>),
    Critic(Box<Critic>),
    Reward(Box<Reward>),
}

/// Everything the compute thread owns.
pub struct RoleActor {
    /// The process kind (`--kind`): InitRole must name the same role.
    pub kind: RoleKind,
    /// IP the TCP rendezvous binds on (reachable by the other ranks).
    pub host: String,
    pub role: Option<Role>,
    pub groups: Groups,
    /// Which rank of which role part, once initialised.
    pub ident: Option<RoleSlot>,
}

impl RoleActor {
    pub fn new(kind: RoleKind, host: &str) -> Self {
        Self {
            kind,
            host: host.to_string(),
            role: None,
            groups: Groups::new(),
            ident: None,
        }
    }

    fn label(&self) -> String {
        match &self.ident {
            Some(slot) => slot.label(),
            None => format!("{} (not initialised)", self.kind),
        }
    }

    fn role(&mut self) -> Result<&mut Role> {
        let kind = self.kind;
        self.role.as_mut().ok_or_else(|| {
            Error::invalid(format!(
                "the {kind} actor is not initialised; call InitRole first"
            ))
        })
    }

    pub fn init(&mut self, req: &pb::InitRoleRequest) -> Result<pb::InitRoleResponse> {
        if self.role.is_some() {
            return Err(Error::invalid(format!(
                "{} is already initialised; InitRole runs once per process",
                self.label()
            )));
        }
        let slot = RoleSlot {
            kind: RoleKind::from_wire(req.role, "InitRoleRequest.role")?,
            part: RolePart::from_wire(req.part, "InitRoleRequest.part")?,
            rank: req.rank,
            world_size: req.world_size.max(1),
        };
        if slot.kind != self.kind {
            return Err(Error::invalid(format!(
                "InitRole for role '{}' sent to a '{}' actor process",
                slot.kind, self.kind
            )));
        }
        slot.validate()?;
        let cfg: PpoConfig = rlhf_config::from_bundle(&req.config_bundle)?;
        let (rank, world) = (slot.rank as usize, slot.world_size as usize);
        let role = match (slot.kind, slot.part) {
            (RoleKind::ActorRollout, RolePart::Train) => {
                Role::Trainer(Box::new(Trainer::from_config(&cfg, rank, world)?))
            }
            (RoleKind::ActorRollout, _) => Role::Rollout(Box::new(Rollout::from_config(&cfg)?)),
            (RoleKind::Ref, _) => Role::Ref(Box::new(RefPolicy::from_config(&cfg)?)),
            (RoleKind::Critic, _) => {
                Role::Critic(Box::new(Critic::from_config(&cfg, rank, world)?))
            }
            (RoleKind::Reward, _) => Role::Reward(Box::new(Reward::from_config(&cfg)?)),
        };
        let (model, num_params, checksum) = match &role {
            Role::Trainer(t) => (src(&t.model), t.model.params().num_params(), t.checksum()?),
            Role::Rollout(r) => (src(&r.model), r.model.params().num_params(), r.checksum()?),
            Role::Ref(r) => (src(&r.model), r.model.params().num_params(), r.checksum()?),
            Role::Critic(c) => (src(&c.model), c.model.params().num_params(), c.checksum()?),
            Role::Reward(w) => match w.as_ref() {
                Reward::Model { model, .. } => (
                    src(model),
                    model.params().num_params(),
                    crate::weights::weights_checksum(model)?,
                ),
                other => (other.describe(), 0, 0),
            },
        };
        self.role = Some(role);
        self.ident = Some(slot);
        Ok(pb::InitRoleResponse {
            model,
            num_params: num_params as u64,
            weights_checksum: checksum,
            device: "cpu".into(),
        })
    }

    pub fn prepare_comm(&mut self, req: &pb::PrepareCommRequest) -> Result<Prepared> {
        let host = self.host.clone();
        self.groups.prepare(
            CommGroup::from_wire(req.group, "PrepareCommRequest.group")?,
            CommBackend::from_wire(req.backend, "PrepareCommRequest.backend")?,
            &host,
        )
    }

    pub fn join_comm(&mut self, req: &pb::JoinCommRequest) -> Result<()> {
        self.groups.join(&JoinSpec {
            group: CommGroup::from_wire(req.group, "JoinCommRequest.group")?,
            backend: CommBackend::from_wire(req.backend, "JoinCommRequest.backend")?,
            rank: req.rank as usize,
            world_size: req.world_size as usize,
            address: req.address.clone(),
            unique_id: req.unique_id.clone(),
            timeout_ms: req.timeout_ms,
        })
    }

    fn world(&self) -> usize {
        self.ident.as_ref().map_or(1, |s| s.world_size as usize)
    }

    /// Runs a batch call; the error names the role, rank and call.
    pub fn batch(&mut self, call: BatchCall, batch: &DataBatch) -> Result<DataBatch> {
        let label = self.label();
        let world = self.world();
        let wrong =
            |label: &str| Error::invalid(format!("{} is not served by {label}", call.name()));
        let out = match (call, self.role()?) {
            (BatchCall::Generate, Role::Rollout(r)) => r.generate(batch),
            (BatchCall::ComputeLogProbs, Role::Trainer(t)) => t.compute_log_probs(batch),
            (BatchCall::ComputeLogProbs, Role::Ref(r)) => r.compute_log_probs(batch),
            (BatchCall::ComputeValues, Role::Critic(c)) => c.compute_values(batch),
            (BatchCall::ComputeScores, Role::Reward(w)) => w.compute_scores(batch),
            (BatchCall::UpdateActor, Role::Trainer(_)) => self.update(call, batch, world),
            (BatchCall::UpdateCritic, Role::Critic(_)) => self.update(call, batch, world),
            _ => Err(wrong(&label)),
        };
        out.with_ctx(|| format!("{label} {}", call.name()))
    }

    fn update(&mut self, call: BatchCall, batch: &DataBatch, world: usize) -> Result<DataBatch> {
        let group = if call == BatchCall::UpdateActor {
            CommGroup::ActorDp
        } else {
            CommGroup::CriticDp
        };
        let comm = self.groups.get(group, world)?;
        let res = match self.role.as_mut() {
            Some(Role::Trainer(t)) => t.update(comm, batch),
            Some(Role::Critic(c)) => c.update(comm, batch),
            _ => Err(Error::internal("update on a role without an optimizer")),
        };
        if matches!(&res, Err(e) if is_collective(e)) {
            self.groups.forget(group);
        }
        res
    }

    pub fn sync_weights(
        &mut self,
        req: &pb::SyncWeightsRequest,
    ) -> Result<pb::SyncWeightsResponse> {
        let label = self.label();
        let group = CommGroup::from_wire(req.group, "SyncWeightsRequest.group")?;
        let bucket = req.bucket_bytes as usize;
        // The weights group has the trainer and at least one rollout rank: never a group
        // of one made on the spot, so a missing JoinComm is reported.
        let comm = self.groups.get(group, 2)?;
        let res = match self.role.as_mut() {
            Some(Role::Trainer(t)) => t.send_weights(comm, req.version, bucket),
            Some(Role::Rollout(r)) => r.recv_weights(comm, req.version, bucket),
            _ => Err(Error::invalid(format!(
                "SyncWeights is served by actor_rollout ranks only, not by {label}"
            ))),
        };
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
        })
    }

    pub fn weights_checksum(&mut self) -> Result<pb::WeightsChecksumResponse> {
        let (checksum, version) = match self.role()? {
            Role::Trainer(t) => (t.checksum()?, t.version),
            Role::Rollout(r) => (r.checksum()?, r.version),
            Role::Ref(r) => (r.checksum()?, 0),
            Role::Critic(c) => (c.checksum()?, c.version),
            Role::Reward(w) => match w.as_ref() {
                Reward::Model { model, .. } => (crate::weights::weights_checksum(model)?, 0),
                _ => (0, 0),
            },
        };
        Ok(pb::WeightsChecksumResponse { checksum, version })
    }

    pub fn save_checkpoint(&mut self, dir: &str) -> Result<Vec<String>> {
        let label = self.label();
        let dir = checkpoint_dir(dir)?;
        match self.role()? {
            Role::Trainer(t) => t.save_checkpoint(dir),
            Role::Critic(c) => c.save_checkpoint(dir),
            _ => Err(Error::invalid(format!(
                "SaveCheckpoint is for trainable roles (actor_rollout train, critic), not {label}"
            ))),
        }
        .with_ctx(|| format!("{label} SaveCheckpoint"))
    }

    pub fn load_checkpoint(&mut self, dir: &str) -> Result<u64> {
        let label = self.label();
        let dir = checkpoint_dir(dir)?;
        match self.role()? {
            Role::Trainer(t) => t.load_checkpoint(dir),
            Role::Critic(c) => c.load_checkpoint(dir),
            _ => Err(Error::invalid(format!(
                "LoadCheckpoint is for trainable roles (actor_rollout train, critic), not {label}"
            ))),
        }
        .with_ctx(|| format!("{label} LoadCheckpoint"))
    }
}

fn checkpoint_dir(dir: &str) -> Result<&Path> {
    if dir.is_empty() {
        return Err(Error::invalid("checkpoint dir is empty"));
    }
    Ok(Path::new(dir))
}

fn src(model: &rlhf_model::Model) -> String {
    model
        .source_dir()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "random".into())
}

fn is_collective(e: &Error) -> bool {
    match e {
        Error::Collective(_) => true,
        Error::Context { source, .. } => is_collective(source),
        _ => false,
    }
}
