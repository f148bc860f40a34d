//! The training math: pure, synchronous functions over candle tensors with masks.
//!
//! Per-token rewards with a KL penalty, KL estimators and controllers, advantage
//! estimators (GAE, GRPO, RLOO, REINFORCE++, REINFORCE++ with baseline, ReMax),
//! masked whitening, the clipped policy and value losses, entropy and KL losses,
//! the GRPO family's objectives (GSPO's sequence-level ratio, CISPO, SAPO; TRL's
//! aggregations grpo, bnpo, dr_grpo and dapo) and training metrics; the losses of the other stages (SFT, the reward model's
//! Bradley–Terry, the DPO family: `supervised`, `preference`). Names and defaults
//! follow TRL's trainers and verl's `core_algos`; `scripts/algo_reference.py`,
//! `scripts/preference_reference.py` and `scripts/grpo_loss_reference.py` produce the
//! reference numbers the integration tests compare against.
//!
//! Conventions:
//! * token tensors are `f32` `[batch, response_len]`, responses right-padded;
//! * `response_mask` is 1.0 on response tokens (EOS included) and 0.0 on padding;
//! * the sequence score sits on the last valid response token;
//! * results are zero outside the mask, and values at masked positions never
//!   change any result;
//! * every public function validates shapes, masks and finiteness and returns an
//!   [`AlgoError`] naming the tensor at fault instead of panicking.
//!
//! On the CPU the estimators and the per-token losses run as single passes over
//! host buffers (the losses through custom ops with an exact backward pass);
//! on other devices the losses are chains of differentiable candle ops.
//!
//! One PPO step, end to end:
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use rlhf_algo::*;
//!
//! # fn main() -> rlhf_algo::Result<()> {
//! let dev = Device::Cpu;
//! // two responses of 3 and 2 tokens, right-padded to 3
//! let mask = Tensor::new(&[[1f32, 1.0, 1.0], [1.0, 1.0, 0.0]], &dev)?;
//! let logp = Tensor::new(&[[-0.5f32, -1.0, -0.2], [-0.7, -0.1, 0.0]], &dev)?;
//! let ref_logp = Tensor::new(&[[-0.6f32, -0.9, -0.3], [-0.6, -0.2, 0.0]], &dev)?;
//! let values = Tensor::new(&[[0.1f32, 0.2, 0.3], [0.0, -0.1, 0.0]], &dev)?;
//! let scores = Tensor::new(&[1.0f32, -0.5], &dev)?;
//!
//! let cfg = AlgorithmConfig::default(); // gae, gamma 1.0, lam 0.95, kl_coef 0.05
//! let kl_ctl = KlController::from_config(&cfg.kl_ctrl)?;
//! let rewards =
//!     compute_token_rewards(&scores, &logp, &ref_logp, &mask, &[true, false], kl_ctl.value(), &cfg)?;
//! let inputs = AdvantageInputs {
//!     token_rewards: &rewards.rewards,
//!     response_mask: &mask,
//!     values: Some(&values),
//!     value_mask: None,
//!     group_ids: None,
//!     baseline_scores: None,
//! };
//! let adv = compute_advantage(&inputs, &cfg)?;
//!
//! // the policy's new log-probs would come from a forward pass; a Var stands in
//! let new_logp = Var::from_tensor(&(&logp + 0.05)?)?;
//! let pg = policy_loss(&logp, new_logp.as_tensor(), &adv.advantages, &mask, &PolicyLossConfig::default())?;
//! let grads = pg.loss.backward()?;
//! assert!(grads.get(&new_logp).is_some());
//!
//! let vf = value_loss(&values, &values, &adv.returns, &mask, &ValueLossConfig::default())?;
//! let mut stats = TrainStats::new();
//! stats.push_policy(&pg)?;
//! stats.push_value(&vf)?;
//! let metrics = compute_metrics(
//!     &RolloutMetricsInputs {
//!         rewards: &rewards,
//!         logp: &logp,
//!         response_mask: &mask,
//!         has_eos: &[true, false],
//!         advantages: &adv.advantages,
//!         returns: &adv.returns,
//!         values: Some(&values),
//!     },
//!     &stats,
//! )?;
//! assert!(metrics.contains_key("objective/kl") && metrics.contains_key("val/ratio"));
//! # Ok(())
//! # }
//! ```

mod advantage;
mod config;
mod error;
mod fused;
mod kl;
mod loss;
mod masked;
pub mod metric;
mod metrics;
mod names;
mod objective;
mod off_policy;
mod preference;
mod rewards;
mod sampling;
mod supervised;
mod validate;

pub use advantage::{
    compute_advantage, gae, grpo_outcome_advantage, grpo_scaled_advantage,
    reinforce_plus_plus_advantage, reinforce_plus_plus_baseline_advantage, remax_advantage,
    rloo_outcome_advantage, AdvantageInputs, Advantages,
};
pub use config::{
    AlgorithmConfig, DynamicSamplingConfig, KlCtrlConfig, OverlongBufferConfig, PolicyLossConfig,
    ValueLossConfig,
};
pub use error::{AlgoError, Result};
pub use kl::{entropy_from_logits, kl_penalty, log_softmax, KlController};
pub use loss::{
    actor_loss, agg_loss, agg_loss_scaled, kl_loss, micro_batch_scale, policy_loss, value_loss,
    ActorLossOutput, GlobalBatch, PolicyLossOutput, ValueLossOutput,
};
pub use masked::{masked_mean, masked_sum, masked_var, masked_whiten, WHITEN_EPS};
pub use metrics::{
    compute_metrics, rollout_metrics, RolloutMetricsInputs, TrainStats, METRIC_NAMES,
};
pub use names::{
    AdvEstimator, FilterMetric, ImportanceSamplingLevel, KlCtrlType, KlPenalty, LossAggMode,
    PolicyLoss, PreferenceLoss, ScaleRewards, ScorePlacement, WhenExhausted,
};
pub use off_policy::{importance_weights, log_prob_gap, ImportanceWeights};
pub use preference::{
    kto_kl_estimate, preference_loss, PairBatch, PreferenceConfig, PreferenceLossOutput,
    PreferenceStats,
};
pub use rewards::{compute_token_rewards, TokenRewards};
pub use sampling::{informative_groups, mask_truncated, overlong_penalty};
pub use supervised::{reward_loss, sft_loss, RewardStats};
