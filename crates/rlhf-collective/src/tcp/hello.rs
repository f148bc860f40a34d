//! The first bytes on every rendezvous connection: the hello (magic, kind, rank, the
//! communicator's nonce and tag), reading and checking it, and the JOIN answer with rank 0's
//! address table or an error code. Split from rendezvous.rs, which decides who connects where.

use std::io::{self, Read, Write};

use super::auth::{self, Side, NONCE_BYTES, TAG_BYTES};
use super::conn::Conn;
use super::frame::{map_io, mismatch, set_io_timeout};
use super::rendezvous::{HELLO_MAGIC, JOIN_TIMEOUT, KIND_JOIN};
use crate::error::{Error, Op, Result};
use crate::CommConfig;

pub(super) struct Hello {
    pub(super) kind: u8,
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) addr: String,
    /// The connecting side's nonce, when it authenticates.
    pub(super) nonce: Option<[u8; NONCE_BYTES]>,
    /// The hello as it crossed the wire (the start of the handshake transcript).
    pub(super) raw: Vec<u8>,
}

pub(super) fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Magic, kind, rank, world size, listener address, then 0 (no authentication) or 1 and
/// the connecting side's nonce.
fn encode_hello(
    out: &mut Vec<u8>,
    kind: u8,
    rank: usize,
    world: usize,
    addr: &str,
    nonce: Option<&[u8; NONCE_BYTES]>,
) {
    out.extend_from_slice(&HELLO_MAGIC);
    out.push(kind);
    out.extend_from_slice(&(rank as u32).to_le_bytes());
    out.extend_from_slice(&(world as u32).to_le_bytes());
    put_str(out, addr);
    match nonce {
        Some(n) => {
            out.push(1);
            out.extend_from_slice(n);
        }
        None => out.push(0),
    }
}

/// Connecting side: sends the hello and, with a secret, completes the handshake (checks the
/// accepting side's tag, sends its own). `ranks`: (this rank, the rank it connects to).
pub(super) fn send_hello(
    s: &Conn,
    kind: u8,
    ranks: (usize, usize),
    world: usize,
    addr: &str,
    config: &CommConfig,
) -> Result<()> {
    let (rank, peer) = ranks;
    let what = if kind == KIND_JOIN { "JOIN" } else { "RING" };
    let io = |e, step: &str| map_io(Op::Rendezvous, rank, peer, config, step, e);
    let nonce_c = config.secret.as_ref().map(|_| auth::nonce());
    let mut hello = Vec::new();
    encode_hello(&mut hello, kind, rank, world, addr, nonce_c.as_ref());
    let mut w = s;
    w.write_all(&hello)
        .map_err(|e| io(e, &format!("sending the {what} hello")))?;
    let Some(secret) = &config.secret else {
        return Ok(());
    };
    let mut answer = [0u8; NONCE_BYTES + TAG_BYTES];
    (&*s).read_exact(&mut answer).map_err(|e| {
        io(
            e,
            &format!(
                "authenticating to rank {peer} (it dropped the connection: does it have this \
                 communicator's secret, from the same JoinComm?)"
            ),
        )
    })?;
    let (nonce_a, tag_a) = answer.split_at(NONCE_BYTES);
    let mut transcript = hello;
    transcript.extend_from_slice(nonce_a);
    if !secret.verify(Side::Accepting, &transcript, tag_a) {
        return Err(Error::Auth {
            rank,
            peer: Some(peer),
            detail: "the peer answered with a wrong tag: it does not hold this communicator's \
                     secret (another job's listener, or a stale address)"
                .into(),
        });
    }
    w.write_all(&secret.tag(Side::Connecting, &transcript))
        .map_err(|e| io(e, "sending the authentication tag"))
}

/// Longest listener address a hello may carry: a DNS name (253 bytes) with a port fits.
pub(super) const MAX_HELLO_ADDR: usize = 512;

pub(super) fn read_str(s: &Conn) -> io::Result<String> {
    read_str_max(s, usize::from(u16::MAX))
}

/// Reads a length-prefixed string, refusing one announced longer than `max` bytes before
/// reading it.
fn read_str_max(mut s: &Conn, max: usize) -> io::Result<String> {
    let mut len = [0u8; 2];
    s.read_exact(&mut len)?;
    let len = usize::from(u16::from_le_bytes(len));
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("it announces a {len}-byte address (at most {max})"),
        ));
    }
    let mut b = vec![0u8; len];
    s.read_exact(&mut b)?;
    String::from_utf8(b).map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "non-UTF-8 text"))
}

/// Reads a hello; `Ok(None)` for a connection that is not one of ours.
pub(super) fn read_hello(mut s: &Conn) -> io::Result<Option<Hello>> {
    let mut head = [0u8; 17];
    s.read_exact(&mut head)?;
    if head[..8] != HELLO_MAGIC {
        return Ok(None);
    }
    let rank = u32::from_le_bytes([head[9], head[10], head[11], head[12]]) as usize;
    let world = u32::from_le_bytes([head[13], head[14], head[15], head[16]]) as usize;
    let addr = read_str_max(s, MAX_HELLO_ADDR)?;
    let mut flag = [0u8; 1];
    s.read_exact(&mut flag)?;
    let nonce = match flag[0] {
        0 => None,
        1 => {
            let mut n = [0u8; NONCE_BYTES];
            s.read_exact(&mut n)?;
            Some(n)
        }
        _ => return Ok(None),
    };
    let mut raw = Vec::new();
    encode_hello(&mut raw, head[8], rank, world, &addr, nonce.as_ref());
    Ok(Some(Hello {
        kind: head[8],
        rank,
        world,
        addr,
        nonce,
        raw,
    }))
}

/// Accepting side: with a secret, answers the hello's nonce with its own and its tag, then
/// checks the connecting side's tag. `Err` names why the connection is not trusted.
pub(super) fn authenticate(
    s: &Conn,
    hello: &Hello,
    config: &CommConfig,
) -> std::result::Result<(), String> {
    let Some(secret) = &config.secret else {
        return match hello.nonce {
            None => Ok(()),
            Some(_) => {
                Err("it authenticates, but this rank has no secret for the communicator".into())
            }
        };
    };
    if hello.nonce.is_none() {
        return Err("it sent no authentication".into());
    }
    let nonce_a = auth::nonce();
    let mut transcript = hello.raw.clone();
    transcript.extend_from_slice(&nonce_a);
    let mut answer = nonce_a.to_vec();
    answer.extend_from_slice(&secret.tag(Side::Accepting, &transcript));
    let mut w = s;
    w.write_all(&answer)
        .map_err(|e| format!("sending the challenge: {e}"))?;
    let mut tag = [0u8; TAG_BYTES];
    (&*s)
        .read_exact(&mut tag)
        .map_err(|e| format!("no authentication tag: {e}"))?;
    if !secret.verify(Side::Connecting, &transcript, &tag) {
        return Err("wrong authentication tag (not a member of this communicator)".into());
    }
    Ok(())
}

pub(super) fn send_join_error(mut s: &Conn, code: u8, msg: &str) -> io::Result<()> {
    let mut b = vec![code];
    let msg: String = msg.chars().take(4000).collect();
    put_str(&mut b, &msg);
    s.write_all(&b)
}

pub(super) fn read_join_answer(
    s: &Conn,
    rank: usize,
    n: usize,
    config: &CommConfig,
) -> Result<Vec<String>> {
    // Rank 0 answers only when everyone joined: allow the whole rendezvous timeout.
    set_io_timeout(&s.tcp, config.timeout);
    let ctx_err = |e: io::Error| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::Timeout {
            op: Op::Rendezvous,
            rank,
            peer: Some(0),
            timeout: config.timeout,
            detail: "; rank 0 accepted this rank but not every rank joined in time \
                     (rank 0's error names the missing ones)"
                .into(),
        },
        _ => map_io(
            Op::Rendezvous,
            rank,
            0,
            config,
            "waiting for the address table",
            e,
        ),
    };
    let mut status = [0u8; 1];
    (&*s).read_exact(&mut status).map_err(ctx_err)?;
    if status[0] != 0 {
        let msg = read_str(s).map_err(ctx_err)?;
        if status[0] == JOIN_TIMEOUT {
            return Err(Error::Timeout {
                op: Op::Rendezvous,
                rank,
                peer: Some(0),
                timeout: config.timeout,
                detail: format!("; {msg}"),
            });
        }
        return Err(mismatch(Op::Rendezvous, rank, Some(0), msg));
    }
    let mut table = Vec::with_capacity(n);
    for _ in 0..n {
        table.push(read_str(s).map_err(ctx_err)?);
    }
    Ok(table)
}
