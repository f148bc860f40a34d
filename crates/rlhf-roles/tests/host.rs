//! A RoleHost with two engines on one device sharing one model (the hybrid engine): the
//! rollout generates with the trainer's weights as they are after an update, with no sync,
//! and calls reach the engine of the slot they name.

mod common;

use std::sync::Arc;

use common::*;
use rlhf_collective::{CommConfig, TcpCommunicator};
use rlhf_core::calls::{self, BatchCall, GenerateRequest, GenerateResponse, Mat, Wire};
use rlhf_core::{RoleKind, RolePart};
use rlhf_roles::{Engine, RoleHost};

fn single() -> TcpCommunicator {
    TcpCommunicator::single(CommConfig::default())
}

#[test]
fn a_rollout_sharing_the_trainer_model_generates_with_updated_weights() {
    let cfg = config();
    let mut host = RoleHost::new(RoleKind::ActorRollout, "127.0.0.1");
    let train = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, 0, 1);
    let infer = spec(&cfg, RoleKind::ActorRollout, RolePart::Infer, 0, 1);
    host.add(train.clone()).unwrap();
    host.add_sharing(infer, train.slot).unwrap();
    let (Engine::Trainer(t), Engine::Rollout(r)) =
        (&host.engines[0].engine, &host.engines[1].engine)
    else {
        panic!("engines in the wrong order")
    };
    assert!(
        Arc::ptr_eq(&t.state.model, &r.model),
        "one model, two engines"
    );

    // Prompts of the geometry the rollout expects.
    let prompt = |v: i64| Mat::new(2, P, (0..2 * P as i64).map(|i| 1 + (i * v) % 300).collect());
    let req = GenerateRequest {
        prompt_ids: prompt(7).unwrap(),
        prompt_mask: Mat::filled(2, P, 1),
        step: 1,
        seed: 3,
    };
    let mut wire = req.to_batch().unwrap();
    calls::set_target(&mut wire, RoleKind::ActorRollout, RolePart::Infer);
    let before = host.batch(BatchCall::Generate, &wire).unwrap();

    // Update the trainer through the host; the rollout sees the new weights at once.
    let seqs = sequences(&[3, 5, 1, 4, 2, 5, 3, 4], 11);
    let Engine::Trainer(t) = &host.engines[0].engine else {
        unreachable!()
    };
    let lp = log_probs_of(t.as_ref(), &seqs).unwrap().tensors["log_probs"]
        .to_f32()
        .unwrap();
    let Engine::Trainer(t) = &mut host.engines[0].engine else {
        unreachable!()
    };
    t.upd(&mut single(), &actor_batch(&seqs, &lp, 5)).unwrap();
    let after = host.batch(BatchCall::Generate, &wire).unwrap();
    let before = GenerateResponse::from_batch(BatchCall::Generate, &before).unwrap();
    let after = GenerateResponse::from_batch(BatchCall::Generate, &after).unwrap();
    assert_ne!(
        before.behaviour_log_probs, after.behaviour_log_probs,
        "the shared model moved with the update"
    );
    // The rollout samples with the trainer's version: the update's step, no sync needed.
    assert!(before.policy_version.iter().all(|&v| v == 0));
    assert!(
        after.policy_version.iter().all(|&v| v == 1),
        "{:?}",
        after.policy_version
    );

    // A separate rollout given the trained weights generates exactly the same.
    let separate = rollout(&cfg);
    let Engine::Trainer(t) = &host.engines[0].engine else {
        unreachable!()
    };
    separate
        .model
        .set_weights(&t.state.model.named_tensors())
        .unwrap();
    let want = rlhf_roles::Generate::generate(&separate, 0, &req).unwrap();
    assert_eq!(want.responses, after.responses);
    let worst = want
        .behaviour_log_probs
        .data
        .iter()
        .zip(&after.behaviour_log_probs.data)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst < 1e-4, "behaviour log-probs differ by {worst}");

    // ComputeLogProbs is served by the trainer and by the rollout (its teacher-forced pass,
    // for the rollout-vs-trainer gap): a batch must name which; on the shared weights both
    // answer the same.
    let mut lp_wire = typed::<calls::LogProbsRequest>(&seqs)
        .unwrap()
        .to_batch()
        .unwrap();
    let err = host
        .batch(BatchCall::ComputeLogProbs, &lp_wire)
        .unwrap_err()
        .to_string();
    assert!(err.contains("served by several engines"), "{err}");
    let mut answer = |part| {
        calls::set_target(&mut lp_wire, RoleKind::ActorRollout, part);
        let b = host.batch(BatchCall::ComputeLogProbs, &lp_wire).unwrap();
        calls::LogProbsResponse::from_batch(BatchCall::ComputeLogProbs, &b).unwrap()
    };
    let (by_trainer, by_rollout) = (answer(RolePart::Train), answer(RolePart::Infer));
    assert_eq!(by_trainer.log_probs, by_rollout.log_probs);
    let err = host.add(train).unwrap_err().to_string();
    assert!(err.contains("already initialised"), "{err}");
}

#[test]
fn empty_batches_and_negative_ids_are_errors() {
    let cfg = config();
    let mut host = RoleHost::new(RoleKind::ActorRollout, "127.0.0.1");
    let train = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, 0, 1);
    host.add(train.clone()).unwrap();
    host.add_sharing(
        spec(&cfg, RoleKind::ActorRollout, RolePart::Infer, 0, 1),
        train.slot,
    )
    .unwrap();
    let empty = GenerateRequest {
        prompt_ids: Mat::filled(0, P, 1),
        prompt_mask: Mat::filled(0, P, 1),
        step: 1,
        seed: 3,
    };
    let seqs = typed::<calls::LogProbsRequest>(&sequences(&[3, 5], 11)).unwrap();
    let no_rows = calls::LogProbsRequest(calls::Sequences {
        input_ids: Mat::filled(0, seqs.0.input_ids.cols, 1),
        attention_mask: Mat::filled(0, seqs.0.attention_mask.cols, 1),
        response_len: seqs.0.response_len,
    });
    for (call, wire) in [
        (BatchCall::ComputeLogProbs, no_rows.to_batch().unwrap()),
        (BatchCall::Generate, empty.to_batch().unwrap()),
    ] {
        let e = host.batch(call, &wire).unwrap_err().to_string();
        assert!(e.contains("has no rows"), "{call:?}: {e}");
    }
    // A negative id would wrap onto token 4294967295 (or panic deeper): refused by place.
    let mut ids = Mat::filled(1, P, 5i64);
    ids.row_mut(0)[P - 1] = -1;
    let bad = GenerateRequest {
        prompt_ids: ids,
        prompt_mask: Mat::filled(1, P, 1),
        step: 1,
        seed: 3,
    };
    let e = host
        .batch(BatchCall::Generate, &bad.to_batch().unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("token id -1"), "{e}");
}

/// A role placed on a GPU in a build without the `cuda` feature refuses to start, naming the
/// role, rank, device and the rebuild command, instead of computing on the CPU.
#[cfg(not(feature = "cuda"))]
#[test]
fn a_gpu_placed_role_refuses_to_start_without_the_cuda_feature() {
    let cfg = config();
    for (kind, part) in [
        (RoleKind::ActorRollout, RolePart::Train),
        (RoleKind::Ref, RolePart::Whole),
        (RoleKind::Critic, RolePart::Whole),
    ] {
        let mut host = RoleHost::new(kind, "127.0.0.1");
        let mut s = spec(&cfg, kind, part, 1, 2);
        s.device = rlhf_core::DeviceSpec::Cuda { ordinal: 0 };
        let err = host.add(s.clone()).unwrap_err().to_string();
        assert!(err.contains(&s.slot.label()), "{err}");
        assert!(err.contains("cuda:0"), "{err}");
        assert!(err.contains("without the `cuda` feature"), "{err}");
        assert!(err.contains("--features cuda"), "{err}");
        assert!(!err.contains('\n'), "one line: {err}");
        assert!(host.engines.is_empty(), "nothing was built");
    }
    // The CPU still works in the same process kind.
    let mut host = RoleHost::new(RoleKind::Ref, "127.0.0.1");
    host.add(spec(&cfg, RoleKind::Ref, RolePart::Whole, 0, 1))
        .unwrap();
}

/// The reference of a LoRA actor at ZeRO stage 3, served through the host by the trainer's
/// sharded model with its adapters off: every call gathers the whole model, so the host
/// plans as many as the reference's micro-batches take (8 rows in 2-row micro-batches: 4),
/// not one per row, and answers the log-probs of the base.
#[test]
fn a_reference_sharing_a_stage_3_lora_trainer_makes_one_call_per_micro_batch() {
    let mut cfg = config();
    cfg.training.zero_stage = 3;
    cfg.training.micro_batch_size = 2;
    let l = &mut cfg.actor_rollout.lora;
    l.rank = 4;
    l.alpha = 8.0;
    l.target_modules = vec!["q_proj".into(), "v_proj".into()];
    let mut host = RoleHost::new(RoleKind::ActorRollout, "127.0.0.1");
    let train = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, 0, 1);
    host.add(train.clone()).unwrap();
    let shared = spec(&cfg, RoleKind::Ref, RolePart::Whole, 0, 1);
    host.add_sharing(shared, train.slot).unwrap();
    let model = host.engines[0].engine.model().unwrap().clone();
    let z = model.zero3().expect("sharded").clone();
    let seqs = sequences(&[3, 5, 1, 4, 2, 5, 3, 4], 11);
    let mut wire = typed::<calls::LogProbsRequest>(&seqs)
        .unwrap()
        .to_batch()
        .unwrap();
    calls::set_target(&mut wire, RoleKind::Ref, RolePart::Whole);
    let before = z.calls();
    let got = host.batch(BatchCall::ComputeLogProbs, &wire).unwrap();
    assert_eq!(
        z.calls() - before,
        4,
        "model calls for 8 rows in micro-batches of 2"
    );
    // The base's log-probs: a reference loaded on its own from the same checkpoint.
    let want = log_probs_of(&reference(&config()), &seqs).unwrap();
    let (got, want) = (
        got.tensors["log_probs"].to_f32().unwrap(),
        want.tensors["log_probs"].to_f32().unwrap(),
    );
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst < 1e-5, "reference log-probs {worst} off the base's");
}
