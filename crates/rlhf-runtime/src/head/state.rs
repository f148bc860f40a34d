//! The head's registry: nodes, placement groups, actors and the KV store, with the
//! rules for health, reservation and recovery. Synchronous and clock-driven, so every
//! rule is unit-tested without a server; the gRPC service is a thin shell around it.

use std::collections::BTreeMap;

use rlhf_core::{Error, FailureKind, Resources, Result};

pub use super::records::*;
use super::store::{self, Store};
use crate::placement::{self, NodeCapacity, Strategy};

/// The resource CUDA roles are placed on.
const GPU: &str = "GPU";

/// Why rejoining nodes are left out, in placement errors.
const REJOINING: &str =
    "not placeable until their workers register again (the head restarted; they get the dead threshold to do so)";

/// What the roles of a placement group need of their nodes' workers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Needs {
    /// GPUs count only where the worker runs CUDA roles.
    pub cuda_roles: bool,
    /// Only nodes whose worker runs vLLM servers.
    pub vllm_roles: bool,
}

pub struct HeadState {
    pub nodes: BTreeMap<String, NodeRecord>,
    pub pgs: BTreeMap<String, PgRecord>,
    pub actors: BTreeMap<String, ActorRecord>,
    pub kv: BTreeMap<String, Vec<u8>>,
    store: Option<Store>,
}

fn short_id(prefix: &str) -> String {
    let u = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}{}", &u[..12])
}

impl HeadState {
    pub fn in_memory() -> Self {
        Self {
            nodes: BTreeMap::new(),
            pgs: BTreeMap::new(),
            actors: BTreeMap::new(),
            kv: BTreeMap::new(),
            store: None,
        }
    }

    /// Loads the previous state; every node alive before the restart is rejoining, with a
    /// fresh grace period from `now_ms` to register again (placement skips it until then).
    pub fn open(store: Store, now_ms: i64) -> Result<Self> {
        let mut s = Self::in_memory();
        for mut n in store.load::<NodeRecord>(store::NODES)? {
            if n.state.up() {
                n.state = NodeState::Rejoining;
            }
            n.last_heartbeat_ms = now_ms;
            s.nodes.insert(n.node_id.clone(), n);
        }
        for p in store.load::<PgRecord>(store::PGS)? {
            s.pgs.insert(p.pg_id.clone(), p);
        }
        for mut a in store.load::<ActorRecord>(store::ACTORS)? {
            if a.state == ActorState::Pending {
                // Its CreateActor call died with the previous head; nothing will finish it.
                a.state = ActorState::Dead;
                a.reason = "the head restarted while the actor was starting".into();
            }
            s.actors.insert(a.actor_id.clone(), a);
        }
        for (k, v) in store.load_raw(store::KV)? {
            s.kv.insert(k, v);
        }
        s.store = Some(store);
        Ok(s)
    }

    fn save_node(&self, id: &str) -> Result<()> {
        match (&self.store, self.nodes.get(id)) {
            (Some(st), Some(n)) => st.put(store::NODES, id, n),
            _ => Ok(()),
        }
    }
    fn save_pg(&self, id: &str) -> Result<()> {
        match (&self.store, self.pgs.get(id)) {
            (Some(st), Some(p)) => st.put(store::PGS, id, p),
            _ => Ok(()),
        }
    }
    fn save_actor(&self, id: &str) -> Result<()> {
        match (&self.store, self.actors.get(id)) {
            (Some(st), Some(a)) => st.put(store::ACTORS, id, a),
            _ => Ok(()),
        }
    }

    /// Free resources of a node: total minus created bundles and actors outside groups.
    pub fn available(&self, node_id: &str) -> Resources {
        let Some(n) = self.nodes.get(node_id) else {
            return Resources::new();
        };
        let mut avail = n.total.clone();
        for p in self.pgs.values().filter(|p| p.state == PgState::Created) {
            for (b, on) in p.bundles.iter().zip(&p.bundle_nodes) {
                if on == node_id {
                    avail.sub(b);
                }
            }
        }
        for a in self.actors.values() {
            if a.node_id == node_id && a.spec.pg_id.is_empty() && a.state != ActorState::Dead {
                avail.sub(&a.spec.resources);
            }
        }
        avail
    }

    /// What placement may use on each alive node. For CUDA roles, the GPUs of a node whose
    /// worker cannot run them are left out, and its label says why (placement errors show it).
    /// Rejoining nodes are no candidates at all (not even for a request of no resources);
    /// [`Self::placement_error`] names them.
    fn capacities(&self, needs: Needs) -> Vec<NodeCapacity> {
        self.nodes
            .values()
            .filter(|n| n.state == NodeState::Alive)
            .map(|n| {
                let mut available = self.available(&n.node_id);
                let mut label = format!("{} {}", n.hostname, n.address);
                let gpus = available.get(GPU);
                if needs.vllm_roles && !n.vllm_roles {
                    available = Resources::default();
                    label.push_str(
                        "; not placeable for vLLM rollout ranks: its rlhf-worker has no vLLM Python (start it with --vllm-python PATH or RLHF_VLLM_PYTHON, an interpreter with vLLM installed)",
                    );
                }
                if needs.cuda_roles && !n.cuda_roles && gpus > 0.0 {
                    available.0.remove(GPU);
                    label.push_str(&format!(
                        "; its {gpus} GPU(s) are not placeable: its rlhf-worker cannot run CUDA roles (built without the `cuda` feature: rebuild with `cargo build --release -p rlhf-worker --features cuda` and join again)"
                    ));
                }
                NodeCapacity {
                    node_id: n.node_id.clone(),
                    label,
                    available,
                }
            })
            .collect()
    }

    /// Registers a node (new, or coming back with its previous id). Actors the node still
    /// runs are revived; actors recorded on it that it no longer runs are marked dead.
    pub fn register(
        &mut self,
        node_id: Option<String>,
        node: NewNode,
        live: Vec<LiveActor>,
        now_ms: i64,
    ) -> Result<String> {
        let (id, ops) = self.register_ops(node_id, node, live, now_ms)?;
        if let Some(st) = &self.store {
            st.write(ops)?;
        }
        Ok(id)
    }

    /// [`HeadState::register`] with its writes queued for a group commit (registrations of
    /// many nodes share commits); the caller awaits it, if at all, after releasing the
    /// head's lock (RegisterNode answers without waiting and only logs a failure).
    /// They are not fsynced first: a head that loses them to a crash does not know the node,
    /// and the node registers again with its live actors, which rebuilds the same records.
    pub fn register_deferred(
        &mut self,
        node_id: Option<String>,
        node: NewNode,
        live: Vec<LiveActor>,
        now_ms: i64,
    ) -> Result<(String, store::Commit)> {
        let (id, ops) = self.register_ops(node_id, node, live, now_ms)?;
        let commit = match &self.store {
            Some(st) => st.submit_lazy(ops),
            None => store::Commit::done(),
        };
        Ok((id, commit))
    }

    fn register_ops(
        &mut self,
        node_id: Option<String>,
        node: NewNode,
        live: Vec<LiveActor>,
        now_ms: i64,
    ) -> Result<(String, Vec<store::Op>)> {
        let durable = self.store.is_some();
        let mut ops = Vec::new();
        let NewNode {
            hostname,
            address,
            total,
            cuda_roles,
            vllm_roles,
        } = node;
        let id = node_id
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| short_id("node-"));
        let rec = NodeRecord {
            node_id: id.clone(),
            hostname,
            address,
            total,
            state: NodeState::Alive,
            last_heartbeat_ms: now_ms,
            registered_ms: now_ms,
            death_reason: String::new(),
            death_ms: 0,
            cuda_roles,
            vllm_roles,
        };
        if durable {
            ops.push(store::Op::put(store::NODES, &id, &rec)?);
        }
        self.nodes.insert(id.clone(), rec);
        let live_ids: BTreeMap<&str, &LiveActor> =
            live.iter().map(|a| (a.actor_id.as_str(), a)).collect();
        // Actors still starting (Pending) are left to their CreateActor call: the node lists
        // them only once they are up.
        let on_node: Vec<String> = self
            .actors
            .values()
            .filter(|a| a.node_id == id && a.state == ActorState::Alive)
            .map(|a| a.actor_id.clone())
            .chain(live.iter().map(|a| a.actor_id.clone()))
            .collect();
        for aid in on_node {
            let Some(a) = self.actors.get_mut(&aid) else {
                tracing::warn!(actor = %aid, node = %id, "node reports an actor the head does not know; ignoring");
                continue;
            };
            if let Some(l) = live_ids.get(aid.as_str()) {
                a.node_id = id.clone();
                a.state = ActorState::Alive;
                a.address = l.address.clone();
                a.pid = l.pid;
                a.devices = l.devices.clone();
                a.log_file = l.log_file.clone();
                a.reason.clear();
            } else if a.state != ActorState::Dead {
                a.state = ActorState::Dead;
                a.reason = format!("not running on node {id} when it registered again");
            }
            if durable {
                ops.push(store::Op::put(store::ACTORS, &aid, a)?);
            }
        }
        Ok((id, ops))
    }

    /// Records a heartbeat; false when the node must register again (unknown, dead, or
    /// rejoining after a head restart).
    pub fn heartbeat(&mut self, node_id: &str, now_ms: i64) -> bool {
        match self.nodes.get_mut(node_id) {
            Some(n) if n.state == NodeState::Alive => {
                n.last_heartbeat_ms = now_ms;
                true
            }
            _ => false,
        }
    }

    /// Marks nodes silent past `threshold_ms` dead, with their actors. Returns their ids.
    pub fn check_health(&mut self, now_ms: i64, threshold_ms: i64) -> Result<Vec<String>> {
        let dead: Vec<String> = self
            .nodes
            .values()
            .filter(|n| n.state.up() && now_ms - n.last_heartbeat_ms > threshold_ms)
            .map(|n| n.node_id.clone())
            .collect();
        for id in &dead {
            let (silent, rejoining) = {
                let n = self.nodes.get_mut(id).expect("listed above");
                let silent = now_ms - n.last_heartbeat_ms;
                let rejoining = n.state == NodeState::Rejoining;
                n.death_reason = if rejoining {
                    format!(
                        "did not register again within {:.1}s (the dead threshold) of the head's restart",
                        threshold_ms as f64 / 1000.0
                    )
                } else {
                    format!(
                        "no heartbeat for {:.1}s (threshold {:.1}s)",
                        silent as f64 / 1000.0,
                        threshold_ms as f64 / 1000.0
                    )
                };
                n.state = NodeState::Dead;
                n.death_ms = now_ms;
                (silent, rejoining)
            };
            let why = if rejoining {
                "did not register again after the head restarted"
            } else {
                "no heartbeat"
            };
            tracing::warn!(node = %id, silent_ms = silent, "node marked dead: {why}");
            self.save_node(id)?;
            self.mark_node_actors_dead(id, &format!("node {id} died ({why})"))?;
        }
        Ok(dead)
    }

    pub fn mark_node_dead(&mut self, node_id: &str, reason: &str, now_ms: i64) -> Result<()> {
        if let Some(n) = self.nodes.get_mut(node_id) {
            n.state = NodeState::Dead;
            n.death_ms = now_ms;
            n.death_reason = reason.to_string();
        }
        self.save_node(node_id)?;
        self.mark_node_actors_dead(node_id, reason)
    }

    fn mark_node_actors_dead(&mut self, node_id: &str, reason: &str) -> Result<()> {
        let ids: Vec<String> = self
            .actors
            .values()
            .filter(|a| a.node_id == node_id && a.state != ActorState::Dead)
            .map(|a| a.actor_id.clone())
            .collect();
        for aid in ids {
            if let Some(a) = self.actors.get_mut(&aid) {
                a.state = ActorState::Dead;
                a.reason = reason.to_string();
            }
            self.save_actor(&aid)?;
        }
        Ok(())
    }

    /// A placement failure, naming the rejoining nodes it could not use when there are any.
    fn placement_error(&self, e: Error) -> Error {
        let rejoining: Vec<String> = self
            .nodes
            .values()
            .filter(|n| n.state == NodeState::Rejoining)
            .map(|n| format!("{} ({} {})", n.node_id, n.hostname, n.address))
            .collect();
        if rejoining.is_empty() || e.kind() != FailureKind::InsufficientResources {
            return e;
        }
        Error::new(
            e.kind(),
            format!("{e}; left out: {} {REJOINING}", rejoining.join(", ")),
        )
    }

    /// Whether an actor of `spec` waits for its placement group's node to register again
    /// after a head restart (a reservation now fails; one after it does may succeed).
    pub fn bundle_node_rejoining(&self, spec: &ActorSpec) -> bool {
        self.pgs
            .get(&spec.pg_id)
            .and_then(|p| p.bundle_nodes.get(spec.bundle_index))
            .and_then(|node| self.nodes.get(node))
            .is_some_and(|n| n.state == NodeState::Rejoining)
    }

    /// Tries to reserve a placement group now: all bundles or none. With `cuda_roles` the
    /// bundles host CUDA roles, and GPUs count only on nodes whose worker can run them.
    pub fn create_pg(
        &mut self,
        name: &str,
        strategy: Strategy,
        bundles: Vec<Resources>,
        cuda_roles: bool,
    ) -> Result<PgRecord> {
        let needs = Needs {
            cuda_roles,
            vllm_roles: false,
        };
        self.create_pg_needing(name, strategy, bundles, needs)
    }

    /// [`Self::create_pg`] with all that the bundles' roles need of their nodes' workers.
    pub fn create_pg_needing(
        &mut self,
        name: &str,
        strategy: Strategy,
        bundles: Vec<Resources>,
        needs: Needs,
    ) -> Result<PgRecord> {
        let caps = self.capacities(needs);
        let chosen =
            placement::place(&caps, &bundles, strategy).map_err(|e| self.placement_error(e))?;
        let rec = PgRecord {
            pg_id: short_id("pg-"),
            name: name.to_string(),
            strategy,
            bundle_nodes: chosen.iter().map(|&i| caps[i].node_id.clone()).collect(),
            bundles,
            state: PgState::Created,
        };
        self.pgs.insert(rec.pg_id.clone(), rec.clone());
        self.save_pg(&rec.pg_id)?;
        Ok(rec)
    }

    pub fn remove_pg(&mut self, pg_id: &str) -> Result<()> {
        let p = self
            .pgs
            .get_mut(pg_id)
            .ok_or_else(|| Error::not_found(format!("no placement group {pg_id}")))?;
        p.state = PgState::Removed;
        self.save_pg(pg_id)
    }

    /// Chooses the node for a new actor and records it as pending.
    /// An actor in a bundle without resources of its own takes the whole bundle.
    pub fn reserve_actor(&mut self, mut spec: ActorSpec) -> Result<ActorRecord> {
        let node_id = if spec.pg_id.is_empty() {
            let caps = self.capacities(Needs::default());
            let i = placement::place(&caps, std::slice::from_ref(&spec.resources), Strategy::Pack)
                .map_err(|e| self.placement_error(e))?[0];
            caps[i].node_id.clone()
        } else {
            let p = self
                .pgs
                .get(&spec.pg_id)
                .filter(|p| p.state == PgState::Created)
                .ok_or_else(|| {
                    Error::not_found(format!("no created placement group {}", spec.pg_id))
                })?;
            let node = p.bundle_nodes.get(spec.bundle_index).ok_or_else(|| {
                Error::invalid(format!(
                    "bundle_index {} is out of range: placement group {} has {} bundles",
                    spec.bundle_index,
                    spec.pg_id,
                    p.bundles.len()
                ))
            })?;
            let unusable = match self.nodes.get(node).map(|n| n.state) {
                Some(NodeState::Alive) => None,
                Some(NodeState::Rejoining) => Some(
                    "has not registered again since the head restarted; retry once it has (or it is marked dead)",
                ),
                _ => Some("is dead"),
            };
            if let Some(why) = unusable {
                return Err(Error::new(
                    FailureKind::Unavailable,
                    format!(
                        "node {node} holding bundle {} of {} {why}",
                        spec.bundle_index, spec.pg_id
                    ),
                ));
            }
            if spec.resources.is_empty() {
                spec.resources = p.bundles[spec.bundle_index].clone();
            } else if !spec.resources.fits_in(&p.bundles[spec.bundle_index]) {
                return Err(Error::invalid(format!(
                    "actor needs {{{}}} but bundle {} of {} holds {{{}}}",
                    spec.resources.display(),
                    spec.bundle_index,
                    spec.pg_id,
                    p.bundles[spec.bundle_index].display()
                )));
            }
            node.clone()
        };
        let rec = ActorRecord {
            actor_id: short_id("actor-"),
            spec,
            node_id,
            address: String::new(),
            state: ActorState::Pending,
            pid: 0,
            reason: String::new(),
            exit: None,
            devices: Vec::new(),
            log_file: String::new(),
            rss_bytes: 0,
        };
        self.actors.insert(rec.actor_id.clone(), rec.clone());
        self.save_actor(&rec.actor_id)?;
        Ok(rec)
    }

    pub fn actor_started(
        &mut self,
        actor_id: &str,
        address: String,
        pid: i32,
        devices: Vec<u32>,
        log_file: String,
    ) -> Result<()> {
        if let Some(a) = self.actors.get_mut(actor_id) {
            a.state = ActorState::Alive;
            a.address = address;
            a.pid = pid;
            a.devices = devices;
            a.log_file = log_file;
        }
        self.save_actor(actor_id)
    }

    /// A worker's memory sample of its actors; entries for actors that are not on that node
    /// (or are unknown) are ignored, so a node cannot write another node's numbers.
    pub fn actor_usage<'a>(
        &mut self,
        node_id: &str,
        usage: impl IntoIterator<Item = (&'a str, u64)>,
    ) {
        for (id, rss) in usage {
            if let Some(a) = self.actors.get_mut(id) {
                if a.node_id == node_id && a.state != ActorState::Dead {
                    a.rss_bytes = rss;
                }
            }
        }
    }

    pub fn actor_died(
        &mut self,
        actor_id: &str,
        reason: String,
        exit: Option<ActorExit>,
    ) -> Result<()> {
        if let Some(a) = self.actors.get_mut(actor_id) {
            a.state = ActorState::Dead;
            a.reason = reason;
            if exit.is_some() {
                a.exit = exit;
            }
        }
        self.save_actor(actor_id)
    }

    pub fn kv_put(&mut self, key: &str, value: Vec<u8>, overwrite: bool) -> Result<bool> {
        if !overwrite && self.kv.contains_key(key) {
            return Ok(false);
        }
        if let Some(st) = self.store.as_ref().filter(|_| durable(key)) {
            st.put_raw(store::KV, key, &value)?;
        }
        self.kv.insert(key.to_string(), value);
        Ok(true)
    }

    /// Removes `key`; false when it was not there. The stored copy goes first, so a key
    /// whose delete failed is still there after a restart, as it is now.
    pub fn kv_delete(&mut self, key: &str) -> Result<bool> {
        if !self.kv.contains_key(key) {
            return Ok(false);
        }
        if let Some(st) = self.store.as_ref().filter(|_| durable(key)) {
            st.delete(store::KV, key)?;
        }
        self.kv.remove(key);
        Ok(true)
    }
}

/// Whether a KV key is written to the state database. Communicator rendezvous
/// (`comm/...`) live only while a group forms and are worthless after a head restart (the
/// ranks' listeners are gone with the attempt): kept in memory only, so a key whose group
/// never finished forming cannot outlive the head, and no commit is paid for them.
fn durable(key: &str) -> bool {
    !key.starts_with("comm/")
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
