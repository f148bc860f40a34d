//! Checkpoint snapshots held in a worker's memory (`checkpoint.memory_snapshot`): the wire
//! form of one checkpoint directory (a stream of `SnapshotChunk`s), checked as it arrives,
//! and the two client calls role processes make: push a directory just written to disk into
//! a peer worker's memory, and fetch one back into a local directory for a restart. The
//! worker's side is `crate::worker::snapshots`.
//!
//! A directory is flat (a checkpoint part: model files, optimizer state, manifest), so a
//! snapshot is a list of (file name, bytes). What a restart loads is checked against the
//! directory's own manifest, as a disk checkpoint is; the chunk checks here only make sure
//! that a peer cannot make a worker write outside the directory or hold more than it said.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use prost::bytes::Bytes;
use rlhf_core::{Error, FailureKind, Result};
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::worker_service_client::WorkerServiceClient;
use rlhf_proto::MAX_MESSAGE_BYTES;
use tokio_stream::StreamExt;

use crate::net::{self, ClientOptions};

/// Bytes of file data per chunk.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Longest directory or file name a snapshot accepts.
const MAX_NAME: usize = 255;

/// One snapshot directory in memory: its files in the order they were sent.
#[derive(Debug, Clone, Default)]
pub struct Files {
    pub files: Vec<(String, Bytes)>,
}

impl Files {
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|(_, b)| b.len() as u64).sum()
    }
}

/// A file or directory name inside a checkpoint step: letters, digits, `_ . -`, not `.` or
/// `..`, so nothing written from a snapshot lands outside its directory.
pub fn check_name(s: &str, field: &str) -> Result<()> {
    let ok = !s.is_empty()
        && s.len() <= MAX_NAME
        && s != "."
        && s != ".."
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{field} {:?} is not a checkpoint file or directory name (letters, digits, _ . - ; at most {MAX_NAME} bytes)",
            s.chars().take(80).collect::<String>()
        )))
    }
}

/// Checks a key as a worker stores it.
pub fn check_key(key: &pb::SnapshotKey) -> Result<()> {
    crate::head::validate::name(&key.job_id, "SnapshotKey.job_id", false)?;
    check_name(&key.part, "SnapshotKey.part")
}

/// `files` under `key` as chunks: the first names the key and the total, each file starts
/// with a chunk naming it (an empty file is that chunk alone).
pub fn chunks(key: pb::SnapshotKey, files: &Files) -> Vec<pb::SnapshotChunk> {
    let mut out = vec![pb::SnapshotChunk {
        key: Some(key),
        total_bytes: files.bytes(),
        ..Default::default()
    }];
    for (name, data) in &files.files {
        let mut first = true;
        let mut at = 0;
        while first || at < data.len() {
            let end = (at + CHUNK_BYTES).min(data.len());
            out.push(pb::SnapshotChunk {
                file: if first { name.clone() } else { String::new() },
                file_bytes: if first { data.len() as u64 } else { 0 },
                data: data.slice(at..end),
                ..Default::default()
            });
            first = false;
            at = end;
        }
    }
    out
}

/// Receives a chunk stream, checking every name and size as it comes: the first chunk
/// names the key and the total (`admit` may refuse it before anything else is read), a file
/// gets exactly the bytes its first chunk announced, and the files add up to the total.
pub struct Assembler {
    key: Option<pb::SnapshotKey>,
    total: u64,
    got: u64,
    /// Each file: name, bytes announced, bytes seen, the data kept.
    files: Vec<(String, u64, u64, Vec<Bytes>)>,
    /// Keep the data ([`Assembler::finish`] returns it) or only check it.
    keep: bool,
}

impl Assembler {
    pub fn new() -> Self {
        Self {
            key: None,
            total: 0,
            got: 0,
            files: Vec::new(),
            keep: true,
        }
    }

    /// Checks names and sizes without keeping the data (the caller stores it elsewhere).
    pub fn checking_only() -> Self {
        Self {
            keep: false,
            ..Self::new()
        }
    }

    /// Takes one chunk; returns the key and total when this was the first.
    pub fn push(&mut self, c: pb::SnapshotChunk) -> Result<Option<(pb::SnapshotKey, u64)>> {
        let Some(_) = &self.key else {
            let key = c.key.ok_or_else(|| {
                Error::invalid("a snapshot stream starts with a chunk that names its key")
            })?;
            check_key(&key)?;
            self.total = c.total_bytes;
            self.key = Some(key.clone());
            return Ok(Some((key, c.total_bytes)));
        };
        if c.key.is_some() {
            return Err(Error::invalid("a snapshot stream names its key only once"));
        }
        if !c.file.is_empty() {
            check_name(&c.file, "SnapshotChunk.file")?;
            self.close_file()?;
            if self.files.iter().any(|(n, ..)| *n == c.file) {
                return Err(Error::invalid(format!(
                    "the snapshot sends the file {} twice",
                    c.file
                )));
            }
            self.files.push((c.file, c.file_bytes, 0, Vec::new()));
        }
        let Some((name, want, have, parts)) = self.files.last_mut() else {
            return Err(Error::invalid("snapshot data before any file name"));
        };
        if *have + c.data.len() as u64 > *want {
            return Err(Error::invalid(format!(
                "the snapshot sends more than the {want} bytes it announced for {name}"
            )));
        }
        *have += c.data.len() as u64;
        self.got += c.data.len() as u64;
        if self.got > self.total {
            return Err(Error::invalid(format!(
                "the snapshot sends more than the {} bytes it announced",
                self.total
            )));
        }
        if self.keep && !c.data.is_empty() {
            parts.push(c.data);
        }
        Ok(None)
    }

    /// Bytes received so far.
    pub fn received(&self) -> u64 {
        self.got
    }

    fn close_file(&self) -> Result<()> {
        if let Some((name, want, have, _)) = self.files.last() {
            if have != want {
                return Err(Error::invalid(format!(
                    "the snapshot's file {name} has {have} of the {want} bytes announced"
                )));
            }
        }
        Ok(())
    }

    /// The whole directory, once the stream ended.
    pub fn finish(self) -> Result<(pb::SnapshotKey, Files)> {
        let key = self
            .key
            .clone()
            .ok_or_else(|| Error::invalid("an empty snapshot stream"))?;
        self.close_file()?;
        if self.got != self.total {
            return Err(Error::invalid(format!(
                "the snapshot ended after {} of the {} bytes announced",
                self.got, self.total
            )));
        }
        let files = self
            .files
            .into_iter()
            .map(|(name, _, _, parts)| {
                let data = match parts.len() {
                    0 => Bytes::new(),
                    1 => parts.into_iter().next().unwrap_or_default(),
                    _ => Bytes::from(parts.concat()),
                };
                (name, data)
            })
            .collect();
        Ok((key, Files { files }))
    }
}

impl Default for Assembler {
    fn default() -> Self {
        Self::new()
    }
}

async fn worker_client(
    address: &str,
    opts: &ClientOptions,
) -> Result<WorkerServiceClient<net::AuthChannel>> {
    Ok(WorkerServiceClient::new(net::connect(address, opts).await?)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES))
}

fn deadline(what: &str, address: &str, t: Duration) -> Error {
    Error::new(
        FailureKind::Timeout,
        format!(
            "{what} with the worker at {address} did not finish within {:.0} s",
            t.as_secs_f64()
        ),
    )
}

/// The regular files of `dir` (not recursing), by name.
fn dir_files(dir: &Path) -> Result<Vec<(String, PathBuf, u64)>> {
    let mut out = Vec::new();
    let rd =
        std::fs::read_dir(dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
    for entry in rd {
        let entry = entry.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
        let path = entry.path();
        let meta = entry
            .metadata()
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        if meta.is_file() {
            let name = entry.file_name().to_string_lossy().into_owned();
            check_name(&name, "a checkpoint file")?;
            out.push((name, path, meta.len()));
        }
    }
    out.sort();
    Ok(out)
}

/// Pushes the files of `dir` to the worker at `address` under `key`, read a chunk at a time
/// on a thread of their own; returns the bytes sent. Fails after `timeout`.
pub async fn push_dir(
    address: &str,
    opts: &ClientOptions,
    key: pb::SnapshotKey,
    dir: &Path,
    timeout: Duration,
) -> Result<u64> {
    check_key(&key)?;
    let files = dir_files(dir)?;
    let total: u64 = files.iter().map(|(_, _, n)| n).sum();
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::SnapshotChunk>(4);
    let first = pb::SnapshotChunk {
        key: Some(key),
        total_bytes: total,
        ..Default::default()
    };
    let reader = std::thread::Builder::new()
        .name("rlhf-snapshot-read".into())
        .spawn(move || -> Result<()> {
            if tx.blocking_send(first).is_err() {
                return Ok(());
            }
            for (name, path, len) in files {
                let mut f = std::fs::File::open(&path)
                    .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
                let mut left = len;
                let mut head = true;
                while head || left > 0 {
                    let n = left.min(CHUNK_BYTES as u64) as usize;
                    let mut buf = vec![0u8; n];
                    f.read_exact(&mut buf)
                        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
                    let chunk = pb::SnapshotChunk {
                        file: if head { name.clone() } else { String::new() },
                        file_bytes: if head { len } else { 0 },
                        data: Bytes::from(buf),
                        ..Default::default()
                    };
                    if tx.blocking_send(chunk).is_err() {
                        return Ok(()); // the call ended; its error says why
                    }
                    head = false;
                    left -= n as u64;
                }
            }
            Ok(())
        })
        .map_err(|e| Error::io("starting the snapshot reader thread", e))?;
    let call = async {
        let mut c = worker_client(address, opts).await?;
        let r = c
            .put_snapshot(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?;
        Ok::<_, Error>(r.into_inner().bytes)
    };
    let sent = tokio::time::timeout(timeout, call).await;
    let read = reader
        .join()
        .map_err(|_| Error::internal("the snapshot reader thread panicked"))?;
    let sent = sent.map_err(|_| deadline("pushing a snapshot", address, timeout))??;
    read?;
    Ok(sent)
}

/// Fetches the snapshot `key` from the worker at `address` into the directory `dest`
/// (created; files written as they arrive); returns its bytes. Fails after `timeout`.
pub async fn fetch_into(
    address: &str,
    opts: &ClientOptions,
    key: pb::SnapshotKey,
    dest: &Path,
    timeout: Duration,
) -> Result<u64> {
    use tokio::io::AsyncWriteExt;
    check_key(&key)?;
    let call = async {
        let mut c = worker_client(address, opts).await?;
        let mut stream = c
            .get_snapshot(pb::GetSnapshotRequest {
                key: Some(key.clone()),
            })
            .await?
            .into_inner();
        tokio::fs::create_dir_all(dest)
            .await
            .map_err(|e| Error::io(format!("creating {}", dest.display()), e))?;
        // The assembler checks names and sizes; the bytes go to the files, not into it.
        let mut check = Assembler::checking_only();
        let mut file: Option<(tokio::fs::File, PathBuf)> = None;
        while let Some(c) = stream.next().await {
            let c = c?;
            let (data, name) = (c.data.clone(), c.file.clone());
            check.push(c)?;
            if !name.is_empty() {
                if let Some((mut f, p)) = file.take() {
                    f.flush()
                        .await
                        .map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
                }
                let p = dest.join(&name);
                let f = tokio::fs::File::create(&p)
                    .await
                    .map_err(|e| Error::io(format!("creating {}", p.display()), e))?;
                file = Some((f, p));
            }
            if !data.is_empty() {
                let Some((f, p)) = file.as_mut() else {
                    return Err(Error::invalid("snapshot data before any file name"));
                };
                f.write_all(&data)
                    .await
                    .map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
            }
        }
        if let Some((mut f, p)) = file.take() {
            f.flush()
                .await
                .map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
        }
        let got = check.received();
        check.finish()?;
        Ok::<_, Error>(got)
    };
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| deadline("fetching a snapshot", address, timeout))?
}

/// Where a restart puts fetched snapshots: under `/dev/shm` (memory) when it has room for
/// `bytes` with a quarter to spare, else the temporary directory.
pub fn restore_root(bytes: u64) -> PathBuf {
    let shm = Path::new("/dev/shm");
    let room = nix::sys::statvfs::statvfs(shm)
        .map(|s| s.blocks_available().saturating_mul(s.fragment_size()))
        .unwrap_or(0);
    if room > bytes.saturating_add(bytes / 4) {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> pb::SnapshotKey {
        pb::SnapshotKey {
            job_id: "job-1".into(),
            step: 4,
            part: "actor".into(),
        }
    }

    fn files() -> Files {
        let big: Vec<u8> = (0..CHUNK_BYTES * 2 + 17).map(|i| (i % 251) as u8).collect();
        Files {
            files: vec![
                ("model.safetensors".into(), Bytes::from(big)),
                ("empty.txt".into(), Bytes::new()),
                ("manifest.json".into(), Bytes::from_static(b"{}")),
            ],
        }
    }

    #[test]
    fn chunks_reassemble_to_the_same_files() {
        let f = files();
        let c = chunks(key(), &f);
        assert_eq!(
            c.len(),
            1 + 3 + 1 + 1,
            "a header, 3 chunks, an empty file, one small"
        );
        assert!(c.iter().all(|c| c.data.len() <= CHUNK_BYTES));
        let mut a = Assembler::new();
        let mut first = None;
        for ch in c {
            if let Some(k) = a.push(ch).unwrap() {
                first = Some(k);
            }
        }
        assert_eq!(first.unwrap().1, f.bytes());
        let (k, back) = a.finish().unwrap();
        assert_eq!(k, key());
        assert_eq!(back.files, f.files);
    }

    #[test]
    fn bad_streams_are_refused_by_name() {
        let feed = |c: Vec<pb::SnapshotChunk>| -> Result<()> {
            let mut a = Assembler::new();
            for ch in c {
                a.push(ch)?;
            }
            a.finish().map(|_| ())
        };
        let good = chunks(key(), &files());
        // A file name that climbs out of the directory.
        let mut c = good.clone();
        c[1].file = "../evil".into();
        let e = feed(c).unwrap_err().to_string();
        assert!(
            e.contains("SnapshotChunk.file") && e.contains("../evil"),
            "{e}"
        );
        // A part name with a slash.
        let mut c = good.clone();
        c[0].key.as_mut().unwrap().part = "actor/../../x".into();
        assert!(feed(c)
            .unwrap_err()
            .to_string()
            .contains("SnapshotKey.part"));
        // More bytes than announced for a file.
        let mut c = good.clone();
        c[1].file_bytes = 10;
        assert!(feed(c)
            .unwrap_err()
            .to_string()
            .contains("more than the 10 bytes"));
        // A stream cut short.
        let mut c = good.clone();
        c.pop();
        let e = feed(c).unwrap_err().to_string();
        assert!(e.contains("ended after") || e.contains("has 0 of"), "{e}");
        // No key first.
        let c = good[1..].to_vec();
        assert!(feed(c).unwrap_err().to_string().contains("names its key"));
        // The same file twice.
        let mut c = good.clone();
        c[5].file = "empty.txt".into();
        assert!(feed(c).unwrap_err().to_string().contains("twice"));
    }

    #[test]
    fn names_stay_inside_the_directory() {
        for ok in ["actor", "actor.rank-1", "model-00001-of-00002.safetensors"] {
            check_name(ok, "n").unwrap();
        }
        for bad in ["", ".", "..", "a/b", "a\\b", "x y", &"a".repeat(300)] {
            assert!(check_name(bad, "n").is_err(), "{bad:?}");
        }
    }
}
