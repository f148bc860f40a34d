//! Control-plane bench: (1) no-op RPC round trip to a real actor process, over control
//! frames, direct HTTP/2 and tonic's channel, next to a raw TCP echo round trip on loopback
//! measured in the same run; (2) 10,000 simulated nodes
//! registering and heartbeating at 1 Hz (signed UDP beats, one idle stream per node, as
//! workers do) against one head process:
//! registration latency, head CPU use from /proc, and how fast a node that goes silent at
//! that scale is declared dead.
//!
//! Run: `cargo build --release --workspace --bins --examples`, then
//! `target/release/examples/cluster_bench [--nodes 10000 --seconds 10 --calls 2000] [--rpc-only]`
//! (one workspace build: the bench spawns the release `rlhf-head` and `rlhf-worker` built
//! beside it).

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rlhf_e2e::{raw_tcp_copy, Cluster};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::actor_service_client::ActorServiceClient;
use rlhf_proto::v1::head_service_client::HeadServiceClient;
use rlhf_runtime::net::{self, ClientOptions};

/// The head's dead-node threshold in this bench.
const DEAD_AFTER_MS: u64 = 5000;

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn sim_node(i: usize) -> pb::RegisterNodeRequest {
    pb::RegisterNodeRequest {
        protocol_version: rlhf_proto::PROTOCOL_VERSION,
        hostname: format!("sim-{i}"),
        address: format!("127.0.0.1:{}", 10_000 + i),
        resources: Some(pb::Resources {
            amounts: [("CPU".to_string(), 8.0)].into(),
        }),
        ..Default::default()
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// An echo server on a thread of its own: 8 bytes back for every 8 in, on one connection.
fn echo_server() -> Result<(
    std::net::SocketAddr,
    std::thread::JoinHandle<std::io::Result<()>>,
)> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let srv = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = l.accept()?;
        s.set_nodelay(true)?;
        let mut b = [0u8; 8];
        while s.read_exact(&mut b).is_ok() {
            s.write_all(&b)?;
        }
        Ok(())
    });
    Ok((addr, srv))
}

/// Raw loopback round trip: 8 bytes out, 8 bytes back, over one TCP connection, blocking.
fn raw_tcp_rtt(calls: usize) -> Result<Vec<f64>> {
    let (addr, srv) = echo_server()?;
    let mut c = std::net::TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let mut out = Vec::with_capacity(calls);
    let mut b = [0u8; 8];
    for i in 0..calls + 200 {
        let t = Instant::now();
        c.write_all(&b)?;
        c.read_exact(&mut b)?;
        if i >= 200 {
            out.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(c);
    let _ = srv.join();
    Ok(out)
}

/// The same echo, the client on a task of `rt` (what the async runtime's wakeups add).
fn tokio_tcp_rtt(rt: &tokio::runtime::Runtime, calls: usize) -> Result<Vec<f64>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (addr, srv) = echo_server()?;
    let out = rt.block_on(async move {
        tokio::spawn(async move {
            let mut c = tokio::net::TcpStream::connect(addr).await?;
            c.set_nodelay(true)?;
            let mut out = Vec::with_capacity(calls);
            let mut b = [0u8; 8];
            for i in 0..calls + 200 {
                let t = Instant::now();
                c.write_all(&b).await?;
                c.read_exact(&mut b).await?;
                if i >= 200 {
                    out.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            anyhow::Ok(out)
        })
        .await?
    })?;
    let _ = srv.join();
    Ok(out)
}

fn proc_cpu_seconds(pid: i32) -> Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = s.rsplit(')').next().context("stat format")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields after the command: state is index 0, utime 11, stime 12 (in clock ticks).
    let ticks = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / hz)
}

fn main() -> Result<()> {
    rlhf_runtime::raise_fd_limit();
    let calls = arg("--calls", 2000) as usize;
    let nodes = arg("--nodes", 10_000) as usize;
    let rpc_only = std::env::args().any(|a| a == "--rpc-only");
    let seconds = arg("--seconds", 10);

    let dead_after = DEAD_AFTER_MS.to_string();
    let mut c = Cluster::start(&["--dead-after-ms", &dead_after])?;
    c.add_worker(r#"{"CPU": 1}"#)?;
    c.wait_alive_nodes(1, Duration::from_secs(30))?;
    let rt = tokio::runtime::Runtime::new()?;
    let token = c.token()?;

    // 1. Actor round trip, from a multi-thread runtime (as the driver calls) and from a
    // current-thread one (no cross-thread wakeups on the client side), same actor.
    let actor_addr = rt.block_on(async {
        let o = ClientOptions::new(token.clone());
        let mut h = HeadServiceClient::new(net::connect(&c.address(), &o).await?);
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
            .context("no actor")?;
        anyhow::Ok(a.address)
    })?;
    // Through the control frames the driver uses for unary calls to role processes, through
    // the direct HTTP/2 connection it used before them, and through tonic's buffered,
    // reconnecting channel (what clients of the head use).
    #[derive(Clone, Copy, PartialEq)]
    enum Path {
        Frames,
        Http2Direct,
        Http2Channel,
    }
    let pings = |rt: &tokio::runtime::Runtime, path: Path| {
        let (token, actor_addr) = (token.clone(), actor_addr.clone());
        // On a task of the runtime, as the driver's loop runs.
        let run = async move {
            let mut o = ClientOptions::new(token.clone());
            o.control_frames = path == Path::Frames;
            let ch = match path {
                Path::Http2Channel => net::connect(&actor_addr, &o).await?,
                _ => {
                    let t = net::direct_transport(&actor_addr, &o).await?;
                    anyhow::ensure!(
                        t.frames().is_some() == (path == Path::Frames),
                        "control frames {} to {actor_addr}",
                        if path == Path::Frames {
                            "refused"
                        } else {
                            "used"
                        }
                    );
                    net::with_token(t, &token)?
                }
            };
            let mut client = ActorServiceClient::new(ch);
            let mut out = Vec::with_capacity(calls);
            for i in 0..calls + 200 {
                let t = Instant::now();
                client.ping(pb::PingRequest::default()).await?;
                if i >= 200 {
                    out.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            anyhow::Ok(out)
        };
        rt.block_on(async move { tokio::spawn(run).await? })
    };
    let current = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Alternating, three times each, so drift in the machine's load hits all alike.
    let (mut frames, mut direct, mut chan, mut frames_ct, mut direct_ct, mut raw, mut raw_rt) =
        (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..3 {
        frames.extend(pings(&rt, Path::Frames)?);
        direct.extend(pings(&rt, Path::Http2Direct)?);
        chan.extend(pings(&rt, Path::Http2Channel)?);
        frames_ct.extend(pings(&current, Path::Frames)?);
        direct_ct.extend(pings(&current, Path::Http2Direct)?);
        raw.extend(raw_tcp_rtt(calls)?);
        raw_rt.extend(tokio_tcp_rtt(&rt, calls)?);
    }
    drop(current);
    for v in [
        &mut frames,
        &mut direct,
        &mut chan,
        &mut frames_ct,
        &mut direct_ct,
        &mut raw,
        &mut raw_rt,
    ] {
        v.sort_by(f64::total_cmp);
    }
    println!(
        "actor no-op RPC round trip over {} calls each to {actor_addr}:",
        3 * calls
    );
    for (name, v) in [
        (
            "control frames, multi-thread client (the driver's)",
            &frames,
        ),
        ("direct HTTP/2 connection, multi-thread client", &direct),
        ("tonic channel (HTTP/2), multi-thread client", &chan),
        ("control frames, current-thread client", &frames_ct),
        (
            "direct HTTP/2 connection, current-thread client",
            &direct_ct,
        ),
        ("raw tcp echo (baseline, same run)", &raw),
        (
            "raw tcp echo, client on a multi-thread runtime task",
            &raw_rt,
        ),
    ] {
        println!(
            "  {name:55} median {:6.1} us, p99 {:6.1} us",
            percentile(v, 0.5),
            percentile(v, 0.99)
        );
    }
    let m = percentile(&frames, 0.5);
    let rm = percentile(&raw, 0.5);
    // The goal was set as 100 us against a 59 us raw echo on this kind of VM: also shown as
    // that ratio, since the VM's own echo drifts between runs.
    println!(
        "  ratio median frames/direct HTTP/2 {:.2}x, frames/raw echo {:.2}x (goal's ratio {:.2}x: {}); goal median <= 100 us: {}",
        m / percentile(&direct, 0.5),
        m / rm,
        100.0 / 59.0,
        if m / rm <= 100.0 / 59.0 { "met" } else { "NOT met" },
        if m <= 100.0 { "met" } else { "NOT met" }
    );
    if rpc_only {
        return Ok(());
    }
    // 2. Experience batches streamed to the actor process vs a raw TCP copy of the same
    // bytes, alternating, 3 runs each, medians (tests/e2e/examples/transfer_bench.rs has
    // the detailed version: CPU per side, chunk sizes).
    let o = ClientOptions::new(token.clone());
    let mut batch_client = rt.block_on(async {
        anyhow::Ok(ActorServiceClient::new(
            net::connect(&actor_addr, &o).await?,
        ))
    })?;
    for mib in [64usize, 256] {
        let floats = mib * (1 << 20) / 4;
        let rows = 256;
        let data: Vec<f32> = (0..floats).map(|i| (i % 1009) as f32).collect();
        let batch = rlhf_core::DataBatch::new().with_tensor(
            "values",
            rlhf_core::TensorData::from_f32(vec![rows, floats / rows], &data)?,
        );
        drop(data);
        let sum = rlhf_core::batch::checksum(&batch);
        let (mut raw, mut grpc) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            raw.push(raw_tcp_copy(&vec![7u8; mib << 20])?);
            grpc.push(rt.block_on(async {
                let t = Instant::now();
                let r = batch_client
                    .put_batch(rlhf_runtime::batch_stream(&batch)?)
                    .await?
                    .into_inner();
                let s = t.elapsed().as_secs_f64();
                anyhow::ensure!(r.checksum == sum, "checksum mismatch");
                anyhow::Ok(s)
            })?);
        }
        raw.sort_by(f64::total_cmp);
        grpc.sort_by(f64::total_cmp);
        let (raw_s, grpc_s) = (raw[1], grpc[1]);
        let gbps = |s: f64| (mib as f64 / 1024.0) / s;
        println!(
            "batch {mib} MiB to actor: {:.2} GB/s (encode + stream + decode); raw TCP copy {:.2} GB/s; ratio {:.2} (medians of 3; goal >= 0.5)",
            gbps(grpc_s),
            gbps(raw_s),
            raw_s / grpc_s
        );
    }

    // 3. Simulated nodes.
    let head_pid = c.head.as_ref().context("head")?.pid();
    let (reg, cpu, beats, detected, idle, alive_after, one) = rt.block_on(async {
        // As workers connect to the head (rlhf_runtime::worker).
        let o = ClientOptions {
            keepalive: Duration::from_secs(60),
            ..ClientOptions::new(token.clone())
        };
        let mut tasks = Vec::with_capacity(nodes);
        let start_all = Instant::now();
        let (head_cpu0, own_cpu0) = (
            proc_cpu_seconds(head_pid)?,
            proc_cpu_seconds(std::process::id() as i32)?,
        );
        // Nodes join 50 at a time, as a cluster coming up does, not in one SYN flood.
        let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(50));
        for i in 0..nodes {
            let o = o.clone();
            let addr = c.address();
            let gate = gate.clone();
            tasks.push(tokio::spawn(async move {
                let _permit = gate.acquire().await?;
                let mut h = HeadServiceClient::new(net::connect(&addr, &o).await?);
                let t = Instant::now();
                let r = h.register_node(sim_node(i)).await?.into_inner();
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let port = r.heartbeat_udp_port as u16;
                let key = rlhf_runtime::beat::hmac_key(&r.heartbeat_key);
                anyhow::Ok(((h, r.node_id, port, key), ms))
            }));
        }
        let mut clients = Vec::with_capacity(nodes);
        let mut reg = Vec::with_capacity(nodes);
        for t in tasks {
            let (client, ms) = t.await??;
            clients.push(client);
            reg.push(ms);
        }
        let reg_all = start_all.elapsed();
        // Where the storm's CPU went: the head, and the simulated nodes' clients (this
        // process), which share the machine's cores with it.
        let head_cpu = proc_cpu_seconds(head_pid)? - head_cpu0;
        let own_cpu = proc_cpu_seconds(std::process::id() as i32)? - own_cpu0;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        println!(
            "\n{nodes} simulated nodes registered in {:.2}s ({:.0} per second); CPU in that time: head {head_cpu:.2} s, the nodes' clients {own_cpu:.2} s, of {:.2} core-seconds on {cores} cores",
            reg_all.as_secs_f64(),
            nodes as f64 / reg_all.as_secs_f64(),
            reg_all.as_secs_f64() * cores as f64
        );
        // After the beats, the streams stay open for a moment with no beats (less than the
        // threshold): the cost of 10,000 idle connections alone.
        let close = tokio_util::sync::CancellationToken::new();
        // Node 0 goes silent after `seconds` (its stream stays open, nothing more is sent);
        // the rest keep beating until the head has declared it dead.
        let stop = tokio_util::sync::CancellationToken::new();
        let (silent_tx, silent_rx) = tokio::sync::oneshot::channel::<Instant>();
        let mut silent_tx = Some(silent_tx);
        // Streams are opened first; the CPU window starts once all are open and beating.
        let opened = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
        let go_silent = tokio_util::sync::CancellationToken::new();
        let silent_id = clients
            .first()
            .map(|(_, id, _, _)| id.clone())
            .context("no nodes")?;
        // One socket sends every simulated node's datagrams (the head does not care where
        // they come from; 10,000 sockets would exhaust the descriptors here).
        let udp = std::sync::Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await?);
        let head_port: u16 = c.address().rsplit_once(':').context("address")?.1.parse()?;
        let mut beat_tasks = Vec::new();
        for (i, (mut h, id, port, key)) in clients.into_iter().enumerate() {
            anyhow::ensure!(port == head_port, "the head offers no UDP heartbeats");
            let (stop, udp) = (stop.clone(), udp.clone());
            let (close, opened, go_silent) = (close.clone(), opened.clone(), go_silent.clone());
            let went_silent = if i == 0 { silent_tx.take() } else { None };
            beat_tasks.push(tokio::spawn(async move {
                let (tx, rx) = tokio::sync::mpsc::channel(4);
                tx.send(pb::HeartbeatRequest {
                    protocol_version: rlhf_proto::PROTOCOL_VERSION,
                    node_id: id.clone(),
                })
                .await?;
                let mut answers = h
                    .heartbeat_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
                    .await?
                    .into_inner();
                let first = answers.message().await?.context("no first answer")?;
                anyhow::ensure!(first.known, "head forgot node {id}");
                // Spread the nodes over the second, as real nodes would be.
                opened.add_permits(1);
                tokio::time::sleep(Duration::from_micros((i as u64 * 997) % 1_000_000)).await;
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                tick.tick().await;
                let (mut n, mut last) = (0u64, Instant::now());
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tick.tick() => {}
                    }
                    if went_silent.is_some() && go_silent.is_cancelled() {
                        break;
                    }
                    let d = rlhf_runtime::beat::encode(&id, n + 1, &key)?;
                    udp.send_to(&d, ("127.0.0.1", port)).await?;
                    (n, last) = (n + 1, Instant::now());
                }
                if let Some(s) = went_silent {
                    let _ = s.send(last);
                }
                close.cancelled().await;
                drop(answers);
                anyhow::Ok(n)
            }));
        }
        let _all = opened.acquire_many(nodes as u32).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let cpu0 = proc_cpu_seconds(head_pid)?;
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        let cpu = (proc_cpu_seconds(head_pid)? - cpu0) / t0.elapsed().as_secs_f64();
        go_silent.cancel();
        let silent_at = silent_rx.await?;
        // Poll the head until it declares node 0 dead.
        let mut h = HeadServiceClient::new(net::connect(&c.address(), &o).await?);
        let detected = loop {
            let s = h
                .cluster_status(pb::ClusterStatusRequest::default())
                .await?
                .into_inner();
            let n = s
                .nodes
                .iter()
                .find(|n| n.node_id == silent_id)
                .context("silent node gone from the status")?;
            if n.state == pb::NodeState::Dead as i32 {
                break silent_at.elapsed().as_secs_f64();
            }
            anyhow::ensure!(
                silent_at.elapsed() < Duration::from_secs(60),
                "the silent node was not declared dead in 60 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let alive_after = {
            let s = h
                .cluster_status(pb::ClusterStatusRequest::default())
                .await?
                .into_inner();
            s.nodes
                .iter()
                .filter(|n| n.state == pb::NodeState::Alive as i32)
                .count()
        };
        stop.cancel();
        let idle_s = 2.0;
        let cpu_idle0 = proc_cpu_seconds(head_pid)?;
        tokio::time::sleep(Duration::from_secs_f64(idle_s)).await;
        let idle = (proc_cpu_seconds(head_pid)? - cpu_idle0) / idle_s;
        close.cancel();
        let mut beats = 0;
        for t in beat_tasks {
            beats += t.await??;
        }
        // Nodes joining one at a time a head that holds 10,000.
        let mut one = Vec::with_capacity(200);
        for i in nodes..nodes + 200 {
            let mut h = HeadServiceClient::new(net::connect(&c.address(), &o).await?);
            let t = Instant::now();
            h.register_node(sim_node(i)).await?;
            one.push(t.elapsed().as_secs_f64() * 1e3);
        }
        one.sort_by(f64::total_cmp);
        anyhow::Ok((reg, cpu, beats, detected, idle, alive_after, one))
    })?;
    let mut reg = reg;
    reg.sort_by(f64::total_cmp);
    let p99 = percentile(&reg, 0.99);
    println!(
        "  registration latency, 50 nodes joining at once: median {:.2} ms, p99 {p99:.2} ms; goal p99 <= 10 ms: {}",
        percentile(&reg, 0.5),
        if p99 <= 10.0 { "met" } else { "NOT met" }
    );
    let one99 = percentile(&one, 0.99);
    println!(
        "  registration latency, one node at a time into {nodes}: median {:.2} ms, p99 {one99:.2} ms; goal p99 <= 10 ms: {}",
        percentile(&one, 0.5),
        if one99 <= 10.0 { "met" } else { "NOT met" }
    );
    println!(
        "  heartbeats (UDP, one idle stream per node): {beats} at 1 Hz per node; head CPU {:.2}% of one core over {seconds} s once every stream is open; goal <= 5%: {}",
        cpu * 100.0,
        if cpu <= 0.05 { "met" } else { "NOT met" }
    );
    println!(
        "  the {nodes} open streams alone (no beats, 2 s right after them): {:.2}% of one core",
        idle * 100.0
    );
    let threshold = DEAD_AFTER_MS as f64 / 1000.0;
    println!(
        "  a silent node declared dead {detected:.2} s after its last beat (threshold {threshold:.1} s); goal <= threshold + 1 s: {}",
        if detected <= threshold + 1.0 { "met" } else { "NOT met" }
    );
    let alive = c.alive_nodes()?;
    println!(
        "  alive nodes right after the beats: {alive_after} of {} (all but the silent one)",
        nodes + 1
    );
    println!("  alive nodes at the end: {alive}");
    Ok(())
}
