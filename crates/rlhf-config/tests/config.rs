//! Loading, overrides, unknown keys, validation and round trips (placement and the check
//! report: placement.rs).

mod common;

use std::path::PathBuf;

use common::{base_with, configs, tiny, BASE};
use rlhf_config::{
    from_yaml_str, load, ConfigError, DeviceKind, RoleKind, TemplateValue, TrainingConfig,
};

#[test]
fn every_shipped_config_loads_and_validates() {
    let mut names: Vec<String> = std::fs::read_dir(configs())
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            (p.extension()? == "yaml")
                .then(|| p.file_stem().unwrap().to_string_lossy().into_owned())
        })
        .collect();
    names.sort();
    assert!(names.len() >= 3, "{names:?}");
    for name in &names {
        let cfg = load(&configs(), name, &[]).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(cfg.source.is_some());
        assert!(rlhf_config::problems(&cfg).is_empty());
    }
    // `.yaml` in the name is tolerated; a missing name lists the choices.
    assert!(load(&configs(), "ppo_tiny.yaml", &[]).is_ok());
    let err = load(&configs(), "ppo_nope", &[]).unwrap_err().to_string();
    assert!(
        err.contains("ppo_tiny") && err.contains("ppo_llama32_1b"),
        "{err}"
    );
}

#[test]
fn shipped_configs_have_the_documented_shape() {
    let t = tiny(&[]).unwrap();
    assert_eq!(t.resource_pool.device, DeviceKind::Cpu);
    assert_eq!(t.prompts_per_step(), 8);
    assert_eq!(t.rollout_batch_size(), 16);
    assert_eq!(t.actor_rollout.max_response_length, 16);
    assert_eq!(t.actor_rollout.ppo_epochs, 2);
    assert_eq!(t.reward.kind, rlhf_config::RewardKind::Rule);
    assert_eq!(t.reward.rule, "contains_digit");
    assert_eq!(t.actor_rollout.model, "models/tiny");

    let l = load(&configs(), "ppo_llama32_1b", &[]).unwrap();
    let m = &l.models["llama32_1b"];
    assert_eq!(
        (
            m.hidden_size,
            m.num_hidden_layers,
            m.num_attention_heads,
            m.kv_heads()
        ),
        (2048, 16, 32, 8)
    );
    assert_eq!((m.intermediate_size, m.vocab_size), (8192, 128256));
    assert!(m.tie_word_embeddings);
    // Llama 3.2 1B has 1.236 B parameters.
    assert_eq!(m.lm_params(), 1_235_814_400);
    let actor = l.role_model(RoleKind::ActorRollout).unwrap();
    assert_eq!(
        actor.path.unwrap(),
        PathBuf::from("models/Llama-3.2-1B-Instruct")
    );
    assert_eq!(
        l.role_model(RoleKind::Reward).unwrap().name,
        "llama32_1b_rm"
    );

    let q = load(&configs(), "ppo_qwen25_7b", &[]).unwrap();
    let m = &q.models["qwen25_7b"];
    // Qwen2.5 7B: 7.616 B parameters (q/k/v bias, untied head).
    assert_eq!(m.lm_params(), 7_615_616_512);
    assert_eq!(q.rollout_batch_size(), 256);
}

#[test]
fn unknown_key_in_file_names_path_line_and_suggestion() {
    let err = base_with(&[("  ppo_epochs: 1", "  ppo_epoch: 1")], &[]).unwrap_err();
    let msg = err.to_string();
    match err {
        ConfigError::UnknownKey {
            key,
            line,
            suggestion,
            ..
        } => {
            assert_eq!(key, "actor_rollout.ppo_epoch");
            assert_eq!(
                line,
                Some(BASE.lines().position(|l| l == "  ppo_epochs: 1").unwrap() + 1)
            );
            assert_eq!(suggestion.as_deref(), Some("actor_rollout.ppo_epochs"));
        }
        other => panic!("wrong error: {other}"),
    }
    assert!(
        msg.contains("base.yaml: unknown key 'actor_rollout.ppo_epoch' at line"),
        "{msg}"
    );
    assert!(
        msg.contains("did you mean 'actor_rollout.ppo_epochs'?"),
        "{msg}"
    );

    // Nested (rlhf-algo) sections and top-level sections are checked too.
    let err = base_with(
        &[(
            "reward:\n",
            "algorithm:\n  kl_ctrl:\n    kl_cof: 0.1\nreward:\n",
        )],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("'algorithm.kl_ctrl.kl_cof'") && err.contains("'algorithm.kl_ctrl.kl_coef'"),
        "{err}"
    );
    let err = base_with(&[("critic:\n", "critic:\n  ppo_epochs: 2\n")], &[])
        .unwrap_err()
        .to_string();
    let line = BASE.lines().position(|l| l == "critic:").unwrap() + 2;
    assert!(
        err.contains(&format!(
            "'critic.ppo_epochs' at line {line}; did you mean 'actor_rollout.ppo_epochs'?"
        )),
        "{err}"
    );
    let err = base_with(&[("critic:\n", "critc:\n")], &[])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("unknown key 'critc'") && err.contains("'critic'"),
        "{err}"
    );
    // Far from everything: no suggestion.
    let err = base_with(&[("reward:\n", "zzz_qqq: 1\nreward:\n")], &[])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("'zzz_qqq'") && !err.contains("did you mean"),
        "{err}"
    );
}

#[test]
fn unknown_key_in_override_is_rejected_with_suggestion() {
    let err = tiny(&["actor_rollout.ppo_epoch=3"]).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ConfigError::UnknownKey { .. }), "{msg}");
    assert!(
        msg.contains("override 'actor_rollout.ppo_epoch=3'"),
        "{msg}"
    );
    assert!(
        msg.contains("did you mean 'actor_rollout.ppo_epochs'?"),
        "{msg}"
    );

    let msg = tiny(&["algorithm.kl_ctrl.klcoef=0.1"])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("'algorithm.kl_ctrl.kl_coef'"), "{msg}");
    // A valid key in the wrong section points at the right one.
    let msg = tiny(&["critic.ppo_epochs=2"]).unwrap_err().to_string();
    assert!(
        msg.contains("did you mean 'actor_rollout.ppo_epochs'?"),
        "{msg}"
    );
    let msg = tiny(&["no_equals_sign"]).unwrap_err().to_string();
    assert!(msg.contains("key.path=value"), "{msg}");
}

#[test]
fn overrides_change_values() {
    let cfg = tiny(&[
        "actor_rollout.ppo_epochs=3",
        "algorithm.kl_ctrl.kl_coef=0.1",
        "algorithm.kl_ctrl.type=adaptive",
        "data.shuffle=false",
        "actor_rollout.clip_ratio_c=null",
        "training.bf16=true",
        "checkpoint.resume=latest",
        "training.lr=1e-5",
    ])
    .unwrap();
    assert_eq!(cfg.actor_rollout.ppo_epochs, 3);
    assert_eq!(cfg.algorithm.kl_ctrl.kl_coef, 0.1);
    assert_eq!(cfg.algorithm.kl_ctrl.kind, rlhf_algo::KlCtrlType::Adaptive);
    assert!(!cfg.data.shuffle);
    assert_eq!(cfg.actor_rollout.clip_ratio_c, None);
    assert!(cfg.training.bf16);
    assert_eq!(cfg.checkpoint.resume.as_deref(), Some("latest"));
    assert_eq!(cfg.training.lr, 1e-5);
    // Unchanged keys keep the file's values.
    assert_eq!(cfg.actor_rollout.num_samples_per_step, 2);
}

#[test]
fn bad_value_types_name_the_key_and_expected_type() {
    let err = tiny(&["actor_rollout.ppo_epochs=two"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("actor_rollout.ppo_epochs") && err.contains("non-negative integer"),
        "{err}"
    );
    let err = base_with(&[("  ppo_epochs: 1", "  ppo_epochs: -1")], &[])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("'actor_rollout.ppo_epochs'") && err.contains("at line"),
        "{err}"
    );
    let err = tiny(&["data.shuffle=maybe"]).unwrap_err().to_string();
    assert!(
        err.contains("data.shuffle") && err.contains("boolean"),
        "{err}"
    );
    // Enum names: serde lists the variants, the path names the key.
    let err = tiny(&["algorithm.adv_estimator=ppo"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("algorithm.adv_estimator") && err.contains("grpo"),
        "{err}"
    );
    let err = tiny(&["critic.lr=fast"]).unwrap_err().to_string();
    assert!(err.contains("critic.lr") && err.contains("number"), "{err}");
}

#[test]
fn role_sections_override_training_keys() {
    let cfg = tiny(&["ref.micro_batch_size=2", "actor_rollout.bf16=true"]).unwrap();
    // The file sets critic.lr = 1e-4 over training.lr = 5e-5.
    assert_eq!(cfg.training.lr, 5.0e-5);
    assert_eq!(cfg.resolved(RoleKind::Critic).lr, 1.0e-4);
    assert_eq!(cfg.resolved(RoleKind::ActorRollout).lr, 5.0e-5);
    assert_eq!(cfg.resolved(RoleKind::Ref).micro_batch_size, 2);
    assert_eq!(cfg.resolved(RoleKind::Critic).micro_batch_size, 4);
    assert!(cfg.resolved(RoleKind::ActorRollout).bf16);
    assert!(!cfg.resolved(RoleKind::Ref).bf16);
    // Every training key is accepted in every role section.
    for role in ["actor_rollout", "ref", "critic", "reward"] {
        for key in TrainingConfig::KEYS {
            let schema = rlhf_config::config_schema();
            assert!(
                schema[role][*key] == schema["training"][*key],
                "{role}.{key}"
            );
        }
    }
    // The resolved YAML shows overrides where they were written.
    let yaml = cfg.to_yaml();
    assert!(yaml.contains("micro_batch_size: 2"), "{yaml}");
}

#[test]
fn indivisible_batches_are_all_reported_with_keys_and_numbers() {
    // rollout 4 x 2 = 8; mini batch 3 does not divide 8 and is not a multiple
    // of micro 2 x 1 train rank; infer ranks 3 do not divide 8 either and
    // 1 + 3 != 2 devices.
    let err = base_with(
        &[
            ("  ppo_mini_batch_size: 4", "  ppo_mini_batch_size: 3"),
            ("  num_gpus_for_infer: 1", "  num_gpus_for_infer: 3"),
        ],
        &[],
    )
    .unwrap_err();
    let ConfigError::Invalid { errors, .. } = &err else {
        panic!("wrong error: {err}")
    };
    let all = errors.join("\n");
    assert!(
        all.contains("= 8 is not divisible by actor_rollout.ppo_mini_batch_size (3)"),
        "{all}"
    );
    assert!(
        all.contains("actor_rollout.ppo_mini_batch_size (3) is not divisible by micro_batch_size (2) x actor_rollout.num_gpus_for_train (1) = 2"),
        "{all}"
    );
    assert!(
        all.contains("not divisible by actor_rollout.num_gpus_for_infer (3)"),
        "{all}"
    );
    assert!(
        all.contains("= 4 != resource_pool.actor_rollout (2)"),
        "{all}"
    );
    assert_eq!(errors.len(), 4, "{all}");

    let err = base_with(
        &[("  critic_mini_batch_size: 4", "  critic_mini_batch_size: 3")],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("critic.critic_mini_batch_size (3)"), "{err}");

    // GRPO needs groups.
    let err = base_with(
        &[],
        &[
            "algorithm.adv_estimator=grpo",
            "actor_rollout.num_samples_per_step=1",
            "actor_rollout.ppo_mini_batch_size=2",
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("num_samples_per_step (1) must be >= 2"),
        "{err}"
    );

    // Lengths against the model's context and the role's seq_length.
    let err = load(
        &configs(),
        "ppo_qwen25_7b",
        &[
            "actor_rollout.max_prompt_length=32000".into(),
            "training.seq_length=40000".into(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("actor_rollout: actor_rollout.max_prompt_length (32000) + actor_rollout.max_response_length (1024) = 33024 exceeds max_position_embeddings (32768) of model 'qwen25_7b'"),
        "{err}"
    );
    let err = base_with(&[], &["critic.seq_length=16"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("critic: seq_length (16) < actor_rollout.max_prompt_length (16) + actor_rollout.max_response_length (16) = 32"), "{err}");
}

#[test]
fn yaml_syntax_errors_carry_the_line() {
    let err = from_yaml_str("training:\n  lr: [1,\n", "bad.yaml", &configs(), &[]).unwrap_err();
    assert!(
        matches!(err, ConfigError::Yaml { line: Some(_), .. }),
        "{err}"
    );
}

#[test]
fn resolved_yaml_round_trips() {
    for name in ["ppo_tiny", "ppo_llama32_1b", "ppo_qwen25_7b"] {
        let cfg = load(&configs(), name, &["ref.micro_batch_size=2".into()]).unwrap();
        let yaml = cfg.to_yaml();
        let mut again = from_yaml_str(&yaml, "resolved.yaml", &configs(), &[])
            .unwrap_or_else(|e| panic!("{name}: {e}\n{yaml}"));
        again.source = cfg.source.clone();
        assert_eq!(again, cfg, "{name}");
        // The self-contained bundle needs no files.
        let back = rlhf_config::from_bundle(&cfg.to_bundle()).unwrap();
        assert_eq!(back, cfg, "{name}");
    }
}

#[test]
fn null_for_a_required_value_names_the_key() {
    let err = tiny(&["actor_rollout.ppo_epochs=null"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("actor_rollout.ppo_epochs"), "{err}");
    let err = tiny(&["training.lr=null"]).unwrap_err().to_string();
    assert!(err.contains("training.lr"), "{err}");
    // In a role section null means "inherit".
    let cfg = tiny(&["critic.lr=null"]).unwrap();
    assert_eq!(cfg.resolved(RoleKind::Critic).lr, cfg.training.lr);
}

#[test]
fn async_rollout_keys_load_and_bad_combinations_name_the_fix() {
    let c = tiny(&[
        "actor_rollout.async.mode=bounded",
        "actor_rollout.async.max_staleness=3",
        "actor_rollout.async.is_cap=5",
    ])
    .unwrap();
    assert_eq!(c.actor_rollout.async_.mode, rlhf_config::AsyncMode::Bounded);
    assert_eq!(
        (
            c.actor_rollout.async_.staleness(),
            c.actor_rollout.async_.sync_every()
        ),
        (3, 3)
    );
    assert_eq!(c.actor_rollout.async_.is_cap, 5.0);
    assert_eq!(
        tiny(&[]).unwrap().actor_rollout.async_.mode,
        rlhf_config::AsyncMode::Sync
    );

    let err = |o: &[&str]| match tiny(o) {
        Ok(c) => rlhf_config::problems(&c).join("\n"),
        Err(e) => e.to_string(),
    };
    let e = err(&[
        "actor_rollout.async.mode=one_step_off",
        "resource_pool.colocate=true",
    ]);
    assert!(
        e.contains("actor_rollout.async.mode=one_step_off")
            && e.contains("resource_pool.colocate=false"),
        "{e}"
    );
    let e = err(&[
        "actor_rollout.async.mode=bounded",
        "actor_rollout.async.max_staleness=0",
    ]);
    assert!(e.contains("max_staleness >= 1"), "{e}");
    let e = err(&["actor_rollout.async.is_cap=0.5"]);
    assert!(e.contains("actor_rollout.async.is_cap (0.5)"), "{e}");
    let e = err(&["actor_rollout.async.mode=two_steps_off"]);
    assert!(
        e.contains("two_steps_off") && e.contains("one_step_off"),
        "{e}"
    );
    let e = err(&["actor_rollout.async.depth=2"]);
    assert!(e.contains("actor_rollout.async.depth"), "{e}");
}

/// `data.chat_template_kwargs` takes chat template variables by name, scalars only, in the
/// file and as overrides (one variable, or the whole mapping), and survives the bundle; a
/// list, a mapping or a name the renderer sets itself is refused naming the key.
#[test]
fn chat_template_kwargs_take_scalars_by_name() {
    let with = |vars: &str| {
        let text = format!("{BASE}data:\n  chat_template_kwargs:\n{vars}");
        from_yaml_str(&text, "base.yaml", &configs(), &[])
    };
    let cfg = with("    enable_thinking: false\n    effort: high\n    budget: 2\n").unwrap();
    assert_eq!(
        serde_json::Value::Object(cfg.data.chat_template_vars()),
        serde_json::json!({"budget": 2, "effort": "high", "enable_thinking": false})
    );
    let back = rlhf_config::from_bundle(&cfg.to_bundle()).unwrap();
    assert_eq!(back.data, cfg.data);
    let cfg = tiny(&["data.chat_template_kwargs.enable_thinking=false"]).unwrap();
    assert_eq!(
        cfg.data.chat_template_kwargs["enable_thinking"],
        TemplateValue::Bool(false)
    );
    let cfg =
        tiny(&["data.chat_template_kwargs={enable_thinking: true, temperature: 0.5}"]).unwrap();
    assert_eq!(
        serde_json::Value::Object(cfg.data.chat_template_vars()),
        serde_json::json!({"enable_thinking": true, "temperature": 0.5})
    );
    assert!(tiny(&[]).unwrap().data.chat_template_kwargs.is_empty());

    for (vars, key, want) in [
        (
            "    enable_thinking: {a: 1}\n",
            "enable_thinking",
            "a mapping",
        ),
        ("    budget: [1, 2]\n", "budget", "a list"),
        ("    messages: hi\n", "messages", "reserved name"),
        ("    ok: 1\n    tools: x\n", "tools", "reserved name"),
    ] {
        let err = with(vars).unwrap_err().to_string();
        let key = format!("'data.chat_template_kwargs.{key}'");
        assert!(
            err.contains(&key) && err.contains(want) && err.contains("at line"),
            "{err}"
        );
    }
    for (o, want) in [
        (
            "data.chat_template_kwargs.enable_thinking=[1]",
            "data.chat_template_kwargs.enable_thinking",
        ),
        ("data.chat_template_kwargs.a.b=1", "NAME=value"),
        (
            "data.chat_template_kwargs={x: {y: 1}}",
            "data.chat_template_kwargs.x",
        ),
        ("data.chat_template_kwargs=5", "mapping"),
        (
            "data.chat_template_kwargs.add_generation_prompt=false",
            "reserved name",
        ),
    ] {
        let err = tiny(&[o]).unwrap_err().to_string();
        assert!(err.contains(want), "{o}: {err}");
    }
}

/// DAPO's settings against the rest of the config: each refusal names the key and the fix.
#[test]
fn dynamic_sampling_and_overlong_shaping_are_checked_against_the_rollout() {
    let problems = |overrides: &[&str]| -> String {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        match load(&configs(), "grpo_math_tiny", &o) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    };
    assert_eq!(problems(&[]), "");
    let e = problems(&[
        "actor_rollout.num_samples_per_step=1",
        "actor_rollout.ppo_mini_batch_size=8",
        "algorithm.adv_estimator=reinforce_plus_plus",
    ]);
    assert!(
        e.contains("algorithm.dynamic_sampling.enable") && e.contains("there are no groups"),
        "{e}"
    );
    let e = problems(&["reward.rule=contains_digit", "reward.format_score=0.1"]);
    assert!(
        e.contains("reward.format_score (0.1) only applies to reward.rule math"),
        "{e}"
    );
    let e = problems(&[
        "reward.rule=contains_digit",
        "algorithm.dynamic_sampling.metric=accuracy",
    ]);
    assert!(
        e.contains("metric is accuracy") && e.contains("the reward is rule contains_digit"),
        "{e}"
    );
    let e = problems(&["algorithm.overlong_buffer.len=6"]);
    assert!(
        e.contains(
            "algorithm.overlong_buffer.len (6) must be below actor_rollout.max_response_length (6)"
        ),
        "{e}"
    );
    let e = problems(&["algorithm.dynamic_sampling.max_num_gen_batches=0"]);
    assert!(
        e.contains("algorithm.dynamic_sampling.max_num_gen_batches"),
        "{e}"
    );
    let e = problems(&["algorithm.dynamic_sampling.metric=variance"]);
    assert!(e.contains("score") && e.contains("accuracy"), "{e}");
}
