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
}

impl ModelImage {
    /// Writes config.json, model.safetensors, generation_config.json and the tokenizer files.
    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        write_json(&dir.join("config.json"), &self.config)?;
        save_safetensors(&self.tensors, &dir.join(crate::weights::SAFETENSORS_FILE))?;
        write_json(&dir.join("generation_config.json"), &self.generation)?;
        if let Some(src) = &self.tokenizer_dir {
            crate::tokenizer::copy_tokenizer_files(src, dir)?;
        }
        Ok(())
    }
}
