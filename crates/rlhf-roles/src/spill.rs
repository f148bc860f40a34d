//! Where rank 0 of a ZeRO-3 group writes a checkpoint's model while its group gathers it,
//! before the checkpoint's writer moves the file into place (`crate::checkpoint`): the
//! whole model never waits in memory for the writer.
//!
//! Each save spills into a directory of its own beside the checkpoint part,
//! `<part>.model-spill-<pid>-<n>`, so two saves of one part (a second captured while the
//! first is still being written) never touch each other's file. The directory goes when the
//! image that owns it goes, written or not ([`Spill`]'s drop); one left by a process that
//! died is removed by the next save of the part from another process.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rlhf_model::{Model, ModelImage};

use crate::error::{Ctx, Error, Result};

const SPILL: &str = ".model-spill-";

/// A spill directory and the checksum of the weights written there; the directory is
/// removed when this is dropped (the writer moves the file out first).
#[derive(Debug)]
pub struct Spill {
    dir: PathBuf,
    checksum: u64,
}

impl Spill {
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// [`crate::weights::tensors_checksum`] of the weights written.
    pub fn checksum(&self) -> u64 {
        self.checksum
    }
}

impl Drop for Spill {
    fn drop(&mut self) {
        if self.dir.exists() {
            if let Err(e) = std::fs::remove_dir_all(&self.dir) {
                tracing::warn!("removing {}: {e}", self.dir.display());
            }
        }
    }
}

/// The spill directories beside checkpoint part `dir`, with the process id in each name.
pub fn spills(dir: &Path) -> Vec<(PathBuf, Option<u32>)> {
    let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
        return Vec::new();
    };
    let prefix = format!("{}{SPILL}", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    }) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let file = e.file_name().to_string_lossy().into_owned();
            let rest = file.strip_prefix(&prefix)?;
            let pid = rest.split('-').next().and_then(|p| p.parse().ok());
            Some((dir.with_file_name(&file), pid))
        })
        .collect()
}

/// A fresh spill directory's path for part `dir`.
fn fresh(dir: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(format!("{SPILL}{}-{n}", std::process::id()));
    dir.with_file_name(name)
}

/// Removes the spill directories of part `dir` that processes other than this one left.
fn sweep(dir: &Path) {
    let me = std::process::id();
    for (path, pid) in spills(dir) {
        if pid != Some(me) {
            if let Err(e) = std::fs::remove_dir_all(&path) {
                tracing::warn!("removing {}: {e}", path.display());
            }
        }
    }
}

/// Rank 0's part of a ZeRO-3 save of checkpoint part `dir`: the weights written into a
/// fresh spill directory as the group gathers them ([`Model::image_streamed`]), and the
/// image that moves them into place. Every rank of the group takes part in every gather
/// even when the writing fails, and a failed save leaves no spill behind.
pub(crate) fn write_model(
    model: &Model,
    tok: Option<&Path>,
    dir: &Path,
) -> Result<(ModelImage, Spill)> {
    sweep(dir);
    let mut spill = Spill {
        dir: fresh(dir),
        checksum: 0,
    };
    if let Err(e) = std::fs::create_dir_all(&spill.dir) {
        if let Some(z) = model.zero3() {
            // The other ranks are gathering: take part before failing.
            let _ = z.gather_all_for_others();
        }
        return Err(Error::internal(format!(
            "creating {}: {e}",
            spill.dir.display()
        )));
    }
    let file = spill.dir.join(rlhf_model::weights::SAFETENSORS_FILE);
    let (image, sum) = model
        .image_streamed(tok, &file)
        .with_ctx(|| format!("writing the gathered weights to {}", file.display()))?;
    spill.checksum = sum;
    Ok((image, spill))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spills_are_unique_go_with_their_owner_and_dead_processes_ones_are_swept() {
        let tmp = tempfile::tempdir().unwrap();
        let part = tmp.path().join("actor");
        let (a, b) = (fresh(&part), fresh(&part));
        assert_ne!(a, b, "two saves of one part spill apart");
        for d in [&a, &b] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("model.safetensors"), b"x").unwrap();
        }
        // Another process's leftover, and an unrelated sibling.
        let dead = tmp.path().join("actor.model-spill-4000000000-0");
        std::fs::create_dir_all(&dead).unwrap();
        std::fs::create_dir_all(tmp.path().join("critic.model-spill-1-0")).unwrap();
        let found = spills(&part);
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(found.contains(&(dead.clone(), Some(4_000_000_000))));
        sweep(&part);
        assert!(!dead.exists(), "a dead process's spill is swept");
        assert!(a.exists() && b.exists(), "this process's spills are not");
        assert!(tmp.path().join("critic.model-spill-1-0").exists());
        // A spill goes with the image that owns it, written or not.
        drop(Spill {
            dir: a.clone(),
            checksum: 1,
        });
        assert!(!a.exists());
        assert_eq!(spills(&part).len(), 1);
    }
}
