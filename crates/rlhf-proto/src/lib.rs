//! The rlhf wire protocol: generated prost/tonic code for proto/rlhf/v1 and the
//! protocol version every node checks at register and heartbeat.
//!
//! Only generated code and constants live here; conversions to domain types are in
//! `rlhf-core`.

/// Bumped on any incompatible change to proto/. Checked at register and on every heartbeat.
pub const PROTOCOL_VERSION: u32 = 1;

/// Messages larger than this are refused by servers and clients; batches above a few MiB
/// are streamed in chunks well below it.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("rlhf.v1");
}
