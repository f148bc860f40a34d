//! Leaf types shared by every crate that moves tensors: the element type ([`DType`]) and the
//! content hash ([`Checksum`]) that transfers and weight syncs are checked with. A crate of
//! its own so the collectives (which must not depend on the cluster's crates) and the
//! experience batches use the same ones. Also the rules of LoRA settings ([`lora`]), which
//! the config checker and the models crate share.

mod dtype;
mod hash;
pub mod lora;

pub use dtype::{f32s_from_le_bytes, DType};
pub use hash::Checksum;
