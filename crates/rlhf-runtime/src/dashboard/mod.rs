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
                        "total": n["total"], "available": n["available"], "usage": n["usage"],
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
    let name = host_name(host);
    if host.trim().starts_with('[') {
        return name.parse::<std::net::Ipv6Addr>().is_ok();
    }
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

impl Dash {
    /// The job's metric series (none while it has no metrics file).
    fn series(&self, id: &str, files: &JobFiles) -> Arc<job::Series> {
        files
            .metrics
            .as_deref()
            .map(|p| self.series.read(id, p))
            .unwrap_or_default()
    }
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

/// The host of a `Host` header or an `Origin`'s authority, without its port.
fn host_name(host: &str) -> &str {
    let host = host.trim();
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split_once(']').map_or("", |(v6, _)| v6);
    }
    match host.rsplit_once(':') {
        Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
        _ => host,
    }
}

/// Whether a request that carries `Origin: <scheme>://<origin>` may be answered: the page is
/// the dashboard's own (the origin is the `Host` the request was sent to), or it is served
/// from loopback, `localhost` or the bound host. Any other site, an IP address among them,
/// is foreign.
pub fn origin_allowed(origin: &str, host: &str, bound_host: &str) -> bool {
    let Some((_, authority)) = origin.split_once("://") else {
        return false;
    };
    if authority.is_empty() {
        return false;
    }
    if authority.eq_ignore_ascii_case(host.trim()) {
        return true;
    }
    let name = host_name(authority);
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
        || (!bound_host.is_empty() && name.eq_ignore_ascii_case(bound_host))
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
            let foreign = origin.is_some_and(|o| !origin_allowed(o, host, &d.access.bound_host));
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
    let series = d.series(&id, &files);
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
    let series = d.series(&id, &files);
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
mod tests;
