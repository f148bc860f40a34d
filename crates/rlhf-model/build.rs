//! Compiles src/kernels.cu to PTX when the `cuda` feature is on (src/kernels_cuda.rs embeds
//! it). Why a build step: the GPU machines have a driver but no compiler, so the kernels
//! travel inside the binary as PTX the driver JIT-compiles, as candle's own kernels do.
//! nvcc comes from `NVCC`, `$CUDA_HOME/bin` (scripts/cuda-toolkit.sh sets it) or PATH; the
//! target architecture from `CUDA_COMPUTE_CAP` (default 80: PTX for sm_80 also loads on
//! newer GPUs, which JIT it forward).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/kernels.cu");
    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| {
            ["CUDA_HOME", "CUDA_PATH"].iter().find_map(|v| {
                let p = PathBuf::from(std::env::var_os(v)?).join("bin").join("nvcc");
                p.exists().then_some(p)
            })
        })
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let cap = std::env::var("CUDA_COMPUTE_CAP")
        .ok()
        .map(|c| c.trim().replace('.', ""))
        .filter(|c| !c.is_empty() && c.chars().all(|ch| ch.is_ascii_digit()))
        .unwrap_or_else(|| "80".to_string());
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("rlhf_kernels.ptx");
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("--gpu-architecture=sm_{cap}"))
        .arg("-o")
        .arg(&out)
        .arg("src/kernels.cu")
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!(
            "nvcc ({}) failed on src/kernels.cu ({s}); the `cuda` feature needs a CUDA toolkit: \
             eval \"$(scripts/cuda-toolkit.sh)\" sets one up",
            nvcc.display()
        ),
        Err(e) => panic!(
            "cannot run nvcc ({}): {e}; the `cuda` feature needs a CUDA toolkit: \
             eval \"$(scripts/cuda-toolkit.sh)\" sets one up, or set NVCC",
            nvcc.display()
        ),
    }
}
