//! A job's lifecycle states (QUEUED, PENDING, RUNNING, then SUCCEEDED, FAILED or STOPPED), as
//! the head records them and as `rlhf-head` prints them.

use rlhf_proto::v1 as pb;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobState {
    /// Waiting for a running job to end (`JobsConfig::max_running`).
    Queued,
    Pending,
    Running,
    Succeeded,
    Failed,
    Stopped,
}

impl JobState {
    pub fn ended(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Stopped
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "QUEUED",
            JobState::Pending => "PENDING",
            JobState::Running => "RUNNING",
            JobState::Succeeded => "SUCCEEDED",
            JobState::Failed => "FAILED",
            JobState::Stopped => "STOPPED",
        }
    }

    pub fn to_proto(self) -> pb::JobState {
        match self {
            JobState::Queued => pb::JobState::Queued,
            JobState::Pending => pb::JobState::Pending,
            JobState::Running => pb::JobState::Running,
            JobState::Succeeded => pb::JobState::Succeeded,
            JobState::Failed => pb::JobState::Failed,
            JobState::Stopped => pb::JobState::Stopped,
        }
    }
}

/// The name of a protocol job state, as `rlhf-head` prints it.
pub fn state_name(v: i32) -> &'static str {
    match pb::JobState::try_from(v) {
        Ok(pb::JobState::Queued) => "QUEUED",
        Ok(pb::JobState::Pending) => "PENDING",
        Ok(pb::JobState::Running) => "RUNNING",
        Ok(pb::JobState::Succeeded) => "SUCCEEDED",
        Ok(pb::JobState::Failed) => "FAILED",
        Ok(pb::JobState::Stopped) => "STOPPED",
        _ => "UNKNOWN",
    }
}

/// A job's state as `rlhf-head` shows it: `QUEUED (position 2)` for a queued job.
pub fn state_text(j: &pb::JobInfo) -> String {
    match j.queue_position {
        0 => state_name(j.state).to_string(),
        p => format!("{} (position {p})", state_name(j.state)),
    }
}

/// Whether a protocol job state is final.
pub fn state_ended(v: i32) -> bool {
    matches!(
        pb::JobState::try_from(v),
        Ok(pb::JobState::Succeeded | pb::JobState::Failed | pb::JobState::Stopped)
    )
}
