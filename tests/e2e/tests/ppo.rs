//! The PPO job over real processes: `rlhf-head run` with the four roles as separate role
//! actor processes, on a head + 2 workers and on the embedded default; resume continuity;
//! too few devices for the pool; a role killed mid-run, then resume.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use nix::sys::signal::Signal;
use rlhf_e2e::{
    assert_same_steps, child_with, comparable, wait_steps, wait_success, Cluster, Proc,
};
use serde_json::Value;

fn repo() -> PathBuf {
    rlhf_e2e::repo_root()
}

/// `rlhf-head run --config-name ppo_tiny` with outputs under `out`, a sample table every
/// step and extra overrides.
fn run_cmd(out: &Path, extra: &[&str]) -> Command {
    let mut args = vec!["logging.sample_every=1"];
    args.extend_from_slice(extra);
    rlhf_e2e::ppo_run_cmd(out, &args)
}

fn metrics(path: &Path) -> Result<Vec<Value>> {
    rlhf_e2e::jsonl(path)
}

#[test]
fn three_steps_on_a_head_and_two_workers() -> Result<()> {
    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"CPU": 2}"#)?;
    c.add_worker(r#"{"CPU": 2}"#)?;
    c.wait_alive_nodes(2, Duration::from_secs(30))?;
    let out = c.dir.path().join("job");
    let mut cmd = run_cmd(&out, &["training.train_iters=3", "checkpoint.save_steps=3"]);
    cmd.args(["--address", &c.address()])
        .arg("--token-file")
        .arg(c.token_file());
    let mut p = Proc::spawn("run", c.dir.path(), &mut cmd)?;
    wait_success(&mut p, Duration::from_secs(900))?;

    // Every role ran as its own process, placed by the head on the two workers.
    let status = c.status()?;
    let actors = status["actors"].as_array().context("actors")?;
    let mut kinds: Vec<String> = actors
        .iter()
        .map(|a| {
            a["kind"]
                .as_str()
                .or(a["role"].as_str())
                .unwrap_or("")
                .to_string()
        })
        .collect();
    kinds.sort();
    for k in ["actor_rollout", "critic", "ref", "reward"] {
        assert!(kinds.iter().any(|x| x == k), "no {k} actor in {kinds:?}");
    }
    let pids: std::collections::BTreeSet<i64> =
        actors.iter().filter_map(|a| a["pid"].as_i64()).collect();
    assert!(pids.len() >= 5, "role processes {pids:?}");
    let nodes: std::collections::BTreeSet<&str> = actors
        .iter()
        .filter_map(|a| a["node_id"].as_str())
        .collect();
    assert_eq!(nodes.len(), 2, "roles should use both workers: {nodes:?}");

    let m = metrics(&out.join("metrics.jsonl"))?;
    assert_eq!(m.len(), 3, "one metrics line per step");
    for (i, line) in m.iter().enumerate() {
        assert_eq!(line["step"].as_u64(), Some(i as u64 + 1));
        for k in [
            "objective/scores",
            "objective/kl",
            "loss/policy_avg",
            "loss/value_avg",
            "policy/approxkl_avg",
            "timing_s/gen",
            "timing_s/update_actor",
            "timing_s/sync_weights",
            "perf/throughput",
        ] {
            assert!(
                line[k].as_f64().is_some_and(f64::is_finite),
                "step {}: {k} in {line}",
                i + 1
            );
        }
    }
    let ck = out.join("ckpt/global_step_3");
    for f in [
        "trainer_state.json",
        "actor/config.json",
        "actor/model.safetensors",
        "actor/optimizer.safetensors",
        "actor/tokenizer.json",
        "critic/model.safetensors",
    ] {
        assert!(ck.join(f).is_file(), "missing {f} in {}", ck.display());
    }
    let samples = std::fs::read_to_string(out.join("samples.jsonl"))?;
    assert!(samples.lines().count() >= 3, "{samples}");
    assert!(p.output().contains("samples at step"), "{}", p.output());
    Ok(())
}

#[test]
fn resume_gives_the_same_metrics_as_a_straight_run() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let common = ["training.train_iters=4", "checkpoint.save_steps=2"];
    let a = dir.path().join("straight");
    let mut p = Proc::spawn("straight", dir.path(), &mut run_cmd(&a, &common))?;
    wait_success(&mut p, Duration::from_secs(900))?;

    let b = dir.path().join("resumed");
    let mut cmd = run_cmd(&b, &common);
    cmd.args(["--stop-after", "2"]);
    let mut p = Proc::spawn("first-half", dir.path(), &mut cmd)?;
    wait_success(&mut p, Duration::from_secs(900))?;
    assert_eq!(metrics(&b.join("metrics.jsonl"))?.len(), 2);
    let mut cmd = run_cmd(&b, &common);
    cmd.args(["--resume", "latest"]);
    let mut p = Proc::spawn("second-half", dir.path(), &mut cmd)?;
    wait_success(&mut p, Duration::from_secs(900))?;

    let (ma, mb) = (
        metrics(&a.join("metrics.jsonl"))?,
        metrics(&b.join("metrics.jsonl"))?,
    );
    assert_eq!(ma.len(), 4, "the straight run logs every step");
    assert_same_steps(&ma, &mb);
    Ok(())
}

/// Config errors without a cluster are tested on `rlhf-head` alone (crates/rlhf-head/tests);
/// this one needs a worker.
#[test]
fn too_few_devices_names_the_device_and_the_pool() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // Too few devices: a cluster with 2 CPU slots for a job that needs 4.
    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"CPU": 2}"#)?;
    c.wait_alive_nodes(1, Duration::from_secs(30))?;
    let out = run_cmd(dir.path(), &[])
        .args(["--address", &c.address(), "--start-timeout", "2"])
        .arg("--token-file")
        .arg(c.token_file())
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("CPU") && err.contains("resource_pool"),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_killed_role_stops_the_job_clearly_and_resume_finishes_it() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("job");
    // A run far longer than the test: the kill lands mid-run however fast the machine is;
    // the resume then finishes a short run two steps past the kill.
    let common = [
        "training.train_iters=100000",
        "checkpoint.save_steps=1",
        // No automatic restart: the job fails as a job does when its restarts run out.
        "fault_tolerance.max_restarts=0",
    ];
    let mut p = Proc::spawn("run", dir.path(), &mut run_cmd(&out, &common))?;
    let metrics_file = out.join("metrics.jsonl");
    wait_steps(&mut p, &metrics_file, 2, Duration::from_secs(600))?;
    let critic = child_with(p.pid(), "--kind critic").context("critic process")?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(critic), Signal::SIGKILL)?;
    let st = p.wait_exit(Duration::from_secs(120))?;
    let text = p.output();
    assert!(!st.success(), "the run must fail when a role dies:\n{text}");
    let err = text
        .lines()
        .filter(|l| !l.starts_with("step "))
        .collect::<Vec<_>>()
        .join("\n");
    let done = metrics(&metrics_file)?.len() as u64;
    assert!(done >= 2, "{done} steps before the kill");
    assert!(err.contains("role critic rank 0 died"), "{err}");
    assert!(err.contains("signal 9"), "{err}");
    assert!(err.contains("--resume latest"), "{err}");

    let total = done + 2;
    let iters = format!("training.train_iters={total}");
    let mut cmd = run_cmd(&out, &[iters.as_str(), "checkpoint.save_steps=1"]);
    cmd.args(["--resume", "latest"]);
    let mut p = Proc::spawn("resume", dir.path(), &mut cmd)?;
    wait_success(&mut p, Duration::from_secs(900))?;
    let m = metrics(&metrics_file)?;
    let steps: Vec<u64> = m.iter().filter_map(|l| l["step"].as_u64()).collect();
    assert_eq!(steps, (1..=total).collect::<Vec<u64>>(), "{steps:?}");
    Ok(())
}

/// The demo as shipped (configs/ppo_tiny.yaml, the committed tiny policy, the rule reward):
/// `objective/scores` climbs clearly over the run.
#[test]
fn the_demo_raises_the_score() -> Result<()> {
    // Policy = reference before the first update: the rollout's KL to the reference is zero
    // up to kernel rounding (the trainer and the reference run different kernels).
    demo_climbs(&[], 1e-4)
}

/// The same in bf16 mixed precision, with activation checkpointing and a 7-token LM-head
/// chunk: the memory savers keep the learning. At step 1 the trainer (f32 master weights,
/// bf16 activations) and the reference (bf16 weights) round differently: KL within 1e-2.
#[test]
fn the_demo_raises_the_score_in_bf16_with_checkpointing_and_chunked_logits() -> Result<()> {
    demo_climbs(
        &[
            "training.bf16=true",
            "training.gradient_checkpointing=true",
            "training.logits_chunk_size=7",
        ],
        1e-2,
    )
}

fn demo_climbs(extra: &[&str], kl1_tolerance: f64) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("demo");
    let mut args = vec!["checkpoint.save_steps=0"];
    args.extend_from_slice(extra);
    let mut p = Proc::spawn("demo", dir.path(), &mut run_cmd(&out, &args))?;
    wait_success(&mut p, Duration::from_secs(1200))?;
    let m = metrics(&out.join("metrics.jsonl"))?;
    let scores: Vec<f64> = m
        .iter()
        .filter_map(|l| l["objective/scores"].as_f64())
        .collect();
    assert_eq!(scores.len(), m.len());
    assert!(scores.len() >= 20, "{} steps", scores.len());
    let kl1 = m[0]["objective/kl"]
        .as_f64()
        .context("objective/kl at step 1")?;
    assert!(
        kl1.abs() < kl1_tolerance,
        "KL at step 1 with policy = reference: {kl1}"
    );
    let kl_last = m[m.len() - 10..]
        .iter()
        .filter_map(|l| l["objective/kl"].as_f64())
        .sum::<f64>()
        / 10.0;
    assert!(
        kl_last > 1e-3,
        "the policy moved away from the reference: mean KL of the last 10 steps {kl_last}"
    );
    let k = 10;
    let first = scores[..k].iter().sum::<f64>() / k as f64;
    let last = scores[scores.len() - k..].iter().sum::<f64>() / k as f64;
    println!(
        "{extra:?}: objective/scores: first {k} steps {first:.3}, last {k} steps {last:.3}; KL at step 1 {kl1:e}"
    );
    assert!(
        last >= first + 0.15,
        "the score should climb: first {k} steps {first:.3}, last {k} steps {last:.3}"
    );
    assert!(p.output().contains("objective/scores"), "{}", p.output());
    Ok(())
}

fn weights(path: &Path) -> Result<std::collections::BTreeMap<String, Vec<f32>>> {
    let bytes = std::fs::read(path)?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let mut out = std::collections::BTreeMap::new();
    for (name, view) in st.tensors() {
        anyhow::ensure!(view.dtype() == safetensors::Dtype::F32, "{name} is not f32");
        let v = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        out.insert(name, v);
    }
    Ok(out)
}

/// Data-parallel training across processes: the same step with 2 trainer ranks (each on half
/// the batch, gradients all-reduced over TCP) and with 1 trainer rank ends in the same policy.
#[test]
fn two_trainer_processes_make_the_same_update_as_one() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let common = [
        "training.train_iters=1",
        "checkpoint.save_steps=1",
        "actor_rollout.ppo_epochs=1",
        "actor_rollout.ppo_mini_batch_size=16",
        "actor_rollout.shuffle_minibatch=false",
        "training.lr=1.0e-3",
    ];
    let mut finals = Vec::new();
    for (tag, extra) in [
        (
            "one",
            [
                "resource_pool.actor_rollout=2",
                "actor_rollout.num_gpus_for_train=1",
            ],
        ),
        (
            "two",
            [
                "resource_pool.actor_rollout=3",
                "actor_rollout.num_gpus_for_train=2",
            ],
        ),
    ] {
        let out = dir.path().join(tag);
        let mut cmd = run_cmd(&out, &common);
        cmd.args(extra);
        let mut p = Proc::spawn(tag, dir.path(), &mut cmd)?;
        wait_success(&mut p, Duration::from_secs(600))?;
        let w = weights(&out.join("ckpt/global_step_1/actor/model.safetensors"))?;
        finals.push((metrics(&out.join("metrics.jsonl"))?, w));
    }
    let before = weights(&repo().join("models/tiny/model.safetensors"))?;
    let ((m1, w1), (m2, w2)) = (&finals[0], &finals[1]);
    assert_eq!(w1.keys().collect::<Vec<_>>(), w2.keys().collect::<Vec<_>>());
    let mut moved = 0.0f32;
    for (name, a) in w1 {
        let b = &w2[name];
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + x.abs()),
                "{name}: 1 rank {x} vs 2 ranks {y}"
            );
        }
        if let Some(orig) = before.get(name) {
            moved = moved.max(
                a.iter()
                    .zip(orig)
                    .map(|(x, o)| (x - o).abs())
                    .fold(0.0, f32::max),
            );
        }
    }
    assert!(
        moved > 1e-4,
        "the update did not change the policy (max change {moved})"
    );
    // Experience metrics (old log-probs split over the trainer ranks) and the update's metrics
    // (token-weighted over the whole group) agree too.
    for k in [
        "objective/scores",
        "objective/kl",
        "objective/rlhf_reward",
        "loss/policy_avg",
        "policy/approxkl_avg",
        "policy/clipfrac_avg",
    ] {
        let (a, b) = (
            m1[0][k].as_f64().unwrap_or(f64::NAN),
            m2[0][k].as_f64().unwrap_or(f64::NAN),
        );
        assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{k}: {a} vs {b}");
    }
    Ok(())
}

/// Precision-alignment mode: responses come from `actor_rollout.fixed_responses_file` instead
/// of generation, so two runs give the same losses step by step; bad dataset rows are
/// skipped and reported with their line numbers.
#[test]
fn fixed_responses_replace_generation_and_bad_rows_are_reported() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("prompts.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"2+3=\"}\n{\"prompt\": \"7-4=\"}\nnot json\n{\"prompt\": \"3*3=\"}\n{\"text\": \"no prompt key\"}\n{\"prompt\": \"4+5=\"}\n",
    )?;
    let fixed = dir.path().join("fixed.jsonl");
    let answers = [
        ("2+3=", " 5."),
        ("7-4=", " It is three."),
        ("3*3=", " 9."),
        ("4+5=", " Nine."),
    ];
    let lines: Vec<String> = answers
        .iter()
        .map(|(p, r)| serde_json::json!({"prompt": p, "response": r}).to_string())
        .collect();
    std::fs::write(&fixed, lines.join("\n"))?;
    let args = [
        format!("data.path={}", data.display()),
        "data.bad_rows=skip".to_string(),
        format!("actor_rollout.fixed_responses_file={}", fixed.display()),
        "actor_rollout.do_sample=false".into(),
        "training.global_batch_size=4".into(),
        "training.train_iters=2".into(),
        "checkpoint.save_steps=0".into(),
        "logging.sample_rows=8".into(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut runs = Vec::new();
    for tag in ["a", "b"] {
        let out = dir.path().join(tag);
        let mut p = Proc::spawn(tag, dir.path(), &mut run_cmd(&out, &args))?;
        wait_success(&mut p, Duration::from_secs(600))?;
        let text = p.output();
        assert!(text.contains("2 bad row(s) skipped"), "{text}");
        assert!(
            text.contains("line 3:") && text.contains("line 5:"),
            "{text}"
        );
        let samples = std::fs::read_to_string(out.join("samples.jsonl"))?;
        assert!(
            samples.lines().count() >= 2,
            "a sample table every step: {samples:?}"
        );
        for l in samples.lines() {
            let v: Value = serde_json::from_str(l)?;
            let q = v["query"].as_str().unwrap_or_default();
            let want = answers.iter().find(|(p, _)| *p == q).map(|(_, r)| r.trim());
            assert_eq!(v["response"].as_str().map(str::trim), want, "{l}");
            let digit = want.is_some_and(|r| r.chars().any(|c| c.is_ascii_digit()));
            assert_eq!(
                v["score"].as_f64(),
                Some(if digit { 1.0 } else { 0.0 }),
                "{l}"
            );
        }
        runs.push(metrics(&out.join("metrics.jsonl"))?);
    }
    assert_eq!(runs[0].len(), 2, "both runs log both steps");
    assert_eq!(runs[1].len(), 2, "both runs log both steps");
    for (x, y) in runs[0].iter().zip(&runs[1]) {
        for (k, u) in comparable(x) {
            let v = y[&k].as_f64().unwrap_or(f64::NAN);
            assert!((u - v).abs() <= 1e-6 * (1.0 + u.abs()), "{k}: {u} vs {v}");
        }
    }
    Ok(())
}

/// Precision alignment for a group estimator: GRPO with two samples per prompt gets one
/// fixed response per sample (`"responses"`), so the group's rewards differ and its
/// advantages are not all zero, as on the other implementation's fixed completions.
#[test]
fn grpo_groups_take_one_fixed_response_per_sample() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("prompts.jsonl");
    let groups = [
        ("2+3=", [" 5.", " five."]),
        ("7-4=", [" three.", " 3."]),
        ("3*3=", [" 9.", " nine."]),
        ("4+5=", [" Nine.", " 9!"]),
    ];
    let rows: Vec<String> = groups
        .iter()
        .map(|(p, _)| serde_json::json!({"prompt": p}).to_string())
        .collect();
    std::fs::write(&data, rows.join("\n"))?;
    let fixed = dir.path().join("fixed.jsonl");
    let lines: Vec<String> = groups
        .iter()
        .map(|(p, r)| serde_json::json!({"prompt": p, "responses": r}).to_string())
        .collect();
    std::fs::write(&fixed, lines.join("\n"))?;
    let args = [
        format!("data.path={}", data.display()),
        format!("actor_rollout.fixed_responses_file={}", fixed.display()),
        "algorithm.adv_estimator=grpo".into(),
        "actor_rollout.num_samples_per_step=2".into(),
        "training.global_batch_size=4".into(),
        "training.train_iters=1".into(),
        "checkpoint.save_steps=0".into(),
        "logging.sample_rows=8".into(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = dir.path().join("grpo");
    let mut p = Proc::spawn("grpo-fixed", dir.path(), &mut run_cmd(&out, &args))?;
    wait_success(&mut p, Duration::from_secs(600))?;
    let samples = std::fs::read_to_string(out.join("samples.jsonl"))?;
    let mut seen: Vec<(String, String, f64)> = Vec::new();
    for l in samples.lines() {
        let v: Value = serde_json::from_str(l)?;
        seen.push((
            v["query"].as_str().unwrap_or_default().to_string(),
            v["response"]
                .as_str()
                .unwrap_or_default()
                .trim()
                .to_string(),
            v["score"].as_f64().unwrap_or(f64::NAN),
        ));
    }
    for (prompt, responses) in groups {
        for r in responses {
            let digit = r.chars().any(|c| c.is_ascii_digit());
            assert!(
                seen.iter().any(|(q, got, score)| q == prompt
                    && got == r.trim()
                    && *score == if digit { 1.0 } else { 0.0 }),
                "sample {prompt:?} -> {r:?} missing or mis-scored: {samples}"
            );
        }
    }
    Ok(())
}
