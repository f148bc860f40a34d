//! NCCL backend (feature `nccl`): the [`Communicator`] trait over NCCL through
//! cudarc, staging host slices through device buffers.
//!
//! Rank 0 creates a unique id with [`unique_id`]; the caller ships its 128 bytes
//! to the other ranks (a KV store) and every rank calls [`NcclCommunicator::new`].
//!
//! cudarc either links `libnccl.so.2` (with candle's `cuda` feature) or loads NCCL at
//! run time and panics when it is missing, so [`probe`] first checks with `dlopen` for the
//! names this build needs and turns their absence into [`Error::Unavailable`] with install
//! advice; construction additionally runs under `catch_unwind`.
//!
//! Timeouts: NCCL kernels wait for peers on the GPU, so every op enqueues its
//! collective, records an event, and polls it until [`CommConfig::timeout`]; on
//! expiry the NCCL communicator is aborted (which frees the stuck kernels) and the
//! op fails with [`Error::Timeout`]. NCCL does not say which rank is missing.
//! Communicator creation (`ncclCommInitRank`, which blocks until all ranks join)
//! runs on a helper thread with the same timeout; on expiry that thread is left
//! blocked inside NCCL and the error is returned.
//!
//! Every op first all-gathers a 32-byte header ([`crate::op_header`]: op, sequence number,
//! root, reduction, element type and count) so calls that disagree across ranks fail with
//! [`Error::Mismatch`] naming both calls instead of corrupting data or hanging.
//!
//! NaN: NCCL's Max drops NaN (Max of NaN and x is x), while [`ReduceOp::Max`] promises NaN
//! wherever any rank has one. Each rank flags a NaN in its header; only when some rank did,
//! a second all-reduce (Max over a `u8` mask, one byte per element) marks the elements to
//! set back to NaN afterwards. Without NaN the check costs a scan of the host buffer.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{Comm, NcclType};

use crate::error::{Error, Op, Result};
use crate::op_header::{apply_nan_mask, nan_mask, Counts, ElemType, Float, OpHeader, HDR_LEN};
use crate::{CommConfig, Communicator, ReduceOp};

const BACKEND: &str = "nccl";
/// Bytes in an NCCL unique id.
pub const ID_BYTES: usize = 128;

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
    /// This rank's claim on its GPU for the group (none in a world of one).
    _claim: Option<crate::nccl_init::GpuClaim>,
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
    ///
    /// A world of one opens no NCCL communicator: every collective returns its input.
    /// Before init the rank claims its GPU for the group ([`crate::nccl_init::GpuClaim`]),
    /// so a second rank of the group on the same GPU is refused naming NCCL's
    /// one-rank-per-GPU rule. Init waits up to [`CommConfig::timeout`], which is also every
    /// op's timeout.
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

        if world_size == 1 {
            return Ok(Self {
                rank,
                world: 1,
                timeout: config.timeout,
                ctx,
                stream,
                comm: None,
                seq: 0,
                broken: None,
                _claim: None,
            });
        }
        let uuid = ctx
            .uuid()
            .map_err(|e| unavailable(format!("reading the UUID of CUDA device {device}: {e}")))?;
        let gpu = format!(
            "GPU-{}",
            uuid.bytes
                .iter()
                .map(|b| format!("{:02x}", *b as u8))
                .collect::<String>()
        );
        let id_bytes = id_to_bytes(&id);
        let claim = crate::nccl_init::GpuClaim::take(
            &crate::nccl_init::claim_dir(),
            &id_bytes,
            &gpu,
            rank,
        )?;
        tracing::info!(
            "NCCL rank {rank} of {world_size} joining group {:016x} on CUDA device {device} ({gpu})",
            crate::nccl_init::id_digest(&id_bytes)
        );

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
                    detail: crate::nccl_init::init_timeout_detail(
                        rank,
                        world_size,
                        &id_bytes,
                        config.timeout,
                        &crate::nccl_init::nccl_env_summary(|k| std::env::var(k).ok()),
                    ),
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
            _claim: Some(claim),
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

    /// All ranks agree on `h` (op, seq, root, reduction, element type and, with
    /// [`Counts::Equal`], count) or every rank gets a Mismatch naming both calls. Returns
    /// whether any rank flagged a NaN.
    fn check_header(&self, h: OpHeader, counts: Counts) -> Result<bool> {
        let all = self.gather_fixed(h.op, &h.encode())?;
        debug_assert_eq!(all.len(), HDR_LEN * self.world);
        h.check_all(&all, counts, self.rank)
    }

    /// The header of an op on this rank.
    fn header(&self, op: Op, seq: u64, elem: ElemType, count: usize) -> OpHeader {
        OpHeader {
            op,
            red: None,
            elem,
            root: 0,
            seq,
            count: count as u64,
            counts_digest: 0,
            has_nan: false,
            unstaged: false,
        }
    }

    /// Device buffers made before the header: a failure is logged here and flagged in the
    /// header ([`OpHeader::unstaged`]), so every rank fails the op together.
    fn staged<T>(&self, op: Op, r: Result<T>) -> (Option<T>, bool) {
        match r {
            Ok(v) => (Some(v), false),
            Err(e) => {
                tracing::warn!("NCCL rank {}: {op} could not stage: {e}", self.rank);
                (None, true)
            }
        }
    }

    /// After a Max whose header said some rank holds a NaN: Max-reduces the NaN mask of
    /// `input` (this rank's values before the reduction) and sets those elements of
    /// `out` to NaN.
    fn restore_nan<T: Float>(&self, op: Op, input_mask: Vec<u8>, out: &mut [T]) -> Result<()> {
        let mut dev = self.to_device(op, &input_mask)?;
        let (comm, _) = self.parts(op)?;
        comm.all_reduce_in_place(&mut dev, &cudarc::nccl::ReduceOp::Max)
            .map_err(|e| self.nccl_err(op, e))?;
        self.wait(op)?;
        let mut mask = input_mask;
        self.to_host(op, &dev, &mut mask)?;
        apply_nan_mask(out, &mask);
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
        let (dev, unstaged) = if buf.is_empty() {
            (None, false)
        } else {
            let r = self.to_device(op, buf);
            self.staged(op, r)
        };
        let h = OpHeader {
            root: root as u32,
            unstaged,
            ..self.header(op, seq, ElemType::U8, buf.len())
        };
        self.check_header(h, Counts::Equal)?;
        let Some(mut dev) = dev else {
            return Ok(());
        };
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
        T: DeviceRepr + ValidAsZeroBits + NcclType + crate::Plain + Float,
    {
        let op = Op::AllReduce;
        let (dev, unstaged) = if buf.is_empty() {
            (None, false)
        } else {
            let r = self.to_device(op, buf);
            self.staged(op, r)
        };
        let h = OpHeader {
            red: Some(red),
            has_nan: red == ReduceOp::Max && buf.iter().any(|v| v.is_nan()),
            unstaged,
            ..self.header(op, seq, T::ELEM, buf.len())
        };
        let any_nan = self.check_header(h, Counts::Equal)?;
        let Some(mut dev) = dev else {
            return Ok(());
        };
        let mask = (any_nan && red == ReduceOp::Max).then(|| nan_mask(buf));
        let nop = nccl_op(red);
        let (comm, _) = self.parts(op)?;
        comm.all_reduce_in_place(&mut dev, &nop)
            .map_err(|e| self.nccl_err(op, e))?;
        self.wait(op)?;
        self.to_host(op, &dev, buf)?;
        match mask {
            Some(mask) => self.restore_nan(op, mask, buf),
            None => Ok(()),
        }
    }

    /// One in-place `ncclReduce` per rank with a non-empty segment, to that rank
    /// ([`crate::uneven`]), over one device copy of the buffer: each rank sends about
    /// `(n - 1) / n` of it, as `ncclReduceScatter` would, but nothing is padded to the
    /// largest segment (ZeRO's segments are as uneven as its parameter shares).
    fn reduce_scatter_inner(
        &mut self,
        buf: &mut [f32],
        counts: &[usize],
        red: ReduceOp,
        seq: u64,
    ) -> Result<()> {
        let op = Op::ReduceScatter;
        crate::check_counts(buf.len(), counts, self.world)?;
        let plan = crate::uneven::UnevenPlan::new(counts);
        let (whole, unstaged) = if plan.payload == 0 {
            (None, false)
        } else {
            let r = self.to_device(op, buf);
            self.staged(op, r)
        };
        let h = OpHeader {
            red: Some(red),
            counts_digest: crate::op_header::counts_digest(counts),
            has_nan: red == ReduceOp::Max && buf.iter().any(|v| v.is_nan()),
            unstaged,
            ..self.header(op, seq, ElemType::F32, buf.len())
        };
        let any_nan = self.check_header(h, Counts::Equal)?;
        let Some(mut whole) = whole else {
            return Ok(());
        };
        let mask = (any_nan && red == ReduceOp::Max).then(|| nan_mask(buf));
        let nop = nccl_op(red);
        let (comm, _) = self.parts(op)?;
        for step in &plan.steps {
            let mut block = whole.slice_mut(step.offset..step.offset + step.len);
            comm.reduce_in_place(&mut block, &nop, step.root as i32)
                .map_err(|e| self.nccl_err(op, e))?;
        }
        self.wait(op)?;
        let (at, n) = (plan.offset_of(self.rank), counts[self.rank]);
        if n > 0 {
            let mut mine = vec![0f32; n];
            self.stream
                .memcpy_dtoh(&whole.slice(at..at + n), &mut mine)
                .map_err(|e| self.err(op, "copying to the host", e.to_string()))?;
            self.stream
                .synchronize()
                .map_err(|e| self.err(op, "synchronizing the stream", e.to_string()))?;
            buf[at..at + n].copy_from_slice(&mine);
        }
        match mask {
            // The whole buffer's mask: every rank's segment gets its NaN back.
            Some(mask) => self.restore_nan(op, mask, buf),
            None => Ok(()),
        }
    }

    fn gather_inner(&mut self, op: Op, data: &[u8], seq: u64) -> Result<Vec<Vec<u8>>> {
        self.check_header(
            self.header(op, seq, ElemType::U8, data.len()),
            Counts::MayDiffer,
        )?;
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
        // Per-rank broadcasts into one buffer of the payload ([`crate::uneven`]), not NCCL's
        // equal-block all_gather, which would stage every block padded to the largest.
        let plan = crate::uneven::UnevenPlan::new(&lens);
        if plan.payload == 0 {
            return Ok(vec![Vec::new(); self.world]);
        }
        let (comm, stream) = self.parts(op)?;
        let mut whole = stream
            .alloc_zeros::<u8>(plan.gather_staging())
            .map_err(|e| self.err(op, "allocating device memory", e.to_string()))?;
        if !data.is_empty() {
            let at = plan.offset_of(self.rank);
            let mut mine = whole.slice_mut(at..at + data.len());
            stream
                .memcpy_htod(data, &mut mine)
                .map_err(|e| self.err(op, "copying to the device", e.to_string()))?;
        }
        for step in &plan.steps {
            let mut block = whole.slice_mut(step.offset..step.offset + step.len);
            comm.broadcast_in_place(&mut block, step.root as i32)
                .map_err(|e| self.nccl_err(op, e))?;
        }
        self.wait(op)?;
        let mut all = vec![0u8; plan.payload];
        self.to_host(op, &whole, &mut all)?;
        let mut at = 0;
        Ok(lens
            .iter()
            .map(|&l| {
                at += l;
                all[at - l..at].to_vec()
            })
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
        if self.world == 1 && root == 0 {
            return Ok(());
        }
        let seq = self.begin(Op::Broadcast)?;
        let r = self.broadcast_inner(buf, root, seq);
        self.finish(r)
    }

    fn all_reduce_f32(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        let seq = self.begin(Op::AllReduce)?;
        let r = self.all_reduce_inner(buf, op, seq);
        self.finish(r)
    }

    fn all_reduce_f64(&mut self, buf: &mut [f64], op: ReduceOp) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
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
        if self.world == 1 {
            return crate::check_counts(buf.len(), counts, 1);
        }
        let seq = self.begin(Op::ReduceScatter)?;
        let r = self.reduce_scatter_inner(buf, counts, op, seq);
        self.finish(r)
    }

    fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        if self.world == 1 {
            return Ok(vec![data.to_vec()]);
        }
        let seq = self.begin(Op::AllGather)?;
        let r = self.gather_inner(Op::AllGather, data, seq);
        self.finish(r)
    }

    fn barrier(&mut self) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        let seq = self.begin(Op::Barrier)?;
        // The header all-gather is itself a full synchronisation point.
        let r = self
            .check_header(
                self.header(Op::Barrier, seq, ElemType::U8, 0),
                Counts::Equal,
            )
            .map(|_| ());
        self.finish(r)
    }
}
