//! Times one PPO step's math for a batch of 256 x 1024 tokens: per-token rewards
//! with KL, GAE + whitening, clipped policy and value losses, and all metrics.
//! `scripts/algo_bench.sh` runs this next to the same computation in PyTorch
//! (`scripts/algo_bench.py`) and prints the ratio.
//!
//! Usage: `cargo run --release -p rlhf-algo --example algo_bench [-- --batch 256 --len 1024 --iters 20]`
//! The last line is machine-readable: `RESULT rust_median_ms=<total>`.

use std::time::Instant;

use candle_core::{Device, Tensor};
use rlhf_algo::{
    compute_advantage, compute_metrics, compute_token_rewards, metric, policy_loss, value_loss,
    AdvantageInputs, AlgorithmConfig, PolicyLossConfig, RolloutMetricsInputs, TrainStats,
    ValueLossConfig,
};

/// xorshift64*: a dependency-free, seeded generator; the numbers only need to
/// look like log-probs and values, not to be good randomness.
struct Rng(u64);

impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (x >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        // Irwin-Hall approximation: plenty for benchmark data.
        (0..4).map(|_| self.next_f32()).sum::<f32>() - 2.0
    }
}

fn arg(name: &str, default: usize) -> usize {
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
    let b = arg("--batch", 256);
    let t = arg("--len", 1024);
    let iters = arg("--iters", 20).max(1);
    let dev = Device::Cpu;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);

    let mut mask = vec![0f32; b * t];
    let mut has_eos = vec![false; b];
    for (i, eos) in has_eos.iter_mut().enumerate() {
        let len = t / 4 + (rng.next_f32() * (t - t / 4) as f32) as usize;
        let len = len.clamp(1, t);
        mask[i * t..i * t + len].fill(1.0);
        *eos = len < t;
    }
    let tok = |v: Vec<f32>| Tensor::from_vec(v, (b, t), &dev);
    let mut gen =
        |f: &mut dyn FnMut(&mut Rng) -> f32| (0..b * t).map(|_| f(&mut rng)).collect::<Vec<f32>>();
    let logp_v = gen(&mut |r| -2.0 * r.next_f32() - 0.01);
    let ref_v: Vec<f32> = {
        let noise = gen(&mut |r| 0.1 * r.normal());
        logp_v.iter().zip(noise).map(|(a, n)| a + n).collect()
    };
    let new_v: Vec<f32> = {
        let noise = gen(&mut |r| 0.2 * r.normal());
        logp_v.iter().zip(noise).map(|(a, n)| a + n).collect()
    };
    let values_v = gen(&mut |r| r.normal());
    let vpreds_v: Vec<f32> = {
        let noise = gen(&mut |r| 0.3 * r.normal());
        values_v.iter().zip(noise).map(|(a, n)| a + n).collect()
    };
    let scores_v: Vec<f32> = (0..b).map(|_| 2.0 * rng.normal()).collect();

    let mask = tok(mask)?;
    let logp = tok(logp_v)?;
    let ref_logp = tok(ref_v)?;
    let new_logp = tok(new_v)?;
    let values = tok(values_v)?;
    let vpreds = tok(vpreds_v)?;
    let scores = Tensor::from_vec(scores_v, b, &dev)?;

    let cfg = AlgorithmConfig {
        missing_eos_penalty: Some(1.0),
        ..AlgorithmConfig::default()
    };
    let pcfg = PolicyLossConfig::default();
    let vcfg = ValueLossConfig::default();

    let stages = [
        "rewards",
        "gae+whiten",
        "policy_loss",
        "value_loss",
        "metrics",
    ];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); stages.len() + 1];
    let mut checksum = 0f64;
    for it in 0..iters + 2 {
        let mut lap = [0f64; 5];
        let start = Instant::now();
        let mut t0 = Instant::now();
        let mut tick = |i: usize| {
            lap[i] = t0.elapsed().as_secs_f64() * 1e3;
            t0 = Instant::now();
        };
        let rw = compute_token_rewards(&scores, &logp, &ref_logp, &mask, &has_eos, 0.05, &cfg)?;
        tick(0);
        let inputs = AdvantageInputs {
            token_rewards: &rw.rewards,
            response_mask: &mask,
            values: Some(&values),
            value_mask: None,
            group_ids: None,
            baseline_scores: None,
        };
        let adv = compute_advantage(&inputs, &cfg)?;
        tick(1);
        let p = policy_loss(&logp, &new_logp, &adv.advantages, &mask, &pcfg)?;
        tick(2);
        let v = value_loss(&vpreds, &values, &adv.returns, &mask, &vcfg)?;
        tick(3);
        let mut stats = TrainStats::new();
        stats.push_policy(&p)?;
        stats.push_value(&v)?;
        let metrics = compute_metrics(
            &RolloutMetricsInputs {
                rewards: &rw,
                logp: &logp,
                response_mask: &mask,
                has_eos: &has_eos,
                advantages: &adv.advantages,
                returns: &adv.returns,
                values: Some(&values),
            },
            &stats,
        )?;
        tick(4);
        let total = start.elapsed().as_secs_f64() * 1e3;
        if it >= 2 {
            for (i, l) in lap.iter().enumerate() {
                times[i].push(*l);
            }
            times[stages.len()].push(total);
        }
        checksum = metrics[metric::LOSS_POLICY_AVG] + metrics[metric::LOSS_VALUE_AVG];
    }
    println!("rlhf-algo bench: batch {b} x len {t}, {iters} iterations (median ms)");
    for (i, s) in stages.iter().enumerate() {
        println!("  {s:<12} {:8.3}", median(&mut times[i]));
    }
    let total = median(&mut times[stages.len()]);
    println!("  {:<12} {total:8.3}   (checksum {checksum:.6})", "total");
    println!("RESULT rust_median_ms={total:.4}");
    Ok(())
}
