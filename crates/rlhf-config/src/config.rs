//! Typed config sections.
//!
//! Key names follow MindSpeed-LLM's `ppo_trainer_*.yaml` (sections, role names,
//! `num_gpus_for_train`, `critic_mini_batch_size`, ...) and, inside
//! `algorithm`, verl / TRL through `rlhf_algo`'s structs. Every section takes
//! defaults for missing keys; unknown keys are rejected by the loader's schema
//! check (see [`crate::load`]) before these structs are deserialized.

use std::collections::BTreeMap;
use std::path::PathBuf;

use rlhf_algo::AlgorithmConfig;
pub use rlhf_core::RoleKind;
use serde::{Deserialize, Serialize};

use crate::fault::FaultToleranceConfig;
use crate::model::ModelConfig;
pub use crate::roles::{ActorRolloutConfig, CriticConfig, RefConfig, RewardConfig, RewardKind};

/// Defines [`TrainingConfig`] (every key with its default) and
/// [`TrainingOverrides`] (the same keys, all optional, for role sections) from
/// one list, so the two can never disagree.
macro_rules! training_keys {
    ($( $(#[doc = $doc:literal])+ $name:ident : $ty:ty = $default:expr ),+ $(,)?) => {
        /// Shared training defaults (`training.*`); each role section may
        /// override any of these keys.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields, default)]
        pub struct TrainingConfig {
            $( $(#[doc = $doc])+ pub $name: $ty, )+
        }

        impl Default for TrainingConfig {
            fn default() -> Self {
                Self { $( $name: $default, )+ }
            }
        }

        /// Role-level overrides of [`TrainingConfig`] keys (unset = inherit).
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
        #[serde(default)]
        pub struct TrainingOverrides {
            $(
                $(#[doc = $doc])+
                #[serde(skip_serializing_if = "Option::is_none")]
                pub $name: Option<$ty>,
            )+
        }

        impl TrainingConfig {
            /// Names of every training key, in declaration order.
            pub const KEYS: &'static [&'static str] = &[$(stringify!($name)),+];

            /// One-line docs of the training keys, by name.
            pub fn key_docs() -> Vec<(&'static str, String)> {
                vec![$( (stringify!($name), [$($doc.trim()),+].join(" ")) ),+]
            }

            /// These defaults with a role's overrides applied.
            pub fn merged(&self, o: &TrainingOverrides) -> TrainingConfig {
                TrainingConfig {
                    $( $name: o.$name.clone().unwrap_or_else(|| self.$name.clone()), )+
                }
            }
        }
    };
}

training_keys! {
    /// Sequences per forward/backward pass on one rank.
    micro_batch_size: u32 = 1,
    /// Prompts per PPO step; the rollout batch is this times `actor_rollout.num_samples_per_step`.
    global_batch_size: u32 = 8,
    /// Longest prompt + response sequence a role processes, in tokens.
    seq_length: u32 = 1024,
    /// Number of PPO steps to run.
    train_iters: u64 = 100,
    /// Peak learning rate.
    lr: f64 = 1e-6,
    /// Floor of the learning-rate schedule.
    min_lr: f64 = 0.0,
    /// Learning-rate schedule after warm-up: constant, linear or cosine.
    lr_decay_style: LrDecayStyle = LrDecayStyle::Constant,
    /// Linear warm-up steps.
    lr_warmup_iters: u64 = 0,
    /// AdamW decoupled weight decay.
    weight_decay: f64 = 0.0,
    /// AdamW beta1.
    adam_beta1: f64 = 0.9,
    /// AdamW beta2.
    adam_beta2: f64 = 0.999,
    /// AdamW epsilon.
    adam_eps: f64 = 1e-8,
    /// Gradient-norm clip (0 disables clipping).
    clip_grad: f64 = 1.0,
    /// bfloat16 mixed precision: trained roles keep f32 master weights and f32 AdamW state
    /// and compute activations in bf16; frozen roles hold bf16 weights. Log-softmax,
    /// log-probs, entropies, values, losses and advantages stay in f32.
    bf16: bool = false,
    /// Activation checkpointing per decoder layer in trained roles: keep each layer's input
    /// only and recompute the layer in backward (about one more forward of compute).
    gradient_checkpointing: bool = false,
    /// Tokens per chunk of the LM head when computing log-probs and entropies, so the
    /// `[batch, seq, vocab]` logits never exist at once (0: the whole micro-batch at once).
    logits_chunk_size: u32 = 1024,
    /// ZeRO stage of a trained role's data-parallel ranks: 0, every rank holds the whole
    /// AdamW state; 1, each of the N ranks holds the moments of 1/N of the parameters (8 of
    /// the 16 bytes per trained parameter), steps them, and the ranks exchange the result
    /// (the same weights as 0); 2, each rank also keeps only its 1/N of the summed gradient
    /// (every micro-batch's gradient is reduce-scattered as soon as it exists, so no rank
    /// holds an accumulated whole one); 3, the parameters too: each rank keeps its 1/N of
    /// every weight, gathers a decoder layer just before its forward and again before its
    /// backward (which reduce-scatters the layer's gradients at once) and drops it after
    /// (with LoRA the frozen base is sharded too and only the adapters train; a colocated PPO
    /// policy needs actor_rollout.hybrid_engine=false).
    zero_stage: u32 = 0,
    /// Keep a trained role's AdamW moments in host memory and step them there: the device
    /// holds the parameters and gradients only (8 bytes per trained parameter less); each
    /// step moves the gradients to the host and the parameters back. On a CPU device the
    /// moments are in host memory anyway.
    offload_optimizer: bool = false,
    /// With `zero_stage: 3`: keep this rank's pieces of the parameters in host memory (and so
    /// their summed gradients and AdamW's moments, stepped there); the device holds only
    /// what a pass gathers (the embeddings and heads, one decoder layer). On a CPU device
    /// everything is in host memory anyway.
    offload_params: bool = false,
    /// Seed of every RNG the job uses (sampling, shuffling, init).
    seed: u64 = 1234,
    /// Tokenizer directory (HF `tokenizer.json`) or Hugging Face repo id (`owner/name`,
    /// through the local HF cache); unset = the role's model.
    tokenizer_name_or_path: Option<String> = None,
}

/// Learning-rate schedule after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrDecayStyle {
    /// Flat at `lr`.
    Constant,
    /// Linear from `lr` to `min_lr` over `train_iters`.
    Linear,
    /// Cosine from `lr` to `min_lr` over `train_iters`.
    Cosine,
}

/// Kind of accelerator the resource pool counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceKind {
    /// NVIDIA GPUs (cluster resource `GPU`).
    #[serde(rename = "GPU", alias = "gpu")]
    Gpu,
    /// Ascend NPUs (cluster resource `NPU`).
    #[serde(rename = "NPU", alias = "npu")]
    Npu,
    /// CPU slots (cluster resource `CPU`).
    #[serde(rename = "CPU", alias = "cpu")]
    Cpu,
}

impl DeviceKind {
    /// The cluster resource name this kind is counted under.
    pub fn resource(self) -> &'static str {
        match self {
            DeviceKind::Gpu => "GPU",
            DeviceKind::Npu => "NPU",
            DeviceKind::Cpu => "CPU",
        }
    }
}

/// Devices per role (`resource_pool.*`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResourcePool {
    /// Device kind every role runs on.
    pub device: DeviceKind,
    /// Memory of one device in GiB, for the fit warning of `check`.
    pub device_memory_gb: f64,
    /// Devices of the actor: `num_gpus_for_train + num_gpus_for_infer`.
    pub actor_rollout: u32,
    /// Devices of the reference model.
    #[serde(rename = "ref")]
    pub ref_: u32,
    /// Devices of the critic (0 when the estimator needs none).
    pub critic: u32,
    /// Devices of the reward role (0 for rule or HTTP rewards).
    pub reward: u32,
    /// Every role shares the same devices: one pool as large as the largest role, each
    /// device holding a fraction of every role (fractional bundles), and each actor trainer
    /// rank generating with its own weights (the hybrid engine: no second copy of the
    /// policy, no weight sync). Needs `actor_rollout.num_gpus_for_infer` equal to
    /// `num_gpus_for_train`.
    pub colocate: bool,
}

impl Default for ResourcePool {
    fn default() -> Self {
        Self {
            device: DeviceKind::Gpu,
            device_memory_gb: 80.0,
            actor_rollout: 2,
            ref_: 1,
            critic: 1,
            reward: 1,
            colocate: false,
        }
    }
}

/// Dataset file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// From the file extension (`.jsonl`/`.json` or `.parquet`).
    Auto,
    /// One JSON object per line.
    Jsonl,
    /// Apache Parquet.
    Parquet,
}

/// What happens to a prompt longer than `actor_rollout.max_prompt_length`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptOverflow {
    /// Keep the last `max_prompt_length` tokens (the end of a prompt is what
    /// the response continues from).
    Truncate,
    /// Drop the prompt from the batch.
    Skip,
}

/// What happens to a dataset row that fails to parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BadRows {
    /// Count it, report it, and drop it.
    Skip,
    /// Refuse the dataset, listing the bad rows.
    Fail,
}

/// A chat template variable's value (`data.chat_template_kwargs`): a scalar, what templates
/// test (`enable_thinking is false`) or print.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TemplateValue {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
}

impl From<&TemplateValue> for serde_json::Value {
    fn from(v: &TemplateValue) -> Self {
        match v {
            TemplateValue::Bool(b) => (*b).into(),
            TemplateValue::Int(i) => (*i).into(),
            TemplateValue::Float(f) => (*f).into(),
            TemplateValue::Str(s) => s.as_str().into(),
        }
    }
}

/// Names `data.chat_template_kwargs` cannot set: the renderer sets them itself.
pub const RESERVED_CHAT_TEMPLATE_KWARGS: &[&str] =
    &["messages", "add_generation_prompt", "tools", "documents"];

/// Prompt dataset (`data.*`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Dataset file.
    pub path: String,
    /// auto, jsonl or parquet.
    pub format: DataFormat,
    /// Column with the prompt: a string, or a list of {role, content} messages.
    pub prompt_key: String,
    /// Column with chat messages; when set it is read instead of `prompt_key`.
    pub messages_key: Option<String>,
    /// Column with the reference answer, passed to the reward as `ground_truth` (rule `exact_match`).
    pub ground_truth_key: Option<String>,
    /// trainer sft: column with the completion the loss covers (text, or messages).
    pub completion_key: String,
    /// trainer reward / dpo: column with the preferred answer.
    pub chosen_key: String,
    /// trainer reward / dpo: column with the dispreferred answer.
    pub rejected_key: String,
    /// trainer reward: column with a per-pair margin the chosen score must clear (unset: none).
    pub margin_key: Option<String>,
    /// Render prompts with the model's chat template.
    pub apply_chat_template: bool,
    /// Extra chat template variables, as transformers' `apply_chat_template(**kwargs)`
    /// (Qwen3's `enable_thinking: false`); scalars only, checked at load.
    pub chat_template_kwargs: BTreeMap<String, TemplateValue>,
    /// truncate or skip prompts longer than `actor_rollout.max_prompt_length`.
    pub max_prompt_length_policy: PromptOverflow,
    /// Reshuffle the prompts every epoch.
    pub shuffle: bool,
    /// Shuffle seed (default `training.seed`).
    pub seed: Option<u64>,
    /// skip or fail on rows that do not parse.
    pub bad_rows: BadRows,
    /// trainer reward / dpo: held-out pairs in the format of `path`, scored every
    /// `eval_every` steps and at the last step (unset: no eval).
    pub eval_path: Option<String>,
    /// Steps between evals on `eval_path`.
    pub eval_every: u64,
    /// trainer sft: pack several examples into each row of `max_prompt_length +
    /// max_response_length` tokens (best-fit decreasing), each attending only to its own
    /// tokens; `training.global_batch_size` then counts packed rows.
    pub packing: bool,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            path: "data/prompts_tiny.jsonl".into(),
            format: DataFormat::Auto,
            prompt_key: "prompt".into(),
            messages_key: None,
            ground_truth_key: None,
            completion_key: "completion".into(),
            chosen_key: "chosen".into(),
            rejected_key: "rejected".into(),
            margin_key: None,
            apply_chat_template: false,
            chat_template_kwargs: BTreeMap::new(),
            max_prompt_length_policy: PromptOverflow::Truncate,
            shuffle: true,
            seed: None,
            bad_rows: BadRows::Fail,
            eval_path: None,
            eval_every: 10,
            packing: false,
        }
    }
}

impl DataConfig {
    /// `chat_template_kwargs` as the tokenizer's extra template variables.
    pub fn chat_template_vars(&self) -> serde_json::Map<String, serde_json::Value> {
        self.chat_template_kwargs
            .iter()
            .map(|(k, v)| (k.clone(), v.into()))
            .collect()
    }
}

/// Checkpoints (`checkpoint.*`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Directory that holds `step_N/` checkpoints.
    pub dir: String,
    /// Save every N steps (0 = only at the end).
    pub save_steps: u64,
    /// Keep the newest N checkpoints (0 = keep all).
    pub keep_last: u32,
    /// `latest`, a checkpoint path, or null to start fresh.
    pub resume: Option<String>,
    /// Also hold each checkpoint in the memory of a peer node's worker, so that an automatic
    /// restart loads it from there instead of from `dir`.
    pub memory_snapshot: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            dir: "checkpoints".into(),
            save_steps: 100,
            keep_last: 3,
            resume: None,
            memory_snapshot: false,
        }
    }
}

/// Metrics and console output (`logging.*`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoggingConfig {
    /// JSONL file with one metrics record per step.
    pub metrics_file: String,
    /// JSONL file with the sample tables.
    pub samples_file: String,
    /// JSONL ledger of the prompts each step consumed (dataset rows trained on, and those
    /// dynamic sampling dropped or generated beyond the batch), kept exactly once per step across restarts and resumes as
    /// the metrics file is; empty = none. PPO-family jobs.
    pub ledger_file: String,
    /// Print and save a (query, response, score) table every N steps (0 = never).
    pub sample_every: u64,
    /// Rows in each sample table.
    pub sample_rows: u32,
    /// Show a progress bar with ETA.
    pub progress: bool,
    /// Directory of TensorBoard event files (empty = off). Set, it turns the tensorboard
    /// backend on whether or not `backends` lists it.
    pub tensorboard_dir: String,
    /// Where metrics go: `jsonl` (`metrics_file`, `samples_file`) and/or `tensorboard`
    /// (`tensorboard_dir`).
    pub backends: Vec<LogBackend>,
}

impl Default for LoggingConfig {
    fn default() -> Self {
        Self {
            metrics_file: "logs/metrics.jsonl".into(),
            samples_file: "logs/samples.jsonl".into(),
            ledger_file: String::new(),
            sample_every: 10,
            sample_rows: 4,
            progress: true,
            tensorboard_dir: String::new(),
            backends: vec![LogBackend::Jsonl],
        }
    }
}

impl LoggingConfig {
    /// The JSONL metrics and samples files are written (`backends` lists `jsonl`).
    pub fn jsonl(&self) -> bool {
        self.backends.contains(&LogBackend::Jsonl)
    }

    /// TensorBoard event files are written: `tensorboard_dir` is set (`backends` listing
    /// `tensorboard` without it is refused at load).
    pub fn tensorboard(&self) -> bool {
        !self.tensorboard_dir.is_empty()
    }
}

/// A destination of the per-step metrics (`logging.backends`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogBackend {
    /// `logging.metrics_file` and `logging.samples_file`, one JSON object per line.
    Jsonl,
    /// TensorBoard event files under `logging.tensorboard_dir`.
    Tensorboard,
}

/// One `defaults` entry: `- model: NAME` or `- model: [NAME, ...]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DefaultsEntry {
    /// Model config names, each `<config_dir>/model/<name>.yaml`.
    pub model: OneOrMany,
}

/// A single name or a list of names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// `model: llama32_1b`
    One(String),
    /// `model: [llama32_1b, rm_1b]`
    Many(Vec<String>),
}

impl OneOrMany {
    /// The names, in order.
    pub fn names(&self) -> Vec<&str> {
        match self {
            OneOrMany::One(s) => vec![s.as_str()],
            OneOrMany::Many(v) => v.iter().map(String::as_str).collect(),
        }
    }
}

/// What a job trains (`trainer`): one stage of the pipeline, all on the same cluster, config
/// shape, checkpoints and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainerKind {
    /// RL from a reward: PPO and the critic-free estimators (`algorithm.adv_estimator`).
    #[default]
    Ppo,
    /// Supervised fine-tuning of `actor_rollout.model` on completions or chats.
    Sft,
    /// A reward model (`reward.model` with a fresh score head) on preference pairs.
    Reward,
    /// The DPO family (`algorithm.loss_type`) on preference pairs, against `ref`.
    Dpo,
}

impl TrainerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TrainerKind::Ppo => "ppo",
            TrainerKind::Sft => "sft",
            TrainerKind::Reward => "reward",
            TrainerKind::Dpo => "dpo",
        }
    }
}

impl std::fmt::Display for TrainerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A whole job config (PPO, or another stage as `trainer` says).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PpoConfig {
    /// What the job trains: ppo, sft, reward or dpo.
    pub trainer: TrainerKind,
    /// Model config files to load from `<config_dir>/model/`.
    pub defaults: Vec<DefaultsEntry>,
    /// Shared training defaults.
    pub training: TrainingConfig,
    /// Devices per role.
    pub resource_pool: ResourcePool,
    /// Rewards and advantages.
    pub algorithm: AlgorithmConfig,
    /// Policy role.
    pub actor_rollout: ActorRolloutConfig,
    /// Reference role.
    #[serde(rename = "ref")]
    pub ref_: RefConfig,
    /// Critic role.
    pub critic: CriticConfig,
    /// Reward role.
    pub reward: RewardConfig,
    /// Prompt dataset.
    pub data: DataConfig,
    /// Checkpoints.
    pub checkpoint: CheckpointConfig,
    /// Metrics and console output.
    pub logging: LoggingConfig,
    /// Automatic restarts when a role process dies.
    pub fault_tolerance: FaultToleranceConfig,
    /// Model configs loaded from `defaults`, by name (filled by the loader).
    #[serde(skip)]
    pub models: BTreeMap<String, ModelConfig>,
    /// The file this config was loaded from (filled by the loader).
    #[serde(skip)]
    pub source: Option<PathBuf>,
}
