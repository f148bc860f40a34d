//! Resource quantities keyed by name ("CPU", "GPU", "NPU", "memory", custom keys).

use std::collections::BTreeMap;

use rlhf_proto::v1 as pb;

use crate::{Error, Result};

/// Tolerance for float resource arithmetic (fractional GPUs are allowed).
const EPS: f64 = 1e-9;

#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Resources(pub BTreeMap<String, f64>);

impl Resources {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with(mut self, key: &str, amount: f64) -> Self {
        self.0.insert(key.to_string(), amount);
        self
    }

    pub fn get(&self, key: &str) -> f64 {
        self.0.get(key).copied().unwrap_or(0.0)
    }

    /// Parses `--resources` JSON such as `{"GPU": 8, "custom": 1}`. Errors name the flag,
    /// the position of a syntax error and the offending key.
    pub fn parse_json(flag: &str, text: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| {
            Error::invalid(format!(
                "{flag}: malformed JSON at line {} column {}: {e}; expected an object such as '{{\"GPU\": 8, \"CPU\": 16}}'",
                e.line(),
                e.column()
            ))
        })?;
        let obj = value.as_object().ok_or_else(|| {
            Error::invalid(format!(
                "{flag}: expected a JSON object such as '{{\"GPU\": 8}}', got {value}"
            ))
        })?;
        let mut out = Resources::new();
        for (k, v) in obj {
            let n = v.as_f64().ok_or_else(|| {
                Error::invalid(format!(
                    "{flag}: resource \"{k}\" must be a number, got {v}"
                ))
            })?;
            if !n.is_finite() || n < 0.0 {
                return Err(Error::invalid(format!(
                    "{flag}: resource \"{k}\" must be a finite number >= 0, got {n}"
                )));
            }
            out.0.insert(k.clone(), n);
        }
        Ok(out)
    }

    /// Adds or overrides every key of `other`.
    pub fn override_with(&mut self, other: &Resources) {
        for (k, v) in &other.0 {
            self.0.insert(k.clone(), *v);
        }
    }

    pub fn fits_in(&self, available: &Resources) -> bool {
        self.0.iter().all(|(k, v)| *v <= available.get(k) + EPS)
    }

    /// Per key, how much is missing from `available` to hold `self`.
    pub fn shortfall(&self, available: &Resources) -> Resources {
        let mut out = Resources::new();
        for (k, v) in &self.0 {
            let miss = v - available.get(k);
            if miss > EPS {
                out.0.insert(k.clone(), miss);
            }
        }
        out
    }

    pub fn add(&mut self, other: &Resources) {
        for (k, v) in &other.0 {
            *self.0.entry(k.clone()).or_insert(0.0) += v;
        }
    }

    pub fn sub(&mut self, other: &Resources) {
        for (k, v) in &other.0 {
            let e = self.0.entry(k.clone()).or_insert(0.0);
            *e -= v;
            if e.abs() < EPS {
                *e = 0.0;
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.0.values().all(|v| *v <= EPS)
    }

    /// `GPU: 2, CPU: 1` with memory shown in GiB.
    pub fn display(&self) -> String {
        self.0
            .iter()
            .map(|(k, v)| format!("{k}: {}", fmt_amount(k, *v)))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Whether a resource key counts bytes of memory (`memory`, `*_memory`).
pub fn is_memory(key: &str) -> bool {
    key == "memory" || key.ends_with("_memory")
}

/// Human form of one quantity: memory in GiB, whole numbers without decimals.
pub fn fmt_amount(key: &str, v: f64) -> String {
    if is_memory(key) {
        format!("{:.1}GiB", v / (1u64 << 30) as f64)
    } else if (v - v.round()).abs() < EPS {
        format!("{}", v.round() as i64)
    } else {
        format!("{v:.2}")
    }
}

impl From<&Resources> for pb::Resources {
    fn from(r: &Resources) -> Self {
        pb::Resources {
            amounts: r.0.clone().into_iter().collect(),
        }
    }
}

impl From<Resources> for pb::Resources {
    fn from(r: Resources) -> Self {
        (&r).into()
    }
}

impl From<&pb::Resources> for Resources {
    fn from(r: &pb::Resources) -> Self {
        Resources(r.amounts.clone().into_iter().collect())
    }
}

impl From<Option<&pb::Resources>> for Resources {
    fn from(r: Option<&pb::Resources>) -> Self {
        r.map(Resources::from).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_overrides() {
        let r = Resources::parse_json("--resources", r#"{"GPU": 8, "fast_disk": 1}"#).unwrap();
        assert_eq!(r.get("GPU"), 8.0);
        let mut base = Resources::new().with("CPU", 4.0).with("GPU", 2.0);
        base.override_with(&r);
        assert_eq!(base.get("GPU"), 8.0);
        assert_eq!(base.get("CPU"), 4.0);
        assert_eq!(base.get("fast_disk"), 1.0);
    }

    #[test]
    fn malformed_json_points_at_the_flag_and_position() {
        let e = Resources::parse_json("--resources", r#"{"GPU": 8,"#).unwrap_err();
        let m = e.to_string();
        assert!(
            m.starts_with("--resources: malformed JSON at line 1"),
            "{m}"
        );
        let e = Resources::parse_json("--resources", r#"{"GPU": "eight"}"#).unwrap_err();
        assert!(e.to_string().contains("\"GPU\" must be a number"), "{e}");
        let e = Resources::parse_json("--resources", r#"[1]"#).unwrap_err();
        assert!(e.to_string().contains("expected a JSON object"), "{e}");
        let e = Resources::parse_json("--resources", r#"{"GPU": -1}"#).unwrap_err();
        assert!(e.to_string().contains(">= 0"), "{e}");
    }

    #[test]
    fn shortfall_and_arithmetic() {
        let need = Resources::new().with("GPU", 4.0).with("CPU", 1.0);
        let have = Resources::new().with("GPU", 1.5).with("CPU", 8.0);
        assert!(!need.fits_in(&have));
        let s = need.shortfall(&have);
        assert_eq!(s.0.len(), 1);
        assert!((s.get("GPU") - 2.5).abs() < 1e-12);
        let mut avail = have.clone();
        avail.sub(&Resources::new().with("CPU", 8.0));
        assert_eq!(avail.get("CPU"), 0.0);
        avail.add(&Resources::new().with("CPU", 2.0));
        assert_eq!(avail.get("CPU"), 2.0);
    }
}
