use std::os::fd::AsRawFd;

use super::segment::claimed;
use super::*;
use rlhf_core::batch::checksum;
use rlhf_core::TensorData;

fn batch(rows: usize, salt: f32) -> DataBatch {
    let v: Vec<f32> = (0..rows * 8).map(|i| i as f32 * 0.5 + salt).collect();
    DataBatch::new()
        .with_tensor("values", TensorData::from_f32(vec![rows, 8], &v).unwrap())
        .with_column("id", (0..rows).map(|i| serde_json::json!(i)).collect())
}

/// A batch reads back as views of the segment; the segment cannot be taken for another
/// batch while those views live, and can once they are gone.
#[test]
fn a_batch_reads_back_as_views_and_its_segment_is_reused_after_the_views_go() {
    let a = batch(3000, 0.0);
    let fa = SharedFile::write(&a).unwrap();
    let seg = fa.seg.clone();
    let got = open(&fa.chunk(), 1 << 30).unwrap().unwrap();
    drop(fa);
    assert_eq!(got, a);
    assert_eq!(checksum(&got), checksum(&a));
    assert!(got.tensors["values"].data.is_view());
    assert!(!seg.take(), "taken while a reader's views point into it");
    // More batches meanwhile go to other segments and leave these views alone.
    let b = batch(3000, 1.0);
    let fb = SharedFile::write(&b).unwrap();
    assert!(!Arc::ptr_eq(&fb.seg, &seg));
    let got_b = open(&fb.chunk(), 1 << 30).unwrap().unwrap();
    assert_eq!((&got, &got_b), (&a, &b));
    let views = got.tensors["values"].clone();
    drop(got);
    assert!(!seg.take(), "one view is enough to hold the segment");
    drop(views);
    assert!(seg.take(), "free once the last view is gone");
    seg.map.header().lease.store(FREE, Ordering::Release);
}

#[test]
fn a_wrong_id_or_descriptor_is_unreachable_a_late_claim_and_a_big_batch_errors() {
    let b = batch(10, 0.0);
    let f = SharedFile::write(&b).unwrap();
    let mut c = f.chunk();
    if let Some(s) = &mut c.shared {
        s.nonce = vec![0u8; ID_BYTES];
    }
    assert!(open(&c, 1 << 30)
        .unwrap()
        .unwrap_err()
        .0
        .contains("another segment"));
    let mut c = f.chunk();
    if let Some(s) = &mut c.shared {
        s.fd = 1_000_000;
    }
    assert!(open(&c, 1 << 30)
        .unwrap()
        .unwrap_err()
        .0
        .contains("cannot open"));
    // An ordinary file is no segment.
    let plain = tempfile::tempfile().unwrap();
    plain.set_len(3 * PAGE as u64).unwrap();
    let mut c = f.chunk();
    if let Some(s) = &mut c.shared {
        s.fd = plain.as_raw_fd();
    }
    assert!(open(&c, 1 << 30)
        .unwrap()
        .unwrap_err()
        .0
        .contains("not sealed"));
    assert!(open(&f.chunk(), 10).is_err(), "over the limit");
    // A generation the sender took back cannot be claimed.
    let c = f.chunk();
    drop(f);
    let err = open(&c, 1 << 30).unwrap_err().to_string();
    assert!(err.contains("is gone"), "{err}");
    let status = unreachable_status(&Unreachable("x".into()));
    assert!(is_unreachable(&status));
    assert!(!is_unreachable(&tonic::Status::failed_precondition("x")));
}

/// A claim by a process that has died does not keep the segment from the sender.
#[test]
fn a_claim_by_a_dead_process_is_taken_back() {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let f = SharedFile::write(&batch(100_000, 0.0)).unwrap();
    let seg = f.seg.clone();
    let h = seg.map.header();
    assert!(h.swap_lease(written(f.generation), claimed(f.generation, dead)));
    drop(f);
    assert!(seg.take(), "the dead claimant's segment is free again");
    h.lease.store(FREE, Ordering::Release);
    // A live claimant keeps it.
    let f = SharedFile::write(&batch(100_000, 0.0)).unwrap();
    let seg = f.seg.clone();
    assert!(seg.map.header().swap_lease(
        written(f.generation),
        claimed(f.generation, std::process::id())
    ));
    assert!(!seg.take());
    seg.map.header().lease.store(FREE, Ordering::Release);
}

#[test]
fn segment_sizes_round_up_by_at_most_a_quarter() {
    for need in [1usize, 4096, 1 << 20, (1 << 20) + 1, 3 << 20, 100_000_000] {
        let s = segment_size(need);
        assert!(s >= need && s >= MIN_SEGMENT);
        assert!(
            need < MIN_SEGMENT || (s - need) * 4 <= need,
            "{need} -> {s}"
        );
        assert_eq!(s % PAGE, 0);
    }
}

/// Loopback and this host's own addresses may share memory; an address of no interface
/// here (TEST-NET-1, documentation only) is surely another host's; a name is not judged.
#[test]
fn an_address_of_no_interface_here_is_another_hosts() {
    assert!(!on_another_host("127.0.0.1:9"));
    assert!(!on_another_host("[::1]:9"));
    assert!(!on_another_host("head.example:9"), "names are not judged");
    assert!(on_another_host("192.0.2.1:9"));
    assert!(on_another_host("[2001:db8::1]:9") || !ipv6_configured());
    // One of this host's own non-loopback addresses, where it has one: the one a socket
    // bound to all interfaces gets a route from (no packet is sent).
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    if probe.connect("192.0.2.1:9").is_ok() {
        let own = probe.local_addr().unwrap();
        if !own.ip().is_unspecified() {
            assert!(!on_another_host(&format!("{}:9", own.ip())), "{own}");
        }
    }
}

fn ipv6_configured() -> bool {
    std::net::UdpSocket::bind("[::1]:0").is_ok()
}
