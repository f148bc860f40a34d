//! The memory savers of training — chunked LM-head log-probs, activation checkpointing and
//! bf16 mixed precision — give the gradients of the plain path: equal in f32, matching finite
//! differences in f64, on every device present.

mod common;

use common::grad::{finite_difference_check, loss, BODY};
use common::{devices, fixture, tiny_batch, tiny_config};
use rlhf_model::{
    AdamW, AdamWConfig, DType, Device, Family, Gradients, Kernels, LoadOptions, Model, ModelKind,
    ValueHeadInit,
};

fn opts(kind: ModelKind, dtype: DType, device: &Device) -> LoadOptions {
    LoadOptions {
        value_head_init: ValueHeadInit::Fresh { std: 0.1 },
        seed: 7,
        ..LoadOptions::training(kind)
            .with_dtype(dtype)
            .with_device(device.clone())
    }
}

fn chunked(o: &LoadOptions) -> LoadOptions {
    LoadOptions {
        logits_chunk: Some(4),
        ..o.clone()
    }
}

fn checkpointed(o: &LoadOptions) -> LoadOptions {
    LoadOptions {
        gradient_checkpointing: true,
        ..o.clone()
    }
}

fn grads_of(model: &Model, device: &Device) -> Vec<(String, Vec<f32>)> {
    let vars = model.vars();
    let grads = Gradients::backward(&loss(model, &tiny_batch(device)), &vars).unwrap();
    assert!(
        grads.missing(&vars).is_empty(),
        "no gradient for {:?}",
        grads.missing(&vars)
    );
    grads
        .iter()
        .map(|(n, g)| {
            let v = g
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            (n.clone(), v)
        })
        .collect()
}

#[test]
fn chunked_and_checkpointed_gradients_equal_the_plain_ones_in_f32() {
    let cfg = tiny_config(Family::Qwen2);
    for device in devices() {
        for composite_ops in [false, true] {
            let base = LoadOptions {
                composite_ops,
                ..opts(ModelKind::CausalLm, DType::F32, &device)
            };
            let want = grads_of(&Model::random(&cfg, &base).unwrap(), &device);
            for (what, o) in [
                ("chunked", chunked(&base)),
                ("checkpointed", checkpointed(&base)),
                ("chunked + checkpointed", checkpointed(&chunked(&base))),
            ] {
                let got = grads_of(&Model::random(&cfg, &o).unwrap(), &device);
                assert_eq!(got.len(), want.len());
                for ((name, a), (_, b)) in got.iter().zip(&want) {
                    let d = a
                        .iter()
                        .zip(b)
                        .map(|(x, y)| (x - y).abs())
                        .fold(0f32, f32::max);
                    assert!(
                        d <= 1e-6,
                        "{device:?} composite={composite_ops} {what}: gradient of {name} differs by {d:e}"
                    );
                }
            }
        }
    }
}

#[test]
fn chunked_and_checkpointed_gradients_match_finite_differences() {
    let cfg = tiny_config(Family::Llama);
    let mut names = BODY.to_vec();
    names.push("lm_head.weight");
    for device in devices() {
        let batch = tiny_batch(&device);
        let o = checkpointed(&chunked(&opts(ModelKind::CausalLm, DType::F64, &device)));
        let model = Model::random(&cfg, &o).unwrap();
        let worst = finite_difference_check(&model, &batch, &names);
        println!("{device:?} chunked + checkpointed: worst relative error {worst:e}");
        // Value and score heads through checkpointed layers.
        for kind in [ModelKind::Value, ModelKind::Reward] {
            let model =
                Model::random(&cfg, &checkpointed(&opts(kind, DType::F64, &device))).unwrap();
            finite_difference_check(
                &model,
                &batch,
                &[
                    "score.weight",
                    "model.layers.0.self_attn.q_proj.weight",
                    "model.layers.1.mlp.down_proj.weight",
                ],
            );
        }
    }
}

/// Mixed precision keeps f32 parameters, gradients and AdamW state and computes in bf16.
#[test]
fn mixed_precision_keeps_f32_master_weights_and_state() {
    let cfg = tiny_config(Family::Qwen2);
    for device in devices() {
        let o = LoadOptions {
            seed: 3,
            ..LoadOptions::training(ModelKind::CausalLm)
                .with_device(device.clone())
                .with_bf16(true)
        };
        let model = Model::random(&cfg, &o).unwrap();
        assert_eq!(model.dtype(), DType::F32);
        assert_eq!(model.compute_dtype(), DType::BF16);
        // bf16 on the CPU takes candle's primitive ops; on a GPU (a `cuda` build) this
        // crate's fused CUDA kernels.
        let want = if device.is_cpu() {
            Kernels::Composite
        } else {
            Kernels::FusedTraining
        };
        assert_eq!(model.kernels(), want, "{device:?}");
        let vars = model.vars();
        let batch = tiny_batch(&device);
        let (lp, ent) = model.log_probs_and_entropy(&batch, 1.0, true).unwrap();
        assert_eq!(lp.dtype(), DType::F32, "log-probs leave in f32");
        assert_eq!(ent.unwrap().dtype(), DType::F32, "entropies leave in f32");
        let grads = Gradients::backward(&loss(&model, &batch), &vars).unwrap();
        assert!(grads.missing(&vars).is_empty());
        grads.check_finite().unwrap();
        for (name, g) in grads.iter() {
            assert_eq!(g.dtype(), DType::F32, "gradient of {name}");
            let max = g
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(max > 0.0, "gradient of {name} is all zeros");
        }
        let before = model.named_tensors()[0].1.copy().unwrap();
        let mut opt = AdamW::new(vars, AdamWConfig::default()).unwrap();
        opt.step(&grads).unwrap();
        let (state, _) = opt.state().unwrap();
        assert!(state.iter().all(|(_, t)| t.dtype() == DType::F32));
        let after = &model.named_tensors()[0].1;
        let moved = (after - &before)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(moved > 0.0, "the step did not move the f32 master weights");
    }
}

/// bf16 log-probs of the committed tiny model against f32 ones.
///
/// Tolerance: bf16 keeps 8 significant bits, so each rounding is off by up to 2^-9 (0.2 %)
/// relative. A log-prob is `z_t - logsumexp(z)`, and the logits `z` come out of two layers
/// whose activations are each rounded a few times; with logits of magnitude ~5 here an error
/// of a few roundings of ~5 * 2^-9 ≈ 0.01 per logit is expected. Since log-softmax is
/// 1-Lipschitz in the max norm per entry (the target term and the logsumexp each move by at
/// most the largest logit error), 0.05 absolute bounds it with margin; the mean error, which
/// is what PPO's ratios feel on average, must stay under 0.02 (measured here: max 0.025, mean
/// 0.008 for the frozen bf16 model; a GPU accumulates its bf16 matmuls in f32 and does better).
#[test]
fn bf16_log_probs_are_within_tolerance_of_f32() {
    let dir = fixture("tiny-llama");
    for device in devices() {
        let batch = tiny_batch(&device);
        let f32_model =
            Model::load(&dir, &LoadOptions::inference().with_device(device.clone())).unwrap();
        let want = f32_model.token_log_probs(&batch, 1.0).unwrap();
        for o in [
            LoadOptions::inference().with_bf16(true),
            LoadOptions::training(ModelKind::CausalLm).with_bf16(true),
        ] {
            let m = Model::load(&dir, &o.clone().with_device(device.clone())).unwrap();
            let got = m.token_log_probs(&batch, 1.0).unwrap();
            // Only positions whose input and target are real tokens.
            let mask = batch.attention_mask.to_dtype(DType::F32).unwrap();
            let t = mask.dim(1).unwrap();
            let m2 =
                (mask.narrow(1, 1, t - 1).unwrap() * mask.narrow(1, 0, t - 1).unwrap()).unwrap();
            let diff = ((got - &want).unwrap().abs().unwrap() * &m2).unwrap();
            let max = diff.max_all().unwrap().to_scalar::<f32>().unwrap();
            let n = m2.sum_all().unwrap().to_scalar::<f32>().unwrap();
            let mean = diff.sum_all().unwrap().to_scalar::<f32>().unwrap() / n;
            println!(
                "{device:?} trainable={}: bf16 vs f32 log-probs max {max:e}, mean {mean:e}",
                o.trainable
            );
            assert!(max <= 0.05, "bf16 log-probs off by {max} (max)");
            assert!(mean <= 0.02, "bf16 log-probs off by {mean} (mean)");
            assert!(
                max > 0.0,
                "bf16 gave exactly the f32 numbers: not computed in bf16"
            );
        }
    }
}

#[test]
fn the_kernel_seam_never_trains_with_gradient_dropping_ops() {
    for trainable in [true, false] {
        for device in devices() {
            for dtype in [DType::F32, DType::BF16, DType::F64] {
                let k = Kernels::choose(&device, dtype, !trainable, false);
                if !trainable {
                    assert_eq!(k, Kernels::Inference);
                    continue;
                }
                assert_ne!(k, Kernels::Inference, "{device:?} {dtype:?}");
                // The fused kernels: f32/f64 on the CPU, every dtype here on a GPU (whose
                // CUDA kernels exist for f32, f64 and bf16).
                let fused = !device.is_cpu() || dtype != DType::BF16;
                assert_eq!(k == Kernels::FusedTraining, fused, "{device:?} {dtype:?}");
                assert_eq!(
                    Kernels::choose(&device, dtype, false, true),
                    Kernels::Composite
                );
            }
        }
    }
}

#[test]
fn bad_memory_options_are_refused() {
    let cfg = tiny_config(Family::Llama);
    let err = |o: LoadOptions| Model::random(&cfg, &o).err().expect("refused").to_string();
    let e = err(LoadOptions {
        gradient_checkpointing: true,
        ..LoadOptions::inference()
    });
    assert!(
        e.contains("gradient checkpointing is for trainable models"),
        "{e}"
    );
    let e = err(LoadOptions {
        logits_chunk: Some(0),
        ..LoadOptions::training(ModelKind::CausalLm)
    });
    assert!(e.contains("logits_chunk must be at least 1"), "{e}");
    let e = err(LoadOptions::inference().with_dtype(DType::U32));
    assert!(e.contains("floating-point dtype"), "{e}");
}

/// The layers of a checkpointed model really are replayed: a bare `loss.backward()` finds no
/// gradient for their parameters (they are handed over on the side). What such a backward
/// parks belongs to no `Gradients::backward` call and is dropped by the next one, which
/// gives exactly the plain path's gradients, not twice them.
#[test]
fn checkpointed_layers_hand_their_gradients_over_on_the_side() {
    let cfg = tiny_config(Family::Llama);
    let device = Device::Cpu;
    let base = opts(ModelKind::CausalLm, DType::F32, &device);
    let want = grads_of(&Model::random(&cfg, &base).unwrap(), &device);
    let model = Model::random(&cfg, &checkpointed(&base)).unwrap();
    let vars = model.vars();
    let store = loss(&model, &tiny_batch(&device)).backward().unwrap();
    for (name, var) in &vars {
        let in_layer = name.starts_with("model.layers.");
        assert_eq!(
            store.get(var.as_tensor()).is_none(),
            in_layer,
            "{name}: a layer parameter's gradient must come from the replay, others from candle"
        );
    }
    // The stray backward above parked gradients; a proper one is not polluted by them.
    let got = grads_of(&model, &device);
    let mut n = 0;
    for ((name, g), (_, w)) in got.iter().zip(&want) {
        let d = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d <= 1e-6, "{name}: gradient differs by {d:e}");
        n += usize::from(name.starts_with("model.layers."));
    }
    assert!(n >= 18, "only {n} layer parameters checked");
    // And nothing is left parked afterwards.
    let nothing = rlhf_model::Tensor::new(0f32, &device).unwrap();
    assert!(Gradients::backward(&nothing, &vars).unwrap().is_empty());
}
