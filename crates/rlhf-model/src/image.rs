//! A model's HF directory captured at one instant, so a checkpoint can be written by another
//! thread while the next optimizer steps change the live parameters.

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::model::write_json;
use crate::weights::save_safetensors;

/// An HF model directory's content at one instant ([`Model::image`]).
pub struct ModelImage {
    pub(crate) config: Value,
    pub(crate) generation: Value,
    /// Copies, in parameter order.
    pub tensors: Vec<(String, Tensor)>,
    pub(crate) tokenizer_dir: Option<PathBuf>,
    /// A LoRA model's `adapter_config.json` and its base's fingerprint: the image is a PEFT
    /// adapter, not a model.
    pub(crate) adapter: Option<(Value, String)>,
}

impl ModelImage {
    /// Writes config.json, model.safetensors, generation_config.json and the tokenizer files;
    /// for a LoRA model, adapter_config.json and adapter_model.safetensors (PEFT's names).
    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        if let Some((adapter, fingerprint)) = &self.adapter {
            write_json(&dir.join(crate::lora::ADAPTER_CONFIG_FILE), adapter)?;
            let named: Vec<(String, Tensor)> = self
                .tensors
                .iter()
                .map(|(n, t)| (crate::lora::peft_name(n), t.clone()))
                .collect();
            crate::weights::save_safetensors_with_metadata(
                &named,
                &[(crate::lora::BASE_FINGERPRINT_KEY, fingerprint.clone())],
                &dir.join(crate::lora::ADAPTER_WEIGHTS_FILE),
            )?;
        } else {
            self.write_model(dir)?;
        }
        if let Some(src) = &self.tokenizer_dir {
            crate::tokenizer::copy_tokenizer_files(src, dir)?;
        }
        Ok(())
    }

    /// Whether this is a LoRA adapter's image.
    pub fn is_adapter(&self) -> bool {
        self.adapter.is_some()
    }

    fn write_model(&self, dir: &Path) -> Result<()> {
        write_json(&dir.join("config.json"), &self.config)?;
        save_safetensors(&self.tensors, &dir.join(crate::weights::SAFETENSORS_FILE))?;
        write_json(&dir.join("generation_config.json"), &self.generation)
    }
}
