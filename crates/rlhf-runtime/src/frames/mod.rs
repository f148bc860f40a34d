//! Control frames: the unary gRPC calls to role and actor processes (and their batch calls,
//! [`batch`]), carried over TCP frames instead of HTTP/2 (inside TLS on a TLS cluster).
//!
//! Why: a no-op call through HTTP/2 took 120–135 µs here against a ~50 µs raw TCP echo, and
//! the difference was user-space work in h2 and hyper on both sides (about 58 µs of the
//! server's CPU per call), not the network. The driver's control calls to its role processes
//! (init, comm set-up, weight sync, checksums, checkpoints) pay that on every step. A
//! frame is one `write` and one `read` on each side, and the call runs on the caller's task
//! (no connection task to wake).
//!
//! What travels: the gRPC call itself, whole ([`ControlRequest`], [`ControlResponse`] in
//! proto/rlhf/v1/control.proto): path, headers, the length-prefixed gRPC body, trailers. So
//! the server dispatches it into the same tonic services, behind the same token check
//! (`authorization` is one of the headers), and the client hands tonic the same response
//! it would have read from HTTP/2. Batch calls travel as frames only when the client puts
//! the batch beside the call ([`FramedBatch`]); otherwise they stream over HTTP/2.
//!
//! The wire: a connection starts with [`HELLO`] from the client, answered by the same 24
//! bytes and a 32-byte random challenge (a server that does not speak frames answers
//! something else, and the client falls back to HTTP/2 for good). The client proves it holds
//! the cluster token: HMAC-SHA256 keyed with the token over the hello and the challenge. The
//! server answers one byte, [`ACCEPTED`] or [`REFUSED`] (then closes), and reads no frame
//! before that: a peer without the token cannot make it read or buffer anything more. Then
//! frames, `u32 LE length | u8 kind | payload`:
//! - [`Kind::Request`]: a `ControlRequest`, client to server, one call at a time per
//!   connection (a client opens another connection for a call made while one is in flight);
//! - [`Kind::Response`]: its `ControlResponse`;
//! - [`Kind::Keepalive`]: empty, server to client every [`KEEPALIVE_EVERY`] while a call
//!   runs, so a client finds a stopped or vanished server within [`IDLE_LIMIT`] even during
//!   a call that takes minutes (HTTP/2 keepalive pings did that before);
//! - [`Kind::Batch`]: a batch call, client to server: `u64 LE length | ControlRequest` (an
//!   empty body), then that many raw bytes of the request batch's encoding ([`batch`]);
//! - [`Kind::BatchAnswer`]: its answer when it is a batch: `u64 LE length |
//!   ControlResponse`, then the answer's encoding. A batch call answered otherwise (an
//!   error, or a unary answer such as `PutBatch`'s) gets a [`Kind::Response`].
//!
//! Security: on a TLS cluster the connection is TLS first, frames chosen by ALPN
//! (`crate::tls`), and all of the above runs inside it. The connection is authenticated by
//! the challenge above, and every call still carries the cluster token and is checked by the
//! same interceptor as over HTTP/2.

pub mod batch;
pub mod client;
pub mod server;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tls_tests;

use std::time::Duration;

use prost::bytes::Bytes;
use prost::Message;
use rlhf_proto::v1 as pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub use batch::FramedBatch;
pub use client::FramesClient;

/// First bytes of a frames connection, both ways; as long as the HTTP/2 client preface, so a
/// server reading a preface gets all of it at once and refuses it.
pub const HELLO: &[u8; 24] = b"RLHF control frames v1\r\n";

/// The server's challenge and the client's answer (an HMAC-SHA256 tag), in bytes.
pub const CHALLENGE: usize = 32;

/// The server's verdict on the client's answer.
pub const ACCEPTED: u8 = 1;
pub const REFUSED: u8 = 0;

/// What the client's answer signs: [`HELLO`], then the server's challenge.
fn signed(challenge: &[u8]) -> Vec<u8> {
    [HELLO.as_slice(), challenge].concat()
}

/// The client's answer to `challenge`: HMAC-SHA256 keyed with the cluster token.
fn answer(token: &str, challenge: &[u8]) -> ring::hmac::Tag {
    ring::hmac::sign(&crate::beat::hmac_key(token.as_bytes()), &signed(challenge))
}

/// Whether `tag` answers `challenge` for `token` (in constant time).
fn answered(token: &str, challenge: &[u8], tag: &[u8]) -> bool {
    ring::hmac::verify(
        &crate::beat::hmac_key(token.as_bytes()),
        &signed(challenge),
        tag,
    )
    .is_ok()
}

/// Largest frame payload: a gRPC message at its limit, plus room for headers.
pub const MAX_FRAME: usize = rlhf_proto::MAX_MESSAGE_BYTES + (1 << 20);

/// How often a server that is running a call says it is alive.
pub const KEEPALIVE_EVERY: Duration = Duration::from_secs(5);

/// A client gives up on a connection that sent nothing for this long during a call.
pub const IDLE_LIMIT: Duration = Duration::from_secs(30);

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Request = 1,
    Response = 2,
    Keepalive = 3,
    Batch = 4,
    BatchAnswer = 5,
}

impl Kind {
    fn from_byte(b: u8) -> std::io::Result<Kind> {
        match b {
            1 => Ok(Kind::Request),
            2 => Ok(Kind::Response),
            3 => Ok(Kind::Keepalive),
            4 => Ok(Kind::Batch),
            5 => Ok(Kind::BatchAnswer),
            other => Err(invalid(format!("unknown control frame kind {other}"))),
        }
    }
}

fn invalid(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
}

/// Writes one frame in one write, and flushes it (a TLS stream may hold it otherwise), within
/// [`IDLE_LIMIT`] plus its size at the batches' rate floor (a peer that stopped reading
/// fails the write, it does not hang it).
pub async fn write_frame<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    kind: Kind,
    payload: &[u8],
) -> std::io::Result<()> {
    let within = IDLE_LIMIT + Duration::from_secs_f64(payload.len() as f64 / batch::MIN_RATE);
    tokio::time::timeout(within, write_frame_now(w, kind, payload))
        .await
        .map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "a control frame of {} bytes was not sent within {within:?} (the peer \
                     stopped reading or is unreachable)",
                    payload.len()
                ),
            )
        })?
}

async fn write_frame_now<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    kind: Kind,
    payload: &[u8],
) -> std::io::Result<()> {
    if payload.len() > MAX_FRAME {
        return Err(invalid(format!(
            "control frame of {} bytes is over the {MAX_FRAME}-byte limit",
            payload.len()
        )));
    }
    let mut buf = Vec::with_capacity(5 + payload.len());
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.push(kind as u8);
    buf.extend_from_slice(payload);
    w.write_all(&buf).await?;
    w.flush().await
}

/// Reads one frame; `None` at a clean end of the connection before a frame starts.
pub async fn read_frame<R: AsyncReadExt + Unpin>(
    r: &mut R,
) -> std::io::Result<Option<(Kind, Bytes)>> {
    let mut head = [0u8; 5];
    // The first byte tells a clean close (EOF here) from one cut inside a frame. A TLS peer
    // that closes without close_notify reads as an unexpected EOF here: a close all the same.
    match r.read(&mut head[..1]).await {
        Ok(0) => return Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Ok(_) => {}
        Err(e) => return Err(e),
    }
    // Once a frame has begun, the rest comes within IDLE_LIMIT plus its size at the batches'
    // rate floor, as a frame is written: a peer that stops mid-frame (stopped, not dead,
    // so TCP keepalive does not end it) does not hold this reader for ever.
    let cut = |what: &str, within: Duration| {
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "the peer stopped inside a control frame: its {what} did not arrive within {:.0} s",
                within.as_secs_f64()
            ),
        )
    };
    tokio::time::timeout(IDLE_LIMIT, r.read_exact(&mut head[1..]))
        .await
        .map_err(|_| cut("header", IDLE_LIMIT))??;
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let kind = Kind::from_byte(head[4])?;
    if len > MAX_FRAME {
        return Err(invalid(format!(
            "control frame of {len} bytes is over the {MAX_FRAME}-byte limit"
        )));
    }
    let mut payload = vec![0u8; len];
    let within = IDLE_LIMIT + Duration::from_secs_f64(len as f64 / batch::MIN_RATE);
    tokio::time::timeout(within, r.read_exact(&mut payload))
        .await
        .map_err(|_| cut("payload", within))??;
    Ok(Some((kind, Bytes::from(payload))))
}

/// HTTP headers as frame headers (names are lower-case ASCII already).
fn to_frame_headers(h: &http::HeaderMap) -> Vec<pb::FrameHeader> {
    h.iter()
        .map(|(n, v)| pb::FrameHeader {
            name: n.as_str().to_string(),
            value: v.as_bytes().to_vec(),
        })
        .collect()
}

/// Frame headers back into HTTP headers; a name or value HTTP would not carry is an error.
fn from_frame_headers(h: Vec<pb::FrameHeader>) -> std::io::Result<http::HeaderMap> {
    let mut map = http::HeaderMap::with_capacity(h.len());
    for f in h {
        let name = http::HeaderName::from_bytes(f.name.as_bytes())
            .map_err(|e| invalid(format!("control frame header name {:?}: {e}", f.name)))?;
        let value = http::HeaderValue::from_bytes(&f.value)
            .map_err(|e| invalid(format!("control frame header {name}: {e}")))?;
        map.append(name, value);
    }
    Ok(map)
}

/// A batch frame's payload: the raw batch's length, then the call or answer message.
fn batch_payload(len: u64, msg: &impl Message) -> Vec<u8> {
    [&len.to_le_bytes()[..], &msg.encode_to_vec()].concat()
}

/// The raw batch's length and the message of a batch frame's payload.
fn split_batch_payload(payload: &[u8]) -> std::io::Result<(u64, &[u8])> {
    let (len, rest) = payload
        .split_first_chunk::<8>()
        .ok_or_else(|| invalid("a batch frame shorter than its length".to_string()))?;
    Ok((u64::from_le_bytes(*len), rest))
}

fn decode<M: Message + Default>(payload: &[u8], what: &str) -> std::io::Result<M> {
    M::decode(payload).map_err(|e| invalid(format!("bad {what} frame: {e}")))
}
