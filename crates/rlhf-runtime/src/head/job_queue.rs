//! The job queue and the removal of old jobs: a child of `jobs`, so it works on the manager's
//! own records. At most `max_running` drivers run; later submits wait QUEUED in submission
//! order; ended jobs go after `keep_for` or beyond the newest `keep_last`.

use std::collections::BTreeMap;

use super::{store, JobRecord, JobState, Jobs};

impl Jobs {
    /// Whether `max_running` drivers run (or are being started) already.
    pub(super) fn full(&self, jobs: &BTreeMap<String, JobRecord>) -> bool {
        let max = self.0.cfg.max_running;
        let running = jobs
            .values()
            .filter(|j| matches!(j.state, JobState::Pending | JobState::Running))
            .count();
        max > 0 && running >= max
    }

    /// Queued jobs, first submitted first.
    pub(super) fn queue(jobs: &BTreeMap<String, JobRecord>) -> Vec<&JobRecord> {
        let mut q: Vec<&JobRecord> = jobs
            .values()
            .filter(|j| j.state == JobState::Queued)
            .collect();
        q.sort_by(|a, b| (a.seq, a.submit_ms, &a.job_id).cmp(&(b.seq, b.submit_ms, &b.job_id)));
        q
    }

    /// Starts queued jobs while there is room.
    pub(super) fn start_queued(&self) {
        loop {
            let next = {
                let mut jobs = crate::lock(&self.0.jobs);
                if self.full(&jobs) {
                    return;
                }
                let Some(id) = Self::queue(&jobs).first().map(|j| j.job_id.clone()) else {
                    return;
                };
                if let Some(r) = jobs.get_mut(&id) {
                    r.state = JobState::Pending;
                }
                id
            };
            tracing::info!(job = %next, "starting the next queued job");
            if let Err(e) = self.start(&next) {
                tracing::error!(job = %next, "starting a queued job: {e}");
            }
        }
    }

    /// Removes ended jobs past `keep_for` or beyond the newest `keep_last`, with their
    /// directories (config, log, outcome).
    pub(super) fn prune(&self) {
        let now = self.0.clock.now_ms();
        let ttl_ms = i64::try_from(self.0.cfg.keep_for.as_millis()).unwrap_or(i64::MAX);
        let keep_last = self.0.cfg.keep_last;
        let gone: Vec<String> = {
            let mut jobs = crate::lock(&self.0.jobs);
            let mut ended: Vec<&JobRecord> = jobs.values().filter(|j| j.state.ended()).collect();
            ended.sort_by_key(|j| std::cmp::Reverse((j.end_ms, j.seq)));
            let gone: Vec<String> = ended
                .iter()
                .enumerate()
                .filter(|(i, j)| {
                    (keep_last > 0 && *i >= keep_last)
                        || (j.end_ms > 0 && now.saturating_sub(j.end_ms) > ttl_ms)
                })
                .map(|(_, j)| j.job_id.clone())
                .collect();
            for id in &gone {
                jobs.remove(id);
            }
            gone
        };
        for id in &gone {
            if let Some(st) = &self.0.store {
                if let Err(e) = st.delete(store::JOBS, id) {
                    tracing::warn!(job = %id, "removing an old job's record: {e}");
                }
            }
            let dir = self.job_dir(id);
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(job = %id, "removing {}: {e}", dir.display());
                }
            }
            tracing::info!(job = %id, "old job removed (--job-ttl / --jobs-kept)");
        }
    }
}
