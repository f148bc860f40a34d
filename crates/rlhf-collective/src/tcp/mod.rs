//! TCP backend: std threads and blocking sockets, ring topology.
//!
//! # Rendezvous
//!
//! Rank 0 listens on the master address ([`TcpRendezvous::bind`]; port 0 picks a free
//! port, readable with [`TcpRendezvous::local_addr`] so the caller can publish it
//! through a KV store). Every other rank binds its own listener on an ephemeral port
//! of the interface it reaches rank 0 through, connects to rank 0 with retry and
//! exponential backoff (10 ms doubling to 500 ms) and sends a JOIN hello carrying
//! its rank, the world size and its listener address. Once all ranks joined, rank 0
//! checks world sizes and duplicate ranks, and answers each with the table of
//! listener addresses. Each rank `r` then connects to `r + 1 (mod n)` (rank 0
//! through the master address) with a RING hello and accepts the RING hello of
//! `r - 1`. A barrier on the new ring completes the init. The whole rendezvous is
//! bounded by [`CommConfig::timeout`].
//!
//! # Links
//!
//! Each rank owns two sockets: `next` (connected to `r + 1`) and `prev` (accepted
//! from `r - 1`); with two ranks they are two distinct sockets to the same peer.
//! Sockets have `TCP_NODELAY`, the configured `SO_SNDBUF`/`SO_RCVBUF`, and send and
//! receive timeouts equal to [`CommConfig::timeout`], so every blocking call either
//! makes progress within the timeout or fails. A peer that exits closes its sockets
//! and its neighbours see EOF at once ([`ErrorKind::PeerClosed`](crate::ErrorKind)); a
//! rank that fails shuts all its sockets down, so a failure travels around the ring
//! instead of leaving the others waiting for the timeout.
//!
//! # Wire format
//!
//! All integers are little-endian.
//!
//! Hello (rendezvous, connecting side → accepting side):
//!
//! | bytes | field |
//! | --- | --- |
//! | 8 | magic `b"RLHFCOL\x02"` (the last byte is the protocol version) |
//! | 1 | kind: 1 = JOIN (to rank 0), 2 = RING (to the previous rank's listener) |
//! | 4 | rank (u32) |
//! | 4 | world size (u32) |
//! | 2 + n | listener address as UTF-8 text, u16 length prefix (empty for RING) |
//! | 1 (+ 32) | 1 and the connecting side's nonce when it authenticates, else 0 |
//!
//! With a [`CommSecret`] (see `auth.rs`) the accepting side answers a hello with its own
//! 32-byte nonce and an HMAC-SHA256 tag over the hello and both nonces, the connecting side
//! checks it and answers with its tag; only then does the connection count. A connection
//! that sends anything else, too little, or a wrong tag is dropped and logged, and the
//! rendezvous goes on waiting for the real rank.
//!
//! JOIN answer (rank 0 → rank r): status u8 (0 = ok), then either `world` addresses
//! (u16 length + UTF-8 each, rank 0's entry empty) or, for status 1 (the ranks
//! disagree) and 2 (rank 0 timed out waiting for others), one u16-prefixed UTF-8
//! error message.
//!
//! Op header, 32 bytes, sent at the start of every op on both links (`next` and
//! `prev`) and read from both, so the two ends of each link check each other:
//!
//! | bytes | field |
//! | --- | --- |
//! | 4 | magic `0x314C4F43` |
//! | 1 | op id (2 broadcast, 3 all_reduce, 4 all_gather, 5 barrier, 7 reduce_scatter) |
//! | 1 | aux: all_reduce / reduce_scatter: reduce op (1 sum, 2 avg, 3 max) + 16 × dtype (1 f32, 2 f64) |
//! | 2 | reserved, zero |
//! | 4 | root rank (broadcast), the low 32 bits of a digest of the segment counts (reduce_scatter), else 0 |
//! | 4 | reserved, zero |
//! | 8 | sequence number of the op on this communicator (1, 2, ...) |
//! | 8 | payload length in bytes (all_gather: this rank's contribution, not compared) |
//!
//! Any field that differs between the two ends is an [`Error::Mismatch`] on both.
//!
//! Payloads follow the header as raw native (little-endian) bytes:
//! - broadcast: a pipelined chain along the ring starting at the root; the root
//!   writes the payload to `next`, each intermediate rank reads `chunk_bytes` from
//!   `prev` into its own buffer and forwards it to `next`, the last rank only reads.
//! - all_reduce: ring reduce-scatter then ring all-gather over `n` contiguous
//!   segments (segment `i` = elements `i*len/n .. (i+1)*len/n`); in step `s` rank
//!   `r` sends segment `(r - s) mod n` and receives segment `(r - s - 1) mod n`
//!   concurrently (a sender thread), reducing it chunk by chunk as it arrives. For
//!   `Avg` the owner divides its reduced segment by `n` before the all-gather, so all
//!   ranks end bit-identical.
//! - reduce_scatter: the first half of all_reduce over the caller's segments, shifted by one
//!   step so that segment `r` (of `counts[r]` elements) ends reduced on rank `r`.
//! - all_gather / barrier: `n - 1` ring steps; each forwards one rank's block as a u64
//!   length followed by the bytes (barrier: empty blocks).

use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Op, Result};

pub(crate) mod auth;
mod conn;
mod frame;
mod hello;
mod loopback;
mod rendezvous;
mod ring;
use crate::{CommConfig, Communicator, ReduceOp};
pub use auth::CommSecret;
pub use conn::CommTls;
use conn::Conn;
pub use frame::tune_stream;
use frame::{mismatch, read_exact, write_all, Ctx, Header};
pub use rendezvous::TcpRendezvous;
#[cfg(test)]
use ring::split_pair;
pub(crate) use ring::Elem;

const HDR_MAGIC: u32 = 0x314C_4F43;
const HDR_LEN: usize = 32;
/// Messages up to this size are written before reading without a sender thread:
/// they always fit in the kernel socket buffers, so two ranks writing to each
/// other at once cannot deadlock, and small ops skip a thread spawn.
const INLINE_SEND: usize = 32 << 10;
const BACKEND: &str = "tcp";

/// One end of a ring connection.
#[derive(Debug)]
struct Link {
    stream: Conn,
    peer: usize,
}

impl Link {
    fn shutdown(&self) {
        let _ = self.stream.tcp.shutdown(Shutdown::Both);
    }
}

/// The TCP [`Communicator`]. Build with [`TcpCommunicator::init`] (any rank),
/// [`TcpRendezvous`] (rank 0, when the port must be published first) or
/// [`TcpCommunicator::connect`] (ranks ≥ 1).
#[derive(Debug)]
pub struct TcpCommunicator {
    rank: usize,
    world: usize,
    config: CommConfig,
    /// `(next, prev)`; `None` for a world of one.
    links: Option<(Link, Link)>,
    seq: u64,
    broken: Option<String>,
    /// Receive buffer for reductions, `chunk_bytes` long; u64 so it is aligned for f64.
    scratch: Vec<u64>,
}

impl TcpCommunicator {
    fn new(rank: usize, world: usize, config: CommConfig, links: Option<(Link, Link)>) -> Self {
        let scratch = vec![0u64; config.chunk_bytes.div_ceil(8)];
        Self {
            rank,
            world,
            config,
            links,
            seq: 0,
            broken: None,
            scratch,
        }
    }

    /// A group of one: every op is local.
    pub fn single(config: CommConfig) -> Self {
        Self::new(0, 1, config, None)
    }

    /// The settings this communicator was built with.
    pub fn config(&self) -> &CommConfig {
        &self.config
    }

    fn begin(&mut self, op: Op) -> Result<u64> {
        if let Some(cause) = &self.broken {
            return Err(Error::Unavailable {
                backend: BACKEND,
                reason: format!(
                    "{op} refused on rank {}: an earlier op failed ({cause}); \
                     the connections are closed, build a new communicator",
                    self.rank
                ),
            });
        }
        self.seq += 1;
        Ok(self.seq)
    }

    fn finish<T>(&mut self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.broken = Some(e.to_string());
            if let Some((next, prev)) = &self.links {
                next.shutdown();
                prev.shutdown();
            }
        }
        r
    }

    fn ctx(&self, op: Op) -> Ctx<'_> {
        Ctx {
            op,
            rank: self.rank,
            config: &self.config,
        }
    }

    fn exchange_headers(&self, ctx: &Ctx<'_>, mine: Header) -> Result<()> {
        let Some((next, prev)) = &self.links else {
            return Ok(());
        };
        let bytes = mine.encode();
        write_all(ctx, next, &bytes)?;
        write_all(ctx, prev, &bytes)?;
        for link in [next, prev] {
            let mut buf = [0u8; HDR_LEN];
            read_exact(ctx, link, &mut buf)?;
            let theirs = Header::decode(&buf);
            if let Some(detail) = mine.mismatch(&theirs) {
                return Err(mismatch(ctx.op, ctx.rank, Some(link.peer), detail));
            }
        }
        Ok(())
    }

    fn broadcast_impl(&mut self, payload: Payload<'_, '_>, root: usize) -> Result<()> {
        let seq = self.begin(Op::Broadcast)?;
        let r = self.broadcast_inner(payload, root, seq);
        self.finish(r)
    }

    fn broadcast_inner(
        &mut self,
        mut payload: Payload<'_, '_>,
        root: usize,
        seq: u64,
    ) -> Result<()> {
        let ctx = self.ctx(Op::Broadcast);
        if root >= self.world {
            return Err(Error::InvalidArgument {
                op: Op::Broadcast,
                detail: format!("root {root} is not a rank of a world of {}", self.world),
            });
        }
        let total = payload.len();
        self.exchange_headers(
            &ctx,
            Header {
                op: Op::Broadcast.wire_id(),
                aux: 0,
                root: root as u32,
                seq,
                len: total as u64,
            },
        )?;
        let Some((next, prev)) = &self.links else {
            return Ok(());
        };
        let n = self.world;
        let pos = (self.rank + n - root) % n;
        let chunk = self.config.chunk_bytes;
        match &mut payload {
            Payload::Send(parts) => {
                for p in parts.iter() {
                    write_all(&ctx, next, p)?;
                }
            }
            Payload::Recv(parts) => {
                for p in parts.iter_mut() {
                    if pos == n - 1 {
                        read_exact(&ctx, prev, p)?;
                    } else {
                        for c in p.chunks_mut(chunk) {
                            read_exact(&ctx, prev, c)?;
                            write_all(&ctx, next, c)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn gather_impl(&mut self, op: Op, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let seq = self.begin(op)?;
        let r = self.gather_inner(op, data, seq);
        self.finish(r)
    }

    fn gather_inner(&mut self, op: Op, data: &[u8], seq: u64) -> Result<Vec<Vec<u8>>> {
        let ctx = self.ctx(op);
        self.exchange_headers(
            &ctx,
            Header {
                op: op.wire_id(),
                aux: 0,
                root: 0,
                seq,
                len: data.len() as u64,
            },
        )?;
        let n = self.world;
        let rank = self.rank;
        let mut blocks: Vec<Vec<u8>> = vec![Vec::new(); n];
        blocks[rank] = data.to_vec();
        let Some((next, prev)) = &self.links else {
            return Ok(blocks);
        };
        for s in 0..n - 1 {
            let send_i = (rank + n - s) % n;
            let recv_i = (rank + 2 * n - s - 1) % n;
            let block = &blocks[send_i];
            let mut framed = Vec::new();
            let small = block.len() + 8 <= INLINE_SEND;
            if small {
                framed.extend_from_slice(&(block.len() as u64).to_le_bytes());
                framed.extend_from_slice(block);
            }
            let got = if small {
                duplex(&ctx, next, prev, &framed, |ctx| recv_block(ctx, prev))?
            } else {
                duplex_with(
                    &ctx,
                    next,
                    prev,
                    false,
                    |ctx| {
                        write_all(ctx, next, &(block.len() as u64).to_le_bytes())?;
                        write_all(ctx, next, block)
                    },
                    |ctx| recv_block(ctx, prev),
                )?
            };
            blocks[recv_i] = got;
        }
        Ok(blocks)
    }
}

impl Communicator for TcpCommunicator {
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
        if self.rank == root {
            self.broadcast_impl(Payload::Send(&[&*buf]), root)
        } else {
            self.broadcast_impl(Payload::Recv(&mut [buf]), root)
        }
    }

    fn broadcast_send_parts(&mut self, parts: &[&[u8]]) -> Result<()> {
        let root = self.rank;
        self.broadcast_impl(Payload::Send(parts), root)
    }

    fn broadcast_recv_parts(&mut self, parts: &mut [&mut [u8]], root: usize) -> Result<()> {
        if root == self.rank {
            return Err(Error::InvalidArgument {
                op: Op::Broadcast,
                detail: format!(
                    "rank {root} is the root: it must call broadcast_send_parts, not broadcast_recv_parts"
                ),
            });
        }
        self.broadcast_impl(Payload::Recv(parts), root)
    }

    fn all_reduce_f32(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        self.all_reduce_impl(buf, op)
    }

    fn all_reduce_f64(&mut self, buf: &mut [f64], op: ReduceOp) -> Result<()> {
        self.all_reduce_impl(buf, op)
    }

    fn reduce_scatter_f32(
        &mut self,
        buf: &mut [f32],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_impl(buf, counts, op)
    }

    fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.gather_impl(Op::AllGather, data)
    }

    fn barrier(&mut self) -> Result<()> {
        self.gather_impl(Op::Barrier, &[]).map(|_| ())
    }
}

enum Payload<'a, 'b> {
    Send(&'a [&'b [u8]]),
    Recv(&'a mut [&'b mut [u8]]),
}

impl Payload<'_, '_> {
    fn len(&self) -> usize {
        match self {
            Payload::Send(p) => p.iter().map(|x| x.len()).sum(),
            Payload::Recv(p) => p.iter().map(|x| x.len()).sum(),
        }
    }
}

/// Reads one length-prefixed block. The buffer grows with the bytes that actually arrive
/// (a chunk at a time), so a length that lies costs the reader nothing before the peer sends.
fn recv_block(ctx: &Ctx<'_>, link: &Link) -> Result<Vec<u8>> {
    let mut len = [0u8; 8];
    read_exact(ctx, link, &mut len)?;
    // Blocks are read as they arrive, so the bound only turns an absurd length into an
    // early, clear error.
    let len = crate::check_block(ctx.op, ctx.rank, link.peer, u64::from_le_bytes(len))?;
    let step = ctx.config.chunk_bytes.max(1);
    let mut v = Vec::with_capacity(len.min(step));
    while v.len() < len {
        let start = v.len();
        v.resize(start + step.min(len - start), 0);
        read_exact(ctx, link, &mut v[start..])?;
    }
    Ok(v)
}

/// Sends `send` to `next` while `recv` reads from `prev`.
fn duplex<R>(
    ctx: &Ctx<'_>,
    next: &Link,
    prev: &Link,
    send: &[u8],
    recv: impl FnOnce(&Ctx<'_>) -> Result<R>,
) -> Result<R> {
    duplex_with(
        ctx,
        next,
        prev,
        send.len() <= INLINE_SEND,
        |ctx| write_all(ctx, next, send),
        recv,
    )
}

/// Runs `send` and `recv` concurrently (or one after the other when `inline`).
/// The first side to fail shuts both links down so the other side cannot stay
/// blocked, and its error (the cause, not the consequence) is returned.
fn duplex_with<R>(
    ctx: &Ctx<'_>,
    next: &Link,
    prev: &Link,
    inline: bool,
    send: impl FnOnce(&Ctx<'_>) -> Result<()> + Send,
    recv: impl FnOnce(&Ctx<'_>) -> Result<R>,
) -> Result<R> {
    if inline {
        send(ctx)?;
        return recv(ctx);
    }
    let aborted = AtomicBool::new(false);
    let first = |e: Error| -> Option<Error> {
        if aborted.swap(true, Ordering::SeqCst) {
            None
        } else {
            next.shutdown();
            prev.shutdown();
            Some(e)
        }
    };
    let (sent, received) = std::thread::scope(|s| {
        let sender = s.spawn(|| send(ctx).map_err(first));
        let received = recv(ctx).map_err(first);
        let sent = match sender.join() {
            Ok(r) => r,
            Err(_) => Err(first(Error::Io {
                op: ctx.op,
                rank: ctx.rank,
                peer: Some(next.peer),
                context: "sender thread".into(),
                source: io::Error::other("sender thread panicked"),
            })),
        };
        (sent, received)
    });
    match (sent, received) {
        (Ok(()), Ok(v)) => Ok(v),
        (Err(Some(e)), _) | (_, Err(Some(e))) => Err(e),
        _ => Err(Error::Io {
            op: ctx.op,
            rank: ctx.rank,
            peer: None,
            context: "concurrent send/receive".into(),
            source: io::Error::other("aborted without a recorded cause"),
        }),
    }
}

#[cfg(test)]
mod tests;
