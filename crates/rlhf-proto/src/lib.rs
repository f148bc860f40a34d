//! The rlhf wire protocol: generated prost/tonic code for proto/rlhf/v1 and the
//! protocol version every node checks at register and heartbeat.
//!
//! Only generated code, constants and names of the wire live here; conversions to domain
//! types are in `rlhf-core`.

/// Bumped on any incompatible change to proto/. Checked at register and on every heartbeat.
pub const PROTOCOL_VERSION: u32 = 9;

/// Messages larger than this are refused by servers and clients; batches above a few MiB
/// are streamed in chunks well below it.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("rlhf.v1");
}

include!(concat!(env!("OUT_DIR"), "/unary_methods.rs"));

/// Whether `path` (`/package.Service/Method`) names a unary method of proto/.
pub fn is_unary(path: &str) -> bool {
    UNARY_METHODS.binary_search(&path).is_ok()
}

/// The batch RPCs of `RoleService`: the driver and the role actors name calls with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchCall {
    Generate,
    ComputeLogProbs,
    ComputeValues,
    ComputeScores,
    UpdateActor,
    UpdateCritic,
    UpdateSft,
    UpdatePreference,
    UpdateRewardModel,
}

impl BatchCall {
    /// The RPC's name in role.proto.
    pub fn name(self) -> &'static str {
        match self {
            BatchCall::Generate => "Generate",
            BatchCall::ComputeLogProbs => "ComputeLogProbs",
            BatchCall::ComputeValues => "ComputeValues",
            BatchCall::ComputeScores => "ComputeScores",
            BatchCall::UpdateActor => "UpdateActor",
            BatchCall::UpdateCritic => "UpdateCritic",
            BatchCall::UpdateSft => "UpdateSft",
            BatchCall::UpdatePreference => "UpdatePreference",
            BatchCall::UpdateRewardModel => "UpdateRewardModel",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unary_methods_are_the_non_streaming_ones() {
        assert!(is_unary("/rlhf.v1.ActorService/Ping"));
        assert!(is_unary("/rlhf.v1.RoleService/SyncWeights"));
        assert!(is_unary("/rlhf.v1.HeadService/RegisterNode"));
        // Client-, server- and bidirectional streams are not.
        assert!(!is_unary("/rlhf.v1.ActorService/PutBatch"));
        assert!(!is_unary("/rlhf.v1.WorkerService/GetSnapshot"));
        assert!(!is_unary("/rlhf.v1.RoleService/Generate"));
        assert!(!is_unary("/rlhf.v1.ActorService/NoSuchMethod"));
        assert!(UNARY_METHODS.windows(2).all(|w| w[0] < w[1]), "sorted");
    }
}
