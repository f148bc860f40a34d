//! LoRA adapters against the real `peft` (tests/fixtures/lora/, written by
//! scripts/lora_fixtures.py): PEFT's adapters load and give PEFT's logits, values and merged
//! model; what we save is what PEFT saves; only the adapters train, with gradients that match
//! finite differences; the base stays frozen, bit for bit.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;

use common::grad::{finite_difference_check, loss};
use common::{
    batch_from, fixture, max_abs_diff, reference, tiny_batch, tiny_config, to_vec2, to_vec3,
};
use rlhf_model::lora::{ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE};
use rlhf_model::{
    AdamW, AdamWConfig, Batch, DType, Device, Family, Gradients, LoadOptions, LoraConfig, Model,
    ModelKind, Tensor,
};

fn lora_fixture(name: &str) -> PathBuf {
    fixture("lora").join(name)
}

/// `<key>` of lora/reference.safetensors.
fn expected(key: &str) -> Tensor {
    let (tensors, _) =
        rlhf_model::weights::load_safetensors(&lora_fixture("reference.safetensors"), &Device::Cpu)
            .unwrap();
    tensors
        .into_iter()
        .find(|(n, _)| n == key)
        .unwrap_or_else(|| panic!("{key} not in lora/reference.safetensors"))
        .1
}

/// Max |a - b| over the positions that are real tokens.
fn max_diff_3d(a: &Tensor, b: &Tensor, mask: &[Vec<u32>]) -> f32 {
    let (a, b) = (to_vec3(a), to_vec3(b));
    let mut m = 0f32;
    for (i, row) in mask.iter().enumerate() {
        for (t, &on) in row.iter().enumerate() {
            if on == 1 {
                for (x, y) in a[i][t].iter().zip(&b[i][t]) {
                    m = m.max((x - y).abs());
                }
            }
        }
    }
    m
}

fn check_lm_adapter(base: &str, opts: &LoadOptions) {
    let reference = reference();
    let (batch, mask) = batch_from(&reference["models"][base]);
    let adapter = lora_fixture(&format!("{base}-adapter"));
    let model = Model::load_with_adapter(&fixture(base), &adapter, opts).unwrap();
    let d = max_diff_3d(
        &model.logits(&batch).unwrap(),
        &expected(&format!("{base}.logits")),
        &mask,
    );
    println!(
        "{base} ({:?}): logits with adapter, max abs diff {d:e}",
        model.kernels()
    );
    assert!(
        d <= 1e-4,
        "{base}: logits with the adapter differ from PEFT's by {d}"
    );
    // The adapter changes the outputs: the comparison above is not the base's by accident.
    let base_logits = expected(&format!("{base}.base_logits"));
    let off = model.with_adapter_disabled(|m| m.logits(&batch)).unwrap();
    let d = max_diff_3d(&off, &base_logits, &mask);
    println!("{base}: logits with the adapter off, max abs diff {d:e}");
    assert!(
        d <= 1e-4,
        "{base}: adapter-off logits differ from PEFT's base by {d}"
    );
    let moved = max_diff_3d(&model.logits(&batch).unwrap(), &base_logits, &mask);
    assert!(
        moved > 1e-2,
        "{base}: the adapter moves the logits by only {moved}"
    );
    assert!(
        model.adapter_enabled(),
        "the adapter is back on after the closure"
    );
}

#[test]
fn peft_adapters_give_peft_logits_in_every_kernel_set() {
    for base in ["tiny-llama", "tiny-qwen2"] {
        check_lm_adapter(base, &LoadOptions::inference());
        check_lm_adapter(base, &LoadOptions::training(ModelKind::CausalLm));
        check_lm_adapter(
            base,
            &LoadOptions {
                composite_ops: true,
                ..LoadOptions::training(ModelKind::CausalLm)
            },
        );
    }
}

#[test]
fn merged_model_gives_peft_merged_logits() {
    let reference = reference();
    for base in ["tiny-llama", "tiny-qwen2"] {
        let (batch, mask) = batch_from(&reference["models"][base]);
        let adapter = lora_fixture(&format!("{base}-adapter"));
        let model =
            Model::load_with_adapter(&fixture(base), &adapter, &LoadOptions::inference()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        model.merged_image(None).unwrap().write(dir.path()).unwrap();
        assert!(!dir.path().join(ADAPTER_CONFIG_FILE).exists());
        let merged = Model::load(dir.path(), &LoadOptions::inference()).unwrap();
        assert!(merged.lora().is_none());
        let names: Vec<String> = merged.vars().into_iter().map(|(n, _)| n).collect();
        assert!(names.iter().all(|n| !n.contains("lora_")), "{names:?}");
        let d = max_diff_3d(
            &merged.logits(&batch).unwrap(),
            &expected(&format!("{base}.merged_logits")),
            &mask,
        );
        println!("{base}: merged model logits, max abs diff {d:e}");
        assert!(d <= 1e-4, "{base}: merged logits differ from PEFT's by {d}");
    }
}

#[test]
fn critic_adapter_with_score_head_gives_peft_values() {
    let reference = reference();
    let (batch, mask) = batch_from(&reference["models"]["tiny-llama"]);
    let adapter = lora_fixture("tiny-llama-critic-adapter");
    let opts = LoadOptions::training(ModelKind::Value);
    let model = Model::load_with_adapter(&fixture("tiny-llama"), &adapter, &opts).unwrap();
    let trained: BTreeSet<String> = model.vars().into_iter().map(|(n, _)| n).collect();
    assert!(trained.contains("score.weight") && trained.contains("score.bias"));
    let got = to_vec2(&model.values(&batch).unwrap());
    let want = to_vec2(&expected("critic.values"));
    let mut d = 0f32;
    for (i, row) in mask.iter().enumerate() {
        for (t, &on) in row.iter().enumerate() {
            if on == 1 {
                d = d.max((got[i][t] - want[i][t]).abs());
            }
        }
    }
    println!("critic adapter: values max abs diff {d:e}");
    assert!(d <= 1e-4, "critic values differ from PEFT's by {d}");
}

/// The keys and the config PEFT reads are the ones PEFT wrote.
#[test]
fn saved_adapter_is_what_peft_saves() {
    for (base, adapter, kind) in [
        ("tiny-llama", "tiny-llama-adapter", ModelKind::CausalLm),
        ("tiny-qwen2", "tiny-qwen2-adapter", ModelKind::CausalLm),
        ("tiny-llama", "tiny-llama-critic-adapter", ModelKind::Value),
    ] {
        let src = lora_fixture(adapter);
        let opts = LoadOptions::training(kind);
        let model = Model::load_with_adapter(&fixture(base), &src, &opts).unwrap();
        let dir = tempfile::tempdir().unwrap();
        model.image(None).unwrap().write(dir.path()).unwrap();
        assert!(!dir.path().join("model.safetensors").exists());
        let read = |d: &std::path::Path| {
            rlhf_model::weights::load_safetensors(&d.join(ADAPTER_WEIGHTS_FILE), &Device::Cpu)
                .unwrap()
        };
        let (ours, meta) = read(dir.path());
        let (theirs, _) = read(&src);
        assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
        let names = |v: &[(String, Tensor)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&ours), names(&theirs), "{adapter}: tensor names");
        for ((n, a), (_, b)) in ours.iter().zip(&theirs) {
            assert_eq!(max_abs_diff(a, b), 0.0, "{adapter}: {n} changed");
        }
        let (ours, theirs) = (adapter_config(dir.path()), adapter_config(&src));
        for key in [
            "peft_type",
            "task_type",
            "r",
            "use_rslora",
            "use_dora",
            "bias",
            "fan_in_fan_out",
            "lora_dropout",
        ] {
            assert_eq!(ours[key], theirs[key], "{adapter}: {key}");
        }
        assert_eq!(ours["lora_alpha"].as_f64(), theirs["lora_alpha"].as_f64());
        assert_eq!(
            target_modules(&ours),
            target_modules(&theirs),
            "{adapter}: target_modules"
        );
        let to_save = |v: &serde_json::Value| -> Vec<String> {
            let mut s: Vec<String> = v["modules_to_save"]
                .as_array()
                .map(|a| a.iter().map(|x| x.as_str().unwrap().to_string()).collect())
                .unwrap_or_default();
            s.retain(|m| m == "score");
            s
        };
        assert_eq!(
            to_save(&ours),
            to_save(&theirs),
            "{adapter}: modules_to_save"
        );
        // And it loads back into the same numbers.
        let again = Model::load_with_adapter(&fixture(base), dir.path(), &opts).unwrap();
        let batch = tiny_batch_for(&again);
        if kind == ModelKind::CausalLm {
            let d = max_abs_diff(
                &model.logits(&batch).unwrap(),
                &again.logits(&batch).unwrap(),
            );
            assert_eq!(d, 0.0, "{adapter}: reloaded logits differ");
        }
    }
}

/// A saved adapter's adapter_config.json.
fn adapter_config(dir: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join(ADAPTER_CONFIG_FILE)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Its `target_modules`, sorted.
fn target_modules(cfg: &serde_json::Value) -> Vec<String> {
    let mut s: Vec<String> = cfg["target_modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().to_string())
        .collect();
    s.sort();
    s
}

fn tiny_batch_for(model: &Model) -> Batch {
    let v = model.config().vocab_size as u32;
    let seqs = vec![vec![3, 9 % v, 12 % v, 40 % v], vec![7, 8, 20 % v]];
    Batch::left_padded(&seqs, 0, &Device::Cpu).unwrap()
}

fn lora_model(dtype: DType, targets: &[&str], kind: ModelKind, composite: bool) -> Model {
    let cfg = tiny_config(Family::Qwen2);
    let opts = LoadOptions {
        dtype,
        composite_ops: composite,
        seed: 7,
        lora: Some(LoraConfig::new(2, 4.0, targets)),
        ..LoadOptions::training(kind)
    };
    let model = Model::random(&cfg, &opts).unwrap();
    randomize_lora_b(&model);
    model
}

/// PEFT starts B at zero (the adapter is a no-op and A gets no gradient): fixed random Bs.
fn randomize_lora_b(model: &Model) {
    let named: Vec<(String, Tensor)> = model
        .vars()
        .into_iter()
        .filter(|(n, _)| n.contains("lora_B"))
        .enumerate()
        .map(|(i, (n, v))| {
            let (o, r) = v.dims2().unwrap();
            let w = common::grad::weights((o, r), v.dtype(), 100 + i as u64, &Device::Cpu);
            (n, (w * 0.2).unwrap())
        })
        .collect();
    model.set_weights(&named).unwrap();
}

/// LoRA on q/k/v/o of a committed checkpoint, in f64, checked against itself where PEFT's
/// numbers are not there (tiny-qwen3's q/k norms sit between q_proj/k_proj and RoPE): only
/// the adapters are variables and each gets a gradient that matches finite differences; with
/// the adapter off the model is the checkpoint; the merged model computes what the adapted
/// one does; and the saved adapter is PEFT-shaped and loads back to the same logits.
fn lora_on_checkpoint(base: &str) {
    let targets = ["q_proj", "k_proj", "v_proj", "o_proj"];
    let f64_opts = |lora| LoadOptions {
        dtype: DType::F64,
        lora,
        ..LoadOptions::training(ModelKind::CausalLm)
    };
    let opts = f64_opts(Some(LoraConfig::new(4, 8.0, &targets)));
    let model = Model::load(fixture(base), &opts).unwrap();
    randomize_lora_b(&model);
    let vars = model.vars();
    let names: Vec<&str> = vars.iter().map(|(n, _)| n.as_str()).collect();
    let layers = model.config().num_hidden_layers;
    assert_eq!(names.len(), layers * targets.len() * 2, "{base}: {names:?}");
    assert!(
        names.iter().all(|n| targets
            .iter()
            .any(|t| n.contains(&format!("self_attn.{t}.lora_")))),
        "{base}: {names:?}"
    );
    let batch = tiny_batch(&Device::Cpu);
    let grads = Gradients::backward(&loss(&model, &batch), &vars).unwrap();
    for (n, _) in &vars {
        let g = grads
            .get(n)
            .unwrap_or_else(|| panic!("{base} {n}: no gradient"));
        let norm = g
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert!(
            norm.is_finite() && norm > 0.0,
            "{base} {n}: gradient norm {norm}"
        );
    }
    let picks: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| n.contains("layers.1."))
        .collect();
    let worst = finite_difference_check(&model, &batch, &picks);
    println!("{base}: LoRA q/k/v/o gradients, worst relative error {worst:e}");

    let logits = model.logits(&batch).unwrap();
    let plain = Model::load(fixture(base), &f64_opts(None)).unwrap();
    let off = model.with_adapter_disabled(|m| m.logits(&batch)).unwrap();
    let d = max_abs_diff(&off, &plain.logits(&batch).unwrap());
    assert!(
        d <= 1e-12,
        "{base}: adapter-off logits differ from the checkpoint's by {d}"
    );
    let moved = max_abs_diff(&logits, &off);
    assert!(
        moved > 1e-3,
        "{base}: the adapter moves the logits by only {moved}"
    );

    let dir = tempfile::tempdir().unwrap();
    let merged_dir = dir.path().join("merged");
    model
        .merged_image(None)
        .unwrap()
        .write(&merged_dir)
        .unwrap();
    let merged = Model::load(&merged_dir, &f64_opts(None)).unwrap();
    let d = max_abs_diff(&merged.logits(&batch).unwrap(), &logits);
    println!("{base}: merged against adapted logits, max abs diff {d:e}");
    assert!(
        d <= 1e-10,
        "{base}: the merged model's logits differ by {d}"
    );

    let saved = dir.path().join("adapter");
    model.image(None).unwrap().write(&saved).unwrap();
    assert_eq!(
        target_modules(&adapter_config(&saved)),
        ["k_proj", "o_proj", "q_proj", "v_proj"],
        "{base}"
    );
    let again = Model::load_with_adapter(&fixture(base), &saved, &opts).unwrap();
    let d = max_abs_diff(&again.logits(&batch).unwrap(), &logits);
    assert_eq!(
        d, 0.0,
        "{base}: the reloaded adapter's logits differ by {d}"
    );
}

/// Qwen3 takes LoRA as Qwen2 does (both on their committed checkpoints).
#[test]
fn lora_on_qwen3_trains_merges_and_round_trips_as_on_qwen2() {
    for base in ["tiny-qwen2", "tiny-qwen3"] {
        lora_on_checkpoint(base);
    }
}

#[test]
fn only_adapters_train_and_their_gradients_match_finite_differences() {
    let all = ["all-linear"];
    for (kind, composite) in [
        (ModelKind::CausalLm, false),
        (ModelKind::CausalLm, true),
        (ModelKind::Value, false),
    ] {
        let model = lora_model(DType::F64, &all, kind, composite);
        let vars = model.vars();
        let names: Vec<&str> = vars.iter().map(|(n, _)| n.as_str()).collect();
        // 2 layers x 7 linear layers x (A, B), plus the value head.
        let head = if kind == ModelKind::Value { 2 } else { 0 };
        assert_eq!(names.len(), 2 * 7 * 2 + head, "{names:?}");
        assert!(names
            .iter()
            .all(|n| n.contains(".lora_A.") || n.contains(".lora_B.") || n.starts_with("score.")));
        let batch = tiny_batch(&Device::Cpu);
        let grads = Gradients::backward(&loss(&model, &batch), &vars).unwrap();
        for (n, _) in &vars {
            let g = grads.get(n).unwrap_or_else(|| panic!("{n}: no gradient"));
            let norm = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            assert!(norm.is_finite() && norm > 0.0, "{n}: gradient norm {norm}");
        }
        let picks: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| n.contains("layers.1.") || n.starts_with("score."))
            .collect();
        let worst = finite_difference_check(&model, &batch, &picks);
        println!("{kind:?} composite={composite}: worst relative error {worst:e}");
    }
}

#[test]
fn an_optimizer_step_moves_adapters_and_leaves_the_base_bit_for_bit() {
    let model = lora_model(
        DType::F32,
        &["q_proj", "v_proj"],
        ModelKind::CausalLm,
        false,
    );
    let base: Vec<(String, Tensor)> = model
        .params()
        .vars()
        .into_iter()
        .filter(|(n, _)| model.params().is_base(n))
        .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
        .collect();
    assert!(base
        .iter()
        .any(|(n, _)| n == "model.layers.0.self_attn.q_proj.weight"));
    let before: Vec<Tensor> = model
        .vars()
        .iter()
        .map(|(_, v)| v.as_tensor().copy().unwrap())
        .collect();
    let batch = tiny_batch(&Device::Cpu);
    let vars = model.vars();
    let mut opt = AdamW::new(vars.clone(), AdamWConfig::default()).unwrap();
    for _ in 0..2 {
        let grads = Gradients::backward(&loss(&model, &batch), &vars).unwrap();
        opt.step(&grads).unwrap();
    }
    for ((n, v), b) in vars.iter().zip(&before) {
        assert!(max_abs_diff(v.as_tensor(), b) > 0.0, "{n} did not move");
    }
    for (n, b) in &base {
        let now = model.params().get(n).unwrap().as_tensor();
        assert_eq!(max_abs_diff(now, b), 0.0, "base {n} moved");
    }
}

#[test]
fn mixed_precision_keeps_the_base_in_bf16_and_adapters_in_f32() {
    let cfg = tiny_config(Family::Llama);
    let opts = LoadOptions {
        lora: Some(LoraConfig::new(4, 8.0, &["q_proj", "v_proj"])),
        ..LoadOptions::training(ModelKind::CausalLm).with_bf16(true)
    };
    let model = Model::random(&cfg, &opts).unwrap();
    let p = model.params();
    assert_eq!(
        p.get("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .dtype(),
        DType::BF16
    );
    for (n, v) in model.vars() {
        assert_eq!(v.dtype(), DType::F32, "{n}");
    }
    let full = Model::random(
        &cfg,
        &LoadOptions::training(ModelKind::CausalLm).with_bf16(true),
    )
    .unwrap();
    let bytes = |m: &Model| -> usize {
        m.params()
            .vars()
            .iter()
            .map(|(_, v)| v.elem_count() * v.dtype().size_in_bytes())
            .sum()
    };
    println!(
        "bf16 LoRA model: {} bytes of parameters, full f32 master: {}",
        bytes(&model),
        bytes(&full)
    );
    assert!(
        bytes(&model) * 10 < bytes(&full) * 6,
        "the frozen base is not in bf16"
    );
    let batch = tiny_batch(&Device::Cpu);
    let grads = Gradients::backward(&loss(&model, &batch), &model.vars()).unwrap();
    assert!(grads
        .get("model.layers.1.self_attn.v_proj.lora_B.weight")
        .is_some());
}

#[test]
fn checkpointed_lora_gradients_equal_plain_ones() {
    let cfg = tiny_config(Family::Llama);
    let mk = |ckpt: bool| {
        let opts = LoadOptions {
            dtype: DType::F64,
            gradient_checkpointing: ckpt,
            lora: Some(LoraConfig::new(2, 2.0, &["all-linear"])),
            seed: 3,
            ..LoadOptions::training(ModelKind::CausalLm)
        };
        let m = Model::random(&cfg, &opts).unwrap();
        let b: Vec<(String, Tensor)> = m
            .vars()
            .into_iter()
            .filter(|(n, _)| n.contains("lora_B"))
            .map(|(n, v)| {
                let (o, r) = v.dims2().unwrap();
                (
                    n,
                    common::grad::weights((o, r), DType::F64, 5, &Device::Cpu),
                )
            })
            .collect();
        m.set_weights(&b).unwrap();
        m
    };
    let (plain, ckpt) = (mk(false), mk(true));
    let batch = tiny_batch(&Device::Cpu);
    let g1 = Gradients::backward(&loss(&plain, &batch), &plain.vars()).unwrap();
    let g2 = Gradients::backward(&loss(&ckpt, &batch), &ckpt.vars()).unwrap();
    for (n, _) in plain.vars() {
        let d = max_abs_diff(g1.get(&n).unwrap(), g2.get(&n).unwrap());
        assert!(d <= 1e-10, "{n}: checkpointed gradient differs by {d}");
    }
}

/// The frozen base joins the graph (the adapters' inputs flow through it) but gets no
/// gradient: candle's matmul backward would compute a weight-sized one for every frozen
/// linear layer and the LM head, held until the backward ends.
#[test]
fn the_frozen_base_gets_no_gradient_computed() {
    for chunk in [None, Some(3)] {
        let opts = LoadOptions {
            dtype: DType::F64,
            logits_chunk: chunk,
            lora: Some(LoraConfig::new(2, 4.0, &["q_proj", "v_proj"])),
            ..LoadOptions::training(ModelKind::CausalLm)
        };
        let model = Model::random(&tiny_config(Family::Llama), &opts).unwrap();
        let batch = tiny_batch(&Device::Cpu);
        let lp = model.token_log_probs(&batch, 1.0).unwrap();
        let store = lp.sum_all().unwrap().backward().unwrap();
        let p = model.params();
        let mut frozen = 0;
        for (n, v) in p.vars() {
            if p.is_base(&n) {
                frozen += v.elem_count();
            } else {
                assert!(store.get(v.as_tensor()).is_some(), "{n}: no gradient");
            }
        }
        // What the backward left in the store: the adapters' gradients and small leftovers
        // (masks, constants), not a gradient per frozen weight.
        let held: usize = store
            .get_ids()
            .filter_map(|&id| store.get_id(id))
            .map(|g| g.elem_count())
            .sum();
        println!(
            "chunk {chunk:?}: the backward holds {held} gradient values; the base has {frozen}"
        );
        assert!(
            held * 2 < frozen,
            "{held} gradient values held for a base of {frozen}"
        );
    }
}

#[test]
fn bad_adapters_are_refused_with_the_reason() {
    let inference = LoadOptions::inference();
    // Our adapter, trained on tiny-llama, put on tiny-qwen2 (same shapes): the base
    // fingerprint in its header tells them apart.
    let ours = tempfile::tempdir().unwrap();
    let src = lora_fixture("tiny-llama-adapter");
    Model::load_with_adapter(&fixture("tiny-llama"), &src, &inference)
        .unwrap()
        .image(None)
        .unwrap()
        .write(ours.path())
        .unwrap();
    let e = Model::load_with_adapter(&fixture("tiny-qwen2"), ours.path(), &inference)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("trained on another base model"), "{e}");
    assert!(!e.contains("  "), "the message has a run of spaces: {e}");
    // A tensor of the wrong shape is named with its file.
    let bad = tempfile::tempdir().unwrap();
    std::fs::copy(
        src.join(ADAPTER_CONFIG_FILE),
        bad.path().join(ADAPTER_CONFIG_FILE),
    )
    .unwrap();
    let (mut tensors, _) =
        rlhf_model::weights::load_safetensors(&src.join(ADAPTER_WEIGHTS_FILE), &Device::Cpu)
            .unwrap();
    tensors[0].1 = Tensor::zeros((3, 3), DType::F32, &Device::Cpu).unwrap();
    rlhf_model::weights::save_safetensors(&tensors, &bad.path().join(ADAPTER_WEIGHTS_FILE))
        .unwrap();
    let e = Model::load_with_adapter(&fixture("tiny-llama"), bad.path(), &inference)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains(&tensors[0].0) && e.contains("shape"), "{e}");
    // A full model cannot take an adapter.
    let full = Model::load(fixture("tiny-llama"), &inference).unwrap();
    let e = full
        .load_adapter(&lora_fixture("tiny-llama-adapter"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("without LoRA"), "{e}");
    assert!(full
        .with_adapter_disabled(|_| Ok::<(), rlhf_model::Error>(()))
        .is_err());
    // Settings that differ from the adapter's.
    let other = LoadOptions {
        lora: Some(LoraConfig::new(8, 8.0, &["q_proj"])),
        ..LoadOptions::inference()
    };
    let m = Model::load(fixture("tiny-llama"), &other).unwrap();
    let e = m
        .load_adapter(&lora_fixture("tiny-llama-adapter"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("r=4") && e.contains("r=8"), "{e}");
    // A missing tensor is named, and nothing changes.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        src.join(ADAPTER_CONFIG_FILE),
        dir.path().join(ADAPTER_CONFIG_FILE),
    )
    .unwrap();
    let (mut tensors, _) =
        rlhf_model::weights::load_safetensors(&src.join(ADAPTER_WEIGHTS_FILE), &Device::Cpu)
            .unwrap();
    let dropped = tensors.remove(3).0;
    rlhf_model::weights::save_safetensors(&tensors, &dir.path().join(ADAPTER_WEIGHTS_FILE))
        .unwrap();
    let m = Model::load(
        fixture("tiny-llama"),
        &LoadOptions {
            lora: Some(LoraConfig::from_adapter_dir(&src).unwrap().0),
            ..LoadOptions::inference()
        },
    )
    .unwrap();
    let e = m.load_adapter(dir.path()).unwrap_err().to_string();
    assert!(e.contains(&dropped), "{e}");
    let zero = m
        .vars()
        .into_iter()
        .filter(|(n, _)| n.contains("lora_B"))
        .all(|(_, v)| max_abs_diff(v.as_tensor(), &v.as_tensor().zeros_like().unwrap()) == 0.0);
    assert!(zero, "a refused adapter changed the weights");
    // Targets that match nothing, and unsupported PEFT options.
    let e = Model::random(
        &tiny_config(Family::Llama),
        &LoadOptions {
            lora: Some(LoraConfig::new(2, 2.0, &["qkv_proj"])),
            ..LoadOptions::inference()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("qkv_proj") && e.contains("matches no linear layer"),
        "{e}"
    );
    let dora = tempfile::tempdir().unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join(ADAPTER_CONFIG_FILE)).unwrap())
            .unwrap();
    cfg["use_dora"] = serde_json::json!(true);
    std::fs::write(dora.path().join(ADAPTER_CONFIG_FILE), cfg.to_string()).unwrap();
    let e = LoraConfig::from_adapter_dir(dora.path())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("use_dora") && e.contains(ADAPTER_CONFIG_FILE),
        "{e}"
    );
}
