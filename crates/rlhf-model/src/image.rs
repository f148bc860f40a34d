//! A model's HF directory (or a LoRA model's PEFT adapter) captured at one instant, so a
//! checkpoint can be written by another thread while the next optimizer steps change the
//! live parameters: [`Model::image`] captures it, [`ModelImage::write`] writes it. A ZeRO-3
//! model's weights can instead be written to a file as its group gathers them
//! ([`Model::image_streamed`]), which the image then moves into place.

use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::model::{write_json, Head, Model, ModelKind};
use crate::weights::save_safetensors;

/// An HF model directory's content at one instant ([`Model::image`]).
pub struct ModelImage {
    pub(crate) kind: ImageKind,
    /// Copies, in parameter order.
    pub tensors: Vec<(String, Tensor)>,
    pub(crate) tokenizer_dir: Option<PathBuf>,
    /// The model's safetensors file, already written ([`Model::image_streamed`]): moved into
    /// the directory instead of `tensors` (then empty).
    pub(crate) written: Option<PathBuf>,
}

/// What an image is written as.
pub(crate) enum ImageKind {
    /// A model: config.json, model.safetensors and generation_config.json.
    Model { config: Value, generation: Value },
    /// A LoRA model's PEFT adapter: its `adapter_config.json` and the fingerprint of the base
    /// it was trained on (header metadata of adapter_model.safetensors).
    Adapter {
        config: Value,
        base_fingerprint: String,
    },
}

impl ModelImage {
    /// Writes config.json, model.safetensors, generation_config.json and the tokenizer files;
    /// for a LoRA model, adapter_config.json and adapter_model.safetensors (PEFT's names).
    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        match &self.kind {
            ImageKind::Model { config, generation } => {
                write_json(&dir.join("config.json"), config)?;
                let file = dir.join(crate::weights::SAFETENSORS_FILE);
                match &self.written {
                    Some(src) => move_file(src, &file)?,
                    None => save_safetensors(&self.tensors, &file)?,
                }
                write_json(&dir.join("generation_config.json"), generation)?;
            }
            ImageKind::Adapter {
                config,
                base_fingerprint,
            } => {
                write_json(&dir.join(crate::lora::ADAPTER_CONFIG_FILE), config)?;
                let named: Vec<(String, Tensor)> = self
                    .tensors
                    .iter()
                    .map(|(n, t)| (crate::lora::peft_name(n), t.clone()))
                    .collect();
                crate::weights::save_safetensors_with_metadata(
                    &named,
                    &[(crate::lora::BASE_FINGERPRINT_KEY, base_fingerprint.clone())],
                    &dir.join(crate::lora::ADAPTER_WEIGHTS_FILE),
                )?;
            }
        }
        if let Some(src) = &self.tokenizer_dir {
            crate::tokenizer::copy_tokenizer_files(src, dir)?;
        }
        Ok(())
    }
}

impl Model {
    /// What [`Model::save`] writes, captured now: the tensors are copied, so the image does
    /// not follow later optimizer steps and can be written by another thread while training
    /// goes on. A LoRA model's image is its PEFT adapter (`adapter_config.json`,
    /// `adapter_model.safetensors`); [`Model::merged_image`] is the full merged model.
    pub fn image(&self, tokenizer_dir: Option<&Path>) -> Result<ModelImage> {
        // A ZeRO-3 model's parameters are gathered from the group into host memory (fresh
        // tensors already; the device never holds the whole model).
        let tensors = match self.zero3() {
            Some(z) => z.gather_all_host()?,
            None => self
                .named_tensors()
                .into_iter()
                .map(|(n, t)| Ok((n, t.copy()?)))
                .collect::<Result<Vec<_>>>()?,
        };
        if let Some((cfg, _)) = &self.lora {
            let base = self.source_dir.as_ref().map(|d| d.display().to_string());
            return Ok(ModelImage {
                kind: ImageKind::Adapter {
                    config: cfg.to_peft_json(self.kind, base.as_deref()),
                    base_fingerprint: self.base_fingerprint()?,
                },
                tensors,
                tokenizer_dir: tokenizer_dir.map(Path::to_path_buf),
                written: None,
            });
        }
        self.full_image(tensors, self.dtype(), tokenizer_dir)
    }

    /// [`Model::image`] of a ZeRO-3 model, its weights written to `file` as the group gathers
    /// them (a collective: the other ranks take part with
    /// [`crate::zero3::Zero3::gather_all_for_others`]), so this rank holds one layer at a
    /// time, not the whole model; the image moves `file` into the directory it writes.
    /// Returns the image and the checksum of the weights written
    /// ([`rlhf_collective::checksum`] of them as `f32`, in name order). A model with LoRA
    /// adapters (whose image is its adapters) or one not sharded is refused.
    pub fn image_streamed(
        &self,
        tokenizer_dir: Option<&Path>,
        file: &Path,
    ) -> Result<(ModelImage, u64)> {
        let z = match (self.zero3(), &self.lora) {
            (Some(z), None) => z,
            _ => {
                return Err(Error::InvalidArgument(
                    "a streamed image is of a ZeRO-3 model without LoRA adapters".into(),
                ))
            }
        };
        let list = z.param_shapes()?;
        let mut hash = rlhf_collective::ChecksumStream::new(list.len());
        // A failed write stops the writing, not the gathers: the other ranks are in them.
        let mut failed = None;
        let mut out = crate::SafetensorsWriter::create(file, list, &[])
            .map_err(|e| failed = Some(e))
            .ok();
        z.gather_each_host(|name, t| {
            let Some(w) = out.as_mut() else {
                return Ok(());
            };
            let written = crate::zero3::hash_param(&mut hash, &name, &t)
                .and_then(|data| w.push_f32(&name, &data));
            if let Err(e) = written {
                failed = Some(e);
                out = None;
            }
            Ok(())
        })?;
        match (failed, out) {
            (Some(e), _) => return Err(e),
            (None, Some(w)) => w.finish()?,
            (None, None) => {
                return Err(Error::InvalidArgument(
                    "the streamed image lost its file".into(),
                ))
            }
        }
        let sum = hash
            .finish()
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let mut image = self.full_image(Vec::new(), self.dtype(), tokenizer_dir)?;
        image.written = Some(file.to_path_buf());
        Ok((image, sum))
    }

    /// An HF model directory's image holding `tensors` (HF names, all in `dtype`).
    pub(crate) fn full_image(
        &self,
        tensors: Vec<(String, Tensor)>,
        dtype: DType,
        tokenizer_dir: Option<&Path>,
    ) -> Result<ModelImage> {
        let dtype_name = match dtype {
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F64 => "float64",
            _ => "float32",
        };
        let mut extra: Vec<(&str, Value)> = vec![("torch_dtype", json!(dtype_name))];
        if let Head::Score(h) = &self.head {
            // The saved head's rows (a ZeRO-3 model's own head is an empty placeholder).
            let sharded = match self.zero3() {
                Some(z) => z.param_shapes()?,
                None => Vec::new(),
            };
            let n = match tensors.iter().find(|(name, _)| name == "score.weight") {
                Some((_, w)) => w.dim(0)?,
                None => match sharded.iter().find(|(name, _)| name == "score.weight") {
                    Some((_, shape)) => shape.first().copied().unwrap_or(0),
                    None => h.w.dim(0)?,
                },
            };
            extra.push(("num_labels", json!(n)));
            extra.push(("id2label", labels_map(n, false)));
            extra.push(("label2id", labels_map(n, true)));
        }
        if self.kind == ModelKind::Value {
            extra.push(("num_labels", json!(1)));
            extra.push(("id2label", labels_map(1, false)));
            extra.push(("label2id", labels_map(1, true)));
        }
        if let Some(pad) = self.generation.pad_token_id {
            if self.config.pad_token_id.is_none() && self.kind != ModelKind::CausalLm {
                // Sequence classification in transformers needs pad_token_id to find the last token.
                extra.push(("pad_token_id", json!(pad)));
            }
        }
        Ok(ModelImage {
            kind: ImageKind::Model {
                config: self.config.to_json(&self.architecture(), &extra),
                generation: match &self.generation_raw {
                    Some(v) => v.clone(),
                    None => self.generation.to_hf_json(),
                },
            },
            tensors,
            tokenizer_dir: tokenizer_dir.map(Path::to_path_buf),
            written: None,
        })
    }
}

/// Moves `src` to `dst`: a rename, or a copy across file systems.
fn move_file(src: &Path, dst: &Path) -> Result<()> {
    let failed = |e: std::io::Error| {
        Error::InvalidArgument(format!(
            "moving {} to {}: {e}",
            src.display(),
            dst.display()
        ))
    };
    match std::fs::rename(src, dst) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::CrossesDevices => {
            std::fs::copy(src, dst).map_err(failed)?;
            std::fs::remove_file(src).map_err(failed)
        }
        Err(e) => Err(failed(e)),
    }
}

fn labels_map(n: usize, inverse: bool) -> Value {
    let mut m = serde_json::Map::new();
    for i in 0..n {
        if inverse {
            m.insert(format!("LABEL_{i}"), json!(i));
        } else {
            m.insert(i.to_string(), json!(format!("LABEL_{i}")));
        }
    }
    Value::Object(m)
}
