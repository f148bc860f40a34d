//! `fault_tolerance`: how often a job restarts by itself when one of its role processes (or
//! the node under it) dies, and how long it waits first. The driver restarts every role from
//! the newest complete checkpoint (`rlhf-driver`'s `job` module).

use serde::{Deserialize, Serialize};

/// `fault_tolerance.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultToleranceConfig {
    /// Automatic restarts per run before the job fails (0 = fail at the first death).
    pub max_restarts: u32,
    /// Seconds between a death and the restart (a node coming back, ports freed).
    pub restart_backoff_s: f64,
}

impl Default for FaultToleranceConfig {
    fn default() -> Self {
        Self {
            max_restarts: 3,
            restart_backoff_s: 5.0,
        }
    }
}

impl FaultToleranceConfig {
    /// Problems with these settings, as `key: why; fix` lines.
    pub fn problems(&self) -> Vec<String> {
        let b = self.restart_backoff_s;
        if b.is_finite() && (0.0..=3600.0).contains(&b) {
            vec![]
        } else {
            vec![format!(
                "fault_tolerance.restart_backoff_s ({b}) must be between 0 and 3600 seconds"
            )]
        }
    }
}
