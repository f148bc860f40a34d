//! `resource_pool.colocate`: the whole tiny PPO job on one device. Against a worker that
//! offers a single CPU slot, every role takes a third of it (fractional bundles), the
//! rollout generates inside the trainer process with the trainer's weights (no second copy,
//! no weight sync), and the score climbs as in the default run. Without the hybrid engine
//! (`actor_rollout.hybrid_engine=false`) the rollout is a process of its own on the same
//! slot, given the weights through shared memory after every update, and the score climbs
//! as well.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use rlhf_e2e::{actor_roles, bin, Cluster, Proc};
use serde_json::Value;

#[test]
fn a_colocated_ppo_job_runs_on_one_device_and_climbs() -> Result<()> {
    // Offload is part of the path (config → role spec → the trainer before each
    // generation); on a CPU device the moments already are in host memory.
    let (c, job, out) = run_on_one_slot(
        "colocated",
        &["resource_pool.colocate=true", "actor_rollout.offload=true"],
    )?;
    // The rollout rank lives in the trainer's process and says so.
    assert!(out.contains("colocated"), "{out}");

    let m = climbs(&job, "colocated")?;
    // The rollout sees the trainer's updates without any sync.
    assert!(m
        .iter()
        .all(|l| l["perf/weight_sync_bytes"].as_f64() == Some(0.0)));

    // The three role processes with a device (actor, ref, critic) shared the one slot: their
    // placement groups held a third of a CPU each.
    let s = c.status()?;
    let bundles = cpu_bundles(&s)?;
    assert_eq!(bundles.len(), 3, "{s}");
    assert!(
        bundles.iter().all(|&b| (b - 0.333).abs() < 1e-9),
        "{bundles:?}"
    );
    // One process per role (the rule reward's holds no device), the rollout inside the
    // trainer's.
    assert_eq!(
        actor_roles(&s),
        ["actor_rollout", "critic", "ref", "reward"],
        "{s}"
    );
    Ok(())
}

/// Runs ppo_tiny with `overrides` (no checkpoints) against one worker that offers a single
/// CPU slot, to its successful end; returns the cluster (for its status), the job directory
/// and the run's output.
fn run_on_one_slot(name: &str, overrides: &[&str]) -> Result<(Cluster, PathBuf, String)> {
    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"CPU": 1}"#)?;
    c.wait_alive_nodes(1, Duration::from_secs(30))?;
    let job = c.dir.path().join("job");
    let mut args = overrides.to_vec();
    args.push("checkpoint.save_steps=0");
    let mut cmd = c.ppo_run_cmd(&job, &args);
    let mut p = Proc::spawn(name, c.dir.path(), &mut cmd)?;
    let st = p.wait_exit(Duration::from_secs(900))?;
    let out = p.output();
    assert!(st.success(), "{name}: {out}");
    Ok((c, job, out))
}

/// The job's metrics after checking that it ran on-policy for at least 20 steps, that the
/// score climbed as in the default run and that the policy moved.
fn climbs(job: &std::path::Path, what: &str) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(job.join("metrics.jsonl"))?;
    let m: Vec<Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<std::result::Result<_, _>>()?;
    assert!(m.len() >= 20, "{} steps", m.len());
    // The rollout samples with the trainer's current weights: on-policy every step.
    for l in &m {
        assert_eq!(l["rollout/staleness_max"].as_f64(), Some(0.0), "{l}");
    }
    let scores: Vec<f64> = m
        .iter()
        .filter_map(|l| l["objective/scores"].as_f64())
        .collect();
    let k = 10;
    let first = scores[..k].iter().sum::<f64>() / k as f64;
    let last = scores[scores.len() - k..].iter().sum::<f64>() / k as f64;
    println!("{what}: objective/scores first {k} steps {first:.3}, last {k} steps {last:.3}");
    assert!(
        last >= first + 0.15,
        "{what}: the score should climb: first {k} steps {first:.3}, last {k} steps {last:.3}"
    );
    let kl_last = m[m.len() - k..]
        .iter()
        .filter_map(|l| l["objective/kl"].as_f64())
        .sum::<f64>()
        / k as f64;
    assert!(
        kl_last > 1e-3,
        "{what}: mean KL of the last {k} steps {kl_last}"
    );
    Ok(m)
}

/// CPU bundles of the job's placement groups, as the head reports them.
fn cpu_bundles(s: &Value) -> Result<Vec<f64>> {
    Ok(s["placement_groups"]
        .as_array()
        .context("placement groups")?
        .iter()
        .flat_map(|p| p["bundles"].as_array().cloned().unwrap_or_default())
        .filter_map(|b| b["CPU"].as_f64())
        .collect())
}

#[test]
fn a_colocated_job_with_rollout_processes_of_its_own_syncs_through_shared_memory() -> Result<()> {
    let (c, job, out) = run_on_one_slot(
        "colocated-split",
        &[
            "resource_pool.colocate=true",
            "actor_rollout.hybrid_engine=false",
        ],
    )?;
    assert!(
        out.contains("weight sync: shared memory (every rank on node"),
        "{out}"
    );
    let m = climbs(&job, "colocated, rollout processes of its own")?;
    // Every update's weights went to the rollout process, checksummed by the driver (all
    // but the last step's: no generation follows it).
    assert!(
        m[..m.len() - 1].iter().all(|l| l["perf/weight_sync_bytes"]
            .as_f64()
            .is_some_and(|b| b > 0.0)),
        "{:?}",
        m[0]
    );
    // Four processes with a device (actor trainer, actor rollout, ref, critic) shared the
    // one slot, a quarter each.
    let s = c.status()?;
    let bundles = cpu_bundles(&s)?;
    assert_eq!(bundles.len(), 4, "{s}");
    assert!(
        bundles.iter().all(|&b| (b - 0.25).abs() < 1e-9),
        "{bundles:?}"
    );
    assert_eq!(
        actor_roles(&s),
        ["actor_rollout", "actor_rollout", "critic", "ref", "reward"],
        "{s}"
    );
    Ok(())
}

/// Fractional GPU bundles share a device: on a worker with one GPU, three actors in bundles
/// of a third each are all bound to GPU 0 (as colocated roles are), and a fourth bundle
/// that would overfill it is refused with the shortfall.
#[test]
fn actors_in_fractional_gpu_bundles_share_one_gpu() -> Result<()> {
    use rlhf_proto::v1 as pb;
    use rlhf_proto::v1::head_service_client::HeadServiceClient;
    use rlhf_runtime::net::{self, ClientOptions};

    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"GPU": 1, "CPU": 2}"#)?;
    c.wait_alive_nodes(1, Duration::from_secs(30))?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let mut o = ClientOptions::new(c.token()?);
        o.connect_timeout = Duration::from_secs(10);
        let mut h = HeadServiceClient::new(net::connect(&c.address(), &o).await?);
        let bundle = |gpu: f64| pb::Bundle {
            resources: Some(pb::Resources {
                amounts: [("GPU".to_string(), gpu)].into(),
            }),
        };
        let mut devices = Vec::new();
        for i in 0..3 {
            let pg = h
                .create_placement_group(pb::CreatePlacementGroupRequest {
                    name: format!("share{i}"),
                    strategy: pb::PlacementStrategy::Pack as i32,
                    bundles: vec![bundle(0.333)],
                    timeout_ms: 0,
                    cuda_roles: false,
                    vllm_roles: false,
                })
                .await?
                .into_inner()
                .placement_group
                .context("placement group")?;
            let a = h
                .create_actor(pb::CreateActorRequest {
                    spec: Some(pb::ActorSpec {
                        name: format!("echo{i}"),
                        role: "test".into(),
                        kind: "test".into(),
                        pg_id: pg.pg_id.clone(),
                        bundle_index: 0,
                        ..Default::default()
                    }),
                    timeout_ms: 20_000,
                })
                .await?
                .into_inner()
                .actor
                .context("actor")?;
            devices.push(a.devices);
        }
        assert_eq!(devices, vec![vec![0u32]; 3], "all three share GPU 0");
        let err = h
            .create_placement_group(pb::CreatePlacementGroupRequest {
                name: "overfill".into(),
                strategy: pb::PlacementStrategy::Pack as i32,
                bundles: vec![bundle(0.5)],
                timeout_ms: 0,
                cuda_roles: false,
                vllm_roles: false,
            })
            .await
            .unwrap_err();
        assert!(err.message().contains("GPU"), "{}", err.message());
        anyhow::Ok(())
    })?;
    let text = Command::new(bin("rlhf-head"))
        .args(["status", "--address", &c.address(), "--token-file"])
        .arg(c.token_file())
        .env_remove("RLHF_TOKEN")
        .output()?;
    let text = String::from_utf8_lossy(&text.stdout);
    assert_eq!(
        text.matches("devices=0 shares {GPU: 0.33}").count(),
        3,
        "status shows the sharing: {text}"
    );
    Ok(())
}
