//! A restart's LoadCheckpoint from memory snapshots (`checkpoint.memory_snapshot`): every
//! directory of the part (`actor`, and each `actor.rank-r` of a sharded optimizer) is fetched
//! from the worker that holds it into a fresh directory laid out as the step on disk, under
//! `/dev/shm` when it has room, and loaded from there exactly as from the checkpoint storage
//! (manifest checked first). The directory goes when the load is done.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rlhf_proto::v1 as pb;
use rlhf_runtime::net::ClientOptions;

use crate::error::{Error, Result};

/// Bound on fetching one part's snapshots.
const FETCH_TIMEOUT: Duration = Duration::from_secs(1800);

/// Fetched snapshot files, removed on drop.
pub struct Restored {
    root: PathBuf,
    load: PathBuf,
    bytes: u64,
    secs: f64,
    holders: Vec<String>,
}

impl Restored {
    /// The directory to load, as the checkpoint's part directory would be.
    pub fn dir(&self) -> String {
        self.load.to_string_lossy().into_owned()
    }

    /// Where the files came from, for the driver's log.
    pub fn describe(&self) -> String {
        format!(
            "the memory snapshot on {} ({:.1} MiB in {:.2} s)",
            self.holders.join(", "),
            self.bytes as f64 / (1 << 20) as f64,
            self.secs
        )
    }
}

impl Drop for Restored {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Fetches every directory of `src` for the part whose checkpoint directory is `dir` (its
/// name picks the one to load).
pub async fn fetch(
    client: &ClientOptions,
    src: &pb::SnapshotSource,
    dir: &str,
) -> Result<Restored> {
    let name = Path::new(dir)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| Error::invalid(format!("checkpoint dir {dir:?} has no name")))?;
    if !src.parts.iter().any(|p| p.part == name) {
        return Err(Error::invalid(format!(
            "the snapshot of step {} lists no {name} directory",
            src.step
        )));
    }
    let bytes = src
        .parts
        .iter()
        .fold(0u64, |a, p| a.saturating_add(p.bytes));
    let root = rlhf_runtime::snapshot::restore_root(bytes).join(format!(
        "rlhf-restore-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    let step_dir = root.join(format!("global_step_{}", src.step));
    let mut restored = Restored {
        load: step_dir.join(&name),
        root,
        bytes: 0,
        secs: 0.0,
        holders: Vec::new(),
    };
    let t = Instant::now();
    let fetches = src.parts.iter().map(|p| {
        let key = pb::SnapshotKey {
            job_id: src.job_id.clone(),
            step: src.step,
            part: p.part.clone(),
        };
        rlhf_runtime::snapshot::check_name(&p.part, "SnapshotHolder.part")
            .map(|()| step_dir.join(&p.part))
            .map(|dest| async move {
                rlhf_runtime::snapshot::fetch_into(&p.address, client, key, &dest, FETCH_TIMEOUT)
                    .await
                    .map_err(|e| format!("{} from the worker at {}: {e}", p.part, p.address))
            })
    });
    let fetches = fetches.collect::<rlhf_core::Result<Vec<_>>>()?;
    let got = futures::future::try_join_all(fetches)
        .await
        .map_err(Error::internal)?;
    restored.bytes = got.iter().sum();
    restored.secs = t.elapsed().as_secs_f64();
    let mut holders: Vec<String> = src.parts.iter().map(|p| p.address.clone()).collect();
    holders.sort();
    holders.dedup();
    restored.holders = holders
        .into_iter()
        .map(|a| format!("the worker at {a}"))
        .collect();
    Ok(restored)
}
