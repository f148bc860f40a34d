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
//! bytes. All-reduce: every rank's buffer goes out in turn and every rank adds them up in
//! rank order as they pass through the slots (bit-identical results, one extra buffer);
//! reduce-scatter the same, each rank adding up only its own segment. Waits poll (spin,
//! yield, then sleep up to 80 µs) against
//! [`CommConfig::timeout`](crate::CommConfig), watch the waited-on peer's process and an
//! abort word a failing rank sets: a dead or failed peer is an error within ~100 ms, never a
//! hang.

mod join;
mod map;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Op, Result};
use crate::tcp::auth::{NONCE_BYTES, TAG_BYTES};
use crate::tcp::Elem;
use crate::{as_bytes, as_bytes_mut, CommConfig, Communicator, ReduceOp};
pub use join::ShmRendezvous;
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
        self.recv_with(op, total, root, |_, bytes| {
            cursor.copy_into_parts(parts, bytes.as_ptr(), bytes.len())
        })
    }

    /// Reads one op's payload of `total` bytes from `root`, message by message: `take` gets
    /// each message's bytes, and their offset in the payload, while they sit in the slot.
    fn recv_with(
        &mut self,
        op: Op,
        total: usize,
        root: usize,
        mut take: impl FnMut(usize, &[u8]),
    ) -> Result<()> {
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
            // SAFETY: the slot holds `n >= 0` published bytes of a live mapping, which its
            // writer does not reuse before this rank marks the message consumed (below,
            // after the borrow ends).
            let bytes = unsafe {
                std::slice::from_raw_parts(self.map.slot(slot, self.slot_bytes).cast_const(), n)
            };
            take(k * self.slot_bytes, bytes);
            h.ranks[self.rank].consumed.store(s, Ordering::Release);
        }
        Ok(())
    }

    /// Elements `keep` of the reduction of every rank's `buf` (the same length on every
    /// rank), in rank order as every rank computes it (so bit-identical on all). Each rank's
    /// buffer goes out whole once; a rank adds up, message by message, only what falls in
    /// `keep`, so besides the result it holds one slot's worth, not every rank's buffer.
    fn reduce_range<T: Elem + Default>(
        &mut self,
        op: Op,
        buf: &[T],
        keep: std::ops::Range<usize>,
        red: ReduceOp,
    ) -> Result<Vec<T>> {
        let size = std::mem::size_of::<T>();
        let total = std::mem::size_of_val(buf);
        let mut acc = vec![T::default(); keep.len()];
        let mut scratch: Vec<T> = Vec::new();
        // Rank 0's values start the sum; every later rank's are added in turn.
        let fold = |r: usize, dst: &mut [T], src: &[T]| {
            if r == 0 {
                dst.copy_from_slice(src);
            } else {
                T::reduce(dst, src, red);
            }
        };
        for r in 0..self.world {
            if r == self.rank {
                self.send(op, &[as_bytes(buf)])?;
                fold(r, &mut acc, &buf[keep.clone()]);
                continue;
            }
            // Slots are a multiple of 64 bytes, so no element straddles two messages.
            self.recv_with(op, total, r, |off, bytes| {
                let (first, n) = (off / size, bytes.len() / size);
                let (lo, hi) = (first.max(keep.start), (first + n).min(keep.end));
                if lo >= hi {
                    return;
                }
                scratch.resize(hi - lo, T::default());
                as_bytes_mut(&mut scratch)
                    .copy_from_slice(&bytes[(lo - first) * size..(hi - first) * size]);
                fold(r, &mut acc[lo - keep.start..hi - keep.start], &scratch);
            })?;
        }
        if red == ReduceOp::Avg {
            T::divide(&mut acc, self.world);
        }
        Ok(acc)
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
                let n = crate::check_block(op, self.rank, r, u64::from_le_bytes(len))?;
                let mut v = vec![0u8; n];
                self.recv(op, &mut [&mut v], r)?;
                out.push(v);
            }
        }
        Ok(out)
    }

    fn reduce<T: Elem + Default>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let all = self.reduce_range(Op::AllReduce, buf, 0..buf.len(), op)?;
        buf.copy_from_slice(&all);
        Ok(())
    }

    /// Each rank keeps the reduction of its own segment only (`counts`, rank order).
    fn reduce_scatter(&mut self, buf: &mut [f32], counts: &[usize], op: ReduceOp) -> Result<()> {
        crate::check_counts(buf.len(), counts, self.world)?;
        let start: usize = counts[..self.rank].iter().sum();
        let keep = start..start + counts[self.rank];
        let mine = self.reduce_range(Op::ReduceScatter, buf, keep.clone(), op)?;
        buf[keep].copy_from_slice(&mine);
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

    fn reduce_scatter_f32(
        &mut self,
        buf: &mut [f32],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.run(Op::ReduceScatter, |c| c.reduce_scatter(buf, counts, op))
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
