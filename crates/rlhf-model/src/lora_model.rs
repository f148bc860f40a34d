//! What a [`Model`] with LoRA adapters can do beyond a full model: switch its adapters off
//! (the reference policy from the same weights), read a PEFT adapter directory into its
//! adapters, and merge them into the base (`rlhf merge-lora`).

use std::collections::BTreeSet;
use std::path::Path;

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};
use crate::lora::{self, LoraConfig, LoraPair, ADAPTER_WEIGHTS_FILE};
use crate::model::{LoadOptions, Model, ModelImage};

impl Model {
    /// The adapters' config, when this is a LoRA model.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref().map(|(c, _)| c)
    }

    /// Whether the adapters are applied (always true for a full model).
    pub fn adapter_enabled(&self) -> bool {
        self.lora.as_ref().is_none_or(|(_, s)| s.enabled())
    }

    /// Runs `f` with the adapters off: the base model's outputs (a LoRA actor's reference
    /// log-probs). They are back on afterwards, also when `f` fails. A full model has none
    /// to switch off: the call is refused rather than silently computing with the policy.
    pub fn with_adapter_disabled<T, E: From<Error>>(
        &self,
        f: impl FnOnce(&Model) -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        let Some((_, switch)) = &self.lora else {
            return Err(E::from(Error::InvalidArgument(
                "this model has no LoRA adapter to switch off; the base model's outputs need \
                 a model loaded with LoRA (or a separate copy of the base)"
                    .into(),
            )));
        };
        struct On<'a>(&'a crate::lora::AdapterSwitch);
        impl Drop for On<'_> {
            fn drop(&mut self) {
                self.0.set(true);
            }
        }
        switch.set(false);
        let _on = On(switch);
        f(self)
    }

    /// Runs LoRA dropout (`lora_dropout`) in this model's forwards until the returned guard
    /// drops: a training pass. `seed` picks every adapter's masks, so the same seed draws the
    /// same ones (a layer recomputed for activation checkpointing, a resumed run). Outside a
    /// pass the adapters see their whole input (log-probs, generation, evaluation). A model
    /// without adapters, or with dropout 0, is unaffected.
    pub fn dropout_pass(&self, seed: u64) -> DropoutPass<'_> {
        let switch = self.lora.as_ref().map(|(_, s)| s);
        if let Some(s) = switch {
            s.set_dropout_seed(Some(seed));
        }
        DropoutPass(switch)
    }

    /// Loads a base model and a PEFT LoRA adapter directory onto it: the adapter's
    /// `adapter_config.json` gives rank, alpha and targets (`opts.lora` is replaced).
    pub fn load_with_adapter(base: &Path, adapter: &Path, opts: &LoadOptions) -> Result<Model> {
        let (cfg, _) = LoraConfig::from_adapter_dir(adapter)?;
        let cfg = LoraConfig {
            dropout: 0.0,
            ..cfg
        };
        let model = Model::load(base, &opts.clone().with_lora(Some(cfg)))?;
        model.load_adapter(adapter)?;
        Ok(model)
    }

    /// Sets the adapters (and any score head saved beside them) from a PEFT adapter
    /// directory. Its config must match this model's LoRA config, and its tensors must be
    /// exactly this model's: a missing or extra tensor is an error naming it, and nothing is
    /// changed then.
    pub fn load_adapter(&self, dir: &Path) -> Result<()> {
        let Some((mine, _)) = &self.lora else {
            return Err(Error::InvalidArgument(format!(
                "{} is a LoRA adapter but this model was loaded without LoRA; set the lora \
                 options (rank, alpha, target_modules) to load it",
                dir.display()
            )));
        };
        let (theirs, _) = LoraConfig::from_adapter_dir(dir)?;
        let file = dir.join(ADAPTER_WEIGHTS_FILE);
        if theirs.rank != mine.rank
            || theirs.modules() != mine.modules()
            || (theirs.scale() - mine.scale()).abs() > 1e-12 * mine.scale().abs()
        {
            return Err(Error::Config(format!(
                "the adapter in {} has r={}, scale {} on {:?}, but this model's LoRA has r={}, \
                 scale {} on {:?}; load it with the adapter's own settings",
                dir.display(),
                theirs.rank,
                theirs.scale(),
                theirs.modules(),
                mine.rank,
                mine.scale(),
                mine.modules()
            )));
        }
        if !file.is_file() {
            return Err(Error::MissingFile {
                path: file,
                hint: "a PEFT adapter directory holds adapter_model.safetensors beside \
                       adapter_config.json"
                    .into(),
            });
        }
        let (saved, meta) = crate::weights::load_safetensors(&file, self.device())?;
        if let Some(theirs) = meta.get(lora::BASE_FINGERPRINT_KEY) {
            let mine = self.base_fingerprint()?;
            if *theirs != mine {
                return Err(Error::Config(format!(
                    "the adapter in {} was trained on another base model (base fingerprint \
                     {theirs}, this base's is {mine}); load it onto the base it was trained \
                     on (base_model_name_or_path in its {})",
                    dir.display(),
                    lora::ADAPTER_CONFIG_FILE
                )));
            }
        }
        // The whole shapes (a ZeRO-3 model's variables are this rank's pieces).
        let shapes: std::collections::BTreeMap<String, Vec<usize>> = match self.zero3() {
            Some(z) => z.param_shapes()?.into_iter().collect(),
            None => self
                .vars()
                .into_iter()
                .map(|(n, v)| (n, v.dims().to_vec()))
                .collect(),
        };
        let want: BTreeSet<String> = shapes.keys().cloned().collect();
        let mut tensors = Vec::with_capacity(saved.len());
        for (name, t) in saved {
            let internal = lora::internal_name(&name).filter(|n| want.contains(*n));
            let Some(internal) = internal else {
                return Err(Error::Config(format!(
                    "tensor {name} in {} matches no adapter of this model (an adapter for \
                     another base model or another head?)",
                    file.display()
                )));
            };
            if let Some(shape) = shapes.get(internal).filter(|s| s.as_slice() != t.dims()) {
                return Err(Error::ShapeMismatch {
                    name: format!("{name} (in {})", file.display()),
                    expected: shape.clone(),
                    found: t.dims().to_vec(),
                });
            }
            tensors.push((internal.to_string(), t));
        }
        let have: BTreeSet<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
        if let Some(missing) = want.iter().find(|n| !have.contains(n.as_str())) {
            return Err(Error::MissingTensor {
                name: lora::peft_name(missing),
                location: file.display().to_string(),
            });
        }
        self.set_weights(&tensors)
    }

    /// A short hash that tells base models apart: the config's shape and samples of the
    /// embedding, the first and last layers and the final norm, rounded to bf16 first so the
    /// same base held in f32 or bf16 gives the same value.
    pub fn base_fingerprint(&self) -> Result<String> {
        if let Some(f) = &self.fingerprint {
            return Ok(f.clone());
        }
        self.fingerprint_from(|name, n| self.first_values(name, n))
    }

    /// The first (at most) `n` values of parameter `name`, flattened, if it is here.
    pub(crate) fn first_values(&self, name: &str, n: usize) -> Result<Option<Tensor>> {
        let Some(var) = self.params.get(name) else {
            return Ok(None);
        };
        let flat = var.as_tensor().detach().flatten_all()?;
        let n = flat.dim(0)?.min(n);
        Ok(Some(flat.narrow(0, 0, n)?))
    }

    /// [`Model::base_fingerprint`] over samples that `first` gives: the first (at most) `n`
    /// values of a parameter, flattened (`None`: the model has no such parameter).
    pub(crate) fn fingerprint_from(
        &self,
        mut first: impl FnMut(&str, usize) -> Result<Option<Tensor>>,
    ) -> Result<String> {
        let c = self.config();
        let mut h = rlhf_types::Checksum::new();
        for v in [
            c.vocab_size,
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.intermediate_size,
        ] {
            h.update_u64(v as u64);
        }
        let last = c.num_hidden_layers.saturating_sub(1);
        let names = [
            "model.embed_tokens.weight".to_string(),
            "model.layers.0.self_attn.q_proj.weight".to_string(),
            format!("model.layers.{last}.mlp.down_proj.weight"),
            "model.norm.weight".to_string(),
        ];
        for name in &names {
            let Some(sample) = first(name, 4096)? else {
                continue;
            };
            let sample = sample
                .to_dtype(DType::BF16)?
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?;
            h.update(name.as_bytes());
            for x in sample {
                h.update(&x.to_le_bytes());
            }
        }
        Ok(format!("{:016x}", h.finish()))
    }

    /// Every tensor of the model as a full HF model: each adapted weight becomes
    /// `W + s B A` and the adapters are gone. A full model's tensors unchanged.
    pub fn merged_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        if self.zero3().is_some() {
            return Err(Error::InvalidArgument(
                "merging the adapters of a model sharded with ZeRO stage 3: each rank holds \
                 pieces of the base only; merge the saved adapter onto its base instead \
                 (rlhf merge-lora)"
                    .into(),
            ));
        }
        let scale = self.lora().map(LoraConfig::scale).unwrap_or(1.0);
        let vars = self.params.vars();
        let get = |n: &str| {
            self.params
                .get(n)
                .map(|v| v.as_tensor().detach())
                .ok_or_else(|| Error::MissingTensor {
                    name: n.to_string(),
                    location: "this model's parameters".into(),
                })
        };
        let mut out = Vec::with_capacity(vars.len());
        for (name, var) in &vars {
            if lora::is_adapter_param(name) {
                continue;
            }
            let w = var.as_tensor().detach();
            let prefix = name.strip_suffix(".weight");
            let a_name = prefix.map(|p| format!("{p}.lora_A.weight"));
            let merged = match a_name.filter(|a| self.params.get(a).is_some()) {
                Some(a_name) => {
                    let b_name = a_name.replace(".lora_A.", ".lora_B.");
                    let pair = LoraPair {
                        a: get(&a_name)?,
                        b: get(&b_name)?,
                        scale,
                        switch: Default::default(),
                        dropout: 0.0,
                        id: 0,
                    };
                    pair.merged(&w)?
                }
                None => w.copy()?,
            };
            out.push((name.clone(), merged));
        }
        Ok(out)
    }

    /// The merged model ([`Model::merged_tensors`]) as an HF directory's image, in the
    /// base's dtype (a head kept in f32 is cast to it).
    pub fn merged_image(&self, tokenizer_dir: Option<&Path>) -> Result<ModelImage> {
        let dtype: DType = self.base_dtype();
        let tensors = self
            .merged_tensors()?
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_dtype(dtype)?)))
            .collect::<Result<Vec<_>>>()?;
        self.full_image(tensors, dtype, tokenizer_dir)
    }
}

/// A training pass of LoRA dropout ([`Model::dropout_pass`]); it ends when this drops.
pub struct DropoutPass<'a>(Option<&'a crate::lora::AdapterSwitch>);

impl Drop for DropoutPass<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.0 {
            s.set_dropout_seed(None);
        }
    }
}
