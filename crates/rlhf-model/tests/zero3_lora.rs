//! ZeRO stage 3 with LoRA adapters over the real TCP communicator, ranks on threads: the
//! frozen base is sharded too (each rank holds its piece of it and gathers a layer for each
//! computation), only the adapters (and a critic's value head) train. With 1, 2 and 4 ranks
//! the adapters end several clipped AdamW steps as one unsharded LoRA model's do; the
//! optimizer's variables are the pieces ZeRO stages 1 and 2 give it over the same adapters;
//! the reference log-probs (adapters off) are the base's; the saved adapter is the unsharded
//! one's, with the same base fingerprint; and a saved adapter restores into the pieces.

mod common;

use common::sharding::{
    adamw, group, host, loss, max_diff, mine, rows, train_whole, Source, Weights, CLIP, STEPS,
};
use common::{fixture, tiny_config};
use rlhf_model::{
    partition, AdamW, Batch, Device, Family, Gradients, LoadOptions, LoraConfig, Model, ModelKind,
    Tensor,
};

fn opts(kind: ModelKind, targets: &[&str]) -> LoadOptions {
    LoadOptions {
        kind,
        device: Device::Cpu,
        trainable: true,
        seed: 7,
        logits_chunk: Some(5),
        lora: Some(LoraConfig::new(4, 8.0, targets)),
        ..LoadOptions::default()
    }
}

/// The reference log-probs: the base's, adapters switched off (a collective when sharded);
/// none for a critic.
fn base_log_probs(model: &Model) -> Vec<f32> {
    if model.kind() != ModelKind::CausalLm {
        return Vec::new();
    }
    let batch = Batch::left_padded(&rows(), 0, model.device()).unwrap();
    let lp: Tensor = model
        .with_adapter_disabled(|m| m.log_probs_and_entropy(&batch, 1.0, false))
        .unwrap()
        .0;
    lp.flatten_all().unwrap().to_vec1().unwrap()
}

/// What one run ends with: the trained weights, the gradient norms, the reference
/// log-probs after training, and the base fingerprint.
struct Run {
    weights: Weights,
    norms: Vec<f64>,
    reference: Vec<f32>,
    fingerprint: String,
}

/// A LoRA model of `o` sharded over the group of `comm`, and its ZeRO-3 state.
fn sharded_model(
    src: &Source,
    o: &LoadOptions,
    comm: rlhf_collective::TcpCommunicator,
) -> (Model, std::sync::Arc<rlhf_model::zero3::Zero3>) {
    let model = src.model(o).into_zero3(Box::new(comm)).unwrap();
    let z = model.zero3().unwrap().clone();
    (model, z)
}

fn unsharded(src: &Source, o: &LoadOptions) -> (Run, Weights) {
    let model = src.model(o);
    let init = host(model.named_tensors());
    let norms = train_whole(&model);
    let run = Run {
        weights: host(model.named_tensors()),
        norms,
        reference: base_log_probs(&model),
        fingerprint: model.base_fingerprint().unwrap(),
    };
    (run, init)
}

/// `world` stage-3 ranks of the LoRA model: what each ends with. `init` is the unsharded
/// model's adapters before training: each rank's variables must be its pieces of them, cut
/// as ZeRO stages 1 and 2 cut the optimizer's parameters.
fn sharded(src: &Source, o: &LoadOptions, world: usize, init: &Weights) -> Vec<Run> {
    let handles: Vec<_> = group(world)
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let (src, o, init) = (src.clone(), o.clone(), init.clone());
            std::thread::spawn(move || {
                let (model, z) = sharded_model(&src, &o, comm);
                // The variables are the adapters' pieces, laid out as stage 1 and 2 lay out
                // AdamW's moments over the adapters.
                let vars = model.vars();
                let names: Vec<&String> = vars.iter().map(|(n, _)| n).collect();
                assert_eq!(names, init.keys().collect::<Vec<_>>(), "rank {rank}");
                let sizes: Vec<usize> = init.values().map(Vec::len).collect();
                for ((name, var), range) in vars.iter().zip(partition(&sizes, rank, world)) {
                    let got: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                    assert_eq!(got, init[name][range], "rank {rank} of {world}: {name}");
                }
                // The frozen base is sharded too: a rank holds its share of everything.
                let (held, total) = z.sizes().unwrap();
                let share = held as f64 / total as f64;
                assert!(
                    share < 1.0 / world as f64 + 0.01,
                    "rank {rank} of {world} holds {share} of the parameters"
                );
                let mut opt = AdamW::new(vars, adamw()).unwrap();
                let mut norms = Vec::new();
                for _ in 0..STEPS {
                    z.begin_pass().unwrap();
                    z.backward(&loss(&model, &mine(rank, world))).unwrap();
                    let norm = z.grad_norm().unwrap();
                    let mut g = z.take_grads().unwrap();
                    g.scale(Gradients::clip_factor(norm, CLIP)).unwrap();
                    opt.step(&g).unwrap();
                    norms.push(norm);
                }
                // A save: the adapters only, the same on every rank, as the image holds them.
                let image = model.image(None).unwrap();
                let weights = host(image.tensors.clone());
                assert_eq!(host(z.gather_all_host().unwrap()), weights);
                Run {
                    weights,
                    norms,
                    reference: base_log_probs(&model),
                    fingerprint: model.base_fingerprint().unwrap(),
                }
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// The exactness of the issue for stage 3 with LoRA: the adapters of every rank, with 1, 2
/// and 4 ranks, end as one unsharded LoRA model's (a policy with adapters on every linear
/// module, a critic with adapters on two, whose value head trains in full, and the Qwen3
/// checkpoint tiny-qwen3 with adapters on q/k/v/o over its frozen, sharded q/k norms); the
/// gradient norms, the reference log-probs and the base fingerprint are the same. On every
/// device present (cuda:0 in scripts/gpu-check.sh).
#[test]
fn stage_3_with_lora_trains_the_adapters_as_one_unsharded_model() {
    for device in common::devices() {
        lora_exactness_on(&device);
    }
}

fn lora_exactness_on(device: &Device) {
    let on = |o: LoadOptions| LoadOptions {
        device: device.clone(),
        ..o
    };
    let all = rlhf_model::lora::LINEAR_MODULES;
    let attention = &["q_proj", "k_proj", "v_proj", "o_proj"];
    for (what, src, o) in [
        (
            "llama policy",
            tiny_config(Family::Llama).into(),
            on(opts(ModelKind::CausalLm, all)),
        ),
        (
            "qwen2 critic",
            tiny_config(Family::Qwen2).into(),
            on(opts(ModelKind::Value, &["q_proj", "v_proj"])),
        ),
        (
            "qwen3 policy",
            Source::Dir(fixture("tiny-qwen3")),
            on(opts(ModelKind::CausalLm, attention)),
        ),
    ] {
        let (want, init) = unsharded(&src, &o);
        let (moved, _) = max_diff(&want.weights, &init);
        assert!(
            moved > 5e-3,
            "{what}: training moved the adapters by {moved}"
        );
        assert!(
            want.weights
                .keys()
                .all(|n| n.contains("lora_") || n.starts_with("score")),
            "{what}: only adapters and the head train"
        );
        for world in [1, 2, 4] {
            for (rank, run) in sharded(&src, &o, world, &init).iter().enumerate() {
                let at = format!("{what} on {device:?}, rank {rank} of {world}");
                let (d, name) = max_diff(&run.weights, &want.weights);
                assert!(d < 1e-4, "{at}: {d} off at {name}");
                for (a, b) in run.norms.iter().zip(&want.norms) {
                    assert!((a - b).abs() < 1e-4 * b, "{at}: norm {a} vs {b}");
                }
                assert_eq!(run.reference.len(), want.reference.len());
                let worst = run
                    .reference
                    .iter()
                    .zip(&want.reference)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(worst < 1e-4, "{at}: reference log-probs {worst} off");
                assert_eq!(run.fingerprint, want.fingerprint, "{at}: base fingerprint");
            }
        }
    }
}

/// A checkpoint's adapter restores into a sharded LoRA model: each rank keeps its pieces of
/// it, and the group gathers back the saved adapter; one saved for another base is refused
/// by its fingerprint and changes nothing.
#[test]
fn a_saved_adapter_restores_into_the_pieces_of_a_sharded_model() {
    let cfg = tiny_config(Family::Llama);
    let o = opts(ModelKind::CausalLm, &["q_proj", "up_proj"]);
    let tmp = tempfile::tempdir().unwrap();
    // A trained adapter, saved by an unsharded model.
    let trained = Model::random(&cfg, &o).unwrap();
    let vars = trained.vars();
    let mut opt = AdamW::new(vars.clone(), adamw()).unwrap();
    for _ in 0..2 {
        let g = Gradients::backward(&loss(&trained, &rows()), &vars).unwrap();
        opt.step(&g).unwrap();
    }
    let saved = tmp.path().join("adapter");
    trained.save(&saved, None).unwrap();
    let want = host(trained.named_tensors());
    // One of another base: another seed.
    let other = tmp.path().join("other");
    Model::random(
        &cfg,
        &LoadOptions {
            seed: 8,
            ..o.clone()
        },
    )
    .unwrap()
    .save(&other, None)
    .unwrap();

    let handles: Vec<_> = group(2)
        .into_iter()
        .map(|comm| {
            let (cfg, o, saved, other, want) = (
                cfg.clone(),
                o.clone(),
                saved.clone(),
                other.clone(),
                want.clone(),
            );
            std::thread::spawn(move || {
                let (model, z) = sharded_model(&cfg.into(), &o, comm);
                let before = host(z.gather_all_host().unwrap());
                let err = model.load_adapter(&other).unwrap_err().to_string();
                assert!(err.contains("another base model"), "{err}");
                assert_eq!(
                    host(z.gather_all_host().unwrap()),
                    before,
                    "nothing changed"
                );
                model.load_adapter(&saved).unwrap();
                let (d, name) = max_diff(&host(z.gather_all_host().unwrap()), &want);
                assert!(d == 0.0, "restored {d} off at {name}");
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

/// Under `training.bf16` the frozen base's pieces are kept in bf16 (no f32 copy of the base
/// anywhere), a computation gathers bf16, and a sharded LoRA model computes exactly what one
/// unsharded LoRA model does: its log-probs and its reference log-probs (adapters off) are
/// bit-equal, and its gradient norm is the unsharded one's (summed in another order).
#[test]
fn stage_3_with_lora_in_bf16_keeps_a_bf16_base_and_computes_what_one_unsharded_model_does() {
    let cfg = tiny_config(Family::Qwen2);
    let o = LoadOptions {
        compute_dtype: Some(rlhf_model::DType::BF16),
        ..opts(ModelKind::CausalLm, &["q_proj", "o_proj", "up_proj"])
    };
    // Adapters that change the outputs (B starts at zero): the same on both sides.
    let adapters = |model: &Model| -> Vec<(String, Tensor)> {
        model
            .vars()
            .into_iter()
            .filter(|(n, _)| n.contains("lora_B"))
            .map(|(n, _)| {
                let shape = match model.zero3() {
                    Some(z) => z.param_shapes().unwrap().into_iter().find(|(m, _)| *m == n),
                    None => model
                        .vars()
                        .into_iter()
                        .find(|(m, _)| *m == n)
                        .map(|(m, v)| (m, v.dims().to_vec())),
                }
                .unwrap()
                .1;
                let k: usize = shape.iter().product();
                let v: Vec<f32> = (0..k).map(|i| ((i % 7) as f32 - 3.0) * 0.01).collect();
                (n, Tensor::from_vec(v, shape, &Device::Cpu).unwrap())
            })
            .collect()
    };
    let lp = |model: &Model| -> Vec<f32> {
        let batch = Batch::left_padded(&rows(), 0, &Device::Cpu).unwrap();
        let t = model.token_log_probs(&batch, 1.0).unwrap();
        let t = t.to_dtype(rlhf_model::DType::F32).unwrap();
        t.flatten_all().unwrap().to_vec1().unwrap()
    };
    let plain = Model::random(&cfg, &o).unwrap();
    plain.set_weights(&adapters(&plain)).unwrap();
    let (want, want_ref) = (lp(&plain), base_log_probs(&plain));
    assert_ne!(want, want_ref, "the adapters change the log-probs");
    let vars = plain.vars();
    let g = Gradients::backward(&loss(&plain, &rows()), &vars).unwrap();
    let want_norm = g.global_norm().unwrap();
    let handles: Vec<_> = group(2)
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let (cfg, o) = (cfg.clone(), o.clone());
            std::thread::spawn(move || {
                let (model, z) = sharded_model(&cfg.into(), &o, comm);
                assert_eq!(z.wire_dtype(), rlhf_model::DType::BF16);
                for (name, piece) in model.params().vars() {
                    let want = if model.params().is_base(&name) {
                        rlhf_model::DType::BF16
                    } else {
                        rlhf_model::DType::F32
                    };
                    assert_eq!(piece.dtype(), want, "{name}");
                }
                model.set_weights(&adapters(&model)).unwrap();
                let (got, got_ref) = (lp(&model), base_log_probs(&model));
                z.begin_pass().unwrap();
                z.backward(&loss(&model, &mine(rank, 2))).unwrap();
                (got, got_ref, z.grad_norm().unwrap())
            })
        })
        .collect();
    for h in handles {
        let (got, got_ref, norm) = h.join().unwrap();
        assert_eq!(got, want, "bf16 log-probs of the sharded LoRA model");
        assert_eq!(got_ref, want_ref, "bf16 reference log-probs");
        let rel = (norm - want_norm).abs() / want_norm;
        assert!(
            rel < 1e-2,
            "gradient norm {norm} against {want_norm} unsharded"
        );
    }
}
