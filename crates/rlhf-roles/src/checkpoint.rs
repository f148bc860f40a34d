//! A trainable engine's checkpoint: an HF model directory (a PEFT adapter directory for a
//! LoRA engine) plus `optimizer.safetensors`,
//! `role_state.json` (scheduler position, weights version) and `manifest.json` (every file's
//! size and content hash). It is written beside the target and moved into place in one
//! rename once every file is on disk (`rlhf_core::durable`), and verified against its
//! manifest before anything is loaded. Saving is two parts: [`capture`] copies the state
//! out on the compute thread, [`Image::write`] writes it, in the background when the driver
//! asks for it (`crate::saves`).

use std::path::Path;

use candle_core::Tensor;
use rlhf_core::durable;
use rlhf_model::Model;
use serde::{Deserialize, Serialize};

use crate::error::{Ctx, Error, Result};
use crate::train::Optim;

/// `role_state.json` of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoleState {
    pub role: rlhf_core::RoleKind,
    /// Optimizer steps taken = the scheduler position.
    pub scheduler_step: u64,
    pub weights_version: u64,
}

pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const ROLE_STATE_FILE: &str = "role_state.json";

/// A trainable engine's checkpoint captured at one instant ([`capture`]): copies, so another
/// thread can write it ([`Image::write`]) while the engine trains on.
pub struct Image {
    model: rlhf_model::ModelImage,
    optim: (Vec<(String, Tensor)>, usize),
    state: RoleState,
}

/// Copies the weights and the role state out of the engine, with the optimizer state
/// (already a copy: [`rlhf_model::AdamW::state`], or a sharded group's gathered state).
pub fn capture(
    model: &Model,
    optim: (Vec<(String, Tensor)>, usize),
    state: RoleState,
    tokenizer_dir: Option<&Path>,
) -> Result<Image> {
    let tok = tokenizer_dir.filter(|d| d.join("tokenizer.json").is_file());
    Ok(Image {
        model: model.image(tok).ctx("copying the weights out")?,
        optim,
        state,
    })
}

impl Image {
    /// The weights' checksum, as [`crate::weights::weights_checksum`] computes it on the
    /// live model at the instant of the capture.
    pub fn checksum(&self) -> Result<u64> {
        crate::weights::tensors_checksum(&self.model.tensors)
    }

    /// Writes an HF model directory plus the optimizer state and `role_state.json`, beside
    /// `dir` first and then moved into place; returns the files written.
    pub fn write(&self, dir: &Path) -> Result<Vec<String>> {
        let staging = durable::staging_dir(dir);
        if staging.exists() {
            // What an interrupted save left behind.
            std::fs::remove_dir_all(&staging)
                .map_err(|e| Error::internal(format!("removing {}: {e}", staging.display())))?;
        }
        self.model
            .write(&staging)
            .with_ctx(|| format!("saving the model to {}", staging.display()))?;
        let (tensors, step) = &self.optim;
        rlhf_model::AdamW::write_state(tensors, *step, &staging.join(OPTIMIZER_FILE))
            .with_ctx(|| format!("saving the optimizer state to {}", staging.display()))?;
        let text = serde_json::to_string_pretty(&self.state)
            .map_err(|e| Error::internal(format!("encoding role_state.json: {e}")))?;
        let path = staging.join(ROLE_STATE_FILE);
        std::fs::write(&path, text + "\n")
            .map_err(|e| Error::internal(format!("writing {}: {e}", path.display())))?;
        let manifest = durable::publish_dir(dir)?;
        let mut files: Vec<String> = manifest.files.into_keys().collect();
        files.push(durable::MANIFEST_FILE.to_string());
        files.sort();
        Ok(files)
    }
}

/// Loads weights (into the existing parameters, so the optimizer keeps its variables),
/// the optimizer state and `role_state.json` written by [`save`].
pub fn load(
    model: &Model,
    optim: &mut Optim,
    dir: &Path,
    opts: &rlhf_model::LoadOptions,
) -> Result<RoleState> {
    durable::Manifest::verify(dir)?;
    let path = dir.join(ROLE_STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        Error::invalid(format!(
            "cannot read {}: {e}; LoadCheckpoint needs a directory written by SaveCheckpoint",
            path.display()
        ))
    })?;
    let state: RoleState = serde_json::from_str(&text)
        .map_err(|e| Error::invalid(format!("{} is not a role state: {e}", path.display())))?;
    if model.lora().is_some() {
        // A LoRA engine's checkpoint is its PEFT adapter; the frozen base never changed.
        model
            .load_adapter(dir)
            .with_ctx(|| format!("restoring the adapters from {}", dir.display()))?;
    } else {
        let saved = Model::load(dir, opts).with_ctx(|| format!("loading {}", dir.display()))?;
        model
            .set_weights(&saved.named_tensors())
            .with_ctx(|| format!("restoring the weights from {}", dir.display()))?;
    }
    optim
        .opt
        .load(&dir.join(OPTIMIZER_FILE))
        .with_ctx(|| format!("restoring the optimizer from {}", dir.display()))?;
    if optim.opt.steps() as u64 != state.scheduler_step {
        return Err(Error::invalid(format!(
            "{}: the optimizer has {} steps but role_state.json says {}; the checkpoint is inconsistent",
            dir.display(),
            optim.opt.steps(),
            state.scheduler_step
        )));
    }
    Ok(state)
}
