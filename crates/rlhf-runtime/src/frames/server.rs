//! The server side of control frames: one listener for both protocols. On a plain cluster
//! each accepted connection's first bytes say which: [`HELLO`] goes to the frames loop,
//! anything else (the HTTP/2 preface) to tonic's server, with the same routes behind both.
//! On a TLS cluster the handshake comes first, and the protocol the client chose in it
//! (ALPN, `crate::tls`) says which.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::BodyExt;
use prost::Message;
use ring::rand::{SecureRandom, SystemRandom};
use rlhf_core::{DataBatch, Error, Result};
use rlhf_proto::v1 as pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;
use tower::ServiceExt;

use super::batch::{read_batch, write_batch, FramedBatch, MAX_ANSWER_BYTES, MAX_REQUEST_BYTES};
use super::{
    batch_payload, decode, from_frame_headers, read_frame, split_batch_payload, to_frame_headers,
    write_frame, Kind, ACCEPTED, CHALLENGE, HELLO, IDLE_LIMIT, KEEPALIVE_EVERY, REFUSED,
};
use crate::auth::LogLimit;
use crate::net::{self, ServerTls};
use crate::tls::Io;
use rlhf_core::batch::encode_header_sized;

/// A connection that has not said which protocol it speaks within this is closed.
const FIRST_BYTES_WITHIN: Duration = Duration::from_secs(10);

/// Serves `routes` on `listener` until `shutdown`: HTTP/2 (tonic) and control frames on the
/// same port, frames only to clients that prove they hold `token`; both inside TLS when
/// `tls` names a certificate.
pub async fn serve(
    tls: &ServerTls,
    routes: Routes,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
    what: &str,
    token: &str,
) -> Result<()> {
    let server_err = |e: tonic::transport::Error| {
        Error::internal(format!("{what} server: {}", net::error_chain(&e)))
    };
    // Reads and checks the certificate and key (both or neither) before serving.
    let acceptor = crate::tls::acceptor(tls)?;
    let (h2_tx, h2_rx) = tokio::sync::mpsc::channel::<std::io::Result<Io>>(64);
    let auth = Arc::new(Auth {
        token: token.to_string(),
        log: Mutex::default(),
    });
    let accept = {
        let (routes, shutdown) = (routes.clone(), shutdown.clone());
        async move {
            loop {
                let (s, peer) = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    r = listener.accept() => match r {
                        Ok(c) => c,
                        Err(e) => {
                            // Out of descriptors and the like: wait, do not spin.
                            tracing::warn!("{e} accepting a connection");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                };
                let (routes, shutdown, h2_tx) = (routes.clone(), shutdown.clone(), h2_tx.clone());
                let (auth, acceptor) = (auth.clone(), acceptor.clone());
                tokio::spawn(async move {
                    net::tune_accepted(&s);
                    let (s, frames) = match &acceptor {
                        Some(a) => match crate::tls::accept(a, s).await {
                            Ok(c) => c,
                            Err(e) => {
                                tracing::debug!("{peer}: TLS handshake: {e}; connection closed");
                                return;
                            }
                        },
                        None => match first_bytes(&s).await {
                            Some(b) => (Io::Plain(s), b == HELLO[..4]),
                            None => {
                                tracing::debug!("{peer} said nothing; connection closed");
                                return;
                            }
                        },
                    };
                    if frames {
                        serve_frames(s, peer, routes, shutdown, auth).await
                    } else {
                        let _ = h2_tx.send(Ok(s)).await;
                    }
                });
            }
        }
    };
    let grpc = net::server_builder()
        .add_routes(routes)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::ReceiverStream::new(h2_rx),
            shutdown.cancelled_owned(),
        );
    tokio::pin!(grpc);
    // The accept loop ends at shutdown (and the listener closes with it), then tonic's server
    // finishes its calls; a server that fails first ends both.
    let failed = tokio::select! {
        r = &mut grpc => Some(r),
        () = accept => None,
    };
    match failed {
        Some(r) => r,
        None => grpc.await,
    }
    .map_err(server_err)
}

/// The connection's first four bytes, left in the socket; `None` if it closed or said
/// nothing within [`FIRST_BYTES_WITHIN`].
async fn first_bytes(s: &TcpStream) -> Option<[u8; 4]> {
    let mut b = [0u8; 4];
    let peek = async {
        loop {
            match s.peek(&mut b).await {
                Ok(0) | Err(_) => return false,
                Ok(n) if n >= b.len() => return true,
                // A first segment shorter than four bytes: wait for the rest.
                Ok(_) => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        }
    };
    match tokio::time::timeout(FIRST_BYTES_WITHIN, peek).await {
        Ok(true) => Some(b),
        _ => None,
    }
}

/// One frames connection: the hello, then calls one at a time (unary, or batch calls with
/// their batch) until the client closes or the server shuts down.
async fn serve_frames(
    mut s: Io,
    peer: SocketAddr,
    routes: Routes,
    shutdown: CancellationToken,
    auth: Arc<Auth>,
) {
    if !authenticate(&mut s, peer, &auth).await {
        return;
    }
    let info = tonic::transport::server::TcpConnectInfo {
        local_addr: s.tcp().local_addr().ok(),
        remote_addr: Some(peer),
    };
    // Reads buffered: a frame's header and payload in one read.
    let mut s = tokio::io::BufReader::new(s);
    loop {
        let frame = tokio::select! {
            _ = shutdown.cancelled() => return,
            f = read_frame(&mut s) => f,
        };
        let (req, framed) = match frame {
            Ok(Some((Kind::Request, p))) => match decode::<pb::ControlRequest>(&p, "request") {
                Ok(r) => (r, None),
                Err(e) => {
                    tracing::debug!("{peer}: {e}; connection closed");
                    return;
                }
            },
            Ok(Some((Kind::Batch, p))) => match tokio::select! {
                // A batch half read is of no use to a server going away.
                _ = shutdown.cancelled() => return,
                r = read_batch_call(&p, &mut s) => r,
            } {
                Ok((r, Ok(b))) => (r, Some(b)),
                // Every byte was read: the stream is in step, the call gets its answer.
                Ok((r, Err(e))) => {
                    let refused = tonic::Status::invalid_argument(format!(
                        "{}: the framed batch: {e}",
                        r.path
                    ));
                    if write_status(&mut s, refused).await.is_err() {
                        return;
                    }
                    continue;
                }
                Err(e) => {
                    tracing::warn!("{peer}: {e} receiving a framed batch; connection closed");
                    return;
                }
            },
            Ok(None) => return,
            Ok(Some((kind, _))) => {
                tracing::debug!("{peer}: unexpected {kind:?} control frame; connection closed");
                return;
            }
            Err(e) => {
                tracing::debug!("{peer}: {e}; connection closed");
                return;
            }
        };
        let answer = match call(&routes, &info, req, framed, &mut s).await {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!("{peer}: {e}; connection closed");
                return;
            }
        };
        let sent = match answer {
            Answer::Response(r) => write_frame(&mut s, Kind::Response, &r).await,
            Answer::Batch(r, b) => send_batch_answer(&mut s, &r, &b).await,
        };
        if let Err(e) = sent {
            tracing::debug!("{peer}: {e} sending an answer; connection closed");
            return;
        }
    }
}

/// A batch call's message and its batch, read after its frame.
async fn read_batch_call(
    payload: &[u8],
    s: &mut tokio::io::BufReader<Io>,
) -> std::io::Result<(pb::ControlRequest, std::result::Result<DataBatch, String>)> {
    let (len, msg) = split_batch_payload(payload)?;
    let r = decode::<pb::ControlRequest>(msg, "batch call")?;
    let b = read_batch(s, len, MAX_REQUEST_BYTES, IDLE_LIMIT).await?;
    Ok((r, b))
}

/// A batch answer frame and the batch's bytes after it.
async fn send_batch_answer(
    s: &mut tokio::io::BufReader<Io>,
    r: &pb::ControlResponse,
    b: &DataBatch,
) -> std::io::Result<()> {
    let (head, len) = encode_header_sized(b).map_err(|e| super::invalid(e.to_string()))?;
    if len > MAX_ANSWER_BYTES {
        return write_status(s, tonic::Status::resource_exhausted(format!(
            "an answer of {len} bytes is over the {MAX_ANSWER_BYTES}-byte limit of a framed answer; split the batch (more ranks, or smaller rollout/micro batches)"
        )))
        .await;
    }
    write_frame(s, Kind::BatchAnswer, &batch_payload(len, r)).await?;
    write_batch(s, &head, b, IDLE_LIMIT).await
}

/// What the server checks a frames connection's answer against.
struct Auth {
    token: String,
    /// Refusals logged one by one only up to a limit (a peer retrying with a wrong token).
    log: Mutex<LogLimit>,
}

/// The hello and the token challenge (see the module doc of `super`); whether the client
/// passed. Nothing past them is read from a client that did not.
async fn authenticate(s: &mut Io, peer: SocketAddr, auth: &Auth) -> bool {
    let mut challenge = [0u8; CHALLENGE];
    if SystemRandom::new().fill(&mut challenge).is_err() {
        tracing::error!("no random bytes for a control frames challenge; connection closed");
        return false;
    }
    let mut hello = [0u8; HELLO.len()];
    let mut tag = [0u8; CHALLENGE];
    let said = tokio::time::timeout(FIRST_BYTES_WITHIN, async {
        s.read_exact(&mut hello).await?;
        if &hello != HELLO {
            return Ok(false);
        }
        s.write_all(HELLO).await?;
        s.write_all(&challenge).await?;
        s.flush().await?;
        s.read_exact(&mut tag).await?;
        std::io::Result::Ok(true)
    })
    .await;
    if !matches!(said, Ok(Ok(true))) {
        tracing::debug!("{peer}: not a control frames hello; connection closed");
        return false;
    }
    let ok = super::answered(&auth.token, &challenge, &tag);
    let verdict = [if ok { ACCEPTED } else { REFUSED }];
    let told = tokio::time::timeout(FIRST_BYTES_WITHIN, async {
        s.write_all(&verdict).await?;
        s.flush().await
    })
    .await;
    if !matches!(told, Ok(Ok(()))) {
        tracing::debug!("{peer}: the control frames verdict could not be sent; connection closed");
        return false;
    }
    if !ok {
        let (log, earlier) = LogLimit::admit_shared(&auth.log);
        if let Some(n) = earlier {
            tracing::warn!("{n} more control frames connections with a wrong cluster token were refused in the last minute (not logged one by one)");
        }
        if log {
            tracing::warn!(peer = %peer, "refused a control frames connection: wrong cluster token");
        }
    }
    ok
}

/// Answers a call with only a gRPC status (trailers-only, as tonic sends an error).
async fn write_status(s: &mut tokio::io::BufReader<Io>, st: tonic::Status) -> std::io::Result<()> {
    let parts = st.into_http::<()>().into_parts().0;
    let r = pb::ControlResponse {
        status: parts.status.as_u16() as u32,
        headers: to_frame_headers(&parts.headers),
        body: Default::default(),
        trailers: Vec::new(),
    };
    write_frame(s, Kind::Response, &r.encode_to_vec()).await
}

/// What a call answers: a response message, or a response and a batch to send after it.
enum Answer {
    Response(Vec<u8>),
    Batch(pb::ControlResponse, DataBatch),
}

/// Runs one call through `routes` (with `framed` as the request's [`FramedBatch`]), saying it
/// is alive every [`KEEPALIVE_EVERY`] while it runs. An error ends the connection (the call,
/// if it started, is dropped with it, as HTTP/2 drops a reset stream's).
async fn call(
    routes: &Routes,
    info: &tonic::transport::server::TcpConnectInfo,
    r: pb::ControlRequest,
    framed: Option<DataBatch>,
    s: &mut tokio::io::BufReader<Io>,
) -> std::io::Result<Answer> {
    let mut req = http::Request::new(tonic::body::Body::new(http_body_util::Full::new(r.body)));
    *req.method_mut() = http::Method::POST;
    *req.version_mut() = http::Version::HTTP_2;
    *req.uri_mut() = r
        .path
        .parse()
        .map_err(|e| super::invalid(format!("control frame path {:?}: {e}", r.path)))?;
    *req.headers_mut() = from_frame_headers(r.headers)?;
    req.extensions_mut().insert(info.clone());
    if let Some(b) = framed {
        req.extensions_mut().insert(FramedBatch(b));
    }
    let answer = async {
        let resp = match routes.clone().oneshot(req).await {
            Ok(r) => r,
            Err(never) => match never {},
        };
        let (mut parts, body) = resp.into_parts();
        let (body, trailers) = match body.collect().await {
            Ok(c) => {
                let trailers = c.trailers().map(to_frame_headers).unwrap_or_default();
                (c.to_bytes(), trailers)
            }
            // The body failed halfway: answer as a gRPC error, which the caller reports.
            Err(e) => (
                Default::default(),
                to_frame_headers(
                    &tonic::Status::internal(format!("response body: {e}"))
                        .into_http::<()>()
                        .into_parts()
                        .0
                        .headers,
                ),
            ),
        };
        let msg = pb::ControlResponse {
            status: parts.status.as_u16() as u32,
            headers: to_frame_headers(&parts.headers),
            body,
            trailers,
        };
        match FramedBatch::take(&mut parts.extensions) {
            Some(b) => Answer::Batch(msg, b),
            None => Answer::Response(msg.encode_to_vec()),
        }
    };
    tokio::pin!(answer);
    let mut alive = tokio::time::interval_at(
        tokio::time::Instant::now() + KEEPALIVE_EVERY,
        KEEPALIVE_EVERY,
    );
    // After a slow keepalive write, the next one a whole period later, not a burst.
    alive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            a = &mut answer => return Ok(a),
            _ = alive.tick() => write_frame(s, Kind::Keepalive, &[]).await?,
        }
    }
}
