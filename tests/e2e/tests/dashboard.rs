//! The dashboard in a real browser: a head and a worker as real processes run a submitted
//! ppo_tiny job, and headless Chromium (the OS package, driven from here through its command
//! line) opens the job's page while it runs. The page must load with the token handed over
//! in the address's fragment, draw its plots with points, show the sample table and the
//! job's roles with their memory, and log nothing to the console (the page itself never
//! logs, so any console line is an error: a script error, a refused resource). A screenshot
//! is kept under the test's target directory (`artifacts/dashboard-job.png`). The same run
//! checks Prometheus's `/metrics` on the head.
//!
//! Without Chromium the test records a skip, unless `RLHF_REQUIRE_BROWSER=1` (CI) makes that
//! a failure.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rlhf_e2e::{wait_for, Cluster};

fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("RLHF_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

/// Runs headless Chromium on `url` with `mode` (`--dump-dom`, `--screenshot=...`), letting
/// the page's scripts run for `budget_ms` of virtual time; stdout and the browser's log.
fn browse(
    exe: &Path,
    profile: &Path,
    url: &str,
    mode: &str,
    budget_ms: u32,
) -> Result<(String, String)> {
    let mut child = Command::new(exe)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--window-size=1300,2200",
            "--enable-logging=stderr",
            "--v=0",
            &format!("--virtual-time-budget={budget_ms}"),
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(mode)
        .arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    let mut out = child.stdout.take().context("stdout")?;
    let mut err = child.stderr.take().context("stderr")?;
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("chromium did not finish {mode} of {url} within 90 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = reader.join().unwrap_or_default();
    let log = err_reader.join().unwrap_or_default();
    Ok((out, log))
}

/// One HTTP/1.1 GET on loopback: status code and body.
fn http_get(addr: &str, path: &str, token: Option<&str>) -> Result<(u16, String)> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n"
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").context("no HTTP header end")?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no status code")?;
    Ok((code, body.to_string()))
}

/// Values of `attr="..."` in `html`.
fn attrs<'a>(html: &'a str, attr: &str) -> Vec<&'a str> {
    let key = format!("{attr}=\"");
    html.split(key.as_str())
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .collect()
}

#[test]
fn job_page_in_a_real_browser_and_prometheus_metrics() -> Result<()> {
    let Some(exe) = chromium() else {
        let reason = "no Chromium (install the chromium package, or set RLHF_CHROMIUM)";
        if std::env::var("RLHF_REQUIRE_BROWSER").is_ok_and(|v| v == "1") {
            bail!("{reason}, and RLHF_REQUIRE_BROWSER=1");
        }
        rlhf_e2e::skip(env!("CARGO_TARGET_TMPDIR"), "dashboard_browser", reason);
        return Ok(());
    };
    let mut c = Cluster::start(&[])?;
    c.add_worker(r#"{"CPU": 4}"#)?;
    c.wait_alive_nodes(1, Duration::from_secs(30))?;
    let out = c.dir.path().join("out");
    std::fs::create_dir_all(&out)?;
    let id = c.submit_ppo_tiny(
        &out,
        &[
            "training.train_iters=400".into(),
            "logging.sample_every=2".into(),
        ],
    )?;
    let metrics_file = out.join("metrics.jsonl");
    wait_for(Duration::from_secs(300), "4 steps logged", || {
        let n = std::fs::read_to_string(&metrics_file)
            .map(|s| s.lines().count())
            .unwrap_or(0);
        Ok((n >= 4).then_some(()))
    })?;
    let info: serde_json::Value =
        serde_json::from_slice(&std::fs::read(c.state_dir().join("head.json"))?)?;
    let base = info["dashboard"]
        .as_str()
        .context("head.json names no dashboard")?
        .to_string();
    let addr = base.trim_start_matches("http://").to_string();
    let token = c.token()?;
    // The workers sample their actors' memory every 5 s.
    wait_for(
        Duration::from_secs(30),
        "memory samples of the roles",
        || {
            let s = c.status()?;
            let sampled = s["actors"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x["rss_bytes"].as_u64().unwrap_or(0) > 0));
            Ok(sampled.then_some(()))
        },
    )?;

    let profile = tempfile::tempdir()?;
    let url = format!("{base}/jobs/{id}#token={token}");
    let (dom, log) = browse(&exe, profile.path(), &url, "--dump-dom", 8000)?;
    let console: Vec<&str> = log.lines().filter(|l| l.contains(":CONSOLE")).collect();
    assert!(
        console.is_empty(),
        "console messages: {console:#?}\nDOM: {dom}"
    );
    assert!(dom.contains(&format!("job {id}")), "{dom}");
    assert!(attrs(&dom, "data-state").contains(&"RUNNING"), "{dom}");
    let points: Vec<usize> = attrs(&dom, "data-points")
        .iter()
        .filter_map(|p| p.parse().ok())
        .collect();
    assert!(points.len() >= 6, "plots: {points:?}\n{dom}");
    assert!(
        points.iter().all(|p| *p >= 4),
        "points per plot: {points:?}"
    );
    let blobs = attrs(&dom, "src")
        .iter()
        .filter(|s| s.starts_with("blob:"))
        .count();
    assert_eq!(blobs, points.len(), "every plot shows its image: {dom}");
    assert!(dom.contains("Samples (step"), "{dom}");
    for role in ["actor_rollout", "critic", "ref"] {
        assert!(dom.contains(role), "roles table lacks {role}: {dom}");
    }
    assert!(dom.contains(" GiB<"), "memory column: {dom}");
    // The cluster page in human units: slots used/total, memory in GiB, no raw JSON.
    let (cluster, _) = browse(
        &exe,
        profile.path(),
        &format!("{base}/#token={token}"),
        "--dump-dom",
        8000,
    )?;
    assert!(
        cluster.contains("CPU 4/4") && cluster.contains(" GiB"),
        "node usage in human units: {cluster}"
    );
    assert!(
        !cluster.contains("{\"CPU\""),
        "raw JSON on the cluster page: {cluster}"
    );
    assert!(
        !dom.contains(&token),
        "the token must not end up in the page: {dom}"
    );

    // Without the token the page says what it needs instead of showing data.
    let profile2 = tempfile::tempdir()?;
    let (dom2, _) = browse(
        &exe,
        profile2.path(),
        &format!("{base}/jobs/{id}"),
        "--dump-dom",
        3000,
    )?;
    assert!(dom2.contains("needs the cluster token"), "{dom2}");
    assert!(attrs(&dom2, "data-points").is_empty(), "{dom2}");

    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("artifacts");
    std::fs::create_dir_all(&shots)?;
    let png = shots.join("dashboard-job.png");
    let _ = std::fs::remove_file(&png);
    browse(
        &exe,
        profile.path(),
        &url,
        &format!("--screenshot={}", png.display()),
        8000,
    )?;
    let size = std::fs::metadata(&png).map(|m| m.len()).unwrap_or(0);
    assert!(
        size > 20_000,
        "screenshot {} is {size} bytes",
        png.display()
    );

    // Prometheus on the same port.
    let (code, public) = http_get(&addr, "/metrics", None)?;
    assert_eq!(code, 200, "{public}");
    assert!(public.contains("rlhf_nodes{state=\"ALIVE\"} 1"), "{public}");
    assert!(
        public.contains("rlhf_jobs{state=\"RUNNING\"} 1"),
        "{public}"
    );
    assert!(
        !public.contains(&id),
        "job metrics need the token: {public}"
    );
    let (code, full) = http_get(&addr, "/metrics", Some(&token))?;
    assert_eq!(code, 200);
    assert!(
        full.contains(&format!(
            "rlhf_job_metric{{job=\"{id}\",metric=\"objective/scores\"}}"
        )),
        "{full}"
    );
    assert!(
        full.contains("rlhf_rpc_duration_seconds_count{method=\"SubmitJob\",code=\"0\"} 1"),
        "{full}"
    );
    assert!(full.contains("method=\"ReportActorUsage\""), "{full}");
    let (code, _) = http_get(&addr, "/metrics", Some("wrong"))?;
    assert_eq!(code, 401);

    // Done: stop the job rather than run it out.
    let stopped = Command::new(rlhf_e2e::bin("rlhf-head"))
        .args(["job", "stop", &id, "--address", &c.address()])
        .arg("--token-file")
        .arg(c.token_file())
        .env_remove("RLHF_TOKEN")
        .output()?;
    assert!(
        stopped.status.success(),
        "{}",
        String::from_utf8_lossy(&stopped.stderr)
    );
    Ok(())
}
