//! The weight checksum: names, dtypes, shapes and bytes of a parameter list, in order,
//! over a whole list at once ([`checksum`]) or one parameter at a time ([`ChecksumStream`]).
//! Equal on trainer and rollout after a successful sync.

use rlhf_types::Checksum;

use crate::bucket::{hash_meta, Listed, ParamView};
use crate::error::{Error, Op, Result};

/// Checksum of a parameter list: names, dtypes, shapes and bytes, in order.
/// Equal on trainer and rollout after a successful sync.
pub fn checksum<P: ParamView>(params: &[P]) -> u64 {
    let mut h = ChecksumStream::new(params.len());
    for p in params {
        h.add(p);
    }
    h.hash.finish()
}

/// [`checksum`] of a list of `count` parameters given one at a time, so that they need not
/// exist at once (a ZeRO-3 model's, gathered a layer at a time).
pub struct ChecksumStream {
    hash: Checksum,
    count: usize,
    added: usize,
}

impl ChecksumStream {
    pub fn new(count: usize) -> Self {
        let mut hash = Checksum::new();
        hash.update_u64(count as u64);
        Self {
            hash,
            count,
            added: 0,
        }
    }

    /// The next parameter of the list.
    pub fn add<P: ParamView>(&mut self, p: &P) {
        self.add_listed(p, p.data());
    }

    /// The next parameter of the list, described by `p`, its bytes `data`.
    pub fn add_listed<P: Listed + ?Sized>(&mut self, p: &P, data: &[u8]) {
        hash_meta(&mut self.hash, p);
        self.hash.update_u64(data.len() as u64);
        self.hash.update(data);
        self.added += 1;
    }

    /// The checksum, once the `count` parameters announced were added.
    pub fn finish(self) -> Result<u64> {
        if self.added != self.count {
            return Err(Error::InvalidArgument {
                op: Op::WeightSync,
                detail: format!(
                    "a checksum of {} parameters was given {}",
                    self.count, self.added
                ),
            });
        }
        Ok(self.hash.finish())
    }
}
