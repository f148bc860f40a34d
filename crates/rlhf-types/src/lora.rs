//! The rules a LoRA adapter's settings must follow, in one place for the config checker
//! (`actor_rollout.lora.*`, `critic.lora.*`) and the models crate that builds the adapters.

/// The decoder's linear modules an adapter can target (Llama / Qwen2 names).
pub const LINEAR_MODULES: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// PEFT's shorthand for every linear layer but the output layer.
pub const ALL_LINEAR: &str = "all-linear";

/// The first problem with adapter settings, as `what: why; fix` without the key prefix:
/// rank 0, a non-positive alpha, dropout outside [0, 1), no targets, or a target that
/// matches no linear layer of the decoder. (Which trainers may use dropout is the config
/// checker's rule.)
pub fn lora_problem(rank: usize, alpha: f64, dropout: f64, targets: &[String]) -> Option<String> {
    if rank == 0 {
        return Some("rank must be at least 1 (rank 0 means no LoRA)".into());
    }
    if !alpha.is_finite() || alpha <= 0.0 {
        return Some(format!("alpha must be positive, got {alpha}"));
    }
    if !(0.0..1.0).contains(&dropout) {
        return Some(format!(
            "dropout must be in [0, 1) (the share of an adapter's inputs zeroed in training), \
             got {dropout}"
        ));
    }
    if targets.is_empty() {
        return Some(format!(
            "target_modules is empty; name some of {} or {ALL_LINEAR}",
            LINEAR_MODULES.join(", ")
        ));
    }
    targets
        .iter()
        .find(|m| *m != ALL_LINEAR && !LINEAR_MODULES.contains(&m.as_str()))
        .map(|m| {
            format!(
                "target module '{m}' matches no linear layer of the decoder; use some of {} or \
                 {ALL_LINEAR}",
                LINEAR_MODULES.join(", ")
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rule_is_named() {
        let t = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            lora_problem(8, 16.0, 0.0, &t(&["q_proj", ALL_LINEAR])),
            None
        );
        let p = |r, a, d, v: &[&str]| lora_problem(r, a, d, &t(v)).unwrap();
        assert!(p(0, 16.0, 0.0, &["q_proj"]).contains("rank"));
        assert!(p(8, 0.0, 0.0, &["q_proj"]).contains("alpha"));
        assert!(p(8, f64::NAN, 0.0, &["q_proj"]).contains("alpha"));
        assert_eq!(lora_problem(8, 16.0, 0.1, &t(&["q_proj"])), None);
        assert!(p(8, 16.0, 1.0, &["q_proj"]).contains("dropout must be in [0, 1)"));
        assert!(p(8, 16.0, -0.1, &["q_proj"]).contains("dropout"));
        assert!(p(8, 16.0, f64::NAN, &["q_proj"]).contains("dropout"));
        assert!(p(8, 16.0, 0.0, &[]).contains("target_modules is empty"));
        let e = p(8, 16.0, 0.0, &["qkv"]);
        assert!(e.contains("'qkv'") && e.contains("down_proj"), "{e}");
    }
}
