//! RL with verifiable rewards through real processes: `rlhf-head run --config-name
//! grpo_math_tiny` (GRPO, the `math` rule reward, DAPO's dynamic sampling and overlong
//! shaping) climbs on the CPU; the same job in an async mode with GSPO's sequence-level ratio
//! and truncated completions masked; a dynamic sampling that runs out of rounds fails as
//! configured, naming the key.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rlhf_e2e::{bin, jsonl, output_overrides, repo_root, wait_success, Proc};
use serde_json::Value;

fn grpo_math_cmd(out: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(bin("rlhf-head"));
    cmd.current_dir(repo_root())
        .args([
            "run",
            "--config-name",
            "grpo_math_tiny",
            "logging.progress=false",
        ])
        .args(output_overrides(out))
        .args(extra)
        .env_remove("RLHF_TOKEN")
        .env("RUST_LOG", "warn");
    cmd
}

fn metric(row: &Value, key: &str) -> Result<f64> {
    row[key]
        .as_f64()
        .with_context(|| format!("step {} has no {key}: {row}", row["step"]))
}

fn mean(rows: &[Value], key: &str) -> Result<f64> {
    let v = rows
        .iter()
        .map(|r| metric(r, key))
        .collect::<Result<Vec<_>>>()?;
    Ok(v.iter().sum::<f64>() / v.len() as f64)
}

#[test]
fn grpo_math_tiny_climbs_with_dynamic_sampling() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("job");
    let mut p = Proc::spawn("run", dir.path(), &mut grpo_math_cmd(&out, &[]))?;
    wait_success(&mut p, Duration::from_secs(600))?;
    let rows = jsonl(&out.join("metrics.jsonl"))?;
    ensure!(rows.len() == 60, "{} steps logged", rows.len());
    let mut rounds = 0.0;
    for r in &rows {
        let gen = metric(r, "rollout/gen_batches")?;
        ensure!(
            (1.0..=4.0).contains(&gen),
            "gen_batches {gen} outside 1..=4"
        );
        rounds += gen;
        // Without padding, every kept group has responses that scored differently.
        metric(r, "rollout/filtered_groups")?;
        metric(r, "rollout/padded_groups")?;
        metric(r, "reward/no_answer")?;
        let pen = metric(r, "rollout/overlong_penalty_mean")?;
        ensure!((-0.1..=0.0).contains(&pen), "overlong penalty {pen}");
    }
    // Groups were dropped and regenerated, and more than one round ran on some steps.
    let filtered: f64 = rows
        .iter()
        .map(|r| metric(r, "rollout/filtered_groups"))
        .sum::<Result<f64>>()?;
    ensure!(
        filtered > 0.0 && rounds > 60.0,
        "filtered {filtered}, rounds {rounds}"
    );
    // The policy's accuracy over everything it generated (before the filter) climbs.
    let (first, last) = (
        mean(&rows[..15], "rollout/generated_accuracy")?,
        mean(&rows[45..], "rollout/generated_accuracy")?,
    );
    // Measured: 0.05 -> 0.20 (the run is deterministic on the CPU).
    ensure!(
        last > first + 0.1,
        "accuracy over all generated responses: {first:.3} in the first 15 steps, {last:.3} in the last 15"
    );
    let (first, last) = (
        mean(&rows[..15], "reward/no_answer")?,
        mean(&rows[45..], "reward/no_answer")?,
    );
    ensure!(
        last < first,
        "responses without an answer: {first} -> {last}"
    );

    // Every prompt drawn was trained on, dropped or left over, each once per epoch: over the run, the
    // 100 rows were consumed equally often, give or take the epoch in progress.
    let ledger = jsonl(&out.join("ledger.jsonl"))?;
    ensure!(ledger.len() == 60, "{} ledger lines", ledger.len());
    let mut count = vec![0u32; 101];
    let mut consumed = 0.0;
    for l in &ledger {
        for key in ["trained", "dropped", "surplus"] {
            for r in l[key].as_array().context("ledger rows")? {
                count[r.as_u64().context("a row")? as usize] += 1;
                consumed += 1.0;
            }
        }
    }
    // Padded groups were drawn in a round of their step, so they count once too.
    ensure!(
        consumed == rounds * 8.0,
        "{consumed} prompts consumed in {rounds} rounds of 8"
    );
    let (lo, hi) = (count[1..].iter().min(), count[1..].iter().max());
    ensure!(
        hi.zip(lo).is_some_and(|(h, l)| h - l <= 1),
        "per-row consumption {lo:?}..{hi:?}"
    );
    Ok(())
}

#[test]
fn dynamic_sampling_feeds_the_async_lane_with_gspo_and_masked_truncations() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("job");
    let mut cmd = grpo_math_cmd(
        &out,
        &[
            "training.train_iters=6",
            "actor_rollout.async.mode=one_step_off",
            "actor_rollout.async.max_staleness=1",
            "actor_rollout.importance_sampling_level=sequence",
            "algorithm.mask_truncated_completions=true",
        ],
    );
    let mut p = Proc::spawn("run", dir.path(), &mut cmd)?;
    wait_success(&mut p, Duration::from_secs(600))?;
    let rows = jsonl(&out.join("metrics.jsonl"))?;
    ensure!(rows.len() == 6, "{} steps logged", rows.len());
    let mut masked = 0.0;
    for r in &rows {
        ensure!(metric(r, "rollout/gen_batches")? >= 1.0);
        masked += metric(r, "rollout/masked_truncated")?;
        ensure!(metric(r, "rollout/staleness_max")? <= 1.0);
    }
    // The untrained policy rarely ends with EOS within 6 tokens.
    ensure!(masked > 0.0, "no truncated response was masked");
    Ok(())
}

#[test]
fn dynamic_sampling_out_of_rounds_fails_when_configured() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("job");
    // One round per batch, no format reward and no overlong penalty: the untrained policy's
    // groups mostly score 0 in every response, so the first batch cannot be filled.
    let mut cmd = grpo_math_cmd(
        &out,
        &[
            "training.train_iters=2",
            "algorithm.dynamic_sampling.max_num_gen_batches=1",
            "algorithm.dynamic_sampling.when_exhausted=fail",
            "algorithm.dynamic_sampling.metric=accuracy",
        ],
    );
    let o = cmd.output()?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(!o.status.success(), "the run succeeded: {err}");
    ensure!(
        err.contains("dynamic sampling kept")
            && err.contains("algorithm.dynamic_sampling.max_num_gen_batches")
            && err.contains("when_exhausted train"),
        "{err}"
    );
    Ok(())
}
