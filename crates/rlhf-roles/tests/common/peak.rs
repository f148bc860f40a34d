//! Measuring what training really holds against `rlhf-head check`'s estimate: a
//! Llama-shaped model of ~36M parameters (big enough that its weights, gradients and AdamW
//! state dominate the process) written to a file, SFT ranks trained on it for two steps of
//! two micro-batches, and the peak resident memory they add (Linux `VmHWM`, reset through
//! `/proc/self/clear_refs` after the model file is written). Each test binary that uses
//! this holds one test, so that no other test's memory is counted.

use std::io::Write;
use std::path::Path;

use rlhf_config::{MemoryRow, PpoConfig, TrainerKind};
use rlhf_core::calls::{Mat, Sequences, SftUpdateRequest};

use super::{config, group, Lcg, P, R};

pub const HIDDEN: usize = 512;
pub const LAYERS: usize = 6;
pub const INTER: usize = 1376;
pub const VOCAB: usize = 16000;

/// Writes a random Llama checkpoint to `dir` a megabyte at a time, so that writing it
/// leaves no large allocation behind in this process.
pub fn write_model(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let mut tensors: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![VOCAB, HIDDEN]),
        ("lm_head.weight".into(), vec![VOCAB, HIDDEN]),
        ("model.norm.weight".into(), vec![HIDDEN]),
    ];
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        for (n, shape) in [
            ("input_layernorm", vec![HIDDEN]),
            ("post_attention_layernorm", vec![HIDDEN]),
            ("self_attn.q_proj", vec![HIDDEN, HIDDEN]),
            ("self_attn.k_proj", vec![HIDDEN, HIDDEN]),
            ("self_attn.v_proj", vec![HIDDEN, HIDDEN]),
            ("self_attn.o_proj", vec![HIDDEN, HIDDEN]),
            ("mlp.gate_proj", vec![INTER, HIDDEN]),
            ("mlp.up_proj", vec![INTER, HIDDEN]),
            ("mlp.down_proj", vec![HIDDEN, INTER]),
        ] {
            tensors.push((format!("{p}.{n}.weight"), shape));
        }
    }
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (name, shape) in &tensors {
        let bytes = shape.iter().product::<usize>() * 4;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [off, off + bytes]}),
        );
        off += bytes;
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    w.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
    w.write_all(&h).unwrap();
    let mut rng = Lcg(7);
    for (name, shape) in &tensors {
        let norm = name.ends_with("norm.weight");
        for _ in 0..shape.iter().product::<usize>() {
            let x: f32 = if norm { 1.0 } else { (rng.unit() - 0.5) * 0.04 };
            w.write_all(&x.to_le_bytes()).unwrap();
        }
    }
    w.flush().unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

/// `VmRSS` or `VmHWM` of this process, in bytes.
pub fn status_bytes(key: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s
        .lines()
        .find(|l| l.starts_with(key))
        .unwrap_or_else(|| panic!("no {key} in /proc/self/status"));
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

/// `world` SFT ranks (threads, over the TCP communicator) of the config `tune` makes from the
/// test config, on the model above: the trainer row of their estimate, and the peak resident
/// memory the ranks added to this process in two updates of 4 rows each (from the second
/// on, AdamW's moments are resident while the gradients are computed: the steady state a
/// run lives in).
pub fn sft_peak(world: usize, tune: fn(&mut PpoConfig)) -> (MemoryRow, u64) {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    write_model(&model);
    let mut cfg = config();
    cfg.trainer = TrainerKind::Sft;
    cfg.actor_rollout.model = model.display().to_string();
    cfg.training.micro_batch_size = 2;
    cfg.resource_pool.actor_rollout = world as u32;
    cfg.actor_rollout.num_gpus_for_train = world as u32;
    tune(&mut cfg);
    let row = cfg
        .memory_estimate()
        .into_iter()
        .find(|r| r.label == "actor_rollout/train")
        .expect("a trainer row");
    assert!(row.params > 30_000_000, "{} parameters", row.params);

    let comms: Vec<rlhf_collective::TcpCommunicator> = match world {
        1 => vec![rlhf_collective::TcpCommunicator::single(Default::default())],
        n => group(n),
    };
    let base = status_bytes("VmRSS:");
    // Every rank loads its model, then the peak is reset and they train: what is measured is
    // training, as the estimate is, not the pages of the model file a load maps in.
    let loaded = std::sync::Arc::new(std::sync::Barrier::new(world + 1));
    let reset = std::sync::Arc::new(std::sync::Barrier::new(world + 1));
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, mut comm)| {
            let (cfg, loaded, reset) = (cfg.clone(), loaded.clone(), reset.clone());
            std::thread::spawn(move || {
                let mut t = super::sft_trainer(&cfg, rank, world);
                loaded.wait();
                reset.wait();
                let rows = 4;
                let mut rng = Lcg(3 + rank as u64);
                let ids: Vec<i64> = (0..rows * (P + R))
                    .map(|_| 1 + (rng.next() % (VOCAB as u64 - 1)) as i64)
                    .collect();
                let req = SftUpdateRequest {
                    seq: Sequences {
                        input_ids: Mat::new(rows, P + R, ids).unwrap(),
                        attention_mask: Mat::filled(rows, P + R, 1),
                        response_len: R,
                    },
                    loss_mask: Mat::filled(rows, R, 1.0),
                    step: 0,
                };
                for step in 1..=2 {
                    let mut r = req.clone();
                    r.step = step;
                    let m = t.update(&mut comm, &r).unwrap().metrics;
                    assert!(m["train/loss"].is_finite());
                }
            })
        })
        .collect();
    loaded.wait();
    // Resets VmHWM to the current RSS (Linux >= 4.0). Where that is refused, the peak so far
    // includes the loads.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    reset.wait();
    for h in handles {
        h.join().unwrap();
    }
    let used = status_bytes("VmHWM:").saturating_sub(base);
    (row, used)
}

/// Prints the estimate beside the measured peak of `world` ranks, and says whether they are
/// within `tolerance` of each other (the estimate is per rank: `world` of them were run).
pub fn compare(what: &str, row: &MemoryRow, used: u64, world: usize, tolerance: f64) {
    let est = row.total() * world as u64;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "{what}: {} parameters, {world} rank(s): estimate {:.0} MiB per rank (weights {:.0}, gradients {:.0}, optimizer {:.0}, activations {:.0}), {:.0} MiB for all; measured peak {:.0} MiB",
        row.params,
        mib(row.total()),
        mib(row.weights),
        mib(row.gradients),
        mib(row.optimizer),
        mib(row.activations),
        mib(est),
        mib(used)
    );
    let err = (est as f64 - used as f64).abs() / used as f64;
    assert!(
        err <= tolerance,
        "{what}: estimate {:.0} MiB vs measured {:.0} MiB: {:.0} % off",
        mib(est),
        mib(used),
        err * 100.0
    );
}
