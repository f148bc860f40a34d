//! TCP backend on loopback, one thread per rank.

mod common;

use std::time::{Duration, Instant};

use common::{config, floats, pattern, run_all, serial, world};
use rlhf_collective::{
    CommConfig, Communicator, ErrorKind, Op, ReduceOp, TcpCommunicator, TcpRendezvous,
};

const SIZES: [usize; 6] = [0, 1, 7, 4099, (1 << 20) + 3, (3 << 20) + 5];

#[test]
fn broadcast_every_size_world_and_root() {
    for n in 1..=4 {
        let mut comms = world(n, config(10_000));
        for root in 0..n {
            for (i, &size) in SIZES.iter().enumerate() {
                let expected = pattern(size, (n * 100 + root * 10 + i) as u64);
                let got = run_all(&mut comms, |r, c| {
                    let mut buf = if r == root {
                        expected.clone()
                    } else {
                        vec![0xAB; size]
                    };
                    c.broadcast(&mut buf, root).map(|_| buf)
                });
                for (r, g) in got.into_iter().enumerate() {
                    let g = g.unwrap_or_else(|e| {
                        panic!("world {n} root {root} size {size} rank {r}: {e}")
                    });
                    assert!(
                        g == expected,
                        "world {n} root {root} size {size}: rank {r} got other bytes"
                    );
                }
            }
        }
    }
}

#[test]
fn typed_broadcasts() {
    let mut comms = world(3, config(10_000));
    let src = floats(1001, 5);
    let got = run_all(&mut comms, |r, c| {
        let mut f = if r == 2 { src.clone() } else { vec![0.0; 1001] };
        c.broadcast_f32(&mut f, 2).unwrap();
        let mut d: Vec<f64> = if r == 1 {
            vec![1.5, -2.25]
        } else {
            vec![0.0; 2]
        };
        c.broadcast_f64(&mut d, 1).unwrap();
        let mut h: Vec<u16> = if r == 0 {
            vec![0x3F80, 0xBF80, 7]
        } else {
            vec![0; 3]
        };
        c.broadcast_u16(&mut h, 0).unwrap();
        (f, d, h)
    });
    for (f, d, h) in got {
        assert_eq!(f, src);
        assert_eq!(d, vec![1.5, -2.25]);
        assert_eq!(h, vec![0x3F80, 0xBF80, 7]);
    }
}

#[test]
fn all_reduce_f32_matches_serial_for_worlds_1_to_4() {
    for n in 1..=4 {
        let mut comms = world(n, config(10_000));
        for len in [0usize, 1, 3, 5, 1000, 300_001] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                // Integer-valued floats: every summation order is exact, so the
                // ring result must equal the serial one bit for bit.
                let ints: Vec<Vec<f32>> = (0..n)
                    .map(|r| {
                        pattern(len, (r * 7 + len) as u64)
                            .into_iter()
                            .map(|b| b as f32 - 128.0)
                            .collect()
                    })
                    .collect();
                let want = serial(&ints, op);
                let got = run_all(&mut comms, |r, c| {
                    let mut v = ints[r].clone();
                    c.all_reduce_f32(&mut v, op).map(|_| v)
                });
                for (r, g) in got.into_iter().enumerate() {
                    let g =
                        g.unwrap_or_else(|e| panic!("world {n} len {len} {op:?} rank {r}: {e}"));
                    assert!(
                        g == want,
                        "world {n} len {len} {op:?}: rank {r} differs from serial"
                    );
                }

                // Random floats: ranks agree bit for bit, and match serial closely.
                let rnd: Vec<Vec<f32>> = (0..n)
                    .map(|r| floats(len, (r * 13 + len + 1) as u64))
                    .collect();
                let want = serial(&rnd, op);
                let got: Vec<Vec<f32>> = run_all(&mut comms, |r, c| {
                    let mut v = rnd[r].clone();
                    c.all_reduce_f32(&mut v, op).unwrap();
                    v
                });
                for g in &got {
                    let same_bits = g
                        .iter()
                        .zip(&got[0])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same_bits, "world {n} len {len} {op:?}: ranks disagree");
                    for (a, b) in g.iter().zip(&want) {
                        assert!((a - b).abs() <= 1e-5, "world {n} {op:?}: {a} vs serial {b}");
                    }
                }
            }
        }
    }
}

#[test]
fn all_reduce_f64_and_nan() {
    let mut comms = world(3, config(10_000));
    let got = run_all(&mut comms, |r, c| {
        let mut v = vec![r as f64 + 0.5, -(r as f64), 1e300];
        c.all_reduce_f64(&mut v, ReduceOp::Sum).unwrap();
        let mut m = vec![r as f32, if r == 1 { f32::NAN } else { 0.0 }];
        c.all_reduce_f32(&mut m, ReduceOp::Max).unwrap();
        (v, m)
    });
    for (v, m) in got {
        assert_eq!(v[0], 4.5);
        assert_eq!(v[1], -3.0);
        assert_eq!(v[2], 3e300);
        assert_eq!(m[0], 2.0);
        assert!(m[1].is_nan(), "a NaN on one rank must survive Max");
    }
}

#[test]
fn all_gather_with_different_lengths() {
    for n in 1..=4 {
        let mut comms = world(n, config(10_000));
        // Rank 0 contributes nothing, the last rank more than a socket write chunk.
        let len = |r: usize| {
            if r == n - 1 && n > 1 {
                (1 << 20) + 17
            } else {
                r * 1000 + r
            }
        };
        let got = run_all(&mut comms, |r, c| c.all_gather(&pattern(len(r), r as u64)));
        for (me, g) in got.into_iter().enumerate() {
            let g = g.unwrap_or_else(|e| panic!("world {n} rank {me}: {e}"));
            assert_eq!(g.len(), n);
            for (r, block) in g.iter().enumerate() {
                assert!(
                    *block == pattern(len(r), r as u64),
                    "world {n}: rank {me} has a wrong block {r}"
                );
            }
        }
    }
}

#[test]
fn barrier_releases_nobody_before_the_last_arrives() {
    let n = 4;
    let mut comms = world(n, config(10_000));
    let t0 = Instant::now();
    let times = run_all(&mut comms, |r, c| {
        std::thread::sleep(Duration::from_millis(60 * r as u64));
        let entered = t0.elapsed();
        c.barrier().unwrap();
        (entered, t0.elapsed())
    });
    let last_entry = times.iter().map(|t| t.0).max().unwrap();
    for (r, (_, left)) in times.iter().enumerate() {
        assert!(
            *left >= last_entry,
            "rank {r} left at {left:?} before the last entry at {last_entry:?}"
        );
    }
}

#[test]
fn mismatched_lengths_are_reported_and_break_the_communicator() {
    let mut comms = world(2, config(5_000));
    let got = run_all(&mut comms, |r, c| {
        let mut buf = vec![1u8; 100 + r];
        let first = c.broadcast(&mut buf, 0);
        let second = c.barrier();
        (first, second)
    });
    for (r, (first, second)) in got.into_iter().enumerate() {
        let e = first.expect_err("lengths differ");
        assert_eq!(e.kind(), ErrorKind::Mismatch, "rank {r}: {e}");
        let msg = e.to_string();
        assert!(
            msg.contains("100") && msg.contains("101"),
            "rank {r}: {msg}"
        );
        assert_eq!(e.peer(), Some(1 - r));
        let e2 = second.expect_err("broken communicator");
        assert_eq!(e2.kind(), ErrorKind::Unavailable, "rank {r}: {e2}");
    }
}

#[test]
fn mismatched_ops_and_roots_are_reported() {
    let mut comms = world(3, config(5_000));
    let got = run_all(&mut comms, |r, c| {
        if r == 1 {
            c.all_reduce_f32(&mut [1.0; 4], ReduceOp::Sum)
        } else {
            c.broadcast(&mut [0u8; 16], 0)
        }
    });
    // Ranks next to rank 1 see the mismatch; nobody hangs or succeeds.
    for (r, g) in got.iter().enumerate() {
        let e = g.as_ref().expect_err("ops differ");
        assert!(
            matches!(e.kind(), ErrorKind::Mismatch | ErrorKind::PeerClosed),
            "rank {r}: {e}"
        );
    }
    assert_eq!(got[1].as_ref().unwrap_err().kind(), ErrorKind::Mismatch);

    let mut comms = world(2, config(5_000));
    let got = run_all(&mut comms, |r, c| c.broadcast(&mut [0u8; 8], r));
    for g in got {
        let e = g.expect_err("roots differ");
        assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
        assert!(e.to_string().contains("root"), "{e}");
    }
}

#[test]
fn a_peer_that_leaves_mid_op_gives_peer_closed() {
    let mut comms = world(3, config(5_000));
    let got = run_all(&mut comms, |r, c| {
        if r == 2 {
            // Take part in the first op's header exchange, then vanish: the
            // sockets close as the communicator is dropped.
            std::thread::sleep(Duration::from_millis(50));
            let dead = std::mem::replace(c, TcpCommunicator::single(CommConfig::default()));
            drop(dead);
            return None;
        }
        let mut v = vec![1.0f32; 4 << 20];
        Some(c.all_reduce_f32(&mut v, ReduceOp::Sum))
    });
    // No wall-clock bound: PeerClosed (not Timeout) is what shows the others noticed the
    // closed sockets instead of waiting out the 5 s timeout, and that timeout bounds the op.
    for (r, g) in got.into_iter().enumerate().take(2) {
        let e = g.unwrap().expect_err("peer 2 left");
        assert!(
            matches!(e.kind(), ErrorKind::PeerClosed),
            "rank {r}: expected PeerClosed, got {e}"
        );
        assert_eq!(e.op(), Some(Op::AllReduce));
    }
}

#[test]
fn a_stuck_peer_gives_timeout_naming_it() {
    let timeout = Duration::from_millis(400);
    let mut comms = world(2, CommConfig::with_timeout(timeout));
    let t0 = Instant::now();
    let got = run_all(&mut comms, |r, c| {
        if r == 1 {
            // Alive but never joins the op.
            std::thread::sleep(timeout * 3);
            return None;
        }
        Some(c.all_gather(b"hello"))
    });
    let e = got[0]
        .as_ref()
        .unwrap()
        .as_ref()
        .expect_err("peer never joined");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert_eq!(e.peer(), Some(1));
    assert!(e.to_string().contains("all_gather"), "{e}");
    assert!(t0.elapsed() >= timeout);
}

#[test]
fn rendezvous_errors_are_clear() {
    // Nobody listening: a timeout naming rank 0 and the address.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let t0 = Instant::now();
    let e = TcpCommunicator::connect(1, 2, &addr, config(300)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert_eq!(e.peer(), Some(0));
    assert!(e.to_string().contains(&addr), "{e}");
    // The 300 ms timeout was honoured rather than the 60 s default; the margin is for a
    // loaded machine, not a speed claim.
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );

    // Rank 0 waiting for ranks that never come names them.
    let rv = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let e = rv.accept(3, config(300)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(e.to_string().contains("ranks 1, 2 never joined"), "{e}");

    // Port in use.
    let rv = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let taken = rv.local_addr().to_string();
    let e = TcpRendezvous::bind(&taken).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io);
    assert!(e.to_string().contains("port 0"), "{e}");

    // Bad arguments.
    let e = TcpCommunicator::init(2, 2, "127.0.0.1:1", config(100)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("rank 2"), "{e}");
    // A world no job has (a JoinComm field): refused before any per-rank table is made.
    let rv = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let e = rv.accept(u32::MAX as usize, config(100)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("at most 65536 ranks"), "{e}");

    // Disagreeing world sizes.
    let rv = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let addr = rv.local_addr().to_string();
    let h = std::thread::spawn(move || TcpCommunicator::connect(1, 3, &addr, config(2_000)));
    let e0 = rv.accept(2, config(2_000)).unwrap_err();
    let e1 = h.join().unwrap().unwrap_err();
    assert_eq!(e0.kind(), ErrorKind::Mismatch);
    assert!(e0.to_string().contains("world_size 3"), "{e0}");
    assert_eq!(e1.kind(), ErrorKind::Mismatch, "{e1}");
    assert!(e1.to_string().contains("world_size"), "{e1}");
}

#[test]
fn init_works_for_every_rank() {
    // `init` with a fixed port: find a free one first.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let n = 3;
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut c = TcpCommunicator::init(r, n, &addr, config(5_000))?;
                let mut v = vec![r as f32; 10];
                c.all_reduce_f32(&mut v, ReduceOp::Sum)?;
                Ok::<_, rlhf_collective::Error>((c.rank(), c.world_size(), v[0]))
            })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let (rank, w, s) = h.join().unwrap().unwrap();
        assert_eq!((rank, w, s), (r, n, 3.0));
    }
}

#[test]
fn bucketed_all_reduce_of_many_gradient_tensors() {
    let n = 3;
    let sizes = [0usize, 5, 1000, 3, 25_000, 0, 1];
    let total: usize = sizes.iter().sum();
    let grads = |r: usize| -> Vec<Vec<f32>> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                (0..s)
                    .map(|j| ((r * 31 + i * 7 + j) % 97) as f32 - 48.0)
                    .collect()
            })
            .collect()
    };
    let all: Vec<Vec<Vec<f32>>> = (0..n).map(grads).collect();
    let mut comms = world(n, config(10_000));
    for bucket in [997usize, 4096, 1 << 20] {
        let got = run_all(&mut comms, |r, c| {
            let mut g = all[r].clone();
            let mut parts: Vec<&mut [f32]> = g.iter_mut().map(|v| v.as_mut_slice()).collect();
            let calls =
                rlhf_collective::all_reduce_f32_bucketed(c, &mut parts, ReduceOp::Avg, bucket)
                    .unwrap();
            (calls, g)
        });
        for (r, (calls, g)) in got.into_iter().enumerate() {
            assert_eq!(calls, total.div_ceil(bucket), "bucket {bucket}");
            for (i, t) in g.iter().enumerate() {
                for (j, x) in t.iter().enumerate() {
                    let want = (0..n).map(|q| all[q][i][j]).sum::<f32>() / n as f32;
                    assert_eq!(*x, want, "rank {r} tensor {i} elem {j} bucket {bucket}");
                }
            }
        }
    }
}

#[test]
fn a_missing_rank_times_out_the_rendezvous_on_every_joined_rank() {
    let rv = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let addr = rv.local_addr().to_string();
    // World of 3, but rank 2 never starts. Rank 1 waits longer than rank 0, so what it sees
    // is rank 0 giving up (on a loaded machine equal deadlines raced: rank 1's own could fire
    // before rank 0's word arrived).
    let h = std::thread::spawn(move || TcpCommunicator::connect(1, 3, &addr, config(5000)));
    let e0 = rv.accept(3, config(500)).unwrap_err();
    assert_eq!(e0.kind(), ErrorKind::Timeout);
    assert!(e0.to_string().contains("ranks 2 never joined"), "{e0}");
    let e1 = h.join().unwrap().unwrap_err();
    // Rank 0 tells the ranks that did join why it gave up.
    assert_eq!(e1.kind(), ErrorKind::Timeout, "{e1}");
    assert!(e1.to_string().contains("ranks 2 never joined"), "{e1}");
}
