//! `logging.backends` and `logging.tensorboard_dir`: defaults, the rule that ties them, and
//! how they load, resolve and travel.

use std::path::{Path, PathBuf};

use rlhf_config::{load, ConfigError, LogBackend, LoggingConfig, PpoConfig};

fn configs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs")
}

fn tiny(overrides: &[&str]) -> rlhf_config::Result<PpoConfig> {
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    load(&configs(), "ppo_tiny", &o)
}

#[test]
fn jsonl_alone_by_default() {
    let d = LoggingConfig::default();
    assert_eq!(d.backends, vec![LogBackend::Jsonl]);
    assert!(d.tensorboard_dir.is_empty());
    assert!(d.jsonl() && !d.tensorboard());
    let cfg = tiny(&[]).unwrap();
    assert!(cfg.logging.jsonl() && !cfg.logging.tensorboard());
}

#[test]
fn a_tensorboard_dir_alone_turns_tensorboard_on_and_resolves_like_the_metrics_file() {
    let mut cfg = tiny(&["logging.tensorboard_dir=runs/ppo_tiny"]).unwrap();
    assert_eq!(cfg.logging.backends, vec![LogBackend::Jsonl]);
    assert!(cfg.logging.tensorboard() && cfg.logging.jsonl());
    let base = Path::new("/base");
    cfg.absolutize_paths(base);
    assert_eq!(
        Path::new(&cfg.logging.tensorboard_dir),
        base.join("runs/ppo_tiny")
    );
    // An absolute directory stays as it is; an empty one stays off.
    let mut abs = tiny(&["logging.tensorboard_dir=/tb/x"]).unwrap();
    abs.absolutize_paths(base);
    assert_eq!(abs.logging.tensorboard_dir, "/tb/x");
    let mut off = tiny(&[]).unwrap();
    off.absolutize_paths(base);
    assert!(off.logging.tensorboard_dir.is_empty() && !off.logging.tensorboard());
}

#[test]
fn backends_listing_tensorboard_without_a_dir_is_refused_naming_both_keys() {
    let err = tiny(&["logging.backends=[jsonl, tensorboard]"]).unwrap_err();
    let ConfigError::Invalid { errors, .. } = &err else {
        panic!("{err}")
    };
    let msg = errors
        .iter()
        .find(|e| e.contains("logging.backends"))
        .unwrap_or_else(|| panic!("{errors:?}"));
    assert!(msg.contains("logging.tensorboard_dir"), "{msg}");
    assert!(msg.contains("set logging.tensorboard_dir"), "{msg}");
    assert!(msg.contains("remove tensorboard"), "{msg}");
    // With the directory it loads, and a list without jsonl turns the JSONL files off.
    let cfg = tiny(&[
        "logging.backends=[tensorboard]",
        "logging.tensorboard_dir=runs/x",
    ])
    .unwrap();
    assert_eq!(cfg.logging.backends, vec![LogBackend::Tensorboard]);
    assert!(cfg.logging.tensorboard() && !cfg.logging.jsonl());
    let none = tiny(&["logging.backends=[]"]).unwrap();
    assert!(!none.logging.jsonl() && !none.logging.tensorboard());
}

#[test]
fn an_unknown_backend_names_the_key_and_the_valid_ones() {
    let err = tiny(&["logging.backends=[jsonl, wandb]"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("logging.backends"), "{err}");
    assert!(
        err.contains("wandb") && err.contains("jsonl") && err.contains("tensorboard"),
        "{err}"
    );
    let err = tiny(&["logging.backends=tensorboard"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("logging.backends") && err.contains("a list"),
        "{err}"
    );
}

#[test]
fn the_keys_load_from_a_file_and_travel_in_the_resolved_yaml_and_the_bundle() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(configs().join("ppo_tiny.yaml")).unwrap();
    // The shipped config (no `defaults`: it needs no model files) with the two keys added.
    let text = text.replacen(
        "logging:\n",
        "logging:\n  backends: [tensorboard]\n  tensorboard_dir: tb/run1\n",
        1,
    );
    let path = dir.path().join("tb.yaml");
    std::fs::write(&path, &text).unwrap();
    let cfg = rlhf_config::load_file(&path, &[]).unwrap();
    assert_eq!(cfg.logging.backends, vec![LogBackend::Tensorboard]);
    assert_eq!(cfg.logging.tensorboard_dir, "tb/run1");
    let again = rlhf_config::from_yaml_str(&cfg.to_yaml(), "resolved", dir.path(), &[]).unwrap();
    assert_eq!(again.logging, cfg.logging);
    let back = rlhf_config::from_bundle(&cfg.to_bundle()).unwrap();
    assert_eq!(back.logging, cfg.logging);
}
