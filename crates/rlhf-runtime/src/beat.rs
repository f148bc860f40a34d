//! Heartbeat datagrams: a node's beat over UDP, which the head reads in batches (a few
//! syscalls for hundreds of beats) where a beat on a gRPC stream costs it an HTTP/2 frame,
//! a task wakeup and a read each.
//!
//! A datagram is `RHB1 | len(node_id) u8 | node_id | seq u64 BE | HMAC-SHA256 tag (32)`,
//! the tag over everything before it, keyed by the secret the head handed the node at
//! registration (over the authenticated gRPC channel; a new one at every registration).
//! The head drops a datagram whose node it does not know, whose tag does not verify or whose
//! sequence number is not above the last one it took (a replay).

use std::net::SocketAddr;

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use rlhf_core::{Error, Result};

const MAGIC: &[u8; 4] = b"RHB1";
pub const KEY_BYTES: usize = 32;
const TAG_BYTES: usize = 32;
/// The longest datagram: magic, length, a 255-byte node id, seq, tag.
pub const MAX_DATAGRAM: usize = 4 + 1 + 255 + 8 + TAG_BYTES;

/// A fresh signing secret for one registration.
pub fn new_key() -> Result<Vec<u8>> {
    let mut k = vec![0u8; KEY_BYTES];
    SystemRandom::new()
        .fill(&mut k)
        .map_err(|_| Error::internal("the system random source failed"))?;
    Ok(k)
}

pub fn hmac_key(secret: &[u8]) -> hmac::Key {
    hmac::Key::new(hmac::HMAC_SHA256, secret)
}

/// One signed beat.
pub fn encode(node_id: &str, seq: u64, key: &hmac::Key) -> Result<Vec<u8>> {
    let id = node_id.as_bytes();
    let len = u8::try_from(id.len())
        .map_err(|_| Error::invalid(format!("node id '{node_id}' is over 255 bytes")))?;
    let mut out = Vec::with_capacity(4 + 1 + id.len() + 8 + TAG_BYTES);
    out.extend_from_slice(MAGIC);
    out.push(len);
    out.extend_from_slice(id);
    out.extend_from_slice(&seq.to_be_bytes());
    let tag = hmac::sign(key, &out);
    out.extend_from_slice(tag.as_ref());
    Ok(out)
}

/// A datagram split into its parts; not yet verified.
pub struct Beat<'a> {
    pub node_id: &'a str,
    pub seq: u64,
    signed: &'a [u8],
    tag: &'a [u8],
}

impl Beat<'_> {
    pub fn verify(&self, key: &hmac::Key) -> bool {
        hmac::verify(key, self.signed, self.tag).is_ok()
    }
}

/// Splits a datagram; None when it is not one.
pub fn parse(buf: &[u8]) -> Option<Beat<'_>> {
    let rest = buf.strip_prefix(MAGIC)?;
    let (&len, rest) = rest.split_first()?;
    let len = len as usize;
    if rest.len() != len + 8 + TAG_BYTES {
        return None;
    }
    let node_id = std::str::from_utf8(&rest[..len]).ok()?;
    let seq = u64::from_be_bytes(rest[len..len + 8].try_into().ok()?);
    let signed_len = buf.len() - TAG_BYTES;
    Some(Beat {
        node_id,
        seq,
        signed: &buf[..signed_len],
        tag: &buf[signed_len..],
    })
}

/// The node side: beats to the head's UDP port under one registration's key.
pub struct Sender {
    socket: tokio::net::UdpSocket,
    node_id: String,
    key: hmac::Key,
    seq: u64,
    pub to: SocketAddr,
}

impl Sender {
    /// A socket towards `head_address`'s host at `port`.
    pub async fn connect(
        head_address: &str,
        port: u16,
        node_id: &str,
        secret: &[u8],
    ) -> Result<Sender> {
        let host = head_address
            .rsplit_once(':')
            .map_or(head_address, |(h, _)| h)
            .trim_start_matches('[')
            .trim_end_matches(']');
        let to = tokio::net::lookup_host((host, port))
            .await
            .map_err(|e| Error::io(format!("resolving the head host {host}"), e))?
            .next()
            .ok_or_else(|| Error::invalid(format!("the head host {host} has no address")))?;
        let local: SocketAddr = if to.is_ipv6() {
            "[::]:0".parse().expect("literal")
        } else {
            "0.0.0.0:0".parse().expect("literal")
        };
        let socket = tokio::net::UdpSocket::bind(local)
            .await
            .map_err(|e| Error::io("binding the heartbeat socket", e))?;
        socket
            .connect(to)
            .await
            .map_err(|e| Error::io(format!("heartbeat socket towards {to}"), e))?;
        Ok(Sender {
            socket,
            node_id: node_id.to_string(),
            key: hmac_key(secret),
            seq: 0,
            to,
        })
    }

    /// Sends the next beat. A full socket buffer drops it (the next one follows).
    pub fn send(&mut self) -> Result<()> {
        self.seq += 1;
        let d = encode(&self.node_id, self.seq, &self.key)?;
        match self.socket.try_send(&d) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
            Err(e) => Err(Error::io(format!("sending a heartbeat to {}", self.to), e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagrams_verify_only_under_their_key_and_unchanged() {
        let secret = new_key().unwrap();
        let key = hmac_key(&secret);
        let d = encode("node-abc", 7, &key).unwrap();
        let b = parse(&d).unwrap();
        assert_eq!((b.node_id, b.seq), ("node-abc", 7));
        assert!(b.verify(&key));
        assert!(!b.verify(&hmac_key(&new_key().unwrap())));
        // Any flipped bit (id, seq or tag) fails: parse or verify.
        for i in 0..d.len() {
            let mut bad = d.clone();
            bad[i] ^= 1;
            assert!(
                parse(&bad).is_none_or(|b| !b.verify(&key)),
                "byte {i} flipped still verifies"
            );
        }
        assert!(parse(&d[..d.len() - 1]).is_none());
        assert!(parse(b"RHB1").is_none());
        assert!(encode(&"x".repeat(256), 1, &key).is_err());
    }
}
