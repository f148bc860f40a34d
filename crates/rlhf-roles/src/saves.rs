//! Checkpoint writes off the compute thread. `SaveCheckpoint` copies the state out on the
//! compute thread (milliseconds) and a blocking task writes the files while the role trains
//! on; `WaitCheckpoint` tells the driver when they are on disk, and only then does the driver
//! commit the step's checkpoint. One save is in flight at a time: a second one waits for the
//! first, so at most one copy of the state is held besides the live one.
//!
//! With `checkpoint.memory_snapshot` the writer then pushes the directory it wrote into a
//! peer worker's memory ([`Push`]); a failed push is reported with the save, which still
//! succeeds (the files are on disk, and a restart reads those).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Mutex};
use tonic::Status;

use crate::checkpoint::Image;
use crate::error::Error;

/// Bound on pushing one snapshot to a peer worker.
const PUSH_TIMEOUT: Duration = Duration::from_secs(1800);

/// Bound on reaching that worker: the head listed it alive when the roles were placed, so it
/// answers at once or is gone (the save waits for the push, and the next save for this one).
const PUSH_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What a finished save reports.
#[derive(Debug, Clone)]
pub struct Saved {
    pub files: Vec<String>,
    pub checksum: u64,
    /// The snapshot pushed: the directory's name under the step, and its bytes or why the
    /// push failed.
    pub snapshot: Option<(String, Result<u64, String>)>,
}

impl From<Saved> for rlhf_proto::v1::SaveCheckpointResponse {
    fn from(s: Saved) -> Self {
        let (part, bytes, error) = match s.snapshot {
            None => (String::new(), 0, String::new()),
            Some((part, Ok(b))) => (part, b, String::new()),
            Some((part, Err(e))) => (part, 0, e),
        };
        Self {
            files: s.files,
            weights_checksum: s.checksum,
            snapshot_part: part,
            snapshot_bytes: bytes,
            snapshot_error: error,
        }
    }
}

/// Where a save pushes its snapshot, and how to reach it.
#[derive(Debug, Clone)]
pub struct Push {
    pub target: rlhf_proto::v1::SnapshotTarget,
    pub client: rlhf_runtime::net::ClientOptions,
}

impl Push {
    /// Sends the directory `written` (a part of step `target.step`) to the worker.
    fn run(&self, written: &std::path::Path) -> (String, Result<u64, String>) {
        let part = written
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let key = rlhf_proto::v1::SnapshotKey {
            job_id: self.target.job_id.clone(),
            step: self.target.step,
            part: part.clone(),
        };
        let address = &self.target.address;
        let mut client = self.client.clone();
        client.connect_timeout = client.connect_timeout.min(PUSH_CONNECT_TIMEOUT);
        // On a blocking thread of the runtime, so the runtime can drive the call.
        let sent = tokio::runtime::Handle::current().block_on(rlhf_runtime::snapshot::push_dir(
            address,
            &client,
            key,
            written,
            PUSH_TIMEOUT,
        ));
        let out = sent.map_err(|e| format!("pushing {part} to the worker at {address}: {e}"));
        if let Err(e) = &out {
            tracing::warn!("{e}; a restart reads this part from disk");
        }
        (part, out)
    }
}

type Outcome = Option<Result<Saved, String>>;

struct InFlight {
    dir: String,
    done: watch::Receiver<Outcome>,
}

/// The background save of one role process.
#[derive(Default, Clone)]
pub struct Saves {
    slot: Arc<Mutex<Option<InFlight>>>,
}

async fn finished(mut rx: watch::Receiver<Outcome>) -> Result<Saved, Status> {
    let out = rx
        .wait_for(Option::is_some)
        .await
        .map_err(|_| Status::internal("the checkpoint writer ended without an answer"))?;
    match out.as_ref() {
        Some(Ok(s)) => Ok(s.clone()),
        Some(Err(e)) => Err(Status::internal(e.clone())),
        None => unreachable!("waited for Some"),
    }
}

impl Saves {
    /// Writes `image` to `dir` on a blocking task (the weights' checksum too) and returns
    /// without waiting for it. A save still in flight is waited for first (its own error, if
    /// any, is reported to its `wait`, not here).
    pub async fn start(&self, dir: String, image: Image, push: Option<Push>) {
        let mut slot = self.slot.lock().await;
        if let Some(prev) = slot.take() {
            let _ = finished(prev.done.clone()).await;
        }
        let (tx, rx) = watch::channel(None);
        let path = PathBuf::from(&dir);
        tokio::task::spawn_blocking(move || {
            let written = image.target_dir(&path);
            let out = image
                .checksum()
                .and_then(|checksum| {
                    Ok(Saved {
                        files: image.write(&path)?,
                        checksum,
                        snapshot: None,
                    })
                })
                .map_err(|e: Error| format!("writing the checkpoint {}: {e}", path.display()));
            // The copy of the state is not needed once the files are on disk.
            drop(image);
            let out = out.map(|mut saved| {
                saved.snapshot = push.map(|p| p.run(&written));
                saved
            });
            let _ = tx.send(Some(out));
        });
        *slot = Some(InFlight { dir, done: rx });
    }

    /// Writes `image` to `dir` and waits for it.
    pub async fn write_now(
        &self,
        dir: String,
        image: Image,
        push: Option<Push>,
    ) -> Result<Saved, Status> {
        self.start(dir.clone(), image, push).await;
        self.wait(&dir, None).await
    }

    /// Waits up to `timeout` for the save to `dir` to be on disk.
    pub async fn wait(&self, dir: &str, timeout: Option<Duration>) -> Result<Saved, Status> {
        let rx = match self.slot.lock().await.as_ref() {
            Some(s) if s.dir == dir => s.done.clone(),
            Some(s) => {
                return Err(Status::failed_precondition(format!(
                    "no checkpoint save to {dir} on this rank: the last one went to {}",
                    s.dir
                )))
            }
            None => {
                return Err(Status::failed_precondition(format!(
                    "no checkpoint save to {dir} on this rank: call SaveCheckpoint first"
                )))
            }
        };
        match timeout {
            None => finished(rx).await,
            Some(t) => tokio::time::timeout(t, finished(rx)).await.map_err(|_| {
                Status::deadline_exceeded(format!(
                    "the checkpoint {dir} is not on disk after {:.1} s; the disk is slow or full",
                    t.as_secs_f64()
                ))
            })?,
        }
    }
}
