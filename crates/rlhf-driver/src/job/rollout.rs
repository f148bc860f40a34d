//! A step's rollout: prompts from the sampler, responses from the rollout ranks or the
//! fixed-responses file, the sequences every role scores.

use std::collections::BTreeMap;
use std::time::Instant;

use rlhf_algo::metric;
use rlhf_core::batch::DataBatch;
use rlhf_core::{Error, Result};
use serde_json::json;

use crate::group::{BatchCall, CallError};
use crate::prompts::{FixedResponse, FixedResponses};
use crate::tensors::{f32_2d, get, wire_f32, wire_i64};

use super::{mix, Failed, Loop, Res};

/// One step's rollout, kept on the driver.
pub(super) struct Rollout {
    pub(super) rows: usize,
    pub(super) p: usize,
    pub(super) r: usize,
    pub(super) input_ids: Vec<i64>,
    pub(super) attention_mask: Vec<i64>,
    pub(super) responses: Vec<i64>,
    pub(super) response_mask: Vec<f32>,
    pub(super) prompt_text: Vec<String>,
    pub(super) response_text: Vec<String>,
    pub(super) ground_truth: Option<Vec<String>>,
    pub(super) has_eos: Vec<bool>,
    pub(super) group_ids: Vec<usize>,
    pub(super) tokens: usize,
}

impl Rollout {
    pub(super) fn sequences(&self) -> Result<DataBatch> {
        let t = self.p + self.r;
        let mut b = DataBatch::new()
            .with_tensor("input_ids", wire_i64(&self.input_ids, &[self.rows, t])?)
            .with_tensor(
                "attention_mask",
                wire_i64(&self.attention_mask, &[self.rows, t])?,
            );
        b.meta.insert("response_length".into(), json!(self.r));
        Ok(b)
    }
}

/// A step's prompts: dataset index per row, the batch for the rollout ranks and its
/// `[rows, P]` ids and mask on the host.
pub(super) struct PromptBatch {
    pub(super) which: Vec<usize>,
    pub(super) batch: DataBatch,
    pub(super) ids: Vec<i64>,
    pub(super) mask: Vec<i64>,
}

impl Loop<'_> {
    fn prompt_batch(&mut self) -> Result<PromptBatch> {
        let cfg = self.cfg;
        let n = cfg.actor_rollout.num_samples_per_step.max(1) as usize;
        let p = cfg.actor_rollout.max_prompt_length as usize;
        let pad = i64::from(self.pad_id());
        let idx = self.sampler.next_batch();
        let rows = idx.len() * n;
        let mut ids = vec![pad; rows * p];
        let mut mask = vec![0i64; rows * p];
        let mut which = Vec::with_capacity(rows);
        for (g, &i) in idx.iter().enumerate() {
            let prompt = &self.prompts[i].ids;
            for k in 0..n {
                let row = g * n + k;
                let off = row * p + (p - prompt.len());
                for (j, &t) in prompt.iter().enumerate() {
                    ids[off + j] = i64::from(t);
                    mask[off + j] = 1;
                }
                which.push(i);
            }
        }
        let batch = DataBatch::new()
            .with_tensor("prompt_ids", wire_i64(&ids, &[rows, p])?)
            .with_tensor("prompt_mask", wire_i64(&mask, &[rows, p])?);
        Ok(PromptBatch {
            which,
            batch,
            ids,
            mask,
        })
    }

    pub(super) fn pad_id(&self) -> u32 {
        self.tok
            .pad_token_id()
            .or_else(|| self.tok.eos_token_id())
            .unwrap_or(0)
    }

    async fn generate(
        &self,
        batch: &DataBatch,
        step: u64,
    ) -> std::result::Result<DataBatch, CallError> {
        let g = &self.roles.infer;
        let n = g.len().max(1);
        let (padded, pad) = batch.pad_to_multiple(n).map_err(|e| g.err(0, e))?;
        let mut shards = padded.chunk(n).map_err(|e| g.err(0, e))?;
        for (rank, s) in shards.iter_mut().enumerate() {
            s.meta.insert(
                "seed".into(),
                json!(mix(self.cfg.training.seed, step, rank as u64)),
            );
            s.meta.insert("step".into(), json!(step));
        }
        let answers = g
            .fan_out(BatchCall::Generate, &shards, self.opts.call_timeout)
            .await?;
        let whole = DataBatch::concat(&answers).map_err(|e| g.err(0, e))?;
        whole.unpad(pad).map_err(|e| g.err(0, e))
    }

    /// Responses from the fixed-responses file instead of generation.
    fn fixed_responses(&self, fixed: &FixedResponses, which: &[usize]) -> Result<DataBatch> {
        let r = self.cfg.actor_rollout.max_response_length as usize;
        let pad = i64::from(self.pad_id());
        let eos = self.tok.eos_token_id();
        let rows = which.len();
        let mut ids = vec![pad; rows * r];
        let mut mask = vec![0f32; rows * r];
        for (row, &i) in which.iter().enumerate() {
            let p = &self.prompts[i];
            let toks = match fixed.get(p) {
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
                ids[row * r + j] = i64::from(t);
                mask[row * r + j] = 1.0;
            }
        }
        Ok(DataBatch::new()
            .with_tensor("responses", wire_i64(&ids, &[rows, r])?)
            .with_tensor("response_mask", wire_f32(&mask, &[rows, r])?))
    }

    pub(super) async fn rollout(
        &mut self,
        step: u64,
        timing: &mut BTreeMap<String, f64>,
    ) -> Res<Rollout> {
        let cfg = self.cfg;
        let PromptBatch {
            which,
            batch: prompt_batch,
            ids: prompt_ids,
            mask: prompt_mask,
        } = self.prompt_batch()?;
        let rows = which.len();
        let p = cfg.actor_rollout.max_prompt_length as usize;
        let r = cfg.actor_rollout.max_response_length as usize;
        let t = Instant::now();
        let gen = match self.fixed {
            Some(f) => self.fixed_responses(f, &which)?,
            None => self.generate(&prompt_batch, step).await?,
        };
        timing.insert(metric::TIMING_S_GEN.into(), t.elapsed().as_secs_f64());
        let from = "actor_rollout/infer Generate";
        let responses = get(&gen, "responses", from)?.to_i64()?;
        let response_mask = f32_2d(&gen, "response_mask", rows, r, from)?;
        if responses.len() != rows * r {
            return Err(Failed::Other(Error::internal(format!(
                "{from}: 'responses' has {} values, expected {rows} x {r}",
                responses.len()
            ))));
        }
        let eos = self.tok.eos_token_id().map(i64::from);
        let mut input_ids = Vec::with_capacity(rows * (p + r));
        let mut attention_mask = Vec::with_capacity(rows * (p + r));
        let mut prompt_text = Vec::with_capacity(rows);
        let mut response_text = Vec::with_capacity(rows);
        let mut has_eos = Vec::with_capacity(rows);
        let mut tokens = 0usize;
        for row in 0..rows {
            input_ids.extend_from_slice(&prompt_ids[row * p..(row + 1) * p]);
            input_ids.extend_from_slice(&responses[row * r..(row + 1) * r]);
            attention_mask.extend_from_slice(&prompt_mask[row * p..(row + 1) * p]);
            attention_mask.extend(
                response_mask[row * r..(row + 1) * r]
                    .iter()
                    .map(|&m| i64::from(m > 0.5)),
            );
            let valid: Vec<u32> = (0..r)
                .filter(|&j| response_mask[row * r + j] > 0.5)
                .map(|j| responses[row * r + j] as u32)
                .collect();
            has_eos.push(match (valid.last(), eos) {
                (Some(&last), Some(e)) => i64::from(last) == e,
                _ => false,
            });
            tokens += valid.len()
                + prompt_mask[row * p..(row + 1) * p]
                    .iter()
                    .filter(|&&m| m == 1)
                    .count();
            prompt_text.push(self.prompts[which[row]].display.clone());
            response_text.push(
                self.tok
                    .decode(&valid, true)
                    .map_err(|e| Error::internal(format!("decoding a response: {e}")))?,
            );
        }
        let n = cfg.actor_rollout.num_samples_per_step.max(1) as usize;
        let ground_truth = which
            .iter()
            .map(|&i| self.prompts[i].ground_truth.clone())
            .collect::<Option<Vec<String>>>();
        Ok(Rollout {
            rows,
            p,
            r,
            input_ids,
            attention_mask,
            responses,
            response_mask,
            prompt_text,
            response_text,
            ground_truth,
            has_eos,
            group_ids: (0..rows).map(|i| i / n).collect(),
            tokens,
        })
    }
}
