//! The records of the head's registry (nodes, placement groups, actors) as they are kept in
//! memory and stored in the head's database, with their life-cycle states.

use std::collections::BTreeMap;

use rlhf_core::Resources;
use serde::{Deserialize, Serialize};

use crate::placement::Strategy;

/// What a node says of itself when it registers.
#[derive(Debug, Clone)]
pub struct NewNode {
    pub hostname: String,
    pub address: String,
    pub total: Resources,
    /// Its worker runs CUDA roles (`RegisterNodeRequest.cuda_roles`).
    pub cuda_roles: bool,
    /// Its worker runs vLLM servers (`RegisterNodeRequest.vllm_roles`).
    pub vllm_roles: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeState {
    Alive,
    Dead,
    /// Alive before the head restarted, and not registered again since: the head waits for
    /// its worker (a grace period of the dead threshold) but places nothing on it, since
    /// the node may have died while the head was down.
    Rejoining,
}

impl NodeState {
    /// Counted as up: alive, or given its grace period to register again.
    pub fn up(self) -> bool {
        matches!(self, Self::Alive | Self::Rejoining)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeRecord {
    pub node_id: String,
    pub hostname: String,
    pub address: String,
    pub total: Resources,
    pub state: NodeState,
    #[serde(skip)]
    pub last_heartbeat_ms: i64,
    pub registered_ms: i64,
    pub death_reason: String,
    pub death_ms: i64,
    /// The node's worker can run roles on CUDA GPUs (`RegisterNodeRequest.cuda_roles`).
    #[serde(default)]
    pub cuda_roles: bool,
    /// The node's worker runs vLLM rollout servers (`RegisterNodeRequest.vllm_roles`).
    #[serde(default)]
    pub vllm_roles: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PgState {
    Pending,
    Created,
    Removed,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PgRecord {
    pub pg_id: String,
    pub name: String,
    pub strategy: Strategy,
    pub bundles: Vec<Resources>,
    pub bundle_nodes: Vec<String>,
    pub state: PgState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ActorState {
    Pending,
    Alive,
    Dead,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ActorSpec {
    pub name: String,
    pub role: String,
    pub kind: String,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub resources: Resources,
    /// Empty when the actor reserves its own resources.
    pub pg_id: String,
    pub bundle_index: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ActorExit {
    pub exit_code: i32,
    pub signal: i32,
    pub log_tail: Vec<String>,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ActorRecord {
    pub actor_id: String,
    pub spec: ActorSpec,
    pub node_id: String,
    pub address: String,
    pub state: ActorState,
    pub pid: i32,
    pub reason: String,
    pub exit: Option<ActorExit>,
    pub devices: Vec<u32>,
    pub log_file: String,
    /// Resident memory as the worker last sampled it; held in memory only (a sample every
    /// few seconds is not worth a database write).
    #[serde(skip)]
    pub rss_bytes: u64,
}

/// What a worker says about an actor it is running (at registration).
#[derive(Debug, Clone)]
pub struct LiveActor {
    pub actor_id: String,
    pub address: String,
    pub pid: i32,
    pub devices: Vec<u32>,
    pub log_file: String,
}
