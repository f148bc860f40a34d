//! The role server in-process over real gRPC: InitRole, Generate, ComputeLogProbs,
//! ComputeScores, Ping on the same endpoint, a wrong token refused, and a panic on the
//! compute thread ending the process. The training calls are in `server_sync.rs`.

mod common;

use common::serve::{client, collect, init, start, wire, TOKEN};
use rlhf_core::batch::{DataBatch, TensorData};
use rlhf_core::calls::{GenerateRequest, LogProbsRequest, ScoresRequest};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::actor_service_client::ActorServiceClient;
use tokio_util::sync::CancellationToken;

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
        rlhf_runtime::net::connect(&addr, &rlhf_runtime::net::ClientOptions::new(TOKEN))
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
