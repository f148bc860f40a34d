//! Submitted PPO jobs. The head runs each job as a driver process
//! (`<exe> run --address HEAD --bundle FILE --job-id ID`) in its own process group, with
//! the cluster token in the environment, its output in `<state-dir>/jobs/<id>/driver.log`,
//! and records every state change (PENDING → RUNNING → SUCCEEDED | FAILED | STOPPED) in the
//! state database, so `rlhf-head job ...` works across head restarts.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::Signal;
use rlhf_core::{Error, JobFailure, JobOutcome, Result};
use rlhf_proto::v1 as pb;
use serde::{Deserialize, Serialize};

use super::store::{self, Store};
use crate::clock::Clock;

/// File names inside a job's directory.
pub const CONFIG_FILE: &str = "config.yaml";
pub const LOG_FILE: &str = "driver.log";
/// A driver may write (or link) its metrics here; `job status` shows the last line.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// Most log bytes one JobLogs call returns.
const DEFAULT_LOG_CHUNK: u64 = 1024 * 1024;
/// How far back from the end of driver.log the last `error:` line is looked for.
const ERROR_SCAN_BYTES: u64 = 64 * 1024;
/// Recent ids listed when a job id is unknown.
const RECENT_IDS: usize = 5;

use super::job_driver::{driver_alive, new_job_id, signal_group};
pub use super::job_driver::{fmt_utc_ms, last_error_line};
pub(crate) use super::job_driver::{last_nonempty_line, read_tail};
pub use super::job_state::{state_ended, state_name, state_text, JobState};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobRecord {
    pub job_id: String,
    pub state: JobState,
    pub config_name: String,
    pub overrides: Vec<String>,
    pub submit_ms: i64,
    pub start_ms: i64,
    pub end_ms: i64,
    pub exit_code: Option<i32>,
    pub signal: i32,
    pub error: String,
    pub pid: i32,
    pub metrics_file: String,
    /// The config's `logging.samples_file` (the dashboard's sample table).
    #[serde(default)]
    pub samples_file: String,
    /// Why a stop was asked for (empty: none); the job ends STOPPED with this reason.
    pub stop_reason: String,
    /// How a failed job failed, as its driver recorded it (`outcome.json`).
    #[serde(default)]
    pub failure: Option<JobFailure>,
    /// Submission order (the queue's), increasing across head restarts.
    #[serde(default)]
    pub seq: u64,
}

/// A file path the submitter named, if it is a JSONL file: only JSONL files' JSON records
/// are shown, so `job status` and the dashboard cannot be used to read the tail of other
/// files on the head.
fn submitted_jsonl(path: &str) -> Option<PathBuf> {
    let p = PathBuf::from(path);
    p.extension().is_some_and(|e| e == "jsonl").then_some(p)
}

/// How the head runs drivers.
#[derive(Debug, Clone)]
pub struct JobsConfig {
    pub state_dir: PathBuf,
    /// The driver executable, run as `<exe> run --address ... --bundle ... --job-id ...`.
    pub exe: PathBuf,
    /// The head address the driver connects to.
    pub head_address: String,
    /// CA for a head that serves TLS (passed as `--tls-ca`).
    pub tls_ca: Option<PathBuf>,
    pub token: String,
    /// Between SIGTERM and SIGKILL when a job is stopped.
    pub stop_grace: Duration,
    /// Jobs whose drivers run at once; later submits wait QUEUED, first in first out
    /// (0 = no limit).
    pub max_running: usize,
    /// Ended jobs are removed (record, directory and log) this long after they ended...
    pub keep_for: Duration,
    /// ...or once this many newer jobs have ended (0 = no count limit).
    pub keep_last: usize,
}

/// `JobsConfig::keep_for` by default: a week.
pub const DEFAULT_JOB_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// `JobsConfig::keep_last` by default.
pub const DEFAULT_JOBS_KEPT: usize = 1000;

struct Inner {
    cfg: JobsConfig,
    store: Option<Store>,
    clock: Arc<dyn Clock>,
    jobs: Mutex<BTreeMap<String, JobRecord>>,
    /// Bumped on every state change; waiters watch it.
    changed: tokio::sync::watch::Sender<u64>,
}

/// The head's job manager. Cheap to clone.
#[derive(Clone)]
pub struct Jobs(Arc<Inner>);

impl Jobs {
    /// Loads recorded jobs. A job recorded PENDING or RUNNING whose driver is gone failed
    /// with the head; one whose driver still runs is watched until it ends.
    pub fn open(cfg: JobsConfig, store: Option<Store>, clock: Arc<dyn Clock>) -> Result<Jobs> {
        let mut jobs = BTreeMap::new();
        if let Some(st) = &store {
            for j in st.load::<JobRecord>(store::JOBS)? {
                jobs.insert(j.job_id.clone(), j);
            }
        }
        let (changed, _) = tokio::sync::watch::channel(0);
        let me = Jobs(Arc::new(Inner {
            cfg,
            store,
            clock,
            jobs: Mutex::new(jobs),
            changed,
        }));
        let unfinished: Vec<JobRecord> = me
            .snapshot()
            .into_iter()
            .filter(|j| !j.state.ended() && j.state != JobState::Queued)
            .collect();
        for j in unfinished {
            if driver_alive(j.pid, &j.job_id) {
                tracing::info!(job = %j.job_id, pid = j.pid, "driver outlived a head restart; watching it");
                me.watch_orphan(j.job_id.clone(), j.pid);
            } else {
                let now = me.0.clock.now_ms();
                me.update(&j.job_id, |r| {
                    r.state = JobState::Failed;
                    r.end_ms = now;
                    r.error = "head restarted".into();
                })?;
            }
        }
        me.prune();
        me.start_queued();
        Ok(me)
    }

    fn snapshot(&self) -> Vec<JobRecord> {
        crate::lock(&self.0.jobs).values().cloned().collect()
    }

    fn persist(&self, r: &JobRecord) -> Result<()> {
        match &self.0.store {
            Some(st) => st.put(store::JOBS, &r.job_id, r),
            None => Ok(()),
        }
    }

    /// Applies `f` to a job's record, persists it and wakes waiters.
    fn update(&self, id: &str, f: impl FnOnce(&mut JobRecord)) -> Result<JobRecord> {
        let rec = {
            let mut jobs = crate::lock(&self.0.jobs);
            let r = jobs
                .get_mut(id)
                .ok_or_else(|| Error::not_found(format!("no job {id}")))?;
            f(r);
            r.clone()
        };
        self.persist(&rec)?;
        self.0.changed.send_modify(|v| *v += 1);
        Ok(rec)
    }

    pub fn job_dir(&self, id: &str) -> PathBuf {
        self.0.cfg.state_dir.join("jobs").join(id)
    }

    fn not_found(&self, id: &str) -> Error {
        let jobs = crate::lock(&self.0.jobs);
        let mut recent: Vec<&JobRecord> = jobs.values().collect();
        recent.sort_by_key(|j| std::cmp::Reverse(j.submit_ms));
        let ids: Vec<&str> = recent
            .iter()
            .take(RECENT_IDS)
            .map(|j| j.job_id.as_str())
            .collect();
        if ids.is_empty() {
            Error::not_found(format!(
                "no job '{id}': this head has no jobs; submit one with `rlhf-head submit`"
            ))
        } else {
            Error::not_found(format!(
                "no job '{id}'; recent jobs: {} (all: `rlhf-head job list`)",
                ids.join(", ")
            ))
        }
    }

    pub fn get(&self, id: &str) -> Result<JobRecord> {
        let found = crate::lock(&self.0.jobs).get(id).cloned();
        found.ok_or_else(|| self.not_found(id))
    }

    /// Every job, oldest first.
    pub fn list(&self) -> Vec<JobRecord> {
        let mut v = self.snapshot();
        v.sort_by(|a, b| (a.submit_ms, &a.job_id).cmp(&(b.submit_ms, &b.job_id)));
        v
    }

    /// Records the job, writes its config and starts its driver.
    pub fn submit(&self, req: pb::SubmitJobRequest) -> Result<JobRecord> {
        if req.bundle.trim().is_empty() {
            return Err(Error::invalid(
                "SubmitJob needs a config bundle; use `rlhf-head submit --config-name NAME`",
            ));
        }
        let now = self.0.clock.now_ms();
        let id = loop {
            let id = new_job_id(now);
            if !crate::lock(&self.0.jobs).contains_key(&id) {
                break id;
            }
        };
        let dir = self.job_dir(&id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::io(format!("creating job directory {}", dir.display()), e))?;
        let config = dir.join(CONFIG_FILE);
        std::fs::write(&config, &req.bundle)
            .map_err(|e| Error::io(format!("writing {}", config.display()), e))?;
        let mut rec = JobRecord {
            job_id: id.clone(),
            state: JobState::Pending,
            config_name: req.config_name,
            overrides: req.overrides,
            submit_ms: now,
            start_ms: 0,
            end_ms: 0,
            exit_code: None,
            signal: 0,
            error: String::new(),
            pid: 0,
            metrics_file: req.metrics_file,
            samples_file: req.samples_file,
            stop_reason: String::new(),
            failure: None,
            seq: 0,
        };
        {
            // Decided under the lock, so two submits cannot both take the last slot.
            let mut jobs = crate::lock(&self.0.jobs);
            rec.seq = jobs.values().map(|j| j.seq).max().unwrap_or(0) + 1;
            if self.full(&jobs) {
                rec.state = JobState::Queued;
            }
            jobs.insert(id.clone(), rec.clone());
        }
        self.persist(&rec)?;
        tracing::info!(job = %id, config = %rec.config_name, state = rec.state.as_str(), "job submitted");
        if rec.state == JobState::Queued {
            self.0.changed.send_modify(|v| *v += 1);
            return Ok(rec);
        }
        self.start(&id)
    }

    /// Starts the driver of a PENDING job: RUNNING, or FAILED when it cannot start.
    fn start(&self, id: &str) -> Result<JobRecord> {
        let id = id.to_string();
        let dir = self.job_dir(&id);
        let config = dir.join(CONFIG_FILE);
        match self.spawn_driver(&id, &dir, &config) {
            Ok(child) => {
                let pid = child.id().map(|p| p as i32).unwrap_or(0);
                let now = self.0.clock.now_ms();
                let rec = self.update(&id, |r| {
                    r.state = JobState::Running;
                    r.pid = pid;
                    r.start_ms = now;
                })?;
                tracing::info!(job = %id, pid, "driver started");
                // A stop that came while the driver was being started.
                if !rec.stop_reason.is_empty() {
                    signal_group(pid, Signal::SIGTERM);
                }
                self.reap(id, child);
                Ok(rec)
            }
            Err(e) => {
                let now = self.0.clock.now_ms();
                tracing::error!(job = %id, "driver did not start: {e}");
                let rec = self.update(&id, |r| {
                    r.state = JobState::Failed;
                    r.end_ms = now;
                    r.error = e.to_string();
                });
                self.start_queued();
                rec
            }
        }
    }

    fn spawn_driver(&self, id: &str, dir: &Path, config: &Path) -> Result<tokio::process::Child> {
        let log_path = dir.join(LOG_FILE);
        let log = std::fs::File::create(&log_path)
            .map_err(|e| Error::io(format!("creating {}", log_path.display()), e))?;
        let log2 = log
            .try_clone()
            .map_err(|e| Error::io(format!("opening {}", log_path.display()), e))?;
        let cfg = &self.0.cfg;
        let mut cmd = tokio::process::Command::new(&cfg.exe);
        cmd.arg("run")
            .arg("--address")
            .arg(&cfg.head_address)
            .arg("--bundle")
            .arg(config)
            .arg("--job-id")
            .arg(id);
        if let Some(ca) = &cfg.tls_ca {
            cmd.arg("--tls-ca").arg(ca);
        }
        // The token goes in the environment: a command line is visible to every user.
        cmd.env(crate::auth::TOKEN_ENV, &cfg.token)
            .current_dir(dir)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log2)
            // Its own group, so a stop reaches everything the driver started.
            .process_group(0)
            .kill_on_drop(false);
        cmd.spawn().map_err(|e| {
            Error::invalid(format!(
                "cannot start the job driver {}: {e}",
                cfg.exe.display()
            ))
        })
    }

    /// Waits for a driver this head started and records how it ended.
    fn reap(&self, id: String, mut child: tokio::process::Child) {
        let me = self.clone();
        tokio::spawn(async move {
            let status = child.wait().await;
            let (code, sig) = match &status {
                Ok(s) => (s.code(), s.signal().unwrap_or(0)),
                Err(e) => {
                    tracing::error!(job = %id, "waiting for the driver: {e}");
                    (None, 0)
                }
            };
            me.finish(&id, code, sig);
        });
    }

    /// Polls a driver this head did not start (it outlived a head restart) until it exits.
    /// Its exit status cannot be known; the log's last `error:` line decides.
    fn watch_orphan(&self, id: String, pid: i32) {
        let me = self.clone();
        tokio::spawn(async move {
            while driver_alive(pid, &id) {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            me.finish(&id, None, 0);
        });
    }

    fn finish(&self, id: &str, code: Option<i32>, sig: i32) {
        let now = self.0.clock.now_ms();
        let log = read_tail(&self.job_dir(id).join(LOG_FILE), ERROR_SCAN_BYTES);
        let err_line = last_error_line(&log);
        // What the driver recorded beats what its log says; the log is the fallback for a
        // driver that died before writing it.
        let outcome = JobOutcome::read(&self.job_dir(id));
        // A driver this head did not start (it outlived a head restart) has no exit status
        // here; the outcome it recorded says whether it succeeded.
        let recorded_success =
            code.is_none() && sig == 0 && outcome.as_ref().is_some_and(|o| o.failure.is_none());
        let failure = outcome.and_then(|o| o.failure);
        let res = self.update(id, |r| {
            r.end_ms = now;
            r.exit_code = code;
            r.signal = sig;
            if !r.stop_reason.is_empty() {
                r.state = JobState::Stopped;
                r.error = r.stop_reason.clone();
            } else if code == Some(0) || recorded_success {
                r.state = JobState::Succeeded;
            } else {
                r.state = JobState::Failed;
                r.failure = failure.clone();
                r.error = match (failure.as_ref().map(|f| f.summary().to_string()).or(err_line), code) {
                    (Some(e), _) => e,
                    (None, Some(c)) => format!("driver exited with code {c} (see {LOG_FILE})"),
                    (None, None) if sig != 0 => {
                        format!("driver killed by signal {sig} (see {LOG_FILE})")
                    }
                    (None, None) => format!(
                        "driver ended while the head was restarting; its exit status is unknown (see {LOG_FILE})"
                    ),
                };
            }
        });
        match res {
            Ok(r) => {
                tracing::info!(job = %id, state = r.state.as_str(), code = ?code, signal = sig, "job ended: {}", r.error)
            }
            Err(e) => tracing::error!(job = %id, "recording the job's end: {e}"),
        }
        self.prune();
        self.start_queued();
    }

    /// Asks a job to stop: SIGTERM to its driver's process group, SIGKILL after the grace
    /// period. Returns at once; the job turns STOPPED when its driver has exited.
    pub fn stop(&self, id: &str, reason: &str) -> Result<JobRecord> {
        let rec = self.get(id)?;
        if rec.state.ended() {
            return Ok(rec);
        }
        if rec.state == JobState::Queued {
            // Leaves the queue; nothing was started.
            let now = self.0.clock.now_ms();
            tracing::info!(job = %id, "queued job removed: {reason}");
            return self.update(id, |r| {
                if r.state == JobState::Queued {
                    r.state = JobState::Stopped;
                    r.end_ms = now;
                    r.stop_reason = reason.to_string();
                    r.error = reason.to_string();
                }
            });
        }
        let rec = self.update(id, |r| {
            if r.stop_reason.is_empty() {
                r.stop_reason = reason.to_string();
            }
        })?;
        tracing::info!(job = %id, pid = rec.pid, "stopping job: {reason}");
        signal_group(rec.pid, Signal::SIGTERM);
        let me = self.clone();
        let id = id.to_string();
        let grace = self.0.cfg.stop_grace;
        tokio::spawn(async move {
            if !me.wait_ended(&id, grace).await {
                tracing::warn!(job = %id, "driver ignored SIGTERM for {grace:?}; sending SIGKILL");
                signal_group(rec.pid, Signal::SIGKILL);
            }
        });
        Ok(rec)
    }

    /// Waits until the job has ended or `timeout` passes; true when it ended.
    pub async fn wait_ended(&self, id: &str, timeout: Duration) -> bool {
        let mut rx = self.0.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.get(id).map(|r| r.state.ended()).unwrap_or(true) {
                return true;
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return self.get(id).map(|r| r.state.ended()).unwrap_or(true),
            }
        }
    }

    /// Stops every unfinished job (the head is shutting down) and waits for them to end.
    pub async fn shutdown(&self) {
        let running: Vec<String> = self
            .snapshot()
            .into_iter()
            .filter(|j| !j.state.ended())
            .map(|j| j.job_id)
            .collect();
        for id in &running {
            let _ = self.stop(id, "the head shut down");
        }
        let grace = self.0.cfg.stop_grace + Duration::from_secs(2);
        for id in &running {
            self.wait_ended(id, grace).await;
        }
    }
}

#[path = "job_queue.rs"]
mod queue;
#[path = "job_view.rs"]
mod view;

#[cfg(test)]
#[path = "jobs_tests.rs"]
mod tests;
