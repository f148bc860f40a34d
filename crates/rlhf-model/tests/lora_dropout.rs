//! LoRA dropout (`lora_dropout`, PEFT's `nn.Dropout` on each adapter's input): it acts only
//! inside a training pass (`Model::dropout_pass`), draws the same masks for the same seed
//! (so a resumed run and a layer recomputed for activation checkpointing see the same ones),
//! and its gradients are the true gradients of the masked loss (finite differences).

mod common;

use common::grad::{finite_difference_check, loss};
use common::{max_abs_diff, tiny_batch, tiny_config};
use rlhf_model::{DType, Device, Family, Gradients, LoadOptions, LoraConfig, Model, ModelKind};

/// A tiny f64 Qwen2 with adapters on every linear layer and a random `B` (PEFT starts it at
/// zero, which would hide the adapters' effect).
fn model(dropout: f64, checkpointing: bool) -> Model {
    let mut lora = LoraConfig::new(2, 4.0, &["all-linear"]);
    lora.dropout = dropout;
    let opts = LoadOptions {
        dtype: DType::F64,
        seed: 7,
        gradient_checkpointing: checkpointing,
        lora: Some(lora),
        ..LoadOptions::training(ModelKind::CausalLm)
    };
    let m = Model::random(&tiny_config(Family::Qwen2), &opts).unwrap();
    let b: Vec<_> = m
        .vars()
        .into_iter()
        .filter(|(n, _)| n.contains("lora_B"))
        .enumerate()
        .map(|(i, (n, v))| {
            let w =
                common::grad::weights(v.dims2().unwrap(), DType::F64, 50 + i as u64, &Device::Cpu);
            (n, (w * 0.5).unwrap())
        })
        .collect();
    m.set_weights(&b).unwrap();
    m
}

#[test]
fn dropout_acts_only_in_a_training_pass_and_repeats_with_its_seed() {
    let batch = tiny_batch(&Device::Cpu);
    let (m, m0) = (model(0.5, false), model(0.0, false));
    let l = |m: &Model| loss(m, &batch).to_scalar::<f64>().unwrap();
    let base = l(&m0);
    assert_eq!(l(&m), base, "dropout outside a training pass");
    let a = {
        let _pass = m.dropout_pass(11);
        l(&m)
    };
    let again = {
        let _pass = m.dropout_pass(11);
        l(&m)
    };
    let other = {
        let _pass = m.dropout_pass(12);
        l(&m)
    };
    assert_eq!(a, again, "the same seed draws the same masks");
    assert!(
        (a - base).abs() > 1e-6,
        "no dropout in a pass: {a} vs {base}"
    );
    assert!(
        (other - a).abs() > 1e-9,
        "another seed draws the same masks"
    );
    // The pass ends with its guard; dropout 0 is a no-op inside one.
    assert_eq!(l(&m), base);
    let _pass = m0.dropout_pass(11);
    assert_eq!(l(&m0), base);
}

#[test]
fn gradients_under_dropout_match_finite_differences_with_and_without_checkpointing() {
    let batch = tiny_batch(&Device::Cpu);
    let (plain, ckpt) = (model(0.3, false), model(0.3, true));
    let grads = |m: &Model| {
        let _pass = m.dropout_pass(5);
        Gradients::backward(&loss(m, &batch), &m.vars()).unwrap()
    };
    let (g, gc) = (grads(&plain), grads(&ckpt));
    let without = {
        let m = model(0.0, false);
        Gradients::backward(&loss(&m, &batch), &m.vars()).unwrap()
    };
    let mut moved = 0;
    for (n, _) in plain.vars() {
        let x = g.get(&n).unwrap_or_else(|| panic!("{n}: no gradient"));
        let norm = x
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert!(norm.is_finite() && norm > 0.0, "{n}: gradient norm {norm}");
        // A recomputed checkpointed layer draws the masks of its forward.
        let d = max_abs_diff(x, gc.get(&n).unwrap());
        assert!(d <= 1e-10, "{n}: checkpointed gradient differs by {d}");
        if max_abs_diff(x, without.get(&n).unwrap()) > 1e-8 {
            moved += 1;
        }
    }
    assert!(moved > 0, "dropout changed no gradient");
    // Inside one pass every loss evaluation draws the same masks: the autograd gradient is
    // the derivative of that loss.
    let _pass = plain.dropout_pass(5);
    let picks = [
        "model.layers.1.self_attn.q_proj.lora_A.weight",
        "model.layers.1.mlp.down_proj.lora_B.weight",
        "model.layers.0.mlp.up_proj.lora_A.weight",
    ];
    let worst = finite_difference_check(&plain, &batch, &picks);
    println!("lora dropout 0.3: worst relative error {worst:e}");
}
