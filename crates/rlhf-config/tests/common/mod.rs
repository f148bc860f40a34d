//! Helpers shared by the config test files: the shipped configs, ppo_tiny with overrides,
//! a node's resources, and a small valid config to edit line by line.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rlhf_config::{from_yaml_str, load, PpoConfig};

pub fn configs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs")
}

pub fn tiny(overrides: &[&str]) -> rlhf_config::Result<PpoConfig> {
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    load(&configs(), "ppo_tiny", &o)
}

pub fn node(name: &str, resource: &str, n: f64) -> (String, BTreeMap<String, f64>) {
    (
        name.to_string(),
        BTreeMap::from([(resource.to_string(), n)]),
    )
}

/// A small valid config as text, for tests that edit one line.
pub const BASE: &str = "\
training:
  global_batch_size: 4
  micro_batch_size: 2
  seq_length: 64
resource_pool:
  device: CPU
  actor_rollout: 2
  ref: 1
  critic: 1
  reward: 0
actor_rollout:
  model: models/none
  max_prompt_length: 16
  max_response_length: 16
  num_samples_per_step: 2
  ppo_mini_batch_size: 4
  ppo_epochs: 1
  num_gpus_for_train: 1
  num_gpus_for_infer: 1
critic:
  critic_mini_batch_size: 4
reward:
  kind: rule
  rule: contains_digit
";

pub fn base_with(edits: &[(&str, &str)], overrides: &[&str]) -> rlhf_config::Result<PpoConfig> {
    let mut text = BASE.to_string();
    for (from, to) in edits {
        assert!(text.contains(from), "BASE lacks {from:?}");
        text = text.replace(from, to);
    }
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    from_yaml_str(&text, "base.yaml", &configs(), &o)
}
