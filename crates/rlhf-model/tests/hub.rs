//! Hub names (`owner/name[@revision]`) load through a fake Hugging Face cache in the exact
//! `huggingface_hub` layout (refs/, snapshots/ with symlinks into blobs/) with the same
//! outputs as the directory itself; no network, no process environment changed.

mod common;

use std::path::{Path, PathBuf};

use common::{fixture, tiny_batch};
use rlhf_model::hub::{test_support::add_snapshot, Hub};
use rlhf_model::{Device, Error, LoadOptions, Model, Tensor, Tokenizer};

const MAIN: &str = "0123456789abcdef0123456789abcdef01234567";
const V1: &str = "89abcdef0123456789abcdef0123456789abcdef";

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Every file of the fixture `name`, as (file name, path).
fn fixture_files(name: &str) -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(fixture(name))
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), e.path())
        })
        .collect();
    out.sort();
    out
}

/// The error of a load that must fail (`Model` has no `Debug`, so no `unwrap_err`).
fn load_err(hub: &Hub, spec: &str) -> Error {
    match Model::load_spec(hub, spec, &LoadOptions::inference()) {
        Ok(_) => panic!("{spec} loaded"),
        Err(e) => e,
    }
}

fn put(cache: &Path, repo: &str, rev: Option<&str>, commit: &str, files: &[(String, PathBuf)]) {
    let refs: Vec<(&str, &Path)> = files
        .iter()
        .map(|(n, p)| (n.as_str(), p.as_path()))
        .collect();
    add_snapshot(cache, repo, rev, commit, &refs).unwrap();
}

#[test]
fn a_cached_repo_loads_with_the_outputs_of_its_directory() {
    let cache = tempfile::tempdir().unwrap();
    put(
        cache.path(),
        "acme/tiny-llama",
        Some("main"),
        MAIN,
        &fixture_files("tiny-llama"),
    );
    put(
        cache.path(),
        "acme/tiny-llama",
        Some("v1"),
        V1,
        &fixture_files("tiny-qwen2"),
    );
    let hub = Hub::new(cache.path());
    let b = tiny_batch(&Device::Cpu);

    let direct = Model::load(fixture("tiny-llama"), &LoadOptions::inference()).unwrap();
    let (cached, dir) =
        Model::load_spec(&hub, "acme/tiny-llama", &LoadOptions::inference()).unwrap();
    assert_eq!(
        dir,
        cache
            .path()
            .join("models--acme--tiny-llama/snapshots")
            .join(MAIN)
    );
    assert!(
        std::fs::symlink_metadata(dir.join("model.safetensors"))
            .unwrap()
            .file_type()
            .is_symlink()
            || cfg!(not(unix))
    );
    assert_eq!(
        max_abs_diff(&direct.logits(&b).unwrap(), &cached.logits(&b).unwrap()),
        0.0
    );
    // The tokenizer comes from the same snapshot.
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let want = Tokenizer::from_dir(fixture("tiny-llama")).unwrap();
    assert_eq!(
        tok.encode("hello world", false).unwrap(),
        want.encode("hello world", false).unwrap()
    );

    // @v1 is another snapshot (here: another model), and a commit hash names it directly.
    let qwen = Model::load(fixture("tiny-qwen2"), &LoadOptions::inference()).unwrap();
    for spec in ["acme/tiny-llama@v1", &format!("acme/tiny-llama@{V1}")] {
        let (m, dir) = Model::load_spec(&hub, spec, &LoadOptions::inference()).unwrap();
        assert!(dir.ends_with(V1), "{spec}: {}", dir.display());
        assert_eq!(
            max_abs_diff(&qwen.logits(&b).unwrap(), &m.logits(&b).unwrap()),
            0.0,
            "{spec}"
        );
    }
}

#[test]
fn a_sharded_cached_repo_loads_and_needs_every_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let direct = Model::load(fixture("tiny-llama"), &LoadOptions::inference()).unwrap();
    let tensors = direct.named_tensors();
    let (a, b) = tensors.split_at(tensors.len() / 2);
    let shards = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let mut weight_map = serde_json::Map::new();
    for (part, shard) in [a, b].iter().zip(shards) {
        rlhf_model::weights::save_safetensors(part, &src.join(shard)).unwrap();
        for (name, _) in part.iter() {
            weight_map.insert(name.clone(), serde_json::Value::from(shard));
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(src.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let mut files: Vec<(String, PathBuf)> = fixture_files("tiny-llama")
        .into_iter()
        .filter(|(n, _)| n != "model.safetensors")
        .collect();
    files.push((
        "model.safetensors.index.json".into(),
        src.join("model.safetensors.index.json"),
    ));
    files.push((shards[0].into(), src.join(shards[0])));
    put(&cache, "acme/sharded", Some("main"), MAIN, &files);

    // One shard missing: the snapshot does not count.
    let hub = Hub::new(&cache);
    let err = load_err(&hub, "acme/sharded");
    assert!(matches!(err, Error::Hub(_)), "{err:?}");
    assert!(err.to_string().contains(shards[1]), "{err}");

    put(
        &cache,
        "acme/sharded",
        Some("main"),
        MAIN,
        &[(shards[1].into(), src.join(shards[1]))],
    );
    let (m, _) = Model::load_spec(&hub, "acme/sharded", &LoadOptions::inference()).unwrap();
    let batch = tiny_batch(&Device::Cpu);
    assert_eq!(
        max_abs_diff(&direct.logits(&batch).unwrap(), &m.logits(&batch).unwrap()),
        0.0
    );
}

#[test]
fn hub_errors_surface_through_load_spec() {
    let cache = tempfile::tempdir().unwrap();
    let hub = Hub::new(cache.path());
    let err = load_err(&hub, "acme/absent");
    let msg = err.to_string();
    assert!(msg.contains("'acme/absent'"), "{msg}");
    assert!(msg.contains(&cache.path().display().to_string()), "{msg}");
    assert!(
        msg.contains("huggingface-cli download acme/absent"),
        "{msg}"
    );
    let err = load_err(&hub, "../x");
    assert!(
        err.to_string().contains("neither an existing directory"),
        "{err}"
    );
    // A snapshot with the config but no weights is not loaded.
    let files: Vec<(String, PathBuf)> = fixture_files("tiny-llama")
        .into_iter()
        .filter(|(n, _)| n != "model.safetensors")
        .collect();
    put(cache.path(), "acme/noweights", Some("main"), MAIN, &files);
    let err = load_err(&hub, "acme/noweights");
    assert!(err.to_string().contains("lacks model.safetensors"), "{err}");
}
