//! Each fused kernel against the composite formulation: values and gradients.

use super::*;
use candle_core::{Device, Var, D};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut x = seed.wrapping_add(0x9E3779B97F4A7C15);
    let v: Vec<f64> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 10_000) as f64 / 5_000.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// Values and gradients (w.r.t. each var, under a random linear loss) of two formulations.
fn compare(
    vars: &[Var],
    fused: impl Fn(&[Tensor]) -> Tensor,
    composite: impl Fn(&[Tensor]) -> Tensor,
) {
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let a = fused(&ts);
    let b = composite(&ts);
    assert!(
        max_diff(&a, &b) < 1e-10,
        "values differ by {}",
        max_diff(&a, &b)
    );
    let w = randn(a.dims(), 99);
    let ga = (&a * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let gb = (&b * &w).unwrap().sum_all().unwrap().backward().unwrap();
    for (i, v) in vars.iter().enumerate() {
        let x = ga.get(v.as_tensor()).expect("fused gradient");
        let y = gb.get(v.as_tensor()).expect("composite gradient");
        assert!(
            max_diff(x, y) < 1e-10,
            "gradient {i} differs by {}",
            max_diff(x, y)
        );
    }
}

#[test]
fn log_probs_match_composite() {
    let logits = Var::from_tensor(&randn(&[2, 3, 11], 1)).unwrap();
    let targets = Tensor::new(&[[1u32, 10, 0], [5, 5, 2]], &Device::Cpu).unwrap();
    compare(
        &[logits],
        |t| log_probs(&t[0], &targets, 1.0 / 0.7).unwrap(),
        |t| {
            let lsm = candle_nn::ops::log_softmax(&(&t[0] / 0.7).unwrap(), D::Minus1).unwrap();
            lsm.gather(&targets.unsqueeze(2).unwrap(), 2)
                .unwrap()
                .squeeze(2)
                .unwrap()
        },
    );
}

#[test]
fn entropy_matches_composite() {
    let logits = Var::from_tensor(&randn(&[2, 3, 11], 11)).unwrap();
    compare(
        &[logits],
        |t| entropy(&t[0], 1.0 / 0.7).unwrap(),
        |t| {
            let lsm = candle_nn::ops::log_softmax(&(&t[0] / 0.7).unwrap(), D::Minus1).unwrap();
            (lsm.exp().unwrap() * &lsm)
                .unwrap()
                .sum(D::Minus1)
                .unwrap()
                .neg()
                .unwrap()
        },
    );
}

#[test]
fn masked_softmax_matches_composite() {
    let (b, g, t, s) = (2, 3, 4, 6);
    let x = Var::from_tensor(&randn(&[b, g, t, s], 2)).unwrap();
    let mut m = vec![0f64; b * t * s];
    for (i, v) in m.iter_mut().enumerate() {
        if (i * 7) % 5 == 0 && i % s != 0 {
            *v = -1e9;
        }
    }
    let mask = Tensor::from_vec(m, (b, t, s), &Device::Cpu).unwrap();
    compare(
        &[x],
        |ts| masked_softmax(&ts[0], &mask).unwrap(),
        |ts| {
            let y = ts[0].broadcast_add(&mask.unsqueeze(1).unwrap()).unwrap();
            candle_nn::ops::softmax(&y, D::Minus1).unwrap()
        },
    );
}

#[test]
fn rms_norm_matches_composite() {
    let x = Var::from_tensor(&randn(&[3, 5, 8], 3)).unwrap();
    let w = Var::from_tensor(&randn(&[8], 4)).unwrap();
    compare(
        &[x, w],
        |t| rms_norm(&t[0], &t[1], 1e-5).unwrap(),
        |t| {
            let var = t[0].sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            let r = (var + 1e-5).unwrap().sqrt().unwrap().recip().unwrap();
            t[0].broadcast_mul(&r)
                .unwrap()
                .broadcast_mul(&t[1])
                .unwrap()
        },
    );
}

#[test]
fn swiglu_matches_composite() {
    let a = Var::from_tensor(&randn(&[4, 9000], 5)).unwrap();
    let u = Var::from_tensor(&randn(&[4, 9000], 6)).unwrap();
    compare(
        &[a, u],
        |t| swiglu(&t[0], &t[1]).unwrap(),
        |t| (t[0].silu().unwrap() * &t[1]).unwrap(),
    );
}

#[test]
fn rope_matches_composite() {
    let (b, h, t, d) = (2, 3, 5, 8);
    let x = Var::from_tensor(&randn(&[b, h, t, d], 7)).unwrap();
    let cos = randn(&[b, t, d / 2], 8);
    let sin = randn(&[b, t, d / 2], 9);
    compare(
        &[x],
        |ts| rope(&ts[0], &cos, &sin).unwrap(),
        |ts| {
            let c = Tensor::cat(&[&cos, &cos], 2).unwrap().unsqueeze(1).unwrap();
            let s = Tensor::cat(&[&sin, &sin], 2).unwrap().unsqueeze(1).unwrap();
            let x1 = ts[0].narrow(3, 0, d / 2).unwrap();
            let x2 = ts[0].narrow(3, d / 2, d / 2).unwrap();
            let rot = Tensor::cat(&[&x2.neg().unwrap(), &x1], 3).unwrap();
            (ts[0].broadcast_mul(&c).unwrap() + rot.broadcast_mul(&s).unwrap()).unwrap()
        },
    );
}

#[test]
fn kernels_work_in_f32_and_refuse_other_dtypes() {
    let x = randn(&[2, 4], 10).to_dtype(DType::F32).unwrap();
    let w = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(rms_norm(&x, &w, 1e-6).unwrap().dims(), &[2, 4]);
    let xb = x.to_dtype(DType::BF16).unwrap();
    let wb = w.to_dtype(DType::BF16).unwrap();
    assert!(rms_norm(&xb, &wb, 1e-6).is_err());
    assert!(!supported(&xb));
}
