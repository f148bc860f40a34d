//! What a stage job measures besides its update: the held-out pairs of `data.eval_path`
//! under the current weights (`eval/*`), and KTO's KL estimate from mismatched pairs.

use std::collections::BTreeMap;

use rlhf_algo::metric;
use rlhf_config::TrainerKind;
use rlhf_core::calls::{LogProbsRequest, Mat, ScoresRequest, Sequences};
use rlhf_core::Error;

use super::encode::{pack, Cuts, Encoded};
use super::{sums, StageLoop};
use crate::group::WorkerGroup;
use crate::job::{Failed, Res};

impl StageLoop<'_> {
    /// The held-out pairs under the current weights, `eval/*` metrics: the reward model's
    /// loss, accuracy and margin, or the DPO family's loss and rewards (no update).
    pub(super) async fn evaluate(&self, group: &WorkerGroup) -> Res<BTreeMap<String, f64>> {
        let Some(pairs) = self.eval else {
            return Ok(BTreeMap::new());
        };
        let (cfg, t, pad) = (self.cfg, self.opts.call_timeout, self.pad());
        let chunk = (cfg.training.global_batch_size as usize).max(1);
        let dev = candle_core::Device::Cpu;
        let algo = |e: rlhf_algo::AlgoError| Failed::Other(Error::invalid(e.to_string()));
        let cand = |e: candle_core::Error| Failed::Other(Error::internal(e.to_string()));
        let vec1 = |v: &[f32]| candle_core::Tensor::new(v, &dev).map_err(cand);
        let mat = |m: &Mat<f32>| {
            candle_core::Tensor::from_vec(m.data.clone(), (m.rows, m.cols), &dev).map_err(cand)
        };
        let mut rm = rlhf_algo::RewardStats::default();
        let mut pref = rlhf_algo::PreferenceStats::default();
        for rows in pairs.chunks(chunk) {
            let mut cuts = Cuts::default();
            let chosen: Vec<&Encoded> = rows.iter().map(|r| &r.0).collect();
            let rejected: Vec<&Encoded> = rows.iter().map(|r| &r.1).collect();
            let (cs, cm) = pack(&chosen, cfg, pad, &mut cuts)?;
            let (rs, rm_mask) = pack(&rejected, cfg, pad, &mut cuts)?;
            if cfg.trainer == TrainerKind::Reward {
                let ask = |seq: Sequences| ScoresRequest {
                    prompt_text: vec![String::new(); seq.rows()],
                    response_text: vec![String::new(); seq.rows()],
                    ground_truth: None,
                    seq,
                };
                let (qc, qr) = (ask(cs), ask(rs));
                let (c, r) = tokio::try_join!(group.call_split(&qc, t), group.call_split(&qr, t))?;
                let margin = rows
                    .iter()
                    .map(|r| r.2.map(|m| m as f32))
                    .collect::<Option<Vec<f32>>>();
                let margin = margin.as_deref().map(vec1).transpose()?;
                let (_, s) = rlhf_algo::reward_loss(
                    &vec1(&c.scores)?,
                    &vec1(&r.scores)?,
                    margin.as_ref(),
                    cfg.algorithm.center_rewards_coefficient,
                )
                .map_err(algo)?;
                rm.merge(&s);
                continue;
            }
            let loss = cfg.algorithm.preference();
            let (qc, qr) = (LogProbsRequest(cs), LogProbsRequest(rs));
            let (pc, pr) = tokio::try_join!(group.call_split(&qc, t), group.call_split(&qr, t))?;
            let (mut ref_c, mut ref_r, mut kl) = (None, None, None);
            if loss.loss_type.needs_reference() {
                let r = &self.roles.reference;
                let (a, b) = tokio::try_join!(r.call_split(&qc, t), r.call_split(&qr, t))?;
                ref_c = Some(vec1(&sums(&a.log_probs, &cm))?);
                ref_r = Some(vec1(&sums(&b.log_probs, &rm_mask))?);
            }
            if loss.loss_type == rlhf_algo::PreferenceLoss::Kto {
                kl = Some(self.kto_kl(&chosen, &rejected, pad, &mut cuts).await?);
            }
            let out = rlhf_algo::preference_loss(
                &rlhf_algo::PairBatch {
                    chosen_logp: &mat(&pc.log_probs)?,
                    chosen_mask: &mat(&cm)?,
                    rejected_logp: &mat(&pr.log_probs)?,
                    rejected_mask: &mat(&rm_mask)?,
                    ref_chosen: ref_c.as_ref(),
                    ref_rejected: ref_r.as_ref(),
                    kto_kl: kl,
                },
                &loss,
            )
            .map_err(algo)?;
            pref.merge(&out.stats);
        }
        Ok(if cfg.trainer == TrainerKind::Reward {
            rm.metrics(metric::EVAL_PREFIX)
        } else {
            pref.metrics()
                .into_iter()
                .map(|(k, v)| {
                    let k = k.strip_prefix("train/").unwrap_or(&k).to_string();
                    (format!("{}{k}", metric::EVAL_PREFIX), v)
                })
                .collect()
        })
    }

    /// KTO's KL estimate: each unpaired row's prompt with the next row's completion, under
    /// the policy and the reference.
    pub(super) async fn kto_kl(
        &self,
        chosen: &[&Encoded],
        rejected: &[&Encoded],
        pad: u32,
        cuts: &mut Cuts,
    ) -> Res<f64> {
        let rows: Vec<&Encoded> = chosen.iter().chain(rejected).copied().collect();
        let mismatched: Vec<Encoded> = (0..rows.len())
            .map(|k| {
                let next = rows[(k + 1) % rows.len()];
                Encoded {
                    prompt: rows[k].prompt.clone(),
                    completion: next.completion.clone(),
                    loss: vec![true; next.completion.len()],
                }
            })
            .collect();
        let refs: Vec<&Encoded> = mismatched.iter().collect();
        let (seq, mask) = pack(&refs, self.cfg, pad, cuts)?;
        let t = self.opts.call_timeout;
        let req = LogProbsRequest(seq);
        let (policy, reference) = tokio::try_join!(
            self.roles.train.call_split(&req, t),
            self.roles.reference.call_split(&req, t),
        )?;
        let as64 = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<f64>>();
        rlhf_algo::kto_kl_estimate(
            &as64(sums(&policy.log_probs, &mask)),
            &as64(sums(&reference.log_probs, &mask)),
        )
        .map_err(|e| Failed::Other(Error::invalid(e.to_string())))
    }
}
