//! Property tests: identities that must hold for any batch.

use candle_core::{Device, Tensor};
use proptest::prelude::*;
use rlhf_algo::{
    agg_loss, compute_advantage, compute_metrics, compute_token_rewards, gae, masked_whiten,
    policy_loss, value_loss, AdvEstimator, AdvantageInputs, AlgorithmConfig, LossAggMode,
    PolicyLossConfig, RolloutMetricsInputs, TrainStats, ValueLossConfig,
};

/// A right-padded batch: `lengths[i]` valid tokens in row `i`, each in 1..=len.
#[derive(Debug, Clone)]
struct Batch {
    b: usize,
    t: usize,
    lengths: Vec<usize>,
    a: Vec<f32>,
    c: Vec<f32>,
    d: Vec<f32>,
    garbage: Vec<f32>,
    scores: Vec<f32>,
}

impl Batch {
    fn mask(&self) -> Vec<f32> {
        let mut m = vec![0f32; self.b * self.t];
        for (i, &n) in self.lengths.iter().enumerate() {
            m[i * self.t..i * self.t + n].fill(1.0);
        }
        m
    }
    fn tensor(&self, data: &[f32]) -> Tensor {
        Tensor::from_vec(data.to_vec(), (self.b, self.t), &Device::Cpu).unwrap()
    }
    /// `data` on the mask, `garbage` (scaled) elsewhere.
    fn padded(&self, data: &[f32], scale: f32) -> Tensor {
        let m = self.mask();
        let v: Vec<f32> = data
            .iter()
            .zip(&m)
            .zip(&self.garbage)
            .map(|((&x, &m), &g)| if m != 0.0 { x } else { g * scale })
            .collect();
        self.tensor(&v)
    }
}

fn batch_strategy() -> impl Strategy<Value = Batch> {
    (1usize..5, 2usize..14)
        .prop_flat_map(|(b, t)| {
            let n = b * t;
            (
                Just(b),
                Just(t),
                prop::collection::vec(1..=t, b),
                prop::collection::vec(-3.0f32..3.0, n),
                prop::collection::vec(-3.0f32..3.0, n),
                prop::collection::vec(-1.0f32..1.0, n),
                prop::collection::vec(-50.0f32..50.0, n),
                prop::collection::vec(-4.0f32..4.0, b),
            )
        })
        .prop_map(|(b, t, lengths, a, c, d, garbage, scores)| Batch {
            b,
            t,
            lengths,
            a,
            c,
            d,
            garbage,
            scores,
        })
}

fn host(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn scalar(t: &Tensor) -> f32 {
    t.to_scalar::<f32>().unwrap()
}

fn close(a: f32, b: f32, tol: f32) -> bool {
    (a - b).abs() <= tol * b.abs().max(1.0)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn gae_with_unit_discounts_is_reward_to_go_minus_value(batch in batch_strategy()) {
        let mask = batch.mask();
        let r = batch.padded(&batch.a, 1.0);
        let v = batch.padded(&batch.c, 1.0);
        let out = gae(&r, &v, &batch.tensor(&mask), 1.0, 1.0).unwrap();
        let adv = host(&out.advantages);
        let ret = host(&out.returns);
        for (i, &n) in batch.lengths.iter().enumerate() {
            let row = i * batch.t;
            for t in 0..n {
                let to_go: f32 = batch.a[row + t..row + n].iter().sum();
                prop_assert!(close(adv[row + t], to_go - batch.c[row + t], 1e-4),
                    "adv[{i},{t}] = {} vs {}", adv[row + t], to_go - batch.c[row + t]);
                prop_assert!(close(ret[row + t], to_go, 1e-4));
            }
            for t in n..batch.t {
                prop_assert_eq!(adv[row + t], 0.0);
                prop_assert_eq!(ret[row + t], 0.0);
            }
        }
    }

    #[test]
    fn whitening_gives_zero_mean_unit_variance(batch in batch_strategy()) {
        let mask = batch.mask();
        let n: usize = batch.lengths.iter().sum();
        prop_assume!(n >= 2);
        let vals: Vec<f32> = batch.a.iter().zip(&mask).filter(|(_, &m)| m != 0.0).map(|(&x, _)| x).collect();
        let mu = vals.iter().sum::<f32>() / n as f32;
        let var = vals.iter().map(|x| (x - mu).powi(2)).sum::<f32>() / (n - 1) as f32;
        prop_assume!(var > 1e-2);
        let w = host(&masked_whiten(&batch.padded(&batch.a, 1.0), &batch.tensor(&mask), true).unwrap());
        let sel: Vec<f64> = w.iter().zip(&mask).filter(|(_, &m)| m != 0.0).map(|(&x, _)| x as f64).collect();
        let mean = sel.iter().sum::<f64>() / n as f64;
        let var_w = sel.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        prop_assert!(mean.abs() < 1e-4, "mean {mean}");
        prop_assert!((var_w - 1.0).abs() < 1e-3, "var {var_w}");
    }

    #[test]
    fn masked_positions_never_change_any_result(batch in batch_strategy(), gamma in 0.5f64..=1.0, lam in 0.5f64..=1.0) {
        let mask_v = batch.mask();
        let n: usize = batch.lengths.iter().sum();
        prop_assume!(n >= 2);
        let mask = batch.tensor(&mask_v);
        let scores = Tensor::new(batch.scores.clone(), &Device::Cpu).unwrap();
        let has_eos: Vec<bool> = batch.lengths.iter().map(|&l| l < batch.t).collect();
        let groups: Vec<usize> = (0..batch.b).map(|i| i / 2).collect();
        let baseline = Tensor::new(vec![0.5f32; batch.b], &Device::Cpu).unwrap();
        // Everything a step computes, for one choice of padding contents.
        let run = |scale: f32| -> Vec<f32> {
            let logp: Vec<f32> = batch.a.iter().map(|x| -x.abs() - 0.1).collect();
            let ref_logp: Vec<f32> = batch.c.iter().map(|x| -x.abs() - 0.1).collect();
            let lp = batch.padded(&logp, scale);
            let rlp = batch.padded(&ref_logp, scale);
            let values = batch.padded(&batch.c, scale);
            let cfg = AlgorithmConfig {
                gamma,
                lam,
                missing_eos_penalty: Some(1.0),
                whiten_rewards: true,
                ..AlgorithmConfig::default()
            };
            let rw = compute_token_rewards(&scores, &lp, &rlp, &mask, &has_eos, 0.1, &cfg).unwrap();
            let mut out = host(&rw.rewards);
            out.extend(host(&rw.kl));
            let rewards = rw.rewards.add(&batch.padded(&vec![0.0; mask_v.len()], scale)).unwrap();
            let mut adv_gae = None;
            for est in AdvEstimator::ALL {
                let cfg = AlgorithmConfig { adv_estimator: *est, gamma, lam, ..AlgorithmConfig::default() };
                let inputs = AdvantageInputs {
                    token_rewards: &rewards,
                    response_mask: &mask,
                    values: Some(&values),
                    value_mask: None,
                    group_ids: Some(&groups),
                    baseline_scores: Some(&baseline),
                };
                let a = compute_advantage(&inputs, &cfg).unwrap();
                out.extend(host(&a.advantages));
                out.extend(host(&a.returns));
                if *est == AdvEstimator::Gae {
                    adv_gae = Some(a);
                }
            }
            let a = adv_gae.unwrap();
            let adv = a.advantages.add(&batch.padded(&vec![0.0; mask_v.len()], scale)).unwrap();
            let new_lp: Vec<f32> = logp.iter().zip(&batch.d).map(|(x, d)| x + 0.5 * d).collect();
            let new_lp = batch.padded(&new_lp, scale);
            let mut stats = TrainStats::new();
            for mode in LossAggMode::ALL {
                let pcfg = PolicyLossConfig { loss_agg_mode: *mode, ..PolicyLossConfig::default() };
                let p = policy_loss(&lp, &new_lp, &adv, &mask, &pcfg).unwrap();
                out.extend([scalar(&p.loss), p.clipfrac as f32, p.clipfrac_lower as f32, p.approxkl as f32]);
                stats.push_policy(&p).unwrap();
                let vcfg = ValueLossConfig { loss_agg_mode: *mode, ..ValueLossConfig::default() };
                let vp: Vec<f32> = batch.c.iter().zip(&batch.d).map(|(x, d)| x + 0.3 * d).collect();
                let v = value_loss(&batch.padded(&vp, scale), &values, &a.returns.add(&batch.padded(&vec![0.0; mask_v.len()], scale)).unwrap(), &mask, &vcfg).unwrap();
                out.push(scalar(&v.loss));
                out.push(v.clipfrac as f32);
                stats.push_value(&v).unwrap();
            }
            let m = compute_metrics(&RolloutMetricsInputs {
                rewards: &rw,
                logp: &lp,
                response_mask: &mask,
                has_eos: &has_eos,
                advantages: &adv,
                returns: &a.returns,
                values: Some(&values),
            }, &stats).unwrap();
            out.extend(m.values().map(|&v| v as f32));
            out
        };
        let first = run(1.0);
        let second = run(-0.5);
        prop_assert_eq!(first.len(), second.len());
        for (i, (a, b)) in first.iter().zip(&second).enumerate() {
            prop_assert!(close(*a, *b, 1e-6), "output {i}: {a} vs {b}");
        }
    }

    #[test]
    fn clipped_losses_equal_plain_ones_at_ratio_one(
        batch in batch_strategy(),
        clip in 0.05f64..0.5,
        high in 0.05f64..0.5,
        dual in prop::option::of(1.1f64..5.0),
        cliprange_value in 0.0f64..1.0,
    ) {
        let mask = batch.tensor(&batch.mask());
        let logp = batch.padded(&batch.a, 1.0);
        let adv = batch.padded(&batch.c, 1.0);
        for mode in LossAggMode::ALL {
            let cfg = PolicyLossConfig {
                clip_ratio: clip,
                clip_ratio_high: Some(high),
                clip_ratio_c: dual,
                loss_agg_mode: *mode,
                ..PolicyLossConfig::default()
            };
            let p = policy_loss(&logp, &logp, &adv, &mask, &cfg).unwrap();
            let plain = agg_loss(&adv.neg().unwrap(), &mask, *mode).unwrap();
            prop_assert!(close(scalar(&p.loss), scalar(&plain), 1e-5));
            prop_assert_eq!(p.clipfrac, 0.0);
            prop_assert_eq!(p.clipfrac_lower, 0.0);
            prop_assert!((p.ratio_mean - 1.0).abs() < 1e-6);

            let v = batch.padded(&batch.d, 1.0);
            let ret = batch.padded(&batch.a, 1.0);
            let vcfg = ValueLossConfig { cliprange_value, loss_agg_mode: *mode, ..ValueLossConfig::default() };
            let vl = value_loss(&v, &v, &ret, &mask, &vcfg).unwrap();
            let sq = v.sub(&ret).unwrap().sqr().unwrap();
            let plain_v = agg_loss(&sq, &mask, *mode).unwrap().affine(0.5, 0.0).unwrap();
            prop_assert!(close(scalar(&vl.loss), scalar(&plain_v), 1e-5));
            prop_assert_eq!(vl.clipfrac, 0.0);
        }
    }
}
