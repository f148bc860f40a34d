//! The actor process side: serves an ActorService on its own endpoint and tells its
//! worker where through a ready file. The built-in "test" actor echoes, sleeps and
//! crashes on demand; other actor kinds (the PPO roles in rlhf-roles) reuse
//! [`bind_ready`] and [`actor_service`] and add their own service next to it.

use std::path::PathBuf;
use std::time::Duration;

use rlhf_core::{Error, Result};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::actor_service_server::{ActorService, ActorServiceServer};
use rlhf_proto::MAX_MESSAGE_BYTES;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::auth::CheckToken;
use crate::net;

pub const ACTOR_KINDS: &[&str] = &["test"];

/// Largest streamed batch an actor accepts.
pub const MAX_BATCH_BYTES: u64 = 4 << 30;

/// The variable a worker names its head's address in, for every process it starts.
pub const HEAD_ADDRESS_ENV: &str = "RLHF_HEAD_ADDRESS";
/// And the name its TLS certificate is checked against, when the worker was given one
/// (`--tls-domain`).
pub const HEAD_TLS_DOMAIN_ENV: &str = "RLHF_HEAD_TLS_DOMAIN";

#[derive(Clone, Debug)]
pub struct ActorOptions {
    pub actor_id: String,
    pub kind: String,
    pub ready_file: PathBuf,
    pub host: String,
    pub token: String,
    /// The worker's TLS identity, served with when the cluster uses TLS.
    pub tls: net::ServerTls,
}

struct TestActor {
    actor_id: String,
}

#[tonic::async_trait]
impl ActorService for TestActor {
    async fn ping(
        &self,
        req: Request<pb::PingRequest>,
    ) -> std::result::Result<Response<pb::PingResponse>, Status> {
        Ok(Response::new(pb::PingResponse {
            payload: req.into_inner().payload,
            actor_id: self.actor_id.clone(),
        }))
    }

    async fn sleep(
        &self,
        req: Request<pb::SleepRequest>,
    ) -> std::result::Result<Response<pb::SleepResponse>, Status> {
        tokio::time::sleep(Duration::from_millis(req.into_inner().ms)).await;
        Ok(Response::new(pb::SleepResponse {}))
    }

    async fn put_batch(
        &self,
        mut req: Request<tonic::Streaming<pb::BatchChunk>>,
    ) -> std::result::Result<Response<pb::PutBatchResponse>, Status> {
        if let Some(batch) = crate::frames::FramedBatch::take(req.extensions_mut()) {
            // Over control frames: views of the received buffer, hashed in one pass.
            let (rows, bytes, checksum) = tokio::task::spawn_blocking(move || {
                let (_, bytes) = rlhf_core::batch::encode_header_sized(&batch)?;
                rlhf_core::Result::Ok((
                    batch.len()? as u64,
                    bytes,
                    rlhf_core::batch::checksum(&batch),
                ))
            })
            .await
            .map_err(|e| Status::internal(format!("framed batch reader: {e}")))??;
            return Ok(Response::new(pb::PutBatchResponse {
                rows,
                bytes,
                checksum,
            }));
        }
        let mut stream = req.into_inner();
        let mut asm = rlhf_core::batch::Assembler::new(MAX_BATCH_BYTES);
        while let Some(chunk) = stream.message().await? {
            if chunk.shared.is_some() {
                // Through shared memory: views of the mapping, hashed in one pass.
                let bytes = chunk.total_bytes;
                let got = tokio::task::spawn_blocking(move || {
                    crate::shared_batch::open(&chunk, MAX_BATCH_BYTES).map(|r| {
                        r.map(|b| {
                            let sum = rlhf_core::batch::checksum(&b);
                            (b, sum)
                        })
                    })
                })
                .await
                .map_err(|e| Status::internal(format!("shared batch reader: {e}")))??;
                let (batch, checksum) =
                    got.map_err(|u| crate::shared_batch::unreachable_status(&u))?;
                return Ok(Response::new(pb::PutBatchResponse {
                    rows: batch.len()? as u64,
                    bytes,
                    checksum,
                }));
            }
            asm.push(chunk)?;
        }
        let bytes = asm.received_bytes();
        // The checksum is computed while the chunks arrive, not in a second pass.
        let (batch, checksum) = asm.finish_with_checksum()?;
        Ok(Response::new(pb::PutBatchResponse {
            rows: batch.len()? as u64,
            bytes,
            checksum,
        }))
    }

    async fn crash(
        &self,
        req: Request<pb::CrashRequest>,
    ) -> std::result::Result<Response<pb::CrashResponse>, Status> {
        let code = req.into_inner().code;
        eprintln!("crash requested with code {code}");
        tokio::spawn(async move {
            // Let the reply go out before the process dies.
            tokio::time::sleep(Duration::from_millis(50)).await;
            if code < 0 {
                std::process::abort();
            }
            std::process::exit(code);
        });
        Ok(Response::new(pb::CrashResponse {}))
    }
}

/// Binds `host` on a free port and announces the address in `ready_file` (write then rename,
/// so the worker never reads half an address). Shared by every actor kind.
pub async fn bind_ready(
    host: &str,
    ready_file: &std::path::Path,
) -> Result<(tokio::net::TcpListener, std::net::SocketAddr)> {
    let listener = net::bind(host, 0, "--host").await?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("actor address", e))?;
    let tmp = ready_file.with_extension("tmp");
    std::fs::write(&tmp, addr.to_string())
        .map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    std::fs::rename(&tmp, ready_file)
        .map_err(|e| Error::io(format!("writing {}", ready_file.display()), e))?;
    Ok((listener, addr))
}

/// The ActorService (Ping, Sleep, PutBatch, Crash) every actor process serves, with the
/// token check and message limits, ready to add to a server next to other services.
pub fn actor_service(
    actor_id: &str,
    token: &str,
) -> tonic::service::interceptor::InterceptedService<
    ActorServiceServer<impl ActorService>,
    CheckToken,
> {
    tonic::service::interceptor::InterceptedService::new(
        ActorServiceServer::new(TestActor {
            actor_id: actor_id.to_string(),
        })
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES),
        CheckToken::new(token, "actor"),
    )
}

/// Serves until `shutdown`. The address is written to the ready file atomically (write then rename).
pub async fn run(opts: ActorOptions, shutdown: CancellationToken) -> Result<()> {
    if !ACTOR_KINDS.contains(&opts.kind.as_str()) {
        return Err(Error::invalid(format!(
            "unknown actor kind '{}'; known kinds: {}",
            opts.kind,
            ACTOR_KINDS.join(", ")
        )));
    }
    let (listener, addr) = bind_ready(&opts.host, &opts.ready_file).await?;
    eprintln!("actor {} ({}) serving on {addr}", opts.actor_id, opts.kind);
    let routes = tonic::service::Routes::new(actor_service(&opts.actor_id, &opts.token));
    crate::frames::server::serve(&opts.tls, routes, listener, shutdown, "actor", &opts.token).await
}
