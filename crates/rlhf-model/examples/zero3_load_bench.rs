//! Host memory of a ZeRO-3 rank while it loads its model and while it restores a
//! checkpoint's weights: reading only its pieces out of the mapped files
//! ([`Model::load_zero3`], [`Model::load_zero3_weights`]) against loading the whole model and
//! then cutting the pieces (what every rank did before, and still what
//! [`Model::into_zero3_lent_on`] does).
//!
//! The model is a ~134M-parameter Llama with random weights (hidden 768, 12 layers,
//! intermediate 2048, a 32000-token vocabulary, untied head), saved here in bf16 as HF models
//! ship. Each variant runs in a fresh process as rank 0 of `world` (no collective is needed
//! to load) and reports its peak resident memory (`VmHWM`: the heap and the pages of the
//! mapped files it touched) and the load's wall time. The pieces of both ways are compared,
//! so the numbers are of loads that give the same model.
//!
//! `cargo run --release -p rlhf-model --example zero3_load_bench [-- --worlds 2,4]`

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use rlhf_model::profile::{reset_peak, status_mib};
use rlhf_model::{Config, DType, Device, LoadOptions, Model, ModelKind};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Set in the child processes: `VARIANT WORLD DIR`.
const CHILD: &str = "RLHF_ZERO3_LOAD_BENCH_CHILD";

/// Every variant: (name, what it does).
const VARIANTS: &[(&str, &str)] = &[
    ("load-whole", "Model::load, then into_zero3_lent_on"),
    ("load-pieces", "Model::load_zero3"),
    (
        "restore-whole",
        "load-pieces, then Model::load + set_weights",
    ),
    ("restore-pieces", "load-pieces, then load_zero3_weights"),
];

fn opts() -> LoadOptions {
    LoadOptions {
        kind: ModelKind::CausalLm,
        device: Device::Cpu,
        trainable: true,
        ..LoadOptions::default()
    }
}

/// A checksum of a model's variables (its pieces): the same for both ways of loading.
fn checksum(model: &Model) -> Result<f64, BoxError> {
    let mut sum = 0.0;
    for (i, (_, v)) in model.vars().iter().enumerate() {
        let s: f32 = v.as_tensor().flatten_all()?.abs()?.sum_all()?.to_scalar()?;
        sum += f64::from(s) * (i + 1) as f64;
    }
    Ok(sum)
}

/// One variant in this process; prints `peak_mib seconds checksum held_elements`.
fn child(spec: &str) -> Result<(), BoxError> {
    let parts: Vec<&str> = spec.split(' ').collect();
    let [variant, world, dir] = parts[..] else {
        return Err(format!("bad child spec {spec}").into());
    };
    let (world, dir): (usize, &Path) = (world.parse()?, Path::new(dir));
    let o = opts();
    let start = Instant::now();
    let model = match variant {
        "load-whole" => Model::load(dir, &o)?.into_zero3_lent_on(0, world, false, &Device::Cpu)?,
        _ => Model::load_zero3(dir, &o, 0, world, false)?,
    };
    let mut seconds = start.elapsed().as_secs_f64();
    match variant {
        "restore-whole" | "restore-pieces" => {
            // Only the restore's own peak counts: the peak is reset after the first load.
            reset_peak()?;
            let start = Instant::now();
            if variant == "restore-whole" {
                let saved = Model::load(dir, &o)?;
                model.set_weights(&saved.named_tensors())?;
            } else {
                model.load_zero3_weights(dir)?;
            }
            seconds = start.elapsed().as_secs_f64();
        }
        _ => {}
    }
    let peak = status_mib("VmHWM:")?;
    let held = model.zero3().ok_or("not sharded")?.sizes()?.0;
    println!("{peak} {seconds} {} {held}", checksum(&model)?);
    Ok(())
}

fn main() -> Result<(), BoxError> {
    if let Ok(spec) = std::env::var(CHILD) {
        return child(&spec);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut worlds = vec![2usize, 4];
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--worlds" => {
                let v = it.next().ok_or("--worlds needs a list, e.g. 2,4")?;
                worlds = v.split(',').map(str::parse).collect::<Result<_, _>>()?;
            }
            other => return Err(format!("unknown argument {other}; try --worlds 2,4").into()),
        }
    }
    let tmp = tempfile::tempdir()?;
    let cfg = Config::tiny_llama(32000, 768, 2048, 12, 12, 12, 512)?;
    let bf16 = LoadOptions {
        dtype: DType::BF16,
        trainable: false,
        seed: 3,
        ..opts()
    };
    let made = Model::random(&cfg, &bf16)?;
    let params = made.params().num_params();
    made.save(tmp.path(), None)?;
    drop(made);
    let dir = tmp.path().display().to_string();
    println!(
        "model: {:.1}M parameters, bf16 on disk ({:.0} MiB), f32 master weights ({:.0} MiB whole)",
        params as f64 / 1e6,
        params as f64 * 2.0 / 1048576.0,
        params as f64 * 4.0 / 1048576.0
    );
    for (name, what) in VARIANTS {
        println!("  {name}: {what}");
    }
    let exe = std::env::current_exe()?;
    println!(
        "\n{:>5} {:>15} {:>10} {:>9} {:>13} {:>9}",
        "world", "variant", "peak MiB", "seconds", "pieces MiB", "vs whole"
    );
    for world in worlds {
        let mut base: Option<(f64, f64)> = None;
        for (variant, _) in VARIANTS {
            let out = Command::new(&exe)
                .env(CHILD, format!("{variant} {world} {dir}"))
                .output()?;
            if !out.status.success() {
                return Err(format!(
                    "{variant} (world {world}) failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                )
                .into());
            }
            let text = String::from_utf8(out.stdout)?;
            let v: Vec<f64> = text
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()?;
            let [peak, seconds, sum, held] = v[..] else {
                return Err(format!("{variant}: unexpected output {text}").into());
            };
            // Each pair (whole, pieces) is compared with the whole one before it.
            let ratio = match (variant.ends_with("whole"), base) {
                (true, _) => {
                    base = Some((peak, sum));
                    "1.000x".to_string()
                }
                (false, Some((p, s))) => {
                    if (sum - s).abs() > 1e-9 * s.abs().max(1.0) {
                        return Err(format!(
                            "{variant} (world {world}) holds other pieces: checksum {sum} vs {s}"
                        )
                        .into());
                    }
                    format!("{:.3}x", peak / p)
                }
                (false, None) => "-".to_string(),
            };
            println!(
                "{world:>5} {variant:>15} {peak:>10.0} {seconds:>9.2} {:>13.0} {ratio:>9}",
                held * 4.0 / 1048576.0
            );
        }
    }
    Ok(())
}
