//! The cluster foundation over real processes on loopback: a head, workers with different
//! resources, placement, actors, failures, auth, restart and clean shutdown.

use std::time::{Duration, Instant};

use anyhow::Result;
use nix::sys::signal::Signal;
use rlhf_e2e::{count_alive, pid_alive, wait_for, Cluster, Proc};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::actor_service_client::ActorServiceClient;

#[path = "cluster/common.rs"]
mod common;
use common::*;

#[test]
fn three_workers_appear_in_status_and_groups_place_all_or_nothing() -> Result<()> {
    let c = three_node_cluster(&[])?;
    let s = c.status()?;
    let mut gpus: Vec<f64> = s["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["total"]["GPU"].as_f64().unwrap())
        .collect();
    gpus.sort_by(f64::total_cmp);
    assert_eq!(gpus, vec![1.0, 2.0, 4.0]);
    assert_eq!(s["resources"]["total"]["GPU"], 7.0);
    assert_eq!(s["resources"]["total"]["special"], 1.0);

    // Human status, like `ray status`.
    let out = std::process::Command::new(rlhf_e2e::bin("rlhf-head"))
        .args(["status", "--address", &c.address(), "--token-file"])
        .arg(c.token_file())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("0/7 GPU") && text.contains("Active:"),
        "{text}"
    );

    rt().block_on(async {
        let mut h = head_client(&c).await?;
        // SPREAD: three bundles on three different nodes.
        let pg = h
            .create_placement_group(pg_req("spread", pb::PlacementStrategy::Spread, 3, 1.0, 0))
            .await?
            .into_inner()
            .placement_group
            .unwrap();
        let mut nodes = pg.bundle_nodes.clone();
        nodes.sort();
        nodes.dedup();
        assert_eq!(nodes.len(), 3, "{pg:?}");

        // Impossible: refused at once, naming the resource, the shortfall and the nodes.
        let e = h
            .create_placement_group(pg_req(
                "huge",
                pb::PlacementStrategy::StrictSpread,
                3,
                4.0,
                0,
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(
            e.message().contains("short of GPU by 8 in total"),
            "{}",
            e.message()
        );
        assert!(e.message().contains("has GPU: 0"), "{}", e.message());

        // Waiting variant: fails after the timeout, then succeeds once resources are freed.
        let t = Instant::now();
        let e = h
            .create_placement_group(pg_req("wait", pb::PlacementStrategy::Pack, 1, 4.0, 600))
            .await
            .unwrap_err();
        assert!(t.elapsed() >= Duration::from_millis(600));
        assert!(e.message().contains("waited 600 ms"), "{}", e.message());
        let mut h2 = h.clone();
        let waiter = tokio::spawn(async move {
            h2.create_placement_group(pg_req("wait2", pb::PlacementStrategy::Pack, 1, 4.0, 10_000))
                .await
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        h.remove_placement_group(pb::RemovePlacementGroupRequest {
            pg_id: pg.pg_id.clone(),
        })
        .await?;
        let got = waiter.await??.into_inner().placement_group.unwrap();
        assert_eq!(got.bundle_nodes.len(), 1);
        anyhow::Ok(())
    })?;
    Ok(())
}

#[test]
fn actors_run_on_their_bundle_node_answer_directly_and_report_crashes() -> Result<()> {
    let c = three_node_cluster(&[])?;
    rt().block_on(async {
        let mut h = head_client(&c).await?;
        let pg = h
            .create_placement_group(pg_req("g", pb::PlacementStrategy::StrictSpread, 2, 1.0, 0))
            .await?
            .into_inner()
            .placement_group
            .unwrap();
        let a = h
            .create_actor(test_actor(&pg.pg_id, 1))
            .await?
            .into_inner()
            .actor
            .unwrap();
        assert_eq!(a.node_id, pg.bundle_nodes[1]);
        assert_eq!(a.devices.len(), 1, "one GPU bound: {a:?}");
        assert!(pid_alive(a.pid));

        let mut actor = actor_client(&c, &a.address).await?;
        let r = actor
            .ping(pb::PingRequest {
                payload: b"hello".to_vec(),
            })
            .await?
            .into_inner();
        assert_eq!(r.payload, b"hello");
        assert_eq!(r.actor_id, a.actor_id);

        // A batch far over gRPC's 4 MiB default message limit streams through in chunks.
        let rows = 1024;
        let logp: Vec<f32> = (0..rows * 3000).map(|i| (i % 977) as f32 * 0.001).collect();
        let batch = rlhf_core::DataBatch::new()
            .with_tensor(
                "old_log_probs",
                rlhf_core::TensorData::from_f32(vec![rows, 3000], &logp)?,
            )
            .with_column(
                "prompt",
                (0..rows)
                    .map(|i| serde_json::json!(format!("q{i}")))
                    .collect(),
            );
        let got = actor
            .put_batch(rlhf_runtime::batch_stream(&batch)?)
            .await?
            .into_inner();
        assert_eq!(got.rows, rows as u64);
        assert!(got.bytes > (rows * 3000 * 4) as u64, "{}", got.bytes);
        assert_eq!(got.checksum, rlhf_core::batch::checksum(&batch));

        // Without the token the actor refuses.
        let raw = tonic::transport::Endpoint::from_shared(format!("http://{}", a.address))?
            .connect()
            .await?;
        let e = ActorServiceClient::new(raw)
            .ping(pb::PingRequest::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);

        actor.crash(pb::CrashRequest { code: 3 }).await?;
        let st = wait_for(Duration::from_secs(10), "actor death reported", || {
            let s = c.status()?;
            let act = s["actors"]
                .as_array()
                .unwrap()
                .iter()
                .find(|x| x["actor_id"] == a.actor_id.as_str())
                .cloned();
            Ok(act.filter(|x| x["state"] == "DEAD"))
        })?;
        assert_eq!(st["reason"], "exited with code 3");
        assert_eq!(st["exit"]["exit_code"], 3);
        let tail = st["exit"]["log_tail"].to_string();
        assert!(tail.contains("crash requested with code 3"), "{tail}");
        anyhow::Ok(())
    })?;
    Ok(())
}

#[test]
fn killed_worker_is_marked_dead_after_missed_heartbeats_with_its_actors() -> Result<()> {
    // Long next to the 200 ms heartbeat, so a loaded machine does not starve a live node
    // into a false death.
    let threshold_ms: i64 = 3000;
    let mut c = three_node_cluster(&["--dead-after-ms", "3000", "--heartbeat-ms", "200"])?;
    let rt = rt();
    let mut h = rt.block_on(head_client(&c))?;
    let actor = rt.block_on(async {
        let pg = h
            .create_placement_group(pg_req("g", pb::PlacementStrategy::Pack, 1, 4.0, 0))
            .await?
            .into_inner()
            .placement_group
            .unwrap();
        anyhow::Ok(
            h.create_actor(test_actor(&pg.pg_id, 0))
                .await?
                .into_inner()
                .actor
                .unwrap(),
        )
    })?;
    // The 4-GPU node is worker 2; the actor runs there.
    let victim = actor.node_id.clone();
    let w = &mut c.workers[2];
    let kill_ms = rlhf_core::unix_ms();
    w.signal(Signal::SIGKILL);
    let killed = Instant::now();
    w.wait_exit(Duration::from_secs(5))?;
    // Polled in-process (no binary started per poll). The deadline only catches a head that
    // never notices; the timing is checked on the head's own timestamps below.
    let deadline = Duration::from_millis(threshold_ms as u64 + 30_000);
    let s = wait_for(deadline, "node marked dead", || {
        let s = rt
            .block_on(h.cluster_status(pb::ClusterStatusRequest {}))?
            .into_inner();
        let s = rlhf_runtime::status::to_json(&s);
        let dead = s["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["node_id"] == victim.as_str() && n["state"] == "DEAD");
        Ok(dead.then_some(s))
    })?;
    let took = killed.elapsed();
    let dead = s["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node_id"] == victim.as_str())
        .unwrap();
    assert!(
        dead["death_reason"]
            .as_str()
            .unwrap()
            .contains("no heartbeat"),
        "{dead}"
    );
    // Ordering, not speed: dead only after a full threshold of silence, and not before the
    // kill (a live node declared dead would show here).
    let death_ms = dead["death_ms"].as_i64().unwrap();
    let silent_ms = death_ms - dead["last_heartbeat_ms"].as_i64().unwrap();
    assert!(
        silent_ms > threshold_ms,
        "dead after {silent_ms} ms without a heartbeat, threshold {threshold_ms} ms: {dead}"
    );
    assert!(
        death_ms >= kill_ms,
        "dead {} ms before the kill: {dead}",
        kill_ms - death_ms
    );
    println!(
        "node dead {} ms after the kill by the head's clock ({took:?} seen here), threshold \
         {threshold_ms} ms",
        death_ms - kill_ms
    );
    let a = s["actors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["actor_id"] == actor.actor_id.as_str())
        .unwrap();
    assert_eq!(a["state"], "DEAD");
    assert!(a["reason"].as_str().unwrap().contains("died"), "{a}");
    // The actor process did not outlive its worker.
    wait_for(Duration::from_secs(30), "actor process gone", || {
        Ok((!pid_alive(actor.pid)).then_some(()))
    })?;
    assert_eq!(count_alive(&s), 2, "{s}");
    Ok(())
}

#[test]
fn wrong_or_missing_token_is_rejected_and_logged() -> Result<()> {
    let c = Cluster::start(&[])?;
    let bad = c.dir.path().join("bad-token");
    std::fs::write(&bad, "not-the-token")?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(0o600))?;
    }
    let mut cmd = c.worker_cmd(r#"{"CPU": 1}"#);
    cmd.arg("--token-file")
        .arg(&bad)
        .args(["--connect-timeout", "3"]);
    let mut w = Proc::spawn("bad-worker", c.dir.path(), &mut cmd)?;
    let st = w.wait_exit(Duration::from_secs(20))?;
    assert!(!st.success());
    let out = w.output();
    assert!(out.contains("wrong cluster token"), "{out}");
    assert_eq!(c.alive_nodes()?, 0);
    let log = wait_for(Duration::from_secs(5), "rejection in head log", || {
        let l = c.head_log();
        Ok(l.contains("rejected RPC").then_some(l))
    })?;
    assert!(log.contains("peer=127.0.0.1:"), "{log}");

    let out = std::process::Command::new(rlhf_e2e::bin("rlhf-head"))
        .args(["status", "--address", &c.address(), "--token-file"])
        .arg(&bad)
        .output()?;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("wrong cluster token"));
    Ok(())
}

/// A new user's first cluster: a head and one worker offering two CPU slots (a laptop's
/// core count) cannot hold ppo_tiny's roles. The run says so at once, with the numbers and
/// the fix, instead of waiting out its ten-minute start timeout in silence.
#[test]
fn a_cluster_that_can_never_hold_the_job_says_so_at_once() -> Result<()> {
    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"CPU": 2}"#)?;
    c.wait_alive_nodes(1, Duration::from_secs(30))?;
    let job = c.dir.path().join("job");
    let mut cmd = c.ppo_run_cmd(&job, &["training.train_iters=1", "checkpoint.save_steps=0"]);
    let t0 = Instant::now();
    let mut p = Proc::spawn("too-small", c.dir.path(), &mut cmd)?;
    let st = p.wait_exit(Duration::from_secs(120))?;
    let out = p.output();
    assert!(!st.success(), "the job must fail: {out}");
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "failed only after {:?}: {out}",
        t0.elapsed()
    );
    assert!(
        out.contains("needs 4 CPU slots (actor_rollout 2, ref 1, critic 1)")
            && out.contains("has 2 in total")
            && out.contains(r#"--resources '{"CPU": 4}'"#)
            && out.contains("resource_pool.colocate=true"),
        "{out}"
    );
    // Nothing was placed.
    let s = c.status()?;
    assert_eq!(
        s["placement_groups"].as_array().map_or(0, |v| v.len()),
        0,
        "{s}"
    );
    Ok(())
}
