//! The other stages as jobs over real processes (`rlhf-head run`, embedded head and worker):
//! SFT's loss falls, packed or not; a reward model learns the shipped pairs and then drives PPO as its
//! `reward.kind=model`; DPO's margins rise; both are scored on held-out pairs; a DPO run
//! stopped and resumed repeats the straight one; ZeRO stages 1 to 3 train like plain data
//! parallelism (SFT, and PPO's actor and critic) and resume.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use rlhf_e2e::{assert_same_steps, bin, jsonl, output_overrides, repo_root, Proc};
use serde_json::Value;

/// PPO with two actor trainer ranks (and a rollout rank) and two critic ranks, two steps.
const PPO_TWO_RANKS: [&str; 4] = [
    "resource_pool.actor_rollout=3",
    "actor_rollout.num_gpus_for_train=2",
    "resource_pool.critic=2",
    "training.train_iters=2",
];

fn stage_cmd(config: &str, out: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(bin("rlhf-head"));
    cmd.current_dir(repo_root())
        .args(["run", "--config-name", config])
        .args(output_overrides(out))
        .arg("logging.progress=false")
        .args(extra)
        .env_remove("RLHF_TOKEN")
        .env("RUST_LOG", "warn");
    cmd
}

fn run(name: &str, dir: &Path, mut cmd: Command) -> Result<String> {
    let mut p = Proc::spawn(name, dir, &mut cmd)?;
    rlhf_e2e::wait_success(&mut p, Duration::from_secs(900))?;
    Ok(p.output())
}

fn series(m: &[Value], key: &str) -> Vec<f64> {
    m.iter().filter_map(|l| l[key].as_f64()).collect()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// Mean of the first and of the last `k` values.
fn ends(v: &[f64], k: usize) -> (f64, f64) {
    (mean(&v[..k]), mean(&v[v.len() - k..]))
}

#[test]
fn sft_then_a_reward_model_that_drives_ppo() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let sft = dir.path().join("sft");
    let out = run(
        "sft",
        dir.path(),
        stage_cmd("sft_tiny", &sft, &["training.train_iters=16"]),
    )?;
    let loss = series(&jsonl(&sft.join("metrics.jsonl"))?, "train/loss");
    assert_eq!(loss.len(), 16, "{out}");
    let (first, last) = ends(&loss, 4);
    println!("sft: train/loss {first:.3} -> {last:.3}");
    assert!(
        last < 0.5 * first,
        "SFT loss should fall: {first:.3} -> {last:.3}"
    );
    assert!(sft
        .join("ckpt/global_step_16/actor/model.safetensors")
        .exists());

    // Packed: about four examples share each row of 48 tokens, each attending only to itself;
    // a step of 2 rows covers as many examples as the 8 rows above.
    let packed = dir.path().join("sft-packed");
    let out = run(
        "sft-packed",
        dir.path(),
        stage_cmd(
            "sft_tiny",
            &packed,
            &[
                "data.packing=true",
                "training.global_batch_size=2",
                "training.micro_batch_size=2",
                "training.train_iters=16",
            ],
        ),
    )?;
    let rows: usize = out
        .split("packed into ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no 'packed into N rows' line in:\n{out}"));
    assert!(
        (10..=24).contains(&rows),
        "64 examples packed into {rows} rows"
    );
    let loss = series(&jsonl(&packed.join("metrics.jsonl"))?, "train/loss");
    let (first, last) = ends(&loss, 4);
    println!("sft packed ({rows} rows): train/loss {first:.3} -> {last:.3}");
    assert!(
        last < 0.5 * first,
        "packed SFT loss should fall: {first:.3} -> {last:.3}"
    );

    let rm = dir.path().join("rm");
    run(
        "rm",
        dir.path(),
        stage_cmd("rm_tiny", &rm, &["training.train_iters=16"]),
    )?;
    let m = jsonl(&rm.join("metrics.jsonl"))?;
    let (acc, margin) = (series(&m, "accuracy"), series(&m, "margin"));
    let (m0, m1) = ends(&margin, 4);
    println!(
        "rm: accuracy {:.3} -> {:.3}, margin {m0:.3} -> {m1:.3}",
        acc[0], acc[15]
    );
    assert!(mean(&acc[12..]) >= 0.9, "accuracy {acc:?}");
    assert!(m1 > m0 + 1.0, "margin {margin:?}");
    // Held-out pairs (data.eval_path): scored at steps 10 and 16.
    let held_out = series(&m, "eval/accuracy");
    println!("rm: held-out accuracy {held_out:?}");
    assert_eq!(held_out.len(), 2, "evals at steps 10 and 16");
    assert!(held_out[1] >= 0.9, "held-out accuracy {held_out:?}");
    let model = rm.join("ckpt/global_step_16/reward");
    let config: Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json"))?)?;
    assert_eq!(config["architectures"][0], "LlamaForSequenceClassification");

    // The reward model as PPO's reward: the policy learns what it prefers (digits).
    let ppo = dir.path().join("ppo");
    let reward = format!("reward.model={}", model.display());
    let mut cmd = Command::new(bin("rlhf-head"));
    cmd.current_dir(repo_root())
        .args(["run", "--config-name", "ppo_tiny"])
        .args(output_overrides(&ppo))
        .args([
            "reward.kind=model",
            &reward,
            "resource_pool.reward=1",
            "training.train_iters=24",
            "checkpoint.save_steps=0",
            "logging.progress=false",
        ])
        .env_remove("RLHF_TOKEN")
        .env("RUST_LOG", "warn");
    run("ppo", dir.path(), cmd)?;
    let scores = series(&jsonl(&ppo.join("metrics.jsonl"))?, "objective/scores");
    let (s0, s1) = ends(&scores, 8);
    println!("ppo with the trained reward model: objective/scores {s0:.3} -> {s1:.3}");
    assert!(s1 > s0 + 0.2, "scores {scores:?}");
    Ok(())
}

#[test]
fn dpo_learns_the_pairs_and_resumes_exactly() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let straight = dir.path().join("straight");
    run(
        "dpo",
        dir.path(),
        stage_cmd("dpo_tiny", &straight, &["training.train_iters=12"]),
    )?;
    let m = jsonl(&straight.join("metrics.jsonl"))?;
    let margins = series(&m, "rewards/margins");
    let acc = series(&m, "rewards/accuracies");
    assert!((series(&m, "train/loss")[0] - std::f64::consts::LN_2).abs() < 1e-3);
    let (m0, m1) = ends(&margins, 3);
    println!(
        "dpo: rewards/margins {m0:.3} -> {m1:.3}, accuracies -> {:.3}",
        acc[11]
    );
    assert!(m1 > m0 + 0.5, "margins {margins:?}");
    assert!(mean(&acc[9..]) >= 0.9, "accuracies {acc:?}");
    for k in [
        "rewards/chosen",
        "rewards/rejected",
        "logps/chosen",
        "logps/rejected",
    ] {
        assert_eq!(series(&m, k).len(), 12, "{k} is logged every step");
    }

    // 4 steps straight against 2, then a resume for 2 more.
    let four = dir.path().join("four");
    let halves = dir.path().join("halves");
    let common = ["training.train_iters=4", "checkpoint.save_steps=2"];
    run("four", dir.path(), stage_cmd("dpo_tiny", &four, &common))?;
    let mut a = stage_cmd("dpo_tiny", &halves, &common);
    a.args(["--stop-after", "2"]);
    run("first-half", dir.path(), a)?;
    let mut b = stage_cmd("dpo_tiny", &halves, &common);
    b.args(["--resume", "latest"]);
    let out = run("second-half", dir.path(), b)?;
    assert!(out.contains("global_step_2"), "{out}");
    assert_same_steps(
        &jsonl(&four.join("metrics.jsonl"))?,
        &jsonl(&halves.join("metrics.jsonl"))?,
    );
    // A checkpoint of another stage is refused by name.
    let mut c = stage_cmd("sft_tiny", &halves, &[]);
    c.args(["--resume", "latest"]);
    let res = c.output()?;
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(
        !res.status.success() && err.contains("\"dpo\"") && err.contains("trainer sft"),
        "{err}"
    );
    Ok(())
}

/// `training.zero_stage: 1` across two SFT trainer processes: each keeps half of the AdamW
/// state, the metrics are those of plain data parallelism, and its checkpoint (one optimizer
/// shard per rank) resumes the run exactly. Stage 2 (each also keeps half of the summed
/// gradient, reduce-scattered over TCP) logs the same metrics too, and so does stage 3 (each
/// also keeps half of the parameters, a layer gathered at a time), stopped after two steps
/// and resumed from its checkpoint.
#[test]
fn zero_stages_1_to_3_train_like_plain_data_parallel_and_resume() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let two = [
        "resource_pool.actor_rollout=2",
        "actor_rollout.num_gpus_for_train=2",
        "training.train_iters=4",
        "checkpoint.save_steps=2",
    ];
    let plain = dir.path().join("plain");
    run("plain", dir.path(), stage_cmd("sft_tiny", &plain, &two))?;
    let zero = dir.path().join("zero");
    let mut a = stage_cmd("sft_tiny", &zero, &two);
    a.arg("training.zero_stage=1").args(["--stop-after", "2"]);
    run("zero-first-half", dir.path(), a)?;
    let mut b = stage_cmd("sft_tiny", &zero, &two);
    b.arg("training.zero_stage=1").args(["--resume", "latest"]);
    let out = run("zero-second-half", dir.path(), b)?;
    assert!(out.contains("global_step_2"), "{out}");
    assert_same_steps(
        &jsonl(&plain.join("metrics.jsonl"))?,
        &jsonl(&zero.join("metrics.jsonl"))?,
    );
    let zero2 = dir.path().join("zero2");
    let mut c = stage_cmd("sft_tiny", &zero2, &two);
    c.arg("training.zero_stage=2");
    run("zero-2", dir.path(), c)?;
    assert_same_steps(
        &jsonl(&plain.join("metrics.jsonl"))?,
        &jsonl(&zero2.join("metrics.jsonl"))?,
    );
    let zero3 = dir.path().join("zero3");
    let mut d = stage_cmd("sft_tiny", &zero3, &two);
    d.arg("training.zero_stage=3").args(["--stop-after", "2"]);
    run("zero-3-first-half", dir.path(), d)?;
    let mut e = stage_cmd("sft_tiny", &zero3, &two);
    e.arg("training.zero_stage=3").args(["--resume", "latest"]);
    run("zero-3-second-half", dir.path(), e)?;
    assert_same_steps(
        &jsonl(&plain.join("metrics.jsonl"))?,
        &jsonl(&zero3.join("metrics.jsonl"))?,
    );
    // Stage 3 saves the whole model as an HF directory, like the others.
    assert!(zero3
        .join("ckpt/global_step_4/actor/model.safetensors")
        .is_file());
    // The sharded checkpoint: one shard per rank, rank 1's beside the actor directory, and
    // together the size of the plain run's whole optimizer state.
    let step = |d: &Path| d.join("ckpt/global_step_4");
    let size = |p: PathBuf| -> Result<u64> { Ok(std::fs::metadata(p)?.len()) };
    let shards = size(step(&zero).join("actor/optimizer-rank-0-of-2.safetensors"))?
        + size(step(&zero).join("actor.rank-1/optimizer-rank-1-of-2.safetensors"))?;
    let whole = size(step(&plain).join("actor/optimizer.safetensors"))?;
    assert!(step(&zero).join("actor/optimizer_shards.json").is_file());
    assert!(
        shards < whole && whole - shards < 16 * 1024,
        "shards {shards} bytes vs whole {whole}"
    );
    Ok(())
}

/// `zero_stage` 2 and 3 in PPO across real processes: two actor trainer ranks and two critic
/// ranks keep only their shares of the AdamW state and of the summed gradients (2), and of
/// the parameters too (3: the log-probs and values gather each layer from the group, and the
/// trainer ranks gather the whole policy for every weight sync to the rollout), and the runs
/// log plain data parallelism's metrics (rollouts, losses, gradient norms) at every step.
#[test]
fn ppo_with_zero_stages_2_and_3_over_shared_memory_logs_the_metrics_of_plain_data_parallel_over_tcp(
) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let shape = [&PPO_TWO_RANKS[..], &["checkpoint.save_steps=0"]].concat();
    // Plain data parallelism over TCP, asked for; the ZeRO runs take the default, shared
    // memory (every rank on this one node): for two ranks every sum is the same either way.
    let plain = dir.path().join("plain");
    let mut c = stage_cmd("ppo_tiny", &plain, &shape);
    c.args(["--comm-backend", "tcp"]);
    let said = run("ppo-plain", dir.path(), c)?;
    for part in ["actor", "critic"] {
        let line = format!("{part} data-parallel group: tcp (asked for with --comm-backend");
        assert!(said.contains(&line), "no {line:?} in:\n{said}");
    }
    let zero = dir.path().join("zero2");
    let mut c = stage_cmd("ppo_tiny", &zero, &shape);
    c.arg("training.zero_stage=2");
    let said = run("ppo-zero-2", dir.path(), c)?;
    for part in ["actor", "critic"] {
        let line = format!("{part} data-parallel group: shm (every rank on node");
        assert_eq!(
            said.matches(&line).count(),
            1,
            "no one {line:?} in:\n{said}"
        );
    }
    let (p, z) = (
        jsonl(&plain.join("metrics.jsonl"))?,
        jsonl(&zero.join("metrics.jsonl"))?,
    );
    assert!(p[0]["actor/grad_norm"].as_f64().is_some_and(|g| g > 0.0));
    assert!(p[0]["critic/grad_norm"].as_f64().is_some_and(|g| g > 0.0));
    assert_same_steps(&p, &z);
    let zero3 = dir.path().join("zero3");
    let mut c = stage_cmd("ppo_tiny", &zero3, &shape);
    c.arg("training.zero_stage=3");
    run("ppo-zero-3", dir.path(), c)?;
    // Step 2 generated with the weights step 1 trained, gathered from both trainer ranks: a
    // sync that delivered other weights would change its rollouts and every metric after.
    assert_eq!(p.len(), 2, "metrics lines");
    assert_same_steps(&p, &jsonl(&zero3.join("metrics.jsonl"))?);
    Ok(())
}

/// `zero_stage: 3` with LoRA on PPO's policy and critic across real processes (the seeds'
/// LoRA plus ZeRO-3 setup): two actor trainer ranks and two critic ranks each keep half of
/// the frozen base and of the adapters, the reference log-probs come from the actor's base
/// with its adapters off, and each weight sync sends the adapters gathered from both ranks.
/// Stopped after a step and resumed from its checkpoint (PEFT adapters and optimizer shards),
/// the run logs the metrics of LoRA with plain data parallelism at every step.
#[test]
fn ppo_with_lora_at_zero_stage_3_logs_the_metrics_of_plain_data_parallel_and_resumes() -> Result<()>
{
    let dir = tempfile::tempdir()?;
    let lora = [
        "checkpoint.save_steps=1",
        "actor_rollout.lora.rank=8",
        "actor_rollout.lora.alpha=16",
        "critic.lora.rank=8",
        "critic.lora.alpha=16",
    ];
    let shape = [&PPO_TWO_RANKS[..], &lora].concat();
    let plain = dir.path().join("plain");
    let mut c = stage_cmd("ppo_tiny", &plain, &shape);
    c.args(["--comm-backend", "tcp"]);
    run("ppo-lora-plain", dir.path(), c)?;
    let zero3 = dir.path().join("zero3");
    let mut a = stage_cmd("ppo_tiny", &zero3, &shape);
    a.arg("training.zero_stage=3").args(["--stop-after", "1"]);
    run("ppo-lora-zero-3-first", dir.path(), a)?;
    let mut b = stage_cmd("ppo_tiny", &zero3, &shape);
    b.arg("training.zero_stage=3").args(["--resume", "latest"]);
    let out = run("ppo-lora-zero-3-resumed", dir.path(), b)?;
    assert!(out.contains("global_step_1"), "{out}");
    let p = jsonl(&plain.join("metrics.jsonl"))?;
    assert_eq!(p.len(), 2, "metrics lines");
    assert!(p[0]["actor/grad_norm"].as_f64().is_some_and(|g| g > 0.0));
    assert!(p[0]["critic/grad_norm"].as_f64().is_some_and(|g| g > 0.0));
    assert_same_steps(&p, &jsonl(&zero3.join("metrics.jsonl"))?);
    // The checkpoint holds the adapters, not the base.
    let actor = zero3.join("ckpt/global_step_2/actor");
    assert!(actor.join("adapter_model.safetensors").is_file());
    assert!(!actor.join("model.safetensors").exists());
    Ok(())
}

/// `zero_stage: 3` for DPO and reward models across real processes: two trainer ranks each
/// keep half of every weight, the chosen and rejected sides go through one model call per
/// pass, and the held-out scoring (`eval/*`, a stage-3 inference call on both ranks) and
/// every training metric equal plain data parallelism's at every step.
#[test]
fn dpo_and_reward_models_at_zero_stage_3_log_the_metrics_of_plain_data_parallel() -> Result<()> {
    let dir = tempfile::tempdir()?;
    for (config, ranks) in [
        (
            "dpo_tiny",
            [
                "resource_pool.actor_rollout=2",
                "actor_rollout.num_gpus_for_train=2",
            ],
        ),
        (
            "rm_tiny",
            ["resource_pool.reward=2", "checkpoint.save_steps=4"],
        ),
    ] {
        let shape: Vec<&str> = ranks
            .iter()
            .copied()
            .chain(["training.train_iters=4"])
            .collect();
        let mut logs = Vec::new();
        for stage in ["training.zero_stage=0", "training.zero_stage=3"] {
            let out = dir.path().join(format!("{config}-{stage}"));
            let mut cmd = stage_cmd(config, &out, &shape);
            cmd.arg(stage);
            run(&format!("{config} {stage}"), dir.path(), cmd)?;
            logs.push(jsonl(&out.join("metrics.jsonl"))?);
        }
        assert_eq!(logs[0].len(), 4, "{config}");
        assert!(
            logs[0].iter().any(|l| l
                .as_object()
                .is_some_and(|o| o.keys().any(|k| k.starts_with("eval/")))),
            "{config}: no held-out scores"
        );
        assert_same_steps(&logs[0], &logs[1]);
        if config == "rm_tiny" {
            // The sharded reward model is saved as the sequence classifier transformers loads:
            // one label, as the plain run writes it.
            for stage in ["training.zero_stage=0", "training.zero_stage=3"] {
                let saved = dir.path().join(format!(
                    "{config}-{stage}/ckpt/global_step_4/reward/config.json"
                ));
                let cfg: Value = serde_json::from_str(&std::fs::read_to_string(&saved)?)?;
                assert_eq!(cfg["num_labels"], 1, "{stage}: {cfg}");
                assert_eq!(cfg["id2label"]["0"], "LABEL_0", "{stage}: {cfg}");
            }
        }
    }
    Ok(())
}
