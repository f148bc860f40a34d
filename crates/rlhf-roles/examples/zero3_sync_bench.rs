//! Host memory of rank 0 of a ZeRO-3 trainer group during a weight sync to a rollout:
//! sending each parameter as the group gathers it ([`weights::send_weights_sharded`]) against
//! gathering the whole policy first and then sending it (what rank 0 did before: the
//! gathered tensors plus their host copy for the send, two whole `f32` copies); and during a
//! checkpoint's model save: written to a file as the group gathers it
//! ([`Model::image_streamed`]) against the whole model captured in memory and then written
//! ([`Model::image`]). The saved model's checksum must be the same both ways.
//!
//! Three real processes' worth of ranks in two: process A is rank 0 of the data-parallel
//! group and the sync's root; process B holds rank 1 of the group (its part in the gathers)
//! and the rollout (receiving into a whole model), on threads. The groups are TCP. Only A is
//! measured: its peak resident memory over what it held before the sync (`VmHWM` after a
//! reset, less `VmRSS` then), and the sync's wall time. The rollout's checksum of what it
//! received must be rank 0's, and the same for both variants.
//!
//! The model is a ~134M-parameter Llama with random weights (hidden 768, 12 layers,
//! intermediate 2048, a 32000-token vocabulary, untied head), `f32`.
//!
//! `cargo run --release -p rlhf-roles --example zero3_sync_bench`

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use rlhf_collective::{BucketedSync, CommConfig, Param, TcpCommunicator, TcpRendezvous};
use rlhf_model::profile::{reset_peak, status_mib};
use rlhf_model::{Config, Device, LoadOptions, Model, ModelKind};
use rlhf_roles::weights::{self, ipc::IpcState};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Set in the children: `SIDE VARIANT DIR DP_ADDR SYNC_ADDR`.
const CHILD: &str = "RLHF_ZERO3_SYNC_BENCH_CHILD";
const BUCKET: usize = 32 << 20;

fn trainer_opts() -> LoadOptions {
    LoadOptions {
        kind: ModelKind::CausalLm,
        device: Device::Cpu,
        trainable: true,
        ..LoadOptions::default()
    }
}

/// Rank 0: prints `transient_mib seconds checksum`.
fn root(variant: &str, dir: &Path, dp_addr: &str, sync_addr: &str) -> Result<(), BoxError> {
    let cfg = CommConfig::default();
    let model = Model::load_zero3(dir, &trainer_opts(), 0, 2, false)?;
    let mut dp = TcpRendezvous::bind(dp_addr)?.accept(2, cfg.clone())?;
    let mut sync = TcpRendezvous::bind(sync_addr)?.accept(2, cfg)?;
    rlhf_roles::mem::release_freed();
    // The peak from here on: what the sync itself adds.
    reset_peak()?;
    let before = status_mib("VmRSS:")?;
    let start = Instant::now();
    let sum = match variant {
        "save-whole" | "save-streamed" => {
            // A checkpoint's model: captured (gathered) and written.
            let out = tempfile::tempdir_in(dir.parent().ok_or("no parent")?)?;
            let z = model.zero3().ok_or("not sharded")?;
            let image = if variant == "save-whole" {
                z.lend(&mut dp, |_| model.image(None))??
            } else {
                let file = out.path().join("spilled.safetensors");
                z.lend(&mut dp, |_| model.image_streamed(None, &file))??.0
            };
            image.write(&out.path().join("model"))?;
            drop(image);
            // The peak and time of the save, before the check below loads the saved model.
            let (peak, seconds) = (status_mib("VmHWM:")?, start.elapsed().as_secs_f64());
            let saved = Model::load(out.path().join("model"), &trainer_opts())?;
            let sum = weights::weights_checksum(&saved)?;
            println!("{} {seconds} {sum}", peak - before);
            return Ok(());
        }
        "streamed" => {
            let mut st = IpcState::default();
            weights::send_weights_sharded(&model, &mut dp, &mut sync, BUCKET, &mut st)??.1
        }
        _ => {
            // Before: the whole policy gathered, copied to host vectors, then sent.
            let z = model.zero3().ok_or("not sharded")?;
            let whole = z.lend(&mut dp, |_| z.gather_all_host())??;
            let mut st = IpcState::default();
            if weights::ipc::negotiate(&model, &mut sync, &mut st)?.is_some() {
                return Err("CUDA IPC agreed over TCP".into());
            }
            let host: Vec<(String, Vec<usize>, Vec<f32>)> = whole
                .iter()
                .map(|(n, t)| {
                    let v = t.flatten_all()?.to_vec1::<f32>()?;
                    Ok((n.clone(), t.dims().to_vec(), v))
                })
                .collect::<Result<_, BoxError>>()?;
            let views: Vec<Param<'_>> = host
                .iter()
                .map(|(n, s, v)| Param::f32(n.clone(), s, v))
                .collect::<Result<_, _>>()?;
            BucketedSync::new(BUCKET)?.send(&mut sync, &views)?;
            rlhf_collective::checksum(&views)
        }
    };
    let seconds = start.elapsed().as_secs_f64();
    let peak = status_mib("VmHWM:")?;
    println!("{} {seconds} {sum}", peak - before);
    Ok(())
}

/// Rank 1 of the group and the rollout: prints the rollout's checksum (for a save, rank 1
/// only takes part in the gathers and prints 0).
fn others(variant: &str, dir: &Path, dp_addr: &str, sync_addr: &str) -> Result<(), BoxError> {
    if variant.starts_with("save") {
        let model = Model::load_zero3(dir, &trainer_opts(), 1, 2, false)?;
        let mut dp = TcpCommunicator::connect(1, 2, dp_addr, CommConfig::default())?;
        // The root accepts the second group too: connect to it and leave it idle.
        let _sync = TcpCommunicator::connect(1, 2, sync_addr, CommConfig::default())?;
        let z = model.zero3().ok_or("not sharded")?;
        z.lend(&mut dp, |_| z.gather_all_for_others())??;
        println!("0");
        return Ok(());
    }
    let (dir2, sync_addr) = (dir.to_path_buf(), sync_addr.to_string());
    let rollout = std::thread::spawn(move || -> Result<u64, BoxError> {
        let frozen = LoadOptions {
            trainable: false,
            ..trainer_opts()
        };
        let model = Model::load(&dir2, &frozen)?;
        let mut sync = TcpCommunicator::connect(1, 2, &sync_addr, CommConfig::default())?;
        let mut st = IpcState::default();
        Ok(weights::recv_weights(&model, &mut sync, BUCKET, &mut st)?.1)
    });
    let model = Model::load_zero3(dir, &trainer_opts(), 1, 2, false)?;
    let mut dp = TcpCommunicator::connect(1, 2, dp_addr, CommConfig::default())?;
    let z = model.zero3().ok_or("not sharded")?;
    z.lend(&mut dp, |_| z.gather_all_for_others())??;
    let sum = rollout
        .join()
        .map_err(|_| "the rollout thread panicked")??;
    println!("{sum}");
    Ok(())
}

fn free_addr() -> Result<String, BoxError> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    Ok(format!("127.0.0.1:{port}"))
}

fn main() -> Result<(), BoxError> {
    if let Ok(spec) = std::env::var(CHILD) {
        let f: Vec<&str> = spec.split(' ').collect();
        let [side, variant, dir, dp, sync] = f[..] else {
            return Err(format!("bad {CHILD}: {spec}").into());
        };
        return match side {
            "root" => root(variant, Path::new(dir), dp, sync),
            _ => others(variant, Path::new(dir), dp, sync),
        };
    }
    if let Some(a) = std::env::args().nth(1) {
        return Err(format!("unknown argument {a}: this bench takes none").into());
    }
    let tmp = tempfile::tempdir()?;
    let cfg = Config::tiny_llama(32000, 768, 2048, 12, 12, 12, 512)?;
    let made = Model::random(&cfg, &trainer_opts())?;
    let params = made.params().num_params();
    made.save(tmp.path(), None)?;
    drop(made);
    let dir = tmp.path().display().to_string();
    println!(
        "model: {:.1}M parameters, {:.0} MiB whole in f32; 2 trainer ranks (ZeRO-3) and a rollout, TCP",
        params as f64 / 1e6,
        params as f64 * 4.0 / 1048576.0
    );
    println!(
        "\n{:>13} {:>22} {:>9} {:>9}",
        "variant", "rank 0 transient MiB", "seconds", "vs whole"
    );
    let mut base: Option<(f64, u64)> = None;
    let exe = std::env::current_exe()?;
    for variant in ["whole", "streamed", "save-whole", "save-streamed"] {
        if variant == "save-whole" {
            base = None;
        }
        let (dp, sync) = (free_addr()?, free_addr()?);
        let spawn = |side: &str| {
            Command::new(&exe)
                .env(CHILD, format!("{side} {variant} {dir} {dp} {sync}"))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
        };
        let (a, b) = (spawn("root")?, spawn("others")?);
        let (a, b) = (a.wait_with_output()?, b.wait_with_output()?);
        for (who, out) in [("rank 0", &a), ("rank 1 and the rollout", &b)] {
            if !out.status.success() {
                return Err(format!(
                    "{variant}: {who} failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                )
                .into());
            }
        }
        let text = String::from_utf8(a.stdout)?;
        let f: Vec<&str> = text.split_whitespace().collect();
        let [transient, seconds, sum] = f[..] else {
            return Err(format!("{variant}: unexpected output {text}").into());
        };
        let (transient, seconds, sum): (f64, f64, u64) =
            (transient.parse()?, seconds.parse()?, sum.parse()?);
        let received: u64 = String::from_utf8(b.stdout)?.trim().parse()?;
        if received != sum && !variant.starts_with("save") {
            return Err(format!(
                "{variant}: the rollout's checksum {received} is not rank 0's {sum}"
            )
            .into());
        }
        let ratio = match base {
            None => {
                base = Some((transient, sum));
                "1.000x".to_string()
            }
            Some((t, s)) => {
                if s != sum {
                    return Err(format!("{variant} sent other weights: {sum} vs {s}").into());
                }
                format!("{:.3}x", transient / t)
            }
        };
        println!("{variant:>13} {transient:>22.0} {seconds:>9.2} {ratio:>9}");
    }
    Ok(())
}
