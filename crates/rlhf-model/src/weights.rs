//! Reading safetensors checkpoints (single file or sharded) and holding a model's parameters.
//!
//! Every parameter lives in a [`Var`] so that weights can be updated in place (optimizer steps,
//! weight sync). A trainable model computes with the `Var` itself; a frozen model computes with a
//! detached view of the same storage, so no autograd graph is ever built for it.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};

use crate::error::{read_json, Error, Result};

/// File name of a single-file checkpoint.
pub const SAFETENSORS_FILE: &str = "model.safetensors";
/// File name of the index of a sharded checkpoint.
pub const SAFETENSORS_INDEX_FILE: &str = "model.safetensors.index.json";

/// The safetensors files of one checkpoint, memory-mapped.
pub struct WeightFiles {
    st: MmapedSafetensors,
    location: String,
}

#[derive(serde::Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

impl WeightFiles {
    /// Opens `model.safetensors`, or the shards listed in `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join(SAFETENSORS_FILE);
        let index = dir.join(SAFETENSORS_INDEX_FILE);
        let (paths, location): (Vec<PathBuf>, String) = if single.is_file() {
            (vec![single.clone()], single.display().to_string())
        } else if index.is_file() {
            let idx: ShardIndex = read_json(&index)?;
            let mut shards: Vec<String> = idx.weight_map.values().cloned().collect();
            shards.sort();
            shards.dedup();
            let mut paths = Vec::with_capacity(shards.len());
            for shard in shards {
                let p = dir.join(&shard);
                if !p.is_file() {
                    return Err(Error::MissingFile {
                        path: p,
                        hint: format!("it is listed as a shard in {}", index.display()),
                    });
                }
                paths.push(p);
            }
            (paths, index.display().to_string())
        } else {
            let hint = if dir.join("pytorch_model.bin").exists() {
                "only safetensors checkpoints are supported; convert pytorch_model.bin with \
                 transformers' save_pretrained(safe_serialization=True)"
                    .to_string()
            } else {
                format!("expected {SAFETENSORS_FILE} or {SAFETENSORS_INDEX_FILE} in the model directory")
            };
            return Err(Error::MissingFile { path: single, hint });
        };
        // SAFETY: the files are mapped read-only and every tensor is copied out of the mapping
        // when loaded; the checkpoint must not be truncated by another process while we read it,
        // which is the usual contract for reading model files.
        let st = unsafe { MmapedSafetensors::multi(&paths)? };
        Ok(Self { st, location })
    }

    /// Names of all tensors in the checkpoint.
    pub fn names(&self) -> Vec<String> {
        self.st.tensors().into_iter().map(|(n, _)| n).collect()
    }

    /// Shape of a tensor, or None when absent.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.st.get(name).ok().map(|v| v.shape().to_vec())
    }

    /// Tensor `name`'s view in the mapped files.
    fn view(&self, name: &str) -> Result<safetensors::tensor::TensorView<'_>> {
        self.st.get(name).map_err(|_| Error::MissingTensor {
            name: name.to_string(),
            location: self.location.clone(),
        })
    }

    /// Checks that tensor `name` is there with shape `expected`.
    pub(crate) fn check_shape(&self, name: &str, expected: &[usize]) -> Result<()> {
        let found = self.view(name)?.shape().to_vec();
        if found != expected {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                expected: expected.to_vec(),
                found,
            });
        }
        Ok(())
    }

    /// Loads one tensor after checking its shape.
    pub fn load(&self, name: &str, expected: &[usize], device: &Device) -> Result<Tensor> {
        self.check_shape(name, expected)?;
        Ok(self.st.load(name, device)?)
    }

    /// An f32 tensor's values read straight out of the file (`None` when it is stored in
    /// another dtype): one copy, where [`WeightFiles::load`] and a trainable parameter made
    /// from it take two.
    fn load_f32(&self, name: &str, expected: &[usize]) -> Result<Option<Vec<f32>>> {
        self.check_shape(name, expected)?;
        let view = self.view(name)?;
        if view.dtype() != safetensors::Dtype::F32 {
            return Ok(None);
        }
        // safetensors checked the length against the shape and dtype.
        Ok(rlhf_types::f32s_from_le_bytes(view.data()))
    }

    /// The dtype tensor `name` is stored in, when it is one a model can hold.
    pub(crate) fn dtype(&self, name: &str) -> Result<DType> {
        let stored = self.view(name)?.dtype();
        DType::try_from(stored).map_err(|_| {
            Error::InvalidArgument(format!(
                "{name} in {} is stored as {stored:?}, which no model parameter can be",
                self.location
            ))
        })
    }

    /// Elements `range` of tensor `name` (flattened), read straight out of the mapped file
    /// into a 1-D host tensor in the file's dtype: a ZeRO-3 rank's piece, without the whole
    /// tensor ever being copied (only the pages of the range are read).
    pub(crate) fn read_range(&self, name: &str, range: Range<usize>) -> Result<Tensor> {
        let view = self.view(name)?;
        let dtype = self.dtype(name)?;
        let count: usize = view.shape().iter().product();
        if range.start > range.end || range.end > count {
            return Err(Error::InvalidArgument(format!(
                "{name} in {} has {count} values, not the range {range:?}",
                self.location
            )));
        }
        let size = dtype.size_in_bytes();
        let bytes = &view.data()[range.start * size..range.end * size];
        Ok(Tensor::from_raw_buffer(
            bytes,
            dtype,
            &[range.len()],
            &Device::Cpu,
        )?)
    }

    /// Where the weights come from, for messages.
    pub fn location(&self) -> &str {
        &self.location
    }
}

/// How a parameter absent from the checkpoint is initialised.
#[derive(Debug, Clone, Copy)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones (norm weights).
    Ones,
    /// Normal with mean 0 and the given standard deviation.
    Normal(f64),
    /// Uniform on `[-bound, bound]` (LoRA's A matrices, as PEFT's Kaiming-uniform init).
    Uniform(f64),
}

/// Named parameters of a model, in a stable order.
#[derive(Clone, Default)]
pub struct ParamStore {
    vars: BTreeMap<String, Var>,
    /// The frozen base of a LoRA model: never trained, synced or saved with the adapter.
    base: std::collections::BTreeSet<String>,
}

impl ParamStore {
    /// A ZeRO-3 model's pieces, each with whether it trains (those that do not are a LoRA
    /// model's frozen base).
    pub(crate) fn from_pieces(pieces: Vec<(String, Var, bool)>) -> Self {
        let mut store = Self::default();
        for (name, var, trains) in pieces {
            if !trains {
                store.base.insert(name.clone());
            }
            store.vars.insert(name, var);
        }
        store
    }

    /// All parameters, sorted by name.
    pub fn vars(&self) -> Vec<(String, Var)> {
        self.vars
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// The parameters that train, sync and save: all of them, except a LoRA model's frozen
    /// base (then: the adapters and any score head).
    pub fn train_vars(&self) -> Vec<(String, Var)> {
        self.vars
            .iter()
            .filter(|(k, _)| !self.base.contains(*k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Whether `name` belongs to a LoRA model's frozen base.
    pub fn is_base(&self, name: &str) -> bool {
        self.base.contains(name)
    }

    /// One parameter.
    pub fn get(&self, name: &str) -> Option<&Var> {
        self.vars.get(name)
    }

    /// Number of scalar parameters.
    pub fn num_params(&self) -> usize {
        self.vars.values().map(|v| v.elem_count()).sum()
    }
}

/// A parameter left in the checkpoint by a deferred build ([`ParamBuilder::defer_loading`]).
#[derive(Debug, Clone)]
pub(crate) struct Deferred {
    pub shape: Vec<usize>,
    /// Its name in the checkpoint (a value head may be stored under another).
    pub src: String,
    /// A LoRA model's frozen base parameter, and the dtype it is kept in.
    pub frozen: Option<DType>,
}

/// Builds the parameters of a model from a checkpoint or from a seeded random initialisation.
pub(crate) struct ParamBuilder<'a> {
    files: Option<&'a WeightFiles>,
    /// When deferred: the checkpoint's parameters, checked but not read, each standing in the
    /// model as an empty placeholder (a ZeRO-3 load reads only its pieces afterwards).
    deferred: Option<BTreeMap<String, Deferred>>,
    /// Whole tensors handed over in memory (a ZeRO-3 layer gathered from its shards): taken
    /// by name before anything else.
    given: Option<BTreeMap<String, Tensor>>,
    device: Device,
    dtype: DType,
    trainable: bool,
    /// While loading a LoRA model's base: its parameters' dtype (they are frozen).
    base: Option<DType>,
    store: ParamStore,
    rng: rand::rngs::StdRng,
}

impl<'a> ParamBuilder<'a> {
    pub fn new(
        files: Option<&'a WeightFiles>,
        device: &Device,
        dtype: DType,
        trainable: bool,
        seed: u64,
    ) -> Self {
        Self {
            files,
            deferred: None,
            given: None,
            device: device.clone(),
            dtype,
            trainable,
            base: None,
            store: ParamStore::default(),
            rng: rand::rngs::StdRng::seed_from_u64(seed),
        }
    }

    /// A builder that takes every parameter from `tensors` (all of them must be there, a
    /// LoRA adapter's too): a trainable one becomes a variable of its own, a frozen one is
    /// used as it is.
    pub fn from_tensors(
        tensors: BTreeMap<String, Tensor>,
        device: &Device,
        dtype: DType,
        trainable: bool,
    ) -> Self {
        let mut pb = Self::new(None, device, dtype, trainable, 0);
        pb.given = Some(tensors);
        pb
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// From now on, a parameter found in the checkpoint is only checked (present, its shape)
    /// and stands in the model as an empty placeholder; [`ParamBuilder::finish_deferred`]
    /// lists them. Parameters made here (a fresh value head) are built as usual.
    pub fn defer_loading(&mut self) {
        self.deferred = Some(BTreeMap::new());
    }

    /// Records `name` (stored as `src`) as deferred when loading is, returning its placeholder.
    fn defer(&mut self, name: &str, src: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        let (Some(deferred), Some(files)) = (self.deferred.as_mut(), self.files) else {
            return Ok(None);
        };
        files.check_shape(src, shape)?;
        deferred.insert(
            name.to_string(),
            Deferred {
                shape: shape.to_vec(),
                src: src.to_string(),
                frozen: self.base,
            },
        );
        Ok(Some(self.placeholder()?))
    }

    fn placeholder(&self) -> Result<Tensor> {
        Ok(Tensor::zeros(0, self.dtype(), &self.device)?)
    }

    /// From now on, parameters are a LoRA model's frozen base, kept in `dtype` (`Some`), or
    /// trainable as the builder was made (`None`). Returns the previous setting.
    pub fn set_base(&mut self, dtype: Option<DType>) -> Option<DType> {
        std::mem::replace(&mut self.base, dtype)
    }

    fn dtype(&self) -> DType {
        self.base.unwrap_or(self.dtype)
    }

    /// True when parameters come from a checkpoint (false for random models).
    pub fn has_checkpoint(&self) -> bool {
        self.files.is_some()
    }

    /// True when the checkpoint holds `name` (always false for random models).
    pub fn contains(&self, name: &str) -> bool {
        self.files.is_some_and(|f| f.shape(name).is_some())
    }

    /// Shape of `name` in the checkpoint.
    pub fn shape_in_checkpoint(&self, name: &str) -> Option<Vec<usize>> {
        self.files.and_then(|f| f.shape(name))
    }

    /// A parameter that must be in the checkpoint; random models initialise it with `init`.
    pub fn get(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        if let Some(given) = self.given.as_mut() {
            let t = given.remove(name).ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
                location: "the gathered parameters".to_string(),
            })?;
            if t.dims() != shape {
                return Err(Error::ShapeMismatch {
                    name: name.to_string(),
                    expected: shape.to_vec(),
                    found: t.dims().to_vec(),
                });
            }
            if !(self.trainable && self.base.is_none()) {
                return Ok(t);
            }
            return self.register(name, t);
        }
        if let Some(placeholder) = self.defer(name, name, shape)? {
            return Ok(placeholder);
        }
        // An f32 parameter trained on the CPU becomes its variable with a single copy out of
        // the file: the usual path makes a tensor and then the variable from it, and the
        // freed first copies stay in the process's heap.
        if let Some(files) = self.files {
            if self.device.is_cpu() && self.dtype() == DType::F32 {
                if let Some(data) = files.load_f32(name, shape)? {
                    let var = Var::from_vec(data, shape, &self.device)?;
                    return Ok(self.register_var(name, var));
                }
            }
        }
        let t = match self.files {
            Some(files) => files
                .load(name, shape, &self.device)?
                .to_dtype(self.dtype())?,
            None => self.random(shape, init)?,
        };
        self.register(name, t)
    }

    /// A freshly initialised parameter, even when the checkpoint has one of that name.
    pub fn fresh(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        if self.given.is_some() {
            return self.get(name, shape, init);
        }
        let t = self.random(shape, init)?;
        self.register(name, t)
    }

    /// A parameter loaded from `src_name` but stored (and later saved) as `name`.
    pub fn get_renamed(&mut self, name: &str, src_name: &str, shape: &[usize]) -> Result<Tensor> {
        let files = self.files.ok_or_else(|| Error::MissingTensor {
            name: src_name.to_string(),
            location: "a randomly initialised model".to_string(),
        })?;
        if let Some(placeholder) = self.defer(name, src_name, shape)? {
            return Ok(placeholder);
        }
        let t = files
            .load(src_name, shape, &self.device)?
            .to_dtype(self.dtype())?;
        self.register(name, t)
    }

    /// The tensor the model computes with for an already registered parameter (tied weights).
    pub fn shared(&self, name: &str) -> Option<Tensor> {
        if self.deferred.as_ref().is_some_and(|d| d.contains_key(name)) {
            return self.placeholder().ok();
        }
        let var = self.store.vars.get(name)?;
        Some(if self.store.base.contains(name) {
            var.as_tensor().detach()
        } else {
            self.view(var)
        })
    }

    fn view(&self, var: &Var) -> Tensor {
        if self.trainable && self.base.is_none() {
            var.as_tensor().clone()
        } else {
            var.as_tensor().detach()
        }
    }

    fn register(&mut self, name: &str, t: Tensor) -> Result<Tensor> {
        let var = Var::from_tensor(&t.contiguous()?)?;
        Ok(self.register_var(name, var))
    }

    fn register_var(&mut self, name: &str, var: Var) -> Tensor {
        let view = self.view(&var);
        if self.base.is_some() {
            self.store.base.insert(name.to_string());
        }
        self.store.vars.insert(name.to_string(), var);
        view
    }

    fn random(&mut self, shape: &[usize], init: Init) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = match init {
            Init::Zeros => vec![0.0; n],
            Init::Ones => vec![1.0; n],
            Init::Normal(std) => {
                // Box-Muller gives two independent normals per pair of uniforms.
                let mut v = Vec::with_capacity(n + 1);
                while v.len() < n {
                    let (a, b) = normal_pair(&mut self.rng);
                    v.push((a * std) as f32);
                    v.push((b * std) as f32);
                }
                v.truncate(n);
                v
            }
            Init::Uniform(bound) => (0..n)
                .map(|_| ((self.rng.random::<f64>() * 2.0 - 1.0) * bound) as f32)
                .collect(),
        };
        Ok(Tensor::from_vec(data, shape, &self.device)?.to_dtype(self.dtype())?)
    }

    /// The parameters built, and those deferred ([`ParamBuilder::defer_loading`]) by name.
    pub fn finish_deferred(self) -> (ParamStore, BTreeMap<String, Deferred>) {
        (self.store, self.deferred.unwrap_or_default())
    }
}

/// Two independent standard normal samples (Box-Muller); avoids a dependency for one
/// distribution.
pub(crate) fn normal_pair(rng: &mut impl Rng) -> (f64, f64) {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random::<f64>();
    let r = (-2.0 * u1.ln()).sqrt();
    let (s, c) = (2.0 * std::f64::consts::PI * u2).sin_cos();
    (r * c, r * s)
}

/// Writes named tensors to one safetensors file with `{"format": "pt"}` metadata, which
/// transformers expects.
pub fn save_safetensors(tensors: &[(String, Tensor)], path: &Path) -> Result<()> {
    save_safetensors_with_metadata(tensors, &[], path)
}

/// As [`save_safetensors`], with extra string metadata in the header.
pub fn save_safetensors_with_metadata(
    tensors: &[(String, Tensor)],
    metadata: &[(&str, String)],
    path: &Path,
) -> Result<()> {
    let mut map = std::collections::HashMap::new();
    for (name, t) in tensors {
        map.insert(name.clone(), t.contiguous()?);
    }
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    for (k, v) in metadata {
        meta.insert((*k).to_string(), v.clone());
    }
    safetensors::serialize_to_file(&map, Some(meta), path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    })
}

/// Named tensors (sorted by name) and header metadata of a safetensors file.
pub type SafetensorsContent = (
    Vec<(String, Tensor)>,
    std::collections::HashMap<String, String>,
);

/// Reads every tensor and the header metadata of one safetensors file.
pub fn load_safetensors(path: &Path, device: &Device) -> Result<SafetensorsContent> {
    let data = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let bad = |e: safetensors::SafeTensorError| Error::Json {
        path: path.to_path_buf(),
        message: format!("not a safetensors file: {e}"),
    };
    let (_, meta) = safetensors::SafeTensors::read_metadata(&data).map_err(bad)?;
    let meta = meta.metadata().clone().unwrap_or_default();
    let mut tensors: Vec<(String, Tensor)> = candle_core::safetensors::load_buffer(&data, device)?
        .into_iter()
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((tensors, meta))
}
