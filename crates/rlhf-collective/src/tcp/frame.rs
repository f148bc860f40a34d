//! The bytes on a link and the errors about them: the 32-byte op header every op starts
//! with (see the wire format in `super`), reads and writes that name the op, rank and peer
//! when they fail, argument checks, and the socket settings every link gets.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::{Link, HDR_LEN, HDR_MAGIC};
use crate::error::{Error, Op, Result};
use crate::CommConfig;

/// Per-op context for error reporting.
pub(super) struct Ctx<'a> {
    pub(super) op: Op,
    pub(super) rank: usize,
    pub(super) config: &'a CommConfig,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) op: u8,
    pub(super) aux: u8,
    pub(super) root: u32,
    pub(super) seq: u64,
    pub(super) len: u64,
}

impl Header {
    pub(super) fn encode(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..4].copy_from_slice(&HDR_MAGIC.to_le_bytes());
        b[4] = self.op;
        b[5] = self.aux;
        b[8..12].copy_from_slice(&self.root.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a header; a bad magic is kept as op 0 so `mismatch` reports it.
    pub(super) fn decode(b: &[u8; HDR_LEN]) -> Header {
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        Header {
            op: if magic == HDR_MAGIC { b[4] } else { 0 },
            aux: b[5],
            root: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            seq: u64_at(16),
            len: u64_at(24),
        }
    }

    pub(super) fn describe(&self) -> String {
        let Some(op) = Op::from_wire_id(self.op) else {
            return "an unknown message (bad magic or op id: a different program or protocol version?)"
                .into();
        };
        let mut s = format!("{op} #{} of {} bytes", self.seq, self.len);
        match op {
            Op::Broadcast => s.push_str(&format!(" from root {}", self.root)),
            Op::AllReduce | Op::ReduceScatter => {
                let red = match self.aux & 0xF {
                    1 => "sum",
                    2 => "avg",
                    3 => "max",
                    _ => "?",
                };
                let dt = match self.aux >> 4 {
                    1 => "f32",
                    2 => "f64",
                    _ => "?",
                };
                s.push_str(&format!(" ({red}, {dt})"));
            }
            _ => {}
        }
        s
    }

    /// Describes how `theirs` disagrees with `self`, or `None` when compatible.
    pub(super) fn mismatch(&self, theirs: &Header) -> Option<String> {
        let variable_len = matches!(
            Op::from_wire_id(self.op),
            Some(Op::AllGather) | Some(Op::Barrier)
        );
        let same = self.op == theirs.op
            && self.aux == theirs.aux
            && self.root == theirs.root
            && self.seq == theirs.seq
            && (variable_len || self.len == theirs.len);
        if same {
            return None;
        }
        let hint = if self.op == theirs.op && self.seq == theirs.seq && self.len != theirs.len {
            "; buffer lengths must be equal on every rank"
        } else if self.op == theirs.op
            && Op::from_wire_id(self.op) == Some(Op::ReduceScatter)
            && self.root != theirs.root
        {
            "; the ranks cut the buffer into different segment counts"
        } else if self.seq != theirs.seq {
            "; the ranks issued a different number of collective calls"
        } else {
            "; every rank must issue the same collective calls in the same order"
        };
        Some(format!(
            "this rank called {} but the peer called {}{hint}",
            self.describe(),
            theirs.describe()
        ))
    }
}

pub(super) fn write_all(ctx: &Ctx<'_>, link: &Link, buf: &[u8]) -> Result<()> {
    for c in buf.chunks(ctx.config.chunk_bytes.max(1)) {
        (&link.stream)
            .write_all(c)
            .map_err(|e| map_io(ctx.op, ctx.rank, link.peer, ctx.config, "sending", e))?;
    }
    Ok(())
}

pub(super) fn read_exact(ctx: &Ctx<'_>, link: &Link, buf: &mut [u8]) -> Result<()> {
    (&link.stream)
        .read_exact(buf)
        .map_err(|e| map_io(ctx.op, ctx.rank, link.peer, ctx.config, "receiving", e))
}

pub(super) fn map_io(
    op: Op,
    rank: usize,
    peer: usize,
    config: &CommConfig,
    what: &str,
    e: io::Error,
) -> Error {
    use io::ErrorKind as K;
    match e.kind() {
        K::WouldBlock | K::TimedOut => Error::Timeout {
            op,
            rank,
            peer: Some(peer),
            timeout: config.timeout,
            detail: format!(
                "; stuck {what}: the peer is dead, stuck, or not calling the same collective \
                 (raise CommConfig::timeout if it is only slow)"
            ),
        },
        K::UnexpectedEof
        | K::ConnectionReset
        | K::ConnectionAborted
        | K::BrokenPipe
        | K::NotConnected => Error::PeerClosed {
            op,
            rank,
            peer,
            detail: format!("{what}: {e}"),
        },
        _ => io_err(op, rank, Some(peer), what, e),
    }
}

pub(super) fn io_err(op: Op, rank: usize, peer: Option<usize>, what: &str, e: io::Error) -> Error {
    Error::Io {
        op,
        rank,
        peer,
        context: what.to_string(),
        source: e,
    }
}

pub(super) fn mismatch(op: Op, rank: usize, peer: Option<usize>, detail: String) -> Error {
    Error::Mismatch {
        op,
        rank,
        peer,
        detail,
    }
}

/// Most ranks of one TCP communicator: far above any job's, and small enough that the
/// per-rank tables a rendezvous allocates from a JoinComm request stay small.
pub const MAX_WORLD: usize = 1 << 16;

pub(super) fn check_args(rank: usize, world: usize, config: &CommConfig) -> Result<()> {
    let bad = |detail: String| {
        Err(Error::InvalidArgument {
            op: Op::Rendezvous,
            detail,
        })
    };
    if world == 0 {
        return bad("world_size must be at least 1".into());
    }
    if rank >= world {
        return bad(format!(
            "rank {rank} is out of range for world_size {world} (ranks are 0..{world})"
        ));
    }
    if world > MAX_WORLD {
        return bad(format!(
            "world_size {world} is too large: a TCP communicator has at most {MAX_WORLD} ranks"
        ));
    }
    if config.timeout.is_zero() {
        return bad("CommConfig::timeout must be greater than zero".into());
    }
    if config.chunk_bytes < 4096 {
        return bad(format!(
            "CommConfig::chunk_bytes is {} but must be at least 4096",
            config.chunk_bytes
        ));
    }
    Ok(())
}

pub(super) fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// Applies the same send/receive timeout; zero would mean "block forever" to the OS.
pub(super) fn set_io_timeout(s: &TcpStream, t: Duration) {
    let t = t.max(Duration::from_millis(1));
    let _ = s.set_read_timeout(Some(t));
    let _ = s.set_write_timeout(Some(t));
}

pub(super) fn tune(s: &TcpStream, config: &CommConfig) {
    let _ = s.set_nodelay(true);
    if let Some(b) = config.socket_buffer_bytes {
        let sock = socket2::SockRef::from(s);
        let _ = sock.set_send_buffer_size(b);
        let _ = sock.set_recv_buffer_size(b);
    }
}

/// Same socket settings as the communicator's links; for baselines in benchmarks.
pub fn tune_stream(s: &TcpStream, config: &CommConfig) {
    tune(s, config);
    set_io_timeout(s, config.timeout);
}
