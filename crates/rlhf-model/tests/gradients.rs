//! Backward through every layer: all trainable parameters get finite nonzero gradients, and the
//! gradients match central finite differences (f64) for each layer type.

mod common;

use common::grad::{finite_difference_check, loss, BODY};
use common::{devices, tiny_batch, tiny_config};
use rlhf_model::{DType, Device, Family, Gradients, LoadOptions, Model, ModelKind, ValueHeadInit};

fn opts(kind: ModelKind, dtype: DType) -> LoadOptions {
    LoadOptions {
        value_head_init: ValueHeadInit::Fresh { std: 0.1 },
        seed: 7,
        ..LoadOptions::training(kind).with_dtype(dtype)
    }
}

/// Both differentiable paths: this crate's fused kernels (CPU or CUDA) and candle's primitive
/// ops.
fn both_paths(kind: ModelKind, dtype: DType) -> [LoadOptions; 2] {
    let fused = opts(kind, dtype);
    let composite = LoadOptions {
        composite_ops: true,
        ..fused.clone()
    };
    [fused, composite]
}

fn check_all_params_get_gradients(family: Family, kind: ModelKind) {
    let cfg = tiny_config(family);
    let cfg = if family == Family::Qwen2 {
        cfg.with_key("tie_word_embeddings", serde_json::json!(true))
            .unwrap()
    } else {
        cfg
    };
    for o in both_paths(kind, DType::F32) {
        check_params_of(&Model::random(&cfg, &o).unwrap(), family, kind);
    }
}

fn check_params_of(model: &Model, family: Family, kind: ModelKind) {
    let batch = tiny_batch(&Device::Cpu);
    let vars = model.vars();
    let grads = Gradients::backward(&loss(model, &batch), &vars).unwrap();
    let missing = grads.missing(&vars);
    assert!(
        missing.is_empty(),
        "{family:?} {kind:?}: no gradient for {missing:?}"
    );
    grads.check_finite().unwrap();
    for (name, g) in grads.iter() {
        let max = g
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(
            max > 0.0,
            "{family:?} {kind:?}: gradient of {name} is all zeros"
        );
    }
    // Qwen2 adds q/k/v biases; check they were among the parameters.
    let has_bias = vars.iter().any(|(n, _)| n.ends_with("q_proj.bias"));
    assert_eq!(has_bias, family == Family::Qwen2);
    println!(
        "{family:?} {kind:?}: {} parameters, all with gradients",
        vars.len()
    );
}

#[test]
fn every_parameter_gets_a_finite_nonzero_gradient() {
    for family in [Family::Llama, Family::Qwen2, Family::Qwen3] {
        for kind in [ModelKind::CausalLm, ModelKind::Value, ModelKind::Reward] {
            check_all_params_get_gradients(family, kind);
        }
    }
}

#[test]
fn gradients_match_finite_differences_llama() {
    let cfg = tiny_config(Family::Llama);
    let mut names = BODY.to_vec();
    names.push("lm_head.weight");
    fd_causal("llama causal LM", &cfg, &names);
}

/// Finite differences of `names` for `cfg`'s causal LM on every device and kernel path.
fn fd_causal(label: &str, cfg: &rlhf_model::Config, names: &[&str]) {
    for device in devices() {
        let batch = tiny_batch(&device);
        for o in both_paths(ModelKind::CausalLm, DType::F64) {
            let model = Model::random(cfg, &o.with_device(device.clone())).unwrap();
            let worst = finite_difference_check(&model, &batch, names);
            println!(
                "{label} {device:?} {:?}: worst relative error {worst:e}",
                model.kernels()
            );
        }
    }
}

#[test]
fn gradients_match_finite_differences_qwen3_qk_norms() {
    // head_dim 8 with 4 heads on hidden 16: not hidden / heads, as in Qwen3-0.6B.
    let cfg = tiny_config(Family::Qwen3)
        .with_key("head_dim", serde_json::json!(8))
        .unwrap();
    assert!(cfg.qk_norm && cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size);
    let mut names = BODY.to_vec();
    names.extend([
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.1.self_attn.k_norm.weight",
        "lm_head.weight",
    ]);
    fd_causal("qwen3 causal LM", &cfg, &names);
}

#[test]
fn gradients_match_finite_differences_qwen2_biases_and_tied_head() {
    let cfg = tiny_config(Family::Qwen2)
        .with_key("tie_word_embeddings", serde_json::json!(true))
        .unwrap();
    let mut names = BODY.to_vec();
    names.extend([
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.bias",
    ]);
    fd_causal("qwen2 causal LM (tied)", &cfg, &names);
}

#[test]
fn gradients_match_finite_differences_value_and_score_heads() {
    let cfg = tiny_config(Family::Llama);
    for device in devices() {
        let batch = tiny_batch(&device);
        for [co, ro] in both_paths(ModelKind::Value, DType::F64)
            .into_iter()
            .zip(both_paths(ModelKind::Reward, DType::F64))
            .map(|(a, b)| [a, b])
        {
            let critic = Model::random(&cfg, &co.with_device(device.clone())).unwrap();
            let w1 = finite_difference_check(
                &critic,
                &batch,
                &[
                    "score.weight",
                    "score.bias",
                    "model.layers.1.mlp.down_proj.weight",
                    "model.norm.weight",
                ],
            );
            let reward = Model::random(&cfg, &ro.with_device(device.clone())).unwrap();
            let w2 = finite_difference_check(
                &reward,
                &batch,
                &[
                    "score.weight",
                    "model.embed_tokens.weight",
                    "model.layers.0.self_attn.v_proj.weight",
                ],
            );
            println!(
                "{device:?} {:?}: value head worst relative error {w1:e}; score head {w2:e}",
                critic.kernels()
            );
        }
    }
}

#[test]
fn frozen_models_build_no_autograd_graph() {
    let cfg = tiny_config(Family::Llama);
    let model = Model::random(&cfg, &LoadOptions::inference()).unwrap();
    assert!(!model.is_trainable());
    let batch = tiny_batch(&Device::Cpu);
    let logits = model.logits(&batch).unwrap();
    let vars = model.vars();
    let grads = Gradients::backward(&logits.sum_all().unwrap(), &vars).unwrap();
    assert!(grads.is_empty(), "a frozen model produced gradients");
}

#[test]
fn trainable_and_fast_paths_agree() {
    let cfg = tiny_config(Family::Qwen2);
    let batch = tiny_batch(&Device::Cpu);
    let fast = Model::random(&cfg, &LoadOptions::inference()).unwrap();
    let b = fast.logits(&batch).unwrap();
    for o in both_paths(ModelKind::CausalLm, DType::F32) {
        let slow = Model::random(&cfg, &LoadOptions { seed: 0, ..o }).unwrap();
        let a = slow.logits(&batch).unwrap();
        let d = max_abs_diff(&a, &b);
        assert!(
            d < 1e-5,
            "{:?} and inference paths differ by {d}",
            slow.kernels()
        );
    }
}

#[test]
fn bf16_training_uses_composite_ops_and_updates_weights() {
    let cfg = tiny_config(Family::Qwen2);
    let model = Model::random(&cfg, &opts(ModelKind::CausalLm, DType::BF16)).unwrap();
    assert_eq!(model.kernels(), rlhf_model::Kernels::Composite);
    let batch = tiny_batch(&Device::Cpu);
    let vars = model.vars();
    let grads = Gradients::backward(&loss(&model, &batch), &vars).unwrap();
    assert!(grads.missing(&vars).is_empty());
    grads.check_finite().unwrap();
    // Copies: named tensors share storage with the parameters, which update in place.
    let before: Vec<_> = model
        .named_tensors()
        .into_iter()
        .map(|(n, t)| (n, t.copy().unwrap()))
        .collect();
    let mut opt = rlhf_model::AdamW::new(
        vars,
        rlhf_model::AdamWConfig {
            lr: 1e-2,
            ..Default::default()
        },
    )
    .unwrap();
    opt.step(&grads).unwrap();
    let after = model.named_tensors();
    let changed = before
        .iter()
        .zip(&after)
        .filter(|((_, a), (_, b))| max_abs_diff(a, b) > 0.0)
        .count();
    assert_eq!(
        changed,
        before.len(),
        "every bf16 parameter moves after a step"
    );
}

/// Max |a - b| over every element, in f32.
fn max_abs_diff(a: &rlhf_model::Tensor, b: &rlhf_model::Tensor) -> f32 {
    let a = a.to_dtype(DType::F32).unwrap();
    let b = b.to_dtype(DType::F32).unwrap();
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Max |a - b| over max |b| (or the absolute difference where b is all zeros).
fn rel_diff(a: &rlhf_model::Tensor, b: &rlhf_model::Tensor) -> f32 {
    let d = max_abs_diff(a, b);
    let m = max_abs_diff(b, &b.zeros_like().unwrap());
    if m > 0.0 {
        d / m
    } else {
        d
    }
}

/// Log-probs, entropies and every parameter's gradient of a model on `device`, fused kernels
/// against candle's primitive ops.
fn compare_paths(cfg: &rlhf_model::Config, batch: &rlhf_model::Batch, device: &Device, bf16: bool) {
    let [f, c] = both_paths(ModelKind::CausalLm, DType::F32)
        .map(|o| Model::random(cfg, &o.with_bf16(bf16).with_device(device.clone())).unwrap());
    assert_eq!(c.kernels(), rlhf_model::Kernels::Composite);
    // The fused kernels run on the CPU in f32 and, in a `cuda` build, on the GPU in f32 and
    // bf16: this test then checks the CUDA kernels.
    let gpu_fused = cfg!(feature = "cuda") && !device.is_cpu();
    let want = if gpu_fused || (device.is_cpu() && !bf16) {
        rlhf_model::Kernels::FusedTraining
    } else {
        rlhf_model::Kernels::Composite
    };
    assert_eq!(f.kernels(), want, "{device:?} bf16={bf16}");
    // bf16 rounds every activation to 8 bits of mantissa at different points on the two paths
    // (~0.4 % per op): a wrong index, sign or reduction is off by order 1, not by 10 %.
    let (tol_lp, tol_grad) = if bf16 { (0.05, 0.1) } else { (1e-5, 1e-4) };
    let (lf, ef) = f.log_probs_and_entropy(batch, 0.7, true).unwrap();
    let (lc, ec) = c.log_probs_and_entropy(batch, 0.7, true).unwrap();
    let d = rel_diff(&lf, &lc);
    assert!(
        d < tol_lp,
        "{device:?} bf16={bf16}: log-probs differ by {d:e} (relative)"
    );
    let d = rel_diff(&ef.unwrap(), &ec.unwrap());
    assert!(
        d < tol_lp,
        "{device:?} bf16={bf16}: entropies differ by {d:e} (relative)"
    );
    let gf = Gradients::backward(&loss(&f, batch), &f.vars()).unwrap();
    let gc = Gradients::backward(&loss(&c, batch), &c.vars()).unwrap();
    assert!(gf.missing(&f.vars()).is_empty());
    gf.check_finite().unwrap();
    let mut worst = (0f32, String::new());
    for (name, g) in gc.iter() {
        let got = gf
            .get(name)
            .unwrap_or_else(|| panic!("fused path: no gradient for {name}"));
        let d = rel_diff(got, g);
        if d > worst.0 {
            worst = (d, name.to_string());
        }
    }
    println!(
        "{device:?} bf16={bf16} {:?}: worst gradient difference {:e} ({})",
        f.kernels(),
        worst.0,
        worst.1
    );
    assert!(
        worst.0 < tol_grad,
        "{device:?} bf16={bf16}: gradient of {} differs by {:e} (relative)",
        worst.1,
        worst.0
    );
}

/// The fused kernels against the composite ops on every device present (on a GPU, this
/// crate's CUDA kernels), on the tiny model and on one wide enough that every kernel loops
/// (hidden 320, 300 positions, vocabulary 700: each row is longer than a block of threads).
#[test]
fn fused_and_composite_paths_agree_on_every_device() {
    let tiny = tiny_config(Family::Qwen2);
    let wide = rlhf_model::Config::tiny_llama(700, 320, 640, 1, 5, 1, 512)
        .unwrap()
        .with_family(Family::Qwen2)
        .unwrap();
    let long: Vec<Vec<u32>> = vec![
        (0..300).map(|i| (i * 7 + 3) % 700).collect(),
        (0..260).map(|i| (i * 13 + 5) % 700).collect(),
    ];
    for device in devices() {
        let mut bf16 = vec![false];
        if !device.is_cpu() {
            bf16.push(true);
        }
        for &b in &bf16 {
            compare_paths(&tiny, &tiny_batch(&device), &device, b);
            let batch = rlhf_model::Batch::left_padded(&long, 0, &device).unwrap();
            compare_paths(&wide, &batch, &device, b);
        }
    }
}

/// AdamW with its moments on the device (on a GPU, the two fused kernels per parameter)
/// against the host loop, over three steps with clipping-sized gradient scales and weight
/// decay: the weights agree to f32 rounding.
#[test]
fn adamw_device_moments_match_the_host_loop_on_every_device() {
    let cfg = tiny_config(Family::Llama);
    for device in devices() {
        let batch = tiny_batch(&device);
        let mut finals = Vec::new();
        for host_state in [true, false] {
            let model = Model::random(
                &cfg,
                &opts(ModelKind::CausalLm, DType::F32).with_device(device.clone()),
            )
            .unwrap();
            let mut opt = rlhf_model::AdamW::new(
                model.vars(),
                rlhf_model::AdamWConfig {
                    lr: 1e-2,
                    weight_decay: 0.1,
                    host_state,
                    ..Default::default()
                },
            )
            .unwrap();
            for _ in 0..3 {
                let grads = Gradients::backward(&loss(&model, &batch), &model.vars()).unwrap();
                opt.step(&grads).unwrap();
            }
            finals.push(model.named_tensors());
        }
        for ((name, a), (_, b)) in finals[0].iter().zip(&finals[1]) {
            let d = rel_diff(a, b);
            assert!(
                d < 1e-5,
                "{device:?}: {name} differs by {d:e} after 3 steps"
            );
        }
    }
}
