//! Configuration structs with TRL / verl names and defaults.
//!
//! Each struct deserializes with `deny_unknown_fields` (a typo is an error, not a
//! silently ignored key) and `default` (a missing key takes the documented
//! default), so a config loader can embed them as sections.

use serde::{Deserialize, Serialize};

use crate::error::{AlgoError, Result};
use crate::names::{
    AdvEstimator, FilterMetric, ImportanceSamplingLevel, KlCtrlType, KlPenalty, LossAggMode,
    PolicyLoss, PreferenceLoss, ScaleRewards, ScorePlacement, WhenExhausted,
};
use crate::preference::PreferenceConfig;
use crate::validate::{check_non_negative, check_positive, check_unit_interval};

/// KL coefficient controller settings (`algorithm.kl_ctrl`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KlCtrlConfig {
    /// `fixed` or `adaptive`.
    #[serde(rename = "type")]
    pub kind: KlCtrlType,
    /// Initial (or constant) KL coefficient. TRL default 0.05.
    pub kl_coef: f64,
    /// Adaptive only: the KL the controller steers towards (Ziegler et al.: 6.0).
    pub target_kl: f64,
    /// Adaptive only: number of samples over which the error is corrected.
    pub horizon: f64,
}

impl Default for KlCtrlConfig {
    fn default() -> Self {
        Self {
            kind: KlCtrlType::Fixed,
            kl_coef: 0.05,
            target_kl: 6.0,
            horizon: 10000.0,
        }
    }
}

impl KlCtrlConfig {
    /// Checks value ranges.
    pub fn validate(&self) -> Result<()> {
        check_non_negative("algorithm.kl_ctrl.kl_coef", self.kl_coef)?;
        if self.kind == KlCtrlType::Adaptive {
            check_positive("algorithm.kl_ctrl.target_kl", self.target_kl)?;
            check_positive("algorithm.kl_ctrl.horizon", self.horizon)?;
        }
        Ok(())
    }
}

/// DAPO's dynamic sampling (`algorithm.dynamic_sampling`): groups whose responses all score
/// alike carry no group-relative advantage; they are dropped and more prompts are generated
/// until the batch is full.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DynamicSamplingConfig {
    /// Filter groups and generate more (off by default).
    pub enable: bool,
    /// What must differ within a group: `score` or `accuracy`.
    pub metric: FilterMetric,
    /// Generation rounds (each `training.global_batch_size` prompts) per training batch,
    /// the first included. verl's default is 10.
    pub max_num_gen_batches: u32,
    /// What the job does when the rounds run out: `train` on what there is, or `fail`.
    pub when_exhausted: WhenExhausted,
}

impl Default for DynamicSamplingConfig {
    fn default() -> Self {
        Self {
            enable: false,
            metric: FilterMetric::Score,
            max_num_gen_batches: 10,
            when_exhausted: WhenExhausted::Train,
        }
    }
}

/// DAPO's overlong reward shaping (`algorithm.overlong_buffer`): a response longer than
/// `max_response_length - len` tokens loses `penalty_factor * (excess / len)` of score, up to
/// `penalty_factor` at the full length (TRL's `get_soft_overlong_punishment` at factor 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OverlongBufferConfig {
    /// Shape the scores (off by default).
    pub enable: bool,
    /// The buffer's length in tokens at the end of `actor_rollout.max_response_length`.
    pub len: u32,
    /// The penalty at the full length. DAPO's default 1.0.
    pub penalty_factor: f64,
}

impl Default for OverlongBufferConfig {
    fn default() -> Self {
        Self {
            enable: false,
            len: 0,
            penalty_factor: 1.0,
        }
    }
}

/// Rewards and advantages (`algorithm.*`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlgorithmConfig {
    /// Advantage estimator.
    pub adv_estimator: AdvEstimator,
    /// Discount factor. TRL default 1.0.
    pub gamma: f64,
    /// GAE lambda. TRL default 0.95.
    pub lam: f64,
    /// KL estimator used in the per-token reward.
    pub kl_penalty: KlPenalty,
    /// KL coefficient controller.
    pub kl_ctrl: KlCtrlConfig,
    /// Subtract `kl_coef * KL` from the per-token reward (TRL PPO always does).
    pub use_kl_in_reward: bool,
    /// Subtracted from the score of a response that has no EOS token (TRL).
    pub missing_eos_penalty: Option<f64>,
    /// Clip scores to `[-reward_clip, reward_clip]` after the EOS penalty.
    pub reward_clip: Option<f64>,
    /// Whiten per-token rewards over the batch, keeping their mean (TRL `whiten_rewards`).
    pub whiten_rewards: bool,
    /// Whiten GAE advantages over the batch (TRL and verl always do).
    pub whiten_advantages: bool,
    /// GRPO: divide by the group std (false gives Dr. GRPO).
    pub norm_adv_by_std_in_grpo: bool,
    /// GRPO: which std the centred scores are divided by, as TRL's `scale_rewards`:
    /// `group` (default), `batch` (the whole batch's std) or `none`. `none` is the same as
    /// `norm_adv_by_std_in_grpo: false`.
    pub scale_rewards: ScaleRewards,
    /// GRPO: added to the group std before dividing.
    pub grpo_epsilon: f64,
    /// Where the score goes: `last_token` (verl) or `trl` (one slot past it, as TRL's
    /// PPOTrainer does; values and the value loss then cover that slot too).
    pub score_placement: ScorePlacement,
    /// DPO-family jobs (`trainer: dpo`): the loss, `sigmoid` (DPO), `ipo`, `simpo` or `kto`.
    pub loss_type: PreferenceLoss,
    /// DPO-family jobs: the implicit reward's inverse temperature (TRL's `beta`).
    pub beta: f64,
    /// DPO-family jobs: the assumed share of flipped preference labels (cDPO), in [0, 0.5);
    /// `sigmoid` and `simpo` only.
    pub label_smoothing: f64,
    /// SimPO's target reward margin (`gamma`).
    pub simpo_gamma: f64,
    /// KTO's weights of the chosen (desirable) and rejected (undesirable) completions.
    pub desirable_weight: f64,
    pub undesirable_weight: f64,
    /// Reward-model jobs (`trainer: reward`): adds this times the mean squared sum of the
    /// pair's scores to the loss, keeping rewards centred at 0 (TRL's
    /// `center_rewards_coefficient`); unset = off.
    pub center_rewards_coefficient: Option<f64>,
    /// DAPO's dynamic sampling of informative groups.
    pub dynamic_sampling: DynamicSamplingConfig,
    /// DAPO's soft penalty for responses that run into the length limit.
    pub overlong_buffer: OverlongBufferConfig,
    /// Leave responses that hit `max_response_length` without EOS out of the policy loss
    /// (TRL's `mask_truncated_completions`); their scores still enter the advantages.
    pub mask_truncated_completions: bool,
}

impl Default for AlgorithmConfig {
    fn default() -> Self {
        let pref = PreferenceConfig::default();
        Self {
            adv_estimator: AdvEstimator::Gae,
            gamma: 1.0,
            lam: 0.95,
            kl_penalty: KlPenalty::Kl,
            kl_ctrl: KlCtrlConfig::default(),
            use_kl_in_reward: true,
            missing_eos_penalty: None,
            reward_clip: None,
            whiten_rewards: false,
            whiten_advantages: true,
            norm_adv_by_std_in_grpo: true,
            scale_rewards: ScaleRewards::Group,
            grpo_epsilon: 1e-6,
            score_placement: ScorePlacement::LastToken,
            loss_type: pref.loss_type,
            beta: pref.beta,
            label_smoothing: pref.label_smoothing,
            simpo_gamma: pref.simpo_gamma,
            desirable_weight: pref.desirable_weight,
            undesirable_weight: pref.undesirable_weight,
            center_rewards_coefficient: None,
            dynamic_sampling: DynamicSamplingConfig::default(),
            overlong_buffer: OverlongBufferConfig::default(),
            mask_truncated_completions: false,
        }
    }
}

impl AlgorithmConfig {
    /// How GRPO scales its centred scores: `scale_rewards`, or `none` when
    /// `norm_adv_by_std_in_grpo` is off.
    pub fn grpo_scale(&self) -> ScaleRewards {
        if self.norm_adv_by_std_in_grpo {
            self.scale_rewards
        } else {
            ScaleRewards::None
        }
    }

    fn check_scale_rewards(&self) -> Result<()> {
        if self.scale_rewards == ScaleRewards::Group {
            return Ok(());
        }
        if self.adv_estimator != AdvEstimator::Grpo {
            return Err(AlgoError::InvalidConfig {
                key: "algorithm.scale_rewards",
                value: self.scale_rewards.to_string(),
                reason: format!(
                    "only the grpo advantage estimator scales rewards, not {}: \
                     remove scale_rewards or use adv_estimator grpo",
                    self.adv_estimator
                ),
            });
        }
        if self.scale_rewards == ScaleRewards::Batch && !self.norm_adv_by_std_in_grpo {
            return Err(AlgoError::InvalidConfig {
                key: "algorithm.scale_rewards",
                value: "batch".into(),
                reason: "norm_adv_by_std_in_grpo is false, which turns every std scaling off: \
                         set norm_adv_by_std_in_grpo true, or scale_rewards none"
                    .into(),
            });
        }
        Ok(())
    }

    /// Dynamic sampling and overlong shaping on their own (the limits that involve the
    /// rollout's lengths and group size are checked with the whole config).
    fn check_dapo(&self) -> Result<()> {
        let ds = &self.dynamic_sampling;
        if ds.enable {
            if ds.max_num_gen_batches == 0 {
                return Err(AlgoError::InvalidConfig {
                    key: "algorithm.dynamic_sampling.max_num_gen_batches",
                    value: "0".into(),
                    reason: "at least the first generation round is needed: use 1 or more \
                             (verl's default is 10)"
                        .into(),
                });
            }
            if self.adv_estimator == AdvEstimator::Gae {
                return Err(AlgoError::InvalidConfig {
                    key: "algorithm.dynamic_sampling.enable",
                    value: "true".into(),
                    reason: "dynamic sampling drops groups whose scores are all equal because \
                             a group-relative estimator gives them no advantage; gae's \
                             advantages come from a critic and are not zero there: use \
                             adv_estimator grpo, rloo or reinforce_plus_plus_baseline, or \
                             turn dynamic sampling off"
                        .into(),
                });
            }
        }
        let ob = &self.overlong_buffer;
        if ob.enable {
            if ob.len == 0 {
                return Err(AlgoError::InvalidConfig {
                    key: "algorithm.overlong_buffer.len",
                    value: "0".into(),
                    reason: "the buffer must hold at least one token; DAPO uses a quarter of \
                             the maximum response length"
                        .into(),
                });
            }
            check_non_negative(
                "algorithm.overlong_buffer.penalty_factor",
                ob.penalty_factor,
            )?;
        }
        Ok(())
    }

    /// The DPO-family loss these keys describe.
    pub fn preference(&self) -> PreferenceConfig {
        PreferenceConfig {
            loss_type: self.loss_type,
            beta: self.beta,
            label_smoothing: self.label_smoothing,
            simpo_gamma: self.simpo_gamma,
            desirable_weight: self.desirable_weight,
            undesirable_weight: self.undesirable_weight,
        }
    }

    /// Checks value ranges and combinations.
    pub fn validate(&self) -> Result<()> {
        check_unit_interval("algorithm.gamma", self.gamma)?;
        check_unit_interval("algorithm.lam", self.lam)?;
        self.kl_ctrl.validate()?;
        if self.use_kl_in_reward && self.kl_penalty == KlPenalty::Full {
            return Err(AlgoError::InvalidConfig {
                key: "algorithm.kl_penalty",
                value: "full".into(),
                reason: "the per-token reward uses the sampled tokens' log-probs only; \
                         choose kl, abs, mse or low_var_kl"
                    .into(),
            });
        }
        if let Some(p) = self.missing_eos_penalty {
            check_non_negative("algorithm.missing_eos_penalty", p)?;
        }
        if let Some(c) = self.reward_clip {
            check_positive("algorithm.reward_clip", c)?;
        }
        check_non_negative("algorithm.grpo_epsilon", self.grpo_epsilon)?;
        self.check_scale_rewards()?;
        self.preference().validate()?;
        if let Some(c) = self.center_rewards_coefficient {
            check_non_negative("algorithm.center_rewards_coefficient", c)?;
        }
        self.check_dapo()?;
        if self.score_placement == ScorePlacement::Trl && self.adv_estimator != AdvEstimator::Gae {
            return Err(AlgoError::InvalidConfig {
                key: "algorithm.score_placement",
                value: "trl".into(),
                reason: format!(
                    "TRL's placement puts the score past the response, where only a critic's \
                     extra value slot sees it; it needs adv_estimator gae, not {}: \
                     use score_placement last_token",
                    self.adv_estimator
                ),
            });
        }
        Ok(())
    }
}

/// Actor (policy) loss settings, verl names; the GRPO-family choices with TRL's names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyLossConfig {
    /// PPO clip range epsilon (TRL `cliprange`, GRPO's `epsilon`). Default 0.2.
    pub clip_ratio: f64,
    /// Lower clip range; `clip_ratio` when unset.
    pub clip_ratio_low: Option<f64>,
    /// Upper clip range (GRPO's `epsilon_high`); `clip_ratio` when unset.
    pub clip_ratio_high: Option<f64>,
    /// Dual-clip bound for negative advantages (verl default 3.0, must be > 1);
    /// `null` turns dual clipping off, which is TRL's loss. `ppo` only.
    pub clip_ratio_c: Option<f64>,
    /// How the token loss matrix is reduced.
    pub loss_agg_mode: LossAggMode,
    /// `seq-mean-token-sum-norm` only: the constant each sequence's token sum is divided
    /// by (TRL's `max_completion_length`, verl's `loss_scale_factor`); the response width
    /// when unset. Set it to the rollout's maximum response length so that it stays the
    /// same for every micro-batch.
    pub loss_scale_factor: Option<f64>,
    /// The per-token objective: `ppo` (clipped surrogate), `cispo` or `sapo`.
    pub policy_loss: PolicyLoss,
    /// `token` (per-token ratios) or `sequence` (GSPO's per-sequence ratio).
    pub importance_sampling_level: ImportanceSamplingLevel,
    /// `cispo` only: the upper bound on the importance weight (TRL's `epsilon_high` under
    /// `loss_type: cispo`, ScaleRL's epsilon_max). Default 5.0, ScaleRL's recommendation.
    pub cispo_clip_max: f64,
    /// `sapo` only: the gate's temperature where the advantage is positive. TRL default 1.0.
    pub sapo_temperature_pos: f64,
    /// `sapo` only: the gate's temperature elsewhere. TRL default 1.05.
    pub sapo_temperature_neg: f64,
    /// Add a KL-to-reference term to the actor loss (GRPO style).
    pub use_kl_loss: bool,
    /// Weight of the KL loss.
    pub kl_loss_coef: f64,
    /// KL estimator of the KL loss.
    pub kl_loss_type: KlPenalty,
    /// Weight of the entropy bonus (subtracted from the loss).
    pub entropy_coeff: f64,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        Self {
            clip_ratio: 0.2,
            clip_ratio_low: None,
            clip_ratio_high: None,
            clip_ratio_c: Some(3.0),
            loss_agg_mode: LossAggMode::TokenMean,
            loss_scale_factor: None,
            policy_loss: PolicyLoss::Ppo,
            importance_sampling_level: ImportanceSamplingLevel::Token,
            cispo_clip_max: 5.0,
            sapo_temperature_pos: 1.0,
            sapo_temperature_neg: 1.05,
            use_kl_loss: false,
            kl_loss_coef: 0.001,
            kl_loss_type: KlPenalty::LowVarKl,
            entropy_coeff: 0.0,
        }
    }
}

impl PolicyLossConfig {
    /// Effective lower clip range.
    pub fn low(&self) -> f64 {
        self.clip_ratio_low.unwrap_or(self.clip_ratio)
    }

    /// Effective upper clip range.
    pub fn high(&self) -> f64 {
        self.clip_ratio_high.unwrap_or(self.clip_ratio)
    }

    /// Checks value ranges and combinations.
    pub fn validate(&self) -> Result<()> {
        check_non_negative("clip_ratio", self.clip_ratio)?;
        check_unit_interval("clip_ratio_low", self.low())?;
        check_non_negative("clip_ratio_high", self.high())?;
        if let Some(c) = self.clip_ratio_c {
            if !(c.is_finite() && c > 1.0) {
                return Err(AlgoError::InvalidConfig {
                    key: "clip_ratio_c",
                    value: c.to_string(),
                    reason: "the dual-clip bound must be > 1.0 (or null to disable dual clipping)"
                        .into(),
                });
            }
        }
        check_non_negative("kl_loss_coef", self.kl_loss_coef)?;
        if !self.entropy_coeff.is_finite() {
            return Err(AlgoError::InvalidConfig {
                key: "entropy_coeff",
                value: self.entropy_coeff.to_string(),
                reason: "must be finite".into(),
            });
        }
        self.validate_grpo_family()
    }

    fn validate_grpo_family(&self) -> Result<()> {
        check_scale_factor(self.loss_scale_factor, self.loss_agg_mode)?;
        if !(self.cispo_clip_max.is_finite() && self.cispo_clip_max > 1.0) {
            return Err(AlgoError::InvalidConfig {
                key: "cispo_clip_max",
                value: self.cispo_clip_max.to_string(),
                reason: "the cap on the importance weight must be a finite number > 1.0, or \
                         every on-policy token's gradient is scaled down (ScaleRL uses 5.0)"
                    .into(),
            });
        }
        for (key, t) in [
            ("sapo_temperature_pos", self.sapo_temperature_pos),
            ("sapo_temperature_neg", self.sapo_temperature_neg),
        ] {
            if !(t.is_finite() && t > 0.0) {
                return Err(AlgoError::InvalidConfig {
                    key,
                    value: t.to_string(),
                    reason: "the SAPO gate divides by its temperature: use a finite number > 0 \
                             (TRL's defaults: 1.0 for positive advantages, 1.05 otherwise)"
                        .into(),
                });
            }
        }
        Ok(())
    }
}

/// `loss_scale_factor` must be a positive number, and set only where it is used.
pub(crate) fn check_scale_factor(factor: Option<f64>, mode: LossAggMode) -> Result<()> {
    let Some(f) = factor else {
        return Ok(());
    };
    if mode != LossAggMode::SeqMeanTokenSumNorm {
        return Err(AlgoError::InvalidConfig {
            key: "loss_scale_factor",
            value: f.to_string(),
            reason: format!(
                "it is the divisor of loss_agg_mode seq-mean-token-sum-norm, not of {mode}: \
                 remove it or set loss_agg_mode seq-mean-token-sum-norm"
            ),
        });
    }
    check_positive("loss_scale_factor", f)
}

/// Critic (value) loss settings, TRL names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ValueLossConfig {
    /// Value clip range around the rollout values. TRL default 0.2.
    pub cliprange_value: f64,
    /// Weight of the value loss in a shared policy+value loss. TRL default 0.1.
    pub vf_coef: f64,
    /// How the token loss matrix is reduced.
    pub loss_agg_mode: LossAggMode,
}

impl Default for ValueLossConfig {
    fn default() -> Self {
        Self {
            cliprange_value: 0.2,
            vf_coef: 0.1,
            loss_agg_mode: LossAggMode::TokenMean,
        }
    }
}

impl ValueLossConfig {
    /// Checks value ranges.
    pub fn validate(&self) -> Result<()> {
        check_non_negative("cliprange_value", self.cliprange_value)?;
        check_non_negative("vf_coef", self.vf_coef)
    }
}
