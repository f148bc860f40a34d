//! CPU bench of the LM head's memory saver: log-probs and their backward over Qwen2.5's
//! vocabulary (151,936) for 8 x 512 tokens, with the full `[B, T, V]` logits and in chunks,
//! in one run. Two scenarios, each printing one JSON line per variant (seconds, peak bytes
//! allocated above the baseline) and one with the ratios chunked / full:
//!
//! * `head`: the LM head alone (`lm_head_log_probs` on hidden states `[N, 896]` and the head
//!   weight, both trainable): what chunking changes;
//! * `model`: Qwen2.5-0.5B's head (hidden 896, tied embeddings) over a one-layer trunk with
//!   a tiny MLP, through `Model::token_log_probs` and `Gradients::backward`: end to end,
//!   including the f32 gradients of the tied 151,936 x 896 embedding that candle's autograd
//!   builds (index-select backward, head gradient, their sum) in both variants.
//!
//! Peak memory is counted by this binary's global allocator (every candle CPU buffer is a
//! Rust allocation), not sampled from the OS.
//!
//! `cargo run --release -p rlhf-model --example head_bench [-- --chunk 512 --tokens 512
//! --batch 8 --repeats 1]`

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use rlhf_model::{
    lm_head_log_probs, Batch, Config, DType, Device, Family, Gradients, LoadOptions, Model,
    ModelKind, Tensor, Var,
};

/// The system allocator, counting live bytes and their high-water mark.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded unchanged to the system allocator, which upholds the
// GlobalAlloc contract; the counters are only arithmetic on the sizes passed through.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout is passed through as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with this layout (every allocation of this
        // allocator is).
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `dealloc`; the caller guarantees `new_size` is valid for the layout.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} takes a number, got {v}"))
        })
        .unwrap_or(default)
}

/// Best time over `repeats` runs of `f` and the largest peak of live bytes above what was
/// live before each run.
fn measure(
    repeats: usize,
    mut f: impl FnMut() -> rlhf_model::Result<bool>,
) -> rlhf_model::Result<(f64, usize)> {
    let mut best = f64::INFINITY;
    let mut peak = 0usize;
    for _ in 0..repeats {
        let base = LIVE.load(Ordering::Relaxed);
        PEAK.store(base, Ordering::Relaxed);
        let t0 = Instant::now();
        let ok = f()?;
        best = best.min(t0.elapsed().as_secs_f64());
        peak = peak.max(PEAK.load(Ordering::Relaxed).saturating_sub(base));
        assert!(ok, "the backward produced no gradient");
    }
    Ok((best, peak))
}

fn report(
    scenario: &str,
    name: &str,
    chunk: Option<usize>,
    batch: usize,
    tokens: usize,
    vocab: usize,
    (seconds, peak): (f64, usize),
) {
    println!(
        "{}",
        serde_json::json!({
            "scenario": scenario, "variant": name, "batch": batch, "tokens": tokens,
            "vocab": vocab, "hidden": 896, "chunk": chunk, "seconds": seconds,
            "peak_bytes": peak, "peak_gib": peak as f64 / (1u64 << 30) as f64,
        })
    );
}

fn ratio(scenario: &str, full: (f64, usize), chunked: (f64, usize)) {
    println!(
        "{}",
        serde_json::json!({
            "scenario": scenario,
            "ratio": "chunked / full",
            "peak": chunked.1 as f64 / full.1 as f64,
            "time": chunked.0 / full.0,
            "goal": "peak <= 0.125, time <= 1.2",
        })
    );
}

fn main() -> rlhf_model::Result<()> {
    let (batch, tokens) = (arg("--batch", 8), arg("--tokens", 512));
    let chunk = arg("--chunk", 512);
    let repeats = arg("--repeats", 1).max(1);
    let vocab = 151_936;
    let cfg = Config::tiny_llama(vocab, 896, 64, 1, 14, 2, 4096)?
        .with_family(Family::Qwen2)?
        .with_key("tie_word_embeddings", serde_json::json!(true))?;
    let mut x = 0x9E3779B97F4A7C15u64;
    let seqs: Vec<Vec<u32>> = (0..batch)
        .map(|_| {
            (0..tokens)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % vocab as u64) as u32
                })
                .collect()
        })
        .collect();
    let data = Batch::left_padded(&seqs, 0, &Device::Cpu)?;

    // The head alone.
    let n = batch * tokens;
    let h0 = Tensor::randn(0f32, 1.0, (n, 896), &Device::Cpu)?;
    let w0 = (Tensor::randn(0f32, 1.0, (vocab, 896), &Device::Cpu)? * 0.02)?;
    let ids: Vec<u32> = seqs.iter().flatten().copied().collect();
    let targets = Tensor::from_vec(ids, n, &Device::Cpu)?;
    let mut head = Vec::new();
    for (name, logits_chunk) in [("full", None), ("chunked", Some(chunk))] {
        let (h, w) = (Var::from_tensor(&h0)?, Var::from_tensor(&w0)?);
        let r = measure(repeats, || {
            let lp = lm_head_log_probs(h.as_tensor(), w.as_tensor(), &targets, 1.0, logits_chunk)?;
            let grads = lp.mean_all()?.neg()?.backward()?;
            Ok(grads.get(w.as_tensor()).is_some())
        })?;
        report("head", name, logits_chunk, batch, tokens, vocab, r);
        head.push(r);
    }
    ratio("head", head[0], head[1]);

    // End to end through the model.
    let mut model_runs = Vec::new();
    for (name, logits_chunk) in [("full", None), ("chunked", Some(chunk))] {
        let opts = LoadOptions {
            logits_chunk,
            seed: 1,
            ..LoadOptions::training(ModelKind::CausalLm).with_dtype(DType::F32)
        };
        let model = Model::random(&cfg, &opts)?;
        let vars = model.vars();
        let r = measure(repeats, || {
            let lp = model.token_log_probs(&data, 1.0)?;
            let grads = Gradients::backward(&lp.mean_all()?.neg()?, &vars)?;
            Ok(!grads.is_empty())
        })?;
        report("model", name, logits_chunk, batch, tokens, vocab, r);
        model_runs.push(r);
    }
    ratio("model", model_runs[0], model_runs[1]);
    Ok(())
}
