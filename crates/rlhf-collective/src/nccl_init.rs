//! What a rank checks and says around `ncclCommInitRank`, kept free of CUDA so it is tested
//! without a GPU: a host-wide claim on one GPU for one rank of one NCCL group, and the
//! message of an init that did not complete.
//!
//! The claim, taken before init. Why: NCCL runs at most one rank of a communicator per GPU; two ranks
//! of one group placed on one GPU fail inside init as a bare "invalid usage" (or, before the
//! error reaches us, as a timeout), naming neither rank. Each rank instead takes an
//! exclusive `flock` on a file named after the group (a digest of its unique id) and the
//! GPU's UUID; the second rank on that GPU is refused at once, naming the rank that holds
//! it and the rule. The kernel drops the lock when the process ends, so a crashed rank
//! leaves no stale claim. Ranks in different containers that share a GPU but not the claim
//! directory are not seen: NCCL's own error remains for them.

#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Error, Op, Result};

/// Where claims live: `/dev/shm` (shared by every process of the host, in memory) when
/// there is one, else the temporary directory.
pub(crate) fn claim_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// A digest of an NCCL unique id (FNV-1a), short enough for a file name and a log line:
/// ranks that print the same digest hold the same id.
pub(crate) fn id_digest(id: &[u8]) -> u64 {
    id.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Held while the rank's communicator lives; dropping it releases the GPU.
#[derive(Debug)]
pub(crate) struct GpuClaim {
    /// Holds the lock; closing it releases the claim.
    _lock: File,
    path: PathBuf,
}

impl GpuClaim {
    /// Claims `gpu` (its UUID) for `rank` of the group whose unique id is `id`, in `dir`.
    pub(crate) fn take(dir: &Path, id: &[u8], gpu: &str, rank: usize) -> Result<Self> {
        let gpu_name: String = gpu
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let path = dir.join(format!("rlhf-nccl-{:016x}-{gpu_name}.lock", id_digest(id)));
        let io = |what: &str, e: std::io::Error| Error::Io {
            op: Op::Rendezvous,
            rank,
            peer: None,
            context: format!("{what} the GPU claim {}", path.display()),
            source: e,
        };
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io("opening", e))?;
        // SAFETY: the descriptor belongs to `file`, which is open for the whole call;
        // flock has no memory-safety preconditions.
        let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(io("locking", e));
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let holder = if holder.is_empty() {
                "another rank".to_string()
            } else {
                holder.to_string()
            };
            return Err(Error::InvalidArgument {
                op: Op::Rendezvous,
                detail: format!(
                    "rank {rank} of NCCL group {:016x} is on GPU {gpu}, which {holder} of the \
                     same group already holds: NCCL runs one rank of a communicator per GPU \
                     (ncclCommInitRank would fail with \"Duplicate GPU detected\"); give each \
                     rank its own GPU, or use the tcp or shm backend for ranks that share one",
                    id_digest(id)
                ),
            });
        }
        let me = format!("rank {rank} (pid {})", std::process::id());
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| file.write_all(me.as_bytes()))
            .map_err(|e| io("writing", e))?;
        Ok(Self { _lock: file, path })
    }
}

impl Drop for GpuClaim {
    fn drop(&mut self) {
        // Unlink while still locked, so nobody locks a file about to vanish unseen; the
        // lock itself goes with the descriptor.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The `NCCL_*` settings that decide how ranks find each other, as this process sees
/// them, for messages (`NCCL_SOCKET_IFNAME=unset` says as much as a value).
pub(crate) fn nccl_env_summary(get: impl Fn(&str) -> Option<String>) -> String {
    ["NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG"]
        .iter()
        .map(|k| format!("{k}={}", get(k).unwrap_or_else(|| "unset".into())))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Why `ncclCommInitRank` on `rank` of `world` did not complete within `waited`: what it
/// waits for (every other rank calling it with the same unique id, then NCCL's bootstrap
/// connections to rank 0's host), which ranks those are, and what to compare or set.
pub(crate) fn init_timeout_detail(
    rank: usize,
    world: usize,
    id: &[u8],
    waited: std::time::Duration,
    env: &str,
) -> String {
    let others: Vec<String> = (0..world)
        .filter(|&r| r != rank)
        .map(|r| r.to_string())
        .collect();
    format!(
        "; ncclCommInitRank on rank {rank} of {world} did not complete within {waited:?}. It \
         waits for ranks {} to call it with the unique id {:016x} (each rank logs the digest of \
         the id it joins with: a rank that logged another one, or none, is the one missing), then \
         for NCCL's bootstrap connections to rank 0's host. If every rank logged this digest, \
         the ranks cannot reach each other on the interface NCCL picked: set \
         NCCL_SOCKET_IFNAME (and NCCL_IB_HCA) for the job, and NCCL_DEBUG=INFO to see the \
         bootstrap; this rank has {env}",
        others.join(", "),
        id_digest(id)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn a_second_rank_of_a_group_on_one_gpu_is_refused_naming_the_rule() {
        let dir = tempfile::tempdir().unwrap();
        let id = [7u8; 128];
        let gpu = "GPU-1234abcd-0000";
        let first = GpuClaim::take(dir.path(), &id, gpu, 0).unwrap();
        let e = GpuClaim::take(dir.path(), &id, gpu, 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let msg = e.to_string();
        assert!(msg.contains("rank 1"), "{msg}");
        assert!(msg.contains("rank 0 (pid"), "{msg}");
        assert!(msg.contains("one rank of a communicator per GPU"), "{msg}");
        // Another GPU, or another group on this GPU, is fine.
        let _other_gpu = GpuClaim::take(dir.path(), &id, "GPU-5678", 1).unwrap();
        let _other_group = GpuClaim::take(dir.path(), &[8u8; 128], gpu, 1).unwrap();
        // Released with the communicator.
        drop(first);
        let _again = GpuClaim::take(dir.path(), &id, gpu, 1).unwrap();
    }

    #[test]
    fn the_id_digest_tells_ids_apart() {
        assert_eq!(id_digest(&[1, 2, 3]), id_digest(&[1, 2, 3]));
        assert_ne!(id_digest(&[1, 2, 3]), id_digest(&[1, 2, 4]));
    }

    #[test]
    fn an_init_timeout_names_the_awaited_ranks_the_id_and_the_network_settings() {
        let id = [3u8; 128];
        let env = nccl_env_summary(|k| (k == "NCCL_DEBUG").then(|| "INFO".to_string()));
        assert_eq!(
            env,
            "NCCL_SOCKET_IFNAME=unset, NCCL_IB_HCA=unset, NCCL_DEBUG=INFO"
        );
        let d = init_timeout_detail(1, 4, &id, std::time::Duration::from_secs(60), &env);
        assert!(d.contains("rank 1 of 4"), "{d}");
        assert!(d.contains("ranks 0, 2, 3 to call it"), "{d}");
        assert!(d.contains(&format!("{:016x}", id_digest(&id))), "{d}");
        assert!(d.contains("NCCL_SOCKET_IFNAME=unset"), "{d}");
        assert!(!d.contains("unique id or world size"), "{d}");
    }
}
