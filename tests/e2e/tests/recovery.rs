//! `fault_tolerance`: a role process SIGKILLed mid-run (which one and when chosen by a seed,
//! `RLHF_CHAOS_SEED`) and the job recovers by itself: every role placed again, the newest
//! checkpoint reloaded, the steps after it run again and written once, and the metrics equal
//! those of an uninterrupted run; the other stages (a DPO job) recover the same way. With
//! `checkpoint.memory_snapshot` the restart loads the checkpoint from a worker's memory: it
//! does so even when every checkpoint on disk has been damaged in the meantime.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nix::sys::signal::Signal;
use rlhf_e2e::{children_of, comparable, jsonl, wait_steps, wait_success, Proc};

const STEPS: u64 = 12;
/// The prompts of data/prompts_tiny.jsonl: 12 steps of 8 take one epoch and a half.
const PPO_TINY_PROMPTS: usize = 64;

/// Waits until the run `p` has committed a checkpoint at step `min` or later under `ckpt`
/// (`latest_checkpointed_iteration.txt`, written once a save is complete). Saves run in the
/// background, so on a loaded machine the steps logged can be ahead of the newest complete
/// checkpoint: a kill before it completes rightly restarts from an older one (or the start).
fn wait_checkpoint(p: &mut Proc, ckpt: &Path, min: u64) -> Result<()> {
    let latest = ckpt.join("latest_checkpointed_iteration.txt");
    rlhf_e2e::wait_for(
        Duration::from_secs(300),
        &format!("a checkpoint at step {min} or later in {}", ckpt.display()),
        || {
            if let Some(st) = p.child.try_wait()? {
                bail!("the run ended first ({st}): {}", p.output());
            }
            let step = std::fs::read_to_string(&latest)
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok());
            Ok(step.filter(|&s| s >= min).map(|_| ()))
        },
    )
}

fn common() -> Vec<&'static str> {
    vec![
        "training.train_iters=12",
        "checkpoint.save_steps=2",
        "logging.sample_every=1",
        "fault_tolerance.restart_backoff_s=1",
    ]
}

#[test]
fn a_killed_role_process_is_restarted_from_the_last_checkpoint_with_the_same_metrics() -> Result<()>
{
    let seed: u64 = std::env::var("RLHF_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let mut rng = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = |n: u64| {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (rng >> 33) % n
    };
    let kill_at = 3 + next(6) as usize; // after step 3..=8 of 12
    let victim_pick = next(1000);
    let dir = tempfile::tempdir()?;

    let straight = dir.path().join("straight");
    let mut p = Proc::spawn(
        "straight",
        dir.path(),
        &mut rlhf_e2e::ppo_run_cmd(&straight, &common()),
    )?;
    wait_success(&mut p, Duration::from_secs(900))?;

    let out = dir.path().join("chaos");
    let mut p = Proc::spawn(
        "chaos",
        dir.path(),
        &mut rlhf_e2e::ppo_run_cmd(&out, &common()),
    )?;
    let metrics_file = out.join("metrics.jsonl");
    wait_steps(&mut p, &metrics_file, kill_at, Duration::from_secs(600))?;
    wait_checkpoint(&mut p, &out.join("ckpt"), 2)?;
    let mut roles: Vec<(i32, String)> = children_of(p.pid())
        .into_iter()
        .filter(|(_, c)| c.contains(" actor ") && c.contains("--kind "))
        .collect();
    roles.sort();
    if roles.len() < 4 {
        bail!("role processes: {roles:?}");
    }
    let (pid, cmd) = roles[(victim_pick % roles.len() as u64) as usize].clone();
    let kind = cmd
        .split("--kind ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or("?")
        .to_string();
    println!("seed {seed}: SIGKILL {kind} (pid {pid}) after step {kill_at}");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL)?;
    let st = p.wait_exit(Duration::from_secs(900))?;
    let text = p.output();
    if !st.success() {
        bail!("the run should recover by itself ({st}):\n{text}");
    }
    assert!(text.contains(&format!("role {kind}")), "{text}");
    assert!(text.contains("died"), "{text}");
    assert!(text.contains("restart 1/3"), "{text}");
    assert!(
        text.contains("global_step_"),
        "restarts from a checkpoint:\n{text}"
    );

    same_as_straight(&straight, &out)?;

    // Again with the checkpoints also in the embedded worker's memory: the actor trainer
    // dies, and while the job waits to restart every weight file on disk is zeroed (a
    // restart from disk would be refused by the manifest check). The restart loads the
    // memory copies and ends with the uninterrupted run's numbers.
    let out = dir.path().join("memory");
    let mut args = common();
    args.retain(|a| !a.starts_with("fault_tolerance.restart_backoff_s"));
    args.extend([
        "checkpoint.memory_snapshot=true",
        "fault_tolerance.restart_backoff_s=4",
    ]);
    let mut p = Proc::spawn(
        "memory",
        dir.path(),
        &mut rlhf_e2e::ppo_run_cmd(&out, &args),
    )?;
    wait_steps(
        &mut p,
        &out.join("metrics.jsonl"),
        kill_at,
        Duration::from_secs(600),
    )?;
    wait_checkpoint(&mut p, &out.join("ckpt"), 2)?;
    let trainer = children_of(p.pid())
        .into_iter()
        .find(|(_, c)| c.contains("--kind actor_rollout"))
        .with_context(|| format!("no actor process: {:?}", children_of(p.pid())))?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(trainer.0), Signal::SIGKILL)?;
    rlhf_e2e::wait_for(Duration::from_secs(120), "the restart notice", || {
        Ok(p.output().contains("restart 1/3").then_some(()))
    })?;
    let zeroed = zero_weight_files(&out.join("ckpt"))?;
    assert!(
        zeroed >= 2,
        "the actor and critic weights of a checkpoint: {zeroed}"
    );
    let st = p.wait_exit(Duration::from_secs(900))?;
    let text = p.output();
    if !st.success() {
        bail!("the run should recover from the memory snapshot ({st}):\n{text}");
    }
    for l in text
        .lines()
        .filter(|l| l.contains("checkpoint loaded from"))
    {
        println!("{l}");
    }
    for part in ["actor", "critic"] {
        assert!(
            text.contains(&format!(
                "{part}: checkpoint loaded from the memory snapshot on the worker at"
            )),
            "{part} loads from memory:\n{text}"
        );
    }
    same_as_straight(&straight, &out)
}

/// Zeroes every weight file of every checkpoint under `root` (same size, so only the
/// content check can tell); returns how many.
fn zero_weight_files(root: &Path) -> Result<usize> {
    let mut n = 0;
    for step in std::fs::read_dir(root)?.flatten() {
        for part in ["actor", "critic"] {
            let Ok(files) = std::fs::read_dir(step.path().join(part)) else {
                continue;
            };
            for f in files.flatten() {
                let path = f.path();
                if path.extension().is_some_and(|e| e == "safetensors") {
                    let len = std::fs::metadata(&path)?.len() as usize;
                    std::fs::write(&path, vec![0u8; len])?;
                    n += 1;
                }
            }
        }
    }
    Ok(n)
}

/// The ledger under `out` (`logging.ledger_file`) equals the uninterrupted run's line for
/// line, and the prompts it consumed are each dataset row once per epoch: the first
/// `dataset` of them are every row, and the rest are distinct.
fn exactly_once(straight: &Path, out: &Path, dataset: usize) -> Result<()> {
    let (a, b) = (
        jsonl(&straight.join("ledger.jsonl"))?,
        jsonl(&out.join("ledger.jsonl"))?,
    );
    let steps: Vec<u64> = b.iter().filter_map(|l| l["step"].as_u64()).collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>(), "ledger steps");
    assert_eq!(
        a, b,
        "the recovered run consumed other prompts than the uninterrupted one"
    );
    let rows: Vec<u64> = b
        .iter()
        .flat_map(|l| l["trained"].as_array().cloned().unwrap_or_default())
        .filter_map(|v| v.as_u64())
        .collect();
    assert!(
        rows.len() > dataset,
        "{} prompts, dataset {dataset}",
        rows.len()
    );
    let mut first: Vec<u64> = rows[..dataset].to_vec();
    first.sort_unstable();
    // Rows are numbered from 1, as the data loader's messages number them.
    assert_eq!(first, (1..=dataset as u64).collect::<Vec<_>>(), "epoch 0");
    let mut rest: Vec<u64> = rows[dataset..].to_vec();
    rest.sort_unstable();
    rest.dedup();
    assert_eq!(
        rest.len(),
        rows.len() - dataset,
        "a prompt twice in epoch 1"
    );
    Ok(())
}

/// The same steps with the same metric names and values within 1e-4 relative, in both runs
/// (counted first: zip stops at the shorter side).
fn same_metrics(a: &[serde_json::Value], b: &[serde_json::Value]) {
    assert_eq!(a.len(), b.len(), "uninterrupted and recovered step counts");
    for (x, y) in a.iter().zip(b) {
        let (cx, cy) = (comparable(x), comparable(y));
        let names = |c: &[(String, f64)]| c.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
        assert_eq!(
            names(&cx),
            names(&cy),
            "step {}: metric sets differ",
            x["step"]
        );
        for ((k, u), (_, v)) in cx.iter().zip(&cy) {
            assert!(
                (u - v).abs() <= 1e-4 * u.abs().max(1e-6),
                "step {}: {k} uninterrupted {u} vs recovered {v}",
                x["step"]
            );
        }
    }
}

/// The run under `out` logged each step once, with the numbers and sample tables of the
/// uninterrupted run under `straight`, and consumed the same prompts.
fn same_as_straight(straight: &Path, out: &Path) -> Result<()> {
    exactly_once(straight, out, PPO_TINY_PROMPTS)?;
    let (a, b) = (
        jsonl(&straight.join("metrics.jsonl"))?,
        jsonl(&out.join("metrics.jsonl"))?,
    );
    let steps: Vec<u64> = b.iter().filter_map(|l| l["step"].as_u64()).collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>());
    same_metrics(&a, &b);
    // The sample table of every step once, as in the uninterrupted run.
    let per_step = |path: &Path| -> Result<Vec<usize>> {
        let s = jsonl(path)?;
        Ok((1..=STEPS)
            .map(|k| s.iter().filter(|l| l["step"].as_u64() == Some(k)).count())
            .collect())
    };
    assert_eq!(
        per_step(&out.join("samples.jsonl"))?,
        per_step(&straight.join("samples.jsonl"))?
    );
    Ok(())
}

/// A whole worker lost (the worker and every role process under it SIGKILLed) while the
/// other worker has room: the head declares the node dead, and the job is placed again on
/// the survivor and finishes, each step written once. The job keeps memory snapshots: a
/// trainer that ran on the lost node had its copy on the survivor, and loads from there.
#[test]
fn a_lost_worker_moves_the_job_to_the_other_one() -> Result<()> {
    use rlhf_e2e::Cluster;
    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"CPU": 4}"#)?;
    c.add_worker(r#"{"CPU": 4}"#)?;
    c.wait_alive_nodes(2, Duration::from_secs(30))?;
    let out = c.dir.path().join("job");
    let mut args = common();
    args.push("checkpoint.memory_snapshot=true");
    let mut p = Proc::spawn("run", c.dir.path(), &mut c.ppo_run_cmd(&out, &args))?;
    let metrics_file = out.join("metrics.jsonl");
    wait_steps(&mut p, &metrics_file, 4, Duration::from_secs(600))?;
    // The worker with the most role processes goes, with them.
    let (w, kids) = c
        .workers
        .iter()
        .enumerate()
        .map(|(i, w)| (i, children_of(w.pid())))
        .max_by_key(|(_, k)| k.len())
        .context("workers")?;
    if kids.is_empty() {
        bail!("no role process under either worker");
    }
    for (pid, _) in &kids {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), Signal::SIGKILL)?;
    }
    c.workers[w].signal(Signal::SIGKILL);
    let st = p.wait_exit(Duration::from_secs(900))?;
    let text = p.output();
    if !st.success() {
        bail!("the run should move to the other worker ({st}):\n{text}");
    }
    assert!(
        text.contains("died") && text.contains("restart 1/3"),
        "{text}"
    );
    let steps: Vec<u64> = jsonl(&metrics_file)?
        .iter()
        .filter_map(|l| l["step"].as_u64())
        .collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>());
    // The survivor's worker held the copies of the lost node's savers.
    let status = c.status()?;
    let survivor = status["nodes"]
        .as_array()
        .and_then(|n| n.iter().find(|n| n["state"] == "ALIVE"))
        .and_then(|n| n["address"].as_str())
        .with_context(|| format!("no alive node: {status}"))?
        .to_string();
    let loaded: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("checkpoint loaded from"))
        .collect();
    println!("{}", loaded.join("\n"));
    if kids.iter().any(|(_, cmd)| cmd.contains("--kind critic")) {
        let want = format!(
            "critic: checkpoint loaded from the memory snapshot on the worker at {survivor}"
        );
        assert!(loaded.iter().any(|l| l.contains(&want)), "{want}:\n{text}");
    }
    for part in ["actor", "critic"] {
        assert!(
            loaded
                .iter()
                .any(|l| l.contains(&format!("{part}: checkpoint loaded from"))),
            "{text}"
        );
    }
    Ok(())
}

/// The worker holding a job's memory snapshots lost mid-run (a node that runs none of the
/// job's roles): the job goes on; the checkpoint whose push found it gone (and one already
/// pushing to it) loses its memory copy, and every later one is held by the savers' own
/// worker. Before, each later checkpoint tried the lost worker again, 30 s of connecting each.
#[test]
fn a_lost_snapshot_holder_costs_one_checkpoint_not_every_one() -> Result<()> {
    use rlhf_e2e::Cluster;
    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"CPU": 5}"#)?;
    // No role fits on the second node (the reward asks for a slot too, so that it does not
    // land there for want of a request); it is the other node, so it holds the copies.
    c.add_worker(r#"{"CPU": 0}"#)?;
    c.wait_alive_nodes(2, Duration::from_secs(30))?;
    let out = c.dir.path().join("job");
    let mut args = common();
    // Room for several checkpoints after the kill.
    args.extend([
        "checkpoint.memory_snapshot=true",
        "training.train_iters=20",
        "resource_pool.reward=1",
    ]);
    let mut p = Proc::spawn("run", c.dir.path(), &mut c.ppo_run_cmd(&out, &args))?;
    wait_checkpoint(&mut p, &out.join("ckpt"), 2)?;
    let kids = children_of(c.workers[1].pid());
    if !kids.is_empty() {
        bail!("the holder's node should run no role process: {kids:?}");
    }
    c.workers[1].signal(Signal::SIGKILL);
    wait_success(&mut p, Duration::from_secs(600))?;
    let text = p.output();
    assert!(
        !text.contains("restart 1/"),
        "the job needed no restart:\n{text}"
    );
    // The steps whose snapshot stayed incomplete, from the driver's warnings.
    let mut incomplete: Vec<u64> = text
        .lines()
        .filter(|l| l.contains("is incomplete"))
        .filter_map(|l| {
            let rest = l.split(" at step ").nth(1)?;
            rest.split_whitespace().next()?.parse().ok()
        })
        .collect();
    incomplete.sort_unstable();
    incomplete.dedup();
    println!("checkpoints without a whole memory copy: {incomplete:?}");
    assert!(
        !incomplete.is_empty() && incomplete.len() <= 2,
        "one checkpoint (two if one was pushing at the kill) should miss its copy: {incomplete:?}\n{text}"
    );
    assert!(
        !incomplete.contains(&20),
        "the last one is held: {incomplete:?}"
    );
    let said = text.matches("did not take a memory snapshot").count();
    assert_eq!(said, 1, "said once, for the lost worker:\n{text}");
    Ok(())
}

/// The other stages recover the same way (`trainer: dpo`, whose trainer and reference are
/// separate role processes): the trainer SIGKILLed after step 3 of 8, the job places both
/// again from the newest checkpoint (its memory snapshot) and ends with each step written
/// once and the metrics of an uninterrupted run.
#[test]
fn a_killed_dpo_trainer_is_restarted_with_the_same_metrics() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let args = [
        "training.train_iters=8",
        "checkpoint.save_steps=2",
        "fault_tolerance.restart_backoff_s=1",
        "logging.progress=false",
        "checkpoint.memory_snapshot=true",
    ];
    let cmd = |out: &Path| {
        let mut cmd = std::process::Command::new(rlhf_e2e::bin("rlhf-head"));
        cmd.current_dir(rlhf_e2e::repo_root())
            .args(["run", "--config-name", "dpo_tiny"])
            .args(rlhf_e2e::output_overrides(out))
            .args(args)
            .env_remove("RLHF_TOKEN")
            .env("RUST_LOG", "warn");
        cmd
    };
    let straight = dir.path().join("straight");
    let mut p = Proc::spawn("straight", dir.path(), &mut cmd(&straight))?;
    wait_success(&mut p, Duration::from_secs(900))?;

    let out = dir.path().join("chaos");
    let mut p = Proc::spawn("chaos", dir.path(), &mut cmd(&out))?;
    let metrics_file = out.join("metrics.jsonl");
    wait_steps(&mut p, &metrics_file, 3, Duration::from_secs(600))?;
    wait_checkpoint(&mut p, &out.join("ckpt"), 2)?;
    let trainer = children_of(p.pid())
        .into_iter()
        .find(|(_, c)| c.contains("--kind actor"))
        .with_context(|| format!("no trainer process: {:?}", children_of(p.pid())))?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(trainer.0), Signal::SIGKILL)?;
    let st = p.wait_exit(Duration::from_secs(900))?;
    let text = p.output();
    if !st.success() {
        bail!("the DPO run should recover by itself ({st}):\n{text}");
    }
    assert!(
        text.contains("died") && text.contains("restart 1/3"),
        "{text}"
    );
    assert!(
        text.contains("actor: checkpoint loaded from the memory snapshot on the worker at"),
        "the DPO trainer loads from memory:\n{text}"
    );
    let (a, b) = (
        jsonl(&straight.join("metrics.jsonl"))?,
        jsonl(&metrics_file)?,
    );
    let steps: Vec<u64> = b.iter().filter_map(|l| l["step"].as_u64()).collect();
    assert_eq!(steps, (1..=8).collect::<Vec<_>>());
    same_metrics(&a, &b);
    Ok(())
}
