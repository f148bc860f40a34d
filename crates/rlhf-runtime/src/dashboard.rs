//! A tiny read-only HTTP dashboard: `/` (a page that polls) and `/api/status` (JSON).
//!
//! It binds 127.0.0.1 unless `--dashboard-host` says otherwise, and still trusts no page
//! that reaches it: a request whose `Host` is not an IP address, `localhost` or the bound
//! host name is refused (a DNS-rebinding page cannot read it), and so is one whose `Origin`
//! is another site. Without the cluster token (`Authorization: Bearer ...`, which the page
//! asks for and keeps for the browser tab) it shows only the public shape of the cluster:
//! node states and resource totals, counts of actors and jobs. Actors, jobs, their errors
//! and log tails need the token. The page renders every value as text, never as markup.

use std::net::SocketAddr;
use std::sync::Arc;

use rlhf_core::{Error, Result};
use rlhf_proto::v1 as pb;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// Where the dashboard reads the cluster's status from (the head passes its own); the
/// dashboard knows nothing else of the head.
pub type StatusSource = Arc<dyn Fn() -> pb::ClusterStatusResponse + Send + Sync>;

/// Who may read what.
#[derive(Clone)]
pub struct Access {
    /// The cluster token: with it, the full status.
    pub token: String,
    /// The host the dashboard was bound to (`--dashboard-host`), also accepted as `Host`.
    pub bound_host: String,
}

const PAGE: &str = r#"<!doctype html><html><head><meta charset="utf-8"><title>rlhf cluster</title>
<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}</style>
</head><body><h1>rlhf cluster</h1>
<form id="f">cluster token (kept for this tab only): <input id="t" type="password" autocomplete="off"> <button>show all</button></form>
<div id="s">loading…</div><script>
'use strict';
const el=(tag,text)=>{const e=document.createElement(tag);if(text!==undefined)e.textContent=String(text);return e};
function table(title,head,rows){const d=el('div');d.append(el('h2',title));const t=el('table');const tr=el('tr');
for(const h of head)tr.append(el('th',h));t.append(tr);
for(const r of rows){const x=el('tr');for(const c of r)x.append(el('td',c));t.append(x)}d.append(t);return d}
document.getElementById('f').addEventListener('submit',ev=>{ev.preventDefault();
sessionStorage.setItem('rlhf-token',document.getElementById('t').value);load()});
async function load(){const tok=sessionStorage.getItem('rlhf-token');
const r=await fetch('/api/status',{headers:tok?{'Authorization':'Bearer '+tok}:{}});const s=await r.json();
const out=el('div');
out.append(table('Nodes',['node','host','state','total','available'],s.nodes.map(n=>
[n.node_id,(n.hostname||'')+' '+(n.address||''),n.state+' '+(n.death_reason||''),JSON.stringify(n.total),JSON.stringify(n.available)])));
if(s.actors){out.append(table('Actors',['actor','role','node','state','reason'],s.actors.map(a=>[a.actor_id,a.role,a.node_id,a.state,a.reason])));
out.append(table('Jobs',['job','config','state','submitted','error'],(s.jobs||[]).map(j=>[j.job_id,j.config_name,j.state,new Date(j.submit_ms).toISOString(),j.error])))}
else{out.append(el('p',`${s.counts.actors} actors, ${s.counts.jobs} jobs; enter the cluster token to see them`))}
document.getElementById('s').replaceChildren(out)}
load();setInterval(load,2000);</script></body></html>"#;

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

struct Req<'a> {
    path: &'a str,
    host: Option<&'a str>,
    origin: Option<&'a str>,
    bearer: Option<&'a str>,
}

fn parse(text: &str) -> Req<'_> {
    let mut lines = text.split("\r\n");
    let path = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("/");
    let mut r = Req {
        path: path.split('?').next().unwrap_or("/"),
        host: None,
        origin: None,
        bearer: None,
    };
    for l in lines {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        let v = v.trim();
        match k.trim().to_ascii_lowercase().as_str() {
            "host" => r.host = Some(v),
            "origin" => r.origin = Some(v),
            "authorization" => r.bearer = v.strip_prefix("Bearer "),
            _ => {}
        }
    }
    r
}

/// The answer to one request: status line, content type, body.
pub fn respond(
    text: &str,
    access: &Access,
    status: &dyn Fn() -> pb::ClusterStatusResponse,
) -> (&'static str, &'static str, String) {
    let req = parse(text);
    let forbidden = |why: &str| ("403 Forbidden", "text/plain", format!("{why}\n"));
    match req.host {
        Some(h) if host_allowed(h, &access.bound_host) => {}
        _ => return forbidden(
            "the Host header must be an IP address, localhost or the dashboard's --dashboard-host",
        ),
    }
    if let Some(o) = req.origin {
        let host = o.split_once("://").map(|(_, h)| h).unwrap_or("");
        if !host_allowed(host, &access.bound_host) {
            return forbidden("requests from other sites are refused");
        }
    }
    match req.path {
        "/" | "/index.html" => ("200 OK", "text/html; charset=utf-8", PAGE.to_string()),
        "/api/status" => {
            let full = crate::status::to_json(&status());
            let authorized = req.bearer.is_some_and(|t| {
                crate::auth::constant_time_eq(t.as_bytes(), access.token.as_bytes())
            });
            let body = if authorized {
                full
            } else if req.bearer.is_some() {
                return (
                    "401 Unauthorized",
                    "text/plain",
                    "wrong cluster token\n".into(),
                );
            } else {
                public_status(&full)
            };
            ("200 OK", "application/json", body.to_string())
        }
        _ => ("404 Not Found", "text/plain", "not found\n".to_string()),
    }
}

pub fn serve(
    listener: tokio::net::TcpListener,
    status: StatusSource,
    access: Access,
    shutdown: CancellationToken,
) -> Result<SocketAddr> {
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("dashboard address", e))?;
    let access = Arc::new(access);
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = tokio::select! {
                _ = shutdown.cancelled() => break,
                r = listener.accept() => match r { Ok(x) => x, Err(_) => continue },
            };
            let status = Arc::clone(&status);
            let access = Arc::clone(&access);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let n = match tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    sock.read(&mut buf),
                )
                .await
                {
                    Ok(Ok(n)) => n,
                    _ => return,
                };
                let text = String::from_utf8_lossy(&buf[..n]);
                let (code, ctype, body) = respond(&text, &access, status.as_ref());
                let resp = format!(
                    "HTTP/1.1 {code}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nX-Content-Type-Options: nosniff\r\nContent-Security-Policy: default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    sock.write_all(resp.as_bytes()),
                )
                .await;
            });
        }
    });
    Ok(addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status() -> pb::ClusterStatusResponse {
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
            ..Default::default()
        }
    }

    fn get(path: &str, headers: &str) -> (&'static str, String) {
        let access = Access {
            token: "tok".into(),
            bound_host: "head.local".into(),
        };
        let text = format!("GET {path} HTTP/1.1\r\n{headers}\r\n");
        let (code, _, body) = respond(&text, &access, &status);
        (code, body)
    }

    #[test]
    fn hosts_origins_and_tokens() {
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
        // DNS rebinding: the page of another site, resolved to this address.
        let (code, _) = get("/api/status", "Host: evil.example:8265\r\n");
        assert_eq!(code, "403 Forbidden");
        let (code, _) = get("/api/status", "");
        assert_eq!(code, "403 Forbidden", "no Host header");
        let (code, _) = get(
            "/api/status",
            "Host: 127.0.0.1:8265\r\nOrigin: http://evil.example\r\n",
        );
        assert_eq!(code, "403 Forbidden");
        // Without the token: the public shape only, no actor, no log tail, no host name.
        let (code, body) = get(
            "/api/status",
            "Host: 127.0.0.1:8265\r\nOrigin: http://127.0.0.1:8265\r\n",
        );
        assert_eq!(code, "200 OK");
        assert!(
            !body.contains("secret log tail") && !body.contains("onerror"),
            "{body}"
        );
        assert!(body.contains("\"counts\"") && body.contains("n1"), "{body}");
        let (code, _) = get(
            "/api/status",
            "Host: localhost\r\nAuthorization: Bearer nope\r\n",
        );
        assert_eq!(code, "401 Unauthorized");
        let (code, body) = get(
            "/api/status",
            "host: localhost\r\nauthorization: Bearer tok\r\n",
        );
        assert_eq!(code, "200 OK");
        assert!(body.contains("secret log tail"), "{body}");
    }

    #[test]
    fn the_page_renders_values_as_text() {
        let (code, page) = get("/", "Host: 127.0.0.1\r\n");
        assert_eq!(code, "200 OK");
        assert!(!page.contains("innerHTML") && !page.contains("insertAdjacentHTML"));
        assert!(page.contains("textContent"));
    }
}
