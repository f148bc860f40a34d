//! Shared helpers: in-process worlds on loopback.
#![allow(dead_code)]

use std::thread;
use std::time::Duration;

use rlhf_collective::{CommConfig, ReduceOp, TcpCommunicator, TcpRendezvous};

pub fn config(timeout_ms: u64) -> CommConfig {
    CommConfig::with_timeout(Duration::from_millis(timeout_ms))
}

/// Builds a world of `n` ranks on 127.0.0.1 with a free port, one thread per rank.
pub fn world(n: usize, cfg: CommConfig) -> Vec<TcpCommunicator> {
    let rv = TcpRendezvous::bind("127.0.0.1:0").expect("bind rank 0");
    let addr = rv.local_addr().to_string();
    let handles: Vec<_> = (1..n)
        .map(|r| {
            let addr = addr.clone();
            let cfg = cfg.clone();
            thread::spawn(move || TcpCommunicator::connect(r, n, &addr, cfg))
        })
        .collect();
    let mut comms = vec![rv.accept(n, cfg).expect("rank 0 accept")];
    for h in handles {
        comms.push(h.join().expect("join thread").expect("rank connect"));
    }
    comms
}

/// Runs `f` on every rank concurrently and returns the results by rank.
pub fn run_all<C: Send, T: Send>(comms: &mut [C], f: impl Fn(usize, &mut C) -> T + Sync) -> Vec<T> {
    thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter_mut()
            .enumerate()
            .map(|(r, c)| {
                let f = &f;
                s.spawn(move || f(r, c))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// Deterministic pseudo-random bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Deterministic floats in [-1, 1).
pub fn floats(len: usize, seed: u64) -> Vec<f32> {
    pattern(len * 4, seed)
        .chunks_exact(4)
        .map(|c| {
            (u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64 / u32::MAX as f64 * 2.0 - 1.0)
                as f32
        })
        .collect()
}

/// The element-wise reduction of every rank's input, computed in one place.
pub fn serial(inputs: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
    let n = inputs.len();
    (0..inputs[0].len())
        .map(|i| {
            let col = inputs.iter().map(|v| v[i]);
            match op {
                ReduceOp::Sum => col.sum(),
                ReduceOp::Avg => col.sum::<f32>() / n as f32,
                ReduceOp::Max => col.fold(f32::NEG_INFINITY, f32::max),
            }
        })
        .collect()
}
