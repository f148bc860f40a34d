//! The GRPO family's policy losses and GRPO's reward scaling against TRL 1.16's own code
//! (`fixtures/grpo_losses.json`, written by `scripts/grpo_loss_reference.py`): every
//! micro-batch's loss, its gradient w.r.t. the log-probs and the metrics TRL logs that we
//! also report, to 1e-6; that the fixture tells every choice apart (a wrong aggregation,
//! ratio level or objective misses it); and the refusals of combinations that make no sense.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor, Var};
use rlhf_algo::{
    actor_loss, compute_advantage, micro_batch_scale, AdvEstimator, AdvantageInputs,
    AlgorithmConfig, GlobalBatch, ImportanceSamplingLevel, KlPenalty, LossAggMode, PolicyLoss,
    PolicyLossConfig, ScaleRewards,
};
use serde::Deserialize;

const TOL: f64 = 1e-6;

#[derive(Deserialize)]
struct Micro {
    logp: Vec<Vec<f32>>,
    old_logp: Vec<Vec<f32>>,
    ref_logp: Vec<Vec<f32>>,
    advantages: Vec<f32>,
    mask: Vec<Vec<f32>>,
    loss: f64,
    grad: Vec<Vec<f64>>,
    metrics: BTreeMap<String, f64>,
}

#[derive(Deserialize)]
struct LossCase {
    name: String,
    trl_loss_type: String,
    policy_loss: PolicyLoss,
    loss_agg_mode: LossAggMode,
    importance_sampling_level: ImportanceSamplingLevel,
    epsilon_low: f64,
    epsilon_high: f64,
    max_completion_length: Option<f64>,
    sapo_temperature_pos: Option<f64>,
    sapo_temperature_neg: Option<f64>,
    beta: Option<f64>,
    num_tokens: usize,
    num_seqs: usize,
    micro_batches: Vec<Micro>,
}

#[derive(Deserialize)]
struct AdvCase {
    scale_rewards: ScaleRewards,
    group_size: usize,
    epsilon: f64,
    rewards: Vec<f32>,
    advantages: Vec<f64>,
}

#[derive(Deserialize)]
struct Fixture {
    trl: String,
    losses: Vec<LossCase>,
    advantages: Vec<AdvCase>,
}

fn fixture() -> Fixture {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/grpo_losses.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn mat(rows: &[Vec<f32>]) -> Tensor {
    let (b, t) = (rows.len(), rows[0].len());
    Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap()
}

/// Our settings for a TRL case: GRPO's `epsilon`/`epsilon_high` are the clip ranges (no
/// dual clip: TRL has none), `epsilon_high` is CISPO's cap, `max_completion_length` is
/// Dr. GRPO's constant and `beta` the weight of the k3 KL loss.
fn config(case: &LossCase) -> PolicyLossConfig {
    let d = PolicyLossConfig::default();
    PolicyLossConfig {
        clip_ratio: case.epsilon_low,
        clip_ratio_high: Some(case.epsilon_high),
        clip_ratio_c: None,
        loss_agg_mode: case.loss_agg_mode,
        loss_scale_factor: case.max_completion_length,
        policy_loss: case.policy_loss,
        importance_sampling_level: case.importance_sampling_level,
        cispo_clip_max: if case.policy_loss == PolicyLoss::Cispo {
            case.epsilon_high
        } else {
            d.cispo_clip_max
        },
        sapo_temperature_pos: case.sapo_temperature_pos.unwrap_or(d.sapo_temperature_pos),
        sapo_temperature_neg: case.sapo_temperature_neg.unwrap_or(d.sapo_temperature_neg),
        use_kl_loss: case.beta.is_some(),
        kl_loss_coef: case.beta.unwrap_or(0.0),
        kl_loss_type: KlPenalty::LowVarKl,
        ..d
    }
}

/// One micro-batch's loss scaled for its accumulation window, the gradient of that w.r.t.
/// the log-probs, the clip fraction and the KL loss.
struct Ours {
    loss: f64,
    grad: Vec<Vec<f32>>,
    clipfrac: f64,
    kl: Option<f64>,
}

fn run(case: &LossCase, mb: &Micro, cfg: &PolicyLossConfig) -> Ours {
    let mask = mat(&mb.mask);
    let adv_rows: Vec<Vec<f32>> = mb
        .advantages
        .iter()
        .zip(&mb.mask)
        .map(|(&a, m)| m.iter().map(|&k| a * k).collect())
        .collect();
    let adv = mat(&adv_rows);
    let old = mat(&mb.old_logp);
    let reference = mat(&mb.ref_logp);
    let logp = Var::from_tensor(&mat(&mb.logp)).unwrap();
    let reference = cfg.use_kl_loss.then_some(&reference);
    let out = actor_loss(&old, logp.as_tensor(), &adv, &mask, None, reference, cfg).unwrap();
    let global = GlobalBatch {
        num_tokens: case.num_tokens,
        num_seqs: case.num_seqs,
        dp_size: 1,
    };
    let scale = micro_batch_scale(&mask, cfg.loss_agg_mode, &global).unwrap();
    let loss = out.loss.affine(scale, 0.0).unwrap();
    let grad = loss
        .backward()
        .unwrap()
        .get(&logp)
        .unwrap()
        .to_vec2()
        .unwrap();
    Ours {
        loss: f64::from(loss.to_scalar::<f32>().unwrap()),
        grad,
        clipfrac: out.policy.clipfrac,
        kl: out.kl_loss,
    }
}

/// Largest difference between ours and TRL's loss and gradient over a case's micro-batches.
fn worst(case: &LossCase, cfg: &PolicyLossConfig) -> (f64, f64) {
    let (mut dl, mut dg) = (0f64, 0f64);
    for mb in &case.micro_batches {
        let ours = run(case, mb, cfg);
        dl = dl.max((ours.loss - mb.loss).abs());
        for (a, b) in ours.grad.iter().flatten().zip(mb.grad.iter().flatten()) {
            dg = dg.max((f64::from(*a) - b).abs());
        }
    }
    (dl, dg)
}

/// TRL metrics this crate does not report (per-side and per-sequence extremes of the clip
/// share; the region share is `clipfrac`).
const NOT_REPORTED: &[&str] = &[
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
];

#[test]
fn losses_gradients_and_metrics_match_trl() {
    let fx = fixture();
    assert_eq!(fx.trl, "1.16.0");
    assert!(fx.losses.len() >= 12);
    let mut report = Vec::new();
    for case in &fx.losses {
        let cfg = config(case);
        let (dl, dg) = worst(case, &cfg);
        assert!(
            dl <= TOL && dg <= TOL,
            "{}: loss off by {dl:e}, gradient by {dg:e}",
            case.name
        );
        let mut dm = 0f64;
        for (k, mb) in case.micro_batches.iter().enumerate() {
            let ours = run(case, mb, &cfg);
            for (key, &want) in &mb.metrics {
                let got = match key.as_str() {
                    "clip_ratio/region_mean" | "cispo_clip_ratio" => ours.clipfrac,
                    "kl" => ours.kl.expect("a KL case uses the KL loss"),
                    other if NOT_REPORTED.contains(&other) => continue,
                    other => panic!("{}: TRL metric {other} is not checked", case.name),
                };
                assert!(
                    (got - want).abs() <= TOL,
                    "{} micro-batch {k}: {key} ours {got}, TRL {want}",
                    case.name
                );
                dm = dm.max((got - want).abs());
            }
            if case.policy_loss == PolicyLoss::Sapo {
                assert_eq!(ours.clipfrac, 0.0, "{}: SAPO clips nothing", case.name);
            }
        }
        report.push(format!(
            "{} ({}): loss {dl:.1e}, grad {dg:.1e}, metrics {dm:.1e}",
            case.name, case.trl_loss_type
        ));
    }
    println!("{}", report.join("\n"));
}

#[test]
fn the_fixture_tells_every_choice_apart() {
    // A wrong aggregation, ratio level or objective must miss TRL's numbers, so the test
    // above can fail.
    for case in &fixture().losses {
        let right = config(case);
        let mut wrong = Vec::new();
        for mode in LossAggMode::ALL {
            if *mode != right.loss_agg_mode {
                let loss_scale_factor = None;
                wrong.push(PolicyLossConfig {
                    loss_agg_mode: *mode,
                    loss_scale_factor,
                    ..right.clone()
                });
            }
        }
        for level in ImportanceSamplingLevel::ALL {
            if *level != right.importance_sampling_level {
                wrong.push(PolicyLossConfig {
                    importance_sampling_level: *level,
                    ..right.clone()
                });
            }
        }
        for loss in PolicyLoss::ALL {
            if *loss != right.policy_loss {
                wrong.push(PolicyLossConfig {
                    policy_loss: *loss,
                    ..right.clone()
                });
            }
        }
        if right.loss_agg_mode == LossAggMode::SeqMeanTokenSumNorm {
            // the constant is TRL's max_completion_length, not the padded width
            wrong.push(PolicyLossConfig {
                loss_scale_factor: None,
                ..right.clone()
            });
        }
        for cfg in wrong {
            let (dl, dg) = worst(case, &cfg);
            assert!(
                dl.max(dg) > 1e-4,
                "{}: {:?}/{:?}/{:?} also matches TRL ({dl:e}, {dg:e})",
                case.name,
                cfg.policy_loss,
                cfg.importance_sampling_level,
                cfg.loss_agg_mode
            );
        }
    }
}

#[test]
fn grpo_reward_scaling_matches_trl() {
    for case in fixture().advantages {
        let rows = case.rewards.len();
        let width = 3;
        // the score on the last token of a full-width response
        let mut rewards = vec![0f32; rows * width];
        for (i, &r) in case.rewards.iter().enumerate() {
            rewards[i * width + width - 1] = r;
        }
        let rewards = Tensor::from_vec(rewards, (rows, width), &Device::Cpu).unwrap();
        let mask = Tensor::ones((rows, width), candle_core::DType::F32, &Device::Cpu).unwrap();
        let groups: Vec<usize> = (0..rows).map(|i| i / case.group_size).collect();
        let cfg = AlgorithmConfig {
            adv_estimator: AdvEstimator::Grpo,
            scale_rewards: case.scale_rewards,
            grpo_epsilon: case.epsilon,
            ..AlgorithmConfig::default()
        };
        let inputs = AdvantageInputs {
            token_rewards: &rewards,
            response_mask: &mask,
            values: None,
            value_mask: None,
            group_ids: Some(&groups),
            baseline_scores: None,
        };
        let adv = compute_advantage(&inputs, &cfg).unwrap();
        let adv = adv.advantages.to_vec2::<f32>().unwrap();
        for (i, want) in case.advantages.iter().enumerate() {
            for got in &adv[i] {
                assert!(
                    (f64::from(*got) - want).abs() <= TOL,
                    "scale_rewards {}: row {i} ours {got}, TRL {want}",
                    case.scale_rewards
                );
            }
        }
    }
}

#[test]
fn norm_adv_by_std_off_is_scale_rewards_none() {
    let cfg = AlgorithmConfig {
        adv_estimator: AdvEstimator::Grpo,
        norm_adv_by_std_in_grpo: false,
        ..AlgorithmConfig::default()
    };
    assert_eq!(cfg.grpo_scale(), ScaleRewards::None);
    assert_eq!(AlgorithmConfig::default().grpo_scale(), ScaleRewards::Group);
}

fn refusal(cfg: &PolicyLossConfig) -> String {
    cfg.validate().expect_err("expected a refusal").to_string()
}

#[test]
fn senseless_policy_settings_are_refused_with_the_key_and_the_fix() {
    let d = PolicyLossConfig::default();
    for t in [0.0, -1.0, f64::NAN] {
        let e = refusal(&PolicyLossConfig {
            policy_loss: PolicyLoss::Sapo,
            sapo_temperature_neg: t,
            ..d.clone()
        });
        assert!(e.starts_with("invalid sapo_temperature_neg = "), "{e}");
        assert!(e.contains("finite number > 0"), "{e}");
    }
    let e = refusal(&PolicyLossConfig {
        sapo_temperature_pos: 0.0,
        ..d.clone()
    });
    assert!(e.starts_with("invalid sapo_temperature_pos = 0"), "{e}");
    let e = refusal(&PolicyLossConfig {
        policy_loss: PolicyLoss::Cispo,
        cispo_clip_max: 0.28,
        ..d.clone()
    });
    assert!(e.starts_with("invalid cispo_clip_max = 0.28"), "{e}");
    assert!(e.contains("ScaleRL uses 5.0"), "{e}");
    let e = refusal(&PolicyLossConfig {
        loss_scale_factor: Some(512.0),
        ..d.clone()
    });
    assert!(e.starts_with("invalid loss_scale_factor = 512"), "{e}");
    assert!(
        e.contains("set loss_agg_mode seq-mean-token-sum-norm"),
        "{e}"
    );
    let e = refusal(&PolicyLossConfig {
        loss_agg_mode: LossAggMode::SeqMeanTokenSumNorm,
        loss_scale_factor: Some(0.0),
        ..d.clone()
    });
    assert!(e.starts_with("invalid loss_scale_factor = 0"), "{e}");
    // and the losses refuse them too
    let m = Tensor::ones((1, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
    let e = rlhf_algo::policy_loss(
        &m,
        &m,
        &m,
        &m,
        &PolicyLossConfig {
            sapo_temperature_pos: -2.0,
            ..d.clone()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.starts_with("invalid sapo_temperature_pos"), "{e}");
    let e = rlhf_algo::agg_loss_scaled(&m, &m, LossAggMode::TokenMean, Some(4.0))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("invalid loss_scale_factor = 4"), "{e}");
}

#[test]
fn senseless_reward_scaling_is_refused() {
    let e = AlgorithmConfig {
        adv_estimator: AdvEstimator::Grpo,
        scale_rewards: ScaleRewards::Batch,
        norm_adv_by_std_in_grpo: false,
        ..AlgorithmConfig::default()
    }
    .validate()
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("invalid algorithm.scale_rewards = batch"),
        "{e}"
    );
    assert!(e.contains("set norm_adv_by_std_in_grpo true"), "{e}");
    let e = AlgorithmConfig {
        adv_estimator: AdvEstimator::Rloo,
        scale_rewards: ScaleRewards::None,
        ..AlgorithmConfig::default()
    }
    .validate()
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("invalid algorithm.scale_rewards = none"),
        "{e}"
    );
    assert!(e.contains("use adv_estimator grpo"), "{e}");
}

#[test]
fn names_are_closed_and_snake_case() {
    let cfg: PolicyLossConfig = serde_json::from_str(
        r#"{"policy_loss": "cispo", "importance_sampling_level": "sequence",
            "loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 1024}"#,
    )
    .unwrap();
    assert_eq!(cfg.policy_loss, PolicyLoss::Cispo);
    assert_eq!(
        cfg.importance_sampling_level,
        ImportanceSamplingLevel::Sequence
    );
    assert_eq!(cfg.loss_agg_mode, LossAggMode::SeqMeanTokenSumNorm);
    cfg.validate().unwrap();
    let e = serde_json::from_str::<PolicyLossConfig>(r#"{"policy_loss": "gspo"}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("unknown variant `gspo`, expected one of"),
        "{e}"
    );
    let e = "group_mean"
        .parse::<ScaleRewards>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("group, batch, none"), "{e}");
    let a: AlgorithmConfig = serde_json::from_str(r#"{"scale_rewards": "batch"}"#).unwrap();
    assert_eq!(a.scale_rewards, ScaleRewards::Batch);
}

/// DAPO's overlong shaping at `penalty_factor` 1 against TRL's
/// `get_soft_overlong_punishment` (`fixtures/overlong.json`, `scripts/overlong_reference.py`),
/// and scaled by the factor otherwise.
#[test]
fn overlong_penalty_is_trls_soft_overlong_punishment() {
    #[derive(Deserialize)]
    struct Case {
        max_len: usize,
        buffer: u32,
        lengths: Vec<usize>,
        rewards: Vec<f64>,
    }
    #[derive(Deserialize)]
    struct Fixture {
        cases: Vec<Case>,
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/overlong.json");
    let fx: Fixture = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(fx.cases.len() >= 4);
    let mut below_zero = 0;
    for c in &fx.cases {
        for factor in [1.0, 0.5] {
            let cfg = rlhf_algo::OverlongBufferConfig {
                enable: true,
                len: c.buffer,
                penalty_factor: factor,
            };
            for (&len, &want) in c.lengths.iter().zip(&c.rewards) {
                let got = rlhf_algo::overlong_penalty(len, c.max_len, &cfg);
                assert!(
                    (got - factor * want).abs() <= TOL,
                    "max {} buffer {} length {len} factor {factor}: {got} vs TRL {want}",
                    c.max_len,
                    c.buffer
                );
                below_zero += usize::from(want < 0.0);
            }
        }
    }
    assert!(below_zero > 10, "the fixture must reach into the buffer");
}
