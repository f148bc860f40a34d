//! The actor process side: serves an ActorService on its own endpoint and tells its
//! worker where through a ready file. The built-in "test" actor echoes, sleeps and
//! crashes on demand; the PPO role actors plug in here as further kinds.

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

#[derive(Clone, Debug)]
pub struct ActorOptions {
    pub actor_id: String,
    pub kind: String,
    pub ready_file: PathBuf,
    pub host: String,
    pub token: String,
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
        req: Request<tonic::Streaming<pb::BatchChunk>>,
    ) -> std::result::Result<Response<pb::PutBatchResponse>, Status> {
        let mut stream = req.into_inner();
        let mut asm = rlhf_core::batch::Assembler::new(MAX_BATCH_BYTES);
        let mut bytes = 0u64;
        while let Some(chunk) = stream.message().await? {
            bytes += chunk.data.len() as u64;
            asm.push(chunk)?;
        }
        let batch = asm.finish()?;
        Ok(Response::new(pb::PutBatchResponse {
            rows: batch.len()? as u64,
            bytes,
            checksum: rlhf_core::batch::checksum(&batch),
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

/// Serves until `shutdown`. The address is written to the ready file atomically (write then rename).
pub async fn run(opts: ActorOptions, shutdown: CancellationToken) -> Result<()> {
    if !ACTOR_KINDS.contains(&opts.kind.as_str()) {
        return Err(Error::invalid(format!(
            "unknown actor kind '{}'; known kinds: {}",
            opts.kind,
            ACTOR_KINDS.join(", ")
        )));
    }
    let listener = net::bind(&opts.host, 0, "--host").await?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("actor address", e))?;
    let tmp = opts.ready_file.with_extension("tmp");
    std::fs::write(&tmp, addr.to_string())
        .map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    std::fs::rename(&tmp, &opts.ready_file)
        .map_err(|e| Error::io(format!("writing {}", opts.ready_file.display()), e))?;
    eprintln!("actor {} ({}) serving on {addr}", opts.actor_id, opts.kind);
    let svc = tonic::service::interceptor::InterceptedService::new(
        ActorServiceServer::new(TestActor {
            actor_id: opts.actor_id.clone(),
        })
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES),
        CheckToken::new(&opts.token, "actor"),
    );
    net::server_builder()
        .add_service(svc)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown.cancelled_owned(),
        )
        .await
        .map_err(|e| Error::internal(format!("actor server: {}", net::error_chain(&e))))
}
