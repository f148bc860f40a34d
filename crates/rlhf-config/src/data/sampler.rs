//! The seeded, resumable order in which a job walks its dataset: per-epoch shuffles and a
//! cursor a checkpoint saves, so a resumed run takes exactly the next batch.

use serde::{Deserialize, Serialize};

use crate::error::{ConfigError, Result};

/// Position in the prompt stream; save it with a checkpoint and restore it
/// to get exactly the same next batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataCursor {
    /// Completed passes over the dataset.
    pub epoch: u64,
    /// Index of the next prompt in this epoch's order.
    pub position: usize,
    /// Dataset size the cursor was taken on (checked at restore).
    pub dataset_len: usize,
    /// Shuffle seed the cursor was taken with (checked at restore).
    pub seed: u64,
}

/// Deterministic batches of prompt indices, reshuffled every epoch.
///
/// Epoch `e`'s order is a Fisher–Yates permutation driven by SplitMix64
/// seeded from `(seed, e)`, so it depends only on the seed, the epoch and the
/// dataset size, not on library versions. Every prompt is drawn exactly once per epoch: when
/// the epoch's tail is shorter than a batch, the batch is completed from the next epoch's
/// order (no tail is dropped, so a dataset that the batch does not divide loses no prompt).
#[derive(Debug, Clone)]
pub struct PromptSampler {
    len: usize,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    epoch: u64,
    position: usize,
    order: Vec<usize>,
}

impl PromptSampler {
    /// A sampler over `len` prompts in batches of `batch_size`.
    pub fn new(len: usize, batch_size: usize, shuffle: bool, seed: u64) -> Result<Self> {
        if batch_size == 0 {
            return Err(ConfigError::Cursor(
                "batch size is 0; set training.global_batch_size > 0".into(),
            ));
        }
        if len < batch_size {
            return Err(ConfigError::Cursor(format!(
                "the dataset has {len} prompts, fewer than one batch of {batch_size} \
                 (training.global_batch_size); add prompts or lower the batch"
            )));
        }
        let mut s = Self {
            len,
            batch_size,
            shuffle,
            seed,
            epoch: 0,
            position: 0,
            order: Vec::new(),
        };
        s.order = s.epoch_order(0);
        Ok(s)
    }

    /// A sampler with the job's batch (`training.global_batch_size` as the
    /// actor resolves it), `data.shuffle` and seed.
    pub fn for_config(cfg: &crate::PpoConfig, dataset_len: usize) -> Result<Self> {
        Self::new(
            dataset_len,
            cfg.prompts_per_step() as usize,
            cfg.data.shuffle,
            cfg.data_seed(),
        )
    }

    /// The order of prompt indices in `epoch`.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = SplitMix64(self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            for i in (1..order.len()).rev() {
                let j = (rng.next() % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
        }
        order
    }

    /// The next batch of prompt indices: the rest of this epoch's order, then the next
    /// epoch's, as a batch needs.
    pub fn next_batch(&mut self) -> Vec<usize> {
        let mut batch = Vec::with_capacity(self.batch_size);
        while batch.len() < self.batch_size {
            if self.position >= self.len {
                self.epoch += 1;
                self.position = 0;
                self.order = self.epoch_order(self.epoch);
            }
            let take = (self.batch_size - batch.len()).min(self.len - self.position);
            batch.extend_from_slice(&self.order[self.position..self.position + take]);
            self.position += take;
        }
        batch
    }

    /// Where the stream stands (before the next batch).
    pub fn cursor(&self) -> DataCursor {
        DataCursor {
            epoch: self.epoch,
            position: self.position,
            dataset_len: self.len,
            seed: self.seed,
        }
    }

    /// Continues from a saved cursor; refuses one taken on another dataset
    /// size or seed, since the order would differ.
    pub fn restore(&mut self, c: DataCursor) -> Result<()> {
        if c.dataset_len != self.len || c.seed != self.seed {
            return Err(ConfigError::Cursor(format!(
                "saved for {} prompts with seed {}, but the dataset has {} prompts and the seed is {}; \
                 resume with the same data.path and data.seed / training.seed",
                c.dataset_len, c.seed, self.len, self.seed
            )));
        }
        if c.position > self.len {
            return Err(ConfigError::Cursor(format!(
                "position {} is past the end of a {}-prompt epoch",
                c.position, self.len
            )));
        }
        self.epoch = c.epoch;
        self.position = c.position;
        self.order = self.epoch_order(c.epoch);
        Ok(())
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and fixed forever, which
/// is what reproducible shuffles across versions need.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}
