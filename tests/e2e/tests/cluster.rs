//! The cluster foundation over real processes on loopback: a head, workers with different
//! resources, placement, actors, failures, auth, restart and clean shutdown.

use std::time::{Duration, Instant};

use anyhow::Result;
use nix::sys::signal::Signal;
use rlhf_e2e::{count_alive, pid_alive, wait_for, Cluster, Proc};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::actor_service_client::ActorServiceClient;
use rlhf_proto::v1::head_service_client::HeadServiceClient;
use rlhf_runtime::net::{self, AuthChannel, ClientOptions};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Runtime::new().expect("runtime")
}

async fn head_client(c: &Cluster) -> Result<HeadServiceClient<AuthChannel>> {
    let mut o = ClientOptions::new(c.token()?);
    o.connect_timeout = Duration::from_secs(10);
    Ok(HeadServiceClient::new(
        net::connect(&c.address(), &o).await?,
    ))
}

async fn actor_client(c: &Cluster, addr: &str) -> Result<ActorServiceClient<AuthChannel>> {
    let mut o = ClientOptions::new(c.token()?);
    o.connect_timeout = Duration::from_secs(5);
    Ok(ActorServiceClient::new(net::connect(addr, &o).await?))
}

fn gpu_bundles(n: usize, gpus: f64) -> Vec<pb::Bundle> {
    (0..n)
        .map(|_| pb::Bundle {
            resources: Some(pb::Resources {
                amounts: [("GPU".to_string(), gpus)].into(),
            }),
        })
        .collect()
}

fn pg_req(
    name: &str,
    strategy: pb::PlacementStrategy,
    n: usize,
    gpus: f64,
    timeout_ms: u64,
) -> pb::CreatePlacementGroupRequest {
    pb::CreatePlacementGroupRequest {
        name: name.into(),
        strategy: strategy as i32,
        bundles: gpu_bundles(n, gpus),
        timeout_ms,
        cuda_roles: false,
    }
}

fn test_actor(pg_id: &str, bundle: i32) -> pb::CreateActorRequest {
    pb::CreateActorRequest {
        spec: Some(pb::ActorSpec {
            name: "echo".into(),
            role: "test".into(),
            kind: "test".into(),
            pg_id: pg_id.into(),
            bundle_index: bundle,
            ..Default::default()
        }),
        timeout_ms: 20_000,
    }
}

fn three_node_cluster(extra_head: &[&str]) -> Result<Cluster> {
    let mut c = Cluster::start(extra_head)?;
    c.add_worker(r#"{"GPU": 1, "CPU": 2}"#)?;
    c.add_worker(r#"{"GPU": 2, "CPU": 4, "special": 1}"#)?;
    c.add_worker(r#"{"GPU": 4, "CPU": 8}"#)?;
    c.wait_alive_nodes(3, Duration::from_secs(30))?;
    Ok(c)
}

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

#[test]
fn restarted_head_gets_its_state_back_and_workers_reregister() -> Result<()> {
    let mut c = Cluster::start(&["--dead-after-ms", "2000", "--heartbeat-ms", "200"])?;
    c.add_worker(r#"{"GPU": 2}"#)?;
    c.add_worker(r#"{"GPU": 2}"#)?;
    c.wait_alive_nodes(2, Duration::from_secs(30))?;
    let (pg, actor) = rt().block_on(async {
        let mut h = head_client(&c).await?;
        let pg = h
            .create_placement_group(pg_req("keep", pb::PlacementStrategy::Spread, 2, 1.0, 0))
            .await?
            .into_inner()
            .placement_group
            .unwrap();
        let a = h
            .create_actor(test_actor(&pg.pg_id, 0))
            .await?
            .into_inner()
            .actor
            .unwrap();
        h.kv_put(pb::KvPutRequest {
            key: "rendezvous".into(),
            value: b"id-123".to_vec(),
            overwrite: true,
        })
        .await?;
        anyhow::Ok((pg, a))
    })?;
    let before = c.status()?;

    let head = c.head.as_mut().unwrap();
    head.signal(Signal::SIGKILL);
    head.wait_exit(Duration::from_secs(5))?;
    std::thread::sleep(Duration::from_millis(500));
    c.start_head()?;

    let after = c.wait_alive_nodes(2, Duration::from_secs(20))?;
    let ids = |s: &serde_json::Value| {
        let mut v: Vec<String> = s["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["node_id"].as_str().unwrap().to_string())
            .collect();
        v.sort();
        v
    };
    assert_eq!(ids(&before), ids(&after));
    let p = after["placement_groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pg_id"] == pg.pg_id.as_str())
        .unwrap();
    assert_eq!(p["state"], "CREATED");
    let a = after["actors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["actor_id"] == actor.actor_id.as_str())
        .unwrap();
    assert_eq!(a["state"], "ALIVE", "{a}");
    assert_eq!(after["resources"]["used"]["GPU"], 2.0);
    rt().block_on(async {
        let mut actor_c = actor_client(&c, &actor.address).await?;
        let r = actor_c
            .ping(pb::PingRequest {
                payload: b"still here".to_vec(),
            })
            .await?
            .into_inner();
        assert_eq!(r.payload, b"still here");
        let mut h = head_client(&c).await?;
        let v = h
            .kv_wait(pb::KvWaitRequest {
                key: "rendezvous".into(),
                timeout_ms: 1000,
            })
            .await?
            .into_inner();
        assert_eq!(v.value, b"id-123");
        let e = h
            .kv_wait(pb::KvWaitRequest {
                key: "never".into(),
                timeout_ms: 200,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded);
        anyhow::Ok(())
    })?;
    Ok(())
}

#[test]
fn port_in_use_is_a_clear_error() -> Result<()> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = l.local_addr()?.port();
    let dir = tempfile::tempdir()?;
    let out = std::process::Command::new(rlhf_e2e::bin("rlhf-head"))
        .args([
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--no-dashboard",
            "--state-dir",
        ])
        .arg(dir.path())
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("port {port} is already in use")) && err.contains("--port 0"),
        "{err}"
    );

    // Malformed --resources points at the flag; nothing is started.
    let out = std::process::Command::new(rlhf_e2e::bin("rlhf-worker"))
        .args([
            "join",
            "--address",
            "127.0.0.1:1",
            "--resources",
            "{\"GPU\": 8,",
        ])
        .output()?;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--resources: malformed JSON at line 1"));

    // Unreachable head: fails after --connect-timeout naming the address.
    let t = Instant::now();
    let token = dir.path().join("t");
    std::fs::write(&token, "x")?;
    let out = std::process::Command::new(rlhf_e2e::bin("rlhf-worker"))
        .args([
            "join",
            "--address",
            &format!("127.0.0.1:{port}"),
            "--connect-timeout",
            "1",
            "--token-file",
        ])
        .arg(&token)
        .arg("--state-dir")
        .arg(dir.path())
        .output();
    drop(l);
    let out = out?;
    assert!(!out.status.success());
    assert!(t.elapsed() < Duration::from_secs(15));
    Ok(())
}

#[test]
fn stop_and_signals_leave_no_orphans() -> Result<()> {
    let mut c = three_node_cluster(&[])?;
    let pids = rt().block_on(async {
        let mut h = head_client(&c).await?;
        let mut pids = Vec::new();
        for _ in 0..3 {
            let a = h
                .create_actor(pb::CreateActorRequest {
                    spec: Some(pb::ActorSpec {
                        kind: "test".into(),
                        ..Default::default()
                    }),
                    timeout_ms: 20_000,
                })
                .await?
                .into_inner()
                .actor
                .unwrap();
            pids.push(a.pid);
        }
        anyhow::Ok(pids)
    })?;
    assert!(pids.iter().all(|p| pid_alive(*p)));

    // SIGTERM one worker: it stops its own actors and exits cleanly.
    c.workers[0].signal(Signal::SIGTERM);
    assert!(c.workers[0].wait_exit(Duration::from_secs(10))?.success());

    // `rlhf-head stop` takes everything else down.
    let out = std::process::Command::new(rlhf_e2e::bin("rlhf-head"))
        .args(["stop", "--address", &c.address(), "--token-file"])
        .arg(c.token_file())
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for w in c.workers.iter_mut().skip(1) {
        assert!(
            w.wait_exit(Duration::from_secs(15))?.success(),
            "{}",
            w.output()
        );
    }
    c.head
        .as_mut()
        .unwrap()
        .wait_exit(Duration::from_secs(10))?;
    wait_for(Duration::from_secs(5), "all actor processes gone", || {
        Ok(pids.iter().all(|p| !pid_alive(*p)).then_some(()))
    })?;
    Ok(())
}

/// A token planted in the state directory (world-writable, as a shared /tmp allows) is not
/// adopted: the head and the worker refuse to start and say how to fix it; the state
/// directory a head creates is private.
#[test]
fn a_planted_token_is_refused_and_state_dirs_are_private() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    std::fs::create_dir(&state)?;
    let token = state.join("token");
    std::fs::write(&token, "0123456789abcdef")?;
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o666))?;
    let head = |state: &std::path::Path| {
        std::process::Command::new(rlhf_e2e::bin("rlhf-head"))
            .args([
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-dashboard",
            ])
            .arg("--state-dir")
            .arg(state)
            .env_remove("RLHF_TOKEN")
            .output()
    };
    let out = head(&state)?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("mode 666") && err.contains(&format!("chmod 600 {}", token.display())),
        "{err}"
    );
    let out = std::process::Command::new(rlhf_e2e::bin("rlhf-worker"))
        .args(["join", "--address", "127.0.0.1:1", "--connect-timeout", "1"])
        .arg("--state-dir")
        .arg(&state)
        .env_remove("RLHF_TOKEN")
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("mode 666"), "{err}");

    // A fresh state directory is created 0700, whatever the umask.
    let fresh = dir.path().join("fresh/state");
    let mut child = std::process::Command::new(rlhf_e2e::bin("rlhf-head"))
        .args([
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-dashboard",
        ])
        .arg("--state-dir")
        .arg(&fresh)
        .env_remove("RLHF_TOKEN")
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let ok = rlhf_e2e::wait_for(Duration::from_secs(20), "head.json", || {
        Ok(fresh.join("head.json").exists().then_some(()))
    });
    let _ = child.kill();
    let _ = child.wait();
    ok?;
    let mode = std::fs::metadata(&fresh)?.permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
    Ok(())
}
