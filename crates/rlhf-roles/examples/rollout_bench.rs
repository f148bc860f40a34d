//! The rollout engines side by side, on the same model, prompts and sampling settings in one
//! run: our candle loop against a vLLM server (`actor_rollout.engine: vllm`).
//!
//! - Generation: `--prompts` prompts of spread lengths, `--samples` samples each (consecutive,
//!   as a GRPO group; vLLM gets each group as one request with `n`), up to `--max-new`
//!   tokens; `--stop-frac` of the vocabulary are stop ids, so responses end at spread lengths
//!   (a random model never says EOS on its own). Reports tokens/s of each and the ratio.
//! - Weights: one publish to vLLM (safetensors into its shared-memory directory, pause,
//!   reload, resume) against one candle weight sync of the same model over the shared-memory
//!   communicator between two threads (what a rollout rank on the trainer's node receives).
//!   Medians over `--iters`.
//!
//! The model is a random Llama made here (`--hidden`, `--layers`, `--heads`; head_dim =
//! hidden / heads must be ≥ 32 for vLLM's CPU attention) with models/tiny's tokenizer.
//! One JSON line per measurement; the last line has the ratios.
//!
//! `cargo run --release -p rlhf-roles --example rollout_bench -- --python target/vllm-venv/bin/python [--device cpu|cuda] [--hidden 1024 --layers 6 --heads 16]`

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rlhf_collective::{CommConfig, ShmCommunicator, ShmRendezvous};
use rlhf_model::{generate, Config, Device, Generation, GenerationConfig, LoadOptions, Model};
use rlhf_roles::vllm::{VllmDevice, VllmServer, VllmSettings};
use rlhf_roles::weights::{self, ipc::IpcState};
use serde_json::json;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct Opts {
    python: Option<PathBuf>,
    device: String,
    hidden: usize,
    layers: usize,
    heads: usize,
    prompts: usize,
    samples: usize,
    prompt_len: usize,
    max_new: usize,
    stop_frac: f64,
    iters: usize,
    seed: u64,
}

fn parse() -> Result<Opts, BoxError> {
    let mut o = Opts {
        python: std::env::var_os("RLHF_VLLM_PYTHON").map(PathBuf::from),
        device: "cpu".into(),
        hidden: 1024,
        layers: 6,
        heads: 16,
        prompts: 8,
        samples: 8,
        prompt_len: 48,
        max_new: 128,
        stop_frac: 0.01,
        iters: 3,
        seed: 7,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--python" => o.python = Some(val()?.into()),
            "--device" => o.device = val()?.clone(),
            "--hidden" => o.hidden = val()?.parse()?,
            "--layers" => o.layers = val()?.parse()?,
            "--heads" => o.heads = val()?.parse()?,
            "--prompts" => o.prompts = val()?.parse()?,
            "--samples" => o.samples = val()?.parse()?,
            "--prompt-len" => o.prompt_len = val()?.parse()?,
            "--max-new" => o.max_new = val()?.parse()?,
            "--stop-frac" => o.stop_frac = val()?.parse()?,
            "--iters" => o.iters = val()?.parse()?,
            "--seed" => o.seed = val()?.parse()?,
            other => return Err(format!("unknown option {other}; see the file header").into()),
        }
    }
    if o.heads == 0 || !o.hidden.is_multiple_of(o.heads) || o.hidden / o.heads < 32 {
        return Err(format!(
            "--hidden {} / --heads {} must be a whole head_dim of at least 32 (vLLM's CPU attention)",
            o.hidden, o.heads
        )
        .into());
    }
    Ok(o)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// A random Llama with models/tiny's tokenizer, saved as an HF directory.
fn make_model(o: &Opts, dir: &Path, tiny: &Path) -> Result<Config, BoxError> {
    let tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny.join("config.json"))?)?;
    let cfg = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": o.hidden, "intermediate_size": o.hidden * 11 / 4,
        "num_hidden_layers": o.layers, "num_attention_heads": o.heads,
        "num_key_value_heads": o.heads, "head_dim": o.hidden / o.heads,
        "vocab_size": tok["vocab_size"], "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": false, "eos_token_id": tok["eos_token_id"],
        "pad_token_id": tok["pad_token_id"], "torch_dtype": "float32",
        "attention_bias": false, "mlp_bias": false,
    });
    let config = Config::from_json(&cfg)?;
    let model = Model::random(&config, &LoadOptions::inference())?;
    model.save(dir, Some(tiny))?;
    Ok(config)
}

/// Prints one generation's line (tokens/s and the spread of response lengths, plus
/// `extra`'s fields) and returns its tokens/s.
fn report(engine: &str, g: &Generation, seconds: f64, extra: serde_json::Value) -> f64 {
    let l: Vec<usize> = g.sequences.iter().map(|s| s.token_ids.len()).collect();
    let tokens: usize = l.iter().sum();
    let tps = tokens as f64 / seconds;
    let mut line = json!({"bench": "generate", "engine": engine, "sequences": l.len(),
        "tokens": tokens, "seconds": seconds, "tokens_per_s": tps,
        "len_min": l.iter().min(), "len_max": l.iter().max(),
        "len_mean": tokens as f64 / l.len().max(1) as f64});
    if let (Some(m), Some(e)) = (line.as_object_mut(), extra.as_object()) {
        m.extend(e.clone());
    }
    println!("{line}");
    tps
}

/// One candle weight sync of `model` into `into` over a shared-memory pair of threads.
fn candle_sync(model: &Model, into: &Model) -> Result<Duration, BoxError> {
    let rv = ShmRendezvous::create(64 << 20)?;
    let addr = rv.address().to_string();
    let cfg = || CommConfig::with_timeout(Duration::from_secs(600));
    std::thread::scope(|s| {
        let recv = s.spawn(move || -> Result<(), BoxError> {
            let mut c = ShmCommunicator::connect(1, 2, &addr, cfg())?;
            weights::recv_weights(into, &mut c, 64 << 20, &mut IpcState::default())?;
            Ok(())
        });
        let mut c = rv.accept(2, cfg())?;
        let t = Instant::now();
        weights::send_weights(model, &mut c, 64 << 20, &mut IpcState::default())?;
        recv.join().map_err(|_| "the receiving thread panicked")??;
        Ok(t.elapsed())
    })
}

fn main() -> Result<(), BoxError> {
    let o = parse()?;
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let tiny = root.join("models/tiny");
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("model");
    let config = make_model(&o, &dir, &tiny)?;
    let vocab = config.vocab_size as u32;
    let device = match o.device.as_str() {
        "cpu" => Device::Cpu,
        d => Device::new_cuda(d.strip_prefix("cuda:").unwrap_or("0").parse().unwrap_or(0))?,
    };
    let model = Model::load(&dir, &LoadOptions::inference().with_device(device.clone()))?;
    let params = config.num_params();
    println!(
        "{}",
        json!({"bench": "model", "params_m": params as f64 / 1e6, "device": o.device,
               "head_dim": o.hidden / o.heads, "vocab": vocab})
    );

    let mut rng = rand::rngs::StdRng::seed_from_u64(o.seed);
    let mut prompts = Vec::new();
    for _ in 0..o.prompts {
        let len = rng.random_range(o.prompt_len / 2..=o.prompt_len);
        let p: Vec<u32> = (0..len).map(|_| rng.random_range(1..vocab)).collect();
        prompts.extend(std::iter::repeat_n(p, o.samples));
    }
    let stop_n = ((f64::from(vocab) * o.stop_frac).round() as usize).max(1);
    let stop: Vec<u32> = (0..stop_n)
        .map(|i| 1 + (i as u32 * 37) % (vocab - 1))
        .collect();
    let gen = GenerationConfig {
        max_new_tokens: o.max_new,
        min_new_tokens: 0,
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        n: 1,
        seed: o.seed,
        eos_token_ids: vec![0],
        stop_token_ids: stop,
        pad_token_id: Some(0),
        truncate_prompts: false,
        ..GenerationConfig::default()
    };

    // candle: a warm-up, then the timed batch.
    generate(&model, &prompts[..2], &gen)?;
    let t = Instant::now();
    let out = generate(&model, &prompts, &gen)?;
    let candle_tps = report("candle", &out, t.elapsed().as_secs_f64(), json!({}));

    // The candle sync baseline.
    let into = Model::load(&dir, &LoadOptions::inference().with_device(device.clone()))?;
    candle_sync(&model, &into)?;
    let sync_s = median(
        (0..o.iters)
            .map(|_| candle_sync(&model, &into).map(|d| d.as_secs_f64()))
            .collect::<Result<_, _>>()?,
    );
    let bytes = params as f64 * 4.0;
    println!(
        "{}",
        json!({"bench": "weights", "engine": "candle", "path": "shared-memory sync",
               "seconds": sync_s, "gb": bytes / 1e9, "s_per_gb": sync_s / (bytes / 1e9)})
    );

    let Some(python) = o.python.clone().filter(|p| !p.as_os_str().is_empty()) else {
        println!(
            "{}",
            json!({"bench": "vllm", "skipped": "no --python or RLHF_VLLM_PYTHON: vLLM not measured"})
        );
        return Ok(());
    };
    let settings = VllmSettings {
        python,
        model_dir: dir.clone(),
        device: if o.device == "cpu" {
            VllmDevice::Cpu
        } else {
            VllmDevice::Cuda
        },
        dtype: "float32".into(),
        max_model_len: o.prompt_len + o.max_new,
        kv_cache_gb: 2,
        gpu_memory_utilization: 0.5,
        max_num_seqs: prompts.len().max(1),
        enable_prefix_caching: true,
        extra_args: vec![],
        start_timeout: Duration::from_secs(1200),
        request_timeout: Duration::from_secs(1200),
        vocab_size: vocab as usize,
    };
    let t = Instant::now();
    let mut server = VllmServer::start(&settings)?;
    let start_s = t.elapsed().as_secs_f64();
    server.generate(&prompts[..2], &gen)?;
    let t = Instant::now();
    let out = server.generate(&prompts, &gen)?;
    let secs = t.elapsed().as_secs_f64();
    let vllm_tps = report("vllm", &out, secs, json!({ "start_s": start_s }));

    // One publish: what a vLLM rollout rank does after each sync.
    let wdir = server.weights_dir();
    let mut publish = Vec::new();
    for _ in 0..o.iters.max(1) {
        let t = Instant::now();
        model.save(&wdir, None)?;
        server.reload(&wdir)?;
        publish.push(t.elapsed().as_secs_f64());
        let _ = std::fs::remove_dir_all(&wdir);
    }
    let publish_s = median(publish);
    println!(
        "{}",
        json!({"bench": "weights", "engine": "vllm", "path": "safetensors in shared memory + reload",
               "seconds": publish_s, "gb": bytes / 1e9, "s_per_gb": publish_s / (bytes / 1e9)})
    );
    println!(
        "{}",
        json!({"bench": "ratio", "vllm_over_candle_tokens_per_s": vllm_tps / candle_tps,
               "vllm_publish_over_candle_sync": publish_s / sync_s,
               "note": "the weight time of a vLLM rank is the candle sync plus the publish"})
    );
    Ok(())
}
