//! Trainer → rollout weight sync through device memory handed over by handle (CUDA IPC) when
//! every rank of the sync computes on a GPU of one node: the trainer copies its weights into
//! one exported GPU buffer bucket by bucket, the rollout ranks map that buffer once and copy
//! each bucket straight into their own GPU memory. No byte crosses the host; the
//! communicator (shared memory, which already proves every rank is on this node) carries
//! only the control: one offer per rank, the handle, two barriers per bucket, the checksums.
//!
//! Why: the host path copies every weight GPU → host, through the segment, host → GPU, in
//! f32 (twice a bf16 model's bytes). OpenRLHF and slime hand weights over on a node the same
//! way.
//!
//! Every sync starts with [`negotiate`] on every rank (an all-gather of offers), so the ranks
//! agree on the path without another message: CUDA IPC when every rank offers it over a
//! shared-memory communicator, else the host path. A rank that cannot open the trainer's
//! handle says why in one more all-gather and every rank takes the host path instead (and
//! stops offering IPC); the reason is logged once. The bytes are checksummed where they live:
//! the trainer hashes what it sends, each rollout what it installs ([`rlhf_model::ipc::hash`],
//! a kernel on the GPU), and every rank checks every sum against the trainer's.

use std::time::Instant;

use candle_core::{DType, Tensor};
use rlhf_collective::{Communicator, SyncStats};
use rlhf_model::ipc::{self, Dest, Handle, Mapped, Region, HANDLE_BYTES};
use rlhf_model::Model;

use crate::error::{Ctx, Error, Result};

/// Bucket of a sync when the request gives none: the size of the trainer's exported buffer.
pub const DEFAULT_BUCKET_BYTES: usize = 256 << 20;
const OFFER_VERSION: u8 = 1;
const SETUP_BYTES: usize = HANDLE_BYTES + 3 * 8;

/// What a trainer or rollout rank keeps between syncs.
#[derive(Default)]
pub struct IpcState {
    /// The trainer's exported buffer.
    region: Option<Region>,
    /// A rollout's mapping of the trainer's buffer, under its handle.
    mapped: Option<(Handle, Mapped)>,
    /// Why this rank stopped offering CUDA IPC (a failed open), once set.
    disabled: Option<String>,
    /// The path of the last sync (true: CUDA IPC), logged when it changes.
    logged: Option<bool>,
    /// Offer no IPC: the sync goes through the communicator (benchmarks compare the two).
    pub prefer_host: bool,
    /// Seconds spent in each phase of the last IPC sync on this rank.
    phases: Vec<(&'static str, f64)>,
    /// Tests only: let CPU ranks take this protocol (process-local regions).
    #[doc(hidden)]
    pub allow_cpu: bool,
}

impl IpcState {
    /// Whether the last sync went through CUDA IPC (`None` before the first).
    pub fn last_was_ipc(&self) -> Option<bool> {
        self.logged
    }

    /// Seconds per phase of the last CUDA IPC sync on this rank (benchmarks print them).
    pub fn last_phases(&self) -> &[(&'static str, f64)] {
        &self.phases
    }

    fn log_once(&mut self, ipc: bool, why: &str) {
        if self.logged != Some(ipc) {
            self.logged = Some(ipc);
            if ipc {
                tracing::info!("weight sync data: CUDA IPC ({why})");
            } else if !why.is_empty() {
                tracing::info!("weight sync data: through the communicator ({why})");
            }
        }
    }
}

fn dtype_code(d: DType) -> u8 {
    match d {
        DType::BF16 => 1,
        DType::F16 => 2,
        DType::F32 => 3,
        DType::F64 => 4,
        _ => 0,
    }
}

fn dtype_of(code: u8) -> Option<DType> {
    Some(match code {
        1 => DType::BF16,
        2 => DType::F16,
        3 => DType::F32,
        4 => DType::F64,
        _ => return None,
    })
}

/// The agreed path of one sync: `Some(wire dtype)` for CUDA IPC, `None` for the host path.
/// Every rank of the sync calls it first, with the same communicator.
pub fn negotiate(
    model: &Model,
    comm: &mut dyn Communicator,
    st: &mut IpcState,
) -> Result<Option<DType>> {
    let dev = model.device();
    let can = !st.prefer_host
        && st.disabled.is_none()
        && comm.backend() == "shm"
        && model.zero3().is_none()
        && (ipc::supported(dev) || (st.allow_cpu && dev.is_cpu()));
    let offer = [OFFER_VERSION, u8::from(can), dtype_code(model.dtype())];
    let offers = comm
        .all_gather(&offer)
        .ctx("agreeing on the weight sync path")?;
    let all = offers
        .iter()
        .all(|o| o.len() == offer.len() && o[0] == OFFER_VERSION && o[1] == 1);
    // The receivers' dtype is the wire's, so the first receiver installs without a cast.
    let wire = offers
        .get(1)
        .and_then(|o| o.get(2))
        .copied()
        .and_then(dtype_of);
    match (all, wire) {
        (true, Some(w)) => Ok(Some(w)),
        _ => {
            let why = match &st.disabled {
                Some(r) => r.clone(),
                None if comm.backend() != "shm" => String::new(),
                None => "not every rank of the sync computes on a GPU".into(),
            };
            st.log_once(false, &why);
            Ok(None)
        }
    }
}

/// Wall time per named phase, summed over its laps.
struct Phases {
    last: Instant,
    sums: Vec<(&'static str, f64)>,
}

impl Phases {
    fn new(start: Instant) -> Self {
        Phases {
            last: start,
            sums: Vec::new(),
        }
    }

    fn lap(&mut self, name: &'static str) {
        let now = Instant::now();
        let dt = (now - self.last).as_secs_f64();
        self.last = now;
        match self.sums.iter_mut().find(|(n, _)| *n == name) {
            Some((_, s)) => *s += dt,
            None => self.sums.push((name, dt)),
        }
    }

    fn done(self) -> Vec<(&'static str, f64)> {
        self.sums
    }
}

/// Where each parameter lies in the byte stream of the sync.
struct Layout {
    /// (byte offset, byte length) per parameter, in parameter order.
    spans: Vec<(usize, usize)>,
    total: usize,
    /// A hash of the names, shapes and wire dtype: both sides must agree on it.
    manifest: u64,
}

impl Layout {
    /// Where parameter `i` starts, in the hash's 16-bit units.
    fn base(&self, i: usize) -> u64 {
        (self.spans[i].0 / 2) as u64
    }

    /// Whether a piece `from..from + len` of parameter `i` is its last.
    fn ends(&self, i: usize, from: usize, len: usize) -> bool {
        from + len == self.spans[i].1
    }
}

fn layout(tensors: &[(String, Tensor)], wire: DType) -> Layout {
    let mut spans = Vec::with_capacity(tensors.len());
    let mut total = 0;
    let mut m = rlhf_model::ipc::hash_bytes(&[dtype_code(wire), 0], 0);
    for (i, (name, t)) in tensors.iter().enumerate() {
        let len = t.elem_count() * wire.size_in_bytes();
        spans.push((total, len));
        total += len;
        let mut desc = name.clone().into_bytes();
        for d in t.dims() {
            desc.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        if desc.len() % 2 == 1 {
            desc.push(0);
        }
        m = m.wrapping_add(rlhf_model::ipc::hash_bytes(&desc, (i as u64) << 40));
    }
    Layout {
        spans,
        total,
        manifest: m,
    }
}

/// The pieces of the parameters that fall in bucket `b` of `slot` bytes: (parameter, byte
/// in the parameter, byte in the slot, length).
fn pieces(l: &Layout, b: usize, slot: usize) -> Vec<(usize, usize, usize, usize)> {
    let (lo, hi) = (b * slot, ((b + 1) * slot).min(l.total));
    l.spans
        .iter()
        .enumerate()
        .filter_map(|(i, &(off, len))| {
            let (a, z) = (off.max(lo), (off + len).min(hi));
            (a < z).then(|| (i, a - off, a - lo, z - a))
        })
        .collect()
}

/// Every rank's checksum against the trainer's (rank 0): an error names the rollout rank.
fn agree(comm: &mut dyn Communicator, sum: u64) -> Result<()> {
    let sums = comm
        .all_gather(&sum.to_le_bytes())
        .ctx("comparing the checksums of the CUDA IPC weight sync")?;
    let read = |s: &[u8]| s.try_into().map(u64::from_le_bytes).unwrap_or(0);
    let root = read(&sums[0]);
    for (r, s) in sums.iter().enumerate().skip(1) {
        if read(s) != root {
            return Err(Error::internal(format!(
                "CUDA IPC weight sync: rollout rank {} installed weights with checksum {:016x}, the trainer sent {root:016x}",
                r - 1,
                read(s)
            )));
        }
    }
    Ok(())
}

/// One message each way after the handle went out: "" when this rank mapped it, else why not.
/// Returns the first failure of any rank.
fn opened(comm: &mut dyn Communicator, mine: Option<&str>) -> Result<Option<String>> {
    let all = comm
        .all_gather(mine.unwrap_or("").as_bytes())
        .ctx("agreeing whether every rank mapped the trainer's GPU memory")?;
    Ok(all
        .iter()
        .enumerate()
        .find(|(_, m)| !m.is_empty())
        .map(|(r, m)| {
            format!(
                "rollout rank {} could not map the trainer's GPU memory: {}",
                r.saturating_sub(1),
                String::from_utf8_lossy(m)
            )
        }))
}

/// Trainer side (rank 0) after [`negotiate`] chose IPC. `Ok(None)`: a receiver could not map
/// the buffer; the caller takes the host path.
pub fn send(
    model: &Model,
    comm: &mut dyn Communicator,
    wire: DType,
    bucket_bytes: usize,
    st: &mut IpcState,
) -> Result<Option<(SyncStats, u64)>> {
    let start = Instant::now();
    let params = model.named_tensors();
    let l = layout(&params, wire);
    let slot = l.total.clamp(1, bucket_bytes.max(1));
    if st.region.as_ref().is_none_or(|r| r.len() != slot) {
        st.region = None;
        match Region::new(model.device(), slot) {
            Ok(r) => st.region = Some(r),
            Err(e) => {
                // No buffer (the GPU is full): a setup with no slot sends every rank to the
                // host path, this sync and the next ones.
                let why = format!("the trainer cannot export a {slot}-byte GPU buffer: {e}");
                comm.broadcast(&mut [0u8; SETUP_BYTES], 0)
                    .ctx("telling the rollouts the weight buffer is missing")?;
                st.disabled = Some(why.clone());
                st.log_once(false, &why);
                return Ok(None);
            }
        }
    }
    let region = st
        .region
        .as_ref()
        .ok_or_else(|| Error::internal("no region"))?;
    let mut setup = region.handle().to_vec();
    for v in [slot as u64, l.total as u64, l.manifest] {
        setup.extend_from_slice(&v.to_le_bytes());
    }
    comm.broadcast(&mut setup, 0)
        .ctx("sending the weight buffer's handle")?;
    if let Some(why) = opened(comm, None)? {
        st.disabled = Some(why.clone());
        st.log_once(false, &why);
        return Ok(None);
    }
    let mut clock = Phases::new(start);
    clock.lap("setup");
    let mut hasher = ipc::Hasher::default();
    // Each parameter in the wire's dtype, made (and hashed) at its first piece and dropped
    // once its last piece is in the buffer: under mixed precision (f32 weights, a bf16
    // rollout) the trainer never holds a second copy of the whole model.
    let mut wired: Vec<Option<Tensor>> = vec![None; params.len()];
    let buckets = l.total.div_ceil(slot);
    for b in 0..buckets {
        let ps = pieces(&l, b, slot);
        for &(i, from, at, len) in &ps {
            if wired[i].is_none() {
                let t = params[i].1.to_dtype(wire)?.contiguous()?;
                hasher.add(&t, l.base(i))?;
                wired[i] = Some(t);
            }
            if let Some(t) = &wired[i] {
                region.write(at, t, from, len)?;
            }
        }
        region.flush()?;
        for &(i, from, _, len) in &ps {
            if l.ends(i, from, len) {
                wired[i] = None;
            }
        }
        clock.lap("pack");
        comm.barrier().ctx("announcing a weight bucket")?;
        comm.barrier()
            .ctx("waiting for the rollouts to copy a weight bucket")?;
        clock.lap("wait");
    }
    let sum = hasher.finish()?;
    clock.lap("hash");
    agree(comm, sum)?;
    clock.lap("agree");
    st.phases = clock.done();
    st.log_once(
        true,
        &format!(
            "every rank on a GPU of this node; {} MiB buffer",
            slot >> 20
        ),
    );
    Ok(Some((
        SyncStats {
            params: params.len(),
            bytes: l.total as u64,
            buckets,
            elapsed: start.elapsed(),
        },
        sum,
    )))
}

/// Rollout side after [`negotiate`] chose IPC: maps the trainer's buffer (once per handle),
/// copies every bucket into new tensors and installs each parameter as soon as it is whole.
/// `Ok(None)`: some rank could not map the buffer; the caller takes the host path.
pub fn recv(
    model: &Model,
    comm: &mut dyn Communicator,
    wire: DType,
    st: &mut IpcState,
) -> Result<Option<(SyncStats, u64)>> {
    let start = Instant::now();
    let names = model.named_tensors();
    let l = layout(&names, wire);
    let mut setup = vec![0u8; SETUP_BYTES];
    comm.broadcast(&mut setup, 0)
        .ctx("receiving the weight buffer's handle")?;
    let handle: Handle = setup[..HANDLE_BYTES]
        .try_into()
        .map_err(|_| Error::internal("short handle"))?;
    let word = |k: usize| {
        let at = HANDLE_BYTES + 8 * k;
        u64::from_le_bytes(setup[at..at + 8].try_into().unwrap_or([0; 8])) as usize
    };
    let (slot, total, manifest) = (word(0), word(1), word(2) as u64);
    if slot == 0 {
        // The trainer has no buffer to hand over; it logged why.
        st.log_once(false, "the trainer could not export its GPU buffer");
        return Ok(None);
    }
    let mut failed = None;
    if total != l.total || manifest != l.manifest {
        failed = Some(format!(
            "the trainer sends {total} bytes of other parameters than this model's {} bytes \
             (names, shapes or dtype differ): the actor's trainer and rollout must load the same model",
            l.total
        ));
    } else if st
        .mapped
        .as_ref()
        .is_none_or(|(h, m)| *h != handle || m.len() != slot)
    {
        st.mapped = None;
        match Mapped::open(model.device(), &handle, slot) {
            Ok(m) => st.mapped = Some((handle, m)),
            Err(e) => failed = Some(e.to_string()),
        }
    }
    if let Some(why) = opened(comm, failed.as_deref())? {
        // The host path that every rank takes now checks the parameter lists itself and
        // names a difference; a failed open stops this rank offering IPC.
        if failed.is_some() && total == l.total && manifest == l.manifest {
            st.disabled = Some(why.clone());
        }
        st.log_once(false, &why);
        return Ok(None);
    }
    let mapped = &st
        .mapped
        .as_ref()
        .ok_or_else(|| Error::internal("no mapping"))?
        .1;
    let device = model.device();
    let mut dests: Vec<Option<Dest>> = (0..names.len()).map(|_| None).collect();
    // A GPU parameter already in the wire's dtype takes the bytes in place: no second copy.
    let in_place: Vec<bool> = names
        .iter()
        .map(|(_, t)| device.is_cuda() && t.dtype() == wire && t.is_contiguous())
        .collect();
    let mut hasher = ipc::Hasher::default();
    let buckets = total.div_ceil(slot.max(1));
    let mut clock = Phases::new(start);
    clock.lap("setup");
    for b in 0..buckets {
        comm.barrier().ctx("waiting for a weight bucket")?;
        clock.lap("wait");
        let ps = pieces(&l, b, slot);
        for &(i, from, at, len) in &ps {
            if in_place[i] {
                mapped.read_over(at, &names[i].1, from, len)?;
                continue;
            }
            if dests[i].is_none() {
                dests[i] = Some(Dest::new(device, wire, names[i].1.dims())?);
            }
            if let Some(d) = dests[i].as_mut() {
                mapped.read(at, d, from, len)?;
            }
        }
        mapped.flush()?;
        clock.lap("copy");
        comm.barrier()
            .ctx("telling the trainer a weight bucket was copied")?;
        clock.lap("wait");
        // Install every parameter whose last byte was in this bucket.
        for &(i, from, _, len) in &ps {
            if !l.ends(i, from, len) {
                continue;
            }
            if in_place[i] {
                hasher.add(&names[i].1, l.base(i))?;
            } else if let Some(d) = dests[i].take() {
                let t = d.finish()?;
                hasher.add(&t, l.base(i))?;
                model
                    .set_weights(&[(names[i].0.clone(), t)])
                    .ctx("installing received weights")?;
            }
        }
    }
    clock.lap("install");
    let sum = hasher.finish()?;
    clock.lap("hash");
    agree(comm, sum)?;
    clock.lap("agree");
    st.phases = clock.done();
    st.log_once(true, "every rank on a GPU of this node");
    Ok(Some((
        SyncStats {
            params: names.len(),
            bytes: total as u64,
            buckets,
            elapsed: start.elapsed(),
        },
        sum,
    )))
}
