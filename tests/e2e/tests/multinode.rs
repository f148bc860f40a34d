//! Multi-node launch over several "hosts" made on one machine, driven by the real
//! scripts/start-cluster.sh and scripts/stop-cluster.sh.
//!
//! A host is a network namespace with its own address (10.231.0.x on a bridge that lives in a
//! namespace of its own, so nothing touches the machine's own network), or a loopback address
//! (127.0.0.2-5; all of 127/8 is loopback on Linux). The remote shell the scripts use is
//! overridden with `ip netns exec` or a local `sh`. One test uses namespaces and is skipped
//! (printing SKIPPED and the reason) where they cannot be made (root and iproute2) or
//! RLHF_MULTINODE_MODE=loopback turns them off; another always uses loopback addresses.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rlhf_e2e::{bin, free_port, free_port_pair, pid_alive, skip, wait_for};
use serde_json::Value;

#[path = "multinode/hosts.rs"]
mod hosts;
use hosts::*;

fn scenario(tag: &str, hosts: Hosts) -> Result<()> {
    let mode = hosts.mode_name();
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    let marker = state.display().to_string();
    let _kill = KillOnDrop(marker.clone());
    let head_bin = bin("rlhf-head");
    let bin_dir = head_bin.parent().context("binary dir")?.to_path_buf();
    let _ = bin("rlhf-worker");
    // Timed from here.
    let started = Instant::now();

    // Head alone on host 0; three workers with different resources.
    let worker_res = [
        r#"{"GPU": 1, "CPU": 2}"#,
        r#"{"GPU": 2, "CPU": 4, "special": 1}"#,
        r#"{"GPU": 4, "CPU": 8}"#,
    ];
    let mut hostfile = format!("# head\n{}\n", hosts.addrs[0]);
    for (a, r) in hosts.addrs[1..].iter().zip(worker_res) {
        hostfile.push_str(&format!("{a} {r}   # worker\n"));
    }
    let hostfile_path = dir.path().join("hosts");
    std::fs::write(&hostfile_path, &hostfile)?;

    let mut common: Vec<String> = vec![
        "--state-dir".into(),
        marker.clone(),
        "--bin-dir".into(),
        bin_dir.display().to_string(),
    ];
    let mut start_args = vec![
        "--timeout".to_string(),
        "30".into(),
        "--head-arg=--dashboard-port=0".into(),
        format!("--head-arg=--dead-after-ms={DEAD_AFTER_MS}"),
        "--head-arg=--heartbeat-ms=200".into(),
    ];
    if let Mode::Loopback = hosts.mode {
        // Other tests may use the usual port on loopback; a namespace has its own ports.
        start_args.extend([
            "--port".into(),
            free_port().to_string(),
            "--head-bind".into(),
            hosts.addrs[0].clone(),
        ]);
    }
    common.push(hostfile_path.display().to_string());
    let script = |name: &str| {
        let mut c = Command::new("bash");
        c.arg(repo_root().join("scripts").join(name))
            .env("RLHF_REMOTE_SHELL", &hosts.remote_shell)
            .env_remove("RLHF_TOKEN")
            .env_remove("RLHF_STATE_DIR");
        c
    };

    let out = run_ok(
        script("start-cluster.sh").args(&start_args).args(&common),
        &format!("start-cluster.sh ({mode})"),
    )?;
    let text = String::from_utf8_lossy(&out.stdout);
    let start_took = started.elapsed();
    assert!(text.contains("all 3 worker node(s) alive"), "{text}");
    assert!(text.contains("Cluster status"), "status printed: {text}");
    // The token reached every worker host through a 0600 file, not a command line.
    for a in &hosts.addrs[1..] {
        let f = state.join(a).join("token");
        let meta = std::fs::metadata(&f).with_context(|| format!("{}", f.display()))?;
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            meta.permissions().mode() & 0o077,
            0,
            "{} readable by others",
            f.display()
        );
    }
    let token = std::fs::read_to_string(state.join("head/token"))?;
    for pid in pids_with_marker(&marker) {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&cmdline).contains(token.trim()),
            "the token is on the command line of pid {pid}"
        );
    }

    let status = || -> Result<Value> {
        let out = run_ok(
            hosts
                .on_host(0, &head_bin)
                .args(["status", "--format", "json", "--connect-timeout", "2"])
                .arg("--state-dir")
                .arg(state.join("head"))
                .env_remove("RLHF_TOKEN"),
            "rlhf-head status",
        )?;
        Ok(serde_json::from_slice(&out.stdout)?)
    };
    let s = status()?;
    let nodes = node_map(&s);
    assert_eq!(nodes.len(), 3, "{s}");
    for (a, r) in hosts.addrs[1..].iter().zip(worker_res) {
        let n = nodes
            .get(a)
            .with_context(|| format!("no node with address {a} in {s}"))?;
        assert_eq!(n["state"], "ALIVE", "{n}");
        let want: Value = serde_json::from_str(r)?;
        for (k, v) in want.as_object().context("resources")? {
            assert_eq!(n["total"][k].as_f64(), v.as_f64(), "{a}: {k} in {n}");
        }
    }
    assert_eq!(s["resources"]["total"]["GPU"], 7.0, "{s}");

    // A PPO job across the hosts: the driver on the head's host, the four roles placed by the
    // head on the worker hosts, batches and weights crossing between them.
    let head_json: Value =
        serde_json::from_str(&std::fs::read_to_string(state.join("head/head.json"))?)?;
    let head_addr = head_json["address"]
        .as_str()
        .context("head address")?
        .to_string();
    let job = dir.path().join("job");
    let ppo_started = Instant::now();
    // Batches as between real hosts: these "hosts" share one kernel, so shared memory
    // would reach the roles; the flag makes every batch take the cross-host path.
    run_ok(
        hosts
            .on_host(0, &head_bin)
            .current_dir(repo_root())
            .args(["run", "--address", &head_addr, "--config-name", "ppo_tiny"])
            .args(["training.train_iters=2", "checkpoint.save_steps=0"])
            .args(rlhf_e2e::output_overrides(&job))
            .args(["--batch-path", "frames"])
            .arg("--token-file")
            .arg(state.join("head/token"))
            .env_remove("RLHF_TOKEN"),
        "rlhf-head run across hosts",
    )?;
    let logs_saying = |line: &str| rlhf_e2e::logs_saying(&state, line);
    // The line rlhf_roles::server::FRAMED_LOG, in each role process's log.
    let framed = logs_saying("batches arrive as raw control frames over TCP");
    assert!(
        framed >= 4,
        "every role process gets its batches as frames: {framed} role logs say so"
    );
    // rlhf_roles::KV_RENDEZVOUS_LOG: the rollout (rank 1 of the weights group) met the
    // trainer through the head's KV store.
    let met = logs_saying("communicator rendezvous read from the head's KV store");
    assert!(
        met >= 1,
        "no role process read a rendezvous from the head's KV store"
    );
    let lines = std::fs::read_to_string(job.join("metrics.jsonl"))?;
    assert_eq!(lines.lines().count(), 2, "{lines}");
    let s = status()?;
    let actors: Vec<&Value> = s["actors"]
        .as_array()
        .context("actors")?
        .iter()
        .filter(|a| !a["role"].as_str().unwrap_or_default().is_empty())
        .collect();
    assert!(actors.len() >= 4, "{s}");
    let mut role_hosts = BTreeMap::new();
    for a in &actors {
        let host = a["address"]
            .as_str()
            .unwrap_or_default()
            .rsplit_once(':')
            .map(|x| x.0.to_string());
        let host = host.unwrap_or_default();
        assert!(
            hosts.addrs[1..].contains(&host),
            "role {} ran on {host}, not on a worker host: {a}",
            a["role"]
        );
        role_hosts.insert(a["role"].as_str().unwrap_or_default().to_string(), host);
    }
    println!(
        "multinode {tag}: PPO job of 2 steps in {:?}, roles on {role_hosts:?}",
        ppo_started.elapsed()
    );

    // A worker host goes away: everything started for it is killed.
    let victim = 2;
    let kill_ms = rlhf_core::unix_ms();
    let killed_pids = hosts.kill_host(victim, &state)?;
    let killed = Instant::now();
    wait_for(
        Duration::from_secs(30),
        "killed host's processes gone",
        || Ok(killed_pids.iter().all(|&p| !pid_alive(p)).then_some(())),
    )?;
    let victim_addr = hosts.addrs[victim].clone();
    // Each poll starts a process (in the head's namespace); the deadline only catches a head
    // that never notices, the timing is checked on the head's own timestamps below.
    let s = wait_for(
        Duration::from_millis(DEAD_AFTER_MS + 30_000),
        "node marked dead",
        || {
            let s = status()?;
            Ok((node_map(&s)
                .get(&victim_addr)
                .map(|n| n["state"] == "DEAD")
                .unwrap_or(false))
            .then_some(s))
        },
    )?;
    let took = killed.elapsed();
    let nodes = node_map(&s);
    let dead = &nodes[&victim_addr];
    assert!(
        dead["death_reason"]
            .as_str()
            .unwrap_or_default()
            .contains("no heartbeat"),
        "{dead}"
    );
    // Ordering, not speed: dead only after a full threshold of silence, and not before the
    // kill (a live node declared dead would show here).
    let death_ms = dead["death_ms"].as_i64().context("death_ms")?;
    let last_heartbeat_ms = dead["last_heartbeat_ms"].as_i64().context("heartbeat")?;
    let silent_ms = death_ms - last_heartbeat_ms;
    assert!(
        silent_ms > DEAD_AFTER_MS as i64,
        "{mode}: dead after {silent_ms} ms without a heartbeat, threshold {DEAD_AFTER_MS} ms"
    );
    assert!(
        death_ms >= kill_ms,
        "{mode}: dead {} ms before the kill: {dead}",
        kill_ms - death_ms
    );
    for (i, a) in hosts.addrs.iter().enumerate().skip(1) {
        if i != victim {
            assert_eq!(nodes[a]["state"], "ALIVE", "{a} should live on: {s}");
        }
    }

    // Stop: nothing the scripts started may survive.
    let before = hosts.leftover_pids(&marker);
    assert!(
        !before.is_empty(),
        "the cluster's processes should be found"
    );
    let out = run_ok(
        script("stop-cluster.sh").args(&common),
        &format!("stop-cluster.sh ({mode})"),
    )?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("cluster stopped"), "{text}");
    let left = wait_for(Duration::from_secs(5), "no process left", || {
        let left = hosts.leftover_pids(&marker);
        Ok(left.is_empty().then_some(()))
    });
    if let Err(e) = left {
        bail!(
            "{e}: still running: {:?}; stop output:\n{text}",
            hosts.leftover_pids(&marker)
        );
    }
    for pid in before {
        assert!(!pid_alive(pid), "pid {pid} outlived stop-cluster.sh");
    }
    let pid_files: Vec<_> = rlhf_e2e::files_under(&state)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "pid"))
        .collect();
    assert!(pid_files.is_empty(), "pid files left: {pid_files:?}");
    println!(
        "multinode {tag} ({mode}) passed in {:?}: start-cluster.sh {start_took:?}, node dead \
         {} ms after the kill by the head's clock ({took:?} seen here)",
        started.elapsed(),
        death_ms - kill_ms
    );
    Ok(())
}

/// Hosts in network namespaces: the head on one host, three workers on three others, a
/// worker host killed, then everything stopped. Skipped (not run on loopback, which the next
/// test covers) where namespaces cannot be made or RLHF_MULTINODE_MODE=loopback.
#[test]
fn scripts_start_a_cluster_across_hosts_detect_a_lost_host_and_stop_everything() -> Result<()> {
    const TEST: &str =
        "scripts_start_a_cluster_across_hosts_detect_a_lost_host_and_stop_everything";
    let tmp = env!("CARGO_TARGET_TMPDIR");
    if std::env::var("RLHF_MULTINODE_MODE").as_deref() == Ok("loopback") {
        skip(
            tmp,
            TEST,
            "RLHF_MULTINODE_MODE=loopback turns network namespaces off",
        );
        return Ok(());
    }
    let hosts = match Hosts::netns("a", 4) {
        Ok(h) => h,
        Err(e) => {
            let reason = format!("network namespaces not available here: {e:#}");
            skip(tmp, TEST, &reason);
            return Ok(());
        }
    };
    println!(
        "multinode mode: network namespaces ({})",
        hosts.addrs.join(", ")
    );
    scenario("a", hosts)
}

/// The same on loopback addresses, on every machine (namespaces or not), so the scripts'
/// local-shell path is always tested.
#[test]
fn scripts_work_with_hosts_on_loopback_addresses() -> Result<()> {
    println!("multinode mode: loopback (this test always uses it)");
    scenario("lo", Hosts::loopback(4))
}

/// Bad host files are refused with the line and the fix, before anything is started.
#[test]
fn start_cluster_refuses_bad_host_files() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cases = [
        ("", "lists no host"),
        ("10.0.0.1\n10.0.0.2 GPU=8\n", "line 2"),
        (
            "10.0.0.1\n10.0.0.2\n10.0.0.2 {\"GPU\": 1}\n",
            "listed twice",
        ),
    ];
    for (content, want) in cases {
        let f = dir.path().join("hosts");
        std::fs::write(&f, content)?;
        let out = Command::new("bash")
            .arg(repo_root().join("scripts/start-cluster.sh"))
            .arg(&f)
            // Nothing may be started: a remote shell that fails loudly proves it.
            .env("RLHF_REMOTE_SHELL", "false {host}")
            .stdin(Stdio::null())
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{content:?} accepted");
        assert!(err.contains(want), "{content:?}: {err}");
    }
    Ok(())
}

/// scripts/slurm/rlhf.sbatch under stand-ins for `srun` and `scontrol` that run each step on
/// this machine: two "nodes" (both localhost), the head and a worker step per node, the
/// command run against the cluster, and everything stopped when the batch script ends.
#[test]
fn slurm_batch_script_starts_runs_and_stops_a_cluster() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fake = dir.path().join("bin");
    std::fs::create_dir_all(&fake)?;
    // srun [--opt=value | -w NODE | --overlap ...] CMD...: --ntasks copies of CMD, output
    // to --output with %N replaced.
    let srun = r#"#!/usr/bin/env bash
n=1; out=""
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in
    --ntasks=*) n=${1#*=} ;;
    --output=*) out=${1#*=} ;;
    -w|--nodelist) shift ;;
  esac
  shift
done
for i in $(seq 1 "$n"); do
  if [[ -n $out ]]; then "$@" >"${out//%N/node$i}" 2>&1 & else "$@" & fi
done
wait
"#;
    let scontrol =
        "#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'localhost\\nlocalhost\\n'\n";
    use std::os::unix::fs::PermissionsExt;
    for (name, text) in [("srun", srun), ("scontrol", scontrol)] {
        let p = fake.join(name);
        std::fs::write(&p, text)?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))?;
    }
    let head_bin = bin("rlhf-head");
    let bin_dir = head_bin.parent().context("binary dir")?.to_path_buf();
    let _ = bin("rlhf-worker");
    let job_dir = dir.path().join("job");
    let marker = job_dir.display().to_string();
    let _kill = KillOnDrop(marker.clone());
    let path = format!(
        "{}:{}",
        fake.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // The "job": the cluster's status as JSON, written where the test can read it.
    let status_file = dir.path().join("status.json");
    let out = Command::new("bash")
        .arg(repo_root().join("scripts/slurm/rlhf.sbatch"))
        .args(["sh", "-c"])
        .arg(r#"rlhf-head status --format json > "$0""#)
        .arg(&status_file)
        .env("PATH", format!("{}:{path}", bin_dir.display()))
        .env("SLURM_JOB_ID", "4242")
        .env("SLURM_JOB_NODELIST", "localhost,localhost")
        .env("SLURM_GPUS_ON_NODE", "2")
        .env("SLURM_CPUS_ON_NODE", "3")
        .env("RLHF_BIN_DIR", &bin_dir)
        .env("RLHF_JOB_DIR", &job_dir)
        .env("RLHF_PORT", free_port_pair().to_string())
        .env("RLHF_TIMEOUT", "30")
        .env_remove("RLHF_IFACE")
        .env_remove("RLHF_TOKEN")
        .env_remove("RLHF_STATE_DIR")
        .stdin(Stdio::null())
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "sbatch script failed:\n{text}");
    assert!(text.contains("all 2 nodes alive"), "{text}");
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&status_file)?)?;
    let nodes = s["nodes"].as_array().context("nodes")?;
    assert_eq!(nodes.len(), 2, "{s}");
    for n in nodes {
        assert_eq!(n["state"], "ALIVE", "{n}");
        assert_eq!(n["total"]["GPU"], 2.0, "GPUs from SLURM_GPUS_ON_NODE: {n}");
        assert_eq!(n["total"]["CPU"], 3.0, "CPUs from SLURM_CPUS_ON_NODE: {n}");
    }
    // The job's end stopped the cluster and removed the token.
    wait_for(Duration::from_secs(10), "no process left", || {
        Ok(pids_with_marker(&marker).is_empty().then_some(()))
    })?;
    assert!(!job_dir.join("head/token").exists(), "token left behind");
    Ok(())
}
