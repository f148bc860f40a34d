//! Checkpoint writes off the compute thread. `SaveCheckpoint` copies the state out on the
//! compute thread (milliseconds) and a blocking task writes the files while the role trains
//! on; `WaitCheckpoint` tells the driver when they are on disk, and only then does the driver
//! commit the step's checkpoint. One save is in flight at a time: a second one waits for the
//! first, so at most one copy of the state is held besides the live one.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Mutex};
use tonic::Status;

use crate::checkpoint::Image;
use crate::error::Error;

/// What a finished save reports.
#[derive(Debug, Clone)]
pub struct Saved {
    pub files: Vec<String>,
    pub checksum: u64,
}

impl From<Saved> for rlhf_proto::v1::SaveCheckpointResponse {
    fn from(s: Saved) -> Self {
        Self {
            files: s.files,
            weights_checksum: s.checksum,
        }
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
    pub async fn start(&self, dir: String, image: Image) {
        let mut slot = self.slot.lock().await;
        if let Some(prev) = slot.take() {
            let _ = finished(prev.done.clone()).await;
        }
        let (tx, rx) = watch::channel(None);
        let path = PathBuf::from(&dir);
        tokio::task::spawn_blocking(move || {
            let out = image
                .checksum()
                .and_then(|checksum| {
                    Ok(Saved {
                        files: image.write(&path)?,
                        checksum,
                    })
                })
                .map_err(|e: Error| format!("writing the checkpoint {}: {e}", path.display()));
            let _ = tx.send(Some(out));
        });
        *slot = Some(InFlight { dir, done: rx });
    }

    /// Writes `image` to `dir` and waits for it.
    pub async fn write_now(&self, dir: String, image: Image) -> Result<Saved, Status> {
        self.start(dir.clone(), image).await;
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
