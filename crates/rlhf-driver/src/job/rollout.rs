//! A step's rollout: prompts from the sampler, responses from the rollout ranks or the
//! fixed-responses file, the sequences every role scores. [`RolloutSource`] holds what
//! making a batch needs and nothing the trainers use, so the rollout lane of an async run
//! (`super::pipeline`) makes the next batches while the loop trains on this one.

use std::time::Instant;

use rlhf_config::data::{DataCursor, PromptSampler};
use rlhf_config::PpoConfig;
use rlhf_core::calls::{GenerateRequest, GenerateResponse, Mat, Sequences};
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
    pub(super) tokens: usize,
    /// The sampler's cursor right after this batch's prompts were drawn: what a
    /// checkpoint after this step records.
    pub(super) cursor: DataCursor,
    /// Wall time of the generation (overlapped with training in async modes).
    pub(super) gen_s: f64,
    pub(super) probe: Probe,
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

    pub(super) async fn rollout(&mut self, step: u64) -> Res<Rollout> {
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
            tokens,
            cursor,
            gen_s,
            probe: Probe::None,
        })
    }
}
