//! Times the algorithm math of one GRPO step on a batch of 256 x 4096 tokens for each loss
//! of the GRPO family (grpo, bnpo, dr_grpo, dapo, gspo, cispo, sapo): the group advantages
//! from the scores (`scale_rewards: group`), then the actor loss and its gradient w.r.t. the
//! log-probs, as the trainer needs both. `scripts/grpo_bench.sh` runs this next to the same
//! computation by TRL's code in PyTorch (`scripts/grpo_bench.py`), checks that both sides
//! agree, and prints the ratios.
//!
//! The inputs come from a counter-based hash that `grpo_bench.py` implements bit for bit, so
//! both sides see the same f32 numbers. The timed step starts from the scores, as TRL's does:
//! it places them on each row's last valid token (the token rewards `compute_advantage` takes),
//! and `actor_loss` also aggregates the token entropies the trainer reports (TRL's loss logs
//! their mean too).
//!
//! Usage: `cargo run --release -p rlhf-algo --example grpo_bench [-- --batch 256 --len 4096
//! --group 8 --iters 10 --losses grpo,sapo]`. The last lines are machine-readable:
//! `RESULT loss=<name> rust_median_ms=<ms> loss_value=<v> grad_abs_sum=<g>`.

use std::time::Instant;

use candle_core::{Device, Tensor, Var};
use rlhf_algo::{
    actor_loss, compute_advantage, AdvEstimator, AdvantageInputs, AlgorithmConfig,
    ImportanceSamplingLevel, LossAggMode, PolicyLoss, PolicyLossConfig, ScaleRewards,
};

/// One loss of the bench: TRL's name and our settings for it.
struct Case {
    name: &'static str,
    policy_loss: PolicyLoss,
    agg: LossAggMode,
    level: ImportanceSamplingLevel,
    eps_low: f64,
    eps_high: f64,
}

const CASES: &[Case] = &[
    Case {
        name: "grpo",
        policy_loss: PolicyLoss::Ppo,
        agg: LossAggMode::SeqMeanTokenMean,
        level: ImportanceSamplingLevel::Token,
        eps_low: 0.2,
        eps_high: 0.2,
    },
    Case {
        name: "bnpo",
        policy_loss: PolicyLoss::Ppo,
        agg: LossAggMode::TokenMean,
        level: ImportanceSamplingLevel::Token,
        eps_low: 0.2,
        eps_high: 0.2,
    },
    Case {
        name: "dr_grpo",
        policy_loss: PolicyLoss::Ppo,
        agg: LossAggMode::SeqMeanTokenSumNorm,
        level: ImportanceSamplingLevel::Token,
        eps_low: 0.2,
        eps_high: 0.2,
    },
    // one micro-batch per step: TRL's num_items_in_batch is this batch's token count
    Case {
        name: "dapo",
        policy_loss: PolicyLoss::Ppo,
        agg: LossAggMode::TokenMean,
        level: ImportanceSamplingLevel::Token,
        eps_low: 0.2,
        eps_high: 0.28,
    },
    Case {
        name: "gspo",
        policy_loss: PolicyLoss::Ppo,
        agg: LossAggMode::SeqMeanTokenMean,
        level: ImportanceSamplingLevel::Sequence,
        eps_low: 3e-4,
        eps_high: 4e-4,
    },
    // TRL's epsilon_high under cispo is the cap on the weight (cispo_clip_max here)
    Case {
        name: "cispo",
        policy_loss: PolicyLoss::Cispo,
        agg: LossAggMode::TokenMean,
        level: ImportanceSamplingLevel::Token,
        eps_low: 0.2,
        eps_high: 5.0,
    },
    Case {
        name: "sapo",
        policy_loss: PolicyLoss::Sapo,
        agg: LossAggMode::SeqMeanTokenMean,
        level: ImportanceSamplingLevel::Token,
        eps_low: 0.2,
        eps_high: 0.2,
    },
];

impl Case {
    fn config(&self, len: usize) -> PolicyLossConfig {
        let d = PolicyLossConfig::default();
        let cispo = self.policy_loss == PolicyLoss::Cispo;
        PolicyLossConfig {
            clip_ratio: self.eps_low,
            clip_ratio_high: Some(if cispo { self.eps_low } else { self.eps_high }),
            // TRL has no dual clip
            clip_ratio_c: None,
            loss_agg_mode: self.agg,
            // TRL's max_completion_length
            loss_scale_factor: (self.agg == LossAggMode::SeqMeanTokenSumNorm).then_some(len as f64),
            policy_loss: self.policy_loss,
            importance_sampling_level: self.level,
            cispo_clip_max: if cispo {
                self.eps_high
            } else {
                d.cispo_clip_max
            },
            sapo_temperature_pos: 1.0,
            sapo_temperature_neg: 1.05,
            ..d
        }
    }
}

/// Chris Wellons' lowbias32 integer hash (`grpo_bench.py` has the same).
fn lowbias32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7FEB_352D);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846C_A68B);
    x ^ (x >> 16)
}

/// `n` numbers in [0, 1) with 24 bits, exact in f32 and f64: element i of `stream`.
fn uniform(n: usize, stream: u32) -> Vec<f64> {
    let key = lowbias32(stream);
    (0..n)
        .map(|i| f64::from(lowbias32((i as u32).wrapping_add(key)) >> 8) / f64::from(1u32 << 24))
        .collect()
}

fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> rlhf_algo::Result<()> {
    let b: usize = arg("--batch", 256);
    let t: usize = arg("--len", 4096);
    let g: usize = arg("--group", 8).max(1);
    let iters: usize = arg("--iters", 10).max(1);
    let all: Vec<&str> = CASES.iter().map(|c| c.name).collect();
    let wanted: String = arg("--losses", all.join(","));
    let cases: Vec<&Case> = wanted
        .split(',')
        .map(|n| {
            CASES
                .iter()
                .find(|c| c.name == n)
                .unwrap_or_else(|| panic!("unknown loss {n}; choose from {}", all.join(",")))
        })
        .collect();
    assert!(
        b.is_multiple_of(g),
        "--batch {b} is not a multiple of --group {g}"
    );
    let dev = Device::Cpu;

    // The inputs of grpo_bench.py, element for element (f64 math, rounded to f32).
    let lens: Vec<usize> = uniform(b, 1)
        .iter()
        .map(|u| (t / 4 + (u * (t - t / 4 + 1) as f64).floor() as usize).min(t))
        .collect();
    let mut mask = vec![0f32; b * t];
    for (row, &len) in mask.chunks_exact_mut(t).zip(&lens) {
        row[..len].fill(1.0);
    }
    let scores: Vec<f32> = uniform(b, 2)
        .iter()
        .map(|u| (u * 4.0 - 2.0) as f32)
        .collect();
    let old: Vec<f32> = uniform(b * t, 3)
        .iter()
        .map(|u| (-3.0 * u) as f32)
        .collect();
    let drift: Vec<f64> = uniform(b, 4).iter().map(|u| (u - 0.5) * 0.01).collect();
    let logp: Vec<f32> = uniform(b * t, 5)
        .iter()
        .enumerate()
        .map(|(k, u)| ((f64::from(old[k]) + drift[k / t]) + (u - 0.5) * 0.4) as f32)
        .collect();
    let entropy: Vec<f32> = uniform(b * t, 6).iter().map(|u| (u * 2.0) as f32).collect();
    let valid = lens.iter().sum::<usize>();

    let tok = |v: Vec<f32>| Tensor::from_vec(v, (b, t), &dev);
    let mask = tok(mask)?;
    let old = tok(old)?;
    let logp = Var::from_tensor(&tok(logp)?)?;
    let entropy = tok(entropy)?;
    let groups: Vec<usize> = (0..b).map(|i| i / g).collect();
    let acfg = AlgorithmConfig {
        adv_estimator: AdvEstimator::Grpo,
        scale_rewards: ScaleRewards::Group,
        // TRL divides by std + 1e-4
        grpo_epsilon: 1e-4,
        use_kl_in_reward: false,
        ..AlgorithmConfig::default()
    };

    println!(
        "rlhf-algo GRPO bench: batch {b} x len {t}, group {g}, {valid} valid tokens, \
         {iters} iterations (median ms: advantages, loss, backward)"
    );
    let mut results = Vec::new();
    for case in cases {
        let pcfg = case.config(t);
        let mut times: [Vec<f64>; 4] = Default::default();
        let (mut value, mut grad_abs) = (0f64, 0f64);
        for it in 0..iters + 2 {
            let start = Instant::now();
            // The scores as token rewards: each on its row's last valid token.
            let mut rewards = vec![0f32; b * t];
            for (i, (&len, &s)) in lens.iter().zip(&scores).enumerate() {
                rewards[i * t + len - 1] = s;
            }
            let rewards = tok(rewards)?;
            let adv = compute_advantage(
                &AdvantageInputs {
                    token_rewards: &rewards,
                    response_mask: &mask,
                    values: None,
                    value_mask: None,
                    group_ids: Some(&groups),
                    baseline_scores: None,
                },
                &acfg,
            )?;
            let t_adv = start.elapsed().as_secs_f64() * 1e3;
            let out = actor_loss(
                &old,
                logp.as_tensor(),
                &adv.advantages,
                &mask,
                Some(&entropy),
                None,
                &pcfg,
            )?;
            let t_loss = start.elapsed().as_secs_f64() * 1e3;
            let grads = out.loss.backward()?;
            let grad = grads.get(&logp).expect("the loss depends on the log-probs");
            value = f64::from(out.loss.to_scalar::<f32>()?);
            let total = start.elapsed().as_secs_f64() * 1e3;
            if it >= 2 {
                times[0].push(t_adv);
                times[1].push(t_loss - t_adv);
                times[2].push(total - t_loss);
                times[3].push(total);
            }
            if it == iters + 1 {
                grad_abs = grad
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .map(|x| f64::from(x.abs()))
                    .sum();
            }
        }
        let fastest = times[3].iter().copied().fold(f64::INFINITY, f64::min);
        let [a, l, bw, total] = times.each_mut().map(|v| median(v));
        println!(
            "  {:<8} {total:9.3}   ({a:.3} + {l:.3} + {bw:.3}; min {fastest:.3}; loss {value:.6e}, sum |grad| {grad_abs:.6e})",
            case.name
        );
        results.push(format!(
            "RESULT loss={} rust_median_ms={total:.4} loss_value={value:.9e} grad_abs_sum={grad_abs:.9e}",
            case.name
        ));
    }
    println!("{}", results.join("\n"));
    Ok(())
}
