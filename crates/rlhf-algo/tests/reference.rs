//! Compares every quantity with the reference numbers written by
//! `scripts/algo_reference.py` (TRL / verl formulas in float64).

use std::path::PathBuf;

use candle_core::{Device, Tensor, Var};
use rlhf_algo::{
    actor_loss, agg_loss, compute_advantage, compute_metrics, compute_token_rewards,
    entropy_from_logits, gae, kl_loss, kl_penalty, log_softmax, masked_mean, masked_var,
    masked_whiten, policy_loss, value_loss, AdvEstimator, AdvantageInputs, AlgorithmConfig,
    KlController, KlCtrlConfig, KlPenalty, LossAggMode, PolicyLossConfig, RolloutMetricsInputs,
    TrainStats, ValueLossConfig, METRIC_NAMES,
};
use serde_json::Value;

const TOL: f64 = 1e-5;

struct Fixture {
    root: Value,
    b: usize,
    t: usize,
    v: usize,
    mask: Vec<f32>,
}

fn fixture() -> Fixture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reference.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; run scripts/algo_reference.py", path.display()));
    let root: Value = serde_json::from_str(&text).expect("reference.json is valid JSON");
    let batch = &root["batch"];
    let dim = |k: &str| batch[k].as_u64().expect("dims") as usize;
    let (b, t, v) = (dim("batch"), dim("len"), dim("vocab"));
    let mask = floats(&batch["response_mask"]);
    Fixture {
        root,
        b,
        t,
        v,
        mask,
    }
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap_or_else(|| panic!("expected an array, got {v}"))
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

fn num(v: &Value) -> f64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("expected a number, got {v}"))
}

impl Fixture {
    fn tok(&self, data: &[f32]) -> Tensor {
        Tensor::from_vec(data.to_vec(), (self.b, self.t), &Device::Cpu).unwrap()
    }
    fn input(&self, key: &str) -> Tensor {
        self.tok(&floats(&self.root["batch"][key]))
    }
    fn vec1(&self, key: &str) -> Tensor {
        Tensor::new(floats(&self.root["batch"][key]), &Device::Cpu).unwrap()
    }
    fn mask_t(&self) -> Tensor {
        self.tok(&self.mask)
    }
    fn logits(&self, key: &str) -> Tensor {
        let d = floats(&self.root["batch"][key]);
        Tensor::from_vec(d, (self.b, self.t, self.v), &Device::Cpu).unwrap()
    }
    fn has_eos(&self) -> Vec<bool> {
        self.root["batch"]["has_eos"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_bool().unwrap())
            .collect()
    }
    fn group_ids(&self) -> Vec<usize> {
        self.root["batch"]["group_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect()
    }

    /// Compares on the mask and requires exact zeros outside it.
    fn assert_masked(&self, what: &str, got: &Tensor, want: &Value) {
        let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let want = floats(want);
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, ((&g, &w), &m)) in got.iter().zip(&want).zip(&self.mask).enumerate() {
            let pos = [i / self.t, i % self.t];
            if m == 0.0 {
                assert_eq!(g, 0.0, "{what}{pos:?}: must be zero outside the mask");
            } else {
                close(&format!("{what}{pos:?}"), g as f64, w as f64);
            }
        }
    }

    fn assert_all(&self, what: &str, got: &Tensor, want: &Value) {
        let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let want = floats(want);
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            close(&format!("{what}[{i}]"), g as f64, w as f64);
        }
    }
}

fn close(what: &str, got: f64, want: f64) {
    let tol = TOL * want.abs().max(1.0);
    assert!(
        (got - want).abs() <= tol,
        "{what}: got {got}, reference {want} (|diff| {} > {tol})",
        (got - want).abs()
    );
}

fn scalar(t: &Tensor) -> f64 {
    t.to_scalar::<f32>().unwrap() as f64
}

#[test]
fn kl_estimators_match() {
    let f = fixture();
    let lp = f.input("logp");
    let rf = f.input("ref_logp");
    let mask = f.mask_t();
    for p in [
        KlPenalty::Kl,
        KlPenalty::Abs,
        KlPenalty::Mse,
        KlPenalty::LowVarKl,
    ] {
        let kl = kl_penalty(&lp, &rf, p).unwrap().mul(&mask).unwrap();
        f.assert_masked(
            &format!("kl_penalty {p}"),
            &kl,
            &f.root["kl_penalty"][p.as_str()],
        );
    }
    let full = kl_penalty(
        &log_softmax(&f.logits("logits")).unwrap(),
        &log_softmax(&f.logits("ref_logits")).unwrap(),
        KlPenalty::Full,
    )
    .unwrap();
    f.assert_all("kl_penalty full", &full, &f.root["kl_penalty"]["full"]);
}

#[test]
fn token_rewards_match() {
    let f = fixture();
    let cases = f.root["token_rewards"].as_array().unwrap();
    assert!(cases.len() >= 4);
    for (i, case) in cases.iter().enumerate() {
        let cfg: AlgorithmConfig = serde_json::from_value(case["config"].clone()).unwrap();
        let out = compute_token_rewards(
            &f.vec1("scores"),
            &f.input("logp"),
            &f.input("ref_logp"),
            &f.mask_t(),
            &f.has_eos(),
            num(&case["kl_coef"]),
            &cfg,
        )
        .unwrap();
        f.assert_masked(&format!("case {i} rewards"), &out.rewards, &case["rewards"]);
        f.assert_masked(&format!("case {i} kl"), &out.kl, &case["kl"]);
        f.assert_masked(
            &format!("case {i} non_score_reward"),
            &out.non_score_reward,
            &case["non_score_reward"],
        );
        f.assert_all(&format!("case {i} scores"), &out.scores, &case["scores"]);
    }
}

#[test]
fn advantage_estimators_match() {
    let f = fixture();
    let rewards = f.tok(&floats(&f.root["advantage_rewards"]));
    let mask = f.mask_t();
    let values = f.input("values");
    let base = f.vec1("baseline_scores");
    let groups = f.group_ids();
    let mut seen = std::collections::HashSet::new();
    for case in f.root["advantages"].as_array().unwrap() {
        let cfg: AlgorithmConfig = serde_json::from_value(case["config"].clone()).unwrap();
        seen.insert(cfg.adv_estimator);
        let what = format!("{} {}", cfg.adv_estimator, case["config"]);
        let inputs = AdvantageInputs {
            token_rewards: &rewards,
            response_mask: &mask,
            values: Some(&values),
            value_mask: None,
            group_ids: Some(&groups),
            baseline_scores: Some(&base),
        };
        let out = compute_advantage(&inputs, &cfg).unwrap();
        f.assert_masked(
            &format!("{what} advantages"),
            &out.advantages,
            &case["advantages"],
        );
        f.assert_masked(&format!("{what} returns"), &out.returns, &case["returns"]);
        if cfg.adv_estimator == AdvEstimator::Gae {
            let raw = gae(&rewards, &values, &mask, cfg.gamma, cfg.lam).unwrap();
            f.assert_masked(
                &format!("{what} raw advantages"),
                &raw.advantages,
                &case["raw_advantages"],
            );
        }
    }
    assert_eq!(
        seen.len(),
        AdvEstimator::ALL.len(),
        "every estimator is covered"
    );
}

#[test]
fn policy_losses_and_gradients_match() {
    let f = fixture();
    let old = f.input("logp");
    let adv = f.tok(&floats(&f.root["loss_advantages"]));
    let mask = f.mask_t();
    for case in f.root["policy_loss"].as_array().unwrap() {
        let cfg: PolicyLossConfig = serde_json::from_value(case["config"].clone()).unwrap();
        let what = format!("policy_loss {}", case["config"]);
        let var = Var::from_tensor(&f.input("new_logp")).unwrap();
        let out = policy_loss(&old, var.as_tensor(), &adv, &mask, &cfg).unwrap();
        close(
            &format!("{what} loss"),
            scalar(&out.loss),
            num(&case["loss"]),
        );
        close(
            &format!("{what} clipfrac"),
            out.clipfrac,
            num(&case["clipfrac"]),
        );
        close(
            &format!("{what} clipfrac_lower"),
            out.clipfrac_lower,
            num(&case["clipfrac_lower"]),
        );
        close(
            &format!("{what} approxkl"),
            out.approxkl,
            num(&case["approxkl"]),
        );
        close(&format!("{what} ppo_kl"), out.ppo_kl, num(&case["ppo_kl"]));
        close(
            &format!("{what} ratio"),
            out.ratio_mean,
            num(&case["ratio_mean"]),
        );
        let grads = out.loss.backward().unwrap();
        let g = grads.get(&var).expect("gradient reaches logp");
        f.assert_all(&format!("{what} grad"), g, &case["grad_logp"]);
    }
}

#[test]
fn value_losses_and_gradients_match() {
    let f = fixture();
    let old = f.input("values");
    let ret = f.tok(&floats(&f.root["loss_returns"]));
    let mask = f.mask_t();
    for case in f.root["value_loss"].as_array().unwrap() {
        let cfg: ValueLossConfig = serde_json::from_value(case["config"].clone()).unwrap();
        let what = format!("value_loss {}", case["config"]);
        let var = Var::from_tensor(&f.input("vpreds")).unwrap();
        let out = value_loss(var.as_tensor(), &old, &ret, &mask, &cfg).unwrap();
        close(
            &format!("{what} loss"),
            scalar(&out.loss),
            num(&case["loss"]),
        );
        close(
            &format!("{what} clipfrac"),
            out.clipfrac,
            num(&case["clipfrac"]),
        );
        let grads = out.loss.backward().unwrap();
        let g = grads.get(&var).expect("gradient reaches vpreds");
        f.assert_all(&format!("{what} grad"), g, &case["grad_vpreds"]);
    }
}

#[test]
fn entropy_kl_loss_and_actor_loss_match() {
    let f = fixture();
    let mask = f.mask_t();
    let ent = entropy_from_logits(&f.logits("logits")).unwrap();
    f.assert_all("entropy", &ent, &f.root["entropy"]["entropy"]);
    // verl's modes; seq-mean-token-sum-norm (TRL's dr_grpo) is checked against TRL in
    // grpo_losses.rs
    let verl_modes = LossAggMode::ALL
        .iter()
        .filter(|m| **m != LossAggMode::SeqMeanTokenSumNorm);
    for mode in verl_modes {
        let agg = agg_loss(&ent, &mask, *mode).unwrap();
        close(
            &format!("entropy {mode}"),
            scalar(&agg),
            num(&f.root["entropy"]["agg"][mode.as_str()]),
        );
    }
    let rf = f.input("ref_logp");
    for case in f.root["kl_loss"].as_array().unwrap() {
        let kind: KlPenalty = case["kl_loss_type"].as_str().unwrap().parse().unwrap();
        let mode: LossAggMode = case["loss_agg_mode"].as_str().unwrap().parse().unwrap();
        let var = Var::from_tensor(&f.input("new_logp")).unwrap();
        let loss = kl_loss(var.as_tensor(), &rf, &mask, kind, mode).unwrap();
        close(
            &format!("kl_loss {kind} {mode}"),
            scalar(&loss),
            num(&case["loss"]),
        );
        let grads = loss.backward().unwrap();
        f.assert_all(
            &format!("kl_loss {kind} grad"),
            grads.get(&var).unwrap(),
            &case["grad_logp"],
        );
    }
    let case = &f.root["actor_loss"];
    let cfg: PolicyLossConfig = serde_json::from_value(case["config"].clone()).unwrap();
    let var = Var::from_tensor(&f.input("new_logp")).unwrap();
    let adv = f.tok(&floats(&f.root["loss_advantages"]));
    let out = actor_loss(
        &f.input("logp"),
        var.as_tensor(),
        &adv,
        &mask,
        Some(&ent),
        Some(&rf),
        &cfg,
    )
    .unwrap();
    close("actor loss", scalar(&out.loss), num(&case["loss"]));
    close("actor entropy", out.entropy.unwrap(), num(&case["entropy"]));
    close("actor kl_loss", out.kl_loss.unwrap(), num(&case["kl_loss"]));
    let grads = out.loss.backward().unwrap();
    f.assert_all("actor grad", grads.get(&var).unwrap(), &case["grad_logp"]);
}

#[test]
fn masked_statistics_match() {
    let f = fixture();
    let v = f.input("values");
    let m = f.mask_t();
    let r = &f.root["masked"];
    close(
        "mean",
        scalar(&masked_mean(&v, &m).unwrap()),
        num(&r["mean"]),
    );
    close(
        "var unbiased",
        scalar(&masked_var(&v, &m, true).unwrap()),
        num(&r["var_unbiased"]),
    );
    close(
        "var biased",
        scalar(&masked_var(&v, &m, false).unwrap()),
        num(&r["var_biased"]),
    );
    f.assert_masked(
        "whiten",
        &masked_whiten(&v, &m, true).unwrap(),
        &r["whiten"],
    );
    f.assert_masked(
        "whiten keep mean",
        &masked_whiten(&v, &m, false).unwrap(),
        &r["whiten_keep_mean"],
    );
}

#[test]
fn kl_controllers_match() {
    let f = fixture();
    let r = &f.root["kl_controller"];
    let cfg: KlCtrlConfig = serde_json::from_value(r["config"].clone()).unwrap();
    let mut ada = KlController::from_config(&cfg).unwrap();
    let mut fixed = KlController::from_config(&KlCtrlConfig::default()).unwrap();
    let n = r["n_steps"].as_u64().unwrap() as usize;
    for (kl, want) in r["kls"]
        .as_array()
        .unwrap()
        .iter()
        .zip(r["adaptive_values"].as_array().unwrap())
    {
        ada.update(num(kl), n).unwrap();
        fixed.update(num(kl), n).unwrap();
        close("adaptive kl coef", ada.value(), num(want));
    }
    close("fixed kl coef", fixed.value(), num(&r["fixed_value"]));
    // The controller state survives a checkpoint round trip.
    let saved = serde_json::to_string(&ada).unwrap();
    let restored: KlController = serde_json::from_str(&saved).unwrap();
    assert_eq!(restored, ada);
}

#[test]
fn metrics_match() {
    let f = fixture();
    let mask = f.mask_t();
    let case = &f.root["token_rewards"][0];
    let cfg: AlgorithmConfig = serde_json::from_value(case["config"].clone()).unwrap();
    let has_eos = f.has_eos();
    let rewards = compute_token_rewards(
        &f.vec1("scores"),
        &f.input("logp"),
        &f.input("ref_logp"),
        &mask,
        &has_eos,
        num(&case["kl_coef"]),
        &cfg,
    )
    .unwrap();
    let adv = f.tok(&floats(&f.root["loss_advantages"]));
    let ret = f.tok(&floats(&f.root["loss_returns"]));
    let values = f.input("values");
    let old = f.input("logp");
    let mut stats = TrainStats::new();
    let logits = f.logits("logits");
    for (lp, vp, scale) in [("new_logp", "vpreds", 1.0), ("new_logp2", "vpreds2", 0.5)] {
        let p = policy_loss(
            &old,
            &f.input(lp),
            &adv,
            &mask,
            &PolicyLossConfig::default(),
        )
        .unwrap();
        stats.push_policy(&p).unwrap();
        let v = value_loss(
            &f.input(vp),
            &values,
            &ret,
            &mask,
            &ValueLossConfig::default(),
        )
        .unwrap();
        stats.push_value(&v).unwrap();
        let ent = entropy_from_logits(&logits.affine(scale, 0.0).unwrap()).unwrap();
        stats.push_entropy(scalar(&masked_mean(&ent, &mask).unwrap()));
    }
    let inputs = RolloutMetricsInputs {
        rewards: &rewards,
        logp: &old,
        response_mask: &mask,
        has_eos: &has_eos,
        advantages: &adv,
        returns: &ret,
        values: Some(&values),
    };
    let metrics = compute_metrics(&inputs, &stats).unwrap();
    let want = f.root["metrics"].as_object().unwrap();
    let names: Vec<&str> = metrics.keys().map(String::as_str).collect();
    let mut expected: Vec<&str> = METRIC_NAMES.to_vec();
    expected.sort();
    assert_eq!(names, expected, "exactly the documented metric names");
    for (k, v) in want {
        let got = *metrics
            .get(k)
            .unwrap_or_else(|| panic!("metric {k} missing"));
        close(k, got, num(v));
    }
    assert_eq!(want.len(), METRIC_NAMES.len());
}
