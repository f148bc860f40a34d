//! Communicator secrets on loopback: a world that shares one works as before; a stranger who
//! reaches rank 0's port first, with no authentication or a forged one, gets nothing of value
//! and does not stop the real ranks; a rank with another secret is refused by name.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::Duration;

use common::{config, pattern, run_all, world};
use rlhf_collective::{
    CommSecret, Communicator, ErrorKind, ReduceOp, TcpCommunicator, TcpRendezvous,
};

fn with_secret(timeout_ms: u64, s: &CommSecret) -> rlhf_collective::CommConfig {
    let mut c = config(timeout_ms);
    c.secret = Some(s.clone());
    c
}

/// A JOIN hello as rank 1 of a world of 3, as the wire format documents it.
fn hello(nonce: Option<[u8; 32]>) -> Vec<u8> {
    let mut h = b"RLHFCOL\x02".to_vec();
    h.push(1);
    h.extend_from_slice(&1u32.to_le_bytes());
    h.extend_from_slice(&3u32.to_le_bytes());
    let addr = b"127.0.0.1:9";
    h.extend_from_slice(&(addr.len() as u16).to_le_bytes());
    h.extend_from_slice(addr);
    match nonce {
        Some(n) => {
            h.push(1);
            h.extend_from_slice(&n);
        }
        None => h.push(0),
    }
    h
}

/// Connects, sends `first`, then `then` once something arrives, and returns all it read
/// before rank 0 closed the connection.
fn intruder(addr: String, first: Vec<u8>, then: Vec<u8>) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut s = TcpStream::connect(&addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.write_all(&first).expect("hello");
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    let _ = s.write_all(&then);
                }
            }
        }
        got
    })
}

#[test]
fn a_world_with_a_secret_reduces_as_before() {
    let s = CommSecret::generate();
    let mut comms = world(3, with_secret(10_000, &s));
    let got = run_all(&mut comms, |r, c| {
        let mut v = vec![r as f32 + 1.0; 5];
        c.all_reduce_f32(&mut v, ReduceOp::Sum).map(|_| v)
    });
    for g in got {
        assert_eq!(g.unwrap(), vec![6.0; 5]);
    }
}

#[test]
fn strangers_get_nothing_and_the_real_ranks_still_join() {
    let secret = CommSecret::generate();
    let rv = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let addr = rv.local_addr().to_string();
    // Both strangers claim rank 1 before the real one: one without authentication, one
    // with a nonce and then a forged tag.
    let plain = intruder(addr.clone(), hello(None), vec![]);
    let forged = intruder(addr.clone(), hello(Some([7; 32])), vec![0x55; 32]);
    thread::sleep(Duration::from_millis(200));
    let ranks: Vec<_> = (1..3)
        .map(|r| {
            let (addr, cfg) = (addr.clone(), with_secret(15_000, &secret));
            thread::spawn(move || TcpCommunicator::connect(r, 3, &addr, cfg))
        })
        .collect();
    let mut comms = vec![rv.accept(3, with_secret(15_000, &secret)).expect("rank 0")];
    for h in ranks {
        comms.push(h.join().unwrap().expect("a real rank"));
    }
    let weights = pattern(100_000, 3);
    let got = run_all(&mut comms, |r, c| {
        let mut buf = if r == 0 {
            weights.clone()
        } else {
            vec![0; weights.len()]
        };
        c.broadcast(&mut buf, 0).map(|_| buf)
    });
    for g in got {
        assert!(g.unwrap() == weights);
    }
    let plain = plain.join().unwrap();
    assert!(
        plain.is_empty(),
        "no authentication, no bytes: got {}",
        plain.len()
    );
    // The forged one saw the challenge (a nonce and a tag, 64 bytes) and nothing after.
    let forged = forged.join().unwrap();
    assert_eq!(forged.len(), 64, "challenge only");
}

#[test]
fn a_rank_with_another_secret_is_refused_by_name() {
    let rv = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let addr = rv.local_addr().to_string();
    let other = thread::spawn(move || {
        TcpCommunicator::connect(1, 2, &addr, with_secret(2_000, &CommSecret::generate()))
    });
    let e = rv
        .accept(2, with_secret(2_000, &CommSecret::generate()))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.to_string().contains("ranks 1 never joined"), "{e}");
    let e = other.join().unwrap().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    assert!(e.to_string().contains("secret"), "{e}");
}

/// A JOIN hello as rank 1 of a world of 3 whose listener address is `addr_len` bytes long.
fn hello_with_addr(addr_len: usize) -> Vec<u8> {
    let mut h = b"RLHFCOL\x02".to_vec();
    h.push(1);
    h.extend_from_slice(&1u32.to_le_bytes());
    h.extend_from_slice(&3u32.to_le_bytes());
    h.extend_from_slice(&(addr_len as u16).to_le_bytes());
    h.extend(std::iter::repeat_n(b'a', addr_len));
    h.push(0);
    h
}

/// A slow-loris peer: connects, sends `bytes` one at a time `every` apart (all at once when
/// `every` is zero), then waits; returns how long after connecting rank 0 closed the
/// connection, or `None` if it was still open after 30 s.
fn dribbler(addr: String, bytes: Vec<u8>, every: Duration) -> thread::JoinHandle<Option<Duration>> {
    thread::spawn(move || {
        let mut s = TcpStream::connect(&addr).expect("connect");
        let t0 = std::time::Instant::now();
        let poll = if every.is_zero() {
            Duration::from_millis(20)
        } else {
            every
        };
        s.set_read_timeout(Some(poll)).unwrap();
        if every.is_zero() {
            let _ = s.write_all(&bytes);
        }
        let mut sent = if every.is_zero() { bytes.len() } else { 0 };
        let mut buf = [0u8; 256];
        while t0.elapsed() < Duration::from_secs(30) {
            if sent < bytes.len() {
                if s.write_all(&bytes[sent..=sent]).is_err() {
                    return Some(t0.elapsed());
                }
                sent += 1;
            }
            match s.read(&mut buf) {
                Ok(0) => return Some(t0.elapsed()),
                Ok(_) => {}
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(_) => return Some(t0.elapsed()),
            }
        }
        None
    })
}

#[test]
fn a_dribbling_stranger_does_not_hold_up_the_real_ranks() {
    let secret = CommSecret::generate();
    let rv = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let addr = rv.local_addr().to_string();
    // Connects first and sends a well-formed hello one byte every 300 ms (it would take
    // about 2.5 minutes to finish).
    let slow = dribbler(
        addr.clone(),
        hello_with_addr(500),
        Duration::from_millis(300),
    );
    thread::sleep(Duration::from_millis(200));
    let t0 = std::time::Instant::now();
    let ranks: Vec<_> = (1..3)
        .map(|r| {
            let (addr, cfg) = (addr.clone(), with_secret(20_000, &secret));
            thread::spawn(move || TcpCommunicator::connect(r, 3, &addr, cfg))
        })
        .collect();
    let mut comms = vec![rv.accept(3, with_secret(20_000, &secret)).expect("rank 0")];
    for h in ranks {
        comms.push(h.join().unwrap().expect("a real rank"));
    }
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "the real ranks joined only after {took:?} while a stranger dribbled"
    );
    let got = run_all(&mut comms, |r, c| {
        let mut v = vec![r as f32; 4];
        c.all_reduce_f32(&mut v, ReduceOp::Sum).map(|_| v)
    });
    for g in got {
        assert_eq!(g.unwrap(), vec![3.0; 4]);
    }
    drop(comms);
    // The rendezvous is over: the stranger's half-read hello was cut off with it.
    let closed = slow.join().unwrap();
    assert!(closed.is_some(), "the dribbling stranger was never cut off");
}

#[test]
fn a_stranger_is_cut_off_at_the_handshake_limit_and_a_huge_address_at_once() {
    let rv = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let addr = rv.local_addr().to_string();
    let rank0 = thread::spawn(move || rv.accept(2, config(30_000)));
    // A hello announcing a 65,535-byte address: refused as soon as the length is read.
    let huge = dribbler(
        addr.clone(),
        hello_with_addr(65_535)[..19].to_vec(),
        Duration::ZERO,
    );
    // A hello that never ends: 1 byte every 200 ms, so every single read succeeds in time.
    let slow = dribbler(
        addr.clone(),
        hello_with_addr(400),
        Duration::from_millis(200),
    );
    let huge = huge
        .join()
        .unwrap()
        .expect("the huge address was never refused");
    assert!(huge < Duration::from_secs(1), "refused only after {huge:?}");
    let slow = slow
        .join()
        .unwrap()
        .expect("the dribbler was never cut off");
    assert!(
        slow >= Duration::from_millis(4500) && slow < Duration::from_secs(7),
        "cut off after {slow:?}, expected the 5 s handshake limit"
    );
    // The wait went on: a real rank still joins.
    let one = TcpCommunicator::connect(1, 2, &addr, config(10_000)).expect("rank 1");
    let zero = rank0.join().unwrap().expect("rank 0");
    assert_eq!((zero.rank(), one.rank()), (0, 1));
}
