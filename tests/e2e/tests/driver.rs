//! The driver as a library: `rlhf_driver::run` in this process against a head and a worker
//! running as processes, with a recorder among its reporters. What a user sees on the console
//! and in the JSONL files is the same stream of events, checked here as data: the order of
//! milestones, one report per role rank, a step report per step with samples when due, the
//! early stop, and a resume that restores the algorithm's state from the checkpoint.

use std::time::Duration;

use anyhow::{Context, Result};
use rlhf_driver::report::{Recorded, Recorder};
use rlhf_driver::{metric, DriverOptions};
use rlhf_e2e::Cluster;
use rlhf_proto::v1::head_service_client::HeadServiceClient;
use rlhf_runtime::net::{self, ClientOptions};
use tokio_util::sync::CancellationToken;

fn config(out: &std::path::Path, extra: &[&str]) -> Result<rlhf_config::PpoConfig> {
    let root = rlhf_e2e::repo_root();
    let mut overrides = rlhf_e2e::output_overrides(out).to_vec();
    overrides.extend([
        "logging.sample_every=2".to_string(),
        "logging.progress=false".to_string(),
        "checkpoint.save_steps=10".to_string(),
    ]);
    overrides.extend(extra.iter().map(|s| s.to_string()));
    let mut cfg = rlhf_config::load(&root.join("configs"), "ppo_tiny", &overrides)?;
    cfg.absolutize_paths(&root);
    Ok(cfg)
}

async fn drive(c: &Cluster, opts: DriverOptions) -> Result<rlhf_driver::JobSummary> {
    let ch = net::connect(&c.address(), &opts.client).await?;
    let head = HeadServiceClient::new(ch).max_decoding_message_size(rlhf_proto::MAX_MESSAGE_BYTES);
    rlhf_driver::run(head, opts, CancellationToken::new())
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_reports_its_run_as_events_and_resumes_the_algorithm_state() -> Result<()> {
    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"CPU": 4}"#)?;
    c.wait_alive_nodes(1, Duration::from_secs(30))?;
    let client = ClientOptions::new(c.token()?);
    let out = c.dir.path().join("job");

    // Three steps asked, two run: the stop writes a checkpoint.
    let rec = Recorder::default();
    let mut opts = DriverOptions::new(
        config(
            &out,
            &["training.train_iters=3", "algorithm.kl_ctrl.type=adaptive"],
        )?,
        "driver-events",
        client.clone(),
    );
    opts.stop_after = Some(2);
    opts.call_timeout = Duration::from_secs(300);
    opts.reporters.push(Box::new(rec.clone()));
    let summary = drive(&c, opts).await?;
    assert_eq!((summary.global_step, summary.steps_run), (2, 2));

    let ev = rec.events();
    let Recorded::Dataset(d) = &ev[0] else {
        panic!("the dataset comes first: {ev:?}")
    };
    assert!(d.prompts > 0 && d.kept == d.prompts, "{d:?}");
    // Trainer, rollout, reference, critic and the rule reward: a process each.
    assert_eq!(ev[1], Recorded::Placed { processes: 5 }, "{ev:?}");
    let ready: Vec<&str> = ev
        .iter()
        .filter_map(|e| match e {
            Recorded::RoleReady { who, device, .. } => {
                assert!(device.starts_with("cpu"), "{e:?}");
                Some(who.as_str())
            }
            _ => None,
        })
        .collect();
    assert_eq!(ready.len(), 5, "one report per role rank: {ev:?}");
    assert!(ready.contains(&"critic rank 0"), "{ready:?}");
    let steps: Vec<(u64, usize, &std::collections::BTreeMap<String, f64>)> = ev
        .iter()
        .filter_map(|e| match e {
            Recorded::Step {
                step,
                samples,
                metrics,
            } => Some((*step, *samples, metrics)),
            _ => None,
        })
        .collect();
    assert_eq!(steps.len(), 2, "{ev:?}");
    // Samples are due on the first step of a run and every logging.sample_every=2 steps.
    assert_eq!((steps[0].0, steps[1].0), (1, 2));
    assert!(steps[0].1 > 0 && steps[1].1 > 0, "{ev:?}");
    for (step, _, m) in &steps {
        for k in [
            metric::OBJECTIVE_SCORES,
            metric::OBJECTIVE_KL_COEF,
            metric::LOSS_POLICY_AVG,
            metric::TIMING_S_STEP,
        ] {
            assert!(m.get(k).is_some_and(|v| v.is_finite()), "step {step}: {k}");
        }
    }
    assert!(
        steps[1].2.contains_key(metric::TIMING_S_CHECKPOINT),
        "the stop step is checkpointed"
    );
    assert_eq!(ev.last(), Some(&Recorded::Stopped { steps_run: 2 }));
    // The files got the same steps the recorder did.
    let lines = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    assert_eq!(lines.lines().count(), 2, "{lines}");

    // The adaptive KL coefficient moved, and the checkpoint holds where it went.
    let state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        summary
            .last_checkpoint
            .context("a checkpoint")?
            .join(rlhf_driver::checkpoint::STATE_FILE),
    )?)?;
    assert!(state["kl_ctl"].is_object(), "{state}");

    let saved_coef = state["kl_ctl"]["value"].as_f64().context("kl_ctl.value")?;
    assert!((saved_coef - 0.05).abs() > 1e-9, "adaptive: {state}");

    // Resume: step 3 starts from the saved coefficient, not the configured one.
    let resume = |rec: &Recorder| -> Result<DriverOptions> {
        let mut opts = DriverOptions::new(
            config(
                &out,
                &["training.train_iters=3", "algorithm.kl_ctrl.type=adaptive"],
            )?,
            "driver-events",
            client.clone(),
        );
        opts.resume = Some("latest".into());
        opts.call_timeout = Duration::from_secs(300);
        opts.reporters.push(Box::new(rec.clone()));
        Ok(opts)
    };
    let rec = Recorder::default();
    let summary = drive(&c, resume(&rec)?).await?;
    assert_eq!((summary.global_step, summary.steps_run), (3, 1));
    let ev = rec.events();
    assert!(
        matches!(&ev[1], Recorded::Resumed { step: 2, dir } if dir.ends_with("global_step_2")),
        "{ev:?}"
    );
    let Some(Recorded::Step {
        step: 3, metrics, ..
    }) = ev.last()
    else {
        panic!("step 3 last: {ev:?}")
    };
    let coef = metrics[metric::OBJECTIVE_KL_COEF];
    assert!(
        (coef - saved_coef).abs() < 1e-12,
        "step 3 used kl_coef {coef}, the checkpoint holds {saved_coef}"
    );

    // A run that is already complete places nothing.
    let rec = Recorder::default();
    let summary = drive(&c, resume(&rec)?).await?;
    assert_eq!((summary.global_step, summary.steps_run), (3, 0));
    let ev = rec.events();
    assert_eq!(ev[2], Recorded::NothingToDo { step: 3, total: 3 }, "{ev:?}");
    assert_eq!(ev.len(), 3, "{ev:?}");

    // A damaged checkpoint is refused before a step runs. First the trainer state records
    // other weights than the files hold, then a weight file is changed after the save.
    let resume4 = || -> Result<DriverOptions> {
        let mut opts = DriverOptions::new(
            config(&out, &["training.train_iters=4"])?,
            "driver-events",
            client.clone(),
        );
        opts.resume = Some("latest".into());
        opts.call_timeout = Duration::from_secs(300);
        Ok(opts)
    };
    let ckpt = out.join("ckpt/global_step_3");
    let state_file = ckpt.join(rlhf_driver::checkpoint::STATE_FILE);
    let original = std::fs::read_to_string(&state_file)?;
    let mut state: serde_json::Value = serde_json::from_str(&original)?;
    state["actor_checksum"] = serde_json::json!(12345u64);
    std::fs::write(&state_file, state.to_string())?;
    // The signature catches the edit before anything loads.
    let e = drive(&c, resume4()?).await.unwrap_err().to_string();
    assert!(e.contains("changed after it was signed"), "{e}");
    assert!(!e.contains("12345") && !e.contains("3039"), "{e}");
    // Trusted anyway, the loaded weights do not match what the state records.
    let mut trusted = resume4()?;
    trusted.trust_checkpoint = true;
    let e = drive(&c, trusted).await.unwrap_err().to_string();
    assert!(
        e.contains("loaded weights are not the ones") && e.contains("actor"),
        "{e}"
    );
    std::fs::write(&state_file, original)?;
    let weights = ckpt.join("actor/model.safetensors");
    let mut bytes = std::fs::read(&weights)?;
    let n = bytes.len();
    bytes[n - 256..].fill(0);
    std::fs::write(&weights, bytes)?;
    let e = drive(&c, resume4()?).await.unwrap_err().to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("changed after it was saved"),
        "{e}"
    );
    Ok(())
}

/// A launch that cannot finish releases what it made: on a node with 4 CPU slots, one of
/// them held by another placement group, the actor_rollout (2) and ref (1) groups are
/// placed, the critic's cannot be within the start timeout, and after the failure no
/// placement group of the job holds a slot and no actor runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_launch_leaves_no_placement_groups_or_actors() -> Result<()> {
    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"CPU": 4}"#)?;
    c.wait_alive_nodes(1, Duration::from_secs(30))?;
    // Another tenant holds one slot: the job fits the cluster, just not now.
    let mut head =
        HeadServiceClient::new(net::connect(&c.address(), &ClientOptions::new(c.token()?)).await?);
    let one = rlhf_proto::v1::Bundle {
        resources: Some(rlhf_proto::v1::Resources {
            amounts: [("CPU".to_string(), 1.0)].into_iter().collect(),
        }),
    };
    let held = head
        .create_placement_group(rlhf_proto::v1::CreatePlacementGroupRequest {
            name: "other-tenant".into(),
            strategy: rlhf_proto::v1::PlacementStrategy::Pack as i32,
            bundles: vec![one],
            timeout_ms: 0,
            cuda_roles: false,
            vllm_roles: false,
        })
        .await?
        .into_inner()
        .placement_group
        .context("placement group")?
        .pg_id;
    let out = c.dir.path().join("job");
    let mut opts = DriverOptions::new(
        config(&out, &["training.train_iters=1"])?,
        "driver-leak",
        ClientOptions::new(c.token()?),
    );
    opts.start_timeout = Duration::from_secs(2);
    let e = drive(&c, opts).await.unwrap_err().to_string();
    assert!(e.contains("placing role critic"), "{e}");
    let status = c.status()?;
    let pgs = status["placement_groups"].as_array().context("pgs")?;
    assert!(
        pgs.len() >= 3,
        "the first groups were placed before the failure: {pgs:?}"
    );
    assert!(
        pgs.iter()
            .filter(|p| p["pg_id"] != held.as_str())
            .all(|p| p["state"] == "REMOVED"),
        "a failed launch left placement groups: {pgs:?}"
    );
    let actors = status["actors"].as_array().context("actors")?;
    assert!(
        actors
            .iter()
            .all(|a| a["state"] != "ALIVE" && a["state"] != "PENDING"),
        "{actors:?}"
    );
    Ok(())
}
