//! Protocol checks against an in-process head (no binaries needed).

use std::sync::Arc;
use std::time::Duration;

use rlhf_proto::v1 as pb;
use rlhf_proto::v1::head_service_client::HeadServiceClient;
use rlhf_runtime::clock::SystemClock;
use rlhf_runtime::head::{self, HeadOptions};
use rlhf_runtime::net::{self, ClientOptions};
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn version_mismatch_is_refused_naming_both_versions() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = HeadOptions::new(dir.path().to_path_buf(), "tok".into());
    o.host = "127.0.0.1".into();
    o.port = 0;
    o.dashboard = Some(("127.0.0.1".into(), 0));
    let sd = CancellationToken::new();
    let h = head::start(o, Arc::new(SystemClock), sd.clone())
        .await
        .unwrap();
    let mut co = ClientOptions::new("tok");
    co.connect_timeout = Duration::from_secs(5);
    let mut c = HeadServiceClient::new(net::connect(&h.addr.to_string(), &co).await.unwrap());
    let e = c
        .register_node(pb::RegisterNodeRequest {
            protocol_version: 999,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(
        e.message()
            .contains(&format!("version {}", rlhf_proto::PROTOCOL_VERSION))
            && e.message().contains("999"),
        "{}",
        e.message()
    );
    let e = c
        .heartbeat(pb::HeartbeatRequest {
            protocol_version: 0,
            node_id: "x".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);

    // The dashboard serves status JSON on loopback.
    let d = h.dashboard.unwrap();
    assert!(d.ip().is_loopback());
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(d).await.unwrap();
    s.write_all(b"GET /api/status HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    assert!(
        body.starts_with("HTTP/1.1 200") && body.contains("\"protocol_version\":1"),
        "{body}"
    );
    sd.cancel();
    h.wait().await;
}
