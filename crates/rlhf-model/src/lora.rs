//! LoRA adapters (Hu et al., 2021) on the decoder's linear layers, saved and read in PEFT's
//! format so that `peft` loads what we train and we load what `peft` trains.
//!
//! Why: a 7B policy with f32 master weights and AdamW state needs ~112 GB; with LoRA the base
//! stays frozen (in the compute dtype, no gradients, no optimizer state) and only two small
//! matrices per adapted layer train. A LoRA model computes `y = x W^T + b + s * (x A^T) B^T`
//! with `A: [r, in]`, `B: [out, r]` and `s = alpha / r` (`alpha / sqrt(r)` with rsLoRA), as
//! PEFT's `lora.Linear` does. The adapter can be switched off at run time: the reference
//! policy of a LoRA actor is the same base with the adapter off (no second copy).
//!
//! On disk (what `PeftModel.save_pretrained` writes): `adapter_config.json` and
//! `adapter_model.safetensors` whose keys are `base_model.model.` + the module path, e.g.
//! `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`; a critic's or reward
//! model's `score` head is saved beside them (PEFT's `modules_to_save`).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::Tensor;
use serde_json::{json, Value};

use crate::error::{read_json, Error, Result};
use crate::load::ModelKind;

/// File name of an adapter's config.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// File name of an adapter's weights.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// Prefix PEFT puts before the module path of every saved tensor.
pub const PEFT_PREFIX: &str = "base_model.model.";
/// Header metadata key of our adapters' safetensors: the fingerprint of the base they were
/// trained on ([`crate::Model::base_fingerprint`]), so an adapter put on another base is
/// refused. PEFT ignores it; adapters without it are checked by shape only.
pub const BASE_FINGERPRINT_KEY: &str = "rlhf_base_fingerprint";

pub use rlhf_types::lora::{ALL_LINEAR, LINEAR_MODULES};

/// Shape and scale of the adapters.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank `r` of the update `B A` (at least 1).
    pub rank: usize,
    /// `lora_alpha`: the update is scaled by `alpha / r` (`alpha / sqrt(r)` with rsLoRA).
    pub alpha: f64,
    /// `lora_dropout`: in a training pass ([`crate::Model::dropout_pass`]) each adapter's
    /// input elements are zeroed with this probability and the rest scaled by `1 / (1 - p)`,
    /// as PEFT's `nn.Dropout`; outside one the adapters see their whole input.
    pub dropout: f64,
    /// Module names (`q_proj`, ...) or `all-linear`.
    pub target_modules: Vec<String>,
    /// rsLoRA scaling (`use_rslora`).
    pub rslora: bool,
}

impl LoraConfig {
    /// A config with PEFT's defaults for the rest (no dropout, no rsLoRA).
    pub fn new(rank: usize, alpha: f64, target_modules: &[&str]) -> Self {
        Self {
            rank,
            alpha,
            dropout: 0.0,
            target_modules: target_modules.iter().map(|s| s.to_string()).collect(),
            rslora: false,
        }
    }

    /// The factor the update `B A x` is multiplied by.
    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    /// The module names targeted, expanded and sorted (`all-linear` is every linear layer).
    pub fn modules(&self) -> Vec<String> {
        let mut out: Vec<String> = if self.target_modules.iter().any(|m| m == ALL_LINEAR) {
            LINEAR_MODULES.iter().map(|s| s.to_string()).collect()
        } else {
            self.target_modules.clone()
        };
        out.sort();
        out.dedup();
        out
    }

    /// Whether the linear layer `module` (its last path component, `q_proj`) gets an adapter.
    pub fn targets(&self, module: &str) -> bool {
        self.modules().iter().any(|m| m == module)
    }

    /// Refuses what the adapters cannot be ([`rlhf_types::lora::lora_problem`]).
    pub fn validate(&self) -> Result<()> {
        match rlhf_types::lora::lora_problem(
            self.rank,
            self.alpha,
            self.dropout,
            &self.target_modules,
        ) {
            Some(p) => Err(Error::InvalidArgument(format!("lora {p}"))),
            None => Ok(()),
        }
    }

    /// `adapter_config.json` as PEFT writes it (the keys PEFT needs to load it).
    pub fn to_peft_json(&self, kind: ModelKind, base: Option<&str>) -> Value {
        let (task, to_save) = match kind {
            ModelKind::CausalLm => ("CAUSAL_LM", Value::Null),
            ModelKind::Value => ("TOKEN_CLS", json!(["score"])),
            ModelKind::Reward => ("SEQ_CLS", json!(["score"])),
        };
        json!({
            "peft_type": "LORA",
            "task_type": task,
            "base_model_name_or_path": base,
            "revision": null,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": self.modules(),
            "use_rslora": self.rslora,
            "use_dora": false,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "modules_to_save": to_save,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
        })
    }

    /// Reads an adapter directory's `adapter_config.json`; refuses the PEFT options this
    /// implementation does not compute (DoRA, biases, per-layer ranks, ...) by name.
    pub fn from_adapter_dir(dir: &Path) -> Result<(Self, Value)> {
        let path = dir.join(ADAPTER_CONFIG_FILE);
        if !path.is_file() {
            return Err(Error::MissingFile {
                path,
                hint: "a LoRA adapter directory holds adapter_config.json and \
                       adapter_model.safetensors (what peft's save_pretrained writes)"
                    .into(),
            });
        }
        let raw: Value = read_json(&path)?;
        let bad = |m: String| Error::Json {
            path: path.clone(),
            message: m,
        };
        let peft_type = raw.get("peft_type").and_then(Value::as_str).unwrap_or("");
        if peft_type != "LORA" {
            return Err(bad(format!(
                "peft_type is {peft_type:?}; only LORA adapters are supported"
            )));
        }
        let rank = raw
            .get("r")
            .and_then(Value::as_u64)
            .ok_or_else(|| bad("r (the rank) is missing or not a positive integer".into()))?;
        let alpha = raw
            .get("lora_alpha")
            .and_then(Value::as_f64)
            .ok_or_else(|| bad("lora_alpha is missing or not a number".into()))?;
        let targets: Vec<String> = match raw.get("target_modules") {
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| bad("target_modules holds a non-string".into()))
                })
                .collect::<Result<_>>()?,
            _ => return Err(bad("target_modules is missing".into())),
        };
        let flag = |k: &str| raw.get(k).and_then(Value::as_bool).unwrap_or(false);
        let nonempty = |k: &str| match raw.get(k) {
            None | Some(Value::Null) => false,
            Some(Value::Object(m)) => !m.is_empty(),
            Some(Value::Array(a)) => !a.is_empty(),
            Some(_) => true,
        };
        for k in ["use_dora", "fan_in_fan_out", "lora_bias"] {
            if flag(k) {
                return Err(bad(format!("{k} is true; not supported")));
            }
        }
        for k in [
            "rank_pattern",
            "alpha_pattern",
            "layers_to_transform",
            "layer_replication",
        ] {
            if nonempty(k) {
                return Err(bad(format!("{k} is set; not supported")));
            }
        }
        if let Some(b) = raw.get("bias").and_then(Value::as_str) {
            if b != "none" {
                return Err(bad(format!("bias is {b:?}; only \"none\" is supported")));
            }
        }
        let cfg = Self {
            rank: rank as usize,
            alpha,
            dropout: raw
                .get("lora_dropout")
                .and_then(Value::as_f64)
                .unwrap_or(0.0),
            target_modules: targets,
            rslora: flag("use_rslora"),
        };
        // Dropout only acts in training; an adapter trained with it still loads.
        let check = Self {
            dropout: 0.0,
            ..cfg.clone()
        };
        check.validate().map_err(|e| bad(e.to_string()))?;
        Ok((cfg, raw))
    }
}

/// The name PEFT saves an internal parameter under.
pub fn peft_name(name: &str) -> String {
    format!("{PEFT_PREFIX}{name}")
}

/// The internal name of a tensor PEFT saved, or None when it lacks PEFT's prefix.
pub fn internal_name(peft: &str) -> Option<&str> {
    peft.strip_prefix(PEFT_PREFIX)
}

/// Whether a parameter name is one of an adapter's matrices.
pub fn is_adapter_param(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// Whether a model's adapters are applied, and the seed of the training pass their dropout
/// masks come from (none outside one); shared by every adapted layer of one model.
#[derive(Debug, Clone)]
pub struct AdapterSwitch {
    on: Arc<AtomicBool>,
    /// 0: no training pass.
    pass: Arc<AtomicU64>,
}

impl Default for AdapterSwitch {
    fn default() -> Self {
        Self {
            on: Arc::new(AtomicBool::new(true)),
            pass: Arc::new(AtomicU64::new(0)),
        }
    }
}

impl AdapterSwitch {
    pub fn enabled(&self) -> bool {
        self.on.load(Ordering::Acquire)
    }

    pub fn set(&self, on: bool) {
        self.on.store(on, Ordering::Release)
    }

    /// The seed of the training pass under way, if any.
    pub fn dropout_seed(&self) -> Option<u64> {
        let v = self.pass.load(Ordering::Acquire);
        (v != 0).then_some(v)
    }

    /// Starts (`Some`) or ends (`None`) a training pass.
    pub fn set_dropout_seed(&self, seed: Option<u64>) {
        self.pass
            .store(seed.map_or(0, |s| s.max(1)), Ordering::Release)
    }
}

/// The splitmix64 finalizer: a well-mixed 64-bit hash of `z`.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// PEFT's `nn.Dropout(p)` mask for an adapter input of `[rows, cols]`, as a function of
/// `seed` alone (so a recomputed checkpointed layer and a resumed run draw the same one):
/// an element is kept, scaled by `1 / (1 - p)`, when its hash is at least `p` of the range.
pub(crate) fn dropout_mask(
    seed: u64,
    (rows, cols): (usize, usize),
    p: f64,
    device: &candle_core::Device,
    dtype: candle_core::DType,
) -> Result<Tensor> {
    let keep = (1.0 / (1.0 - p)) as f32;
    // `p < 1`, so the cut is below 2^64 (the cast saturates anyway).
    let cut = (p * 18_446_744_073_709_551_616.0) as u64;
    let v: Vec<f32> = (0..(rows * cols) as u64)
        .map(|i| {
            if mix64(seed ^ mix64(i)) >= cut {
                keep
            } else {
                0.0
            }
        })
        .collect();
    Ok(Tensor::from_vec(v, (rows, cols), device)?.to_dtype(dtype)?)
}

/// A layer's own stream of dropout masks: its parameter prefix hashed.
pub(crate) fn layer_id(prefix: &str) -> u64 {
    let mut h = rlhf_types::Checksum::new();
    h.update(prefix.as_bytes());
    h.finish()
}

/// One adapted layer's matrices.
#[derive(Debug, Clone)]
pub(crate) struct LoraPair {
    /// `[r, in]`.
    pub a: Tensor,
    /// `[out, r]`.
    pub b: Tensor,
    pub scale: f64,
    pub switch: AdapterSwitch,
    /// `lora_dropout`.
    pub dropout: f64,
    /// [`layer_id`] of the adapted layer.
    pub id: u64,
}

impl LoraPair {
    /// `s * (drop(x) A^T) B^T` for `x: [rows, in]`, in the dtype of `x`; `drop` is
    /// `lora_dropout` in a training pass, nothing outside one.
    pub fn delta(&self, x: &Tensor) -> Result<Tensor> {
        let x = match self.switch.dropout_seed() {
            Some(seed) if self.dropout > 0.0 => {
                let mask = dropout_mask(
                    mix64(seed ^ self.id),
                    x.dims2()?,
                    self.dropout,
                    x.device(),
                    x.dtype(),
                )?;
                (x * mask)?
            }
            _ => x.clone(),
        };
        let a = self.a.to_dtype(x.dtype())?;
        let b = self.b.to_dtype(x.dtype())?;
        Ok((x.matmul(&a.t()?)?.matmul(&b.t()?)? * self.scale)?)
    }

    /// `W + s B A`, computed in f32 (f64 for f64 weights) and returned in `w`'s dtype.
    pub fn merged(&self, w: &Tensor) -> Result<Tensor> {
        let wide = crate::ops::wide_dtype(w.dtype());
        let update = (self.b.to_dtype(wide)?.matmul(&self.a.to_dtype(wide)?)? * self.scale)?;
        Ok((w.to_dtype(wide)? + update)?.to_dtype(w.dtype())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mask zeroes about `p` of the elements, scales the rest by `1 / (1 - p)`, and is a
    /// function of its seed.
    #[test]
    fn dropout_mask_keeps_one_minus_p_scaled_and_follows_its_seed() {
        let dev = candle_core::Device::Cpu;
        let f32s = |seed| {
            dropout_mask(seed, (200, 100), 0.25, &dev, candle_core::DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let m = f32s(3);
        let zeros = m.iter().filter(|&&x| x == 0.0).count() as f64 / m.len() as f64;
        assert!((zeros - 0.25).abs() < 0.02, "zeroed share {zeros}");
        assert!(m.iter().all(|&x| x == 0.0 || (x - 4.0 / 3.0).abs() < 1e-6));
        assert_eq!(m, f32s(3));
        assert_ne!(m, f32s(4));
        let none = dropout_mask(3, (4, 4), 0.0, &dev, candle_core::DType::F32).unwrap();
        assert_eq!(none.sum_all().unwrap().to_scalar::<f32>().unwrap(), 16.0);
    }

    #[test]
    fn scale_and_targets() {
        let mut c = LoraConfig::new(4, 8.0, &["q_proj", "v_proj"]);
        assert_eq!(c.scale(), 2.0);
        assert!(c.targets("q_proj") && !c.targets("k_proj"));
        c.rslora = true;
        assert_eq!(c.scale(), 4.0);
        let all = LoraConfig::new(2, 2.0, &[ALL_LINEAR]);
        assert_eq!(all.modules().len(), LINEAR_MODULES.len());
        assert!(all.targets("down_proj"));
    }

    #[test]
    fn bad_configs_are_refused_with_the_key() {
        let e = LoraConfig::new(4, 8.0, &["qkv"]).validate().unwrap_err();
        assert!(e.to_string().contains("lora target module 'qkv'"), "{e}");
        assert!(LoraConfig::new(4, 8.0, &["q_proj"]).validate().is_ok());
    }

    #[test]
    fn peft_names_round_trip() {
        let n = "model.layers.0.self_attn.q_proj.lora_A.weight";
        assert_eq!(
            peft_name(n),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        );
        assert_eq!(internal_name(&peft_name(n)), Some(n));
        assert!(is_adapter_param(n) && !is_adapter_param("score.weight"));
    }
}
