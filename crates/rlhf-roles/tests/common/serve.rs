//! A role server in this process over real gRPC, called as the driver calls it: the
//! helpers of the server tests (`server.rs`, `server_sync.rs`).

use rlhf_core::batch::{Assembler, DataBatch};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::role_service_client::RoleServiceClient;
use rlhf_roles::ServeOptions;
use rlhf_runtime::net::{AuthChannel, ClientOptions};
use tokio_util::sync::CancellationToken;

use super::fixture;

pub const TOKEN: &str = "role-test-token";

/// ppo_tiny with the tiny fixture model.
pub fn ppo_tiny() -> rlhf_config::PpoConfig {
    let configs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let model = fixture("tiny-llama").display().to_string();
    rlhf_config::load(
        &configs,
        "ppo_tiny",
        &[
            format!("actor_rollout.model={model}"),
            format!("ref.model={model}"),
            format!("critic.model={model}"),
            format!("training.tokenizer_name_or_path={model}"),
            "actor_rollout.do_sample=false".into(),
        ],
    )
    .unwrap()
}

pub async fn start(kind: &str, shutdown: &CancellationToken) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let opts = ServeOptions {
        actor_id: format!("test-{kind}"),
        kind: kind.parse().unwrap(),
        host: "127.0.0.1".into(),
        token: TOKEN.into(),
        tls: Default::default(),
        head_address: None,
        head_tls_domain: None,
    };
    tokio::spawn(rlhf_roles::serve(opts, listener, shutdown.clone()));
    addr
}

/// As the driver calls a role process: unary calls as control frames, batches over HTTP/2.
pub async fn client(addr: &str, token: &str) -> RoleServiceClient<AuthChannel> {
    let t = rlhf_runtime::net::direct_transport(addr, &ClientOptions::new(token))
        .await
        .unwrap();
    // Only to a client that holds the token: another one is refused at the challenge and
    // keeps HTTP/2, where its calls are refused one by one.
    assert_eq!(
        t.frames().is_some(),
        token == TOKEN,
        "a role process serves control frames to holders of the token"
    );
    let ch = rlhf_runtime::net::with_token(t, token).unwrap();
    RoleServiceClient::new(ch)
        .max_decoding_message_size(rlhf_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(rlhf_proto::MAX_MESSAGE_BYTES)
}

pub async fn collect(resp: tonic::Response<tonic::Streaming<pb::BatchChunk>>) -> DataBatch {
    let mut s = resp.into_inner();
    let mut asm = Assembler::new(1 << 30);
    while let Some(c) = s.message().await.unwrap() {
        asm.push(c).unwrap();
    }
    asm.finish().unwrap()
}

pub fn init(role: &str, part: &str) -> pb::InitRoleRequest {
    let role: rlhf_core::RoleKind = role.parse().unwrap();
    let part: rlhf_core::RolePart = part.parse().unwrap();
    pb::InitRoleRequest {
        role: pb::RoleKind::from(role) as i32,
        spec: super::spec(&ppo_tiny(), role, part, 0, 1).to_json(),
        job_id: "job-1".into(),
    }
}

/// A test batch as the driver sends it: through the typed request of its call.
pub fn wire<R: rlhf_core::calls::RoleCall>(b: &DataBatch) -> DataBatch {
    super::typed::<R>(b).unwrap().to_batch().unwrap()
}
