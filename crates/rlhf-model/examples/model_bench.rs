//! CPU benchmark of rlhf-model on a random Llama: batched greedy generation (tokens/s at each
//! batch size) and one training step (forward + backward + AdamW). Prints one JSON line per
//! measurement; scripts/model_bench.sh runs the same work in PyTorch and prints the ratios.
//!
//! `cargo run --release -p rlhf-model --example model_bench -- --hidden 512 --layers 6 ...`

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rlhf_model::{
    generate, AdamW, AdamWConfig, Batch, Config, Device, GenerationConfig, Gradients, LoadOptions,
    Model, ModelKind, Tensor,
};

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
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let flag = argv[i].as_str();
        let value = argv
            .get(i + 1)
            .ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || -> Result<usize, String> {
            value
                .parse::<usize>()
                .map_err(|_| format!("{flag} expects a non-negative integer, got {value:?}"))
        };
        match flag {
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
            other => return Err(format!("unknown flag {other}")),
        }
        i += 2;
    }
    Ok(a)
}

/// Median wall time of `repeats` runs after one warm-up run.
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
    if let Err(e) = run(&args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> rlhf_model::Result<()> {
    let cfg = Config::tiny_llama(
        args.vocab,
        args.hidden,
        args.intermediate,
        args.layers,
        args.heads,
        args.kv_heads,
        (args.prompt_len + args.new_tokens).max(args.train_seq),
    )?
    .with_key("rms_norm_eps", serde_json::json!(1e-5))?;
    let dev = Device::Cpu;
    eprintln!(
        "rlhf-model (candle), {} threads, {:.1}M parameters",
        rayon_threads(),
        cfg.num_params() as f64 / 1e6
    );

    let model = Model::random(&cfg, &LoadOptions::inference())?;
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
    drop(model);

    let model = Model::random(&cfg, &LoadOptions::training(ModelKind::CausalLm))?;
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
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let n = args.train_batch * args.train_seq;
    let ids: Vec<u32> = (0..n)
        .map(|_| rng.random_range(2..args.vocab as u32))
        .collect();
    let ids = Tensor::from_vec(ids, (args.train_batch, args.train_seq), &dev)?;
    let mask = Tensor::ones(
        (args.train_batch, args.train_seq),
        rlhf_model::DType::U32,
        &dev,
    )?;
    let batch = Batch::from_mask(ids, mask)?;
    // MODEL_BENCH_PROFILE=1 prints the phases of each training step to stderr.
    let profile = std::env::var_os("MODEL_BENCH_PROFILE").is_some();
    let secs = median_secs(args.repeats, || {
        // Mean next-token cross-entropy, as transformers' `labels=input_ids` loss.
        let t0 = Instant::now();
        let lp = model.token_log_probs(&batch, 1.0)?;
        let loss = lp.mean_all()?.neg()?;
        let t1 = Instant::now();
        let grads = Gradients::backward(&loss, &vars)?;
        let t2 = Instant::now();
        opt.step(&grads)?;
        if profile {
            eprintln!(
                "forward {:.3}s backward {:.3}s adamw {:.3}s",
                (t1 - t0).as_secs_f64(),
                (t2 - t1).as_secs_f64(),
                t2.elapsed().as_secs_f64()
            );
        }
        let l = loss.to_scalar::<f32>()?;
        if !l.is_finite() {
            return Err(rlhf_model::Error::Gradient(format!("loss is {l}")));
        }
        Ok(())
    })?;
    println!("{{\"bench\":\"train_step\",\"seconds\":{secs}}}");
    Ok(())
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
