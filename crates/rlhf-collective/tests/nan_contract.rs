//! The NaN contract, as one table every backend must pass: Sum and Avg give NaN where any
//! rank holds one (IEEE arithmetic), and Max does too ([`ReduceOp::Max`]: a bad loss or
//! gradient is never hidden), for f32 and f64 all-reduce and f32 reduce-scatter. Why a file
//! of its own: the backends implement reductions separately (TCP's ring, shared memory's
//! slots, NCCL's kernels with a NaN mask on top), and NCCL's own Max drops NaN; the table is
//! the one place that says what all of them must give.
//!
//! TCP and shared memory run here; NCCL needs two GPUs (`RLHF_TEST_GPUS=2 cargo test -p
//! rlhf-collective --features nccl --test nan_contract -- --ignored`).

mod common;

use rlhf_collective::{Communicator, ReduceOp};

const N: f64 = f64::NAN;
const INF: f64 = f64::INFINITY;

/// (reduction, each rank's values, the result: `None` for NaN).
type Case = (ReduceOp, [[f64; 4]; 2], [Option<f64>; 4]);

fn table() -> Vec<Case> {
    vec![
        (
            ReduceOp::Max,
            [[1.0, N, 3.0, -1.0], [2.0, 0.5, N, N]],
            [Some(2.0), None, None, None],
        ),
        (
            ReduceOp::Max,
            [[N, -INF, 5.0, -0.5], [N, -3.0, 6.0, -0.25]],
            [None, Some(-3.0), Some(6.0), Some(-0.25)],
        ),
        (
            ReduceOp::Sum,
            [[1.0, N, INF, 1.0], [2.0, 1.0, -INF, 2.0]],
            [Some(3.0), None, None, Some(3.0)],
        ),
        (
            ReduceOp::Avg,
            [[3.0, N, 0.0, 1.5], [3.0, 1.0, 0.0, 1.5]],
            [Some(3.0), None, Some(0.0), Some(1.5)],
        ),
    ]
}

fn check(backend: &str, what: &str, case: usize, got: &[f64], want: &[Option<f64>]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        match w {
            None => assert!(
                g.is_nan(),
                "{backend} {what} case {case} element {i}: {g}, want NaN"
            ),
            Some(w) => assert_eq!(
                *g, *w,
                "{backend} {what} case {case} element {i}: {g}, want {w}"
            ),
        }
    }
}

/// Runs the whole table on a world of two `comms`.
fn conforms(comms: &mut [Box<dyn Communicator>]) {
    let backend = comms[0].backend();
    for (k, (op, inputs, want)) in table().into_iter().enumerate() {
        let got = common::run_all(comms, |r, c| {
            let mut v32: Vec<f32> = inputs[r].iter().map(|&x| x as f32).collect();
            c.all_reduce_f32(&mut v32, op).unwrap();
            let mut v64 = inputs[r].to_vec();
            c.all_reduce_f64(&mut v64, op).unwrap();
            // Segments of 3 and 1 elements: each rank checks its own.
            let counts = [3usize, 1];
            let mut rs: Vec<f32> = inputs[r].iter().map(|&x| x as f32).collect();
            c.reduce_scatter_f32(&mut rs, &counts, op).unwrap();
            let at: usize = counts[..r].iter().sum();
            let seg: Vec<f64> = rs[at..at + counts[r]].iter().map(|&x| x as f64).collect();
            (v32, v64, (at, seg))
        });
        for (v32, v64, (at, seg)) in got {
            let v32: Vec<f64> = v32.iter().map(|&x| x as f64).collect();
            check(backend, &format!("{op:?} f32 all_reduce"), k, &v32, &want);
            check(backend, &format!("{op:?} f64 all_reduce"), k, &v64, &want);
            check(
                backend,
                &format!("{op:?} f32 reduce_scatter"),
                k,
                &seg,
                &want[at..at + seg.len()],
            );
        }
    }
}

#[test]
fn tcp_keeps_the_nan_contract() {
    let mut comms: Vec<Box<dyn Communicator>> = common::world(2, common::config(10_000))
        .into_iter()
        .map(|c| Box::new(c) as Box<dyn Communicator>)
        .collect();
    conforms(&mut comms);
}

#[cfg(target_os = "linux")]
#[test]
fn shared_memory_keeps_the_nan_contract() {
    use rlhf_collective::shm::{ShmCommunicator, ShmRendezvous, DEFAULT_SLOT_BYTES};
    let n = 2;
    let rv = ShmRendezvous::create(DEFAULT_SLOT_BYTES).unwrap();
    let addr = rv.address().to_string();
    let hs: Vec<_> = (1..n)
        .map(|r| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                ShmCommunicator::connect(r, n, &addr, common::config(10_000))
            })
        })
        .collect();
    let mut comms: Vec<Box<dyn Communicator>> =
        vec![Box::new(rv.accept(n, common::config(10_000)).unwrap())];
    for h in hs {
        comms.push(Box::new(h.join().unwrap().unwrap()));
    }
    conforms(&mut comms);
}

/// NCCL's Max drops NaN; the backend's NaN mask must put it back. Needs two GPUs (NCCL
/// allows one rank of a communicator per GPU).
#[cfg(feature = "nccl")]
#[test]
#[ignore = "needs 2 GPUs: RLHF_TEST_GPUS=2 cargo test -p rlhf-collective --features nccl --test nan_contract -- --ignored"]
fn nccl_keeps_the_nan_contract() {
    use rlhf_collective::nccl::{self, NcclCommunicator};
    let gpus: usize = std::env::var("RLHF_TEST_GPUS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    assert!(gpus >= 2, "set RLHF_TEST_GPUS to the GPUs here (2 or more)");
    let id = nccl::unique_id().unwrap();
    let hs: Vec<_> = (0..2)
        .map(|r| {
            std::thread::spawn(move || NcclCommunicator::new(r, 2, r, &id, &common::config(60_000)))
        })
        .collect();
    let mut comms: Vec<Box<dyn Communicator>> = hs
        .into_iter()
        .map(|h| Box::new(h.join().unwrap().unwrap()) as Box<dyn Communicator>)
        .collect();
    conforms(&mut comms);
}
