//! Hugging Face repo ids in a role's spec, resolved on the role's own node: each node looks
//! in (and downloads into) its own HF cache, so the driver passes ids on as they are.

use std::path::Path;

use rlhf_config::RoleSpec;

use crate::error::{Error, Result};

/// The spec with its model and tokenizer names that are Hugging Face repo ids
/// (`owner/name[@revision]`) replaced by directories of this node's HF cache, downloaded
/// first when the cache lacks them and the node is online (`HF_HUB_OFFLINE` unset). The
/// driver passes ids on unresolved: each node resolves through its own cache.
pub(crate) fn resolve_hub_names(spec: RoleSpec) -> Result<RoleSpec> {
    let id = |p: &Option<std::path::PathBuf>| {
        p.as_deref()
            .and_then(Path::to_str)
            .filter(|s| rlhf_config::spec::is_repo_id_not_dir(s))
            .map(str::to_string)
    };
    // A role without a model (a rule or HTTP reward) uses no tokenizer either: nothing to
    // fetch.
    if spec.model_dir.is_none()
        || (id(&spec.model_dir).is_none() && id(&spec.tokenizer_dir).is_none())
    {
        return Ok(spec);
    }
    resolve_hub_names_in(&rlhf_model::hub::Hub::from_env(), spec)
}

/// [`resolve_hub_names`] through `hub`.
fn resolve_hub_names_in(hub: &rlhf_model::hub::Hub, mut spec: RoleSpec) -> Result<RoleSpec> {
    let id = |p: &Option<std::path::PathBuf>| {
        p.as_deref()
            .and_then(Path::to_str)
            .filter(|s| rlhf_config::spec::is_repo_id_not_dir(s))
            .map(str::to_string)
    };
    let (model_id, tokenizer_id) = (id(&spec.model_dir), id(&spec.tokenizer_dir));
    let label = spec.slot.label();
    let failed = |e: rlhf_model::hub::Error| Error::invalid(format!("{label}: {e}"));
    if let Some(id) = &model_id {
        let dir = hub.resolve_model(id).map_err(failed)?;
        if tokenizer_id.as_ref() == Some(id) {
            spec.tokenizer_dir = Some(dir.clone());
        }
        spec.model_dir = Some(dir);
    }
    if let Some(id) = tokenizer_id.filter(|t| Some(t) != model_id.as_ref()) {
        spec.tokenizer_dir = Some(hub.resolve_tokenizer(&id).map_err(failed)?);
    }
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use rlhf_config::RoleSpec;
    use rlhf_core::{RoleKind, RolePart, RoleSlot};
    use rlhf_model::hub::{test_support::add_snapshot, Hub};

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

    fn spec(overrides: &[&str]) -> RoleSpec {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        let mut cfg = rlhf_config::load(&root.join("configs"), "ppo_tiny", &overrides).unwrap();
        cfg.absolutize_paths(&root);
        let slot = RoleSlot {
            kind: RoleKind::Ref,
            part: RolePart::Whole,
            rank: 0,
            world_size: 1,
        };
        RoleSpec::resolve(&cfg, slot).unwrap()
    }

    fn cache_with(repo: &str, names: &[&str]) -> tempfile::TempDir {
        let cache = tempfile::tempdir().unwrap();
        let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny");
        let files: Vec<(&str, PathBuf)> = names.iter().map(|n| (*n, tiny.join(n))).collect();
        let refs: Vec<(&str, &Path)> = files.iter().map(|(n, p)| (*n, p.as_path())).collect();
        add_snapshot(cache.path(), repo, Some("main"), COMMIT, &refs).unwrap();
        cache
    }

    #[test]
    fn repo_ids_in_a_spec_become_snapshot_directories_of_this_nodes_cache() {
        let all = [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ];
        let cache = cache_with("acme/tiny", &all);
        let hub = Hub::new(cache.path());
        let snapshot = cache
            .path()
            .join("models--acme--tiny/snapshots")
            .join(COMMIT);

        // The model and (by default) the tokenizer come from the same snapshot.
        let s = spec(&[
            "ref.model=acme/tiny",
            "training.tokenizer_name_or_path=acme/tiny",
        ]);
        assert_eq!(s.model_dir, Some(PathBuf::from("acme/tiny")));
        let s = super::resolve_hub_names_in(&hub, s).unwrap();
        assert_eq!(s.model_dir.as_deref(), Some(snapshot.as_path()));
        assert_eq!(s.tokenizer_dir.as_deref(), Some(snapshot.as_path()));
        // A local directory is left alone.
        let local = spec(&[]);
        let same = super::resolve_hub_names(local.clone()).unwrap();
        assert_eq!(same.model_dir, local.model_dir);

        // Not cached (and this hub is offline): the role fails naming its slot, the id and
        // the cache.
        let err = super::resolve_hub_names_in(&hub, spec(&["ref.model=acme/absent"]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("ref"), "{err}");
        assert!(err.contains("'acme/absent'"), "{err}");
        assert!(err.contains(&cache.path().display().to_string()), "{err}");
    }
}
