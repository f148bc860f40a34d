//! Every metric name the job logs, as constants: TRL's PPOTrainer names (`objective/*`,
//! `policy/*`, `loss/*`, `val/*`, `lr`, `episode`), verl's families (`critic/*`,
//! `response_length/*`, `timing_s/*`, `perf/*`) and the per-role update statistics
//! (`actor/*`). Producers and readers use these, so a renamed metric is one edit.

pub const OBJECTIVE_ENTROPY: &str = "objective/entropy";
pub const OBJECTIVE_KL: &str = "objective/kl";
pub const OBJECTIVE_KL_COEF: &str = "objective/kl_coef";
pub const OBJECTIVE_NON_SCORE_REWARD: &str = "objective/non_score_reward";
pub const OBJECTIVE_RLHF_REWARD: &str = "objective/rlhf_reward";
pub const OBJECTIVE_SCORES: &str = "objective/scores";

pub const POLICY_APPROXKL_AVG: &str = "policy/approxkl_avg";
pub const POLICY_CLIPFRAC_AVG: &str = "policy/clipfrac_avg";
pub const POLICY_ENTROPY_AVG: &str = "policy/entropy_avg";

pub const LOSS_POLICY_AVG: &str = "loss/policy_avg";
pub const LOSS_VALUE_AVG: &str = "loss/value_avg";

pub const VAL_CLIPFRAC_AVG: &str = "val/clipfrac_avg";
pub const VAL_NUM_EOS_TOKENS: &str = "val/num_eos_tokens";
pub const VAL_RATIO: &str = "val/ratio";
pub const VAL_RATIO_VAR: &str = "val/ratio_var";
pub const VAL_VPRED: &str = "val/vpred";

pub const EPISODE: &str = "episode";
pub const EPOCH: &str = "epoch";
pub const LR: &str = "lr";

pub const CRITIC_ADVANTAGES_MEAN: &str = "critic/advantages/mean";
pub const CRITIC_GRAD_NORM: &str = "critic/grad_norm";
pub const CRITIC_LR: &str = "critic/lr";
pub const CRITIC_RETURNS_MEAN: &str = "critic/returns/mean";
pub const CRITIC_VALUES_MEAN: &str = "critic/values/mean";
pub const CRITIC_VF_EXPLAINED_VAR: &str = "critic/vf_explained_var";

pub const ACTOR_GRAD_NORM: &str = "actor/grad_norm";
pub const ACTOR_KL_LOSS: &str = "actor/kl_loss";
pub const ACTOR_LR: &str = "actor/lr";
pub const ACTOR_PG_CLIPFRAC_LOWER: &str = "actor/pg_clipfrac_lower";

pub const RESPONSE_LENGTH_MEAN: &str = "response_length/mean";

/// |rollout engine log-prob - trainer log-prob| over valid response tokens, on the same
/// weights and tokens: the inference path (kernels, dtype, synced weights) against the
/// trainer's recomputation. Sync mode compares the sampling log-probs; async modes a
/// teacher-forced pass of the rollout ranks once they hold the trainer's weights.
pub const TRAINING_ROLLOUT_LOGPROB_GAP_MEAN: &str = "training/rollout_logprob_gap_mean";
pub const TRAINING_ROLLOUT_LOGPROB_GAP_MAX: &str = "training/rollout_logprob_gap_max";
/// Policy versions between the weights that sampled a row and the trainer's (admitted rows).
pub const ROLLOUT_STALENESS_MEAN: &str = "rollout/staleness_mean";
pub const ROLLOUT_STALENESS_MAX: &str = "rollout/staleness_max";
/// Rows dropped because they were sampled more than `max_staleness` versions ago.
pub const ROLLOUT_DROPPED: &str = "rollout/dropped";
/// The importance weight pi_old / pi_behaviour over valid tokens, before truncation.
pub const ROLLOUT_IS_WEIGHT_MEAN: &str = "rollout/is_weight_mean";
pub const ROLLOUT_IS_WEIGHT_MAX: &str = "rollout/is_weight_max";
/// Dynamic sampling: generation rounds that made the batch, groups dropped because every
/// response scored alike, and dropped groups put back when the rounds ran out.
pub const ROLLOUT_GEN_BATCHES: &str = "rollout/gen_batches";
pub const ROLLOUT_FILTERED_GROUPS: &str = "rollout/filtered_groups";
pub const ROLLOUT_PADDED_GROUPS: &str = "rollout/padded_groups";
/// Dynamic sampling with a verifying reward: the share of right answers over every response
/// generated for the batch, before the filter chose (`reward/accuracy` is the batch's).
pub const ROLLOUT_GENERATED_ACCURACY: &str = "rollout/generated_accuracy";
/// Mean of DAPO's overlong penalties over the batch's rows (0 without shaping).
pub const ROLLOUT_OVERLONG_PENALTY_MEAN: &str = "rollout/overlong_penalty_mean";
/// Responses left out of the policy loss by `algorithm.mask_truncated_completions`.
pub const ROLLOUT_MASKED_TRUNCATED: &str = "rollout/masked_truncated";
/// Verifying rewards (`math`, `exact_match`): the share of right answers, and how many
/// responses had no answer to check.
pub const REWARD_ACCURACY: &str = "reward/accuracy";
pub const REWARD_NO_ANSWER: &str = "reward/no_answer";

pub const TIMING_S_ADV: &str = "timing_s/adv";
pub const TIMING_S_CHECKPOINT: &str = "timing_s/checkpoint";
pub const TIMING_S_EXPERIENCE: &str = "timing_s/experience";
pub const TIMING_S_GEN: &str = "timing_s/gen";
pub const TIMING_S_OLD_LOG_PROB: &str = "timing_s/old_log_prob";
pub const TIMING_S_REF: &str = "timing_s/ref";
pub const TIMING_S_REWARD: &str = "timing_s/reward";
pub const TIMING_S_STEP: &str = "timing_s/step";
pub const TIMING_S_SYNC_WEIGHTS: &str = "timing_s/sync_weights";
pub const TIMING_S_UPDATE_ACTOR: &str = "timing_s/update_actor";
pub const TIMING_S_UPDATE_CRITIC: &str = "timing_s/update_critic";
pub const TIMING_S_VALUES: &str = "timing_s/values";
/// Time the trainers waited for the step's batch (0 when the rollout ran ahead).
pub const TIMING_S_WAIT_ROLLOUT: &str = "timing_s/wait_rollout";

pub const PERF_THROUGHPUT: &str = "perf/throughput";
/// Response tokens the rollout generated per second of its generation (the engine's speed,
/// candle or vLLM).
pub const PERF_ROLLOUT_TOKENS_PER_S: &str = "perf/rollout_tokens_per_s";
pub const PERF_TOTAL_NUM_TOKENS: &str = "perf/total_num_tokens";
/// Wall time of the step's trainer → rollout weight sync (0 when colocated).
pub const PERF_WEIGHT_SYNC_S: &str = "perf/weight_sync_s";
/// Bytes the weight sync delivered to rollout ranks (payload times receivers).
pub const PERF_WEIGHT_SYNC_BYTES: &str = "perf/weight_sync_bytes";

/// Prefix of the wall-clock timings (left out when runs are compared).
pub const TIMING_PREFIX: &str = "timing_s/";

/// The supervised and preference jobs' loss (mean over the step's tokens or pairs).
pub const TRAIN_LOSS: &str = "train/loss";
/// Prefix of the metrics measured on an eval split (`eval/loss`, `eval/accuracy`, ...).
pub const EVAL_PREFIX: &str = "eval/";
/// Completion tokens trained on per second (SFT).
pub const TRAIN_TOKENS_PER_S: &str = "train/tokens_per_s";

/// DPO family, TRL's names: the implicit rewards `beta * (logp - ref_logp)` of the chosen and
/// rejected completions (SimPO: `beta *` the average log-prob), the share of pairs whose
/// chosen reward is higher, their mean difference, and the policy's log-probs.
pub const REWARDS_CHOSEN: &str = "rewards/chosen";
pub const REWARDS_REJECTED: &str = "rewards/rejected";
pub const REWARDS_ACCURACIES: &str = "rewards/accuracies";
pub const REWARDS_MARGINS: &str = "rewards/margins";
pub const LOGPS_CHOSEN: &str = "logps/chosen";
pub const LOGPS_REJECTED: &str = "logps/rejected";
/// KTO's KL estimate over mismatched prompt/completion pairs.
pub const KTO_KL: &str = "kl";

/// Reward-model training, TRL's `RewardTrainer` names: pairs scored chosen above rejected,
/// the mean score difference, and the scores' mean, min and max.
pub const RM_ACCURACY: &str = "accuracy";
pub const RM_MARGIN: &str = "margin";
pub const RM_MEAN_REWARD: &str = "mean_reward";
pub const RM_MIN_REWARD: &str = "min_reward";
pub const RM_MAX_REWARD: &str = "max_reward";
/// A reward-model trainer's gradient norm and learning rate.
pub const REWARD_MODEL_GRAD_NORM: &str = "reward_model/grad_norm";
pub const REWARD_MODEL_LR: &str = "reward_model/lr";
