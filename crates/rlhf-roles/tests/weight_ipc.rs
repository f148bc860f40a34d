//! The CUDA IPC weight sync's protocol (src/weights/ipc.rs) without a GPU: a trainer and two
//! rollout ranks in threads, over a real shared-memory communicator, with CPU regions standing
//! in for the exported GPU buffer (the GPU path itself runs in scripts/gpu-check.sh). Checks
//! that the ranks agree on the path, that parameters split across buckets arrive whole, that
//! the checksums are of the bytes moved, and that a rank without IPC turns every rank to the
//! host path.

mod common;

use std::thread;

use common::*;
use rlhf_collective::{CommConfig, Communicator, ShmCommunicator, ShmRendezvous};
use rlhf_roles::{Rollout, Trainer};

/// A shared-memory group of `n` ranks in this process.
fn shm_group(n: usize) -> Vec<ShmCommunicator> {
    let rv = ShmRendezvous::create(1 << 16).unwrap();
    let addr = rv.address().to_string();
    let others: Vec<_> = (1..n)
        .map(|r| {
            let a = addr.clone();
            thread::spawn(move || {
                ShmCommunicator::connect(r, n, &a, CommConfig::default()).unwrap()
            })
        })
        .collect();
    let mut v = vec![rv.accept(n, CommConfig::default()).unwrap()];
    v.extend(others.into_iter().map(|h| h.join().unwrap()));
    v
}

struct Synced {
    sent: u64,
    trainer_ipc: Option<bool>,
    rollouts: Vec<(Rollout, u64, Option<bool>)>,
}

/// One sync from `trainer` to two fresh rollouts of `cfg` over `comms`; `cpu_ipc[r]` lets
/// rank r take the IPC protocol with CPU regions.
fn sync(
    trainer: &mut Trainer,
    cfg: &rlhf_config::PpoConfig,
    mut comms: Vec<Box<dyn Communicator>>,
    cpu_ipc: [bool; 3],
    bucket: usize,
) -> Synced {
    let mut c0 = comms.remove(0);
    let hs: Vec<_> = comms
        .into_iter()
        .zip([cpu_ipc[1], cpu_ipc[2]])
        .map(|(mut c, allow)| {
            let cfg = cfg.clone();
            thread::spawn(move || {
                let mut r = rollout(&cfg);
                r.ipc.allow_cpu = allow;
                let (_, sum) = r.recv_weights(c.as_mut(), 3, bucket).unwrap();
                let ipc = r.ipc.last_was_ipc();
                (r, sum, ipc)
            })
        })
        .collect();
    trainer.ipc.allow_cpu = cpu_ipc[0];
    let (stats, sent) = trainer.send_weights(c0.as_mut(), 3, bucket).unwrap();
    assert!(stats.bytes > 0 && stats.params > 0);
    if trainer.ipc.last_was_ipc() == Some(true) {
        assert!(
            stats.buckets > 1,
            "{} bytes in buckets of {bucket}",
            stats.bytes
        );
    }
    Synced {
        sent,
        trainer_ipc: trainer.ipc.last_was_ipc(),
        rollouts: hs.into_iter().map(|h| h.join().unwrap()).collect(),
    }
}

fn log_probs(t: &Trainer, seqs: &rlhf_core::batch::DataBatch) -> Vec<f32> {
    log_probs_of(t, seqs).unwrap().tensors["log_probs"]
        .to_f32()
        .unwrap()
}

fn boxed<C: Communicator + 'static>(v: Vec<C>) -> Vec<Box<dyn Communicator>> {
    v.into_iter()
        .map(|c| Box::new(c) as Box<dyn Communicator>)
        .collect()
}

fn trained_trainer() -> Trainer {
    let cfg = config();
    let seqs = sequences(&LENS, 33);
    let mut t = trainer(&cfg, 0, 1);
    let batch = actor_batch(&seqs, &log_probs(&t, &seqs), 4);
    t.upd(&mut single(), &batch).unwrap();
    t
}

/// The CUDA IPC checksum of a model's weights: `ipc::hash` over its parameters laid end to
/// end in its dtype.
fn ipc_sum(model: &rlhf_model::Model) -> u64 {
    let mut off = 0u64;
    let mut sum = 0u64;
    for (_, t) in model.named_tensors() {
        sum = sum.wrapping_add(rlhf_model::ipc::hash(&t.contiguous().unwrap(), off / 2).unwrap());
        off += (t.elem_count() * t.dtype().size_in_bytes()) as u64;
    }
    sum
}

#[test]
fn ipc_sync_moves_the_trainers_weights_in_buckets_and_checksums_what_arrived() {
    let mut t = trained_trainer();
    let host_sum = t.state.checksum().unwrap();
    let want = params(&t.state.model);
    // 1000-byte buckets: most parameters of the tiny model span several.
    let s = sync(&mut t, &config(), boxed(shm_group(3)), [true; 3], 1000);
    assert_eq!(s.trainer_ipc, Some(true));
    assert_eq!(s.sent, ipc_sum(&t.state.model));
    assert_ne!(s.sent, host_sum, "the IPC checksum is its own function");
    for (r, sum, ipc) in &s.rollouts {
        assert_eq!(*ipc, Some(true));
        assert_eq!(*sum, s.sent);
        assert_eq!(params(&r.model), want, "rollout weights after the sync");
        assert_eq!(r.checksum().unwrap(), host_sum);
        assert_eq!(r.version, 3);
    }

    // A second sync reuses the buffer and its mapping, and moves the new weights.
    let seqs = sequences(&LENS, 9);
    let batch = actor_batch(&seqs, &log_probs(&t, &seqs), 5);
    t.upd(&mut single(), &batch).unwrap();
    let s2 = sync(&mut t, &config(), boxed(shm_group(3)), [true; 3], 1000);
    assert_ne!(s2.sent, s.sent);
    for (r, _, _) in &s2.rollouts {
        assert_eq!(params(&r.model), params(&t.state.model));
    }
}

#[test]
fn a_rank_without_ipc_or_a_tcp_group_turns_every_rank_to_the_host_path() {
    let mut t = trained_trainer();
    let host_sum = t.state.checksum().unwrap();
    for (what, comms, allow) in [
        (
            "one rollout without IPC",
            boxed(shm_group(3)),
            [true, true, false],
        ),
        ("a TCP group", boxed(group(3)), [true; 3]),
    ] {
        let s = sync(&mut t, &config(), comms, allow, 1000);
        assert_eq!(s.trainer_ipc, Some(false), "{what}");
        assert_eq!(s.sent, host_sum, "{what}: the host path's checksum");
        for (r, sum, ipc) in &s.rollouts {
            assert_eq!(*ipc, Some(false), "{what}");
            assert_eq!(*sum, host_sum, "{what}");
            assert_eq!(r.checksum().unwrap(), host_sum, "{what}");
        }
    }
}

/// Mixed precision: the trainer keeps f32 weights, the rollouts hold bf16 ones. The wire is
/// the rollouts' dtype, so the trainer casts each parameter as it packs it, and the rollouts
/// end with the trainer's weights rounded to bf16.
#[test]
fn ipc_sync_casts_f32_trainer_weights_to_the_bf16_rollouts() {
    let mut t = trained_trainer();
    let mut bf16 = config();
    bf16.training.bf16 = true;
    let want: Vec<(String, Vec<f32>)> = t
        .state
        .model
        .named_tensors()
        .into_iter()
        .map(|(n, w)| {
            let r = w.to_dtype(rlhf_model::DType::BF16).unwrap();
            (
                n,
                r.to_dtype(rlhf_model::DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap(),
            )
        })
        .collect();
    let s = sync(&mut t, &bf16, boxed(shm_group(3)), [true; 3], 1000);
    assert_eq!(s.trainer_ipc, Some(true));
    for (r, sum, ipc) in &s.rollouts {
        assert_eq!(r.model.dtype(), rlhf_model::DType::BF16);
        assert_eq!(*ipc, Some(true));
        assert_eq!(*sum, s.sent);
        assert_eq!(
            ipc_sum(&r.model),
            s.sent,
            "the rollout's bf16 weights hash as sent"
        );
        assert_eq!(
            params(&r.model),
            want,
            "the trainer's weights rounded to bf16"
        );
    }
}
