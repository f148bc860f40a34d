//! Reduce-scatter on the TCP ring and the bucketed stream ZeRO stage 2 feeds gradients into:
//! each rank ends with exactly the serial sum of its own segment, for uneven and empty
//! segments, and ranks that cut the buffer differently are told so.

mod common;

use common::{config, run_all, serial, world};
use rlhf_collective::{Communicator, ErrorKind, ReduceOp, ReduceScatterStream};

/// Integer-valued floats: every summation order is exact, so results must equal the serial
/// ones bit for bit.
fn ints(len: usize, rank: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 31 + rank * 17) % 101) as f32 - 50.0)
        .collect()
}

#[test]
fn reduce_scatter_gives_each_rank_its_reduced_segment_for_worlds_1_to_4() {
    for n in 1..=4 {
        let mut comms = world(n, config(10_000));
        // Even, uneven, empty and one-rank-takes-all cuts.
        let cuts: Vec<Vec<usize>> = vec![
            vec![1000; n],
            (0..n).map(|r| 3 + r * 250_001).collect(),
            (0..n).map(|r| if r % 2 == 0 { 0 } else { 77 }).collect(),
            (0..n).map(|r| if r == n - 1 { 5000 } else { 0 }).collect(),
        ];
        for counts in &cuts {
            let len: usize = counts.iter().sum();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| ints(len, r)).collect();
                let want = serial(&inputs, op);
                let got = run_all(&mut comms, |r, c| {
                    let mut v = ints(len, r);
                    c.reduce_scatter_f32(&mut v, counts, op).map(|_| v)
                });
                let mut at = 0;
                for (r, g) in got.into_iter().enumerate() {
                    let g = g.unwrap_or_else(|e| panic!("world {n} {counts:?} {op:?}: {e}"));
                    let seg = at..at + counts[r];
                    assert!(
                        g[seg.clone()] == want[seg.clone()],
                        "world {n} counts {counts:?} {op:?}: rank {r}'s segment differs"
                    );
                    at = seg.end;
                }
            }
        }
    }
}

#[test]
fn bad_counts_are_refused_and_different_cuts_are_a_mismatch() {
    let mut comms = world(2, config(5_000));
    let got = run_all(&mut comms, |_, c| {
        c.reduce_scatter_f32(&mut [1.0; 4], &[1, 2], ReduceOp::Sum)
    });
    for g in got {
        let e = g.expect_err("counts do not add up");
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("adding up to"), "{e}");
    }
    let got = run_all(&mut comms, |r, c| {
        let counts = if r == 0 { [1, 3] } else { [2, 2] };
        c.reduce_scatter_f32(&mut [1.0; 4], &counts, ReduceOp::Sum)
    });
    for (r, g) in got.into_iter().enumerate() {
        let e = g.expect_err("cuts differ");
        assert_eq!(e.kind(), ErrorKind::Mismatch, "rank {r}: {e}");
        assert!(e.to_string().contains("segment counts"), "rank {r}: {e}");
    }
}

/// The stream cuts a vector pushed in pieces of any size (zeros included) into buckets,
/// adds each rank's reduced span into its output, and makes one call per bucket.
#[test]
fn the_stream_adds_each_ranks_reduced_span_bucket_by_bucket() {
    let n = 3;
    let pieces = [0usize, 5, 1000, 3, 25_000, 0, 1];
    let total: usize = pieces.iter().sum();
    let bounds = vec![0, 9_000, 9_001, total];
    let mut comms = world(n, config(10_000));
    for bucket in [997usize, 4096, 1 << 20] {
        let got = run_all(&mut comms, |r, c| {
            let v = ints(total, r);
            let me = bounds[r]..bounds[r + 1];
            // Start from ones: the stream adds, it does not overwrite.
            let mut out = vec![1.0f32; me.len()];
            let mut s =
                ReduceScatterStream::new(c, bounds.clone(), &mut out, ReduceOp::Sum, bucket)
                    .unwrap();
            let mut at = 0;
            for (i, &p) in pieces.iter().enumerate() {
                // Rank 1 has no values for piece 4: zeros stand in for them.
                if r == 1 && i == 4 {
                    s.push_zeros(p).unwrap();
                } else {
                    s.push(&v[at..at + p]).unwrap();
                }
                at += p;
            }
            (s.finish().unwrap(), out)
        });
        let zeroed = 1008..1008 + 25_000;
        let all: Vec<Vec<f32>> = (0..n).map(|q| ints(total, q)).collect();
        for (r, (calls, out)) in got.into_iter().enumerate() {
            assert_eq!(calls, total.div_ceil(bucket), "bucket {bucket}");
            for (k, x) in out.iter().enumerate() {
                let i = bounds[r] + k;
                let want: f32 = (0..n)
                    .filter(|&q| !(q == 1 && zeroed.contains(&i)))
                    .map(|q| all[q][i])
                    .sum::<f32>()
                    + 1.0;
                assert_eq!(*x, want, "rank {r} element {i} bucket {bucket}");
            }
        }
    }
    // Too much or too little is an error, not a silent cut.
    let got = run_all(&mut comms, |r, c| {
        let mut out = vec![0.0f32; bounds[r + 1] - bounds[r]];
        let mut s =
            ReduceScatterStream::new(c, bounds.clone(), &mut out, ReduceOp::Sum, 1 << 20).unwrap();
        let over = s.push(&vec![0.0; total + 1]).unwrap_err().to_string();
        s.push(&vec![0.0; total - 1]).unwrap();
        let short = s.finish().unwrap_err().to_string();
        (over, short)
    });
    for (over, short) in got {
        assert!(over.contains("pushed into a vector of"), "{over}");
        assert!(short.contains("were pushed"), "{short}");
    }
}
