//! NCCL backend (feature `nccl`): the [`Communicator`] trait over NCCL through
//! cudarc, staging host slices through device buffers.
//!
//! Rank 0 creates a unique id with [`unique_id`]; the caller ships its 128 bytes
//! to the other ranks (a KV store) and every rank calls [`NcclCommunicator::new`].
//!
//! cudarc loads `libcuda` and `libnccl` at run time and panics when they are
//! missing, so [`probe`] first opens them with `dlopen` and turns their absence
//! into [`Error::Unavailable`] with install advice; construction additionally runs
//! under `catch_unwind`.
//!
//! Timeouts: NCCL kernels wait for peers on the GPU, so every op enqueues its
//! collective, records an event, and polls it until [`CommConfig::timeout`]; on
//! expiry the NCCL communicator is aborted (which frees the stuck kernels) and the
//! op fails with [`Error::Timeout`]. NCCL does not say which rank is missing.
//! Communicator creation (`ncclCommInitRank`, which blocks until all ranks join)
//! runs on a helper thread with the same timeout; on expiry that thread is left
//! blocked inside NCCL and the error is returned.
//!
//! Every op first all-gathers a 32-byte header (op, sequence number, length,
//! root) so calls that disagree across ranks fail with [`Error::Mismatch`] instead
//! of corrupting data or hanging.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{Comm, NcclType};

use crate::error::{Error, Op, Result};
use crate::{CommConfig, Communicator, ReduceOp};

const BACKEND: &str = "nccl";
/// Bytes in an NCCL unique id.
pub const ID_BYTES: usize = 128;
const HDR_LEN: usize = 32;

mod probe;
use probe::{guarded, unavailable};
pub use probe::{id_from_bytes, id_to_bytes, probe, unique_id};

/// NCCL's name for a reduction.
fn nccl_op(red: ReduceOp) -> cudarc::nccl::ReduceOp {
    match red {
        ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
        ReduceOp::Avg => cudarc::nccl::ReduceOp::Avg,
        ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
    }
}

/// Owns the NCCL communicator.
struct OwnedComm(Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it
// are not concurrent. `OwnedComm` is only reachable through `&mut
// NcclCommunicator` (or moved whole out of the init thread), so at most one
// thread touches it at a time.
unsafe impl Send for OwnedComm {}

/// The NCCL [`Communicator`]: one rank per process and device.
pub struct NcclCommunicator {
    rank: usize,
    world: usize,
    timeout: Duration,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm: Option<OwnedComm>,
    seq: u64,
    broken: Option<String>,
}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.ctx.ordinal())
            .field("broken", &self.broken)
            .finish()
    }
}

impl NcclCommunicator {
    /// Joins the NCCL group identified by `id` (from [`unique_id`] on one rank) as
    /// `rank` of `world_size`, on CUDA device `device`.
    pub fn new(
        rank: usize,
        world_size: usize,
        device: usize,
        id: &[u8],
        config: &CommConfig,
    ) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument {
                op: Op::Rendezvous,
                detail: format!("rank {rank} is out of range for world_size {world_size}"),
            });
        }
        probe()?;
        let id = id_from_bytes(id)?;
        let (ctx, stream) = guarded("opening the CUDA device", || {
            let ctx = CudaContext::new(device)
                .map_err(|e| unavailable(format!("cannot open CUDA device {device}: {e}")))?;
            let stream = ctx.new_stream().map_err(|e| {
                unavailable(format!(
                    "cannot create a CUDA stream on device {device}: {e}"
                ))
            })?;
            Ok((ctx, stream))
        })?;

        // ncclCommInitRank blocks until every rank joined: wait on a helper thread.
        let (tx, rx) = mpsc::channel();
        let (tctx, tstream) = (ctx.clone(), stream.clone());
        std::thread::Builder::new()
            .name(format!("nccl-init-rank{rank}"))
            .spawn(move || {
                let r = guarded("ncclCommInitRank", || {
                    tctx.bind_to_thread()
                        .map_err(|e| unavailable(format!("binding device {device}: {e}")))?;
                    Comm::from_rank(tstream, rank, world_size, id)
                        .map(OwnedComm)
                        .map_err(|e| unavailable(format!("ncclCommInitRank failed: {:?}", e.0)))
                });
                let _ = tx.send(r);
            })
            .map_err(|e| Error::Io {
                op: Op::Rendezvous,
                rank,
                peer: None,
                context: "spawning the NCCL init thread".into(),
                source: e,
            })?;
        let comm = match rx.recv_timeout(config.timeout) {
            Ok(r) => r?,
            Err(_) => {
                return Err(Error::Timeout {
                    op: Op::Rendezvous,
                    rank,
                    peer: None,
                    timeout: config.timeout,
                    detail: "; ncclCommInitRank did not complete: some rank never joined \
                             (check every rank got the same unique id and world size)"
                        .into(),
                })
            }
        };
        let mut me = Self {
            rank,
            world: world_size,
            timeout: config.timeout,
            ctx,
            stream,
            comm: Some(comm),
            seq: 0,
            broken: None,
        };
        me.barrier()?;
        Ok(me)
    }

    /// The CUDA device ordinal this rank uses.
    pub fn device(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The underlying cudarc communicator, for device-resident collectives.
    /// `None` after an error aborted it.
    pub fn comm(&self) -> Option<&Comm> {
        self.comm.as_ref().map(|c| &c.0)
    }

    /// The stream all ops run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn begin(&mut self, op: Op) -> Result<u64> {
        if let Some(cause) = &self.broken {
            return Err(unavailable(format!(
                "{op} refused on rank {}: an earlier op failed ({cause}); build a new communicator",
                self.rank
            )));
        }
        self.seq += 1;
        Ok(self.seq)
    }

    fn finish<T>(&mut self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.broken = Some(e.to_string());
            if let Some(c) = self.comm.take() {
                // Dropping aborts the NCCL communicator, which releases kernels
                // still waiting for peers; cudarc panics if the abort itself fails.
                let _ = catch_unwind(AssertUnwindSafe(move || drop(c)));
            }
        }
        r
    }

    fn err(&self, op: Op, what: &str, detail: String) -> Error {
        Error::Io {
            op,
            rank: self.rank,
            peer: None,
            context: what.to_string(),
            source: std::io::Error::other(detail),
        }
    }

    fn parts(&self, op: Op) -> Result<(&Comm, &Arc<CudaStream>)> {
        let comm = self
            .comm
            .as_ref()
            .ok_or_else(|| unavailable(format!("{op}: the NCCL communicator was aborted")))?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.err(op, "binding the CUDA context", e.to_string()))?;
        Ok((&comm.0, &self.stream))
    }

    /// Waits for the work enqueued so far, up to the timeout.
    fn wait(&self, op: Op) -> Result<()> {
        let ev = self
            .stream
            .record_event(None)
            .map_err(|e| self.err(op, "recording a CUDA event", e.to_string()))?;
        let deadline = Instant::now() + self.timeout;
        let mut nap = Duration::from_micros(20);
        loop {
            match ev.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.err(op, "waiting for the NCCL kernel", e.to_string())),
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    op,
                    rank: self.rank,
                    peer: None,
                    timeout: self.timeout,
                    detail:
                        "; NCCL does not report which rank is missing: check the other ranks' logs"
                            .into(),
                });
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(2));
        }
    }

    fn to_device<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        op: Op,
        host: &[T],
    ) -> Result<CudaSlice<T>> {
        self.stream
            .clone_htod(host)
            .map_err(|e| self.err(op, "copying to the device", e.to_string()))
    }

    fn to_host<T: DeviceRepr>(&self, op: Op, dev: &CudaSlice<T>, host: &mut [T]) -> Result<()> {
        self.stream
            .memcpy_dtoh(dev, host)
            .map_err(|e| self.err(op, "copying to the host", e.to_string()))?;
        self.stream
            .synchronize()
            .map_err(|e| self.err(op, "synchronizing the stream", e.to_string()))
    }

    fn nccl_err(&self, op: Op, e: cudarc::nccl::result::NcclError) -> Error {
        self.err(op, "NCCL call failed", format!("{:?}", e.0))
    }

    /// All-gathers fixed-size byte blocks (each rank's `mine` has the same length).
    fn gather_fixed(&self, op: Op, mine: &[u8]) -> Result<Vec<u8>> {
        let (comm, stream) = self.parts(op)?;
        let src = self.to_device(op, mine)?;
        let mut dst = stream
            .alloc_zeros::<u8>(mine.len() * self.world)
            .map_err(|e| self.err(op, "allocating device memory", e.to_string()))?;
        comm.all_gather(&src, &mut dst)
            .map_err(|e| self.nccl_err(op, e))?;
        self.wait(op)?;
        let mut out = vec![0u8; mine.len() * self.world];
        self.to_host(op, &dst, &mut out)?;
        Ok(out)
    }

    /// All ranks agree on (op, seq, len, root, aux) or every rank gets a Mismatch.
    fn check_header(
        &self,
        op: Op,
        seq: u64,
        len: u64,
        root: usize,
        aux: u8,
        fixed_len: bool,
    ) -> Result<()> {
        let mut h = [0u8; HDR_LEN];
        h[0] = op.wire_id();
        h[1] = aux;
        h[4..8].copy_from_slice(&(root as u32).to_le_bytes());
        h[8..16].copy_from_slice(&seq.to_le_bytes());
        h[16..24].copy_from_slice(&len.to_le_bytes());
        let all = self.gather_fixed(op, &h)?;
        for (peer, theirs) in all.chunks_exact(HDR_LEN).enumerate() {
            let field = |b: &[u8], r: std::ops::Range<usize>| {
                let mut a = [0u8; 8];
                a[..r.len()].copy_from_slice(&b[r]);
                u64::from_le_bytes(a)
            };
            let same = theirs[0] == h[0]
                && theirs[1] == h[1]
                && theirs[4..16] == h[4..16]
                && (!fixed_len || theirs[16..24] == h[16..24]);
            if !same {
                let d = |b: &[u8]| {
                    format!(
                        "{} #{} of {} bytes (root {}, aux {})",
                        Op::from_wire_id(b[0])
                            .map_or("an unknown op".to_string(), |o| o.to_string()),
                        field(b, 8..16),
                        field(b, 16..24),
                        field(b, 4..8),
                        b[1]
                    )
                };
                return Err(Error::Mismatch {
                    op,
                    rank: self.rank,
                    peer: Some(peer),
                    detail: format!(
                        "this rank called {} but rank {peer} called {}; every rank must issue the \
                         same collective calls with equal lengths",
                        d(&h),
                        d(theirs)
                    ),
                });
            }
        }
        Ok(())
    }

    fn broadcast_inner(&mut self, buf: &mut [u8], root: usize, seq: u64) -> Result<()> {
        let op = Op::Broadcast;
        if root >= self.world {
            return Err(Error::InvalidArgument {
                op,
                detail: format!("root {root} is not a rank of a world of {}", self.world),
            });
        }
        self.check_header(op, seq, buf.len() as u64, root, 0, true)?;
        if buf.is_empty() {
            return Ok(());
        }
        let mut dev = self.to_device(op, buf)?;
        let (comm, _) = self.parts(op)?;
        comm.broadcast_in_place(&mut dev, root as i32)
            .map_err(|e| self.nccl_err(op, e))?;
        self.wait(op)?;
        if self.rank != root {
            self.to_host(op, &dev, buf)?;
        }
        Ok(())
    }

    fn all_reduce_inner<T>(&mut self, buf: &mut [T], red: ReduceOp, seq: u64) -> Result<()>
    where
        T: DeviceRepr + ValidAsZeroBits + NcclType + crate::Plain,
    {
        let op = Op::AllReduce;
        let bytes = std::mem::size_of_val(buf) as u64;
        self.check_header(op, seq, bytes, 0, red.wire_id(), true)?;
        if buf.is_empty() {
            return Ok(());
        }
        let mut dev = self.to_device(op, buf)?;
        let nop = nccl_op(red);
        let (comm, _) = self.parts(op)?;
        comm.all_reduce_in_place(&mut dev, &nop)
            .map_err(|e| self.nccl_err(op, e))?;
        self.wait(op)?;
        self.to_host(op, &dev, buf)
    }

    /// `ncclReduceScatter` over the segments padded to equal blocks ([`crate::padded_blocks`]):
    /// each rank sends and receives `(n - 1) / n` of the buffer, half an all-reduce's traffic.
    fn reduce_scatter_inner(
        &mut self,
        buf: &mut [f32],
        counts: &[usize],
        red: ReduceOp,
        seq: u64,
    ) -> Result<()> {
        let op = Op::ReduceScatter;
        crate::check_counts(buf.len(), counts, self.world)?;
        self.check_header(op, seq, buf.len() as u64, 0, red.wire_id(), true)?;
        let (padded, width) = crate::padded_blocks(buf, counts);
        if width == 0 {
            return Ok(());
        }
        let src = self.to_device(op, &padded)?;
        drop(padded);
        let nop = nccl_op(red);
        let (comm, stream) = self.parts(op)?;
        let mut dst = stream
            .alloc_zeros::<f32>(width)
            .map_err(|e| self.err(op, "allocating device memory", e.to_string()))?;
        comm.reduce_scatter(&src, &mut dst, &nop)
            .map_err(|e| self.nccl_err(op, e))?;
        self.wait(op)?;
        let mut mine = vec![0f32; width];
        self.to_host(op, &dst, &mut mine)?;
        let at: usize = counts[..self.rank].iter().sum();
        let n = counts[self.rank];
        buf[at..at + n].copy_from_slice(&mine[..n]);
        Ok(())
    }

    fn gather_inner(&mut self, op: Op, data: &[u8], seq: u64) -> Result<Vec<Vec<u8>>> {
        self.check_header(op, seq, data.len() as u64, 0, 0, false)?;
        let lens = self.gather_fixed(op, &(data.len() as u64).to_le_bytes())?;
        let lens: Vec<usize> = lens
            .chunks_exact(8)
            .enumerate()
            .map(|(peer, c)| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                crate::check_block(op, self.rank, peer, u64::from_le_bytes(a))
            })
            .collect::<Result<_>>()?;
        let max = lens.iter().copied().max().unwrap_or(0);
        if max == 0 {
            return Ok(vec![Vec::new(); self.world]);
        }
        let mut padded = vec![0u8; max];
        padded[..data.len()].copy_from_slice(data);
        let all = self.gather_fixed(op, &padded)?;
        Ok(all
            .chunks_exact(max)
            .zip(&lens)
            .map(|(c, &l)| c[..l].to_vec())
            .collect())
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        if let Some(c) = self.comm.take() {
            // cudarc aborts the NCCL communicator on drop and panics if that fails;
            // a destructor must not unwind.
            let _ = catch_unwind(AssertUnwindSafe(move || drop(c)));
        }
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<()> {
        let seq = self.begin(Op::Broadcast)?;
        let r = self.broadcast_inner(buf, root, seq);
        self.finish(r)
    }

    fn all_reduce_f32(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        let seq = self.begin(Op::AllReduce)?;
        let r = self.all_reduce_inner(buf, op, seq);
        self.finish(r)
    }

    fn all_reduce_f64(&mut self, buf: &mut [f64], op: ReduceOp) -> Result<()> {
        let seq = self.begin(Op::AllReduce)?;
        let r = self.all_reduce_inner(buf, op, seq);
        self.finish(r)
    }

    fn reduce_scatter_f32(
        &mut self,
        buf: &mut [f32],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let seq = self.begin(Op::ReduceScatter)?;
        let r = self.reduce_scatter_inner(buf, counts, op, seq);
        self.finish(r)
    }

    fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let seq = self.begin(Op::AllGather)?;
        let r = self.gather_inner(Op::AllGather, data, seq);
        self.finish(r)
    }

    fn barrier(&mut self) -> Result<()> {
        let seq = self.begin(Op::Barrier)?;
        // The header all-gather is itself a full synchronisation point.
        let r = self.check_header(Op::Barrier, seq, 0, 0, 0, true);
        self.finish(r)
    }
}
