//! The client side of control frames: a small pool of connections to one role or actor
//! process; a call (unary, or a batch call with a [`FramedBatch`]) takes one (or opens one),
//! runs on the caller's task and gives it back.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::BodyExt;
use prost::Message;
use rlhf_proto::v1 as pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::tls::{Connector, Io};
use tonic::body::Body;

use super::batch::{read_batch, write_batch, FramedBatch, MAX_ANSWER_BYTES, MAX_REQUEST_BYTES};
use super::{
    batch_payload, decode, from_frame_headers, read_frame, split_batch_payload, to_frame_headers,
    write_frame, Kind, ACCEPTED, CHALLENGE, HELLO, IDLE_LIMIT,
};
use rlhf_core::batch::encode_header_sized;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A connection past the hello: reads buffered (a frame's header and payload in one read),
/// writes straight through (a frame is one write already).
type Conn = BufReader<Io>;

/// Connections kept open for later calls; more are opened while calls overlap and closed
/// when they come back to a full pool.
const POOL: usize = 8;

/// How long connecting and the hello exchange may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Unary calls to one server over control frames; clones share the pool.
#[derive(Clone)]
pub struct FramesClient {
    addr: String,
    /// The cluster token, to answer each new connection's challenge.
    token: String,
    /// TLS on a TLS cluster (offering only control frames).
    tls: Option<Connector>,
    idle: Arc<Mutex<Vec<Conn>>>,
    /// A call fails when the server sends nothing for this long ([`IDLE_LIMIT`]).
    idle_limit: Duration,
}

/// Without the token: a transport printed in a log must not show it.
impl std::fmt::Debug for FramesClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FramesClient")
            .field("addr", &self.addr)
            .field("idle_connections", &self.idle_connections())
            .field("idle_limit", &self.idle_limit)
            .finish_non_exhaustive()
    }
}

impl FramesClient {
    /// Connects to `addr` (through `tls` on a TLS cluster), says hello and proves it holds
    /// `token`. `Ok(None)`: the server answered, but not with frames (a server without them);
    /// the caller keeps HTTP/2. A server that refuses the token is an error
    /// (`PermissionDenied`).
    pub async fn connect(
        addr: &str,
        token: &str,
        tls: Option<Connector>,
    ) -> std::io::Result<Option<FramesClient>> {
        let c = FramesClient {
            addr: addr.to_string(),
            token: token.to_string(),
            tls,
            idle: Arc::default(),
            idle_limit: IDLE_LIMIT,
        };
        match c.open().await? {
            Some(s) => {
                c.give_back(s);
                Ok(Some(c))
            }
            None => Ok(None),
        }
    }

    /// A new connection past the hello; `None` when the server does not speak frames.
    async fn open(&self) -> std::io::Result<Option<Conn>> {
        let timed_out = |what: &str| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("{what} {} timed out after {CONNECT_TIMEOUT:?}", self.addr),
            )
        };
        // "tcp connect error" is what `net::never_sent` looks for: such a call is safe to
        // send again.
        let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&self.addr))
            .await
            .map_err(|_| timed_out("tcp connect error: connecting"))?
            .map_err(|e| std::io::Error::new(e.kind(), format!("tcp connect error: {e}")))?;
        tcp.set_nodelay(true)?;
        let mut s = match &self.tls {
            None => Io::Plain(tcp),
            Some(c) => match c.connect(tcp).await {
                Ok(s) => s,
                // The server offered no control frames in the handshake: it does not speak
                // them (HTTP/2 only).
                Err(e) if crate::tls::no_common_protocol(&e) => return Ok(None),
                // Nothing was sent: a call may go again ("tcp connect error" is what
                // `net::never_sent` looks for).
                Err(e) => {
                    return Err(std::io::Error::new(
                        e.kind(),
                        format!("tcp connect error: TLS handshake for control frames: {e}"),
                    ))
                }
            },
        };
        let mut hello = [0u8; HELLO.len() + CHALLENGE];
        let said = tokio::time::timeout(CONNECT_TIMEOUT, async {
            s.write_all(HELLO).await?;
            s.flush().await?;
            s.read_exact(&mut hello).await
        })
        .await
        .map_err(|_| timed_out("control frames hello to"))?;
        match said {
            Ok(_) if &hello[..HELLO.len()] == HELLO => {}
            // Closed, or answered with something else: not a frames server.
            Ok(_) => return Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(None),
            Err(e) => return Err(e),
        }
        let tag = super::answer(&self.token, &hello[HELLO.len()..]);
        let mut verdict = [0u8; 1];
        tokio::time::timeout(CONNECT_TIMEOUT, async {
            s.write_all(tag.as_ref()).await?;
            s.flush().await?;
            s.read_exact(&mut verdict).await
        })
        .await
        .map_err(|_| timed_out("control frames challenge from"))??;
        if verdict[0] != ACCEPTED {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "{} refused this cluster token for control frames; pass the head's token with --token-file or {}",
                    self.addr,
                    crate::auth::TOKEN_ENV
                ),
            ));
        }
        Ok(Some(BufReader::new(s)))
    }

    /// The same pool with another silence limit (tests shorten it).
    pub fn with_idle_limit(mut self, limit: Duration) -> FramesClient {
        self.idle_limit = limit;
        self
    }

    /// Connections open and idle now.
    pub fn idle_connections(&self) -> usize {
        self.idle.lock().map(|v| v.len()).unwrap_or(0)
    }

    fn take(&self) -> Option<Conn> {
        self.idle.lock().ok()?.pop()
    }

    fn give_back(&self, s: Conn) {
        if let Ok(mut idle) = self.idle.lock() {
            if idle.len() < POOL {
                idle.push(s);
            }
        }
    }

    /// Sends one unary gRPC call, or a batch call whose request carries a [`FramedBatch`]
    /// (the answer batch then comes back in the response's extensions), and returns its
    /// response as HTTP/2 would have. A connection that fails is `Unavailable`, as a broken
    /// HTTP/2 connection is.
    pub async fn call(self, req: http::Request<Body>) -> Result<http::Response<Body>, BoxError> {
        let path = req.uri().path().to_string();
        let addr = self.addr.clone();
        self.call_inner(req)
            .await
            .map_err(|e| match e.downcast::<tonic::Status>() {
                // Refused for what it is (a batch over a limit, a misuse): not worth a retry.
                Ok(s) => Box::new(tonic::Status::new(
                    s.code(),
                    format!("control call {path} to {addr}: {}", s.message()),
                )) as BoxError,
                Err(e) => Box::new(tonic::Status::unavailable(format!(
                    "control call {path} to {addr}: {e}"
                ))) as BoxError,
            })
    }

    async fn call_inner(self, req: http::Request<Body>) -> Result<http::Response<Body>, BoxError> {
        let (mut parts, body) = req.into_parts();
        // A batch call with its batch beside it: the message stream is empty.
        // The batch, its encoding's header and length.
        let framed = match FramedBatch::take(&mut parts.extensions) {
            Some(_) if rlhf_proto::is_unary(parts.uri.path()) => {
                return Err(Box::new(tonic::Status::invalid_argument(format!(
                    "{} is not a batch call: a framed batch goes only with one",
                    parts.uri.path()
                ))));
            }
            Some(b) => {
                let (head, len) = encode_header_sized(&b)?;
                if len > MAX_REQUEST_BYTES {
                    return Err(Box::new(tonic::Status::resource_exhausted(format!(
                        "a batch of {len} bytes is over the {MAX_REQUEST_BYTES}-byte limit of a call; split it (more ranks, or smaller rollout/micro batches)"
                    ))));
                }
                Some((b, head, len))
            }
            None => None,
        };
        let body = match framed {
            Some(_) => Default::default(),
            None => body.collect().await?.to_bytes(),
        };
        let msg = pb::ControlRequest {
            path: parts.uri.path().to_string(),
            headers: to_frame_headers(&parts.headers),
            body,
        };
        let mut s = match self.take() {
            Some(s) => s,
            None => self.open().await?.ok_or_else(|| {
                format!(
                    "{} stopped answering control frames on a new connection",
                    self.addr
                )
            })?,
        };
        match &framed {
            Some((b, head, len)) => {
                write_frame(&mut s, Kind::Batch, &batch_payload(*len, &msg)).await?;
                write_batch(&mut s, head, b, self.idle_limit).await?;
            }
            None => write_frame(&mut s, Kind::Request, &msg.encode_to_vec()).await?,
        }
        let resp = self.answer(&mut s).await?;
        self.give_back(s);
        Ok(resp)
    }

    /// Reads the call's answer: a response frame, or a batch answer and its batch (then in
    /// the response's extensions as a [`FramedBatch`]), skipping keepalives.
    async fn answer(&self, s: &mut Conn) -> Result<http::Response<Body>, BoxError> {
        loop {
            let frame = tokio::time::timeout(self.idle_limit, read_frame(s))
                .await
                .map_err(|_| {
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "the server sent nothing for {:?} during the call (stopped or unreachable)",
                            self.idle_limit
                        ),
                    )
                })??;
            match frame {
                None => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the server closed the connection during the call",
                    )
                    .into())
                }
                Some((Kind::Keepalive, _)) => continue,
                Some((Kind::Response, payload)) => {
                    return Ok(response(decode::<pb::ControlResponse>(
                        &payload, "response",
                    )?)?)
                }
                Some((Kind::BatchAnswer, payload)) => {
                    let (len, msg) = split_batch_payload(&payload)?;
                    if len > MAX_ANSWER_BYTES {
                        // The server checks this too; the connection is dropped either way.
                        return Err(Box::new(tonic::Status::resource_exhausted(format!(
                            "an answer of {len} bytes is over the {MAX_ANSWER_BYTES}-byte limit; split the batch (more ranks, or smaller rollout/micro batches)"
                        ))));
                    }
                    let r = decode::<pb::ControlResponse>(msg, "batch answer")?;
                    let b = read_batch(s, len, MAX_ANSWER_BYTES, self.idle_limit)
                        .await?
                        .map_err(|e| format!("the answer batch: {e}"))?;
                    let mut resp = response(r)?;
                    resp.extensions_mut().insert(FramedBatch(b));
                    return Ok(resp);
                }
                Some((kind @ (Kind::Request | Kind::Batch), _)) => {
                    return Err(super::invalid(format!("the server sent a {kind:?} frame")).into())
                }
            }
        }
    }
}

fn response(r: pb::ControlResponse) -> std::io::Result<http::Response<Body>> {
    let status = http::StatusCode::from_u16(r.status.min(u16::MAX as u32) as u16)
        .map_err(|e| super::invalid(format!("control frame status {}: {e}", r.status)))?;
    let trailers = from_frame_headers(r.trailers)?;
    let data = http_body_util::Full::new(r.body);
    let body = if trailers.is_empty() {
        Body::new(data)
    } else {
        Body::new(data.with_trailers(async move { Some(Ok(trailers)) }))
    };
    let mut resp = http::Response::new(body);
    *resp.status_mut() = status;
    *resp.headers_mut() = from_frame_headers(r.headers)?;
    Ok(resp)
}
