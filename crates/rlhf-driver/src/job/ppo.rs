//! PPO as an [`Algorithm`]: from the step's batch, experience from every role at once, token
//! rewards and advantages, the off-policy correction of async batches (`rlhf_algo`'s
//! `off_policy`), critic and actor updates at once, metrics. The advantage
//! estimator picks GAE (with the critic) or a critic-free one (GRPO, RLOO, REINFORCE++); the
//! KL controller is the state it keeps across steps.

use std::collections::BTreeMap;
use std::time::Instant;

use rlhf_algo::{
    compute_advantage, compute_token_rewards, importance_weights, log_prob_gap, mask_truncated,
    metric, rollout_metrics, AdvEstimator, AdvantageInputs, KlController, RolloutMetricsInputs,
};
use rlhf_config::PpoConfig;
use rlhf_core::calls::candle::{f32_tensor, mat_f32};
use rlhf_core::calls::{
    ActorUpdateRequest, CriticUpdateRequest, LogProbsRequest, Mat, ValuesRequest,
};
use rlhf_core::{Error, Result};

use crate::checkpoint::TrainerState;
use crate::group::mean_metrics;
use crate::output::Sample;

use super::algorithm::{Algorithm, StepOutput};
use super::rollout::{scores_request, Probe, Rollout, Scored};
use super::{timed, Failed, Loop, Res};

/// PPO and its critic-free relatives.
pub(crate) struct Ppo {
    kl_ctl: KlController,
    /// The last rollout-vs-trainer gap measured (bounded mode measures it once per sync).
    last_gap: Option<(f64, f64)>,
}

impl Ppo {
    /// Checks what the config asks for against what the driver runs.
    pub(crate) fn new(cfg: &PpoConfig) -> Result<Self> {
        if cfg.algorithm.adv_estimator == AdvEstimator::Remax {
            return Err(Error::invalid(
                "algorithm.adv_estimator=remax needs a greedy baseline rollout per prompt, which the driver does not run yet; use gae, grpo, rloo, reinforce_plus_plus or reinforce_plus_plus_baseline",
            ));
        }
        let kl_ctl = KlController::from_config(&cfg.algorithm.kl_ctrl)
            .map_err(|e| Error::invalid(format!("algorithm.kl_ctrl: {e}")))?;
        Ok(Self {
            kl_ctl,
            last_gap: None,
        })
    }
}

impl Algorithm for Ppo {
    const NAME: &'static str = "ppo";

    fn resume(&mut self, state: &TrainerState) -> Result<()> {
        self.kl_ctl = state.kl_ctl.clone().ok_or_else(|| {
            Error::invalid(format!(
                "the PPO checkpoint of step {} holds no KL controller state (kl_ctl in trainer_state.json): the file is damaged; resume from an earlier checkpoint",
                state.global_step
            ))
        })?;
        Ok(())
    }

    fn save(&self, state: &mut TrainerState) {
        state.kl_ctl = Some(self.kl_ctl.clone());
    }

    async fn step(&mut self, cx: &mut Loop<'_>, step: u64, mut ro: Rollout) -> Res<StepOutput> {
        let cfg = cx.cfg;
        let mut timing = BTreeMap::new();
        let (rows, r) = (ro.rows, ro.r);
        let shape = [rows, r];
        let lp_req = LogProbsRequest(ro.seq.clone());
        let val_req = ValuesRequest(ro.seq.clone());
        // Dynamic sampling scored the batch while filtering it.
        let pre_scored = ro.scored.take();
        let tmo = cx.opts.call_timeout;
        let roles = cx.roles;
        let t = Instant::now();
        let ((old, t_old), (refl, t_ref), (vals, t_val), scores) = tokio::join!(
            timed(roles.train.call_split(&lp_req, tmo)),
            timed(async {
                if roles.reference.is_empty() {
                    Ok(None)
                } else {
                    roles.reference.call_split(&lp_req, tmo).await.map(Some)
                }
            }),
            timed(async {
                if roles.critic.is_empty() {
                    Ok(None)
                } else {
                    roles.critic.call_split(&val_req, tmo).await.map(Some)
                }
            }),
            // The reward's own time goes in `Scored::secs` (dynamic sampling's scoring too).
            async {
                match pre_scored {
                    Some(s) => Res::<Scored>::Ok(s),
                    None => {
                        let t = Instant::now();
                        let resp = roles.reward.call_split(&scores_request(&ro), tmo).await?;
                        Ok(Scored::new(cfg, &ro, resp, t.elapsed().as_secs_f64())?)
                    }
                }
            },
        );
        timing.insert(metric::TIMING_S_OLD_LOG_PROB.into(), t_old);
        timing.insert(metric::TIMING_S_REF.into(), t_ref);
        timing.insert(metric::TIMING_S_VALUES.into(), t_val);
        let scored: Scored = scores?;
        timing.insert(metric::TIMING_S_REWARD.into(), scored.secs);
        timing.insert(
            metric::TIMING_S_EXPERIENCE.into(),
            t.elapsed().as_secs_f64(),
        );
        let check = |m: &Mat<f32>, what: &str| -> Res<()> {
            if m.shape() != shape {
                return Err(Failed::Other(Error::internal(format!(
                    "{what} answered {:?}, expected {shape:?}",
                    m.shape()
                ))));
            }
            Ok(())
        };
        let old = old?.log_probs;
        check(&old, "actor_rollout/train ComputeLogProbs")?;
        let refl = match refl? {
            Some(b) => {
                check(&b.log_probs, "ref ComputeLogProbs")?;
                b.log_probs
            }
            None => old.clone(),
        };
        let vals = match vals? {
            Some(b) => {
                check(&b.values, "critic ComputeValues")?;
                Some(b.values)
            }
            None => None,
        };
        let scores = scored.scores.clone();
        if let Some(i) = scores.iter().position(|s| !s.is_finite()) {
            return Err(Failed::Other(Error::invalid(format!(
                "reward returned a non-finite score ({}) for row {i} at step {step}",
                scores[i]
            ))));
        }

        // Rewards and advantages on the driver.
        let t = Instant::now();
        let cpu = candle_core::Device::Cpu;
        let mask_t = f32_tensor(&ro.response_mask, "response_mask", &cpu)?;
        let old_t = f32_tensor(&old, "old_log_probs", &cpu)?;
        let ref_t = f32_tensor(&refl, "ref_log_probs", &cpu)?;
        let scores_t = candle_core::Tensor::from_slice(&scores, rows, &cpu)
            .map_err(|e| Error::internal(format!("scores: {e}")))?;
        let vals_t = match &vals {
            Some(v) => Some(f32_tensor(v, "values", &cpu)?),
            None => None,
        };
        let rewards = compute_token_rewards(
            &scores_t,
            &old_t,
            &ref_t,
            &mask_t,
            &ro.has_eos,
            self.kl_ctl.value(),
            &cfg.algorithm,
        )?;
        let adv = compute_advantage(
            &AdvantageInputs {
                token_rewards: &rewards.rewards,
                response_mask: &mask_t,
                values: vals_t.as_ref(),
                value_mask: Some(&rewards.value_mask),
                group_ids: Some(&ro.group_ids),
                baseline_scores: None,
            },
            &cfg.algorithm,
        )?;
        let mut metrics = rollout_metrics(&RolloutMetricsInputs {
            rewards: &rewards,
            logp: &old_t,
            response_mask: &mask_t,
            has_eos: &ro.has_eos,
            advantages: &adv.advantages,
            returns: &adv.returns,
            values: vals_t.as_ref(),
        })?;
        scored.metrics(&mut metrics);
        let mut advantages = mat_f32(&adv.advantages, "advantages")?;
        if let Some((behaviour, _)) = &ro.behaviour {
            let a = &cfg.actor_rollout.async_;
            let w =
                importance_weights(&old.data, &behaviour.data, &ro.response_mask.data, a.is_cap)?;
            metrics.insert(metric::ROLLOUT_IS_WEIGHT_MEAN.into(), w.mean);
            metrics.insert(metric::ROLLOUT_IS_WEIGHT_MAX.into(), w.max);
            // Sync mode samples with the trainers' own weights (w is 1 up to numerics): the
            // correction is for async batches only.
            if a.is_async() {
                for (x, w) in advantages.data.iter_mut().zip(&w.truncated) {
                    *x *= w;
                }
            }
        }
        let gap = match ro.probe {
            Probe::Behaviour => match &ro.behaviour {
                Some((b, _)) => log_prob_gap(&b.data, &old.data, &ro.response_mask.data)?,
                None => None,
            },
            Probe::Pending(rx) => match rx.await {
                Ok(lp) => {
                    let lp = lp?;
                    check(&lp, "actor_rollout/infer ComputeLogProbs")?;
                    log_prob_gap(&lp.data, &old.data, &ro.response_mask.data)?
                }
                Err(_) => None,
            },
            Probe::None => None,
        };
        if gap.is_some() {
            self.last_gap = gap;
        }
        if let Some((mean, max)) = self.last_gap {
            metrics.insert(metric::TRAINING_ROLLOUT_LOGPROB_GAP_MEAN.into(), mean);
            metrics.insert(metric::TRAINING_ROLLOUT_LOGPROB_GAP_MAX.into(), max);
        }
        let returns = mat_f32(&adv.returns, "returns")?;
        // The critic fits values where GAE ran: the response, plus the score's slot with
        // TRL's placement.
        let value_mask = mat_f32(&rewards.value_mask, "value_mask")?;
        timing.insert(metric::TIMING_S_ADV.into(), t.elapsed().as_secs_f64());

        // Updates: critic and actor at once.
        // TRL's mask_truncated_completions: responses cut at the length limit stay in the
        // advantages (their scores were given) but leave the policy loss.
        let mut actor_mask = ro.response_mask.clone();
        if cfg.algorithm.mask_truncated_completions {
            let masked = mask_truncated(&mut actor_mask.data, r, &ro.has_eos)?;
            metrics.insert(metric::ROLLOUT_MASKED_TRUNCATED.into(), masked as f64);
        }
        let actor_req = ActorUpdateRequest {
            seq: ro.seq.clone(),
            response_mask: actor_mask,
            old_log_probs: old,
            advantages,
            ref_log_probs: cfg.actor_rollout.use_kl_loss.then_some(refl),
            step,
        };
        let critic_req = vals.map(|v| CriticUpdateRequest {
            seq: ro.seq.clone(),
            value_mask,
            values: v,
            returns,
            step,
        });
        let ((actor_out, t_actor), (critic_out, t_critic)) = tokio::join!(
            timed(roles.train.call_each(&actor_req, tmo)),
            timed(async {
                match &critic_req {
                    Some(req) => roles.critic.call_each(req, tmo).await.map(Some),
                    None => Ok(None),
                }
            }),
        );
        timing.insert(metric::TIMING_S_UPDATE_ACTOR.into(), t_actor);
        timing.insert(metric::TIMING_S_UPDATE_CRITIC.into(), t_critic);
        metrics.extend(mean_metrics(&actor_out?));
        // TRL logs the policy's learning rate as `lr`.
        if let Some(&lr) = metrics.get(metric::ACTOR_LR) {
            metrics.insert(metric::LR.into(), lr);
        }
        if let Some(c) = critic_out? {
            metrics.extend(mean_metrics(&c));
        }
        for (k, v) in &metrics {
            if !v.is_finite() && k.starts_with("loss/") {
                return Err(Failed::Other(Error::invalid(format!(
                    "non-finite {k} ({v}) at step {step}: the update diverged; lower training.lr or check the reward scale"
                ))));
            }
        }

        let kl = metrics.get(metric::OBJECTIVE_KL).copied().unwrap_or(0.0);
        metrics.insert(metric::OBJECTIVE_KL_COEF.into(), self.kl_ctl.value());
        self.kl_ctl.update(kl, rows)?;
        metrics.extend(timing);
        metrics.insert(metric::PERF_TOTAL_NUM_TOKENS.into(), ro.tokens as f64);
        metrics.insert(metric::EPISODE.into(), (step * rows as u64) as f64);

        let k = (cfg.logging.sample_rows as usize).min(rows);
        let samples = (0..k)
            .map(|i| Sample {
                prompt: ro.prompt_text[i].clone(),
                response: ro.response_text[i].clone(),
                score: f64::from(scores[i]),
            })
            .collect();
        Ok(StepOutput { metrics, samples })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::algorithm::check_resume;
    use rlhf_config::data::DataCursor;

    #[test]
    fn config_checks_and_checkpoint_state() {
        let mut cfg = PpoConfig::default();
        cfg.algorithm.adv_estimator = AdvEstimator::Remax;
        let e = Ppo::new(&cfg).err().expect("remax refused").to_string();
        assert!(e.contains("algorithm.adv_estimator=remax"), "{e}");

        let cfg = PpoConfig::default();
        let mut ppo = Ppo::new(&cfg).unwrap();
        ppo.kl_ctl = KlController::Fixed { value: 0.125 };
        let mut st = TrainerState::new(Ppo::NAME, 4, DataCursor::default(), 1, "j");
        ppo.save(&mut st);
        let mut back = Ppo::new(&cfg).unwrap();
        check_resume::<Ppo>(&st, std::path::Path::new("ckpt/global_step_4")).unwrap();
        back.resume(&st).unwrap();
        assert_eq!(back.kl_ctl, ppo.kl_ctl);

        st.kl_ctl = None;
        let e = back.resume(&st).unwrap_err().to_string();
        assert!(e.contains("kl_ctl") && e.contains("step 4"), "{e}");

        st.algorithm = "dpo".into();
        let e = check_resume::<Ppo>(&st, std::path::Path::new("ckpt/global_step_4"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("global_step_4") && e.contains("\"dpo\"") && e.contains("\"ppo\""),
            "{e}"
        );
    }
}
