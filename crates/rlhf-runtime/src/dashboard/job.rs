//! What the job page shows, read off the files the job's driver writes (the JSONL metrics and
//! samples files) and the cluster status (the job's role actors carry `RLHF_JOB_ID`).
//!
//! The metrics file is read incrementally: each poll parses only the lines appended since the
//! last one. A restart of the job from a checkpoint truncates the file to the checkpoint's
//! step and appends again; a record whose step is not after the last one seen drops the
//! points from that step on, so each step shows once (as the file holds it).

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rlhf_proto::v1 as pb;
use serde_json::json;

/// The files of a job the head ran. Either may be missing (not written yet, or turned off).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobFiles {
    pub metrics: Option<PathBuf>,
    pub samples: Option<PathBuf>,
}

/// Every metric of a job by name, as (step, value) points in step order.
#[derive(Debug, Clone, Default)]
pub struct Series {
    pub metrics: BTreeMap<String, Vec<(f64, f64)>>,
    pub last_step: Option<f64>,
    /// The last record, as read (for the page's "latest" table).
    pub latest: BTreeMap<String, f64>,
}

impl Series {
    fn push(&mut self, record: &serde_json::Map<String, serde_json::Value>) {
        let Some(step) = record.get("step").and_then(|s| s.as_f64()) else {
            return;
        };
        if self.last_step.is_some_and(|last| step <= last) {
            for pts in self.metrics.values_mut() {
                pts.retain(|(x, _)| *x < step);
            }
        }
        self.latest.clear();
        for (k, v) in record {
            if k == "step" {
                continue;
            }
            // A null is a NaN or an infinity: a gap in the plot, not a zero.
            let y = v.as_f64().unwrap_or(f64::NAN);
            self.metrics.entry(k.clone()).or_default().push((step, y));
            if y.is_finite() {
                self.latest.insert(k.clone(), y);
            }
        }
        self.last_step = Some(step);
    }
}

struct Cached {
    path: PathBuf,
    offset: u64,
    /// Shared with the requests that read it: a poll copies nothing, an append copies only
    /// while an earlier answer still holds the old one.
    series: Arc<Series>,
}

/// Series per job, kept between polls.
#[derive(Default)]
pub struct SeriesCache(Mutex<HashMap<String, Cached>>);

/// Bytes parsed per poll at most (a long run's file is caught up over a few polls).
const MAX_READ: u64 = 64 * 1024 * 1024;

impl SeriesCache {
    /// The job's series with the lines appended since the last call read in.
    pub fn read(&self, job_id: &str, path: &Path) -> Arc<Series> {
        let mut all = crate::lock(&self.0);
        let c = all.entry(job_id.to_string()).or_insert_with(|| Cached {
            path: path.to_path_buf(),
            offset: 0,
            series: Arc::default(),
        });
        let len = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        if c.path != path || len < c.offset {
            // Another file, or truncated (a restart): read it from the start.
            *c = Cached {
                path: path.to_path_buf(),
                offset: 0,
                series: Arc::default(),
            };
        }
        if len > c.offset {
            let _ = catch_up(c, len);
        }
        Arc::clone(&c.series)
    }

    /// Forgets jobs not in `keep` (the head removed them).
    pub fn retain(&self, keep: &dyn Fn(&str) -> bool) {
        crate::lock(&self.0).retain(|k, _| keep(k));
    }
}

fn catch_up(c: &mut Cached, len: u64) -> std::io::Result<()> {
    let mut f = std::fs::File::open(&c.path)?;
    f.seek(SeekFrom::Start(c.offset))?;
    let mut buf = Vec::new();
    f.take((len - c.offset).min(MAX_READ))
        .read_to_end(&mut buf)?;
    // Only whole lines: the driver may be writing the next one.
    let Some(end) = buf.iter().rposition(|&b| b == b'\n') else {
        return Ok(());
    };
    for line in buf[..end].split(|&b| b == b'\n') {
        if let Ok(serde_json::Value::Object(rec)) = serde_json::from_slice(line) {
            Arc::make_mut(&mut c.series).push(&rec);
        }
    }
    c.offset += end as u64 + 1;
    Ok(())
}

/// The rows of the newest step in a samples file (its last 256 KiB).
pub fn latest_samples(path: &Path) -> serde_json::Value {
    let tail = crate::head::jobs::read_tail(path, 256 * 1024);
    let rows: Vec<serde_json::Value> = tail
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.is_object())
        .collect();
    let Some(step) = rows.last().and_then(|r| r["step"].as_u64()) else {
        return json!({"step": null, "rows": []});
    };
    let rows: Vec<_> = rows
        .into_iter()
        .filter(|r| r["step"].as_u64() == Some(step))
        .map(|r| json!({"query": r["query"], "response": r["response"], "score": r["score"]}))
        .collect();
    json!({"step": step, "rows": rows})
}

/// The job's role actors: the name, role, node (and its host), devices and state of each.
pub fn roles(s: &pb::ClusterStatusResponse, job_id: &str) -> Vec<serde_json::Value> {
    let host: HashMap<&str, &str> = s
        .nodes
        .iter()
        .map(|n| (n.node_id.as_str(), n.hostname.as_str()))
        .collect();
    s.actors
        .iter()
        .filter(|a| {
            a.spec
                .as_ref()
                .and_then(|sp| sp.env.get("RLHF_JOB_ID"))
                .is_some_and(|j| j == job_id)
        })
        .map(|a| {
            let spec = a.spec.clone().unwrap_or_default();
            json!({
                "name": spec.name, "role": spec.role, "node_id": a.node_id,
                "host": host.get(a.node_id.as_str()).copied().unwrap_or(""),
                "devices": a.devices, "resources": crate::status::resources_json(spec.resources.as_ref()),
                "state": crate::status::actor_state(a.state), "pid": a.pid,
                "rss_bytes": a.rss_bytes, "reason": a.reason,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn series_follow_appends_and_restarts() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("metrics.jsonl");
        let mut f = std::fs::File::create(&p).unwrap();
        for s in 1..=4 {
            writeln!(
                f,
                "{{\"step\":{s},\"objective/scores\":{},\"x\":null}}",
                s as f64 / 10.0
            )
            .unwrap();
        }
        // Half a line: not read until it ends.
        write!(f, "{{\"step\":5,").unwrap();
        f.flush().unwrap();
        let cache = SeriesCache::default();
        let s = cache.read("j", &p);
        assert_eq!(s.last_step, Some(4.0));
        assert_eq!(s.metrics["objective/scores"].len(), 4);
        assert!(s.metrics["x"][0].1.is_nan());
        assert_eq!(s.latest.get("objective/scores"), Some(&0.4));
        assert!(!s.latest.contains_key("x"));
        writeln!(f, "\"objective/scores\":0.5}}").unwrap();
        // A restart from step 2's checkpoint appends step 3 again (the file still has the
        // old lines here: the rewind alone must drop them).
        writeln!(f, "{{\"step\":3,\"objective/scores\":0.9}}").unwrap();
        f.flush().unwrap();
        let s = cache.read("j", &p);
        let steps: Vec<f64> = s.metrics["objective/scores"].iter().map(|p| p.0).collect();
        assert_eq!(steps, [1.0, 2.0, 3.0]);
        assert_eq!(s.metrics["objective/scores"][2].1, 0.9);
        // Truncated (the driver's restart cuts the file): read from the start again.
        std::fs::write(&p, "{\"step\":1,\"objective/scores\":0.1}\n").unwrap();
        let s = cache.read("j", &p);
        assert_eq!(s.metrics["objective/scores"], vec![(1.0, 0.1)]);
        let missing = cache.read("k", &d.path().join("none.jsonl"));
        assert!(missing.metrics.is_empty() && missing.last_step.is_none());
    }

    #[test]
    fn samples_of_the_newest_step() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("samples.jsonl");
        std::fs::write(
            &p,
            "{\"step\":1,\"query\":\"q\",\"response\":\"old\",\"score\":0}\n\
             {\"step\":2,\"query\":\"q1\",\"response\":\"<b>a</b>\",\"score\":1}\n\
             {\"step\":2,\"query\":\"q2\",\"response\":\"b\",\"score\":0.5}\n",
        )
        .unwrap();
        let v = latest_samples(&p);
        assert_eq!(v["step"], 2);
        assert_eq!(v["rows"].as_array().unwrap().len(), 2);
        assert_eq!(v["rows"][0]["response"], "<b>a</b>");
        assert_eq!(latest_samples(&d.path().join("none"))["rows"], json!([]));
    }

    #[test]
    fn roles_are_the_actors_of_the_job() {
        let actor = |name: &str, job: &str| pb::ActorInfo {
            actor_id: name.into(),
            node_id: "n1".into(),
            spec: Some(pb::ActorSpec {
                name: name.into(),
                role: "critic".into(),
                env: [("RLHF_JOB_ID".to_string(), job.to_string())].into(),
                ..Default::default()
            }),
            state: pb::ActorState::Alive as i32,
            rss_bytes: 1 << 20,
            ..Default::default()
        };
        let s = pb::ClusterStatusResponse {
            nodes: vec![pb::NodeInfo {
                node_id: "n1".into(),
                hostname: "h1".into(),
                ..Default::default()
            }],
            actors: vec![actor("a", "j1"), actor("b", "j2"), actor("c", "j1")],
            ..Default::default()
        };
        let r = roles(&s, "j1");
        let names: Vec<_> = r.iter().map(|v| v["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["a", "c"]);
        assert_eq!(r[0]["host"], "h1");
        assert_eq!(r[0]["state"], "ALIVE");
        assert_eq!(r[0]["rss_bytes"], 1 << 20);
    }
}
