//! A communicator's rendezvous through the head's KV store, with a real head and real role
//! servers over gRPC: rank 0 publishes it, the other ranks read it while they join, rank 0
//! deletes it afterwards (and when the group is prepared again); a key nobody publishes
//! fails the join at its deadline; a role process without a head, or whose head cannot be
//! reached, answers the rendezvous to the driver as before.

use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message;
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::head_service_client::HeadServiceClient;
use rlhf_proto::v1::role_service_client::RoleServiceClient;
use rlhf_roles::ServeOptions;
use rlhf_runtime::head::{self, HeadOptions};
use rlhf_runtime::net::{AuthChannel, ClientOptions};
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "comm-kv-test-token";

async fn start_head(dir: &std::path::Path, shutdown: &CancellationToken) -> String {
    let mut opts = HeadOptions::new(dir.to_path_buf(), TOKEN.into());
    opts.host = "127.0.0.1".into();
    opts.port = 0;
    opts.dashboard = None;
    let h = head::start(
        opts,
        Arc::new(rlhf_runtime::clock::SystemClock),
        shutdown.clone(),
    )
    .await
    .unwrap();
    h.addr.to_string()
}

async fn start_role(
    head: Option<&str>,
    shutdown: &CancellationToken,
) -> RoleServiceClient<AuthChannel> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let opts = ServeOptions {
        actor_id: "comm-kv".into(),
        kind: rlhf_core::RoleKind::ActorRollout,
        host: "127.0.0.1".into(),
        token: TOKEN.into(),
        tls: Default::default(),
        head_address: head.map(str::to_string),
        head_tls_domain: None,
    };
    tokio::spawn(rlhf_roles::serve(opts, listener, shutdown.clone()));
    let ch = rlhf_runtime::net::connect_direct(&addr, &ClientOptions::new(TOKEN))
        .await
        .unwrap();
    RoleServiceClient::new(ch)
}

async fn head_client(addr: &str) -> HeadServiceClient<AuthChannel> {
    HeadServiceClient::new(
        rlhf_runtime::net::connect(addr, &ClientOptions::new(TOKEN))
            .await
            .unwrap(),
    )
}

fn prepare(key: &str) -> pb::PrepareCommRequest {
    pb::PrepareCommRequest {
        group: pb::CommGroup::Weights as i32,
        backend: pb::CommBackend::Tcp as i32,
        kv_key: key.into(),
    }
}

fn join(rank: u32, world: u32, key: &str, timeout_ms: u64) -> pb::JoinCommRequest {
    pb::JoinCommRequest {
        group: pb::CommGroup::Weights as i32,
        backend: pb::CommBackend::Tcp as i32,
        rank,
        world_size: world,
        address: String::new(),
        unique_id: vec![],
        timeout_ms,
        secret: vec![7; 32],
        kv_key: key.into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ranks_meet_through_the_heads_kv_store() {
    let dir = tempfile::tempdir().unwrap();
    let shutdown = CancellationToken::new();
    let head_addr = start_head(dir.path(), &shutdown).await;
    let mut h = head_client(&head_addr).await;
    let mut ranks = Vec::new();
    for _ in 0..3 {
        ranks.push(start_role(Some(&head_addr), &shutdown).await);
    }
    let key = "comm/weights/0123456789abcdef";

    // Rank 0 publishes: nothing comes back to the driver, the store holds its address.
    let p = ranks[0]
        .prepare_comm(prepare(key))
        .await
        .unwrap()
        .into_inner();
    assert!(p.published, "{p:?}");
    assert!(p.address.is_empty() && p.unique_id.is_empty(), "{p:?}");
    let stored = h
        .kv_get(pb::KvGetRequest { key: key.into() })
        .await
        .unwrap()
        .into_inner();
    assert!(stored.found);
    let rv = pb::CommRendezvous::decode(&stored.value[..]).unwrap();
    assert!(rv.address.starts_with("127.0.0.1:"), "{rv:?}");
    // The same key again is refused: two groups must not meet under one key.
    let again = ranks[1].prepare_comm(prepare(key)).await.unwrap_err();
    assert_eq!(again.code(), tonic::Code::AlreadyExists, "{again:?}");
    assert!(again.message().contains(key), "{again:?}");

    // Every rank joins with only the key: rank 0's join returns only once ranks 1 and 2
    // connected to the address they read from the store and proved the secret.
    let (mut r0, mut r1, mut r2) = (ranks[0].clone(), ranks[1].clone(), ranks[2].clone());
    let (a, b, c) = tokio::join!(
        r0.join_comm(join(0, 3, key, 20_000)),
        r1.join_comm(join(1, 3, key, 20_000)),
        r2.join_comm(join(2, 3, key, 20_000)),
    );
    a.unwrap();
    b.unwrap();
    c.unwrap();
    // Rank 0 deleted the key once its join was over.
    let gone = h
        .kv_get(pb::KvGetRequest { key: key.into() })
        .await
        .unwrap()
        .into_inner();
    assert!(!gone.found, "the rendezvous key outlived the join");

    // A key nobody publishes: the join fails at its deadline, naming the key.
    let t = Instant::now();
    let e = r1
        .join_comm(join(1, 2, "comm/weights/never", 700))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
    assert!(e.message().contains("comm/weights/never"), "{e:?}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    // A group prepared again under a new key: the old key goes, the new one stays.
    r2.prepare_comm(prepare("comm/weights/old")).await.unwrap();
    r2.prepare_comm(prepare("comm/weights/new")).await.unwrap();
    let found = |k: &'static str| {
        let mut h = h.clone();
        async move {
            h.kv_get(pb::KvGetRequest { key: k.into() })
                .await
                .unwrap()
                .into_inner()
                .found
        }
    };
    assert!(
        !found("comm/weights/old").await,
        "a replaced rendezvous stays"
    );
    assert!(found("comm/weights/new").await);
    // Keys outside the communicators' namespace are refused, both ways.
    for e in [
        r0.prepare_comm(prepare("jobs/x")).await.unwrap_err(),
        r1.join_comm(join(1, 2, "nccl/id", 700)).await.unwrap_err(),
    ] {
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("must start with 'comm/'"), "{e:?}");
    }
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_a_head_the_driver_gets_the_rendezvous() {
    let shutdown = CancellationToken::new();
    let mut r0 = start_role(None, &shutdown).await;
    let mut r1 = start_role(None, &shutdown).await;
    let p = r0
        .prepare_comm(prepare("comm/weights/1"))
        .await
        .unwrap()
        .into_inner();
    assert!(!p.published);
    assert!(p.address.starts_with("127.0.0.1:"), "{p:?}");
    // A head named but not reachable (nothing listens there): the driver relays instead.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_head = closed.local_addr().unwrap().to_string();
    drop(closed);
    let mut lost = start_role(Some(&dead_head), &shutdown).await;
    let p2 = lost
        .prepare_comm(prepare("comm/weights/2"))
        .await
        .unwrap()
        .into_inner();
    assert!(
        !p2.published && p2.address.starts_with("127.0.0.1:"),
        "{p2:?}"
    );
    // A rank told to read the store it cannot reach says so, and what to pass instead.
    let e = r1
        .join_comm(join(1, 2, "comm/weights/1", 2_000))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("RLHF_HEAD_ADDRESS"), "{e:?}");
    // The relayed address works as before.
    let mut j1 = join(1, 2, "", 20_000);
    j1.address = p.address.clone();
    let (a, b) = tokio::join!(r0.join_comm(join(0, 2, "", 20_000)), r1.join_comm(j1));
    a.unwrap();
    b.unwrap();
    shutdown.cancel();
}

/// A rank that reads rank 0's rendezvous from the store joins with the configured timeout,
/// not with what the read left of it: `timeout_ms` is also every op's timeout on the
/// communicator, and rank 0 (which reads nothing) has the whole of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_reads_the_store_keeps_the_whole_op_timeout() {
    use rlhf_roles::comm::Prepared;
    use rlhf_roles::rendezvous::{HeadKv, Rendezvous};
    let dir = tempfile::tempdir().unwrap();
    let shutdown = CancellationToken::new();
    let head_addr = start_head(dir.path(), &shutdown).await;
    let kv = HeadKv::new(&head_addr, &ClientOptions::new(TOKEN)).unwrap();
    let key = "comm/weights/timeout0123456789";
    let p = Prepared {
        address: "127.0.0.1:1".into(),
        unique_id: vec![],
    };
    kv.publish(key, &p).await.unwrap();
    let rv = Rendezvous::new(Some(kv));
    let (tx, rx) = std::sync::mpsc::channel();
    rv.join(join(1, 2, key, 60_000), move |req| async move {
        tx.send((req.timeout_ms, req.address)).unwrap();
        Ok(())
    })
    .await
    .unwrap();
    let (timeout_ms, address) = rx.recv().unwrap();
    assert_eq!(address, "127.0.0.1:1", "the rendezvous came from the store");
    assert_eq!(timeout_ms, 60_000);
    shutdown.cancel();
}
