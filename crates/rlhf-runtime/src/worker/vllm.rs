//! The worker's vLLM Python (`--vllm-python` / `RLHF_VLLM_PYTHON`): the interpreter its
//! rollout ranks start vLLM servers with. It is the worker's setting, never a job's, so a
//! job submitter chooses no executable; the worker checks it once at join (it exists and
//! can import vLLM) and hands it to each role process in [`VLLM_PYTHON_ENV`], removing any
//! value a job's environment carried.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rlhf_core::{Error, Result};

/// The variable a role process reads its worker's vLLM Python from (and the one
/// `rlhf-worker join` and `rlhf-head run` read as the flag's default).
pub const VLLM_PYTHON_ENV: &str = "RLHF_VLLM_PYTHON";

/// How long the import check may take (Python starts in well under a second; a cold
/// filesystem with a large venv may take longer).
const CHECK_WITHIN: Duration = Duration::from_secs(60);

/// Checks that `python` is an interpreter that can import vLLM; returns its absolute path.
/// `origin` names where the path came from (the flag or the variable) for the error.
pub async fn check_vllm_python(python: &Path, origin: &str) -> Result<PathBuf> {
    let fix = "give an interpreter with vLLM installed (scripts/vllm-cpu-venv.sh makes one \
               for the CPU), or leave it unset for a worker without vLLM rollout";
    // Absolute, but not resolved: a venv's `bin/python` is a link to the system Python,
    // and only the link's path makes it the venv's.
    let abs = std::path::absolute(python)
        .map_err(|e| Error::invalid(format!("{origin} {}: {e}; {fix}", python.display())))?;
    if !abs.exists() {
        return Err(Error::invalid(format!(
            "{origin} {}: no such file; {fix}",
            python.display()
        )));
    }
    if !abs.is_file() {
        return Err(Error::invalid(format!(
            "{origin} {}: not a file; {fix}",
            python.display()
        )));
    }
    // find_spec only locates the package (importing vLLM itself takes seconds).
    let run = tokio::process::Command::new(&abs)
        .args([
            "-c",
            "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(CHECK_WITHIN, run).await {
        Err(_) => Err(Error::invalid(format!(
            "{origin} {}: did not answer within {} s; {fix}",
            python.display(),
            CHECK_WITHIN.as_secs()
        ))),
        Ok(Err(e)) => Err(Error::invalid(format!(
            "{origin} {}: cannot run it ({e}); {fix}",
            python.display()
        ))),
        Ok(Ok(out)) if out.status.code() == Some(3) => Err(Error::invalid(format!(
            "{origin} {}: this Python has no `vllm` module; {fix}",
            python.display()
        ))),
        Ok(Ok(out)) if !out.status.success() => Err(Error::invalid(format!(
            "{origin} {}: it failed ({}): {}; {fix}",
            python.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
        Ok(Ok(_)) => Ok(abs),
    }
}

/// The vLLM Python of a worker: the flag's value (clap fills it from [`VLLM_PYTHON_ENV`]
/// too), checked; `None` when neither is set or the value is empty.
pub async fn resolve(flag: Option<&Path>) -> Result<Option<PathBuf>> {
    match flag.filter(|p| !p.as_os_str().is_empty()) {
        None => Ok(None),
        Some(p) => check_vllm_python(p, "--vllm-python (or RLHF_VLLM_PYTHON)")
            .await
            .map(Some),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn missing_file_and_python_without_vllm_are_refused_with_the_fix() {
        let e = check_vllm_python(Path::new("/nonexistent/python3"), "--vllm-python")
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("--vllm-python /nonexistent/python3"), "{e}");
        assert!(e.contains("vllm-cpu-venv.sh"), "{e}");
        // A shell script standing in for a Python that has no vLLM: exits 3 as find_spec
        // would.
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("python");
        std::fs::write(&fake, "#!/bin/sh\nexit 3\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = check_vllm_python(&fake, "RLHF_VLLM_PYTHON")
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("has no `vllm` module"), "{e}");
        std::fs::write(&fake, "#!/bin/sh\nexit 0\n").unwrap();
        // A venv's python is a link: the link's path is kept (resolving it would lose the
        // venv).
        let link = dir.path().join("venv-python");
        std::os::unix::fs::symlink(&fake, &link).unwrap();
        let ok = check_vllm_python(&link, "RLHF_VLLM_PYTHON").await.unwrap();
        assert_eq!(ok, link);
        assert_eq!(resolve(Some(Path::new(""))).await.unwrap(), None);
        assert_eq!(resolve(None).await.unwrap(), None);
    }
}
