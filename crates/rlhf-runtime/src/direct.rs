//! The transport under every client of the cluster ([`Transport`]): tonic's `Channel`, or one
//! HTTP/2 connection used directly ([`Direct`]).
//!
//! Why a direct connection: tonic's `Channel` puts a buffer task between the caller and the
//! connection (it makes the channel shareable and reconnecting), which costs two more task
//! wake-ups per call; on a small VM that is a good part of a control call's round trip. The
//! driver's calls to role processes need neither: a role process's address lives and dies
//! with it. So `crate::net::connect_direct` hands those out (over TLS on a TLS cluster,
//! `crate::tls`), and everything that must survive a peer's restart (workers and drivers
//! to the head) keeps the reconnecting channel. On such a connection the unary calls travel
//! as control frames (`crate::frames`) where the server speaks them, and so do batch calls
//! whose request carries its batch as a `crate::frames::FramedBatch`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::uri::{Authority, Scheme};
use hyper::client::conn::http2::SendRequest;
use tonic::body::Body;
use tonic::transport::Channel;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture = Pin<Box<dyn Future<Output = Result<http::Response<Body>, BoxError>> + Send>>;

/// One HTTP/2 connection, driven by a task of its own; clones share it. Unary calls go as
/// control frames instead when the server speaks them (`crate::frames`).
#[derive(Clone, Debug)]
pub struct Direct {
    pub(crate) send: SendRequest<Body>,
    pub(crate) authority: Authority,
    /// `https` over TLS (`crate::tls`), `http` otherwise.
    pub(crate) scheme: Scheme,
    pub(crate) frames: Option<crate::frames::FramesClient>,
}

/// What a gRPC client of this cluster sends through.
#[derive(Clone, Debug)]
pub enum Transport {
    /// tonic's reconnecting, buffered channel.
    Channel(Channel),
    /// One connection, no buffer task (see the module doc).
    Direct(Direct),
}

impl Transport {
    /// The control frames pool unary calls go through, if they do.
    pub fn frames(&self) -> Option<&crate::frames::FramesClient> {
        match self {
            Transport::Direct(d) => d.frames.as_ref(),
            Transport::Channel(_) => None,
        }
    }

    /// The same transport with its frames pool changed by `f` (tests shorten its limits).
    pub fn map_frames(
        mut self,
        f: impl FnOnce(crate::frames::FramesClient) -> crate::frames::FramesClient,
    ) -> Transport {
        if let Transport::Direct(d) = &mut self {
            d.frames = d.frames.take().map(f);
        }
        self
    }
}

impl tower::Service<http::Request<Body>> for Transport {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match self {
            Transport::Channel(c) => {
                tower::Service::<http::Request<Body>>::poll_ready(c, cx).map_err(Into::into)
            }
            Transport::Direct(d) => d.send.poll_ready(cx).map_err(Into::into),
        }
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let framed = req
            .extensions()
            .get::<crate::frames::FramedBatch>()
            .is_some();
        if framed && self.frames().is_none() {
            // Over HTTP/2 the call would arrive with no batch at all.
            let path = req.uri().path().to_string();
            return Box::pin(async move {
                Err(Box::new(tonic::Status::internal(format!(
                    "{path}: a framed batch needs a control frames connection; stream the batch instead"
                ))) as BoxError)
            });
        }
        match self {
            Transport::Channel(c) => {
                let f = tower::Service::call(c, req);
                Box::pin(async move { f.await.map_err(Into::into) })
            }
            Transport::Direct(d) => {
                if let Some(f) = &d.frames {
                    if framed || rlhf_proto::is_unary(req.uri().path()) {
                        return Box::pin(f.clone().call(req));
                    }
                }
                // tonic's clients send the path alone; HTTP/2 needs scheme and authority.
                let (mut parts, body) = req.into_parts();
                let mut uri = parts.uri.into_parts();
                uri.scheme = Some(d.scheme.clone());
                uri.authority = Some(d.authority.clone());
                parts.uri = match http::Uri::from_parts(uri) {
                    Ok(u) => u,
                    Err(e) => return Box::pin(async move { Err(e.into()) }),
                };
                let f = d.send.send_request(http::Request::from_parts(parts, body));
                Box::pin(async move { Ok(f.await?.map(Body::new)) })
            }
        }
    }
}
