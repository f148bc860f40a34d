//! Submitted jobs: the head's job RPCs against an in-process head with a stand-in driver
//! (the job manager's contract is "run this program with these arguments"), and the real
//! `rlhf-head submit` / `rlhf-head job ...` against a real head.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rlhf_e2e::{bin, wait_for, Cluster, Proc};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::head_service_client::HeadServiceClient;
use rlhf_runtime::clock::SystemClock;
use rlhf_runtime::head::{self, HeadOptions};
use rlhf_runtime::net::{self, ClientOptions};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

fn submit_req(name: &str) -> pb::SubmitJobRequest {
    pb::SubmitJobRequest {
        bundle: "{}".into(),
        config_name: name.into(),
        overrides: vec![],
        metrics_file: String::new(),
        samples_file: String::new(),
    }
}

type Client = HeadServiceClient<net::AuthChannel>;

async fn get(c: &mut Client, id: &str) -> pb::JobInfo {
    c.get_job(pb::GetJobRequest {
        job_id: id.to_string(),
    })
    .await
    .unwrap()
    .into_inner()
    .job
    .unwrap()
}

async fn wait_state(c: &mut Client, id: &str, st: pb::JobState) -> pb::JobInfo {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        let j = get(c, id).await;
        if j.state == st as i32 {
            return j;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("job {id} never reached {st:?}: {:?}", get(c, id).await);
}

/// Job RPCs through a real gRPC server, with a stand-in driver that fails on its first run
/// and sleeps until stopped on later runs.
#[tokio::test]
async fn job_rpcs_run_fail_stop_and_list_through_the_head() {
    let dir = tempfile::tempdir().unwrap();
    let driver = script(
        dir.path(),
        "driver.sh",
        // $7 is the job id: `run --address A --bundle B --job-id ID`.
        "if [ -e ../../../first-done ]; then echo \"running $7\"; exec sleep 600; fi\n\
         touch ../../../first-done\necho 'error: cannot reach the head' >&2\nexit 2",
    );
    let mut o = HeadOptions::new(dir.path().join("state"), "tok".into());
    o.host = "127.0.0.1".into();
    o.port = 0;
    o.dashboard = None;
    o.job_exe = Some(driver);
    o.job_stop_grace = Duration::from_secs(5);
    let sd = CancellationToken::new();
    let h = head::start(o, Arc::new(SystemClock), sd.clone())
        .await
        .unwrap();
    let mut co = ClientOptions::new("tok");
    co.connect_timeout = Duration::from_secs(5);
    let mut c = HeadServiceClient::new(net::connect(&h.addr.to_string(), &co).await.unwrap());

    // First job: the driver fails; its last `error:` line becomes the job's error.
    let first = c
        .submit_job(submit_req("ppo_tiny"))
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert!(first.job_id.starts_with("job-"), "{}", first.job_id);
    let j = wait_state(&mut c, &first.job_id, pb::JobState::Failed).await;
    assert!(j.has_exit_code && j.exit_code == 2, "{j:?}");
    assert_eq!(j.error, "cannot reach the head");
    let logs = c
        .job_logs(pb::JobLogsRequest {
            job_id: first.job_id.clone(),
            offset: 0,
            max_bytes: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(logs.data, b"error: cannot reach the head\n");
    assert!(logs.finished);

    // Second job: runs until stopped.
    let second = c
        .submit_job(submit_req("ppo_other"))
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(second.state, pb::JobState::Running as i32);
    let want = format!("running {}\n", second.job_id);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let l = c
            .job_logs(pb::JobLogsRequest {
                job_id: second.job_id.clone(),
                offset: 0,
                max_bytes: 0,
            })
            .await
            .unwrap()
            .into_inner();
        if l.data == want.as_bytes() {
            assert!(!l.finished, "the log of a running job is not finished");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "job {} never logged {want:?}: {:?}",
            second.job_id,
            String::from_utf8_lossy(&l.data)
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // Cluster status lists both, oldest first.
    let s = c
        .cluster_status(pb::ClusterStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    let ids: Vec<_> = s.jobs.iter().map(|j| j.job_id.clone()).collect();
    assert_eq!(ids, vec![first.job_id.clone(), second.job_id.clone()]);
    let text = rlhf_runtime::status::to_text(&s);
    assert!(
        text.contains(&format!("{} RUNNING ppo_other", second.job_id)),
        "{text}"
    );

    c.stop_job(pb::StopJobRequest {
        job_id: second.job_id.clone(),
    })
    .await
    .unwrap();
    let j = wait_state(&mut c, &second.job_id, pb::JobState::Stopped).await;
    assert_eq!(j.signal, libc::SIGTERM);
    assert!(j.end_ms >= j.start_ms && j.start_ms > 0);

    // Unknown ids name the recent ones.
    let e = c
        .get_job(pb::GetJobRequest {
            job_id: "job-nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    assert!(
        e.message().contains(&first.job_id) && e.message().contains(&second.job_id),
        "{}",
        e.message()
    );

    // A third job is still running when the head shuts down: the head stops it first.
    let third = c
        .submit_job(submit_req("ppo_tiny"))
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(third.state, pb::JobState::Running as i32);
    let pid = third.pid;
    sd.cancel();
    tokio::time::timeout(Duration::from_secs(20), h.wait())
        .await
        .expect("head did not stop");
    assert!(
        !rlhf_e2e::pid_alive(pid),
        "driver {pid} survived the head's shutdown"
    );
}

fn head_cmd(c: &Cluster, args: &[&str]) -> Result<Output> {
    let out = Command::new(bin("rlhf-head"))
        .args(args)
        .args(["--address", &c.address(), "--connect-timeout", "5"])
        .arg("--token-file")
        .arg(c.token_file())
        .current_dir(c.dir.path())
        .env_remove("RLHF_TOKEN")
        .output()
        .with_context(|| format!("running rlhf-head {args:?}"))?;
    Ok(out)
}

fn ok_stdout(out: &Output, what: &str) -> Result<String> {
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn job_json(c: &Cluster, id: &str) -> Result<Value> {
    let out = head_cmd(c, &["job", "status", id, "--format", "json"])?;
    Ok(serde_json::from_str(&ok_stdout(&out, "job status")?)?)
}

/// The real binaries: `submit` validates the config on the client, the head runs
/// `rlhf-head run` for it, and `job stop` ends it. The job is submitted from the repository
/// (so its model and data paths resolve) with every output redirected to the test's
/// directory. This cluster has no workers, so the driver waits RUNNING for its role actors
/// until `job stop` ends it.
#[test]
fn submit_ppo_tiny_then_stop_it() -> Result<()> {
    let c = Cluster::start(&[])?;
    let repo = std::fs::canonicalize(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))?;
    let out_dir = c.dir.path().display().to_string();
    let in_repo = |args: &[&str]| -> Result<Output> {
        Command::new(bin("rlhf-head"))
            .args(args)
            .args(["--address", &c.address(), "--connect-timeout", "5"])
            .arg("--token-file")
            .arg(c.token_file())
            .current_dir(&repo)
            .env_remove("RLHF_TOKEN")
            .output()
            .context("running rlhf-head submit")
    };

    // Config errors are caught on the client, before the head sees anything.
    let out = in_repo(&[
        "submit",
        "--config-name",
        "ppo_tiny",
        "actor_rollout.ppo_epoch=2",
    ])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.starts_with("error: ") && err.contains("ppo_epoch") && err.contains("ppo_epochs"),
        "{err}"
    );

    let out = in_repo(&[
        "submit",
        "--config-name",
        "ppo_tiny",
        "training.train_iters=1",
        &format!("checkpoint.dir={out_dir}/ckpt"),
        &format!("logging.metrics_file={out_dir}/metrics.jsonl"),
        &format!("logging.samples_file={out_dir}/samples.jsonl"),
    ])?;
    let text = ok_stdout(&out, "submit")?;
    let id = text
        .split_whitespace()
        .find(|w| w.starts_with("job-"))
        .with_context(|| format!("no job id in: {text}"))?
        .to_string();
    assert!(
        text.contains(&format!("rlhf-head job logs -f {id}")),
        "{text}"
    );

    let job_dir = c.state_dir().join("jobs").join(&id);
    let log = job_dir.join("driver.log");
    assert!(log.exists(), "{} missing", log.display());
    // Relative paths were made absolute against the submitting shell's directory.
    let bundle = std::fs::read_to_string(job_dir.join("config.yaml"))?;
    let data = repo.join("data/prompts_tiny.jsonl");
    assert!(
        bundle.contains(&data.display().to_string()),
        "{}",
        &bundle[..bundle.len().min(2000)]
    );

    let j = wait_for(Duration::from_secs(60), "the job to start", || {
        let j = job_json(&c, &id)?;
        Ok((j["state"] != "PENDING").then_some(j))
    })?;
    // No worker: the driver waits for its role actors, so the job stays RUNNING until stopped.
    assert_eq!(j["state"], "RUNNING", "{j}");
    // A follower started while the job runs stays attached until the stop has ended it: it
    // can only print the final state after `job stop`.
    let mut follow = Proc::spawn(
        "follow",
        c.dir.path(),
        Command::new(bin("rlhf-head"))
            .args(["job", "logs", "-f", &id])
            .args(["--address", &c.address()])
            .arg("--token-file")
            .arg(c.token_file())
            .env_remove("RLHF_TOKEN"),
    )?;
    assert!(
        follow.child.try_wait()?.is_none(),
        "`job logs -f` returned while the job was running: {}",
        follow.output()
    );
    let out = head_cmd(&c, &["job", "stop", &id])?;
    let text = ok_stdout(&out, "job stop")?;
    assert!(text.contains("STOPPED"), "{text}");
    let j = job_json(&c, &id)?;
    assert_eq!(j["state"], "STOPPED", "{j}");
    let st = follow.wait_exit(Duration::from_secs(60))?;
    assert!(st.success(), "{}", follow.output());
    assert!(
        follow.output().contains(&format!("job {id} STOPPED")),
        "{}",
        follow.output()
    );

    // `job logs` gives the driver's output; `-f` returns once the job has ended.
    let out = head_cmd(&c, &["job", "logs", "-f", &id])?;
    assert_eq!(ok_stdout(&out, "job logs")?, std::fs::read_to_string(&log)?);
    let out = head_cmd(&c, &["job", "list"])?;
    assert!(ok_stdout(&out, "job list")?.contains(&id));
    let s = c.status()?;
    assert_eq!(s["jobs"][0]["job_id"], id.as_str(), "{s}");

    // `submit --follow` stays attached and exits non-zero unless the job succeeds.
    let mut attached = Proc::spawn(
        "submit-follow",
        c.dir.path(),
        Command::new(bin("rlhf-head"))
            .args(["submit", "--follow", "--config-name", "ppo_tiny"])
            .args([
                "training.train_iters=1",
                &format!("checkpoint.dir={out_dir}/ckpt"),
            ])
            .args([&format!("logging.metrics_file={out_dir}/metrics.jsonl")])
            .args([&format!("logging.samples_file={out_dir}/samples.jsonl")])
            .args(["--address", &c.address()])
            .arg("--token-file")
            .arg(c.token_file())
            .current_dir(&repo)
            .env_remove("RLHF_TOKEN"),
    )?;
    let id2 = wait_for(Duration::from_secs(20), "submit --follow's job id", || {
        let out = attached.output();
        Ok(out
            .split_whitespace()
            .skip_while(|w| *w != "job")
            .nth(1)
            .filter(|w| w.starts_with("job-"))
            .map(str::to_string))
    })?;
    let j = wait_for(Duration::from_secs(60), "the attached job to start", || {
        let j = job_json(&c, &id2)?;
        Ok((j["state"] != "PENDING").then_some(j))
    })?;
    assert_eq!(j["state"], "RUNNING", "{j}");
    assert!(
        attached.child.try_wait()?.is_none(),
        "{}",
        attached.output()
    );
    ok_stdout(&head_cmd(&c, &["job", "stop", &id2])?, "job stop")?;
    // Still attached at the stop: it reports the final state and exits non-zero.
    let st = attached.wait_exit(Duration::from_secs(60))?;
    let end = job_json(&c, &id2)?;
    assert!(!st.success() && end["state"] == "STOPPED", "{end}");
    assert!(
        attached
            .output()
            .contains(&format!("error: job {id2} STOPPED")),
        "{}",
        attached.output()
    );

    let out = head_cmd(&c, &["job", "status", "job-nope"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no job 'job-nope'") && err.contains(&id),
        "{err}"
    );
    Ok(())
}

/// `rlhf-head submit` of ppo_tiny for `iters` steps (a checkpoint every `save_steps`) from the
/// repository, every output under `out_dir`; returns the job id.
fn submit_tiny(c: &Cluster, out_dir: &Path, iters: u32, save_steps: u32) -> Result<String> {
    c.submit_ppo_tiny(
        out_dir,
        &[
            format!("training.train_iters={iters}"),
            format!("checkpoint.save_steps={save_steps}"),
        ],
    )
}

/// `job status --format json` of job `id` once it has ended.
fn wait_job_end(c: &Cluster, id: &str) -> Result<Value> {
    wait_for(Duration::from_secs(900), "the job to end", || {
        let j = job_json(c, id)?;
        let done = matches!(
            j["state"].as_str(),
            Some("SUCCEEDED" | "FAILED" | "STOPPED")
        );
        Ok(done.then_some(j))
    })
}

/// What every submitted job runs (`rlhf-head run --bundle --job-id` started by the head) run
/// to success: ppo_tiny submitted to a head with a real worker ends SUCCEEDED, with its
/// metrics (one line per step) and a complete checkpoint written. A second job submitted
/// meanwhile waits QUEUED (the head runs one job at a time by default), then runs and
/// succeeds once the first has ended.
#[test]
fn a_submitted_ppo_tiny_job_runs_to_success() -> Result<()> {
    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"CPU": 4}"#)?;
    c.wait_alive_nodes(1, Duration::from_secs(30))?;
    let out_dir = c.dir.path().join("job");
    let id = submit_tiny(&c, &out_dir, 2, 2)?;
    let second_dir = c.dir.path().join("second");
    let second = submit_tiny(&c, &second_dir, 2, 2)?;
    let q = job_json(&c, &second)?;
    assert_eq!(q["state"], "QUEUED", "{q}");
    assert_eq!(q["queue_position"].as_u64(), Some(1), "{q}");
    let end = wait_job_end(&c, &id)?;
    let log = std::fs::read_to_string(c.state_dir().join("jobs").join(&id).join("driver.log"))
        .unwrap_or_default();
    assert_eq!(end["state"], "SUCCEEDED", "{end}\ndriver log:\n{log}");
    assert_eq!(end["exit_code"].as_i64(), Some(0), "{end}");
    // The driver recorded how it ended, as data, in its job directory.
    let outcome = rlhf_core::JobOutcome::read(&c.state_dir().join("jobs").join(&id))
        .context("the driver wrote no outcome.json")?;
    assert_eq!(outcome.failure, None);
    assert!(end["failure"].is_null(), "{end}");

    let metrics = std::fs::read_to_string(out_dir.join("metrics.jsonl"))?;
    let steps: Vec<u64> = metrics
        .lines()
        .map(|l| {
            Ok(serde_json::from_str::<Value>(l)?["step"]
                .as_u64()
                .unwrap_or(0))
        })
        .collect::<Result<_>>()?;
    assert_eq!(steps, vec![1, 2], "{metrics}");
    let ck = out_dir.join("ckpt/global_step_2");
    for f in [
        "actor/model.safetensors",
        "actor/optimizer.safetensors",
        "critic/model.safetensors",
        "trainer_state.json",
    ] {
        assert!(ck.join(f).is_file(), "missing {f} in {}", ck.display());
    }
    let latest = std::fs::read_to_string(out_dir.join("ckpt/latest_checkpointed_iteration.txt"))?;
    assert_eq!(latest.trim(), "2");

    let end2 = wait_job_end(&c, &second)?;
    assert_eq!(end2["state"], "SUCCEEDED", "{end2}");
    assert!(
        end2["start_ms"].as_i64() >= end["end_ms"].as_i64(),
        "the queued job started before the first ended: {end} {end2}"
    );
    assert!(second_dir
        .join("ckpt/global_step_2/trainer_state.json")
        .is_file());
    Ok(())
}

/// The head dies mid-job (SIGKILL) and comes back on the same state directory: the job's
/// driver, the worker and the role processes go on without it, `job status` shows the job
/// RUNNING again, and it ends SUCCEEDED with every step written.
#[test]
fn a_job_outlives_a_head_restart_and_ends_succeeded() -> Result<()> {
    use nix::sys::signal::Signal;
    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"CPU": 4}"#)?;
    c.wait_alive_nodes(1, Duration::from_secs(30))?;
    let out_dir = c.dir.path().join("job");
    let metrics = out_dir.join("metrics.jsonl");
    let id = submit_tiny(&c, &out_dir, 10, 0)?;
    let steps = || {
        std::fs::read_to_string(&metrics)
            .map(|t| t.lines().count())
            .unwrap_or(0)
    };
    wait_for(Duration::from_secs(600), "the first steps", || {
        Ok((steps() >= 2).then_some(()))
    })?;
    let head = c.head.as_mut().context("head")?;
    head.signal(Signal::SIGKILL);
    head.wait_exit(Duration::from_secs(5))?;
    let during = steps();
    std::thread::sleep(Duration::from_millis(500));
    c.start_head()?;
    // The driver needs no head to train: on a fast machine the last steps may finish while
    // the head is down, and the restarted head must then learn the end from the driver.
    let j = job_json(&c, &id)?;
    assert!(
        matches!(j["state"].as_str(), Some("RUNNING" | "SUCCEEDED")),
        "{j}"
    );
    assert!(during < 10, "the head died after the last step: {during}");
    let end = wait_job_end(&c, &id)?;
    assert_eq!(end["state"], "SUCCEEDED", "{end}");
    assert_eq!(steps(), 10, "steps before the head died: {during}");
    Ok(())
}
