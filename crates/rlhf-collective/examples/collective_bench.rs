//! Loopback throughput of the TCP communicator next to a raw TCP copy of the same
//! bytes, measured in the same run with the same socket settings.
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

/// Median of the per-iteration wall times.
fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn raw_copy(bytes: usize, o: &Opts) -> Result<Duration, BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let cfg = o.config.clone();
    let iters = o.iters + 1;
    let writer = thread::spawn(move || -> Result<(), std::io::Error> {
        let s = TcpStream::connect(addr)?;
        tune_stream(&s, &cfg);
        let src = vec![7u8; bytes];
        let mut ack = [0u8; 1];
        for _ in 0..iters {
            for c in src.chunks(cfg.chunk_bytes) {
                (&s).write_all(c)?;
            }
            // Wait for the reader so iterations do not overlap.
            (&s).read_exact(&mut ack)?;
        }
        Ok(())
    });
    let (s, _) = listener.accept()?;
    tune_stream(&s, &o.config);
    let mut dst = vec![0u8; bytes];
    let mut times = Vec::new();
    for i in 0..iters {
        let t = Instant::now();
        (&s).read_exact(&mut dst)?;
        if i > 0 {
            times.push(t.elapsed());
        }
        (&s).write_all(&[1])?;
    }
    writer.join().map_err(|_| "writer panicked")??;
    if dst[bytes - 1] != 7 {
        return Err("raw copy delivered wrong bytes".into());
    }
    Ok(median(times))
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

/// Runs `op` on every rank after a barrier, `iters + 1` times (the first is a
/// warm-up); returns the median of the slowest rank's time per iteration.
fn timed<S: Send>(
    comms: &mut [TcpCommunicator],
    iters: usize,
    setup: impl Fn(usize) -> S + Sync,
    op: impl Fn(usize, &mut TcpCommunicator, &mut S) -> rlhf_collective::Result<()> + Sync,
) -> Result<Duration, BoxError> {
    let per_rank: Vec<Result<Vec<Duration>, rlhf_collective::Error>> = thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter_mut()
            .enumerate()
            .map(|(r, c)| {
                let (setup, op) = (&setup, &op);
                s.spawn(move || {
                    let mut state = setup(r);
                    let mut times = Vec::new();
                    for i in 0..=iters {
                        c.barrier()?;
                        let t = Instant::now();
                        op(r, c, &mut state)?;
                        if i > 0 {
                            times.push(t.elapsed());
                        }
                    }
                    Ok(times)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("bench rank panicked"))
            .collect()
    });
    let per_rank: Vec<Vec<Duration>> = per_rank.into_iter().collect::<Result<_, _>>()?;
    let slowest: Vec<Duration> = (0..iters)
        .map(|i| per_rank.iter().map(|t| t[i]).max().unwrap_or_default())
        .collect();
    Ok(median(slowest))
}

fn main() -> Result<(), BoxError> {
    let o = parse()?;
    println!(
        "collective_bench: world {}, iters {} (+1 warm-up, median), chunk {} KiB, socket buffers {}, {} parameters for the sync",
        o.world,
        o.iters,
        o.config.chunk_bytes >> 10,
        o.config
            .socket_buffer_bytes
            .map_or("auto".to_string(), |b| format!("{} KiB", b >> 10)),
        o.params
    );
    let mut comms = make_world(&o)?;
    for &mib in &o.sizes_mib {
        let bytes = mib << 20;
        let raw = raw_copy(bytes, &o)?;
        let raw_gbps = gbps(bytes, raw);
        println!("\n{mib} MiB");
        println!(
            "  {:<34} {:>8.2} GB/s  {:>8.1} ms  ratio 1.00",
            "raw TCP copy (2 threads)",
            raw_gbps,
            raw.as_secs_f64() * 1e3
        );
        let report = |name: &str, d: Duration| {
            let g = gbps(bytes, d);
            println!(
                "  {name:<34} {g:>8.2} GB/s  {:>8.1} ms  ratio {:.2}",
                d.as_secs_f64() * 1e3,
                g / raw_gbps
            );
        };

        let t = timed(
            &mut comms,
            o.iters,
            |r| vec![r as u8 + 1; bytes],
            |_, c, buf| c.broadcast(buf, 0),
        )?;
        report(&format!("broadcast (world {})", o.world), t);

        // BucketedSync of the same bytes as ~`params` parameters of uneven sizes.
        let n_params = o.params;
        let elems = bytes / 4;
        let bounds: Vec<usize> = (0..=n_params)
            .map(|i| {
                // Quadratic spacing: a few large tensors and many small ones.
                let f = i as f64 / n_params as f64;
                ((f * f) * elems as f64) as usize
            })
            .collect();
        let sync = BucketedSync::default();
        let t = timed(
            &mut comms,
            o.iters,
            |r| vec![r as f32 + 1.0; elems],
            |r, c, buf| {
                if r == 0 {
                    let params: Vec<Param<'_>> = bounds
                        .windows(2)
                        .enumerate()
                        .map(|(i, w)| Param::f32(format!("p{i}"), &[w[1] - w[0]], &buf[w[0]..w[1]]))
                        .collect::<Result<_, _>>()?;
                    sync.send(c, &params).map(|_| ())
                } else {
                    let mut params: Vec<ParamMut<'_>> = Vec::with_capacity(n_params);
                    let mut rest: &mut [f32] = buf;
                    for (i, w) in bounds.windows(2).enumerate() {
                        let (head, tail) = rest.split_at_mut(w[1] - w[0]);
                        params.push(ParamMut::f32(format!("p{i}"), &[w[1] - w[0]], head)?);
                        rest = tail;
                    }
                    sync.recv(c, 0, &mut params).map(|_| ())
                }
            },
        )?;
        report(
            &format!("BucketedSync {n_params} params (world {})", o.world),
            t,
        );

        let t = timed(
            &mut comms,
            o.iters,
            |r| vec![r as f32 + 0.5; elems],
            |_, c, buf| c.all_reduce_f32(buf, ReduceOp::Sum),
        )?;
        report(&format!("all_reduce_f32 sum (world {})", o.world), t);
    }
    println!("\nratio = communicator GB/s / raw copy GB/s (payload bytes / wall time; goal ≥ 0.5)");
    Ok(())
}
