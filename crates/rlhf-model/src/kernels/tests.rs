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

#[test]
fn linear_matches_composite() {
    // A 3-d input (the op keeps its leading dims) and a strided one (made contiguous).
    let x = Var::from_tensor(&randn(&[2, 3, 5], 12)).unwrap();
    let w = Var::from_tensor(&randn(&[4, 5], 13)).unwrap();
    compare(
        &[x.clone(), w.clone()],
        |t| linear(&t[0], &t[1]).unwrap(),
        |t| t[0].broadcast_matmul(&t[1].t().unwrap()).unwrap(),
    );
    compare(
        &[x, w],
        |t| linear(&t[0].narrow(1, 1, 2).unwrap(), &t[1]).unwrap(),
        |t| {
            t[0].narrow(1, 1, 2)
                .unwrap()
                .broadcast_matmul(&t[1].t().unwrap())
                .unwrap()
        },
    );
}

#[test]
fn linear_casts_the_master_weight_and_returns_its_gradient_in_its_dtype() {
    // f32 master weight, f64 activations: the product runs in f64, dW comes back in f32.
    let x = Var::from_tensor(&randn(&[3, 5], 14)).unwrap();
    let w = Var::from_tensor(&randn(&[4, 5], 15).to_dtype(DType::F32).unwrap()).unwrap();
    let y = linear(x.as_tensor(), w.as_tensor()).unwrap();
    assert_eq!(y.dtype(), DType::F64);
    let wd = w.as_tensor().to_dtype(DType::F64).unwrap();
    let want = x.as_tensor().matmul(&wd.t().unwrap()).unwrap();
    assert!(max_diff(&y, &want) < 1e-12);
    let g = randn(&[3, 4], 16);
    let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
    let dw = grads.get(w.as_tensor()).expect("weight gradient");
    assert_eq!(dw.dtype(), DType::F32);
    let want_dw = g.t().unwrap().matmul(x.as_tensor()).unwrap();
    assert!(max_diff(&dw.to_dtype(DType::F64).unwrap(), &want_dw) < 1e-5);
    // A frozen weight gets no gradient, the input still does.
    let frozen = w.as_tensor().detach();
    let y = linear(x.as_tensor(), &frozen).unwrap();
    let grads = y.sum_all().unwrap().backward().unwrap();
    assert!(grads.get(&frozen).is_none());
    assert!(grads.get(x.as_tensor()).is_some());
    assert!(linear(&randn(&[3, 6], 1), w.as_tensor()).is_err());
}

#[test]
fn attention_matches_composite() {
    // 2 KV heads shared by 3 query heads each, 4 query positions over 6 key positions
    // (a cache-like prefix), an additive mask with masked entries.
    let (b, g, r, t, s, d) = (2, 2, 3, 4, 6, 5);
    let q = Var::from_tensor(&randn(&[b, g, r * t, d], 17)).unwrap();
    let k = Var::from_tensor(&randn(&[b, g, s, d], 18)).unwrap();
    let v = Var::from_tensor(&randn(&[b, g, s, d], 19)).unwrap();
    let mut m = vec![0f64; b * t * s];
    for (i, x) in m.iter_mut().enumerate() {
        if (i * 7) % 5 == 0 && i % s != 0 {
            *x = -1e9;
        }
    }
    let mask = Tensor::from_vec(m, (b, t, s), &Device::Cpu).unwrap();
    let scale = 0.37;
    compare(
        &[q, k, v],
        |ts| attention(&ts[0], &ts[1], &ts[2], &mask, scale).unwrap(),
        |ts| {
            let att = (&ts[0] * scale)
                .unwrap()
                .matmul(&ts[1].t().unwrap())
                .unwrap()
                .reshape((b, g, r, t, s))
                .unwrap();
            let m = mask.reshape((b, 1, 1, t, s)).unwrap();
            let p = candle_nn::ops::softmax(&att.broadcast_add(&m).unwrap(), D::Minus1).unwrap();
            p.reshape((b, g, r * t, s)).unwrap().matmul(&ts[2]).unwrap()
        },
    );
    let bad = randn(&[b, t + 1, s], 20);
    let qt = randn(&[b, g, r * t, d], 21);
    let kt = randn(&[b, g, s, d], 22);
    assert!(attention(&qt, &kt, &kt, &bad, scale).is_err());
}

#[test]
fn lm_head_matches_composite() {
    // Hidden states [2, 3, 5] under a head of 7 entries, at a temperature of 0.7; the
    // log-probs and the entropies together (one loss over both).
    let h = Var::from_tensor(&randn(&[2, 3, 5], 23)).unwrap();
    let w = Var::from_tensor(&randn(&[7, 5], 24)).unwrap();
    let targets = Tensor::new(&[[1u32, 6, 0], [5, 5, 2]], &Device::Cpu).unwrap();
    let scale = 1.0 / 0.7;
    compare(
        &[h.clone(), w.clone()],
        |t| {
            let (lp, ent) = lm_head(&t[0], &t[1], &targets, scale, true).unwrap();
            Tensor::cat(&[lp, ent.unwrap()], 1).unwrap()
        },
        |t| {
            let z = (t[0].broadcast_matmul(&t[1].t().unwrap()).unwrap() * scale).unwrap();
            let lsm = candle_nn::ops::log_softmax(&z, D::Minus1).unwrap();
            let lp = lsm
                .gather(&targets.unsqueeze(2).unwrap(), 2)
                .unwrap()
                .squeeze(2)
                .unwrap();
            let ent = (lsm.exp().unwrap() * &lsm)
                .unwrap()
                .sum(D::Minus1)
                .unwrap()
                .neg()
                .unwrap();
            Tensor::cat(&[lp, ent], 1).unwrap()
        },
    );
    // Without the entropy: the log-probs alone, shaped like the targets.
    let (lp, ent) = lm_head(h.as_tensor(), w.as_tensor(), &targets, scale, false).unwrap();
    assert_eq!(lp.dims(), &[2, 3]);
    assert!(ent.is_none());
    assert!(lm_head(
        h.as_tensor(),
        w.as_tensor(),
        &targets.narrow(1, 0, 2).unwrap(),
        1.0,
        false
    )
    .is_err());
}

#[test]
fn embedding_matches_composite() {
    // Repeated ids (3 three times, 0 twice) sum their rows' gradients; id 5 is never looked up.
    let w = Var::from_tensor(&randn(&[6, 4], 25)).unwrap();
    let ids = Tensor::new(&[3u32, 0, 3, 1, 0, 3, 2], &Device::Cpu).unwrap();
    compare(
        std::slice::from_ref(&w),
        |t| embedding(&t[0], &ids, DType::F64).unwrap(),
        |t| t[0].index_select(&ids, 0).unwrap(),
    );
    // An f32 table looked up in f64: the gradient comes back in f32.
    let w32 = Var::from_tensor(&w.as_tensor().to_dtype(DType::F32).unwrap()).unwrap();
    let y = embedding(w32.as_tensor(), &ids, DType::F64).unwrap();
    assert_eq!(y.dtype(), DType::F64);
    let grads = y.sum_all().unwrap().backward().unwrap();
    let g = grads.get(w32.as_tensor()).expect("table gradient");
    assert_eq!(g.dtype(), DType::F32);
    let counts: Vec<f32> = g.sum(1).unwrap().to_vec1().unwrap();
    assert_eq!(counts, vec![8.0, 4.0, 4.0, 12.0, 0.0, 0.0]);
    let bad = Tensor::new(&[7u32], &Device::Cpu).unwrap();
    assert!(embedding(w.as_tensor(), &bad, DType::F64).is_err());
}

#[test]
fn gate_up_swiglu_matches_composite() {
    let x = Var::from_tensor(&randn(&[2, 3, 5], 26)).unwrap();
    let wg = Var::from_tensor(&randn(&[7, 5], 27)).unwrap();
    let wu = Var::from_tensor(&randn(&[7, 5], 28)).unwrap();
    compare(
        &[x, wg, wu],
        |t| gate_up_swiglu(&t[0], &t[1], &t[2]).unwrap(),
        |t| {
            let gate = t[0].broadcast_matmul(&t[1].t().unwrap()).unwrap();
            let up = t[0].broadcast_matmul(&t[2].t().unwrap()).unwrap();
            (gate.silu().unwrap() * up).unwrap()
        },
    );
    let x = randn(&[2, 5], 29);
    assert!(gate_up_swiglu(&x, &randn(&[7, 5], 1), &randn(&[6, 5], 2)).is_err());
}

#[test]
fn attention_block_matches_composite() {
    // 6 query heads over 2 KV heads of width 4, 5 positions, a causal mask; RoPE from
    // half-width tables, then the output back in the projections' layout.
    let (b, t, hq, hkv, d) = (2, 5, 6, 2, 4);
    let q = Var::from_tensor(&randn(&[b, t, hq * d], 30)).unwrap();
    let k = Var::from_tensor(&randn(&[b, t, hkv * d], 31)).unwrap();
    let v = Var::from_tensor(&randn(&[b, t, hkv * d], 32)).unwrap();
    let cos = randn(&[b, t, d / 2], 33);
    let sin = randn(&[b, t, d / 2], 34);
    let m: Vec<f64> = (0..b * t * t)
        .map(|i| if i % t > (i / t) % t { -1e9 } else { 0.0 })
        .collect();
    let mask = Tensor::from_vec(m, (b, t, t), &Device::Cpu).unwrap();
    let scale = 0.41;
    let rot = |x: &Tensor| {
        let c = Tensor::cat(&[&cos, &cos], 2).unwrap().unsqueeze(1).unwrap();
        let s = Tensor::cat(&[&sin, &sin], 2).unwrap().unsqueeze(1).unwrap();
        let x1 = x.narrow(3, 0, d / 2).unwrap();
        let x2 = x.narrow(3, d / 2, d / 2).unwrap();
        let r = Tensor::cat(&[&x2.neg().unwrap(), &x1], 3).unwrap();
        (x.broadcast_mul(&c).unwrap() + r.broadcast_mul(&s).unwrap()).unwrap()
    };
    let split = |x: &Tensor, n: usize| {
        x.reshape((b, t, n, d))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    compare(
        &[q, k, v],
        |ts| attention_block(&ts[0], &ts[1], &ts[2], &cos, &sin, &mask, hq, hkv, scale).unwrap(),
        |ts| {
            let q = rot(&split(&ts[0], hq));
            let k = rot(&split(&ts[1], hkv));
            let v = split(&ts[2], hkv);
            // Each query head against its KV head (head i uses KV head i / (hq / hkv)).
            let rep = |x: &Tensor| {
                let parts: Vec<Tensor> = (0..hq)
                    .map(|i| x.narrow(1, i / (hq / hkv), 1).unwrap())
                    .collect();
                Tensor::cat(&parts, 1).unwrap()
            };
            let att = (q * scale)
                .unwrap()
                .matmul(&rep(&k).t().unwrap())
                .unwrap()
                .broadcast_add(&mask.unsqueeze(1).unwrap())
                .unwrap();
            let p = candle_nn::ops::softmax(&att, D::Minus1).unwrap();
            p.matmul(&rep(&v))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .reshape((b, t, hq * d))
                .unwrap()
        },
    );
    let qt = randn(&[b, t, hq * d], 35);
    let kt = randn(&[b, t, hkv * d], 36);
    assert!(attention_block(&qt, &kt, &kt, &cos, &sin, &mask, 5, hkv, scale).is_err());
}
