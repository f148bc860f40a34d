//! Fuzzing of the config loader with proptest: a job config with bytes changed, lines
//! dropped or arbitrary `key=value` overrides loads or fails with a clear error, never a
//! panic. Cases: `RLHF_FUZZ_CASES` (default 64); for a long run:
//! `RLHF_FUZZ_CASES=100000 cargo test --release --workspace --test fuzz_config`.

use std::path::Path;

use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("RLHF_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

fn configs() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn mutated_yaml_never_panics(
        flips in proptest::collection::vec((any::<usize>(), any::<char>()), 0..6),
        drop_line in proptest::option::of(any::<usize>()),
    ) {
        let text = std::fs::read_to_string(configs().join("ppo_tiny.yaml")).unwrap();
        let mut lines: Vec<String> = text.lines().map(String::from).collect();
        if let Some(d) = drop_line {
            let n = lines.len();
            lines.remove(d % n);
        }
        let mut chars: Vec<char> = lines.join("\n").chars().collect();
        for (at, c) in flips {
            let n = chars.len();
            chars[at % n] = c;
        }
        let text: String = chars.into_iter().collect();
        let _ = rlhf_config::from_yaml_str(&text, "fuzz.yaml", &configs(), &[]);
    }

    #[test]
    fn arbitrary_overrides_never_panic(
        keys in proptest::collection::vec("[a-z_.]{0,40}", 1..4),
        values in proptest::collection::vec(".{0,20}", 1..4),
    ) {
        let overrides: Vec<String> = keys
            .iter()
            .zip(values.iter().cycle())
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let _ = rlhf_config::load(&configs(), "ppo_tiny", &overrides);
    }

    #[test]
    fn real_keys_with_wrong_values_never_panic(
        key in prop::sample::select(vec![
            "training.train_iters", "training.global_batch_size", "training.micro_batch_size",
            "training.lr", "training.seq_length", "resource_pool.actor_rollout",
            "resource_pool.device", "actor_rollout.max_prompt_length",
            "actor_rollout.num_samples_per_step", "actor_rollout.temperature",
            "algorithm.gamma", "algorithm.kl_ctrl.type", "data.path", "checkpoint.save_steps",
        ]),
        value in prop_oneof![
            Just("-1".to_string()), Just("0".to_string()), Just("1e400".to_string()),
            Just("nan".to_string()), Just("18446744073709551616".to_string()),
            Just("[]".to_string()), Just("{a: 1}".to_string()), Just("".to_string()),
            ".{0,12}",
        ],
    ) {
        let _ = rlhf_config::load(&configs(), "ppo_tiny", &[format!("{key}={value}")]);
    }
}
