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
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// `lora_dropout`; only 0 is supported (see [`LoraConfig::validate`]).
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

/// Whether a model's adapters are applied; shared by every adapted layer of one model.
#[derive(Debug, Clone)]
pub struct AdapterSwitch(Arc<AtomicBool>);

impl Default for AdapterSwitch {
    fn default() -> Self {
        Self(Arc::new(AtomicBool::new(true)))
    }
}

impl AdapterSwitch {
    pub fn enabled(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    pub fn set(&self, on: bool) {
        self.0.store(on, Ordering::Release)
    }
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
}

impl LoraPair {
    /// `s * (x A^T) B^T` for `x: [rows, in]`, in the dtype of `x`.
    pub fn delta(&self, x: &Tensor) -> Result<Tensor> {
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
