//! BucketedSync over the TCP backend: checksums, bucket boundaries, mismatches.

mod common;

use common::{config, pattern, run_all, world};
use rlhf_collective::{
    checksum, BucketedSync, Communicator, DType, ErrorKind, Param, ParamMut, ReduceOp, Result,
    TcpCommunicator,
};

/// (name, shape, dtype) of a model-like parameter list: one tensor larger than
/// the bucket, many tiny ones, an empty one, bf16 and odd-length u8 data.
fn layout() -> Vec<(String, Vec<usize>, DType)> {
    let mut v = vec![
        ("embed".to_string(), vec![25, 50], DType::F32),
        ("empty".to_string(), vec![0, 4], DType::F32),
        ("bf16.w".to_string(), vec![33, 3], DType::BF16),
        ("mask".to_string(), vec![77], DType::U8),
    ];
    for i in 0..60 {
        v.push((format!("layers.{i}.bias"), vec![1 + i % 3], DType::F32));
    }
    v.push(("head".to_string(), vec![300], DType::F64));
    v
}

fn bytes_for(shape: &[usize], dt: DType) -> usize {
    shape.iter().product::<usize>() * dt.size()
}

/// The root's data for parameter `i`; receivers start from zeros.
fn buffers(rank: usize, root: usize) -> Vec<Vec<u8>> {
    layout()
        .iter()
        .enumerate()
        .map(|(i, (_, shape, dt))| {
            let n = bytes_for(shape, *dt);
            if rank == root {
                pattern(n, 1000 + i as u64)
            } else {
                vec![0u8; n]
            }
        })
        .collect()
}

fn sync_world<C: Communicator>(
    c: &mut C,
    sync: &BucketedSync,
    root: usize,
    bufs: &mut [Vec<u8>],
) -> Result<(u64, u64, rlhf_collective::SyncStats)> {
    let lay = layout();
    if c.rank() == root {
        let params: Vec<Param<'_>> = lay
            .iter()
            .zip(bufs.iter())
            .map(|((n, s, d), b)| Param::new(n.clone(), s, *d, b))
            .collect::<Result<_>>()?;
        let before = checksum(&params);
        let stats = sync.send(c, &params)?;
        Ok((before, checksum(&params), stats))
    } else {
        let mut params: Vec<ParamMut<'_>> = lay
            .iter()
            .zip(bufs.iter_mut())
            .map(|((n, s, d), b)| ParamMut::new(n.clone(), s, *d, b))
            .collect::<Result<_>>()?;
        let before = checksum(&params);
        let stats = sync.recv(c, root, &mut params)?;
        Ok((before, checksum(&params), stats))
    }
}

#[test]
fn sync_makes_checksums_equal_and_corruption_shows() {
    let total: usize = layout().iter().map(|(_, s, d)| bytes_for(s, *d)).sum();
    for (n, root, bucket) in [(2, 0, 1000), (3, 1, 1000), (4, 3, 7), (3, 0, 1 << 20)] {
        let sync = BucketedSync::new(bucket).unwrap();
        let mut comms = world(n, config(10_000));
        let mut bufs: Vec<Vec<Vec<u8>>> = (0..n).map(|r| buffers(r, root)).collect();
        let results = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter_mut()
                .zip(bufs.iter_mut())
                .map(|(c, b)| {
                    let sync = &sync;
                    s.spawn(move || sync_world(c, sync, root, b))
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        let results: Vec<_> = results
            .into_iter()
            .enumerate()
            .map(|(r, x)| x.unwrap_or_else(|e| panic!("world {n} root {root} rank {r}: {e}")))
            .collect();
        let trainer = results[root].1;
        for (r, (before, after, stats)) in results.iter().enumerate() {
            assert_eq!(
                *after, trainer,
                "world {n}: rank {r} checksum differs after sync"
            );
            if r != root {
                assert_ne!(
                    *before, trainer,
                    "rank {r} matched before the sync: test is vacuous"
                );
            }
            assert_eq!(stats.bytes as usize, total);
            assert_eq!(stats.buckets, total.div_ceil(bucket), "bucket count");
            assert_eq!(stats.params, layout().len());
        }
        for (r, b) in bufs.iter().enumerate() {
            assert!(*b == bufs[root], "rank {r} data differs");
        }

        // A single flipped bit in one receiver parameter changes its checksum.
        let victim = (root + 1) % n;
        bufs[victim][2][5] ^= 0x10;
        let lay = layout();
        let params: Vec<Param<'_>> = lay
            .iter()
            .zip(bufs[victim].iter())
            .map(|((nm, s, d), b)| Param::new(nm.clone(), s, *d, b).unwrap())
            .collect();
        assert_ne!(checksum(&params), trainer, "corruption not detected");
    }
}

#[test]
fn a_parameter_spanning_two_default_buckets() {
    // 40 MiB f32 tensor, default 32 MiB buckets: two broadcasts.
    let elems = 10 << 20;
    let src: Vec<f32> = (0..elems).map(|i| i as f32 * 0.5).collect();
    let sync = BucketedSync::default();
    let mut comms = world(2, config(20_000));
    let out = run_all(&mut comms, |r, c| {
        if r == 0 {
            let p = [Param::f32("big", &[elems], &src).unwrap()];
            sync.send(c, &p).map(|s| (s, checksum(&p)))
        } else {
            let mut dst = vec![0f32; elems];
            let mut p = [ParamMut::f32("big", &[elems], &mut dst).unwrap()];
            let s = sync.recv(c, 0, &mut p)?;
            let sum = checksum(&p);
            assert!(dst == src, "received tensor differs");
            Ok((s, sum))
        }
    });
    let (s0, c0) = out[0].as_ref().unwrap();
    let (s1, c1) = out[1].as_ref().unwrap();
    assert_eq!(s0.buckets, 2);
    assert_eq!(s1.buckets, 2);
    assert_eq!(c0, c1);
}

#[test]
fn different_parameter_lists_fail_on_every_rank_naming_the_parameter() {
    let mut comms = world(3, config(10_000));
    let sync = BucketedSync::new(64).unwrap();
    let out = run_all(&mut comms, |r, c| {
        let shape = if r == 2 { [4, 2] } else { [2, 4] };
        let mut data = vec![r as f32; 8];
        let other = vec![1.0f32; 3];
        if r == 0 {
            let p = [
                Param::f32("a", &[3], &other).unwrap(),
                Param::f32("layer.1.w", &shape, &data).unwrap(),
            ];
            sync.send(c, &p).map(|_| ())
        } else {
            let mut o2 = other.clone();
            let mut p = [
                ParamMut::f32("a", &[3], &mut o2).unwrap(),
                ParamMut::f32("layer.1.w", &shape, &mut data).unwrap(),
            ];
            sync.recv(c, 0, &mut p).map(|_| ())
        }
    });
    for (r, o) in out.into_iter().enumerate() {
        let e = o.expect_err("lists differ");
        assert_eq!(e.kind(), ErrorKind::Mismatch, "rank {r}: {e}");
        let msg = e.to_string();
        assert!(
            msg.contains("'layer.1.w'") && msg.contains("[4, 2]") && msg.contains("rank 2"),
            "rank {r}: {msg}"
        );
    }
    // The manifest check leaves the communicator usable.
    let ok = run_all(&mut comms, |_, c| c.barrier());
    assert!(ok.iter().all(|r| r.is_ok()));
}

#[test]
fn root_must_send_not_recv() {
    let mut c = TcpCommunicator::single(config(1000));
    let mut d = [0f32; 2];
    let mut p = [ParamMut::f32("x", &[2], &mut d).unwrap()];
    let e = BucketedSync::default().recv(&mut c, 0, &mut p).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    // World of one: send is a no-op that still succeeds.
    let s = [1.0f32, 2.0];
    let stats = BucketedSync::default()
        .send(&mut c, &[Param::f32("x", &[2], &s).unwrap()])
        .unwrap();
    assert_eq!(stats.bytes, 8);
}

/// Uses only the required trait methods, so the default (staging) multi-part
/// broadcast implementations are exercised.
struct DefaultsOnly(TcpCommunicator);

impl Communicator for DefaultsOnly {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn backend(&self) -> &'static str {
        "defaults-only"
    }
    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<()> {
        self.0.broadcast(buf, root)
    }
    fn all_reduce_f32(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        self.0.all_reduce_f32(buf, op)
    }
    fn all_reduce_f64(&mut self, buf: &mut [f64], op: ReduceOp) -> Result<()> {
        self.0.all_reduce_f64(buf, op)
    }
    fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.0.all_gather(data)
    }
    fn barrier(&mut self) -> Result<()> {
        self.0.barrier()
    }
}

#[test]
fn default_trait_methods_stage_correctly() {
    let mut comms: Vec<DefaultsOnly> = world(3, config(10_000))
        .into_iter()
        .map(DefaultsOnly)
        .collect();
    let root = 2;
    let sync = BucketedSync::new(333).unwrap();
    let mut bufs: Vec<Vec<Vec<u8>>> = (0..3).map(|r| buffers(r, root)).collect();
    let results = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter_mut()
            .zip(bufs.iter_mut())
            .map(|(c, b)| {
                let sync = &sync;
                s.spawn(move || sync_world(c, sync, root, b).map(|x| x.1))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(results.iter().all(|c| *c == results[root]));
    for b in &bufs {
        assert!(*b == bufs[root]);
    }
}
