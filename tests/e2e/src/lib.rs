//! Helpers for end-to-end tests: find and spawn the real binaries, free ports, one log
//! per child, kill on drop, and polling with deadlines instead of fixed sleeps.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

mod cluster;
pub use cluster::Cluster;

/// Path of a workspace binary as cargo built it: `cargo test --workspace` builds
/// `rlhf-head` and `rlhf-worker` before any test runs (each has integration tests of its
/// own, for which cargo builds the package's binaries), with the features the whole
/// workspace unifies to. Tests never run cargo themselves: a nested `cargo build -p ...`
/// resolves features for a different package set and recompiles a dozen crates.
///
/// Panics with the command to run when the binary is missing or older than one of its sources
/// (e.g. after `cargo test -p rlhf-e2e` alone, which does not rebuild other packages).
pub fn bin(name: &str) -> PathBuf {
    // tests run from target/<profile>/deps/<test-binary>, examples from
    // target/<profile>/examples/<example>
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf();
    let path = dir.join(name);
    let release = if cfg!(debug_assertions) {
        ""
    } else {
        " --release"
    };
    let fix = format!(
        "run `cargo test{release} --workspace` (it builds every binary first) or \
         `cargo build{release} --workspace --bins`"
    );
    let built = match std::fs::metadata(&path).and_then(|m| m.modified()) {
        Ok(t) => t,
        Err(_) => panic!("{} does not exist: {fix}", path.display()),
    };
    // Cargo's dep-info file beside the binary lists every source it was built from.
    if let Some(src) = newer_source(&path.with_extension("d"), built) {
        panic!("{} is older than {}: {fix}", path.display(), src.display());
    }
    path
}

/// A source listed in a dep-info file (`target: a.rs b.rs ...`, spaces escaped) that was
/// modified after `built`.
fn newer_source(dep_info: &Path, built: std::time::SystemTime) -> Option<PathBuf> {
    let text = std::fs::read_to_string(dep_info).ok()?;
    let first = text.lines().next()?;
    let (_, deps) = first.split_once(": ")?;
    let mut cur = String::new();
    let mut files = Vec::new();
    let mut chars = deps.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&' ') => {
                cur.push(' ');
                chars.next();
            }
            ' ' => files.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    files.push(cur);
    files
        .into_iter()
        .filter(|f| !f.is_empty())
        .map(PathBuf::from)
        .find(|f| {
            std::fs::metadata(f)
                .and_then(|m| m.modified())
                .is_ok_and(|t| t > built)
        })
}

/// The repository root (configs, models and data paths resolve against it).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The overrides that put a job's checkpoints, metrics and samples under `out`
/// (`ckpt/`, `metrics.jsonl`, `samples.jsonl`).
pub fn output_overrides(out: &Path) -> [String; 4] {
    [
        format!("checkpoint.dir={}", out.join("ckpt").display()),
        format!("logging.ledger_file={}", out.join("ledger.jsonl").display()),
        format!(
            "logging.metrics_file={}",
            out.join("metrics.jsonl").display()
        ),
        format!(
            "logging.samples_file={}",
            out.join("samples.jsonl").display()
        ),
    ]
}

/// `rlhf-head run --config-name ppo_tiny` from the repository, embedded head and worker, with
/// the checkpoints, metrics and samples under `out`, then the `extra` overrides.
pub fn ppo_run_cmd(out: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(bin("rlhf-head"));
    cmd.current_dir(repo_root())
        .args(["run", "--config-name", "ppo_tiny"])
        .args(output_overrides(out))
        .args(extra)
        .env_remove("RLHF_TOKEN")
        .env("RUST_LOG", "warn");
    cmd
}

/// A free port P whose neighbour P + 1 is free too (a script that puts the dashboard on
/// the next port): both are bound at once before they are let go, so neither is an
/// ephemeral port some connection holds at that moment.
pub fn free_port_pair() -> u16 {
    for _ in 0..100 {
        let Ok(a) = std::net::TcpListener::bind("127.0.0.1:0") else {
            continue;
        };
        let Ok(p) = a.local_addr().map(|x| x.port()) else {
            continue;
        };
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no pair of free ports on 127.0.0.1 in 100 tries")
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A child process with its own log file, killed (SIGKILL) and reaped on drop.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, log_dir: &Path, cmd: &mut Command) -> Result<Proc> {
        let log = log_dir.join(format!("{name}.out"));
        let f = std::fs::File::create(&log)?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()
            .with_context(|| format!("spawning {name}"))?;
        Ok(Proc {
            name: name.into(),
            child,
            log,
        })
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig);
    }

    /// Waits for the process to exit; returns its status.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait()? {
                return Ok(st);
            }
            if start.elapsed() > timeout {
                bail!(
                    "{} did not exit within {timeout:?}; output:\n{}",
                    self.name,
                    self.output()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether a process with this pid still exists (zombies count as gone).
pub fn pid_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit(')')
            .next()
            .map(|r| r.trim_start().starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// The children of `parent` with their command lines (role processes are children of the
/// embedded worker, i.e. of the `run` process itself).
pub fn children_of(parent: i32) -> Vec<(i32, String)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|s| s.parse::<i32>().ok());
        if ppid == Some(parent) {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            out.push((pid, String::from_utf8_lossy(&cmdline).replace('\0', " ")));
        }
    }
    out
}

/// The first child of `parent` whose command line contains `needle`.
pub fn child_with(parent: i32, needle: &str) -> Option<i32> {
    children_of(parent)
        .into_iter()
        .find(|(_, c)| c.contains(needle))
        .map(|(pid, _)| pid)
}

/// Whether process `pid` has a file open whose link target contains `needle` (a memfd shows
/// as `/memfd:NAME (deleted)`).
pub fn holds_file(pid: i32, needle: &str) -> bool {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    dir.flatten()
        .any(|e| std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().contains(needle)))
}

/// Polls `f` until it returns Some, or fails after `timeout` with `what` and the last value.
pub fn wait_for<T>(
    timeout: Duration,
    what: &str,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let start = Instant::now();
    let mut last_err = String::new();
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = format!("{e:#}"),
        }
        if start.elapsed() > timeout {
            bail!("timed out after {timeout:?} waiting for {what} {last_err}");
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Waits until the run `p` has logged `n` steps to `metrics_file` (one JSON line each); fails
/// at once, with its output, if the run ends first, and after `timeout` otherwise.
pub fn wait_steps(p: &mut Proc, metrics_file: &Path, n: usize, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    loop {
        if let Some(st) = p.child.try_wait()? {
            bail!("run ended before {n} steps ({st}): {}", p.output());
        }
        let done = std::fs::read_to_string(metrics_file).map_or(0, |t| t.lines().count());
        if done >= n {
            return Ok(());
        }
        if start.elapsed() > timeout {
            bail!("{done} of {n} steps after {timeout:?}: {}", p.output());
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Reports a test that cannot run on this machine: prints `SKIPPED <test>: <reason>` and
/// leaves the reason in `<tmp_dir>/skipped/<test>`, where CI lists run-time skips (a passing
/// test's output is captured). `tmp_dir` is the calling test's `env!("CARGO_TARGET_TMPDIR")`.
pub fn skip(tmp_dir: &str, test: &str, reason: &str) {
    eprintln!("SKIPPED {test}: {reason}");
    let dir = Path::new(tmp_dir).join("skipped");
    let file = dir.join(test);
    let record = || -> std::io::Result<()> {
        std::fs::create_dir_all(&dir)?;
        std::fs::write(&file, reason)
    };
    if let Err(e) = record() {
        eprintln!("could not record the skip in {}: {e}", file.display());
    }
}

/// A fresh CA: its certificate (PEM) and the issuer that signs with it.
pub fn make_ca() -> Result<(String, rcgen::Issuer<'static, rcgen::KeyPair>)> {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), Issuer::new(params, key)))
}

/// A CA, and a certificate for localhost and 127.0.0.1 signed by it, as PEM files in `dir`:
/// (certificate, key, CA).
pub fn node_cert(dir: &Path) -> Result<(PathBuf, PathBuf, PathBuf)> {
    let (ca_pem, issuer) = make_ca()?;
    let key = rcgen::KeyPair::generate()?;
    let params =
        rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])?;
    let cert = params.signed_by(&key, &issuer)?;
    let (cert_p, key_p, ca_p) = (
        dir.join("node.crt"),
        dir.join("node.key"),
        dir.join("ca.crt"),
    );
    std::fs::write(&cert_p, cert.pem())?;
    std::fs::write(&key_p, key.serialize_pem())?;
    std::fs::write(&ca_p, &ca_pem)?;
    Ok((cert_p, key_p, ca_p))
}

/// Every file under `dir`, recursively.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(files_under(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// How many `.log` files under `dir` contain `line`.
pub fn logs_saying(dir: &Path, line: &str) -> usize {
    files_under(dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .filter(|p| std::fs::read_to_string(p).is_ok_and(|t| t.contains(line)))
        .count()
}

/// Nodes in state ALIVE in a `status --format json` document.
pub fn count_alive(status: &Value) -> usize {
    status["nodes"]
        .as_array()
        .map(|a| a.iter().filter(|n| n["state"] == "ALIVE").count())
        .unwrap_or(0)
}

/// Seconds to push `src` through one loopback TCP connection to a reading thread that
/// collects it into one buffer: the baseline the transfer benches compare against (what a
/// receiver of a whole batch must do at least).
pub fn raw_tcp_copy(src: &[u8]) -> Result<f64> {
    let bytes = src.len();
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let srv = std::thread::spawn(move || -> std::io::Result<Vec<u8>> {
        let (mut s, _) = l.accept()?;
        let mut out = Vec::with_capacity(bytes);
        s.read_to_end(&mut out)?;
        Ok(out)
    });
    let t = Instant::now();
    let mut c = std::net::TcpStream::connect(addr)?;
    c.write_all(src)?;
    drop(c);
    let got = srv
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))??;
    let s = t.elapsed().as_secs_f64();
    anyhow::ensure!(got.len() == bytes, "short copy");
    Ok(s)
}

/// The JSON objects of a JSONL file (metrics, samples), one per line.
pub fn jsonl(path: &Path) -> Result<Vec<Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines().map(|l| Ok(serde_json::from_str(l)?)).collect()
}

/// A step's metrics to compare between runs: everything but wall-clock numbers.
pub fn comparable(m: &Value) -> Vec<(String, f64)> {
    m.as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| {
            !k.starts_with("timing_s/")
                && !k.starts_with("perf/throughput")
                && !k.starts_with("perf/weight_sync_s")
                && !k.ends_with("/tokens_per_s")
                && !k.starts_with("perf/rollout_tokens_per_s")
        })
        .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
        .collect()
}

/// The role of each actor process in a `status` answer, sorted (processes that serve no
/// role are left out): one entry per process.
pub fn actor_roles(status: &Value) -> Vec<String> {
    let mut roles: Vec<String> = status["actors"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a["role"].as_str())
        .filter(|r| !r.is_empty())
        .map(str::to_string)
        .collect();
    roles.sort_unstable();
    roles
}

/// Two runs logged the same steps with the same numbers (wall-clock ones aside): what a
/// resumed run must show against a straight one.
pub fn assert_same_steps(straight: &[Value], resumed: &[Value]) {
    assert_eq!(
        straight.len(),
        resumed.len(),
        "both runs log every step once"
    );
    for (x, y) in straight.iter().zip(resumed) {
        let (cx, cy) = (comparable(x), comparable(y));
        assert_eq!(
            cx.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            cy.iter().map(|(k, _)| k).collect::<Vec<_>>()
        );
        for ((k, u), (_, v)) in cx.iter().zip(&cy) {
            let tol = 1e-4 * (1.0 + u.abs());
            assert!(
                (u - v).abs() <= tol,
                "step {}: {k} straight {u} vs resumed {v}",
                x["step"]
            );
        }
    }
}

/// Waits for `p` to exit and fails with its output unless it succeeded.
pub fn wait_success(p: &mut Proc, timeout: Duration) -> Result<()> {
    let st = p.wait_exit(timeout)?;
    if !st.success() {
        bail!("{} failed ({st}):\n{}", p.name, p.output());
    }
    Ok(())
}
