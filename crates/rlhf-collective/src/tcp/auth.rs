//! Who may join a communicator. With a [`CommSecret`] in the [`CommConfig`](crate::CommConfig),
//! every rendezvous connection (JOIN to rank 0, RING to the next rank) proves knowledge of the
//! secret both ways before anything else moves: the connecting side sends its hello with a
//! fresh nonce, the accepting side answers with its own nonce and an HMAC-SHA256 tag over the
//! whole exchange, and the connecting side answers with its tag. Nonces on both sides make a
//! recorded handshake useless; the hello (kind, rank, world size, address) is in the tagged
//! transcript, so a peer cannot claim another rank than the one it authenticated as. The
//! secret never crosses this socket: the driver hands it to every rank through the
//! token-authenticated JoinComm call.

use std::fmt;

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

/// Length of the nonces and tags.
pub(crate) const NONCE_BYTES: usize = 32;
pub(crate) const TAG_BYTES: usize = 32;
/// Shortest secret accepted.
const MIN_SECRET_BYTES: usize = 16;

/// Which side a tag is from, so one side's tag is never valid as the other's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Accepting,
    Connecting,
    /// The creator of a shared-memory segment (rank 0).
    ShmRoot,
    /// A rank that opened someone else's shared-memory segment.
    ShmRank,
}

impl Side {
    fn label(self) -> &'static [u8] {
        match self {
            Side::Accepting => b"rlhf-collective accepting side v1",
            Side::Connecting => b"rlhf-collective connecting side v1",
            Side::ShmRoot => b"rlhf-collective shm root v1",
            Side::ShmRank => b"rlhf-collective shm rank v1",
        }
    }
}

/// A communicator's shared secret. Its `Debug` never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct CommSecret(Vec<u8>);

impl CommSecret {
    /// 32 bytes from the operating system's random source.
    pub fn generate() -> Self {
        let mut b = vec![0u8; 32];
        // The system source does not fail on the platforms we run on; a failure here would
        // be a broken OS, and a predictable secret is worse than stopping.
        SystemRandom::new()
            .fill(&mut b)
            .expect("the operating system's random source failed");
        CommSecret(b)
    }

    /// A secret handed over by the driver; at least 16 bytes.
    pub fn from_bytes(b: &[u8]) -> Result<Self, String> {
        if b.len() < MIN_SECRET_BYTES {
            return Err(format!(
                "a communicator secret of {} bytes is too short; it must have at least {MIN_SECRET_BYTES}",
                b.len()
            ));
        }
        Ok(CommSecret(b.to_vec()))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    fn key(&self) -> hmac::Key {
        hmac::Key::new(hmac::HMAC_SHA256, &self.0)
    }

    /// This side's tag over the handshake transcript.
    pub(crate) fn tag(&self, side: Side, transcript: &[u8]) -> [u8; TAG_BYTES] {
        let mut ctx = hmac::Context::with_key(&self.key());
        ctx.update(side.label());
        ctx.update(transcript);
        let mut out = [0u8; TAG_BYTES];
        out.copy_from_slice(ctx.sign().as_ref());
        out
    }

    /// Checks the other side's tag (constant time).
    pub(crate) fn verify(&self, side: Side, transcript: &[u8], tag: &[u8]) -> bool {
        let mut msg = side.label().to_vec();
        msg.extend_from_slice(transcript);
        hmac::verify(&self.key(), &msg, tag).is_ok()
    }
}

impl fmt::Debug for CommSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CommSecret({} bytes, redacted)", self.0.len())
    }
}

/// A fresh nonce.
pub(crate) fn nonce() -> [u8; NONCE_BYTES] {
    let mut n = [0u8; NONCE_BYTES];
    SystemRandom::new()
        .fill(&mut n)
        .expect("the operating system's random source failed");
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_bind_secret_side_and_transcript() {
        let s = CommSecret::generate();
        let t = s.tag(Side::Accepting, b"hello+nonces");
        assert!(s.verify(Side::Accepting, b"hello+nonces", &t));
        assert!(!s.verify(Side::Connecting, b"hello+nonces", &t), "side");
        assert!(
            !s.verify(Side::Accepting, b"hello+nonceS", &t),
            "transcript"
        );
        let other = CommSecret::generate();
        assert_ne!(s, other);
        assert!(
            !other.verify(Side::Accepting, b"hello+nonces", &t),
            "secret"
        );
        assert!(
            !s.verify(Side::Accepting, b"hello+nonces", &t[..31]),
            "short tag"
        );
        assert_ne!(nonce(), nonce());
    }

    #[test]
    fn short_secrets_are_refused_and_debug_hides_the_bytes() {
        let e = CommSecret::from_bytes(&[7; 8]).unwrap_err();
        assert!(e.contains("8 bytes") && e.contains("16"), "{e}");
        let s = CommSecret::from_bytes(&[0xAB; 16]).unwrap();
        let d = format!("{s:?}");
        assert!(
            !d.contains("171") && !d.contains("ab") && d.contains("redacted"),
            "{d}"
        );
    }
}
