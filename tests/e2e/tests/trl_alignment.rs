//! Precision alignment with TRL, across implementations: one full PPO step of `rlhf-head run`
//! (real role processes, 4 epochs, fixed responses given as token ids, a reward model that is
//! also the critic's starting point, `algorithm.score_placement=trl`, a batch with left and
//! right padding) against the same step computed the way TRL's PPOTrainer computes it in
//! PyTorch (`scripts/trl_ppo_step_reference.py`, committed output in
//! `tests/e2e/fixtures/trl_ppo_step/`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rlhf_e2e::Proc;
use serde_json::Value;

fn repo() -> PathBuf {
    rlhf_e2e::repo_root()
}

fn fixture() -> PathBuf {
    repo().join("tests/e2e/fixtures/trl_ppo_step")
}

/// Tensor names in a safetensors file (its JSON header).
fn safetensors_names(path: &Path) -> Result<Vec<String>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let n = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n])?;
    let mut names: Vec<String> = header
        .as_object()
        .context("safetensors header")?
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    names.sort();
    Ok(names)
}

fn run_step(out: &Path, reference: &Value, extra: &[&str]) -> Result<Vec<Value>> {
    let mut args: Vec<&str> = reference["overrides"]
        .as_array()
        .context("overrides")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    args.push("checkpoint.save_steps=1");
    args.extend_from_slice(extra);
    let mut cmd = rlhf_e2e::ppo_run_cmd(out, &args);
    let mut p = Proc::spawn("run", out, &mut cmd)?;
    let st = p.wait_exit(Duration::from_secs(600))?;
    if !st.success() {
        bail!("rlhf-head run failed ({st}):\n{}", p.output());
    }
    let text = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    text.lines().map(|l| Ok(serde_json::from_str(l)?)).collect()
}

fn rel_err(got: f64, want: f64) -> f64 {
    (got - want).abs() / want.abs().max(1e-6)
}

#[test]
fn one_ppo_step_matches_trl_metric_by_metric() -> Result<()> {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json"))?)?;
    let dir = tempfile::tempdir()?;
    let lines = run_step(dir.path(), &reference, &[])?;
    assert_eq!(lines.len(), 1, "one step, one metrics line: {lines:?}");
    let got = &lines[0];
    let want = reference["metrics"].as_object().context("metrics")?;
    assert!(want.len() >= 16, "the reference lists every TRL metric");
    let mut report = Vec::new();
    let mut worst = 0f64;
    for (k, w) in want {
        let w = w.as_f64().context("reference value")?;
        let g = got[k]
            .as_f64()
            .with_context(|| format!("metric {k} missing from the run: {got}"))?;
        let e = rel_err(g, w);
        worst = worst.max(e);
        report.push(format!("{k:28} ours {g:<14.9} TRL {w:<14.9} rel {e:.1e}"));
    }
    let report = report.join("\n");
    eprintln!("{report}");
    assert!(
        worst <= 1e-5,
        "a metric differs from TRL by more than 1e-5:\n{report}"
    );

    // The critic trained exactly the parameters of the reward model it started from (no
    // `score.bias` grown on a head that has none) and saved back the same set.
    let ckpt = dir
        .path()
        .join("ckpt/global_step_1/critic/model.safetensors");
    let rm = repo().join("crates/rlhf-model/tests/fixtures/tiny-llama-reward/model.safetensors");
    assert_eq!(safetensors_names(&ckpt)?, safetensors_names(&rm)?);
    Ok(())
}

/// The same step with the default (verl) score placement differs from TRL exactly where the
/// placement matters (values, advantages, the value loss), so the comparison above is able to
/// tell the two apart.
#[test]
fn last_token_placement_differs_from_trl_in_the_value_loss() -> Result<()> {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json"))?)?;
    let dir = tempfile::tempdir()?;
    let lines = run_step(
        dir.path(),
        &reference,
        &["algorithm.score_placement=last_token"],
    )?;
    let got = &lines[0];
    let want = &reference["metrics"];
    for k in ["objective/scores", "objective/kl", "objective/rlhf_reward"] {
        let (g, w) = (got[k].as_f64().unwrap(), want[k].as_f64().unwrap());
        assert!(
            rel_err(g, w) <= 1e-5,
            "{k} does not depend on placement: {g} vs {w}"
        );
    }
    let (g, w) = (
        got["loss/value_avg"].as_f64().unwrap(),
        want["loss/value_avg"].as_f64().unwrap(),
    );
    assert!(rel_err(g, w) > 1e-3, "loss/value_avg {g} vs TRL {w}");
    Ok(())
}
