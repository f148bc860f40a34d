//! `rlhf generate --model owner/name` through a fake Hugging Face cache (the exact
//! `huggingface_hub` layout) named by `HF_HUB_CACHE`, offline: the same completions as the
//! directory itself, and a one-line error naming the id and the cache when it is absent.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use rlhf_model::hub::test_support::add_snapshot_of_dir;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../rlhf-model/tests/fixtures/tiny-llama")
}

fn rlhf(cache: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rlhf"))
        .args(args)
        .env("HF_HUB_CACHE", cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap()
}

fn fake_cache() -> tempfile::TempDir {
    let cache = tempfile::tempdir().unwrap();
    add_snapshot_of_dir(
        cache.path(),
        "acme/tiny-llama",
        Some("main"),
        COMMIT,
        &fixture(),
    )
    .unwrap();
    cache
}

#[test]
fn generate_with_a_repo_id_matches_the_directory() {
    let cache = fake_cache();
    let args = |model: &str| -> Vec<String> {
        [
            "generate",
            "--model",
            model,
            "--prompt",
            "hello",
            "--max-new-tokens",
            "6",
            "--temperature",
            "0",
            "--format",
            "json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let run = |model: &str| {
        let a = args(model);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let out = rlhf(cache.path(), &a);
        assert!(
            out.status.success(),
            "{model}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let by_id = run("acme/tiny-llama");
    let by_dir = run(&fixture().to_string_lossy());
    assert!(by_id.contains("completion_token_ids"), "{by_id}");
    assert_eq!(by_id, by_dir);
    assert_eq!(run(&format!("acme/tiny-llama@{COMMIT}")), by_dir);
}

#[test]
fn an_uncached_repo_offline_fails_with_one_line_naming_it() {
    let cache = fake_cache();
    let out = rlhf(
        cache.path(),
        &["generate", "--model", "acme/absent", "--prompt", "x"],
    );
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(out.stdout.is_empty());
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    for want in [
        "'acme/absent'",
        &cache.path().display().to_string(),
        "HF_HUB_OFFLINE",
        "huggingface-cli download acme/absent",
    ] {
        assert!(err.contains(want), "missing {want:?} in: {err}");
    }
    let out = rlhf(
        cache.path(),
        &["generate", "--model", "a/b/c", "--prompt", "x"],
    );
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        err.contains("neither an existing directory nor a Hugging Face repo id"),
        "{err}"
    );
}
