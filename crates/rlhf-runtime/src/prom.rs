//! Prometheus exposition of the head (`/metrics` on the dashboard port), written with the
//! `prometheus-client` crate: nodes, resources, actors and jobs by state (read off the
//! cluster status at each scrape, so they cannot drift from `rlhf-head status`), the latency
//! of every head RPC as a histogram (a tower layer on the gRPC server), and, for each running
//! job, its latest step's metrics.
//!
//! Who may read what follows the dashboard: the counts are public (as on its front page);
//! RPC latencies and job metrics need the cluster token (`Authorization: Bearer ...`, which
//! Prometheus sends with `authorization: {credentials_file: ...}` in its scrape config).

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use rlhf_proto::v1 as pb;

use crate::status;

type Labels = Vec<(String, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// Distinct `method` labels kept; calls to further paths (only a misbehaving client sends
/// them: tonic answers Unimplemented) count under `other`, so a client cannot grow the
/// exposition without bound.
const MAX_METHODS: usize = 64;

fn rpc_histogram() -> Histogram {
    // 50 µs .. ~26 s, doubling.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 20))
}

/// Latency of the head's RPCs by method and gRPC status code.
pub struct RpcMetrics {
    family: Family<Labels, Histogram, fn() -> Histogram>,
    methods: Mutex<HashSet<String>>,
}

impl Default for RpcMetrics {
    fn default() -> Self {
        Self {
            family: Family::new_with_constructor(rpc_histogram),
            methods: Mutex::new(HashSet::new()),
        }
    }
}

impl RpcMetrics {
    /// The label of a request path (`/rlhf.v1.HeadService/RegisterNode` → `RegisterNode`).
    fn method(&self, path: &str) -> String {
        let name = path.rsplit('/').next().unwrap_or("");
        let valid = !name.is_empty()
            && name.len() <= 64
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return "other".into();
        }
        let mut known = crate::lock(&self.methods);
        if known.contains(name) || known.len() < MAX_METHODS {
            known.insert(name.to_string());
            name.to_string()
        } else {
            "other".into()
        }
    }

    pub fn observe(&self, path: &str, code: &str, secs: f64) {
        let labels = vec![
            ("method".to_string(), self.method(path)),
            ("code".to_string(), code.to_string()),
        ];
        self.family.get_or_create(&labels).observe(secs);
    }
}

/// A tower layer that times every request of the service it wraps into [`RpcMetrics`]: from
/// the request's arrival to the response headers (for a streaming RPC, until the stream
/// opens). The code is the `grpc-status` of a trailers-only answer (how tonic sends errors),
/// else 0.
#[derive(Clone)]
pub struct RpcTimerLayer(pub Arc<RpcMetrics>);

impl<S> tower::Layer<S> for RpcTimerLayer {
    type Service = RpcTimer<S>;
    fn layer(&self, inner: S) -> RpcTimer<S> {
        RpcTimer {
            inner,
            metrics: self.0.clone(),
        }
    }
}

#[derive(Clone)]
pub struct RpcTimer<S> {
    inner: S,
    metrics: Arc<RpcMetrics>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, RB> tower::Service<http::Request<B>> for RpcTimer<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let path = req.uri().path().to_string();
        let started = Instant::now();
        let fut = self.inner.call(req);
        let metrics = self.metrics.clone();
        Box::pin(async move {
            let r = fut.await;
            let code = match &r {
                Ok(resp) => resp
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("0")
                    .to_string(),
                Err(_) => "transport".to_string(),
            };
            metrics.observe(&path, &code, started.elapsed().as_secs_f64());
            r
        })
    }
}

/// The latest step of a running job, as its metrics file's last line holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct JobLatest {
    pub job_id: String,
    pub step: Option<f64>,
    pub metrics: BTreeMap<String, f64>,
}

impl JobLatest {
    /// From a metrics record (`{"step": 3, "objective/scores": 0.4, ...}`); non-numbers
    /// (a `null` for a NaN) are left out.
    pub fn from_record(job_id: &str, line: &str) -> Option<JobLatest> {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        let obj = v.as_object()?;
        let mut metrics = BTreeMap::new();
        for (k, v) in obj {
            if let Some(x) = v.as_f64() {
                if k != "step" {
                    metrics.insert(k.clone(), x);
                }
            }
        }
        Some(JobLatest {
            job_id: job_id.to_string(),
            step: obj.get("step").and_then(|s| s.as_f64()),
            metrics,
        })
    }
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn gauge_family(
    reg: &mut Registry,
    name: &str,
    help: &str,
    values: impl IntoIterator<Item = (Labels, f64)>,
) {
    let fam = Family::<Labels, FloatGauge>::default();
    for (l, v) in values {
        fam.get_or_create(&l).set(v);
    }
    reg.register(name, help, fam);
}

fn by_state<'a>(states: impl Iterator<Item = &'a str>, all: &[&'a str]) -> BTreeMap<&'a str, f64> {
    // Every state is present (0 included), so a graph of a state that empties drops to 0.
    let mut m: BTreeMap<&str, f64> = all.iter().map(|s| (*s, 0.0)).collect();
    for s in states {
        *m.entry(s).or_default() += 1.0;
    }
    m
}

/// The text exposition. `full`: the caller holds the cluster token (RPC latencies and job
/// metrics included).
pub fn render(
    s: &pb::ClusterStatusResponse,
    rpc: &RpcMetrics,
    jobs: &[JobLatest],
    full: bool,
) -> String {
    let mut reg = Registry::with_prefix("rlhf");
    let nodes = by_state(
        s.nodes.iter().map(|n| status::node_state(n.state)),
        &["ALIVE", "DEAD", "REJOINING"],
    );
    gauge_family(
        &mut reg,
        "nodes",
        "Nodes by state",
        nodes.into_iter().map(|(k, v)| (labels(&[("state", k)]), v)),
    );
    let (used, total) = status::usage(s);
    gauge_family(
        &mut reg,
        "resource_total",
        "Resources of the alive nodes",
        total
            .0
            .iter()
            .map(|(k, v)| (labels(&[("resource", k)]), *v)),
    );
    gauge_family(
        &mut reg,
        "resource_used",
        "Resources held by placement groups and actors on the alive nodes",
        total.0.keys().map(|k| {
            let u = used.0.get(k).copied().unwrap_or(0.0);
            (labels(&[("resource", k)]), u)
        }),
    );
    let actors = by_state(
        s.actors.iter().map(|a| status::actor_state(a.state)),
        &["PENDING", "ALIVE", "DEAD"],
    );
    gauge_family(
        &mut reg,
        "actors",
        "Actors by state",
        actors
            .into_iter()
            .map(|(k, v)| (labels(&[("state", k)]), v)),
    );
    let job_states = by_state(
        s.jobs.iter().map(|j| status::job_state(j.state)),
        &[
            "PENDING",
            "QUEUED",
            "RUNNING",
            "SUCCEEDED",
            "FAILED",
            "STOPPED",
        ],
    );
    gauge_family(
        &mut reg,
        "jobs",
        "Jobs by state",
        job_states
            .into_iter()
            .map(|(k, v)| (labels(&[("state", k)]), v)),
    );
    if full {
        reg.register(
            "rpc_duration_seconds",
            "Head RPC latency, request to response headers, by method and gRPC status code",
            rpc.family.clone(),
        );
        gauge_family(
            &mut reg,
            "job_step",
            "Last step a running job has logged",
            jobs.iter()
                .filter_map(|j| Some((labels(&[("job", &j.job_id)]), j.step?))),
        );
        gauge_family(
            &mut reg,
            "job_metric",
            "A running job's latest step metrics, by the metric's name in its metrics file",
            jobs.iter().flat_map(|j| {
                j.metrics
                    .iter()
                    .map(|(k, v)| (labels(&[("job", &j.job_id), ("metric", k)]), *v))
            }),
        );
    }
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, &reg);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status() -> pb::ClusterStatusResponse {
        let res = |cpu: f64| {
            Some(pb::Resources {
                amounts: [("CPU".to_string(), cpu)].into(),
            })
        };
        pb::ClusterStatusResponse {
            nodes: vec![
                pb::NodeInfo {
                    node_id: "n1".into(),
                    state: pb::NodeState::Alive as i32,
                    total: res(8.0),
                    available: res(5.0),
                    ..Default::default()
                },
                pb::NodeInfo {
                    node_id: "n2".into(),
                    state: pb::NodeState::Dead as i32,
                    total: res(4.0),
                    available: res(4.0),
                    ..Default::default()
                },
            ],
            actors: vec![pb::ActorInfo {
                state: pb::ActorState::Alive as i32,
                ..Default::default()
            }],
            jobs: vec![pb::JobInfo {
                state: pb::JobState::Running as i32,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn exposition_counts_and_access() {
        let rpc = RpcMetrics::default();
        rpc.observe("/rlhf.v1.HeadService/RegisterNode", "0", 0.0003);
        rpc.observe("/rlhf.v1.HeadService/RegisterNode", "0", 0.0007);
        rpc.observe("/rlhf.v1.HeadService/GetJob", "5", 0.001);
        let jobs = vec![JobLatest::from_record(
            "job-1",
            r#"{"step":7,"objective/scores":0.5,"objective/kl":null}"#,
        )
        .unwrap()];
        let public = render(&status(), &rpc, &jobs, false);
        assert!(public.contains("rlhf_nodes{state=\"ALIVE\"} 1"), "{public}");
        assert!(public.contains("rlhf_nodes{state=\"DEAD\"} 1"), "{public}");
        // Dead nodes count in neither total nor used.
        assert!(
            public.contains("rlhf_resource_total{resource=\"CPU\"} 8"),
            "{public}"
        );
        assert!(
            public.contains("rlhf_resource_used{resource=\"CPU\"} 3"),
            "{public}"
        );
        assert!(
            public.contains("rlhf_actors{state=\"ALIVE\"} 1"),
            "{public}"
        );
        assert!(
            public.contains("rlhf_actors{state=\"PENDING\"} 0"),
            "{public}"
        );
        assert!(
            public.contains("rlhf_jobs{state=\"RUNNING\"} 1"),
            "{public}"
        );
        assert!(
            !public.contains("job-1") && !public.contains("rpc_duration"),
            "{public}"
        );
        let full = render(&status(), &rpc, &jobs, true);
        assert!(
            full.contains("rlhf_rpc_duration_seconds_count{method=\"RegisterNode\",code=\"0\"} 2"),
            "{full}"
        );
        assert!(
            full.contains("rlhf_rpc_duration_seconds_bucket{le=\"0.0008\",method=\"RegisterNode\",code=\"0\"} 2")
                || full.contains("rlhf_rpc_duration_seconds_bucket{method=\"RegisterNode\",code=\"0\",le=\"0.0008\"} 2"),
            "{full}"
        );
        assert!(full.contains("code=\"5\""), "{full}");
        assert!(full.contains("rlhf_job_step{job=\"job-1\"} 7"), "{full}");
        assert!(
            full.contains("rlhf_job_metric{job=\"job-1\",metric=\"objective/scores\"} 0.5"),
            "{full}"
        );
        assert!(
            !full.contains("objective/kl\""),
            "a null is left out: {full}"
        );
        assert!(full.trim_end().ends_with("# EOF"), "{full}");
    }

    #[test]
    fn method_labels_are_bounded() {
        let rpc = RpcMetrics::default();
        for i in 0..(MAX_METHODS + 10) {
            rpc.observe(&format!("/x/M{i}"), "12", 0.001);
        }
        rpc.observe("/x/bad label{}", "12", 0.001);
        let out = render(&pb::ClusterStatusResponse::default(), &rpc, &[], true);
        let count = |m: &str| {
            let key = format!("rlhf_rpc_duration_seconds_count{{method=\"{m}\",code=\"12\"}} ");
            out.lines()
                .find_map(|l| l.strip_prefix(&key))
                .map(|v| v.parse::<u64>().unwrap())
        };
        assert_eq!(count("M0"), Some(1), "{out}");
        assert_eq!(count(&format!("M{}", MAX_METHODS + 5)), None, "{out}");
        assert_eq!(count("other"), Some(11), "{out}");
    }
}
