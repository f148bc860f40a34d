//! Control frames and the direct HTTP/2 connection on a TLS cluster, against real servers on
//! loopback with a CA and certificates made here: frames inside TLS, HTTP/2 beside them on
//! the same port (for the direct client and for tonic's own TLS channel), and what is refused.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::actor_service_client::ActorServiceClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::net::{self, ClientOptions, ServerTls};

const TOKEN: &str = "frames-tls-test-token";

/// A CA (`{name}-ca.crt`) and a certificate for 127.0.0.1 signed by it, as PEM files.
fn certs(dir: &Path, name: &str) -> (ServerTls, PathBuf) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let (c, k, a) = (
        dir.join(format!("{name}.crt")),
        dir.join(format!("{name}.key")),
        dir.join(format!("{name}-ca.crt")),
    );
    std::fs::write(&c, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    std::fs::write(&a, ca_cert.pem()).unwrap();
    let tls = ServerTls {
        cert: Some(c),
        key: Some(k),
        ca: Some(a.clone()),
    };
    (tls, a)
}

/// The actor service behind [`server::serve`] with `tls`; ends with the guard.
async fn actor_server(tls: &ServerTls) -> (String, tokio_util::sync::DropGuard) {
    let listener = net::bind("127.0.0.1", 0, "--port").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = CancellationToken::new();
    let routes = tonic::service::Routes::new(crate::actor::actor_service("a1", TOKEN));
    let (s, tls) = (stop.clone(), tls.clone());
    tokio::spawn(async move {
        server::serve(&tls, routes, listener, s, "actor", TOKEN)
            .await
            .unwrap()
    });
    (addr, stop.drop_guard())
}

fn options(ca: Option<&Path>, token: &str) -> ClientOptions {
    let mut o = ClientOptions::new(token);
    o.tls_ca = ca.map(Path::to_path_buf);
    o.connect_timeout = Duration::from_secs(2);
    o
}

fn batch(rows: usize) -> rlhf_core::DataBatch {
    let v: Vec<f32> = (0..rows * 1000).map(|i| i as f32 * 0.5).collect();
    rlhf_core::DataBatch::new().with_tensor(
        "x",
        rlhf_core::TensorData::from_f32(vec![rows, 1000], &v).unwrap(),
    )
}

#[tokio::test]
async fn on_a_tls_cluster_frames_and_http2_both_run_inside_tls() {
    let dir = tempfile::tempdir().unwrap();
    let (tls, ca) = certs(dir.path(), "role");
    let (addr, _server) = actor_server(&tls).await;

    let t = net::direct_transport(&addr, &options(Some(&ca), TOKEN))
        .await
        .unwrap();
    let frames = t.frames().expect("frames inside TLS").clone();
    let mut c = ActorServiceClient::new(net::with_token(t, TOKEN).unwrap());
    let r = c
        .ping(pb::PingRequest {
            payload: b"over tls".to_vec(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.payload, b"over tls");
    // Calls that overlap each take a frames connection (each its own TLS handshake); over
    // HTTP/2 they would share one and the pool would stay at one.
    let calls = (0..4u8).map(|i| {
        let mut c = c.clone();
        async move {
            c.sleep(pb::SleepRequest { ms: 100 }).await.unwrap();
            c.ping(pb::PingRequest { payload: vec![i] }).await.unwrap()
        }
    });
    for (i, a) in futures::future::join_all(calls)
        .await
        .into_iter()
        .enumerate()
    {
        assert_eq!(a.into_inner().payload, vec![i as u8]);
    }
    assert_eq!(frames.idle_connections(), 4, "the calls went as frames");

    // A batch beside its call, as raw frames inside TLS (4 MB: many TLS records).
    let b = batch(1000);
    let mut req = tonic::Request::new(tokio_stream::empty());
    req.extensions_mut().insert(FramedBatch(b.clone()));
    let put = c.put_batch(req).await.unwrap().into_inner();
    assert_eq!(put.rows, 1000);
    assert_eq!(put.checksum, rlhf_core::batch::checksum(&b));

    // The same batch streamed over the direct HTTP/2 connection, also inside TLS.
    let put = c
        .put_batch(crate::batch_stream(&b).unwrap())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(put.checksum, rlhf_core::batch::checksum(&b));

    // tonic's own TLS channel (what a worker or the head would use) negotiates HTTP/2.
    let ch = net::connect(&addr, &options(Some(&ca), TOKEN))
        .await
        .unwrap();
    let r = ActorServiceClient::new(ch)
        .ping(pb::PingRequest {
            payload: b"tonic".to_vec(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.actor_id, "a1");

    // A wrong token is refused inside TLS as on a plain connection.
    let tls_frames =
        crate::tls::Connector::new(&addr, &options(Some(&ca), TOKEN), crate::tls::ALPN_FRAMES)
            .unwrap();
    let e = FramesClient::connect(&addr, "not-the-token", tls_frames)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
}

#[tokio::test]
async fn a_tls_server_serves_nothing_in_the_clear_nor_to_a_client_of_another_ca() {
    let dir = tempfile::tempdir().unwrap();
    let (tls, ca) = certs(dir.path(), "role");
    let (_, other_ca) = certs(dir.path(), "other");
    let (addr, _server) = actor_server(&tls).await;

    // A client without TLS: its HTTP/2 preface is no handshake, so the connection is
    // closed; the first call fails at once (hyper's handshake does not wait for the server).
    let t0 = Instant::now();
    if let Ok(t) = net::direct_transport(&addr, &options(None, TOKEN)).await {
        assert!(t.frames().is_none(), "no frames in the clear");
        let r = ActorServiceClient::new(net::with_token(t, TOKEN).unwrap())
            .ping(pb::PingRequest::default())
            .await;
        assert!(r.is_err(), "a TLS server answered a clear-text call");
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());

    // A client trusting another CA cannot complete the handshake.
    let e = net::direct_transport(&addr, &options(Some(&other_ca), TOKEN))
        .await
        .unwrap_err();
    assert!(e.to_string().contains(&addr), "{e}");
    assert!(e.to_string().contains("invalid peer certificate"), "{e}");
    // Nor one expecting another name than the certificate's, on either protocol.
    let mut o = options(Some(&ca), TOKEN);
    o.tls_domain = Some("elsewhere.example".into());
    let e = net::direct_transport(&addr, &o).await.unwrap_err();
    assert!(e.to_string().contains("not valid for name"), "{e}");
    let c = crate::tls::Connector::new(&addr, &o, crate::tls::ALPN_FRAMES).unwrap();
    let e = FramesClient::connect(&addr, TOKEN, c).await.unwrap_err();
    assert!(e.to_string().contains("not valid for name"), "{e}");

    // A frames hello in the clear gets no hello back: the server wants a TLS handshake.
    let mut raw = tokio::net::TcpStream::connect(&addr).await.unwrap();
    raw.write_all(HELLO).await.unwrap();
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(15), raw.read_to_end(&mut got)).await;
    let got = match read {
        Ok(Ok(_)) => got,
        // A reset is a refusal too.
        Ok(Err(_)) => Vec::new(),
        Err(_) => panic!("the server neither answered nor closed a clear-text hello"),
    };
    assert!(
        !got.starts_with(HELLO),
        "a TLS server spoke frames in the clear"
    );
}

#[tokio::test]
async fn a_tls_server_without_frames_keeps_the_client_on_http2() {
    let dir = tempfile::tempdir().unwrap();
    let (tls, ca) = certs(dir.path(), "role");
    // tonic's own TLS server: it offers only HTTP/2 in the handshake.
    let listener = net::bind("127.0.0.1", 0, "--port").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let server = tls
        .server()
        .unwrap()
        .add_service(crate::actor::actor_service("a1", TOKEN));
    tokio::spawn(async move {
        server
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                s.cancelled_owned(),
            )
            .await
            .unwrap()
    });
    let _guard = stop.drop_guard();

    let o = options(Some(&ca), TOKEN);
    // The frames client itself reads the refusal as "no frames" (not as an error).
    let c = crate::tls::Connector::new(&addr, &o, crate::tls::ALPN_FRAMES).unwrap();
    assert!(
        FramesClient::connect(&addr, TOKEN, c)
            .await
            .unwrap()
            .is_none(),
        "no common protocol: no frames"
    );
    let t = net::direct_transport(&addr, &o).await.unwrap();
    assert!(t.frames().is_none(), "no common protocol: no frames");
    let r = ActorServiceClient::new(net::with_token(t, TOKEN).unwrap())
        .ping(pb::PingRequest {
            payload: b"h2".to_vec(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.payload, b"h2");
}

#[tokio::test]
async fn a_client_silent_in_the_handshake_is_dropped_at_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let (tls, _) = certs(dir.path(), "role");
    let (addr, _server) = actor_server(&tls).await;
    let mut raw = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let t0 = Instant::now();
    let mut got = Vec::new();
    let read = tokio::time::timeout(
        crate::tls::HANDSHAKE_WITHIN + Duration::from_secs(10),
        raw.read_to_end(&mut got),
    )
    .await;
    assert!(read.is_ok(), "the server kept a silent connection open");
    assert!(
        t0.elapsed() >= crate::tls::HANDSHAKE_WITHIN - Duration::from_secs(1),
        "closed after {:?}, before the handshake's deadline",
        t0.elapsed()
    );
}

/// A peer that accepts the connection and then says nothing (a frozen host): tonic's TLS
/// channel gives up its handshake after `tls::HANDSHAKE_WITHIN` and the connect fails
/// naming the address, instead of waiting forever.
#[tokio::test]
async fn a_silent_peer_fails_a_tls_channel_connect_instead_of_holding_it() {
    let dir = tempfile::tempdir().unwrap();
    let (_, ca) = certs(dir.path(), "silent");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let held = tokio::spawn(async move {
        let mut socks = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            socks.push(s);
        }
    });
    let mut o = ClientOptions::new(TOKEN);
    o.tls_ca = Some(ca);
    o.connect_timeout = Duration::from_secs(1);
    let t = Instant::now();
    let connected = tokio::time::timeout(Duration::from_secs(30), net::connect(&addr, &o))
        .await
        .expect("the connect must end by itself");
    let Err(e) = connected else {
        panic!("a silent peer is no server");
    };
    assert!(
        t.elapsed() < crate::tls::HANDSHAKE_WITHIN * 2,
        "{:?}",
        t.elapsed()
    );
    assert!(e.to_string().contains(&addr), "{e}");
    held.abort();
}
