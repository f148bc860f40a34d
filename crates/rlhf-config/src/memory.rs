//! Per-device memory estimate of each role, and the `check` report.
//!
//! Formulas (bytes, per device; `P` parameters, `b` bytes per element of the
//! role's activations: 2 with `bf16`, else 4; `s` = max_prompt_length +
//! max_response_length; `mb` the role's micro batch; `h`, `L`, `a`, `V` the
//! model's hidden size, layers, heads and vocabulary; `c` the LM-head chunk,
//! `training.logits_chunk_size`, 0 meaning `mb·s`):
//!
//! * weights: frozen roles `P·b`; trained roles `4·P` (f32 weights, the master
//!   copy under bf16) plus, with `bf16`, `2·P` for the bf16 copy the forward
//!   computes with and backward keeps;
//! * gradients (trained roles): `4·P` (f32, like the weights they update), twice that when
//!   a rank's mini-batch takes more than one micro-batch: the running sum and the next
//!   micro-batch's gradients exist together (candle's backward returns a whole new set);
//! * optimizer (AdamW): `2·4·P` for the two f32 moments;
//! * KV cache (rollout ranks): `L · 2 · kv_heads · head_dim · s · B · b` with
//!   `B` = rollout batch / `num_gpus_for_infer`;
//! * activations, training: `L · mb·s·h · (34 + 5·a·s/h) · b/2` (Korthikanti
//!   et al. 2022, no flash attention); with `gradient_checkpointing` only each
//!   layer's input is kept, `L · mb·s·h·b`, plus one layer's full term for the
//!   recompute; plus `3 · min(c, mb·s) · V · 4` for one chunk's f32 logits, its
//!   log-softmax and its gradient (none for a value model);
//! * activations, forward only: one layer's worth of the training term plus
//!   `2 · min(c, mb·s) · V · 4` (none for a value model); rollout ranks: the
//!   prefill of `B` prompts through one layer plus `B·V·4` for the last-token
//!   logits.
//!
//! With LoRA (`actor_rollout.lora`, `critic.lora`; `A` adapter parameters, `r·(in + out)`
//! per adapted linear layer, plus the critic's value head) a trained role holds the frozen
//! base at `P·b` and trains only `A`: weights `P·b` plus the trained-weight terms of `A`,
//! gradients `4·A`, optimizer `8·A`; a reference served by the LoRA actor's trainers (its
//! base, adapters off) holds nothing of its own.
//!
//! ZeRO stages 1 and 2 divide the optimizer (and, for 2, the summed gradient) by the `N`
//! data-parallel ranks. Stage 3 divides the weights and the summed gradient too, and adds
//! what a pass holds whole (`E` the edge parameters: embeddings, final norm, heads; `Ly`
//! one layer's): the edges and a layer at the trained-weight terms (the frozen base's at
//! `b` with LoRA) and their f32 gradients (of what trains), the next layer gathered ahead,
//! the all-gather's buffer of every rank's pieces as sent (`(E + Ly)·b`) and the
//! reduce-scatter's f32 buffer of what trains. Held against the measured peak of two
//! stage-3 ranks, with and without LoRA, in rlhf-roles' `memory_estimate_zero3*` tests.
//!
//! A rollout rank that generates with vLLM (`actor_rollout.engine: vllm`) holds the received
//! copy (`P·b`, which each sync publishes) beside vLLM: on a GPU vLLM takes
//! `gpu_memory_utilization` of the device (its weights, activations and KV cache), on the CPU
//! its weights `P·b`, `kv_cache_gb` and the prefill.
//!
//! NCCL's own device memory ([`Collectives::Nccl`], `rlhf-head check --comm-backend nccl`):
//! [`NCCL_COMM_BYTES`] (1 GiB) for every NCCL communicator a rank holds on a GPU, counted for
//! groups of more than one rank (a group of one opens none): a trainer rank its data-parallel
//! group (`actor_dp`, `critic_dp`) and, for the actor's trainer rank 0 and every rollout rank,
//! the `weights` group when the rollout has processes of its own; so the actor's rank 0 may
//! hold two. The weights group uses NCCL only when its ranks span nodes (on one node the
//! weights go by shared memory and CUDA IPC): counting it is the upper bound. Where 1 GiB
//! comes from: NCCL allocates per channel and per peer connection a buffer for each
//! protocol, `NCCL_BUFFSIZE` (4 MiB, Simple) plus LL128 (about 4.6 MiB) and LL (about
//! 0.25 MiB); with up to 32 channels on NVLink machines and two ring peers that is
//! 32 · 2 · ~9 MiB ≈ 0.56 GiB, plus its work queues, proxy buffers and the tree and collnet
//! connections; issue #56 puts the total at 1-2 GB per communicator, more with NVLS on
//! NVSwitch machines (`NCCL_NVLS_ENABLE=0` turns that off). 1 GiB is the planning figure,
//! not a bound; lower `NCCL_BUFFSIZE` / `NCCL_MAX_NCHANNELS` shrink it.
//!
//! These are rough upper-ish bounds for planning, not allocator-exact numbers.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::config::{PpoConfig, RewardKind, RoleKind};
use crate::model::{mul, ModelConfig};

const GIB: f64 = (1u64 << 30) as f64;

/// Device bytes counted per NCCL communicator a rank holds (see the module docs for where
/// the number comes from).
pub const NCCL_COMM_BYTES: u64 = 1 << 30;

/// The collectives library the job's communicator groups use, which decides whether they
/// hold device memory of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Collectives {
    /// TCP or shared memory: host buffers only, nothing on the device.
    #[default]
    Host,
    /// NCCL (`--comm-backend nccl`): each communicator of more than one rank holds
    /// [`NCCL_COMM_BYTES`] on its GPU.
    Nccl,
}

/// Estimated bytes per device for one role (or one kind of rank of a role).
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryRow {
    /// Role name, with the rank kind for the actor (`actor_rollout/train`).
    pub label: String,
    /// The role.
    pub role: RoleKind,
    /// Model name, or why there is none.
    pub model: String,
    /// Parameters counted.
    pub params: u64,
    /// Weight bytes.
    pub weights: u64,
    /// Gradient bytes.
    pub gradients: u64,
    /// Optimizer-state bytes.
    pub optimizer: u64,
    /// KV-cache bytes.
    pub kv_cache: u64,
    /// Activation bytes.
    pub activations: u64,
    /// Device bytes of the NCCL communicators the rank holds ([`Collectives::Nccl`]).
    pub comm: u64,
}

impl MemoryRow {
    /// Sum of all parts.
    pub fn total(&self) -> u64 {
        [
            self.gradients,
            self.optimizer,
            self.kv_cache,
            self.activations,
            self.comm,
        ]
        .iter()
        .fold(self.weights, |a, &x| a.saturating_add(x))
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / GIB
}

impl PpoConfig {
    /// Per-device memory estimate of every enabled role whose architecture
    /// is known (from `defaults` or the model directory's `config.json`).
    /// Roles without a known architecture are listed with zero bytes.
    pub fn memory_estimate(&self) -> Vec<MemoryRow> {
        self.memory_estimate_with(Collectives::Host)
    }

    /// The NCCL communicators (groups of more than one rank) a GPU rank of `label` holds.
    fn nccl_comms(&self, label: &str) -> u64 {
        let a = &self.actor_rollout;
        let group = |ranks: u32| u64::from(ranks > 1);
        // Rollout ranks of their own receive the weights through the `weights` group, with
        // the actor's trainer rank 0.
        let weights = u64::from(
            self.trainer == crate::TrainerKind::Ppo
                && !self.resource_pool.colocate
                && a.num_gpus_for_infer > 0,
        );
        match label {
            "actor_rollout/train" => group(a.num_gpus_for_train) + weights,
            "actor_rollout/infer" => weights,
            "critic" => group(self.resource_pool.critic),
            "reward" if self.trainer == crate::TrainerKind::Reward => {
                group(self.resource_pool.reward)
            }
            _ => 0,
        }
    }

    /// [`Self::memory_estimate`] with the communicators' device memory of `collectives`.
    pub fn memory_estimate_with(&self, collectives: Collectives) -> Vec<MemoryRow> {
        let mut rows = self.memory_estimate_host();
        if collectives == Collectives::Nccl && self.resource_pool.device == crate::DeviceKind::Gpu {
            for r in &mut rows {
                if r.params > 0 {
                    r.comm = self.nccl_comms(&r.label).saturating_mul(NCCL_COMM_BYTES);
                }
            }
        }
        rows
    }

    fn memory_estimate_host(&self) -> Vec<MemoryRow> {
        let a = &self.actor_rollout;
        let s = u64::from(a.max_prompt_length) + u64::from(a.max_response_length);
        let mut rows = Vec::new();
        for role in RoleKind::ALL {
            if !self.role_enabled(role) {
                continue;
            }
            let t = self.resolved(role);
            let b: u64 = if t.bf16 { 2 } else { 4 };
            let mb = u64::from(t.micro_batch_size);
            let chunk = match u64::from(t.logits_chunk_size) {
                0 => mul(&[mb, s]),
                c => c.min(mul(&[mb, s])),
            };
            let trained =
                |p: u64| mul(&[p, 4]).saturating_add(if t.bf16 { mul(&[p, 2]) } else { 0 });
            // ZeRO-3 recomputes every layer in its backward: checkpointed whatever the key.
            let checkpointed = t.gradient_checkpointing || t.zero_stage >= 3;
            let train_act = |arch: &ModelConfig, lm_head: bool| {
                let layers = if checkpointed {
                    mul(&[arch.num_hidden_layers, mb, s, arch.hidden_size, b])
                        .saturating_add(layer_activations(arch, mb, s, b))
                } else {
                    mul(&[arch.num_hidden_layers, layer_activations(arch, mb, s, b)])
                };
                let head = if lm_head {
                    mul(&[3, chunk, arch.vocab_size, 4])
                } else {
                    0
                };
                layers.saturating_add(head)
            };
            let model = self.role_model(role);
            let empty = |label: &str, why: String| MemoryRow {
                comm: 0,
                label: label.to_string(),
                role,
                model: why,
                params: 0,
                weights: 0,
                gradients: 0,
                optimizer: 0,
                kv_cache: 0,
                activations: 0,
            };
            let Some(m) = model else {
                let why = match self.reward.kind {
                    RewardKind::Rule => format!("rule '{}'", self.reward.rule),
                    RewardKind::Http => format!("http {}", self.reward.url),
                    RewardKind::Model => "no model".into(),
                };
                rows.push(empty(role.as_str(), why));
                continue;
            };
            let Some(arch) = m.arch else {
                rows.push(empty(
                    role.as_str(),
                    format!("{} (architecture unknown: no config.json yet)", m.name),
                ));
                continue;
            };
            // AdamW's two f32 moments; with `zero_stage` 1 to 3 each data-parallel rank holds
            // its share of them.
            let dp = match role {
                RoleKind::ActorRollout => a.num_gpus_for_train,
                RoleKind::Critic => self.resource_pool.critic,
                RoleKind::Reward => self.resource_pool.reward,
                RoleKind::Ref => 1,
            };
            let shards = if t.zero_stage >= 1 {
                u64::from(dp.max(1))
            } else {
                1
            };
            // Rows of one optimizer step on a rank against the micro-batch.
            let mini = match (self.trainer, role) {
                (crate::TrainerKind::Ppo, RoleKind::ActorRollout) => a.ppo_mini_batch_size,
                (crate::TrainerKind::Ppo, RoleKind::Critic) => self.critic.critic_mini_batch_size,
                _ => t.global_batch_size,
            };
            let grad_copies = if u64::from(mini) / u64::from(dp.max(1)) > mb {
                2
            } else {
                1
            };
            // ZeRO stage 2 reduce-scatters every micro-batch's gradient at once: one whole
            // gradient while the backward runs, and this rank's share of the sum.
            let gradients = |p: u64| {
                if t.zero_stage >= 2 && shards > 1 {
                    mul(&[p, 4]).saturating_add(mul(&[p, 4]).div_ceil(shards))
                } else {
                    mul(&[p, 4, grad_copies])
                }
            };
            // `offload_optimizer` keeps them in host memory: none on the device (nor with
            // ZeRO-3's `offload_params`, whose pieces AdamW steps on the host).
            let offloaded = t.offload_optimizer || (t.offload_params && t.zero_stage >= 3);
            let on_device = if offloaded { 0 } else { 8 };
            let optimizer = |p: u64| mul(&[on_device, p]).div_ceil(shards);
            // Weights and the parameters that train: all of them, or LoRA's adapters (plus
            // `head` trained parameters) over a frozen base held at `b` bytes.
            let split = |p: u64, lora: &crate::LoraOptions, head: u64| match lora.active() {
                Some(l) => {
                    let trained_p = arch
                        .lora_params(u64::from(l.rank), &l.target_modules)
                        .saturating_add(head);
                    (mul(&[p, b]).saturating_add(trained(trained_p)), trained_p)
                }
                None => (trained(p), p),
            };
            // ZeRO stage 3: each rank holds its share of the weights and of the summed
            // gradient, plus what a pass gathers whole: the `edges` (embeddings, final norm,
            // LM, value or score head) for the call and one decoder layer, each with its
            // gradient during the backward. With LoRA (`tp` parameters train, `head` of them
            // outside the layers) the frozen base is sharded too, at `b` bytes, and only the
            // adapters and the head have gradients.
            let heads = if arch.tie_word_embeddings { 1 } else { 2 };
            let lm_edges =
                mul(&[heads, arch.vocab_size, arch.hidden_size]).saturating_add(arch.hidden_size);
            // The embeddings, the final norm and the value or score head with its bias.
            let value_edges = mul(&[arch.vocab_size, arch.hidden_size])
                .saturating_add(mul(&[arch.hidden_size, 2]))
                .saturating_add(1);
            let zero3 = |p: u64, edges: u64, lora: Option<(u64, u64)>| -> Option<(u64, u64)> {
                if t.zero_stage < 3 || shards <= 1 {
                    return None;
                }
                let layers = arch.num_hidden_layers.max(1);
                let layer = p.saturating_sub(edges) / layers;
                let whole = edges.saturating_add(layer);
                // What trains (`tp`, of it a layer's and the edges'), and the bytes a frozen
                // parameter takes: everything trains, or a layer's adapters and the head over
                // a base held at `b` bytes.
                let (tp, frozen, layer_trained, edges_trained) = match lora {
                    Some((tp, head)) => (tp, b, tp.saturating_sub(head) / layers, head),
                    None => (p, 0, layer, edges),
                };
                let whole_trained = layer_trained.saturating_add(edges_trained);
                // `offload_params`: the pieces and their summed gradients are in host memory.
                let (pieces, piece_grads) = if t.offload_params {
                    (0, 0)
                } else {
                    (
                        mul(&[p, frozen])
                            .saturating_add(trained(tp))
                            .div_ceil(shards),
                        mul(&[tp, 4]).div_ceil(shards),
                    )
                };
                // Gathered whole for a pass: the edges and a layer, and the layer after it
                // gathered ahead (the prefetch).
                let gathered = mul(&[whole, frozen]).saturating_add(trained(whole_trained));
                let ahead = mul(&[layer, frozen]).saturating_add(trained(layer_trained));
                // Transients of the collectives (zero3/mod.rs): an all-gather holds every
                // rank's pieces as sent (`b` bytes a value) while it decodes them into whole
                // tensors, and a reduce-scatter a whole f32 buffer of what trains.
                let sent = mul(&[whole, b]);
                let scatter = mul(&[whole_trained, 4]);
                Some((
                    pieces
                        .saturating_add(gathered)
                        .saturating_add(ahead)
                        .saturating_add(sent),
                    piece_grads
                        .saturating_add(mul(&[whole_trained, 4]))
                        .saturating_add(scatter),
                ))
            };
            match role {
                RoleKind::ActorRollout => {
                    let p = arch.lm_params();
                    let (weights, tp) = split(p, &a.lora, 0);
                    let lora = a.lora.is_on().then_some((tp, 0));
                    let (weights, grads) =
                        zero3(p, lm_edges, lora).unwrap_or((weights, gradients(tp)));
                    rows.push(MemoryRow {
                        comm: 0,
                        label: "actor_rollout/train".into(),
                        role,
                        model: m.name.clone(),
                        params: p,
                        weights,
                        gradients: grads,
                        optimizer: optimizer(tp),
                        kv_cache: 0,
                        activations: train_act(&arch, true),
                    });
                    if self.trainer != crate::TrainerKind::Ppo {
                        // The other stages have no rollout ranks.
                        continue;
                    }
                    let adapters = if a.lora.is_on() { tp } else { 0 };
                    let infer = u64::from(a.num_gpus_for_infer.max(1));
                    let batch = self.rollout_batch_size().div_ceil(infer);
                    let kv = mul(&[
                        arch.num_hidden_layers,
                        2,
                        arch.kv_heads(),
                        arch.head_dim(),
                        s,
                        batch,
                        b,
                    ]);
                    let prefill =
                        layer_activations(&arch, batch, u64::from(a.max_prompt_length), b)
                            .saturating_add(mul(&[batch, arch.vocab_size, 4]));
                    // The base plus the adapters the sync sends, in the same dtype.
                    let received = mul(&[p.saturating_add(adapters), b]);
                    // With vLLM: the received copy, which each sync publishes to vLLM, plus
                    // vLLM: on a GPU it takes its gpu_memory_utilization share of the device
                    // (weights, activations and KV cache within it); on the CPU its
                    // weights, its KV cache space and the prefill.
                    let (model, weights, kv, activations) = match a.engine {
                        crate::RolloutEngine::Candle => (m.name, received, kv, prefill),
                        crate::RolloutEngine::Vllm => {
                            let served = mul(&[p, b]);
                            let (kv, act) = if self.resource_pool.device == crate::DeviceKind::Gpu {
                                let share = a.vllm.gpu_memory_utilization
                                    * self.resource_pool.device_memory_gb
                                    * GIB;
                                ((share as u64).saturating_sub(served), 0)
                            } else {
                                ((f64::from(a.vllm.kv_cache_gb) * GIB) as u64, prefill)
                            };
                            let model = format!("{} (vllm)", m.name);
                            (model, received.saturating_add(served), kv, act)
                        }
                    };
                    rows.push(MemoryRow {
                        comm: 0,
                        // The colocated phases look the rollout row up by this label.
                        label: "actor_rollout/infer".into(),
                        role,
                        model,
                        params: p,
                        weights,
                        gradients: 0,
                        optimizer: 0,
                        kv_cache: kv,
                        activations,
                    });
                }
                RoleKind::Ref if self.ref_in_trainer() => {
                    rows.push(empty(
                        RoleKind::Ref.as_str(),
                        "served by actor_rollout/train: its LoRA base, adapters off".into(),
                    ));
                }
                RoleKind::Ref => {
                    let p = arch.lm_params();
                    rows.push(MemoryRow {
                        comm: 0,
                        label: RoleKind::Ref.to_string(),
                        role,
                        model: m.name,
                        params: p,
                        weights: mul(&[p, b]),
                        gradients: 0,
                        optimizer: 0,
                        kv_cache: 0,
                        activations: layer_activations(&arch, mb, s, b).saturating_add(mul(&[
                            2,
                            chunk,
                            arch.vocab_size,
                            4,
                        ])),
                    });
                }
                RoleKind::Critic => {
                    let p = arch.value_params();
                    let head = arch.hidden_size.saturating_add(1);
                    let (weights, tp) = split(p, &self.critic.lora, head);
                    let lora = self.critic.lora.is_on().then_some((tp, head));
                    let (weights, grads) =
                        zero3(p, value_edges, lora).unwrap_or((weights, gradients(tp)));
                    rows.push(MemoryRow {
                        comm: 0,
                        label: RoleKind::Critic.to_string(),
                        role,
                        model: m.name,
                        params: p,
                        weights,
                        gradients: grads,
                        optimizer: optimizer(tp),
                        kv_cache: 0,
                        activations: train_act(&arch, false),
                    });
                }
                RoleKind::Reward if self.trainer == crate::TrainerKind::Reward => {
                    // A reward model in training: trained like the critic (no LoRA here).
                    let p = arch.value_params();
                    let (weights, grads) =
                        zero3(p, value_edges, None).unwrap_or((trained(p), gradients(p)));
                    rows.push(MemoryRow {
                        comm: 0,
                        label: RoleKind::Reward.to_string(),
                        role,
                        model: m.name,
                        params: p,
                        weights,
                        gradients: grads,
                        optimizer: optimizer(p),
                        kv_cache: 0,
                        activations: train_act(&arch, false),
                    });
                }
                RoleKind::Reward => {
                    let p = arch.value_params();
                    rows.push(MemoryRow {
                        comm: 0,
                        label: RoleKind::Reward.to_string(),
                        role,
                        model: m.name,
                        params: p,
                        weights: mul(&[p, b]),
                        gradients: 0,
                        optimizer: 0,
                        kv_cache: 0,
                        activations: layer_activations(&arch, mb, s, b),
                    });
                }
            }
        }
        rows
    }

    /// The rows a device's memory budget is judged on: the roles' rows, or under
    /// `resource_pool.colocate` the phases of one shared device.
    fn budget_rows(&self, collectives: Collectives) -> Vec<MemoryRow> {
        if self.resource_pool.colocate {
            self.colocated_phases_with(collectives)
        } else {
            self.memory_estimate_with(collectives)
        }
    }

    /// Rows whose estimate exceeds `resource_pool.device_memory_gb` ([`Self::budget_rows`]).
    pub fn memory_warnings(&self) -> Vec<String> {
        self.memory_warnings_with(Collectives::Host)
    }

    /// [`Self::memory_warnings`] with the communicators' device memory of `collectives`.
    pub fn memory_warnings_with(&self, collectives: Collectives) -> Vec<String> {
        let cap = self.resource_pool.device_memory_gb;
        self.budget_rows(collectives)
            .iter()
            .filter(|r| gib(r.total()) > cap)
            .map(|r| {
                format!(
                    "WARNING: {} needs about {:.1} GiB per device but resource_pool.device_memory_gb is {cap}; \
                     lower micro_batch_size / lengths / the rollout batch, use bf16, or give the role more devices",
                    r.label,
                    gib(r.total())
                )
            })
            .collect()
    }

    /// What `rlhf-head check` prints, the answer first: the verdict (fits or not, with the
    /// largest phase against the device memory and the placement's shortfall), the placement
    /// plan on `nodes` (or why it fails), the memory table and fit warnings, and, with
    /// `show_config`, the resolved config's sections this job's trainer uses.
    pub fn check_report(
        &self,
        nodes: &[(String, BTreeMap<String, f64>)],
        show_config: bool,
    ) -> String {
        self.check_report_with(nodes, show_config, Collectives::Host)
    }

    /// [`Self::check_report`] for a job whose groups use `collectives`: with NCCL the table
    /// has an `nccl` column and the verdict counts it.
    pub fn check_report_with(
        &self,
        nodes: &[(String, BTreeMap<String, f64>)],
        show_config: bool,
        collectives: Collectives,
    ) -> String {
        let mut out = String::new();
        let cap = self.resource_pool.device_memory_gb;
        let device = self.resource_pool.device.resource();
        let rows = self.budget_rows(collectives);
        let plan = self.placement_plan(nodes);
        let largest = rows.iter().max_by(|a, b| a.total().cmp(&b.total()));
        let over: Vec<String> = rows
            .iter()
            .filter(|r| gib(r.total()) > cap)
            .map(|r| format!("{} needs {:.2} GiB per {device}", r.label, gib(r.total())))
            .collect();
        let _ = writeln!(out, "# verdict");
        match (&plan, over.is_empty()) {
            (Ok(_), true) => {
                let _ = write!(out, "fits: every role is placed and fits its devices");
                if let Some(r) = largest {
                    let _ = write!(
                        out,
                        "; the largest phase is {} at {:.2} of {cap} GiB per {device}",
                        r.label,
                        gib(r.total())
                    );
                }
                let _ = writeln!(out);
            }
            _ => {
                let _ = writeln!(out, "does not fit:");
                if let Err(e) = &plan {
                    let _ = writeln!(out, "- placement: {e}");
                }
                for o in &over {
                    let _ = writeln!(
                        out,
                        "- memory: {o}, more than resource_pool.device_memory_gb ({cap})"
                    );
                }
            }
        }
        let _ = writeln!(out, "\n# placement plan");
        match &plan {
            Ok(plan) => out.push_str(&plan.to_string()),
            Err(e) => {
                let _ = writeln!(out, "ERROR: {e}");
            }
        }
        let _ = writeln!(
            out,
            "\n# memory estimate per device (GiB; formulas in rlhf-config's memory module docs)"
        );
        let nccl = collectives == Collectives::Nccl;
        let _ = writeln!(
            out,
            "{:<20} {:>8} {:>8} {:>8} {:>8} {:>8} {}{:>8}  model",
            "role",
            "weights",
            "grads",
            "optim",
            "kv",
            "activ",
            if nccl {
                format!("{:>8} ", "nccl")
            } else {
                String::new()
            },
            "total"
        );
        for r in self
            .memory_estimate_with(collectives)
            .into_iter()
            .chain(self.colocated_phases_with(collectives))
        {
            let _ = writeln!(
                out,
                "{:<20} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {}{:>8.2}  {}",
                r.label,
                gib(r.weights),
                gib(r.gradients),
                gib(r.optimizer),
                gib(r.kv_cache),
                gib(r.activations),
                if nccl {
                    format!("{:>8.2} ", gib(r.comm))
                } else {
                    String::new()
                },
                gib(r.total()),
                r.model
            );
        }
        if nccl {
            let _ = writeln!(
                out,
                "nccl: {:.0} GiB per NCCL communicator of more than one rank (NCCL's buffers and state; see the memory module docs)",
                gib(NCCL_COMM_BYTES)
            );
        }
        let _ = writeln!(
            out,
            "device memory: {cap} GiB per {device} (resource_pool.device_memory_gb)"
        );
        for w in self.memory_warnings_with(collectives) {
            let _ = writeln!(out, "{w}");
        }
        for (name, m) in &self.models {
            let _ = writeln!(out, "model '{name}': {} parameters (LM)", m.lm_params());
        }
        if show_config {
            let _ = writeln!(
                out,
                "\n# resolved config (the sections a {} job uses)",
                self.trainer.as_str()
            );
            out.push_str(&self.to_yaml_used());
        } else {
            let _ = writeln!(out, "\n(the resolved config: add --show-config)");
        }
        out
    }
}

/// One layer's activations for `batch` sequences of `s` tokens.
fn layer_activations(m: &ModelConfig, batch: u64, s: u64, b: u64) -> u64 {
    let h = m.hidden_size;
    // (34·s·b·h + 5·a·s²·b) bytes at 16 bit; scale by b/2 for other dtypes.
    let per_token = mul(&[34, h]).saturating_add(mul(&[5, m.num_attention_heads, s]));
    mul(&[batch, s, per_token, b]) / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_sizes_saturate_instead_of_wrapping() {
        let m: ModelConfig = serde_json::from_value(serde_json::json!({
            "hidden_size": 1u64 << 40, "intermediate_size": 1u64 << 40,
            "num_hidden_layers": 1u64 << 40, "num_attention_heads": 1u64 << 20,
            "vocab_size": 1u64 << 40, "max_position_embeddings": 1u64 << 40,
        }))
        .unwrap();
        assert_eq!(m.lm_params(), u64::MAX);
        assert_eq!(layer_activations(&m, u64::MAX, u64::MAX, 4), u64::MAX / 2);
    }

    #[test]
    fn a_vllm_rollout_counts_its_server_beside_the_received_copy() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let infer = |o: &[&str]| {
            let o: Vec<String> = o.iter().map(|s| s.to_string()).collect();
            let cfg = crate::load(&dir, "ppo_qwen25_05b", &o).unwrap();
            cfg.memory_estimate()
                .into_iter()
                .find(|r| r.label.starts_with("actor_rollout/infer"))
                .unwrap()
        };
        let candle = infer(&[]);
        let gpu = infer(&[
            "actor_rollout.engine=vllm",
            "actor_rollout.vllm.gpu_memory_utilization=0.4",
        ]);
        assert!(gpu.model.ends_with("(vllm)"), "{}", gpu.model);
        // The received copy and vLLM's own copy of the weights.
        assert_eq!(gpu.weights, 2 * candle.weights);
        // vLLM's share of the 80 GiB device in all, its weights inside it.
        let share = (0.4 * 80.0 * GIB) as u64;
        assert_eq!(gpu.total(), candle.weights + share);
        let cpu = infer(&[
            "resource_pool.device=CPU",
            "actor_rollout.engine=vllm",
            "actor_rollout.vllm.kv_cache_gb=2",
        ]);
        assert_eq!(cpu.kv_cache, 2 * (1 << 30));
        assert_eq!(cpu.weights, 2 * candle.weights);
    }
}
