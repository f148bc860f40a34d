//! One PPO step: rollout, experience from every role at once, token rewards and
//! advantages, critic and actor updates at once, weight sync, metrics.

use std::collections::BTreeMap;
use std::time::Instant;

use rlhf_algo::{
    compute_advantage, compute_token_rewards, metric, rollout_metrics, AdvantageInputs,
    RolloutMetricsInputs,
};
use rlhf_core::Error;
use serde_json::json;

use crate::group::{mean_meta_metrics, BatchCall};
use crate::output::Sample;
use crate::tensors::{candle, f32_1d, f32_2d, host, wire_f32, wire_i64};

use super::{timed, Failed, Loop, Res};

impl Loop<'_> {
    pub(super) async fn step(&mut self, step: u64) -> Res<(BTreeMap<String, f64>, Vec<Sample>)> {
        let cfg = self.cfg;
        let step_start = Instant::now();
        let mut timing = BTreeMap::new();
        let ro = self.rollout(step, &mut timing).await?;
        let (rows, r) = (ro.rows, ro.r);
        let seq = ro.sequences()?;
        let mut score_batch = seq.clone();
        score_batch
            .tensors
            .insert("responses".into(), wire_i64(&ro.responses, &[rows, r])?);
        score_batch.tensors.insert(
            "response_mask".into(),
            wire_f32(&ro.response_mask, &[rows, r])?,
        );
        score_batch.columns.insert(
            "prompt_text".into(),
            ro.prompt_text.iter().map(|s| json!(s)).collect(),
        );
        score_batch.columns.insert(
            "response_text".into(),
            ro.response_text.iter().map(|s| json!(s)).collect(),
        );
        if let Some(gt) = &ro.ground_truth {
            score_batch
                .columns
                .insert("ground_truth".into(), gt.iter().map(|s| json!(s)).collect());
        }
        let tmo = self.opts.call_timeout;
        let roles = self.roles;
        let t = Instant::now();
        let ((old, t_old), (refl, t_ref), (vals, t_val), (scores, t_score)) = tokio::join!(
            timed(
                roles
                    .train
                    .call_split(BatchCall::ComputeLogProbs, &seq, tmo)
            ),
            timed(async {
                if roles.reference.is_empty() {
                    Ok(None)
                } else {
                    roles
                        .reference
                        .call_split(BatchCall::ComputeLogProbs, &seq, tmo)
                        .await
                        .map(Some)
                }
            }),
            timed(async {
                if roles.critic.is_empty() {
                    Ok(None)
                } else {
                    roles
                        .critic
                        .call_split(BatchCall::ComputeValues, &seq, tmo)
                        .await
                        .map(Some)
                }
            }),
            timed(
                roles
                    .reward
                    .call_split(BatchCall::ComputeScores, &score_batch, tmo)
            ),
        );
        timing.insert(metric::TIMING_S_OLD_LOG_PROB.into(), t_old);
        timing.insert(metric::TIMING_S_REF.into(), t_ref);
        timing.insert(metric::TIMING_S_VALUES.into(), t_val);
        timing.insert(metric::TIMING_S_REWARD.into(), t_score);
        timing.insert(
            metric::TIMING_S_EXPERIENCE.into(),
            t.elapsed().as_secs_f64(),
        );
        let old = f32_2d(
            &old?,
            "log_probs",
            rows,
            r,
            "actor_rollout/train ComputeLogProbs",
        )?;
        let refl = match refl? {
            Some(b) => f32_2d(&b, "log_probs", rows, r, "ref ComputeLogProbs")?,
            None => old.clone(),
        };
        let vals = match vals? {
            Some(b) => Some(f32_2d(&b, "values", rows, r, "critic ComputeValues")?),
            None => None,
        };
        let scores = f32_1d(&scores?, "scores", rows, "reward ComputeScores")?;
        if let Some(i) = scores.iter().position(|s| !s.is_finite()) {
            return Err(Failed::Other(Error::invalid(format!(
                "reward returned a non-finite score ({}) for row {i} at step {step}",
                scores[i]
            ))));
        }

        // Rewards and advantages on the driver.
        let t = Instant::now();
        let shape = [rows, r];
        let mask_t = candle(&ro.response_mask, &shape)?;
        let old_t = candle(&old, &shape)?;
        let ref_t = candle(&refl, &shape)?;
        let scores_t = candle(&scores, &[rows])?;
        let vals_t = match &vals {
            Some(v) => Some(candle(v, &shape)?),
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
        let advantages = host(&adv.advantages)?;
        let returns = host(&adv.returns)?;
        // The critic fits values where GAE ran: the response, plus the score's slot with
        // TRL's placement.
        let value_mask = host(&rewards.value_mask)?;
        timing.insert(metric::TIMING_S_ADV.into(), t.elapsed().as_secs_f64());

        // Updates: critic and actor at once.
        let mut actor_batch = seq.clone();
        actor_batch.meta.insert("step".into(), json!(step));
        for (name, v) in [
            ("response_mask", &ro.response_mask),
            ("old_log_probs", &old),
            ("advantages", &advantages),
        ] {
            actor_batch
                .tensors
                .insert(name.into(), wire_f32(v, &shape)?);
        }
        if cfg.actor_rollout.use_kl_loss {
            actor_batch
                .tensors
                .insert("ref_log_probs".into(), wire_f32(&refl, &shape)?);
        }
        let critic_batch = match &vals {
            Some(v) => {
                let mut b = seq.clone();
                b.meta.insert("step".into(), json!(step));
                b.tensors
                    .insert("response_mask".into(), wire_f32(&value_mask, &shape)?);
                b.tensors.insert("values".into(), wire_f32(v, &shape)?);
                b.tensors
                    .insert("returns".into(), wire_f32(&returns, &shape)?);
                Some(b)
            }
            None => None,
        };
        let ((actor_out, t_actor), (critic_out, t_critic)) = tokio::join!(
            timed(
                roles
                    .train
                    .call_each(BatchCall::UpdateActor, &actor_batch, tmo)
            ),
            timed(async {
                match &critic_batch {
                    Some(b) => roles
                        .critic
                        .call_each(BatchCall::UpdateCritic, b, tmo)
                        .await
                        .map(Some),
                    None => Ok(None),
                }
            }),
        );
        timing.insert(metric::TIMING_S_UPDATE_ACTOR.into(), t_actor);
        timing.insert(metric::TIMING_S_UPDATE_CRITIC.into(), t_critic);
        metrics.extend(mean_meta_metrics(&actor_out?));
        // TRL logs the policy's learning rate as `lr`.
        if let Some(&lr) = metrics.get(metric::ACTOR_LR) {
            metrics.insert(metric::LR.into(), lr);
        }
        if let Some(c) = critic_out? {
            metrics.extend(mean_meta_metrics(&c));
        }
        for (k, v) in &metrics {
            if !v.is_finite() && k.starts_with("loss/") {
                return Err(Failed::Other(Error::invalid(format!(
                    "non-finite {k} ({v}) at step {step}: the update diverged; lower training.lr or check the reward scale"
                ))));
            }
        }

        let t_sync = self.sync_weights(step).await?;
        timing.insert(metric::TIMING_S_SYNC_WEIGHTS.into(), t_sync);

        let kl = metrics.get(metric::OBJECTIVE_KL).copied().unwrap_or(0.0);
        metrics.insert(metric::OBJECTIVE_KL_COEF.into(), self.kl_ctl.value());
        self.kl_ctl.update(kl, rows)?;
        let elapsed = step_start.elapsed().as_secs_f64();
        timing.insert(metric::TIMING_S_STEP.into(), elapsed);
        metrics.extend(timing);
        metrics.insert(
            metric::PERF_THROUGHPUT.into(),
            ro.tokens as f64 / elapsed.max(1e-9),
        );
        metrics.insert(metric::PERF_TOTAL_NUM_TOKENS.into(), ro.tokens as f64);
        metrics.insert(metric::EPISODE.into(), (step * rows as u64) as f64);
        metrics.insert(metric::EPOCH.into(), self.sampler.cursor().epoch as f64);

        let k = (cfg.logging.sample_rows as usize).min(rows);
        let samples = (0..k)
            .map(|i| Sample {
                prompt: ro.prompt_text[i].clone(),
                response: ro.response_text[i].clone(),
                score: f64::from(scores[i]),
            })
            .collect();
        Ok((metrics, samples))
    }
}
