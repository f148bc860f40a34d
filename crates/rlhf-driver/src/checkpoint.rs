//! Checkpoint layout and the trainer-state file.
//!
//! ```text
//! <checkpoint.dir>/
//!   latest_checkpointed_iteration.txt     N of the newest complete checkpoint
//!   global_step_N/
//!     actor/        HF model dir + optimizer.safetensors + role_state.json
//!     critic/       same, with the value head (when the estimator uses a critic)
//!     checkpoint.hmac      the signature of trainer_state.json (rlhf_core::seal)
//!     trainer_state.json   step, data cursor, KL controller, seeds, the digest of every
//!                          manifest below (written last)
//! ```
//! A checkpoint counts only once `trainer_state.json` exists, so a crash while saving
//! leaves the previous one as `latest`. A resume checks the signature with the run's
//! checkpoint key unless told to trust the directory (`--trust-checkpoint`).

use std::path::{Path, PathBuf};

use rlhf_algo::KlController;
use rlhf_config::data::DataCursor;
use rlhf_core::seal::{self, CheckpointKey};
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
    /// SHA-256 of every manifest below the step directory, by relative path: what the
    /// signature binds besides this file.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub manifests: std::collections::BTreeMap<String, String>,
}

/// How a resume treats the checkpoint's signature.
#[derive(Debug, Clone, Copy)]
pub enum Seal<'a> {
    /// Refuse a checkpoint not signed with this key.
    Verify(&'a CheckpointKey),
    /// `--trust-checkpoint`: load it unsigned; the manifests still catch accidents.
    Trust,
}

/// Largest trainer state read.
const MAX_STATE_BYTES: u64 = 256 << 20;

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
            manifests: Default::default(),
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

/// Records the digest of every manifest the role directories were published with, signs the
/// state with `key`, writes the signature and then the state file (atomically, fsynced), and
/// then moves `latest` to this step.
pub fn commit(root: &Path, state: &TrainerState, key: &CheckpointKey) -> Result<PathBuf> {
    let dir = step_dir(root, state.global_step);
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let mut state = state.clone();
    state.manifests = seal::manifest_digests(&dir)?;
    let text = serde_json::to_string_pretty(&state)
        .map_err(|e| Error::internal(format!("serializing trainer state: {e}")))?;
    seal::sign(&dir, text.as_bytes(), key)?;
    durable::write_atomic(&dir.join(STATE_FILE), text.as_bytes())?;
    durable::write_atomic(
        &root.join(LATEST_FILE),
        format!("{}\n", state.global_step).as_bytes(),
    )?;
    Ok(dir)
}

/// Removes the state file and the signature of a step directory about to be saved again.
pub fn uncommit(dir: &Path) -> Result<()> {
    for f in [STATE_FILE, seal::MAC_FILE] {
        match std::fs::remove_file(dir.join(f)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("removing {}", dir.join(f).display()), e)),
        }
    }
    Ok(())
}

/// The parts (role directories) of a committed step whose manifest the signature does not
/// cover because this process cannot see it.
pub fn parts_without_manifest(dir: &Path, parts: &[&str]) -> Vec<String> {
    parts
        .iter()
        .filter(|p| !dir.join(p).join(durable::MANIFEST_FILE).is_file())
        .map(|p| p.to_string())
        .collect()
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
/// a `global_step_N` directory, and checks its signature as `seal` says.
pub fn resolve(root: &Path, spec: &str, seal: Seal<'_>) -> Result<(PathBuf, TrainerState)> {
    let dir = if spec == "latest" {
        let latest = root.join(LATEST_FILE);
        let step = durable::read_regular(&latest, 64)
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
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
    let text = durable::read_regular(&state_path, MAX_STATE_BYTES).map_err(|_| {
        Error::invalid(format!(
            "--resume {spec}: {} not found; pass `latest` or a global_step_N directory under checkpoint.dir",
            state_path.display()
        ))
    })?;
    if let Seal::Verify(key) = seal {
        seal::verify(&dir, STATE_FILE, &text, key)?;
    }
    let state: TrainerState = serde_json::from_slice(&text)
        .map_err(|e| Error::invalid(format!("{}: {e}", state_path.display())))?;
    if state.format != FORMAT {
        return Err(Error::invalid(format!(
            "{}: trainer state format {} is not supported (expected {FORMAT})",
            state_path.display(),
            state.format
        )));
    }
    if let Seal::Verify(_) = seal {
        seal::check_manifests(&dir, &state.manifests)?;
    }
    Ok((dir, state))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> CheckpointKey {
        CheckpointKey::from_secret(b"cluster token", "the cluster token")
    }

    fn state(step: u64) -> TrainerState {
        let mut s = TrainerState::new("ppo", step, DataCursor::default(), 7, "job");
        s.kl_ctl = Some(KlController::Fixed { value: 0.1 });
        s
    }

    #[test]
    fn commit_list_prune_and_resolve() {
        let d = tempfile::tempdir().unwrap();
        for s in [2, 4, 6] {
            commit(d.path(), &state(s), &key()).unwrap();
        }
        // An incomplete save (no state file) never counts.
        std::fs::create_dir_all(step_dir(d.path(), 8).join("actor")).unwrap();
        assert_eq!(
            list(d.path()).iter().map(|(n, _)| *n).collect::<Vec<_>>(),
            vec![2, 4, 6]
        );
        let (dir, st) = resolve(d.path(), "latest", Seal::Verify(&key())).unwrap();
        assert_eq!(st.global_step, 6);
        assert_eq!(st.kl_ctl, Some(KlController::Fixed { value: 0.1 }));
        assert!(dir.ends_with("global_step_6"));
        // An algorithm without a KL controller writes none, and reads back none.
        let mut bare = state(7);
        bare.kl_ctl = None;
        let json = serde_json::to_string(&bare).unwrap();
        assert!(!json.contains("kl_ctl"), "{json}");
        assert_eq!(serde_json::from_str::<TrainerState>(&json).unwrap(), bare);
        assert!(!json.contains("manifests"), "{json}");
        // A state from before the algorithm was recorded is PPO's.
        let old = json.replace("\"algorithm\":\"ppo\",", "");
        assert!(!old.contains("algorithm"), "{old}");
        assert_eq!(serde_json::from_str::<TrainerState>(&old).unwrap(), bare);
        let (_, st) = resolve(
            d.path(),
            step_dir(d.path(), 4).to_str().unwrap(),
            Seal::Verify(&key()),
        )
        .unwrap();
        assert_eq!(st.global_step, 4);
        let removed = prune(d.path(), 2).unwrap();
        assert_eq!(removed.len(), 1);
        assert!(!step_dir(d.path(), 2).exists());
        assert!(step_dir(d.path(), 4).exists());
    }

    #[test]
    fn resume_errors_name_the_fix() {
        let d = tempfile::tempdir().unwrap();
        let e = resolve(d.path(), "latest", Seal::Trust)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("checkpoint.dir") && e.contains("without --resume"),
            "{e}"
        );
        let e = resolve(d.path(), "/nonexistent/global_step_3", Seal::Trust)
            .unwrap_err()
            .to_string();
        assert!(e.contains("trainer_state.json"), "{e}");
    }

    #[test]
    fn a_tampered_or_foreign_checkpoint_is_refused_unless_trusted() {
        let d = tempfile::tempdir().unwrap();
        let dir = step_dir(d.path(), 3);
        let part = dir.join("actor");
        std::fs::create_dir_all(durable::staging_dir(&part)).unwrap();
        std::fs::write(
            durable::staging_dir(&part).join("model.safetensors"),
            [1u8; 64],
        )
        .unwrap();
        durable::publish_dir(&part).unwrap();
        commit(d.path(), &state(3), &key()).unwrap();
        let (_, st) = resolve(d.path(), "latest", Seal::Verify(&key())).unwrap();
        assert_eq!(st.manifests.len(), 1, "{:?}", st.manifests);

        // Another cluster's key: refused, naming the way out.
        let other = CheckpointKey::from_secret(b"another token", "key file k");
        let e = resolve(d.path(), "latest", Seal::Verify(&other))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("another checkpoint key") && e.contains("--trust-checkpoint"),
            "{e}"
        );

        // The step moved forward by hand: the signature no longer matches.
        let path = dir.join(STATE_FILE);
        let good = std::fs::read_to_string(&path).unwrap();
        std::fs::write(
            &path,
            good.replace("\"global_step\": 3", "\"global_step\": 30"),
        )
        .unwrap();
        let e = resolve(d.path(), "latest", Seal::Verify(&key()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("changed after it was signed"), "{e}");
        let (_, st) = resolve(d.path(), "latest", Seal::Trust).unwrap();
        assert_eq!(st.global_step, 30, "trusted as it is");
        std::fs::write(&path, &good).unwrap();

        // Weights replaced and their manifest rewritten to match (what a writer of the
        // directory can do without the key): the manifest's digest gives it away.
        std::fs::write(part.join("model.safetensors"), [2u8; 64]).unwrap();
        std::fs::remove_file(part.join(durable::MANIFEST_FILE)).unwrap();
        let m = durable::Manifest::of_dir(&part).unwrap();
        std::fs::write(
            part.join(durable::MANIFEST_FILE),
            serde_json::to_string(&m).unwrap(),
        )
        .unwrap();
        durable::Manifest::verify(&part).unwrap();
        let e = resolve(d.path(), "latest", Seal::Verify(&key()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("actor/manifest.json changed after the checkpoint was signed"),
            "{e}"
        );

        // Signature removed: unsigned, refused unless trusted.
        std::fs::remove_file(dir.join(seal::MAC_FILE)).unwrap();
        let e = resolve(d.path(), "latest", Seal::Verify(&key()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("is not signed"), "{e}");
        resolve(d.path(), "latest", Seal::Trust).unwrap();
    }
}
