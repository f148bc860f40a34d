//! GPU roles with a worker that cannot run them (this test build has no `cuda` feature): the
//! worker says so at join, the head places no GPU role on it and the job's error names the
//! node and the rebuild command; nothing ever computes on the CPU in silence.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use rlhf_e2e::{bin, Cluster, Proc};

/// What the worker executable says of itself (its hidden `capabilities` subcommand).
fn worker_runs_cuda_roles() -> Result<bool> {
    let out = Command::new(bin("rlhf-worker"))
        .arg("capabilities")
        .output()?;
    anyhow::ensure!(out.status.success(), "rlhf-worker capabilities failed");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    v["cuda_roles"]
        .as_bool()
        .with_context(|| format!("no cuda_roles in {v}"))
}

#[test]
fn gpu_roles_are_not_placed_on_a_worker_without_cuda_and_the_error_says_why() -> Result<()> {
    if worker_runs_cuda_roles()? {
        rlhf_e2e::skip(
            env!("CARGO_TARGET_TMPDIR"),
            "gpu_roles_are_not_placed_on_a_worker_without_cuda",
            "the rlhf-worker under test was built with the `cuda` feature",
        );
        return Ok(());
    }
    let mut c = Cluster::start(&[])?;
    // Four GPUs as the worker would detect them on a GPU machine.
    c.add_worker(r#"{"GPU": 4, "CPU": 4}"#)?;
    let status = c.wait_alive_nodes(1, Duration::from_secs(30))?;
    assert_eq!(status["resources"]["total"]["GPU"], 4.0, "{status}");
    let job = c.dir.path().join("job");
    let mut cmd = c.ppo_run_cmd(
        &job,
        &[
            "resource_pool.device=GPU",
            "training.train_iters=1",
            "checkpoint.save_steps=0",
        ],
    );
    // With the default ten-minute start timeout: no live node can ever run the job, so it
    // fails at once instead of waiting for resources that cannot come.
    let t0 = std::time::Instant::now();
    let mut p = Proc::spawn("gpu-run", c.dir.path(), &mut cmd)?;
    let st = p.wait_exit(Duration::from_secs(120))?;
    let out = p.output();
    assert!(!st.success(), "the job must fail: {out}");
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "failed only after {:?}: {out}",
        t0.elapsed()
    );
    assert!(out.contains("can never be placed"), "{out}");
    assert!(out.contains("cannot run CUDA roles"), "{out}");
    assert!(
        out.contains("cargo build --release -p rlhf-worker --features cuda"),
        "{out}"
    );
    assert!(
        !job.join("metrics.jsonl").exists(),
        "no step may run on the CPU"
    );
    let s = c.status()?;
    let actors = s["actors"].as_array().context("actors")?;
    assert!(
        actors
            .iter()
            .all(|a| a["role"].as_str().unwrap_or_default().is_empty()),
        "no role actor was started: {s}"
    );
    Ok(())
}
