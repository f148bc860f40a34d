//! `actor_rollout.lora.*` and `critic.lora.*`: LoRA adapters for a trained role. Rank 0 (the
//! default) trains the full model; a rank above 0 freezes the base and trains only the
//! adapters on `target_modules` (and the critic's value head), saved as PEFT adapters.

use serde::{Deserialize, Serialize};

/// A trained role's LoRA settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraOptions {
    /// Rank of the adapters; 0 = off (the full model trains).
    pub rank: u32,
    /// `lora_alpha`: the update is scaled by alpha / rank.
    pub alpha: f64,
    /// `lora_dropout`: the share of each adapter's inputs zeroed in training (SFT only).
    pub dropout: f64,
    /// Linear modules that get adapters (`q_proj`, ..., or `all-linear`).
    pub target_modules: Vec<String>,
}

impl Default for LoraOptions {
    fn default() -> Self {
        Self {
            rank: 0,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: vec![rlhf_types::lora::ALL_LINEAR.to_string()],
        }
    }
}

impl LoraOptions {
    /// Whether adapters are on.
    pub fn is_on(&self) -> bool {
        self.rank > 0
    }

    /// The settings when adapters are on.
    pub fn active(&self) -> Option<&LoraOptions> {
        self.is_on().then_some(self)
    }

    /// Problems as `key: why; fix` lines, keys under `section` (`actor_rollout.lora`).
    pub fn problems(&self, section: &str) -> Vec<String> {
        if !self.is_on() {
            return Vec::new();
        }
        rlhf_types::lora::lora_problem(
            self.rank as usize,
            self.alpha,
            self.dropout,
            &self.target_modules,
        )
        .map(|p| format!("{section}: {p}"))
        .into_iter()
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_by_default_and_problems_name_the_section() {
        let mut l = LoraOptions::default();
        assert!(!l.is_on() && l.active().is_none() && l.problems("critic.lora").is_empty());
        l.rank = 8;
        assert!(l.problems("actor_rollout.lora").is_empty());
        l.target_modules = vec!["attn".into()];
        let p = l.problems("actor_rollout.lora").join("\n");
        assert!(
            p.starts_with("actor_rollout.lora: target module 'attn'"),
            "{p}"
        );
    }
}
