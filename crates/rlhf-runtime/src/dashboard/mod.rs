//! The head's read-only web dashboard, on axum: `/` (the cluster), `/jobs/{id}` (one job:
//! live plots, latest metrics, samples, roles), their JSON under `/api/`, and Prometheus's
//! `/metrics` (`prom.rs`).
//!
//! It binds 127.0.0.1 unless `--dashboard-host` says otherwise, and still trusts no page
//! that reaches it: a request whose `Host` is not an IP address, `localhost` or the bound
//! host name is refused (a DNS-rebinding page cannot read it), and so is one whose `Origin`
//! is another site. Without the cluster token (`Authorization: Bearer ...`, which the page
//! asks for and keeps for the browser tab) it shows only the public shape of the cluster:
//! node states and resource totals, counts of actors and jobs. Actors, jobs, their errors
//! and log tails need the token. The page renders every value as text, never as markup.

mod job;
mod page;
mod plot;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use rlhf_core::{Error, Result};
use rlhf_proto::v1 as pb;
use serde_json::json;
use tokio_util::sync::CancellationToken;

pub use job::JobFiles;

use crate::prom::{JobLatest, RpcMetrics};

/// What the dashboard reads of the head (the head passes itself); it knows nothing else.
pub trait Source: Send + Sync + 'static {
    fn status(&self) -> pb::ClusterStatusResponse;
    /// The files of a job the head knows (`None`: no such job).
    fn job_files(&self, job_id: &str) -> Option<JobFiles>;
    /// The head's RPC latencies.
    fn rpc(&self) -> &RpcMetrics;
}

/// Who may read what.
#[derive(Clone)]
pub struct Access {
    /// The cluster token: with it, the full status.
    pub token: String,
    /// The host the dashboard was bound to (`--dashboard-host`), also accepted as `Host`.
    pub bound_host: String,
}

/// The part of the status anyone who reaches the dashboard may see.
pub fn public_status(full: &serde_json::Value) -> serde_json::Value {
    let nodes: Vec<_> = full["nodes"]
        .as_array()
        .map(|v| {
            v.iter()
                .map(|n| {
                    json!({
                        "node_id": n["node_id"], "state": n["state"],
                        "total": n["total"], "available": n["available"],
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let count = |k: &str| full[k].as_array().map_or(0, |v| v.len());
    json!({
        "protocol_version": full["protocol_version"],
        "now_ms": full["now_ms"],
        "nodes": nodes,
        "resources": full["resources"],
        "counts": {"actors": count("actors"), "jobs": count("jobs"), "placement_groups": count("placement_groups")},
    })
}

/// Whether a `Host` (or an `Origin`'s host) names this dashboard: an IP address, `localhost`
/// or the bound host name, with any port.
pub fn host_allowed(host: &str, bound_host: &str) -> bool {
    let host = host.trim();
    let name = if let Some(rest) = host.strip_prefix('[') {
        match rest.split_once(']') {
            Some((v6, _)) => return v6.parse::<std::net::Ipv6Addr>().is_ok(),
            None => return false,
        }
    } else {
        match host.rsplit_once(':') {
            Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
            _ => host,
        }
    };
    !name.is_empty()
        && (name.parse::<std::net::Ipv4Addr>().is_ok()
            || name.eq_ignore_ascii_case("localhost")
            || name.eq_ignore_ascii_case(bound_host))
}

/// Longest a request may take to arrive (its headers), and longest a connection is kept.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECTION_MAX: Duration = Duration::from_secs(300);

struct Dash {
    src: Arc<dyn Source>,
    access: Access,
    series: job::SeriesCache,
}

/// Whose request this is: no token (public parts only), the cluster token, or a wrong one.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Caller {
    Anonymous,
    Authorized,
    WrongToken,
}

fn caller(headers: &HeaderMap, access: &Access) -> Caller {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match bearer {
        None => Caller::Anonymous,
        Some(t) if crate::auth::constant_time_eq(t.as_bytes(), access.token.as_bytes()) => {
            Caller::Authorized
        }
        Some(_) => Caller::WrongToken,
    }
}

fn text(code: StatusCode, body: &str) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "text/plain")],
        format!("{body}\n"),
    )
        .into_response()
}

fn json_response(v: serde_json::Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// Refuses foreign hosts and origins (DNS rebinding, other sites) before any handler runs,
/// and marks every answer as not to be sniffed, framed or cached.
async fn guard(State(d): State<Arc<Dash>>, req: Request, next: Next) -> Response {
    let h = req.headers();
    let host = h.get(header::HOST).and_then(|v| v.to_str().ok());
    let mut resp = match host {
        Some(host) if host_allowed(host, &d.access.bound_host) => {
            let origin = h.get(header::ORIGIN).map(|o| o.to_str().unwrap_or(""));
            let foreign = origin.is_some_and(|o| {
                let host = o.split_once("://").map(|(_, h)| h).unwrap_or("");
                !host_allowed(host, &d.access.bound_host)
            });
            if foreign {
                text(
                    StatusCode::FORBIDDEN,
                    "requests from other sites are refused",
                )
            } else {
                next.run(req).await
            }
        }
        _ => text(
            StatusCode::FORBIDDEN,
            "the Host header must be an IP address, localhost or the dashboard's --dashboard-host",
        ),
    };
    let hs = resp.headers_mut();
    hs.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    hs.insert("x-frame-options", HeaderValue::from_static("DENY"));
    hs.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' blob:",
        ),
    );
    hs.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

fn html(body: String) -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], body).into_response()
}

async fn status_api(State(d): State<Arc<Dash>>, headers: HeaderMap) -> Response {
    let full = crate::status::to_json(&d.src.status());
    match caller(&headers, &d.access) {
        Caller::Authorized => json_response(full),
        Caller::Anonymous => json_response(public_status(&full)),
        Caller::WrongToken => text(StatusCode::UNAUTHORIZED, "wrong cluster token"),
    }
}

/// The answer that refuses a request without the token (`None`: it has it).
fn refused(headers: &HeaderMap, access: &Access) -> Option<Response> {
    match caller(headers, access) {
        Caller::Authorized => None,
        Caller::Anonymous => Some(text(
            StatusCode::UNAUTHORIZED,
            "this needs the cluster token (Authorization: Bearer ...)",
        )),
        Caller::WrongToken => Some(text(StatusCode::UNAUTHORIZED, "wrong cluster token")),
    }
}

fn no_job(id: &str) -> Response {
    text(
        StatusCode::NOT_FOUND,
        &format!("no job {id:?} on this head (`rlhf-head job list` shows them)"),
    )
}

async fn job_api(
    State(d): State<Arc<Dash>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Some(r) = refused(&headers, &d.access) {
        return r;
    }
    let status = d.src.status();
    // Jobs the head removed (--job-ttl) leave the cache too.
    d.series
        .retain(&|j: &str| status.jobs.iter().any(|x| x.job_id == j));
    let (Some(info), Some(files)) = (
        status.jobs.iter().find(|j| j.job_id == id),
        d.src.job_files(&id),
    ) else {
        return no_job(&id);
    };
    let series = files
        .metrics
        .as_deref()
        .map(|p| d.series.read(&id, p))
        .unwrap_or_default();
    let plots: Vec<_> = plot::PLOTS
        .iter()
        .enumerate()
        .filter_map(|(i, spec)| {
            let s = plot::series_of(spec, &series.metrics);
            (!s.is_empty()).then(|| {
                json!({
                    "index": i, "title": spec.title,
                    "series": s.iter().map(|(n, _)| n).collect::<Vec<_>>(),
                    "points": s.iter().map(|(_, p)| p.len()).max().unwrap_or(0),
                })
            })
        })
        .collect();
    let samples = files
        .samples
        .as_deref()
        .map(job::latest_samples)
        .unwrap_or_else(|| json!({"step": null, "rows": []}));
    json_response(json!({
        "job": crate::status::job_json(info),
        "step": series.last_step,
        "latest": series.latest,
        "plots": plots,
        "samples": samples,
        "roles": job::roles(&status, &id),
    }))
}

async fn plot_api(
    State(d): State<Arc<Dash>>,
    Path((id, index)): Path<(String, usize)>,
    headers: HeaderMap,
) -> Response {
    if let Some(r) = refused(&headers, &d.access) {
        return r;
    }
    let Some(files) = d.src.job_files(&id) else {
        return no_job(&id);
    };
    let Some(spec) = plot::PLOTS.get(index) else {
        return text(
            StatusCode::NOT_FOUND,
            &format!("no plot {index}: there are {}", plot::PLOTS.len()),
        );
    };
    let series = files
        .metrics
        .as_deref()
        .map(|p| d.series.read(&id, p))
        .unwrap_or_default();
    let lines = plot::series_of(spec, &series.metrics);
    let svg = plot::svg(spec.title, &lines, plot::size(lines.len()));
    ([(header::CONTENT_TYPE, "image/svg+xml")], svg).into_response()
}

async fn metrics_api(State(d): State<Arc<Dash>>, headers: HeaderMap) -> Response {
    let who = caller(&headers, &d.access);
    if who == Caller::WrongToken {
        return text(StatusCode::UNAUTHORIZED, "wrong cluster token");
    }
    let status = d.src.status();
    let full = who == Caller::Authorized;
    let mut jobs = Vec::new();
    if full {
        for j in status
            .jobs
            .iter()
            .filter(|j| j.state == pb::JobState::Running as i32)
        {
            let latest = d
                .src
                .job_files(&j.job_id)
                .and_then(|f| f.metrics)
                .and_then(|p| crate::head::jobs::last_nonempty_line(&p))
                .and_then(|l| JobLatest::from_record(&j.job_id, &l));
            jobs.extend(latest);
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        crate::prom::render(&status, d.src.rpc(), &jobs, full),
    )
        .into_response()
}

fn router(d: Arc<Dash>) -> Router {
    Router::new()
        .route("/", get(|| async { html(page::cluster()) }))
        .route("/index.html", get(|| async { html(page::cluster()) }))
        .route("/jobs/{id}", get(|| async { html(page::job()) }))
        .route("/api/status", get(status_api))
        .route("/api/jobs/{id}", get(job_api))
        .route("/api/jobs/{id}/plot/{index}", get(plot_api))
        .route("/metrics", get(metrics_api))
        .fallback(|| async { text(StatusCode::NOT_FOUND, "not found") })
        .layer(axum::middleware::from_fn_with_state(d.clone(), guard))
        .with_state(d)
}

/// Serves the dashboard on `listener` until `shutdown`; answers with the bound address.
pub fn serve(
    listener: tokio::net::TcpListener,
    src: Arc<dyn Source>,
    access: Access,
    shutdown: CancellationToken,
) -> Result<SocketAddr> {
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("dashboard address", e))?;
    let app = router(Arc::new(Dash {
        src,
        access,
        series: job::SeriesCache::default(),
    }));
    tokio::spawn(async move {
        loop {
            let (sock, _) = tokio::select! {
                _ = shutdown.cancelled() => break,
                r = listener.accept() => match r {
                    Ok(x) => x,
                    // Out of descriptors and the like: try again shortly, do not spin.
                    Err(_) => { tokio::time::sleep(Duration::from_millis(50)).await; continue }
                },
            };
            let svc = hyper_util::service::TowerToHyperService::new(app.clone());
            let sd = shutdown.clone();
            tokio::spawn(async move {
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .serve_connection(hyper_util::rt::TokioIo::new(sock), svc);
                let mut conn = std::pin::pin!(conn);
                tokio::select! {
                    _ = tokio::time::timeout(CONNECTION_MAX, conn.as_mut()) => {}
                    _ = sd.cancelled() => {
                        conn.as_mut().graceful_shutdown();
                        let _ = tokio::time::timeout(Duration::from_secs(1), conn).await;
                    }
                }
            });
        }
    });
    Ok(addr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    struct Fake {
        files: JobFiles,
        rpc: RpcMetrics,
    }

    impl Source for Fake {
        fn status(&self) -> pb::ClusterStatusResponse {
            pb::ClusterStatusResponse {
                protocol_version: 4,
                nodes: vec![pb::NodeInfo {
                    node_id: "n1".into(),
                    hostname: "<img src=x onerror=alert(1)>".into(),
                    ..Default::default()
                }],
                actors: vec![pb::ActorInfo {
                    actor_id: "a1".into(),
                    reason: "secret log tail".into(),
                    ..Default::default()
                }],
                jobs: vec![pb::JobInfo {
                    job_id: "job-1".into(),
                    state: pb::JobState::Running as i32,
                    ..Default::default()
                }],
                ..Default::default()
            }
        }
        fn job_files(&self, job_id: &str) -> Option<JobFiles> {
            (job_id == "job-1").then(|| self.files.clone())
        }
        fn rpc(&self) -> &RpcMetrics {
            &self.rpc
        }
    }

    fn app(dir: &std::path::Path) -> Router {
        let metrics = dir.join("metrics.jsonl");
        std::fs::write(
            &metrics,
            "{\"step\":1,\"objective/scores\":0.25,\"timing_s/gen\":0.1}\n{\"step\":2,\"objective/scores\":0.5,\"timing_s/gen\":0.2}\n",
        )
        .unwrap();
        let samples = dir.join("samples.jsonl");
        std::fs::write(
            &samples,
            "{\"step\":2,\"query\":\"q\",\"response\":\"r\",\"score\":1}\n",
        )
        .unwrap();
        let src = Fake {
            files: JobFiles {
                metrics: Some(metrics),
                samples: Some(samples),
            },
            rpc: RpcMetrics::default(),
        };
        src.rpc.observe("/rlhf.v1.HeadService/GetJob", "0", 0.001);
        router(Arc::new(Dash {
            src: Arc::new(src),
            access: Access {
                token: "tok".into(),
                bound_host: "head.local".into(),
            },
            series: job::SeriesCache::default(),
        }))
    }

    async fn get(app: &Router, path: &str, headers: &[(&str, &str)]) -> (StatusCode, String) {
        let mut req = Request::builder().uri(path);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = app
            .clone()
            .oneshot(req.body(axum::body::Body::empty()).unwrap())
            .await
            .unwrap();
        let code = resp.status();
        assert_eq!(resp.headers()["x-content-type-options"], "nosniff");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (code, String::from_utf8_lossy(&body).into_owned())
    }

    const LOCAL: (&str, &str) = ("host", "127.0.0.1:8265");
    const TOKEN: (&str, &str) = ("authorization", "Bearer tok");

    #[test]
    fn hosts_allowed() {
        for ok in [
            "127.0.0.1:8265",
            "localhost",
            "[::1]:80",
            "10.1.2.3",
            "HEAD.local:9",
        ] {
            assert!(host_allowed(ok, "head.local"), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8265",
            "",
            "[::1",
            "127.0.0.1.evil.example",
        ] {
            assert!(!host_allowed(bad, "head.local"), "{bad}");
        }
    }

    #[tokio::test]
    async fn hosts_origins_and_tokens() {
        let d = tempfile::tempdir().unwrap();
        let app = app(d.path());
        // DNS rebinding: the page of another site, resolved to this address.
        let (code, _) = get(&app, "/api/status", &[("host", "evil.example:8265")]).await;
        assert_eq!(code, StatusCode::FORBIDDEN);
        let (code, _) = get(&app, "/api/status", &[]).await;
        assert_eq!(code, StatusCode::FORBIDDEN, "no Host header");
        let (code, _) = get(
            &app,
            "/api/jobs/job-1",
            &[LOCAL, TOKEN, ("origin", "http://evil.example")],
        )
        .await;
        assert_eq!(code, StatusCode::FORBIDDEN);
        // Without the token: the public shape only, no actor, no log tail, no host name.
        let (code, body) = get(
            &app,
            "/api/status",
            &[LOCAL, ("origin", "http://127.0.0.1:8265")],
        )
        .await;
        assert_eq!(code, StatusCode::OK);
        assert!(
            !body.contains("secret log tail") && !body.contains("onerror"),
            "{body}"
        );
        assert!(body.contains("\"counts\"") && body.contains("n1"), "{body}");
        let (code, _) = get(
            &app,
            "/api/status",
            &[LOCAL, ("authorization", "Bearer no")],
        )
        .await;
        assert_eq!(code, StatusCode::UNAUTHORIZED);
        let (code, body) = get(&app, "/api/status", &[("host", "localhost"), TOKEN]).await;
        assert_eq!(code, StatusCode::OK);
        assert!(body.contains("secret log tail"), "{body}");
        // A job's data needs the token.
        for path in ["/api/jobs/job-1", "/api/jobs/job-1/plot/0"] {
            let (code, _) = get(&app, path, &[LOCAL]).await;
            assert_eq!(code, StatusCode::UNAUTHORIZED, "{path}");
        }
        // Prometheus: counts for anyone, latencies and job metrics with the token.
        let (code, m) = get(&app, "/metrics", &[LOCAL]).await;
        assert_eq!(code, StatusCode::OK);
        assert!(m.contains("rlhf_jobs{state=\"RUNNING\"} 1"), "{m}");
        assert!(!m.contains("job-1") && !m.contains("rpc_duration"), "{m}");
        let (_, m) = get(&app, "/metrics", &[LOCAL, TOKEN]).await;
        assert!(
            m.contains("rlhf_job_metric{job=\"job-1\",metric=\"objective/scores\"} 0.5"),
            "{m}"
        );
        assert!(m.contains("method=\"GetJob\""), "{m}");
        let (code, _) = get(&app, "/metrics", &[LOCAL, ("authorization", "Bearer no")]).await;
        assert_eq!(code, StatusCode::UNAUTHORIZED);
    }

    #[tokio::test]
    async fn job_page_data_and_plots() {
        let d = tempfile::tempdir().unwrap();
        let app = app(d.path());
        let (code, body) = get(&app, "/api/jobs/job-1", &[LOCAL, TOKEN]).await;
        assert_eq!(code, StatusCode::OK, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["step"], 2.0);
        assert_eq!(v["latest"]["objective/scores"], 0.5);
        assert_eq!(v["samples"]["rows"][0]["response"], "r");
        let plots = v["plots"].as_array().unwrap();
        let titles: Vec<_> = plots.iter().map(|p| p["title"].as_str().unwrap()).collect();
        assert_eq!(titles, ["scores", "time per phase (s)"], "{body}");
        assert_eq!(plots[0]["points"], 2);
        let idx = plots[1]["index"].as_u64().unwrap();
        let (code, svg) = get(
            &app,
            &format!("/api/jobs/job-1/plot/{idx}"),
            &[LOCAL, TOKEN],
        )
        .await;
        assert_eq!(code, StatusCode::OK);
        assert!(
            svg.contains("<polyline") && svg.contains("timing_s/gen"),
            "{svg}"
        );
        let (code, _) = get(&app, "/api/jobs/job-1/plot/99", &[LOCAL, TOKEN]).await;
        assert_eq!(code, StatusCode::NOT_FOUND);
        let (code, body) = get(&app, "/api/jobs/nope", &[LOCAL, TOKEN]).await;
        assert_eq!(code, StatusCode::NOT_FOUND);
        assert!(body.contains("job list"), "{body}");
    }

    #[tokio::test]
    async fn the_pages_render_values_as_text() {
        let d = tempfile::tempdir().unwrap();
        let app = app(d.path());
        for path in ["/", "/jobs/job-1"] {
            let (code, page) = get(&app, path, &[LOCAL]).await;
            assert_eq!(code, StatusCode::OK);
            assert!(!page.contains("innerHTML") && !page.contains("insertAdjacentHTML"));
            assert!(page.contains("textContent"));
        }
        let (code, _) = get(&app, "/nothing", &[LOCAL]).await;
        assert_eq!(code, StatusCode::NOT_FOUND);
    }
}
