//! A worker's memory snapshots (`checkpoint.memory_snapshot`) over real gRPC to a real
//! `rlhf-worker` process: a checkpoint directory pushed and fetched back byte for byte, the
//! previous step kept until a newer one is committed, a job's snapshots dropped at its end,
//! the `--snapshot-memory-gb` bound, and nothing for a caller without the cluster token.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use rlhf_e2e::{Cluster, Proc};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::worker_service_client::WorkerServiceClient;
use rlhf_runtime::net::{self, ClientOptions};
use rlhf_runtime::snapshot::{fetch_into, push_dir};

const T: Duration = Duration::from_secs(30);

fn key(step: u64) -> pb::SnapshotKey {
    pb::SnapshotKey {
        job_id: "job-snap".into(),
        step,
        part: "actor".into(),
    }
}

/// A checkpoint-like directory: a weight file of `n` bytes (over one chunk when large), a
/// small JSON file and an empty one.
fn make_dir(dir: &Path, n: usize, seed: u8) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let w: Vec<u8> = (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    std::fs::write(dir.join("model.safetensors"), w)?;
    std::fs::write(dir.join("manifest.json"), format!("{{\"seed\": {seed}}}"))?;
    std::fs::write(dir.join("empty.txt"), b"")?;
    Ok(())
}

fn same_files(a: &Path, b: &Path) -> Result<()> {
    let list = |d: &Path| -> Result<Vec<(String, Vec<u8>)>> {
        let mut v = Vec::new();
        for e in std::fs::read_dir(d)? {
            let e = e?;
            v.push((
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path())?,
            ));
        }
        v.sort();
        Ok(v)
    };
    let (x, y) = (list(a)?, list(b)?);
    assert_eq!(
        x.iter().map(|f| &f.0).collect::<Vec<_>>(),
        y.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    assert!(x == y, "the fetched files differ from the pushed ones");
    Ok(())
}

#[test]
fn a_worker_holds_pushed_checkpoints_until_a_newer_commit_and_only_for_the_token() -> Result<()> {
    let mut c = Cluster::start(&[])?;
    // About 3 MiB of room.
    let mut cmd = c.worker_cmd(r#"{"CPU": 1}"#);
    cmd.arg("--token-file")
        .arg(c.token_file())
        .args(["--snapshot-memory-gb", "0.003"]);
    let w = Proc::spawn("worker-snap", c.dir.path(), &mut cmd)?;
    c.workers.push(w);
    let status = c.wait_alive_nodes(1, Duration::from_secs(30))?;
    let address = status["nodes"][0]["address"]
        .as_str()
        .with_context(|| format!("no worker address in {status}"))?
        .to_string();
    let opts = ClientOptions::new(c.token()?);
    let d = c.dir.path();
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        // Step 2 in and back out, byte for byte (2.5 chunks of weights).
        make_dir(&d.join("s2"), (5 << 20) / 4 + 11, 2)?;
        let sent = push_dir(&address, &opts, key(2), &d.join("s2"), T).await?;
        assert!(sent > (5 << 20) / 4, "{sent}");
        let got = fetch_into(&address, &opts, key(2), &d.join("back2"), T).await?;
        assert_eq!(got, sent);
        same_files(&d.join("s2"), &d.join("back2"))?;

        // Step 4 pushed: step 2 stays until step 4 is committed.
        make_dir(&d.join("s4"), 1000, 4)?;
        push_dir(&address, &opts, key(4), &d.join("s4"), T).await?;
        fetch_into(&address, &opts, key(2), &d.join("again2"), T).await?;
        let mut w = WorkerServiceClient::new(net::connect(&address, &opts).await?);
        w.commit_snapshot(pb::CommitSnapshotRequest {
            job_id: "job-snap".into(),
            step: 4,
        })
        .await?;
        let e = fetch_into(&address, &opts, key(2), &d.join("gone2"), T)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no snapshot of actor at step 2") && e.contains("[4]"),
            "{e}"
        );
        fetch_into(&address, &opts, key(4), &d.join("back4"), T).await?;
        same_files(&d.join("s4"), &d.join("back4"))?;

        // More than the worker may hold: refused, naming the flag.
        make_dir(&d.join("big"), 4 << 20, 9)?;
        let e = push_dir(&address, &opts, key(6), &d.join("big"), T)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("--snapshot-memory-gb"), "{e}");

        // Without the cluster token: nothing in, nothing out.
        let stranger = ClientOptions::new("not-the-token");
        let e = push_dir(&address, &stranger, key(8), &d.join("s4"), T)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), rlhf_core::FailureKind::Unauthenticated, "{e}");
        let e = fetch_into(&address, &stranger, key(4), &d.join("stolen"), T)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), rlhf_core::FailureKind::Unauthenticated, "{e}");
        assert!(!d.join("stolen").join("model.safetensors").exists());

        // The job ends: everything of it goes.
        let freed = w
            .drop_snapshots(pb::DropSnapshotsRequest {
                job_id: "job-snap".into(),
            })
            .await?
            .into_inner()
            .bytes_freed;
        assert_eq!(
            freed,
            1000 + r#"{"seed": 4}"#.len() as u64,
            "step 4: weights and manifest"
        );
        let e = fetch_into(&address, &opts, key(4), &d.join("after"), T)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("no snapshot of job job-snap"), "{e}");
        anyhow::Ok(())
    })
}
