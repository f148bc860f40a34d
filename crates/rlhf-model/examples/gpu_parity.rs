//! GPU parity check: the committed fixture models give the CPU's numbers on cuda:0.
//!
//! Why: the model tests compare against PyTorch on the CPU, and the GPU path differs in every
//! kernel (cuBLAS matmuls, candle's CUDA softmax/rms-norm/rope, f32 reductions in log-probs),
//! so a GPU machine needs its own check that needs no Python: for each causal-LM fixture under
//! `tests/fixtures` (tiny-llama, tiny-llama3-rope, tiny-qwen2), on a few left-padded rows,
//! the logits and token log-probs of a frozen model on cuda:0 in f32 and bf16, and the
//! log-probs of a trainable model on cuda:0 in f32 and bf16 mixed precision, against the
//! frozen f32 model on the CPU, over real (unpadded) positions only.
//!
//! Tolerances: 1e-4 absolute in f32 (reduction order only); 0.05 absolute in bf16, the bound
//! `tests/memory_paths.rs` derives for bf16 log-probs (8 significant bits, a few roundings of
//! logits of magnitude ~5, log-softmax 1-Lipschitz), applied to logits and log-probs alike.
//!
//! Prints one JSON line per (model, path, dtype); exits 1 naming every pair out of tolerance,
//! 2 when no GPU can be opened.
//!
//! `cargo run --release -p rlhf-model --features cuda --example gpu_parity [-- FIXTURES_DIR]`

use std::path::{Path, PathBuf};

use rlhf_model::{Batch, DType, Device, LoadOptions, Model, ModelKind, Tensor};

const F32_TOL: f64 = 1e-4;
const BF16_TOL: f64 = 0.05;

/// Largest |a - b| over paired entries; a NaN or infinite difference counts as infinite.
fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| {
        let d = (x - y).abs();
        if d.is_finite() {
            m.max(d)
        } else {
            f32::INFINITY
        }
    })
}

/// Logits `[B, T, V]` at real positions, flattened: position `p` of a row of `len` tokens left
/// padded to `t` is real when `p >= t - len`.
fn real_logits(logits: &Tensor, lens: &[usize]) -> rlhf_model::Result<Vec<f32>> {
    let rows = logits.to_dtype(DType::F32)?.to_vec3::<f32>()?;
    let mut out = Vec::new();
    for (row, &len) in rows.iter().zip(lens) {
        let t = row.len();
        for pos in row.iter().skip(t - len) {
            out.extend_from_slice(pos);
        }
    }
    Ok(out)
}

/// Log-probs `[B, T-1]` at real positions: entry `p` scores token `p + 1` from position `p`,
/// both real when `p >= t - len`.
fn real_log_probs(lp: &Tensor, lens: &[usize]) -> rlhf_model::Result<Vec<f32>> {
    let rows = lp.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let mut out = Vec::new();
    for (row, &len) in rows.iter().zip(lens) {
        let t = row.len() + 1;
        out.extend(row.iter().skip(t - len).copied());
    }
    Ok(out)
}

/// Causal-LM fixture directories (config.json whose architecture ends in ForCausalLM).
fn causal_fixtures(root: &Path) -> Result<Vec<PathBuf>, String> {
    let entries =
        std::fs::read_dir(root).map_err(|e| format!("cannot list {}: {e}", root.display()))?;
    let mut out = Vec::new();
    for entry in entries {
        let dir = entry
            .map_err(|e| format!("cannot list {}: {e}", root.display()))?
            .path();
        let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else {
            continue;
        };
        let cfg: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("{}: bad config.json: {e}", dir.display()))?;
        let causal = cfg["architectures"]
            .as_array()
            .and_then(|a| a.first())
            .and_then(|a| a.as_str())
            .is_some_and(|a| a.ends_with("ForCausalLM"));
        if causal {
            out.push(dir);
        }
    }
    out.sort();
    if out.is_empty() {
        return Err(format!("no causal-LM fixture under {}", root.display()));
    }
    Ok(out)
}

/// Four rows of 7, 12, 3 and 10 tokens, ids in `3..vocab`, left-padded with 0.
fn rows(vocab: usize) -> Vec<Vec<u32>> {
    let span = (vocab.max(4) - 3) as u64;
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    [7usize, 12, 3, 10]
        .iter()
        .map(|&len| {
            (0..len)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (3 + (x >> 33) % span) as u32
                })
                .collect::<Vec<u32>>()
        })
        .collect()
}

struct Outcome {
    line: serde_json::Value,
    failure: Option<String>,
}

fn check_model(dir: &Path, gpu: &Device) -> rlhf_model::Result<Vec<Outcome>> {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let cpu = Model::load(dir, &LoadOptions::inference())?;
    let seqs = rows(cpu.config().vocab_size);
    let lens: Vec<usize> = seqs.iter().map(Vec::len).collect();
    let cpu_batch = Batch::left_padded(&seqs, 0, &Device::Cpu)?;
    let want_logits = real_logits(&cpu.logits(&cpu_batch)?, &lens)?;
    let want_lp = real_log_probs(&cpu.token_log_probs(&cpu_batch, 1.0)?, &lens)?;
    drop(cpu);

    let batch = Batch::left_padded(&seqs, 0, gpu)?;
    let mut out = Vec::new();
    // (path, dtype, options); the frozen models also compare logits.
    let variants = [
        ("inference", "f32", LoadOptions::inference()),
        (
            "inference",
            "bf16",
            LoadOptions::inference().with_bf16(true),
        ),
        (
            "training",
            "f32",
            LoadOptions::training(ModelKind::CausalLm),
        ),
        (
            "training",
            "bf16",
            LoadOptions::training(ModelKind::CausalLm).with_bf16(true),
        ),
    ];
    for (path, dtype, opts) in variants {
        let trainable = opts.trainable;
        let model = Model::load(dir, &opts.with_device(gpu.clone()))?;
        let lp = real_log_probs(&model.token_log_probs(&batch, 1.0)?, &lens)?;
        let lp_diff = max_abs_diff(&lp, &want_lp);
        let logits_diff = if trainable {
            None
        } else {
            Some(max_abs_diff(
                &real_logits(&model.logits(&batch)?, &lens)?,
                &want_logits,
            ))
        };
        let tol = if dtype == "bf16" { BF16_TOL } else { F32_TOL };
        // max_abs_diff turns NaN into infinity, so `>` catches it.
        let bad_lp = f64::from(lp_diff) > tol;
        let bad_logits = logits_diff.is_some_and(|d| f64::from(d) > tol);
        let ok = !bad_lp && !bad_logits;
        let line = serde_json::json!({
            "model": name,
            "path": path,
            "dtype": dtype,
            "device": "cuda:0",
            "log_probs_max_abs_diff": f64::from(lp_diff),
            "logits_max_abs_diff": logits_diff.map(f64::from),
            "tolerance": tol,
            "ok": ok,
        });
        let failure = (!ok).then(|| {
            format!(
                "{name} {path} {dtype}: max |gpu - cpu f32| log-probs {lp_diff:e}{} > tolerance {tol:e}",
                logits_diff
                    .map(|d| format!(", logits {d:e}"))
                    .unwrap_or_default()
            )
        });
        out.push(Outcome { line, failure });
    }
    Ok(out)
}

fn main() {
    let root = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"));
    let gpu = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            let hint = if cfg!(feature = "cuda") {
                "no NVIDIA driver or GPU here?"
            } else {
                "this build has no CUDA: rebuild with --features cuda"
            };
            println!("gpu_parity: no GPU: cannot open cuda:0: {e} ({hint})");
            std::process::exit(2);
        }
    };
    let dirs = match causal_fixtures(&root) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpu_parity: error: {e}");
            std::process::exit(1);
        }
    };
    let mut failures = Vec::new();
    for dir in &dirs {
        match check_model(dir, &gpu) {
            Ok(outcomes) => {
                for o in outcomes {
                    println!("{}", o.line);
                    failures.extend(o.failure);
                }
            }
            Err(e) => failures.push(format!("{}: error: {e}", dir.display())),
        }
    }
    if !failures.is_empty() {
        for f in &failures {
            eprintln!("gpu_parity: FAIL {f}");
        }
        std::process::exit(1);
    }
    eprintln!(
        "gpu_parity: {} models x 4 paths on cuda:0 within tolerance (f32 {F32_TOL:e}, bf16 {BF16_TOL:e})",
        dirs.len()
    );
}
