//! A fast non-cryptographic 64-bit content hash for weight checksums.
//!
//! Four independent multiply-rotate lanes over little-endian 8-byte words (so the
//! CPU can overlap them), a length-aware merge and a final avalanche. Stable across
//! platforms and releases: it is compared between processes and may be logged.
//! Not collision resistant against an adversary; it detects corruption and
//! missed updates.

const K1: u64 = 0x9E37_79B9_7F4A_7C15;
const K2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const K3: u64 = 0x1656_67B1_9E37_79F9;
const BLOCK: usize = 32;

#[inline(always)]
fn round(acc: u64, word: u64) -> u64 {
    acc.wrapping_add(word.wrapping_mul(K2))
        .rotate_left(31)
        .wrapping_mul(K1)
}

#[inline(always)]
fn word(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// Streaming 64-bit checksum; feed bytes with [`Checksum::update`].
#[derive(Debug, Clone)]
pub struct Checksum {
    lanes: [u64; 4],
    pending: [u8; BLOCK],
    pending_len: usize,
    total: u64,
}

impl Default for Checksum {
    fn default() -> Self {
        Self::new()
    }
}

impl Checksum {
    /// An empty checksum.
    pub fn new() -> Self {
        Self {
            lanes: [K1.wrapping_add(K2), K2, 0, K1.wrapping_neg()],
            pending: [0; BLOCK],
            pending_len: 0,
            total: 0,
        }
    }

    fn block(&mut self, b: &[u8]) {
        self.lanes[0] = round(self.lanes[0], word(&b[0..]));
        self.lanes[1] = round(self.lanes[1], word(&b[8..]));
        self.lanes[2] = round(self.lanes[2], word(&b[16..]));
        self.lanes[3] = round(self.lanes[3], word(&b[24..]));
    }

    /// Feeds bytes; the result depends only on the concatenation of all inputs.
    pub fn update(&mut self, mut bytes: &[u8]) {
        self.total = self.total.wrapping_add(bytes.len() as u64);
        if self.pending_len > 0 {
            let take = (BLOCK - self.pending_len).min(bytes.len());
            self.pending[self.pending_len..self.pending_len + take].copy_from_slice(&bytes[..take]);
            self.pending_len += take;
            bytes = &bytes[take..];
            if self.pending_len < BLOCK {
                return;
            }
            let p = self.pending;
            self.block(&p);
            self.pending_len = 0;
        }
        let mut chunks = bytes.chunks_exact(BLOCK);
        for c in &mut chunks {
            self.block(c);
        }
        let rest = chunks.remainder();
        self.pending[..rest.len()].copy_from_slice(rest);
        self.pending_len = rest.len();
    }

    /// Feeds a u64 (little-endian), for lengths and tags.
    pub fn update_u64(&mut self, v: u64) {
        self.update(&v.to_le_bytes());
    }

    /// The checksum of everything fed so far.
    pub fn finish(&self) -> u64 {
        let [a, b, c, d] = self.lanes;
        let mut h = a
            .rotate_left(1)
            .wrapping_add(b.rotate_left(7))
            .wrapping_add(c.rotate_left(12))
            .wrapping_add(d.rotate_left(18));
        for lane in self.lanes {
            h = (h ^ round(0, lane)).wrapping_mul(K1).wrapping_add(K3);
        }
        h = h.wrapping_add(self.total);
        let tail = &self.pending[..self.pending_len];
        let mut words = tail.chunks_exact(8);
        for w in &mut words {
            h = (h ^ round(0, word(w)))
                .rotate_left(27)
                .wrapping_mul(K1)
                .wrapping_add(K3);
        }
        for &byte in words.remainder() {
            h = (h ^ u64::from(byte).wrapping_mul(K3))
                .rotate_left(11)
                .wrapping_mul(K1);
        }
        h ^= h >> 33;
        h = h.wrapping_mul(K2);
        h ^= h >> 29;
        h = h.wrapping_mul(K3);
        h ^ (h >> 32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_shot(b: &[u8]) -> u64 {
        let mut c = Checksum::new();
        c.update(b);
        c.finish()
    }

    #[test]
    fn streaming_equals_one_shot_for_any_split() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 31 % 251) as u8).collect();
        let whole = one_shot(&data);
        for split in [0, 1, 7, 31, 32, 33, 500, 999, 1000] {
            let mut c = Checksum::new();
            c.update(&data[..split]);
            c.update(&data[split..]);
            assert_eq!(c.finish(), whole, "split at {split}");
        }
    }

    #[test]
    fn every_single_bit_flip_changes_the_hash() {
        let data: Vec<u8> = (0..77u8).collect();
        let base = one_shot(&data);
        for i in 0..data.len() {
            for bit in 0..8 {
                let mut d = data.clone();
                d[i] ^= 1 << bit;
                assert_ne!(one_shot(&d), base, "byte {i} bit {bit}");
            }
        }
        // Lengths matter even with zero bytes.
        assert_ne!(one_shot(&[]), one_shot(&[0]));
        assert_ne!(one_shot(&[0; 32]), one_shot(&[0; 33]));
    }
}
