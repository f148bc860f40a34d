//! The receiving side of a shared-memory batch: the sender's segment is mapped once and
//! the mapping cached (keyed by the sender's pid and descriptor, checked against the
//! segment's id), the batch's generation is claimed in the segment's lease word, and the
//! batch is decoded as views of the mapping. The claim is released when the last view is
//! dropped, which frees the segment for the sender's next batch.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use rlhf_core::batch::{decode_view, SharedRegion};
use rlhf_core::{DataBatch, Error, Result};
use rlhf_proto::v1 as pb;

use super::segment::{claimed, written, Map, FREE, MAGIC, PAGE, SIZE_SEALS};
use super::{Unreachable, IDLE};
use crate::process_alive as alive;

/// A sender's segment as this process maps it: the header page read-write (for the lease
/// word), the data area read-only.
struct Mapped {
    header: Map,
    data: Map,
    id: Vec<u8>,
    pid: u32,
    last_used: Mutex<Instant>,
}

/// Mappings by the sender's pid and descriptor.
type Cache = Mutex<HashMap<(u32, i32), Arc<Mapped>>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The mapping of the segment `s` points at: cached, or made now.
fn mapped(s: &pb::SharedBatch) -> Result<std::result::Result<Arc<Mapped>, Unreachable>> {
    let mut cache = cache()
        .lock()
        .map_err(|_| Error::internal("shared batch mappings: lock poisoned"))?;
    // Mappings of senders that are gone, or idle, go: they pin the sender's memory.
    cache.retain(|_, m| {
        let idle = m.last_used.lock().map(|t| t.elapsed()).unwrap_or_default();
        idle <= IDLE && alive(m.pid)
    });
    if let Some(m) = cache.get(&(s.pid, s.fd)) {
        if m.id[..] == s.nonce[..] {
            if let Ok(mut t) = m.last_used.lock() {
                *t = Instant::now();
            }
            return Ok(Ok(m.clone()));
        }
    }
    let path = format!("/proc/{}/fd/{}", s.pid, s.fd);
    let unreachable = |why: String| Ok(Err(Unreachable(format!("{path}: {why}"))));
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) => return unreachable(format!("cannot open it ({e})")),
    };
    // SAFETY: fcntl F_GET_SEALS on a descriptor this function owns.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & SIZE_SEALS != SIZE_SEALS {
        return unreachable("not sealed against resizing, so not a batch segment".into());
    }
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let Some(data_len) = usize::try_from(size).ok().and_then(|s| s.checked_sub(PAGE)) else {
        return unreachable(format!("{size} bytes, not a batch segment"));
    };
    let header = Map::new(file.as_raw_fd(), 0, PAGE, true)
        .map_err(|e| Error::io(format!("mapping {path}"), e))?;
    let h = header.header();
    if h.magic.load(std::sync::atomic::Ordering::Acquire) != MAGIC {
        return unreachable("not a batch segment".into());
    }
    if h.id()[..] != s.nonce[..] {
        return unreachable("another segment than the call announced".into());
    }
    let data = Map::new(file.as_raw_fd(), PAGE, data_len, false)
        .map_err(|e| Error::io(format!("mapping {path}"), e))?;
    let m = Arc::new(Mapped {
        header,
        data,
        id: s.nonce.to_vec(),
        pid: s.pid,
        last_used: Mutex::new(Instant::now()),
    });
    cache.insert((s.pid, s.fd), m.clone());
    Ok(Ok(m))
}

/// A claimed batch: the bytes its views read. Dropping it (with the last view) frees the
/// segment for the sender.
struct Lease {
    seg: Arc<Mapped>,
    value: u64,
    len: usize,
}

impl SharedRegion for Lease {
    fn bytes(&self) -> &[u8] {
        &self.seg.data.bytes()[..self.len]
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.seg.header.header().swap_lease(self.value, FREE);
    }
}

/// Opens the batch `c` points at and decodes it as views of the sender's segment. Problems
/// of reach (the segment cannot be opened, or is not the announced one) are
/// [`Unreachable`]; a batch over `max_bytes`, a generation that is gone or a corrupt
/// encoding is an error.
pub fn open(
    c: &pb::BatchChunk,
    max_bytes: u64,
) -> Result<std::result::Result<DataBatch, Unreachable>> {
    let Some(s) = &c.shared else {
        return Err(Error::invalid("not a shared-memory batch chunk"));
    };
    if c.total_bytes > max_bytes {
        return Err(Error::invalid(format!(
            "batch of {} bytes is over the {max_bytes} byte limit",
            c.total_bytes
        )));
    }
    let generation = u32::try_from(s.generation)
        .ok()
        .filter(|&g| g != 0)
        .ok_or_else(|| Error::invalid(format!("shared batch generation {}", s.generation)))?;
    let seg = match mapped(s)? {
        Ok(m) => m,
        Err(u) => return Ok(Err(u)),
    };
    let len = usize::try_from(c.total_bytes)
        .ok()
        .filter(|&l| l <= seg.data.bytes().len())
        .ok_or_else(|| {
            Error::invalid(format!(
                "a shared batch of {} bytes in a segment of {}",
                c.total_bytes,
                seg.data.bytes().len()
            ))
        })?;
    let value = claimed(generation, std::process::id());
    if !seg.header.header().swap_lease(written(generation), value) {
        return Err(Error::invalid(format!(
            "shared batch {generation} of process {} is gone: its sender took it back (the call was abandoned) or another reader claimed it",
            s.pid
        )));
    }
    let lease: Arc<dyn SharedRegion> = Arc::new(Lease { seg, value, len });
    Ok(Ok(decode_view(lease, 0)?))
}
