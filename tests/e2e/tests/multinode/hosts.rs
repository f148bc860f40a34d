//! The hosts of the multi-node tests: network namespaces on a bridge of their own, or
//! loopback addresses, with the process bookkeeping that cleans up after them (split out of
//! multinode.rs, which keeps the scenarios).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use anyhow::{bail, Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use rlhf_e2e::pid_alive;
use serde_json::Value;

/// Long next to the 200 ms heartbeat, so a loaded machine does not starve a live node into a
/// false death.
pub(crate) const DEAD_AFTER_MS: u64 = 3000;
/// Prefix of every namespace these tests make; the test's pid follows, so a later run can
/// tell stale namespaces (of a killed run) from those of a run still going.
pub(crate) const NS_PREFIX: &str = "rlhfmn";

pub(crate) fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub(crate) fn run_ok(cmd: &mut Command, what: &str) -> Result<Output> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out)
}

pub(crate) fn ip(args: &[&str]) -> Result<()> {
    run_ok(
        Command::new("ip").args(args),
        &format!("ip {}", args.join(" ")),
    )
    .map(|_| ())
}

/// Pids of every process that lives in namespace `ns`.
pub(crate) fn netns_pids(ns: &str) -> Vec<i32> {
    Command::new("ip")
        .args(["netns", "pids", ns])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

pub(crate) fn kill_all(pids: &[i32]) {
    for &p in pids {
        let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
    }
}

/// Processes whose command line mentions `marker` (every process the scripts start names the
/// test's state directory in its arguments).
pub(crate) fn pids_with_marker(marker: &str) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != std::process::id() as i32 && pid_alive(pid))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(marker))
                .unwrap_or(false)
        })
        .collect()
}

/// Namespaces made for one test, deleted (with every process inside) on drop, so a failing
/// test leaves none behind.
pub(crate) struct Netns {
    names: Vec<String>,
}

impl Drop for Netns {
    fn drop(&mut self) {
        for ns in &self.names {
            kill_all(&netns_pids(ns));
        }
        for ns in &self.names {
            let _ = Command::new("ip")
                .args(["netns", "del", ns])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Removes namespaces left by a run of this test that was killed before its guards ran.
pub(crate) fn remove_stale_namespaces() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let Some(rest) = name.strip_prefix(NS_PREFIX) else {
            continue;
        };
        let owner: i32 = rest
            .split('-')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        if owner > 0 && !pid_alive(owner) {
            kill_all(&netns_pids(name));
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
}

pub(crate) enum Mode {
    /// One namespace per host; the namespace names by host address.
    Netns(Netns),
    Loopback,
}

pub(crate) struct Hosts {
    pub(crate) mode: Mode,
    pub(crate) addrs: Vec<String>,
    /// RLHF_REMOTE_SHELL for the scripts.
    pub(crate) remote_shell: String,
}

impl Hosts {
    /// `n` hosts in network namespaces: a switch namespace holding a bridge, and per host a
    /// namespace whose eth0 is a veth pair into that bridge.
    pub(crate) fn netns(tag: &str, n: usize) -> Result<Hosts> {
        remove_stale_namespaces();
        let pid = std::process::id();
        let prefix = format!("{NS_PREFIX}{pid}-{tag}");
        let switch = format!("{prefix}-sw");
        let mut guard = Netns { names: Vec::new() };
        ip(&["netns", "add", &switch])?;
        guard.names.push(switch.clone());
        ip(&["-n", &switch, "link", "set", "lo", "up"])?;
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &switch, "link", "set", "br0", "up"])?;
        let mut addrs = Vec::new();
        for i in 0..n {
            let addr = format!("10.231.0.{}", i + 1);
            let ns = format!("{prefix}-{addr}");
            ip(&["netns", "add", &ns])?;
            guard.names.push(ns.clone());
            let port = format!("p{i}");
            // Both ends are made inside namespaces of ours: the host's network is never touched.
            ip(&[
                "-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns",
                &switch,
            ])?;
            ip(&["-n", &switch, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &switch, "link", "set", &port, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            addrs.push(addr);
        }
        Ok(Hosts {
            mode: Mode::Netns(guard),
            addrs,
            remote_shell: format!("ip netns exec {prefix}-{{host}} sh -c"),
        })
    }

    pub(crate) fn loopback(n: usize) -> Hosts {
        Hosts {
            mode: Mode::Loopback,
            addrs: (0..n).map(|i| format!("127.0.0.{}", i + 2)).collect(),
            remote_shell: "env RLHF_TEST_HOST={host} sh -c".into(),
        }
    }

    pub(crate) fn mode_name(&self) -> &'static str {
        match self.mode {
            Mode::Netns(_) => "netns",
            Mode::Loopback => "loopback",
        }
    }

    /// A command run "on" host `i`.
    pub(crate) fn on_host(&self, i: usize, program: &Path) -> Command {
        match &self.mode {
            Mode::Netns(g) => {
                // names[0] is the switch; host i is names[i + 1].
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &g.names[i + 1]]).arg(program);
                c
            }
            Mode::Loopback => Command::new(program),
        }
    }

    /// Kills every process started for host `i`; returns their pids.
    pub(crate) fn kill_host(&self, i: usize, state: &Path) -> Result<Vec<i32>> {
        let pids = match &self.mode {
            Mode::Netns(g) => netns_pids(&g.names[i + 1]),
            Mode::Loopback => {
                // The scripts start each process in a session of its own, group id = pid.
                let pid: i32 =
                    std::fs::read_to_string(state.join(&self.addrs[i]).join("worker.pid"))?
                        .trim()
                        .parse()?;
                let _ = kill(Pid::from_raw(-pid), Signal::SIGKILL);
                vec![pid]
            }
        };
        if pids.is_empty() {
            bail!("no process found for host {}", self.addrs[i]);
        }
        kill_all(&pids);
        Ok(pids)
    }

    pub(crate) fn leftover_pids(&self, marker: &str) -> Vec<i32> {
        let mut pids = pids_with_marker(marker);
        if let Mode::Netns(g) = &self.mode {
            for ns in &g.names {
                pids.extend(netns_pids(ns));
            }
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }
}

/// Kills whatever the scripts started if a test fails half-way.
pub(crate) struct KillOnDrop(pub(crate) String);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        kill_all(&pids_with_marker(&self.0));
    }
}

pub(crate) fn node_map(status: &Value) -> BTreeMap<String, Value> {
    status["nodes"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|n| {
                    let addr = n["address"].as_str().unwrap_or_default();
                    let ip = addr.rsplit_once(':').map(|(h, _)| h).unwrap_or(addr);
                    (ip.to_string(), n.clone())
                })
                .collect()
        })
        .unwrap_or_default()
}
