//! The role server's training calls over real gRPC, as the driver makes them on a trainer
//! and a rollout process: the `weights` communicator, an update, a weight sync with
//! checksums, and a checkpoint saved and loaded.

mod common;

use common::serve::{client, collect, init, start, wire, TOKEN};
use rlhf_core::batch::{DataBatch, TensorData};
use rlhf_core::calls::{ActorUpdateRequest, LogProbsRequest};
use rlhf_proto::v1 as pb;
use tokio_util::sync::CancellationToken;

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
