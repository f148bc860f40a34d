//! Core domain types shared by the head, the workers and the tools: resources and their
//! parsing, the error type with scheduling-relevant failure kinds, role identity (role,
//! part, communicator group and backend), and wire conversions.
//!
//! No servers and no GPU code live here.

pub mod batch;
pub mod calls;
pub mod durable;
pub mod error;
pub mod outcome;
pub mod placement;
pub mod resources;
pub mod role;
pub mod seal;
mod tensor_bytes;

pub use batch::{DataBatch, TensorData};
pub use error::{Error, FailureKind, Result};
pub use outcome::{JobFailure, JobOutcome};
pub use resources::Resources;
pub use role::{BatchRoute, CommBackend, CommGroup, DeviceSpec, RoleKind, RolePart, RoleSlot};

/// Milliseconds since the Unix epoch, for timestamps that cross the wire or the state store.
pub fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
