//! The local Hugging Face cache, read the way `huggingface_hub` writes it:
//!
//! ```text
//! {cache}/models--{owner}--{name}/
//!     refs/{revision}            a commit hash
//!     snapshots/{hash}/{file}    usually a relative symlink into blobs/
//!     blobs/{etag}
//! ```
//!
//! Nothing here touches the network: a snapshot counts when it holds every file the caller
//! needs (followed through its symlinks, so a dangling link does not count).

use std::path::{Path, PathBuf};

use crate::repo_id::{is_commit_hash, RepoId};

/// What a resolved directory must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// A model to load: `config.json` and the safetensors weights (`model.safetensors`, or
    /// `model.safetensors.index.json` and every shard it lists).
    Model,
    /// A tokenizer: `tokenizer.json` (the only kind the tokenizer crate reads).
    Tokenizer,
    /// Only the architecture: `config.json`.
    Config,
}

/// File name of a single-file safetensors checkpoint.
pub const WEIGHTS: &str = "model.safetensors";
/// File name of the index of a sharded safetensors checkpoint.
pub const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

/// Where the cache is, from the environment as `huggingface_hub` reads it: `$HF_HUB_CACHE`,
/// else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
/// `~/.cache/huggingface/hub`.
pub fn cache_dir_from_env() -> PathBuf {
    if let Some(p) = env_path("HF_HUB_CACHE") {
        return p;
    }
    hf_home_from_env().join("hub")
}

/// `$HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface` (where the
/// cache and the token file live).
pub(crate) fn hf_home_from_env() -> PathBuf {
    if let Some(p) = env_path("HF_HOME") {
        return p;
    }
    if let Some(p) = env_path("XDG_CACHE_HOME") {
        return p.join("huggingface");
    }
    let home = env_path("HOME")
        .or_else(std::env::home_dir)
        .unwrap_or_default();
    home.join(".cache").join("huggingface")
}

fn env_path(key: &str) -> Option<PathBuf> {
    std::env::var_os(key)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Whether `HF_HUB_OFFLINE` forbids downloads (`1`, `true`, `yes` or `on`).
pub fn offline_from_env() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// A file name inside a repo (from the Hub's listing or a shard index) that is safe to join
/// onto a snapshot directory: relative, `/`-separated, no empty, `.` or `..` segment.
pub(crate) fn safe_repo_path(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 1024
        && !name.contains('\\')
        && !name.contains('\0')
        && name
            .split('/')
            .all(|s| !s.is_empty() && s != "." && s != "..")
}

/// The commit a revision points at in the cache, when the cache knows it: a commit hash
/// names itself; otherwise `refs/{revision}` holds it.
pub(crate) fn commit_for(repo_dir: &Path, repo: &RepoId) -> Option<String> {
    let rev = repo.revision();
    if is_commit_hash(rev) {
        return Some(rev.to_string());
    }
    let text = std::fs::read_to_string(repo_dir.join("refs").join(rev)).ok()?;
    let hash = text.trim();
    let plausible =
        !hash.is_empty() && hash.len() <= 128 && hash.bytes().all(|b| b.is_ascii_alphanumeric());
    plausible.then(|| hash.to_string())
}

/// The shards a `model.safetensors.index.json` lists (its `weight_map` values, deduplicated).
pub(crate) fn index_shards(index: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(index).map_err(|e| format!("cannot read it: {e}"))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("not JSON: {e}"))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| "it has no weight_map object".to_string())?;
    let mut shards = Vec::new();
    for file in map.values() {
        let file = file
            .as_str()
            .ok_or_else(|| "a weight_map value is not a file name".to_string())?;
        if !safe_repo_path(file) {
            return Err(format!(
                "it lists the shard '{file}', which is not a plain file name"
            ));
        }
        if !shards.iter().any(|s| s == file) {
            shards.push(file.to_string());
        }
    }
    if shards.is_empty() {
        return Err("its weight_map is empty".into());
    }
    Ok(shards)
}

/// What `dir` lacks for `need`, in words; `None` when it has everything.
pub fn lacks(dir: &Path, need: Need) -> Option<String> {
    let has = |f: &str| dir.join(f).is_file();
    match need {
        Need::Config => (!has("config.json")).then(|| "config.json".to_string()),
        Need::Tokenizer => (!has("tokenizer.json")).then(|| "tokenizer.json".to_string()),
        Need::Model => {
            if !has("config.json") {
                return Some("config.json".into());
            }
            if has(WEIGHTS) {
                return None;
            }
            if !has(WEIGHTS_INDEX) {
                return Some(format!("{WEIGHTS} (or {WEIGHTS_INDEX} with its shards)"));
            }
            match index_shards(&dir.join(WEIGHTS_INDEX)) {
                Err(e) => Some(format!("a usable {WEIGHTS_INDEX} ({e})")),
                Ok(shards) => {
                    let missing: Vec<&str> = shards
                        .iter()
                        .map(String::as_str)
                        .filter(|s| !has(s))
                        .collect();
                    (!missing.is_empty()).then(|| {
                        format!(
                            "the shard{} {} listed in {WEIGHTS_INDEX}",
                            if missing.len() == 1 { "" } else { "s" },
                            missing.join(", ")
                        )
                    })
                }
            }
        }
    }
}

/// Looks `repo` up in `cache` for `need`: the snapshot directory, or why there is none.
pub(crate) fn lookup(cache: &Path, repo: &RepoId, need: Need) -> Result<PathBuf, String> {
    let repo_dir = cache.join(repo.folder_name());
    if !repo_dir.is_dir() {
        return Err(format!("no {} folder", repo.folder_name()));
    }
    let Some(commit) = commit_for(&repo_dir, repo) else {
        return Err(format!(
            "{} has no refs/{} (the revision was never downloaded)",
            repo.folder_name(),
            repo.revision()
        ));
    };
    let snapshot = repo_dir.join("snapshots").join(&commit);
    if !snapshot.is_dir() {
        return Err(format!("{} has no snapshots/{commit}", repo.folder_name()));
    }
    match lacks(&snapshot, need) {
        None => Ok(snapshot),
        Some(what) => Err(format!("snapshot {commit} lacks {what}")),
    }
}
