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
    load_err_with(dir, &LoadOptions::inference())
}

fn load_err_with(dir: &Path, opts: &LoadOptions) -> Error {
    match Model::load(dir, opts) {
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

/// A copy of tiny-qwen3 in `tmp/name` whose safetensors hold what `edit` leaves of its
/// tensors and whose config.json `cfg` edits.
fn broken_qwen3(
    tmp: &Path,
    name: &str,
    edit: impl FnOnce(&mut Vec<(String, rlhf_model::Tensor)>),
    cfg: impl FnOnce(&mut serde_json::Value),
) -> std::path::PathBuf {
    let dir = tmp.join(name);
    copy_dir(&fixture("tiny-qwen3"), &dir);
    let file = dir.join("model.safetensors");
    let (mut tensors, _) =
        rlhf_model::weights::load_safetensors(&file, &rlhf_model::Device::Cpu).unwrap();
    edit(&mut tensors);
    rlhf_model::weights::save_safetensors(&tensors, &file).unwrap();
    edit_config(&dir, cfg);
    dir
}

fn assert_names(err: &Error, parts: &[&str]) {
    let msg = err.to_string();
    println!("{msg}");
    for p in parts {
        assert!(msg.contains(p), "missing {p:?} in: {msg}");
    }
}

/// A Qwen3 checkpoint without a layer's q/k norm is refused naming the tensor, what Qwen3
/// needs it for and the likely cause (a Qwen2 checkpoint labeled Qwen3); a Qwen3 checkpoint
/// labeled as another family is refused by its q_norm instead of loading without the norms.
#[test]
fn qwen3_without_its_qk_norms_is_refused_with_the_likely_mislabel() {
    let tmp = tempfile::tempdir().unwrap();
    for norm in ["q_norm", "k_norm"] {
        let missing = format!("model.layers.1.self_attn.{norm}.weight");
        let dir = broken_qwen3(
            tmp.path(),
            norm,
            |t| t.retain(|(n, _)| *n != missing),
            |_| {},
        );
        for opts in [
            LoadOptions::inference(),
            LoadOptions::training(ModelKind::Value),
        ] {
            let err = load_err_with(&dir, &opts);
            assert!(matches!(err, Error::Config(_)), "{err}");
            assert_names(
                &err,
                &[
                    &missing,
                    "Qwen3ForCausalLM",
                    "per-head RMSNorm",
                    "Qwen2",
                    "architectures",
                ],
            );
        }
    }
    // The other way round: tiny-qwen3's weights under a Qwen2 or a Llama config.
    for (model_type, arch) in [("qwen2", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM")] {
        let dir = broken_qwen3(
            tmp.path(),
            model_type,
            |_| {},
            |v| {
                v["model_type"] = model_type.into();
                v["architectures"] = serde_json::json!([arch]);
            },
        );
        let err = load_err(&dir);
        assert_names(
            &err,
            &[
                "model.layers.0.self_attn.q_norm.weight",
                arch,
                "Qwen3",
                "architectures",
            ],
        );
    }
}

/// A head_dim that disagrees with the q/k projections or with the q/k norms is refused
/// naming config.json's head_dim (or its default), the tensor, both shapes and the head_dim
/// the weights fit; the fixture itself loads (head_dim 32 with hidden 64 and 4 heads).
#[test]
fn qwen3_head_dim_disagreeing_with_the_weights_names_both() {
    Model::load(fixture("tiny-qwen3"), &LoadOptions::inference()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // hidden_size / num_attention_heads, what a Qwen2 config would imply.
    let dir = broken_qwen3(tmp.path(), "hd16", |_| {}, |v| v["head_dim"] = 16.into());
    let err = load_err(&dir);
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert_names(
        &err,
        &[
            "model.layers.0.self_attn.q_proj.weight",
            "config.json's head_dim=16",
            "[128, 64]",
            "[64, 64]",
            "fit head_dim=32",
            "q_norm.weight has shape [32]",
        ],
    );
    // No head_dim at all: Qwen3's default of 128.
    let dir = broken_qwen3(
        tmp.path(),
        "no-hd",
        |_| {},
        |v| {
            v.as_object_mut().unwrap().remove("head_dim");
        },
    );
    assert_names(
        &load_err(&dir),
        &[
            "no head_dim",
            "128",
            "[512, 64]",
            "[128, 64]",
            "fit head_dim=32",
        ],
    );
    // The projections agree with head_dim but a layer's k_norm has another length.
    let name = "model.layers.1.self_attn.k_norm.weight";
    let dir = broken_qwen3(
        tmp.path(),
        "short-norm",
        |t| {
            for (n, w) in t.iter_mut() {
                if n == name {
                    *w = w.narrow(0, 0, 16).unwrap();
                }
            }
        },
        |_| {},
    );
    let err = load_err(&dir);
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert_names(&err, &[name, "[16]", "config.json's head_dim=32", "[32]"]);
}
