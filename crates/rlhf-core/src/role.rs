//! Role identity across the driver ↔ role seam: which role, which part of it, which
//! communicator group over which backend. Closed enums with their config / CLI names, and
//! the one place they are converted to and from the wire (`rlhf.v1` enums), so no other crate
//! spells a role or group name as a string.

use std::fmt;
use std::str::FromStr;

use rlhf_proto::v1 as pb;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

macro_rules! names {
    ($ty:ident, $what:literal { $($v:ident = $s:literal),+ $(,)? }) => {
        impl $ty {
            /// The config / CLI name.
            pub const fn as_str(self) -> &'static str {
                match self { $($ty::$v => $s),+ }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $ty {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                match s {
                    $($s => Ok($ty::$v),)+
                    _ => Err(Error::invalid(format!(
                        "unknown {} '{s}'; expected one of: {}",
                        $what,
                        [$($s),+].join(", ")
                    ))),
                }
            }
        }
    };
}

/// A PPO role: a section of the job config, a resource-pool entry, an actor kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum RoleKind {
    /// Policy: generation and PPO update.
    #[serde(rename = "actor_rollout")]
    ActorRollout,
    /// Frozen reference policy.
    #[serde(rename = "ref")]
    Ref,
    /// Value model.
    #[serde(rename = "critic")]
    Critic,
    /// Scores responses.
    #[serde(rename = "reward")]
    Reward,
}

impl RoleKind {
    /// Every role, in placement order.
    pub const ALL: [RoleKind; 4] = [
        RoleKind::ActorRollout,
        RoleKind::Ref,
        RoleKind::Critic,
        RoleKind::Reward,
    ];
}

names!(RoleKind, "role" {
    ActorRollout = "actor_rollout",
    Ref = "ref",
    Critic = "critic",
    Reward = "reward",
});

/// Which part of a role a process runs: the actor's trainer or rollout ranks, or the whole
/// role (every other role).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum RolePart {
    /// The role has a single kind of rank.
    #[serde(rename = "")]
    Whole,
    /// actor_rollout ranks that train the policy (and give old log-probs).
    #[serde(rename = "train")]
    Train,
    /// actor_rollout ranks that generate.
    #[serde(rename = "infer")]
    Infer,
}

impl RolePart {
    /// Every part.
    pub const ALL: [RolePart; 3] = [RolePart::Whole, RolePart::Train, RolePart::Infer];
}

names!(RolePart, "role part" {
    Whole = "",
    Train = "train",
    Infer = "infer",
});

/// One rank of one role part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RoleSlot {
    pub kind: RoleKind,
    pub part: RolePart,
    pub rank: u32,
    pub world_size: u32,
}

impl RoleSlot {
    /// `critic rank 0`, `actor_rollout train rank 1`: how messages name a process.
    pub fn label(&self) -> String {
        match self.part {
            RolePart::Whole => format!("{} rank {}", self.kind, self.rank),
            p => format!("{} {p} rank {}", self.kind, self.rank),
        }
    }

    /// Checks that the part fits the role (only actor_rollout is split).
    pub fn validate(&self) -> Result<()> {
        let ok = match self.kind {
            RoleKind::ActorRollout => self.part != RolePart::Whole,
            _ => self.part == RolePart::Whole,
        };
        if !ok {
            return Err(Error::invalid(format!(
                "role {} cannot run part '{}': actor_rollout runs 'train' or 'infer', \
                 every other role runs whole",
                self.kind, self.part
            )));
        }
        if self.rank >= self.world_size.max(1) {
            return Err(Error::invalid(format!(
                "{}: rank {} outside a world of {}",
                self.label(),
                self.rank,
                self.world_size
            )));
        }
        Ok(())
    }
}

/// The communicators of a PPO job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum CommGroup {
    /// Trainer rank 0 and every rollout rank: weight sync.
    #[serde(rename = "weights")]
    Weights,
    /// The actor's trainer ranks: gradient all-reduce.
    #[serde(rename = "actor_dp")]
    ActorDp,
    /// The critic's ranks: gradient all-reduce.
    #[serde(rename = "critic_dp")]
    CriticDp,
    /// A reward model's trainer ranks (`trainer: reward`): gradient all-reduce.
    #[serde(rename = "reward_dp")]
    RewardDp,
}

impl CommGroup {
    /// Every group.
    pub const ALL: [CommGroup; 4] = [
        CommGroup::Weights,
        CommGroup::ActorDp,
        CommGroup::CriticDp,
        CommGroup::RewardDp,
    ];
}

names!(CommGroup, "communicator group" {
    Weights = "weights",
    ActorDp = "actor_dp",
    CriticDp = "critic_dp",
    RewardDp = "reward_dp",
});

/// How a communicator moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum CommBackend {
    /// A TCP ring (CPU tensors; any machine).
    #[default]
    #[serde(rename = "tcp")]
    Tcp,
    /// NCCL through cudarc (GPU tensors; the `nccl` feature).
    #[serde(rename = "nccl")]
    Nccl,
    /// A shared-memory segment (every rank on one host; Linux).
    #[serde(rename = "shm")]
    Shm,
}

impl CommBackend {
    /// Every backend.
    pub const ALL: [CommBackend; 3] = [CommBackend::Tcp, CommBackend::Nccl, CommBackend::Shm];
}

names!(CommBackend, "communicator backend" {
    Tcp = "tcp",
    Nccl = "nccl",
    Shm = "shm",
});

/// How experience batches go between the driver and a role process (`--batch-path`; chosen
/// per role process when not given: shm on the same host, else frames, else stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchRoute {
    /// A segment of the sender's shared memory (same host only).
    Shm,
    /// Raw control frames over TCP beside the call (inside TLS on a TLS cluster).
    Frames,
    /// A gRPC stream of chunks over HTTP/2 (always possible).
    Stream,
}

names!(BatchRoute, "batch path" {
    Shm = "shm",
    Frames = "frames",
    Stream = "stream",
});

/// The device a role rank computes on. The driver resolves it from the placement: a rank on
/// a GPU bundle gets `Cuda { ordinal: 0 }` (the worker makes the bundle's GPU the only
/// visible one), a CPU bundle gets `Cpu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum DeviceSpec {
    #[default]
    Cpu,
    Cuda {
        ordinal: u32,
    },
    Npu {
        ordinal: u32,
    },
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
            DeviceSpec::Npu { ordinal } => write!(f, "npu:{ordinal}"),
        }
    }
}

impl DeviceSpec {
    pub fn to_wire(self) -> pb::DeviceSpec {
        let (kind, ordinal) = match self {
            DeviceSpec::Cpu => (pb::DeviceKind::Cpu, 0),
            DeviceSpec::Cuda { ordinal } => (pb::DeviceKind::Cuda, ordinal),
            DeviceSpec::Npu { ordinal } => (pb::DeviceKind::Npu, ordinal),
        };
        pb::DeviceSpec {
            kind: kind as i32,
            ordinal,
        }
    }

    pub fn from_wire(d: Option<&pb::DeviceSpec>, field: &str) -> Result<Self> {
        let d = d.ok_or_else(|| unspecified("device", field))?;
        match pb::DeviceKind::try_from(d.kind) {
            Ok(pb::DeviceKind::Cpu) => Ok(DeviceSpec::Cpu),
            Ok(pb::DeviceKind::Cuda) => Ok(DeviceSpec::Cuda { ordinal: d.ordinal }),
            Ok(pb::DeviceKind::Npu) => Ok(DeviceSpec::Npu { ordinal: d.ordinal }),
            Ok(pb::DeviceKind::Unspecified) => Err(unspecified("device", field)),
            Err(_) => Err(Error::invalid(format!(
                "{field}: unknown device kind {}",
                d.kind
            ))),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Wire conversions: the only place these enums meet their proto counterparts.

fn unspecified(what: &str, field: &str) -> Error {
    Error::invalid(format!(
        "{field}: {what} not set (a peer speaking an older protocol?)"
    ))
}

impl From<RoleKind> for pb::RoleKind {
    fn from(k: RoleKind) -> Self {
        match k {
            RoleKind::ActorRollout => pb::RoleKind::ActorRollout,
            RoleKind::Ref => pb::RoleKind::Ref,
            RoleKind::Critic => pb::RoleKind::Critic,
            RoleKind::Reward => pb::RoleKind::Reward,
        }
    }
}

impl RoleKind {
    /// From a wire value (`i32` as prost stores enums); `field` names it in errors.
    pub fn from_wire(v: i32, field: &str) -> Result<Self> {
        match pb::RoleKind::try_from(v) {
            Ok(pb::RoleKind::ActorRollout) => Ok(RoleKind::ActorRollout),
            Ok(pb::RoleKind::Ref) => Ok(RoleKind::Ref),
            Ok(pb::RoleKind::Critic) => Ok(RoleKind::Critic),
            Ok(pb::RoleKind::Reward) => Ok(RoleKind::Reward),
            Ok(pb::RoleKind::Unspecified) => Err(unspecified("role", field)),
            Err(_) => Err(Error::invalid(format!("{field}: unknown role {v}"))),
        }
    }
}

impl From<RolePart> for pb::RolePart {
    fn from(p: RolePart) -> Self {
        match p {
            RolePart::Whole => pb::RolePart::Whole,
            RolePart::Train => pb::RolePart::Train,
            RolePart::Infer => pb::RolePart::Infer,
        }
    }
}

impl RolePart {
    /// From a wire value; `field` names it in errors.
    pub fn from_wire(v: i32, field: &str) -> Result<Self> {
        match pb::RolePart::try_from(v) {
            Ok(pb::RolePart::Whole) => Ok(RolePart::Whole),
            Ok(pb::RolePart::Train) => Ok(RolePart::Train),
            Ok(pb::RolePart::Infer) => Ok(RolePart::Infer),
            Ok(pb::RolePart::Unspecified) => Err(unspecified("role part", field)),
            Err(_) => Err(Error::invalid(format!("{field}: unknown role part {v}"))),
        }
    }
}

impl From<CommGroup> for pb::CommGroup {
    fn from(g: CommGroup) -> Self {
        match g {
            CommGroup::Weights => pb::CommGroup::Weights,
            CommGroup::ActorDp => pb::CommGroup::ActorDp,
            CommGroup::CriticDp => pb::CommGroup::CriticDp,
            CommGroup::RewardDp => pb::CommGroup::RewardDp,
        }
    }
}

impl CommGroup {
    /// From a wire value; `field` names it in errors.
    pub fn from_wire(v: i32, field: &str) -> Result<Self> {
        match pb::CommGroup::try_from(v) {
            Ok(pb::CommGroup::Weights) => Ok(CommGroup::Weights),
            Ok(pb::CommGroup::ActorDp) => Ok(CommGroup::ActorDp),
            Ok(pb::CommGroup::CriticDp) => Ok(CommGroup::CriticDp),
            Ok(pb::CommGroup::RewardDp) => Ok(CommGroup::RewardDp),
            Ok(pb::CommGroup::Unspecified) => Err(unspecified("communicator group", field)),
            Err(_) => Err(Error::invalid(format!(
                "{field}: unknown communicator group {v}"
            ))),
        }
    }
}

impl From<CommBackend> for pb::CommBackend {
    fn from(b: CommBackend) -> Self {
        match b {
            CommBackend::Tcp => pb::CommBackend::Tcp,
            CommBackend::Nccl => pb::CommBackend::Nccl,
            CommBackend::Shm => pb::CommBackend::Shm,
        }
    }
}

impl CommBackend {
    /// From a wire value; `field` names it in errors.
    pub fn from_wire(v: i32, field: &str) -> Result<Self> {
        match pb::CommBackend::try_from(v) {
            Ok(pb::CommBackend::Tcp) => Ok(CommBackend::Tcp),
            Ok(pb::CommBackend::Nccl) => Ok(CommBackend::Nccl),
            Ok(pb::CommBackend::Shm) => Ok(CommBackend::Shm),
            Ok(pb::CommBackend::Unspecified) => Err(unspecified("communicator backend", field)),
            Err(_) => Err(Error::invalid(format!(
                "{field}: unknown communicator backend {v}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_typos_list_the_choices() {
        for k in &RoleKind::ALL {
            assert_eq!(k.as_str().parse::<RoleKind>().unwrap(), *k);
            let w: pb::RoleKind = (*k).into();
            assert_eq!(RoleKind::from_wire(w as i32, "role").unwrap(), *k);
            let json = serde_json::to_string(k).unwrap();
            assert_eq!(json, format!("\"{k}\""));
        }
        for g in &CommGroup::ALL {
            let w: pb::CommGroup = (*g).into();
            assert_eq!(CommGroup::from_wire(w as i32, "group").unwrap(), *g);
            assert_eq!(g.as_str().parse::<CommGroup>().unwrap(), *g);
        }
        for b in &CommBackend::ALL {
            let w: pb::CommBackend = (*b).into();
            assert_eq!(CommBackend::from_wire(w as i32, "backend").unwrap(), *b);
        }
        for p in &RolePart::ALL {
            let w: pb::RolePart = (*p).into();
            assert_eq!(RolePart::from_wire(w as i32, "part").unwrap(), *p);
        }
        let e = "critc".parse::<RoleKind>().unwrap_err().to_string();
        assert!(
            e.contains("unknown role 'critc'") && e.contains("actor_rollout, ref, critic, reward"),
            "{e}"
        );
        let e = "mpi".parse::<CommBackend>().unwrap_err().to_string();
        assert!(e.contains("tcp, nccl"), "{e}");
        let e = RoleKind::from_wire(0, "InitRoleRequest.role")
            .unwrap_err()
            .to_string();
        assert!(e.contains("InitRoleRequest.role: role not set"), "{e}");
        assert!(RoleKind::from_wire(99, "r").is_err());
    }

    #[test]
    fn slots_check_the_part_and_the_rank() {
        let s = |kind, part, rank| RoleSlot {
            kind,
            part,
            rank,
            world_size: 2,
        };
        s(RoleKind::ActorRollout, RolePart::Train, 1)
            .validate()
            .unwrap();
        s(RoleKind::Critic, RolePart::Whole, 0).validate().unwrap();
        assert_eq!(
            s(RoleKind::ActorRollout, RolePart::Infer, 1).label(),
            "actor_rollout infer rank 1"
        );
        assert_eq!(
            s(RoleKind::Critic, RolePart::Whole, 0).label(),
            "critic rank 0"
        );
        let e = s(RoleKind::Critic, RolePart::Train, 0)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("role critic cannot run part 'train'"), "{e}");
        assert!(s(RoleKind::ActorRollout, RolePart::Whole, 0)
            .validate()
            .is_err());
        let e = s(RoleKind::Ref, RolePart::Whole, 2)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 2 outside a world of 2"), "{e}");
    }
}
