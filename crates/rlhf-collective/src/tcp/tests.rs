//! Unit tests of the TCP communicator's framing, headers and reductions.

use super::frame::set_io_timeout;
use super::*;
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

#[test]
fn header_roundtrip_and_mismatch_text() {
    let h = Header {
        op: Op::AllReduce.wire_id(),
        aux: ReduceOp::Avg.wire_id() | (1 << 4),
        root: 0,
        seq: 7,
        len: 4096,
    };
    assert_eq!(Header::decode(&h.encode()), h);
    let other = Header { len: 4100, ..h };
    let msg = h.mismatch(&other).expect("lengths differ");
    assert!(msg.contains("4096") && msg.contains("4100"), "{msg}");
    assert!(msg.contains("buffer lengths"), "{msg}");
    let gather = Header {
        op: Op::AllGather.wire_id(),
        ..h
    };
    assert!(gather.mismatch(&Header { len: 1, ..gather }).is_none());
    let mut bad = h.encode();
    bad[0] = 0;
    assert!(h
        .mismatch(&Header::decode(&bad))
        .unwrap()
        .contains("unknown message"));
}

#[test]
fn split_pair_handles_order_and_empty() {
    let mut v: Vec<u32> = (0..10).collect();
    let (a, b) = split_pair(&mut v, 0..3, 5..8);
    assert_eq!(a, &[0, 1, 2]);
    assert_eq!(b, &mut [5, 6, 7]);
    let (a, b) = split_pair(&mut v, 6..9, 1..2);
    assert_eq!(a, &[6, 7, 8]);
    assert_eq!(b, &mut [1]);
    let (a, b) = split_pair(&mut v, 4..4, 4..6);
    assert!(a.is_empty());
    assert_eq!(b.len(), 2);
    let (a, b) = split_pair(&mut v, 4..6, 4..4);
    assert_eq!(a.len(), 2);
    assert!(b.is_empty());
}

#[test]
fn lying_block_lengths_fail_cleanly() {
    use std::net::TcpListener;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let peer = std::thread::spawn(move || {
        // 32 GiB announced, 100 bytes sent, then the peer leaves.
        let mut a = TcpStream::connect(addr).unwrap();
        a.write_all(&(1u64 << 35).to_le_bytes()).unwrap();
        a.write_all(&[1; 100]).unwrap();
        drop(a);
        // 1 TiB announced: over the bound.
        let mut b = TcpStream::connect(addr).unwrap();
        b.write_all(&(1u64 << 40).to_le_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    });
    let config = CommConfig::with_timeout(Duration::from_secs(5));
    let ctx = Ctx {
        op: Op::AllGather,
        rank: 0,
        config: &config,
    };
    let link = |s: TcpStream| {
        set_io_timeout(&s, config.timeout);
        Link {
            stream: Conn::plain(s),
            peer: 1,
        }
    };
    let e = recv_block(&ctx, &link(l.accept().unwrap().0)).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::PeerClosed, "{e}");
    let e = recv_block(&ctx, &link(l.accept().unwrap().0)).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Mismatch, "{e}");
    assert!(e.to_string().contains("at most"), "{e}");
    peer.join().unwrap();
}

#[test]
fn max_propagates_nan() {
    let mut d = [1.0f32, 5.0, f32::NAN];
    f32::reduce(&mut d, &[2.0, f32::NAN, 0.0], ReduceOp::Max);
    assert_eq!(d[0], 2.0);
    assert!(d[1].is_nan() && d[2].is_nan());
}
