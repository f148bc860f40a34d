//! The trainer → rollout weight sync path, as a user runs it: on one node (the embedded
//! head and worker) the weights go through a shared-memory segment, chosen automatically and
//! logged once, with the same results as the TCP path; the segment is an anonymous memfd
//! that the role processes hold while they run, and nothing of it is left once they end,
//! even when the trainer is killed mid-run.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nix::sys::signal::Signal;
use rlhf_e2e::{holds_file, pid_alive, wait_for, wait_steps, Cluster, Proc};
use serde_json::Value;

/// The memfd's name as /proc shows it.
const SEGMENT: &str = "memfd:rlhf-collective";

fn metrics(path: &Path) -> Result<Vec<Value>> {
    rlhf_e2e::jsonl(path)
}

fn shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn one_node_syncs_through_shared_memory_with_the_same_results_as_tcp() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let common = ["training.train_iters=3", "checkpoint.save_steps=0"];
    let mut runs = Vec::new();
    for (tag, flags, says) in [
        (
            "shm",
            &[][..],
            "weight sync: shared memory (every rank on node",
        ),
        (
            "tcp",
            &["--weight-sync-backend", "tcp"][..],
            "weight sync: tcp (",
        ),
    ] {
        let out = dir.path().join(tag);
        let mut cmd = rlhf_e2e::ppo_run_cmd(&out, &common);
        cmd.args(flags);
        let mut p = Proc::spawn(tag, dir.path(), &mut cmd)?;
        let st = p.wait_exit(Duration::from_secs(900))?;
        let text = p.output();
        if !st.success() {
            bail!("{tag} run failed ({st}):\n{text}");
        }
        assert_eq!(
            text.matches("weight sync:").count(),
            1,
            "logged once:\n{text}"
        );
        assert!(text.contains(says), "{tag}:\n{text}");
        runs.push(metrics(&out.join("metrics.jsonl"))?);
    }
    let (shm, tcp) = (&runs[0], &runs[1]);
    assert_eq!(shm.len(), 3);
    assert_eq!(tcp.len(), 3);
    for (i, (a, b)) in shm.iter().zip(tcp).enumerate() {
        let bytes = a["perf/weight_sync_bytes"].as_f64().context("bytes")?;
        assert_eq!(Some(bytes), b["perf/weight_sync_bytes"].as_f64());
        let secs = a["perf/weight_sync_s"].as_f64().context("secs")?;
        if i + 1 == shm.len() {
            // No batch is sampled after the last step: nothing to sync.
            assert_eq!((bytes, secs), (0.0, 0.0), "{a}");
        } else {
            // ppo_tiny's policy as f32 to one rollout rank.
            assert!(bytes > 100_000.0, "{a}");
            assert!(secs.is_finite() && secs > 0.0, "{a}");
        }
        // The same weights reach the rollout: every learning number matches.
        for (k, u) in a.as_object().into_iter().flatten() {
            if k.starts_with("timing_s/") || k.starts_with("perf/") {
                continue;
            }
            let (Some(u), Some(v)) = (u.as_f64(), b[k].as_f64()) else {
                continue;
            };
            assert!(
                (u - v).abs() <= 1e-6 * (1.0 + u.abs()),
                "step {}: {k} shm {u} vs tcp {v}",
                a["step"]
            );
        }
    }
    Ok(())
}

#[test]
fn the_segment_goes_with_the_processes_even_when_the_trainer_is_killed() -> Result<()> {
    let before = shm_entries();
    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"CPU": 4}"#)?;
    c.wait_alive_nodes(1, Duration::from_secs(30))?;
    let out = c.dir.path().join("job");
    let mut p = Proc::spawn(
        "run",
        c.dir.path(),
        &mut c.ppo_run_cmd(
            &out,
            &[
                "training.train_iters=100000",
                "checkpoint.save_steps=0",
                "fault_tolerance.max_restarts=0",
            ],
        ),
    )?;
    let metrics_file = out.join("metrics.jsonl");
    wait_steps(&mut p, &metrics_file, 2, Duration::from_secs(600))?;
    // The trainer (rank 0, it made the segment) and the rollout hold it, no other role.
    let status = c.status()?;
    let actors: Vec<(i32, String)> = status["actors"]
        .as_array()
        .context("actors")?
        .iter()
        .filter_map(|a| Some((a["pid"].as_i64()? as i32, a["name"].as_str()?.to_string())))
        .collect();
    let holders: Vec<(i32, String)> = actors
        .iter()
        .filter(|(pid, _)| holds_file(*pid, SEGMENT))
        .cloned()
        .collect();
    let mut names: Vec<&str> = holders
        .iter()
        .filter_map(|(_, n)| n.rsplit_once("-actor_rollout-").map(|(_, part)| part))
        .collect();
    names.sort_unstable();
    assert_eq!(
        names,
        ["infer0", "train0"],
        "holders {holders:?} among {actors:?}"
    );
    let trainer = holders
        .iter()
        .find(|(_, n)| n.ends_with("-train0"))
        .map(|(pid, _)| *pid)
        .context("the trainer")?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(trainer), Signal::SIGKILL)?;
    let st = p.wait_exit(Duration::from_secs(120))?;
    let text = p.output();
    assert!(
        !st.success(),
        "the run must fail when the trainer dies:\n{text}"
    );
    assert!(text.contains("actor_rollout"), "{text}");
    // Every process that held the segment is gone or let it go (the job's end stops the
    // rollout); nothing was made in /dev/shm.
    wait_for(Duration::from_secs(60), "the holders let go", || {
        Ok(holders
            .iter()
            .all(|(pid, _)| !pid_alive(*pid) || !holds_file(*pid, SEGMENT))
            .then_some(()))
    })?;
    let after: Vec<String> = shm_entries()
        .into_iter()
        .filter(|e| !before.contains(e))
        .collect();
    assert!(after.is_empty(), "new entries in /dev/shm: {after:?}");
    Ok(())
}
