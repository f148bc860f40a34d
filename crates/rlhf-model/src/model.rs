//! A decoder plus one head: causal LM (policy, reference), value (critic) or score (reward).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use serde_json::Value;

use crate::config::Config;
use crate::error::{read_json, Error, Result};
use crate::gen_config::GenerationConfig;
pub use crate::image::ModelImage;
pub use crate::load::{Batch, LoadOptions, ModelKind, ValueHeadInit};
use crate::lora::AdapterSwitch;
use crate::transformer::{Kernels, Linear, LoraSetup, Transformer};
use crate::weights::{Deferred, Init, ParamBuilder, ParamStore, WeightFiles};

mod outputs;

#[derive(Debug, Clone)]
pub(crate) enum Head {
    Lm(Tensor),
    Value(Linear),
    Score(Linear),
}

/// A loaded model: decoder, head and its parameters.
pub struct Model {
    pub(crate) config: Config,
    pub(crate) kind: ModelKind,
    pub(crate) body: Transformer,
    pub(crate) head: Head,
    pub(crate) params: ParamStore,
    trainable: bool,
    /// The dtype the trained parameters are kept in (a LoRA base may be in another).
    dtype: DType,
    pub(crate) lora: Option<LoraSetup>,
    logits_chunk: Option<usize>,
    pub(crate) generation: GenerationConfig,
    pub(crate) source_dir: Option<PathBuf>,
    pub(crate) generation_raw: Option<Value>,
    /// A sharded LoRA model's [`Model::base_fingerprint`], taken from the whole base before
    /// it was cut into pieces (ZeRO stage 3).
    pub(crate) fingerprint: Option<String>,
}

/// Names of known value-head tensors, in order of preference: (weight, bias).
const VALUE_HEAD_NAMES: &[(&str, &str)] = &[
    ("score.weight", "score.bias"),
    ("v_head.summary.weight", "v_head.summary.bias"),
    ("value_head.weight", "value_head.bias"),
];

fn num_labels(cfg: &Config) -> Option<usize> {
    let raw = &cfg.raw;
    raw.get("num_labels")
        .and_then(Value::as_u64)
        .map(|n| n as usize)
        .or_else(|| {
            raw.get("id2label")
                .and_then(Value::as_object)
                .map(|m| m.len())
        })
}

impl Model {
    /// Loads an HF model directory (config.json, safetensors weights, optional
    /// generation_config.json).
    pub fn load(dir: impl AsRef<Path>, opts: &LoadOptions) -> Result<Self> {
        let dir = dir.as_ref();
        let (config, files, generation_raw) = Self::open_dir(dir)?;
        let model = Self::build(&config, Some(&files), opts)?;
        Ok(model.with_source(dir, generation_raw))
    }

    /// An HF model directory's config, its weight files (mapped, not read) and its
    /// generation config.
    pub(crate) fn open_dir(dir: &Path) -> Result<(Config, WeightFiles, Option<Value>)> {
        if !dir.is_dir() {
            return Err(Error::MissingFile {
                path: dir.to_path_buf(),
                hint: "the model directory does not exist".to_string(),
            });
        }
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(Error::MissingFile {
                path: config_path,
                hint: "an HF model directory needs config.json".to_string(),
            });
        }
        let raw: Value = read_json(&config_path)?;
        let config = Config::from_json(&raw)?;
        let files = WeightFiles::open(dir)?;
        let gen_path = dir.join("generation_config.json");
        let generation_raw: Option<Value> = if gen_path.is_file() {
            Some(read_json(&gen_path)?)
        } else {
            None
        };
        Ok((config, files, generation_raw))
    }

    /// This model as loaded from `dir`, with the generation config found there.
    pub(crate) fn with_source(mut self, dir: &Path, generation_raw: Option<Value>) -> Self {
        self.generation = GenerationConfig::from_hf(&self.config, generation_raw.as_ref());
        self.generation_raw = generation_raw;
        self.source_dir = Some(dir.to_path_buf());
        self
    }

    /// A model with seeded random weights (normal(0, 0.02), unit norms): tests and benchmarks.
    pub fn random(config: &Config, opts: &LoadOptions) -> Result<Self> {
        let mut model = Self::build(config, None, opts)?;
        model.generation = GenerationConfig::from_hf(config, None);
        Ok(model)
    }

    fn build(config: &Config, files: Option<&WeightFiles>, opts: &LoadOptions) -> Result<Self> {
        Ok(Self::build_in(config, files, opts, false)?.0)
    }

    /// [`Model::build`]; with `defer`, the parameters found in `files` are only checked and
    /// left there, each an empty placeholder in the model, and returned by name (a ZeRO-3
    /// load reads its pieces of them: [`Model::load_zero3`]).
    pub(crate) fn build_in(
        config: &Config,
        files: Option<&WeightFiles>,
        opts: &LoadOptions,
        defer: bool,
    ) -> Result<(Self, BTreeMap<String, Deferred>)> {
        let fast = opts.fast.unwrap_or(!opts.trainable);
        if fast && opts.trainable {
            return Err(Error::InvalidArgument(
                "a trainable model cannot use the fused kernels (they have no backward pass and \
                 would silently drop gradients); leave `fast` unset or false"
                    .to_string(),
            ));
        }
        let compute = opts.compute();
        if !compute.is_float() || !opts.dtype.is_float() {
            return Err(Error::InvalidArgument(format!(
                "models compute in a floating-point dtype (f32, bf16, f16, f64), not {:?}",
                compute
            )));
        }
        if opts.gradient_checkpointing && !opts.trainable {
            return Err(Error::InvalidArgument(
                "gradient checkpointing is for trainable models; a frozen model keeps no \
                 activations for backward"
                    .to_string(),
            ));
        }
        if opts.logits_chunk == Some(0) {
            return Err(Error::InvalidArgument(
                "logits_chunk must be at least 1 token (or unset for no chunking)".to_string(),
            ));
        }
        let kernels = Kernels::choose(&opts.device, compute, fast, opts.composite_ops);
        let mut pb = ParamBuilder::new(files, &opts.device, opts.dtype, opts.trainable, opts.seed);
        if defer {
            pb.defer_loading();
        }
        let lora: Option<LoraSetup> = match &opts.lora {
            Some(cfg) => {
                cfg.validate()?;
                // The frozen base needs no f32 master copy: it is kept in the compute dtype.
                pb.set_base(Some(compute));
                Some((cfg.clone(), AdapterSwitch::default()))
            }
            None => None,
        };
        let body = Transformer::load(
            config,
            &mut pb,
            (kernels, opts.composite_ops),
            compute,
            opts.gradient_checkpointing,
            lora.as_ref(),
        )?;
        let h = config.hidden_size;
        let head = match opts.kind {
            ModelKind::CausalLm => {
                if config.tie_word_embeddings {
                    let w = pb.shared("model.embed_tokens.weight").ok_or_else(|| {
                        Error::Config("tied embeddings need model.embed_tokens.weight".into())
                    })?;
                    Head::Lm(w)
                } else {
                    Head::Lm(pb.get(
                        "lm_head.weight",
                        &[config.vocab_size, h],
                        Init::Normal(0.02),
                    )?)
                }
            }
            ModelKind::Value => {
                // A head trains in full even on a LoRA model (PEFT's modules_to_save).
                pb.set_base(None);
                Head::Value(Self::value_head(&mut pb, h, opts)?)
            }
            ModelKind::Reward => {
                pb.set_base(None);
                let labels = pb
                    .shape_in_checkpoint("score.weight")
                    .and_then(|s| s.first().copied())
                    .or_else(|| num_labels(config))
                    .unwrap_or(1);
                // Training a reward model from a causal LM (TRL's `RewardTrainer` over an SFT
                // model): the score head starts fresh, as transformers initialises it; a
                // frozen reward model must have one.
                let w = if opts.trainable && !pb.contains("score.weight") {
                    pb.fresh("score.weight", &[1, h], Init::Normal(0.02))?
                } else {
                    pb.get("score.weight", &[labels, h], Init::Normal(0.02))?
                };
                Head::Score(Linear::plain(w, None))
            }
        };
        let (params, deferred) = pb.finish_deferred();
        let model = Self {
            config: config.clone(),
            kind: opts.kind,
            body,
            head,
            params,
            trainable: opts.trainable,
            dtype: opts.dtype,
            lora,
            logits_chunk: opts.logits_chunk,
            generation: GenerationConfig::default(),
            source_dir: None,
            generation_raw: None,
            fingerprint: None,
        };
        Ok((model, deferred))
    }

    fn value_head(pb: &mut ParamBuilder, h: usize, opts: &LoadOptions) -> Result<Linear> {
        let found = VALUE_HEAD_NAMES
            .iter()
            .find(|(w, _)| pb.contains(w))
            .copied();
        let fresh_std = match opts.value_head_init {
            ValueHeadInit::Fresh { std } => Some(std),
            ValueHeadInit::Auto if found.is_none() => Some(0.0),
            ValueHeadInit::FromCheckpoint if found.is_none() => {
                return Err(Error::MissingTensor {
                    name: "score.weight (or v_head.summary.weight / value_head.weight)"
                        .to_string(),
                    location: "the checkpoint; a critic initialised from a checkpoint needs a reward model's score head".to_string(),
                })
            }
            _ => None,
        };
        if let Some(std) = fresh_std {
            // A zero head would give zero gradients to the whole body on the first step, so
            // `Auto` uses a small random head instead.
            let std = if std > 0.0 {
                std
            } else {
                1.0 / (h as f64).sqrt() * 0.1
            };
            let w = pb.fresh("score.weight", &[1, h], Init::Normal(std))?;
            let b = pb.fresh("score.bias", &[1], Init::Zeros)?;
            return Ok(Linear::plain(w, Some(b)));
        }
        let (wn, bn) = found.ok_or_else(|| Error::MissingTensor {
            name: "score.weight".to_string(),
            location: "the checkpoint".to_string(),
        })?;
        let shape = pb.shape_in_checkpoint(wn).unwrap_or_default();
        if shape.first().copied() != Some(1) {
            return Err(Error::ShapeMismatch {
                name: wn.to_string(),
                expected: vec![1, h],
                found: shape,
            });
        }
        let w = pb.get_renamed("score.weight", wn, &[1, h])?;
        // Train exactly what the checkpoint defines: a reward model's score head has no bias
        // (`*ForSequenceClassification`, TRL's value model), and a zero bias added here would
        // be moved by the optimizer and saved as a parameter the source never had.
        let b = if pb.contains(bn) {
            Some(pb.get_renamed("score.bias", bn, &[1])?)
        } else {
            None
        };
        Ok(Linear::plain(w, b))
    }

    /// Decoder config.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Head kind.
    pub fn kind(&self) -> ModelKind {
        self.kind
    }

    /// Which op implementations the forward uses.
    pub fn kernels(&self) -> Kernels {
        self.body.kernels()
    }

    /// Whether the forward builds an autograd graph over the parameters.
    pub fn is_trainable(&self) -> bool {
        self.trainable
    }

    pub fn device(&self) -> &Device {
        self.body.embed_tokens().device()
    }

    /// The dtype the trained parameters are kept (and saved) in; a LoRA model's frozen base
    /// is kept in the compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dtype of the decoder's weights (a LoRA model's frozen base: the compute dtype).
    pub(crate) fn base_dtype(&self) -> DType {
        self.body.embed_tokens().dtype()
    }

    /// The dtype activations are computed in (bf16 under mixed precision over f32 weights).
    pub fn compute_dtype(&self) -> DType {
        self.body.compute_dtype()
    }

    /// Generation defaults from generation_config.json and config.json.
    pub fn generation_config(&self) -> &GenerationConfig {
        &self.generation
    }

    /// Directory the model was loaded from, if any.
    pub fn source_dir(&self) -> Option<&Path> {
        self.source_dir.as_deref()
    }

    /// The parameters that train, sync and save, by HF name (a trainable model's are the
    /// optimizer's variables): every parameter of a full model; the adapters (and a value or
    /// score head) of a LoRA model, whose frozen base is in [`Model::params`] only.
    pub fn vars(&self) -> Vec<(String, Var)> {
        self.params.train_vars()
    }

    /// Parameter store.
    pub fn params(&self) -> &ParamStore {
        &self.params
    }

    /// Overwrites parameters in place (weight sync); every name must exist with the same shape.
    /// A ZeRO-3 model keeps this rank's piece of each.
    pub fn set_weights(&self, weights: &[(String, Tensor)]) -> Result<()> {
        if let Some(z) = self.zero3() {
            for (name, t) in weights {
                z.set_whole(name, t)?;
            }
            return Ok(());
        }
        let vars = self.vars();
        for (name, t) in weights {
            let var = vars
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v)
                .ok_or_else(|| Error::MissingTensor {
                    name: name.clone(),
                    location: "this model's parameters".to_string(),
                })?;
            if var.dims() != t.dims() {
                return Err(Error::ShapeMismatch {
                    name: name.clone(),
                    expected: var.dims().to_vec(),
                    found: t.dims().to_vec(),
                });
            }
            var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
        }
        Ok(())
    }

    /// HF architecture written on save.
    pub fn architecture(&self) -> String {
        let p = self.config.family.class_prefix();
        match self.kind {
            ModelKind::CausalLm => format!("{p}ForCausalLM"),
            // A value head with a bias is saved as HF's token classifier (`score.weight` and
            // `score.bias`); one without is TRL's value model layout, a sequence classifier
            // whose `score` has no bias. Both load back as a critic.
            ModelKind::Value => match &self.head {
                Head::Value(Linear { b: None, .. }) => format!("{p}ForSequenceClassification"),
                _ => format!("{p}ForTokenClassification"),
            },
            ModelKind::Reward => format!("{p}ForSequenceClassification"),
        }
    }

    /// Tensors under their HF names, as saved. They share storage with the parameters (no
    /// copy), so they follow later optimizer steps; `copy()` them to keep a snapshot.
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        self.vars()
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().detach()))
            .collect()
    }

    /// Saves an HF directory: config.json, model.safetensors, generation_config.json and, when
    /// `tokenizer_dir` is given, its tokenizer files.
    ///
    /// A ZeRO-3 model gathers its parameters: every rank of the group must call this, and
    /// rank 0 writes.
    pub fn save(&self, dir: impl AsRef<Path>, tokenizer_dir: Option<&Path>) -> Result<()> {
        let image = self.image(tokenizer_dir)?;
        if self.zero3().is_some_and(|z| z.rank_world().0 != 0) {
            return Ok(());
        }
        image.write(dir.as_ref())
    }
}

pub(crate) fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}
