//! Decoder configuration (HF `config.json` for Llama 2/3, Qwen2 and Qwen3 dense): parsing with size limits,
//! the parameter count and the per-role memory estimate.

use candle_core::DType;
use serde_json::{json, Value};

use crate::error::{Error, Result};

/// Architectures (HF `architectures[0]`) this crate loads.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "LlamaForCausalLM",
    "LlamaForSequenceClassification",
    "LlamaForTokenClassification",
    "Qwen2ForCausalLM",
    "Qwen2ForSequenceClassification",
    "Qwen2ForTokenClassification",
    "Qwen3ForCausalLM",
    "Qwen3ForSequenceClassification",
    "Qwen3ForTokenClassification",
];

/// Model family, from `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen2,
    /// Qwen3 dense: per-head RMSNorm on q and k before RoPE, no q/k/v bias, a `head_dim` of
    /// its own (128 when config.json omits it, as transformers' `Qwen3Config`).
    Qwen3,
}

impl Family {
    /// HF `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        }
    }

    /// Prefix of HF class names (`LlamaForCausalLM`).
    pub fn class_prefix(self) -> &'static str {
        match self {
            Family::Llama => "Llama",
            Family::Qwen2 => "Qwen2",
            Family::Qwen3 => "Qwen3",
        }
    }
}

/// RoPE frequency scaling.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Positions divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1 wavelength-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// Decoder hyper-parameters, read from an HF `config.json`.
#[derive(Debug, Clone)]
pub struct Config {
    pub family: Family,
    /// `architectures[0]` as found (or implied).
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Bias on gate/up/down projections.
    pub mlp_bias: bool,
    /// RMSNorm over each head's q and k before RoPE (`q_norm`, `k_norm`; Qwen3).
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    /// `torch_dtype` / `dtype` as written in the file.
    pub torch_dtype: Option<String>,
    /// The JSON this config was read from; kept so that saving preserves unknown keys.
    pub raw: Value,
}

fn get_usize(v: &Value, key: &str) -> Result<Option<usize>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| Error::Config(format!("{key} must be a non-negative integer, got {x}"))),
    }
}

fn req_usize(v: &Value, key: &str) -> Result<usize> {
    get_usize(v, key)?.ok_or_else(|| Error::Config(format!("config.json lacks {key}")))
}

/// Largest value accepted for each size in config.json: far above any released model, far
/// below what would make the loader allocate without bound before the weights are read.
const DIM_LIMITS: &[(&str, usize)] = &[
    ("vocab_size", 1 << 22),
    ("hidden_size", 1 << 17),
    ("intermediate_size", 1 << 20),
    ("num_hidden_layers", 1 << 10),
    ("num_attention_heads", 1 << 10),
    ("num_key_value_heads", 1 << 10),
    ("head_dim", 1 << 12),
    ("max_position_embeddings", 1 << 24),
    ("bos_token_id", u32::MAX as usize),
    ("pad_token_id", u32::MAX as usize),
];

/// Refuses a size in config.json beyond [`DIM_LIMITS`].
fn check_limits(v: &Value) -> Result<()> {
    for &(key, max) in DIM_LIMITS {
        if let Some(n) = get_usize(v, key)? {
            if n > max {
                return Err(Error::Config(format!(
                    "{key} is {n}, more than any model this loader takes (at most {max}); config.json is damaged or not a causal LM config"
                )));
            }
        }
    }
    Ok(())
}

fn get_f64(v: &Value, key: &str) -> Result<Option<f64>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_f64()
            .map(Some)
            .ok_or_else(|| Error::Config(format!("{key} must be a number, got {x}"))),
    }
}

fn get_bool(v: &Value, key: &str) -> Result<Option<bool>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_bool()
            .map(Some)
            .ok_or_else(|| Error::Config(format!("{key} must be true or false, got {x}"))),
    }
}

/// Token ids that may be one integer or a list (`eos_token_id`).
pub(crate) fn id_list(v: Option<&Value>) -> Vec<u32> {
    // An id that does not fit a u32 is no token id: dropped, never wrapped onto another one.
    let id = |x: &Value| x.as_u64().and_then(|x| u32::try_from(x).ok());
    match v {
        Some(x @ Value::Number(_)) => id(x).map(|x| vec![x]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(id).collect(),
        _ => vec![],
    }
}

fn parse_rope(v: &Value) -> Result<(f64, RopeScaling)> {
    // transformers >= 5 writes `rope_parameters`, older versions `rope_theta` + `rope_scaling`.
    let params = v.get("rope_parameters").filter(|p| p.is_object());
    let scaling = params.or_else(|| v.get("rope_scaling").filter(|p| p.is_object()));
    let theta = params
        .map(|p| get_f64(p, "rope_theta"))
        .transpose()?
        .flatten()
        .or(get_f64(v, "rope_theta")?)
        .unwrap_or(10_000.0);
    let Some(s) = scaling else {
        return Ok((theta, RopeScaling::Default));
    };
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(|x| x.as_str())
        .unwrap_or("default");
    let need = |key: &str| -> Result<f64> {
        get_f64(s, key)?.ok_or_else(|| Error::Config(format!("rope scaling {kind:?} needs {key}")))
    };
    let scaling = match kind {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: need("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: need("original_max_position_embeddings")?,
        },
        other => {
            return Err(Error::Config(format!(
                "rope type {other:?} is not supported; supported: default, linear, llama3"
            )))
        }
    };
    Ok((theta, scaling))
}

impl Config {
    /// Parses an HF `config.json` value.
    pub fn from_json(v: &Value) -> Result<Self> {
        check_limits(v)?;
        let archs: Vec<String> = v
            .get("architectures")
            .and_then(|a| a.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        let model_type = v.get("model_type").and_then(|m| m.as_str());
        let family = match model_type {
            Some("llama") => Family::Llama,
            Some("qwen2") => Family::Qwen2,
            Some("qwen3") => Family::Qwen3,
            Some(other) => {
                return Err(Error::UnsupportedArchitecture {
                    name: match archs.first() {
                        Some(a) => format!("{a} (model_type {other})"),
                        None => format!("model_type {other}"),
                    },
                    supported: SUPPORTED_ARCHITECTURES.to_vec(),
                })
            }
            None => match archs.first().map(String::as_str) {
                Some(a) if a.starts_with("Llama") => Family::Llama,
                Some(a) if a.starts_with("Qwen2") && !a.starts_with("Qwen2Moe") => Family::Qwen2,
                Some(a) if a.starts_with("Qwen3") && !a.starts_with("Qwen3Moe") => Family::Qwen3,
                other => {
                    return Err(Error::UnsupportedArchitecture {
                        name: other
                            .unwrap_or(
                                "<none: config.json has neither model_type nor architectures>",
                            )
                            .to_string(),
                        supported: SUPPORTED_ARCHITECTURES.to_vec(),
                    })
                }
            },
        };
        let architecture = match archs.first() {
            Some(a) if SUPPORTED_ARCHITECTURES.contains(&a.as_str()) => a.clone(),
            Some(a) => {
                return Err(Error::UnsupportedArchitecture {
                    name: a.clone(),
                    supported: SUPPORTED_ARCHITECTURES.to_vec(),
                })
            }
            None => format!("{}ForCausalLM", family.class_prefix()),
        };
        if let Some(act) = v.get("hidden_act").and_then(|a| a.as_str()) {
            if act != "silu" {
                return Err(Error::Config(format!(
                    "hidden_act {act:?} is not supported; only silu (SwiGLU) is"
                )));
            }
        }
        if matches!(family, Family::Qwen2 | Family::Qwen3)
            && get_bool(v, "use_sliding_window")?.unwrap_or(false)
        {
            return Err(Error::Config(
                "use_sliding_window=true is not supported; set it to false".to_string(),
            ));
        }
        let hidden_size = req_usize(v, "hidden_size")?;
        let num_attention_heads = req_usize(v, "num_attention_heads")?;
        let num_key_value_heads =
            get_usize(v, "num_key_value_heads")?.unwrap_or(num_attention_heads);
        if num_attention_heads == 0 || num_key_value_heads == 0 {
            return Err(Error::Config(
                "attention head counts must be positive".into(),
            ));
        }
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(Error::Config(format!(
                "num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads ({num_key_value_heads})"
            )));
        }
        let head_dim = match (get_usize(v, "head_dim")?, family) {
            (Some(d), _) => d,
            // transformers' Qwen3Config defaults to 128, whatever the hidden size.
            (None, Family::Qwen3) => 128,
            (None, _) => hidden_size / num_attention_heads,
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(Error::Config(format!(
                "head_dim {head_dim} must be even and positive"
            )));
        }
        let (rope_theta, rope_scaling) = parse_rope(v)?;
        let attention_bias = get_bool(v, "attention_bias")?.unwrap_or(false);
        let (qkv_bias, o_bias) = match family {
            Family::Llama => (attention_bias, attention_bias),
            Family::Qwen2 => (true, false),
            Family::Qwen3 => (attention_bias, attention_bias),
        };
        Ok(Self {
            family,
            architecture,
            vocab_size: req_usize(v, "vocab_size")?,
            hidden_size,
            intermediate_size: req_usize(v, "intermediate_size")?,
            num_hidden_layers: req_usize(v, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: get_f64(v, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: get_usize(v, "max_position_embeddings")?.unwrap_or(2048),
            tie_word_embeddings: get_bool(v, "tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias: family == Family::Llama && get_bool(v, "mlp_bias")?.unwrap_or(false),
            qk_norm: family == Family::Qwen3,
            bos_token_id: get_usize(v, "bos_token_id")?.map(|x| x as u32),
            eos_token_ids: id_list(v.get("eos_token_id")),
            pad_token_id: get_usize(v, "pad_token_id")?.map(|x| x as u32),
            torch_dtype: v
                .get("torch_dtype")
                .or_else(|| v.get("dtype"))
                .and_then(|d| d.as_str())
                .map(String::from),
            raw: v.clone(),
        })
    }

    /// A small Llama config for tests and benchmarks (random weights, untied embeddings).
    #[allow(clippy::too_many_arguments)]
    pub fn tiny_llama(
        vocab_size: usize,
        hidden_size: usize,
        intermediate_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        num_key_value_heads: usize,
        max_position_embeddings: usize,
    ) -> Result<Self> {
        Self::from_json(&json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": num_attention_heads,
            "num_key_value_heads": num_key_value_heads,
            "max_position_embeddings": max_position_embeddings,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32",
        }))
    }

    /// The same config with another family (Qwen2 adds q/k/v biases, Qwen3 q/k norms).
    pub fn with_family(&self, family: Family) -> Result<Self> {
        let mut raw = self.raw.clone();
        raw["model_type"] = json!(family.model_type());
        let suffix = self
            .architecture
            .strip_prefix(self.family.class_prefix())
            .unwrap_or("ForCausalLM");
        raw["architectures"] = json!([format!("{}{}", family.class_prefix(), suffix)]);
        // Keep the head size (Qwen3 would otherwise take its own default of 128).
        raw["head_dim"] = json!(self.head_dim);
        Self::from_json(&raw)
    }

    /// The same config with a changed JSON key.
    pub fn with_key(&self, key: &str, value: Value) -> Result<Self> {
        let mut raw = self.raw.clone();
        raw[key] = value;
        Self::from_json(&raw)
    }

    /// `config.json` content for saving under `architecture`, keeping the keys read from file.
    pub fn to_json(&self, architecture: &str, extra: &[(&str, Value)]) -> Value {
        let mut raw = self.raw.clone();
        if !raw.is_object() {
            raw = json!({});
        }
        raw["architectures"] = json!([architecture]);
        raw["model_type"] = json!(self.family.model_type());
        for (k, v) in extra {
            raw[*k] = v.clone();
        }
        raw
    }

    /// RoPE inverse frequencies `[head_dim / 2]`, computed in f32 as transformers does.
    pub fn inv_freq(&self) -> Vec<f32> {
        let dim = self.head_dim;
        let base = self.rope_theta as f32;
        let inv: Vec<f32> = (0..dim / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32))
            .collect();
        match self.rope_scaling {
            RopeScaling::Default => inv,
            RopeScaling::Linear { factor } => inv.iter().map(|f| f / factor as f32).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let (factor, low, high, old) = (
                    factor as f32,
                    low_freq_factor as f32,
                    high_freq_factor as f32,
                    original_max_position_embeddings as f32,
                );
                let low_wavelen = old / low;
                let high_wavelen = old / high;
                inv.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                        if medium {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect()
            }
        }
    }

    /// Number of parameters of the decoder plus LM head (tied heads count once).
    pub fn num_params(&self) -> usize {
        let h = self.hidden_size;
        let i = self.intermediate_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let mut per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h;
        if self.qkv_bias {
            per_layer += q + 2 * kv;
        }
        if self.o_bias {
            per_layer += h;
        }
        if self.mlp_bias {
            per_layer += 2 * i + h;
        }
        if self.qk_norm {
            per_layer += 2 * self.head_dim;
        }
        let embed = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        embed + head + h + self.num_hidden_layers * per_layer
    }

    /// Rough memory needs of one role, to refuse a plan that cannot fit before launching it.
    ///
    /// Weights in `dtype`; when `trainable`, gradients in `dtype` plus AdamW moments in f32 and
    /// activations kept for backward (about 34 * hidden + 5 * heads * seq values per token and
    /// layer, after Korthikanti et al. 2022, plus three copies of the logits); a KV cache in
    /// `dtype` for `batch` sequences of `seq_len` tokens when not trainable.
    pub fn memory_estimate(
        &self,
        dtype: DType,
        trainable: bool,
        batch: usize,
        seq_len: usize,
    ) -> MemoryEstimate {
        // Saturating: a job config may ask for absurd batches; the estimate then says "more
        // than any device" instead of wrapping round to a small number.
        let mul = |xs: &[usize]| xs.iter().fold(1usize, |a, &x| a.saturating_mul(x));
        let bytes = dtype.size_in_bytes();
        let params = self.num_params();
        let weights = mul(&[params, bytes]);
        let tokens = mul(&[batch, seq_len]);
        let kv_cache_per_token = mul(&[
            2,
            self.num_hidden_layers,
            self.num_key_value_heads,
            self.head_dim,
            bytes,
        ]);
        if trainable {
            let per_token_layer = mul(&[34, self.hidden_size]).saturating_add(mul(&[
                5,
                self.num_attention_heads,
                seq_len,
            ]));
            let activations = mul(&[tokens, self.num_hidden_layers, per_token_layer, bytes])
                .saturating_add(mul(&[3, tokens, self.vocab_size, 4]));
            MemoryEstimate {
                weights,
                gradients: weights,
                optimizer: mul(&[params, 8]),
                activations,
                kv_cache: 0,
                kv_cache_per_token,
            }
        } else {
            MemoryEstimate {
                weights,
                gradients: 0,
                optimizer: 0,
                activations: mul(&[batch, self.vocab_size, 4]),
                kv_cache: mul(&[tokens, kv_cache_per_token]),
                kv_cache_per_token,
            }
        }
    }
}

/// Bytes a role needs, by kind (see [`Config::memory_estimate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryEstimate {
    pub weights: usize,
    pub gradients: usize,
    pub optimizer: usize,
    pub activations: usize,
    pub kv_cache: usize,
    pub kv_cache_per_token: usize,
}

impl MemoryEstimate {
    /// Sum of all parts.
    pub fn total(&self) -> usize {
        [
            self.gradients,
            self.optimizer,
            self.activations,
            self.kv_cache,
        ]
        .iter()
        .fold(self.weights, |a, &x| a.saturating_add(x))
    }
}
