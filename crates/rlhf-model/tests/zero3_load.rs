//! A ZeRO-3 rank reading only its pieces out of a checkpoint's files ([`Model::load_zero3`],
//! [`Model::load_zero3_weights`]) holds exactly what sharding the whole loaded model gives it,
//! on every rank, for transformers' own checkpoints (Llama, Qwen2 with a tied head, Qwen3 with
//! its q/k norms, a reward model's score head taken as a critic's value head, a fresh value
//! head; LoRA adapters over Llama, the reward model and Qwen3) and for a bf16 checkpoint (the
//! pieces are converted to f32 master weights); the group gathers back the model the files
//! hold; a bad checkpoint is refused by name and changes nothing.

mod common;

use std::path::Path;

use common::{fixture, tiny_config};
use rlhf_collective::{CommConfig, TcpCommunicator};
use rlhf_model::{DType, Device, Family, LoadOptions, Model, ModelKind, Tensor};

fn opts(kind: ModelKind) -> LoadOptions {
    LoadOptions {
        kind,
        device: Device::Cpu,
        trainable: true,
        seed: 11,
        ..LoadOptions::default()
    }
}

/// A model's parameters (its pieces, when sharded; a LoRA model's frozen base too): name,
/// shape and values.
fn pieces(model: &Model) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    model
        .params()
        .vars()
        .into_iter()
        .map(|(name, v)| {
            assert_eq!(v.dtype(), DType::F32, "{name}: f32 master weights");
            let values = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            (name, v.dims().to_vec(), values)
        })
        .collect()
}

/// For 1, 2 and 3 ranks, every rank's pieces read from `dir` are those sharding the whole
/// loaded model gives; returns how many pieces were compared.
fn same_pieces_as_sharding_the_whole(dir: &Path, kind: ModelKind) -> usize {
    same_pieces_with(dir, &opts(kind))
}

/// [`same_pieces_as_sharding_the_whole`] loading with `o` (LoRA adapters: the frozen base's
/// pieces and the adapters', whose trained ones alone are the variables, and the base's
/// fingerprint, read from samples of the files, that of the whole base).
fn same_pieces_with(dir: &Path, o: &LoadOptions) -> usize {
    let mut compared = 0;
    for world in 1..=3 {
        for rank in 0..world {
            let read = Model::load_zero3(dir, o, rank, world, false).unwrap();
            let cut = Model::load(dir, o)
                .unwrap()
                .into_zero3_lent(rank, world, false)
                .unwrap();
            let (read_z, cut_z) = (read.zero3().unwrap(), cut.zero3().unwrap());
            assert_eq!(read_z.rank_world(), (rank, world));
            let names = |m: &Model| m.vars().into_iter().map(|(n, _)| n).collect::<Vec<_>>();
            assert_eq!(names(&read), names(&cut), "the same variables");
            if o.lora.is_some() {
                let whole = Model::load(dir, o).unwrap().base_fingerprint().unwrap();
                assert_eq!(read.base_fingerprint().unwrap(), whole);
                assert_eq!(cut.base_fingerprint().unwrap(), whole);
                assert!(names(&read)
                    .iter()
                    .all(|n| n.contains("lora_") || n.starts_with("score")));
            }
            assert_eq!(read_z.sizes().unwrap(), cut_z.sizes().unwrap());
            let (a, b) = (pieces(&read), pieces(&cut));
            assert_eq!(a.len(), b.len(), "{}: the same parameters", dir.display());
            for (x, y) in a.iter().zip(&b) {
                assert_eq!(x, y, "{} rank {rank} of {world}", dir.display());
            }
            compared += a.len();
        }
    }
    compared
}

#[test]
fn a_sharded_load_reads_the_pieces_sharding_the_whole_model_gives() {
    let mut n = 0;
    for name in ["tiny-llama", "tiny-qwen2", "tiny-llama3-rope", "tiny-qwen3"] {
        n += same_pieces_as_sharding_the_whole(&fixture(name), ModelKind::CausalLm);
    }
    // A critic from a causal LM: a fresh value head (made by the load, not read).
    n += same_pieces_as_sharding_the_whole(&fixture("tiny-llama"), ModelKind::Value);
    // A critic from a reward model: the checkpoint's score head, read as the value head.
    n += same_pieces_as_sharding_the_whole(&fixture("tiny-llama-reward"), ModelKind::Value);
    n += same_pieces_as_sharding_the_whole(&fixture("tiny-llama-reward"), ModelKind::Reward);
    assert!(n > 100, "compared {n} pieces");
    // LoRA: a policy's adapters over its frozen base, and a critic's over a reward model's,
    // whose score head (read from the files) trains in full.
    let lora = |kind| LoadOptions {
        lora: Some(rlhf_model::LoraConfig::new(
            4,
            8.0,
            &["q_proj", "v_proj", "down_proj"],
        )),
        ..opts(kind)
    };
    let m = same_pieces_with(&fixture("tiny-llama"), &lora(ModelKind::CausalLm));
    let v = same_pieces_with(&fixture("tiny-llama-reward"), &lora(ModelKind::Value));
    assert!(m > 100 && v > 100, "compared {m} and {v} LoRA pieces");
    // Qwen3 with adapters on q/k/v/o: its q/k norms are frozen base pieces.
    let qwen3 = LoadOptions {
        lora: Some(rlhf_model::LoraConfig::new(
            4,
            8.0,
            &["q_proj", "k_proj", "v_proj", "o_proj"],
        )),
        ..opts(ModelKind::CausalLm)
    };
    let q = same_pieces_with(&fixture("tiny-qwen3"), &qwen3);
    assert!(q > 100, "compared {q} Qwen3 LoRA pieces");

    // A bf16 checkpoint (as HF models ship): each piece converted to f32 as a whole load is.
    let tmp = tempfile::tempdir().unwrap();
    let bf16 = LoadOptions {
        dtype: DType::BF16,
        trainable: false,
        ..opts(ModelKind::CausalLm)
    };
    let mut raw = tiny_config(Family::Qwen2).raw.clone();
    raw["tie_word_embeddings"] = serde_json::json!(true);
    let cfg = rlhf_model::Config::from_json(&raw).unwrap();
    Model::random(&cfg, &bf16)
        .unwrap()
        .save(tmp.path(), None)
        .unwrap();
    same_pieces_as_sharding_the_whole(tmp.path(), ModelKind::CausalLm);
}

/// Two ranks on threads over TCP, each loading only its pieces: together they gather back
/// exactly the model in the files (the whole load's f32 tensors).
#[test]
fn ranks_that_read_only_their_pieces_gather_back_the_whole_model() {
    let dir = fixture("tiny-qwen2");
    let whole: Vec<(String, Vec<f32>)> = Model::load(&dir, &opts(ModelKind::CausalLm))
        .unwrap()
        .named_tensors()
        .into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1().unwrap()))
        .collect();
    let comms = TcpCommunicator::loopback_group(2, CommConfig::default()).unwrap();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, mut comm)| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let o = opts(ModelKind::CausalLm);
                let model = Model::load_zero3(&dir, &o, rank, 2, true).unwrap();
                let z = model.zero3().unwrap().clone();
                let on_host = model.vars().iter().all(|(_, v)| v.device().is_cpu());
                assert!(on_host, "offload_params keeps the pieces in host memory");
                let (held, total) = z.sizes().unwrap();
                assert!(held * 2 <= total + 2, "rank {rank} holds {held} of {total}");
                z.lend(&mut comm, |_| z.gather_all_host()).unwrap().unwrap()
            })
        })
        .collect();
    for h in handles {
        let got: Vec<(String, Vec<f32>)> = h
            .join()
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1().unwrap()))
            .collect();
        assert_eq!(got, whole);
    }
}

fn values(model: &Model) -> Vec<Vec<f32>> {
    pieces(model).into_iter().map(|(_, _, v)| v).collect()
}

/// Restoring a checkpoint's weights reads this rank's pieces of it; a checkpoint missing a
/// tensor, or holding one of another shape, is refused by name before anything is set.
#[test]
fn restoring_weights_reads_the_pieces_and_a_bad_checkpoint_changes_nothing() {
    let cfg = tiny_config(Family::Llama);
    let tmp = tempfile::tempdir().unwrap();
    let (first, second) = (tmp.path().join("first"), tmp.path().join("second"));
    let random = |seed| LoadOptions {
        seed,
        ..opts(ModelKind::CausalLm)
    };
    Model::random(&cfg, &random(1))
        .unwrap()
        .save(&first, None)
        .unwrap();
    let later = Model::random(&cfg, &random(2)).unwrap();
    later.save(&second, None).unwrap();
    let o = opts(ModelKind::CausalLm);
    let model = Model::load_zero3(&first, &o, 1, 2, false).unwrap();
    let expected = values(&Model::load_zero3(&second, &o, 1, 2, false).unwrap());
    let before = values(&model);
    assert_ne!(before, expected, "the two checkpoints differ");

    // Missing a tensor: every tensor of `second` but one, written over the file.
    let mut named = later.named_tensors();
    let (dropped, _) = named.remove(named.len() / 2);
    let file = second.join("model.safetensors");
    rlhf_model::weights::save_safetensors(&named, &file).unwrap();
    let err = model.load_zero3_weights(&second).unwrap_err().to_string();
    assert!(
        err.contains(&dropped) && err.contains("model.safetensors"),
        "names the tensor and the file: {err}"
    );
    assert_eq!(values(&model), before, "nothing was set");

    // One tensor of another shape (the first one sorted, so the check must come before any set).
    let (name, t) = later.named_tensors().into_iter().next().unwrap();
    let mut named = later.named_tensors();
    named[0] = (
        name.clone(),
        Tensor::zeros(t.dims()[0] + 1, DType::F32, &Device::Cpu).unwrap(),
    );
    rlhf_model::weights::save_safetensors(&named, &file).unwrap();
    let err = model.load_zero3_weights(&second).unwrap_err().to_string();
    assert!(err.contains(&name), "names the tensor: {err}");
    assert_eq!(values(&model), before, "nothing was set");

    // One tensor stored in a dtype no parameter can have (bool), the right shape: the last
    // one sorted, so the check must come before any set.
    let mut named = later.named_tensors();
    let (name, t) = named.pop().unwrap();
    let bools = vec![1u8; t.elem_count()];
    let mut views = vec![(
        name.clone(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::BOOL, t.dims().to_vec(), &bools)
            .unwrap(),
    )];
    let rest: Vec<(String, Vec<u8>, Vec<usize>)> = named
        .iter()
        .map(|(n, t)| {
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            (n.clone(), bytes, t.dims().to_vec())
        })
        .collect();
    for (n, bytes, shape) in &rest {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes);
        views.push((n.clone(), view.unwrap()));
    }
    safetensors::tensor::serialize_to_file(views, None, &file).unwrap();
    let err = model.load_zero3_weights(&second).unwrap_err().to_string();
    assert!(
        err.contains(&name) && err.contains("BOOL"),
        "names the tensor and its dtype: {err}"
    );
    assert_eq!(values(&model), before, "nothing was set");

    // The whole checkpoint again: this rank's pieces of it.
    rlhf_model::weights::save_safetensors(&later.named_tensors(), &file).unwrap();
    model.load_zero3_weights(&second).unwrap();
    assert_eq!(values(&model), expected);

    // A first load of a checkpoint missing a tensor names it and the file too.
    rlhf_model::weights::save_safetensors(&later.named_tensors()[1..], &file).unwrap();
    let err = match Model::load_zero3(&second, &o, 0, 2, false) {
        Ok(_) => panic!("a checkpoint missing a tensor loads"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("model.safetensors"), "names the file: {err}");
}

/// What cannot be sharded is refused as sharding a whole model is: a frozen model, a rank
/// outside the group.
#[test]
fn a_sharded_load_refuses_frozen_models_and_ranks_outside_the_group() {
    let dir = fixture("tiny-llama");
    let frozen = LoadOptions {
        trainable: false,
        ..opts(ModelKind::CausalLm)
    };
    let err = Model::load_zero3(&dir, &frozen, 0, 2, false).err().unwrap();
    assert!(err.to_string().contains("trainable: true"), "{err}");
    let err = Model::load_zero3(&dir, &opts(ModelKind::CausalLm), 2, 2, false)
        .err()
        .unwrap();
    assert!(err.to_string().contains("rank 2 of 2"), "{err}");
}
