//! Leaf types shared by every crate that moves tensors: the element type ([`DType`]) and the
//! content hash ([`Checksum`]) that transfers and weight syncs are checked with. A crate of
//! its own so the collectives (which must not depend on the cluster's crates) and the
//! experience batches use the same ones.

mod dtype;
mod hash;

pub use dtype::DType;
pub use hash::Checksum;
