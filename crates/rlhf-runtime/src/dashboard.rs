//! A tiny read-only HTTP dashboard: `/` (a page that polls) and `/api/status` (JSON, with
//! nodes, actors and jobs).
//! Binds 127.0.0.1 unless `--dashboard-host` says otherwise; it needs no token because it
//! only shows status and is local by default.

use std::net::SocketAddr;

use std::sync::Arc;

use rlhf_core::{Error, Result};
use rlhf_proto::v1 as pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// Where the dashboard reads the cluster's status from (the head passes its own); the
/// dashboard knows nothing else of the head.
pub type StatusSource = Arc<dyn Fn() -> pb::ClusterStatusResponse + Send + Sync>;

const PAGE: &str = r#"<!doctype html><html><head><meta charset="utf-8"><title>rlhf cluster</title>
<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}</style>
</head><body><h1>rlhf cluster</h1><div id="s">loading…</div><script>
async function load(){const s=await (await fetch('/api/status')).json();
let h='<h2>Nodes</h2><table><tr><th>node</th><th>host</th><th>state</th><th>total</th><th>available</th></tr>';
for(const n of s.nodes){h+=`<tr><td>${n.node_id}</td><td>${n.hostname} ${n.address}</td><td>${n.state} ${n.death_reason}</td><td>${JSON.stringify(n.total)}</td><td>${JSON.stringify(n.available)}</td></tr>`}
h+='</table><h2>Actors</h2><table><tr><th>actor</th><th>role</th><th>node</th><th>state</th><th>reason</th></tr>';
for(const a of s.actors){h+=`<tr><td>${a.actor_id}</td><td>${a.role}</td><td>${a.node_id}</td><td>${a.state}</td><td>${a.reason}</td></tr>`}
h+='</table><h2>Jobs</h2><table><tr><th>job</th><th>config</th><th>state</th><th>submitted</th><th>error</th></tr>';
for(const j of (s.jobs||[])){h+=`<tr><td>${j.job_id}</td><td>${j.config_name}</td><td>${j.state}</td><td>${new Date(j.submit_ms).toISOString()}</td><td>${j.error}</td></tr>`}
document.getElementById('s').innerHTML=h+'</table>'}
load();setInterval(load,2000);</script></body></html>"#;

pub fn serve(
    listener: tokio::net::TcpListener,
    status: StatusSource,
    shutdown: CancellationToken,
) -> Result<SocketAddr> {
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("dashboard address", e))?;
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = tokio::select! {
                _ = shutdown.cancelled() => break,
                r = listener.accept() => match r { Ok(x) => x, Err(_) => continue },
            };
            let status = Arc::clone(&status);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let n = match tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    sock.read(&mut buf),
                )
                .await
                {
                    Ok(Ok(n)) => n,
                    _ => return,
                };
                let req = String::from_utf8_lossy(&buf[..n]);
                let path = req.split_whitespace().nth(1).unwrap_or("/");
                let (status, ctype, body) = match path {
                    "/" | "/index.html" => ("200 OK", "text/html; charset=utf-8", PAGE.to_string()),
                    "/api/status" => (
                        "200 OK",
                        "application/json",
                        crate::status::to_json(&status()).to_string(),
                    ),
                    _ => ("404 Not Found", "text/plain", "not found\n".to_string()),
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
            });
        }
    });
    Ok(addr)
}
