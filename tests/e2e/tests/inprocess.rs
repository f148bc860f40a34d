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
    s.write_all(b"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    assert!(
        body.starts_with("HTTP/1.1 200")
            && body.contains(&format!(
                "\"protocol_version\":{}",
                rlhf_proto::PROTOCOL_VERSION
            )),
        "{body}"
    );
    assert!(
        body.contains("\"counts\"") && !body.contains("\"actors\":["),
        "public shape: {body}"
    );
    // With the token the whole status; a page of another site gets nothing.
    let ask = |req: &'static str| async move {
        let mut s = tokio::net::TcpStream::connect(d).await.unwrap();
        s.write_all(req.as_bytes()).await.unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).await.unwrap();
        body
    };
    let full =
        ask("GET /api/status HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer tok\r\n\r\n")
            .await;
    assert!(
        full.starts_with("HTTP/1.1 200") && full.contains("\"actors\":["),
        "{full}"
    );
    let rebound = ask("GET /api/status HTTP/1.1\r\nHost: evil.example\r\n\r\n").await;
    assert!(rebound.starts_with("HTTP/1.1 403"), "{rebound}");
    sd.cancel();
    h.wait().await;
}

#[tokio::test]
async fn injected_clock_drives_node_death_without_waiting() {
    use rlhf_runtime::clock::ManualClock;
    let dir = tempfile::tempdir().unwrap();
    let mut o = HeadOptions::new(dir.path().to_path_buf(), "tok".into());
    o.host = "127.0.0.1".into();
    o.port = 0;
    o.dashboard = None;
    // A long threshold on the wall clock; only the injected clock moves.
    o.dead_threshold = Duration::from_millis(200);
    let clock = ManualClock::new(1_000_000);
    let sd = CancellationToken::new();
    let h = head::start(o, Arc::new(clock.clone()), sd.clone())
        .await
        .unwrap();
    let mut co = ClientOptions::new("tok");
    co.connect_timeout = Duration::from_secs(5);
    let mut c = HeadServiceClient::new(net::connect(&h.addr.to_string(), &co).await.unwrap());
    let id = c
        .register_node(pb::RegisterNodeRequest {
            protocol_version: rlhf_proto::PROTOCOL_VERSION,
            hostname: "sim".into(),
            address: "127.0.0.1:9".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .node_id;
    let state_of =
        |s: &pb::ClusterStatusResponse| s.nodes.iter().find(|n| n.node_id == id).map(|n| n.state);
    // Real time passes, the injected clock does not: the node stays alive.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let s = c
        .cluster_status(pb::ClusterStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(state_of(&s), Some(pb::NodeState::Alive as i32));
    // The injected clock jumps past the threshold: the next health check marks it dead. The
    // deadline only catches a check that never comes (checks run every 50 ms of real time);
    // the time of death is asserted on the injected clock, which nothing else moves.
    clock.advance(250);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let n = loop {
        let s = c
            .cluster_status(pb::ClusterStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        if state_of(&s) == Some(pb::NodeState::Dead as i32) {
            break s.nodes.into_iter().find(|n| n.node_id == id).unwrap();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "node not marked dead 30 s after the clock moved: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert!(
        n.death_reason.contains("no heartbeat for 0.2s"),
        "{}",
        n.death_reason
    );
    assert_eq!(n.death_ms, 1_000_250);
    // A heartbeat from a dead node is refused so it registers anew.
    let hb = c
        .heartbeat(pb::HeartbeatRequest {
            protocol_version: rlhf_proto::PROTOCOL_VERSION,
            node_id: id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!hb.known);
    sd.cancel();
    h.wait().await;
}

/// What nodes and clients send is validated before it reaches the state: a NaN or negative
/// resource, a host name with markup, an address that is no address and a wait with no
/// real deadline are each refused naming the field, nothing is stored, and a database that
/// holds a record which does not decode still starts.
#[tokio::test]
async fn bad_node_reports_are_refused_and_a_bad_stored_record_is_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let start = |dir: std::path::PathBuf| async move {
        let mut o = HeadOptions::new(dir, "tok".into());
        o.host = "127.0.0.1".into();
        o.port = 0;
        o.dashboard = None;
        let sd = CancellationToken::new();
        let h = head::start(o, Arc::new(SystemClock), sd.clone())
            .await
            .expect("the head starts");
        let mut co = ClientOptions::new("tok");
        co.connect_timeout = Duration::from_secs(5);
        let c = HeadServiceClient::new(net::connect(&h.addr.to_string(), &co).await.unwrap());
        (h, sd, c)
    };
    let (h, sd, mut c) = start(dir.path().to_path_buf()).await;
    let node = |hostname: &str, address: &str, res: &[(&str, f64)]| pb::RegisterNodeRequest {
        protocol_version: rlhf_proto::PROTOCOL_VERSION,
        hostname: hostname.into(),
        address: address.into(),
        resources: Some(pb::Resources {
            amounts: res.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        }),
        ..Default::default()
    };
    for (req, want) in [
        (node("n", "127.0.0.1:9", &[("CPU", f64::NAN)]), "NaN"),
        (node("n", "127.0.0.1:9", &[("GPU", -8.0)]), "\"GPU\" is -8"),
        (node("<b>x</b>", "127.0.0.1:9", &[]), "hostname"),
        (node("n", "127.0.0.1", &[]), "not host:port"),
    ] {
        let e = c.register_node(req).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{want}: {e:?}");
        assert!(e.message().contains(want), "{want}: {}", e.message());
    }
    let e = c
        .kv_wait(pb::KvWaitRequest {
            key: "k".into(),
            timeout_ms: u64::MAX,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("KvWaitRequest.timeout_ms"),
        "{}",
        e.message()
    );
    // CreateActor is behind the token, and still sets no variable that changes how the
    // process loads or what the worker sets itself.
    for var in ["LD_PRELOAD", "CUDA_VISIBLE_DEVICES"] {
        let e = c
            .create_actor(pb::CreateActorRequest {
                spec: Some(pb::ActorSpec {
                    name: "a".into(),
                    env: [(var.to_string(), "x".to_string())].into_iter().collect(),
                    ..Default::default()
                }),
                timeout_ms: 1000,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(var), "{}", e.message());
    }
    let s = c
        .cluster_status(pb::ClusterStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(s.nodes.is_empty(), "nothing was stored: {:?}", s.nodes);
    c.register_node(node("good", "127.0.0.1:9", &[("CPU", 2.0)]))
        .await
        .expect("a valid node registers");
    sd.cancel();
    h.wait().await;

    // A record that does not decode (what a NaN amount became in JSON) next to a good one.
    {
        let st = rlhf_runtime::head::store::Store::open(dir.path()).unwrap();
        st.put(
            rlhf_runtime::head::store::NODES,
            "node-bad",
            &serde_json::json!({"resources": {"CPU": null}}),
        )
        .unwrap();
    }
    let (h, sd, mut c) = start(dir.path().to_path_buf()).await;
    let s = c
        .cluster_status(pb::ClusterStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    let hosts: Vec<&str> = s.nodes.iter().map(|n| n.hostname.as_str()).collect();
    assert_eq!(hosts, vec!["good"], "{:?}", s.nodes);
    sd.cancel();
    h.wait().await;
}
