//! `RoleSpec`: everything one role rank needs, resolved once by the driver from the job
//! config and sent in `InitRole`. Role processes never parse the job config, so a value is
//! derived in exactly one place (here): model and tokenizer directories, shapes, seeds, the
//! rank's share of a mini-batch, the optimizer and its schedule length, losses, sampling,
//! the reward source, the device and the communicator groups.

use std::path::{Path, PathBuf};

use rlhf_algo::{PolicyLossConfig, ValueLossConfig};
use rlhf_core::{CommGroup, DeviceSpec, RoleKind, RolePart, RoleSlot};
use rlhf_types::DType;
use serde::{Deserialize, Serialize};

use crate::config::{DeviceKind, PpoConfig, RewardKind, TrainerKind, TrainingConfig};
use crate::error::{ConfigError, Result};

/// Sequence geometry of a job: prompts left-padded to `prompt_len`, responses
/// right-padded to `response_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shapes {
    pub prompt_len: usize,
    pub response_len: usize,
}

impl Shapes {
    pub fn seq_len(&self) -> usize {
        self.prompt_len + self.response_len
    }
}

/// How a trainable engine updates: optimizer, schedule and the walk over its shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainSpec {
    /// The role's resolved `training` section (lr, betas, eps, decay, schedule, clipping).
    pub optimizer: TrainingConfig,
    /// Optimizer steps per PPO step (epochs x mini-batches): the schedule spans
    /// `train_iters * steps_per_iter` of them.
    pub steps_per_iter: usize,
    pub epochs: usize,
    /// This rank's rows of a global mini-batch (global / ranks).
    pub mini_batch_rows: usize,
    pub shuffle: bool,
}

impl TrainSpec {
    /// `epochs` over a rollout of `rollout` rows in global mini-batches of `mini.0` rows
    /// (config key `mini.1`), each split over `world` ranks.
    fn new(
        optimizer: &TrainingConfig,
        rollout: usize,
        epochs: u32,
        mini: (u32, &str),
        world: u32,
        shuffle: bool,
    ) -> Result<Self> {
        let (global, key) = mini;
        Ok(Self {
            optimizer: optimizer.clone(),
            steps_per_iter: epochs as usize * (rollout / global.max(1) as usize).max(1),
            epochs: epochs as usize,
            mini_batch_rows: rank_rows(global, world, key)?,
            shuffle,
        })
    }
}

/// How the rollout samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingSpec {
    /// 0 means greedy.
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: usize,
}

/// Where scores come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "source", rename_all = "snake_case")]
pub enum RewardSpec {
    /// A built-in rule by name (`reward.rule`), with the `math` rule's scores of a wrong
    /// answer and of none.
    Rule {
        rule: String,
        #[serde(default)]
        format_score: f64,
        #[serde(default)]
        no_answer_score: f64,
    },
    /// An HTTP endpoint.
    Http { url: String, timeout_s: f64 },
    /// A reward model at the spec's `model_dir`.
    Model,
}

/// What the rank computes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "engine", rename_all = "snake_case")]
pub enum EngineSpec {
    /// actor_rollout train: old log-probs and the PPO update.
    Trainer {
        train: TrainSpec,
        loss: PolicyLossConfig,
        /// Log-prob temperature: the sampling temperature, 1 when greedy.
        temperature: f64,
    },
    /// actor_rollout infer: generation; receives weights.
    Rollout {
        sampling: SamplingSpec,
        /// Temperature of its teacher-forced log-probs: the trainer's (the sampling
        /// temperature, 1 when greedy).
        temperature: f64,
        /// Generate with a vLLM server of these settings instead of the candle loop.
        #[serde(default)]
        vllm: Option<crate::VllmOptions>,
    },
    /// The frozen reference policy.
    Ref {
        temperature: f64,
    },
    /// The value model and its update.
    Critic {
        train: TrainSpec,
        loss: ValueLossConfig,
    },
    Reward(RewardSpec),
    /// `trainer: sft`: the policy trained on completion tokens (actor_rollout train ranks).
    Sft {
        train: TrainSpec,
    },
    /// `trainer: dpo`: the policy trained on preference pairs with a DPO-family loss.
    Preference {
        train: TrainSpec,
        loss: rlhf_algo::PreferenceConfig,
    },
    /// `trainer: reward`: a reward model (score head) trained on preference pairs.
    RewardModel {
        train: TrainSpec,
        center_rewards_coefficient: Option<f64>,
    },
}

/// One rank's resolved spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoleSpec {
    pub slot: RoleSlot,
    pub device: DeviceSpec,
    /// Compute dtype (`training.bf16`): BF16 means mixed precision for a trained engine (f32
    /// master weights and optimizer state) and bf16 weights for a frozen one.
    pub dtype: DType,
    /// Activation checkpointing per decoder layer (`training.gradient_checkpointing`).
    #[serde(default)]
    pub gradient_checkpointing: bool,
    /// Tokens per LM-head chunk for log-probs (`training.logits_chunk_size`; `None`: whole).
    #[serde(default)]
    pub logits_chunk: Option<usize>,
    /// A colocated actor trainer moves its optimizer state to host memory before each
    /// generation (`actor_rollout.offload`).
    #[serde(default)]
    pub offload: bool,
    /// The HF directory to load (absolute), or a Hugging Face repo id the role process
    /// resolves through its node's HF cache; `None` for rule and HTTP rewards.
    pub model_dir: Option<PathBuf>,
    /// Where the tokenizer files are (copied into checkpoints; EOS / pad ids for sampling):
    /// a directory or, like `model_dir`, a repo id.
    pub tokenizer_dir: Option<PathBuf>,
    pub shapes: Shapes,
    pub seed: u64,
    /// Rows per forward (inference) and per accumulation step (training).
    pub micro_batch_rows: usize,
    /// LoRA adapters this engine trains or serves (`actor_rollout.lora`, `critic.lora`);
    /// `None`: the full model.
    #[serde(default)]
    pub lora: Option<crate::LoraOptions>,
    /// The communicator groups this rank joins.
    pub comms: Vec<CommGroup>,
    /// Under the hybrid engine (`resource_pool.colocate`), the trainer slot whose process hosts this rollout
    /// rank and whose model it generates with (the hybrid engine: no copy, no sync).
    #[serde(default)]
    pub shares_model_of: Option<RoleSlot>,
    pub engine: EngineSpec,
}

fn invalid(msg: String) -> ConfigError {
    ConfigError::Spec(msg)
}

/// The HF directory of a role's model, checked.
/// Where the tokenizer is: `training.tokenizer_name_or_path`, else `model_dir` (the role's
/// model; the driver passes the actor's). One rule for the driver and every role.
pub fn tokenizer_dir(cfg: &PpoConfig, model_dir: Option<&std::path::Path>) -> Option<PathBuf> {
    cfg.training
        .tokenizer_name_or_path
        .as_deref()
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| model_dir.map(PathBuf::from))
}

/// The role's model: an HF model directory, checked to hold a `config.json`, or a Hugging
/// Face repo id (`owner/name[@revision]`, when no such directory exists), passed on as it is
/// for the role process to resolve through its own node's HF cache
/// (`rlhf_model::hub`). Nothing is looked up or downloaded here.
pub fn model_dir(cfg: &PpoConfig, role: RoleKind) -> Result<PathBuf> {
    let m = cfg.role_model(role).ok_or_else(|| {
        invalid(format!(
            "{role} has no model in the config (set {role}.model, or actor_rollout.model)"
        ))
    })?;
    let dir = m.path.unwrap_or_else(|| PathBuf::from(&m.name));
    if !dir.join("config.json").is_file() {
        if let Some(id) = dir.to_str().filter(|s| is_repo_id_not_dir(s)) {
            return Ok(PathBuf::from(id));
        }
        return Err(invalid(format!(
            "{role} model '{}' is not an HF model directory ({} has no config.json) nor a \
             Hugging Face repo id (owner/name)",
            m.name,
            dir.display()
        )));
    }
    Ok(dir)
}

/// Whether a model path is a Hub repo id rather than a local directory.
pub fn is_repo_id_not_dir(spec: &str) -> bool {
    rlhf_hub::is_repo_id(spec) && !Path::new(spec).exists()
}

/// A global mini-batch split over `world` ranks.
fn rank_rows(global: u32, world: u32, key: &str) -> Result<usize> {
    let world = world.max(1);
    if global == 0 || !global.is_multiple_of(world) {
        return Err(invalid(format!(
            "{key} ({global}) must be a positive multiple of the number of ranks ({world})"
        )));
    }
    Ok((global / world) as usize)
}

impl RoleSpec {
    /// The spec of `slot` in a job, on a device of the pool's kind (each rank sees its
    /// bundle's device as ordinal 0).
    pub fn resolve(cfg: &PpoConfig, slot: RoleSlot) -> Result<Self> {
        slot.validate()
            .map_err(|e| invalid(format!("role slot: {e}")))?;
        let kind = slot.kind;
        let t = cfg.resolved(kind);
        let a = &cfg.actor_rollout;
        let shapes = Shapes {
            prompt_len: a.max_prompt_length as usize,
            response_len: a.max_response_length as usize,
        };
        if shapes.prompt_len == 0 || shapes.response_len == 0 {
            return Err(invalid(format!(
                "actor_rollout.max_prompt_length ({}) and max_response_length ({}) must be > 0",
                shapes.prompt_len, shapes.response_len
            )));
        }
        let device = match cfg.resource_pool.device {
            DeviceKind::Cpu => DeviceSpec::Cpu,
            DeviceKind::Gpu => DeviceSpec::Cuda { ordinal: 0 },
            DeviceKind::Npu => DeviceSpec::Npu { ordinal: 0 },
        };
        let rollout = cfg.rollout_batch_size().max(1) as usize;
        let logprob_temperature = if a.temperature > 0.0 && a.temperature.is_finite() {
            a.temperature
        } else {
            1.0
        };
        // The other stages: one optimizer step per step over `training.global_batch_size`
        // examples or pairs, split over the ranks.
        let stage_train = || {
            TrainSpec::new(
                &t,
                t.global_batch_size as usize,
                1,
                (t.global_batch_size, "training.global_batch_size"),
                slot.world_size,
                false,
            )
        };
        let (engine, comms) = match (cfg.trainer, kind, slot.part) {
            (TrainerKind::Sft, RoleKind::ActorRollout, RolePart::Train) => (
                EngineSpec::Sft {
                    train: stage_train()?,
                },
                vec![CommGroup::ActorDp],
            ),
            (TrainerKind::Dpo, RoleKind::ActorRollout, RolePart::Train) => (
                EngineSpec::Preference {
                    train: stage_train()?,
                    loss: cfg.algorithm.preference(),
                },
                vec![CommGroup::ActorDp],
            ),
            (TrainerKind::Reward, RoleKind::Reward, _) => (
                EngineSpec::RewardModel {
                    train: stage_train()?,
                    center_rewards_coefficient: cfg.algorithm.center_rewards_coefficient,
                },
                vec![CommGroup::RewardDp],
            ),
            (TrainerKind::Sft | TrainerKind::Dpo | TrainerKind::Reward, _, RolePart::Infer) => {
                return Err(invalid(format!(
                    "trainer {} has no rollout ranks; {} is not part of it",
                    cfg.trainer,
                    slot.label()
                )))
            }
            (_, RoleKind::ActorRollout, RolePart::Train) => {
                let mut comms = vec![CommGroup::ActorDp];
                if slot.rank == 0 && !cfg.hybrid_engine() {
                    comms.push(CommGroup::Weights);
                }
                let train = TrainSpec::new(
                    &t,
                    rollout,
                    a.ppo_epochs,
                    (a.ppo_mini_batch_size, "actor_rollout.ppo_mini_batch_size"),
                    slot.world_size,
                    a.shuffle_minibatch,
                )?;
                let engine = EngineSpec::Trainer {
                    train,
                    loss: a.policy_loss(),
                    temperature: logprob_temperature,
                };
                (engine, comms)
            }
            (_, RoleKind::ActorRollout, _) => {
                let sampling = SamplingSpec {
                    temperature: if a.do_sample { a.temperature } else { 0.0 },
                    top_p: a.top_p,
                    top_k: a.top_k as usize,
                };
                let comms = if cfg.hybrid_engine() {
                    vec![]
                } else {
                    vec![CommGroup::Weights]
                };
                (
                    EngineSpec::Rollout {
                        sampling,
                        temperature: logprob_temperature,
                        vllm: (a.engine == crate::RolloutEngine::Vllm).then(|| a.vllm.clone()),
                    },
                    comms,
                )
            }
            (_, RoleKind::Ref, _) => (
                EngineSpec::Ref {
                    temperature: logprob_temperature,
                },
                vec![],
            ),
            (_, RoleKind::Critic, _) => {
                let c = &cfg.critic;
                let train = TrainSpec::new(
                    &t,
                    rollout,
                    c.critic_update_epochs,
                    (c.critic_mini_batch_size, "critic.critic_mini_batch_size"),
                    slot.world_size,
                    c.shuffle_minibatch,
                )?;
                let engine = EngineSpec::Critic {
                    train,
                    loss: c.value_loss(),
                };
                (engine, vec![CommGroup::CriticDp])
            }
            (_, RoleKind::Reward, _) => {
                let r = &cfg.reward;
                let spec = match r.kind {
                    RewardKind::Rule => RewardSpec::Rule {
                        rule: r.rule.clone(),
                        format_score: r.format_score,
                        no_answer_score: r.no_answer_score,
                    },
                    RewardKind::Http => RewardSpec::Http {
                        url: r.url.clone(),
                        timeout_s: r.timeout_s,
                    },
                    RewardKind::Model => RewardSpec::Model,
                };
                (EngineSpec::Reward(spec), vec![])
            }
        };
        let model_dir = match &engine {
            EngineSpec::Reward(RewardSpec::Rule { .. } | RewardSpec::Http { .. }) => None,
            _ => Some(model_dir(cfg, kind)?),
        };
        let tokenizer_dir = tokenizer_dir(cfg, model_dir.as_deref());
        // A role without a model (rule or HTTP reward) computes nothing on a device and is
        // placed without one: it must not try to open the pool's device kind.
        let device = if model_dir.is_some() {
            device
        } else {
            DeviceSpec::Cpu
        };
        Ok(Self {
            slot,
            device,
            dtype: if t.bf16 { DType::BF16 } else { DType::F32 },
            gradient_checkpointing: t.gradient_checkpointing,
            logits_chunk: match t.logits_chunk_size {
                0 => None,
                n => Some(n as usize),
            },
            offload: cfg.actor_rollout.offload
                && kind == RoleKind::ActorRollout
                && slot.part == RolePart::Train,
            model_dir,
            tokenizer_dir,
            shapes,
            seed: t.seed,
            micro_batch_rows: t.micro_batch_size.max(1) as usize,
            lora: match kind {
                RoleKind::ActorRollout => cfg.actor_rollout.lora.active().cloned(),
                RoleKind::Critic => cfg.critic.lora.active().cloned(),
                _ => None,
            },
            comms,
            shares_model_of: ((cfg.hybrid_engine()
                && kind == RoleKind::ActorRollout
                && slot.part == RolePart::Infer)
                || (kind == RoleKind::Ref && cfg.ref_in_trainer()))
            .then_some(RoleSlot {
                kind: RoleKind::ActorRollout,
                part: RolePart::Train,
                rank: slot.rank,
                world_size: a.num_gpus_for_train.max(1),
            }),
            engine,
        })
    }

    /// The model directory, or an error naming the rank when the spec has none.
    pub fn model_dir(&self) -> Result<&Path> {
        self.model_dir.as_deref().ok_or_else(|| {
            invalid(format!(
                "{}: the spec has no model directory",
                self.slot.label()
            ))
        })
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn from_json(s: &str) -> Result<Self> {
        let spec: Self = serde_json::from_str(s).map_err(|e| {
            invalid(format!(
                "InitRole spec is not a RoleSpec of this version ({e}); are the driver and the \
                 worker the same release?"
            ))
        })?;
        // Every engine splits its rows by this; the driver sends micro_batch_size, at least 1.
        if spec.micro_batch_rows == 0 {
            return Err(invalid(
                "InitRole spec: micro_batch_rows is 0; it must be at least 1 (the role's micro_batch_size)"
                    .into(),
            ));
        }
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> PpoConfig {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let mut cfg = crate::load(&dir, "ppo_tiny", &[]).unwrap();
        cfg.absolutize_paths(&dir.join(".."));
        cfg
    }

    fn slot(kind: RoleKind, part: RolePart, rank: u32, world: u32) -> RoleSlot {
        RoleSlot {
            kind,
            part,
            rank,
            world_size: world,
        }
    }

    #[test]
    fn specs_resolve_each_value_once_and_survive_json() {
        let cfg = tiny();
        let t =
            RoleSpec::resolve(&cfg, slot(RoleKind::ActorRollout, RolePart::Train, 0, 2)).unwrap();
        let EngineSpec::Trainer { train, .. } = &t.engine else {
            panic!("{t:?}")
        };
        // ppo_tiny: 8 prompts x 2 samples, mini-batch 8 over 2 ranks, 2 epochs.
        assert_eq!(train.mini_batch_rows, 4);
        assert_eq!(train.steps_per_iter, 4);
        assert_eq!(t.comms, vec![CommGroup::ActorDp, CommGroup::Weights]);
        assert!(t.model_dir().unwrap().join("config.json").is_file());
        assert_eq!(t.tokenizer_dir, t.model_dir);
        assert_eq!(RoleSpec::from_json(&t.to_json()).unwrap(), t);

        let r1 =
            RoleSpec::resolve(&cfg, slot(RoleKind::ActorRollout, RolePart::Train, 1, 2)).unwrap();
        assert_eq!(r1.comms, vec![CommGroup::ActorDp]);
        let reward =
            RoleSpec::resolve(&cfg, slot(RoleKind::Reward, RolePart::Whole, 0, 1)).unwrap();
        assert!(matches!(
            reward.engine,
            EngineSpec::Reward(RewardSpec::Rule { .. })
        ));
        assert_eq!(reward.model_dir, None);
        assert_eq!(RoleSpec::from_json(&reward.to_json()).unwrap(), reward);
    }

    /// In a GPU pool every role with a model computes on its GPU; a rule reward, placed
    /// without a device, must not open one (it failed on a real GPU node with
    /// CUDA_ERROR_NO_DEVICE before).
    #[test]
    fn gpu_pools_put_only_roles_with_a_model_on_the_gpu() {
        let mut cfg = tiny();
        cfg.resource_pool.device = DeviceKind::Gpu;
        let actor =
            RoleSpec::resolve(&cfg, slot(RoleKind::ActorRollout, RolePart::Train, 0, 1)).unwrap();
        assert_eq!(actor.device, DeviceSpec::Cuda { ordinal: 0 });
        let reward =
            RoleSpec::resolve(&cfg, slot(RoleKind::Reward, RolePart::Whole, 0, 1)).unwrap();
        assert_eq!(reward.device, DeviceSpec::Cpu);
    }

    /// With LoRA on the actor the reference shares the trainer rank's model (adapters off);
    /// without it, or with a reference model of its own, it loads its own.
    #[test]
    fn a_lora_actors_reference_shares_the_trainer() {
        let mut cfg = tiny();
        let reference = |c: &PpoConfig| {
            RoleSpec::resolve(c, slot(RoleKind::Ref, RolePart::Whole, 0, 1))
                .unwrap()
                .shares_model_of
        };
        assert_eq!(reference(&cfg), None);
        cfg.actor_rollout.lora.rank = 8;
        let of = reference(&cfg).expect("shares the trainer's model");
        assert_eq!(
            (of.kind, of.part, of.rank),
            (RoleKind::ActorRollout, RolePart::Train, 0)
        );
        let train =
            RoleSpec::resolve(&cfg, slot(RoleKind::ActorRollout, RolePart::Train, 0, 1)).unwrap();
        assert_eq!(train.lora.as_ref().map(|l| l.rank), Some(8));
        cfg.ref_.model = "acme/other-ref".into();
        assert_eq!(reference(&cfg), None);
    }

    #[test]
    fn bad_specs_name_the_key() {
        let cfg = tiny();
        let err = RoleSpec::resolve(&cfg, slot(RoleKind::ActorRollout, RolePart::Train, 0, 3))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("actor_rollout.ppo_mini_batch_size (8)"),
            "{err}"
        );
        let err = RoleSpec::resolve(&cfg, slot(RoleKind::Critic, RolePart::Train, 0, 1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot run part 'train'"), "{err}");
        let mut missing = cfg.clone();
        missing.critic.model = "/nonexistent/critic".into();
        let err = RoleSpec::resolve(&missing, slot(RoleKind::Critic, RolePart::Whole, 0, 1))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("/nonexistent/critic") && err.contains("config.json"),
            "{err}"
        );
        let mut by_id = cfg.clone();
        by_id.critic.model = "acme/critic@v1".into();
        by_id.actor_rollout.model = "acme/actor".into();
        by_id.ref_.model = String::new(); // the actor's
        let critic =
            RoleSpec::resolve(&by_id, slot(RoleKind::Critic, RolePart::Whole, 0, 1)).unwrap();
        assert_eq!(critic.model_dir, Some(PathBuf::from("acme/critic@v1")));
        let reference =
            RoleSpec::resolve(&by_id, slot(RoleKind::Ref, RolePart::Whole, 0, 1)).unwrap();
        assert_eq!(reference.model_dir, Some(PathBuf::from("acme/actor")));
        let mut bad = cfg.clone();
        bad.critic.model = "a/b/c".into();
        let err = RoleSpec::resolve(&bad, slot(RoleKind::Critic, RolePart::Whole, 0, 1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("a/b/c") && err.contains("repo id"), "{err}");
        let err = RoleSpec::from_json("{\"slot\": 3}")
            .unwrap_err()
            .to_string();
        assert!(err.contains("same release"), "{err}");
        // A spec no engine can split rows by (it would panic the role process's compute
        // thread at its first batch) is refused at InitRole.
        let mut zero =
            RoleSpec::resolve(&cfg, slot(RoleKind::Critic, RolePart::Whole, 0, 1)).unwrap();
        zero.micro_batch_rows = 0;
        let err = RoleSpec::from_json(&zero.to_json())
            .unwrap_err()
            .to_string();
        assert!(err.contains("micro_batch_rows is 0"), "{err}");
    }
}
