//! What the head accepts from a client. Every field a node, driver or CLI sends is checked
//! here before it reaches the state or the database: resource amounts finite, non-negative
//! and bounded (a NaN once stored made the head unable to restart; a negative GPU count
//! inflated capacity), names and addresses bounded in length and charset (they end up in
//! logs, the dashboard and file names), waits bounded. A bad field is an InvalidArgument that
//! names the field and what is allowed.

use std::time::Duration;

use rlhf_core::resources::Resources;
use rlhf_core::{Error, Result};
use rlhf_proto::v1 as pb;

/// Most resource kinds one request may name.
const MAX_RESOURCE_KINDS: usize = 64;
/// Largest amount of one resource (memory is in bytes: this is about 1 PB).
const MAX_AMOUNT: f64 = 1e15;
/// Longest name (node id, actor id, resource kind, placement group name, ...).
pub const MAX_NAME: usize = 128;
/// Longest host name (DNS allows 253).
const MAX_HOST: usize = 253;
/// Most actors one node reports at once (usage samples).
pub const MAX_ACTORS_PER_NODE: usize = 4096;
/// Longest wait a client may ask the head for.
pub const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// A resource map from the wire, checked.
pub fn resources(r: Option<&pb::Resources>, field: &str) -> Result<Resources> {
    let Some(r) = r else {
        return Ok(Resources::new());
    };
    if r.amounts.len() > MAX_RESOURCE_KINDS {
        return Err(Error::invalid(format!(
            "{field}: {} resource kinds, at most {MAX_RESOURCE_KINDS} are accepted",
            r.amounts.len()
        )));
    }
    for (k, &v) in &r.amounts {
        name(k, &format!("{field} key"), false)?;
        if !v.is_finite() || !(0.0..=MAX_AMOUNT).contains(&v) {
            return Err(Error::invalid(format!(
                "{field}: resource \"{k}\" is {}; amounts must be finite numbers from 0 to {MAX_AMOUNT:e}",
                if v.is_finite() && v.abs() >= 1e6 { format!("{v:e}") } else { v.to_string() }
            )));
        }
    }
    Ok(Resources::from(r))
}

/// An identifier: letters, digits and `_ . - : / @ +`, at most [`MAX_NAME`] characters.
pub fn name(s: &str, field: &str, allow_empty: bool) -> Result<()> {
    if s.is_empty() {
        return if allow_empty {
            Ok(())
        } else {
            Err(Error::invalid(format!("{field} is empty")))
        };
    }
    if s.len() > MAX_NAME {
        return Err(Error::invalid(format!(
            "{field} has {} bytes, at most {MAX_NAME} are accepted",
            s.len()
        )));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "_.-:/@+".contains(*c)))
    {
        return Err(Error::invalid(format!(
            "{field} {:?} has the character {c:?}; use letters, digits and _ . - : / @ +",
            truncate(s)
        )));
    }
    Ok(())
}

/// A host name as a node reports it: letters, digits, `.`, `-` and `_`.
pub fn hostname(s: &str, field: &str) -> Result<()> {
    if s.len() > MAX_HOST {
        return Err(Error::invalid(format!(
            "{field} has {} bytes, at most {MAX_HOST} are accepted",
            s.len()
        )));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || ".-_".contains(*c)))
    {
        return Err(Error::invalid(format!(
            "{field} {:?} has the character {c:?}; a host name has letters, digits, '.', '-' and '_'",
            truncate(s)
        )));
    }
    Ok(())
}

/// `host:port` (an IPv6 host in brackets), or empty when `allow_empty`.
pub fn address(s: &str, field: &str, allow_empty: bool) -> Result<()> {
    if s.is_empty() && allow_empty {
        return Ok(());
    }
    let bad = || {
        Error::invalid(format!(
            "{field} {:?} is not host:port (such as 10.0.0.5:6345 or [fe80::1]:6345)",
            truncate(s)
        ))
    };
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    port.parse::<u16>().map_err(|_| bad())?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return Err(bad());
    }
    if host.contains(':') {
        host.parse::<std::net::Ipv6Addr>().map_err(|_| bad())?;
        return Ok(());
    }
    hostname(host, field)
}

/// A wait in milliseconds from a request: `0` takes `default`; more than [`MAX_WAIT`] is
/// refused (a deadline that far is no deadline).
pub fn wait_ms(ms: u64, field: &str, default: Duration) -> Result<Duration> {
    if ms == 0 {
        return Ok(default);
    }
    let d = Duration::from_millis(ms);
    if d > MAX_WAIT {
        return Err(Error::invalid(format!(
            "{field} is {ms} ms; waits of at most {} ms are accepted",
            MAX_WAIT.as_millis()
        )));
    }
    Ok(d)
}

/// Environment variables a CreateActor may set for the role process (exact names, then
/// prefixes). CreateActor is behind the cluster token, which is the trust boundary: whoever
/// holds it runs processes on the workers. The allow-list keeps a caller from setting what
/// changes how a process loads (`LD_PRELOAD`, `PATH`, ...) or what the worker itself sets
/// (the token, the actor id, the visible devices).
pub const ACTOR_ENV: &[&str] = &[
    "RLHF_JOB_ID",
    "RUST_LOG",
    "RUST_BACKTRACE",
    "OMP_NUM_THREADS",
    "RAYON_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "HF_HOME",
    "HF_HUB_OFFLINE",
];
pub const ACTOR_ENV_PREFIXES: &[&str] = &["NCCL_"];

/// Refuses an actor environment variable outside [`ACTOR_ENV`] / [`ACTOR_ENV_PREFIXES`].
pub fn actor_env<'a>(vars: impl IntoIterator<Item = &'a String>, field: &str) -> Result<()> {
    for k in vars {
        let ok = ACTOR_ENV.contains(&k.as_str())
            || ACTOR_ENV_PREFIXES
                .iter()
                .any(|p| k.starts_with(p) && k.len() <= MAX_NAME);
        if !ok {
            return Err(Error::invalid(format!(
                "{field}: {:?} cannot be set for a role process; allowed are {} and {}*",
                truncate(k),
                ACTOR_ENV.join(", "),
                ACTOR_ENV_PREFIXES.join("*, ")
            )));
        }
    }
    Ok(())
}

fn truncate(s: &str) -> String {
    s.chars().take(40).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(pairs: &[(&str, f64)]) -> pb::Resources {
        pb::Resources {
            amounts: pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        }
    }

    #[test]
    fn resources_must_be_finite_bounded_and_named() {
        let ok = resources(Some(&res(&[("GPU", 8.0), ("memory", 8e10)])), "r").unwrap();
        assert_eq!(ok.get("GPU"), 8.0);
        for (k, v, want) in [
            ("GPU", f64::NAN, "NaN"),
            ("GPU", -2.0, "-2"),
            ("GPU", f64::INFINITY, "inf"),
            ("GPU", 1e300, "1e300"),
            ("G<b>", 1.0, "character '<'"),
            ("", 1.0, "empty"),
        ] {
            let e = resources(Some(&res(&[(k, v)])), "RegisterNodeRequest.resources")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("RegisterNodeRequest.resources") && e.contains(want),
                "{k} {v}: {e}"
            );
        }
        let many: Vec<(String, f64)> = (0..65).map(|i| (format!("r{i}"), 1.0)).collect();
        let many = pb::Resources {
            amounts: many.into_iter().collect(),
        };
        assert!(resources(Some(&many), "r").is_err());
    }

    #[test]
    fn names_hosts_addresses_and_waits() {
        name("node-1a2b", "node_id", false).unwrap();
        name("", "node_id", true).unwrap();
        assert!(name("", "node_id", false).is_err());
        assert!(name(&"x".repeat(129), "node_id", false)
            .unwrap_err()
            .to_string()
            .contains("129 bytes"));
        hostname("gpu-07.cluster.local", "hostname").unwrap();
        let e = hostname("<img src=x onerror=alert(1)>", "hostname")
            .unwrap_err()
            .to_string();
        assert!(e.contains("hostname") && e.contains("'<'"), "{e}");
        assert!(hostname("a\nb", "hostname").is_err());
        address("10.0.0.5:6345", "address", false).unwrap();
        address("[fe80::1]:6345", "address", false).unwrap();
        address("", "address", true).unwrap();
        for bad in ["10.0.0.5", "host:99999", ":80", "[zz::1]:80", "a b:80"] {
            assert!(address(bad, "address", false).is_err(), "{bad}");
        }
        assert_eq!(
            wait_ms(0, "timeout_ms", Duration::from_secs(3)).unwrap(),
            Duration::from_secs(3)
        );
        let env = |k: &str| vec![k.to_string()];
        actor_env(&env("RLHF_JOB_ID"), "ActorSpec.env").unwrap();
        actor_env(&env("NCCL_DEBUG"), "ActorSpec.env").unwrap();
        for bad in ["LD_PRELOAD", "PATH", "RLHF_TOKEN", "CUDA_VISIBLE_DEVICES"] {
            let e = actor_env(&env(bad), "ActorSpec.env")
                .unwrap_err()
                .to_string();
            assert!(e.contains(bad) && e.contains("RLHF_JOB_ID"), "{e}");
        }
        let e = wait_ms(u64::MAX, "KvWaitRequest.timeout_ms", Duration::ZERO)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("KvWaitRequest.timeout_ms") && e.contains("at most"),
            "{e}"
        );
    }
}
