//! Collective communication between role processes: gradient all-reduce across
//! data-parallel trainer ranks and bucketed trainer → rollout weight sync.
//!
//! - [`Communicator`]: the backend-neutral trait (broadcast, all-reduce, all-gather,
//!   barrier) over plain host slices; tensors are converted by the caller.
//! - [`TcpCommunicator`]: std-only TCP backend (ring topology), see [`tcp`] for the
//!   rendezvous and the wire format.
//! - [`BucketedSync`] and [`checksum`]: named-parameter weight sync in fixed-size
//!   buckets, and a content hash proving both sides hold the same weights.
//! - [`ShmCommunicator`] (Linux): the same trait through a shared-memory segment, for ranks
//!   on one host (trainer → rollout weight sync without the TCP stack), see [`shm`].
//! - `NcclCommunicator` (feature `nccl`): the same trait over NCCL through cudarc.
//!
//! Every wait on a peer is bounded by [`CommConfig::timeout`]; a dead or stuck peer
//! becomes an [`Error`] naming the op and the peer rank, never a hang or a panic.
//! After any error a communicator refuses further ops (the byte streams are in an
//! unknown state): build a new one.
//!
//! ```
//! use rlhf_collective::{CommConfig, Communicator, ReduceOp, TcpCommunicator, TcpRendezvous};
//!
//! let rv = TcpRendezvous::bind("127.0.0.1:0")?;
//! let addr = rv.local_addr().to_string(); // publish it, e.g. through the head's KV store
//! let peer = std::thread::spawn(move || -> rlhf_collective::Result<Vec<f32>> {
//!     let mut c = TcpCommunicator::connect(1, 2, &addr, CommConfig::default())?;
//!     let mut grads = vec![3.0f32; 4];
//!     c.all_reduce_f32(&mut grads, ReduceOp::Avg)?;
//!     Ok(grads)
//! });
//! let mut c = rv.accept(2, CommConfig::default())?;
//! let mut grads = vec![1.0f32; 4];
//! c.all_reduce_f32(&mut grads, ReduceOp::Avg)?;
//! assert_eq!(grads, vec![2.0; 4]);
//! assert_eq!(peer.join().expect("peer thread")?, vec![2.0; 4]);
//! # Ok::<(), rlhf_collective::Error>(())
//! ```

#[cfg(target_endian = "big")]
compile_error!("rlhf-collective sends native-endian numbers and assumes a little-endian host");

mod bucket;
mod checksum;
mod error;
#[cfg(feature = "nccl")]
pub mod nccl;
mod nccl_init;
mod op_header;
mod scatter;
mod send_stream;
#[cfg(target_os = "linux")]
pub mod shm;
pub mod tcp;
mod uneven;

use std::time::Duration;

/// Largest all_gather block accepted from a peer (64 GiB), on every backend: an absurd
/// length (a corrupt stream, a foreign program) is an early, clear error, not an allocation
/// that aborts the process.
pub(crate) const MAX_BLOCK: u64 = 1 << 36;

/// [`MAX_BLOCK`] checked for the block `len` that rank `peer` announced to `rank` in `op`.
pub(crate) fn check_block(op: Op, rank: usize, peer: usize, len: u64) -> Result<usize> {
    if len > MAX_BLOCK {
        return Err(Error::Mismatch {
            op,
            rank,
            peer: Some(peer),
            detail: format!(
                "peer announced a block of {len} bytes (at most {MAX_BLOCK}): corrupt stream or foreign program"
            ),
        });
    }
    Ok(len as usize)
}

pub use bucket::{
    all_reduce_f32_bucketed, BucketedSync, DType, Listed, Param, ParamMut, ParamView, SyncStats,
};
pub use checksum::{checksum, ChecksumStream};
pub use error::{Error, ErrorKind, Op, Result};
#[cfg(feature = "nccl")]
pub use nccl::NcclCommunicator;
pub use rlhf_types::Checksum;
pub use scatter::ReduceScatterStream;
pub use send_stream::{ParamMeta, SendStream};
#[cfg(target_os = "linux")]
pub use shm::{ShmCommunicator, ShmRendezvous};
pub use tcp::{CommSecret, CommTls, TcpCommunicator, TcpRendezvous};

/// Reduction applied element-wise by all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Sum over ranks divided by the world size (gradient averaging).
    Avg,
    /// Maximum over ranks; a NaN on any rank gives NaN, so a bad loss is never hidden. The
    /// same on every backend (tests/nan_contract.rs): TCP and shared memory compare with
    /// NaN winning; NCCL's own Max drops NaN, so the nccl backend sets it back from a NaN
    /// mask reduced alongside (only when some rank flagged a NaN in the op's header).
    /// A `Min`, if one is ever added, keeps the same contract.
    Max,
}

impl ReduceOp {
    pub(crate) fn wire_id(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Avg => 2,
            ReduceOp::Max => 3,
        }
    }
}

/// Settings shared by all backends.
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// Longest wait for a peer without progress (rendezvous: total time to connect).
    pub timeout: Duration,
    /// Largest single socket write / read, and the all-reduce pipelining unit.
    pub chunk_bytes: usize,
    /// `SO_SNDBUF` / `SO_RCVBUF` request; `None` keeps the kernel's autotuning.
    pub socket_buffer_bytes: Option<usize>,
    /// TCP: the communicator's shared secret. With it, every rendezvous connection is
    /// authenticated both ways before any data moves, and connections that fail are dropped;
    /// without it, anyone who reaches the port can join. Every rank must have the same one.
    pub secret: Option<CommSecret>,
    /// TCP: TLS for every connection (this node's certificate and the cluster CA); every
    /// rank must have one or none.
    pub tls: Option<CommTls>,
}

impl Default for CommConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            chunk_bytes: 1 << 20,
            socket_buffer_bytes: Some(4 << 20),
            secret: None,
            tls: None,
        }
    }
}

impl CommConfig {
    /// Default settings with a different timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        Self {
            timeout,
            ..Self::default()
        }
    }
}

/// Collective operations over a fixed group of `world_size` ranks.
///
/// All ranks must issue the same sequence of calls with matching arguments (same
/// lengths, same root, same reduce op); a disagreement is detected and reported as
/// [`ErrorKind::Mismatch`] where the backend can see it. Every method blocks the
/// calling thread: call from a dedicated compute thread, not from an async runtime.
pub trait Communicator: Send {
    /// This process's rank in `0..world_size`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Short backend name for logs ("tcp", "nccl").
    fn backend(&self) -> &'static str;

    /// Copies `buf` on `root` into `buf` on every other rank. Lengths must match.
    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<()>;

    /// Root side of a broadcast whose payload is the concatenation of `parts`.
    /// Receivers call [`Communicator::broadcast_recv_parts`] with any split of the
    /// same total length. The default stages through one buffer; backends override
    /// it to avoid the copy.
    fn broadcast_send_parts(&mut self, parts: &[&[u8]]) -> Result<()> {
        let mut staging = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
        for p in parts {
            staging.extend_from_slice(p);
        }
        let root = self.rank();
        self.broadcast(&mut staging, root)
    }

    /// Receiver side of [`Communicator::broadcast_send_parts`]: fills `parts` in order.
    fn broadcast_recv_parts(&mut self, parts: &mut [&mut [u8]], root: usize) -> Result<()> {
        let mut staging = vec![0u8; parts.iter().map(|p| p.len()).sum()];
        self.broadcast(&mut staging, root)?;
        let mut at = 0;
        for p in parts.iter_mut() {
            let n = p.len();
            p.copy_from_slice(&staging[at..at + n]);
            at += n;
        }
        Ok(())
    }

    /// In-place all-reduce of `f32` values; every rank ends with bit-identical results.
    fn all_reduce_f32(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<()>;

    /// In-place all-reduce of `f64` values; every rank ends with bit-identical results.
    fn all_reduce_f64(&mut self, buf: &mut [f64], op: ReduceOp) -> Result<()>;

    /// In-place reduce-scatter of `f32` values: `buf` is `world_size` segments laid end to
    /// end, segment `r` of `counts[r]` elements (counts may differ and may be 0, the same on
    /// every rank). Afterwards this rank's segment holds the reduction of every rank's copy
    /// of it; the other segments hold unspecified values. The default all-reduces the whole
    /// buffer (right, at twice the traffic); TCP sends each element `(n - 1) / n` times.
    fn reduce_scatter_f32(
        &mut self,
        buf: &mut [f32],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        check_counts(buf.len(), counts, self.world_size())?;
        self.all_reduce_f32(buf, op)
    }

    /// Every rank contributes `data` (lengths may differ); returns all contributions
    /// indexed by rank.
    fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<()>;

    /// [`Communicator::broadcast`] of `f32` values.
    fn broadcast_f32(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        self.broadcast(as_bytes_mut(buf), root)
    }

    /// [`Communicator::broadcast`] of `f64` values.
    fn broadcast_f64(&mut self, buf: &mut [f64], root: usize) -> Result<()> {
        self.broadcast(as_bytes_mut(buf), root)
    }

    /// [`Communicator::broadcast`] of 16-bit values (bf16 / f16 bit patterns).
    fn broadcast_u16(&mut self, buf: &mut [u16], root: usize) -> Result<()> {
        self.broadcast(as_bytes_mut(buf), root)
    }
}

/// `counts` of a reduce-scatter: one per rank, adding up to the buffer.
pub(crate) fn check_counts(len: usize, counts: &[usize], world: usize) -> Result<()> {
    let total = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c));
    if counts.len() != world || total != Some(len) {
        return Err(Error::InvalidArgument {
            op: Op::ReduceScatter,
            detail: format!(
                "{} segment counts adding up to {total:?} for a buffer of {len} elements in a world of {world}: \
                 give one count per rank, adding up to the buffer's length",
                counts.len()
            ),
        });
    }
    Ok(())
}

mod sealed {
    pub trait Sealed {}
}

/// Plain numeric types whose every bit pattern is valid, so they can be viewed as
/// bytes and back. Sealed: implemented for the primitive numbers only.
pub trait Plain: sealed::Sealed + Copy + Send + Sync + 'static {}

macro_rules! plain {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Plain for $t {}
    )*};
}
plain!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64);

/// Views a slice of plain numbers as its native (little-endian) bytes.
pub fn as_bytes<T: Plain>(s: &[T]) -> &[u8] {
    // SAFETY: `T: Plain` is sealed to primitive numbers, which have no padding;
    // u8 has alignment 1 and the byte length is exactly `size_of_val(s)`, and the
    // returned borrow keeps `s` borrowed for its lifetime.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// Views a mutable slice of plain numbers as its native (little-endian) bytes.
pub fn as_bytes_mut<T: Plain>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; additionally every byte pattern written through
    // the view is a valid `T` because `T: Plain` excludes types with invalid values.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gathered block's announced length is bounded the same on every backend: the bound
    /// passes, one byte more is a mismatch naming the peer, not an allocation.
    #[test]
    fn an_absurd_block_length_is_a_mismatch_naming_the_peer() {
        assert_eq!(
            check_block(Op::AllGather, 0, 1, MAX_BLOCK).unwrap(),
            1 << 36
        );
        let e = check_block(Op::AllGather, 0, 3, u64::MAX).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Mismatch);
        assert!(e.to_string().contains("announced a block"), "{e}");
        assert_eq!(e.peer(), Some(3));
    }

    #[test]
    fn communicator_is_object_safe_and_bytes_views_roundtrip() {
        let mut c: Box<dyn Communicator> = Box::new(TcpCommunicator::single(CommConfig::default()));
        let mut v = [1.0f32, -2.5];
        c.all_reduce_f32(&mut v, ReduceOp::Avg).unwrap();
        assert_eq!(v, [1.0, -2.5]);
        assert_eq!(c.all_gather(b"x").unwrap(), vec![b"x".to_vec()]);
        assert_eq!(as_bytes(&[1.0f32]), &1.0f32.to_le_bytes());
        let mut w = [0u16; 2];
        as_bytes_mut(&mut w).copy_from_slice(&[1, 0, 0, 1]);
        assert_eq!(w, [1, 256]);
        let e = all_reduce_f32_bucketed(c.as_mut(), &mut [], ReduceOp::Sum, 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }
}
