//! vLLM as a rollout engine: a `vllm` OpenAI-compatible server run as a child of the role
//! process, spoken to token in and token out (prompts as ids, responses as ids with their
//! sampling log-probs; text is never re-tokenized), its weights replaced in place after an
//! update (pause, `reload_weights` from a directory of safetensors, resume).
//!
//! The server and every process it starts live in a process group of their own. Dropping
//! the [`VllmServer`] ends the group (SIGTERM, then SIGKILL); if the role process dies
//! instead, a guardian shell it started with a parent-death signal does it: vLLM's engine
//! processes do not die with its API server (seen with vLLM 0.32), so a parent-death
//! signal on the server alone would leave them running. The server listens on a Unix socket
//! in a directory only this user can enter (see `http.rs` for why not a TCP port).

mod api;
mod http;
pub mod rollout;

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::error::{Error, Result};

/// The name the server gives the model it serves.
const SERVED_NAME: &str = "rollout";
/// Lines of the server's output kept for error messages.
const TAIL_LINES: usize = 200;

/// Where vLLM runs: its CPU build needs eager mode and a KV cache size in GiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VllmDevice {
    Cpu,
    Cuda,
}

/// How to start a vLLM server for one rollout rank.
#[derive(Debug, Clone)]
pub struct VllmSettings {
    /// The interpreter that has vLLM (the worker's `--vllm-python`).
    pub python: PathBuf,
    /// An HF model directory.
    pub model_dir: PathBuf,
    pub device: VllmDevice,
    /// `float32`, `bfloat16` or `float16`.
    pub dtype: String,
    /// Prompt plus response tokens.
    pub max_model_len: usize,
    /// KV cache of the CPU build, in whole GiB (`VLLM_CPU_KVCACHE_SPACE`).
    pub kv_cache_gb: u32,
    /// Share of the device's memory vLLM may take (GPU; the CPU build checks it too).
    pub gpu_memory_utilization: f64,
    pub max_num_seqs: usize,
    pub enable_prefix_caching: bool,
    /// Further engine arguments, validated by the config.
    pub extra_args: Vec<String>,
    /// Bound on start-up (loading, and the first compile on the CPU).
    pub start_timeout: Duration,
    /// Bound on one generation request.
    pub request_timeout: Duration,
    /// The tokenizer's vocabulary size: response ids at or above it are refused.
    pub vocab_size: usize,
}

/// A running vLLM server, owned by one rollout rank.
pub struct VllmServer {
    child: Child,
    guardian: Option<Child>,
    dir: PathBuf,
    socket: PathBuf,
    api_key: String,
    tail: Arc<Mutex<VecDeque<String>>>,
    settings: VllmSettings,
}

/// A directory only this user can enter, for the socket and the weights of a reload.
fn private_dir() -> Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    for n in 0..1000u32 {
        let d = base.join(format!("rlhf-vllm-{}-{n}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&d) {
            Ok(()) => return Ok(d),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(Error::internal(format!(
                    "creating a private directory for vLLM under {}: {e}",
                    base.display()
                )))
            }
        }
    }
    Err(Error::internal(format!(
        "no free name for a vLLM directory under {}",
        base.display()
    )))
}

/// The JSON of a 200 answer to `what` (a path, or what the request was for); any other
/// status is a refusal carrying vLLM's own message.
fn json_answer(a: &http::Answer, what: &str) -> Result<Value> {
    let text = String::from_utf8_lossy(&a.body);
    if a.status != 200 {
        let shown: String = text.chars().take(1000).collect();
        return Err(Error::invalid(format!(
            "vLLM refused {what} (HTTP {}): {shown}",
            a.status
        )));
    }
    serde_json::from_str(&text)
        .map_err(|e| Error::internal(format!("vLLM {what}: an answer that is not JSON ({e})")))
}

/// Copies a child's output lines to this process's stderr (the role's log) and keeps the
/// last ones for error messages.
fn forward(stream: impl std::io::Read + Send + 'static, tail: Arc<Mutex<VecDeque<String>>>) {
    std::thread::spawn(move || {
        for line in BufReader::new(stream)
            .lines()
            .map_while(std::result::Result::ok)
        {
            eprintln!("vllm: {line}");
            let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
            if t.len() == TAIL_LINES {
                t.pop_front();
            }
            t.push_back(line);
        }
    });
}

impl VllmServer {
    /// Starts the server and waits until it answers `/health`, within `start_timeout`. The
    /// error of a server that exits or never gets healthy carries its last lines (a model
    /// it refuses, a missing module).
    ///
    /// Call it from a thread that lives as long as the server (a role's compute thread):
    /// the kernel's parent-death signal follows the thread that started a child, so a
    /// short-lived thread would take vLLM with it when it ends.
    pub fn start(settings: &VllmSettings) -> Result<Self> {
        let s = settings;
        if !s.python.is_file() {
            return Err(Error::invalid(format!(
                "the vLLM Python {} does not exist: give the worker --vllm-python (or \
                 RLHF_VLLM_PYTHON) with an interpreter that has vLLM installed",
                s.python.display()
            )));
        }
        let dir = private_dir()?;
        let socket = dir.join("api.sock");
        // A fresh 256-bit secret, as a cluster token is made.
        let api_key = rlhf_runtime::auth::generate_token();
        let mut cmd = Command::new(&s.python);
        cmd.args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&s.model_dir)
            .args(["--served-model-name", SERVED_NAME, "--uds"])
            .arg(&socket)
            .args(["--api-key", &api_key, "--dtype", &s.dtype])
            .args(["--max-model-len", &s.max_model_len.to_string()])
            .args(["--max-num-seqs", &s.max_num_seqs.to_string()])
            .args([
                "--gpu-memory-utilization",
                &s.gpu_memory_utilization.to_string(),
            ])
            // The log-probs of the distribution sampled from (after the temperature), which
            // is what the trainer recomputes; vLLM's default is the raw logits' softmax.
            .args(["--logprobs-mode", "processed_logprobs"])
            .arg(if s.enable_prefix_caching {
                "--enable-prefix-caching"
            } else {
                "--no-enable-prefix-caching"
            })
            .args(["--disable-uvicorn-access-log"])
            // Sampling exactly as asked: by default vLLM also applies the model's
            // generation_config.json (a repetition penalty, say), which the trainer's
            // log-probs do not.
            .args(["--generation-config", "vllm"])
            .args(&s.extra_args)
            // /pause, /resume and /collective_rpc exist only in its development mode; the
            // socket's directory is what keeps others away from them.
            .env("VLLM_SERVER_DEV_MODE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if s.device == VllmDevice::Cpu {
            // A prompt whose prefill is split over two engine steps, in a request with a
            // seed (all of ours), makes vLLM 0.32's CPU runner rewind its random generator,
            // which the CPU generator cannot: the engine dies ("CPU Generator does not use
            // offset"). Whole prefills avoid that path.
            if !s.extra_args.iter().any(|a| a.contains("chunked-prefill")) {
                cmd.arg("--no-enable-chunked-prefill");
            }
            cmd.arg("--enforce-eager")
                .env("VLLM_CPU_KVCACHE_SPACE", s.kv_cache_gb.max(1).to_string());
        }
        // SAFETY: setpgid and prctl are async-signal-safe and change only the child's own
        // state: its own process group (so the whole tree can be ended at once) and a
        // SIGKILL when the thread that started it dies.
        unsafe {
            cmd.pre_exec(|| {
                libc::setpgid(0, 0);
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| {
            let _ = std::fs::remove_dir_all(&dir);
            Error::invalid(format!(
                "starting vLLM with {}: {e}; check the worker's --vllm-python",
                s.python.display()
            ))
        })?;
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(out) = child.stdout.take() {
            forward(out, Arc::clone(&tail));
        }
        if let Some(err) = child.stderr.take() {
            forward(err, Arc::clone(&tail));
        }
        let guardian = guard_group(child.id() as i32, &dir);
        let mut server = Self {
            child,
            guardian,
            dir,
            socket,
            api_key,
            tail,
            settings: s.clone(),
        };
        server.wait_healthy()?;
        Ok(server)
    }

    /// Posts JSON and returns the JSON answer; a refusal carries vLLM's own message, and a
    /// server error (5xx, whose body only says "see the stack trace") the error lines of the
    /// server's output.
    fn answer(&self, a: &http::Answer, what: &str) -> Result<Value> {
        json_answer(a, what).map_err(|e| {
            if a.status >= 500 {
                e.context(format!("vLLM's output says:\n  {}", self.error_lines()))
            } else {
                e
            }
        })
    }

    /// The error lines among the server's last output lines (its exceptions), else its last
    /// lines.
    fn error_lines(&self) -> String {
        let t = self.tail.lock().unwrap_or_else(|e| e.into_inner());
        let errs: Vec<&str> = t
            .iter()
            .filter(|l| l.contains("Error:") || l.contains("Exception:"))
            .map(|l| l.as_str())
            .collect();
        if errs.is_empty() {
            drop(t);
            return self.last_lines();
        }
        let from = errs.len().saturating_sub(4);
        errs[from..]
            .iter()
            .map(|l| l.chars().take(600).collect::<String>())
            .collect::<Vec<_>>()
            .join("\n  ")
    }

    /// The server's last output lines, for an error message.
    fn last_lines(&self) -> String {
        let t = self.tail.lock().unwrap_or_else(|e| e.into_inner());
        let lines: Vec<&str> = t.iter().rev().take(12).rev().map(String::as_str).collect();
        if lines.is_empty() {
            "(it printed nothing)".into()
        } else {
            lines.join("\n  ")
        }
    }

    fn wait_healthy(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.settings.start_timeout;
        loop {
            if let Some(st) = self
                .child
                .try_wait()
                .map_err(|e| Error::internal(e.to_string()))?
            {
                // Give the output threads a moment to catch the last lines.
                std::thread::sleep(Duration::from_millis(200));
                return Err(Error::invalid(format!(
                    "vLLM exited during start-up ({st}) serving {}; its last lines:\n  {}",
                    self.settings.model_dir.display(),
                    self.last_lines()
                )));
            }
            if self.socket.exists() {
                if let Ok(a) = self.call("GET", "/health", None, Duration::from_secs(5)) {
                    if a.status == 200 {
                        return Ok(());
                    }
                }
            }
            if Instant::now() >= deadline {
                let e = Error::internal(format!(
                    "vLLM did not answer /health within {:?} (actor_rollout.vllm start-up); \
                     its last lines:\n  {}",
                    self.settings.start_timeout,
                    self.last_lines()
                ));
                self.stop();
                return Err(e);
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        within: Duration,
    ) -> Result<http::Answer> {
        let bytes = body.map(|b| b.to_string().into_bytes());
        http::request(
            &self.socket,
            method,
            path,
            &self.api_key,
            bytes.as_deref(),
            within,
        )
    }

    /// A failed exchange, said as the server's death (with its last lines) when it died.
    fn explain(&mut self, e: Error) -> Error {
        match self.child.try_wait() {
            Ok(Some(st)) => Error::internal(format!(
                "the vLLM server died ({st}); its last lines:\n  {}",
                self.last_lines()
            )),
            _ => e,
        }
    }

    /// Posts JSON and returns the JSON answer; a refusal carries vLLM's own message.
    fn post(&mut self, path: &str, body: &Value, within: Duration) -> Result<Value> {
        let a = self
            .call("POST", path, Some(body), within)
            .map_err(|e| self.explain(e))?;
        self.answer(&a, path)
    }

    /// The server's process id (its process group's id too).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the server answers `/health` (within 5 s): vLLM says 503 there once its
    /// engine processes died, while its API server goes on answering.
    pub fn healthy(&self) -> bool {
        self.call("GET", "/health", None, Duration::from_secs(5))
            .is_ok_and(|a| a.status == 200)
    }

    /// Whether the server still runs.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Ends the server's whole process group: SIGTERM, up to 10 s, then SIGKILL.
    pub fn stop(&mut self) {
        let pg = self.child.id() as i32;
        // SAFETY: kill with a negative pid signals the group this server leads; it made its
        // own group at start, so no other process is in it.
        unsafe { libc::kill(-pg, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && group_alive(pg) {
            let _ = self.child.try_wait();
            std::thread::sleep(Duration::from_millis(100));
        }
        // SAFETY: as above.
        unsafe { libc::kill(-pg, libc::SIGKILL) };
        let _ = self.child.wait();
        if let Some(mut g) = self.guardian.take() {
            let _ = g.kill();
            let _ = g.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for VllmServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether any process of group `pg` is left (zombies of reaped children do not count once
/// reaped).
fn group_alive(pg: i32) -> bool {
    // SAFETY: signal 0 only checks that the group exists and may be signalled.
    unsafe { libc::kill(-pg, 0) == 0 }
}

/// Starts a shell that ends process group `pg` when this process dies: it gets SIGTERM from
/// the kernel then (a parent-death signal) and SIGKILLs the group; it also ends by itself
/// once the group is gone. `None` (with a warning) if it cannot start.
fn guard_group(pg: i32, dir: &Path) -> Option<Child> {
    let parent = std::process::id() as i32;
    // `kill -9 -PG` and `kill -0 -PG` are the spellings every POSIX shell takes (dash
    // refuses `--` and `-s KILL` before a negative pid). The private directory (weights of
    // a reload, in shared memory) goes with the group. The path is passed as an argument,
    // never pasted into the script.
    let script = format!(
        "trap 'kill -9 -{pg} 2>/dev/null; rm -rf \"$0\"; exit 0' TERM; \
         while kill -0 -{pg} 2>/dev/null; do sleep 1; done; rm -rf \"$0\""
    );
    let mut cmd = Command::new("/bin/sh");
    cmd.args(["-c", &script]).arg(dir).stdin(Stdio::null());
    // SAFETY: prctl, getppid, kill and _exit are async-signal-safe. If this process died
    // before the prctl took effect, the parent is already another one: end the group now.
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            if libc::getppid() != parent {
                libc::kill(-pg, libc::SIGKILL);
                libc::_exit(0);
            }
            Ok(())
        });
    }
    match cmd.spawn() {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!(
                "cannot start the guardian of the vLLM server (its processes may outlive a killed role process): {e}"
            );
            None
        }
    }
}
