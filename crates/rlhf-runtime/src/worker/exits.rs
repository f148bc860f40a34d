//! What the worker says about its actors' processes: why one exited (code, signal, the
//! usual cause of a SIGKILL), the last lines of its log, and which actor ids may name its
//! files.

use std::path::Path;

use rlhf_core::{Error, Result};

pub(super) fn log_tail(path: &Path, n: usize) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("signal {sig}"))
}

/// An actor id as the head makes them (`actor-<hex>`): letters, digits, `-` and `_`, so it
/// can name files in the worker's state directory and nothing outside it.
pub(super) fn check_actor_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "StartActorRequest.actor_id {:?} is not an actor id: 1 to 128 letters, digits, - and _",
            id.chars().take(140).collect::<String>()
        )))
    }
}

/// The exit reason of a role process stopped by its job or the head: no failure.
pub const STOPPED_ON_REQUEST: &str = "stopped on request";

/// Human reason for an exit, with the usual cause of a SIGKILL named.
pub fn exit_reason(code: Option<i32>, signal: Option<i32>, stop_requested: bool) -> String {
    if stop_requested {
        return STOPPED_ON_REQUEST.into();
    }
    match (code, signal) {
        (Some(0), _) => "exited normally (code 0)".into(),
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(9)) => "killed by SIGKILL (often the kernel OOM killer; check `dmesg`)".into(),
        (None, Some(s)) => format!("killed by {}", signal_name(s)),
        _ => "exited for an unknown reason".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_reasons_are_specific() {
        assert_eq!(exit_reason(Some(3), None, false), "exited with code 3");
        assert!(exit_reason(None, Some(9), false).contains("OOM"));
        assert_eq!(exit_reason(None, Some(15), false), "killed by SIGTERM");
        assert_eq!(exit_reason(None, Some(15), true), "stopped on request");
    }

    /// The head's ids pass; a path, an empty or an overlong id (a caller with the token
    /// naming files outside the state directory) is refused.
    #[test]
    fn only_actor_ids_as_the_head_makes_them_are_taken() {
        assert!(check_actor_id("actor-0f75824a5fbb").is_ok());
        for bad in ["", "../../etc/x", "a/b", "a b", &"x".repeat(129)] {
            let e = check_actor_id(bad).unwrap_err();
            assert!(e.to_string().contains("is not an actor id"), "{bad}: {e}");
        }
    }
}
