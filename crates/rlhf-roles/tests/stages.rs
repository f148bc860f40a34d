//! The engines of the other stages without gRPC, on the tiny model: SFT's loss is the mean
//! NLL of exactly the completion tokens and falls; DPO starts at ln 2 with zero margins and
//! learns the pairs (every loss type lowers its loss); a reward model trained from a causal
//! LM ranks every pair, is saved as a sequence classifier and scores the same when the
//! reward role loads it; two ranks on halves equal one rank on the whole batch.

mod common;

use common::*;
use rlhf_algo::PreferenceLoss;
use rlhf_config::{RewardKind, TrainerKind};
use rlhf_core::calls::{
    LogProbsRequest, Mat, PreferenceUpdateRequest, RewardModelUpdateRequest, ScoresRequest,
    Sequences, SftUpdateRequest,
};
use rlhf_core::{RoleKind, RolePart};
use rlhf_roles::{LogProbs, PreferenceTrainer, RewardModelTrainer, Score, SftTrainer};

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

/// LoRA dropout in SFT (`actor_rollout.lora.dropout`): the masks come from the job seed,
/// the step and the rows, so two runs end with the same adapters bit for bit (what exact
/// resume needs); dropout changes the training (other adapters than without it) but not
/// evaluation, whose log-probs are the same before and after an update's pass ends.
#[test]
fn sft_with_lora_dropout_trains_repeatably() {
    let (seq, resp) = seqs(&LENS, 3);
    let run = |dropout: f64| {
        let mut cfg = stage_config(TrainerKind::Sft);
        cfg.actor_rollout.lora.rank = 4;
        cfg.actor_rollout.lora.alpha = 8.0;
        cfg.actor_rollout.lora.dropout = dropout;
        let s = spec(&cfg, RoleKind::ActorRollout, RolePart::Train, 0, 1);
        let mut t = SftTrainer::new(&s, &candle_core::Device::Cpu).unwrap();
        let mut losses = Vec::new();
        for step in 1..=3 {
            let req = SftUpdateRequest {
                seq: seq.clone(),
                loss_mask: resp.clone(),
                step,
            };
            losses.push(t.update(&mut single(), &req).unwrap().metrics["train/loss"]);
        }
        let lp = logps(&t, &seq);
        assert_eq!(lp, logps(&t, &seq), "evaluation is deterministic");
        (params(&t.state.model), losses, lp)
    };
    let (a, la, lpa) = run(0.3);
    let (b, lb, lpb) = run(0.3);
    let (c, lc, _) = run(0.0);
    assert!(a.iter().any(|(n, _)| n.contains("lora_A")), "no adapters");
    assert_eq!(
        max_rel_diff(&a, &b).0,
        0.0,
        "dropout masks differ between runs"
    );
    assert_eq!((la.clone(), lpa), (lb, lpb));
    assert!(max_rel_diff(&a, &c).0 > 1e-4, "dropout changed nothing");
    // B starts at zero (PEFT's init), so the first loss is the base model's either way;
    // after that the masks show.
    assert_eq!(la[0], lc[0]);
    assert!((la[2] - lc[2]).abs() > 1e-6, "{} vs {}", la[2], lc[2]);
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
    // AdamW's first step moves a weight by ~lr * g / (|g| + eps): for a near-zero gradient
    // the f32 rounding of summing two halves instead of the whole batch is amplified. The
    // machine's matmul kernels set that rounding: 4.6e-4 here on an AVX-512 CPU, below 1e-4
    // on others. A missing or doubled share moves weights by lr (~5 relative), far above this.
    assert!(diff < 2e-3, "rank 0 vs one rank: {diff} at {name}");
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
        .capture_checkpoint(None)
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
