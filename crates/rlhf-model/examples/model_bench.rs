//! Benchmark of rlhf-model on a random Llama or Qwen2: batched greedy generation (tokens/s at
//! each batch size), forward log-probs without gradients (tokens/s) and one training step
//! (forward + backward + AdamW). Prints one JSON line per measurement;
//! scripts/model_bench.sh runs the same work in PyTorch (scripts/model_bench.py, same flags)
//! and prints the ratios, on the CPU by default or on a GPU (`--device cuda:0`, a build with
//! `--features cuda`; scripts/gpu_bench.sh).
//!
//! `cargo run --release -p rlhf-model --example model_bench -- --hidden 512 --layers 6 ...`
//!
//! Flags beyond the sizes: `--device cpu|cuda:N` (default cpu), `--dtype f32|bf16` (bf16: the
//! trained model keeps f32 master weights and computes in bf16, the generating model holds
//! bf16 weights), `--family llama|qwen2|qwen3` (qwen2: q/k/v biases, Qwen2's rms_norm_eps 1e-6; qwen3: q/k norms),
//! `--tie` (tied embeddings), `--parts` (instead of the above, each training op of a layer and
//! the LM head timed alone at these sizes, forward and forward + backward: where a step's time
//! goes). On a GPU every timed region ends with a read of a result back to the host, which
//! waits for the queued kernels.

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rlhf_model::{
    generate, AdamW, AdamWConfig, Batch, Config, DType, Device, Family, GenerationConfig,
    Gradients, LoadOptions, Model, ModelKind, Tensor,
};

const USAGE: &str = "usage: model_bench [--hidden N] [--layers N] [--heads N] [--kv-heads N] \
[--intermediate N] [--vocab N] [--prompt-len N] [--new-tokens N] [--train-batch N] \
[--train-seq N] [--batches N,N,..] [--repeats N] [--threads N] [--device cpu|cuda:N] \
[--dtype f32|bf16] [--family llama|qwen2|qwen3] [--tie] [--parts]";

struct Args {
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    intermediate: usize,
    vocab: usize,
    prompt_len: usize,
    new_tokens: usize,
    train_batch: usize,
    train_seq: usize,
    batches: Vec<usize>,
    repeats: usize,
    device: String,
    bf16: bool,
    family: Family,
    tie: bool,
    parts: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        hidden: 512,
        layers: 6,
        heads: 8,
        kv_heads: 4,
        intermediate: 1408,
        vocab: 8192,
        prompt_len: 16,
        new_tokens: 64,
        train_batch: 8,
        train_seq: 128,
        batches: vec![1, 16],
        repeats: 3,
        device: "cpu".to_string(),
        bf16: false,
        family: Family::Llama,
        tie: false,
        parts: false,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        // `--flag value` or `--flag=value`, as argparse takes them on the PyTorch side.
        let (flag, inline) = match argv[i].split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (argv[i].clone(), None),
        };
        i += 1;
        match flag.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            "--tie" => {
                if inline.is_some() {
                    return Err("--tie takes no value".to_string());
                }
                a.tie = true;
                continue;
            }
            "--parts" => {
                if inline.is_some() {
                    return Err("--parts takes no value".to_string());
                }
                a.parts = true;
                continue;
            }
            _ => {}
        }
        let value = match inline {
            Some(v) => v,
            None => {
                let v = argv
                    .get(i)
                    .cloned()
                    .ok_or_else(|| format!("{flag} needs a value"))?;
                i += 1;
                v
            }
        };
        let num = || -> Result<usize, String> {
            value
                .parse::<usize>()
                .map_err(|_| format!("{flag} expects a non-negative integer, got {value:?}"))
        };
        match flag.as_str() {
            "--hidden" => a.hidden = num()?,
            "--layers" => a.layers = num()?,
            "--heads" => a.heads = num()?,
            "--kv-heads" => a.kv_heads = num()?,
            "--intermediate" => a.intermediate = num()?,
            "--vocab" => a.vocab = num()?,
            "--prompt-len" => a.prompt_len = num()?,
            "--new-tokens" => a.new_tokens = num()?,
            "--train-batch" => a.train_batch = num()?,
            "--train-seq" => a.train_seq = num()?,
            "--repeats" => a.repeats = num()?.max(1),
            // Thread count is set with RAYON_NUM_THREADS; accepted so both sides share flags.
            "--threads" => {
                num()?;
            }
            "--batches" => {
                a.batches = value
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| s.parse().map_err(|_| format!("bad --batches entry {s:?}")))
                    .collect::<Result<_, _>>()?
            }
            "--device" => a.device = value.clone(),
            "--dtype" => {
                a.bf16 = match value.as_str() {
                    "f32" => false,
                    "bf16" => true,
                    other => return Err(format!("--dtype expects f32 or bf16, got {other:?}")),
                }
            }
            "--family" => {
                a.family = match value.as_str() {
                    "llama" => Family::Llama,
                    "qwen2" => Family::Qwen2,
                    "qwen3" => Family::Qwen3,
                    other => {
                        return Err(format!(
                            "--family expects llama, qwen2 or qwen3, got {other:?}"
                        ))
                    }
                }
            }
            other => return Err(format!("unknown flag {other}\n{USAGE}")),
        }
    }
    if a.vocab < 3 {
        return Err(format!(
            "--vocab must be at least 3 (ids 0 and 1 are pad and eos), got {}",
            a.vocab
        ));
    }
    if a.train_seq < 2 {
        return Err(format!(
            "--train-seq must be at least 2 (log-probs score tokens 1..T), got {}",
            a.train_seq
        ));
    }
    Ok(a)
}

/// `cpu`, `cuda` or `cuda:N`; a clear message when the GPU cannot be opened.
fn open_device(spec: &str) -> Result<Device, String> {
    if spec == "cpu" {
        return Ok(Device::Cpu);
    }
    let bad = || format!("--device expects cpu or cuda:N, got {spec:?}");
    let ordinal = match spec.strip_prefix("cuda") {
        Some("") => 0,
        Some(rest) => rest
            .strip_prefix(':')
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(bad)?,
        None => return Err(bad()),
    };
    Device::new_cuda(ordinal).map_err(|e| {
        if cfg!(feature = "cuda") {
            format!(
                "cannot open {spec}: {e}; is there an NVIDIA driver and a GPU {ordinal} on this \
                 machine (nvidia-smi)?"
            )
        } else {
            format!(
                "cannot open {spec}: {e}; this model_bench was built without CUDA: rebuild with \
                 --features cuda (cargo build --release -p rlhf-model --features cuda --example \
                 model_bench)"
            )
        }
    })
}

/// Median wall time of `repeats` runs after one warm-up run. Each run must end by reading a
/// result back to the host, so that on a GPU its kernels are done when the clock stops.
fn median_secs(
    repeats: usize,
    mut f: impl FnMut() -> rlhf_model::Result<()>,
) -> rlhf_model::Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t0 = Instant::now();
        f()?;
        times.push(t0.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let dev = match open_device(&args.device) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let result = if args.parts {
        parts(&args, &dev)
    } else {
        run(&args, &dev)
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// A `[batch, seq]` batch of random ids from 2 up (never pad or eos), no padding.
fn random_batch(
    batch: usize,
    seq: usize,
    vocab: usize,
    seed: u64,
    dev: &Device,
) -> rlhf_model::Result<Batch> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let ids: Vec<u32> = (0..batch * seq)
        .map(|_| rng.random_range(2..vocab as u32))
        .collect();
    let ids = Tensor::from_vec(ids, (batch, seq), dev)?;
    let mask = Tensor::ones((batch, seq), DType::U32, dev)?;
    Batch::from_mask(ids, mask)
}

/// The bench model's config from the flags.
fn bench_config(args: &Args) -> rlhf_model::Result<Config> {
    let cfg = Config::tiny_llama(
        args.vocab,
        args.hidden,
        args.intermediate,
        args.layers,
        args.heads,
        args.kv_heads,
        (args.prompt_len + args.new_tokens).max(args.train_seq),
    )?;
    // Llama keeps the 1e-5 of the original CPU bench; Qwen2 its own default, 1e-6 (which is
    // what tiny_llama writes).
    let cfg = match args.family {
        Family::Llama => cfg.with_key("rms_norm_eps", serde_json::json!(1e-5))?,
        Family::Qwen2 => cfg.with_family(Family::Qwen2)?,
        Family::Qwen3 => cfg.with_family(Family::Qwen3)?,
    };
    let cfg = if args.tie {
        cfg.with_key("tie_word_embeddings", serde_json::json!(true))?
    } else {
        cfg
    };
    Ok(cfg)
}

/// `--parts`: one JSON line per op of a training step, timed alone.
fn parts(args: &Args, dev: &Device) -> rlhf_model::Result<()> {
    let shape = rlhf_model::profile::PartsShape {
        batch: args.train_batch,
        seq: args.train_seq,
        hidden: args.hidden,
        intermediate: args.intermediate,
        heads: args.heads,
        kv_heads: args.kv_heads,
        vocab: args.vocab,
    };
    let dtype = if args.bf16 { DType::BF16 } else { DType::F32 };
    for p in rlhf_model::profile::parts(dev, dtype, shape, args.repeats.max(5))? {
        println!(
            "{{\"bench\":\"part\",\"name\":{:?},\"forward_ms\":{:.3},\"forward_backward_ms\":{}}}",
            p.name,
            p.forward_ms,
            p.forward_backward_ms
                .map_or("null".to_string(), |ms| format!("{ms:.3}"))
        );
    }
    Ok(())
}

fn run(args: &Args, dev: &Device) -> rlhf_model::Result<()> {
    let cfg = bench_config(args)?;
    let where_ = if dev.is_cpu() {
        format!("cpu, {} threads", rayon_threads())
    } else {
        args.device.clone()
    };
    eprintln!(
        "rlhf-model (candle), {where_}, {}, {} {}, {:.1}M parameters",
        if args.bf16 { "bf16" } else { "f32" },
        args.family.model_type(),
        if args.tie { "tied" } else { "untied" },
        cfg.num_params() as f64 / 1e6
    );

    // Generation and log-probs: a frozen model, bf16 weights under --dtype bf16.
    let model = Model::random(
        &cfg,
        &LoadOptions::inference()
            .with_device(dev.clone())
            .with_bf16(args.bf16),
    )?;
    for &b in &args.batches {
        let mut rng = rand::rngs::StdRng::seed_from_u64(b as u64);
        let prompts: Vec<Vec<u32>> = (0..b)
            .map(|_| {
                (0..args.prompt_len)
                    .map(|_| rng.random_range(2..args.vocab as u32))
                    .collect()
            })
            .collect();
        let gcfg = GenerationConfig {
            max_new_tokens: args.new_tokens,
            min_new_tokens: args.new_tokens,
            temperature: 0.0,
            eos_token_ids: vec![1],
            pad_token_id: Some(0),
            ..GenerationConfig::default()
        };
        // Every decoding step reads its logits back to the host: the run ends synchronised.
        let secs = median_secs(args.repeats, || {
            let out = generate(&model, &prompts, &gcfg)?;
            if out
                .sequences
                .iter()
                .any(|s| s.token_ids.len() != args.new_tokens)
            {
                return Err(rlhf_model::Error::InvalidArgument(
                    "a sequence stopped before new_tokens".into(),
                ));
            }
            Ok(())
        })?;
        let tps = (b * args.new_tokens) as f64 / secs;
        println!("{{\"bench\":\"generate\",\"batch\":{b},\"tokens_per_s\":{tps}}}");
    }

    // Log-probs of train-batch x train-seq tokens without gradients (reference / old-policy
    // log-probs in PPO), full-vocabulary log-softmax at temperature 1.
    let lp_batch = random_batch(args.train_batch, args.train_seq, args.vocab, 11, dev)?;
    let secs = median_secs(args.repeats, || {
        let s = model
            .token_log_probs(&lp_batch, 1.0)?
            .sum_all()?
            .to_dtype(DType::F32)?
            .to_scalar::<f32>()?;
        if !s.is_finite() {
            return Err(rlhf_model::Error::InvalidArgument(format!(
                "log-probs sum to {s}"
            )));
        }
        Ok(())
    })?;
    let tps = (args.train_batch * args.train_seq) as f64 / secs;
    println!("{{\"bench\":\"log_probs\",\"tokens_per_s\":{tps}}}");
    drop(model);

    // Training: f32 master weights, bf16 compute under --dtype bf16.
    let (secs, kernels) = train_step_secs(args, dev, false)?;
    let tps = (args.train_batch * args.train_seq) as f64 / secs;
    println!("{{\"bench\":\"train_step\",\"seconds\":{secs},\"tokens_per_s\":{tps}}}");
    if !dev.is_cpu() && kernels != rlhf_model::Kernels::Composite {
        // The same step through candle's primitive ops (the path GPUs took before this
        // crate's CUDA kernels), measured in the same run as the baseline of the fused one.
        let (base, _) = train_step_secs(args, dev, true)?;
        println!(
            "{{\"bench\":\"train_step_composite\",\"seconds\":{base},\"fused_speedup\":{}}}",
            base / secs
        );
        // The same fused step with the freed memory kept by the device's pool across the
        // step's final synchronisation (see rlhf_model::keep_freed_device_memory).
        rlhf_model::keep_freed_device_memory(dev, u64::MAX)?;
        let (kept, _) = train_step_secs(args, dev, false)?;
        rlhf_model::keep_freed_device_memory(dev, 0)?;
        println!(
            "{{\"bench\":\"train_step_pool_kept\",\"seconds\":{kept},\"speedup\":{}}}",
            secs / kept
        );
    }
    Ok(())
}

/// Median seconds of one training step (mean next-token loss, backward, AdamW) and the
/// kernels the model used; `composite` forces candle's primitive ops.
fn train_step_secs(
    args: &Args,
    dev: &Device,
    composite: bool,
) -> rlhf_model::Result<(f64, rlhf_model::Kernels)> {
    let cfg = bench_config(args)?;
    let model = Model::random(
        &cfg,
        &LoadOptions {
            composite_ops: composite,
            ..LoadOptions::training(ModelKind::CausalLm)
                .with_device(dev.clone())
                .with_bf16(args.bf16)
        },
    )?;
    let vars = model.vars();
    let mut opt = AdamW::new(
        vars.clone(),
        AdamWConfig {
            lr: 1e-5,
            weight_decay: 0.01,
            decay_1d: true,
            ..AdamWConfig::default()
        },
    )?;
    let batch = random_batch(args.train_batch, args.train_seq, args.vocab, 7, dev)?;
    // MODEL_BENCH_PROFILE=1 prints the phases of each training step to stderr (on a GPU each
    // phase is waited for, which costs a little).
    let profile = std::env::var_os("MODEL_BENCH_PROFILE").is_some();
    let secs = median_secs(args.repeats, || {
        // Mean next-token cross-entropy, as transformers' `labels=input_ids` loss.
        let t0 = Instant::now();
        let lp = model.token_log_probs(&batch, 1.0)?;
        let loss = lp.mean_all()?.neg()?;
        if profile {
            dev.synchronize()?;
        }
        let t1 = Instant::now();
        let grads = Gradients::backward(&loss, &vars)?;
        if profile {
            dev.synchronize()?;
        }
        let t2 = Instant::now();
        opt.step(&grads)?;
        if profile {
            dev.synchronize()?;
            eprintln!(
                "forward {:.3}s backward {:.3}s adamw {:.3}s",
                (t1 - t0).as_secs_f64(),
                (t2 - t1).as_secs_f64(),
                t2.elapsed().as_secs_f64()
            );
        }
        // Read back after the optimizer step was queued: on a GPU this waits for the whole
        // step (one stream, in order); the synchronize makes that explicit.
        let l = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        dev.synchronize()?;
        if !l.is_finite() {
            return Err(rlhf_model::Error::Gradient(format!("loss is {l}")));
        }
        Ok(())
    })?;
    Ok((secs, model.kernels()))
}

fn rayon_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
}
