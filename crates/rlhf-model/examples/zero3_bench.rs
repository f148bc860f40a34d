//! ZeRO stage 3 against plain data parallelism (stage 0), two trainer ranks as two real
//! processes over the TCP communicator, on a ~57M-parameter Llama made here with random weights
//! (hidden 768, 8 layers, vocabulary 384: the model `scripts/zero_bench.sh` uses for stages 0-2)
//! and on the tiny one's shape. Per variant and rank: the median step time (two micro-batches
//! of log-prob loss, the backward, the gradient exchange and an AdamW step; the first step is
//! a warm-up) and the peak resident memory of the rank's process (`VmHWM`, so each variant runs
//! in fresh processes), with their ratios to stage 0. Rounds alternate the variants to spread
//! machine noise. The two variants must end with the same weights (their checksums are
//! compared), so the stage-3 numbers are of a run that trains the same model.
//!
//! With `--device cuda` (a `cuda` build) both ranks compute on cuda:0 and the peak is of the
//! GPU memory each rank's process holds, sampled from `nvidia-smi` every 50 ms while it runs;
//! `--models q05` adds Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads over 2 KV heads,
//! a 151936-token vocabulary; untied head, so 0.63B parameters).
//!
//! With `--dtype bf16` both variants compute in bf16 over f32 master weights
//! (`training.bf16`), and stage 3's gathers for a computation send bf16, half the bytes.
//!
//! `--comm shm` connects the ranks through the shared-memory communicator instead of TCP.
//!
//! `cargo run --release -p rlhf-model --example zero3_bench [-- --steps 6 --rounds 2
//! --models tiny,m57 --device cpu --dtype f32 --comm tcp]`

use std::process::{Command, Stdio};
use std::time::Instant;

use rlhf_collective::{
    all_reduce_f32_bucketed, CommConfig, Communicator, ReduceOp, ShmCommunicator, ShmRendezvous,
    TcpCommunicator, TcpRendezvous,
};
use rlhf_model::{AdamW, AdamWConfig, Batch, Config, DType, Device, Gradients, LoadOptions, Model};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One rank's result: median step seconds, peak MiB, weights checksum.
type RankResult = (f64, f64, f64);

/// Set in the rank processes: `MODEL VARIANT RANK WORLD ADDRESS STEPS`.
const CHILD: &str = "RLHF_ZERO3_BENCH_CHILD";
const WORLD: usize = 2;
const ROWS_PER_MICRO: usize = 2;
const MICROS: usize = 2;
const SEQ: usize = 48;

fn config(model: &str) -> Result<Config, BoxError> {
    Ok(match model {
        // hidden, intermediate, layers, heads as in scripts/zero_bench.sh's m57.
        "m57" => Config::tiny_llama(384, 768, 2048, 8, 12, 12, 256)?,
        "tiny" => Config::tiny_llama(384, 64, 128, 2, 4, 2, 256)?,
        "q05" => Config::tiny_llama(151936, 896, 4864, 24, 14, 2, 256)?,
        other => return Err(format!("unknown model {other}").into()),
    })
}

/// `cpu` or `cuda` (cuda:0).
fn device(name: &str) -> Result<Device, BoxError> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::new_cuda(0)?),
        other => Err(format!("unknown device {other}: cpu or cuda").into()),
    }
}

/// Micro-batch `m` of step `step` on `rank`: rows of token ids, some left-padded.
fn micro(step: usize, rank: usize, m: usize, dev: &Device) -> Result<Batch, BoxError> {
    let rows: Vec<Vec<u32>> = (0..ROWS_PER_MICRO)
        .map(|r| {
            let seed = (step * 131 + rank * 17 + m * 7 + r) as u32;
            let len = SEQ - (seed as usize % 9);
            (0..len as u32)
                .map(|i| (seed.wrapping_mul(2654435761).wrapping_add(i * 97)) % 383 + 1)
                .collect()
        })
        .collect();
    Ok(Batch::left_padded(&rows, 0, dev)?)
}

fn loss(model: &Model, batch: &Batch) -> Result<rlhf_model::Tensor, BoxError> {
    let lp = model.token_log_probs(batch, 1.0)?;
    let am = batch.attention_mask.to_dtype(rlhf_model::DType::F32)?;
    let t = am.dim(1)?;
    let m = (am.narrow(1, 0, t - 1)? * am.narrow(1, 1, t - 1)?)?;
    let scale = -1.0 / (WORLD * MICROS * ROWS_PER_MICRO * SEQ) as f64;
    Ok(((lp * m)?.sum_all()? * scale)?)
}

/// This rank's communicator. TCP: rank 0 listens on `addr`. Shared memory: rank 0 makes the
/// segment and writes its address into the file `addr`, which the others wait for.
fn connect(
    backend: &str,
    rank: usize,
    world: usize,
    addr: &str,
) -> Result<Box<dyn Communicator>, BoxError> {
    let cfg = CommConfig::default();
    Ok(match (backend, rank) {
        ("tcp", 0) => Box::new(TcpRendezvous::bind(addr)?.accept(world, cfg)?),
        ("tcp", _) => Box::new(TcpCommunicator::connect(rank, world, addr, cfg)?),
        ("shm", 0) => {
            let rv = ShmRendezvous::create(rlhf_collective::shm::DEFAULT_SLOT_BYTES)?;
            let tmp = format!("{addr}.tmp");
            std::fs::write(&tmp, rv.address())?;
            std::fs::rename(&tmp, addr)?;
            Box::new(rv.accept(world, cfg)?)
        }
        ("shm", _) => {
            let deadline = Instant::now() + cfg.timeout;
            let at = loop {
                if let Ok(a) = std::fs::read_to_string(addr) {
                    break a;
                }
                if Instant::now() > deadline {
                    return Err(format!("rank 0 published no segment in {addr}").into());
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            };
            Box::new(ShmCommunicator::connect(rank, world, &at, cfg)?)
        }
        (other, _) => return Err(format!("--comm is tcp or shm, not {other}").into()),
    })
}

fn child(spec: &str) -> Result<(), BoxError> {
    let f: Vec<&str> = spec.split(' ').collect();
    let [model, variant, rank, world, addr, steps, dev, dtype, backend] = f[..] else {
        return Err(format!("bad {CHILD}: {spec}").into());
    };
    let (rank, world, steps): (usize, usize, usize) =
        (rank.parse()?, world.parse()?, steps.parse()?);
    let mut comm = connect(backend, rank, world, addr)?;
    let dev = device(dev)?;
    let opts = LoadOptions {
        device: dev.clone(),
        trainable: true,
        logits_chunk: Some(256),
        gradient_checkpointing: true,
        seed: 7,
        compute_dtype: (dtype == "bf16").then_some(DType::BF16),
        ..LoadOptions::default()
    };
    let adamw = AdamWConfig {
        lr: 1e-3,
        weight_decay: 0.01,
        ..AdamWConfig::default()
    };
    let model = Model::random(&config(model)?, &opts)?;
    let mut times = Vec::new();
    let weights = if variant == "zero3" {
        let model = model.into_zero3(comm)?;
        let z = model.zero3().ok_or("not sharded")?.clone();
        let mut opt = AdamW::new(model.vars(), adamw)?;
        for step in 0..steps {
            let t = Instant::now();
            for m in 0..MICROS {
                z.begin_pass()?;
                z.backward(&loss(&model, &micro(step, rank, m, &dev)?)?)?;
            }
            let norm = z.grad_norm()?;
            let mut g = z.take_grads()?;
            g.scale(Gradients::clip_factor(norm, 1.0))?;
            opt.step(&g)?;
            times.push(t.elapsed().as_secs_f64());
        }
        z.gather_all()?
    } else {
        let vars = model.vars();
        let mut opt = AdamW::new(vars.clone(), adamw)?;
        for step in 0..steps {
            let t = Instant::now();
            let mut sum = Gradients::default();
            for m in 0..MICROS {
                sum.add(Gradients::backward(
                    &loss(&model, &micro(step, rank, m, &dev)?)?,
                    &vars,
                )?)?;
            }
            let mut host: Vec<Vec<f32>> = vars
                .iter()
                .map(|(n, v)| match sum.get(n) {
                    Some(g) => g.flatten_all()?.to_vec1::<f32>(),
                    None => Ok(vec![0.0; v.elem_count()]),
                })
                .collect::<Result<_, _>>()?;
            drop(sum);
            let mut parts: Vec<&mut [f32]> = host.iter_mut().map(|v| v.as_mut_slice()).collect();
            all_reduce_f32_bucketed(comm.as_mut(), &mut parts, ReduceOp::Sum, 4 << 20)?;
            let mut named = std::collections::BTreeMap::new();
            for ((n, v), h) in vars.iter().zip(host) {
                named.insert(n.clone(), rlhf_model::Tensor::from_vec(h, v.shape(), &dev)?);
            }
            let mut g = Gradients::from_map(named);
            g.clip_global_norm(1.0)?;
            opt.step(&g)?;
            times.push(t.elapsed().as_secs_f64());
        }
        comm.barrier()?;
        model.named_tensors()
    };
    // A checksum that moves with any element: each weighted by a pseudo-random coefficient.
    let mut sum = 0f64;
    let mut i = 0u64;
    for (_, t) in &weights {
        for x in t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()? {
            i += 1;
            let c = (i.wrapping_mul(2654435761) % 1000) as f64 / 1000.0 - 0.5;
            sum += c * f64::from(x);
        }
    }
    let mut warm = times[1..].to_vec();
    warm.sort_by(f64::total_cmp);
    println!(
        "RESULT {} {} {:.6}",
        warm[warm.len() / 2],
        rlhf_model::profile::status_mib("VmHWM:")?,
        sum
    );
    Ok(())
}

/// The GPU memory (MiB) each of `pids` holds, sampled from `nvidia-smi` every 50 ms until
/// `stop`: the most seen per process.
fn gpu_peaks(
    pids: Vec<u32>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Vec<f64>> {
    std::thread::spawn(move || {
        let mut peak = vec![0f64; pids.len()];
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let out = Command::new("nvidia-smi")
                .args([
                    "--query-compute-apps=pid,used_memory",
                    "--format=csv,noheader,nounits",
                ])
                .output();
            if let Ok(o) = out {
                for line in String::from_utf8_lossy(&o.stdout).lines() {
                    let mut f = line.split(',').map(str::trim);
                    let (Some(pid), Some(mib)) = (f.next(), f.next()) else {
                        continue;
                    };
                    let (Ok(pid), Ok(mib)) = (pid.parse::<u32>(), mib.parse::<f64>()) else {
                        continue;
                    };
                    if let Some(i) = pids.iter().position(|&p| p == pid) {
                        peak[i] = peak[i].max(mib);
                    }
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        peak
    })
}

/// Runs one variant on `WORLD` fresh processes: per rank (median step s, peak MiB, checksum);
/// the peak is of the process's GPU memory on `cuda`, of its resident memory on the CPU.
fn run(
    model: &str,
    variant: &str,
    steps: usize,
    dev: &str,
    dtype: &str,
    backend: &str,
) -> Result<Vec<RankResult>, BoxError> {
    let tmp = tempfile::tempdir()?;
    let addr = if backend == "shm" {
        tmp.path().join("segment").display().to_string()
    } else {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        format!("127.0.0.1:{port}")
    };
    let exe = std::env::current_exe()?;
    // Every rank is started before any is waited for: rank 0 waits for the others to join.
    let started: Vec<_> = (0..WORLD)
        .map(|r| {
            Command::new(&exe)
                .env(
                    CHILD,
                    format!("{model} {variant} {r} {WORLD} {addr} {steps} {dev} {dtype} {backend}"),
                )
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler =
        (dev == "cuda").then(|| gpu_peaks(started.iter().map(|c| c.id()).collect(), stop.clone()));
    let children: Vec<_> = started
        .into_iter()
        .map(|c| c.wait_with_output())
        .collect::<Result<_, _>>()?;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let gpu = match sampler {
        Some(h) => Some(h.join().map_err(|_| "the nvidia-smi sampler panicked")?),
        None => None,
    };
    let mut out = Vec::new();
    for (r, o) in children.iter().enumerate() {
        let text = String::from_utf8_lossy(&o.stdout);
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("RESULT "))
            .ok_or_else(|| {
                format!(
                    "{model} {variant} rank {r} failed: {}",
                    String::from_utf8_lossy(&o.stderr)
                )
            })?;
        let v: Vec<f64> = line.split(' ').map(str::parse).collect::<Result<_, _>>()?;
        let peak = gpu.as_ref().map_or(v[1], |g| g[r]);
        out.push((v[0], peak, v[2]));
    }
    Ok(out)
}

fn main() -> Result<(), BoxError> {
    if let Ok(spec) = std::env::var(CHILD) {
        return child(&spec);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut steps, mut rounds) = (6usize, 2usize);
    let mut models = "tiny,m57".to_string();
    let mut dev = "cpu".to_string();
    let mut dtype = "f32".to_string();
    let mut backend = "tcp".to_string();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let v = it.next().ok_or_else(|| format!("{a} needs a value"))?;
        match a.as_str() {
            "--steps" => steps = v.parse()?,
            "--rounds" => rounds = v.parse()?,
            "--models" => models = v.clone(),
            "--dtype" if v == "f32" || v == "bf16" => dtype = v.clone(),
            "--comm" if v == "tcp" || v == "shm" => backend = v.clone(),
            "--comm" => return Err(format!("--comm is tcp or shm, not {v}").into()),
            "--dtype" => return Err(format!("--dtype is f32 or bf16, not {v}").into()),
            "--device" => {
                device(v)?;
                dev = v.clone();
            }
            other => return Err(format!("unknown option {other}; see the file header").into()),
        }
    }
    if steps < 2 || rounds == 0 {
        return Err("--steps must be at least 2 and --rounds at least 1".into());
    }
    let what = if dev == "cuda" {
        "peak GPU memory per rank"
    } else {
        "peak RSS per rank"
    };
    for model in models.split(',') {
        let n: usize = Model::random(&config(model)?, &LoadOptions::default())?
            .params()
            .num_params();
        println!(
            "{model}: {:.1}M parameters, {WORLD} ranks on {dev} computing in {dtype} over {backend}, {MICROS} micro-batches of {ROWS_PER_MICRO} x {SEQ} tokens per rank and step",
            n as f64 / 1e6
        );
        let mut res: Vec<(&str, Vec<RankResult>)> = Vec::new();
        for _ in 0..rounds {
            for v in ["zero0", "zero3"] {
                res.push((v, run(model, v, steps, &dev, &dtype, &backend)?));
            }
        }
        let pick = |v: &str, f: fn(&RankResult) -> f64| -> Vec<f64> {
            res.iter()
                .filter(|(x, _)| *x == v)
                .flat_map(|(_, r)| r.iter().map(f))
                .collect()
        };
        let median = |mut x: Vec<f64>| {
            x.sort_by(f64::total_cmp);
            x[x.len() / 2]
        };
        let max = |x: Vec<f64>| x.into_iter().fold(0.0, f64::max);
        let (t0, m0) = (median(pick("zero0", |r| r.0)), max(pick("zero0", |r| r.1)));
        let (t3, m3) = (median(pick("zero3", |r| r.0)), max(pick("zero3", |r| r.1)));
        let (c0, c3) = (pick("zero0", |r| r.2), pick("zero3", |r| r.2));
        let drift = c0
            .iter()
            .zip(&c3)
            .map(|(a, b)| (a - b).abs() / a.abs().max(1e-3))
            .fold(0.0, f64::max);
        println!("  zero0  median step {t0:8.4} s (1.000x)   {what} {m0:7.0} MiB (1.000x)");
        println!(
            "  zero3  median step {t3:8.4} s ({:.3}x)   {what} {m3:7.0} MiB ({:.3}x)",
            t3 / t0,
            m3 / m0
        );
        println!("  final weights' checksums agree to {drift:.2e} (relative)");
        if drift > 1e-4 {
            return Err(format!("{model}: stage 3 trained other weights ({drift:.2e})").into());
        }
    }
    Ok(())
}
