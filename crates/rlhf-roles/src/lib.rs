//! PPO role actors: the processes `rlhf-worker actor --kind actor_rollout|ref|critic|reward`
//! runs, each serving `RoleService` (proto/rlhf/v1/role.proto) plus `ActorService` (Ping).
//!
//! A role process owns a [`RoleHost`] on one compute thread: its device, its communicator
//! groups and its engines — [`Trainer`] (trainable policy, PPO update with data-parallel
//! exact loss scaling), [`Rollout`] (generation, receives weights, or shares the trainer's
//! model), [`RefPolicy`], [`Critic`] and [`Reward`] (rules, HTTP, reward model) — each
//! built from the `RoleSpec` the driver resolved. Engines are reached through capability
//! traits ([`engine`]); the trainable ones share the update loop through [`train::Train`].
//! [`server`] is the thin gRPC adapter. The requests and answers of every call are the
//! types of `rlhf_core::calls`.

mod accumulate;
pub mod checkpoint;
pub mod comm;
pub mod convert;
pub mod critic;
pub mod engine;
pub mod error;
pub mod host;
mod hub;
pub mod math_answer;
pub mod mem;
pub mod optim;
pub mod policy;
pub mod rendezvous;
pub mod restore;
pub mod reward;
pub mod saves;
pub mod server;
pub mod spill;
pub mod stages;
pub mod train;
pub mod vllm;
pub mod weights;
pub mod zero;

pub use comm::Groups;
pub use critic::Critic;
pub use engine::{Engine, Generate, LogProbs, Score, Values};
pub use error::{Error, Result};
pub use host::{BatchCall, RoleHost};
pub use policy::{RefPolicy, Rollout, Trainer};
pub use rendezvous::KV_RENDEZVOUS_LOG;
pub use reward::{HttpReward, Reward, Rule};
pub use server::{run, serve, ServeOptions};
pub use stages::{PreferenceTrainer, RewardModelTrainer, SftTrainer};
