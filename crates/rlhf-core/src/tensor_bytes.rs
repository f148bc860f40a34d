//! A tensor's bytes inside a [`DataBatch`](crate::DataBatch): owned and shared
//! copy-on-write, or a read-only view of memory someone else owns (a sealed shared-memory
//! batch another process on this host wrote, mapped here). Cloning a batch, streaming it or
//! receiving it through shared memory hands out references instead of copying hundreds of
//! MiB; writing through it copies only while another reference is alive, and always when
//! the bytes are a view (the view itself is never written).

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;

/// Memory that outlives the tensors viewing it: a read-only mapping, for instance. What it
/// returns must never change while it is alive.
pub trait SharedRegion: Send + Sync + 'static {
    fn bytes(&self) -> &[u8];
}

#[derive(Clone)]
enum Repr {
    Owned(Arc<Vec<u8>>),
    View(Arc<dyn SharedRegion>, Range<usize>),
}

/// A tensor's bytes; derefs to a byte slice.
#[derive(Clone)]
pub struct TensorBytes(Repr);

impl Default for TensorBytes {
    fn default() -> Self {
        Self(Repr::Owned(Arc::default()))
    }
}

impl TensorBytes {
    /// A view of `range` inside `region` (checked against its length).
    pub fn view(region: Arc<dyn SharedRegion>, range: Range<usize>) -> Option<Self> {
        (range.start <= range.end && range.end <= region.bytes().len())
            .then(|| Self(Repr::View(region, range)))
    }

    /// Whether these bytes are a view of shared memory rather than a buffer of this process.
    pub fn is_view(&self) -> bool {
        matches!(self.0, Repr::View(..))
    }

    /// The bytes as an owned vector, without a copy when this is the only reference to an
    /// owned buffer.
    pub fn into_vec(self) -> Vec<u8> {
        match self.0 {
            Repr::Owned(v) => Arc::try_unwrap(v).unwrap_or_else(|shared| (*shared).clone()),
            Repr::View(r, range) => r.bytes()[range].to_vec(),
        }
    }

    /// A zero-copy `Bytes` view that keeps the buffer alive (for stream chunks).
    pub fn to_bytes(&self) -> Bytes {
        Bytes::from_owner(self.clone())
    }

    /// The bytes as a vector to write to: copied first when shared or a view.
    pub fn make_mut(&mut self) -> &mut Vec<u8> {
        if let Repr::View(r, range) = &self.0 {
            self.0 = Repr::Owned(Arc::new(r.bytes()[range.clone()].to_vec()));
        }
        match &mut self.0 {
            Repr::Owned(v) => Arc::make_mut(v),
            Repr::View(..) => unreachable!("a view was just replaced by an owned copy"),
        }
    }
}

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::ops::Deref for TensorBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            Repr::Owned(v) => v,
            Repr::View(r, range) => &r.bytes()[range.clone()],
        }
    }
}

impl std::ops::DerefMut for TensorBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.make_mut()
    }
}

impl From<Vec<u8>> for TensorBytes {
    fn from(v: Vec<u8>) -> Self {
        Self(Repr::Owned(Arc::new(v)))
    }
}

impl From<TensorBytes> for Vec<u8> {
    fn from(b: TensorBytes) -> Self {
        b.into_vec()
    }
}

impl PartialEq for TensorBytes {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for TensorBytes {}

impl PartialEq<[u8]> for TensorBytes {
    fn eq(&self, other: &[u8]) -> bool {
        &**self == other
    }
}

impl PartialEq<Vec<u8>> for TensorBytes {
    fn eq(&self, other: &Vec<u8>) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for TensorBytes {
    // Batches are often hundreds of MiB: print small tensors whole, big ones by length.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b: &[u8] = self;
        if b.len() <= 64 {
            f.debug_tuple("TensorBytes").field(&b).finish()
        } else {
            write!(
                f,
                "TensorBytes({} bytes, starting {:?}..)",
                b.len(),
                &b[..16]
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{checksum, decode, decode_view, encode};
    use crate::{DataBatch, TensorData};

    struct Region(Vec<u8>);
    impl SharedRegion for Region {
        fn bytes(&self) -> &[u8] {
            &self.0
        }
    }

    #[test]
    fn views_read_the_region_and_copy_before_a_write() {
        let region: Arc<dyn SharedRegion> = Arc::new(Region((0..16).collect()));
        assert!(TensorBytes::view(region.clone(), 4..17).is_none());
        let mut v = TensorBytes::view(region.clone(), 4..8).unwrap();
        assert!(v.is_view());
        assert_eq!(v, vec![4u8, 5, 6, 7]);
        assert_eq!(&v.to_bytes()[..], &[4, 5, 6, 7]);
        v[0] = 40;
        assert!(!v.is_view());
        assert_eq!(v, vec![40u8, 5, 6, 7]);
        assert_eq!(region.bytes()[4], 4, "the region itself is never written");
        let owned = TensorBytes::from(vec![1u8, 2]);
        let mut c = owned.clone();
        c.make_mut().push(3);
        assert_eq!((owned.len(), c.len()), (2, 3));
    }

    /// A batch decoded as views of a region equals the copied decode, shares the region's
    /// memory, and a region that does not hold a whole encoding is refused.
    #[test]
    fn a_batch_decodes_as_views_of_its_region() {
        let ids: Vec<i64> = (0..12).collect();
        let lp: Vec<f32> = (0..12).map(|i| i as f32 * 0.25).collect();
        let b = DataBatch::new()
            .with_tensor("input_ids", TensorData::from_i64(vec![4, 3], &ids).unwrap())
            .with_tensor("logprobs", TensorData::from_f32(vec![4, 3], &lp).unwrap())
            .with_column("prompt", (0..4).map(|i| serde_json::json!(i)).collect());
        let buf = [vec![9u8; 5], encode(&b).unwrap()].concat();
        let region: Arc<dyn SharedRegion> = Arc::new(Region(buf.clone()));
        let v = decode_view(region.clone(), 5).unwrap();
        assert_eq!(v, decode(&buf[5..]).unwrap());
        assert_eq!(checksum(&v), checksum(&b));
        let t = &v.tensors["logprobs"].data;
        assert!(t.is_view());
        let inside = region.bytes().as_ptr_range();
        assert!(inside.contains(&t.as_ptr()), "a view, not a copy");
        for bad in [
            buf[..buf.len() - 1].to_vec(),
            [buf.clone(), vec![0]].concat(),
            buf[5..].to_vec(),
        ] {
            let r: Arc<dyn SharedRegion> = Arc::new(Region(bad));
            assert!(decode_view(r, 5).is_err());
        }
        assert!(decode_view(region, buf.len() + 1).is_err());
    }
}
