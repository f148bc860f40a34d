//! The role server in-process over real gRPC: InitRole, Generate, ComputeLogProbs,
//! ComputeScores, Ping on the same endpoint, and a wrong token refused.

mod common;

use common::fixture;
use rlhf_core::batch::{Assembler, DataBatch, TensorData};
use rlhf_core::calls::{ActorUpdateRequest, GenerateRequest, LogProbsRequest, ScoresRequest};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::actor_service_client::ActorServiceClient;
use rlhf_proto::v1::role_service_client::RoleServiceClient;
use rlhf_roles::ServeOptions;
use rlhf_runtime::net::{AuthChannel, ClientOptions};
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "role-test-token";

/// ppo_tiny with the tiny fixture model.
fn config() -> rlhf_config::PpoConfig {
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

async fn start(kind: &str, shutdown: &CancellationToken) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let opts = ServeOptions {
        actor_id: format!("test-{kind}"),
        kind: kind.parse().unwrap(),
        host: "127.0.0.1".into(),
        token: TOKEN.into(),
        tls: Default::default(),
        head_address: None,
    };
    tokio::spawn(rlhf_roles::serve(opts, listener, shutdown.clone()));
    addr
}

/// As the driver calls a role process: unary calls as control frames, batches over HTTP/2.
async fn client(addr: &str, token: &str) -> RoleServiceClient<AuthChannel> {
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

async fn collect(resp: tonic::Response<tonic::Streaming<pb::BatchChunk>>) -> DataBatch {
    let mut s = resp.into_inner();
    let mut asm = Assembler::new(1 << 30);
    while let Some(c) = s.message().await.unwrap() {
        asm.push(c).unwrap();
    }
    asm.finish().unwrap()
}

fn init(role: &str, part: &str) -> pb::InitRoleRequest {
    let role: rlhf_core::RoleKind = role.parse().unwrap();
    let part: rlhf_core::RolePart = part.parse().unwrap();
    pb::InitRoleRequest {
        role: pb::RoleKind::from(role) as i32,
        spec: common::spec(&config(), role, part, 0, 1).to_json(),
        job_id: "job-1".into(),
    }
}

/// A test batch as the driver sends it: through the typed request of its call.
fn wire<R: rlhf_core::calls::RoleCall>(b: &DataBatch) -> DataBatch {
    common::typed::<R>(b).unwrap().to_batch().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_and_log_probs_over_grpc() {
    let shutdown = CancellationToken::new();
    let (p, r) = (32usize, 16usize);

    // Rollout rank: Generate.
    let addr = start("actor_rollout", &shutdown).await;
    let mut bad = client(&addr, "wrong-token").await;
    let err = bad
        .init_role(init("actor_rollout", "infer"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err}");

    let mut c = client(&addr, TOKEN).await;
    let err = c.init_role(init("critic", "")).await.unwrap_err();
    assert!(
        err.message().contains("sent to a 'actor_rollout' actor"),
        "{err}"
    );
    let info = c
        .init_role(init("actor_rollout", "infer"))
        .await
        .unwrap()
        .into_inner();
    assert!(
        info.num_params > 0 && info.weights_checksum != 0,
        "{info:?}"
    );
    let err = c
        .init_role(init("actor_rollout", "infer"))
        .await
        .unwrap_err();
    assert!(err.message().contains("already initialised"), "{err}");

    let ping = ActorServiceClient::new(
        rlhf_runtime::net::connect(&addr, &ClientOptions::new(TOKEN))
            .await
            .unwrap(),
    )
    .ping(pb::PingRequest {
        payload: b"hi".to_vec(),
    })
    .await
    .unwrap()
    .into_inner();
    assert_eq!(ping.payload, b"hi");

    let mut ids = vec![0i64; 2 * p];
    let mut mask = vec![0i64; 2 * p];
    for (row, len) in [5usize, 9].iter().enumerate() {
        for j in p - len..p {
            ids[row * p + j] = (3 + row * 7 + j) as i64;
            mask[row * p + j] = 1;
        }
    }
    let mut prompts = DataBatch::new()
        .with_tensor(
            "prompt_ids",
            TensorData::from_i64(vec![2, p], &ids).unwrap(),
        )
        .with_tensor(
            "prompt_mask",
            TensorData::from_i64(vec![2, p], &mask).unwrap(),
        );
    prompts.meta.insert("seed".into(), serde_json::json!(11));
    let stream = rlhf_runtime::batch_stream(&wire::<GenerateRequest>(&prompts)).unwrap();
    let out = collect(c.generate(stream).await.unwrap()).await;
    assert_eq!(out.tensors["responses"].shape, vec![2, r]);
    assert_eq!(out.tensors["response_mask"].shape, vec![2, r]);
    let lps = out.tensors["behaviour_log_probs"].to_f32().unwrap();
    let rmask = out.tensors["response_mask"].to_f32().unwrap();
    assert!(
        rmask[0] == 1.0 && rmask[r] == 1.0,
        "every response has a first token"
    );
    assert!(lps
        .iter()
        .zip(&rmask)
        .all(|(l, m)| *m == 0.0 || (*l <= 0.0 && l.is_finite())));

    // The same call through shared memory: the answer comes back the same way, as views of
    // the role's segment, equal to the streamed one (greedy decoding, same seed). The role
    // holds its answer until this request stream ends.
    let req =
        rlhf_runtime::shared_batch::SharedFile::write(&wire::<GenerateRequest>(&prompts)).unwrap();
    let (mapped, held) = tokio::sync::oneshot::channel::<()>();
    let stream = futures::StreamExt::chain(
        futures::stream::iter([req.chunk()]),
        futures::StreamExt::filter_map(
            futures::stream::once(async move {
                let _ = held.await;
            }),
            |()| std::future::ready(None),
        ),
    );
    let mut answer = c.generate(stream).await.unwrap().into_inner();
    let first = answer.message().await.unwrap().unwrap();
    assert!(
        first.shared.is_some(),
        "a shared request is answered in shared memory"
    );
    let shared_out = rlhf_runtime::shared_batch::open(&first, 1 << 30)
        .unwrap()
        .unwrap();
    drop(mapped);
    assert!(shared_out.tensors["responses"].data.is_view());
    assert_eq!(shared_out, out);
    // A batch the role cannot reach (here: a descriptor that is not open) is refused with
    // the mark that makes the driver stream it instead.
    let mut bogus = req.chunk();
    if let Some(sh) = &mut bogus.shared {
        sh.fd = 1_000_000;
    }
    let err = c
        .generate(futures::stream::iter([bogus]))
        .await
        .unwrap_err();
    assert!(rlhf_runtime::shared_batch::is_unreachable(&err), "{err}");
    drop(req);

    // The same call as raw control frames (a driver on another host): the answer comes back
    // the same way, beside the response, equal to the streamed one; no chunk is streamed.
    let mut framed = tonic::Request::new(futures::stream::empty::<pb::BatchChunk>());
    framed
        .extensions_mut()
        .insert(rlhf_runtime::frames::FramedBatch(wire::<GenerateRequest>(
            &prompts,
        )));
    let mut resp = c.generate(framed).await.unwrap();
    let framed_out = rlhf_runtime::frames::FramedBatch::take(resp.extensions_mut())
        .expect("a framed request is answered with a framed batch");
    assert!(resp.into_inner().message().await.unwrap().is_none());
    assert!(framed_out.tensors["responses"].data.is_view());
    assert_eq!(framed_out, out);

    let bad_batch = DataBatch::new()
        .with_tensor(
            "prompt_ids",
            TensorData::from_i64(vec![1, 3], &[1, 2, 3]).unwrap(),
        )
        .with_tensor(
            "prompt_mask",
            TensorData::from_i64(vec![1, 3], &[1, 1, 1]).unwrap(),
        );
    let mut framed = tonic::Request::new(futures::stream::empty::<pb::BatchChunk>());
    framed
        .extensions_mut()
        .insert(rlhf_runtime::frames::FramedBatch(wire::<GenerateRequest>(
            &bad_batch,
        )));
    // Streamed and framed, the role's refusal reaches the caller the same way.
    for err in [
        c.generate(rlhf_runtime::batch_stream(&wire::<GenerateRequest>(&bad_batch)).unwrap())
            .await
            .unwrap_err(),
        c.generate(framed).await.unwrap_err(),
    ] {
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(
            err.message()
                .contains("'prompt_ids' has shape [1, 3], expected [1, 32]"),
            "{err}"
        );
    }

    // Trainer rank: ComputeLogProbs on the generated sequences.
    let addr = start("actor_rollout", &shutdown).await;
    let mut t = client(&addr, TOKEN).await;
    let info = t
        .init_role(init("actor_rollout", "train"))
        .await
        .unwrap()
        .into_inner();
    assert!(info.num_params > 0);
    let resp = out.tensors["responses"].to_i64().unwrap();
    let mut seq_ids = vec![0i64; 2 * (p + r)];
    let mut seq_mask = vec![0i64; 2 * (p + r)];
    for row in 0..2 {
        for j in 0..p {
            seq_ids[row * (p + r) + j] = ids[row * p + j];
            seq_mask[row * (p + r) + j] = mask[row * p + j];
        }
        for k in 0..r {
            seq_ids[row * (p + r) + p + k] = resp[row * r + k];
            seq_mask[row * (p + r) + p + k] = rmask[row * r + k] as i64;
        }
    }
    let mut seqs = DataBatch::new()
        .with_tensor(
            "input_ids",
            TensorData::from_i64(vec![2, p + r], &seq_ids).unwrap(),
        )
        .with_tensor(
            "attention_mask",
            TensorData::from_i64(vec![2, p + r], &seq_mask).unwrap(),
        );
    seqs.meta
        .insert("response_length".into(), serde_json::json!(r));
    let lp = collect(
        t.compute_log_probs(rlhf_runtime::batch_stream(&wire::<LogProbsRequest>(&seqs)).unwrap())
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(lp.tensors["log_probs"].shape, vec![2, r]);
    assert_eq!(lp.tensors["entropy"].shape, vec![2, r]);
    // The trainer recomputes what the rollout sampled with (greedy: temperature 1).
    let recomputed = lp.tensors["log_probs"].to_f32().unwrap();
    for i in 0..2 * r {
        if rmask[i] == 1.0 {
            assert!(
                (recomputed[i] - lps[i]).abs() < 1e-3,
                "{i}: {} vs {}",
                recomputed[i],
                lps[i]
            );
        }
    }
    let sums = t
        .weights_checksum(pb::WeightsChecksumRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(sums.checksum, info.weights_checksum);

    // Reward rank: the rule of ppo_tiny (contains_digit).
    let addr = start("reward", &shutdown).await;
    let mut w = client(&addr, TOKEN).await;
    w.init_role(init("reward", "")).await.unwrap();
    let scored = seqs
        .clone()
        .with_column("prompt_text", vec!["a".into(), "b".into()])
        .with_column("response_text", vec!["7 apples".into(), "none".into()]);
    let s = collect(
        w.compute_scores(rlhf_runtime::batch_stream(&wire::<ScoresRequest>(&scored)).unwrap())
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s.tensors["scores"].to_f32().unwrap(), vec![1.0, 0.0]);
    shutdown.cancel();
}

/// The driver's flow for one step on a trainer and a rollout process: PrepareComm and
/// JoinComm for the `weights` group, UpdateActor, SyncWeights on both at once, checksums,
/// then SaveCheckpoint / LoadCheckpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn update_and_sync_weights_over_grpc() {
    let shutdown = CancellationToken::new();
    let (p, r) = (32usize, 16usize);
    let train_addr = start("actor_rollout", &shutdown).await;
    let infer_addr = start("actor_rollout", &shutdown).await;
    let mut t = client(&train_addr, TOKEN).await;
    let mut g = client(&infer_addr, TOKEN).await;
    t.init_role(init("actor_rollout", "train")).await.unwrap();
    let infer_info = g
        .init_role(init("actor_rollout", "infer"))
        .await
        .unwrap()
        .into_inner();

    let prepared = t
        .prepare_comm(pb::PrepareCommRequest {
            group: pb::CommGroup::Weights as i32,
            backend: pb::CommBackend::Tcp as i32,
            kv_key: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(prepared.address.starts_with("127.0.0.1:"), "{prepared:?}");
    let join = |rank: u32| pb::JoinCommRequest {
        group: pb::CommGroup::Weights as i32,
        backend: pb::CommBackend::Tcp as i32,
        rank,
        world_size: 2,
        address: prepared.address.clone(),
        unique_id: vec![],
        timeout_ms: 20_000,
        secret: vec![3; 32],
        kv_key: String::new(),
    };
    let (a, b) = tokio::join!(t.join_comm(join(0)), g.join_comm(join(1)));
    a.unwrap();
    b.unwrap();
    let err = g
        .prepare_comm(pb::PrepareCommRequest {
            group: pb::CommGroup::Weights as i32,
            backend: pb::CommBackend::Nccl as i32,
            kv_key: String::new(),
        })
        .await;
    if !cfg!(feature = "nccl") {
        assert!(err
            .unwrap_err()
            .message()
            .contains("without the nccl feature"));
    }

    // One update on 8 sequences (ppo_tiny: mini-batch 8, micro 4, 2 epochs).
    let mut seqs = common::sequences(&[5, 3, 4, 1, 5, 5, 2, 3], 5);
    let pad = |b: &mut DataBatch| {
        // common::sequences uses P=6/R=5; rebuild at ppo_tiny's 32/16 by left/right padding.
        let (ids, am, rm) = (
            b.tensors["input_ids"].to_i64().unwrap(),
            b.tensors["attention_mask"].to_i64().unwrap(),
            b.tensors["response_mask"].to_f32().unwrap(),
        );
        let (sp, sr) = (common::P, common::R);
        let n = rm.len() / sr;
        let mut ni = vec![0i64; n * (p + r)];
        let mut na = vec![0i64; n * (p + r)];
        let mut nr = vec![0f32; n * r];
        for i in 0..n {
            for j in 0..sp {
                ni[i * (p + r) + p - sp + j] = ids[i * (sp + sr) + j];
                na[i * (p + r) + p - sp + j] = am[i * (sp + sr) + j];
            }
            for k in 0..sr {
                ni[i * (p + r) + p + k] = ids[i * (sp + sr) + sp + k];
                na[i * (p + r) + p + k] = am[i * (sp + sr) + sp + k];
                nr[i * r + k] = rm[i * sr + k];
            }
        }
        *b = DataBatch::new()
            .with_tensor(
                "input_ids",
                TensorData::from_i64(vec![n, p + r], &ni).unwrap(),
            )
            .with_tensor(
                "attention_mask",
                TensorData::from_i64(vec![n, p + r], &na).unwrap(),
            )
            .with_tensor(
                "response_mask",
                TensorData::from_f32(vec![n, r], &nr).unwrap(),
            );
    };
    pad(&mut seqs);
    let lp = collect(
        t.compute_log_probs(rlhf_runtime::batch_stream(&wire::<LogProbsRequest>(&seqs)).unwrap())
            .await
            .unwrap(),
    )
    .await;
    let update = common::actor_batch(&seqs, &lp.tensors["log_probs"].to_f32().unwrap(), 3);
    let metrics = collect(
        t.update_actor(rlhf_runtime::batch_stream(&wire::<ActorUpdateRequest>(&update)).unwrap())
            .await
            .unwrap(),
    )
    .await;
    assert!(
        metrics.meta["actor/grad_norm"].as_f64().unwrap() > 0.0,
        "{:?}",
        metrics.meta
    );
    assert_eq!(metrics.meta["actor/lr"].as_f64().unwrap(), 5e-5);

    let sync = |_: ()| pb::SyncWeightsRequest {
        group: pb::CommGroup::Weights as i32,
        version: 1,
        bucket_bytes: 64 << 10,
    };
    let (a, b) = tokio::join!(t.sync_weights(sync(())), g.sync_weights(sync(())));
    let (a, b) = (a.unwrap().into_inner(), b.unwrap().into_inner());
    assert_eq!(a.checksum, b.checksum);
    assert_ne!(b.checksum, infer_info.weights_checksum);
    assert!(
        a.buckets > 1 && a.bytes > 0 && b.version == 1,
        "{a:?} {b:?}"
    );
    let now = g
        .weights_checksum(pb::WeightsChecksumRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!((now.checksum, now.version), (a.checksum, 1));

    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("step1").display().to_string();
    let saved = t
        .save_checkpoint(pb::SaveCheckpointRequest {
            dir: ckpt.clone(),
            background: false,
            snapshot: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(saved.weights_checksum, a.checksum);
    let files = saved.files;
    assert!(
        files.contains(&"optimizer.safetensors".to_string()),
        "{files:?}"
    );
    assert!(files.contains(&"tokenizer.json".to_string()), "{files:?}");
    // In the background: the answer comes before the files; WaitCheckpoint tells when
    // they are on disk and what they hold.
    let bg = dir.path().join("step1-bg").display().to_string();
    let started = t
        .save_checkpoint(pb::SaveCheckpointRequest {
            dir: bg.clone(),
            background: true,
            snapshot: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(started.files.is_empty(), "{started:?}");
    let wait = |dir: &str| pb::WaitCheckpointRequest {
        dir: dir.to_string(),
        timeout_ms: 60_000,
    };
    let err = t.wait_checkpoint(wait(&ckpt)).await.unwrap_err();
    assert!(
        err.message().contains("no checkpoint save to") && err.message().contains("step1-bg"),
        "{err}"
    );
    let done = t.wait_checkpoint(wait(&bg)).await.unwrap().into_inner();
    assert_eq!((done.weights_checksum, done.files), (a.checksum, files));
    let t2_addr = start("actor_rollout", &shutdown).await;
    let mut t2 = client(&t2_addr, TOKEN).await;
    t2.init_role(init("actor_rollout", "train")).await.unwrap();
    for d in [ckpt, bg.clone()] {
        let loaded = t2
            .load_checkpoint(pb::LoadCheckpointRequest {
                dir: d,
                snapshot: None,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(loaded.weights_checksum, a.checksum);
        assert_eq!(loaded.source, "disk");
    }
    // A memory snapshot whose worker is gone: the rank loads the same files from disk, and
    // says why.
    let gone = pb::SnapshotSource {
        job_id: "job-x".into(),
        step: 1,
        parts: vec![pb::SnapshotHolder {
            part: "step1-bg".into(),
            address: "127.0.0.1:1".into(),
            bytes: 10,
        }],
    };
    let loaded = t2
        .load_checkpoint(pb::LoadCheckpointRequest {
            dir: bg.clone(),
            snapshot: Some(gone),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(loaded.weights_checksum, a.checksum);
    assert!(
        loaded
            .source
            .starts_with("disk (the memory snapshot was not available: ")
            && loaded.source.contains("127.0.0.1:1"),
        "{}",
        loaded.source
    );
    let err = g
        .save_checkpoint(pb::SaveCheckpointRequest {
            dir: "/tmp/x".into(),
            background: true,
            snapshot: None,
        })
        .await
        .unwrap_err();
    assert!(err.message().contains("trainable roles"), "{err}");
    let err = t2.wait_checkpoint(wait(&bg)).await.unwrap_err();
    assert!(err.message().contains("call SaveCheckpoint first"), "{err}");
    shutdown.cancel();
}

/// A panic on the compute thread must end the process with the message on stderr (the
/// worker reports the log tail), never leave the RPC side waiting. Runs itself as a child.
#[test]
fn a_panic_on_the_compute_thread_ends_the_process() {
    const CHILD: &str = "RLHF_ROLES_PANIC_CHILD";
    if std::env::var(CHILD).is_ok() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let c = rlhf_roles::server::Compute::spawn(rlhf_roles::RoleHost::new(
                rlhf_core::RoleKind::Critic,
                "127.0.0.1",
            ))
            .unwrap();
            let r = c
                .run(|_| -> rlhf_roles::Result<()> { panic!("boom in compute") })
                .await;
            assert!(r.is_err());
        });
        // The compute thread exits the process; reaching the end here would be a bug.
        std::thread::sleep(std::time::Duration::from_secs(20));
        std::process::exit(0);
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_panic_on_the_compute_thread_ends_the_process",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(101), "{err}");
    assert!(
        err.contains("the critic compute thread panicked: boom in compute"),
        "{err}"
    );
}
