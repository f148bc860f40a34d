//! The cluster's life cycle over real processes on loopback: a head restarted on its state,
//! a port in use, stop and signals that leave no orphans, private state directories and a
//! planted token (split out of cluster.rs, which keeps placement, actors, failures and auth).

use std::time::{Duration, Instant};

use anyhow::Result;
use nix::sys::signal::Signal;
use rlhf_e2e::{pid_alive, wait_for, Cluster};
use rlhf_proto::v1 as pb;

#[path = "cluster/common.rs"]
mod common;
use common::*;

#[test]
fn restarted_head_gets_its_state_back_and_workers_reregister() -> Result<()> {
    // The threshold leaves the workers time to register again: while the head was down their
    // retry delay doubled, and a node not back within it would be declared dead (with its
    // actor) by the restarted head.
    let mut c = Cluster::start(&["--dead-after-ms", "10000", "--heartbeat-ms", "200"])?;
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

/// A worker that dies while the head is down: the restarted head lists its node REJOINING,
/// not ALIVE, and places nothing on it (a placement that needs it fails naming it), while
/// the worker that comes back is ALIVE and placed on at once; when the dead threshold passes
/// the lost node is DEAD, saying it did not register again.
#[test]
fn a_worker_lost_while_the_head_was_down_is_not_placed_on() -> Result<()> {
    let mut c = Cluster::start(&["--dead-after-ms", "20000", "--heartbeat-ms", "200"])?;
    c.add_worker(r#"{"GPU": 1}"#)?;
    c.add_worker(r#"{"GPU": 1}"#)?;
    let before = c.wait_alive_nodes(2, Duration::from_secs(30))?;
    // Registrations reach the head's disk with its next group commit; a durable write
    // queued after them is answered once they are on disk too.
    rt().block_on(async {
        head_client(&c)
            .await?
            .kv_put(pb::KvPutRequest {
                key: "flush".into(),
                value: b"1".to_vec(),
                overwrite: true,
            })
            .await?;
        anyhow::Ok(())
    })?;
    let lost_log = c.workers[1].output();
    let head = c.head.as_mut().unwrap();
    head.signal(Signal::SIGKILL);
    head.wait_exit(Duration::from_secs(5))?;
    c.workers[1].signal(Signal::SIGKILL);
    c.workers[1].wait_exit(Duration::from_secs(5))?;
    c.start_head()?;
    let after = c.wait_alive_nodes(1, Duration::from_secs(15))?;
    let state = |s: &serde_json::Value, state: &str| -> Vec<String> {
        s["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["state"] == state)
            .map(|n| n["node_id"].as_str().unwrap().to_string())
            .collect()
    };
    let rejoining = state(&after, "REJOINING");
    assert_eq!(
        rejoining.len(),
        1,
        "{after}\n(the lost worker's log: {lost_log})"
    );
    let lost = &rejoining[0];
    assert_eq!(state(&before, "ALIVE").len(), 2);
    assert!(state(&before, "ALIVE").contains(lost));
    rt().block_on(async {
        let mut h = head_client(&c).await?;
        let e = h
            .create_placement_group(pg_req(
                "both",
                pb::PlacementStrategy::StrictSpread,
                2,
                1.0,
                0,
            ))
            .await
            .unwrap_err();
        assert!(
            e.message().contains(lost.as_str()) && e.message().contains("register again"),
            "{e}"
        );
        // The node that came back is placed on.
        h.create_placement_group(pg_req("one", pb::PlacementStrategy::Pack, 1, 1.0, 0))
            .await?;
        anyhow::Ok(())
    })?;
    let t = Instant::now();
    let s = wait_for(Duration::from_secs(60), "the lost node marked dead", || {
        let s = c.status()?;
        Ok(state(&s, "DEAD").contains(lost).then_some(s))
    })?;
    let node = s["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node_id"] == lost.as_str())
        .unwrap();
    assert!(
        node["death_reason"]
            .as_str()
            .unwrap()
            .contains("did not register again"),
        "{node}"
    );
    println!(
        "marked dead {:.1} s after the check",
        t.elapsed().as_secs_f64()
    );
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

/// A head told to stop (SIGTERM) while workers beat over their gRPC streams (no UDP, as
/// where datagrams are blocked) exits within seconds: it ends those streams itself. It used
/// to wait for them forever, and only SIGKILL ended it. The workers stay up and find the
/// head gone.
#[test]
fn a_signalled_head_exits_while_workers_stream_heartbeats() -> Result<()> {
    let mut c = Cluster::start(&["--no-udp-heartbeats"])?;
    c.add_worker(r#"{"CPU": 1}"#)?;
    c.add_worker(r#"{"CPU": 1}"#)?;
    c.wait_alive_nodes(2, Duration::from_secs(30))?;
    // A few beats on the streams first.
    std::thread::sleep(Duration::from_secs(2));
    let head = c.head.as_mut().unwrap();
    head.signal(Signal::SIGTERM);
    let st = head.wait_exit(Duration::from_secs(20))?;
    assert!(st.success(), "{st}: {}", head.output());
    assert!(c
        .workers
        .iter_mut()
        .all(|w| w.child.try_wait().ok().flatten().is_none()));
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
        let mut cmd = std::process::Command::new(rlhf_e2e::bin("rlhf-head"));
        cmd.args([
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-dashboard",
        ])
        .arg("--state-dir")
        .arg(state)
        .env_remove("RLHF_TOKEN");
        cmd
    };
    let out = head(&state).output()?;
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
    let mut child = head(&fresh).stderr(std::process::Stdio::null()).spawn()?;
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
