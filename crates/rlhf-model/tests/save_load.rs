//! Saving HF directories and loading them back; training steps change what is saved.

mod common;

use common::{fixture, tiny_batch, tiny_config};
use rlhf_model::{
    AdamW, AdamWConfig, Device, Family, Gradients, LoadOptions, Model, ModelKind, Tensor,
    Tokenizer, ValueHeadInit,
};

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

fn safetensors_names(path: &std::path::Path) -> Vec<String> {
    let data = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&data).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    names
}

fn read_json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn causal_lm_round_trip_is_exact_and_directory_is_complete() {
    let tmp = tempfile::tempdir().unwrap();
    let m = Model::load(fixture("tiny-qwen2"), &LoadOptions::inference()).unwrap();
    let out = tmp.path().join("saved");
    m.save(&out, Some(&fixture("tiny-qwen2"))).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(
            out.join(f).is_file(),
            "{f} missing from the saved directory"
        );
    }
    let cfg = read_json(&out.join("config.json"));
    assert_eq!(cfg["architectures"][0], "Qwen2ForCausalLM");
    assert_eq!(cfg["model_type"], "qwen2");
    assert_eq!(cfg["tie_word_embeddings"], true);
    let names = safetensors_names(&out.join("model.safetensors"));
    assert!(names.contains(&"model.layers.1.self_attn.q_proj.bias".to_string()));
    assert!(
        !names.contains(&"lm_head.weight".to_string()),
        "tied head saved"
    );
    assert_eq!(
        read_json(&out.join("generation_config.json"))["eos_token_id"],
        serde_json::json!([0, 2])
    );

    let back = Model::load(&out, &LoadOptions::inference()).unwrap();
    let b = tiny_batch(&Device::Cpu);
    assert_eq!(
        max_abs_diff(&m.logits(&b).unwrap(), &back.logits(&b).unwrap()),
        0.0
    );
    let tok = Tokenizer::from_dir(&out).unwrap();
    assert!(tok.chat_template().is_some());
}

#[test]
fn value_and_reward_heads_are_saved_under_hf_names() {
    let tmp = tempfile::tempdir().unwrap();
    let b = tiny_batch(&Device::Cpu);
    let opts = LoadOptions {
        value_head_init: ValueHeadInit::Fresh { std: 0.05 },
        ..LoadOptions::training(ModelKind::Value)
    };
    let critic = Model::load(fixture("tiny-llama"), &opts).unwrap();
    let dir = tmp.path().join("critic");
    critic.save(&dir, None).unwrap();
    let cfg = read_json(&dir.join("config.json"));
    assert_eq!(cfg["architectures"][0], "LlamaForTokenClassification");
    assert_eq!(cfg["num_labels"], 1);
    let names = safetensors_names(&dir.join("model.safetensors"));
    assert!(names.contains(&"score.weight".to_string()));
    assert!(names.contains(&"score.bias".to_string()));
    assert!(!names.contains(&"lm_head.weight".to_string()));
    let reopts = LoadOptions {
        value_head_init: ValueHeadInit::FromCheckpoint,
        ..LoadOptions::inference().with_kind(ModelKind::Value)
    };
    let back = Model::load(&dir, &reopts).unwrap();
    assert!(max_abs_diff(&critic.values(&b).unwrap(), &back.values(&b).unwrap()) < 1e-5);

    let rm = Model::load(
        fixture("tiny-llama-reward"),
        &LoadOptions::inference().with_kind(ModelKind::Reward),
    )
    .unwrap();
    let dir = tmp.path().join("rm");
    rm.save(&dir, Some(&fixture("tiny-llama-reward"))).unwrap();
    let cfg = read_json(&dir.join("config.json"));
    assert_eq!(cfg["architectures"][0], "LlamaForSequenceClassification");
    assert_eq!(
        safetensors_names(&dir.join("model.safetensors"))
            .iter()
            .filter(|n| n.starts_with("score"))
            .collect::<Vec<_>>(),
        vec!["score.weight"]
    );
    let back = Model::load(&dir, &LoadOptions::inference().with_kind(ModelKind::Reward)).unwrap();
    assert_eq!(
        max_abs_diff(&rm.scores(&b).unwrap(), &back.scores(&b).unwrap()),
        0.0
    );
}

#[test]
fn training_lowers_the_loss_and_the_saved_model_has_the_new_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config(Family::Llama);
    let model = Model::random(&cfg, &LoadOptions::training(ModelKind::CausalLm)).unwrap();
    let batch = tiny_batch(&Device::Cpu);
    let vars = model.vars();
    let mut opt = AdamW::new(
        vars.clone(),
        AdamWConfig {
            lr: 1e-2,
            weight_decay: 0.01,
            ..AdamWConfig::default()
        },
    )
    .unwrap();
    let mask = batch
        .attention_mask
        .to_dtype(rlhf_model::DType::F32)
        .unwrap();
    let t = mask.dim(1).unwrap();
    let m = (mask.narrow(1, 1, t - 1).unwrap() * mask.narrow(1, 0, t - 1).unwrap()).unwrap();
    let nll = |model: &Model| -> Tensor {
        let lp = model.token_log_probs(&batch, 1.0).unwrap();
        rlhf_model::masked_mean(&lp.neg().unwrap(), &m).unwrap()
    };
    let first = nll(&model).to_scalar::<f32>().unwrap();
    for _ in 0..20 {
        let mut g = Gradients::backward(&nll(&model), &vars).unwrap();
        let norm = g.clip_global_norm(1.0).unwrap();
        assert!(norm.is_finite() && norm > 0.0);
        opt.step(&g).unwrap();
    }
    let last = nll(&model).to_scalar::<f32>().unwrap();
    assert!(last < first * 0.5, "loss went from {first} to {last}");

    let dir = tmp.path().join("trained");
    model.save(&dir, None).unwrap();
    let back = Model::load(&dir, &LoadOptions::inference()).unwrap();
    let lp_back = nll(&back).to_scalar::<f32>().unwrap();
    assert!((lp_back - last).abs() < 1e-5, "{lp_back} vs {last}");
}

#[test]
fn weight_sync_updates_a_frozen_model_in_place() {
    let cfg = tiny_config(Family::Qwen2);
    let trainer = Model::random(
        &cfg,
        &LoadOptions {
            seed: 1,
            ..LoadOptions::training(ModelKind::CausalLm)
        },
    )
    .unwrap();
    let rollout = Model::random(
        &cfg,
        &LoadOptions {
            seed: 2,
            ..LoadOptions::inference()
        },
    )
    .unwrap();
    let b = tiny_batch(&Device::Cpu);
    assert!(max_abs_diff(&trainer.logits(&b).unwrap(), &rollout.logits(&b).unwrap()) > 1e-3);
    rollout.set_weights(&trainer.named_tensors()).unwrap();
    assert!(max_abs_diff(&trainer.logits(&b).unwrap(), &rollout.logits(&b).unwrap()) < 1e-5);
    let bad = vec![(
        "model.norm.weight".to_string(),
        Tensor::zeros(3, rlhf_model::DType::F32, &Device::Cpu).unwrap(),
    )];
    let err = rollout.set_weights(&bad).unwrap_err();
    assert!(err.to_string().contains("model.norm.weight"), "{err}");
}

#[test]
fn half_precision_loads_and_stays_close_to_f32() {
    let b = tiny_batch(&Device::Cpu);
    let f32m = Model::load(fixture("tiny-llama"), &LoadOptions::inference()).unwrap();
    let want = f32m.logits(&b).unwrap();
    for dtype in [rlhf_model::DType::BF16, rlhf_model::DType::F16] {
        let m = Model::load(
            fixture("tiny-llama"),
            &LoadOptions::inference().with_dtype(dtype),
        )
        .unwrap();
        assert_eq!(m.dtype(), dtype);
        let got = m
            .logits(&b)
            .unwrap()
            .to_dtype(rlhf_model::DType::F32)
            .unwrap();
        let d = max_abs_diff(&got, &want);
        assert!(d < 0.1, "{dtype:?} logits differ from f32 by {d}");
    }
}

#[test]
fn value_heads_in_trl_and_openrlhf_layouts_are_recognised() {
    let tmp = tempfile::tempdir().unwrap();
    let b = tiny_batch(&Device::Cpu);
    let opts = LoadOptions {
        value_head_init: ValueHeadInit::Fresh { std: 0.1 },
        ..LoadOptions::inference().with_kind(ModelKind::Value)
    };
    let critic = Model::load(fixture("tiny-llama"), &opts).unwrap();
    let want = critic.values(&b).unwrap();
    for (w_name, b_name) in [
        ("v_head.summary.weight", Some("v_head.summary.bias")),
        ("value_head.weight", None),
    ] {
        let dir = tmp.path().join(w_name.replace('.', "_"));
        critic.save(&dir, None).unwrap();
        // Rewrite the weights with the head under the other library's names.
        let mut tensors = std::collections::HashMap::new();
        for (n, t) in critic.named_tensors() {
            let n = match n.as_str() {
                "score.weight" => w_name.to_string(),
                "score.bias" => match b_name {
                    Some(bn) => bn.to_string(),
                    None => continue,
                },
                _ => n,
            };
            tensors.insert(n, t);
        }
        let bias = critic
            .named_tensors()
            .into_iter()
            .find(|(n, _)| n == "score.bias")
            .unwrap()
            .1;
        candle_core_save(&tensors, &dir.join("model.safetensors"));
        let back = Model::load(
            &dir,
            &LoadOptions {
                value_head_init: ValueHeadInit::FromCheckpoint,
                ..LoadOptions::inference().with_kind(ModelKind::Value)
            },
        )
        .unwrap();
        let got = back.values(&b).unwrap();
        // Without a bias tensor the head's bias starts at zero.
        let expected = if b_name.is_some() {
            want.clone()
        } else {
            want.broadcast_sub(&bias.to_dtype(rlhf_model::DType::F32).unwrap())
                .unwrap()
        };
        assert!(max_abs_diff(&got, &expected) < 1e-5, "{w_name}");
    }
}

fn candle_core_save(tensors: &std::collections::HashMap<String, Tensor>, path: &std::path::Path) {
    let list: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    rlhf_model::weights::save_safetensors(&list, path).unwrap();
}

#[test]
fn models_can_move_to_a_compute_thread() {
    fn assert_send<T: Send>() {}
    assert_send::<Model>();
    assert_send::<Tokenizer>();
    assert_send::<AdamW>();
}

#[test]
fn parameter_count_and_memory_estimate_match_the_loaded_models() {
    for name in ["tiny-llama", "tiny-qwen2", "tiny-llama3-rope"] {
        let m = Model::load(fixture(name), &LoadOptions::inference()).unwrap();
        assert_eq!(m.config().num_params(), m.params().num_params(), "{name}");
        let est = m
            .config()
            .memory_estimate(rlhf_model::DType::BF16, false, 4, 100);
        assert_eq!(est.weights, 2 * m.params().num_params());
        // 2 (k, v) * 2 layers * 2 KV heads * 16 head dim * 2 bytes.
        assert_eq!(est.kv_cache_per_token, 2 * 2 * 2 * 16 * 2);
        assert_eq!(est.kv_cache, 400 * est.kv_cache_per_token);
        let train = m
            .config()
            .memory_estimate(rlhf_model::DType::F32, true, 4, 100);
        assert_eq!(train.optimizer, 8 * m.params().num_params());
        assert!(train.total() > est.total());
        assert!(
            m.config()
                .memory_estimate(rlhf_model::DType::F32, true, 8, 100)
                .activations
                > train.activations
        );
    }
}

/// A critic started from a reward model trains exactly the reward model's parameters: its
/// score head has no bias, so none is added (AdamW would move it), and the saved critic holds
/// the same tensor names as the source, in TRL's value-model layout.
#[test]
fn critic_from_a_reward_model_trains_and_saves_exactly_its_parameters() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("tiny-llama-reward");
    let opts = LoadOptions {
        value_head_init: ValueHeadInit::FromCheckpoint,
        ..LoadOptions::training(ModelKind::Value)
    };
    let critic = Model::load(&src, &opts).unwrap();
    let mut trained: Vec<String> = critic.vars().into_iter().map(|(n, _)| n).collect();
    trained.sort();
    let source = safetensors_names(&src.join("model.safetensors"));
    assert_eq!(
        trained, source,
        "trainable parameters = the checkpoint's tensors"
    );
    let dir = tmp.path().join("critic");
    critic.save(&dir, None).unwrap();
    assert_eq!(safetensors_names(&dir.join("model.safetensors")), source);
    let cfg = read_json(&dir.join("config.json"));
    assert_eq!(cfg["architectures"][0], "LlamaForSequenceClassification");
    // It loads back as a critic with the same values (inference kernels vs training ones).
    let back = Model::load(
        &dir,
        &LoadOptions {
            value_head_init: ValueHeadInit::FromCheckpoint,
            ..LoadOptions::inference().with_kind(ModelKind::Value)
        },
    )
    .unwrap();
    let b = tiny_batch(&Device::Cpu);
    assert!(max_abs_diff(&critic.values(&b).unwrap(), &back.values(&b).unwrap()) < 1e-5);
}
