//! Shared-memory groups made of threads of this process (the segment is opened through
//! /proc/self's pid like another process would); real processes are in tests/processes.rs.

use std::thread;
use std::time::Duration;

use super::*;
use crate::{checksum, BucketedSync, CommSecret, ErrorKind, Param, ParamMut};

fn cfg(secret: Option<u8>) -> CommConfig {
    let mut c = CommConfig::with_timeout(Duration::from_secs(10));
    c.secret = secret.map(|b| CommSecret::from_bytes(&[b; 32]).unwrap());
    c
}

/// A group of `n` threads; rank r gets `secrets[r]`.
fn group(n: usize, slot_bytes: usize, secrets: &[Option<u8>]) -> Vec<Result<ShmCommunicator>> {
    let rv = ShmRendezvous::create(slot_bytes).unwrap();
    let addr = rv.address().to_string();
    let handles: Vec<_> = (1..n)
        .map(|r| {
            let (addr, c) = (addr.clone(), cfg(secrets[r]));
            thread::spawn(move || ShmCommunicator::connect(r, n, &addr, c))
        })
        .collect();
    let mut out = vec![rv.accept(n, cfg(secrets[0]))];
    out.extend(handles.into_iter().map(|h| h.join().unwrap()));
    out
}

fn run_all<T: Send>(
    comms: &mut [ShmCommunicator],
    f: impl Fn(usize, &mut ShmCommunicator) -> T + Sync,
) -> Vec<T> {
    thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter_mut()
            .enumerate()
            .map(|(r, c)| {
                let f = &f;
                s.spawn(move || f(r, c))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn ok(v: Vec<Result<ShmCommunicator>>) -> Vec<ShmCommunicator> {
    v.into_iter().map(|c| c.expect("join")).collect()
}

#[test]
fn broadcast_gather_reduce_and_barrier_across_many_slot_turns() {
    // 100-byte slots: a 10 kB broadcast turns the 4-slot ring 25 times.
    let mut comms = ok(group(3, 100, &[Some(1); 3]));
    assert_eq!(comms[1].slot_bytes, 128);
    let payload: Vec<u8> = (0..10_007u32).map(|i| (i * 31 % 251) as u8).collect();
    let results = run_all(&mut comms, |r, c| {
        // Broadcast from rank 1, received into two uneven parts on the others.
        let mut got = vec![0u8; payload.len()];
        if r == 1 {
            got.copy_from_slice(&payload);
            let (a, b) = payload.split_at(3);
            c.broadcast_send_parts(&[a, b]).unwrap();
        } else {
            let (a, b) = got.split_at_mut(5000);
            c.broadcast_recv_parts(&mut [a, b], 1).unwrap();
        }
        let gathered = c.all_gather(&vec![r as u8; r * 70]).unwrap();
        let mut sum = vec![r as f32 + 0.5; 333];
        c.all_reduce_f32(&mut sum, ReduceOp::Sum).unwrap();
        let mut avg = vec![r as f64; 3];
        c.all_reduce_f64(&mut avg, ReduceOp::Avg).unwrap();
        let mut max = [r as f32, if r == 2 { f32::NAN } else { 0.0 }];
        c.all_reduce_f32(&mut max, ReduceOp::Max).unwrap();
        c.barrier().unwrap();
        (got, gathered, sum[332], avg[2], max)
    });
    for (r, (got, gathered, sum, avg, max)) in results.into_iter().enumerate() {
        assert_eq!(got, payload, "rank {r}");
        for (from, g) in gathered.iter().enumerate() {
            assert_eq!(g, &vec![from as u8; from * 70], "rank {r} from {from}");
        }
        assert_eq!(sum, 0.5 + 1.5 + 2.5);
        assert_eq!(avg, 1.0);
        assert_eq!(max[0], 2.0);
        assert!(max[1].is_nan(), "a NaN on one rank wins the max");
    }
}

/// All-reduce and reduce-scatter add every rank's values up as they pass through the slots
/// (128-byte slots: 32 floats a message, so a rank's buffer takes many turns of the ring):
/// every element is the rank-order sum on every rank (bit-identical), and a reduce-scatter
/// leaves each rank its own segment's sums, for uneven and empty segments, with the
/// average and the max too.
#[test]
fn reductions_add_up_every_element_in_rank_order_as_it_streams_through() {
    let mut comms = ok(group(3, 100, &[Some(4); 3]));
    let n = 1001usize;
    let value = |r: usize, i: usize| ((r * 7919 + i * 104_729) % 1000) as f32 * 0.37 - 150.0;
    let counts = [400usize, 0, 601];
    let results = run_all(&mut comms, |r, c| {
        let mut all: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
        c.all_reduce_f32(&mut all, ReduceOp::Sum).unwrap();
        let mut seg: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
        c.reduce_scatter_f32(&mut seg, &counts, ReduceOp::Sum)
            .unwrap();
        let mut avg: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
        c.reduce_scatter_f32(&mut avg, &counts, ReduceOp::Avg)
            .unwrap();
        let mut max: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
        c.reduce_scatter_f32(&mut max, &counts, ReduceOp::Max)
            .unwrap();
        let e = c
            .reduce_scatter_f32(&mut [0.0; 3], &[1, 1], ReduceOp::Sum)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        (all, seg, avg, max)
    });
    let sum = |i: usize| (value(0, i) + value(1, i)) + value(2, i);
    let top = |i: usize| value(0, i).max(value(1, i)).max(value(2, i));
    let mut start = 0;
    for (r, (all, seg, avg, max)) in results.iter().enumerate() {
        for (i, v) in all.iter().enumerate() {
            assert_eq!(v.to_bits(), sum(i).to_bits(), "rank {r} element {i}");
        }
        for i in start..start + counts[r] {
            assert_eq!(
                seg[i].to_bits(),
                sum(i).to_bits(),
                "rank {r} segment element {i}"
            );
            assert_eq!(avg[i], sum(i) / 3.0, "rank {r} average {i}");
            assert_eq!(max[i], top(i), "rank {r} max {i}");
        }
        start += counts[r];
    }
}

#[test]
fn bucketed_weight_sync_arrives_with_the_trainers_checksum() {
    let mut comms = ok(group(3, 4096, &[Some(3); 3]));
    let sizes = [70_001usize, 5, 0, 3, 20_000];
    let weights: Vec<Vec<f32>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| (i * 1000 + j) as f32 * 0.25).collect())
        .collect();
    let sums = run_all(&mut comms, |r, c| {
        let sync = BucketedSync::new(50_000).unwrap();
        if r == 0 {
            let p: Vec<Param<'_>> = weights
                .iter()
                .enumerate()
                .map(|(i, w)| Param::f32(format!("w{i}"), &[w.len()], w).unwrap())
                .collect();
            let stats = sync.send(c, &p).unwrap();
            assert_eq!(stats.bytes, 4 * sizes.iter().sum::<usize>() as u64);
            checksum(&p)
        } else {
            let mut w: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.0; n]).collect();
            let mut p: Vec<ParamMut<'_>> = w
                .iter_mut()
                .enumerate()
                .map(|(i, d)| ParamMut::f32(format!("w{i}"), &[d.len()], d).unwrap())
                .collect();
            sync.recv(c, 0, &mut p).unwrap();
            checksum(&p)
        }
    });
    assert!(sums.iter().all(|&s| s == sums[0]), "{sums:x?}");
}

#[test]
fn a_rank_without_the_secret_is_refused_on_both_sides() {
    let got = group(2, 256, &[Some(1), Some(2)]);
    let e = got[1].as_ref().err().expect("rank 1 must refuse rank 0");
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    assert!(e.to_string().contains("secret"), "{e}");
    // Rank 1 stops before answering: rank 0 sees it aborted (or times out); it never
    // accepts a group with an unauthenticated member.
    assert!(got[0].is_err(), "rank 0 accepted a rank without the secret");
}

#[test]
fn disagreeing_ranks_get_a_mismatch_naming_both_sides() {
    let mut comms = ok(group(2, 256, &[None, None]));
    let errs = run_all(&mut comms, |r, c| {
        if r == 0 {
            c.broadcast(&mut [1u8; 10], 0).err()
        } else {
            c.broadcast(&mut [0u8; 12], 0).err()
        }
    });
    let e = errs[1].as_ref().expect("rank 1 sees the mismatch");
    assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
    assert!(
        e.to_string().contains("10 bytes") && e.to_string().contains("12 bytes"),
        "{e}"
    );
    // Broken after an error: the next op is refused, not attempted.
    let again = comms[1].barrier().unwrap_err();
    assert_eq!(again.kind(), ErrorKind::Unavailable, "{again}");
}

#[test]
fn a_silent_peer_is_a_timeout_naming_it() {
    let mut comms = ok(group(2, 256, &[None, None]));
    comms[1].config.timeout = Duration::from_millis(300);
    let e = comms[1].broadcast(&mut [0u8; 4], 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert_eq!(e.peer(), Some(0), "{e}");
}

#[test]
fn bad_addresses_are_explained() {
    for (addr, want) in [
        ("127.0.0.1:5", "not a shared-memory segment address"),
        ("memfd:x/3", "not a shared-memory segment address"),
        ("memfd:999999999/3", "same user"),
    ] {
        let e = ShmCommunicator::connect(1, 2, addr, cfg(None))
            .err()
            .expect("must fail");
        assert!(e.to_string().contains(want), "{addr}: {e}");
    }
    let e = ShmRendezvous::create(16)
        .unwrap()
        .accept(MAX_RANKS + 1, cfg(None))
        .err()
        .expect("too many ranks");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    // A segment whose header announces a slot size that is zero, or whose slots would not
    // fit in the address space (the header is another process's word), is no segment of
    // ours: refused at join, not a division by zero or an overflowed offset later.
    for bad in [0u64, 1 << 62, u64::MAX / 3 + 1] {
        let rv = ShmRendezvous::create(64).unwrap();
        rv.map.header().slot_bytes.store(bad, Ordering::Relaxed);
        let e = ShmCommunicator::connect(1, 2, rv.address(), cfg(None))
            .err()
            .expect("must fail");
        assert!(
            e.to_string()
                .contains("not a shared-memory segment of this version"),
            "{bad}: {e}"
        );
    }
}
