//! The `rlhf-head` binary on its own (no cluster): config errors are clear and alone, and
//! `check` prints the resolved config, the placement plan and the memory estimate.
//!
//! Having integration tests also makes `cargo test --workspace` build `rlhf-head` before
//! any test runs, so the end-to-end tests in tests/e2e use that binary instead of running
//! cargo themselves.

use std::path::Path;
use std::process::{Command, Output};

const EXE: &str = env!("CARGO_BIN_EXE_rlhf-head");

fn head(args: &[&str], out_dir: &Path) -> Output {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    Command::new(EXE)
        .current_dir(repo)
        .args(args)
        .arg(format!("checkpoint.dir={}", out_dir.join("ckpt").display()))
        .arg(format!(
            "logging.metrics_file={}",
            out_dir.join("metrics.jsonl").display()
        ))
        .env_remove("RLHF_TOKEN")
        .env("RUST_LOG", "warn")
        .output()
        .expect("running rlhf-head")
}

#[test]
fn config_errors_name_the_key_and_nothing_runs() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &[&str]); 3] = [
        (
            "actor_rollout.ppo_epoch=2",
            &["actor_rollout.ppo_epoch", "ppo_epochs"],
        ),
        (
            "actor_rollout.ppo_mini_batch_size=5",
            &["ppo_mini_batch_size", "5"],
        ),
        ("bogus.key=1", &["bogus"]),
    ];
    for (arg, needles) in cases {
        for cmd in ["run", "check"] {
            let out = head(&[cmd, "--config-name", "ppo_tiny", arg], dir.path());
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{cmd} {arg} should fail");
            for n in needles {
                assert!(err.contains(n), "{cmd} {arg}: '{n}' not in:\n{err}");
            }
            assert!(!err.contains("panicked"), "{err}");
            // One `error:` line, then one bullet per invalid setting when there are several.
            let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
            assert!(lines[0].starts_with("error: "), "{cmd} {arg}:\n{err}");
            assert!(
                lines[1..].iter().all(|l| l.starts_with("  - ")),
                "{cmd} {arg}: stray output:\n{err}"
            );
        }
    }
    // Nothing ran: no checkpoint or metrics were written.
    assert!(!dir.path().join("ckpt").exists());
    assert!(!dir.path().join("metrics.jsonl").exists());
}

#[test]
fn check_prints_config_plan_and_memory() {
    let dir = tempfile::tempdir().unwrap();
    let out = head(
        &[
            "check",
            "--config-name",
            "ppo_tiny",
            "actor_rollout.ppo_epochs=3",
            "--show-config",
        ],
        dir.path(),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for section in [
        "# resolved config",
        "# placement plan",
        "# memory estimate per device",
    ] {
        assert!(text.contains(section), "'{section}' missing:\n{text}");
    }
    // The verdict leads; the config comes last and without other trainers' keys.
    assert!(text.starts_with("# verdict\nfits: "), "{text}");
    assert!(
        text.find("# placement plan") < text.find("# resolved config"),
        "{text}"
    );
    assert!(
        !text.contains("\n  loss_type:") && !text.contains("\n  beta:"),
        "{text}"
    );
    // The override reached the resolved config, and every role has a plan row.
    assert!(text.contains("ppo_epochs: 3"), "{text}");
    for role in ["actor_rollout", "ref", "critic", "reward"] {
        assert!(
            text.lines().any(|l| l.starts_with(role)),
            "no plan row for {role}:\n{text}"
        );
    }
    assert!(text.contains("actor_rollout/train"), "{text}");
    assert!(
        text.contains("# files the run reads\nall present"),
        "{text}"
    );

    // What the run would fail to read is listed, by key.
    let out = head(
        &[
            "check",
            "--config-name",
            "ppo_tiny",
            "data.path=/nonexistent/prompts.jsonl",
            "critic.model=/nonexistent/critic",
        ],
        dir.path(),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("missing: data.path /nonexistent/prompts.jsonl is not a file"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("missing: ") && l.contains("/nonexistent/critic")),
        "{text}"
    );
}
