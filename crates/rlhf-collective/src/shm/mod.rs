//! Shared-memory communicator for ranks on one host: trainer → rollout weight sync (and
//! every other collective) through memory the ranks map, instead of the TCP stack.
//!
//! Rank 0 makes an anonymous memory file (memfd: it has no name in any filesystem, so
//! nothing is left behind when the processes end, however they end) and publishes its
//! address `memfd:PID/FD`; the other ranks open it through `/proc/PID/fd/FD`, which the
//! kernel allows to processes of the same user only (processes that could read rank 0's
//! memory anyway). With a [`CommSecret`](crate::CommSecret), rank 0 writes an HMAC of the
//! segment's random nonce, every other rank checks it before use and answers with its own
//! tag, which rank 0 checks: a process without the driver's secret cannot join.
//!
//! The segment holds a ring of [`SLOTS`] slots of `slot_bytes` each. Every op is a
//! sequence of messages with one writer each (a broadcast: the root; an all-gather: each
//! rank in turn). Message `s` goes into slot `s % SLOTS` once every rank has consumed
//! message `s - SLOTS`, so the writer fills the next slots while the readers copy out of
//! the earlier ones. A slot's header (sequence, op, root, length) is checked by every
//! reader, so ranks that disagree about the call get a `Mismatch` error instead of wrong
//! bytes. All-reduce is an all-gather followed by the same reduction in rank order on every
//! rank (bit-identical results). Waits poll (spin, yield, then sleep up to 80 µs) against
//! [`CommConfig::timeout`](crate::CommConfig), watch the waited-on peer's process and an
//! abort word a failing rank sets: a dead or failed peer is an error within ~100 ms, never a
//! hang.

mod map;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Op, Result};
use crate::tcp::auth::{self, Side, NONCE_BYTES, TAG_BYTES};
use crate::tcp::Elem;
use crate::{as_bytes, as_bytes_mut, CommConfig, Communicator, ReduceOp};
use map::Mapping;

const BACKEND: &str = "shm";
/// Slots in the ring.
pub const SLOTS: usize = 4;
/// Default slot size: 1 MiB (a 4 MiB segment). Small enough that the ring stays in the
/// CPU cache, so the reader copies out of cache what the writer just put there:
/// weight_sync_bench measured 0.73 of a memcpy's bandwidth for 512 MiB with 1 MiB slots,
/// 0.46 with 8 MiB slots.
pub const DEFAULT_SLOT_BYTES: usize = 1 << 20;
/// Most ranks one segment serves.
pub const MAX_RANKS: usize = 64;
const MAGIC: u64 = u64::from_le_bytes(*b"RLHFSHM1");
/// `RankWord::joined` states.
const CLAIMED: u64 = 1;
const JOINED: u64 = 2;
/// How often a wait looks at the waited-on peer's process.
const LIVENESS_EVERY: Duration = Duration::from_millis(100);

/// One rank's words, on its own cache line.
#[repr(C, align(64))]
struct RankWord {
    pid: AtomicU64,
    joined: AtomicU64,
    /// Sequence number of the last message this rank consumed (or wrote).
    consumed: AtomicU64,
    tag: [AtomicU64; TAG_BYTES / 8],
}

/// What the writer of a slot's message says about it.
#[repr(C, align(64))]
struct SlotMeta {
    /// The message's sequence number; stored last (release), so the rest is visible.
    seq: AtomicU64,
    op: AtomicU64,
    root: AtomicU64,
    /// Total bytes of the op's payload (all its messages).
    len: AtomicU64,
}

/// The segment's first bytes. Every field is atomic: several processes read and write it.
#[repr(C)]
struct Header {
    magic: AtomicU64,
    slots: AtomicU64,
    slot_bytes: AtomicU64,
    world: AtomicU64,
    nonce: [AtomicU64; NONCE_BYTES / 8],
    root_tag: [AtomicU64; TAG_BYTES / 8],
    /// 0, or 1 + the rank that failed an op (its peers stop waiting for it).
    aborted: AtomicU64,
    ranks: [RankWord; MAX_RANKS],
    meta: [SlotMeta; SLOTS],
}

/// Where the slots start: the header rounded up to a page.
const DATA_OFFSET: usize = std::mem::size_of::<Header>().div_ceil(4096) * 4096;

fn store_bytes(words: &[AtomicU64], bytes: &[u8]) {
    for (w, c) in words.iter().zip(bytes.chunks_exact(8)) {
        let mut b = [0u8; 8];
        b.copy_from_slice(c);
        w.store(u64::from_le_bytes(b), Ordering::Relaxed);
    }
}

fn load_bytes(words: &[AtomicU64]) -> Vec<u8> {
    words
        .iter()
        .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes())
        .collect()
}

fn unavailable(reason: String) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        reason,
    }
}

/// The pieces both ends of the handshake tag: the segment's nonce and a rank.
fn transcript(nonce: &[u8], world: usize, rank: usize) -> Vec<u8> {
    let mut t = nonce.to_vec();
    t.extend_from_slice(&(world as u64).to_le_bytes());
    t.extend_from_slice(&(rank as u64).to_le_bytes());
    t
}

/// Rank 0's segment between PrepareComm (made, address published) and JoinComm.
pub struct ShmRendezvous {
    map: Mapping,
    address: String,
}

impl ShmRendezvous {
    /// Makes a segment of [`SLOTS`] slots of `slot_bytes` (rounded up to 64 bytes).
    pub fn create(slot_bytes: usize) -> Result<Self> {
        if slot_bytes == 0 {
            return Err(Error::InvalidArgument {
                op: Op::Rendezvous,
                detail: "shared-memory slot_bytes must be at least 1".into(),
            });
        }
        let slot_bytes = slot_bytes.div_ceil(64) * 64;
        let (map, fd) = Mapping::create(DATA_OFFSET + SLOTS * slot_bytes)
            .map_err(|e| unavailable(format!("cannot make a shared-memory segment: {e}")))?;
        let h = map.header();
        h.slots.store(SLOTS as u64, Ordering::Relaxed);
        h.slot_bytes.store(slot_bytes as u64, Ordering::Relaxed);
        store_bytes(&h.nonce, &auth::nonce());
        h.magic.store(MAGIC, Ordering::Release);
        Ok(Self {
            address: format!("memfd:{}/{fd}", std::process::id()),
            map,
        })
    }

    /// What the other ranks pass to [`ShmCommunicator::connect`].
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Rank 0 joins; returns once all `world` ranks joined (each proving the secret when
    /// the config has one) or fails at the timeout naming the missing rank.
    pub fn accept(self, world: usize, config: CommConfig) -> Result<ShmCommunicator> {
        check_world(world)?;
        let h = self.map.header();
        h.world.store(world as u64, Ordering::Relaxed);
        let nonce = load_bytes(&h.nonce);
        if let Some(secret) = &config.secret {
            let tag = secret.tag(Side::ShmRoot, &transcript(&nonce, world, 0));
            store_bytes(&h.root_tag, &tag);
        }
        let me = &h.ranks[0];
        me.pid
            .store(u64::from(std::process::id()), Ordering::Relaxed);
        me.joined.store(JOINED, Ordering::Release);
        let mut comm = ShmCommunicator::new(0, world, config, self.map);
        let r = comm.wait_joined(|c, r| {
            // Each rank's tag is checked once, when it shows up (rank 0 is this process).
            let Some(secret) = c.config.secret.as_ref().filter(|_| r != 0) else {
                return Ok(());
            };
            let tag = load_bytes(&c.map.header().ranks[r].tag);
            if secret.verify(Side::ShmRank, &transcript(&nonce, world, r), &tag) {
                Ok(())
            } else {
                Err(Error::Auth {
                    rank: 0,
                    peer: Some(r),
                    detail: "the process that joined the shared-memory segment as this rank \
                             does not hold the communicator's secret"
                        .into(),
                })
            }
        });
        comm.finish(r)?;
        Ok(comm)
    }
}

fn check_world(world: usize) -> Result<()> {
    if world == 0 || world > MAX_RANKS {
        return Err(Error::InvalidArgument {
            op: Op::Rendezvous,
            detail: format!("a shared-memory communicator has 1 to {MAX_RANKS} ranks, not {world}"),
        });
    }
    Ok(())
}

/// Parses `memfd:PID/FD`.
fn parse_address(address: &str) -> Result<(u32, u32)> {
    let bad = || {
        Error::InvalidArgument {
        op: Op::Rendezvous,
        detail: format!(
            "'{address}' is not a shared-memory segment address; expected memfd:PID/FD from rank 0's PrepareComm"
        ),
    }
    };
    let rest = address.strip_prefix("memfd:").ok_or_else(bad)?;
    let (pid, fd) = rest.split_once('/').ok_or_else(bad)?;
    Ok((
        pid.parse().map_err(|_| bad())?,
        fd.parse().map_err(|_| bad())?,
    ))
}

/// Whether process `pid` still runs (not gone, not a zombie).
fn alive(pid: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit_once(") ").and_then(|(_, r)| r.chars().next()),
            Some('Z' | 'X')
        ),
        Err(_) => false,
    }
}

/// A joined shared-memory group. Like every communicator: all ranks issue the same calls in
/// the same order, and after an error every op is refused.
pub struct ShmCommunicator {
    rank: usize,
    world: usize,
    config: CommConfig,
    map: Mapping,
    slot_bytes: usize,
    /// The next message's sequence number (1-based; the same on every rank).
    next: u64,
    broken: Option<String>,
}

impl ShmCommunicator {
    fn new(rank: usize, world: usize, config: CommConfig, map: Mapping) -> Self {
        let slot_bytes = map.header().slot_bytes.load(Ordering::Relaxed) as usize;
        Self {
            rank,
            world,
            config,
            map,
            slot_bytes,
            next: 1,
            broken: None,
        }
    }

    /// Rank `rank` (≥ 1) joins the segment at `address` (rank 0's
    /// [`ShmRendezvous::address`]); returns once every rank joined.
    pub fn connect(rank: usize, world: usize, address: &str, config: CommConfig) -> Result<Self> {
        check_world(world)?;
        if rank == 0 || rank >= world {
            return Err(Error::InvalidArgument {
                op: Op::Rendezvous,
                detail: format!(
                    "rank {rank} cannot connect to a shared-memory group of {world}: rank 0 \
                     accepts, ranks 1..{world} connect"
                ),
            });
        }
        let (pid, fd) = parse_address(address)?;
        let path = format!("/proc/{pid}/fd/{fd}");
        let map = Mapping::open(&path, DATA_OFFSET).map_err(|e| {
            unavailable(format!(
                "rank {rank} cannot open rank 0's shared-memory segment {path} ({e}): every \
                 rank of a shared-memory group must run on rank 0's host, as the same user and \
                 in the same process namespace; across hosts use the tcp or nccl backend"
            ))
        })?;
        let h = map.header();
        let slots = h.slots.load(Ordering::Relaxed) as usize;
        let slot_bytes = h.slot_bytes.load(Ordering::Relaxed) as usize;
        if h.magic.load(Ordering::Acquire) != MAGIC
            || slots != SLOTS
            || map.len() != DATA_OFFSET + SLOTS * slot_bytes
        {
            return Err(unavailable(format!(
                "{path} is not a shared-memory segment of this version of rlhf-collective"
            )));
        }
        let mut comm = Self::new(rank, world, config, map);
        let r = comm.join_as(rank, u64::from(pid));
        comm.finish(r)?;
        Ok(comm)
    }

    fn join_as(&mut self, rank: usize, root_pid: u64) -> Result<()> {
        let world = self.world;
        let h = self.map.header();
        let timeout = self.config.timeout;
        let deadline = Instant::now() + timeout;
        // Rank 0 joins first: it sets the world and its tag.
        while h.ranks[0].joined.load(Ordering::Acquire) != JOINED {
            if !alive(root_pid) {
                return Err(Error::PeerClosed {
                    op: Op::Rendezvous,
                    rank,
                    peer: 0,
                    detail: format!("process {root_pid} that owns the segment exited"),
                });
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    op: Op::Rendezvous,
                    rank,
                    peer: Some(0),
                    timeout,
                    detail: "; rank 0 made the segment but never joined it".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let theirs = h.world.load(Ordering::Relaxed) as usize;
        if theirs != world {
            return Err(Error::Mismatch {
                op: Op::Rendezvous,
                rank,
                peer: Some(0),
                detail: format!("rank 0 made a group of {theirs} ranks, this rank expects {world}"),
            });
        }
        let nonce = load_bytes(&h.nonce);
        if let Some(secret) = &self.config.secret {
            let tag = load_bytes(&h.root_tag);
            if !secret.verify(Side::ShmRoot, &transcript(&nonce, world, 0), &tag) {
                return Err(Error::Auth {
                    rank,
                    peer: Some(0),
                    detail: "the shared-memory segment's owner does not hold the communicator's \
                             secret"
                        .into(),
                });
            }
        }
        let me = &h.ranks[rank];
        if me
            .joined
            .compare_exchange(0, CLAIMED, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(Error::Mismatch {
                op: Op::Rendezvous,
                rank,
                peer: None,
                detail: format!("another process already joined the group as rank {rank}"),
            });
        }
        me.pid
            .store(u64::from(std::process::id()), Ordering::Relaxed);
        if let Some(secret) = &self.config.secret {
            store_bytes(
                &me.tag,
                &secret.tag(Side::ShmRank, &transcript(&nonce, world, rank)),
            );
        }
        me.joined.store(JOINED, Ordering::Release);
        self.wait_joined(|_, _| Ok(()))
    }

    /// Waits until every rank joined; `check` runs once per rank as it shows up.
    fn wait_joined(&mut self, mut check: impl FnMut(&Self, usize) -> Result<()>) -> Result<()> {
        for r in 0..self.world {
            let ready = |h: &Header| h.ranks[r].joined.load(Ordering::Acquire) == JOINED;
            self.wait(Op::Rendezvous, r, ready)?;
            check(self, r)?;
        }
        Ok(())
    }

    /// Polls `ready` until it holds; fails at the timeout, when `peer`'s process is gone,
    /// or when another rank aborted.
    fn wait(&self, op: Op, peer: usize, ready: impl Fn(&Header) -> bool) -> Result<()> {
        let h = self.map.header();
        let start = Instant::now();
        let mut last_check = start;
        let mut spins = 0u32;
        loop {
            if ready(h) {
                return Ok(());
            }
            let aborted = h.aborted.load(Ordering::Acquire);
            if aborted != 0 && aborted - 1 != self.rank as u64 {
                return Err(Error::PeerClosed {
                    op,
                    rank: self.rank,
                    peer: (aborted - 1) as usize,
                    detail: "it aborted the group after its own error".into(),
                });
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
                continue;
            }
            if spins < 128 {
                std::thread::yield_now();
                continue;
            }
            let now = Instant::now();
            if now.duration_since(last_check) >= LIVENESS_EVERY {
                last_check = now;
                let pid = h.ranks[peer].pid.load(Ordering::Relaxed);
                if pid != 0 && !alive(pid) {
                    return Err(Error::PeerClosed {
                        op,
                        rank: self.rank,
                        peer,
                        detail: format!("its process {pid} exited"),
                    });
                }
                if now.duration_since(start) > self.config.timeout {
                    return Err(Error::Timeout {
                        op,
                        rank: self.rank,
                        peer: Some(peer),
                        timeout: self.config.timeout,
                        detail: String::new(),
                    });
                }
            }
            // Short naps: a slot of 1 MiB is copied in about 100 µs, and a longer nap than
            // that would leave the pipeline idle.
            let exp = (spins - 128).min(4);
            std::thread::sleep(Duration::from_micros(5 << exp));
        }
    }

    fn begin(&self, op: Op) -> Result<()> {
        match &self.broken {
            Some(cause) => Err(unavailable(format!(
                "{op} refused on rank {}: an earlier op failed ({cause}); build a new communicator",
                self.rank
            ))),
            None => Ok(()),
        }
    }

    fn finish<T>(&mut self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            if self.broken.is_none() {
                self.broken = Some(e.to_string());
                let _ = self.map.header().aborted.compare_exchange(
                    0,
                    self.rank as u64 + 1,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
        }
        r
    }

    fn messages(&self, total: usize) -> usize {
        total.div_ceil(self.slot_bytes).max(1)
    }

    /// Writes one op's payload (`parts` concatenated) as this rank's messages.
    fn send(&mut self, op: Op, parts: &[&[u8]]) -> Result<()> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut cursor = Cursor::default();
        for k in 0..self.messages(total) {
            let s = self.next;
            self.next += 1;
            let n = (total - k * self.slot_bytes).min(self.slot_bytes);
            // The slot is free once every rank consumed the message it held before.
            for r in 0..self.world {
                let before = s.saturating_sub(SLOTS as u64);
                self.wait(op, r, |h| {
                    h.ranks[r].consumed.load(Ordering::Acquire) >= before
                })?;
            }
            let slot = (s % SLOTS as u64) as usize;
            cursor.copy_from_parts(parts, self.map.slot(slot, self.slot_bytes), n);
            let h = self.map.header();
            let meta = &h.meta[slot];
            meta.op.store(u64::from(op.wire_id()), Ordering::Relaxed);
            meta.root.store(self.rank as u64, Ordering::Relaxed);
            meta.len.store(total as u64, Ordering::Relaxed);
            meta.seq.store(s, Ordering::Release);
            h.ranks[self.rank].consumed.store(s, Ordering::Release);
        }
        Ok(())
    }

    /// Reads one op's payload from `root` into `parts`.
    fn recv(&mut self, op: Op, parts: &mut [&mut [u8]], root: usize) -> Result<()> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut cursor = Cursor::default();
        for k in 0..self.messages(total) {
            let s = self.next;
            self.next += 1;
            let slot = (s % SLOTS as u64) as usize;
            self.wait(op, root, |h| h.meta[slot].seq.load(Ordering::Acquire) == s)?;
            let h = self.map.header();
            let meta = &h.meta[slot];
            let (their_op, their_root, their_len) = (
                meta.op.load(Ordering::Relaxed),
                meta.root.load(Ordering::Relaxed) as usize,
                meta.len.load(Ordering::Relaxed) as usize,
            );
            if their_op != u64::from(op.wire_id()) || their_root != root || their_len != total {
                let their = Op::from_wire_id(their_op as u8)
                    .map_or_else(|| format!("op #{their_op}"), |o| o.to_string());
                return Err(Error::Mismatch {
                    op,
                    rank: self.rank,
                    peer: Some(their_root),
                    detail: format!(
                        "rank {their_root} sent {their} of {their_len} bytes; this rank expects {op} of {total} bytes from rank {root}"
                    ),
                });
            }
            let n = (total - k * self.slot_bytes).min(self.slot_bytes);
            cursor.copy_into_parts(parts, self.map.slot(slot, self.slot_bytes), n);
            h.ranks[self.rank].consumed.store(s, Ordering::Release);
        }
        Ok(())
    }

    fn gather(&mut self, op: Op, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::with_capacity(self.world);
        for r in 0..self.world {
            if r == self.rank {
                self.send(op, &[&(data.len() as u64).to_le_bytes()])?;
                self.send(op, &[data])?;
                out.push(data.to_vec());
            } else {
                let mut len = [0u8; 8];
                self.recv(op, &mut [&mut len], r)?;
                let mut v = vec![0u8; u64::from_le_bytes(len) as usize];
                self.recv(op, &mut [&mut v], r)?;
                out.push(v);
            }
        }
        Ok(out)
    }

    fn reduce<T: Elem + Default>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let all = self.gather(Op::AllReduce, as_bytes(buf))?;
        let mut acc = vec![T::default(); buf.len()];
        let mut other = vec![T::default(); buf.len()];
        for (r, bytes) in all.iter().enumerate() {
            if bytes.len() != std::mem::size_of_val(buf) {
                return Err(Error::Mismatch {
                    op: Op::AllReduce,
                    rank: self.rank,
                    peer: Some(r),
                    detail: format!(
                        "rank {r} reduces {} bytes, this rank {}",
                        bytes.len(),
                        std::mem::size_of_val(buf)
                    ),
                });
            }
            if r == 0 {
                as_bytes_mut(&mut acc).copy_from_slice(bytes);
            } else {
                as_bytes_mut(&mut other).copy_from_slice(bytes);
                T::reduce(&mut acc, &other, op);
            }
        }
        if op == ReduceOp::Avg {
            T::divide(&mut acc, self.world);
        }
        buf.copy_from_slice(&acc);
        Ok(())
    }

    fn run<T>(&mut self, op: Op, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.begin(op)?;
        let r = f(self);
        self.finish(r)
    }

    fn check_root(&self, op: Op, root: usize) -> Result<()> {
        if root >= self.world {
            return Err(Error::InvalidArgument {
                op,
                detail: format!("root rank {root} is out of range for {} ranks", self.world),
            });
        }
        Ok(())
    }
}

/// A position in a list of byte slices, for copying a contiguous slot from or to them.
#[derive(Default)]
struct Cursor {
    part: usize,
    at: usize,
}

impl Cursor {
    fn copy_from_parts(&mut self, parts: &[&[u8]], dst: *mut u8, n: usize) {
        let mut done = 0;
        while done < n {
            let p = parts[self.part];
            let take = (p.len() - self.at).min(n - done);
            // SAFETY: `dst` points at a slot of at least `n` bytes in a live mapping that no
            // other rank touches until this message is published; `p[at..at + take]` is in
            // bounds by the `min` above.
            unsafe { std::ptr::copy_nonoverlapping(p.as_ptr().add(self.at), dst.add(done), take) };
            done += take;
            self.at += take;
            if self.at == p.len() {
                self.part += 1;
                self.at = 0;
            }
        }
    }

    fn copy_into_parts(&mut self, parts: &mut [&mut [u8]], src: *const u8, n: usize) {
        let mut done = 0;
        while done < n {
            let p = &mut parts[self.part];
            let take = (p.len() - self.at).min(n - done);
            // SAFETY: `src` points at a published slot of at least `n` bytes in a live
            // mapping that its writer does not reuse before this rank marks it consumed;
            // `p[at..at + take]` is in bounds by the `min` above.
            unsafe {
                std::ptr::copy_nonoverlapping(src.add(done), p.as_mut_ptr().add(self.at), take)
            };
            done += take;
            self.at += take;
            if self.at == p.len() {
                self.part += 1;
                self.at = 0;
            }
        }
    }
}

impl Communicator for ShmCommunicator {
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
        if root == self.rank {
            self.broadcast_send_parts(&[buf])
        } else {
            self.broadcast_recv_parts(&mut [buf], root)
        }
    }

    fn broadcast_send_parts(&mut self, parts: &[&[u8]]) -> Result<()> {
        self.run(Op::Broadcast, |c| c.send(Op::Broadcast, parts))
    }

    fn broadcast_recv_parts(&mut self, parts: &mut [&mut [u8]], root: usize) -> Result<()> {
        self.check_root(Op::Broadcast, root)?;
        if root == self.rank {
            return Err(Error::InvalidArgument {
                op: Op::Broadcast,
                detail: format!("rank {root} is the root: it sends, it does not receive"),
            });
        }
        self.run(Op::Broadcast, |c| c.recv(Op::Broadcast, parts, root))
    }

    fn all_reduce_f32(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        self.run(Op::AllReduce, |c| c.reduce(buf, op))
    }

    fn all_reduce_f64(&mut self, buf: &mut [f64], op: ReduceOp) -> Result<()> {
        self.run(Op::AllReduce, |c| c.reduce(buf, op))
    }

    fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.run(Op::AllGather, |c| c.gather(Op::AllGather, data))
    }

    fn barrier(&mut self) -> Result<()> {
        self.run(Op::Barrier, |c| c.gather(Op::Barrier, &[]).map(|_| ()))
    }
}

#[cfg(test)]
mod tests;
