//! The job manager's tests: drivers are shell scripts, so states, logs, stops, head
//! restarts and the queue are checked without a cluster.

use super::*;
use crate::clock::SystemClock;
use std::os::unix::fs::PermissionsExt;

#[test]
fn utc_formatting_and_job_ids() {
    assert_eq!(fmt_utc_ms(0), "1970-01-01 00:00:00");
    assert_eq!(fmt_utc_ms(1_700_000_000_000), "2023-11-14 22:13:20");
    // A leap day and the day after.
    assert_eq!(fmt_utc_ms(951_782_400_000), "2000-02-29 00:00:00");
    assert_eq!(fmt_utc_ms(951_868_800_000), "2000-03-01 00:00:00");
    let id = new_job_id(1_700_000_000_000);
    assert!(id.starts_with("job-20231114-221320-"), "{id}");
    assert_eq!(id.len(), "job-20231114-221320-abcd".len());
}

#[test]
fn last_error_line_is_the_last_one() {
    let log = "starting\nerror: first\nmore\n  error: second problem \ndone\n";
    assert_eq!(last_error_line(log).as_deref(), Some("second problem"));
    assert_eq!(last_error_line("all good\n"), None);
}

fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

fn manager(dir: &Path, exe: PathBuf, grace: Duration) -> Jobs {
    manager_with(dir, exe, grace, None)
}

fn manager_with(dir: &Path, exe: PathBuf, grace: Duration, tls_ca: Option<PathBuf>) -> Jobs {
    queued_manager(dir, exe, grace, tls_ca, 0)
}

fn queued_manager(
    dir: &Path,
    exe: PathBuf,
    grace: Duration,
    tls_ca: Option<PathBuf>,
    max_running: usize,
) -> Jobs {
    kept_manager(dir, exe, grace, tls_ca, max_running, DEFAULT_JOBS_KEPT)
}

fn kept_manager(
    dir: &Path,
    exe: PathBuf,
    grace: Duration,
    tls_ca: Option<PathBuf>,
    max_running: usize,
    keep_last: usize,
) -> Jobs {
    let store = Store::open(&dir.join("state")).unwrap();
    Jobs::open(
        JobsConfig {
            state_dir: dir.join("state"),
            exe,
            head_address: "127.0.0.1:1".into(),
            tls_ca,
            token: "sekrit-token".into(),
            stop_grace: grace,
            max_running,
            keep_for: DEFAULT_JOB_TTL,
            keep_last,
        },
        Some(store),
        Arc::new(SystemClock),
    )
    .unwrap()
}

fn submit(j: &Jobs) -> JobRecord {
    j.submit(pb::SubmitJobRequest {
        bundle: "{\"config\":\"x\"}".into(),
        config_name: "ppo_tiny".into(),
        overrides: vec!["training.train_iters=1".into()],
        metrics_file: String::new(),
        samples_file: String::new(),
    })
    .unwrap()
}

#[tokio::test]
async fn driver_runs_with_args_env_and_cwd_and_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let exe = script(
        dir.path(),
        "ok.sh",
        "echo \"args: $*\"\necho \"token: $RLHF_TOKEN\"\necho \"cwd: $(pwd)\"\necho '{\"step\":1}' > metrics.jsonl",
    );
    let j = manager(dir.path(), exe, Duration::from_secs(5));
    let r = submit(&j);
    assert_eq!(r.state, JobState::Running);
    assert!(r.pid > 0);
    assert!(j.wait_ended(&r.job_id, Duration::from_secs(10)).await);
    let r = j.get(&r.job_id).unwrap();
    assert_eq!(r.state, JobState::Succeeded, "{r:?}");
    assert_eq!(r.exit_code, Some(0));
    assert!(r.end_ms >= r.start_ms && r.start_ms >= r.submit_ms);
    let jd = j.job_dir(&r.job_id);
    assert_eq!(
        std::fs::read_to_string(jd.join(CONFIG_FILE)).unwrap(),
        "{\"config\":\"x\"}"
    );
    let log = String::from_utf8(j.logs(&r.job_id, 0, 0).unwrap().data).unwrap();
    let cfg = jd.join(CONFIG_FILE).display().to_string();
    assert!(
        log.contains(&format!(
            "args: run --address 127.0.0.1:1 --bundle {cfg} --job-id {}",
            r.job_id
        )),
        "{log}"
    );
    assert!(log.contains("token: sekrit-token"), "{log}");
    assert!(!log.lines().next().unwrap().contains("sekrit"), "{log}");
    let cwd = std::fs::canonicalize(&jd).unwrap();
    assert!(log.contains(&format!("cwd: {}", cwd.display())), "{log}");
    let info = j.info_with_metrics(&r.job_id).unwrap();
    assert_eq!(info.last_metrics, "{\"step\":1}");
    // A TLS head tells its drivers which CA verifies it.
    let echo = script(dir.path(), "echo.sh", "echo \"$*\"");
    let t = manager_with(
        &dir.path().join("tls"),
        echo,
        Duration::from_secs(5),
        Some(PathBuf::from("/pki/ca.crt")),
    );
    let tr = submit(&t);
    assert!(t.wait_ended(&tr.job_id, Duration::from_secs(10)).await);
    let args = String::from_utf8(t.logs(&tr.job_id, 0, 0).unwrap().data).unwrap();
    assert!(
        args.trim_end()
            .ends_with(&format!("--job-id {} --tls-ca /pki/ca.crt", tr.job_id)),
        "{args}"
    );
    // A metrics path that is not a JSONL file of records is not read.
    let secret = dir.path().join("secret.txt");
    std::fs::write(&secret, "password\n").unwrap();
    std::fs::remove_file(jd.join(METRICS_FILE)).unwrap();
    crate::lock(&j.0.jobs)
        .get_mut(&r.job_id)
        .unwrap()
        .metrics_file = secret.display().to_string();
    assert_eq!(j.info_with_metrics(&r.job_id).unwrap().last_metrics, "");
    let m = dir.path().join("m.jsonl");
    std::fs::write(&m, "{\"step\":1}\n{\"step\":2}\n\n").unwrap();
    crate::lock(&j.0.jobs)
        .get_mut(&r.job_id)
        .unwrap()
        .metrics_file = m.display().to_string();
    assert_eq!(
        j.info_with_metrics(&r.job_id).unwrap().last_metrics,
        "{\"step\":2}"
    );
    assert_eq!(info.state, pb::JobState::Succeeded as i32);
}

#[tokio::test]
async fn failing_driver_reports_its_last_error_line_and_logs_page() {
    let dir = tempfile::tempdir().unwrap();
    let exe = script(
        dir.path(),
        "fail.sh",
        "echo 'loading'\necho 'error: early' >&2\necho 'error: no worker has 2 CPU free' >&2\nexit 3",
    );
    let j = manager(dir.path(), exe, Duration::from_secs(5));
    let r = submit(&j);
    assert!(j.wait_ended(&r.job_id, Duration::from_secs(10)).await);
    let r = j.get(&r.job_id).unwrap();
    assert_eq!(r.state, JobState::Failed);
    assert_eq!(r.exit_code, Some(3));
    assert_eq!(r.error, "no worker has 2 CPU free");
    assert_eq!(r.failure, None, "no outcome.json: the log decides");
    // Paging through the log in small pieces gives the whole log back.
    let mut off = 0;
    let mut all = Vec::new();
    loop {
        let p = j.logs(&r.job_id, off, 5).unwrap();
        assert!(p.data.len() <= 5);
        all.extend_from_slice(&p.data);
        off = p.next_offset;
        if p.finished {
            break;
        }
    }
    assert_eq!(
        String::from_utf8(all).unwrap(),
        "loading\nerror: early\nerror: no worker has 2 CPU free\n"
    );
    // Beyond the end: nothing, and finished.
    let p = j.logs(&r.job_id, 10_000, 0).unwrap();
    assert!(p.data.is_empty() && p.finished);
}

/// A driver that records its outcome (as `rlhf-head run --bundle` does): the head takes
/// the kind, the role and rank to blame and the message from it, not from the log.
#[tokio::test]
async fn a_recorded_outcome_beats_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let outcome = rlhf_core::JobOutcome {
        failure: Some(JobFailure::new(
            &Error::new(
                rlhf_core::FailureKind::ActorDied,
                "role critic rank 1 died (actor a7, pid 9, node n1): signal 9\nlast log lines:\n  x",
            ),
            Some(("critic".into(), 1)),
        )),
    };
    let json = serde_json::to_string(&outcome).unwrap();
    let exe = script(
        dir.path(),
        "fail.sh",
        &format!(
            "echo 'error: a misleading last line' >&2\ncat > {} <<'EOF'\n{json}\nEOF\nexit 1",
            rlhf_core::outcome::OUTCOME_FILE
        ),
    );
    let j = manager(dir.path(), exe, Duration::from_secs(5));
    let r = submit(&j);
    assert!(j.wait_ended(&r.job_id, Duration::from_secs(10)).await);
    let r = j.get(&r.job_id).unwrap();
    assert_eq!(r.state, JobState::Failed);
    assert_eq!(
        r.error,
        "role critic rank 1 died (actor a7, pid 9, node n1): signal 9"
    );
    assert_eq!(r.failure, outcome.failure);
    let p = j.to_proto(&r);
    assert_eq!(
        (
            p.failure_kind.as_str(),
            p.failure_role.as_str(),
            p.failure_rank,
            p.retryable
        ),
        ("actor_died", "critic", 1, true)
    );
}

#[tokio::test]
async fn stop_terms_then_kills_a_driver_that_ignores_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let polite = script(dir.path(), "sleep.sh", "echo started\nsleep 600");
    let j = manager(dir.path(), polite, Duration::from_secs(30));
    let r = submit(&j);
    assert_eq!(r.state, JobState::Running);
    let t = std::time::Instant::now();
    j.stop(&r.job_id, "stopped by user").unwrap();
    assert!(j.wait_ended(&r.job_id, Duration::from_secs(10)).await);
    // SIGTERM was enough: well before the 30 s grace.
    assert!(t.elapsed() < Duration::from_secs(10));
    let r = j.get(&r.job_id).unwrap();
    assert_eq!(r.state, JobState::Stopped);
    assert_eq!(r.error, "stopped by user");
    assert_eq!(r.signal, libc::SIGTERM);

    // Ignores SIGTERM (its sleep inherits the ignored disposition): SIGKILL after grace.
    let stubborn = script(
        dir.path(),
        "stubborn.sh",
        "trap '' TERM\necho started\nwhile true; do sleep 0.1; done",
    );
    let j2 = manager(&dir.path().join("b"), stubborn, Duration::from_millis(300));
    let r = submit(&j2);
    // Let the shell install its trap first.
    for _ in 0..100 {
        if !j2.logs(&r.job_id, 0, 0).unwrap().data.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    j2.stop(&r.job_id, "stopped by user").unwrap();
    assert!(
        !j2.wait_ended(&r.job_id, Duration::from_millis(150)).await,
        "ended before the grace period although it ignores SIGTERM"
    );
    assert!(j2.wait_ended(&r.job_id, Duration::from_secs(10)).await);
    let r = j2.get(&r.job_id).unwrap();
    assert_eq!(r.state, JobState::Stopped);
    assert_eq!(r.signal, libc::SIGKILL);
    // Stopping an ended job changes nothing.
    assert_eq!(
        j2.stop(&r.job_id, "again").unwrap().error,
        "stopped by user"
    );
}

#[tokio::test]
async fn missing_exe_fails_the_job_and_unknown_ids_list_recent_ones() {
    let dir = tempfile::tempdir().unwrap();
    let j = manager(
        dir.path(),
        dir.path().join("no-such-driver"),
        Duration::from_secs(1),
    );
    let e = j.get("job-x").unwrap_err().to_string();
    assert!(e.contains("no jobs"), "{e}");
    let r = submit(&j);
    assert_eq!(r.state, JobState::Failed);
    assert!(
        r.error.contains("cannot start the job driver") && r.error.contains("no-such-driver"),
        "{}",
        r.error
    );
    let e = j.get("job-x").unwrap_err();
    assert_eq!(e.kind(), rlhf_core::FailureKind::NotFound);
    assert!(
        e.to_string().contains("no job 'job-x'") && e.to_string().contains(&r.job_id),
        "{e}"
    );
    let e = j
        .submit(pb::SubmitJobRequest::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("config bundle"), "{e}");
}

fn running_record(id: &str, pid: i32) -> JobRecord {
    JobRecord {
        job_id: id.into(),
        state: JobState::Running,
        config_name: "ppo_tiny".into(),
        overrides: vec![],
        submit_ms: 1,
        start_ms: 2,
        end_ms: 0,
        exit_code: None,
        signal: 0,
        error: String::new(),
        pid,
        metrics_file: String::new(),
        samples_file: String::new(),
        stop_reason: String::new(),
        failure: None,
        seq: 0,
    }
}

#[tokio::test]
async fn drivers_that_outlive_a_head_restart_are_watched_and_stoppable() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    // Stand-ins for drivers of a previous head: the job id is on their command line,
    // as it is on a real driver's, and each leads its own process group.
    let orphan = |id: &str, body: &str| {
        let jd = dir.path().join("state/jobs").join(id);
        std::fs::create_dir_all(&jd).unwrap();
        let log = std::fs::File::create(jd.join(LOG_FILE)).unwrap();
        std::process::Command::new("sh")
            .args(["-c", body, id])
            .current_dir(&jd)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap()
    };
    let stop_id = "job-20260101-000000-stop";
    let fail_id = "job-20260101-000000-fail";
    let mut a = orphan(stop_id, "sleep 600; exit 0");
    let mut b = orphan(
        fail_id,
        "while [ ! -e go ]; do sleep 0.05; done; echo 'error: lost the head' >&2; exit 4",
    );
    {
        let st = Store::open(&dir.path().join("state")).unwrap();
        for (id, pid) in [(stop_id, a.id() as i32), (fail_id, b.id() as i32)] {
            st.put(store::JOBS, id, &running_record(id, pid)).unwrap();
        }
    }
    let j = manager(
        dir.path(),
        PathBuf::from("/bin/true"),
        Duration::from_secs(5),
    );
    assert_eq!(j.get(stop_id).unwrap().state, JobState::Running);
    assert_eq!(j.get(fail_id).unwrap().state, JobState::Running);

    // Reaped here (they are this test's children) so they do not linger as zombies.
    let reap_a = std::thread::spawn(move || a.wait());
    let reap_b = std::thread::spawn(move || b.wait());
    j.stop(stop_id, "stopped by user").unwrap();
    assert!(j.wait_ended(stop_id, Duration::from_secs(10)).await);
    let r = j.get(stop_id).unwrap();
    assert_eq!(
        (r.state, r.error.as_str()),
        (JobState::Stopped, "stopped by user")
    );

    std::fs::write(j.job_dir(fail_id).join("go"), "").unwrap();
    assert!(j.wait_ended(fail_id, Duration::from_secs(10)).await);
    let r = j.get(fail_id).unwrap();
    // Its exit status is unknown to this head; its log says why it failed.
    assert_eq!(
        (r.state, r.error.as_str()),
        (JobState::Failed, "lost the head")
    );
    assert_eq!(r.exit_code, None);
    reap_a.join().unwrap().unwrap();
    assert_eq!(reap_b.join().unwrap().unwrap().code(), Some(4));
}

#[tokio::test]
async fn restart_fails_jobs_whose_driver_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    // A pid that surely ended: a child we reaped.
    let mut c = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = c.id() as i32;
    c.wait().unwrap();
    {
        let st = Store::open(&dir.path().join("state")).unwrap();
        let mut rec = JobRecord {
            job_id: "job-20260101-000000-abcd".into(),
            state: JobState::Running,
            config_name: "ppo_tiny".into(),
            overrides: vec![],
            submit_ms: 1,
            start_ms: 2,
            end_ms: 0,
            exit_code: None,
            signal: 0,
            error: String::new(),
            pid: dead_pid,
            metrics_file: String::new(),
            samples_file: String::new(),
            stop_reason: String::new(),
            failure: None,
            seq: 0,
        };
        st.put(store::JOBS, &rec.job_id, &rec).unwrap();
        rec.job_id = "job-20260101-000000-done".into();
        rec.state = JobState::Succeeded;
        rec.exit_code = Some(0);
        st.put(store::JOBS, &rec.job_id, &rec).unwrap();
    }
    let j = manager(
        dir.path(),
        PathBuf::from("/bin/true"),
        Duration::from_secs(1),
    );
    let r = j.get("job-20260101-000000-abcd").unwrap();
    assert_eq!(r.state, JobState::Failed);
    assert_eq!(r.error, "head restarted");
    assert!(r.end_ms > 0);
    assert_eq!(
        j.get("job-20260101-000000-done").unwrap().state,
        JobState::Succeeded
    );
    assert_eq!(j.list().len(), 2);
    drop(j);
    // The change was persisted.
    let st = Store::open(&dir.path().join("state")).unwrap();
    let recs: Vec<JobRecord> = st.load(store::JOBS).unwrap();
    assert!(recs
        .iter()
        .any(|r| r.state == JobState::Failed && r.error == "head restarted"));
}

#[tokio::test]
async fn jobs_queue_first_in_first_out_and_a_queued_job_stops_without_starting() {
    let dir = tempfile::tempdir().unwrap();
    let exe = script(dir.path(), "slow.sh", "sleep 0.6\necho done");
    let j = queued_manager(dir.path(), exe, Duration::from_secs(5), None, 1);
    let a = submit(&j);
    let b = submit(&j);
    let c = submit(&j);
    assert_eq!(a.state, JobState::Running);
    assert_eq!((b.state, c.state), (JobState::Queued, JobState::Queued));
    assert_eq!((b.pid, c.pid), (0, 0));
    assert_eq!(j.to_proto(&j.get(&b.job_id).unwrap()).queue_position, 1);
    assert_eq!(j.to_proto(&j.get(&c.job_id).unwrap()).queue_position, 2);
    assert_eq!(state_text(&j.to_proto(&c)), "QUEUED (position 2)");
    assert_eq!(j.to_proto(&a).queue_position, 0);

    // A stopped queued job leaves the queue at once; the one behind it moves up.
    let stopped = j.stop(&c.job_id, "not needed").unwrap();
    assert_eq!(stopped.state, JobState::Stopped);
    assert_eq!(stopped.error, "not needed");
    assert!(!j.job_dir(&c.job_id).join(LOG_FILE).exists());

    assert!(j.wait_ended(&a.job_id, Duration::from_secs(10)).await);
    assert!(j.wait_ended(&b.job_id, Duration::from_secs(10)).await);
    let (a, b) = (j.get(&a.job_id).unwrap(), j.get(&b.job_id).unwrap());
    assert_eq!(
        (a.state, b.state),
        (JobState::Succeeded, JobState::Succeeded)
    );
    assert!(
        b.start_ms >= a.end_ms,
        "b started before a ended: {a:?} {b:?}"
    );
    assert_eq!(j.get(&c.job_id).unwrap().pid, 0);
}

#[tokio::test]
async fn queued_and_orphaned_jobs_survive_a_head_restart() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    // A driver of the previous head, still running (its job id on its command line), and a
    // job that head had queued behind it.
    let running = "job-20260101-000000-runs";
    let queued = "job-20260101-000001-waits";
    let jd = dir.path().join("state/jobs").join(running);
    std::fs::create_dir_all(&jd).unwrap();
    let mut driver = std::process::Command::new("sh")
        .args([
            "-c",
            // It records its success, as a real driver does, then exits.
            "while [ ! -e go ]; do sleep 0.05; done; echo '{\"failure\":null}' > outcome.json",
            running,
        ])
        .current_dir(&jd)
        .process_group(0)
        .spawn()
        .unwrap();
    {
        let st = Store::open(&dir.path().join("state")).unwrap();
        st.put(
            store::JOBS,
            running,
            &running_record(running, driver.id() as i32),
        )
        .unwrap();
        // Its directory, as submit made it.
        std::fs::create_dir_all(dir.path().join("state/jobs").join(queued)).unwrap();
        let mut q = running_record(queued, 0);
        (q.state, q.start_ms, q.submit_ms) = (JobState::Queued, 0, 3);
        st.put(store::JOBS, queued, &q).unwrap();
    }
    let exe = script(dir.path(), "ok.sh", "echo done");
    let j = queued_manager(dir.path(), exe, Duration::from_secs(5), None, 1);
    assert_eq!(j.get(running).unwrap().state, JobState::Running);
    let q = j.get(queued).unwrap();
    assert_eq!((q.state, q.pid), (JobState::Queued, 0), "{q:?}");
    assert_eq!(j.to_proto(&q).queue_position, 1);

    std::fs::write(jd.join("go"), "").unwrap();
    let reap = std::thread::spawn(move || driver.wait());
    assert!(j.wait_ended(queued, Duration::from_secs(10)).await);
    reap.join().unwrap().unwrap();
    let q = j.get(queued).unwrap();
    assert_eq!(q.state, JobState::Succeeded, "{q:?}");
    assert!(q.pid > 0 && q.start_ms > 0);
    // The driver of the previous head: no exit status here, its recorded outcome decides.
    let r = j.get(running).unwrap();
    assert_eq!((r.state, r.exit_code), (JobState::Succeeded, None), "{r:?}");
}

#[tokio::test]
async fn ended_jobs_go_after_the_ttl_or_beyond_the_newest_kept() {
    let dir = tempfile::tempdir().unwrap();
    let day = 24 * 3600 * 1000;
    let now = SystemClock.now_ms();
    {
        let st = Store::open(&dir.path().join("state")).unwrap();
        for (id, ended_ago) in [("job-old", 8 * day), ("job-recent", day)] {
            let jd = dir.path().join("state/jobs").join(id);
            std::fs::create_dir_all(&jd).unwrap();
            std::fs::write(jd.join(LOG_FILE), "log").unwrap();
            let mut r = running_record(id, 0);
            (r.state, r.end_ms) = (JobState::Succeeded, now - ended_ago);
            st.put(store::JOBS, id, &r).unwrap();
        }
    }
    let exe = script(dir.path(), "ok.sh", "echo done");
    let j = kept_manager(dir.path(), exe, Duration::from_secs(5), None, 0, 2);
    // A week is the default TTL: the 8-day-old job went with its directory.
    assert!(j.get("job-old").is_err());
    assert!(!j.job_dir("job-old").exists());
    assert_eq!(j.get("job-recent").unwrap().state, JobState::Succeeded);

    // Two kept: the third job to end pushes the oldest ended one out.
    let a = submit(&j);
    assert!(j.wait_ended(&a.job_id, Duration::from_secs(10)).await);
    assert!(j.get("job-recent").is_ok(), "{:?}", j.list());
    let b = submit(&j);
    assert!(j.wait_ended(&b.job_id, Duration::from_secs(10)).await);
    assert!(j.get("job-recent").is_err(), "{:?}", j.list());
    assert!(!j.job_dir("job-recent").exists());
    let ids: Vec<String> = j.list().into_iter().map(|r| r.job_id).collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert!(
        ids.contains(&a.job_id) && ids.contains(&b.job_id),
        "{ids:?}"
    );
}
