//! A head and its workers on loopback in a private state directory, for the end-to-end
//! tests: start and restart the head, add workers, submit and watch jobs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::*;

/// A head (and workers) on loopback, in a private state directory.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub port: u16,
    pub head: Option<Proc>,
    pub workers: Vec<Proc>,
    pub head_args: Vec<String>,
}

impl Cluster {
    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }
    pub fn token_file(&self) -> PathBuf {
        self.state_dir().join("token")
    }
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `rlhf-head run --address <this cluster> --config-name ppo_tiny` from the repository,
    /// with its token file, checkpoints, metrics and samples under `out`, then `extra`.
    pub fn ppo_run_cmd(&self, out: &Path, extra: &[&str]) -> Command {
        let mut cmd = ppo_run_cmd(out, extra);
        cmd.args(["--address", &self.address()])
            .arg("--token-file")
            .arg(self.token_file());
        cmd
    }

    /// `rlhf-head submit --config-name ppo_tiny` from the repository with every output under
    /// `out` and then `overrides`; returns the job id.
    pub fn submit_ppo_tiny(&self, out: &Path, overrides: &[String]) -> Result<String> {
        let res = Command::new(bin("rlhf-head"))
            .args(["submit", "--config-name", "ppo_tiny"])
            .args(overrides)
            .args(output_overrides(out))
            .args(["--address", &self.address(), "--connect-timeout", "5"])
            .arg("--token-file")
            .arg(self.token_file())
            .current_dir(std::fs::canonicalize(repo_root())?)
            .env_remove("RLHF_TOKEN")
            .output()?;
        let text = String::from_utf8_lossy(&res.stdout);
        if !res.status.success() {
            bail!(
                "submit failed ({}): {text}{}",
                res.status,
                String::from_utf8_lossy(&res.stderr)
            );
        }
        Ok(text
            .split_whitespace()
            .find(|w| w.starts_with("job-"))
            .with_context(|| format!("no job id in: {text}"))?
            .to_string())
    }

    /// Starts a head on a free port with the given extra flags and waits until it serves.
    pub fn start(head_args: &[&str]) -> Result<Cluster> {
        let dir = tempfile::tempdir()?;
        let mut c = Cluster {
            dir,
            port: free_port(),
            head: None,
            workers: Vec::new(),
            head_args: head_args.iter().map(|s| s.to_string()).collect(),
        };
        c.start_head()?;
        Ok(c)
    }

    pub fn start_head(&mut self) -> Result<()> {
        let info = self.state_dir().join("head.json");
        let _ = std::fs::remove_file(&info);
        let n = self.workers.len();
        let mut cmd = Command::new(bin("rlhf-head"));
        cmd.args([
            "start",
            "--port",
            &self.port.to_string(),
            "--host",
            "127.0.0.1",
            "--dashboard-port",
            "0",
        ])
        .arg("--state-dir")
        .arg(self.state_dir())
        .args(&self.head_args)
        .env_remove("RLHF_TOKEN")
        .env("RUST_LOG", "info");
        let p = Proc::spawn(
            &format!("head-{n}-{}", free_port()),
            self.dir.path(),
            &mut cmd,
        )?;
        self.head = Some(p);
        let head = self.head.as_mut().expect("just set");
        wait_for(Duration::from_secs(20), "head.json", || {
            if let Some(st) = head.child.try_wait()? {
                bail!("head exited early ({st}): {}", head.output());
            }
            Ok(info.exists().then_some(()))
        })
    }

    /// Joins a worker with `--resources` JSON.
    pub fn add_worker(&mut self, resources: &str) -> Result<usize> {
        let n = self.workers.len();
        let mut cmd = self.worker_cmd(resources);
        cmd.args(["--token-file"]).arg(self.token_file());
        let p = Proc::spawn(&format!("worker-{n}"), self.dir.path(), &mut cmd)?;
        self.workers.push(p);
        Ok(n)
    }

    pub fn worker_cmd(&self, resources: &str) -> Command {
        let mut cmd = Command::new(bin("rlhf-worker"));
        cmd.args([
            "join",
            "--address",
            &self.address(),
            "--node-ip",
            "127.0.0.1",
            "--resources",
            resources,
        ])
        .arg("--state-dir")
        .arg(
            self.dir
                .path()
                .join(format!("wstate-{}", self.workers.len())),
        )
        .env_remove("RLHF_TOKEN")
        .env("RUST_LOG", "info");
        cmd
    }

    /// The command of [`Cluster::status`], for a caller that adds flags (`--tls-ca`).
    pub fn status_cmd(&self) -> Command {
        let mut cmd = Command::new(bin("rlhf-head"));
        cmd.args([
            "status",
            "--format",
            "json",
            "--connect-timeout",
            "2",
            "--address",
            &self.address(),
        ])
        .arg("--token-file")
        .arg(self.token_file());
        cmd
    }

    /// `rlhf-head status --format json`.
    pub fn status(&self) -> Result<Value> {
        let out = self.status_cmd().output()?;
        if !out.status.success() {
            bail!("status failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    pub fn alive_nodes(&self) -> Result<usize> {
        Ok(count_alive(&self.status()?))
    }

    pub fn wait_alive_nodes(&self, n: usize, timeout: Duration) -> Result<Value> {
        wait_for(timeout, &format!("{n} alive nodes"), || {
            let s = self.status()?;
            Ok((count_alive(&s) == n).then_some(s))
        })
    }

    pub fn token(&self) -> Result<String> {
        Ok(std::fs::read_to_string(self.token_file())?
            .trim()
            .to_string())
    }

    pub fn head_log(&self) -> String {
        std::fs::read_to_string(self.state_dir().join("logs/head.log")).unwrap_or_default()
    }
}
