//! Trainer and critic without gRPC: data-parallel exactness, gradients reaching every
//! parameter, non-finite inputs, checkpoint round trips and trainer -> rollout weight sync.

mod common;

use std::thread;

use common::*;
use rlhf_algo::LossAggMode;
use rlhf_collective::{CommConfig, Communicator, TcpCommunicator};
use rlhf_core::batch::{DataBatch, TensorData};
use rlhf_roles::Trainer;

fn single() -> TcpCommunicator {
    TcpCommunicator::single(CommConfig::default())
}

fn log_probs(t: &Trainer, seqs: &DataBatch) -> Vec<f32> {
    log_probs_of(t, seqs).unwrap().tensors["log_probs"]
        .to_f32()
        .unwrap()
}

/// Unequal response lengths, and rank 0's half has many more tokens than rank 1's, so
/// the per-rank denominators differ.
const LENS: [usize; 8] = [5, 4, 5, 3, 1, 2, 1, 2];

fn dp_run(mode: LossAggMode, sync_denominators: bool) -> (f32, f32) {
    let mut cfg = config();
    cfg.actor_rollout.loss_agg_mode = mode;
    let seqs = sequences(&LENS, 11);
    let mut whole = trainer(&cfg, 0, 1);
    let before = params(&whole.state.model);
    let batch = actor_batch(&seqs, &log_probs(&whole, &seqs), 5);
    let metrics = whole.upd(&mut single(), &batch).unwrap();
    let after_whole = params(&whole.state.model);
    assert!(metrics.meta["actor/grad_norm"].as_f64().unwrap() > 0.0);

    let halves = batch.chunk(2).unwrap();
    let comms = group(2);
    let handles: Vec<_> = comms
        .into_iter()
        .zip(halves)
        .enumerate()
        .map(|(rank, (mut comm, half))| {
            let cfg = cfg.clone();
            thread::spawn(move || {
                let mut t = trainer(&cfg, rank, 2);
                t.state.settings.sync_denominators = sync_denominators;
                assert_eq!(t.state.settings.mini_batch_rows, 4);
                let m = t.upd(&mut comm, &half).unwrap();
                (params(&t.state.model), m.meta)
            })
        })
        .collect();
    let (ranks, rank_metrics): (Vec<_>, Vec<_>) =
        handles.into_iter().map(|h| h.join().unwrap()).unzip();
    if sync_denominators {
        // The update metrics are the group's, whatever the split: equal on every rank and
        // equal to one rank's on the whole batch.
        for (k, v) in &metrics.meta {
            let whole_v = v.as_f64().unwrap();
            for (rank, m) in rank_metrics.iter().enumerate() {
                let dp_v = m[k].as_f64().unwrap();
                assert!(
                    (dp_v - whole_v).abs() <= 1e-5 * (1.0 + whole_v.abs()),
                    "{mode}: {k} on rank {rank} {dp_v} vs whole batch {whole_v}"
                );
            }
        }
    }
    let (moved, _) = max_rel_diff(&after_whole, &before);
    let (between_ranks, _) = max_rel_diff(&ranks[0], &ranks[1]);
    assert_eq!(between_ranks, 0.0, "DP ranks must stay bit-identical");
    let (d, name) = max_rel_diff(&ranks[0], &after_whole);
    eprintln!("{mode} sync={sync_denominators}: moved {moved:.3e}, DP vs whole {d:.3e} ({name})");
    (moved, d)
}

#[test]
fn two_ranks_on_halves_equal_one_rank_on_the_whole_batch() {
    for mode in LossAggMode::ALL.iter().copied() {
        let (moved, d) = dp_run(mode, true);
        assert!(
            moved > 1e-3,
            "{mode}: the update barely moved the weights ({moved})"
        );
        assert!(d < 1e-5, "{mode}: DP differs from one rank by {d}");
    }
}

#[test]
fn without_the_denominator_all_reduce_the_ranks_do_not_add_up() {
    let (_, d) = dp_run(LossAggMode::TokenMean, false);
    assert!(
        d > 1e-3,
        "skipping the denominator all-reduce should change the update ({d})"
    );
}

#[test]
fn every_parameter_of_actor_and_critic_learns_and_nan_is_named() {
    let cfg = config();
    let seqs = sequences(&LENS, 3);
    let mut actor = trainer(&cfg, 0, 1);
    let before = params(&actor.state.model);
    let mut batch = actor_batch(&seqs, &log_probs(&actor, &seqs), 9);
    let m = actor.upd(&mut single(), &batch).unwrap();
    for key in [
        "policy/approxkl_avg",
        "policy/clipfrac_avg",
        "policy/entropy_avg",
        "loss/policy_avg",
        "val/ratio",
        "actor/grad_norm",
        "actor/lr",
        "actor/pg_clipfrac_lower",
    ] {
        let v = m.meta.get(key).and_then(|v| v.as_f64());
        assert!(v.is_some_and(f64::is_finite), "metric {key}: {v:?}");
    }
    assert_eq!(m.len().unwrap(), 0);
    for ((name, a), (_, b)) in params(&actor.state.model).iter().zip(&before) {
        assert!(a.iter().all(|x| x.is_finite()), "{name} is not finite");
        assert!(a != b, "actor parameter {name} got no gradient");
    }

    let mut critic = critic(&cfg, 0, 1);
    let values = values_of(&critic, &seqs).unwrap().tensors["values"].clone();
    assert_eq!(values.shape, vec![8, R]);
    let mut cb = seqs.clone();
    let v = values.to_f32().unwrap();
    let returns: Vec<f32> = v
        .iter()
        .enumerate()
        .map(|(i, x)| x + 1.0 - (i % 3) as f32)
        .collect();
    cb.tensors.insert("values".into(), values);
    cb.tensors.insert(
        "returns".into(),
        TensorData::from_f32(vec![8, R], &returns).unwrap(),
    );
    let before = params(&critic.state.model);
    let m = critic.upd(&mut single(), &cb).unwrap();
    for key in [
        "loss/value_avg",
        "val/clipfrac_avg",
        "critic/grad_norm",
        "critic/lr",
        "val/vpred",
    ] {
        assert!(
            m.meta
                .get(key)
                .and_then(|v| v.as_f64())
                .is_some_and(f64::is_finite),
            "{key}"
        );
    }
    for ((name, a), (_, b)) in params(&critic.state.model).iter().zip(&before) {
        assert!(a != b, "critic parameter {name} got no gradient");
    }

    let mut adv = batch.tensors["advantages"].to_f32().unwrap();
    adv[R] = f32::NAN; // row 1, token 0: a valid position
    batch.tensors.insert(
        "advantages".into(),
        TensorData::from_f32(vec![8, R], &adv).unwrap(),
    );
    batch.meta.insert("step".into(), serde_json::json!(3));
    let err = actor.upd(&mut single(), &batch).unwrap_err().to_string();
    assert!(
        err.contains("non-finite advantages in actor_rollout rank 0 at step 3"),
        "{err}"
    );
}

/// A background save writes what was captured, not what the weights became while it wrote:
/// the capture is taken, two more updates change weights and moments, and the files still
/// hold the captured state (the one a resume must continue from).
#[test]
fn captured_checkpoint_is_a_snapshot() {
    let cfg = config();
    let seqs = sequences(&LENS, 22);
    let mut a = trainer(&cfg, 0, 1);
    let batch = actor_batch(&seqs, &log_probs(&a, &seqs), 2);
    a.upd(&mut single(), &batch).unwrap();
    let at_capture = a.state.checksum().unwrap();
    let (opt_at_capture, _) = a.state.optim.opt.state().unwrap();
    let opt_at_capture: Vec<Vec<f32>> = opt_at_capture
        .iter()
        .map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect();
    let image = a.state.capture_checkpoint(None).unwrap();
    for step in 2..4 {
        let mut bb = batch.clone();
        bb.meta.insert("step".into(), serde_json::json!(step));
        a.upd(&mut single(), &bb).unwrap();
    }
    assert_ne!(
        a.state.checksum().unwrap(),
        at_capture,
        "the updates changed nothing"
    );
    assert_eq!(image.checksum().unwrap(), at_capture);
    let dir = tempfile::tempdir().unwrap();
    image.write(dir.path()).unwrap();
    let mut b = trainer(&cfg, 0, 1);
    assert_eq!(b.state.load_checkpoint(dir.path()).unwrap(), at_capture);
    assert_eq!(b.state.optim.steps(), 1);
    let (opt, _) = b.state.optim.opt.state().unwrap();
    for ((name, t), want) in opt.iter().zip(&opt_at_capture) {
        let got = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(
            got.iter()
                .zip(want)
                .all(|(p, q)| p.to_bits() == q.to_bits()),
            "{name}: the saved moments moved with the later updates"
        );
    }
}

#[test]
fn checkpoint_round_trip_resumes_bit_identically() {
    let cfg = config();
    let seqs = sequences(&LENS, 21);
    let mut a = trainer(&cfg, 0, 1);
    let batch = actor_batch(&seqs, &log_probs(&a, &seqs), 2);
    a.upd(&mut single(), &batch).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let files = a
        .state
        .capture_checkpoint(None)
        .unwrap()
        .write(dir.path())
        .unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "role_state.json",
        "manifest.json",
    ] {
        assert!(files.iter().any(|x| x == f), "{f} missing from {files:?}");
    }
    let saved_sum = a.state.checksum().unwrap();
    let (saved_opt, saved_steps) = a.state.optim.opt.state().unwrap();

    let mut b = trainer(&cfg, 0, 1);
    assert_ne!(b.state.checksum().unwrap(), saved_sum);
    assert_eq!(b.state.load_checkpoint(dir.path()).unwrap(), saved_sum);
    let (opt, steps) = b.state.optim.opt.state().unwrap();
    assert_eq!((steps, b.state.optim.steps()), (saved_steps, 1));
    for ((n1, t1), (n2, t2)) in opt.iter().zip(&saved_opt) {
        assert_eq!(n1, n2);
        let (x, y) = (
            t1.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            t2.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert!(
            x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()),
            "{n1} differs"
        );
    }
    for t in [&mut a, &mut b] {
        for step in 2..4 {
            let mut bb = batch.clone();
            bb.meta.insert("step".into(), serde_json::json!(step));
            t.upd(&mut single(), &bb).unwrap();
        }
    }
    assert_eq!(a.state.checksum().unwrap(), b.state.checksum().unwrap());
    assert_eq!(params(&a.state.model), params(&b.state.model));

    let err = b
        .state
        .load_checkpoint(&dir.path().join("nope"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("nope") && err.contains("manifest.json"),
        "{err}"
    );

    // A weight file changed after the save (zeroed, as a bad copy leaves it) is refused by
    // name, and the model keeps its weights.
    let model_file = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&model_file).unwrap();
    let n = bytes.len();
    bytes[n - 64..].fill(0);
    std::fs::write(&model_file, &bytes).unwrap();
    let before = b.state.checksum().unwrap();
    let err = b.state.load_checkpoint(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("changed"),
        "{err}"
    );
    assert_eq!(b.state.checksum().unwrap(), before);
}

#[test]
fn weight_sync_makes_the_rollout_generate_like_the_trainer() {
    let cfg = config();
    let seqs = sequences(&LENS, 33);
    let mut trainer = trainer(&cfg, 0, 1);
    let batch = actor_batch(&seqs, &log_probs(&trainer, &seqs), 4);
    trainer.upd(&mut single(), &batch).unwrap();
    let trained = trainer.state.checksum().unwrap();

    let mut comms = group(3);
    let (c2, c1) = (comms.pop().unwrap(), comms.pop().unwrap());
    let mut c0 = comms.pop().unwrap();
    let rollouts: Vec<_> = [c1, c2]
        .into_iter()
        .map(|mut comm| {
            let cfg = cfg.clone();
            thread::spawn(move || {
                let mut r = rollout(&cfg);
                let before = r.checksum().unwrap();
                let (stats, sum) = r.recv_weights(&mut comm, 5, 4096).unwrap();
                assert!(stats.buckets > 1);
                assert_eq!(r.checksum().unwrap(), sum);
                (r, before, sum)
            })
        })
        .collect();
    let (_, sent) = trainer.send_weights(&mut c0, 5, 4096).unwrap();
    assert_eq!(sent, trained);
    let mut outs = Vec::new();
    for h in rollouts {
        let (r, before, sum) = h.join().unwrap();
        assert_eq!(sum, trained);
        assert_ne!(before, trained, "the sync must change the rollout weights");
        assert_eq!(r.version, 5);
        outs.push(r);
    }
    assert_eq!(c0.world_size(), 3);

    // Greedy generation after the sync equals generation with the trainer's weights.
    let mut prompts = vec![0i64; 3 * P];
    let mut pmask = vec![0i64; 3 * P];
    for (i, len) in [6usize, 3, 4].iter().enumerate() {
        for j in P - len..P {
            prompts[i * P + j] = (7 + 13 * i + 5 * j) as i64 % 300 + 1;
            pmask[i * P + j] = 1;
        }
    }
    let gen_batch = DataBatch::new()
        .with_tensor(
            "prompt_ids",
            TensorData::from_i64(vec![3, P], &prompts).unwrap(),
        )
        .with_tensor(
            "prompt_mask",
            TensorData::from_i64(vec![3, P], &pmask).unwrap(),
        );
    let got = generate_with(&outs[0], &gen_batch).unwrap();
    assert_eq!(got.tensors["responses"].shape, vec![3, R]);
    assert_eq!(got.tensors["response_mask"].shape, vec![3, R]);
    assert_eq!(got.tensors["behaviour_log_probs"].shape, vec![3, R]);
    let reference = rollout(&cfg);
    let stale = generate_with(&reference, &gen_batch).unwrap();
    reference
        .model
        .set_weights(&trainer.state.model.named_tensors())
        .unwrap();
    let want = generate_with(&reference, &gen_batch).unwrap();
    assert_eq!(got.tensors["responses"], want.tensors["responses"]);
    assert_eq!(
        got.tensors["behaviour_log_probs"],
        want.tensors["behaviour_log_probs"]
    );
    assert_ne!(
        stale.tensors["behaviour_log_probs"], want.tensors["behaviour_log_probs"],
        "the trained weights should change the generation"
    );
}

#[test]
fn kl_loss_needs_and_uses_the_reference_log_probs() {
    let mut cfg = config();
    cfg.actor_rollout.use_kl_loss = true;
    cfg.actor_rollout.kl_loss_coef = 0.1;
    let seqs = sequences(&LENS, 8);
    let mut t = trainer(&cfg, 0, 1);
    let lp = log_probs(&t, &seqs);
    let mut batch = actor_batch(&seqs, &lp, 1);
    let err = t.upd(&mut single(), &batch).unwrap_err().to_string();
    assert!(
        err.contains("use_kl_loss is on but the request has no ref_log_probs"),
        "{err}"
    );

    // The frozen reference (fast kernels) agrees with the trainer before any update.
    let reference = reference(&cfg);
    let ref_lp = log_probs_of(&reference, &seqs).unwrap().tensors["log_probs"].clone();
    let mask = seqs.tensors["response_mask"].to_f32().unwrap();
    for ((a, b), m) in ref_lp.to_f32().unwrap().iter().zip(&lp).zip(&mask) {
        if *m == 1.0 {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }
    batch.tensors.insert("ref_log_probs".into(), ref_lp);
    let m = t.upd(&mut single(), &batch).unwrap();
    let kl = m.meta["actor/kl_loss"].as_f64().unwrap();
    assert!(kl.is_finite() && kl >= 0.0, "{kl}");
}

#[test]
fn two_critic_ranks_equal_one() {
    let cfg = config();
    let seqs = sequences(&LENS, 17);
    let mut whole = critic(&cfg, 0, 1);
    let values = values_of(&whole, &seqs).unwrap().tensors["values"].clone();
    let v = values.to_f32().unwrap();
    let returns: Vec<f32> = v
        .iter()
        .enumerate()
        .map(|(i, x)| x + ((i * 7) % 5) as f32 * 0.3 - 0.6)
        .collect();
    let mut batch = seqs.clone();
    batch.tensors.insert("values".into(), values);
    batch.tensors.insert(
        "returns".into(),
        TensorData::from_f32(vec![8, R], &returns).unwrap(),
    );
    whole.upd(&mut single(), &batch).unwrap();
    let want = params(&whole.state.model);
    let handles: Vec<_> = group(2)
        .into_iter()
        .zip(batch.chunk(2).unwrap())
        .enumerate()
        .map(|(rank, (mut comm, half))| {
            let cfg = cfg.clone();
            thread::spawn(move || {
                let mut c = critic(&cfg, rank, 2);
                c.upd(&mut comm, &half).unwrap();
                params(&c.state.model)
            })
        })
        .collect();
    for h in handles {
        let (d, name) = max_rel_diff(&h.join().unwrap(), &want);
        assert!(d < 1e-5, "critic DP differs by {d} at {name}");
    }
}

/// A rank that refuses its shard fails the whole group at once instead of leaving the
/// other ranks waiting in a collective until the timeout.
#[test]
fn a_bad_shard_on_one_rank_fails_every_rank_promptly() {
    let cfg = config();
    let seqs = sequences(&LENS, 13);
    let probe = trainer(&cfg, 0, 1);
    let batch = actor_batch(&seqs, &log_probs(&probe, &seqs), 6);
    let mut halves = batch.chunk(2).unwrap();
    let mut adv = halves[1].tensors["advantages"].to_f32().unwrap();
    adv[0] = f32::INFINITY;
    halves[1].tensors.insert(
        "advantages".into(),
        TensorData::from_f32(vec![4, R], &adv).unwrap(),
    );
    let start = std::time::Instant::now();
    let handles: Vec<_> = group(2)
        .into_iter()
        .zip(halves)
        .enumerate()
        .map(|(rank, (mut comm, half))| {
            let cfg = cfg.clone();
            thread::spawn(move || {
                let mut t = trainer(&cfg, rank, 2);
                t.upd(&mut comm, &half).unwrap_err().to_string()
            })
        })
        .collect();
    let errs: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(start.elapsed() < std::time::Duration::from_secs(20));
    assert!(
        errs[0].contains("another rank of the group refused its shard"),
        "{}",
        errs[0]
    );
    assert!(
        errs[1].contains("non-finite advantages in actor_rollout rank 1 at step 1"),
        "{}",
        errs[1]
    );
}
