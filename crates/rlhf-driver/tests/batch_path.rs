//! How the driver's batch calls pick their path, against a real gRPC server: a member that
//! cannot read this process's shared memory (a role on another host) answers the first
//! shared-memory request with the "unreachable" mark; the driver then sends that batch and
//! every later one to it as raw control frames where the member's server speaks them (else
//! streamed), and the answers are the batches themselves (nothing lost, nothing sent twice
//! to the role's compute).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rlhf_core::batch::{encode_chunks, Assembler, DataBatch, TensorData, CHUNK_BYTES};
use rlhf_core::BatchRoute;
use rlhf_driver::group::{call_batch, BatchCall, BatchPath, Member};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::role_service_client::RoleServiceClient;
use rlhf_proto::v1::role_service_server::{RoleService, RoleServiceServer};
use rlhf_runtime::frames::FramedBatch;
use rlhf_runtime::shared_batch::{unreachable_status, Unreachable};
use tonic::{Request, Response, Status, Streaming};

type Chunks = std::pin::Pin<Box<dyn futures::Stream<Item = Result<pb::BatchChunk, Status>> + Send>>;

/// A role on "another host": refuses shared-memory batches, echoes streamed and framed
/// ones.
#[derive(Default)]
struct FarRole {
    refused: AtomicUsize,
    streamed: AtomicUsize,
    framed: AtomicUsize,
}

impl FarRole {
    async fn echo(
        &self,
        mut req: Request<Streaming<pb::BatchChunk>>,
    ) -> Result<Response<Chunks>, Status> {
        if let Some(b) = FramedBatch::take(req.extensions_mut()) {
            self.framed.fetch_add(1, Ordering::SeqCst);
            let mut resp: Response<Chunks> = Response::new(Box::pin(futures::stream::empty()));
            resp.extensions_mut().insert(FramedBatch(b));
            return Ok(resp);
        }
        let mut s = req.into_inner();
        let mut asm = Assembler::new(1 << 30);
        while let Some(c) = s.message().await? {
            if c.shared.is_some() {
                self.refused.fetch_add(1, Ordering::SeqCst);
                return Err(unreachable_status(&Unreachable("another host".into())));
            }
            asm.push(c)?;
        }
        self.streamed.fetch_add(1, Ordering::SeqCst);
        let b = asm.finish()?;
        let chunks = encode_chunks(&b, CHUNK_BYTES)?;
        Ok(Response::new(Box::pin(futures::stream::iter(
            chunks.into_iter().map(Ok),
        ))))
    }
}

/// The server's handle on the shared counters.
struct Far(Arc<FarRole>);

/// The whole service: unary calls unimplemented, batch calls echoed. One macro for the
/// impl block, so `async_trait` sees every method.
macro_rules! far_role {
    (unary { $($u:ident($req:ty) -> $resp:ty;)* } batch { $($b:ident, $stream:ident;)* }) => {
        #[tonic::async_trait]
        impl RoleService for Far {
            $(
                async fn $u(&self, _: Request<$req>) -> Result<Response<$resp>, Status> {
                    Err(Status::unimplemented(stringify!($u)))
                }
            )*
            $(
                type $stream = Chunks;
                async fn $b(
                    &self,
                    r: Request<Streaming<pb::BatchChunk>>,
                ) -> Result<Response<Chunks>, Status> {
                    self.0.echo(r).await
                }
            )*
        }
    };
}

far_role! {
    unary {
        init_role(pb::InitRoleRequest) -> pb::InitRoleResponse;
        prepare_comm(pb::PrepareCommRequest) -> pb::PrepareCommResponse;
        join_comm(pb::JoinCommRequest) -> pb::JoinCommResponse;
        sync_weights(pb::SyncWeightsRequest) -> pb::SyncWeightsResponse;
        weights_checksum(pb::WeightsChecksumRequest) -> pb::WeightsChecksumResponse;
        save_checkpoint(pb::SaveCheckpointRequest) -> pb::SaveCheckpointResponse;
        wait_checkpoint(pb::WaitCheckpointRequest) -> pb::SaveCheckpointResponse;
        load_checkpoint(pb::LoadCheckpointRequest) -> pb::LoadCheckpointResponse;
    }
    batch {
        generate, GenerateStream;
        compute_log_probs, ComputeLogProbsStream;
        compute_values, ComputeValuesStream;
        compute_scores, ComputeScoresStream;
        update_actor, UpdateActorStream;
        update_critic, UpdateCriticStream;
        update_sft, UpdateSftStream;
        update_preference, UpdatePreferenceStream;
        update_reward_model, UpdateRewardModelStream;
    }
}

/// A member at `addr` through `client`.
fn member(addr: &str, client: rlhf_runtime::net::AuthChannel, batches: BatchPath) -> Member {
    Member {
        actor_id: "far".into(),
        node_id: "n".into(),
        address: addr.to_string(),
        pid: 0,
        log_file: String::new(),
        client: RoleServiceClient::new(client),
        batches,
    }
}

/// 3 MiB of values and a column.
fn far_batch() -> DataBatch {
    let v: Vec<f32> = (0..3 << 18).map(|i| i as f32).collect();
    DataBatch::new()
        .with_tensor(
            "values",
            TensorData::from_f32(vec![3, 1 << 18], &v).unwrap(),
        )
        .with_column("prompt", (0..3).map(|i| serde_json::json!(i)).collect())
}

/// A [`FarRole`] served over gRPC (HTTP/2 only) on loopback: the role, its address and a
/// connection to it.
async fn far_role() -> (Arc<FarRole>, String, rlhf_runtime::net::AuthChannel) {
    let role = Arc::new(FarRole::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RoleServiceServer::new(Far(role.clone())))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let o = rlhf_runtime::net::ClientOptions::new("t");
    let ch = rlhf_runtime::net::connect_direct(&addr, &o).await.unwrap();
    (role, addr, ch)
}

async fn call(m: &Member, call: BatchCall, b: &DataBatch) -> rlhf_core::Result<DataBatch> {
    call_batch(m, call, b, Duration::from_secs(20)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_cannot_read_shared_memory_gets_every_batch_streamed() {
    let (role, addr, ch) = far_role().await;
    let member = member(&addr, ch, BatchPath::new(false));
    let b = far_batch();
    // The first call is refused once and streamed; the path is then settled: the second
    // makes no shared-memory attempt.
    for (n, c) in [BatchCall::ComputeValues, BatchCall::UpdateCritic]
        .into_iter()
        .enumerate()
    {
        let out = call(&member, c, &b).await.unwrap();
        assert_eq!(out, b);
        assert_eq!(role.refused.load(Ordering::SeqCst), 1);
        assert_eq!(role.streamed.load(Ordering::SeqCst), n + 1);
        assert!(!member.batches.is_shared());
    }
    // Asked for shared memory (`--batch-path shm`), such a member is an error naming the
    // flag, not a silent fallback; frames on a connection without them is refused up front.
    let forced = Member {
        batches: BatchPath::forced(false, BatchRoute::Shm, "far").unwrap(),
        ..member.clone()
    };
    let e = call(&forced, BatchCall::ComputeValues, &b)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("--batch-path shm"), "{e}");
    assert_eq!(role.refused.load(Ordering::SeqCst), 2);
    let e = BatchPath::forced(false, BatchRoute::Frames, "far").unwrap_err();
    assert!(
        e.to_string().contains("does not speak control frames"),
        "{e}"
    );
    // `--batch-path stream`: no shared-memory attempt at all.
    let streamed = Member {
        batches: BatchPath::forced(false, BatchRoute::Stream, "far").unwrap(),
        ..member
    };
    let out = call(&streamed, BatchCall::ComputeValues, &b).await.unwrap();
    assert_eq!(out, b);
    assert_eq!(role.refused.load(Ordering::SeqCst), 2);
    assert_eq!(role.streamed.load(Ordering::SeqCst), 3);
}

/// A member whose address is another host's (TEST-NET-1 here, the connection itself local)
/// is never offered shared memory, not even the first batch: nothing is refused, all is
/// streamed. Its loopback twin still makes the one attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_at_another_hosts_address_gets_no_shared_memory_attempt() {
    let (role, addr, ch) = far_role().await;
    let far = "192.0.2.1:9";
    let remote = member(far, ch.clone(), BatchPath::for_address(false, far));
    let b = far_batch();
    for n in 1..=2 {
        let out = call(&remote, BatchCall::ComputeValues, &b).await.unwrap();
        assert_eq!(out, b);
        assert_eq!(role.refused.load(Ordering::SeqCst), 0, "no attempt");
        assert_eq!(role.streamed.load(Ordering::SeqCst), n);
    }
    let near = member(&addr, ch, BatchPath::for_address(false, &addr));
    call(&near, BatchCall::ComputeValues, &b).await.unwrap();
    assert_eq!(
        role.refused.load(Ordering::SeqCst),
        1,
        "loopback: one attempt"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_on_another_host_gets_every_batch_as_raw_frames() {
    let role = Arc::new(FarRole::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = tokio_util::sync::CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    let routes = tonic::service::Routes::new(RoleServiceServer::new(Far(role.clone())));
    tokio::spawn(async move {
        rlhf_runtime::frames::server::serve(
            &Default::default(),
            routes,
            listener,
            stop,
            "role",
            "t",
        )
        .await
    });
    let o = rlhf_runtime::net::ClientOptions::new("t");
    let (ch, framed) = rlhf_runtime::net::connect_direct_framed(&addr, &o)
        .await
        .unwrap();
    assert!(framed, "a role process's server speaks control frames");
    let member = Member {
        actor_id: "far".into(),
        node_id: "n".into(),
        address: addr.clone(),
        pid: 0,
        log_file: String::new(),
        client: RoleServiceClient::new(ch),
        batches: BatchPath::new(framed),
    };
    let v: Vec<f32> = (0..3 << 18).map(|i| i as f32).collect();
    let b = DataBatch::new()
        .with_tensor(
            "values",
            TensorData::from_f32(vec![3, 1 << 18], &v).unwrap(),
        )
        .with_column("prompt", (0..3).map(|i| serde_json::json!(i)).collect());
    for (n, c) in [BatchCall::ComputeValues, BatchCall::UpdateCritic]
        .into_iter()
        .enumerate()
    {
        let out = call(&member, c, &b).await.unwrap();
        assert_eq!(out, b);
        assert!(out.tensors["values"].data.is_view(), "received in place");
        assert_eq!(role.refused.load(Ordering::SeqCst), 1);
        assert_eq!(role.framed.load(Ordering::SeqCst), n + 1);
        assert_eq!(role.streamed.load(Ordering::SeqCst), 0);
        assert!(!member.batches.is_shared());
    }
}
