//! The head's durable state in redb: one table per kind of record, JSON values.
//! Heartbeat times are not persisted (they would cost a commit per beat); a restarted
//! head gives every node a fresh grace period instead.

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

/// Cheap to clone: the registry and the job manager share one database, since redb
/// allows a single opener per file.
#[derive(Clone)]
pub struct Store {
    db: std::sync::Arc<redb::Database>,
}

fn def(name: &str) -> TableDefinition<'_, &'static str, &'static [u8]> {
    TableDefinition::new(name)
}

fn db_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::internal(format!("state store: {what}: {e}"))
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
        let s = Store {
            db: std::sync::Arc::new(db),
        };
        // Create tables up front so reads never meet a missing table.
        let tx = s.db.begin_write().map_err(|e| db_err("begin", e))?;
        for t in [NODES, PGS, ACTORS, KV, META, JOBS] {
            tx.open_table(def(t)).map_err(|e| db_err(t, e))?;
        }
        tx.commit().map_err(|e| db_err("commit", e))?;
        Ok(s)
    }

    pub fn put<T: Serialize>(&self, table: &str, key: &str, value: &T) -> Result<()> {
        let bytes = serde_json::to_vec(value).map_err(|e| db_err("encode", e))?;
        self.put_raw(table, key, &bytes)
    }

    pub fn put_raw(&self, table: &str, key: &str, bytes: &[u8]) -> Result<()> {
        let tx = self.db.begin_write().map_err(|e| db_err("begin", e))?;
        {
            let mut t = tx.open_table(def(table)).map_err(|e| db_err(table, e))?;
            t.insert(key, bytes).map_err(|e| db_err("insert", e))?;
        }
        tx.commit().map_err(|e| db_err("commit", e))
    }

    pub fn delete(&self, table: &str, key: &str) -> Result<()> {
        let tx = self.db.begin_write().map_err(|e| db_err("begin", e))?;
        {
            let mut t = tx.open_table(def(table)).map_err(|e| db_err(table, e))?;
            t.remove(key).map_err(|e| db_err("remove", e))?;
        }
        tx.commit().map_err(|e| db_err("commit", e))
    }

    pub fn load_raw(&self, table: &str) -> Result<Vec<(String, Vec<u8>)>> {
        let tx = self.db.begin_read().map_err(|e| db_err("begin read", e))?;
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
