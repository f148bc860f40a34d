//! How a job's driver ended, as data: the driver writes it to `outcome.json` in its working
//! directory when it exits, and the head reads it instead of scraping the driver's log for
//! an `error:` line (the log stays the fallback for a driver that could not write it).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, FailureKind};

/// The file the driver writes in its working directory (the job directory on the head).
pub const OUTCOME_FILE: &str = "outcome.json";

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobOutcome {
    /// `None` when the job succeeded.
    pub failure: Option<JobFailure>,
}

/// Why a job failed: the kind, where (role part and rank, when one is to blame), the
/// message the user sees, and whether running it again (e.g. `--resume latest`) may succeed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobFailure {
    pub kind: FailureKind,
    /// `actor_rollout/train`, `critic`, ...
    pub role: Option<String>,
    pub rank: Option<u32>,
    pub message: String,
    pub retryable: bool,
}

impl JobFailure {
    /// A failure of the job as a whole, or of one role rank.
    pub fn new(error: &Error, at: Option<(String, u32)>) -> Self {
        let kind = error.kind();
        let (role, rank) = match at {
            Some((r, k)) => (Some(r), Some(k)),
            None => (None, None),
        };
        Self {
            kind,
            role,
            rank,
            message: error.to_string(),
            // A job (unlike a call) also recovers from a dead role: run again from its last
            // checkpoint. Bad input, auth and internal errors need a person.
            retryable: kind.retryable() || kind == FailureKind::ActorDied,
        }
    }

    /// The first line of the message: what the job's status shows.
    pub fn summary(&self) -> &str {
        self.message.lines().next().unwrap_or_default()
    }
}

impl JobOutcome {
    /// Writes `dir/outcome.json` atomically ([`crate::durable::write_atomic`]: a reader
    /// never sees half).
    pub fn write(&self, dir: &Path) -> crate::Result<()> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| crate::Error::internal(format!("encoding {OUTCOME_FILE}: {e}")))?;
        crate::durable::write_atomic(&dir.join(OUTCOME_FILE), (text + "\n").as_bytes())
    }

    /// Reads `dir/outcome.json`; `None` when it is absent or unreadable (the driver died
    /// before writing it, or an older driver).
    pub fn read(dir: &Path) -> Option<Self> {
        let text = std::fs::read_to_string(dir.join(OUTCOME_FILE)).ok()?;
        serde_json::from_str(&text).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_keeps_the_kind_and_where() {
        let dir = std::env::temp_dir().join(format!("rlhf-outcome-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = Error::new(
            FailureKind::ActorDied,
            "role critic rank 0 died (actor a1): signal 9\nlast log lines:\n  x",
        );
        let f = JobFailure::new(&e, Some(("critic".into(), 0)));
        assert!(f.retryable, "a dead actor is worth a restart");
        assert_eq!(f.summary(), "role critic rank 0 died (actor a1): signal 9");
        let o = JobOutcome { failure: Some(f) };
        o.write(&dir).unwrap();
        assert_eq!(JobOutcome::read(&dir), Some(o));
        let text = std::fs::read_to_string(dir.join(OUTCOME_FILE)).unwrap();
        assert!(text.contains("\"kind\": \"actor_died\""), "{text}");
        let bad = JobFailure::new(&Error::invalid("actor_rollout.ppo_epoch is unknown"), None);
        assert!(!bad.retryable && bad.role.is_none());
        std::fs::write(dir.join(OUTCOME_FILE), "{not json").unwrap();
        assert_eq!(JobOutcome::read(&dir), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
