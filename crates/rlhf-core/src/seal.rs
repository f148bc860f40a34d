//! Tamper evidence for checkpoints. A manifest (`durable.rs`) proves that the files of a
//! directory are the ones saved, against accidents; it cannot prove who saved them, since
//! anyone who can write the directory can write a matching manifest. So the driver signs
//! each checkpoint: `trainer_state.json` records the SHA-256 of every manifest below the
//! step directory (each manifest lists the SHA-256 of its files), and `checkpoint.hmac`
//! holds an HMAC-SHA256 of `trainer_state.json` under the checkpoint key (derived from the
//! cluster token, or a key file). A resume verifies the HMAC, then the manifests' digests,
//! then every role verifies its files: changing any byte of a signed checkpoint needs the
//! key. Errors name what differs, never the value that would have matched.

use std::collections::BTreeMap;
use std::path::Path;

use ring::{digest, hmac};
use serde::{Deserialize, Serialize};

use crate::durable::{hex, MANIFEST_FILE};
use crate::{Error, Result};

/// The signature file of a checkpoint step directory.
pub const MAC_FILE: &str = "checkpoint.hmac";
const ALGORITHM: &str = "HMAC-SHA256";
/// Deepest directory below a step directory that may hold a manifest.
const MAX_DEPTH: usize = 4;

/// The key checkpoints are signed with, derived from a secret (never the secret itself, so a
/// signature says nothing usable about the cluster token).
#[derive(Clone)]
pub struct CheckpointKey {
    key: hmac::Key,
    id: String,
    source: String,
}

impl std::fmt::Debug for CheckpointKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CheckpointKey(id {}, from {})", self.id, self.source)
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// SHA-256 of `bytes`, hex encoded.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(digest::digest(&digest::SHA256, bytes).as_ref())
}

impl CheckpointKey {
    /// Derives the key from `secret` (the cluster token, or a key file's contents);
    /// `source` says where it came from, for messages.
    pub fn from_secret(secret: &[u8], source: impl Into<String>) -> Self {
        let outer = hmac::Key::new(hmac::HMAC_SHA256, secret);
        let derived = hmac::sign(&outer, b"rlhf checkpoint signing key v1");
        let id_tag = hmac::sign(&outer, b"rlhf checkpoint key id v1");
        Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, derived.as_ref()),
            id: hex(&id_tag.as_ref()[..8]),
            source: source.into(),
        }
    }

    /// A short public name of the key: two checkpoints with the same id were signed with
    /// the same key.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Where the key came from (`the cluster token`, a file name).
    pub fn source(&self) -> &str {
        &self.source
    }

    fn tag(&self, bytes: &[u8]) -> String {
        hex(hmac::sign(&self.key, bytes).as_ref())
    }

    fn verify(&self, bytes: &[u8], tag: &str) -> bool {
        unhex(tag).is_some_and(|t| hmac::verify(&self.key, bytes, &t).is_ok())
    }
}

/// The contents of [`MAC_FILE`].
#[derive(Debug, Serialize, Deserialize)]
struct MacFile {
    algorithm: String,
    key_id: String,
    tag: String,
}

/// Signs `state_bytes` (the exact bytes of the trainer state file about to be written) and
/// writes [`MAC_FILE`] into `dir`, atomically.
pub fn sign(dir: &Path, state_bytes: &[u8], key: &CheckpointKey) -> Result<()> {
    let mac = MacFile {
        algorithm: ALGORITHM.into(),
        key_id: key.id.clone(),
        tag: key.tag(state_bytes),
    };
    let text = serde_json::to_string_pretty(&mac)
        .map_err(|e| Error::internal(format!("encoding {MAC_FILE}: {e}")))?;
    crate::durable::write_atomic(&dir.join(MAC_FILE), text.as_bytes())
}

/// Checks that `state_bytes` (read from `state_file` in `dir`) carry a valid signature under
/// `key`. The error says which of: unsigned, signed with another key, changed.
pub fn verify(dir: &Path, state_file: &str, state_bytes: &[u8], key: &CheckpointKey) -> Result<()> {
    let path = dir.join(MAC_FILE);
    let shown = dir.join(state_file);
    let shown = shown.display();
    let trust = "pass --trust-checkpoint only if you trust whoever could write it";
    let text = match crate::durable::read_regular(&path, 64 << 10) {
        Ok(t) => t,
        Err(_) => {
            return Err(Error::invalid(format!(
                "{shown} is not signed ({MAC_FILE} is missing or unreadable): it was written \
                 by a version before signed checkpoints, or its signature was removed; {trust}"
            )))
        }
    };
    let mac: MacFile = serde_json::from_slice(&text)
        .map_err(|e| Error::invalid(format!("{} is damaged ({e}); {trust}", path.display())))?;
    if mac.algorithm != ALGORITHM {
        return Err(Error::invalid(format!(
            "{}: signature algorithm {:?} is not supported (expected {ALGORITHM})",
            path.display(),
            mac.algorithm
        )));
    }
    if mac.key_id != key.id {
        // The id comes from the file: shown only when it has the shape ids have.
        let theirs = if mac.key_id.len() == 16 && mac.key_id.chars().all(|c| c.is_ascii_hexdigit())
        {
            format!("key id {}", mac.key_id)
        } else {
            "a malformed key id".to_string()
        };
        return Err(Error::invalid(format!(
            "{shown} was signed with another checkpoint key ({theirs}; this run's key, from {}, \
             has id {}): another cluster's token or key file wrote it; pass the key that did \
             with --checkpoint-key-file, or {trust}",
            key.source, key.id
        )));
    }
    if !key.verify(state_bytes, &mac.tag) {
        return Err(Error::invalid(format!(
            "{shown} changed after it was signed (its signature does not match): resume from \
             another checkpoint, or {trust}"
        )));
    }
    Ok(())
}

/// The SHA-256 of every manifest below the step directory `dir` (not following links), by
/// path relative to `dir` with `/` separators.
pub fn manifest_digests(dir: &Path) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    walk(dir, "", 0, &mut out)?;
    Ok(out)
}

fn walk(dir: &Path, rel: &str, depth: usize, out: &mut BTreeMap<String, String>) -> Result<()> {
    if depth > MAX_DEPTH {
        return Ok(());
    }
    let rd =
        std::fs::read_dir(dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
    for entry in rd {
        let entry = entry.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let ty = entry
            .file_type()
            .map_err(|e| Error::io(format!("reading {}", entry.path().display()), e))?;
        let child = if rel.is_empty() {
            name.clone()
        } else {
            format!("{rel}/{name}")
        };
        if ty.is_dir() {
            walk(&entry.path(), &child, depth + 1, out)?;
        } else if depth > 0 && name == MANIFEST_FILE {
            let bytes =
                crate::durable::read_regular(&entry.path(), crate::durable::MAX_MANIFEST_BYTES)?;
            out.insert(child, sha256_hex(&bytes));
        }
    }
    Ok(())
}

/// Checks the manifests found below `dir` against those the signed trainer state recorded:
/// the same set, each with the same digest.
pub fn check_manifests(dir: &Path, recorded: &BTreeMap<String, String>) -> Result<()> {
    let found = manifest_digests(dir)?;
    for (name, want) in recorded {
        match found.get(name) {
            None => {
                return Err(Error::invalid(format!(
                    "{} is missing: the signed checkpoint has it; resume from another checkpoint",
                    dir.join(name).display()
                )))
            }
            Some(got) if got != want => {
                return Err(Error::invalid(format!(
                    "{} changed after the checkpoint was signed: resume from another checkpoint",
                    dir.join(name).display()
                )))
            }
            Some(_) => {}
        }
    }
    if let Some(extra) = found.keys().find(|k| !recorded.contains_key(*k)) {
        return Err(Error::invalid(format!(
            "{} is not part of the signed checkpoint (added after it was saved): remove it or \
             resume from another checkpoint",
            dir.join(extra).display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_verify_and_say_what_is_wrong_without_the_right_value() {
        let d = tempfile::tempdir().unwrap();
        let key = CheckpointKey::from_secret(b"token-a", "the cluster token");
        let state = br#"{"global_step": 4}"#;
        sign(d.path(), state, &key).unwrap();
        verify(d.path(), "trainer_state.json", state, &key).unwrap();
        // Same key from the same secret: same id; another secret: another id.
        let again = CheckpointKey::from_secret(b"token-a", "x");
        assert_eq!(again.id(), key.id());
        verify(d.path(), "trainer_state.json", state, &again).unwrap();
        let other = CheckpointKey::from_secret(b"token-b", "key file k");
        assert_ne!(other.id(), key.id());
        let e = verify(d.path(), "trainer_state.json", state, &other)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("another checkpoint key") && e.contains("--checkpoint-key-file"),
            "{e}"
        );
        // One byte changed: refused, and the message holds no tag.
        let e = verify(
            d.path(),
            "trainer_state.json",
            br#"{"global_step": 5}"#,
            &key,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("changed after it was signed"), "{e}");
        let tag = key.tag(br#"{"global_step": 5}"#);
        assert!(!e.contains(&tag) && !e.contains(&key.tag(state)), "{e}");
        // A forged tag (right key id, wrong tag) is refused.
        let forged = MacFile {
            algorithm: ALGORITHM.into(),
            key_id: key.id().into(),
            tag: "00".repeat(32),
        };
        std::fs::write(
            d.path().join(MAC_FILE),
            serde_json::to_vec(&forged).unwrap(),
        )
        .unwrap();
        let e = verify(d.path(), "trainer_state.json", state, &key)
            .unwrap_err()
            .to_string();
        assert!(e.contains("changed after it was signed"), "{e}");
        // No signature at all.
        std::fs::remove_file(d.path().join(MAC_FILE)).unwrap();
        let e = verify(d.path(), "trainer_state.json", state, &key)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is not signed") && e.contains("--trust-checkpoint"),
            "{e}"
        );
    }

    #[test]
    fn manifests_are_bound_by_path_and_digest() {
        let d = tempfile::tempdir().unwrap();
        for part in ["actor", "critic"] {
            std::fs::create_dir_all(d.path().join(part)).unwrap();
            std::fs::write(d.path().join(part).join(MANIFEST_FILE), part).unwrap();
        }
        // The step directory's own files are not manifests of a part.
        std::fs::write(d.path().join(MANIFEST_FILE), "x").unwrap();
        let rec = manifest_digests(d.path()).unwrap();
        assert_eq!(
            rec.keys().cloned().collect::<Vec<_>>(),
            ["actor/manifest.json", "critic/manifest.json"]
        );
        check_manifests(d.path(), &rec).unwrap();
        std::fs::write(d.path().join("critic").join(MANIFEST_FILE), "changed").unwrap();
        let e = check_manifests(d.path(), &rec).unwrap_err().to_string();
        assert!(e.contains("critic/manifest.json changed"), "{e}");
        std::fs::write(d.path().join("critic").join(MANIFEST_FILE), "critic").unwrap();
        std::fs::create_dir_all(d.path().join("actor/rank1")).unwrap();
        std::fs::write(d.path().join("actor/rank1").join(MANIFEST_FILE), "new").unwrap();
        let e = check_manifests(d.path(), &rec).unwrap_err().to_string();
        assert!(
            e.contains("rank1/manifest.json is not part of the signed"),
            "{e}"
        );
        std::fs::remove_dir_all(d.path().join("actor")).unwrap();
        let e = check_manifests(d.path(), &rec).unwrap_err().to_string();
        assert!(e.contains("actor/manifest.json is missing"), "{e}");
    }
}
