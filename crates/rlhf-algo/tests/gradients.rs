//! The losses are differentiable: gradients reach the inputs the caller
//! trains through, are finite and non-zero, and match central finite differences.

use candle_core::{Device, Tensor, Var};
use rlhf_algo::{
    actor_loss, entropy_from_logits, policy_loss, value_loss, LossAggMode, PolicyLossConfig,
    ValueLossConfig,
};

const B: usize = 3;
const T: usize = 5;

fn mask() -> Tensor {
    let m: Vec<f32> = [5usize, 3, 1]
        .iter()
        .flat_map(|&n| (0..T).map(move |t| if t < n { 1.0 } else { 0.0 }))
        .collect();
    Tensor::from_vec(m, (B, T), &Device::Cpu).unwrap()
}

fn tok(data: &[f32]) -> Tensor {
    Tensor::from_vec(data.to_vec(), (B, T), &Device::Cpu).unwrap()
}

/// Central differences of `f` at `x`, one element at a time.
fn finite_diff(x: &[f32], eps: f32, f: impl Fn(&Tensor) -> f32) -> Vec<f32> {
    (0..x.len())
        .map(|i| {
            let mut plus = x.to_vec();
            let mut minus = x.to_vec();
            plus[i] += eps;
            minus[i] -= eps;
            (f(&tok(&plus)) - f(&tok(&minus))) / (2.0 * eps)
        })
        .collect()
}

fn check_grad(what: &str, analytic: &Tensor, numeric: &[f32]) {
    let a = analytic.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(
        a.iter().all(|g| g.is_finite()),
        "{what}: non-finite gradient {a:?}"
    );
    assert!(
        a.iter().any(|&g| g.abs() > 1e-4),
        "{what}: gradient is all zero"
    );
    for (i, (g, n)) in a.iter().zip(numeric).enumerate() {
        assert!(
            (g - n).abs() <= 2e-3 * n.abs().max(0.05),
            "{what}[{i}]: autograd {g} vs finite difference {n}"
        );
    }
}

// Log-ratios chosen away from the clip edges (ratio 0.8 / 1.2 and the dual-clip
// bound 3) so a small step never crosses a kink of the loss.
const LOG_RATIO: [f32; B * T] = [
    0.0, 0.5, -0.6, 0.1, 1.4, //
    -0.05, 0.3, 1.3, 9.0, 9.0, //
    -0.4, 9.0, 9.0, 9.0, 9.0,
];
const ADV: [f32; B * T] = [
    1.0, -0.7, 0.4, -1.2, -0.9, //
    0.3, 1.5, -0.2, 7.0, 7.0, //
    -2.0, 7.0, 7.0, 7.0, 7.0,
];

#[test]
fn policy_loss_gradient_matches_finite_differences() {
    let old: Vec<f32> = (0..B * T).map(|i| -0.5 - 0.1 * i as f32).collect();
    let new: Vec<f32> = old.iter().zip(LOG_RATIO).map(|(o, d)| o + d).collect();
    let old_t = tok(&old);
    let adv = tok(&ADV);
    let m = mask();
    for (mode, dual) in [
        (LossAggMode::TokenMean, Some(3.0)),
        (LossAggMode::SeqMeanTokenSum, None),
        (LossAggMode::SeqMeanTokenMean, Some(3.0)),
    ] {
        let cfg = PolicyLossConfig {
            loss_agg_mode: mode,
            clip_ratio_c: dual,
            ..PolicyLossConfig::default()
        };
        let var = Var::from_tensor(&tok(&new)).unwrap();
        let out = policy_loss(&old_t, var.as_tensor(), &adv, &m, &cfg).unwrap();
        assert!(out.clipfrac > 0.0, "the data must exercise clipping");
        if dual.is_some() {
            assert!(
                out.clipfrac_lower > 0.0,
                "the data must exercise the dual clip"
            );
        }
        let grads = out.loss.backward().unwrap();
        let g = grads.get(&var).expect("gradient reaches logp");
        let numeric = finite_diff(&new, 1e-3, |lp| {
            let l = policy_loss(&old_t, lp, &adv, &m, &cfg).unwrap().loss;
            l.to_scalar::<f32>().unwrap()
        });
        check_grad(&format!("policy loss {mode}"), g, &numeric);
    }
}

#[test]
fn value_loss_gradient_matches_finite_differences() {
    let old: Vec<f32> = (0..B * T).map(|i| (i as f32 * 0.37).sin()).collect();
    // Offsets 0.05 (inside the 0.2 clip range) and 0.5 / -0.6 (outside).
    let offsets = [0.05f32, 0.5, -0.6, 0.1, -0.05];
    let vpreds: Vec<f32> = old
        .iter()
        .enumerate()
        .map(|(i, o)| o + offsets[i % offsets.len()])
        .collect();
    let returns: Vec<f32> = (0..B * T).map(|i| (i as f32 * 0.91).cos() * 2.0).collect();
    let (old_t, ret_t, m) = (tok(&old), tok(&returns), mask());
    for mode in LossAggMode::ALL {
        let cfg = ValueLossConfig {
            loss_agg_mode: *mode,
            ..ValueLossConfig::default()
        };
        let var = Var::from_tensor(&tok(&vpreds)).unwrap();
        let out = value_loss(var.as_tensor(), &old_t, &ret_t, &m, &cfg).unwrap();
        assert!(out.clipfrac > 0.0, "the data must exercise clipping");
        let grads = out.loss.backward().unwrap();
        let g = grads.get(&var).expect("gradient reaches vpreds");
        let numeric = finite_diff(&vpreds, 1e-3, |vp| {
            let l = value_loss(vp, &old_t, &ret_t, &m, &cfg).unwrap().loss;
            l.to_scalar::<f32>().unwrap()
        });
        check_grad(&format!("value loss {mode}"), g, &numeric);
    }
}

#[test]
fn entropy_bonus_gradient_reaches_logits() {
    const V: usize = 4;
    let logits: Vec<f32> = (0..B * T * V)
        .map(|i| (i as f32 * 0.77).sin() * 2.0)
        .collect();
    let to_t = |d: &[f32]| Tensor::from_vec(d.to_vec(), (B, T, V), &Device::Cpu).unwrap();
    let old: Vec<f32> = (0..B * T).map(|i| -0.5 - 0.1 * i as f32).collect();
    let (old_t, adv, m) = (tok(&old), tok(&ADV), mask());
    let cfg = PolicyLossConfig {
        entropy_coeff: 0.5,
        ..PolicyLossConfig::default()
    };
    let loss_of = |lg: &Tensor| {
        let h = entropy_from_logits(lg).unwrap();
        actor_loss(&old_t, &old_t, &adv, &m, Some(&h), None, &cfg)
            .unwrap()
            .loss
    };
    let var = Var::from_tensor(&to_t(&logits)).unwrap();
    let grads = loss_of(var.as_tensor()).backward().unwrap();
    let g = grads.get(&var).expect("gradient reaches logits");
    let eps = 1e-3;
    let numeric: Vec<f32> = (0..logits.len())
        .map(|i| {
            let mut p = logits.clone();
            let mut q = logits.clone();
            p[i] += eps;
            q[i] -= eps;
            let lp = loss_of(&to_t(&p)).to_scalar::<f32>().unwrap();
            let lq = loss_of(&to_t(&q)).to_scalar::<f32>().unwrap();
            (lp - lq) / (2.0 * eps)
        })
        .collect();
    check_grad("entropy bonus", g, &numeric);
}
