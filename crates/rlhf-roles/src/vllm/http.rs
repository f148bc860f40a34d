//! HTTP/1.1 over the Unix socket a vLLM server listens on. vLLM's API key guards only its
//! `/v1` routes; `/pause`, `/resume` and `/collective_rpc` (which reloads weights from any
//! path) answer anyone who reaches them. So the server gets no TCP port at all: it listens
//! on a socket in a directory only this user can enter, and this small client (one request
//! per connection, `Connection: close`, a deadline over the whole exchange) talks to it.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Largest answer read (a rollout's completions with their log-probs fit many times over).
const MAX_ANSWER: usize = 256 << 20;

/// A response: its status code and body.
pub(crate) struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Sends one request and reads the whole answer within `within`.
pub(crate) fn request(
    socket: &Path,
    method: &str,
    path: &str,
    api_key: &str,
    body: Option<&[u8]>,
    within: Duration,
) -> Result<Answer> {
    let deadline = Instant::now() + within;
    let what = || format!("vLLM {method} {path}");
    let mut s = UnixStream::connect(socket).map_err(|e| {
        Error::internal(format!(
            "{}: cannot connect to its socket {} ({e})",
            what(),
            socket.display()
        ))
    })?;
    let left = |d: Instant| {
        d.saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    s.set_write_timeout(Some(left(deadline)))
        .and_then(|()| s.set_read_timeout(Some(left(deadline))))
        .map_err(|e| Error::internal(format!("{}: {e}", what())))?;
    let body = body.unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {api_key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())
        .and_then(|()| s.write_all(body))
        .map_err(|e| Error::internal(format!("{}: sending the request: {e}", what())))?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 64 << 10];
    loop {
        if Instant::now() >= deadline {
            return Err(Error::internal(format!(
                "{}: no complete answer within {within:?}",
                what()
            )));
        }
        s.set_read_timeout(Some(left(deadline)))
            .map_err(|e| Error::internal(format!("{}: {e}", what())))?;
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                raw.extend_from_slice(&buf[..n]);
                if raw.len() > MAX_ANSWER {
                    return Err(Error::internal(format!(
                        "{}: the answer is larger than {MAX_ANSWER} bytes",
                        what()
                    )));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(Error::internal(format!(
                    "{}: reading the answer: {e}",
                    what()
                )))
            }
        }
    }
    parse(&raw).map_err(|why| Error::internal(format!("{}: {why}", what())))
}

/// Splits a raw HTTP/1.1 response into status and body (plain or chunked).
fn parse(raw: &[u8]) -> std::result::Result<Answer, String> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("the answer has no complete header")?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| "a header is not text")?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or("no status line")?;
    let chunked = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let mut body = &raw[end + 4..];
    if !chunked {
        return Ok(Answer {
            status,
            body: body.to_vec(),
        });
    }
    let mut out = Vec::new();
    loop {
        let eol = body
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a chunk size line is cut short")?;
        let size = std::str::from_utf8(&body[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next().unwrap_or("").trim(), 16).ok())
            .ok_or("a chunk size is not hexadecimal")?;
        body = &body[eol + 2..];
        if size == 0 {
            break;
        }
        if size.checked_add(2).is_none_or(|need| body.len() < need) {
            return Err("a chunk is cut short".into());
        }
        out.extend_from_slice(&body[..size]);
        body = &body[size + 2..];
    }
    Ok(Answer { status, body: out })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_and_chunked_answers_are_read() {
        let a = parse(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").unwrap();
        assert_eq!((a.status, a.body.as_slice()), (200, b"{}".as_slice()));
        let a = parse(
            b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((a.status, a.body.as_slice()), (400, b"abcde".as_slice()));
        assert!(parse(b"HTTP/1.1 200 OK\r\n").is_err());
        assert!(parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n").is_err());
    }
}
