//! Per-phase memory peaks of a colocated job (`resource_pool.colocate`), for `check`.
//!
//! When every role shares the same devices, the per-role rows of the memory estimate no
//! longer answer "does it fit": one device holds a rank of every role at once. The role
//! processes stay loaded for the whole run, so their weights, gradients and optimizer state
//! are resident in every phase (the colocated rollout generates with its trainer's weights:
//! they are counted once); what changes between phases is the transient part:
//!
//! * generate: the rollout's KV cache and prefill activations;
//! * forward: the forward activations of the old log-probs (the actor's model, as large as
//!   the reference's), the reference log-probs and the reward model's scores, which run
//!   together;
//! * train: the actor's and the critic's training activations, which run together.
//!
//! With `actor_rollout.offload` the actor's optimizer state (and its gradients, which live
//! only inside an update) are off the device while it generates.
//!
//! One device is assumed to host one rank of every role (exact when every role has as many
//! ranks as the pool has devices, an overestimate otherwise).

use crate::config::PpoConfig;
use crate::memory::{Collectives, MemoryRow};
use crate::RoleKind;

/// The phases of a PPO step whose peaks differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Generate,
    Forward,
    Train,
}

impl Phase {
    pub const ALL: [Phase; 3] = [Phase::Generate, Phase::Forward, Phase::Train];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Generate => "generate",
            Phase::Forward => "forward",
            Phase::Train => "train",
        }
    }
}

impl PpoConfig {
    /// Under `resource_pool.colocate`, what one device holds at the peak of each phase
    /// (labelled `colocated/<phase>`); empty otherwise.
    pub fn colocated_phases(&self) -> Vec<MemoryRow> {
        self.colocated_phases_with(Collectives::Host)
    }

    /// [`Self::colocated_phases`] with the communicators' device memory of `collectives`
    /// (every role's, as one device hosts a rank of each).
    pub fn colocated_phases_with(&self, collectives: Collectives) -> Vec<MemoryRow> {
        if !self.resource_pool.colocate {
            return Vec::new();
        }
        let rows = self.memory_estimate_with(collectives);
        // The hybrid engine's rollout generates with the trainer's weights; rollout
        // processes of their own hold a copy.
        let hybrid = self.hybrid_engine();
        let row = |label: &str| rows.iter().find(|r| r.label == label);
        let act = |label: &str| row(label).map_or(0, |r| r.activations);
        let sum = |f: fn(&MemoryRow) -> u64| {
            rows.iter()
                .filter(|r| !(hybrid && r.label == "actor_rollout/infer"))
                .fold(0u64, |a, r| a.saturating_add(f(r)))
        };
        let (weights, gradients, optimizer, comm) = (
            sum(|r| r.weights),
            sum(|r| r.gradients),
            sum(|r| r.optimizer),
            sum(|r| r.comm),
        );
        let actor_train = row("actor_rollout/train");
        let offloaded = |f: fn(&MemoryRow) -> u64| {
            if self.actor_rollout.offload {
                actor_train.map_or(0, f)
            } else {
                0
            }
        };
        let reference = RoleKind::Ref.to_string();
        let reward = RoleKind::Reward.to_string();
        let critic = RoleKind::Critic.to_string();
        Phase::ALL
            .iter()
            .map(|&phase| {
                let (kv_cache, activations) = match phase {
                    Phase::Generate => (
                        row("actor_rollout/infer").map_or(0, |r| r.kv_cache),
                        act("actor_rollout/infer"),
                    ),
                    Phase::Forward => (
                        0,
                        act(&reference)
                            .saturating_mul(2)
                            .saturating_add(act(&reward)),
                    ),
                    Phase::Train => (0, act("actor_rollout/train").saturating_add(act(&critic))),
                };
                MemoryRow {
                    comm,
                    label: format!("colocated/{}", phase.as_str()),
                    role: RoleKind::ActorRollout,
                    model: "every role on one device".into(),
                    params: rows
                        .iter()
                        .filter(|r| !(hybrid && r.label == "actor_rollout/infer"))
                        .map(|r| r.params)
                        .sum(),
                    weights,
                    gradients: if phase == Phase::Generate {
                        gradients.saturating_sub(offloaded(|r| r.gradients))
                    } else {
                        gradients
                    },
                    optimizer: if phase == Phase::Generate {
                        optimizer.saturating_sub(offloaded(|r| r.optimizer))
                    } else {
                        optimizer
                    },
                    kv_cache,
                    activations,
                }
            })
            .collect()
    }
}
