//! The head's durable state in redb: one table per kind of record, JSON values.
//! Heartbeat times are not persisted (they would cost a commit per beat); a restarted
//! head gives every node a fresh grace period instead.
//!
//! Writes go through one writer thread that commits whatever has queued up in a single
//! transaction (group commit): a commit costs an fsync, and 10,000 nodes registering at
//! once would otherwise wait in line for 10,000 of them. A write is answered once its
//! transaction is durable, except registrations ([`Store::submit_lazy`]), which the cluster
//! rebuilds by itself and which reach the disk within a second.

use std::path::Path;

use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use rlhf_core::{Error, Result};
use serde::{de::DeserializeOwned, Serialize};

pub const NODES: &str = "nodes";
pub const PGS: &str = "placement_groups";
pub const ACTORS: &str = "actors";
pub const KV: &str = "kv";
pub const META: &str = "meta";
pub const JOBS: &str = "jobs";

/// One write of a batch.
pub enum Op {
    Put {
        table: &'static str,
        key: String,
        bytes: Vec<u8>,
    },
    Delete {
        table: &'static str,
        key: String,
    },
}

impl Op {
    pub fn put<T: Serialize>(table: &'static str, key: &str, value: &T) -> Result<Op> {
        Ok(Op::Put {
            table,
            key: key.to_string(),
            bytes: serde_json::to_vec(value).map_err(|e| db_err("encode", e))?,
        })
    }
}

enum Reply {
    Blocking(std::sync::mpsc::SyncSender<Result<()>>),
    Async(tokio::sync::oneshot::Sender<Result<()>>),
}

struct WriteRequest {
    ops: Vec<Op>,
    reply: Reply,
    /// Answered only after an fsync. Writes the cluster can rebuild (a node's registration:
    /// a head that lost it asks the node to register again) skip it and reach the disk with
    /// the next durable commit, or within [`LAZY_FLUSH`].
    durable: bool,
}

/// The longest a lazy write stays in memory only.
const LAZY_FLUSH: std::time::Duration = std::time::Duration::from_secs(1);

/// A submitted batch of writes; resolves once it is committed.
pub enum Commit {
    /// Answered already: nothing to write (a head without a store), or it could not be queued.
    Ready(Result<()>),
    Queued(tokio::sync::oneshot::Receiver<Result<()>>),
}

impl Commit {
    /// Nothing to wait for (a head without a store).
    pub fn done() -> Self {
        Commit::Ready(Ok(()))
    }

    pub async fn wait(self) -> Result<()> {
        match self {
            Commit::Ready(r) => r,
            Commit::Queued(rx) => rx
                .await
                .unwrap_or_else(|_| Err(db_err("writer", "the writer thread is gone"))),
        }
    }
}

struct Inner {
    db: std::sync::Arc<redb::Database>,
    tx: Option<std::sync::mpsc::Sender<WriteRequest>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The writer ends with its queue; joining it releases its handle on the database,
        // so the file can be opened again as soon as the store is dropped.
        self.tx.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// Cheap to clone: the registry and the job manager share one database, since redb
/// allows a single opener per file.
#[derive(Clone)]
pub struct Store {
    inner: std::sync::Arc<Inner>,
}

fn def(name: &str) -> TableDefinition<'_, &'static str, &'static [u8]> {
    TableDefinition::new(name)
}

fn db_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::internal(format!("state store: {what}: {e}"))
}

fn apply(db: &redb::Database, reqs: &[WriteRequest], durable: bool) -> Result<()> {
    let mut tx = db.begin_write().map_err(|e| db_err("begin", e))?;
    if !durable {
        tx.set_durability(redb::Durability::None)
            .map_err(|e| db_err("durability", e))?;
    }
    for op in reqs.iter().flat_map(|r| &r.ops) {
        match op {
            Op::Put { table, key, bytes } => {
                let mut t = tx.open_table(def(table)).map_err(|e| db_err(table, e))?;
                t.insert(key.as_str(), bytes.as_slice())
                    .map_err(|e| db_err("insert", e))?;
            }
            Op::Delete { table, key } => {
                let mut t = tx.open_table(def(table)).map_err(|e| db_err(table, e))?;
                t.remove(key.as_str()).map_err(|e| db_err("remove", e))?;
            }
        }
    }
    tx.commit().map_err(|e| db_err("commit", e))
}

/// The writer thread: takes one request, then every request queued behind it, and commits
/// them all at once (durably when any of them asks for it); lazy writes get a durable
/// commit of their own after [`LAZY_FLUSH`] without one.
fn writer(db: std::sync::Arc<redb::Database>, rx: std::sync::mpsc::Receiver<WriteRequest>) {
    use std::sync::mpsc::RecvTimeoutError;
    let mut lazy_since: Option<std::time::Instant> = None;
    loop {
        let first = match lazy_since {
            None => match rx.recv() {
                Ok(r) => r,
                Err(_) => return,
            },
            Some(t) => match rx.recv_timeout(LAZY_FLUSH.saturating_sub(t.elapsed())) {
                Ok(r) => r,
                Err(e) => {
                    if let Err(e) = apply(&db, &[], true) {
                        tracing::error!("state store: flushing lazy writes: {e}");
                    }
                    lazy_since = None;
                    if e == RecvTimeoutError::Disconnected {
                        return;
                    }
                    continue;
                }
            },
        };
        let mut reqs = vec![first];
        reqs.extend(rx.try_iter());
        let durable = reqs.iter().any(|r| r.durable);
        let out = apply(&db, &reqs, durable);
        lazy_since = match (durable, out.is_ok()) {
            (true, true) => None,
            _ => lazy_since.or_else(|| Some(std::time::Instant::now())),
        };
        for r in reqs {
            let o = out
                .as_ref()
                .map(|_| ())
                .map_err(|e| Error::new(e.kind(), e.to_string()));
            match r.reply {
                Reply::Blocking(tx) => {
                    let _ = tx.send(o);
                }
                Reply::Async(tx) => {
                    let _ = tx.send(o);
                }
            }
        }
    }
}

impl Store {
    pub fn open(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating --state-dir {}", dir.display()), e))?;
        let path = dir.join("head.redb");
        let db = redb::Database::create(&path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => Error::invalid(format!(
                "state database {} is in use by another rlhf-head; stop it first or pick another --state-dir",
                path.display()
            )),
            other => db_err(&format!("opening {}", path.display()), other),
        })?;
        let db = std::sync::Arc::new(db);
        // Create tables up front so reads never meet a missing table.
        let tx = db.begin_write().map_err(|e| db_err("begin", e))?;
        for t in [NODES, PGS, ACTORS, KV, META, JOBS] {
            tx.open_table(def(t)).map_err(|e| db_err(t, e))?;
        }
        tx.commit().map_err(|e| db_err("commit", e))?;
        let (wtx, wrx) = std::sync::mpsc::channel();
        let wdb = db.clone();
        let writer = std::thread::Builder::new()
            .name("rlhf-head-store".into())
            .spawn(move || writer(wdb, wrx))
            .map_err(|e| Error::io("starting the state store writer", e))?;
        Ok(Store {
            inner: std::sync::Arc::new(Inner {
                db,
                tx: Some(wtx),
                writer: Some(writer),
            }),
        })
    }

    fn send(&self, ops: Vec<Op>, reply: Reply, durable: bool) -> Result<()> {
        self.inner
            .tx
            .as_ref()
            .ok_or_else(|| db_err("writer", "closed"))?
            .send(WriteRequest {
                ops,
                reply,
                durable,
            })
            .map_err(|_| db_err("writer", "the writer thread is gone"))
    }

    /// Queues `ops` for the next group commit, without waiting for an fsync (for writes the
    /// cluster can rebuild); await the answer outside any lock.
    pub fn submit_lazy(&self, ops: Vec<Op>) -> Commit {
        let (tx, rx) = tokio::sync::oneshot::channel();
        match self.send(ops, Reply::Async(tx), false) {
            Ok(()) => Commit::Queued(rx),
            Err(e) => Commit::Ready(Err(e)),
        }
    }

    /// Writes `ops` and returns once they are committed.
    pub fn write(&self, ops: Vec<Op>) -> Result<()> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.send(ops, Reply::Blocking(tx), true)?;
        rx.recv()
            .unwrap_or_else(|_| Err(db_err("writer", "the writer thread is gone")))
    }

    pub fn put<T: Serialize>(&self, table: &'static str, key: &str, value: &T) -> Result<()> {
        self.write(vec![Op::put(table, key, value)?])
    }

    pub fn put_raw(&self, table: &'static str, key: &str, bytes: &[u8]) -> Result<()> {
        self.write(vec![Op::Put {
            table,
            key: key.to_string(),
            bytes: bytes.to_vec(),
        }])
    }

    pub fn delete(&self, table: &'static str, key: &str) -> Result<()> {
        self.write(vec![Op::Delete {
            table,
            key: key.to_string(),
        }])
    }

    pub fn load_raw(&self, table: &str) -> Result<Vec<(String, Vec<u8>)>> {
        let tx = self
            .inner
            .db
            .begin_read()
            .map_err(|e| db_err("begin read", e))?;
        let t = tx.open_table(def(table)).map_err(|e| db_err(table, e))?;
        let mut out = Vec::new();
        for row in t.iter().map_err(|e| db_err("iter", e))? {
            let (k, v) = row.map_err(|e| db_err("read", e))?;
            out.push((k.value().to_string(), v.value().to_vec()));
        }
        Ok(out)
    }

    /// Every record of `table` that decodes. One that does not (written by a buggy or older
    /// head, or damaged) is skipped with a warning naming it, so one bad record never keeps
    /// the head from starting.
    pub fn load<T: DeserializeOwned>(&self, table: &str) -> Result<Vec<T>> {
        Ok(self
            .load_raw(table)?
            .into_iter()
            .filter_map(|(k, v)| match serde_json::from_slice(&v) {
                Ok(t) => Some(t),
                Err(e) => {
                    tracing::warn!(
                        "state database: record {table}/{k} skipped, it does not decode: {e}"
                    );
                    None
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survives_reopen_and_refuses_second_opener() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = Store::open(dir.path()).unwrap();
            s.put(NODES, "n1", &vec![1, 2, 3]).unwrap();
            s.put(NODES, "n2", &vec![4]).unwrap();
            s.delete(NODES, "n2").unwrap();
            let e = Store::open(dir.path()).err().unwrap();
            assert!(e.to_string().contains("in use by another rlhf-head"), "{e}");
        }
        let s = Store::open(dir.path()).unwrap();
        let v: Vec<Vec<i32>> = s.load(NODES).unwrap();
        assert_eq!(v, vec![vec![1, 2, 3]]);
    }

    /// Lazy (registration) writes and durable ones from several threads all land, and the
    /// lazy ones are flushed when the store closes: the reopened file has every record.
    #[tokio::test]
    async fn group_commits_keep_every_write() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = Store::open(dir.path()).unwrap();
            let commits: Vec<Commit> = (0..200)
                .map(|i| s.submit_lazy(vec![Op::put(NODES, &format!("n{i:03}"), &i).unwrap()]))
                .collect();
            std::thread::scope(|sc| {
                for t in 0..4 {
                    let s = &s;
                    sc.spawn(move || {
                        for i in 0..25 {
                            s.put(ACTORS, &format!("a{t}-{i:02}"), &(t * 100 + i))
                                .unwrap();
                        }
                    });
                }
            });
            for c in commits {
                c.wait().await.unwrap();
            }
            s.delete(NODES, "n000").unwrap();
        }
        let s = Store::open(dir.path()).unwrap();
        let nodes: Vec<i32> = s.load(NODES).unwrap();
        assert_eq!(nodes, (1..200).collect::<Vec<_>>());
        let mut actors: Vec<i32> = s.load(ACTORS).unwrap();
        actors.sort();
        let want: Vec<i32> = (0..4)
            .flat_map(|t| (0..25).map(move |i| t * 100 + i))
            .collect();
        assert_eq!(actors, want);
    }

    #[test]
    fn a_record_that_does_not_decode_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(dir.path()).unwrap();
        s.put(NODES, "good", &vec![1.5f64]).unwrap();
        // What a NaN resource amount becomes in JSON, and a damaged record.
        s.put(NODES, "nan", &serde_json::json!([null])).unwrap();
        s.put(NODES, "text", &"not a list").unwrap();
        let v: Vec<Vec<f64>> = s.load(NODES).unwrap();
        assert_eq!(v, vec![vec![1.5]]);
    }
}
