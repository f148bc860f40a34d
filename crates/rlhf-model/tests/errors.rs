//! Bad input gives errors that name the problem, never a panic.

mod common;

use std::path::Path;

use common::fixture;
use rlhf_model::{generate, Error, GenerationConfig, LoadOptions, Model, ModelKind, Tokenizer};

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
}

fn load_err(dir: &Path) -> Error {
    match Model::load(dir, &LoadOptions::inference()) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn missing_files_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let err = load_err(&tmp.path().join("nope"));
    assert!(err.to_string().contains("nope"), "{err}");

    let dir = tmp.path().join("m");
    copy_dir(&fixture("tiny-llama"), &dir);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let err = load_err(&dir);
    assert!(matches!(err, Error::MissingFile { .. }));
    assert!(err.to_string().contains("model.safetensors"), "{err}");

    std::fs::remove_file(dir.join("config.json")).unwrap();
    let err = load_err(&dir);
    assert!(err.to_string().contains("config.json"), "{err}");

    let sharded = tmp.path().join("s");
    copy_dir(&fixture("tiny-llama3-rope"), &sharded);
    std::fs::remove_file(sharded.join("model-00002-of-00003.safetensors")).unwrap();
    let err = load_err(&sharded);
    assert!(
        err.to_string().contains("model-00002-of-00003.safetensors"),
        "{err}"
    );

    let err = Tokenizer::from_dir(tmp.path())
        .err()
        .expect("no tokenizer there");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}

#[test]
fn unsupported_architecture_lists_supported_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    copy_dir(&fixture("tiny-llama"), &dir);
    edit_config(&dir, |v| {
        v["model_type"] = "gpt2".into();
        v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
    });
    let err = load_err(&dir);
    let msg = err.to_string();
    assert!(matches!(err, Error::UnsupportedArchitecture { .. }));
    assert!(msg.contains("GPT2LMHeadModel"), "{msg}");
    assert!(
        msg.contains("LlamaForCausalLM") && msg.contains("Qwen2ForCausalLM"),
        "{msg}"
    );
}

#[test]
fn shape_mismatch_names_tensor_and_both_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    copy_dir(&fixture("tiny-llama"), &dir);
    edit_config(&dir, |v| v["intermediate_size"] = 96.into());
    let err = load_err(&dir);
    let msg = err.to_string();
    assert!(matches!(err, Error::ShapeMismatch { .. }));
    assert!(msg.contains("model.layers.0.mlp.gate_proj.weight"), "{msg}");
    assert!(
        msg.contains("[128, 64]") && msg.contains("[96, 64]"),
        "{msg}"
    );
}

#[test]
fn missing_head_tensor_is_named() {
    let err = Model::load(
        fixture("tiny-llama"),
        &LoadOptions::inference().with_kind(ModelKind::Reward),
    )
    .err()
    .expect("a causal LM has no score head");
    assert!(err.to_string().contains("score.weight"), "{err}");
    let opts = LoadOptions {
        value_head_init: rlhf_model::ValueHeadInit::FromCheckpoint,
        ..LoadOptions::training(ModelKind::Value)
    };
    let err = Model::load(fixture("tiny-llama"), &opts)
        .err()
        .expect("no value head in a causal LM");
    assert!(err.to_string().contains("score.weight"), "{err}");
}

#[test]
fn malformed_config_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    copy_dir(&fixture("tiny-llama"), &dir);
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    let err = load_err(&dir);
    assert!(err.to_string().contains("config.json"), "{err}");
    edit_config_raw(&dir, r#"{"model_type": "llama", "hidden_size": 64}"#);
    let err = load_err(&dir);
    assert!(err.to_string().contains("lacks"), "{err}");
}

fn edit_config_raw(dir: &Path, text: &str) {
    std::fs::write(dir.join("config.json"), text).unwrap();
}

#[test]
fn chat_template_missing_is_a_clear_error() {
    let tok = Tokenizer::from_dir(fixture("tiny-llama-reward")).unwrap();
    let err = tok
        .apply_chat_template(&[rlhf_model::ChatMessage::user("hi")], true)
        .unwrap_err();
    assert!(matches!(err, Error::NoChatTemplate { .. }));
    assert!(err.to_string().contains("no chat_template"), "{err}");
}

#[test]
fn long_prompts_are_refused_or_truncated() {
    let m = Model::load(fixture("tiny-llama"), &LoadOptions::inference()).unwrap();
    // Context 128: with 8 new tokens, 120 prompt tokens fit.
    let long: Vec<u32> = (0..130).map(|i| 3 + (i % 200)).collect();
    let cfg = GenerationConfig::greedy(8);
    let err = generate(&m, &[vec![5, 6], long.clone()], &cfg).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(
        err,
        Error::PromptTooLong {
            index: 1,
            len: 130,
            limit: 120,
            ..
        }
    ));
    assert!(msg.contains("truncate"), "{msg}");
    let cfg = GenerationConfig {
        truncate_prompts: true,
        ..cfg
    };
    let out = generate(&m, std::slice::from_ref(&long), &cfg).unwrap();
    assert_eq!(out.sequences[0].prompt_ids, long[10..].to_vec());
    assert_eq!(out.sequences[0].token_ids.len(), 8);
}

#[test]
fn bad_generation_arguments_are_rejected() {
    let m = Model::load(fixture("tiny-llama"), &LoadOptions::inference()).unwrap();
    let cases = [
        GenerationConfig {
            top_p: 0.0,
            ..GenerationConfig::default()
        },
        GenerationConfig {
            temperature: -1.0,
            ..GenerationConfig::default()
        },
        GenerationConfig {
            n: 0,
            ..GenerationConfig::default()
        },
        GenerationConfig {
            min_new_tokens: 10,
            ..GenerationConfig::greedy(5)
        },
    ];
    for cfg in cases {
        assert!(matches!(
            generate(&m, &[vec![1, 2]], &cfg),
            Err(Error::InvalidArgument(_))
        ));
    }
    let err = generate(&m, &[vec![1, 100_000]], &GenerationConfig::greedy(2)).unwrap_err();
    assert!(err.to_string().contains("100000"), "{err}");
    assert!(generate(&m, &[vec![]], &GenerationConfig::greedy(2)).is_err());
    assert!(generate(&m, &[], &GenerationConfig::greedy(2)).is_err());
}

#[test]
fn trainable_models_refuse_fused_kernels() {
    let err = Model::load(
        fixture("tiny-llama"),
        &LoadOptions::training(ModelKind::CausalLm).with_fast(true),
    )
    .err()
    .expect("fast + trainable must be refused");
    assert!(err.to_string().contains("backward"), "{err}");
}

#[test]
fn wrong_head_calls_are_errors() {
    let m = Model::load(fixture("tiny-llama"), &LoadOptions::inference()).unwrap();
    let b = rlhf_model::Batch::left_padded(&[vec![1, 2, 3]], 0, &rlhf_model::Device::Cpu).unwrap();
    assert!(matches!(m.values(&b), Err(Error::InvalidArgument(_))));
    assert!(matches!(m.scores(&b), Err(Error::InvalidArgument(_))));
}

#[test]
fn out_of_vocabulary_ids_in_a_batch_are_errors() {
    let m = Model::load(fixture("tiny-llama"), &LoadOptions::inference()).unwrap();
    let b =
        rlhf_model::Batch::left_padded(&[vec![1, 5000, 3]], 0, &rlhf_model::Device::Cpu).unwrap();
    let err = m.logits(&b).unwrap_err();
    assert!(err.to_string().contains("5000"), "{err}");
}

/// Sizes in config.json are checked before anything is allocated: an absurd layer count used
/// to abort the process (a 167 TB allocation), and a count that does not match the weights
/// is named.
#[test]
fn config_sizes_are_bounded_by_limits_and_by_the_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    copy_dir(&fixture("tiny-llama"), &dir);
    let layers = {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        v["num_hidden_layers"].as_u64().unwrap()
    };
    for (key, value, want) in [
        ("num_hidden_layers", 1u64 << 40, "at most 1024"),
        ("vocab_size", 1u64 << 40, "vocab_size"),
        ("num_hidden_layers", layers + 1, "weights hold"),
        ("num_hidden_layers", layers - 1, "weights hold"),
    ] {
        let d = tmp.path().join(format!("{key}-{value}"));
        copy_dir(&dir, &d);
        edit_config(&d, |v| v[key] = serde_json::json!(value));
        let err = load_err(&d).to_string();
        assert!(
            err.contains(key) && err.contains(want),
            "{key}={value}: {err}"
        );
    }
    // An EOS id beyond u32 is no token id: dropped, not wrapped onto token 0.
    edit_config(&dir, |v| {
        v["eos_token_id"] = serde_json::json!([1u64 << 32, 2])
    });
    let m = Model::load(&dir, &LoadOptions::inference()).unwrap();
    assert_eq!(m.config().eos_token_ids, vec![2]);
}
