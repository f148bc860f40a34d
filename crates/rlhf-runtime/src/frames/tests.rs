//! Control frames against real servers on loopback: the actor service behind
//! [`super::server::serve`], and a plain tonic server that does not speak frames.

use std::time::{Duration, Instant};

use rlhf_proto::v1 as pb;
use rlhf_proto::v1::actor_service_client::ActorServiceClient;
use rlhf_proto::v1::role_service_client::RoleServiceClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::net::{self, ClientOptions, ServerTls};

const TOKEN: &str = "frames-test-token";

/// The actor service on a free port, frames and HTTP/2 both; the server ends with the guard.
async fn actor_server() -> (String, tokio_util::sync::DropGuard) {
    let listener = net::bind("127.0.0.1", 0, "--port").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = CancellationToken::new();
    let routes = tonic::service::Routes::new(crate::actor::actor_service("a1", TOKEN));
    let s = stop.clone();
    tokio::spawn(async move {
        server::serve(&ServerTls::default(), routes, listener, s, "actor", TOKEN)
            .await
            .unwrap()
    });
    (addr, stop.drop_guard())
}

async fn transport(addr: &str, frames: bool) -> net::Transport {
    let mut o = ClientOptions::new(TOKEN);
    o.control_frames = frames;
    net::direct_transport(addr, &o).await.unwrap()
}

fn actor(t: net::Transport, token: &str) -> ActorServiceClient<net::AuthChannel> {
    ActorServiceClient::new(net::with_token(t, token).unwrap())
}

#[tokio::test]
async fn unary_calls_go_as_frames_and_streams_stay_on_http2() {
    let (addr, _server) = actor_server().await;
    let t = transport(&addr, true).await;
    let frames = t.frames().expect("the server speaks frames").clone();
    let mut c = actor(t, TOKEN);
    let r = c
        .ping(pb::PingRequest {
            payload: b"hello".to_vec(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (r.payload.as_slice(), r.actor_id.as_str()),
        (&b"hello"[..], "a1")
    );
    // A streamed batch goes through the HTTP/2 connection beside the frames.
    let batch = rlhf_core::DataBatch::new().with_tensor(
        "x",
        rlhf_core::TensorData::from_f32(vec![2, 3], &[1., 2., 3., 4., 5., 6.]).unwrap(),
    );
    let put = c
        .put_batch(crate::batch_stream(&batch).unwrap())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(put.rows, 2);
    assert_eq!(put.checksum, rlhf_core::batch::checksum(&batch));
    // Calls that overlap each take a connection; they come back to the pool after.
    let calls = (0..6u8).map(|i| {
        let mut c = c.clone();
        async move {
            c.sleep(pb::SleepRequest { ms: 50 }).await.unwrap();
            c.ping(pb::PingRequest { payload: vec![i] }).await.unwrap()
        }
    });
    let answers = futures::future::join_all(calls).await;
    for (i, a) in answers.into_iter().enumerate() {
        assert_eq!(a.into_inner().payload, vec![i as u8]);
    }
    assert_eq!(
        frames.idle_connections(),
        6,
        "overlapping calls: one connection each"
    );
}

#[tokio::test]
async fn a_wrong_token_is_refused_at_the_connection_and_on_each_call() {
    let (addr, _server) = actor_server().await;
    // At the connection: the client cannot answer the challenge.
    let e = FramesClient::connect(&addr, "not-the-token", None)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    assert!(e.to_string().contains("--token-file"), "{e}");
    // The driver's path then keeps HTTP/2, where the call is refused as before.
    let mut o = ClientOptions::new("not-the-token");
    o.control_frames = true;
    let t = net::direct_transport(&addr, &o).await.unwrap();
    assert!(t.frames().is_none());
    // On each call: a connection made with the token, calls sent with another.
    let t = transport(&addr, true).await;
    let shown = format!("{:?}", t.frames().expect("frames with the right token"));
    assert!(
        !shown.contains(TOKEN),
        "the token must not be printed: {shown}"
    );
    for t in [t, transport(&addr, false).await] {
        let e = actor(t, "not-the-token")
            .ping(pb::PingRequest::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
        assert!(e.message().contains("wrong cluster token"), "{e}");
    }
    // A peer that fails the challenge is told so and cut off before any frame is read.
    let mut raw = tokio::net::TcpStream::connect(&addr).await.unwrap();
    raw.write_all(HELLO).await.unwrap();
    let mut hello = [0u8; HELLO.len() + CHALLENGE];
    raw.read_exact(&mut hello).await.unwrap();
    assert_eq!(&hello[..HELLO.len()], HELLO);
    raw.write_all(&[0u8; CHALLENGE]).await.unwrap();
    let mut rest = Vec::new();
    raw.read_to_end(&mut rest).await.unwrap();
    assert_eq!(
        rest,
        vec![REFUSED],
        "the verdict, then the end of the connection"
    );
    // A method the server lacks is the server's gRPC answer, not a broken connection.
    let t = transport(&addr, true).await;
    let e = RoleServiceClient::new(net::with_token(t, TOKEN).unwrap())
        .weights_checksum(pb::WeightsChecksumRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e}");
}

#[tokio::test]
async fn a_server_without_frames_is_called_over_http2() {
    let listener = net::bind("127.0.0.1", 0, "--port").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        net::server_builder()
            .add_service(crate::actor::actor_service("plain", TOKEN))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let t = Instant::now();
    let tr = transport(&addr, true).await;
    assert!(
        tr.frames().is_none(),
        "a plain HTTP/2 server refuses the hello"
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let r = actor(tr, TOKEN)
        .ping(pb::PingRequest::default())
        .await
        .unwrap();
    assert_eq!(r.into_inner().actor_id, "plain");
}

#[tokio::test]
async fn a_long_call_is_kept_alive_and_a_silent_server_is_given_up() {
    let (addr, _server) = actor_server().await;
    // Longer than the silence limit: only the server's keepalives carry it through. The
    // limit leaves a keepalive 2 s to be late on a loaded machine (tests run in parallel).
    let limit = KEEPALIVE_EVERY + Duration::from_secs(2);
    let t = transport(&addr, true)
        .await
        .map_frames(|f| f.with_idle_limit(limit));
    let mut c = actor(t, TOKEN);
    let ms = (limit + Duration::from_secs(1)).as_millis() as u64;
    c.sleep(pb::SleepRequest { ms }).await.unwrap();
    // The server shuts down: the next call fails at once, and says so.
    drop(_server);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    let s = c.ping(pb::PingRequest::default()).await.unwrap_err();
    // At once: well below the idle limit it would otherwise wait out.
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(s.message().contains("closed"), "{s:?}");

    // A server that says hello, then nothing (a stopped process).
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut s, _)) = l.accept().await {
            let mut b = [0u8; HELLO.len()];
            let mut tag = [0u8; CHALLENGE];
            let ok = s.read_exact(&mut b).await.is_ok()
                && s.write_all(HELLO).await.is_ok()
                && s.write_all(&[0u8; CHALLENGE]).await.is_ok()
                && s.read_exact(&mut tag).await.is_ok()
                && s.write_all(&[ACCEPTED]).await.is_ok();
            if ok {
                held.push(s);
            }
        }
    });
    let f = FramesClient::connect(&silent, TOKEN, None)
        .await
        .unwrap()
        .unwrap()
        .with_idle_limit(Duration::from_millis(400));
    let req = http::Request::builder()
        .uri("/rlhf.v1.ActorService/Ping")
        .body(tonic::body::Body::empty())
        .unwrap();
    let t = Instant::now();
    let e = f.call(req).await.unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let s = e.downcast_ref::<tonic::Status>().expect("a gRPC status");
    assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
    assert!(
        s.message().contains("sent nothing for") && s.message().contains(&silent),
        "{s:?}"
    );
}

#[tokio::test]
async fn a_cancelled_call_leaves_the_client_usable() {
    let (addr, _server) = actor_server().await;
    let t = transport(&addr, true).await;
    let mut c = actor(t, TOKEN);
    let cut = tokio::time::timeout(
        Duration::from_millis(100),
        c.sleep(pb::SleepRequest { ms: 2000 }),
    )
    .await;
    assert!(cut.is_err(), "the call was to be cut by the timeout");
    let r = c.ping(pb::PingRequest { payload: vec![7] }).await.unwrap();
    assert_eq!(r.into_inner().payload, vec![7]);
}

#[tokio::test]
async fn frames_over_the_limit_or_of_unknown_kind_are_refused() {
    let (mut a, mut b) = tokio::io::duplex(64);
    let mut head = Vec::from(((MAX_FRAME + 1) as u32).to_le_bytes());
    head.push(Kind::Request as u8);
    a.write_all(&head).await.unwrap();
    let e = read_frame(&mut b).await.unwrap_err();
    assert!(e.to_string().contains("over the"), "{e}");
    let mut head = Vec::from(0u32.to_le_bytes());
    head.push(9);
    a.write_all(&head).await.unwrap();
    let e = read_frame(&mut b).await.unwrap_err();
    assert!(
        e.to_string().contains("unknown control frame kind 9"),
        "{e}"
    );
    // A frame written is the frame read; a clean close between frames is `None`.
    write_frame(&mut a, Kind::Keepalive, b"xyz").await.unwrap();
    let (k, p) = read_frame(&mut b).await.unwrap().unwrap();
    assert_eq!((k, &p[..]), (Kind::Keepalive, &b"xyz"[..]));
    drop(a);
    assert!(read_frame(&mut b).await.unwrap().is_none());
}

/// A peer that stops inside a frame (alive, so no keepalive ends the connection) is cut off:
/// within IDLE_LIMIT for the rest of the header, and that plus the payload's time at the
/// rate floor for the payload. The clock is tokio's, paused.
#[tokio::test(start_paused = true)]
async fn a_peer_that_stops_inside_a_frame_is_cut_off() {
    let (mut a, mut b) = tokio::io::duplex(64);
    a.write_all(&[3, 0]).await.unwrap();
    let t = tokio::time::Instant::now();
    let e = read_frame(&mut b).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
    assert!(e.to_string().contains("header did not arrive"), "{e}");
    assert_eq!(t.elapsed(), IDLE_LIMIT);
    let (mut a, mut b) = tokio::io::duplex(64);
    let mut head = Vec::from(10u32.to_le_bytes());
    head.push(Kind::Request as u8);
    a.write_all(&head).await.unwrap();
    a.write_all(b"abc").await.unwrap();
    let e = read_frame(&mut b).await.unwrap_err();
    assert!(e.to_string().contains("payload did not arrive"), "{e}");
    // Kept open to the end: the cut is the deadline's, not an end of the stream.
    drop(a);
}

/// A `PutBatch` request carrying `batch` beside the call.
fn framed_put(batch: &rlhf_core::DataBatch) -> tonic::Request<tokio_stream::Empty<pb::BatchChunk>> {
    let mut req = tonic::Request::new(tokio_stream::empty());
    req.extensions_mut().insert(FramedBatch(batch.clone()));
    req
}

#[tokio::test]
async fn a_batch_goes_beside_its_call_as_raw_frames() {
    let (addr, _server) = actor_server().await;
    let t = transport(&addr, true).await;
    let frames = t.frames().expect("the server speaks frames").clone();
    let mut c = actor(t, TOKEN);
    let v: Vec<f32> = (0..3 << 18).map(|i| i as f32).collect();
    let batch = rlhf_core::DataBatch::new()
        .with_tensor(
            "x",
            rlhf_core::TensorData::from_f32(vec![3, 1 << 18], &v).unwrap(),
        )
        .with_column("prompt", (0..3).map(|i| serde_json::json!(i)).collect());
    // Twice on one connection: the second call reuses it.
    for _ in 0..2 {
        let put = c.put_batch(framed_put(&batch)).await.unwrap().into_inner();
        assert_eq!(put.rows, 3);
        assert_eq!(put.checksum, rlhf_core::batch::checksum(&batch));
        assert_eq!(
            put.bytes,
            rlhf_core::batch::encode(&batch).unwrap().len() as u64
        );
        assert_eq!(frames.idle_connections(), 1);
    }
    // Still behind the token check of every call.
    let t = transport(&addr, true).await;
    let e = actor(t, "not-the-token")
        .put_batch(framed_put(&batch))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
    // Without frames the call would arrive with no batch: refused before it is sent.
    let e = actor(transport(&addr, false).await, TOKEN)
        .put_batch(framed_put(&batch))
        .await
        .unwrap_err();
    assert!(
        e.message()
            .contains("a framed batch needs a control frames connection"),
        "{e}"
    );
    // A unary call cannot carry one: refused before it is sent.
    let mut req = tonic::Request::new(pb::PingRequest::default());
    req.extensions_mut().insert(FramedBatch(batch.clone()));
    let e = c.ping(req).await.unwrap_err();
    assert!(e.message().contains("is not a batch call"), "{e}");
    assert_eq!(
        e.code(),
        tonic::Code::InvalidArgument,
        "not a retryable failure"
    );
}

/// A raw connection past the hello and the token challenge, as a frames client makes it.
async fn raw_frames(addr: &str) -> tokio::net::TcpStream {
    let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
    raw.write_all(HELLO).await.unwrap();
    let mut hello = [0u8; HELLO.len() + CHALLENGE];
    raw.read_exact(&mut hello).await.unwrap();
    let tag = super::answer(TOKEN, &hello[HELLO.len()..]);
    raw.write_all(tag.as_ref()).await.unwrap();
    let mut verdict = [0u8; 1];
    raw.read_exact(&mut verdict).await.unwrap();
    assert_eq!(verdict[0], ACCEPTED);
    raw
}

/// A call to `path` with the token and an empty body.
fn call(path: &str) -> pb::ControlRequest {
    pb::ControlRequest {
        path: path.into(),
        headers: vec![pb::FrameHeader {
            name: "authorization".into(),
            value: format!("Bearer {TOKEN}").into_bytes(),
        }],
        body: Default::default(),
    }
}

#[tokio::test]
async fn bytes_that_are_not_a_batch_get_an_answer_and_the_connection_stays_in_step() {
    let (addr, _server) = actor_server().await;
    let mut raw = raw_frames(&addr).await;
    // 64 bytes announced and sent, none of them a batch encoding.
    let put = call("/rlhf.v1.ActorService/PutBatch");
    write_frame(&mut raw, Kind::Batch, &batch_payload(64, &put))
        .await
        .unwrap();
    raw.write_all(&[7u8; 64]).await.unwrap();
    let (kind, payload) = read_frame(&mut raw).await.unwrap().unwrap();
    assert_eq!(kind, Kind::Response);
    let r = pb::ControlResponse::decode(&payload[..]).unwrap();
    let st = tonic::Status::from_header_map(&from_frame_headers(r.headers).unwrap()).unwrap();
    assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
    assert!(st.message().contains("malformed batch encoding"), "{st:?}");
    // The next call on the same connection is read from the right byte.
    let mut ping = call("/rlhf.v1.ActorService/Ping");
    ping.body = {
        let msg = pb::PingRequest {
            payload: b"x".to_vec(),
        }
        .encode_to_vec();
        let mut b = vec![0u8];
        b.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        b.extend_from_slice(&msg);
        b.into()
    };
    write_frame(&mut raw, Kind::Request, &ping.encode_to_vec())
        .await
        .unwrap();
    let (kind, payload) = read_frame(&mut raw).await.unwrap().unwrap();
    assert_eq!(kind, Kind::Response);
    let r = pb::ControlResponse::decode(&payload[..]).unwrap();
    let pong = pb::PingResponse::decode(&r.body[5..]).unwrap();
    assert_eq!(
        (pong.payload.as_slice(), pong.actor_id.as_str()),
        (&b"x"[..], "a1")
    );
}

#[tokio::test]
async fn a_server_shutting_down_drops_a_batch_it_is_reading_at_once() {
    let (addr, server) = actor_server().await;
    let mut raw = raw_frames(&addr).await;
    // 1 MiB announced, 100 bytes sent: the server waits for the rest...
    let put = call("/rlhf.v1.ActorService/PutBatch");
    write_frame(&mut raw, Kind::Batch, &batch_payload(1 << 20, &put))
        .await
        .unwrap();
    raw.write_all(&[7u8; 100]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // ...until it shuts down: then it closes the connection, not after the piece's 30 s.
    drop(server);
    let mut b = [0u8; 64];
    let closed = tokio::time::timeout(Duration::from_secs(5), raw.read(&mut b))
        .await
        .expect("the connection outlived the server's shutdown");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
}
