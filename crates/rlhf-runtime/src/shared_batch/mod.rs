//! Experience batches between processes on one host through shared memory instead of the
//! TCP stack. The sender copies the batch's encoding once into a segment of its pool of
//! memory files (memfd); the gRPC call carries only a reference (`pb::SharedBatch`: pid,
//! descriptor, the segment's id and the batch's generation); the receiver maps the segment
//! (once: mappings are cached) and decodes the batch without copying a tensor byte: its
//! tensors are views of the mapping. One copy in all, into memory that is already mapped
//! on both sides after the first batch, against two copies through the kernel's socket
//! buffers plus the framing of a gRPC stream.
//!
//! Segments are reused, so the two sides agree on who may touch one through a lease word
//! in its header ([`segment`]): the sender writes only a free segment; a receiver claims
//! the batch's generation before it reads and frees the segment when the last view of the
//! batch is dropped. A claim by a process that has died is taken back; a batch nobody
//! claimed is taken back when the sender drops its [`SharedFile`].
//!
//! Who can read: the receiver opens `/proc/PID/fd/FD`, which the kernel allows to
//! processes of the same user only (processes that could read the sender's memory anyway).
//! A file that is not sealed against resizing (so a mapping of it could lose pages), or
//! whose magic or id is not the announced one (a pid of another host, a reused descriptor),
//! is [`Unreachable`]: the caller then streams the batch instead. Memory goes
//! back to the system when the sender's descriptor and every mapping are gone, however the
//! processes end: a memfd has no name in any filesystem.

mod reader;
mod segment;

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rand::RngCore;
use rlhf_core::batch::encode_header_sized;
use rlhf_core::{DataBatch, Error, Result};
use rlhf_proto::v1 as pb;

use crate::process_alive as alive;
pub use reader::open;
use segment::{claimant, written, Map, FREE, ID_BYTES, MAGIC, PAGE, SIZE_SEALS, WRITING};

/// gRPC metadata key a receiver sets on its refusal when it cannot read the sender's
/// shared memory (another host, another pid namespace): the sender then streams instead.
pub const UNREACHABLE_KEY: &str = "rlhf-shared-batch-unreachable";
/// A free segment unused this long leaves the pool (its memory goes back to the system).
const IDLE: Duration = Duration::from_secs(30);
/// Smallest segment data area.
const MIN_SEGMENT: usize = 1 << 20;

/// One memory file of the pool, mapped read-write.
struct Segment {
    file: File,
    map: Map,
    id: [u8; ID_BYTES],
    /// Data bytes (after the header page).
    cap: usize,
    generation: AtomicU32,
    last_used: Mutex<Instant>,
}

impl Segment {
    fn create(cap: usize) -> Result<Self> {
        // SAFETY: the name is a NUL-terminated literal; the flags are valid memfd flags.
        let fd = unsafe {
            libc::memfd_create(
                c"rlhf-batch".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(os("creating a shared-memory batch segment (memfd_create)"));
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len((PAGE + cap) as u64)
            .map_err(|e| Error::io("sizing a shared-memory batch segment", e))?;
        // Its size is final: a reader's mapping can never lose pages under it (SIGBUS).
        // SAFETY: fcntl on a descriptor this function owns; F_ADD_SEALS takes an int.
        if unsafe {
            libc::fcntl(
                file.as_raw_fd(),
                libc::F_ADD_SEALS,
                SIZE_SEALS | libc::F_SEAL_SEAL,
            )
        } != 0
        {
            return Err(os("sealing the size of a shared-memory batch segment"));
        }
        let map = Map::new(file.as_raw_fd(), 0, PAGE + cap, true)
            .map_err(|e| Error::io("mapping a shared-memory batch segment", e))?;
        let mut id = [0u8; ID_BYTES];
        rand::rng().fill_bytes(&mut id);
        let h = map.header();
        h.set_id(&id);
        h.lease.store(FREE, Ordering::Release);
        h.magic.store(MAGIC, Ordering::Release);
        Ok(Self {
            file,
            map,
            id,
            cap,
            generation: AtomicU32::new(0),
            last_used: Mutex::new(Instant::now()),
        })
    }

    /// Takes the segment for writing if it is free, or claimed by a process that is gone.
    fn take(&self) -> bool {
        let h = self.map.header();
        let lease = h.lease.load(Ordering::Acquire);
        if lease == FREE {
            return h.swap_lease(FREE, WRITING);
        }
        match claimant(lease) {
            Some(pid) if !alive(pid) => h.swap_lease(lease, WRITING),
            _ => false,
        }
    }

    fn touch(&self) {
        if let Ok(mut t) = self.last_used.lock() {
            *t = Instant::now();
        }
    }

    fn idle_for(&self) -> Duration {
        self.last_used
            .lock()
            .map(|t| t.elapsed())
            .unwrap_or_default()
    }
}

fn os(what: &str) -> Error {
    Error::io(what.to_string(), std::io::Error::last_os_error())
}

/// Rounds a data size up to a quarter step of its power of two (at most 19 % unused), so
/// batches of slightly different sizes fit the same segment.
fn segment_size(need: usize) -> usize {
    let need = need.max(MIN_SEGMENT);
    let step = (need.next_power_of_two() / 8).max(PAGE);
    need.div_ceil(step) * step
}

fn pool() -> &'static Mutex<Vec<Arc<Segment>>> {
    static POOL: OnceLock<Mutex<Vec<Arc<Segment>>>> = OnceLock::new();
    POOL.get_or_init(|| Mutex::new(Vec::new()))
}

/// A segment holding `need` bytes, taken for writing: the smallest free one that fits, or
/// a new one. Free segments idle for [`IDLE`] leave the pool on the way.
fn take_segment(need: usize) -> Result<Arc<Segment>> {
    let mut segs = pool()
        .lock()
        .map_err(|_| Error::internal("shared batch pool: lock poisoned"))?;
    segs.retain(|s| {
        let free = s.map.header().lease.load(Ordering::Acquire) == FREE;
        !(free && s.idle_for() > IDLE)
    });
    let mut fits: Vec<&Arc<Segment>> = segs.iter().filter(|s| s.cap >= need).collect();
    fits.sort_by_key(|s| s.cap);
    if let Some(s) = fits.into_iter().find(|s| s.take()) {
        return Ok(s.clone());
    }
    let s = Arc::new(Segment::create(segment_size(need))?);
    if !s.take() {
        return Err(Error::internal("a new shared batch segment is not free"));
    }
    segs.push(s.clone());
    Ok(s)
}

/// A batch written into a segment of this process's pool, offered to one receiver until
/// this handle is dropped (a batch nobody claimed by then is taken back).
pub struct SharedFile {
    seg: Arc<Segment>,
    generation: u32,
    /// The encoding's length.
    len: u64,
}

impl std::fmt::Debug for SharedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SharedFile(fd {}, generation {}, {} bytes)",
            self.seg.file.as_raw_fd(),
            self.generation,
            self.len
        )
    }
}

impl SharedFile {
    /// Copies `batch`'s encoding into a free segment.
    pub fn write(batch: &DataBatch) -> Result<Self> {
        let (head, len) = encode_header_sized(batch)?;
        let len = usize::try_from(len)
            .map_err(|_| Error::invalid(format!("a batch of {len} bytes does not fit")))?;
        let seg = take_segment(len)?;
        // SAFETY: the mapping is writable and `take_segment` moved the lease to WRITING:
        // no reader looks at the data area until the lease says `written` below.
        let out = unsafe { seg.map.bytes_mut(PAGE) };
        let mut at = 0;
        for piece in std::iter::once(&head[..]).chain(batch.tensors.values().map(|t| &t.data[..])) {
            out[at..at + piece.len()].copy_from_slice(piece);
            at += piece.len();
        }
        let mut generation = seg
            .generation
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_add(1);
        if generation == 0 {
            generation = seg
                .generation
                .fetch_add(1, Ordering::Relaxed)
                .wrapping_add(1);
        }
        seg.touch();
        seg.map
            .header()
            .lease
            .store(written(generation), Ordering::Release);
        Ok(Self {
            seg,
            generation,
            len: len as u64,
        })
    }

    /// Bytes of the encoding.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the encoding is empty (it never is: it has a header).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The one stream message that points at this batch.
    pub fn chunk(&self) -> pb::BatchChunk {
        pb::BatchChunk {
            data: Default::default(),
            total_bytes: self.len,
            index: 0,
            shared: Some(pb::SharedBatch {
                pid: std::process::id(),
                fd: self.seg.file.as_raw_fd(),
                nonce: self.seg.id.to_vec(),
                generation: u64::from(self.generation),
            }),
        }
    }
}

impl Drop for SharedFile {
    fn drop(&mut self) {
        // Unclaimed: nobody will read it any more. Claimed: the reader frees it.
        let h = self.seg.map.header();
        h.swap_lease(written(self.generation), FREE);
        self.seg.touch();
    }
}

/// Why a shared batch could not be read here; the sender should stream it instead.
#[derive(Debug)]
pub struct Unreachable(pub String);

impl std::fmt::Display for Unreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shared-memory batch unreachable: {}", self.0)
    }
}

/// The refusal a receiver answers with, marked so the sender knows to stream.
pub fn unreachable_status(u: &Unreachable) -> tonic::Status {
    let mut s = tonic::Status::failed_precondition(u.to_string());
    s.metadata_mut().insert(
        UNREACHABLE_KEY,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    s
}

/// Whether the peer at `address` (`IP:PORT`) is surely on another host: its IP is neither a
/// loopback address nor one this host can bind to. A name, or an address this process
/// cannot judge, is not (the first batch then tries shared memory, and the receiver's
/// refusal settles it).
pub fn on_another_host(address: &str) -> bool {
    let Ok(addr) = address.parse::<std::net::SocketAddr>() else {
        return false;
    };
    let ip = addr.ip();
    if ip.is_loopback() || ip.is_unspecified() {
        return false;
    }
    // Binding succeeds only to an address of one of this host's interfaces.
    match std::net::UdpSocket::bind((ip, 0)) {
        Ok(_) => false,
        Err(e) => e.kind() == std::io::ErrorKind::AddrNotAvailable,
    }
}

/// Whether `s` is a receiver's [`unreachable_status`].
pub fn is_unreachable(s: &tonic::Status) -> bool {
    s.code() == tonic::Code::FailedPrecondition && s.metadata().get(UNREACHABLE_KEY).is_some()
}

#[cfg(test)]
mod tests;
