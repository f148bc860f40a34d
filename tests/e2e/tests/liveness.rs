//! Node liveness over real processes: heartbeats over UDP (the default) and over the gRPC
//! stream, a stalled node marked dead and told to register again.

use std::time::Duration;

use anyhow::Result;
use nix::sys::signal::Signal;
use rlhf_e2e::{wait_for, Cluster};

/// A worker that stalls (SIGSTOP: its heartbeat stream stays open, nothing more comes) is
/// marked dead after the threshold; once it runs again the head tells it over that stream to
/// register again, and it comes back ALIVE under the same node id. Beats over UDP (the
/// default) and on the stream (`--no-udp-heartbeats`).
#[test]
fn a_stalled_worker_is_marked_dead_then_told_to_register_again() -> Result<()> {
    for udp in [true, false] {
        // 15 beats per threshold: a loaded 2-core machine does not miss that many by chance.
        let mut head = vec!["--dead-after-ms", "3000", "--heartbeat-ms", "200"];
        if !udp {
            head.push("--no-udp-heartbeats");
        }
        let mut c = Cluster::start(&head)?;
        c.add_worker(r#"{"CPU": 2}"#)?;
        let s = c.wait_alive_nodes(1, Duration::from_secs(30))?;
        let id = s["nodes"][0]["node_id"].as_str().unwrap().to_string();
        let state = |s: &serde_json::Value| {
            s["nodes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|n| n["node_id"] == id.as_str())
                .map(|n| n["state"].as_str().unwrap_or("").to_string())
        };
        // Alive on its beats for two thresholds first.
        std::thread::sleep(Duration::from_secs(6));
        assert_eq!(state(&c.status()?).as_deref(), Some("ALIVE"), "udp {udp}");
        c.workers[0].signal(Signal::SIGSTOP);
        wait_for(Duration::from_secs(30), "stalled node marked dead", || {
            let s = c.status()?;
            Ok((state(&s).as_deref() == Some("DEAD")).then_some(()))
        })?;
        c.workers[0].signal(Signal::SIGCONT);
        wait_for(Duration::from_secs(30), "node alive again", || {
            let s = c.status()?;
            Ok((state(&s).as_deref() == Some("ALIVE")).then_some(()))
        })?;
        // Told by the head, not by a broken connection; UDP beats got through when offered.
        let out = c.workers[0].output();
        assert!(
            out.contains("the head does not know this node")
                && !out.contains("stream broke")
                && !out.contains("do not reach the head"),
            "udp {udp}: {out}"
        );
    }
    Ok(())
}
