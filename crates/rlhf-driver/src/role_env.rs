//! The environment the driver gives every role process it starts. Why: NCCL picks its
//! network interface and HCAs by itself unless `NCCL_SOCKET_IFNAME` / `NCCL_IB_HCA` say
//! otherwise, and on a multi-node job it often picks one the other nodes cannot reach; the
//! user sets those (and `NCCL_DEBUG` to see the bootstrap) where they start the job, so the
//! driver forwards its own `NCCL_*` variables to every role process on every node. The
//! head's allow-list (`rlhf_runtime::head::validate::actor_env`) admits exactly these.

use std::collections::HashMap;
use std::ffi::OsString;

use rlhf_runtime::head::validate::{actor_env, ACTOR_ENV_PREFIXES};

/// `RLHF_JOB_ID` and every `NCCL_*` variable of `vars` (the driver's environment) that the
/// head accepts for a role process; variables that are not valid UTF-8 are left out.
pub fn role_env(
    job_id: &str,
    vars: impl IntoIterator<Item = (OsString, OsString)>,
) -> HashMap<String, String> {
    let mut env: HashMap<String, String> = vars
        .into_iter()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, _)| {
            ACTOR_ENV_PREFIXES.iter().any(|p| k.starts_with(p))
                && actor_env([k], "ActorSpec.env").is_ok()
        })
        .collect();
    env.insert("RLHF_JOB_ID".to_string(), job_id.to_string());
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(OsString, OsString)> {
        pairs
            .iter()
            .map(|(k, v)| (OsString::from(k), OsString::from(v)))
            .collect()
    }

    #[test]
    fn the_jobs_nccl_settings_reach_the_role_processes() {
        let env = role_env(
            "job-1",
            vars(&[
                ("NCCL_SOCKET_IFNAME", "eth1"),
                ("NCCL_IB_HCA", "mlx5_0,mlx5_1"),
                ("NCCL_DEBUG", "INFO"),
                ("PATH", "/usr/bin"),
                ("LD_PRELOAD", "x.so"),
                ("CUDA_VISIBLE_DEVICES", "0"),
            ]),
        );
        assert_eq!(
            env.get("NCCL_SOCKET_IFNAME").map(String::as_str),
            Some("eth1")
        );
        assert_eq!(
            env.get("NCCL_IB_HCA").map(String::as_str),
            Some("mlx5_0,mlx5_1")
        );
        assert_eq!(env.get("NCCL_DEBUG").map(String::as_str), Some("INFO"));
        assert_eq!(env.get("RLHF_JOB_ID").map(String::as_str), Some("job-1"));
        assert_eq!(env.len(), 4, "{env:?}");
        // Everything forwarded passes the head's allow-list.
        actor_env(env.keys(), "ActorSpec.env").unwrap();
    }

    #[test]
    fn a_name_the_head_would_refuse_is_not_forwarded() {
        let long = format!("NCCL_{}", "X".repeat(200));
        let env = role_env("j", vars(&[(&long, "1")]));
        assert_eq!(env.len(), 1, "{env:?}");
    }
}
