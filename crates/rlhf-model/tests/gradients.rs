//! Backward through every layer: all trainable parameters get finite nonzero gradients, and the
//! gradients match central finite differences (f64) for each layer type.

mod common;

use common::{tiny_batch, tiny_config};
use rlhf_model::{
    Batch, DType, Device, Family, Gradients, LoadOptions, Model, ModelKind, Tensor, ValueHeadInit,
};

fn opts(kind: ModelKind, dtype: DType) -> LoadOptions {
    LoadOptions {
        value_head_init: ValueHeadInit::Fresh { std: 0.1 },
        seed: 7,
        ..LoadOptions::training(kind).with_dtype(dtype)
    }
}

/// Both differentiable paths: the fused CPU kernels and candle's primitive ops.
fn both_paths(kind: ModelKind, dtype: DType) -> [LoadOptions; 2] {
    let fused = opts(kind, dtype);
    let composite = LoadOptions {
        composite_ops: true,
        ..fused.clone()
    };
    [fused, composite]
}

/// Fixed pseudo-random weights so that the loss depends on every output.
fn weights(shape: (usize, usize), dtype: DType, seed: u64) -> Tensor {
    let n = shape.0 * shape.1;
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let data: Vec<f64> = (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 11) as f64 / (1u64 << 53) as f64) - 0.5
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// A scalar loss that exercises the model's head: log-probs (temperature 0.7) plus entropy for
/// a causal LM, weighted values for a critic, weighted scores for a reward model; padding is
/// masked out.
fn loss(model: &Model, batch: &Batch) -> Tensor {
    let dtype = if model.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let (b, t) = batch.input_ids.dims2().unwrap();
    let mask = batch.attention_mask.to_dtype(dtype).unwrap();
    match model.kind() {
        ModelKind::CausalLm => {
            let (lp, ent) = model.log_probs_and_entropy(batch, 0.7, true).unwrap();
            // Positions whose input and target are both real tokens: a pad position's output
            // comes from a fully masked attention row and is meaningless.
            let m =
                (mask.narrow(1, 1, t - 1).unwrap() * mask.narrow(1, 0, t - 1).unwrap()).unwrap();
            let w = weights((b, t - 1), dtype, 1);
            let a = (lp.to_dtype(dtype).unwrap() * &m).unwrap() * &w;
            let e = (ent.unwrap().to_dtype(dtype).unwrap() * &m).unwrap() * 0.3;
            (a.unwrap().sum_all().unwrap() + e.unwrap().sum_all().unwrap()).unwrap()
        }
        ModelKind::Value => {
            let v = model.values(batch).unwrap().to_dtype(dtype).unwrap();
            let w = weights((b, t), dtype, 2);
            ((v * &mask).unwrap() * w).unwrap().sum_all().unwrap()
        }
        ModelKind::Reward => {
            let s = model.scores(batch).unwrap().to_dtype(dtype).unwrap();
            let w = weights((1, b), dtype, 3).squeeze(0).unwrap();
            (s * w).unwrap().sum_all().unwrap()
        }
    }
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
    for family in [Family::Llama, Family::Qwen2] {
        for kind in [ModelKind::CausalLm, ModelKind::Value, ModelKind::Reward] {
            check_all_params_get_gradients(family, kind);
        }
    }
}

fn set_elem(t: &Tensor, idx: usize, value: f64) -> Tensor {
    let shape = t.shape().clone();
    let mut v = t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    v[idx] = value;
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Central differences against autograd for a few elements of each parameter in `names`.
fn finite_difference_check(model: &Model, batch: &Batch, names: &[&str]) -> f64 {
    let vars = model.vars();
    let grads = Gradients::backward(&loss(model, batch), &vars).unwrap();
    // f64 round-off in the loss is ~1e-14; 1e-5 keeps both it and the O(eps^2) error small.
    let eps = 1e-5;
    let mut worst = 0f64;
    for name in names {
        let (_, var) = vars
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no parameter {name}"));
        let g = grads
            .get(name)
            .unwrap_or_else(|| panic!("no gradient for {name}"))
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let orig = var.as_tensor().detach().copy().unwrap();
        let n = g.len();
        // Embedding rows of tokens in the batch (5, 7) and spread-out elements elsewhere.
        let hidden = model.config().hidden_size;
        let picks: Vec<usize> = if name.contains("embed_tokens") {
            vec![5 * hidden + 3, 7 * hidden + 11]
        } else {
            vec![0, n / 2, n - 1]
        };
        for idx in picks {
            let x0 = orig.flatten_all().unwrap().to_vec1::<f64>().unwrap()[idx];
            var.set(&set_elem(&orig, idx, x0 + eps)).unwrap();
            let lp = loss(model, batch).to_scalar::<f64>().unwrap();
            var.set(&set_elem(&orig, idx, x0 - eps)).unwrap();
            let lm = loss(model, batch).to_scalar::<f64>().unwrap();
            var.set(&orig).unwrap();
            let numeric = (lp - lm) / (2.0 * eps);
            let err = (numeric - g[idx]).abs() / (numeric.abs() + g[idx].abs()).max(1e-4);
            assert!(
                err < 1e-4,
                "{name}[{idx}]: autograd {} vs finite difference {numeric} (rel err {err:e})",
                g[idx]
            );
            worst = worst.max(err);
        }
    }
    worst
}

const BODY: &[&str] = &[
    "model.embed_tokens.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.self_attn.q_proj.weight",
    "model.norm.weight",
];

#[test]
fn gradients_match_finite_differences_llama() {
    let batch = tiny_batch(&Device::Cpu);
    let cfg = tiny_config(Family::Llama);
    let mut names = BODY.to_vec();
    names.push("lm_head.weight");
    for o in both_paths(ModelKind::CausalLm, DType::F64) {
        let model = Model::random(&cfg, &o).unwrap();
        let worst = finite_difference_check(&model, &batch, &names);
        println!(
            "llama causal LM {:?}: worst relative error {worst:e}",
            model.kernels()
        );
    }
}

#[test]
fn gradients_match_finite_differences_qwen2_biases_and_tied_head() {
    let batch = tiny_batch(&Device::Cpu);
    let cfg = tiny_config(Family::Qwen2)
        .with_key("tie_word_embeddings", serde_json::json!(true))
        .unwrap();
    let mut names = BODY.to_vec();
    names.extend([
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.bias",
    ]);
    for o in both_paths(ModelKind::CausalLm, DType::F64) {
        let model = Model::random(&cfg, &o).unwrap();
        let worst = finite_difference_check(&model, &batch, &names);
        println!(
            "qwen2 causal LM (tied) {:?}: worst relative error {worst:e}",
            model.kernels()
        );
    }
}

#[test]
fn gradients_match_finite_differences_value_and_score_heads() {
    let batch = tiny_batch(&Device::Cpu);
    let cfg = tiny_config(Family::Llama);
    for [co, ro] in both_paths(ModelKind::Value, DType::F64)
        .into_iter()
        .zip(both_paths(ModelKind::Reward, DType::F64))
        .map(|(a, b)| [a, b])
    {
        let critic = Model::random(&cfg, &co).unwrap();
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
        let reward = Model::random(&cfg, &ro).unwrap();
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
            "{:?}: value head worst relative error {w1:e}; score head {w2:e}",
            critic.kernels()
        );
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
        let d = (a - &b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
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
        .filter(|((_, a), (_, b))| {
            let d = (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            d > 0.0
        })
        .count();
    assert_eq!(
        changed,
        before.len(),
        "every bf16 parameter moves after a step"
    );
}
