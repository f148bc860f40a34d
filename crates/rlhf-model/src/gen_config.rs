//! Decoding options (`GenerationConfig`): what `generate` does, read from and written back
//! to HF's generation_config.json. Apart from the generation loop so that a loaded model can
//! carry its defaults without the model module depending on the loop that uses the model.

use serde_json::{json, Map, Value};

use crate::config::{id_list, Config};
use crate::error::{Error, Result};

/// Decoding options. `temperature == 0` means greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    pub max_new_tokens: usize,
    /// Stop tokens are suppressed until this many tokens were generated.
    pub min_new_tokens: usize,
    pub temperature: f64,
    /// Keep the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Nucleus sampling mass in (0, 1]; 1 disables.
    pub top_p: f64,
    /// Samples per prompt.
    pub n: usize,
    pub seed: u64,
    pub eos_token_ids: Vec<u32>,
    /// Extra stop tokens besides EOS.
    pub stop_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    pub bos_token_id: Option<u32>,
    /// Keep the last tokens of a prompt that does not fit instead of refusing it.
    pub truncate_prompts: bool,
    /// Context length; `None` uses the model's `max_position_embeddings`.
    pub max_context: Option<usize>,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        Self {
            max_new_tokens: 128,
            min_new_tokens: 0,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            n: 1,
            seed: 0,
            eos_token_ids: vec![],
            stop_token_ids: vec![],
            pad_token_id: None,
            bos_token_id: None,
            truncate_prompts: false,
            max_context: None,
        }
    }
}

impl GenerationConfig {
    /// Whether sampling is truncated to the top-k tokens or the top-p mass.
    pub fn truncates(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0
    }

    /// Defaults from `generation_config.json` (when present) over `config.json`.
    pub fn from_hf(config: &Config, gen: Option<&Value>) -> Self {
        let mut g = Self {
            eos_token_ids: config.eos_token_ids.clone(),
            pad_token_id: config.pad_token_id,
            bos_token_id: config.bos_token_id,
            ..Self::default()
        };
        let Some(v) = gen else {
            return g;
        };
        let ids = id_list(v.get("eos_token_id"));
        if !ids.is_empty() {
            g.eos_token_ids = ids;
        }
        if let Some(p) = v.get("pad_token_id").and_then(Value::as_u64) {
            g.pad_token_id = Some(p as u32);
        }
        if let Some(p) = v.get("bos_token_id").and_then(Value::as_u64) {
            g.bos_token_id = Some(p as u32);
        }
        let do_sample = v.get("do_sample").and_then(Value::as_bool).unwrap_or(false);
        if do_sample {
            g.temperature = v.get("temperature").and_then(Value::as_f64).unwrap_or(1.0);
            g.top_k = v.get("top_k").and_then(Value::as_u64).unwrap_or(50) as usize;
            g.top_p = v.get("top_p").and_then(Value::as_f64).unwrap_or(1.0);
        } else {
            g.temperature = 0.0;
        }
        if let Some(m) = v.get("max_new_tokens").and_then(Value::as_u64) {
            g.max_new_tokens = m as usize;
        }
        if let Some(m) = v.get("min_new_tokens").and_then(Value::as_u64) {
            g.min_new_tokens = m as usize;
        }
        g
    }

    /// `generation_config.json` content.
    pub fn to_hf_json(&self) -> Value {
        let mut m = Map::new();
        if let Some(b) = self.bos_token_id {
            m.insert("bos_token_id".into(), json!(b));
        }
        match self.eos_token_ids.as_slice() {
            [] => {}
            [one] => {
                m.insert("eos_token_id".into(), json!(one));
            }
            many => {
                m.insert("eos_token_id".into(), json!(many));
            }
        }
        if let Some(p) = self.pad_token_id {
            m.insert("pad_token_id".into(), json!(p));
        }
        if self.temperature > 0.0 {
            m.insert("do_sample".into(), json!(true));
            m.insert("temperature".into(), json!(self.temperature));
            m.insert("top_k".into(), json!(self.top_k));
            m.insert("top_p".into(), json!(self.top_p));
        }
        Value::Object(m)
    }

    /// Greedy decoding of `max_new_tokens`.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            temperature: 0.0,
            ..Self::default()
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "temperature must be >= 0 (0 = greedy), got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        if self.n == 0 {
            return Err(Error::InvalidArgument(
                "n (samples per prompt) must be >= 1".into(),
            ));
        }
        if self.min_new_tokens > self.max_new_tokens {
            return Err(Error::InvalidArgument(format!(
                "min_new_tokens ({}) exceeds max_new_tokens ({})",
                self.min_new_tokens, self.max_new_tokens
            )));
        }
        Ok(())
    }
}
