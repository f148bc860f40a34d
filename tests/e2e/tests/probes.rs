//! The attacker's view of a running job: while ppo_tiny trains on a head and a worker, every
//! TCP port that any process of the cluster listens on (the head, the worker agent, each
//! role process, the driver; found through /proc, not through what the cluster says about
//! itself) is probed with a raw socket that knows no token: a gRPC preface, an HTTP request,
//! a collective JOIN hello claiming rank 1 (and one announcing a 65,535-byte address), and
//! garbage. No probe gets more than a protocol greeting or refusal, and the job still
//! finishes every step.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rlhf_e2e::{Cluster, Proc};

/// Socket inodes of `pid`'s open file descriptors.
fn socket_inodes(pid: i32) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for e in rd.flatten() {
            if let Ok(target) = std::fs::read_link(e.path()) {
                let t = target.to_string_lossy();
                if let Some(n) = t.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                    if let Ok(n) = n.parse() {
                        out.insert(n);
                    }
                }
            }
        }
    }
    out
}

/// Local ports in LISTEN state whose socket inode is in `inodes`.
fn listening_ports(inodes: &BTreeSet<u64>) -> BTreeSet<u16> {
    let mut ports = BTreeSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[3] != "0A" {
                continue;
            }
            let inode: u64 = f[9].parse().unwrap_or(0);
            if !inodes.contains(&inode) {
                continue;
            }
            if let Some(port) = f[1]
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok())
            {
                ports.insert(port);
            }
        }
    }
    ports
}

/// Descendants of `pid` (the worker's role processes, the driver's nothing).
fn children(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let path = format!("/proc/{p}/task/{p}/children");
        if let Ok(s) = std::fs::read_to_string(path) {
            for c in s.split_whitespace().filter_map(|c| c.parse().ok()) {
                out.push(c);
                todo.push(c);
            }
        }
    }
    out
}

/// What a raw socket gets back from `port` for `payload` within a second.
fn probe(port: u16, payload: &[u8]) -> Vec<u8> {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return vec![];
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let _ = s.write_all(payload);
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 || got.len() > 1 << 20 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    got
}

fn join_hello_as_rank_1() -> Vec<u8> {
    let mut h = b"RLHFCOL\x02".to_vec();
    h.push(1);
    h.extend_from_slice(&1u32.to_le_bytes());
    h.extend_from_slice(&2u32.to_le_bytes());
    h.extend_from_slice(&0u16.to_le_bytes());
    h.push(0);
    h
}

#[test]
fn raw_sockets_get_nothing_of_value_and_the_job_finishes() -> Result<()> {
    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"CPU": 4}"#)?;
    c.wait_alive_nodes(1, Duration::from_secs(30))?;
    let out = c.dir.path().join("job");
    // Long enough that every probe lands while the job trains (checked below).
    let steps = 100;
    let mut run = rlhf_e2e::ppo_run_cmd(&out, &[&format!("training.train_iters={steps}")]);
    run.args(["--address", &c.address()])
        .arg("--token-file")
        .arg(c.token_file());
    let mut driver = Proc::spawn("run", c.dir.path(), &mut run)?;

    // Wait until the roles run (an actor ALIVE for every process), then probe.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut roles = Vec::new();
    while roles.len() < 5 {
        if Instant::now() > deadline {
            bail!("the roles never came up:\n{}", driver.output());
        }
        if let Ok(s) = c.status() {
            roles = s["actors"]
                .as_array()
                .context("actors")?
                .iter()
                .filter(|a| a["state"] == "ALIVE")
                .filter_map(|a| a["pid"].as_i64())
                .map(|p| p as i32)
                .collect();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut pids = vec![
        c.head.as_ref().context("head")?.pid(),
        c.workers[0].pid(),
        driver.pid(),
    ];
    pids.extend(children(c.workers[0].pid()));
    pids.extend(roles);
    let inodes: BTreeSet<u64> = pids.iter().flat_map(|&p| socket_inodes(p)).collect();
    let ports = listening_ports(&inodes);
    // The head, the worker agent and five role servers at least.
    assert!(ports.len() >= 7, "listening ports found: {ports:?}");

    let mut huge_address = join_hello_as_rank_1();
    huge_address.truncate(17);
    huge_address.extend_from_slice(&u16::MAX.to_le_bytes());
    let payloads: [(&str, Vec<u8>); 5] = [
        (
            "gRPC preface",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00".to_vec(),
        ),
        (
            "HTTP request",
            b"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".to_vec(),
        ),
        ("collective hello", join_hello_as_rank_1()),
        (
            "collective hello announcing a 65,535-byte address",
            huge_address,
        ),
        (
            "garbage",
            (0..4096u32).map(|i| (i * 7919 % 251) as u8).collect(),
        ),
    ];
    // Every probe at once: each may wait out its 1 s read timeout, and one after another
    // they could outlast the job, whose running is what makes them meaningful.
    let results: Vec<(u16, &str, Vec<u8>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = ports
            .iter()
            .flat_map(|&port| {
                payloads.iter().map(move |(what, payload)| {
                    scope.spawn(move || (port, *what, probe(port, payload)))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a probe thread panicked"))
            .collect()
    });
    for (port, what, got) in &results {
        // A protocol greeting (HTTP/2 SETTINGS), a refusal or nothing: no weights, no
        // batches, no status beyond the public shape.
        assert!(
            got.len() < 1024,
            "port {port}, {what}: {} bytes came back: {:?}",
            got.len(),
            String::from_utf8_lossy(&got[..got.len().min(200)])
        );
        let text = String::from_utf8_lossy(got);
        assert!(
            !text.contains("\"actors\":[") && !text.contains("log_tail"),
            "port {port}, {what}: {text}"
        );
    }

    assert!(
        driver.child.try_wait()?.is_none(),
        "the job ended before the probes did; they proved nothing"
    );
    let st = driver.wait_exit(Duration::from_secs(900))?;
    assert!(
        st.success(),
        "the job failed after the probes:\n{}",
        driver.output()
    );
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    assert_eq!(metrics.lines().count(), steps, "every step ran");
    Ok(())
}
