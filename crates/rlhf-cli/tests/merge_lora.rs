//! `rlhf merge-lora` as a user runs it (the built binary) on the LoRA fixtures that the real
//! `peft` wrote (crates/rlhf-model/tests/fixtures/lora, scripts/lora_fixtures.py).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use rlhf_model::{Batch, Device, LoadOptions, Model, Tensor};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../rlhf-model/tests/fixtures")
}

fn rlhf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rlhf"))
        .args(args)
        .output()
        .unwrap()
}

fn merge(base: &Path, adapter: &Path, out: &Path) -> Output {
    rlhf(&[
        "merge-lora",
        "--base",
        base.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
}

fn expected(key: &str) -> Tensor {
    let path = fixtures().join("lora/reference.safetensors");
    let (tensors, _) = rlhf_model::weights::load_safetensors(&path, &Device::Cpu).unwrap();
    tensors.into_iter().find(|(n, _)| n == key).unwrap().1
}

#[test]
fn merged_directory_is_a_plain_model_with_peft_merged_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("merged");
    let o = merge(
        &fixtures().join("tiny-llama"),
        &fixtures().join("lora/tiny-llama-adapter"),
        &out,
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        stdout.contains("r=4") && stdout.contains("14 adapted layers"),
        "{stdout}"
    );
    for f in [
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    assert!(!out.join("adapter_config.json").exists());
    let model = Model::load(&out, &LoadOptions::inference()).unwrap();
    // reference.json's first left-padded row: its last 4 tokens are real.
    let ids = Tensor::new(&[[288u32, 296, 81, 90]], &Device::Cpu).unwrap();
    let mask = Tensor::new(&[[1u32, 1, 1, 1]], &Device::Cpu).unwrap();
    let got = model.logits(&Batch::from_mask(ids, mask).unwrap()).unwrap();
    let want = expected("tiny-llama.merged_logits")
        .get(0)
        .unwrap()
        .narrow(0, 8, 4)
        .unwrap();
    let d = (got.squeeze(0).unwrap() - want)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(
        d <= 1e-4,
        "merged logits differ from peft's merge_and_unload by {d}"
    );
}

#[test]
fn nothing_is_overwritten_and_bad_input_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("taken");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "mine").unwrap();
    let base = fixtures().join("tiny-llama");
    let adapter = fixtures().join("lora/tiny-llama-adapter");
    let o = merge(&base, &adapter, &out);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("already exists") && err.contains("never overwrites"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(out.join("keep.txt")).unwrap(),
        "mine"
    );
    // Our adapter trained on tiny-llama, merged onto another base of the same shapes: the
    // base fingerprint in its header refuses it, and nothing is written.
    let ours = tmp.path().join("ours");
    Model::load_with_adapter(&base, &adapter, &LoadOptions::inference())
        .unwrap()
        .image(None)
        .unwrap()
        .write(&ours)
        .unwrap();
    let o = merge(&fixtures().join("tiny-qwen2"), &ours, &tmp.path().join("x"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("trained on another base model"), "{err}");
    assert!(!tmp.path().join("x").exists());
    // A directory that is no adapter.
    let o = merge(&base, &base, &tmp.path().join("y"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("adapter_config.json"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
