//! Closed enums for the algorithm choices that configs name by string.
//!
//! The serde names are the config strings used by verl / TRL, so a config loader
//! can embed these types directly; `FromStr` gives the same names to CLI overrides
//! and reports every valid name on a typo.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::AlgoError;

macro_rules! named_enum {
    (
        $(#[$meta:meta])*
        $name:ident, $kind:literal {
            $( $(#[$vmeta:meta])* $variant:ident = $s:literal $(| $alias:literal)* ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
        pub enum $name {
            $( $(#[$vmeta])* #[serde(rename = $s $(, alias = $alias)*)] $variant, )+
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The config string of this variant.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $s),+ }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = AlgoError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $( $s $(| $alias)* => Ok($name::$variant), )+
                    _ => Err(AlgoError::UnknownName {
                        kind: $kind,
                        got: s.to_string(),
                        valid: [$($s),+].join(", "),
                    }),
                }
            }
        }
    };
}

named_enum! {
    /// How advantages are estimated (`algorithm.adv_estimator`).
    AdvEstimator, "advantage estimator (algorithm.adv_estimator)" {
        /// Generalized Advantage Estimation with a critic.
        #[default]
        Gae = "gae",
        /// Group-relative outcome advantage: (score - group mean) / group std.
        Grpo = "grpo",
        /// Leave-one-out baseline within each group.
        Rloo = "rloo",
        /// Discounted return-to-go, whitened over the batch.
        ReinforcePlusPlus = "reinforce_plus_plus",
        /// Score minus group mean, whitened over the batch.
        ReinforcePlusPlusBaseline = "reinforce_plus_plus_baseline",
        /// Return-to-go minus a greedy-rollout baseline score.
        Remax = "remax",
    }
}

named_enum! {
    /// Per-token KL estimator (`algorithm.kl_penalty`, `kl_loss_type`).
    /// See J. Schulman, "Approximating KL divergence" (2020).
    KlPenalty, "KL penalty (algorithm.kl_penalty / kl_loss_type)" {
        /// k1: `logp - ref_logp`.
        #[default]
        Kl = "kl" | "k1",
        /// `|logp - ref_logp|`.
        Abs = "abs",
        /// k2: `0.5 * (logp - ref_logp)^2`.
        Mse = "mse" | "k2",
        /// k3: `exp(ref - logp) - (ref - logp) - 1`, clamped as in verl.
        LowVarKl = "low_var_kl" | "k3",
        /// Exact KL over the whole vocabulary; needs full log-distributions.
        Full = "full",
    }
}

named_enum! {
    /// How a `[batch, len]` loss matrix is reduced to a scalar (`loss_agg_mode`).
    LossAggMode, "loss aggregation mode (loss_agg_mode)" {
        /// Mean over every valid token of the batch.
        #[default]
        TokenMean = "token-mean",
        /// Sum over each sequence's tokens, then mean over sequences.
        SeqMeanTokenSum = "seq-mean-token-sum",
        /// Mean over each sequence's tokens, then mean over sequences: TRL GRPO's `grpo`
        /// (and `sapo`) aggregation.
        SeqMeanTokenMean = "seq-mean-token-mean",
        /// Sum over each sequence's tokens divided by a constant (`loss_scale_factor`, TRL's
        /// `max_completion_length`; the response width when unset), then mean over
        /// sequences: TRL GRPO's `dr_grpo` (Dr. GRPO), `sum / (batch * max_completion_length)`.
        SeqMeanTokenSumNorm = "seq-mean-token-sum-norm",
    }
}

impl LossAggMode {
    /// Whether the denominator counts sequences (the `seq-mean-*` modes) rather than tokens.
    pub fn per_sequence(self) -> bool {
        !matches!(self, LossAggMode::TokenMean)
    }
}

named_enum! {
    /// Which policy-gradient objective the actor minimises (`policy_loss`), as TRL's
    /// GRPOTrainer computes it per token before aggregation (its `loss_type`'s first half).
    PolicyLoss, "policy loss (policy_loss)" {
        /// The clipped surrogate `max(-A r, -A clip(r, 1 - low, 1 + high))`, with verl's
        /// dual clip when `clip_ratio_c` is set (PPO; TRL's grpo/bnpo/dr_grpo/dapo).
        #[default]
        Ppo = "ppo" | "vanilla",
        /// CISPO (MiniMax-M1): `-sg(min(r, cispo_clip_max)) * A * logp`, the importance
        /// weight clipped from above and detached, times the log-prob (TRL's `cispo`).
        Cispo = "cispo",
        /// SAPO: a soft gate instead of a clip, `-A * sigmoid(tau (r - 1)) * 4 / tau` with
        /// `tau = sapo_temperature_pos` where `A > 0`, else `sapo_temperature_neg` (TRL's
        /// `sapo`).
        Sapo = "sapo",
    }
}

named_enum! {
    /// Where the importance ratio `r` is formed (`importance_sampling_level`).
    ImportanceSamplingLevel, "importance sampling level (importance_sampling_level)" {
        /// Per token: `r_t = exp(logp_t - old_logp_t)`.
        #[default]
        Token = "token",
        /// Per sequence (GSPO): `r = exp(mean over the response tokens of logp - old_logp)`,
        /// the same for every token of the sequence; clipped, gated or capped as the token
        /// ratio is.
        Sequence = "sequence",
    }
}

named_enum! {
    /// How GRPO divides the group-centred scores (`algorithm.scale_rewards`), as TRL's
    /// GRPOTrainer does.
    ScaleRewards, "reward scaling (algorithm.scale_rewards)" {
        /// By the standard deviation of the prompt's group.
        #[default]
        Group = "group",
        /// By the standard deviation of every score in the batch (PPO Lite).
        Batch = "batch",
        /// Not at all (Dr. GRPO).
        None = "none",
    }
}

named_enum! {
    /// KL coefficient controller (`algorithm.kl_ctrl.type`).
    KlCtrlType, "KL controller type (algorithm.kl_ctrl.type)" {
        /// Constant coefficient.
        #[default]
        Fixed = "fixed",
        /// Proportional controller towards `target_kl` (Ziegler et al., 2019).
        Adaptive = "adaptive",
    }
}

named_enum! {
    /// What DAPO's dynamic sampling compares within a group (`algorithm.dynamic_sampling.metric`).
    FilterMetric, "dynamic sampling metric (algorithm.dynamic_sampling.metric)" {
        /// The final score (after overlong shaping): a group whose scores are all equal is
        /// dropped.
        #[default]
        Score = "score",
        /// The reward's correctness verdict (the `math` and `exact_match` rules report it):
        /// a group whose responses are all right or all wrong is dropped.
        Accuracy = "accuracy" | "acc",
    }
}

named_enum! {
    /// What dynamic sampling does when `max_num_gen_batches` generation rounds have not
    /// filled the batch (`algorithm.dynamic_sampling.when_exhausted`).
    WhenExhausted, "dynamic sampling exhaustion (algorithm.dynamic_sampling.when_exhausted)" {
        /// Train on the groups kept so far, the batch topped up with the latest dropped
        /// groups (their advantages are zero under group estimators), so its shape stays.
        #[default]
        Train = "train",
        /// Fail the job with the counts (verl's behaviour).
        Fail = "fail",
    }
}

named_enum! {
    /// Where the sequence score enters the per-token rewards (`algorithm.score_placement`).
    ScorePlacement, "score placement (algorithm.score_placement)" {
        /// On the last valid response token (verl). Values, GAE and the value loss cover the
        /// response tokens.
        #[default]
        LastToken = "last_token",
        /// TRL's PPOTrainer: one slot past the last valid token (on the last slot when the
        /// response fills it), with values, GAE and the value loss extended by that slot.
        /// For precision alignment with TRL; `gae` only.
        Trl = "trl",
    }
}

named_enum! {
    /// The loss of a preference (DPO-family) job (`algorithm.loss_type`), as TRL computes it.
    PreferenceLoss, "preference loss type (algorithm.loss_type)" {
        /// DPO: `-log sigmoid(beta * delta)` of the summed log-ratios (TRL's `sigmoid`), with
        /// conservative label smoothing (cDPO) when `label_smoothing > 0`.
        #[default]
        Sigmoid = "sigmoid" | "dpo",
        /// IPO: `(delta / tokens - 1 / (2 beta))^2`, log-ratios averaged over each
        /// completion's tokens (TRL's `ipo`).
        Ipo = "ipo",
        /// SimPO: no reference model; average log-probs, a target margin `gamma`
        /// (TRL's CPO trainer with `loss_type: simpo`, `cpo_alpha: 0`).
        Simpo = "simpo",
        /// KTO: each completion scored alone against a batch KL estimate from mismatched
        /// prompt/completion pairs (TRL's KTO trainer on the unpaired rows).
        Kto = "kto",
    }
}

impl PreferenceLoss {
    /// Whether the loss needs reference log-probs (a reference role).
    pub fn needs_reference(self) -> bool {
        !matches!(self, PreferenceLoss::Simpo)
    }
}

impl AdvEstimator {
    /// Whether the estimator needs a critic (value model).
    pub fn needs_critic(self) -> bool {
        matches!(self, AdvEstimator::Gae)
    }

    /// Whether the estimator needs group ids (several responses per prompt).
    pub fn needs_groups(self) -> bool {
        matches!(
            self,
            AdvEstimator::Grpo | AdvEstimator::Rloo | AdvEstimator::ReinforcePlusPlusBaseline
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_every_name() {
        for v in AdvEstimator::ALL {
            assert_eq!(v.as_str().parse::<AdvEstimator>().unwrap(), *v);
        }
        for v in KlPenalty::ALL {
            assert_eq!(v.as_str().parse::<KlPenalty>().unwrap(), *v);
        }
        for v in LossAggMode::ALL {
            assert_eq!(v.as_str().parse::<LossAggMode>().unwrap(), *v);
        }
        for v in KlCtrlType::ALL {
            assert_eq!(v.as_str().parse::<KlCtrlType>().unwrap(), *v);
        }
        for v in PreferenceLoss::ALL {
            assert_eq!(v.as_str().parse::<PreferenceLoss>().unwrap(), *v);
        }
        for v in PolicyLoss::ALL {
            assert_eq!(v.as_str().parse::<PolicyLoss>().unwrap(), *v);
        }
        for v in ImportanceSamplingLevel::ALL {
            assert_eq!(v.as_str().parse::<ImportanceSamplingLevel>().unwrap(), *v);
        }
        for v in ScaleRewards::ALL {
            assert_eq!(v.as_str().parse::<ScaleRewards>().unwrap(), *v);
        }
        assert_eq!("vanilla".parse::<PolicyLoss>().unwrap(), PolicyLoss::Ppo);
    }

    #[test]
    fn aliases_parse() {
        assert_eq!("k3".parse::<KlPenalty>().unwrap(), KlPenalty::LowVarKl);
        assert_eq!("k1".parse::<KlPenalty>().unwrap(), KlPenalty::Kl);
        assert_eq!("k2".parse::<KlPenalty>().unwrap(), KlPenalty::Mse);
    }

    #[test]
    fn unknown_name_lists_valid_ones() {
        let err = "ppo".parse::<AdvEstimator>().unwrap_err().to_string();
        assert!(err.contains("`ppo`"), "{err}");
        for v in AdvEstimator::ALL {
            assert!(err.contains(v.as_str()), "{err} misses {v}");
        }
        let err = "token_mean".parse::<LossAggMode>().unwrap_err().to_string();
        assert!(
            err.contains("token-mean, seq-mean-token-sum, seq-mean-token-mean"),
            "{err}"
        );
    }
}
