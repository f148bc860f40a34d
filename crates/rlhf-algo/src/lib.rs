//! PPO algorithm core: pure, synchronous math over candle tensors with masks.
//!
//! Per-token rewards with a KL penalty, KL estimators and controllers, advantage
//! estimators (GAE, GRPO, RLOO, REINFORCE++, REINFORCE++ with baseline, ReMax),
//! masked whitening, the clipped policy and value losses, entropy and KL losses,
//! and training metrics. Names and defaults follow TRL's `PPOTrainer` and verl's
//! `core_algos`; `scripts/algo_reference.py` produces the reference numbers the
//! integration tests compare against.
//!
//! Conventions:
//! * token tensors are `f32` `[batch, response_len]`, responses right-padded;
//! * `response_mask` is 1.0 on response tokens (EOS included) and 0.0 on padding;
//! * the sequence score sits on the last valid response token;
//! * results are zero outside the mask, and values at masked positions never
//!   change any result;
//! * every public function validates shapes, masks and finiteness and returns an
//!   [`AlgoError`] naming the tensor at fault instead of panicking.

mod advantage;
mod config;
mod error;
mod fused;
mod kl;
mod loss;
mod masked;
mod metrics;
mod names;
mod rewards;
mod validate;

pub use advantage::{
    compute_advantage, gae, grpo_outcome_advantage, reinforce_plus_plus_advantage,
    reinforce_plus_plus_baseline_advantage, remax_advantage, rloo_outcome_advantage,
    AdvantageInputs, Advantages,
};
pub use config::{AlgorithmConfig, KlCtrlConfig, PolicyLossConfig, ValueLossConfig};
pub use error::{AlgoError, Result};
pub use kl::{entropy_from_logits, kl_penalty, log_softmax, KlController};
pub use loss::{
    actor_loss, agg_loss, kl_loss, micro_batch_scale, policy_loss, value_loss, ActorLossOutput,
    GlobalBatch, PolicyLossOutput, ValueLossOutput,
};
pub use masked::{masked_mean, masked_sum, masked_var, masked_whiten, WHITEN_EPS};
pub use metrics::{
    compute_metrics, rollout_metrics, RolloutMetricsInputs, TrainStats, METRIC_NAMES,
};
pub use names::{AdvEstimator, KlCtrlType, KlPenalty, LossAggMode};
pub use rewards::{compute_token_rewards, TokenRewards};
