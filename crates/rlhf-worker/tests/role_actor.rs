//! The real binary as the worker starts it: `rlhf-worker actor --kind reward` serves
//! RoleService and Ping behind the token; an unknown kind exits with the known ones.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rlhf_core::batch::Assembler;
use rlhf_proto::v1 as pb;
use rlhf_runtime::net::ClientOptions;

const EXE: &str = env!("CARGO_BIN_EXE_rlhf-worker");

struct Kill(std::process::Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn reward_actor_process_scores_over_grpc() {
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("a1.ready");
    let child = Command::new(EXE)
        .args([
            "actor",
            "--actor-id",
            "a1",
            "--kind",
            "reward",
            "--host",
            "127.0.0.1",
        ])
        .arg("--ready-file")
        .arg(&ready)
        .env("RLHF_TOKEN", "tok")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let _guard = Kill(child);
    let start = Instant::now();
    let addr = loop {
        if let Ok(a) = std::fs::read_to_string(&ready) {
            break a;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no ready file");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let ch = rlhf_runtime::net::connect(&addr, &ClientOptions::new("tok"))
        .await
        .unwrap();
    let mut ping = pb::actor_service_client::ActorServiceClient::new(ch.clone());
    let pong = ping
        .ping(pb::PingRequest {
            payload: b"x".to_vec(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(pong.actor_id, "a1");

    let configs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../rlhf-model/tests/fixtures/tiny-llama")
        .display()
        .to_string();
    let cfg = rlhf_config::load(
        &configs,
        "ppo_tiny",
        &[
            format!("actor_rollout.model={model}"),
            format!("ref.model={model}"),
            format!("critic.model={model}"),
            "reward.rule=length".into(),
        ],
    )
    .unwrap();
    let mut roles = pb::role_service_client::RoleServiceClient::new(ch);
    let info = roles
        .init_role(pb::InitRoleRequest {
            role: pb::RoleKind::Reward as i32,
            spec: rlhf_config::RoleSpec::resolve(
                &cfg,
                rlhf_core::RoleSlot {
                    kind: rlhf_core::RoleKind::Reward,
                    part: rlhf_core::RolePart::Whole,
                    rank: 0,
                    world_size: 1,
                },
            )
            .unwrap()
            .to_json(),
            job_id: "j".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(info.model.contains("Length"), "{info:?}");
    let seq = |v: Vec<i64>| rlhf_core::calls::Mat::new(2, 2, v).unwrap();
    let batch = rlhf_core::calls::ScoresRequest {
        seq: rlhf_core::calls::Sequences {
            input_ids: seq(vec![1, 2, 3, 4]),
            attention_mask: seq(vec![1; 4]),
            response_len: 1,
        },
        prompt_text: vec!["p".into(), "q".into()],
        response_text: vec!["x".repeat(50), "y".repeat(300)],
        ground_truth: None,
    };
    let batch = rlhf_core::calls::Wire::to_batch(&batch).unwrap();
    let mut s = roles
        .compute_scores(rlhf_runtime::batch_stream(&batch).unwrap())
        .await
        .unwrap()
        .into_inner();
    let mut asm = Assembler::new(1 << 20);
    while let Some(c) = s.message().await.unwrap() {
        asm.push(c).unwrap();
    }
    let scores = asm.finish().unwrap().tensors["scores"].to_f32().unwrap();
    assert_eq!(scores, vec![0.5, 1.0]);
}

#[test]
fn unknown_kind_names_the_known_ones() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(EXE)
        .args(["actor", "--actor-id", "a2", "--kind", "trainer"])
        .arg("--ready-file")
        .arg(dir.path().join("r"))
        .env("RLHF_TOKEN", "tok")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown actor kind 'trainer'")
            && err.contains("actor_rollout, ref, critic, reward"),
        "{err}"
    );
}
