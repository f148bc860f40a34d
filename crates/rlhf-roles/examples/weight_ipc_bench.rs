//! Trainer → rollout weight sync of a Qwen2.5-0.5B-shaped bf16 model between two real
//! processes on one GPU through CUDA IPC (src/weights/ipc.rs), next to what it is measured
//! against in the same run:
//!
//! - `map_handles_s`: the rollout process opening a fresh handle of the trainer's buffer
//!   (`cuIpcOpenMemHandle`), the fixed cost of a hand-over. Goal: the sync ≤ 2x this.
//! - `host_path_s`: the same sync through the shared-memory communicator (weights to host
//!   f32 and back), the path every rank took before.
//! - `device_copy_s`: one in-process device copy of every parameter (the bytes the sync moves
//!   once; the IPC sync copies them twice, trainer → buffer → rollout).
//!
//! This process is the trainer (rank 0); it starts itself again as the rollout (rank 1). The
//! rollout's model starts with other random weights; after the syncs both processes compare
//! their whole weights' host checksums. Medians over `--iters` syncs after one warm-up.
//!
//! `cargo run --release -p rlhf-roles --features cuda --example weight_ipc_bench [-- --device cuda:0 --iters 5 --bucket-mib 256 --layers 24]`

use std::process::Command;
use std::time::{Duration, Instant};

use rlhf_collective::{CommConfig, CommSecret, Communicator, ShmCommunicator, ShmRendezvous};
use rlhf_model::ipc::{Mapped, Region, HANDLE_BYTES};
use rlhf_model::{Config, Device, Family, LoadOptions, Model};
use rlhf_roles::weights::{self, ipc::IpcState};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const CHILD: &str = "RLHF_WEIGHT_IPC_BENCH_CHILD";
const SECRET: &str = "RLHF_WEIGHT_IPC_BENCH_SECRET";

struct Opts {
    device: String,
    iters: usize,
    bucket: usize,
    layers: usize,
}

fn parse() -> Result<Opts, BoxError> {
    let mut o = Opts {
        device: "cuda:0".into(),
        iters: 5,
        bucket: weights::ipc::DEFAULT_BUCKET_BYTES,
        layers: 24,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--device" => o.device = val()?.clone(),
            "--iters" => o.iters = val()?.parse()?,
            "--bucket-mib" => o.bucket = val()?.parse::<usize>()? << 20,
            "--layers" => o.layers = val()?.parse()?,
            other => return Err(format!("unknown option {other}; see the file header").into()),
        }
    }
    Ok(o)
}

fn device(spec: &str) -> Result<Device, BoxError> {
    let n = spec
        .strip_prefix("cuda:")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("--device expects cuda:N, got {spec:?} (CUDA IPC needs a GPU)"))?;
    Ok(Device::new_cuda(n).map_err(|e| {
        format!("cannot open {spec}: {e}; this bench needs a GPU and a build with --features cuda")
    })?)
}

/// Qwen2.5-0.5B's shape (tied embeddings), bf16, seeded.
fn model(o: &Opts, dev: &Device, seed: u64) -> Result<Model, BoxError> {
    let cfg = Config::tiny_llama(151_936, 896, 4864, o.layers, 14, 2, 512)?
        .with_family(Family::Qwen2)?
        .with_key("tie_word_embeddings", serde_json::json!(true))?;
    let mut opts = LoadOptions::inference()
        .with_device(dev.clone())
        .with_bf16(true);
    opts.seed = seed;
    Ok(Model::random(&cfg, &opts)?)
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64()
}

/// The communicator's settings, with the secret the trainer made (hex in the child's
/// environment).
fn config(secret: &CommSecret) -> CommConfig {
    CommConfig {
        secret: Some(secret.clone()),
        ..CommConfig::with_timeout(Duration::from_secs(120))
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, BoxError> {
    (0..s.len())
        .step_by(2)
        .map(|i| Ok(u8::from_str_radix(s.get(i..i + 2).ok_or("odd hex")?, 16)?))
        .collect()
}

/// The syncs both processes run, in the same order: `iters + 1` through IPC, then as many
/// through the host; each rank returns its sync times (the warm-up dropped).
fn syncs(
    m: &Model,
    comm: &mut dyn Communicator,
    o: &Opts,
    st: &mut IpcState,
    root: bool,
) -> Result<(Vec<Duration>, Vec<Duration>), BoxError> {
    let mut run = |st: &mut IpcState| -> Result<Vec<Duration>, BoxError> {
        let mut t = Vec::new();
        for i in 0..=o.iters {
            comm.barrier()?;
            let s = Instant::now();
            if root {
                weights::send_weights(m, comm, o.bucket, st)?;
            } else {
                weights::recv_weights(m, comm, o.bucket, st)?;
            }
            if i > 0 {
                t.push(s.elapsed());
            }
        }
        Ok(t)
    };
    let ipc = run(st)?;
    if st.last_was_ipc() != Some(true) {
        return Err("the sync did not take the CUDA IPC path (see the log above)".into());
    }
    let phases: Vec<String> = st
        .last_phases()
        .iter()
        .map(|(n, s)| format!("{n} {:.2} ms", s * 1e3))
        .collect();
    println!(
        "weight_ipc_bench: {} phases of the last sync: {}",
        if root { "trainer" } else { "rollout" },
        phases.join(", ")
    );
    let mut host = IpcState::default();
    host.prefer_host = true;
    Ok((ipc, run(&mut host)?))
}

fn child(addr: &str) -> Result<(), BoxError> {
    let o = parse()?;
    let dev = device(&o.device)?;
    let m = model(&o, &dev, 2)?;
    let secret = CommSecret::from_bytes(&unhex(&std::env::var(SECRET)?)?)?;
    let mut comm = ShmCommunicator::connect(1, 2, addr, config(&secret))?;
    let mut st = IpcState::default();
    syncs(&m, &mut comm, &o, &mut st, false)?;
    // A fresh handle of the same size, mapped here: the fixed cost of a hand-over.
    let mut setup = vec![0u8; HANDLE_BYTES + 8];
    comm.broadcast(&mut setup, 0)?;
    let handle = setup[..HANDLE_BYTES].try_into()?;
    let bytes = u64::from_le_bytes(setup[HANDLE_BYTES..].try_into()?) as usize;
    let s = Instant::now();
    let mapped = Mapped::open(&dev, &handle, bytes)?;
    let map_s = s.elapsed().as_secs_f64();
    drop(mapped);
    comm.all_gather(&map_s.to_le_bytes())?;
    let sum = weights::weights_checksum(&m)?;
    comm.all_gather(&sum.to_le_bytes())?;
    Ok(())
}

fn main() -> Result<(), BoxError> {
    if let Ok(addr) = std::env::var(CHILD) {
        return child(&addr);
    }
    let o = parse()?;
    let dev = device(&o.device)?;
    let m = model(&o, &dev, 1)?;
    let params = m.named_tensors();
    let bytes: usize = params
        .iter()
        .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
        .sum();
    println!(
        "weight_ipc_bench: {} parameters, {:.1} MiB bf16 on {}, buckets of {} MiB",
        params.len(),
        bytes as f64 / (1 << 20) as f64,
        o.device,
        o.bucket >> 20
    );
    // The GPU's hash kernel against the host's function, on a parameter and a piece of one.
    for (name, t) in params
        .iter()
        .filter(|(n, _)| n.ends_with("norm.weight"))
        .take(1)
    {
        let host = t.to_device(&Device::Cpu)?;
        let piece = t.flatten_all()?.narrow(0, 3, 101)?;
        for (what, gpu, cpu) in [
            (name.as_str(), t.clone(), host.clone()),
            (
                "a piece",
                piece.contiguous()?,
                piece.to_device(&Device::Cpu)?,
            ),
        ] {
            let (g, c) = (
                rlhf_model::ipc::hash(&gpu, 77)?,
                rlhf_model::ipc::hash(&cpu, 77)?,
            );
            if g != c {
                return Err(format!("ipc_hash of {what}: GPU {g:016x}, host {c:016x}").into());
            }
        }
        println!("weight_ipc_bench: the GPU hash kernel matches the host's on {name}");
    }
    let secret = CommSecret::generate();
    let rv = ShmRendezvous::create(rlhf_collective::shm::DEFAULT_SLOT_BYTES)?;
    let mut kid = Command::new(std::env::current_exe()?)
        .args(std::env::args().skip(1))
        .env(CHILD, rv.address())
        .env(SECRET, hex(secret.as_bytes()))
        .spawn()?;
    let mut comm = rv.accept(2, config(&secret))?;
    let mut st = IpcState::default();
    let (ipc, host) = syncs(&m, &mut comm, &o, &mut st, true)?;

    // The baseline copy: every parameter once, device to device, in this process.
    let mut copies = Vec::new();
    for _ in 0..=o.iters {
        let s = Instant::now();
        let out: Vec<_> = params
            .iter()
            .map(|(_, t)| t.copy())
            .collect::<Result<_, _>>()?;
        rlhf_model::ipc::hash(&out[0], 0)?; // waits for the stream
        copies.push(s.elapsed());
    }
    copies.remove(0);

    let region = Region::new(&dev, o.bucket.min(bytes))?;
    let mut setup = region.handle().to_vec();
    setup.extend_from_slice(&(region.len() as u64).to_le_bytes());
    comm.broadcast(&mut setup, 0)?;
    let got = comm.all_gather(&0f64.to_le_bytes())?;
    let map_s = f64::from_le_bytes(got[1][..8].try_into()?);
    let mine = weights::weights_checksum(&m)?;
    let sums = comm.all_gather(&mine.to_le_bytes())?;
    let theirs = u64::from_le_bytes(sums[1][..8].try_into()?);
    let status = kid.wait()?;
    if !status.success() {
        return Err(format!("the rollout process failed: {status}").into());
    }
    if theirs != mine {
        return Err(format!(
            "the rollout ended with weights {theirs:016x}, the trainer has {mine:016x}"
        )
        .into());
    }
    let (ipc_s, host_s, copy_s) = (median(ipc), median(host), median(copies));
    println!(
        "{}",
        serde_json::json!({
            "bench": "weight_ipc",
            "bytes": bytes,
            "cuda_ipc_sync_s": ipc_s,
            "map_handles_s": map_s,
            "host_path_s": host_s,
            "device_copy_s": copy_s,
            "sync_over_map": ipc_s / map_s,
            "host_over_ipc": host_s / ipc_s,
            "ipc_gb_per_s": bytes as f64 / ipc_s / 1e9,
            "checksum": format!("{mine:016x}"),
        })
    );
    println!(
        "weight_ipc_bench: CUDA IPC sync {:.2} ms = {:.2}x the {:.2} ms to map a handle (goal <= 2); \
         {:.1}x faster than the host path ({:.1} ms); {:.2}x one device copy ({:.2} ms); \
         the rollout's weights match the trainer's ({mine:016x})",
        ipc_s * 1e3,
        ipc_s / map_s,
        map_s * 1e3,
        host_s / ipc_s,
        host_s * 1e3,
        ipc_s / copy_s,
        copy_s * 1e3
    );
    Ok(())
}
