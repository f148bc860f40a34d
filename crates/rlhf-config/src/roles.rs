//! The role sections of a job config: `actor_rollout.*`, `ref.*`, `critic.*` and
//! `reward.*`, each with its own keys plus overrides of the `training` keys.

use rlhf_algo::{
    ImportanceSamplingLevel, KlPenalty, LossAggMode, PolicyLoss, PolicyLossConfig, ValueLossConfig,
};
use serde::{Deserialize, Serialize};

use crate::asynchrony::AsyncConfig;
use crate::config::TrainingOverrides;

/// Policy role: generation and PPO update (`actor_rollout.*`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ActorRolloutConfig {
    /// A model named in `defaults`, or a path to an HF model directory.
    pub model: String,
    /// Sample during rollout; `false` decodes greedily (precision alignment).
    pub do_sample: bool,
    /// Sampling temperature.
    pub temperature: f64,
    /// Nucleus sampling threshold (1.0 = off).
    pub top_p: f64,
    /// Top-k sampling (0 = off).
    pub top_k: u32,
    /// Longest prompt in tokens; longer prompts follow `data.max_prompt_length_policy`.
    pub max_prompt_length: u32,
    /// Most tokens generated per response.
    pub max_response_length: u32,
    /// Responses sampled per prompt (the group size of GRPO / RLOO).
    pub num_samples_per_step: u32,
    /// Sequences per optimizer step of the actor.
    pub ppo_mini_batch_size: u32,
    /// Passes over each rollout batch.
    pub ppo_epochs: u32,
    /// Shuffle sequences between mini-batches.
    pub shuffle_minibatch: bool,
    /// Data-parallel trainer ranks of the actor.
    pub num_gpus_for_train: u32,
    /// Rollout (generation) ranks of the actor.
    pub num_gpus_for_infer: u32,
    /// PPO clip range epsilon.
    pub clip_ratio: f64,
    /// Lower clip range (default `clip_ratio`).
    pub clip_ratio_low: Option<f64>,
    /// Upper clip range (default `clip_ratio`).
    pub clip_ratio_high: Option<f64>,
    /// Dual-clip bound for negative advantages (> 1; null disables).
    pub clip_ratio_c: Option<f64>,
    /// Reduction of the token loss matrix.
    pub loss_agg_mode: LossAggMode,
    /// `seq-mean-token-sum-norm` (Dr. GRPO): the constant each sequence's token sum is
    /// divided by; unset = `max_response_length` (TRL's `max_completion_length`).
    pub loss_scale_factor: Option<f64>,
    /// Per-token objective: ppo (clipped surrogate), cispo or sapo.
    pub policy_loss: PolicyLoss,
    /// Importance ratio per token, or per sequence (GSPO).
    pub importance_sampling_level: ImportanceSamplingLevel,
    /// cispo: upper bound on the importance weight.
    pub cispo_clip_max: f64,
    /// sapo: gate temperature where the advantage is positive.
    pub sapo_temperature_pos: f64,
    /// sapo: gate temperature elsewhere.
    pub sapo_temperature_neg: f64,
    /// Weight of the entropy bonus.
    pub entropy_coeff: f64,
    /// Add a KL-to-reference loss term (GRPO style).
    pub use_kl_loss: bool,
    /// Weight of that KL loss.
    pub kl_loss_coef: f64,
    /// KL estimator of that KL loss.
    pub kl_loss_type: KlPenalty,
    /// Precision-alignment mode: a JSONL file of fixed responses replaces generation.
    pub fixed_responses_file: Option<String>,
    /// Colocated trainer: optimizer state in host memory while the device generates.
    pub offload: bool,
    /// Under `resource_pool.colocate`: the rollout ranks are the trainer processes and
    /// generate with their weights (true), or processes of their own on the same devices
    /// that receive the weights after every update (false).
    pub hybrid_engine: bool,
    /// The rollout ranks' engine: candle (our own loop) or vllm (a vLLM server per rank).
    pub engine: crate::RolloutEngine,
    /// The vLLM server of each rollout rank (`actor_rollout.vllm.*`; `engine: vllm`).
    pub vllm: crate::VllmOptions,
    /// Rollout overlapped with training (`actor_rollout.async.*`).
    #[serde(rename = "async")]
    pub async_: AsyncConfig,
    /// LoRA adapters instead of the full model (`actor_rollout.lora.*`; rank 0 = off).
    pub lora: crate::LoraOptions,
    /// Overrides of `training` keys for this role.
    #[serde(flatten)]
    pub overrides: TrainingOverrides,
}

impl Default for ActorRolloutConfig {
    fn default() -> Self {
        let p = PolicyLossConfig::default();
        Self {
            model: String::new(),
            do_sample: true,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_prompt_length: 512,
            max_response_length: 512,
            num_samples_per_step: 1,
            ppo_mini_batch_size: 8,
            ppo_epochs: 1,
            shuffle_minibatch: false,
            num_gpus_for_train: 1,
            num_gpus_for_infer: 1,
            clip_ratio: p.clip_ratio,
            clip_ratio_low: p.clip_ratio_low,
            clip_ratio_high: p.clip_ratio_high,
            clip_ratio_c: p.clip_ratio_c,
            loss_agg_mode: p.loss_agg_mode,
            loss_scale_factor: p.loss_scale_factor,
            policy_loss: p.policy_loss,
            importance_sampling_level: p.importance_sampling_level,
            cispo_clip_max: p.cispo_clip_max,
            sapo_temperature_pos: p.sapo_temperature_pos,
            sapo_temperature_neg: p.sapo_temperature_neg,
            entropy_coeff: p.entropy_coeff,
            use_kl_loss: p.use_kl_loss,
            kl_loss_coef: p.kl_loss_coef,
            kl_loss_type: p.kl_loss_type,
            fixed_responses_file: None,
            offload: false,
            hybrid_engine: true,
            engine: crate::RolloutEngine::Candle,
            vllm: crate::VllmOptions::default(),
            async_: AsyncConfig::default(),
            lora: crate::LoraOptions::default(),
            overrides: TrainingOverrides::default(),
        }
    }
}

impl ActorRolloutConfig {
    /// The actor loss settings in `rlhf_algo`'s form.
    pub fn policy_loss(&self) -> PolicyLossConfig {
        PolicyLossConfig {
            clip_ratio: self.clip_ratio,
            clip_ratio_low: self.clip_ratio_low,
            clip_ratio_high: self.clip_ratio_high,
            clip_ratio_c: self.clip_ratio_c,
            loss_agg_mode: self.loss_agg_mode,
            use_kl_loss: self.use_kl_loss,
            kl_loss_coef: self.kl_loss_coef,
            kl_loss_type: self.kl_loss_type,
            entropy_coeff: self.entropy_coeff,
            loss_scale_factor: self
                .loss_scale_factor
                .or((self.loss_agg_mode == LossAggMode::SeqMeanTokenSumNorm)
                    .then_some(f64::from(self.max_response_length))),
            policy_loss: self.policy_loss,
            importance_sampling_level: self.importance_sampling_level,
            cispo_clip_max: self.cispo_clip_max,
            sapo_temperature_pos: self.sapo_temperature_pos,
            sapo_temperature_neg: self.sapo_temperature_neg,
        }
    }

    /// Sequences per step: prompts per step times samples per prompt.
    pub fn rollout_batch_size(&self, prompts_per_step: u32) -> u64 {
        u64::from(prompts_per_step) * u64::from(self.num_samples_per_step)
    }
}

/// Frozen reference policy (`ref.*`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RefConfig {
    /// Model name or path; empty = the actor's model.
    pub model: String,
    /// Overrides of `training` keys for this role.
    #[serde(flatten)]
    pub overrides: TrainingOverrides,
}

/// Value model (`critic.*`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CriticConfig {
    /// Model name or path; empty = the actor's model with a fresh value head.
    pub model: String,
    /// Value clip range around the rollout values.
    pub cliprange_value: f64,
    /// Weight of the value loss.
    pub vf_coef: f64,
    /// Reduction of the value loss matrix.
    pub loss_agg_mode: LossAggMode,
    /// Sequences per optimizer step of the critic.
    pub critic_mini_batch_size: u32,
    /// Passes over each rollout batch.
    pub critic_update_epochs: u32,
    /// Shuffle sequences between mini-batches.
    pub shuffle_minibatch: bool,
    /// LoRA adapters on the critic's body; the value head trains in full (`critic.lora.*`).
    pub lora: crate::LoraOptions,
    /// Overrides of `training` keys for this role.
    #[serde(flatten)]
    pub overrides: TrainingOverrides,
}

impl Default for CriticConfig {
    fn default() -> Self {
        let v = ValueLossConfig::default();
        Self {
            model: String::new(),
            cliprange_value: v.cliprange_value,
            vf_coef: v.vf_coef,
            loss_agg_mode: v.loss_agg_mode,
            critic_mini_batch_size: 8,
            critic_update_epochs: 1,
            shuffle_minibatch: false,
            lora: crate::LoraOptions::default(),
            overrides: TrainingOverrides::default(),
        }
    }
}

impl CriticConfig {
    /// The value loss settings in `rlhf_algo`'s form.
    pub fn value_loss(&self) -> ValueLossConfig {
        ValueLossConfig {
            cliprange_value: self.cliprange_value,
            vf_coef: self.vf_coef,
            loss_agg_mode: self.loss_agg_mode,
        }
    }
}

/// How the reward role scores responses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RewardKind {
    /// A reward model (sequence classifier) at `reward.model`.
    Model,
    /// A built-in rule chosen by `reward.rule`.
    Rule,
    /// An HTTP endpoint at `reward.url`.
    Http,
}

/// Reward role (`reward.*`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RewardConfig {
    /// model, rule or http.
    pub kind: RewardKind,
    /// Reward model name or path (kind: model).
    pub model: String,
    /// Built-in rule name (kind: rule).
    pub rule: String,
    /// Endpoint URL (kind: http).
    pub url: String,
    /// Timeout of one scoring call, seconds (kind: http).
    pub timeout_s: f64,
    /// `rule: math`: the score of a response whose answer was found but is wrong (a format
    /// reward; verl's `format_score`). Right answers score 1.
    pub format_score: f64,
    /// `rule: math`: the score of a response with no answer to find (no `\boxed{}`, no
    /// number); such responses are counted in `reward/no_answer_frac`.
    pub no_answer_score: f64,
    /// Overrides of `training` keys for this role.
    #[serde(flatten)]
    pub overrides: TrainingOverrides,
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self {
            kind: RewardKind::Model,
            model: String::new(),
            rule: String::new(),
            url: String::new(),
            timeout_s: 30.0,
            format_score: 0.0,
            no_answer_score: 0.0,
            overrides: TrainingOverrides::default(),
        }
    }
}
