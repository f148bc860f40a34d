//! Bad input gives an error naming the tensor (or key) at fault, never a panic.

use candle_core::{DType, Device, Tensor};
use rlhf_algo::{
    agg_loss, compute_advantage, compute_token_rewards, gae, grpo_outcome_advantage, kl_penalty,
    masked_whiten, policy_loss, remax_advantage, value_loss, AdvEstimator, AdvantageInputs,
    AlgoError, AlgorithmConfig, KlController, KlCtrlConfig, KlPenalty, LossAggMode,
    PolicyLossConfig, ValueLossConfig,
};

fn t(b: usize, l: usize, v: f32) -> Tensor {
    Tensor::full(v, (b, l), &Device::Cpu).unwrap()
}

fn ones(b: usize, l: usize) -> Tensor {
    t(b, l, 1.0)
}

fn with(b: usize, l: usize, at: (usize, usize), v: f32) -> Tensor {
    let mut d = vec![0.5f32; b * l];
    d[at.0 * l + at.1] = v;
    Tensor::from_vec(d, (b, l), &Device::Cpu).unwrap()
}

fn msg<T: std::fmt::Debug>(r: Result<T, AlgoError>) -> String {
    r.expect_err("expected an error").to_string()
}

#[test]
fn shape_mismatch_names_both_tensors() {
    let e = msg(gae(&t(4, 9, 0.0), &t(4, 10, 0.0), &ones(4, 10), 1.0, 0.95));
    assert_eq!(
        e,
        "token_rewards: shape [4, 9] does not match response_mask [4, 10]"
    );
    let e = msg(policy_loss(
        &t(4, 10, 0.0),
        &t(4, 10, 0.0),
        &t(4, 9, 0.0),
        &ones(4, 10),
        &PolicyLossConfig::default(),
    ));
    assert_eq!(
        e,
        "advantages: shape [4, 9] does not match response_mask [4, 10]"
    );
    let e = msg(value_loss(
        &t(4, 10, 0.0),
        &t(3, 10, 0.0),
        &t(4, 10, 0.0),
        &ones(4, 10),
        &ValueLossConfig::default(),
    ));
    assert!(e.starts_with("old_values: shape [3, 10]"), "{e}");
    let scores = Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
    let e = msg(compute_token_rewards(
        &scores,
        &t(4, 10, -1.0),
        &t(4, 10, -1.0),
        &ones(4, 10),
        &[true; 4],
        0.05,
        &AlgorithmConfig::default(),
    ));
    assert!(e.starts_with("scores: shape [3]"), "{e}");
    let e = msg(kl_penalty(&t(2, 3, 0.0), &t(2, 4, 0.0), KlPenalty::Kl));
    assert!(
        e.starts_with("ref_logp: shape [2, 4] does not match logp [2, 3]"),
        "{e}"
    );
    let e = msg(remax_advantage(
        &t(2, 3, 0.0),
        &Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap(),
        &ones(2, 3),
    ));
    assert!(e.starts_with("baseline_scores: shape [5]"), "{e}");
    let rank3 = Tensor::zeros((2, 3, 4), DType::F32, &Device::Cpu).unwrap();
    let e = msg(gae(&rank3, &rank3, &rank3, 1.0, 0.95));
    assert!(e.starts_with("response_mask: expected a 2-D tensor"), "{e}");
}

#[test]
fn all_zero_mask_is_an_error() {
    let z = t(2, 3, 0.0);
    for e in [
        msg(gae(&z, &z, &z, 1.0, 0.95)),
        msg(policy_loss(&z, &z, &z, &z, &PolicyLossConfig::default())),
        msg(value_loss(&z, &z, &z, &z, &ValueLossConfig::default())),
        msg(agg_loss(&z, &z, LossAggMode::SeqMeanTokenMean)),
        msg(masked_whiten(&z, &z, true)),
        msg(grpo_outcome_advantage(&z, &z, &[0, 0], true, 1e-6)),
    ] {
        assert!(
            e.starts_with("response_mask: mask has no valid")
                || e.starts_with("mask: mask has no valid"),
            "{e}"
        );
    }
}

#[test]
fn nan_and_inf_are_located() {
    let m = ones(4, 20);
    let e = msg(gae(
        &t(4, 20, 0.0),
        &with(4, 20, (3, 17), f32::NAN),
        &m,
        1.0,
        0.95,
    ));
    assert_eq!(
        e.split(';').next().unwrap(),
        "values: contains NaN at [3, 17]"
    );
    let e = msg(policy_loss(
        &t(4, 20, -1.0),
        &with(4, 20, (1, 2), f32::INFINITY),
        &t(4, 20, 1.0),
        &m,
        &PolicyLossConfig::default(),
    ));
    assert_eq!(e.split(';').next().unwrap(), "logp: contains inf at [1, 2]");
    let e = msg(value_loss(
        &t(4, 20, 0.0),
        &t(4, 20, 0.0),
        &with(4, 20, (0, 0), f32::NEG_INFINITY),
        &m,
        &ValueLossConfig::default(),
    ));
    assert_eq!(
        e.split(';').next().unwrap(),
        "returns: contains -inf at [0, 0]"
    );
    let scores = Tensor::new(&[0.0f32, f32::NAN, 1.0, 2.0], &Device::Cpu).unwrap();
    let e = msg(compute_token_rewards(
        &scores,
        &t(4, 20, -1.0),
        &t(4, 20, -1.0),
        &m,
        &[true; 4],
        0.05,
        &AlgorithmConfig::default(),
    ));
    assert_eq!(e.split(';').next().unwrap(), "scores: contains NaN at [1]");
    // A NaN in the padding is still bad input: it signals a broken producer.
    let half = Tensor::from_vec(
        (0..80)
            .map(|i| if i % 20 < 10 { 1.0f32 } else { 0.0 })
            .collect(),
        (4, 20),
        &Device::Cpu,
    )
    .unwrap();
    let e = msg(gae(
        &with(4, 20, (2, 15), f32::NAN),
        &t(4, 20, 0.0),
        &half,
        1.0,
        0.95,
    ));
    assert_eq!(
        e.split(';').next().unwrap(),
        "token_rewards: contains NaN at [2, 15]"
    );
}

#[test]
fn other_bad_inputs() {
    let m = ones(2, 3);
    let e = msg(with_mask_value(0.5));
    assert!(
        e.contains("mask values must be 0.0 or 1.0, found 0.5 at [0, 1]"),
        "{e}"
    );
    let e = msg(grpo_outcome_advantage(&t(2, 3, 1.0), &m, &[0], true, 1e-6));
    assert!(
        e.starts_with("group_ids: has 1 entries for a batch of 2"),
        "{e}"
    );
    let cfg = AlgorithmConfig {
        adv_estimator: AdvEstimator::Remax,
        ..AlgorithmConfig::default()
    };
    let r = t(2, 3, 1.0);
    let inputs = AdvantageInputs {
        token_rewards: &r,
        response_mask: &m,
        values: None,
        value_mask: None,
        group_ids: None,
        baseline_scores: None,
    };
    assert_eq!(
        msg(compute_advantage(&inputs, &cfg)),
        "baseline_scores: the `remax` advantage estimator needs it"
    );
    let e = msg(compute_token_rewards(
        &Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap(),
        &r,
        &r,
        &m,
        &[true],
        0.05,
        &AlgorithmConfig::default(),
    ));
    assert!(
        e.starts_with("has_eos: has 1 entries for a batch of 2"),
        "{e}"
    );
    let f64_t = Tensor::zeros((2, 3), DType::F64, &Device::Cpu).unwrap();
    let e = msg(gae(&f64_t, &r, &m, 1.0, 0.95));
    assert!(
        e.starts_with("token_rewards: dtype F64 is not supported"),
        "{e}"
    );
    // One valid token cannot be whitened (unbiased variance).
    let one = Tensor::new(&[[1f32, 0.0, 0.0]], &Device::Cpu).unwrap();
    let e = msg(masked_whiten(
        &Tensor::new(&[[1f32, 2.0, 3.0]], &Device::Cpu).unwrap(),
        &one,
        true,
    ));
    assert!(e.contains("at least 2 valid positions, found 1"), "{e}");
}

fn with_mask_value(v: f32) -> Result<rlhf_algo::Advantages, AlgoError> {
    let mut d = vec![1f32; 6];
    d[1] = v;
    let m = Tensor::from_vec(d, (2, 3), &Device::Cpu).unwrap();
    gae(&t(2, 3, 0.0), &t(2, 3, 0.0), &m, 1.0, 0.95)
}

#[test]
fn config_errors_name_the_key() {
    let cfg = PolicyLossConfig {
        clip_ratio_c: Some(0.9),
        ..PolicyLossConfig::default()
    };
    let e = msg(cfg.validate());
    assert!(e.starts_with("invalid clip_ratio_c = 0.9"), "{e}");
    let e = msg(AlgorithmConfig {
        lam: 1.5,
        ..AlgorithmConfig::default()
    }
    .validate());
    assert!(e.starts_with("invalid algorithm.lam = 1.5"), "{e}");
    let e = msg(KlController::from_config(&KlCtrlConfig {
        kind: rlhf_algo::KlCtrlType::Adaptive,
        horizon: 0.0,
        ..KlCtrlConfig::default()
    }));
    assert!(
        e.starts_with("invalid algorithm.kl_ctrl.horizon = 0"),
        "{e}"
    );
    // Typos in config keys and names are rejected, listing what is valid.
    let e = serde_json::from_str::<PolicyLossConfig>(r#"{"clip_ration": 0.3}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown field `clip_ration`"), "{e}");
    let e = serde_json::from_str::<AlgorithmConfig>(r#"{"adv_estimator": "ppo"}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown variant `ppo`") && e.contains("reinforce_plus_plus"),
        "{e}"
    );
    // Defaults are TRL's.
    let d: AlgorithmConfig = serde_json::from_str("{}").unwrap();
    assert_eq!((d.gamma, d.lam, d.kl_ctrl.kl_coef), (1.0, 0.95, 0.05));
    let v: ValueLossConfig = serde_json::from_str("{}").unwrap();
    assert_eq!((v.cliprange_value, v.vf_coef), (0.2, 0.1));
    let p: PolicyLossConfig = serde_json::from_str(r#"{"clip_ratio_c": null}"#).unwrap();
    assert_eq!((p.clip_ratio, p.clip_ratio_c), (0.2, None));
    // verl's aliases k1/k2/k3 are accepted; the kl_ctrl section nests.
    let p: PolicyLossConfig = serde_json::from_str(r#"{"kl_loss_type": "k3"}"#).unwrap();
    assert_eq!(p.kl_loss_type, KlPenalty::LowVarKl);
    let a: AlgorithmConfig =
        serde_json::from_str(r#"{"kl_ctrl": {"type": "adaptive", "horizon": 500}}"#).unwrap();
    assert_eq!(a.kl_ctrl.kind, rlhf_algo::KlCtrlType::Adaptive);
    assert_eq!((a.kl_ctrl.horizon, a.kl_ctrl.target_kl), (500.0, 6.0));
}
