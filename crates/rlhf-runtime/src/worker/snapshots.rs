//! The worker's side of `checkpoint.memory_snapshot`: checkpoint directories that role
//! processes of a job (on other nodes, usually) push here after writing them to disk, held in
//! memory so that a restart of that job loads them without reading the checkpoint storage.
//!
//! Per job, the snapshots of each step are kept until the driver commits a newer step (the
//! same rule as `latest` on disk: the previous checkpoint stays until the next is whole),
//! and all of them go when the job ends. The total is bounded by `--snapshot-memory-gb`: a
//! push that does not fit first evicts other jobs' snapshots, least recently written first
//! (they are on disk too; a job whose driver died without dropping its own is the usual
//! case), and is refused with the flag's name when it still does not fit.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use rlhf_core::{Error, FailureKind, Result};
use rlhf_proto::v1 as pb;

use crate::snapshot::Files;

/// The snapshots this worker holds.
pub struct Store {
    cap: u64,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    jobs: HashMap<String, Job>,
    used: u64,
    /// Bumped by every write; a job's `touched` is its last value.
    clock: u64,
}

#[derive(Default)]
struct Job {
    committed: Option<u64>,
    steps: BTreeMap<u64, BTreeMap<String, Arc<Files>>>,
    touched: u64,
}

impl Job {
    fn bytes(&self) -> u64 {
        self.steps
            .values()
            .flat_map(|parts| parts.values())
            .map(|f| f.bytes())
            .sum()
    }
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

impl Store {
    /// A store holding at most `cap` bytes.
    pub fn new(cap: u64) -> Self {
        Self {
            cap,
            inner: Mutex::new(Inner::default()),
        }
    }

    pub fn used(&self) -> u64 {
        crate::lock(&self.inner).used
    }

    /// Whether `bytes` more for `job` can fit once other jobs' snapshots are evicted; the
    /// early answer to a push's first chunk, before its data travels.
    pub fn admit(&self, job: &str, bytes: u64) -> Result<()> {
        let inner = crate::lock(&self.inner);
        let own = inner.jobs.get(job).map_or(0, Job::bytes);
        if own.saturating_add(bytes) > self.cap {
            return Err(self.full(job, own, bytes));
        }
        Ok(())
    }

    fn full(&self, job: &str, own: u64, bytes: u64) -> Error {
        Error::new(
            FailureKind::InsufficientResources,
            format!(
                "this worker holds snapshots in at most {} of memory (rlhf-worker --snapshot-memory-gb); job {job} holds {} and the new snapshot needs {}; raise the flag or set checkpoint.memory_snapshot=false",
                gib(self.cap),
                gib(own),
                gib(bytes)
            ),
        )
    }

    /// Stores `files` under `key`, replacing what the same key held.
    pub fn insert(&self, key: &pb::SnapshotKey, files: Files) -> Result<u64> {
        let bytes = files.bytes();
        let mut inner = crate::lock(&self.inner);
        let inner = &mut *inner;
        let old = inner
            .jobs
            .get(&key.job_id)
            .and_then(|j| j.steps.get(&key.step))
            .and_then(|p| p.get(&key.part))
            .map_or(0, |f| f.bytes());
        let own = inner.jobs.get(&key.job_id).map_or(0, Job::bytes) - old;
        if own.saturating_add(bytes) > self.cap {
            // Evicting other jobs would not make room: refuse before touching them.
            return Err(self.full(&key.job_id, own, bytes));
        }
        while inner.used - old + bytes > self.cap {
            // The least recently written other job goes first.
            let victim = inner
                .jobs
                .iter()
                .filter(|(id, _)| **id != key.job_id)
                .min_by_key(|(_, j)| j.touched)
                .map(|(id, _)| id.clone());
            let Some(victim) = victim else {
                return Err(self.full(&key.job_id, own, bytes));
            };
            if let Some(j) = inner.jobs.remove(&victim) {
                let freed = j.bytes();
                inner.used -= freed;
                tracing::warn!(job = %victim, freed, "snapshot memory full: dropped another job's snapshots (its checkpoints are on disk)");
            }
        }
        inner.clock += 1;
        let job = inner.jobs.entry(key.job_id.clone()).or_default();
        job.touched = inner.clock;
        job.steps
            .entry(key.step)
            .or_default()
            .insert(key.part.clone(), Arc::new(files));
        inner.used = inner.used - old + bytes;
        Ok(bytes)
    }

    /// PutSnapshot: takes the stream's directory (refused at its first chunk, before the
    /// data travels, when it cannot fit) and stores it; returns its bytes.
    pub async fn receive(&self, mut stream: tonic::Streaming<pb::SnapshotChunk>) -> Result<u64> {
        let mut asm = crate::snapshot::Assembler::new();
        while let Some(chunk) = stream.message().await? {
            if let Some((key, total)) = asm.push(chunk)? {
                self.admit(&key.job_id, total)?;
            }
        }
        let (key, files) = asm.finish()?;
        let bytes = self.insert(&key, files)?;
        tracing::info!(job = %key.job_id, step = key.step, part = %key.part, bytes, held = self.used(), "snapshot stored");
        Ok(bytes)
    }

    /// GetSnapshot: the snapshot `key` as chunks, views of the held bytes (nothing copied).
    pub fn chunks(&self, key: pb::SnapshotKey) -> Result<Vec<pb::SnapshotChunk>> {
        crate::snapshot::check_key(&key)?;
        let files = self.get(&key)?;
        Ok(crate::snapshot::chunks(key, &files))
    }

    /// The snapshot `key`, when held.
    pub fn get(&self, key: &pb::SnapshotKey) -> Result<Arc<Files>> {
        let inner = crate::lock(&self.inner);
        let job = inner.jobs.get(&key.job_id).ok_or_else(|| {
            Error::not_found(format!(
                "this worker holds no snapshot of job {}",
                key.job_id
            ))
        })?;
        job.steps
            .get(&key.step)
            .and_then(|p| p.get(&key.part))
            .cloned()
            .ok_or_else(|| {
                Error::not_found(format!(
                    "this worker holds no snapshot of {} at step {} of job {} (it holds steps {:?})",
                    key.part,
                    key.step,
                    key.job_id,
                    job.steps.keys().collect::<Vec<_>>()
                ))
            })
    }

    /// `step` is the job's newest complete checkpoint: older snapshots go.
    pub fn commit(&self, job_id: &str, step: u64) {
        let mut inner = crate::lock(&self.inner);
        let inner = &mut *inner;
        let Some(job) = inner.jobs.get_mut(job_id) else {
            return;
        };
        job.committed = Some(step);
        let keep = job.steps.split_off(&step);
        let dropped: u64 = std::mem::replace(&mut job.steps, keep)
            .values()
            .flat_map(|p| p.values())
            .map(|f| f.bytes())
            .sum();
        inner.used -= dropped;
    }

    /// Drops every snapshot of the job; returns the bytes freed.
    pub fn drop_job(&self, job_id: &str) -> u64 {
        let mut inner = crate::lock(&self.inner);
        let freed = inner.jobs.remove(job_id).map_or(0, |j| j.bytes());
        inner.used -= freed;
        freed
    }

    /// Steps held for a job, with the committed one (for tests and logs).
    pub fn steps(&self, job_id: &str) -> (Vec<u64>, Option<u64>) {
        let inner = crate::lock(&self.inner);
        inner.jobs.get(job_id).map_or((vec![], None), |j| {
            (j.steps.keys().copied().collect(), j.committed)
        })
    }
}

/// The default bound: a quarter of this node's memory (`MemTotal`), 4 GiB when unknown.
pub fn default_cap() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(4 << 30, |kb| kb * 1024 / 4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::bytes::Bytes;

    fn key(job: &str, step: u64, part: &str) -> pb::SnapshotKey {
        pb::SnapshotKey {
            job_id: job.into(),
            step,
            part: part.into(),
        }
    }

    fn files(n: usize) -> Files {
        Files {
            files: vec![("model.safetensors".into(), Bytes::from(vec![1u8; n]))],
        }
    }

    #[test]
    fn commit_keeps_the_newest_complete_step_and_drop_frees_all() {
        let s = Store::new(1000);
        s.insert(&key("a", 2, "actor"), files(100)).unwrap();
        s.insert(&key("a", 2, "critic"), files(100)).unwrap();
        s.insert(&key("a", 4, "actor"), files(100)).unwrap();
        assert_eq!(s.used(), 300);
        // Step 4 is not complete yet: step 2 stays.
        assert_eq!(s.steps("a"), (vec![2, 4], None));
        s.commit("a", 4);
        assert_eq!(s.steps("a"), (vec![4], Some(4)));
        assert_eq!(s.used(), 100);
        assert!(s.get(&key("a", 2, "actor")).is_err());
        assert_eq!(s.get(&key("a", 4, "actor")).unwrap().bytes(), 100);
        // The same key again replaces it.
        s.insert(&key("a", 4, "actor"), files(50)).unwrap();
        assert_eq!(s.used(), 50);
        assert_eq!(s.drop_job("a"), 50);
        assert_eq!(s.used(), 0);
        let e = s.get(&key("a", 4, "actor")).unwrap_err().to_string();
        assert!(e.contains("no snapshot of job a"), "{e}");
    }

    #[test]
    fn a_full_store_evicts_other_jobs_then_refuses_with_the_flag() {
        let s = Store::new(1000);
        s.insert(&key("old", 2, "actor"), files(400)).unwrap();
        s.insert(&key("newer", 2, "actor"), files(400)).unwrap();
        // 400 more: the least recently written other job goes.
        s.insert(&key("mine", 2, "actor"), files(400)).unwrap();
        assert_eq!(s.steps("old").0, Vec::<u64>::new());
        assert_eq!(s.steps("newer").0, vec![2]);
        assert_eq!(s.used(), 800);
        // More than the job alone can hold: refused, naming the flag, nothing changed.
        let e = s.insert(&key("mine", 4, "actor"), files(700)).unwrap_err();
        assert_eq!(e.kind(), FailureKind::InsufficientResources);
        assert!(e.to_string().contains("--snapshot-memory-gb"), "{e}");
        assert!(s.admit("mine", 700).is_err());
        assert!(s.admit("mine", 600).is_ok());
        // A push announcing an absurd size (a peer's u64) is refused, not wrapped below the cap.
        assert!(s.admit("mine", u64::MAX).is_err());
        assert_eq!(s.steps("mine").0, vec![2]);
        assert_eq!(s.steps("newer").0, vec![2], "a refused push evicts nobody");
    }
}
