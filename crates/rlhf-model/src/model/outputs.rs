//! What a model computes for a batch: hidden states, logits (whole, or the next token's with
//! a KV cache), log-probs and entropies of tokens, a critic's values and a reward model's
//! scores.

use candle_core::{DType, Tensor, D};

use super::{Head, Model};
use crate::error::{Error, Result};
use crate::load::Batch;
use crate::ops;
use crate::transformer::{Kernels, KvCache, Linear, Transformer};
use crate::zero3::Parts;

const NEED_LM: &str = "logits need a causal LM";
const NEED_VALUE: &str = "values need a value model";
const NEED_SCORE: &str = "scores need a reward model";

impl Model {
    /// Final hidden states `[B, T, H]`.
    pub fn hidden(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        self.parts()?
            .body()
            .forward(input_ids, attention_mask, position_ids, cache)
    }

    fn lm_head<'h>(&self, head: &'h Head) -> Result<&'h Tensor> {
        match head {
            Head::Lm(w) => Ok(w),
            _ => Err(self.head_error(NEED_LM)),
        }
    }

    fn head_error(&self, need: &str) -> Error {
        Error::InvalidArgument(format!("{need}, this model is a {:?} model", self.kind))
    }

    /// The decoder and head for one call, once this model is known to have the head the call
    /// needs (`has`; `need` says which): a ZeRO-3 call that gathered its edges and then
    /// refused would leave the group's other ranks waiting in the next gather.
    fn parts_for(&self, has: fn(&Head) -> bool, need: &str) -> Result<Parts<'_>> {
        if !has(&self.head) {
            return Err(self.head_error(need));
        }
        self.parts()
    }

    /// Logits `[B, T, V]` at every position.
    pub fn logits(&self, batch: &Batch) -> Result<Tensor> {
        let parts = self.parts_for(|h| matches!(h, Head::Lm(_)), NEED_LM)?;
        let w = self.lm_head(parts.head())?;
        let h = batch_hidden(parts.body(), batch)?;
        Linear::plain(w.clone(), None).forward(&h)
    }

    /// Logits `[B, V]` of the last position of new tokens, extending `cache` (generation).
    pub fn next_token_logits(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let parts = self.parts_for(|h| matches!(h, Head::Lm(_)), NEED_LM)?;
        let w = self.lm_head(parts.head())?;
        let h = parts
            .body()
            .forward(input_ids, attention_mask, position_ids, Some(cache))?;
        let t = h.dim(1)?;
        // The LM-head product of `logits`, on the last position (its rows T·H apart).
        Linear::plain(w.clone(), None).forward(&h.narrow(1, t - 1, 1)?.squeeze(1)?)
    }

    /// An empty KV cache sized for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.config.num_hidden_layers)
    }

    /// Log-probs `[B, T-1]` of tokens `1..T` given their prefixes, at `temperature`
    /// (gather of log-softmax(logits / temperature)); differentiable for trainable models.
    /// Entry `t` is predicted at position `t`: where that position is padding (the first real
    /// token of a left-padded row) the value is meaningless and must be masked out.
    pub fn token_log_probs(&self, batch: &Batch, temperature: f64) -> Result<Tensor> {
        let (lp, _) = self.log_probs_and_entropy(batch, temperature, false)?;
        Ok(lp)
    }

    /// Log-probs `[B, T-1]` as in [`Model::token_log_probs`] and, when asked, the entropy
    /// `[B, T-1]` of each predictive distribution.
    pub fn log_probs_and_entropy(
        &self,
        batch: &Batch,
        temperature: f64,
        with_entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let t = batch.input_ids.dim(1)?;
        if t < 2 {
            return Err(Error::InvalidArgument(
                "log-probs need sequences of at least 2 tokens".to_string(),
            ));
        }
        let parts = self.parts_for(|h| matches!(h, Head::Lm(_)), NEED_LM)?;
        let w = self.lm_head(parts.head())?;
        let h = batch_hidden(parts.body(), batch)?;
        let targets = batch.input_ids.narrow(1, 1, t - 1)?;
        let fused = self.body.kernels() != Kernels::Composite;
        if let Some(chunk) = self.logits_chunk {
            let (b, _, hd) = h.dims3()?;
            let n = b * (t - 1);
            let hs = h.narrow(1, 0, t - 1)?.reshape((n, hd))?;
            let opts = crate::head::HeadOpts {
                temperature,
                with_entropy,
                chunk,
                fused,
                vocab_tile: crate::head::VOCAB_TILE,
            };
            let (lp, ent) = crate::head::log_probs_entropy(&hs, w, &targets.flatten_all()?, opts)?;
            let lp = lp.reshape((b, t - 1))?;
            let ent = ent.map(|e| e.reshape((b, t - 1))).transpose()?;
            return Ok((lp, ent));
        }
        // The last position predicts nothing that is scored: skip its LM-head product.
        let h = h.narrow(1, 0, t - 1)?;
        if self.body.kernels() == Kernels::FusedTraining {
            // Training: the product and the kernels as one graph node (kernels/lm_head.rs).
            if !(temperature > 0.0 && temperature.is_finite()) {
                return Err(Error::InvalidArgument(format!(
                    "temperature must be positive for log-probs, got {temperature}"
                )));
            }
            let (lp, ent) =
                crate::kernels::lm_head(&h, w, &targets, 1.0 / temperature, with_entropy)?;
            return Ok((lp, ent));
        }
        let logits = Linear::plain(w.clone(), None).forward(&h)?;
        let lp = ops::log_probs_impl(&logits, &targets, temperature, fused)?;
        let ent = if with_entropy {
            Some(ops::entropy_impl(&logits, temperature, fused)?)
        } else {
            None
        };
        Ok((lp, ent))
    }

    /// Per-token values `[B, T]` (critic), in f32 (f64 for f64 models).
    pub fn values(&self, batch: &Batch) -> Result<Tensor> {
        let parts = self.parts_for(|h| matches!(h, Head::Value(_)), NEED_VALUE)?;
        let Head::Value(head) = parts.head() else {
            return Err(self.head_error(NEED_VALUE));
        };
        let h = batch_hidden(parts.body(), batch)?;
        Ok(head
            .forward(&h)?
            .squeeze(D::Minus1)?
            .to_dtype(ops::wide_dtype(h.dtype()))?)
    }

    /// Score-head outputs at every position `[B, T, num_labels]`.
    pub fn score_logits(&self, batch: &Batch) -> Result<Tensor> {
        let parts = self.parts_for(|h| matches!(h, Head::Score(_)), NEED_SCORE)?;
        let Head::Score(head) = parts.head() else {
            return Err(self.head_error(NEED_SCORE));
        };
        let h = batch_hidden(parts.body(), batch)?;
        head.forward(&h)
    }

    /// Reward per sequence `[B]` (f32, f64 for f64 models), read where transformers'
    /// `*ForSequenceClassification` reads it: at the last attended token whose id is not the
    /// config's `pad_token_id`. When the pad token is also the EOS (models/tiny, Qwen2.5 base),
    /// a sequence ending in EOS is read at the token before it, as transformers and TRL's
    /// `get_reward` do, so a reward model scores the same here and there. A row made only of
    /// pad tokens is read at its last attended token.
    pub fn scores(&self, batch: &Batch) -> Result<Tensor> {
        let logits = self.score_logits(batch)?;
        let (b, t, labels) = logits.dims3()?;
        if labels != 1 {
            return Err(Error::InvalidArgument(format!(
                "the score head has {labels} labels; a reward model needs exactly 1"
            )));
        }
        let idx = score_positions(batch, self.config.pad_token_id)?
            .into_iter()
            .enumerate()
            .map(|(i, last)| (i * t + last) as u32)
            .collect::<Vec<_>>();
        let idx = Tensor::from_vec(idx, b, logits.device())?;
        Ok(logits
            .reshape((b * t, 1))?
            .index_select(&idx, 0)?
            .squeeze(1)?
            .to_dtype(ops::wide_dtype(logits.dtype()))?)
    }
}

/// Final hidden states `[B, T, H]` of a whole batch (no KV cache).
fn batch_hidden(body: &Transformer, batch: &Batch) -> Result<Tensor> {
    body.forward(
        &batch.input_ids,
        &batch.attention_mask,
        &batch.position_ids,
        None,
    )
}

/// Per row, the position a sequence classifier reads: the last attended token that is not
/// `pad` (the last attended token when every attended token is `pad`).
fn score_positions(batch: &Batch, pad: Option<u32>) -> Result<Vec<usize>> {
    let mask = batch
        .attention_mask
        .to_dtype(DType::F32)?
        .to_vec2::<f32>()?;
    let ids = batch.input_ids.to_dtype(DType::U32)?.to_vec2::<u32>()?;
    let mut out = Vec::with_capacity(mask.len());
    for (i, (m, row)) in mask.iter().zip(&ids).enumerate() {
        let attended = |j: &usize| m[*j] > 0.5;
        let last = (0..m.len())
            .rev()
            .find(attended)
            .ok_or_else(|| Error::InvalidArgument(format!("row {i} of the batch has no tokens")))?;
        let read = match pad {
            Some(p) => (0..=last)
                .rev()
                .find(|j| attended(j) && row[*j] != p)
                .unwrap_or(last),
            None => last,
        };
        out.push(read);
    }
    Ok(out)
}
