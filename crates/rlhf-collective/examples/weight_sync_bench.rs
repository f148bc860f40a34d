//! Trainer → rollout weight sync between two real processes, each path next to its own
//! baseline measured in the same run on the same bytes:
//!
//! - same process (colocated): nothing is copied; shown for completeness;
//! - shared memory ([`ShmCommunicator`]) vs a raw `memcpy` of the same bytes in this process
//!   (goal: ≥ 0.5 of its bandwidth);
//! - TCP ([`TcpCommunicator`]) vs a raw loopback copy between the same two processes, with
//!   the communicator's socket settings and the connection made before timing (goal ≥ 0.9).
//!
//! This process is the trainer (rank 0); it starts itself again as the rollout (rank 1).
//! A sync is `BucketedSync` of `--params` f32 tensors totalling the size, ended by a
//! barrier so the time covers the receiver's last byte. Each round runs every path once,
//! back to back; the ratio is the median over rounds of `baseline time / path time`
//! (the first round is a warm-up).
//!
//! `cargo run --release -p rlhf-collective --example weight_sync_bench [-- --sizes-mib 64,512 --iters 5 --params 100 --slot-kib 8192]`

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use rlhf_collective::tcp::tune_stream;
use rlhf_collective::{
    BucketedSync, CommConfig, CommSecret, Communicator, Param, ParamMut, ShmCommunicator,
    ShmRendezvous, TcpCommunicator, TcpRendezvous,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const CHILD: &str = "RLHF_WEIGHT_SYNC_BENCH_CHILD";

struct Opts {
    sizes_mib: Vec<usize>,
    iters: usize,
    params: usize,
    slot_bytes: usize,
}

fn parse(args: &[String]) -> Result<Opts, BoxError> {
    let mut o = Opts {
        sizes_mib: vec![64, 512],
        iters: 5,
        params: 100,
        slot_bytes: rlhf_collective::shm::DEFAULT_SLOT_BYTES,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--sizes-mib" => {
                o.sizes_mib = val()?
                    .split(',')
                    .map(|s| s.trim().parse())
                    .collect::<Result<_, _>>()?
            }
            "--iters" => o.iters = val()?.parse()?,
            "--params" => o.params = val()?.parse()?,
            "--slot-kib" => o.slot_bytes = val()?.parse::<usize>()? << 10,
            other => return Err(format!("unknown option {other}; see the file header").into()),
        }
    }
    if o.iters == 0 || o.params == 0 || o.sizes_mib.contains(&0) {
        return Err("--iters, --params and every size must be ≥ 1".into());
    }
    Ok(o)
}

fn config() -> Result<CommConfig, BoxError> {
    let mut c = CommConfig::with_timeout(Duration::from_secs(120));
    // The same secret on both sides (this is a benchmark, not a job: no driver hands one out).
    c.secret = Some(CommSecret::from_bytes(&[42; 32])?);
    Ok(c)
}

/// Element counts of `params` tensors totalling `bytes` (f32).
fn split(bytes: usize, params: usize) -> Vec<usize> {
    let elems = bytes / 4;
    (0..params)
        .map(|i| elems / params + usize::from(i < elems % params))
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// One sync on either side, ended by a barrier; returns the wall time.
fn sync_once(comm: &mut dyn Communicator, weights: &mut [Vec<f32>]) -> Result<f64, BoxError> {
    let sync = BucketedSync::default();
    let t = Instant::now();
    if comm.rank() == 0 {
        let p: Vec<Param<'_>> = weights
            .iter()
            .enumerate()
            .map(|(i, w)| Param::f32(format!("w{i}"), &[w.len()], w))
            .collect::<Result<_, _>>()?;
        sync.send(comm, &p)?;
    } else {
        let mut p: Vec<ParamMut<'_>> = weights
            .iter_mut()
            .enumerate()
            .map(|(i, w)| ParamMut::f32(format!("w{i}"), &[w.len()], w))
            .collect::<Result<_, _>>()?;
        sync.recv(comm, 0, &mut p)?;
    }
    comm.barrier()?;
    Ok(t.elapsed().as_secs_f64())
}

/// The raw loopback copy: the trainer writes `buf`, the rollout reads it and answers one byte.
fn raw_once(
    stream: &mut TcpStream,
    buf: &mut [u8],
    sender: bool,
    chunk: usize,
) -> Result<f64, BoxError> {
    let t = Instant::now();
    if sender {
        for c in buf.chunks(chunk) {
            stream.write_all(c)?;
        }
        stream.read_exact(&mut [0u8])?;
    } else {
        stream.read_exact(buf)?;
        stream.write_all(&[1])?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Both processes run the same rounds in the same order.
struct Links {
    shm: ShmCommunicator,
    tcp: TcpCommunicator,
    raw: TcpStream,
}

fn rounds(o: &Opts, links: &mut Links, rank: usize) -> Result<(), BoxError> {
    let cfg = config()?;
    for &mib in &o.sizes_mib {
        let bytes = mib << 20;
        let mut weights: Vec<Vec<f32>> = split(bytes, o.params)
            .into_iter()
            .enumerate()
            .map(|(i, n)| vec![if rank == 0 { i as f32 + 0.5 } else { 0.0 }; n])
            .collect();
        let mut raw_buf = vec![if rank == 0 { 7u8 } else { 0 }; bytes];
        let mut memcpy_dst = vec![0u8; if rank == 0 { bytes } else { 0 }];
        let (mut r_shm, mut r_tcp, mut rows) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..=o.iters {
            let memcpy = if rank == 0 {
                let t = Instant::now();
                memcpy_dst.copy_from_slice(&raw_buf);
                std::hint::black_box(&memcpy_dst);
                t.elapsed().as_secs_f64()
            } else {
                0.0
            };
            let shm = sync_once(&mut links.shm, &mut weights)?;
            let raw = raw_once(&mut links.raw, &mut raw_buf, rank == 0, cfg.chunk_bytes)?;
            let tcp = sync_once(&mut links.tcp, &mut weights)?;
            if rank == 1
                && weights
                    .iter()
                    .enumerate()
                    .any(|(i, w)| w.last() != Some(&(i as f32 + 0.5)))
            {
                return Err("the rollout received wrong weights".into());
            }
            if round > 0 && rank == 0 {
                r_shm.push(memcpy / shm);
                r_tcp.push(raw / tcp);
                rows.push((memcpy, shm, raw, tcp));
            }
        }
        if rank == 0 {
            let med = |f: fn(&(f64, f64, f64, f64)) -> f64| median(rows.iter().map(f).collect());
            let (memcpy, shm, raw, tcp) = (med(|r| r.0), med(|r| r.1), med(|r| r.2), med(|r| r.3));
            let (a, b) = (median(r_shm), median(r_tcp));
            println!(
                "{mib} MiB in {} f32 tensors, median of {} rounds:",
                o.params, o.iters
            );
            println!("  same process (colocated)   0 bytes moved: the rollout reads the trainer's tensors");
            println!(
                "  memcpy in one process      {:>8.4} s  {:>6.2} GB/s   (baseline for shared memory)",
                memcpy,
                gbps(bytes, memcpy)
            );
            println!(
                "  shared memory, 2 processes {:>8.4} s  {:>6.2} GB/s   ratio {a:.2} of memcpy (goal >= 0.5: {})",
                shm,
                gbps(bytes, shm),
                if a >= 0.5 { "met" } else { "MISSED" }
            );
            println!(
                "  raw TCP copy, 2 processes  {:>8.4} s  {:>6.2} GB/s   (baseline for TCP)",
                raw,
                gbps(bytes, raw)
            );
            println!(
                "  TCP sync, 2 processes      {:>8.4} s  {:>6.2} GB/s   ratio {b:.2} of raw TCP (goal >= 0.9: {})",
                tcp,
                gbps(bytes, tcp),
                if b >= 0.9 { "met" } else { "MISSED" }
            );
            println!("  shared memory vs TCP sync: {:.2}x faster", tcp / shm);
        }
    }
    Ok(())
}

/// Kills the rollout process if the trainer stops early.
struct Reap(Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = parse(&args)?;
    if let Ok(addrs) = std::env::var(CHILD) {
        let mut a = addrs.split(' ');
        let (shm, tcp, raw) = (a.next(), a.next(), a.next());
        let (Some(shm), Some(tcp), Some(raw)) = (shm, tcp, raw) else {
            return Err(format!("{CHILD}={addrs}: expected three addresses").into());
        };
        let cfg = config()?;
        let shm = ShmCommunicator::connect(1, 2, shm, cfg.clone())?;
        let tcp = TcpCommunicator::connect(1, 2, tcp, cfg.clone())?;
        let raw = TcpStream::connect(raw)?;
        tune_stream(&raw, &cfg);
        return rounds(&o, &mut Links { shm, tcp, raw }, 1);
    }
    let cfg = config()?;
    let shm_rv = ShmRendezvous::create(o.slot_bytes)?;
    let tcp_rv = TcpRendezvous::bind("127.0.0.1:0")?;
    let raw_l = TcpListener::bind("127.0.0.1:0")?;
    let addrs = format!(
        "{} {} {}",
        shm_rv.address(),
        tcp_rv.local_addr(),
        raw_l.local_addr()?
    );
    let _child = Reap(
        Command::new(std::env::current_exe()?)
            .args(&args)
            .env(CHILD, addrs)
            .spawn()?,
    );
    let shm = shm_rv.accept(2, cfg.clone())?;
    let tcp = tcp_rv.accept(2, cfg.clone())?;
    let (raw, _) = raw_l.accept()?;
    tune_stream(&raw, &cfg);
    println!(
        "weight_sync_bench: trainer pid {} -> rollout in a second process",
        std::process::id()
    );
    rounds(&o, &mut Links { shm, tcp, raw }, 0)
}
