//! Loopback throughput of the TCP communicator between real processes next to a raw TCP
//! copy of the same bytes between two of those processes, measured in the same run with
//! the same socket settings, the connection made before timing and a receive buffer reused
//! from copy to copy. This process is rank 0; it starts itself again for every other rank.
//! Each round runs the raw copy and every communicator op once, back to back, so all of
//! them see the same machine load; an op's time is rank 0's from a barrier to a barrier
//! after it (so it covers the slowest rank's last byte); the ratio is the median over
//! rounds of `raw time / op time` (the first round is a warm-up).
//!
//! `cargo run --release -p rlhf-collective --example collective_bench [-- OPTIONS]`
//!
//! Options: `--sizes-mib 64,256` `--iters 5` `--sockbuf-kib 4096|auto`
//! `--chunk-kib 1024` `--params 100` `--world 2`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use rlhf_collective::tcp::tune_stream;
use rlhf_collective::{
    BucketedSync, CommConfig, Communicator, Param, ParamMut, ReduceOp, TcpCommunicator,
    TcpRendezvous,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Set in the processes of ranks 1..world: `RANK TCP_RENDEZVOUS RAW_ADDRESS`.
const CHILD: &str = "RLHF_COLLECTIVE_BENCH_CHILD";

struct Opts {
    sizes_mib: Vec<usize>,
    iters: usize,
    config: CommConfig,
    params: usize,
    world: usize,
}

fn parse(args: &[String]) -> Result<Opts, BoxError> {
    let mut o = Opts {
        sizes_mib: vec![64, 256],
        iters: 5,
        config: CommConfig::default(),
        params: 100,
        world: 2,
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
            "--sockbuf-kib" => {
                let v = val()?;
                o.config.socket_buffer_bytes = if v == "auto" {
                    None
                } else {
                    Some(v.parse::<usize>()? << 10)
                };
            }
            "--chunk-kib" => o.config.chunk_bytes = val()?.parse::<usize>()? << 10,
            "--params" => o.params = val()?.parse()?,
            "--world" => o.world = val()?.parse()?,
            other => return Err(format!("unknown option {other}; see the file header").into()),
        }
    }
    if o.iters == 0 || o.params == 0 || o.world < 2 {
        return Err("--iters and --params must be ≥ 1 and --world ≥ 2".into());
    }
    Ok(o)
}

fn median<T: PartialOrd + Copy>(mut v: Vec<T>) -> T {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Rank 0 → rank 1 over the raw link: rank 0 writes `buf`, rank 1 reads it into its
/// reused buffer and answers one byte; the others do nothing. Rank 0's time.
fn raw_once(
    raw: &mut Option<TcpStream>,
    buf: &mut [u8],
    rank: usize,
    chunk: usize,
) -> Result<Duration, BoxError> {
    let t = Instant::now();
    match (rank, raw.as_mut()) {
        (0, Some(s)) => {
            for c in buf.chunks(chunk) {
                s.write_all(c)?;
            }
            s.read_exact(&mut [0u8])?;
        }
        (1, Some(s)) => {
            s.read_exact(buf)?;
            s.write_all(&[1])?;
        }
        _ => {}
    }
    Ok(t.elapsed())
}

/// One op on every rank between two barriers; rank 0's time.
fn timed(
    comm: &mut TcpCommunicator,
    op: impl FnOnce(&mut TcpCommunicator) -> rlhf_collective::Result<()>,
) -> Result<Duration, BoxError> {
    comm.barrier()?;
    let t = Instant::now();
    op(comm)?;
    comm.barrier()?;
    Ok(t.elapsed())
}

/// A 64-bit FNV-1a of bytes, to check that every rank ended with the same data.
fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Every rank runs the same rounds in the same order; rank 0 prints.
fn rounds(
    o: &Opts,
    comm: &mut TcpCommunicator,
    mut raw: Option<TcpStream>,
    rank: usize,
) -> Result<(), BoxError> {
    let n = o.world;
    let names = [
        "raw TCP copy (2 processes)".to_string(),
        format!("broadcast (world {n})"),
        format!("BucketedSync {} params (world {n})", o.params),
        format!("all_reduce_f32 sum (world {n})"),
    ];
    for &mib in &o.sizes_mib {
        let bytes = mib << 20;
        let elems = bytes / 4;
        let mut raw_buf = vec![if rank == 0 { 7u8 } else { 0 }; if rank <= 1 { bytes } else { 0 }];
        let mut bcast = vec![if rank == 0 { 1u8 } else { 0 }; bytes];
        let mut weights = vec![if rank == 0 { 1.5f32 } else { 0.0 }; elems];
        let mut grads = vec![rank as f32 + 0.5; elems];
        // ~`params` parameters of uneven sizes (quadratic spacing: a few large
        // tensors and many small ones), like a model's state dict.
        let bounds: Vec<usize> = (0..=o.params)
            .map(|i| {
                let f = i as f64 / o.params as f64;
                ((f * f) * elems as f64) as usize
            })
            .collect();
        let sync = BucketedSync::default();

        let mut times: [Vec<Duration>; 4] = Default::default();
        for round in 0..=o.iters {
            comm.barrier()?;
            // The four measurements in an order that rotates from round to round (the same
            // on every rank), so no path always runs first after the round's barrier.
            let mut t = [Duration::ZERO; 4];
            for k in (0..4).map(|i| (i + round) % 4) {
                t[k] = match k {
                    0 => raw_once(&mut raw, &mut raw_buf, rank, o.config.chunk_bytes)?,
                    1 => timed(comm, |c| c.broadcast(&mut bcast, 0))?,
                    2 => timed(comm, |c| {
                        if rank == 0 {
                            let params: Vec<Param<'_>> = bounds
                                .windows(2)
                                .enumerate()
                                .map(|(i, w)| {
                                    Param::f32(
                                        format!("p{i}"),
                                        &[w[1] - w[0]],
                                        &weights[w[0]..w[1]],
                                    )
                                })
                                .collect::<Result<_, _>>()?;
                            sync.send(c, &params).map(|_| ())
                        } else {
                            let mut params: Vec<ParamMut<'_>> = Vec::with_capacity(bounds.len());
                            let mut rest: &mut [f32] = &mut weights;
                            for (i, w) in bounds.windows(2).enumerate() {
                                let (head, tail) = rest.split_at_mut(w[1] - w[0]);
                                params.push(ParamMut::f32(format!("p{i}"), &[w[1] - w[0]], head)?);
                                rest = tail;
                            }
                            sync.recv(c, 0, &mut params).map(|_| ())
                        }
                    })?,
                    _ => timed(comm, |c| c.all_reduce_f32(&mut grads, ReduceOp::Sum))?,
                };
                // The raw copy involves two ranks only: the others wait here.
                if k == 0 {
                    comm.barrier()?;
                }
            }
            if round > 0 {
                for (acc, d) in times.iter_mut().zip(t) {
                    acc.push(d);
                }
            }
        }
        // Every rank must end with rank 0's broadcast and weights and the same sums.
        let mine = [
            digest(&bcast),
            digest(rlhf_collective::as_bytes(&weights)),
            digest(rlhf_collective::as_bytes(&grads)),
        ];
        let all = comm.all_gather(rlhf_collective::as_bytes(&mine))?;
        if all.iter().any(|d| d[..] != all[0][..])
            || bcast[bytes - 1] != 1
            || weights[elems - 1] != 1.5
        {
            return Err(format!("rank {rank}: the ranks ended with different data").into());
        }
        if rank == 1 && raw_buf.last() != Some(&7) {
            return Err("the raw copy delivered wrong bytes".into());
        }
        if rank != 0 {
            continue;
        }
        println!("\n{mib} MiB (median of {} rounds)", o.iters);
        println!(
            "  {:<36} {:>8} {:>10} {:>7} {:>11}",
            "", "GB/s", "ms", "ratio", "wire ratio"
        );
        // Bytes all ranks together push through sockets, per payload byte.
        let wire = [1.0, (n - 1) as f64, (n - 1) as f64, 2.0 * (n - 1) as f64];
        for (k, name) in names.iter().enumerate() {
            let ratio = median(
                times[0]
                    .iter()
                    .zip(&times[k])
                    .map(|(raw, op)| raw.as_secs_f64() / op.as_secs_f64())
                    .collect(),
            );
            let d = median(times[k].clone());
            println!(
                "  {name:<36} {:>8.2} {:>10.1} {:>7.2} {:>11.2}",
                gbps(bytes, d),
                d.as_secs_f64() * 1e3,
                ratio,
                ratio * wire[k]
            );
        }
    }
    if rank == 0 {
        println!(
            "\nGB/s = payload bytes / wall time until every rank is done; ratio = median over rounds of \
             raw time / op time (goal >= 0.9 for broadcast and the sync); wire ratio = ratio x bytes \
             all ranks send per payload byte (raw 1, broadcast n-1, all_reduce 2(n-1)): on a \
             CPU-bound loopback it shows how much of the raw copy's socket throughput each op achieves."
        );
    }
    Ok(())
}

/// Kills the other ranks' processes if rank 0 stops early.
struct Reap(Vec<Child>);

impl Drop for Reap {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = parse(&args)?;
    if let Ok(v) = std::env::var(CHILD) {
        let f: Vec<&str> = v.split(' ').collect();
        let [rank, tcp, raw_addr] = f[..] else {
            return Err(format!("{CHILD}={v}: expected RANK TCP RAW").into());
        };
        let rank: usize = rank.parse()?;
        let mut comm = TcpCommunicator::connect(rank, o.world, tcp, o.config.clone())?;
        let raw = if rank == 1 {
            let s = TcpStream::connect(raw_addr)?;
            tune_stream(&s, &o.config);
            Some(s)
        } else {
            None
        };
        return rounds(&o, &mut comm, raw, rank);
    }
    println!(
        "collective_bench: world {} (one process per rank), {} rounds (+1 warm-up), chunk {} KiB, socket buffers {}, {} parameters for the sync",
        o.world,
        o.iters,
        o.config.chunk_bytes >> 10,
        o.config
            .socket_buffer_bytes
            .map_or("auto".to_string(), |b| format!("{} KiB", b >> 10)),
        o.params
    );
    let rv = TcpRendezvous::bind("127.0.0.1:0")?;
    let raw_l = TcpListener::bind("127.0.0.1:0")?;
    let mut children = Reap(Vec::new());
    for r in 1..o.world {
        children.0.push(
            Command::new(std::env::current_exe()?)
                .args(&args)
                .env(
                    CHILD,
                    format!("{r} {} {}", rv.local_addr(), raw_l.local_addr()?),
                )
                .spawn()?,
        );
    }
    let mut comm = rv.accept(o.world, o.config.clone())?;
    let (raw, _) = raw_l.accept()?;
    tune_stream(&raw, &o.config);
    rounds(&o, &mut comm, Some(raw), 0)?;
    for c in &mut children.0 {
        let status = c.wait()?;
        if !status.success() {
            return Err(format!("a rank process ended with {status}").into());
        }
    }
    children.0.clear();
    Ok(())
}
