//! The committed key reference matches the code, and every key is documented.

use std::path::Path;

use rlhf_config::docs::{config_reference_markdown, doc_of, leaves, KEY_DOCS, MODEL_KEY_DOCS};

#[test]
fn committed_config_readme_matches_generated() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/README.md");
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    let generated = config_reference_markdown();
    assert!(
        committed == generated,
        "configs/README.md is stale; run `cargo run -p rlhf-config --example gen_config_docs`"
    );
}

#[test]
fn every_key_has_a_doc_and_every_doc_a_key() {
    let schema = rlhf_config::config_schema();
    let paths: Vec<String> = leaves(&schema).into_iter().map(|(p, _)| p).collect();
    for p in &paths {
        assert!(doc_of(p).is_some(), "no doc for {p}");
    }
    for (p, _) in KEY_DOCS {
        assert!(
            paths.iter().any(|x| x == p),
            "KEY_DOCS names unknown key {p}"
        );
    }
    let model = serde_norway::to_value(rlhf_config::ModelConfig::default()).unwrap();
    let model_paths: Vec<String> = leaves(&model).into_iter().map(|(p, _)| p).collect();
    assert_eq!(model_paths.len(), MODEL_KEY_DOCS.len());
    for (p, _) in MODEL_KEY_DOCS {
        assert!(
            model_paths.iter().any(|x| x == p),
            "MODEL_KEY_DOCS names unknown key {p}"
        );
    }
    let md = config_reference_markdown();
    assert!(!md.contains("(undocumented)"));
    assert!(md.contains("| `actor_rollout.ppo_epochs` | `1` |"));
    assert!(md.contains("| `algorithm.kl_ctrl.kl_coef` | `0.05` |"));
}
