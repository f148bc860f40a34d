//! The dashboard's routes against a stand-in head: Host/Origin guard, token rules,
//! the job page's data and plots, /metrics.

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

#[test]
fn origins_allowed() {
    let host = "10.1.2.3:8265";
    for ok in [
        "http://10.1.2.3:8265",
        "http://127.0.0.1:8265",
        "http://127.0.0.1",
        "http://localhost:3000",
        "http://[::1]:8265",
        "https://HEAD.local",
    ] {
        assert!(origin_allowed(ok, host, "head.local"), "{ok}");
    }
    for bad in [
        "http://6.6.6.6",
        "http://10.1.2.3:9999",
        "http://10.1.2.4:8265",
        "http://evil.example",
        "null",
        "http://",
        "",
    ] {
        assert!(!origin_allowed(bad, host, "head.local"), "{bad}");
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
    // Another site at a bare IP address is as foreign as one with a name.
    let (code, _) = get(
        &app,
        "/api/status",
        &[LOCAL, TOKEN, ("origin", "http://6.6.6.6")],
    )
    .await;
    assert_eq!(code, StatusCode::FORBIDDEN, "Origin: http://6.6.6.6");
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
