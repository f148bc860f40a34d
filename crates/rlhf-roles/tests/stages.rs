//! The engines of the other stages without gRPC, on the tiny model: SFT's loss is the mean
//! NLL of exactly the completion tokens and falls; DPO starts at ln 2 with zero margins and
//! learns the pairs (every loss type lowers its loss); a reward model trained from a causal
//! LM ranks every pair, is saved as a sequence classifier and scores the same when the
//! reward role loads it; two ranks on halves equal one rank on the whole batch.

mod common;

use common::*;
use rlhf_algo::PreferenceLoss;
use rlhf_collective::{CommConfig, TcpCommunicator};
use rlhf_config::{PpoConfig, RewardKind, TrainerKind};
use rlhf_core::batch::DataBatch;
use rlhf_core::calls::{
    LogProbsRequest, Mat, PreferenceUpdateRequest, RewardModelUpdateRequest, ScoresRequest,
    Sequences, SftUpdateRequest,
};
use rlhf_core::{RoleKind, RolePart};
use rlhf_roles::{LogProbs, PreferenceTrainer, RewardModelTrainer, Score, SftTrainer};

fn single() -> TcpCommunicator {
    TcpCommunicator::single(CommConfig::default())
}

/// Typed sequences and their response mask from [`common::sequences`].
fn seqs(resp_lens: &[usize], seed: u64) -> (Sequences, Mat<f32>) {
    let b: DataBatch = sequences(resp_lens, seed);
    let n = resp_lens.len();
    let mat_i = |name: &str| Mat::new(n, P + R, b.tensors[name].to_i64().unwrap()).unwrap();
    let seq = Sequences {
        input_ids: mat_i("input_ids"),
        attention_mask: mat_i("attention_mask"),
        response_len: R,
    };
    let mask = Mat::new(n, R, b.tensors["response_mask"].to_f32().unwrap()).unwrap();
    (seq, mask)
}

fn stage_config(trainer: TrainerKind) -> PpoConfig {
    let mut cfg = config();
    cfg.trainer = trainer;
    cfg.training.lr = 0.05;
    cfg.training.adam_eps = 1e-8;
    cfg
}

const LENS: [usize; 8] = [5, 4, 5, 3, 1, 2, 4, 2];

fn logps(engine: &dyn LogProbs, seq: &Sequences) -> Vec<f32> {
    engine
        .log_probs(&LogProbsRequest(seq.clone()))
        .unwrap()
        .log_probs
        .data
}

fn masked_sums(lp: &[f32], mask: &Mat<f32>) -> Vec<f32> {
    lp.chunks(R)
        .zip(mask.data.chunks(R))
        .map(|(l, m)| l.iter().zip(m).map(|(a, b)| a * b).sum())
        .collect()
}

#[test]
fn sft_loss_is_the_completion_nll_and_falls() {
    let cfg = stage_config(TrainerKind::Sft);
    let s = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, 0, 1);
    let mut t = SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
    let (seq, resp) = seqs(&LENS, 3);
    // The loss covers only the first two tokens of each completion.
    let mut loss_mask = resp.clone();
    for (i, v) in loss_mask.data.iter_mut().enumerate() {
        if i % R >= 2 {
            *v = 0.0;
        }
    }
    let lp = logps(&t, &seq);
    let n: f32 = loss_mask.data.iter().sum();
    let want = -masked_sums(&lp, &loss_mask).iter().sum::<f32>() / n;
    let req = |step| SftUpdateRequest {
        seq: seq.clone(),
        loss_mask: loss_mask.clone(),
        step,
    };
    let first = t.update(&mut single(), &req(1)).unwrap().metrics;
    assert!(
        (first["train/loss"] - f64::from(want)).abs() < 1e-4,
        "train/loss {} vs the mean NLL of the masked tokens {want}",
        first["train/loss"]
    );
    assert!(first["actor/grad_norm"] > 0.0);
    let mut last = first.clone();
    for step in 2..=8 {
        last = t.update(&mut single(), &req(step)).unwrap().metrics;
    }
    assert!(
        last["train/loss"] < 0.7 * first["train/loss"],
        "SFT loss {} -> {}",
        first["train/loss"],
        last["train/loss"]
    );
    // Tokens outside the loss mask were not trained towards as much as the masked ones.
    let after = logps(&t, &seq);
    let gain = |keep: bool| {
        let (mut g, mut n) = (0.0, 0.0);
        for i in 0..lp.len() {
            if resp.data[i] == 1.0 && (loss_mask.data[i] == 1.0) == keep {
                g += after[i] - lp[i];
                n += 1.0;
            }
        }
        g / n
    };
    assert!(
        gain(true) > gain(false) + 0.5,
        "{} vs {}",
        gain(true),
        gain(false)
    );
    // A mask that is not 0/1 is refused by name.
    let mut bad = req(9);
    bad.loss_mask.data[0] = 0.5;
    let e = t.update(&mut single(), &bad).unwrap_err().to_string();
    assert!(e.contains("loss_mask"), "{e}");
}

/// `seq`'s rows packed first-fit into rows of P + R tokens (`data.packing`'s layout): each
/// example's tokens back to back under its segment id, `response_len` P + R - 1, the loss on
/// the tokens `loss` covers. Returns the packed request's sequences and loss mask.
fn packed(seq: &Sequences, loss: &Mat<f32>) -> (Sequences, Mat<f32>) {
    let t = P + R;
    let mut rows: Vec<Vec<(i64, bool)>> = Vec::new();
    let mut segs: Vec<Vec<i64>> = Vec::new();
    for i in 0..seq.rows() {
        let mut ex = Vec::new();
        for j in 0..t {
            if seq.attention_mask.row(i)[j] == 1 {
                let trained = j >= P && loss.row(i)[j - P] == 1.0;
                ex.push((seq.input_ids.row(i)[j], trained));
            }
        }
        match rows.iter().position(|r| r.len() + ex.len() <= t) {
            Some(k) => {
                let seg = segs[k].last().copied().unwrap() + 1;
                segs[k].extend(std::iter::repeat_n(seg, ex.len()));
                rows[k].extend(ex);
            }
            None => {
                segs.push(vec![1; ex.len()]);
                rows.push(ex);
            }
        }
    }
    let n = rows.len();
    let (mut ids, mut attn, mut mask) = (
        Mat::filled(n, t, 0i64),
        Mat::filled(n, t, 0i64),
        Mat::filled(n, t - 1, 0f32),
    );
    for (i, (row, seg)) in rows.iter().zip(&segs).enumerate() {
        for (j, (&(id, trained), &s)) in row.iter().zip(seg).enumerate() {
            ids.row_mut(i)[j] = id;
            attn.row_mut(i)[j] = s;
            if trained {
                mask.row_mut(i)[j - 1] = 1.0;
            }
        }
    }
    let seq = Sequences {
        input_ids: ids,
        attention_mask: attn,
        response_len: t - 1,
    };
    (seq, mask)
}

/// Packed rows train exactly like the same examples one per row: the same loss, the same
/// gradient norm and the same weights after the step. Each example attends only to itself
/// and its positions restart, so nothing leaks between the examples of a row.
#[test]
fn packed_rows_train_exactly_like_the_same_examples_unpadded() {
    let cfg = stage_config(TrainerKind::Sft);
    let s = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, 0, 1);
    let (seq, loss_mask) = seqs(&LENS, 3);
    let (pseq, pmask) = packed(&seq, &loss_mask);
    assert!(pseq.rows() < seq.rows(), "{} rows", pseq.rows());
    assert!(pseq.attention_mask.data.iter().any(|&m| m > 1));
    let update = |seq: &Sequences, loss_mask: &Mat<f32>| {
        let mut t = SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
        let req = SftUpdateRequest {
            seq: seq.clone(),
            loss_mask: loss_mask.clone(),
            step: 1,
        };
        let m = t.update(&mut single(), &req).unwrap().metrics;
        (m, t)
    };
    let (a, ta) = update(&seq, &loss_mask);
    let (b, tb) = update(&pseq, &pmask);
    for k in ["train/loss", "actor/grad_norm"] {
        let rel = (a[k] - b[k]).abs() / a[k].abs().max(1e-12);
        assert!(rel < 1e-4, "{k}: unpacked {} packed {}", a[k], b[k]);
    }
    let (la, lb) = (logps(&ta, &seq), logps(&tb, &seq));
    let d = la
        .iter()
        .zip(&lb)
        .zip(&loss_mask.data)
        .filter(|(_, &m)| m == 1.0)
        .map(|((x, y), _)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(d < 1e-4, "log-probs after the step differ by {d}");
    // Segment ids outside the packed geometry are refused by name.
    let mut bad = SftUpdateRequest {
        seq: seq.clone(),
        loss_mask: loss_mask.clone(),
        step: 2,
    };
    bad.seq.attention_mask.data[P] = 2;
    let mut t = ta;
    let e = t.update(&mut single(), &bad).unwrap_err().to_string();
    assert!(e.contains("segment ids"), "{e}");
}

/// Pairs sharing nothing but their row, with the reference's summed log-probs.
fn pairs(t: &dyn LogProbs) -> PreferenceUpdateRequest {
    let (chosen, chosen_mask) = seqs(&LENS, 11);
    let (rejected, rejected_mask) = seqs(&[3, 5, 2, 4, 4, 1, 5, 3], 12);
    PreferenceUpdateRequest {
        ref_chosen: Some(masked_sums(&logps(t, &chosen), &chosen_mask)),
        ref_rejected: Some(masked_sums(&logps(t, &rejected), &rejected_mask)),
        chosen,
        chosen_mask,
        rejected,
        rejected_mask,
        kto_kl: None,
        step: 1,
    }
}

fn preference_trainer(loss: PreferenceLoss, world: u32, rank: u32) -> PreferenceTrainer {
    preference_trainer_lr(loss, world, rank, 0.05)
}

fn preference_trainer_lr(
    loss: PreferenceLoss,
    world: u32,
    rank: u32,
    lr: f64,
) -> PreferenceTrainer {
    let mut cfg = stage_config(TrainerKind::Dpo);
    cfg.training.lr = lr;
    cfg.algorithm.loss_type = loss;
    cfg.algorithm.beta = if loss == PreferenceLoss::Simpo {
        2.0
    } else {
        0.5
    };
    let s = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, rank, world);
    PreferenceTrainer::new(&s, &candle_core::Device::Cpu).unwrap()
}

#[test]
fn dpo_starts_at_ln2_and_learns_the_pairs() {
    let mut t = preference_trainer(PreferenceLoss::Sigmoid, 1, 0);
    let req = pairs(&t);
    let first = t.update(&mut single(), &req).unwrap().metrics;
    assert!(
        (first["train/loss"] - std::f64::consts::LN_2).abs() < 1e-5,
        "{first:?}"
    );
    assert!(first["rewards/margins"].abs() < 1e-5, "{first:?}");
    let mut last = first.clone();
    for step in 2..=10 {
        last = t
            .update(
                &mut single(),
                &PreferenceUpdateRequest {
                    step,
                    ..req.clone()
                },
            )
            .unwrap()
            .metrics;
    }
    assert!(last["rewards/margins"] > 1.0, "{last:?}");
    assert_eq!(last["rewards/accuracies"], 1.0, "{last:?}");
    assert!(last["train/loss"] < 0.4, "{last:?}");
    assert!(last["rewards/chosen"] > first["rewards/chosen"]);
    // Without reference log-probs DPO is refused by name; SimPO needs none.
    let e = t
        .update(
            &mut single(),
            &PreferenceUpdateRequest {
                ref_chosen: None,
                ..req.clone()
            },
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("ref_chosen") && e.contains("sigmoid"), "{e}");
}

#[test]
fn every_preference_loss_lowers_its_loss() {
    for loss in [
        PreferenceLoss::Ipo,
        PreferenceLoss::Simpo,
        PreferenceLoss::Kto,
    ] {
        // IPO's squared loss overshoots its target at DPO's rate on this tiny model.
        let mut t = preference_trainer_lr(loss, 1, 0, 0.01);
        let mut req = pairs(&t);
        if loss == PreferenceLoss::Simpo {
            req.ref_chosen = None;
            req.ref_rejected = None;
        }
        if loss == PreferenceLoss::Kto {
            req.kto_kl = Some(0.0);
        }
        let first = t.update(&mut single(), &req).unwrap().metrics;
        let mut last = first.clone();
        for step in 2..=8 {
            last = t
                .update(
                    &mut single(),
                    &PreferenceUpdateRequest {
                        step,
                        ..req.clone()
                    },
                )
                .unwrap()
                .metrics;
        }
        assert!(
            last["train/loss"] < 0.8 * first["train/loss"],
            "{loss}: {} -> {}",
            first["train/loss"],
            last["train/loss"]
        );
        assert!(
            last["rewards/margins"] > first["rewards/margins"],
            "{loss}: {last:?}"
        );
    }
}

fn half(req: &PreferenceUpdateRequest, rows: std::ops::Range<usize>) -> PreferenceUpdateRequest {
    let seq = |s: &Sequences| Sequences {
        input_ids: Mat::new(
            rows.len(),
            P + R,
            s.input_ids.data[rows.start * (P + R)..rows.end * (P + R)].to_vec(),
        )
        .unwrap(),
        attention_mask: Mat::new(
            rows.len(),
            P + R,
            s.attention_mask.data[rows.start * (P + R)..rows.end * (P + R)].to_vec(),
        )
        .unwrap(),
        response_len: R,
    };
    let m = |m: &Mat<f32>| {
        Mat::new(rows.len(), R, m.data[rows.start * R..rows.end * R].to_vec()).unwrap()
    };
    PreferenceUpdateRequest {
        chosen: seq(&req.chosen),
        chosen_mask: m(&req.chosen_mask),
        rejected: seq(&req.rejected),
        rejected_mask: m(&req.rejected_mask),
        ref_chosen: req.ref_chosen.as_ref().map(|v| v[rows.clone()].to_vec()),
        ref_rejected: req.ref_rejected.as_ref().map(|v| v[rows.clone()].to_vec()),
        kto_kl: req.kto_kl,
        step: req.step,
    }
}

#[test]
fn two_dpo_ranks_on_halves_equal_one_rank_on_the_whole_batch() {
    let mut one = preference_trainer(PreferenceLoss::Sigmoid, 1, 0);
    let req = pairs(&one);
    // The driver deals equal shards (pairs differ in tokens, which the loss does not count).
    let parts = [half(&req, 0..4), half(&req, 4..8)];
    let whole = one.update(&mut single(), &req).unwrap().metrics;
    let comms = group(2);
    let handles: Vec<_> = comms
        .into_iter()
        .zip(parts)
        .enumerate()
        .map(|(rank, (mut c, part))| {
            std::thread::spawn(move || {
                let mut t = preference_trainer(PreferenceLoss::Sigmoid, 2, rank as u32);
                let m = t.update(&mut c, &part).unwrap().metrics;
                (params(&t.state.model), m)
            })
        })
        .collect();
    let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let (diff, name) = max_rel_diff(&out[0].0, &params(&one.state.model));
    assert!(diff < 1e-4, "rank 0 vs one rank: {diff} at {name}");
    let (diff, name) = max_rel_diff(&out[1].0, &out[0].0);
    assert!(diff == 0.0, "the ranks disagree: {diff} at {name}");
    for k in ["train/loss", "rewards/accuracies", "actor/grad_norm"] {
        assert!(
            (out[0].1[k] - whole[k]).abs() < 1e-5,
            "{k}: {} vs {}",
            out[0].1[k],
            whole[k]
        );
    }
}

#[test]
fn a_reward_model_learns_the_pairs_and_loads_as_the_reward_role() {
    let mut cfg = stage_config(TrainerKind::Reward);
    cfg.reward.kind = RewardKind::Model;
    // A causal LM: the score head starts fresh.
    cfg.reward.model = fixture("tiny-llama").display().to_string();
    cfg.algorithm.center_rewards_coefficient = Some(0.01);
    let s = spec(&cfg, RoleKind::Reward, RolePart::Whole, 0, 1);
    let mut t = RewardModelTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
    let (chosen, _) = seqs(&LENS, 21);
    let (rejected, _) = seqs(&LENS, 22);
    let req = |step| RewardModelUpdateRequest {
        chosen: chosen.clone(),
        rejected: rejected.clone(),
        margin: None,
        step,
    };
    let first = t.update(&mut single(), &req(1)).unwrap().metrics;
    let mut last = first.clone();
    for step in 2..=12 {
        last = t.update(&mut single(), &req(step)).unwrap().metrics;
    }
    assert_eq!(last["accuracy"], 1.0, "{first:?} -> {last:?}");
    assert!(
        last["margin"] > 1.0 && last["train/loss"] < 0.3 * first["train/loss"],
        "{last:?}"
    );
    let scores = |e: &dyn Score, seq: &Sequences| {
        e.score(&ScoresRequest {
            seq: seq.clone(),
            prompt_text: vec![String::new(); seq.rows()],
            response_text: vec![String::new(); seq.rows()],
            ground_truth: None,
        })
        .unwrap()
        .scores
    };
    let (c, r) = (scores(&t, &chosen), scores(&t, &rejected));
    assert!(c.iter().zip(&r).all(|(a, b)| a > b), "{c:?} vs {r:?}");

    // Saved as an HF sequence classifier, the reward role scores the same.
    let dir = tempfile::tempdir().unwrap();
    t.state
        .capture_checkpoint()
        .unwrap()
        .write(dir.path())
        .unwrap();
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(
        saved["architectures"][0], "LlamaForSequenceClassification",
        "{saved}"
    );
    let mut rcfg = config();
    rcfg.reward.kind = RewardKind::Model;
    rcfg.reward.model = dir.path().display().to_string();
    let role = reward(&rcfg).unwrap();
    let again = scores(&role, &chosen);
    for (a, b) in again.iter().zip(&c) {
        assert!((a - b).abs() < 1e-5, "{again:?} vs {c:?}");
    }
}

/// `training.zero_stage: 1`: two SFT ranks that each keep half of the AdamW state end every
/// step with exactly the weights of two ranks that keep all of it (AdamW is elementwise), and
/// their checkpoint (one shard per rank) holds exactly the unsharded optimizer state: one
/// unsharded rank and three sharded ranks read it back.
#[test]
fn zero_stage_1_steps_and_saves_exactly_like_plain_data_parallel() {
    let (seq, mask) = seqs(&LENS, 5);
    let half = |rows: std::ops::Range<usize>, step| {
        let pick_i = |m: &Mat<i64>| {
            Mat::new(
                rows.len(),
                m.cols,
                rows.clone().flat_map(|i| m.row(i).to_vec()).collect(),
            )
            .unwrap()
        };
        let pick_f = |m: &Mat<f32>| {
            Mat::new(
                rows.len(),
                m.cols,
                rows.clone().flat_map(|i| m.row(i).to_vec()).collect(),
            )
            .unwrap()
        };
        SftUpdateRequest {
            seq: Sequences {
                input_ids: pick_i(&seq.input_ids),
                attention_mask: pick_i(&seq.attention_mask),
                response_len: R,
            },
            loss_mask: pick_f(&mask),
            step,
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let run = |zero: u32| {
        let comms = group(2);
        let dir = tmp.path().join(format!("zero{zero}"));
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, mut c)| {
                let rows = if rank == 0 { 0..4 } else { 4..8 };
                let dir = dir.clone();
                let req = half(rows, 0);
                std::thread::spawn(move || {
                    let mut cfg = stage_config(TrainerKind::Sft);
                    cfg.training.zero_stage = zero;
                    cfg.training.weight_decay = 0.01;
                    let s = spec(
                        &cfg,
                        RoleKind::ActorRollout,
                        RolePart::Train,
                        rank as u32,
                        2,
                    );
                    let mut t = SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
                    assert_eq!(t.state.optim.opt.shard().is_some(), zero == 1);
                    for step in 1..=3 {
                        let mut r = req.clone();
                        r.step = step;
                        t.update(&mut c, &r).unwrap();
                    }
                    // Plain: rank 0 saves it all; sharded: every rank saves its shard.
                    if rank == 0 || zero == 1 {
                        t.state.capture_checkpoint().unwrap().write(&dir).unwrap();
                    }
                    (params(&t.state.model), t.state.optim.opt.owned_len())
                })
            })
            .collect();
        let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        (out, dir)
    };
    let (plain, plain_dir) = run(0);
    let (zero, zero_dir) = run(1);
    for rank in 0..2 {
        let (diff, name) = max_rel_diff(&zero[rank].0, &plain[rank].0);
        assert!(
            diff == 0.0,
            "rank {rank}: zero 1 vs 0 differ by {diff} at {name}"
        );
    }
    // Each sharded rank held about half of the moments.
    let total = plain[0].1;
    assert_eq!(zero[0].1 + zero[1].1, total);
    assert!(
        zero[0].1.abs_diff(zero[1].1) <= 1,
        "{} + {}",
        zero[0].1,
        zero[1].1
    );
    // The gathered checkpoint is the unsharded one, byte for byte in its optimizer file,
    // and one plain rank resumes from it.
    let cfg = stage_config(TrainerKind::Sft);
    let s = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, 0, 1);
    let load = |dir: &std::path::Path| {
        let mut t = SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
        t.state.load_checkpoint(dir).unwrap();
        t
    };
    let (one, reference) = (load(&zero_dir), load(&plain_dir));
    let state = |t: &SftTrainer| {
        let (tensors, step) = t.state.optim.opt.state().unwrap();
        let v: Vec<(String, Vec<f32>)> = tensors
            .into_iter()
            .map(|(n, x)| (n, x.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect();
        (v, step)
    };
    let ((a, sa), (b, sb)) = (state(&one), state(&reference));
    assert_eq!(sa, sb);
    for ((na, va), (nb, vb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        let first = va
            .iter()
            .zip(vb)
            .position(|(x, y)| x.to_bits() != y.to_bits());
        assert!(
            first.is_none(),
            "{na} differs at {first:?}: {:?}",
            first.map(|i| (va[i], vb[i]))
        );
    }
    let (diff, name) = max_rel_diff(&params(&one.state.model), &plain[0].0);
    assert!(diff == 0.0, "{diff} at {name}");
    assert!(zero_dir
        .with_file_name("zero1.rank-1")
        .join("manifest.json")
        .is_file());
    assert!(!zero_dir.join("optimizer.safetensors").exists());
    // Three sharded ranks: each reads its range out of the two shards.
    let whole: Vec<f32> = {
        let (tensors, _) = reference.state.optim.opt.state().unwrap();
        let mut cfg = stage_config(TrainerKind::Sft);
        cfg.training.zero_stage = 1;
        let s = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, 0, 1);
        let t = SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
        let names: Vec<String> = t.state.model.vars().into_iter().map(|(n, _)| n).collect();
        names
            .iter()
            .flat_map(|n| {
                let (_, x) = tensors
                    .iter()
                    .find(|(k, _)| *k == format!("exp_avg.{n}"))
                    .unwrap();
                x.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            })
            .collect()
    };
    let mut joined = Vec::new();
    for rank in 0..3 {
        let mut cfg = stage_config(TrainerKind::Sft);
        cfg.training.zero_stage = 1;
        cfg.training.global_batch_size = 9;
        let s = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, rank, 3);
        let mut t = SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
        t.state.load_checkpoint(&zero_dir).unwrap();
        assert_eq!(t.state.optim.opt.steps(), 3);
        joined.extend(t.state.optim.opt.owned_moments().unwrap().0);
    }
    assert_eq!(joined, whole);
    // A missing shard is named.
    std::fs::remove_dir_all(zero_dir.with_file_name("zero1.rank-1")).unwrap();
    let mut t = SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
    let e = t.state.load_checkpoint(&zero_dir).unwrap_err().to_string();
    assert!(e.contains("rank 1") && e.contains("zero1.rank-1"), "{e}");
}
