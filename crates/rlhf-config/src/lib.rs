//! PPO job configuration and prompt datasets.
//!
//! Configs are hierarchical YAML in MindSpeed-LLM's `ppo_trainer_*.yaml`
//! shape: `defaults` naming model files under `configs/model/`, shared
//! `training` defaults that each role section may override, `resource_pool`,
//! `algorithm` (rlhf-algo's structs), the four roles (`actor_rollout`, `ref`,
//! `critic`, `reward`), and `data`, `checkpoint`, `logging`. [`load`] resolves
//! `defaults`, applies `key.path=value` overrides, rejects unknown keys with
//! the closest valid one, and validates every batch-size and device rule at
//! once. [`PpoConfig::placement_plan`], [`PpoConfig::memory_estimate`] and
//! [`PpoConfig::check_report`] serve `rlhf-head check`.
//!
//! The [`data`] module reads prompt datasets (JSONL, Parquet), applies the
//! prompt-length policy to caller-tokenized lengths, and hands out seeded,
//! resumable batches.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
//! let cfg = rlhf_config::load(&dir, "ppo_tiny", &["actor_rollout.ppo_epochs=3".into()])?;
//! assert_eq!(cfg.actor_rollout.ppo_epochs, 3);
//! let actor = cfg.resolved(rlhf_config::RoleKind::ActorRollout);
//! assert!(actor.micro_batch_size > 0);
//! # Ok(()) }
//! ```

pub mod asynchrony;
mod config;
pub mod data;
pub mod docs;
mod error;
mod fault;
mod load;
mod lora;
mod memory;
mod model;
mod phases;
mod plan;
mod resolve;
mod roles;
pub mod rollout_engine;
pub mod spec;
mod validate;

pub use asynchrony::{AsyncConfig, AsyncMode};
pub use config::{
    ActorRolloutConfig, BadRows, CheckpointConfig, CriticConfig, DataConfig, DataFormat,
    DefaultsEntry, DeviceKind, LogBackend, LoggingConfig, LrDecayStyle, OneOrMany, PpoConfig,
    PromptOverflow, RefConfig, ResourcePool, RewardConfig, RewardKind, RoleKind, TemplateValue,
    TrainerKind, TrainingConfig, TrainingOverrides, RESERVED_CHAT_TEMPLATE_KWARGS,
};
pub use error::{ConfigError, Result};
pub use fault::FaultToleranceConfig;
pub use load::{config_schema, from_bundle, from_yaml_str, load, load_file, load_model};
pub use lora::LoraOptions;
pub use memory::{Collectives, MemoryRow, NCCL_COMM_BYTES};
pub use model::ModelConfig;
pub use phases::Phase;
pub use plan::{Assignment, Plan};
pub use resolve::RoleModel;
pub use rlhf_algo::{AlgorithmConfig, KlCtrlConfig};
pub use rollout_engine::{RolloutEngine, VllmOptions};
pub use spec::{EngineSpec, RewardSpec, RoleSpec, SamplingSpec, Shapes, TrainSpec};
pub use validate::problems;
