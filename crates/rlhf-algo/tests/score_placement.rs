//! `algorithm.score_placement`: the default puts the score on the last response token (verl);
//! `trl` puts it one slot past it as TRL's PPOTrainer does (`actual_end`), extends values and
//! GAE by that slot (`padding_mask_p1`) and keeps advantages on the response. Rows: EOS early,
//! EOS in the last slot, no EOS (the response fills the row).

use candle_core::{Device, Tensor};
use rlhf_algo::{
    compute_advantage, compute_token_rewards, AdvEstimator, AdvantageInputs, AlgorithmConfig,
    ScorePlacement,
};

const LEN: usize = 5;
const VALID: [usize; 3] = [2, LEN, LEN]; // response tokens per row (EOS included)

fn t(data: Vec<f32>, rows: usize) -> Tensor {
    Tensor::from_vec(data, (rows, LEN), &Device::Cpu).unwrap()
}

fn inputs() -> (Tensor, Tensor, Tensor, Tensor, Tensor) {
    let mut mask = vec![0f32; 3 * LEN];
    for (r, &n) in VALID.iter().enumerate() {
        mask[r * LEN..r * LEN + n].fill(1.0);
    }
    let logp: Vec<f32> = (0..3 * LEN).map(|i| -0.5 - 0.1 * i as f32).collect();
    let refp: Vec<f32> = (0..3 * LEN).map(|i| -0.7 - 0.05 * i as f32).collect();
    let values: Vec<f32> = (0..3 * LEN)
        .map(|i| 0.3 * ((i * 7) % 5) as f32 - 0.4)
        .collect();
    let scores = Tensor::new(&[1.5f32, -0.5, 2.0], &Device::Cpu).unwrap();
    (scores, t(logp, 3), t(refp, 3), t(mask, 3), t(values, 3))
}

fn cfg(p: ScorePlacement) -> AlgorithmConfig {
    AlgorithmConfig {
        score_placement: p,
        whiten_advantages: false,
        ..AlgorithmConfig::default()
    }
}

/// TRL's loop (trl/experimental/ppo/ppo_trainer.py, "compute advantages and returns") over one
/// row: every slot, values zero past `seq_len + 1`.
fn trl_gae(rewards: &[f32], values: &[f32], seq_len: usize, gamma: f32, lam: f32) -> Vec<f32> {
    let v: Vec<f32> = (0..LEN)
        .map(|t| if t <= seq_len + 1 { values[t] } else { 0.0 })
        .collect();
    let mut out = vec![0f32; LEN];
    let mut last = 0f32;
    for t in (0..LEN).rev() {
        let next = if t + 1 < LEN { v[t + 1] } else { 0.0 };
        let delta = rewards[t] + gamma * next - v[t];
        last = delta + gamma * lam * last;
        out[t] = last;
    }
    out
}

#[test]
fn trl_placement_moves_the_score_one_slot_and_extends_values() {
    let (scores, logp, refp, mask, values) = inputs();
    let has_eos = [true, true, false];
    let last = compute_token_rewards(
        &scores,
        &logp,
        &refp,
        &mask,
        &has_eos,
        0.1,
        &cfg(ScorePlacement::LastToken),
    )
    .unwrap();
    let trl = compute_token_rewards(
        &scores,
        &logp,
        &refp,
        &mask,
        &has_eos,
        0.1,
        &cfg(ScorePlacement::Trl),
    )
    .unwrap();
    let nsr = last.non_score_reward.to_vec2::<f32>().unwrap();
    let r_last = last.rewards.to_vec2::<f32>().unwrap();
    let r_trl = trl.rewards.to_vec2::<f32>().unwrap();
    let vm = trl.value_mask.to_vec2::<f32>().unwrap();
    let sc = [1.5f32, -0.5, 2.0];
    // Early EOS (2 tokens): verl scores slot 1, TRL slot 2, which joins the value mask.
    assert_eq!(r_last[0][1], nsr[0][1] + sc[0]);
    assert_eq!(r_trl[0][1], nsr[0][1]);
    assert_eq!(r_trl[0][2], sc[0]);
    assert_eq!(vm[0], vec![1.0, 1.0, 1.0, 0.0, 0.0]);
    // EOS in the last slot and no EOS: nowhere past the row, both score the last slot.
    for row in [1, 2] {
        assert_eq!(r_trl[row], r_last[row], "row {row}");
        assert_eq!(vm[row], vec![1.0; LEN], "row {row}");
    }
    assert_eq!(
        last.value_mask.to_vec2::<f32>().unwrap(),
        mask.to_vec2::<f32>().unwrap()
    );

    // GAE over the extended mask equals TRL's loop over every slot; advantages stay on the
    // response tokens.
    let c = cfg(ScorePlacement::Trl);
    let adv = compute_advantage(
        &AdvantageInputs {
            token_rewards: &trl.rewards,
            response_mask: &mask,
            values: Some(&values),
            value_mask: Some(&trl.value_mask),
            group_ids: None,
            baseline_scores: None,
        },
        &c,
    )
    .unwrap();
    let a = adv.advantages.to_vec2::<f32>().unwrap();
    let ret = adv.returns.to_vec2::<f32>().unwrap();
    let v = values.to_vec2::<f32>().unwrap();
    for (row, &n) in VALID.iter().enumerate() {
        let want = trl_gae(&r_trl[row], &v[row], n - 1, c.gamma as f32, c.lam as f32);
        for s in 0..LEN {
            let on_response = s < n;
            let want_adv = if on_response { want[s] } else { 0.0 };
            assert!(
                (a[row][s] - want_adv).abs() < 1e-6,
                "row {row} slot {s}: {} vs {want_adv}",
                a[row][s]
            );
            if vm[row][s] != 0.0 {
                assert!(
                    (ret[row][s] - (want[s] + v[row][s])).abs() < 1e-6,
                    "return row {row} slot {s}"
                );
            }
        }
    }
    // The early-EOS row's last token sees the score only through the extra slot's value.
    assert!((a[0][1] - want_slot1(&r_trl[0], &v[0], c.lam as f32)).abs() < 1e-6);
}

/// Slot 1 of the early-EOS row by hand: delta_2 = score - V_2, delta_1 = r_1 + V_2 - V_1.
fn want_slot1(r: &[f32], v: &[f32], lam: f32) -> f32 {
    let d2 = r[2] - v[2];
    let d1 = r[1] + v[2] - v[1];
    d1 + lam * d2
}

#[test]
fn trl_placement_needs_gae() {
    let c = AlgorithmConfig {
        adv_estimator: AdvEstimator::Grpo,
        score_placement: ScorePlacement::Trl,
        ..AlgorithmConfig::default()
    };
    let e = c.validate().unwrap_err().to_string();
    assert!(
        e.contains("algorithm.score_placement") && e.contains("gae") && e.contains("last_token"),
        "{e}"
    );
    assert_eq!(
        "trl".parse::<ScorePlacement>().unwrap(),
        ScorePlacement::Trl
    );
    let e = "trl_style"
        .parse::<ScorePlacement>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("last_token, trl"), "{e}");
}
