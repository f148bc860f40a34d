//! `rlhf-head check` with models named by Hugging Face repo ids: looked up in the HF cache
//! (`HF_HUB_CACHE`, here a fake one in the exact `huggingface_hub` layout) without
//! downloading; a cached id is present, an uncached one is downloaded at start (online) or
//! missing with the id and the cache path (offline).

use std::path::Path;
use std::process::Command;

use rlhf_hub::test_support::add_snapshot_of_dir;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn check(cache: &Path, offline: bool, overrides: &[&str]) -> String {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out_dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_rlhf-head"))
        .current_dir(repo)
        .args(["check", "--config-name", "ppo_tiny"])
        .args(overrides)
        .arg(format!(
            "checkpoint.dir={}",
            out_dir.path().join("ckpt").display()
        ))
        .env_remove("RLHF_TOKEN")
        .env("RUST_LOG", "warn")
        .env("HF_HUB_CACHE", cache)
        .env("HF_HUB_OFFLINE", if offline { "1" } else { "0" })
        // Never reached (check does not download); a closed port makes sure.
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn fake_cache() -> tempfile::TempDir {
    let cache = tempfile::tempdir().unwrap();
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny");
    add_snapshot_of_dir(cache.path(), "acme/tiny", Some("main"), COMMIT, &tiny).unwrap();
    cache
}

#[test]
fn check_looks_repo_ids_up_in_the_cache_without_downloading() {
    let cache = fake_cache();
    let ids = [
        "actor_rollout.model=acme/tiny",
        "training.tokenizer_name_or_path=acme/tiny",
    ];
    // Cached: present (and the architecture is read from the snapshot's config.json).
    let text = check(cache.path(), true, &ids);
    assert!(!text.contains("missing:"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("hub: actor_rollout.model")
                && l.contains("acme/tiny is in this machine's Hugging Face cache")
                && l.contains(COMMIT)),
        "{text}"
    );
    assert!(!text.contains("architecture unknown"), "{text}");

    // Not cached, online: downloaded at start.
    let with_critic = [ids[0], ids[1], "critic.model=acme/critic"];
    let text = check(cache.path(), false, &with_critic);
    assert!(!text.contains("missing:"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("hub: critic.model: acme/critic")
                && l.contains("downloads it from http://127.0.0.1:9")
                && l.contains(&cache.path().display().to_string())),
        "{text}"
    );

    // Not cached, offline: missing, with the id, the cache path and how to fetch it.
    let text = check(cache.path(), true, &with_critic);
    let line = text
        .lines()
        .find(|l| l.starts_with("missing: critic.model"))
        .unwrap_or_else(|| panic!("no missing critic line:\n{text}"));
    for want in [
        "'acme/critic'",
        &cache.path().display().to_string(),
        "huggingface-cli download acme/critic",
    ] {
        assert!(line.contains(want), "missing {want:?} in: {line}");
    }
    // Nothing was written into the cache.
    assert!(!cache.path().join("models--acme--critic").exists());
}
