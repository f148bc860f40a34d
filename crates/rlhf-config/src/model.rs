//! Model architecture configs (`configs/model/<name>.yaml`), with Hugging Face
//! `config.json` field names so a value can be checked against the model card.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ConfigError, Result};

/// Architecture numbers of a decoder-only transformer (Llama / Qwen2 / Qwen3 dense).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// HF model directory (weights, config.json, tokenizer); relative paths
    /// are relative to the directory the job is started from.
    #[serde(default)]
    pub path: Option<String>,
    /// HF `model_type` (llama, qwen2, ...).
    #[serde(default)]
    pub model_type: Option<String>,
    /// Width of the residual stream.
    pub hidden_size: u64,
    /// Decoder layers.
    pub num_hidden_layers: u64,
    /// Query heads.
    pub num_attention_heads: u64,
    /// Key/value heads (grouped-query attention); default = query heads.
    #[serde(default)]
    pub num_key_value_heads: Option<u64>,
    /// Per-head width; default `hidden_size / num_attention_heads` (Qwen3: 128, as
    /// transformers' `Qwen3Config`).
    #[serde(default)]
    pub head_dim: Option<u64>,
    /// MLP inner width.
    pub intermediate_size: u64,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: u64,
    /// Longest sequence the position encoding supports.
    pub max_position_embeddings: u64,
    /// The LM head shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2).
    #[serde(default)]
    pub attention_bias: bool,
    /// RoPE base.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RMSNorm epsilon.
    #[serde(default)]
    pub rms_norm_eps: Option<f64>,
}

/// The subset of an HF `config.json` this crate reads; other keys are ignored
/// because config.json files carry many unrelated fields.
#[derive(Deserialize)]
struct HfConfigJson {
    model_type: Option<String>,
    hidden_size: u64,
    num_hidden_layers: u64,
    num_attention_heads: u64,
    num_key_value_heads: Option<u64>,
    head_dim: Option<u64>,
    intermediate_size: u64,
    vocab_size: u64,
    #[serde(default)]
    max_position_embeddings: Option<u64>,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: Option<bool>,
    rope_theta: Option<f64>,
    rms_norm_eps: Option<f64>,
}

/// Product that saturates: sizes from a config file are not trusted to be sane, and an
/// estimate of "more than any device" beats one that wrapped round (or a panic).
pub(crate) fn mul(xs: &[u64]) -> u64 {
    xs.iter().fold(1u64, |a, &x| a.saturating_mul(x))
}

/// Sum that saturates.
pub(crate) fn add(xs: &[u64]) -> u64 {
    xs.iter().fold(0u64, |a, &x| a.saturating_add(x))
}

impl ModelConfig {
    /// Key/value heads (query heads when unset).
    pub fn kv_heads(&self) -> u64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head width.
    pub fn head_dim(&self) -> u64 {
        self.head_dim.unwrap_or_else(|| {
            if self.is_qwen3() {
                128
            } else {
                self.hidden_size / self.num_attention_heads.max(1)
            }
        })
    }

    /// Qwen3 dense: per-head RMSNorm weights on q and k (`head_dim` each per layer).
    pub fn is_qwen3(&self) -> bool {
        self.model_type.as_deref() == Some("qwen3")
    }

    /// Parameters of the transformer body: embedding, layers, final norm
    /// (no output head).
    pub fn body_params(&self) -> u64 {
        let h = self.hidden_size;
        let q = mul(&[self.num_attention_heads, self.head_dim()]);
        let kv = mul(&[self.kv_heads(), self.head_dim()]);
        let bias = if self.attention_bias {
            add(&[q, mul(&[2, kv])])
        } else {
            0
        };
        let attn = add(&[mul(&[h, q]), mul(&[2, h, kv]), mul(&[q, h]), bias]);
        let mlp = mul(&[3, h, self.intermediate_size]);
        let qk_norms = if self.is_qwen3() {
            mul(&[2, self.head_dim()])
        } else {
            0
        };
        let norms = add(&[mul(&[2, h]), qk_norms]);
        add(&[
            mul(&[self.vocab_size, h]),
            mul(&[self.num_hidden_layers, add(&[attn, mlp, norms])]),
            h,
        ])
    }

    /// Parameters of the causal LM (body + LM head unless tied).
    pub fn lm_params(&self) -> u64 {
        let head = if self.tie_word_embeddings {
            0
        } else {
            mul(&[self.vocab_size, self.hidden_size])
        };
        add(&[self.body_params(), head])
    }

    /// Parameters of rank-`rank` LoRA adapters on the `targets` of every layer (module names
    /// or `all-linear`): `rank · (in + out)` per adapted linear layer.
    pub fn lora_params(&self, rank: u64, targets: &[String]) -> u64 {
        let h = self.hidden_size;
        let q = mul(&[self.num_attention_heads, self.head_dim()]);
        let kv = mul(&[self.kv_heads(), self.head_dim()]);
        let i = self.intermediate_size;
        let all = targets.iter().any(|t| t == rlhf_types::lora::ALL_LINEAR);
        let per_layer: u64 = [
            ("q_proj", add(&[h, q])),
            ("k_proj", add(&[h, kv])),
            ("v_proj", add(&[h, kv])),
            ("o_proj", add(&[q, h])),
            ("gate_proj", add(&[h, i])),
            ("up_proj", add(&[h, i])),
            ("down_proj", add(&[i, h])),
        ]
        .iter()
        .filter(|(m, _)| all || targets.iter().any(|t| t == m))
        .fold(0u64, |acc, (_, io)| acc.saturating_add(*io));
        mul(&[self.num_hidden_layers, rank, per_layer])
    }

    /// Parameters of a value / reward model (body + a scalar head).
    pub fn value_params(&self) -> u64 {
        add(&[self.body_params(), self.hidden_size])
    }

    /// Reads the architecture from an HF model directory's `config.json`.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Io {
            path: path.clone(),
            source,
        })?;
        let c: HfConfigJson = serde_json::from_str(&text).map_err(|e| ConfigError::Model {
            origin: path.display().to_string(),
            reason: format!("not a decoder config.json this crate understands: {e}"),
        })?;
        let attention_bias = c
            .attention_bias
            .unwrap_or(c.model_type.as_deref() == Some("qwen2"));
        Ok(Self {
            path: Some(dir.display().to_string()),
            model_type: c.model_type,
            hidden_size: c.hidden_size,
            num_hidden_layers: c.num_hidden_layers,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            intermediate_size: c.intermediate_size,
            vocab_size: c.vocab_size,
            max_position_embeddings: c.max_position_embeddings.unwrap_or(u64::MAX),
            tie_word_embeddings: c.tie_word_embeddings,
            attention_bias,
            rope_theta: c.rope_theta,
            rms_norm_eps: c.rms_norm_eps,
        })
    }

    /// Checks the numbers are usable; one message per problem, keys prefixed.
    pub fn problems(&self, prefix: &str) -> Vec<String> {
        let mut out = Vec::new();
        for (k, v) in [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                out.push(format!("{prefix}.{k} must be > 0"));
            }
        }
        if self.num_attention_heads > 0 {
            let kv = self.kv_heads();
            if kv == 0 || !self.num_attention_heads.is_multiple_of(kv) {
                out.push(format!(
                    "{prefix}.num_attention_heads ({}) must be a multiple of {prefix}.num_key_value_heads ({kv})",
                    self.num_attention_heads
                ));
            }
            if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads)
            {
                out.push(format!(
                    "{prefix}.hidden_size ({}) is not divisible by {prefix}.num_attention_heads ({}); set {prefix}.head_dim",
                    self.hidden_size, self.num_attention_heads
                ));
            }
        }
        out
    }
}
