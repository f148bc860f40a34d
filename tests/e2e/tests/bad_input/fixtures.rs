//! The bad-input table's fixtures (model directories broken in one way each, datasets,
//! tokens, certificates, checkpoints) and the runner that runs one case under a deadline.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

/// Files the cases point at, made once.
pub struct Fixtures {
    dir: tempfile::TempDir,
}

impl Fixtures {
    pub fn new() -> Result<Self> {
        let f = Fixtures {
            dir: tempfile::tempdir()?,
        };
        let d = f.dir.path();
        let tiny = rlhf_e2e::repo_root().join("models/tiny");
        let model = |name: &str, edit: &dyn Fn(&Path) -> Result<()>| -> Result<()> {
            let m = d.join(name);
            std::fs::create_dir_all(&m)?;
            for e in std::fs::read_dir(&tiny)? {
                let e = e?;
                std::fs::copy(e.path(), m.join(e.file_name()))?;
            }
            edit(&m)
        };
        model("m-truncated", &|m| {
            let w = std::fs::read(m.join("model.safetensors"))?;
            Ok(std::fs::write(m.join("model.safetensors"), &w[..100])?)
        })?;
        model("m-no-tokenizer", &|m| {
            Ok(std::fs::remove_file(m.join("tokenizer.json"))?)
        })?;
        model("m-bad-config", &|m| {
            Ok(std::fs::write(m.join("config.json"), "{")?)
        })?;
        let set = |key: &'static str, v: serde_json::Value| {
            move |m: &Path| -> Result<()> {
                let p = m.join("config.json");
                let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p)?)?;
                c[key] = v.clone();
                Ok(std::fs::write(p, c.to_string())?)
            }
        };
        model(
            "m-huge-layers",
            &set("num_hidden_layers", (1u64 << 40).into()),
        )?;
        model("m-extra-layer", &set("num_hidden_layers", 3.into()))?;
        model("m-wide", &set("hidden_size", 128.into()))?;
        model(
            "m-arch",
            &set("architectures", serde_json::json!(["GPT2LMHeadModel"])),
        )?;
        model("m-no-weights", &|m| {
            Ok(std::fs::remove_file(m.join("model.safetensors"))?)
        })?;
        std::fs::write(d.join("bad.jsonl"), "{\"prompt\": \n")?;
        std::fs::write(d.join("empty.jsonl"), "")?;
        std::fs::write(d.join("no-prompt.jsonl"), "{\"question\": \"2+2\"}\n")?;
        std::fs::write(d.join("not-pem"), "not a certificate")?;
        std::fs::write(d.join("empty-token"), "")?;
        std::fs::set_permissions(
            d.join("empty-token"),
            std::fs::Permissions::from_mode(0o600),
        )?;
        std::fs::write(d.join("good-token"), "0123456789abcdef")?;
        std::fs::set_permissions(d.join("good-token"), std::fs::Permissions::from_mode(0o600))?;
        std::fs::write(d.join("a-file"), "x")?;
        let planted = d.join("planted");
        std::fs::create_dir_all(&planted)?;
        std::fs::write(planted.join("token"), "0123456789abcdef")?;
        std::fs::set_permissions(
            planted.join("token"),
            std::fs::Permissions::from_mode(0o666),
        )?;
        let ck = d.join("ck/global_step_1");
        std::fs::create_dir_all(&ck)?;
        std::fs::write(ck.join("trainer_state.json"), "{")?;
        std::fs::write(d.join("ck/latest_checkpointed_iteration.txt"), "1\n")?;
        std::fs::create_dir_all(d.join("no-ckpt"))?;
        // A checkpoint signed by another cluster, and one (trusted) whose manifests point
        // outside their directories.
        // The cursor ppo_tiny's dataset and seed would have (64 prompts, seed 42), so that
        // the resume gets as far as loading the role directories.
        let cursor = serde_json::from_value(
            serde_json::json!({"epoch": 0, "position": 0, "dataset_len": 64, "seed": 42}),
        )?;
        let mut state = rlhf_driver::checkpoint::TrainerState::new("ppo", 1, cursor, 42, "job");
        state.kl_ctl = serde_json::from_value(serde_json::json!({"type": "fixed", "value": 0.05}))?;
        let other = rlhf_core::seal::CheckpointKey::from_secret(b"another cluster's token", "test");
        rlhf_driver::checkpoint::commit(&d.join("ck-foreign"), &state, &other)?;
        let escape = d.join("ck-escape");
        for part in ["actor", "critic"] {
            let dir = escape.join("global_step_1").join(part);
            std::fs::create_dir_all(&dir)?;
            std::fs::write(
                dir.join("manifest.json"),
                r#"{"files": {"../../../../../../proc/self/environ": {"bytes": 1, "checksum": "0000000000000000"}}}"#,
            )?;
        }
        rlhf_driver::checkpoint::commit(&escape, &state, &other)?;
        std::fs::create_dir_all(d.join("no-configs"))?;
        Ok(f)
    }

    pub fn p(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }
}

pub enum Bin {
    Head,
    Worker,
    Cli,
}

/// Runs one case under `limit`; returns (exit success, stderr).
pub fn run(bin: &Bin, args: &[String], limit: Duration) -> Result<(bool, String)> {
    let exe: PathBuf = rlhf_e2e::bin(match bin {
        Bin::Head => "rlhf-head",
        Bin::Worker => "rlhf-worker",
        Bin::Cli => "rlhf",
    });
    let mut child = Command::new(exe)
        .args(args)
        .current_dir(rlhf_e2e::repo_root())
        .env_remove("RLHF_TOKEN")
        // The cases' own flags say which vLLM Python (if any) a worker has.
        .env_remove("RLHF_VLLM_PYTHON")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let start = Instant::now();
    loop {
        if child.try_wait()?.is_some() {
            let out = child.wait_with_output()?;
            return Ok((
                out.status.success(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            ));
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            bail!("still running after {limit:?}: a hang");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
