//! A trainable engine's checkpoint: an HF model directory plus `optimizer.safetensors`,
//! `role_state.json` (scheduler position, weights version) and `manifest.json` (every file's
//! size and content hash). It is written beside the target and moved into place in one
//! rename once every file is on disk (`rlhf_core::durable`), and verified against its
//! manifest before anything is loaded.

use std::path::Path;

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

/// Writes an HF model directory plus the optimizer state and `role_state.json`.
pub fn save(
    model: &Model,
    optim: &Optim,
    state: &RoleState,
    dir: &Path,
    tokenizer_dir: Option<&Path>,
) -> Result<Vec<String>> {
    let tok = tokenizer_dir.filter(|d| d.join("tokenizer.json").is_file());
    let staging = durable::staging_dir(dir);
    if staging.exists() {
        // What an interrupted save left behind.
        std::fs::remove_dir_all(&staging)
            .map_err(|e| Error::internal(format!("removing {}: {e}", staging.display())))?;
    }
    model
        .save(&staging, tok)
        .with_ctx(|| format!("saving the model to {}", staging.display()))?;
    optim
        .opt
        .save(&staging.join(OPTIMIZER_FILE))
        .with_ctx(|| format!("saving the optimizer state to {}", staging.display()))?;
    let text = serde_json::to_string_pretty(state)
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
    let saved = Model::load(dir, opts).with_ctx(|| format!("loading {}", dir.display()))?;
    model
        .set_weights(&saved.named_tensors())
        .with_ctx(|| format!("restoring the weights from {}", dir.display()))?;
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
