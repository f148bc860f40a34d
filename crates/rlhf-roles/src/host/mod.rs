//! `RoleHost`: what one role process's compute thread owns — its device, its communicator
//! groups and one or more engines (a trainer, a rollout, a reference policy, a critic, a
//! reward), each with the `RoleSpec` it was built from. Calls arrive typed (decoded from
//! the wire here, the only place a role process touches a `DataBatch`) and are routed to
//! the engine of the addressed slot through the capability they need.

use std::sync::Arc;

use candle_core::Device;
use rlhf_config::{EngineSpec, RoleSpec};
use rlhf_core::batch::DataBatch;
use rlhf_core::calls::{
    self, ActorUpdateRequest, CriticUpdateRequest, GenerateRequest, LogProbsRequest,
    PreferenceUpdateRequest, RewardModelUpdateRequest, RoleCall, ScoresRequest, SftUpdateRequest,
    ValuesRequest, Wire,
};
use rlhf_core::{CommBackend, CommGroup, DeviceSpec, RoleKind, RolePart, RoleSlot};
use rlhf_model::Model;
use rlhf_proto::v1 as pb;
pub use rlhf_proto::BatchCall;

use crate::comm::{Groups, JoinSpec, Prepared};
use crate::critic::Critic;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::policy::{RefPolicy, Rollout, Trainer};
use crate::reward::Reward;
use crate::stages::{PreferenceTrainer, RewardModelTrainer, SftTrainer};

mod state;
pub(crate) use state::checkpoint_dir;
use state::dp_group;

/// One engine and the spec it was built from.
pub struct Hosted {
    pub spec: RoleSpec,
    pub engine: Engine,
}

/// Everything the compute thread owns.
pub struct RoleHost {
    /// The process kind (`--kind`): every engine's spec must be of this role.
    pub kind: RoleKind,
    /// IP the TCP rendezvous binds on (reachable by the other ranks).
    pub host: String,
    /// Opened by the first engine; every later engine shares it.
    device: Option<(Device, DeviceSpec)>,
    pub engines: Vec<Hosted>,
    pub groups: Groups,
}

/// Opens the device a spec asks for, or refuses: a role placed on a GPU never computes on
/// the CPU in silence. `label` names the role and rank in the error. The note says which
/// physical GPU a `cuda:N` is when the worker bound the process to some.
fn open_device(want: DeviceSpec, label: &str) -> Result<(Device, String)> {
    match want {
        DeviceSpec::Cpu => Ok((Device::Cpu, String::new())),
        DeviceSpec::Cuda { ordinal } => open_cuda(ordinal, label),
        DeviceSpec::Npu { .. } => Err(Error::invalid(format!(
            "{label}: placed on {want}, but this build has no NPU backend; place the job on GPUs or CPUs (resource_pool.device)"
        ))),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: u32, label: &str) -> Result<(Device, String)> {
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into());
    match Device::new_cuda(ordinal as usize) {
        Ok(d) => Ok((
            d,
            format!("computing on cuda:{ordinal} (CUDA_VISIBLE_DEVICES={visible})"),
        )),
        Err(e) => {
            let e = e.to_string();
            let e = e.lines().next().unwrap_or_default();
            Err(Error::invalid(format!(
                "{label}: cannot open cuda:{ordinal} (CUDA_VISIBLE_DEVICES={visible}): {e}; check the NVIDIA driver with nvidia-smi on this node and that the GPU index exists"
            )))
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: u32, label: &str) -> Result<(Device, String)> {
    Err(Error::invalid(format!(
        "{label}: placed on cuda:{ordinal}, but this rlhf-worker was built without the `cuda` feature and would compute on the CPU; rebuild it with `cargo build --release -p rlhf-worker --features cuda`, or run the job on CPUs with resource_pool.device=CPU"
    )))
}

impl RoleHost {
    pub fn new(kind: RoleKind, host: &str) -> Self {
        Self {
            kind,
            host: host.to_string(),
            device: None,
            engines: Vec::new(),
            groups: Groups::new(),
        }
    }

    fn label(&self) -> String {
        if self.engines.is_empty() {
            return format!("{} (not initialised)", self.kind);
        }
        let labels: Vec<String> = self.engines.iter().map(|h| h.spec.slot.label()).collect();
        labels.join(" + ")
    }

    /// The device engines compute on (opened for `want` by the first engine), with the note
    /// of opening it; `label` names the engine in errors.
    pub fn device(&mut self, want: DeviceSpec, label: &str) -> Result<(Device, String)> {
        if let Some((d, actual)) = &self.device {
            if *actual != want {
                return Err(Error::invalid(format!(
                    "{label} asks for {want}, but this process computes on {actual}"
                )));
            }
            return Ok((d.clone(), String::new()));
        }
        let (d, note) = open_device(want, label)?;
        self.device = Some((d.clone(), want));
        Ok((d, note))
    }

    /// Builds the engine a spec describes on this host's device and adds it. Returns the
    /// note of opening the device (which GPU; empty on the CPU or when already open). A
    /// device this build or machine cannot open is an error, never a silent CPU fallback.
    pub fn add(&mut self, spec: RoleSpec) -> Result<String> {
        self.check_new(&spec)?;
        let (device, note) = self.device(spec.device, &spec.slot.label())?;
        let engine = match &spec.engine {
            EngineSpec::Trainer { .. } => Engine::Trainer(Box::new(Trainer::new(&spec, &device)?)),
            EngineSpec::Rollout { .. } => Engine::Rollout(Box::new(Rollout::new(&spec, &device)?)),
            EngineSpec::Ref { .. } => Engine::Ref(Box::new(RefPolicy::new(&spec, &device)?)),
            EngineSpec::Critic { .. } => Engine::Critic(Box::new(Critic::new(&spec, &device)?)),
            EngineSpec::Reward(_) => Engine::Reward(Box::new(Reward::new(&spec, &device)?)),
            EngineSpec::Sft { .. } => Engine::Sft(Box::new(SftTrainer::new(&spec, &device)?)),
            EngineSpec::Preference { .. } => {
                Engine::Preference(Box::new(PreferenceTrainer::new(&spec, &device)?))
            }
            EngineSpec::RewardModel { .. } => {
                Engine::RewardModel(Box::new(RewardModelTrainer::new(&spec, &device)?))
            }
        };
        self.engines.push(Hosted { spec, engine });
        Ok(note)
    }

    /// Adds an engine that computes with the model of the engine already serving `of`: a
    /// rollout that generates with its trainer's weights (the hybrid engine: no second copy,
    /// no weight sync), or the reference as a LoRA trainer's base with its adapters off.
    pub fn add_sharing(&mut self, spec: RoleSpec, of: RoleSlot) -> Result<()> {
        self.check_new(&spec)?;
        let model: Arc<Model> = self
            .engines
            .iter()
            .find(|h| h.spec.slot == of)
            .and_then(|h| h.engine.model())
            .cloned()
            .ok_or_else(|| {
                Error::invalid(format!("no engine with a model serves {}", of.label()))
            })?;
        let engine = match &spec.engine {
            EngineSpec::Ref { .. } => Engine::Ref(Box::new(RefPolicy::sharing(&spec, model)?)),
            _ => Engine::Rollout(Box::new(Rollout::sharing(&spec, model)?)),
        };
        self.engines.push(Hosted { spec, engine });
        Ok(())
    }

    fn check_new(&self, spec: &RoleSpec) -> Result<()> {
        spec.slot.validate()?;
        if !self.hosts(spec) {
            return Err(Error::invalid(format!(
                "InitRole for role '{}' sent to a '{}' actor process",
                spec.slot.kind, self.kind
            )));
        }
        if self.engines.iter().any(|h| h.spec.slot == spec.slot) {
            return Err(Error::invalid(format!(
                "{} is already initialised; InitRole runs once per slot",
                spec.slot.label()
            )));
        }
        Ok(())
    }

    /// Whether this process can host the engine of `spec`: one of its own role, or one that
    /// computes with the model of one of its engines (the reference of a LoRA actor).
    fn hosts(&self, spec: &RoleSpec) -> bool {
        spec.slot.kind == self.kind || spec.shares_model_of.is_some_and(|of| of.kind == self.kind)
    }

    pub fn init(&mut self, req: &pb::InitRoleRequest) -> Result<pb::InitRoleResponse> {
        let kind = RoleKind::from_wire(req.role, "InitRoleRequest.role")?;
        let spec = RoleSpec::from_json(&req.spec)?;
        if kind != spec.slot.kind || !self.hosts(&spec) {
            return Err(Error::invalid(format!(
                "InitRole for role '{kind}' sent to a '{}' actor process",
                self.kind
            )));
        }
        let spec = crate::hub::resolve_hub_names(spec)?;
        let slot = spec.slot;
        let note = match spec.shares_model_of {
            Some(of) => {
                self.add_sharing(spec, of)?;
                match slot.kind {
                    RoleKind::Ref => {
                        format!("the LoRA base of {} (adapters off, no copy)", of.label())
                    }
                    _ => format!("generates with the weights of {} (colocated)", of.label()),
                }
            }
            None => self.add(spec)?,
        };
        let hosted = self
            .engines
            .last()
            .ok_or_else(|| Error::internal("the engine just added is gone"))?;
        let (model, num_params, checksum) = match (hosted.engine.model(), &hosted.engine) {
            (Some(m), _) => (
                src(m),
                match m.zero3() {
                    // The whole model's count, not this rank's pieces.
                    Some(z) => z.sizes()?.1 as u64,
                    None => m.params().num_params() as u64,
                },
                crate::weights::weights_checksum(m)?,
            ),
            (None, Engine::Reward(r)) => (r.describe(), 0, 0),
            (None, _) => (slot.label(), 0, 0),
        };
        let actual = self.device.as_ref().map_or(DeviceSpec::Cpu, |(_, d)| *d);
        Ok(pb::InitRoleResponse {
            model,
            num_params,
            weights_checksum: checksum,
            device: Some(actual.to_wire()),
            note,
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
        let group = CommGroup::from_wire(req.group, "JoinCommRequest.group")?;
        if !self.engines.is_empty() && !self.engines.iter().any(|h| h.spec.comms.contains(&group)) {
            return Err(Error::invalid(format!(
                "{} does not join the {group} group (its spec lists: {:?})",
                self.label(),
                self.engines
                    .iter()
                    .flat_map(|h| h.spec.comms.iter().map(|g| g.as_str()))
                    .collect::<Vec<_>>()
            )));
        }
        self.groups.join(&JoinSpec {
            group,
            backend: CommBackend::from_wire(req.backend, "JoinCommRequest.backend")?,
            rank: req.rank as usize,
            world_size: req.world_size as usize,
            address: req.address.clone(),
            unique_id: req.unique_id.clone(),
            timeout_ms: req.timeout_ms,
            secret: req.secret.clone(),
        })
    }

    /// The index of the engine a call goes to: the batch's target slot when it names one,
    /// else the only engine that can serve the call.
    fn route(&self, call: BatchCall, target: Option<(RoleKind, RolePart)>) -> Result<usize> {
        let serves = |e: &Engine| match call {
            BatchCall::Generate => e.as_generate().is_some(),
            BatchCall::ComputeLogProbs => e.as_log_probs().is_some(),
            BatchCall::ComputeValues => e.as_values().is_some(),
            BatchCall::ComputeScores => e.as_score().is_some(),
            BatchCall::UpdateActor => matches!(e, Engine::Trainer(_)),
            BatchCall::UpdateCritic => matches!(e, Engine::Critic(_)),
            BatchCall::UpdateSft => matches!(e, Engine::Sft(_)),
            BatchCall::UpdatePreference => matches!(e, Engine::Preference(_)),
            BatchCall::UpdateRewardModel => matches!(e, Engine::RewardModel(_)),
        };
        if self.engines.is_empty() {
            return Err(Error::invalid(format!(
                "the {} actor is not initialised; call InitRole first",
                self.kind
            )));
        }
        let found: Vec<usize> = self
            .engines
            .iter()
            .enumerate()
            .filter(|(_, h)| serves(&h.engine))
            .filter(|(_, h)| {
                target.is_none_or(|(k, p)| h.spec.slot.kind == k && h.spec.slot.part == p)
            })
            .map(|(i, _)| i)
            .collect();
        match found[..] {
            [i] => Ok(i),
            [] => Err(Error::invalid(format!(
                "{} is not served by {}",
                call.name(),
                self.label()
            ))),
            _ => Err(Error::invalid(format!(
                "{} is served by several engines of {}; the batch must name its target",
                call.name(),
                self.label()
            ))),
        }
    }

    /// `actor_rollout.offload`: a colocated trainer's optimizer state leaves the device while
    /// the device generates; its next update brings it back.
    fn offload_before_generate(&mut self) -> Result<()> {
        for h in &mut self.engines {
            if let (true, Engine::Trainer(t)) = (h.spec.offload, &mut h.engine) {
                let bytes = t.state.optim.opt.offload()?;
                if bytes > 0 {
                    tracing::debug!(
                        "{}: optimizer state to host memory for generation ({bytes} bytes)",
                        h.spec.slot.label()
                    );
                }
            }
        }
        Ok(())
    }

    /// A rollout generating with a trainer's own weights (the hybrid engine) samples with
    /// the trainer's current version: no sync ever sets it.
    fn share_trainer_version(&mut self) {
        let trainer = self.engines.iter().find_map(|h| match &h.engine {
            Engine::Trainer(t) => Some((Arc::clone(&t.state.model), t.state.version)),
            _ => None,
        });
        let Some((model, version)) = trainer else {
            return;
        };
        for h in &mut self.engines {
            if let Engine::Rollout(r) = &mut h.engine {
                if Arc::ptr_eq(&r.model, &model) {
                    r.version = version;
                }
            }
        }
    }

    /// Runs a batch call from the wire; the error names the engine and the call, and when
    /// the device ran out of memory, the settings that make the call fit.
    pub fn batch(&mut self, call: BatchCall, batch: &DataBatch) -> Result<DataBatch> {
        let label = self.label();
        self.batch_inner(call, batch).map_err(|e| {
            let what = format!("{label} {}", call.name());
            if e.is_out_of_memory() {
                e.context(format!("{what}: {}", out_of_memory_remedy(call)))
            } else {
                e.context(what)
            }
        })
    }

    fn batch_inner(&mut self, call: BatchCall, batch: &DataBatch) -> Result<DataBatch> {
        if batch.len()? == 0 {
            return Err(Error::invalid(format!(
                "the {} batch has no rows; send at least one (the driver pads shards to the rank count)",
                call.name()
            )));
        }
        let i = self.route(call, calls::target(batch)?)?;
        if call == BatchCall::Generate {
            self.offload_before_generate()?;
            self.share_trainer_version();
        }
        fn req<R: RoleCall>(b: &DataBatch) -> Result<R> {
            Ok(R::from_batch(R::CALL, b)?)
        }
        let rank = self.engines[i].spec.slot.rank;
        let world = self.engines[i].spec.slot.world_size as usize;
        let kind = self.engines[i].spec.slot.kind;
        let micro = self.engines[i].spec.micro_batch_rows;
        let engine = &mut self.engines[i].engine;
        let unserved = || Error::internal("routed to an engine without the capability");
        let infer = |engine: &Engine| -> Result<DataBatch> {
            Ok(match call {
                BatchCall::ComputeLogProbs => engine
                    .as_log_probs()
                    .ok_or_else(unserved)?
                    .log_probs(&req::<LogProbsRequest>(batch)?)?
                    .to_batch()?,
                BatchCall::ComputeValues => engine
                    .as_values()
                    .ok_or_else(unserved)?
                    .values(&req::<ValuesRequest>(batch)?)?
                    .to_batch()?,
                BatchCall::ComputeScores => engine
                    .as_score()
                    .ok_or_else(unserved)?
                    .score(&req::<ScoresRequest>(batch)?)?
                    .to_batch()?,
                _ => return Err(unserved()),
            })
        };
        let out = match call {
            BatchCall::Generate => engine
                .as_generate()
                .ok_or_else(unserved)?
                .generate(rank, &req::<GenerateRequest>(batch)?)?
                .to_batch()?,
            BatchCall::ComputeLogProbs | BatchCall::ComputeValues | BatchCall::ComputeScores => {
                match engine.model().filter(|m| m.zero3().is_some()).cloned() {
                    None => infer(engine)?,
                    // ZeRO-3: the model gathers from its data-parallel group at every call.
                    Some(model) => {
                        // The calls the rows take: every engine computes in micro-batches of
                        // its spec's rows (a reference sharing a LoRA trainer's model too).
                        let micro = micro.max(1);
                        let planned = batch.len()?.div_ceil(micro);
                        let group = dp_group(kind);
                        let comm = self.groups.get(group, world)?;
                        let res = crate::zero::lockstep(&model, comm, planned, call.name(), || {
                            infer(engine)
                        });
                        if matches!(&res, Err(e) if is_collective(e)) {
                            self.groups.forget(group);
                        }
                        res?
                    }
                }
            }
            BatchCall::UpdateActor
            | BatchCall::UpdateCritic
            | BatchCall::UpdateSft
            | BatchCall::UpdatePreference
            | BatchCall::UpdateRewardModel => {
                let group = dp_group(kind);
                let comm = self.groups.get(group, world)?;
                let res = match engine {
                    Engine::Trainer(t) => t.update(comm, &req::<ActorUpdateRequest>(batch)?),
                    Engine::Critic(c) => c.update(comm, &req::<CriticUpdateRequest>(batch)?),
                    Engine::Sft(t) => t.update(comm, &req::<SftUpdateRequest>(batch)?),
                    Engine::Preference(t) => {
                        t.update(comm, &req::<PreferenceUpdateRequest>(batch)?)
                    }
                    Engine::RewardModel(t) => {
                        t.update(comm, &req::<RewardModelUpdateRequest>(batch)?)
                    }
                    _ => Err(unserved()),
                };
                if matches!(&res, Err(e) if is_collective(e)) {
                    self.groups.forget(group);
                }
                res?.to_batch()?
            }
        };
        Ok(out)
    }
}

fn src(model: &Model) -> String {
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

/// What to change when `call` ran out of device memory.
pub fn out_of_memory_remedy(call: BatchCall) -> String {
    let what = match call {
        BatchCall::Generate => {
            "the rollout batch and its KV cache did not fit: lower training.global_batch_size or \
             actor_rollout.num_samples_per_step (the rollout batch is their product, split over \
             the rollout ranks) or actor_rollout.max_response_length, use training.bf16=true, or \
             under resource_pool.colocate set actor_rollout.offload=true to move the trainer's \
             optimizer state off the device while it generates"
        }
        BatchCall::ComputeLogProbs | BatchCall::ComputeValues | BatchCall::ComputeScores => {
            "a forward pass did not fit: lower training.micro_batch_size or set \
             training.logits_chunk_size, or use training.bf16=true"
        }
        _ => {
            "a training pass did not fit: lower training.micro_batch_size, set \
             training.gradient_checkpointing=true and training.logits_chunk_size, use \
             training.bf16=true, LoRA, or ZeRO (training.zero_stage)"
        }
    };
    format!("the device ran out of memory; {what} (`rlhf-head check` estimates each role's peak)")
}
