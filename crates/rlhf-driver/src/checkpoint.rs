//! Checkpoint layout and the trainer-state file.
//!
//! ```text
//! <checkpoint.dir>/
//!   latest_checkpointed_iteration.txt     N of the newest complete checkpoint
//!   global_step_N/
//!     actor/        HF model dir + optimizer.safetensors + role_state.json
//!     critic/       same, with the value head (when the estimator uses a critic)
//!     trainer_state.json   step, data cursor, KL controller, seeds (written last)
//! ```
//! A checkpoint counts only once `trainer_state.json` exists, so a crash while saving
//! leaves the previous one as `latest`.

use std::path::{Path, PathBuf};

use rlhf_algo::KlController;
use rlhf_config::data::DataCursor;
use rlhf_core::{durable, Error, Result};
use serde::{Deserialize, Serialize};

pub const STATE_FILE: &str = "trainer_state.json";
pub const LATEST_FILE: &str = "latest_checkpointed_iteration.txt";
const FORMAT: u32 = 1;

/// What the driver needs to continue a run exactly where it stopped.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    pub format: u32,
    /// The algorithm that wrote it (`Algorithm::NAME`); checkpoints from before the field
    /// existed were PPO's.
    #[serde(default = "ppo")]
    pub algorithm: String,
    /// Completed steps.
    pub global_step: u64,
    pub data_cursor: DataCursor,
    /// PPO's adaptive KL coefficient (the algorithm's own state; absent for one that keeps
    /// none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_ctl: Option<KlController>,
    pub seed: u64,
    pub job_id: String,
    /// rlhf_collective::checksum of the saved policy weights.
    pub actor_checksum: u64,
    pub critic_checksum: Option<u64>,
    /// A reward model's (trainer: reward).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward_checksum: Option<u64>,
    pub saved_unix_ms: u64,
}

fn ppo() -> String {
    "ppo".into()
}

impl TrainerState {
    pub fn new(
        algorithm: &str,
        global_step: u64,
        data_cursor: DataCursor,
        seed: u64,
        job_id: &str,
    ) -> Self {
        Self {
            format: FORMAT,
            algorithm: algorithm.into(),
            global_step,
            data_cursor,
            kl_ctl: None,
            seed,
            job_id: job_id.into(),
            actor_checksum: 0,
            critic_checksum: None,
            reward_checksum: None,
            saved_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
        }
    }
}

impl TrainerState {
    /// Records the checksum of the weights saved under the role directory `part`.
    pub fn set_checksum(&mut self, part: &str, checksum: u64) {
        match part {
            "actor" => self.actor_checksum = checksum,
            "critic" => self.critic_checksum = Some(checksum),
            _ => self.reward_checksum = Some(checksum),
        }
    }

    /// The checksum recorded for the role directory `part` (none when not recorded).
    pub fn checksum(&self, part: &str) -> Option<u64> {
        match part {
            "actor" => Some(self.actor_checksum).filter(|&c| c != 0),
            "critic" => self.critic_checksum,
            _ => self.reward_checksum,
        }
    }
}

pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("global_step_{step}"))
}

/// Writes the state file (atomically, fsynced) and then moves `latest` to this step; the
/// role directories were published whole before.
pub fn commit(root: &Path, state: &TrainerState) -> Result<PathBuf> {
    let dir = step_dir(root, state.global_step);
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let text = serde_json::to_string_pretty(state)
        .map_err(|e| Error::internal(format!("serializing trainer state: {e}")))?;
    durable::write_atomic(&dir.join(STATE_FILE), text.as_bytes())?;
    durable::write_atomic(
        &root.join(LATEST_FILE),
        format!("{}\n", state.global_step).as_bytes(),
    )?;
    Ok(dir)
}

/// Complete checkpoints under `root`, oldest first.
pub fn list(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n: u64 = name.strip_prefix("global_step_")?.parse().ok()?;
            let p = e.path();
            p.join(STATE_FILE).is_file().then_some((n, p))
        })
        .collect();
    v.sort();
    v
}

/// Deletes all but the newest `keep` complete checkpoints (0 keeps all), and any
/// incomplete step directory older than the newest complete one.
pub fn prune(root: &Path, keep: u32) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let all = list(root);
    if keep > 0 && all.len() > keep as usize {
        for (_, p) in &all[..all.len() - keep as usize] {
            std::fs::remove_dir_all(p)
                .map_err(|e| Error::io(format!("removing {}", p.display()), e))?;
            removed.push(p.clone());
        }
    }
    Ok(removed)
}

/// Resolves `--resume`: `latest` (the newest complete checkpoint under `root`) or a path to
/// a `global_step_N` directory.
pub fn resolve(root: &Path, spec: &str) -> Result<(PathBuf, TrainerState)> {
    let dir = if spec == "latest" {
        let latest = root.join(LATEST_FILE);
        let step = std::fs::read_to_string(&latest)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok());
        match step {
            Some(n) if step_dir(root, n).join(STATE_FILE).is_file() => step_dir(root, n),
            _ => match list(root).pop() {
                Some((_, p)) => p,
                None => {
                    return Err(Error::invalid(format!(
                        "--resume latest: no checkpoint under {} (checkpoint.dir); run without --resume to start fresh",
                        root.display()
                    )))
                }
            },
        }
    } else {
        PathBuf::from(spec)
    };
    let state_path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&state_path).map_err(|_| {
        Error::invalid(format!(
            "--resume {spec}: {} not found; pass `latest` or a global_step_N directory under checkpoint.dir",
            state_path.display()
        ))
    })?;
    let state: TrainerState = serde_json::from_str(&text)
        .map_err(|e| Error::invalid(format!("{}: {e}", state_path.display())))?;
    if state.format != FORMAT {
        return Err(Error::invalid(format!(
            "{}: trainer state format {} is not supported (expected {FORMAT})",
            state_path.display(),
            state.format
        )));
    }
    Ok((dir, state))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(step: u64) -> TrainerState {
        let mut s = TrainerState::new("ppo", step, DataCursor::default(), 7, "job");
        s.kl_ctl = Some(KlController::Fixed { value: 0.1 });
        s
    }

    #[test]
    fn commit_list_prune_and_resolve() {
        let d = tempfile::tempdir().unwrap();
        for s in [2, 4, 6] {
            commit(d.path(), &state(s)).unwrap();
        }
        // An incomplete save (no state file) never counts.
        std::fs::create_dir_all(step_dir(d.path(), 8).join("actor")).unwrap();
        assert_eq!(
            list(d.path()).iter().map(|(n, _)| *n).collect::<Vec<_>>(),
            vec![2, 4, 6]
        );
        let (dir, st) = resolve(d.path(), "latest").unwrap();
        assert_eq!(st.global_step, 6);
        assert_eq!(st.kl_ctl, Some(KlController::Fixed { value: 0.1 }));
        assert!(dir.ends_with("global_step_6"));
        // An algorithm without a KL controller writes none, and reads back none.
        let mut bare = state(7);
        bare.kl_ctl = None;
        let json = serde_json::to_string(&bare).unwrap();
        assert!(!json.contains("kl_ctl"), "{json}");
        assert_eq!(serde_json::from_str::<TrainerState>(&json).unwrap(), bare);
        // A state from before the algorithm was recorded is PPO's.
        let old = json.replace("\"algorithm\":\"ppo\",", "");
        assert!(!old.contains("algorithm"), "{old}");
        assert_eq!(serde_json::from_str::<TrainerState>(&old).unwrap(), bare);
        let (_, st) = resolve(d.path(), step_dir(d.path(), 4).to_str().unwrap()).unwrap();
        assert_eq!(st.global_step, 4);
        let removed = prune(d.path(), 2).unwrap();
        assert_eq!(removed.len(), 1);
        assert!(!step_dir(d.path(), 2).exists());
        assert!(step_dir(d.path(), 4).exists());
    }

    #[test]
    fn resume_errors_name_the_fix() {
        let d = tempfile::tempdir().unwrap();
        let e = resolve(d.path(), "latest").unwrap_err().to_string();
        assert!(
            e.contains("checkpoint.dir") && e.contains("without --resume"),
            "{e}"
        );
        let e = resolve(d.path(), "/nonexistent/global_step_3")
            .unwrap_err()
            .to_string();
        assert!(e.contains("trainer_state.json"), "{e}");
    }
}
