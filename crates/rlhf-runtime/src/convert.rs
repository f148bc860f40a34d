//! Wire ↔ domain conversions, the only place that touches prost structs field by field.

use rlhf_core::Resources;
use rlhf_proto::v1 as pb;

use crate::head::state::{
    ActorExit, ActorRecord, ActorSpec, ActorState, NodeRecord, NodeState, PgRecord, PgState,
};
use crate::placement::Strategy;

pub fn strategy_from_proto(v: i32) -> Strategy {
    match pb::PlacementStrategy::try_from(v).unwrap_or(pb::PlacementStrategy::Pack) {
        pb::PlacementStrategy::Spread => Strategy::Spread,
        pb::PlacementStrategy::StrictPack => Strategy::StrictPack,
        pb::PlacementStrategy::StrictSpread => Strategy::StrictSpread,
        _ => Strategy::Pack,
    }
}

pub fn strategy_to_proto(s: Strategy) -> pb::PlacementStrategy {
    match s {
        Strategy::Pack => pb::PlacementStrategy::Pack,
        Strategy::Spread => pb::PlacementStrategy::Spread,
        Strategy::StrictPack => pb::PlacementStrategy::StrictPack,
        Strategy::StrictSpread => pb::PlacementStrategy::StrictSpread,
    }
}

pub fn spec_from_proto(s: &pb::ActorSpec) -> ActorSpec {
    ActorSpec {
        name: s.name.clone(),
        role: s.role.clone(),
        kind: s.kind.clone(),
        args: s.args.clone(),
        env: s.env.clone().into_iter().collect(),
        resources: Resources::from(s.resources.as_ref()),
        pg_id: s.pg_id.clone(),
        bundle_index: s.bundle_index.max(0) as usize,
    }
}

pub fn spec_to_proto(s: &ActorSpec) -> pb::ActorSpec {
    pb::ActorSpec {
        name: s.name.clone(),
        role: s.role.clone(),
        kind: s.kind.clone(),
        args: s.args.clone(),
        env: s.env.clone().into_iter().collect(),
        resources: Some((&s.resources).into()),
        pg_id: s.pg_id.clone(),
        bundle_index: s.bundle_index as i32,
    }
}

pub fn exit_to_proto(e: &ActorExit) -> pb::ActorExit {
    pb::ActorExit {
        exit_code: e.exit_code,
        signal: e.signal,
        log_tail: e.log_tail.clone(),
        reason: e.reason.clone(),
    }
}

pub fn exit_from_proto(e: &pb::ActorExit) -> ActorExit {
    ActorExit {
        exit_code: e.exit_code,
        signal: e.signal,
        log_tail: e.log_tail.clone(),
        reason: e.reason.clone(),
    }
}

pub fn node_to_proto(n: &NodeRecord, available: &Resources) -> pb::NodeInfo {
    pb::NodeInfo {
        node_id: n.node_id.clone(),
        hostname: n.hostname.clone(),
        address: n.address.clone(),
        total: Some((&n.total).into()),
        available: Some(available.into()),
        state: match n.state {
            NodeState::Alive => pb::NodeState::Alive,
            NodeState::Dead => pb::NodeState::Dead,
            NodeState::Rejoining => pb::NodeState::Rejoining,
        } as i32,
        last_heartbeat_ms: n.last_heartbeat_ms,
        registered_ms: n.registered_ms,
        death_reason: n.death_reason.clone(),
        death_ms: n.death_ms,
        cuda_roles: n.cuda_roles,
        vllm_roles: n.vllm_roles,
    }
}

pub fn pg_to_proto(p: &PgRecord) -> pb::PlacementGroupInfo {
    pb::PlacementGroupInfo {
        pg_id: p.pg_id.clone(),
        name: p.name.clone(),
        strategy: strategy_to_proto(p.strategy) as i32,
        bundles: p
            .bundles
            .iter()
            .map(|b| pb::Bundle {
                resources: Some(b.into()),
            })
            .collect(),
        bundle_nodes: p.bundle_nodes.clone(),
        state: match p.state {
            PgState::Pending => pb::PlacementGroupState::Pending,
            PgState::Created => pb::PlacementGroupState::Created,
            PgState::Removed => pb::PlacementGroupState::Removed,
        } as i32,
    }
}

pub fn actor_to_proto(a: &ActorRecord) -> pb::ActorInfo {
    pb::ActorInfo {
        actor_id: a.actor_id.clone(),
        spec: Some(spec_to_proto(&a.spec)),
        node_id: a.node_id.clone(),
        address: a.address.clone(),
        state: match a.state {
            ActorState::Pending => pb::ActorState::Pending,
            ActorState::Alive => pb::ActorState::Alive,
            ActorState::Dead => pb::ActorState::Dead,
        } as i32,
        pid: a.pid,
        reason: a.reason.clone(),
        exit: a.exit.as_ref().map(exit_to_proto),
        devices: a.devices.clone(),
        log_file: a.log_file.clone(),
        rss_bytes: a.rss_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_round_trips() {
        let s = ActorSpec {
            name: "n".into(),
            role: "ref".into(),
            kind: "test".into(),
            args: vec!["--x".into()],
            env: [("A".to_string(), "1".to_string())].into(),
            resources: Resources::new().with("GPU", 2.0),
            pg_id: "pg-1".into(),
            bundle_index: 3,
        };
        assert_eq!(spec_from_proto(&spec_to_proto(&s)), s);
        for st in [
            Strategy::Pack,
            Strategy::Spread,
            Strategy::StrictPack,
            Strategy::StrictSpread,
        ] {
            assert_eq!(strategy_from_proto(strategy_to_proto(st) as i32), st);
        }
    }
}
