//! TLS on every gRPC channel: a worker that verifies the head with --tls-ca and serves with
//! its own certificate joins; clients that do not verify (plain connection) or trust
//! another CA are refused; a worker that would serve plain TCP to a TLS head is refused at
//! start; ppo_tiny runs to the end with the driver talking TLS to the head and to every
//! role process.

use std::time::Duration;

use anyhow::Result;
use rlhf_e2e::{wait_for, Cluster, Proc};

fn status_with(c: &Cluster, ca: Option<&std::path::Path>) -> Result<std::process::Output> {
    let mut cmd = c.status_cmd();
    if let Some(ca) = ca {
        cmd.arg("--tls-ca").arg(ca);
    }
    Ok(cmd.output()?)
}

#[test]
fn tls_head_is_verified_by_joining_nodes() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (cert_p, key_p, ca_p) = rlhf_e2e::node_cert(dir.path())?;
    let (other_ca, _) = rlhf_e2e::make_ca()?;
    let other_p = dir.path().join("other-ca.crt");
    std::fs::write(&other_p, other_ca)?;

    let cert_s = cert_p.display().to_string();
    let key_s = key_p.display().to_string();
    let mut c = Cluster::start(&["--tls-cert", &cert_s, "--tls-key", &key_s])?;
    let mut cmd = c.worker_cmd(r#"{"GPU": 1}"#);
    cmd.arg("--token-file")
        .arg(c.token_file())
        .arg("--tls-ca")
        .arg(&ca_p)
        .arg("--tls-cert")
        .arg(&cert_p)
        .arg("--tls-key")
        .arg(&key_p);
    c.workers
        .push(Proc::spawn("tls-worker", c.dir.path(), &mut cmd)?);

    let s = wait_for(Duration::from_secs(20), "TLS worker alive", || {
        let out = status_with(&c, Some(&ca_p))?;
        anyhow::ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        Ok((rlhf_e2e::count_alive(&v) > 0).then_some(v))
    })?;
    assert_eq!(s["resources"]["total"]["GPU"], 1.0);

    // A client that does not speak TLS, or trusts another CA, cannot talk to the head.
    assert!(!status_with(&c, None)?.status.success());
    let out = status_with(&c, Some(&other_p))?;
    assert!(!out.status.success());
    // A worker that would serve its role processes in plain TCP is refused before joining.
    let mut cmd = c.worker_cmd(r#"{"GPU": 1}"#);
    cmd.arg("--token-file")
        .arg(c.token_file())
        .arg("--tls-ca")
        .arg(&ca_p);
    let out = cmd.output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--tls-cert and --tls-key"), "{err}");

    let mut cmd = c.worker_cmd(r#"{"GPU": 1}"#);
    cmd.arg("--token-file")
        .arg(c.token_file())
        .arg("--tls-ca")
        .arg(&other_p)
        .arg("--tls-cert")
        .arg(&cert_p)
        .arg("--tls-key")
        .arg(&key_p)
        .args(["--connect-timeout", "2"]);
    let mut bad = Proc::spawn("untrusting-worker", c.dir.path(), &mut cmd)?;
    assert!(!bad.wait_exit(Duration::from_secs(20))?.success());
    // Said at once, with the flag: retrying cannot change a certificate.
    assert!(
        bad.output()
            .contains("this process does not trust the TLS certificate of")
            && bad.output().contains("--tls-ca"),
        "{}",
        bad.output()
    );
    Ok(())
}

/// A TLS cluster: a head with the node certificate (and `--tls-ca` when `head_has_ca`) and
/// one worker with 4 CPU slots that verifies it with the CA and serves with the same
/// certificate, alive. Returns the cluster and the CA's path.
fn tls_cluster(dir: &std::path::Path, head_has_ca: bool) -> Result<(Cluster, std::path::PathBuf)> {
    let (cert_p, key_p, ca_p) = rlhf_e2e::node_cert(dir)?;
    let (cert_s, key_s, ca_s) = (
        cert_p.display().to_string(),
        key_p.display().to_string(),
        ca_p.display().to_string(),
    );
    let mut head = vec!["--tls-cert", &cert_s, "--tls-key", &key_s];
    if head_has_ca {
        head.extend(["--tls-ca", &ca_s]);
    }
    let mut c = Cluster::start(&head)?;
    let mut cmd = c.worker_cmd(r#"{"CPU": 4}"#);
    cmd.arg("--token-file").arg(c.token_file()).args([
        "--tls-ca",
        &ca_s,
        "--tls-cert",
        &cert_s,
        "--tls-key",
        &key_s,
    ]);
    c.workers
        .push(Proc::spawn("tls-worker", c.dir.path(), &mut cmd)?);
    wait_for(Duration::from_secs(20), "TLS worker alive", || {
        let out = status_with(&c, Some(&ca_p))?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        Ok((rlhf_e2e::count_alive(&v) > 0).then_some(()))
    })?;
    Ok((c, ca_p))
}

/// The whole PPO job over TLS: head and worker with certificates from one CA, the driver
/// (`rlhf-head run --address --tls-ca`) reaching the head and every role process over TLS.
#[test]
fn ppo_tiny_runs_to_the_end_on_a_tls_cluster() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (c, ca_p) = tls_cluster(dir.path(), true)?;
    let ca_s = ca_p.display().to_string();
    let out_dir = c.dir.path().join("job");
    let mut run = rlhf_e2e::ppo_run_cmd(&out_dir, &["training.train_iters=2"]);
    // Batches as between hosts (one host here would take shared memory): raw control
    // frames, inside TLS.
    run.args(["--address", &c.address(), "--tls-ca", &ca_s])
        .args(["--batch-path", "frames"])
        .arg("--token-file")
        .arg(c.token_file());
    let mut p = Proc::spawn("tls-run", c.dir.path(), &mut run)?;
    let st = p.wait_exit(Duration::from_secs(600))?;
    assert!(st.success(), "{}", p.output());
    let metrics = std::fs::read_to_string(out_dir.join("metrics.jsonl"))?;
    assert_eq!(metrics.lines().count(), 2, "{metrics}");
    // The line rlhf_roles::server::FRAMED_LOG, in each role process's log.
    let framed = rlhf_e2e::logs_saying(c.dir.path(), "batches arrive as raw control frames");
    assert!(
        framed >= 4,
        "every role process gets its batches as frames inside TLS: {framed} role logs say so"
    );
    Ok(())
}

/// A CA-signed cluster whose head was started without the CA (`--tls-ca`): the head trusts
/// only its own certificate, so it cannot call the workers. The job's error says which side
/// did not trust whom and the flag that fixes it, instead of a bare `UnknownIssuer`.
#[test]
fn a_head_without_the_cluster_ca_says_which_flag_is_missing() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (c, ca_p) = tls_cluster(dir.path(), false)?;
    let ca_s = ca_p.display().to_string();
    let out_dir = c.dir.path().join("job");
    let mut run = rlhf_e2e::ppo_run_cmd(&out_dir, &["training.train_iters=1"]);
    run.args(["--address", &c.address(), "--tls-ca", &ca_s])
        .args(["--start-timeout", "60"])
        .arg("--token-file")
        .arg(c.token_file());
    let mut p = Proc::spawn("tls-run", c.dir.path(), &mut run)?;
    let st = p.wait_exit(Duration::from_secs(300))?;
    let out = p.output();
    assert!(!st.success(), "{out}");
    assert!(
        out.contains("the head does not trust the TLS certificate of the worker of node")
            && out.contains("not signed by a CA the head trusts")
            && out.contains("start the head with --tls-ca"),
        "{out}"
    );
    Ok(())
}
