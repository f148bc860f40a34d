//! A step's rollout: prompts from the sampler, responses from the rollout ranks or the
//! fixed-responses file, the sequences every role scores. [`RolloutSource`] holds what
//! making a batch needs and nothing the trainers use, so the rollout lane of an async run
//! (`super::pipeline`) makes the next batches while the loop trains on this one. With DAPO's
//! dynamic sampling (`algorithm.dynamic_sampling`) a batch is scored here, its groups whose
//! responses all score alike are dropped, and more prompts are generated until the batch is
//! full: the lane of an async run keeps producing until then.

use std::time::Instant;

use rlhf_algo::{informative_groups, overlong_penalty, FilterMetric, WhenExhausted};
use rlhf_config::data::{DataCursor, PromptSampler};
use rlhf_config::PpoConfig;
use rlhf_core::calls::{
    GenerateRequest, GenerateResponse, Mat, ScoresRequest, ScoresResponse, Sequences, Verdict,
};
use rlhf_core::{Error, Result};
use rlhf_tokenizer::Tokenizer;
use tokio::sync::oneshot;

use crate::cluster::Roles;
use crate::group::CallError;
use crate::prompts::{FixedResponse, FixedResponses, Prompt};

use super::{DriverOptions, Failed, Res};

/// Everything that makes a step's batch: the prompts, their sampler, the rollout ranks.
pub(super) struct RolloutSource<'a> {
    pub(super) cfg: &'a PpoConfig,
    pub(super) opts: &'a DriverOptions,
    pub(super) tok: &'a Tokenizer,
    pub(super) prompts: &'a [Prompt],
    pub(super) fixed: Option<&'a FixedResponses>,
    pub(super) sampler: &'a mut PromptSampler,
    pub(super) roles: &'a Roles,
}

/// The rollout engine's log-probs of a batch on the trainer's weights, for
/// `training/rollout_logprob_gap_*`.
pub(super) enum Probe {
    /// The batch was sampled with the trainer's current weights: its behaviour log-probs.
    Behaviour,
    /// A teacher-forced pass of the rollout ranks once they hold the trainer's weights
    /// (async modes, the first step after each sync).
    Pending(oneshot::Receiver<std::result::Result<Mat<f32>, CallError>>),
    /// Not measured this step (fixed responses; bounded mode between syncs).
    None,
}

/// One step's rollout, kept on the driver.
pub(super) struct Rollout {
    pub(super) rows: usize,
    pub(super) r: usize,
    /// Prompt then response, `[rows, P+R]`.
    pub(super) seq: Sequences,
    pub(super) response_mask: Mat<f32>,
    /// The sampling policy's log-probs and weights version per row (`None` with fixed
    /// responses, which no policy sampled).
    pub(super) behaviour: Option<(Mat<f32>, Vec<u64>)>,
    pub(super) prompt_text: Vec<String>,
    pub(super) response_text: Vec<String>,
    pub(super) ground_truth: Option<Vec<Option<String>>>,
    pub(super) has_eos: Vec<bool>,
    pub(super) group_ids: Vec<usize>,
    /// The dataset row of each group's prompt, in group order (`logging.ledger_file`).
    pub(super) prompt_rows: Vec<usize>,
    /// The dataset rows of the groups dynamic sampling dropped for this batch (all alike),
    /// and of those it generated beyond the batch (informative, but the batch was full).
    pub(super) dropped_rows: Vec<usize>,
    pub(super) surplus_rows: Vec<usize>,
    pub(super) tokens: usize,
    /// The sampler's cursor right after this batch's prompts were drawn: what a
    /// checkpoint after this step records.
    pub(super) cursor: DataCursor,
    /// Wall time of the generation (overlapped with training in async modes).
    pub(super) gen_s: f64,
    pub(super) probe: Probe,
    /// The batch's scores when dynamic sampling made them while filtering.
    pub(super) scored: Option<Scored>,
}

/// A batch's final scores: the reward's, shaped for overlong responses.
#[derive(Debug, Clone)]
pub(super) struct Scored {
    pub(super) scores: Vec<f32>,
    /// What a verifying rule decided per row (`math`, `exact_match`).
    pub(super) verdicts: Option<Vec<Verdict>>,
    /// Each row's overlong penalty (0 without shaping), already in `scores`.
    pub(super) overlong: Vec<f64>,
    /// Wall time of the scoring calls.
    pub(super) secs: f64,
    /// Dynamic sampling's counts, when it made the batch.
    pub(super) filter: Option<FilterCounts>,
}

/// What dynamic sampling did for one batch (`rollout/*` metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct FilterCounts {
    /// Generation rounds, the first included.
    pub(super) gen_batches: u32,
    /// Groups dropped because their responses all scored alike.
    pub(super) filtered_groups: usize,
    /// Dropped groups put back to fill the batch once the rounds ran out.
    pub(super) padded_groups: usize,
    /// Right answers and responses over every round (a verifying reward only): the
    /// policy's accuracy before the filter picks the batch.
    pub(super) right: usize,
    pub(super) generated: usize,
}

impl Scored {
    /// The reward's answer for `ro`, with DAPO's overlong penalty added per row.
    pub(super) fn new(
        cfg: &PpoConfig,
        ro: &Rollout,
        resp: ScoresResponse,
        secs: f64,
    ) -> Result<Self> {
        let rows = ro.rows;
        if resp.scores.len() != rows || resp.verdicts.as_ref().is_some_and(|v| v.len() != rows) {
            return Err(Error::internal(format!(
                "reward ComputeScores answered {} scores ({} verdicts) for {rows} rows",
                resp.scores.len(),
                resp.verdicts.as_ref().map_or(0, Vec::len)
            )));
        }
        let max_len = cfg.actor_rollout.max_response_length as usize;
        let ob = &cfg.algorithm.overlong_buffer;
        let mut scores = resp.scores;
        let mut overlong = Vec::with_capacity(scores.len());
        for (row, s) in scores.iter_mut().enumerate() {
            let len = ro
                .response_mask
                .row(row)
                .iter()
                .filter(|&&m| m > 0.5)
                .count();
            let p = overlong_penalty(len, max_len, ob);
            overlong.push(p);
            *s += p as f32;
        }
        Ok(Self {
            overlong,
            scores,
            verdicts: resp.verdicts,
            secs,
            filter: None,
        })
    }

    /// `reward/*` and `rollout/*` metrics of these scores.
    pub(super) fn metrics(&self, out: &mut std::collections::BTreeMap<String, f64>) {
        use rlhf_algo::metric;
        if let Some(v) = &self.verdicts {
            let n = v.len().max(1) as f64;
            let count = |want: Verdict| v.iter().filter(|&&x| x == want).count() as f64;
            out.insert(metric::REWARD_ACCURACY.into(), count(Verdict::Right) / n);
            out.insert(metric::REWARD_NO_ANSWER.into(), count(Verdict::NoAnswer));
        }
        if !self.overlong.is_empty() {
            let mean = self.overlong.iter().sum::<f64>() / self.overlong.len() as f64;
            out.insert(metric::ROLLOUT_OVERLONG_PENALTY_MEAN.into(), mean);
        }
        if let Some(f) = self.filter {
            out.insert(metric::ROLLOUT_GEN_BATCHES.into(), f64::from(f.gen_batches));
            out.insert(
                metric::ROLLOUT_FILTERED_GROUPS.into(),
                f.filtered_groups as f64,
            );
            out.insert(metric::ROLLOUT_PADDED_GROUPS.into(), f.padded_groups as f64);
            if self.verdicts.is_some() {
                out.insert(
                    metric::ROLLOUT_GENERATED_ACCURACY.into(),
                    f.right as f64 / f.generated.max(1) as f64,
                );
            }
        }
    }
}

/// The request that scores `ro`'s responses.
pub(super) fn scores_request(ro: &Rollout) -> ScoresRequest {
    ScoresRequest {
        seq: ro.seq.clone(),
        prompt_text: ro.prompt_text.clone(),
        response_text: ro.response_text.clone(),
        ground_truth: ro.ground_truth.clone(),
    }
}

/// A step's prompts: dataset index per row and the request for the rollout ranks.
pub(super) struct PromptBatch {
    pub(super) which: Vec<usize>,
    pub(super) req: GenerateRequest,
}

impl RolloutSource<'_> {
    fn prompt_batch(&mut self, step: u64) -> Result<PromptBatch> {
        let cfg = self.cfg;
        let n = cfg.actor_rollout.num_samples_per_step.max(1) as usize;
        let p = cfg.actor_rollout.max_prompt_length as usize;
        let pad = i64::from(self.pad_id());
        let idx = self.sampler.next_batch();
        let rows = idx.len() * n;
        let mut ids = Mat::filled(rows, p, pad);
        let mut mask = Mat::filled(rows, p, 0i64);
        let mut which = Vec::with_capacity(rows);
        for (g, &i) in idx.iter().enumerate() {
            let prompt = &self.prompts[i].ids;
            for k in 0..n {
                let row = g * n + k;
                let off = p - prompt.len();
                for (j, &t) in prompt.iter().enumerate() {
                    ids.row_mut(row)[off + j] = i64::from(t);
                    mask.row_mut(row)[off + j] = 1;
                }
                which.push(i);
            }
        }
        let req = GenerateRequest {
            prompt_ids: ids,
            prompt_mask: mask,
            step,
            seed: cfg.training.seed,
        };
        Ok(PromptBatch { which, req })
    }

    pub(super) fn pad_id(&self) -> u32 {
        self.tok
            .pad_token_id()
            .or_else(|| self.tok.eos_token_id())
            .unwrap_or(0)
    }

    pub(super) async fn generate(
        &self,
        req: &GenerateRequest,
    ) -> std::result::Result<GenerateResponse, CallError> {
        self.roles
            .infer
            .call_split(req, self.opts.call_timeout)
            .await
    }

    /// Responses from the fixed-responses file instead of generation.
    fn fixed_responses(
        &self,
        fixed: &FixedResponses,
        which: &[usize],
    ) -> Result<(Mat<i64>, Mat<f32>)> {
        let r = self.cfg.actor_rollout.max_response_length as usize;
        let pad = i64::from(self.pad_id());
        let eos = self.tok.eos_token_id();
        let rows = which.len();
        // Rows come in groups of `n` samples of one prompt (`prompt_batch`).
        let n = self.cfg.actor_rollout.num_samples_per_step.max(1) as usize;
        let mut ids = Mat::filled(rows, r, pad);
        let mut mask = Mat::filled(rows, r, 0f32);
        for (row, &i) in which.iter().enumerate() {
            let p = &self.prompts[i];
            if let Some(k) = fixed.count(p).filter(|&k| k != 1 && k != n) {
                return Err(Error::invalid(format!(
                    "actor_rollout.fixed_responses_file gives {k} responses for prompt {:?} \
                     (data row {}), but actor_rollout.num_samples_per_step is {n}: give one \
                     response (every sample gets it) or {n}",
                    p.display, p.source_row
                )));
            }
            let toks = match fixed.get(p, row % n) {
                Some(FixedResponse::Ids(toks)) => {
                    if toks.len() > r {
                        return Err(Error::invalid(format!(
                            "actor_rollout.fixed_responses_file: the response_ids for prompt {:?} \
                             (data row {}) have {} tokens, more than \
                             actor_rollout.max_response_length={r}; raise it or shorten the response",
                            p.display,
                            p.source_row,
                            toks.len()
                        )));
                    }
                    toks
                }
                Some(FixedResponse::Text(text)) => {
                    let mut toks = self
                        .tok
                        .encode(&text, false)
                        .map_err(|e| Error::invalid(format!("tokenizing a fixed response: {e}")))?;
                    toks.truncate(r);
                    if let Some(e) = eos {
                        if toks.len() < r {
                            toks.push(e);
                        }
                    }
                    toks
                }
                None => {
                    return Err(Error::invalid(format!(
                        "actor_rollout.fixed_responses_file has no response for prompt {:?} \
                         (data row {}, token ids {:?})",
                        p.display, p.source_row, p.ids
                    )))
                }
            };
            for (j, &t) in toks.iter().enumerate() {
                ids.row_mut(row)[j] = i64::from(t);
                mask.row_mut(row)[j] = 1.0;
            }
        }
        Ok((ids, mask))
    }

    /// The batch of `step`: one generation round, or with dynamic sampling as many as it
    /// takes to fill the batch with informative groups.
    pub(super) async fn rollout(&mut self, step: u64) -> Res<Rollout> {
        if self.cfg.algorithm.dynamic_sampling.enable {
            self.dynamic_rollout(step).await
        } else {
            self.generate_batch(step).await
        }
    }

    /// DAPO's dynamic sampling: rounds of `training.global_batch_size` prompts are generated
    /// and scored; groups whose metric is the same for every response are dropped until the
    /// kept groups fill the batch or `max_num_gen_batches` rounds have run.
    async fn dynamic_rollout(&mut self, step: u64) -> Res<Rollout> {
        let cfg = self.cfg;
        let ds = &cfg.algorithm.dynamic_sampling;
        let n = cfg.actor_rollout.num_samples_per_step.max(1) as usize;
        let want = cfg.training.global_batch_size as usize;
        let mut parts: Vec<(Rollout, Scored)> = Vec::new();
        let (mut keep, mut dropped) = (Vec::new(), Vec::new());
        while keep.len() < want && parts.len() < ds.max_num_gen_batches as usize {
            let ro = self.generate_batch(step).await?;
            let t = Instant::now();
            let resp = self
                .roles
                .reward
                .call_split(&scores_request(&ro), self.opts.call_timeout)
                .await?;
            let sc = Scored::new(cfg, &ro, resp, t.elapsed().as_secs_f64())?;
            let metric: Vec<f32> = match (ds.metric, &sc.verdicts) {
                (FilterMetric::Score, _) => sc.scores.clone(),
                (FilterMetric::Accuracy, Some(v)) => v
                    .iter()
                    .map(|&v| f32::from(u8::from(v == Verdict::Right)))
                    .collect(),
                (FilterMetric::Accuracy, None) => {
                    return Err(Failed::Other(Error::invalid(
                        "algorithm.dynamic_sampling.metric is accuracy but the reward gave no right/wrong verdicts (only reward.rule math and exact_match do); use metric score",
                    )))
                }
            };
            let informative = informative_groups(&metric, n)
                .map_err(|e| Error::internal(format!("dynamic sampling: {e}")))?;
            for (g, ok) in informative.into_iter().enumerate() {
                if ok { &mut keep } else { &mut dropped }.push((parts.len(), g));
            }
            parts.push((ro, sc));
        }
        let rounds = parts.len();
        let mut counts = FilterCounts {
            gen_batches: rounds as u32,
            filtered_groups: dropped.len(),
            padded_groups: 0,
            right: parts
                .iter()
                .filter_map(|(_, sc)| sc.verdicts.as_ref())
                .flatten()
                .filter(|&&v| v == Verdict::Right)
                .count(),
            generated: parts.iter().map(|(ro, _)| ro.rows).sum(),
        };
        if keep.len() < want {
            match ds.when_exhausted {
                WhenExhausted::Fail => {
                    return Err(Failed::Other(Error::invalid(format!(
                        "step {step}: dynamic sampling kept {} of the {want} groups the batch needs after {rounds} generation rounds (algorithm.dynamic_sampling.max_num_gen_batches): {} groups scored alike in every response; raise max_num_gen_batches, use when_exhausted train, or check the reward and the data (are the prompts too easy or too hard?)",
                        keep.len(),
                        dropped.len()
                    ))))
                }
                WhenExhausted::Train => {
                    // The latest dropped groups: sampled by the newest weights. Every round
                    // adds `want` groups to keep or dropped, so there are enough.
                    let short = want - keep.len();
                    let padded = dropped.split_off(dropped.len().saturating_sub(short));
                    counts.padded_groups = padded.len();
                    keep.extend(padded.into_iter().rev());
                }
            }
        }
        let surplus = keep.split_off(want.min(keep.len()));
        let mut ro = assemble(&parts, &keep, n, self.sampler.cursor(), counts)?;
        ro.dropped_rows = prompt_rows_of(&parts, &dropped);
        ro.surplus_rows = prompt_rows_of(&parts, &surplus);
        Ok(ro)
    }

    async fn generate_batch(&mut self, step: u64) -> Res<Rollout> {
        let cfg = self.cfg;
        let PromptBatch { which, req } = self.prompt_batch(step)?;
        let cursor = self.sampler.cursor();
        let rows = which.len();
        let r = cfg.actor_rollout.max_response_length as usize;
        let t = Instant::now();
        let (responses, response_mask, behaviour) = match self.fixed {
            Some(f) => {
                let (ids, mask) = self.fixed_responses(f, &which)?;
                (ids, mask, None)
            }
            None => {
                let g = self.generate(&req).await?;
                (
                    g.responses,
                    g.response_mask,
                    Some((g.behaviour_log_probs, g.policy_version)),
                )
            }
        };
        let gen_s = t.elapsed().as_secs_f64();
        if responses.shape() != [rows, r] || response_mask.shape() != [rows, r] {
            return Err(Failed::Other(Error::internal(format!(
                "actor_rollout/infer Generate: responses {:?} and mask {:?}, expected [{rows}, {r}]",
                responses.shape(),
                response_mask.shape()
            ))));
        }
        let eos = self.tok.eos_token_id().map(i64::from);
        // The response mask as 0/1 ids, for the attention mask of the whole sequence.
        let resp_attn = Mat::new(
            rows,
            r,
            response_mask
                .data
                .iter()
                .map(|&m| i64::from(m > 0.5))
                .collect(),
        )?;
        let seq = Sequences {
            input_ids: Mat::hcat(&req.prompt_ids, &responses)?,
            attention_mask: Mat::hcat(&req.prompt_mask, &resp_attn)?,
            response_len: r,
        };
        let mut prompt_text = Vec::with_capacity(rows);
        let mut response_text = Vec::with_capacity(rows);
        let mut has_eos = Vec::with_capacity(rows);
        let mut tokens = 0usize;
        for (row, &src) in which.iter().enumerate() {
            let valid: Vec<u32> = (0..r)
                .filter(|&j| resp_attn.row(row)[j] == 1)
                .map(|j| {
                    let id = responses.row(row)[j];
                    u32::try_from(id).map_err(|_| {
                        Error::internal(format!(
                            "actor_rollout/infer Generate answered token id {id} in row {row}"
                        ))
                    })
                })
                .collect::<Result<_>>()?;
            has_eos.push(match (valid.last(), eos) {
                (Some(&last), Some(e)) => i64::from(last) == e,
                _ => false,
            });
            tokens += valid.len() + req.prompt_mask.row(row).iter().filter(|&&m| m == 1).count();
            prompt_text.push(self.prompts[src].display.clone());
            response_text.push(
                self.tok
                    .decode(&valid, true)
                    .map_err(|e| Error::internal(format!("decoding a response: {e}")))?,
            );
        }
        let n = cfg.actor_rollout.num_samples_per_step.max(1) as usize;
        let ground_truth = which
            .iter()
            .any(|&i| self.prompts[i].ground_truth.is_some())
            .then(|| {
                which
                    .iter()
                    .map(|&i| self.prompts[i].ground_truth.clone())
                    .collect()
            });
        Ok(Rollout {
            rows,
            r,
            seq,
            response_mask,
            behaviour,
            prompt_text,
            response_text,
            ground_truth,
            has_eos,
            group_ids: (0..rows).map(|i| i / n).collect(),
            prompt_rows: which
                .iter()
                .step_by(n)
                .map(|&i| self.prompts[i].source_row)
                .collect(),
            dropped_rows: Vec::new(),
            surplus_rows: Vec::new(),
            tokens,
            cursor,
            gen_s,
            probe: Probe::None,
            scored: None,
        })
    }
}

/// The dataset rows of the prompts of `groups` (`(part, group)`).
fn prompt_rows_of(parts: &[(Rollout, Scored)], groups: &[(usize, usize)]) -> Vec<usize> {
    groups
        .iter()
        .map(|&(p, g)| parts[p].0.prompt_rows[g])
        .collect()
}

/// One batch from the groups `keep` (`(part, group)`) of several generation rounds, in that
/// order, with their scores.
fn assemble(
    parts: &[(Rollout, Scored)],
    keep: &[(usize, usize)],
    n: usize,
    cursor: DataCursor,
    counts: FilterCounts,
) -> Res<Rollout> {
    let which: Vec<(usize, usize)> = keep
        .iter()
        .flat_map(|&(p, g)| (g * n..(g + 1) * n).map(move |row| (p, row)))
        .collect();
    let rows = which.len();
    let r = parts[0].0.r;
    let ros: Vec<&Rollout> = parts.iter().map(|(ro, _)| ro).collect();
    let mats = |f: fn(&Rollout) -> &Mat<i64>| -> Result<Mat<i64>> {
        Mat::gather_rows(&ros.iter().map(|ro| f(ro)).collect::<Vec<_>>(), &which)
    };
    let seq = Sequences {
        input_ids: mats(|ro| &ro.seq.input_ids)?,
        attention_mask: mats(|ro| &ro.seq.attention_mask)?,
        response_len: r,
    };
    let response_mask = Mat::gather_rows(
        &ros.iter().map(|ro| &ro.response_mask).collect::<Vec<_>>(),
        &which,
    )?;
    let behaviour = match ros
        .iter()
        .map(|ro| ro.behaviour.as_ref())
        .collect::<Option<Vec<_>>>()
    {
        Some(b) => Some((
            Mat::gather_rows(&b.iter().map(|(m, _)| m).collect::<Vec<_>>(), &which)?,
            which.iter().map(|&(p, row)| b[p].1[row]).collect(),
        )),
        None => None,
    };
    let mut out = Rollout {
        rows,
        r,
        seq,
        response_mask,
        behaviour,
        prompt_text: Vec::with_capacity(rows),
        response_text: Vec::with_capacity(rows),
        ground_truth: ros
            .iter()
            .any(|ro| ro.ground_truth.is_some())
            .then(|| Vec::with_capacity(rows)),
        has_eos: Vec::with_capacity(rows),
        group_ids: (0..rows).map(|i| i / n).collect(),
        prompt_rows: prompt_rows_of(parts, keep),
        dropped_rows: Vec::new(),
        surplus_rows: Vec::new(),
        tokens: 0,
        cursor,
        gen_s: ros.iter().map(|ro| ro.gen_s).sum(),
        probe: Probe::None,
        scored: None,
    };
    let mut scored = Scored {
        scores: Vec::with_capacity(rows),
        verdicts: parts[0]
            .1
            .verdicts
            .as_ref()
            .map(|_| Vec::with_capacity(rows)),
        overlong: Vec::with_capacity(rows),
        secs: parts.iter().map(|(_, s)| s.secs).sum(),
        filter: Some(counts),
    };
    for &(p, row) in &which {
        let (ro, sc) = &parts[p];
        out.prompt_text.push(ro.prompt_text[row].clone());
        out.response_text.push(ro.response_text[row].clone());
        if let Some(gt) = &mut out.ground_truth {
            gt.push(ro.ground_truth.as_ref().and_then(|g| g[row].clone()));
        }
        out.has_eos.push(ro.has_eos[row]);
        out.tokens += ro
            .seq
            .attention_mask
            .row(row)
            .iter()
            .filter(|&&m| m == 1)
            .count();
        scored.scores.push(sc.scores[row]);
        if let (Some(all), Some(v)) = (&mut scored.verdicts, &sc.verdicts) {
            all.push(v[row]);
        }
        scored.overlong.push(sc.overlong[row]);
    }
    out.scored = Some(scored);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A round of `groups` groups of `n` rows whose every value tells part and row apart.
    fn part(p: usize, groups: usize, n: usize) -> (Rollout, Scored) {
        let rows = groups * n;
        let tag = |row: usize| (p * 100 + row) as i64;
        let ids: Vec<i64> = (0..rows).flat_map(|r| [tag(r), tag(r) + 1]).collect();
        let ro = Rollout {
            rows,
            r: 1,
            seq: Sequences {
                input_ids: Mat::new(rows, 2, ids).unwrap(),
                attention_mask: Mat::filled(rows, 2, 1),
                response_len: 1,
            },
            response_mask: Mat::filled(rows, 1, 1.0),
            behaviour: Some((
                Mat::new(rows, 1, (0..rows).map(|r| -(tag(r) as f32)).collect()).unwrap(),
                vec![p as u64; rows],
            )),
            prompt_text: (0..rows).map(|r| format!("p{p}r{r}")).collect(),
            response_text: (0..rows).map(|r| format!("resp{p}.{r}")).collect(),
            ground_truth: (p == 1).then(|| (0..rows).map(|r| Some(r.to_string())).collect()),
            has_eos: (0..rows).map(|r| r % 2 == 0).collect(),
            group_ids: (0..rows).map(|r| r / n).collect(),
            prompt_rows: (0..groups).map(|g| p * 10 + g).collect(),
            dropped_rows: Vec::new(),
            surplus_rows: Vec::new(),
            tokens: rows * 2,
            cursor: DataCursor::default(),
            gen_s: 1.0,
            probe: Probe::None,
            scored: None,
        };
        let sc = Scored {
            scores: (0..rows).map(|r| tag(r) as f32).collect(),
            verdicts: Some(vec![Verdict::Wrong; rows]),
            overlong: vec![-(p as f64); rows],
            secs: 0.5,
            filter: None,
        };
        (ro, sc)
    }

    #[test]
    fn kept_groups_of_several_rounds_make_one_batch_in_order() {
        let n = 2;
        let parts = vec![part(0, 3, n), part(1, 3, n)];
        // Group 2 of round 1, then group 0 of round 0.
        let counts = FilterCounts {
            gen_batches: 2,
            filtered_groups: 4,
            ..FilterCounts::default()
        };
        let ro = assemble(&parts, &[(1, 2), (0, 0)], n, DataCursor::default(), counts).unwrap();
        assert_eq!(ro.prompt_rows, vec![12, 0]);
        assert_eq!(ro.rows, 4);
        assert_eq!(ro.seq.input_ids.data, vec![104, 105, 105, 106, 0, 1, 1, 2]);
        assert_eq!(ro.prompt_text, vec!["p1r4", "p1r5", "p0r0", "p0r1"]);
        assert_eq!(ro.group_ids, vec![0, 0, 1, 1]);
        assert_eq!(ro.has_eos, vec![true, false, true, false]);
        let (lp, versions) = ro.behaviour.as_ref().unwrap();
        assert_eq!(lp.data, vec![-104.0, -105.0, -0.0, -1.0]);
        assert_eq!(versions, &vec![1, 1, 0, 0]);
        // Round 0 had no ground truth column: its rows get none.
        assert_eq!(
            ro.ground_truth,
            Some(vec![Some("4".into()), Some("5".into()), None, None])
        );
        let sc = ro.scored.as_ref().unwrap();
        assert_eq!(sc.scores, vec![104.0, 105.0, 0.0, 1.0]);
        assert_eq!(sc.overlong, vec![-1.0, -1.0, 0.0, 0.0]);
        assert_eq!(sc.secs, 1.0);
        assert_eq!(ro.gen_s, 2.0);
        assert_eq!(sc.filter, Some(counts));
        assert_eq!(ro.tokens, 8);
    }
}
