//! Model names as users write them, `Qwen/Qwen2.5-0.5B-Instruct` or `owner/name@revision`,
//! loaded through the local Hugging Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`) in the layout `huggingface_hub` writes, so a model fetched
//! with `huggingface-cli download` (or by any Python tool) is found without copying it, and
//! one missing from the cache is downloaded into it when the process is online.
//!
//! The resolution lives in the `rlhf-hub` crate, which does not link candle: the PPO driver
//! (tokenizer only) and the config checks need it too. This module re-exports it for the
//! model side and adds [`Model::load_spec`]. Resolve where the model is loaded (in each role
//! process, on its own node), never on the machine that only plans the job.

use std::path::PathBuf;

pub use rlhf_hub::{
    cache_dir_from_env, is_commit_hash, is_repo_id, lacks, offline_from_env, resolve_model,
    resolve_tokenizer, Error, Hub, IdError, Located, Need, RepoId, DEFAULT_ENDPOINT, WEIGHTS,
    WEIGHTS_INDEX,
};

#[doc(hidden)]
pub use rlhf_hub::test_support;

use crate::{LoadOptions, Model, Result};

impl Model {
    /// Loads the model `spec` names: an existing directory, or a Hub repo id resolved through
    /// `hub` (see [`Hub::resolve_model`]). Returns the directory it loaded from, where the
    /// tokenizer files are too.
    pub fn load_spec(hub: &Hub, spec: &str, opts: &LoadOptions) -> Result<(Model, PathBuf)> {
        let dir = hub.resolve_model(spec)?;
        let model = Model::load(&dir, opts)?;
        Ok((model, dir))
    }
}
