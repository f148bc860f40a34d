//! LoRA in the PPO job (`actor_rollout.lora.*`, `critic.lora.*`) over real processes: the
//! frozen base with trained adapters learns the demo task; the reference is the actor's
//! base with the adapters off, served by the trainer process (no process or copy of its
//! own); checkpoints hold PEFT adapters that `rlhf merge-lora` turns into a model
//! `rlhf generate` runs; a resumed run repeats the straight one.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use rlhf_e2e::{
    actor_roles, assert_same_steps, bin, jsonl, repo_root, wait_success, Cluster, Proc,
};
use serde_json::Value;

const LORA: &[&str] = &[
    "actor_rollout.lora.rank=8",
    "actor_rollout.lora.alpha=16",
    "critic.lora.rank=8",
    "critic.lora.target_modules=[q_proj,v_proj]",
];

fn scores(m: &[Value]) -> Vec<f64> {
    m.iter()
        .filter_map(|l| l["objective/scores"].as_f64())
        .collect()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn run(cmd: &mut Command) -> std::process::Output {
    cmd.current_dir(repo_root()).output().expect("runs")
}

#[test]
fn lora_ppo_learns_with_the_reference_from_the_trainer_and_merges() -> Result<()> {
    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"CPU": 4}"#)?;
    c.wait_alive_nodes(1, Duration::from_secs(30))?;
    let job = c.dir.path().join("job");
    let mut args: Vec<&str> = LORA.to_vec();
    // Adapters start as a no-op (B = 0) and carry few parameters: LoRA's usual larger step.
    args.extend(["actor_rollout.lr=1.0e-3", "checkpoint.save_steps=20"]);
    let mut p = Proc::spawn("lora", c.dir.path(), &mut c.ppo_run_cmd(&job, &args))?;
    wait_success(&mut p, Duration::from_secs(1200))?;
    let out = p.output();
    assert!(out.contains("adapters off"), "{out}");

    let m = jsonl(&job.join("metrics.jsonl"))?;
    let s = scores(&m);
    assert!(s.len() >= 20, "{} steps", s.len());
    let k = 10;
    let (first, last) = (mean(&s[..k]), mean(&s[s.len() - k..]));
    println!("lora: objective/scores first {k} steps {first:.3}, last {k} steps {last:.3}");
    assert!(
        last >= first + 0.15,
        "the score should climb: first {k} steps {first:.3}, last {k} steps {last:.3}"
    );
    // B = 0 at the start: the policy is its base, and the reference is that base computed
    // by the same process with the same kernels: KL exactly zero at step 1.
    let kl1 = m[0]["objective/kl"].as_f64().context("objective/kl")?;
    assert!(kl1.abs() < 1e-6, "KL at step 1: {kl1}");
    let kl_last = mean(
        &m[m.len() - k..]
            .iter()
            .filter_map(|l| l["objective/kl"].as_f64())
            .collect::<Vec<_>>(),
    );
    assert!(
        kl_last > 1e-3,
        "the adapters moved the policy: KL {kl_last}"
    );

    // No reference process: the trainer serves it (the actor's two are trainer and rollout).
    let st = c.status()?;
    assert_eq!(
        actor_roles(&st),
        ["actor_rollout", "actor_rollout", "critic", "reward"],
        "{st}"
    );

    // The checkpoints are PEFT adapters, a fraction of the model's size.
    let step = job.join("ckpt").join("global_step_40");
    let base_bytes = std::fs::metadata(repo_root().join("models/tiny/model.safetensors"))?.len();
    for (role, task) in [("actor", "CAUSAL_LM"), ("critic", "TOKEN_CLS")] {
        let d = step.join(role);
        assert!(
            !d.join("model.safetensors").exists(),
            "{role}: a full model was saved"
        );
        let cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("adapter_config.json"))?)?;
        assert_eq!(cfg["task_type"], task, "{cfg}");
        assert_eq!(cfg["r"], 8, "{cfg}");
        let bytes = std::fs::metadata(d.join("adapter_model.safetensors"))?.len();
        assert!(
            bytes * 4 < base_bytes,
            "{role}: adapter {bytes} bytes vs base {base_bytes}"
        );
    }
    let critic: Value = serde_json::from_str(&std::fs::read_to_string(
        step.join("critic/adapter_config.json"),
    )?)?;
    assert_eq!(
        critic["target_modules"],
        serde_json::json!(["q_proj", "v_proj"])
    );

    // merge-lora gives a plain model that `rlhf generate` runs.
    let merged = c.dir.path().join("merged");
    let o = run(Command::new(bin("rlhf")).args([
        "merge-lora",
        "--base",
        "models/tiny",
        "--adapter",
        step.join("actor").to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
    ]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = run(Command::new(bin("rlhf")).args([
        "generate",
        "--model",
        merged.to_str().unwrap(),
        "--prompt",
        "Say a number:",
        "--max-new-tokens",
        "8",
        "--format",
        "json",
    ]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let line: Value = serde_json::from_slice(o.stdout.split(|&b| b == b'\n').next().unwrap())?;
    assert!(
        line["completion_token_ids"]
            .as_array()
            .is_some_and(|a| !a.is_empty()),
        "{line}"
    );
    Ok(())
}

#[test]
fn a_resumed_lora_run_repeats_the_straight_one() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut common: Vec<&str> = LORA.to_vec();
    common.extend(["training.train_iters=4", "checkpoint.save_steps=2"]);
    let spawn = |name: &str, out: &Path, extra: &[&str]| -> Result<()> {
        let mut cmd = rlhf_e2e::ppo_run_cmd(out, &common);
        cmd.args(extra);
        let mut p = Proc::spawn(name, dir.path(), &mut cmd)?;
        wait_success(&mut p, Duration::from_secs(900))
    };
    let a = dir.path().join("straight");
    spawn("straight", &a, &[])?;
    let b = dir.path().join("resumed");
    spawn("first-half", &b, &["--stop-after", "2"])?;
    assert_eq!(jsonl(&b.join("metrics.jsonl"))?.len(), 2);
    assert!(b
        .join("ckpt/global_step_2/actor/adapter_model.safetensors")
        .is_file());
    spawn("second-half", &b, &["--resume", "latest"])?;
    let (ma, mb) = (
        jsonl(&a.join("metrics.jsonl"))?,
        jsonl(&b.join("metrics.jsonl"))?,
    );
    assert_eq!(ma.len(), 4);
    assert_same_steps(&ma, &mb);
    Ok(())
}
