//! What the head tells about a job: its record as the wire's `JobInfo` (with its queue
//! position and the last line of its metrics), its files for the dashboard, and its
//! driver's log from an offset.

use std::io::{Read, Seek, SeekFrom};

use rlhf_core::{Error, Result};
use rlhf_proto::v1 as pb;

use super::{
    last_nonempty_line, submitted_jsonl, JobRecord, JobState, Jobs, DEFAULT_LOG_CHUNK, LOG_FILE,
    METRICS_FILE,
};

impl Jobs {
    pub fn to_proto(&self, r: &JobRecord) -> pb::JobInfo {
        let dir = self.job_dir(&r.job_id);
        let queue_position = if r.state == JobState::Queued {
            let jobs = crate::lock(&self.0.jobs);
            Self::queue(&jobs)
                .iter()
                .position(|j| j.job_id == r.job_id)
                .map_or(0, |p| p as u32 + 1)
        } else {
            0
        };
        pb::JobInfo {
            queue_position,
            job_id: r.job_id.clone(),
            state: r.state.to_proto() as i32,
            config_name: r.config_name.clone(),
            overrides: r.overrides.clone(),
            submit_ms: r.submit_ms,
            start_ms: r.start_ms,
            end_ms: r.end_ms,
            has_exit_code: r.exit_code.is_some(),
            exit_code: r.exit_code.unwrap_or(0),
            signal: r.signal,
            error: r.error.clone(),
            pid: r.pid,
            log_file: dir.join(LOG_FILE).display().to_string(),
            job_dir: dir.display().to_string(),
            last_metrics: String::new(),
            failure_kind: r
                .failure
                .as_ref()
                .map(|f| f.kind.as_str().to_string())
                .unwrap_or_default(),
            failure_role: r
                .failure
                .as_ref()
                .and_then(|f| f.role.clone())
                .unwrap_or_default(),
            failure_rank: r
                .failure
                .as_ref()
                .and_then(|f| f.rank)
                .map_or(-1, |k| k as i32),
            retryable: r.failure.as_ref().is_some_and(|f| f.retryable),
        }
    }

    /// The metrics and samples files of a job, for the dashboard. As for `job status`, only
    /// JSONL files are named (the paths come from the submitter).
    pub fn files(&self, id: &str) -> Option<crate::dashboard::JobFiles> {
        let r = self.get(id).ok()?;
        let in_dir = self.job_dir(id).join(METRICS_FILE);
        let metrics = if in_dir.exists() {
            Some(in_dir)
        } else {
            submitted_jsonl(&r.metrics_file)
        };
        Some(crate::dashboard::JobFiles {
            metrics,
            samples: submitted_jsonl(&r.samples_file),
        })
    }

    /// The job with the last line of its metrics: `<job dir>/metrics.jsonl` if the driver
    /// wrote one, else the config's `logging.metrics_file`.
    pub fn info_with_metrics(&self, id: &str) -> Result<pb::JobInfo> {
        let r = self.get(id)?;
        let mut info = self.to_proto(&r);
        let mut candidates = vec![self.job_dir(id).join(METRICS_FILE)];
        candidates.extend(submitted_jsonl(&r.metrics_file));
        info.last_metrics = candidates
            .iter()
            .find_map(|p| last_nonempty_line(p))
            .filter(|l| serde_json::from_str::<serde_json::Value>(l).is_ok_and(|v| v.is_object()))
            .unwrap_or_default();
        Ok(info)
    }

    /// Bytes of driver.log from `offset`.
    pub fn logs(&self, id: &str, offset: u64, max_bytes: u64) -> Result<pb::JobLogsResponse> {
        let rec = self.get(id)?;
        let path = self.job_dir(id).join(LOG_FILE);
        let max = if max_bytes == 0 {
            DEFAULT_LOG_CHUNK
        } else {
            max_bytes.min(DEFAULT_LOG_CHUNK * 16)
        };
        let (data, len) = match std::fs::File::open(&path) {
            Ok(mut f) => {
                let len = f
                    .metadata()
                    .map_err(|e| Error::io(format!("reading {}", path.display()), e))?
                    .len();
                let start = offset.min(len);
                f.seek(SeekFrom::Start(start))
                    .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
                let mut buf = Vec::new();
                f.take(max)
                    .read_to_end(&mut buf)
                    .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
                (buf, len)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (Vec::new(), 0),
            Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
        };
        let next = offset.min(len) + data.len() as u64;
        Ok(pb::JobLogsResponse {
            finished: rec.state.ended() && next >= len,
            next_offset: next,
            data,
            state: rec.state.to_proto() as i32,
        })
    }
}
