//! `actor_rollout.async`: whether the rollout ranks generate the next batches while the
//! trainers train on the current one, how stale the sampling weights may be, and the cap of
//! the importance weight that corrects for that staleness. The schedule these settings
//! imply (which weights version samples which step's batch, when weights move) is
//! [`AsyncConfig::staleness`] and [`AsyncConfig::sync_every`]; the driver follows it exactly,
//! so a seeded async run is reproducible.

use serde::{Deserialize, Serialize};

/// How rollout and training overlap (`actor_rollout.async.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AsyncMode {
    /// Generate, then train, then sync: the batch of step s is sampled with the weights
    /// after step s - 1 (on-policy).
    #[default]
    Sync,
    /// The batch of step s + 1 is generated while step s trains, with the weights after
    /// step s - 1: always one version stale; weights sync after every step.
    OneStepOff,
    /// The rollout runs up to `max_staleness` batches ahead and receives new weights every
    /// `max_staleness` steps (one lockstep point per sync instead of per step): batches are
    /// 1 to `max_staleness` versions stale.
    Bounded,
}

impl std::fmt::Display for AsyncMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AsyncMode::Sync => "sync",
            AsyncMode::OneStepOff => "one_step_off",
            AsyncMode::Bounded => "bounded",
        })
    }
}

/// `actor_rollout.async.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AsyncConfig {
    pub mode: AsyncMode,
    /// Most policy versions a sample may lag the trainer; older samples are dropped.
    pub max_staleness: u32,
    /// Cap of the truncated importance weight pi_old / pi_behaviour (>= 1).
    pub is_cap: f64,
}

impl Default for AsyncConfig {
    fn default() -> Self {
        Self {
            mode: AsyncMode::Sync,
            max_staleness: 1,
            is_cap: 2.0,
        }
    }
}

impl AsyncConfig {
    /// The most versions a batch lags in this mode's schedule: 0 (sync), 1 (one step off)
    /// or `max_staleness` (bounded).
    pub fn staleness(&self) -> u64 {
        match self.mode {
            AsyncMode::Sync => 0,
            AsyncMode::OneStepOff => 1,
            AsyncMode::Bounded => u64::from(self.max_staleness),
        }
    }

    /// Steps between weight syncs: every step, except in bounded mode, where one sync every
    /// `max_staleness` steps keeps every batch within the bound.
    pub fn sync_every(&self) -> u64 {
        self.staleness().max(1)
    }

    /// Whether the rollout overlaps training (and the off-policy correction applies).
    pub fn is_async(&self) -> bool {
        self.mode != AsyncMode::Sync
    }

    /// Problems with these settings, as `key: why; fix` lines.
    pub fn problems(&self) -> Vec<String> {
        let mut e = Vec::new();
        if !(self.is_cap.is_finite() && self.is_cap >= 1.0) {
            e.push(format!(
                "actor_rollout.async.is_cap ({}) must be a number >= 1: it caps the importance weight pi_old / pi_behaviour, and a cap below 1 would shrink on-policy tokens too",
                self.is_cap
            ));
        }
        match self.mode {
            AsyncMode::Sync => {}
            AsyncMode::OneStepOff if self.max_staleness < 1 => e.push(format!(
                "actor_rollout.async.mode=one_step_off samples every batch with weights one version old, but actor_rollout.async.max_staleness ({}) would drop them all; set max_staleness >= 1",
                self.max_staleness
            )),
            AsyncMode::OneStepOff => {}
            AsyncMode::Bounded if self.max_staleness < 1 => e.push(
                "actor_rollout.async.mode=bounded needs actor_rollout.async.max_staleness >= 1 (how many versions the rollout may run ahead); use mode=sync for on-policy rollout".to_string(),
            ),
            AsyncMode::Bounded => {}
        }
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_per_mode_and_problems() {
        let mut a = AsyncConfig::default();
        assert_eq!((a.staleness(), a.sync_every(), a.is_async()), (0, 1, false));
        a.mode = AsyncMode::OneStepOff;
        assert_eq!((a.staleness(), a.sync_every(), a.is_async()), (1, 1, true));
        a.mode = AsyncMode::Bounded;
        a.max_staleness = 3;
        assert_eq!((a.staleness(), a.sync_every()), (3, 3));
        assert!(a.problems().is_empty());
        a.max_staleness = 0;
        let p = a.problems().join("\n");
        assert!(p.contains("actor_rollout.async.max_staleness >= 1"), "{p}");
        a.mode = AsyncMode::OneStepOff;
        assert!(a.problems().join("\n").contains("max_staleness >= 1"));
        a.mode = AsyncMode::Sync;
        a.is_cap = 0.5;
        assert!(a
            .problems()
            .join("\n")
            .contains("actor_rollout.async.is_cap (0.5)"));
    }
}
