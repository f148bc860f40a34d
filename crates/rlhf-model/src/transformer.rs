//! Llama-family decoder (Llama 2/3, Qwen2): config, weights and forward pass.
//!
//! References: Touvron et al., "LLaMA" (2023) and the transformers `modeling_llama.py` /
//! `modeling_qwen2.py` checkpoints, whose tensor names are mirrored here
//! (`model.layers.N.self_attn.q_proj.weight`, ...). Qwen2 differs from Llama only by the q/k/v
//! biases and its defaults, so both share this file.
//!
//! The forward pass takes left-padded batches: an attention mask `[B, S]` (1 = token, 0 = pad,
//! `S` = cached + new tokens) and per-row position ids `[B, T]`. Its non-matmul ops come from one of three
//! [`Kernels`]: candle's fused kernels (no backward pass: inference only), this crate's fused
//! differentiable CPU kernels (training on CPU), or candle's primitive ops (explicit RMSNorm,
//! rotate-half RoPE, softmax from exp/sum: training anywhere).

use candle_core::{DType, Device, Tensor, D};
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::weights::{Init, ParamBuilder};

/// Architectures (HF `architectures[0]`) this crate loads.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "LlamaForCausalLM",
    "LlamaForSequenceClassification",
    "LlamaForTokenClassification",
    "Qwen2ForCausalLM",
    "Qwen2ForSequenceClassification",
    "Qwen2ForTokenClassification",
];

/// Model family, from `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen2,
}

impl Family {
    /// HF `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
        }
    }

    /// Prefix of HF class names (`LlamaForCausalLM`).
    pub fn class_prefix(self) -> &'static str {
        match self {
            Family::Llama => "Llama",
            Family::Qwen2 => "Qwen2",
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
        if family == Family::Qwen2 && get_bool(v, "use_sliding_window")?.unwrap_or(false) {
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
        let head_dim = get_usize(v, "head_dim")?.unwrap_or(hidden_size / num_attention_heads);
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

    /// The same config with another family (Qwen2 adds q/k/v biases).
    pub fn with_family(&self, family: Family) -> Result<Self> {
        let mut raw = self.raw.clone();
        raw["model_type"] = json!(family.model_type());
        let suffix = self
            .architecture
            .strip_prefix(self.family.class_prefix())
            .unwrap_or("ForCausalLM");
        raw["architectures"] = json!([format!("{}{}", family.class_prefix(), suffix)]);
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

/// Which implementation of the non-matmul ops a decoder uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernels {
    /// candle's fused kernels: fastest for inference, no backward pass.
    Inference,
    /// This crate's fused differentiable CPU kernels (f32/f64 on CPU).
    FusedTraining,
    /// candle's primitive differentiable ops: any device and dtype.
    Composite,
}

/// Per-layer key/value cache for incremental decoding; `k`, `v` are `[B, H_kv, S, D]`.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
}

impl KvCache {
    /// An empty cache for `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
        }
    }

    /// Number of cached positions.
    pub fn seq_len(&self) -> usize {
        self.layers
            .first()
            .and_then(|l| l.as_ref())
            .and_then(|(k, _)| k.dim(2).ok())
            .unwrap_or(0)
    }

    /// Reorders or repeats batch rows: row `i` of the result is row `idx[i]` of the cache.
    pub fn select_rows(&mut self, idx: &Tensor) -> Result<()> {
        for (k, v) in self.layers.iter_mut().flatten() {
            *k = k.index_select(idx, 0)?;
            *v = v.index_select(idx, 0)?;
        }
        Ok(())
    }

    /// Drops every cached position.
    pub fn clear(&mut self) {
        for l in self.layers.iter_mut() {
            *l = None;
        }
    }
}

/// Dense layer `y = x W^T (+ b)` with HF weight layout `[out, in]`.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    pub w: Tensor,
    pub b: Option<Tensor>,
}

impl Linear {
    pub fn load(
        pb: &mut ParamBuilder,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
        std: f64,
    ) -> Result<Self> {
        let w = pb.get(
            &format!("{prefix}.weight"),
            &[out_dim, in_dim],
            Init::Normal(std),
        )?;
        let b = if bias {
            Some(pb.get(&format!("{prefix}.bias"), &[out_dim], Init::Normal(std))?)
        } else {
            None
        };
        Ok(Self { w, b })
    }

    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let dims = xs.dims().to_vec();
        let in_dim = *dims
            .last()
            .ok_or_else(|| Error::InvalidArgument("empty input".into()))?;
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let ys = xs.reshape((rows, in_dim))?.matmul(&self.w.t()?)?;
        let ys = match &self.b {
            Some(b) => ys.broadcast_add(b)?,
            None => ys,
        };
        let mut out = dims;
        let last = out.len() - 1;
        out[last] = self.w.dim(0)?;
        Ok(ys.reshape(out)?)
    }
}

fn rms_norm(xs: &Tensor, w: &Tensor, eps: f64, kernels: Kernels) -> Result<Tensor> {
    match kernels {
        Kernels::Inference => {
            return Ok(candle_nn::ops::rms_norm(&xs.contiguous()?, w, eps as f32)?)
        }
        Kernels::FusedTraining => return Ok(crate::kernels::rms_norm(xs, w, eps)?),
        Kernels::Composite => {}
    }
    // Computed in f32 like transformers, then cast back before the weight multiply.
    let dtype = xs.dtype();
    let internal = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let x = xs.to_dtype(internal)?;
    let var = x.sqr()?.mean_keepdim(D::Minus1)?;
    let x = x.broadcast_mul(&(var + eps)?.sqrt()?.recip()?)?;
    Ok(x.to_dtype(dtype)?.broadcast_mul(w)?)
}

fn softmax_last(xs: &Tensor, fast: bool) -> Result<Tensor> {
    let dtype = xs.dtype();
    let internal = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let x = xs.to_dtype(internal)?;
    let p = if fast {
        candle_nn::ops::softmax_last_dim(&x)?
    } else {
        candle_nn::ops::softmax(&x, D::Minus1)?
    };
    Ok(p.to_dtype(dtype)?)
}

fn rotate_half(xs: &Tensor) -> Result<Tensor> {
    let last = xs.dim(D::Minus1)?;
    let x1 = xs.narrow(D::Minus1, 0, last / 2)?;
    let x2 = xs.narrow(D::Minus1, last / 2, last - last / 2)?;
    Ok(Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?)
}

/// cos/sin for one forward: half-width `[B, T, D/2]` tables (fused kernels) or full-width
/// `[B, 1, T, D]` (explicit rotation).
struct Rope {
    cos: Tensor,
    sin: Tensor,
    kernels: Kernels,
}

impl Rope {
    fn new(
        inv_freq: &Tensor,
        position_ids: &Tensor,
        dtype: DType,
        kernels: Kernels,
    ) -> Result<Self> {
        let (b, t) = position_ids.dims2()?;
        let half = inv_freq.dim(0)?;
        let pos = position_ids.to_dtype(DType::F32)?.reshape((b, t, 1))?;
        let freqs = pos.broadcast_mul(&inv_freq.reshape((1, 1, half))?)?;
        if kernels == Kernels::Composite {
            let emb = Tensor::cat(&[&freqs, &freqs], D::Minus1)?.unsqueeze(1)?;
            Ok(Self {
                cos: emb.cos()?.to_dtype(dtype)?,
                sin: emb.sin()?.to_dtype(dtype)?,
                kernels,
            })
        } else {
            Ok(Self {
                cos: freqs.cos()?.to_dtype(dtype)?.contiguous()?,
                sin: freqs.sin()?.to_dtype(dtype)?.contiguous()?,
                kernels,
            })
        }
    }

    fn apply(&self, xs: &Tensor) -> Result<Tensor> {
        match self.kernels {
            Kernels::Inference => Ok(candle_nn::rotary_emb::rope(
                &xs.contiguous()?,
                &self.cos,
                &self.sin,
            )?),
            Kernels::FusedTraining => Ok(crate::kernels::rope(xs, &self.cos, &self.sin)?),
            Kernels::Composite => {
                Ok((xs.broadcast_mul(&self.cos)? + rotate_half(xs)?.broadcast_mul(&self.sin)?)?)
            }
        }
    }
}

#[derive(Debug, Clone)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    fn load(cfg: &Config, pb: &mut ParamBuilder, prefix: &str, std: f64) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        Ok(Self {
            q_proj: Linear::load(
                pb,
                &format!("{prefix}.q_proj"),
                h,
                nh * d,
                cfg.qkv_bias,
                std,
            )?,
            k_proj: Linear::load(
                pb,
                &format!("{prefix}.k_proj"),
                h,
                nkv * d,
                cfg.qkv_bias,
                std,
            )?,
            v_proj: Linear::load(
                pb,
                &format!("{prefix}.v_proj"),
                h,
                nkv * d,
                cfg.qkv_bias,
                std,
            )?,
            o_proj: Linear::load(pb, &format!("{prefix}.o_proj"), nh * d, h, cfg.o_bias, std)?,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
        })
    }

    fn forward(
        &self,
        xs: &Tensor,
        rope: &Rope,
        mask: &Tensor,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
        kernels: Kernels,
    ) -> Result<Tensor> {
        let (b, t, _) = xs.dims3()?;
        let (nh, nkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let q = self
            .q_proj
            .forward(xs)?
            .reshape((b, t, nh, d))?
            .transpose(1, 2)?;
        let k = self
            .k_proj
            .forward(xs)?
            .reshape((b, t, nkv, d))?
            .transpose(1, 2)?;
        let v = self
            .v_proj
            .forward(xs)?
            .reshape((b, t, nkv, d))?
            .transpose(1, 2)?;
        let q = rope.apply(&q)?;
        let k = rope.apply(&k)?.contiguous()?;
        let v = v.contiguous()?;
        let (k, v) = match cache {
            Some(slot) => {
                let kv = match slot.take() {
                    Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
                    None => (k, v),
                };
                // The cache serves decoding only: keep no autograd graph alive through it.
                *slot = Some((kv.0.detach(), kv.1.detach()));
                kv
            }
            None => (k, v),
        };
        let s = k.dim(2)?;
        let n_rep = nh / nkv;
        // Grouped-query attention without copying K/V: the n_rep query heads that share a KV
        // head are stacked along the sequence axis.
        let scale = 1.0 / (d as f64).sqrt();
        let q = (q.contiguous()? * scale)?.reshape((b, nkv, n_rep * t, d))?;
        let att = q.matmul(&k.t()?)?.reshape((b, nkv, n_rep, t, s))?;
        let att = if kernels == Kernels::FusedTraining {
            crate::kernels::masked_softmax(&att, &mask.reshape((b, t, s))?)?
        } else {
            softmax_last(&att.broadcast_add(mask)?, kernels == Kernels::Inference)?
        };
        let att = att.reshape((b, nkv, n_rep * t, s))?;
        let ys = att.matmul(&v)?;
        let ys = ys
            .reshape((b, nh, t, d))?
            .transpose(1, 2)?
            .reshape((b, t, nh * d))?;
        self.o_proj.forward(&ys)
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn load(cfg: &Config, pb: &mut ParamBuilder, prefix: &str, std: f64) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_proj: Linear::load(pb, &format!("{prefix}.gate_proj"), h, i, cfg.mlp_bias, std)?,
            up_proj: Linear::load(pb, &format!("{prefix}.up_proj"), h, i, cfg.mlp_bias, std)?,
            down_proj: Linear::load(pb, &format!("{prefix}.down_proj"), i, h, cfg.mlp_bias, std)?,
        })
    }

    fn forward(&self, xs: &Tensor, kernels: Kernels) -> Result<Tensor> {
        let gate = self.gate_proj.forward(xs)?;
        let up = self.up_proj.forward(xs)?;
        let h = if kernels == Kernels::FusedTraining {
            crate::kernels::swiglu(&gate, &up)?
        } else {
            (gate.silu()? * up)?
        };
        self.down_proj.forward(&h)
    }
}

#[derive(Debug, Clone)]
struct Layer {
    input_layernorm: Tensor,
    self_attn: Attention,
    post_attention_layernorm: Tensor,
    mlp: Mlp,
}

/// The decoder stack (`model.*` tensors): embeddings, layers and the final norm.
#[derive(Debug, Clone)]
pub struct Transformer {
    cfg: Config,
    embed_tokens: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    inv_freq: Tensor,
    kernels: Kernels,
}

/// Large negative score for masked positions; finite so fully masked (padding) rows stay
/// finite instead of turning into NaN.
fn mask_value(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => -3.0e4,
        _ => -1.0e9,
    }
}

impl Transformer {
    pub(crate) fn load(cfg: &Config, pb: &mut ParamBuilder, kernels: Kernels) -> Result<Self> {
        let std = 0.02;
        let h = cfg.hidden_size;
        let embed_tokens = pb.get(
            "model.embed_tokens.weight",
            &[cfg.vocab_size, h],
            Init::Normal(std),
        )?;
        // A checkpoint must hold exactly the layers config.json announces.
        let layer = |i: usize| format!("model.layers.{i}.input_layernorm.weight");
        if pb.has_checkpoint() {
            let n = cfg.num_hidden_layers;
            if n == 0 || !pb.contains(&layer(n - 1)) || pb.contains(&layer(n)) {
                let present = (0..=n).take_while(|&i| pb.contains(&layer(i))).count();
                return Err(Error::Config(format!(
                    "config.json says num_hidden_layers={n} but the weights hold {present} layer(s); the config does not belong to these weights"
                )));
            }
        }
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                input_layernorm: pb.get(
                    &format!("{p}.input_layernorm.weight"),
                    &[h],
                    Init::Ones,
                )?,
                self_attn: Attention::load(cfg, pb, &format!("{p}.self_attn"), std)?,
                post_attention_layernorm: pb.get(
                    &format!("{p}.post_attention_layernorm.weight"),
                    &[h],
                    Init::Ones,
                )?,
                mlp: Mlp::load(cfg, pb, &format!("{p}.mlp"), std)?,
            });
        }
        let norm = pb.get("model.norm.weight", &[h], Init::Ones)?;
        let inv = cfg.inv_freq();
        let inv_freq = Tensor::from_vec(inv.clone(), inv.len(), pb.device())?;
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm,
            inv_freq,
            kernels,
        })
    }

    /// The decoder config.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Input embedding matrix `[V, H]` (used by tied LM heads).
    pub fn embed_tokens(&self) -> &Tensor {
        &self.embed_tokens
    }

    /// Which op implementations the forward uses.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// Final hidden states `[B, T, H]` (after the last norm).
    ///
    /// `attention_mask` is `[B, S]` with `S = cached + T`; `position_ids` is `[B, T]`.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        mut cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        let past = cache.as_ref().map(|c| c.seq_len()).unwrap_or(0);
        let (mb, s) = attention_mask.dims2()?;
        if mb != b || s != past + t {
            return Err(Error::InvalidArgument(format!(
                "attention_mask has shape [{mb}, {s}] but input_ids is [{b}, {t}] with {past} cached positions; expected [{b}, {}]",
                past + t
            )));
        }
        if position_ids.dims() != [b, t] {
            return Err(Error::InvalidArgument(format!(
                "position_ids has shape {:?}, expected [{b}, {t}]",
                position_ids.dims()
            )));
        }
        if let Some(c) = cache.as_ref() {
            if c.layers.len() != self.layers.len() {
                return Err(Error::InvalidArgument(format!(
                    "KV cache has {} layers, the model {}",
                    c.layers.len(),
                    self.layers.len()
                )));
            }
        }
        let dtype = self.embed_tokens.dtype();
        let device = self.embed_tokens.device().clone();
        let mask = build_mask(attention_mask, t, past, dtype, &device)?;
        let rope = Rope::new(&self.inv_freq, position_ids, dtype, self.kernels)?;
        let ids = input_ids.to_dtype(DType::U32)?.flatten_all()?;
        let mut xs =
            self.embed_tokens
                .index_select(&ids, 0)?
                .reshape((b, t, self.cfg.hidden_size))?;
        let eps = self.cfg.rms_norm_eps;
        for (i, layer) in self.layers.iter().enumerate() {
            let slot = cache.as_mut().map(|c| &mut c.layers[i]);
            let h = rms_norm(&xs, &layer.input_layernorm, eps, self.kernels)?;
            let h = layer
                .self_attn
                .forward(&h, &rope, &mask, slot, self.kernels)?;
            xs = (xs + h)?;
            let h = rms_norm(&xs, &layer.post_attention_layernorm, eps, self.kernels)?;
            let h = layer.mlp.forward(&h, self.kernels)?;
            xs = (xs + h)?;
        }
        rms_norm(&xs, &self.norm, eps, self.kernels)
    }
}

/// Additive mask `[B, 1, 1, T, S]`: a query at absolute position `past + i` sees key `j` when
/// `j <= past + i` and key `j` is not padding.
fn build_mask(
    attention_mask: &Tensor,
    t: usize,
    past: usize,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let am = attention_mask.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let b = am.len();
    let s = past + t;
    let neg = mask_value(dtype);
    let mut data = vec![0f32; b * t * s];
    for (bi, row) in am.iter().enumerate() {
        for i in 0..t {
            let base = (bi * t + i) * s;
            for (j, &m) in row.iter().enumerate() {
                if j > past + i || m < 0.5 {
                    data[base + j] = neg;
                }
            }
        }
    }
    Ok(Tensor::from_vec(data, (b, 1, 1, t, s), device)?.to_dtype(dtype)?)
}

/// Position ids `cumsum(mask) - 1`, clamped at 0, for a left-padded batch (`[B, T]`, u32).
pub fn position_ids_from_mask(attention_mask: &Tensor) -> Result<Tensor> {
    let am = attention_mask.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let (b, t) = attention_mask.dims2()?;
    let mut out = Vec::with_capacity(b * t);
    for row in am {
        let mut c: i64 = -1;
        for m in row {
            if m > 0.5 {
                c += 1;
            }
            out.push(c.max(0) as u32);
        }
    }
    Ok(Tensor::from_vec(out, (b, t), attention_mask.device())?)
}
