//! Placement onto nodes (packing, the shortfall when it does not fit), the `check` report,
//! and the model files a config names.

mod common;

use common::{configs, node, tiny, BASE};
use rlhf_config::{from_yaml_str, load, ConfigError, RoleKind};

#[test]
fn placement_packs_and_refuses_with_the_shortfall() {
    let cfg = load(&configs(), "ppo_llama32_1b", &[]).unwrap();
    // 8 GPUs on one node: everything fits there.
    let plan = cfg.placement_plan(&[node("n0", "GPU", 8.0)]).unwrap();
    assert_eq!(plan.devices_on("n0"), 8);
    assert_eq!(plan.of(RoleKind::ActorRollout)[0].devices, 4);
    // Two 4-GPU nodes: the actor takes one whole node.
    let plan = cfg
        .placement_plan(&[node("a", "GPU", 4.0), node("b", "GPU", 4.0)])
        .unwrap();
    let actor = plan.of(RoleKind::ActorRollout);
    assert_eq!(actor.len(), 1);
    assert_eq!(actor[0].devices, 4);
    assert_eq!(plan.devices_on("a") + plan.devices_on("b"), 8);
    // Too few GPUs: names the resource and the shortfall.
    let err = cfg
        .placement_plan(&[node("a", "GPU", 4.0), node("b", "GPU", 2.0)])
        .unwrap_err();
    match &err {
        ConfigError::Placement {
            resource,
            required,
            available,
            shortfall,
            ..
        } => {
            assert_eq!(resource, "GPU");
            assert_eq!((*required, *available, *shortfall), (8.0, 6.0, 2.0));
        }
        other => panic!("wrong error: {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("'GPU' is short by 2") && msg.contains("actor_rollout 4"),
        "{msg}"
    );
    // GPUs of the wrong kind do not count.
    let t = tiny(&[]).unwrap();
    assert!(t.placement_plan(&[node("a", "GPU", 8.0)]).is_err());
    let plan = t.placement_plan(&[node("a", "CPU", 4.0)]).unwrap();
    assert_eq!(plan.devices_on("a"), 4);
    assert_eq!(plan.of(RoleKind::Reward)[0].devices, 0);
    // A role bigger than any node is spread.
    let plan = cfg
        .placement_plan(&[
            node("a", "GPU", 3.0),
            node("b", "GPU", 3.0),
            node("c", "GPU", 2.0),
        ])
        .unwrap();
    let spread: u32 = plan
        .of(RoleKind::ActorRollout)
        .iter()
        .map(|a| a.devices)
        .sum();
    assert_eq!(spread, 4);
}

#[test]
fn check_report_has_config_plan_and_memory() {
    let cfg = load(
        &configs(),
        "ppo_qwen25_7b",
        &["resource_pool.device_memory_gb=40".into()],
    )
    .unwrap();
    let nodes = [node("n0", "GPU", 4.0), node("n1", "GPU", 4.0)];
    let r = cfg.check_report(&nodes, true);
    assert!(
        r.contains("# resolved config") && r.contains("adv_estimator: gae"),
        "{r}"
    );
    // The answer comes first: 40 GiB devices are too small for the rollout.
    assert!(r.starts_with("# verdict\ndoes not fit:\n- memory: "), "{r}");
    // A PPO job's config shows no DPO keys.
    assert!(
        !r.contains("\n  loss_type:") && !r.contains("\n  beta:"),
        "{r}"
    );
    let dpo = load(&configs(), "dpo_tiny", &[]).unwrap();
    let y = dpo.to_yaml_used();
    assert!(
        y.contains("\n  beta:") && !y.contains("adv_estimator") && !y.contains("\ncritic:"),
        "{y}"
    );
    assert!(r.contains("# placement plan") && r.contains("n1"), "{r}");
    assert!(
        r.contains("actor_rollout/infer") && r.contains("WARNING"),
        "{r}"
    );
    let r = cfg.check_report(&[node("n0", "GPU", 4.0)], false);
    assert!(
        !r.contains("# resolved config") && r.contains("--show-config"),
        "{r}"
    );
    assert!(r.contains("- placement: cannot place the job"), "{r}");
    assert!(
        r.contains("ERROR: cannot place the job: resource 'GPU' is short by 4"),
        "{r}"
    );
}

#[test]
fn model_files_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("model")).unwrap();
    std::fs::write(
        dir.path().join("model/m.yaml"),
        "hidden_size: 64\nnum_hidden_layers: 2\nnum_attention_heads: 4\nintermediat_size: 128\nvocab_size: 100\nmax_position_embeddings: 64\n",
    )
    .unwrap();
    let text = format!(
        "defaults:\n  - model: m\n{}",
        BASE.replace("models/none", "m")
    );
    let err = from_yaml_str(&text, "x.yaml", dir.path(), &[])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("unknown key 'intermediat_size' at line 4; did you mean 'intermediate_size'?"),
        "{err}"
    );
    std::fs::write(
        dir.path().join("model/m.yaml"),
        "hidden_size: 64\nnum_hidden_layers: 2\nnum_attention_heads: 4\nintermediate_size: 128\nvocab_size: 100\nmax_position_embeddings: 24\n",
    )
    .unwrap();
    let err = from_yaml_str(&text, "x.yaml", dir.path(), &[])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("= 32 exceeds max_position_embeddings (24) of model 'm'"),
        "{err}"
    );
    let err = from_yaml_str(
        &text.replace("- model: m", "- modle: m"),
        "x.yaml",
        dir.path(),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("unknown key 'defaults[0].modle'; did you mean 'defaults[0].model'?"),
        "{err}"
    );
    let err = from_yaml_str(
        &text.replace("- model: m", "- model: missing"),
        "x.yaml",
        dir.path(),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("missing.yaml"), "{err}");
}

#[test]
fn bundles_without_their_models_are_refused() {
    let cfg = load(&configs(), "ppo_llama32_1b", &[]).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&cfg.to_bundle()).unwrap();
    v["models"].as_object_mut().unwrap().remove("llama32_1b_rm");
    let err = rlhf_config::from_bundle(&v.to_string())
        .unwrap_err()
        .to_string();
    assert!(err.contains("'llama32_1b_rm'"), "{err}");
    assert!(rlhf_config::from_bundle("{").is_err());
}
