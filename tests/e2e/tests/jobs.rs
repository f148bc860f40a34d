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
    for _ in 0..400 {
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
        // $6 is the job id: `run --address A --bundle B --job-id ID`.
        "if [ -e ../../../first-done ]; then echo \"running $6\"; exec sleep 600; fi\n\
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
    for _ in 0..400 {
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
            assert!(!l.finished);
            break;
        }
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
/// directory. This cluster has no workers, so a real driver waits RUNNING for its role
/// actors and the stop path is taken; a driver that exits at once with an `error:` line
/// (the `run` stub before the driver existed, or a config the driver refuses) leaves the
/// job FAILED, and the test then checks that the job's error is that line.
#[test]
fn submit_ppo_tiny_then_stop_or_see_the_drivers_error() -> Result<()> {
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

    let j = wait_for(Duration::from_secs(20), "the job to start", || {
        let j = job_json(&c, &id)?;
        Ok((j["state"] != "PENDING").then_some(j))
    })?;
    eprintln!("job {id} left PENDING as {}", j["state"]);
    match j["state"].as_str() {
        Some("RUNNING") => {
            // A follower started while the job runs returns once the stop has ended it.
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
            std::thread::sleep(Duration::from_millis(300));
            assert!(
                follow.child.try_wait()?.is_none(),
                "`job logs -f` returned while the job was running: {}",
                follow.output()
            );
            let out = head_cmd(&c, &["job", "stop", &id])?;
            let text = ok_stdout(&out, "job stop")?;
            let j = job_json(&c, &id)?;
            if j["state"] == "STOPPED" {
                assert!(text.contains("STOPPED"), "{text}");
            } else {
                // The driver ended on its own between the two calls.
                assert_eq!(j["state"], "FAILED", "{j}");
            }
            let st = follow.wait_exit(Duration::from_secs(10))?;
            assert!(st.success(), "{}", follow.output());
            assert!(
                follow
                    .output()
                    .contains(&format!("job {id} {}", j["state"].as_str().unwrap_or("?"))),
                "{}",
                follow.output()
            );
        }
        Some("FAILED") => {}
        _ => bail!("unexpected job state: {j}"),
    }
    let j = job_json(&c, &id)?;
    if j["state"] == "FAILED" {
        let log_text = std::fs::read_to_string(&log)?;
        let last_error = log_text
            .lines()
            .rev()
            .find_map(|l| l.trim().strip_prefix("error:"))
            .map(str::trim)
            .with_context(|| format!("no error line in driver.log:\n{log_text}"))?;
        assert_eq!(j["error"], last_error, "{j}");
        assert!(j["exit_code"].as_i64().is_some_and(|c| c != 0), "{j}");
    }

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
    if job_json(&c, &id2)?["state"] == "RUNNING" {
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            attached.child.try_wait()?.is_none(),
            "{}",
            attached.output()
        );
        ok_stdout(&head_cmd(&c, &["job", "stop", &id2])?, "job stop")?;
    }
    let st = attached.wait_exit(Duration::from_secs(20))?;
    let end = job_json(&c, &id2)?;
    let state = end["state"].as_str().unwrap_or("?");
    assert!(
        !st.success() && (state == "STOPPED" || state == "FAILED"),
        "{end}"
    );
    assert!(
        attached
            .output()
            .contains(&format!("error: job {id2} {state}")),
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
