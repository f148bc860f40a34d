//! The key/value cache of incremental decoding.

use candle_core::Tensor;

use crate::error::Result;

/// Per-layer key/value cache for incremental decoding; `k`, `v` are `[B, H_kv, S, D]`.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    pub(crate) layers: Vec<Option<(Tensor, Tensor)>>,
}

impl KvCache {
    /// An empty cache for `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
        }
    }

    /// Number of cached positions.
    pub fn seq_len(&self) -> usize {
        self.layers
            .first()
            .and_then(|l| l.as_ref())
            .and_then(|(k, _)| k.dim(2).ok())
            .unwrap_or(0)
    }

    /// Reorders or repeats batch rows: row `i` of the result is row `idx[i]` of the cache.
    pub fn select_rows(&mut self, idx: &Tensor) -> Result<()> {
        for (k, v) in self.layers.iter_mut().flatten() {
            *k = k.index_select(idx, 0)?;
            *v = v.index_select(idx, 0)?;
        }
        Ok(())
    }

    /// Drops every cached position.
    pub fn clear(&mut self) {
        for l in self.layers.iter_mut() {
            *l = None;
        }
    }
}
