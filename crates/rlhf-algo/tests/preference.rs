//! The DPO family's and the reward model's losses against TRL's own trainer code
//! (`fixtures/preference.json`, written by `scripts/preference_reference.py`), their gradients
//! against finite differences, and their errors.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor, Var};
use rlhf_algo::{
    kto_kl_estimate, preference_loss, reward_loss, sft_loss, PairBatch, PreferenceConfig,
    PreferenceLoss,
};
use serde::Deserialize;

#[derive(Deserialize)]
struct PrefCase {
    loss_type: String,
    beta: f64,
    #[serde(default)]
    label_smoothing: f64,
    #[serde(default)]
    simpo_gamma: f64,
    #[serde(default = "one")]
    desirable_weight: f64,
    #[serde(default = "one")]
    undesirable_weight: f64,
    chosen_logp: Vec<Vec<f32>>,
    chosen_mask: Vec<Vec<f32>>,
    rejected_logp: Vec<Vec<f32>>,
    rejected_mask: Vec<Vec<f32>>,
    ref_chosen: Vec<f32>,
    ref_rejected: Vec<f32>,
    kl_logps: Option<Vec<f64>>,
    ref_kl_logps: Option<Vec<f64>>,
    loss: f64,
    metrics: BTreeMap<String, f64>,
}

fn one() -> f64 {
    1.0
}

#[derive(Deserialize)]
struct RewardCase {
    chosen: Vec<f32>,
    rejected: Vec<f32>,
    margin: Option<Vec<f32>>,
    center_rewards_coefficient: Option<f64>,
    loss: f64,
    metrics: BTreeMap<String, f64>,
}

#[derive(Deserialize)]
struct Fixture {
    trl: String,
    preference: Vec<PrefCase>,
    reward: Vec<RewardCase>,
}

fn fixture() -> Fixture {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/preference.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn mat(rows: &[Vec<f32>]) -> Tensor {
    let (b, t) = (rows.len(), rows[0].len());
    Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap()
}

fn vec1(v: &[f32]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

fn close(what: &str, got: f64, want: f64) {
    assert!(
        (got - want).abs() <= 1e-5 * want.abs().max(1.0),
        "{what}: ours {got}, TRL {want}"
    );
}

fn config(c: &PrefCase) -> PreferenceConfig {
    PreferenceConfig {
        loss_type: c.loss_type.parse().unwrap(),
        beta: c.beta,
        label_smoothing: c.label_smoothing,
        simpo_gamma: c.simpo_gamma,
        desirable_weight: c.desirable_weight,
        undesirable_weight: c.undesirable_weight,
    }
}

fn kl_of(c: &PrefCase) -> Option<f64> {
    match (&c.kl_logps, &c.ref_kl_logps) {
        (Some(a), Some(b)) => Some(kto_kl_estimate(a, b).unwrap()),
        _ => None,
    }
}

#[test]
fn preference_losses_and_metrics_match_trl() {
    let f = fixture();
    assert!(f.preference.len() >= 7, "fixture from TRL {}", f.trl);
    let mut seen = std::collections::HashSet::new();
    for (i, c) in f.preference.iter().enumerate() {
        let cfg = config(c);
        seen.insert(cfg.loss_type);
        let (rc, rr) = (vec1(&c.ref_chosen), vec1(&c.ref_rejected));
        let out = preference_loss(
            &PairBatch {
                chosen_logp: &mat(&c.chosen_logp),
                chosen_mask: &mat(&c.chosen_mask),
                rejected_logp: &mat(&c.rejected_logp),
                rejected_mask: &mat(&c.rejected_mask),
                ref_chosen: Some(&rc),
                ref_rejected: Some(&rr),
                kto_kl: kl_of(c),
            },
            &cfg,
        )
        .unwrap();
        let what = format!("case {i} ({} {:?})", c.loss_type, cfg);
        close(
            &format!("{what} loss"),
            f64::from(out.loss.to_scalar::<f32>().unwrap()),
            c.loss,
        );
        let ours = out.stats.metrics();
        close(&format!("{what} train/loss"), ours["train/loss"], c.loss);
        for (k, want) in &c.metrics {
            let got = ours
                .get(k)
                .unwrap_or_else(|| panic!("{what}: no metric {k}"));
            close(&format!("{what} {k}"), *got, *want);
        }
    }
    assert_eq!(
        seen.len(),
        PreferenceLoss::ALL.len(),
        "every loss type has a case"
    );
}

#[test]
fn reward_model_loss_and_metrics_match_trl() {
    for (i, c) in fixture().reward.iter().enumerate() {
        let margin = c.margin.as_deref().map(vec1);
        let (loss, stats) = reward_loss(
            &vec1(&c.chosen),
            &vec1(&c.rejected),
            margin.as_ref(),
            c.center_rewards_coefficient,
        )
        .unwrap();
        close(
            &format!("reward case {i} loss"),
            f64::from(loss.to_scalar::<f32>().unwrap()),
            c.loss,
        );
        let ours = stats.metrics("");
        for (k, want) in &c.metrics {
            close(&format!("reward case {i} {k}"), ours[k], *want);
        }
        let eval = stats.metrics("eval/");
        assert_eq!(eval["eval/accuracy"], ours["accuracy"]);
        assert_eq!(eval["eval/loss"], ours["train/loss"]);
    }
}

/// Merged micro-batch statistics average like one batch.
#[test]
fn stats_of_split_batches_merge_to_the_whole() {
    let f = fixture();
    let c = &f.preference[0];
    let cfg = config(c);
    let run = |rows: std::ops::Range<usize>| {
        let rc = vec1(&c.ref_chosen[rows.clone()]);
        let rr = vec1(&c.ref_rejected[rows.clone()]);
        preference_loss(
            &PairBatch {
                chosen_logp: &mat(&c.chosen_logp[rows.clone()]),
                chosen_mask: &mat(&c.chosen_mask[rows.clone()]),
                rejected_logp: &mat(&c.rejected_logp[rows.clone()]),
                rejected_mask: &mat(&c.rejected_mask[rows.clone()]),
                ref_chosen: Some(&rc),
                ref_rejected: Some(&rr),
                kto_kl: None,
            },
            &cfg,
        )
        .unwrap()
        .stats
    };
    let n = c.chosen_logp.len();
    let mut merged = run(0..2);
    merged.merge(&run(2..n));
    let whole = run(0..n).metrics();
    for (k, v) in merged.metrics() {
        close(&format!("merged {k}"), v, whole[&k]);
    }
}

fn finite_diff(x: &[f32], eps: f32, f: impl Fn(&[f32]) -> f32) -> Vec<f32> {
    (0..x.len())
        .map(|i| {
            let (mut p, mut m) = (x.to_vec(), x.to_vec());
            p[i] += eps;
            m[i] -= eps;
            (f(&p) - f(&m)) / (2.0 * eps)
        })
        .collect()
}

fn check_grad(what: &str, analytic: &[f32], numeric: &[f32], mask: &[f32]) {
    assert!(
        analytic.iter().all(|g| g.is_finite()),
        "{what}: {analytic:?}"
    );
    assert!(
        analytic.iter().any(|g| g.abs() > 1e-4),
        "{what}: the gradient is all zero"
    );
    for (i, ((g, n), m)) in analytic.iter().zip(numeric).zip(mask).enumerate() {
        assert!(
            (g - n).abs() <= 3e-3 * n.abs().max(0.05),
            "{what}[{i}]: autograd {g} vs finite difference {n}"
        );
        if *m == 0.0 {
            assert_eq!(*g, 0.0, "{what}[{i}]: a padded position got a gradient");
        }
    }
}

/// Every loss type sends a gradient into both completions' log-probs, matching finite
/// differences, and none into padding.
#[test]
fn preference_gradients_match_finite_differences() {
    let f = fixture();
    for (i, c) in f.preference.iter().enumerate() {
        let cfg = config(c);
        let kl = kl_of(c);
        let (rc, rr) = (vec1(&c.ref_chosen), vec1(&c.ref_rejected));
        let shape = (c.chosen_logp.len(), c.chosen_logp[0].len());
        let (cm, rm) = (mat(&c.chosen_mask), mat(&c.rejected_mask));
        let loss_at = |cl: &Tensor, rl: &Tensor| {
            preference_loss(
                &PairBatch {
                    chosen_logp: cl,
                    chosen_mask: &cm,
                    rejected_logp: rl,
                    rejected_mask: &rm,
                    ref_chosen: Some(&rc),
                    ref_rejected: Some(&rr),
                    kto_kl: kl,
                },
                &cfg,
            )
            .unwrap()
            .loss
        };
        let (c0, r0) = (c.chosen_logp.concat(), c.rejected_logp.concat());
        let cv = Var::from_tensor(&mat(&c.chosen_logp)).unwrap();
        let rv = Var::from_tensor(&mat(&c.rejected_logp)).unwrap();
        let grads = loss_at(cv.as_tensor(), rv.as_tensor()).backward().unwrap();
        let get = |v: &Var| {
            grads
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("case {i}: no gradient"))
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let t = |x: &[f32]| Tensor::from_vec(x.to_vec(), shape, &Device::Cpu).unwrap();
        let scalar = |l: Tensor| l.to_scalar::<f32>().unwrap();
        let num_c = finite_diff(&c0, 1e-2, |x| scalar(loss_at(&t(x), &t(&r0))));
        let num_r = finite_diff(&r0, 1e-2, |x| scalar(loss_at(&t(&c0), &t(x))));
        let what = format!("case {i} {}", c.loss_type);
        check_grad(
            &format!("{what} chosen"),
            &get(&cv),
            &num_c,
            &c.chosen_mask.concat(),
        );
        check_grad(
            &format!("{what} rejected"),
            &get(&rv),
            &num_r,
            &c.rejected_mask.concat(),
        );
    }
}

#[test]
fn reward_and_sft_gradients_match_finite_differences() {
    let c = &fixture().reward[2];
    let margin = vec1(c.margin.as_ref().unwrap());
    let loss_at = |ch: &Tensor, rj: &Tensor| {
        reward_loss(ch, rj, Some(&margin), c.center_rewards_coefficient)
            .unwrap()
            .0
    };
    let cv = Var::from_tensor(&vec1(&c.chosen)).unwrap();
    let grads = loss_at(cv.as_tensor(), &vec1(&c.rejected))
        .backward()
        .unwrap();
    let g = grads.get(cv.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
    let num = finite_diff(&c.chosen, 1e-2, |x| {
        loss_at(&vec1(x), &vec1(&c.rejected))
            .to_scalar::<f32>()
            .unwrap()
    });
    check_grad("reward chosen", &g, &num, &vec![1.0; g.len()]);

    // SFT: d(-mean logp)/d logp = -1/n on the selected tokens, 0 elsewhere.
    let p = &fixture().preference[0];
    let lv = Var::from_tensor(&mat(&p.chosen_logp)).unwrap();
    let mask = mat(&p.chosen_mask);
    let (loss, n) = sft_loss(lv.as_tensor(), &mask).unwrap();
    let flat_mask = p.chosen_mask.concat();
    assert_eq!(n, flat_mask.iter().filter(|&&m| m > 0.0).count());
    let want: f32 = -p
        .chosen_logp
        .concat()
        .iter()
        .zip(&flat_mask)
        .map(|(l, m)| l * m)
        .sum::<f32>()
        / n as f32;
    assert!((loss.to_scalar::<f32>().unwrap() - want).abs() < 1e-5);
    let g = loss.backward().unwrap();
    let g = g
        .get(lv.as_tensor())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    for (gi, m) in g.iter().zip(&flat_mask) {
        assert!((gi + m / n as f32).abs() < 1e-7, "{gi} for mask {m}");
    }
}

#[test]
fn bad_inputs_name_the_problem() {
    let f = fixture();
    let c = &f.preference[0];
    let (cl, cm, rl, rm) = (
        mat(&c.chosen_logp),
        mat(&c.chosen_mask),
        mat(&c.rejected_logp),
        mat(&c.rejected_mask),
    );
    let rc = vec1(&c.ref_chosen);
    fn pairs<'a>(t: [&'a Tensor; 5], ref_r: Option<&'a Tensor>, kl: Option<f64>) -> PairBatch<'a> {
        PairBatch {
            chosen_logp: t[0],
            chosen_mask: t[1],
            rejected_logp: t[2],
            rejected_mask: t[3],
            ref_chosen: Some(t[4]),
            ref_rejected: ref_r,
            kto_kl: kl,
        }
    }
    let batch = |ref_r, kl| pairs([&cl, &cm, &rl, &rm, &rc], ref_r, kl);
    let err = |b: &PairBatch<'_>, cfg: PreferenceConfig| {
        preference_loss(b, &cfg).err().expect("refused").to_string()
    };
    let dpo = PreferenceConfig::default();
    let e = err(&batch(None, None), dpo);
    assert!(e.contains("ref_rejected") && e.contains("reference"), "{e}");
    // SimPO needs no reference.
    let simpo = PreferenceConfig {
        loss_type: PreferenceLoss::Simpo,
        ..dpo
    };
    assert!(preference_loss(&batch(None, None), &simpo).is_ok());
    let kto = PreferenceConfig {
        loss_type: PreferenceLoss::Kto,
        ..dpo
    };
    let e = err(&batch(Some(&rc), None), kto);
    assert!(e.contains("kto_kl"), "{e}");
    let e = err(
        &batch(Some(&rc), None),
        PreferenceConfig { beta: 0.0, ..dpo },
    );
    assert!(e.contains("algorithm.beta"), "{e}");
    let e = err(
        &batch(Some(&rc), Some(0.1)),
        PreferenceConfig {
            label_smoothing: 0.2,
            ..kto
        },
    );
    assert!(
        e.contains("algorithm.label_smoothing") && e.contains("kto"),
        "{e}"
    );
    let e = err(
        &batch(Some(&rc), None),
        PreferenceConfig {
            label_smoothing: 0.5,
            ..dpo
        },
    );
    assert!(e.contains("[0, 0.5)"), "{e}");
    // An empty completion.
    let empty = cm.zeros_like().unwrap();
    let e = preference_loss(
        &PairBatch {
            chosen_mask: &empty,
            ..batch(Some(&rc), None)
        },
        &dpo,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("chosen_mask"), "{e}");
    // A wrong number of reference values.
    let short = vec1(&c.ref_rejected[..2]);
    let e = err(&batch(Some(&short), None), dpo);
    assert!(e.contains("ref_rejected"), "{e}");
    let e = kto_kl_estimate(&[1.0], &[]).unwrap_err().to_string();
    assert!(e.contains("kl_logps"), "{e}");
    let e = reward_loss(&vec1(&[1.0, f32::NAN]), &vec1(&[0.0, 0.0]), None, None)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("chosen_scores") && e.contains("NaN"), "{e}");
}
