//! Loopback throughput of the TCP communicator next to a raw TCP copy of the same
//! bytes, measured in the same run with the same socket settings. Each round runs
//! the raw copy and every communicator op once, back to back, so all of them see
//! the same machine load; the ratio is the median over rounds of
//! `raw time / op time` (the first round is a warm-up).
//!
//! `cargo run --release -p rlhf-collective --example collective_bench [-- OPTIONS]`
//!
//! Options: `--sizes-mib 64,256` `--iters 5` `--sockbuf-kib 4096|auto`
//! `--chunk-kib 1024` `--params 100` `--world 2`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use rlhf_collective::tcp::tune_stream;
use rlhf_collective::{
    BucketedSync, CommConfig, Communicator, Param, ParamMut, ReduceOp, TcpCommunicator,
    TcpRendezvous,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct Opts {
    sizes_mib: Vec<usize>,
    iters: usize,
    config: CommConfig,
    params: usize,
    world: usize,
}

fn parse() -> Result<Opts, BoxError> {
    let mut o = Opts {
        sizes_mib: vec![64, 256],
        iters: 5,
        config: CommConfig::default(),
        params: 100,
        world: 2,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
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

/// Two connected loopback sockets with the communicator's settings.
struct RawPair {
    tx: TcpStream,
    rx: TcpStream,
    src: Vec<u8>,
    dst: Vec<u8>,
    chunk: usize,
}

impl RawPair {
    fn new(bytes: usize, cfg: &CommConfig) -> Result<Self, BoxError> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let tx = TcpStream::connect(listener.local_addr()?)?;
        let (rx, _) = listener.accept()?;
        tune_stream(&tx, cfg);
        tune_stream(&rx, cfg);
        Ok(Self {
            tx,
            rx,
            src: vec![7u8; bytes],
            dst: vec![0u8; bytes],
            chunk: cfg.chunk_bytes,
        })
    }

    /// One copy: a writer thread with plain `write_all`, the reader with `read_exact`.
    fn once(&mut self) -> Result<Duration, BoxError> {
        let Self {
            tx,
            rx,
            src,
            dst,
            chunk,
        } = self;
        let t = Instant::now();
        let written = thread::scope(|s| {
            let w = s.spawn(|| -> std::io::Result<()> {
                for c in src.chunks(*chunk) {
                    (&*tx).write_all(c)?;
                }
                Ok(())
            });
            let r = (&*rx).read_exact(dst);
            (w.join(), r)
        });
        let d = t.elapsed();
        match written {
            (Ok(Ok(())), Ok(())) => {}
            (w, r) => return Err(format!("raw copy failed: writer {w:?}, reader {r:?}").into()),
        }
        if dst.last() != Some(&7) {
            return Err("raw copy delivered wrong bytes".into());
        }
        Ok(d)
    }
}

fn make_world(o: &Opts) -> Result<Vec<TcpCommunicator>, BoxError> {
    let rv = TcpRendezvous::bind("127.0.0.1:0")?;
    let addr = rv.local_addr().to_string();
    let n = o.world;
    let handles: Vec<_> = (1..n)
        .map(|r| {
            let addr = addr.clone();
            let cfg = o.config.clone();
            thread::spawn(move || TcpCommunicator::connect(r, n, &addr, cfg))
        })
        .collect();
    let mut v = vec![rv.accept(n, o.config.clone())?];
    for h in handles {
        v.push(h.join().map_err(|_| "rank thread panicked")??);
    }
    Ok(v)
}

/// Runs `op` once on every rank (after a barrier); returns the slowest rank's time.
fn once<S: Send>(
    comms: &mut [TcpCommunicator],
    states: &mut [S],
    op: impl Fn(usize, &mut TcpCommunicator, &mut S) -> rlhf_collective::Result<()> + Sync,
) -> Result<Duration, BoxError> {
    let times: Vec<rlhf_collective::Result<Duration>> = thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter_mut()
            .zip(states.iter_mut())
            .enumerate()
            .map(|(r, (c, st))| {
                let op = &op;
                s.spawn(move || {
                    c.barrier()?;
                    let t = Instant::now();
                    op(r, c, st)?;
                    Ok(t.elapsed())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("bench rank panicked"))
            .collect()
    });
    let mut worst = Duration::ZERO;
    for t in times {
        worst = worst.max(t?);
    }
    Ok(worst)
}

fn main() -> Result<(), BoxError> {
    let o = parse()?;
    println!(
        "collective_bench: world {}, {} rounds (+1 warm-up), chunk {} KiB, socket buffers {}, {} parameters for the sync",
        o.world,
        o.iters,
        o.config.chunk_bytes >> 10,
        o.config
            .socket_buffer_bytes
            .map_or("auto".to_string(), |b| format!("{} KiB", b >> 10)),
        o.params
    );
    let mut comms = make_world(&o)?;
    let n = o.world;
    let names = [
        "raw TCP copy (2 threads)".to_string(),
        format!("broadcast (world {n})"),
        format!("BucketedSync {} params (world {n})", o.params),
        format!("all_reduce_f32 sum (world {n})"),
    ];
    for &mib in &o.sizes_mib {
        let bytes = mib << 20;
        let elems = bytes / 4;
        let mut raw = RawPair::new(bytes, &o.config)?;
        let mut bcast: Vec<Vec<u8>> = (0..n).map(|r| vec![r as u8 + 1; bytes]).collect();
        let mut weights: Vec<Vec<f32>> = (0..n).map(|r| vec![r as f32 + 1.0; elems]).collect();
        let mut grads: Vec<Vec<f32>> = (0..n).map(|r| vec![r as f32 + 0.5; elems]).collect();
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
            let t = [
                raw.once()?,
                once(&mut comms, &mut bcast, |_, c, buf| c.broadcast(buf, 0))?,
                once(&mut comms, &mut weights, |r, c, buf| {
                    if r == 0 {
                        let params: Vec<Param<'_>> = bounds
                            .windows(2)
                            .enumerate()
                            .map(|(i, w)| {
                                Param::f32(format!("p{i}"), &[w[1] - w[0]], &buf[w[0]..w[1]])
                            })
                            .collect::<Result<_, _>>()?;
                        sync.send(c, &params).map(|_| ())
                    } else {
                        let mut params: Vec<ParamMut<'_>> = Vec::with_capacity(bounds.len());
                        let mut rest: &mut [f32] = buf;
                        for (i, w) in bounds.windows(2).enumerate() {
                            let (head, tail) = rest.split_at_mut(w[1] - w[0]);
                            params.push(ParamMut::f32(format!("p{i}"), &[w[1] - w[0]], head)?);
                            rest = tail;
                        }
                        sync.recv(c, 0, &mut params).map(|_| ())
                    }
                })?,
                once(&mut comms, &mut grads, |_, c, buf| {
                    c.all_reduce_f32(buf, ReduceOp::Sum)
                })?,
            ];
            if round > 0 {
                for (acc, d) in times.iter_mut().zip(t) {
                    acc.push(d);
                }
            }
        }
        if bcast.iter().any(|b| b != &bcast[0]) || weights.iter().any(|w| w != &weights[0]) {
            return Err("a rank ended with different data".into());
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
    println!(
        "\nGB/s = payload bytes / wall time of the slowest rank; ratio = median over rounds of \
         raw time / op time (goal >= 0.5); wire ratio = ratio x bytes all ranks send per payload \
         byte (raw 1, broadcast n-1, all_reduce 2(n-1)): on a CPU-bound loopback it shows how \
         much of the raw copy's socket throughput each op achieves."
    );
    Ok(())
}
