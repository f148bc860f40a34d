//! Communicator groups of one role process (`actor_dp`, `critic_dp`, `weights`), made in
//! two calls: PrepareComm on rank 0 (listen, make a shared-memory segment, or make an NCCL
//! unique id), then JoinComm on every rank at once.

use std::collections::HashMap;
use std::time::Duration;

use rlhf_collective::shm::{ShmCommunicator, ShmRendezvous, DEFAULT_SLOT_BYTES};
use rlhf_collective::{CommConfig, Communicator, TcpCommunicator, TcpRendezvous};
use rlhf_core::{CommBackend, CommGroup};

use crate::error::{Error, Result};

/// What PrepareComm hands back to the driver.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prepared {
    /// TCP: "ip:port" of rank 0's rendezvous; shared memory: "memfd:PID/FD" of its segment.
    pub address: String,
    /// NCCL: the unique id.
    pub unique_id: Vec<u8>,
}

/// A JoinComm request in domain form.
#[derive(Debug, Clone)]
pub struct JoinSpec {
    pub group: CommGroup,
    pub backend: CommBackend,
    pub rank: usize,
    pub world_size: usize,
    pub address: String,
    pub unique_id: Vec<u8>,
    /// 0 = the collective default (60 s).
    pub timeout_ms: u64,
    /// TCP: the communicator's shared secret; required when the group has several ranks.
    pub secret: Vec<u8>,
}

enum Pending {
    Tcp(TcpRendezvous),
    Shm(ShmRendezvous),
    /// The unique id made for the group, for rank 0's own join when the id went to the
    /// head's KV store instead of back to the driver.
    #[cfg(feature = "nccl")]
    Nccl(Vec<u8>),
}

/// The groups this process belongs to, by name.
#[derive(Default)]
pub struct Groups {
    pending: HashMap<CommGroup, Pending>,
    joined: HashMap<CommGroup, Box<dyn Communicator>>,
    /// CUDA device ordinal for NCCL groups.
    pub cuda_device: usize,
    /// TLS for TCP communicators (the worker's certificate and the cluster CA).
    pub tls: Option<rlhf_collective::CommTls>,
}

fn check_backend(backend: CommBackend) -> Result<()> {
    match backend {
        CommBackend::Tcp | CommBackend::Shm => Ok(()),
        CommBackend::Nccl if cfg!(feature = "nccl") => Ok(()),
        CommBackend::Nccl => Err(Error::invalid(
            "communicator backend 'nccl' requested but this rlhf-worker was built without the \
             nccl feature; rebuild with --features nccl or use backend 'tcp'",
        )),
    }
}

impl Groups {
    pub fn new() -> Self {
        Self::default()
    }

    /// Rank 0: binds a TCP rendezvous on `host` (port 0) and keeps it for JoinComm.
    pub fn prepare(
        &mut self,
        group: CommGroup,
        backend: CommBackend,
        host: &str,
    ) -> Result<Prepared> {
        check_backend(backend)?;
        if backend == CommBackend::Nccl {
            #[cfg(feature = "nccl")]
            {
                let id = rlhf_collective::nccl::unique_id()?;
                self.pending.insert(group, Pending::Nccl(id.to_vec()));
                return Ok(Prepared {
                    address: String::new(),
                    unique_id: id.to_vec(),
                });
            }
        }
        if backend == CommBackend::Shm {
            let rv = ShmRendezvous::create(DEFAULT_SLOT_BYTES)?;
            let address = rv.address().to_string();
            self.pending.insert(group, Pending::Shm(rv));
            return Ok(Prepared {
                address,
                unique_id: Vec::new(),
            });
        }
        let rv = TcpRendezvous::bind(&format!("{host}:0"))?;
        let address = rv.local_addr().to_string();
        self.pending.insert(group, Pending::Tcp(rv));
        Ok(Prepared {
            address,
            unique_id: Vec::new(),
        })
    }

    /// Joins `spec.group`; returns once every rank joined (or the timeout passed).
    /// A group of one gets the in-process communicator whatever the backend (every
    /// collective returns its input): no NCCL communicator, device or library is opened.
    pub fn join(&mut self, spec: &JoinSpec) -> Result<()> {
        if spec.world_size == 0 || spec.rank >= spec.world_size {
            return Err(Error::invalid(format!(
                "JoinComm for group '{}': rank {} is out of range for world_size {}",
                spec.group, spec.rank, spec.world_size
            )));
        }
        let mut config = if spec.timeout_ms > 0 {
            CommConfig::with_timeout(Duration::from_millis(spec.timeout_ms))
        } else {
            CommConfig::default()
        };
        if spec.world_size == 1 {
            self.pending.remove(&spec.group);
            self.joined
                .insert(spec.group, Box::new(TcpCommunicator::single(config)));
            return Ok(());
        }
        check_backend(spec.backend)?;
        if spec.backend != CommBackend::Nccl && spec.world_size > 1 {
            if spec.secret.is_empty() {
                return Err(Error::invalid(format!(
                    "JoinComm for group '{}' rank {}: no secret; a TCP or shared-memory \
                     communicator of several ranks is joined only with the secret the driver makes for it (a driver of \
                     another version?)",
                    spec.group, spec.rank
                )));
            }
            let secret = rlhf_collective::CommSecret::from_bytes(&spec.secret)
                .map_err(|e| Error::invalid(format!("JoinComm for group '{}': {e}", spec.group)))?;
            config.secret = Some(secret);
            config.tls = self.tls.clone();
        }
        let pending = self.pending.remove(&spec.group);
        let comm: Box<dyn Communicator> = if spec.backend == CommBackend::Nccl {
            self.join_nccl(spec, &config, pending)?
        } else if spec.rank == 0 {
            match pending {
                Some(Pending::Tcp(rv)) if spec.backend == CommBackend::Tcp => {
                    Box::new(rv.accept(spec.world_size, config)?)
                }
                Some(Pending::Shm(rv)) if spec.backend == CommBackend::Shm => {
                    Box::new(rv.accept(spec.world_size, config)?)
                }
                _ => {
                    return Err(Error::invalid(format!(
                        "JoinComm for group '{}' ({}) on rank 0 without a PrepareComm of that \
                         backend on this process; call PrepareComm here first",
                        spec.group, spec.backend
                    )))
                }
            }
        } else {
            if spec.address.is_empty() {
                return Err(Error::invalid(format!(
                    "JoinComm for group '{}' rank {}: no address; pass rank 0's PrepareComm address",
                    spec.group, spec.rank
                )));
            }
            match spec.backend {
                CommBackend::Shm => Box::new(ShmCommunicator::connect(
                    spec.rank,
                    spec.world_size,
                    &spec.address,
                    config,
                )?),
                _ => Box::new(TcpCommunicator::connect(
                    spec.rank,
                    spec.world_size,
                    &spec.address,
                    config,
                )?),
            }
        };
        self.joined.insert(spec.group, comm);
        Ok(())
    }

    #[cfg(feature = "nccl")]
    fn join_nccl(
        &mut self,
        spec: &JoinSpec,
        config: &CommConfig,
        pending: Option<Pending>,
    ) -> Result<Box<dyn Communicator>> {
        // Rank 0 made the id; the request carries it only when the driver relayed it.
        let id = match pending {
            Some(Pending::Nccl(id)) if spec.unique_id.is_empty() => id,
            _ => spec.unique_id.clone(),
        };
        if id.is_empty() {
            return Err(Error::invalid(format!(
                "JoinComm for NCCL group '{}' rank {}: no unique id; pass rank 0's PrepareComm \
                 unique_id, or the kv_key it was published under",
                spec.group, spec.rank
            )));
        }
        Ok(Box::new(rlhf_collective::NcclCommunicator::new(
            spec.rank,
            spec.world_size,
            self.cuda_device,
            &id,
            config,
        )?))
    }

    #[cfg(not(feature = "nccl"))]
    fn join_nccl(
        &mut self,
        _: &JoinSpec,
        _: &CommConfig,
        _: Option<Pending>,
    ) -> Result<Box<dyn Communicator>> {
        Err(Error::invalid(
            "communicator backend 'nccl' requested but this build is without the nccl feature",
        ))
    }

    /// Installs a ready communicator (tests, embedding).
    pub fn insert(&mut self, group: CommGroup, comm: Box<dyn Communicator>) {
        self.joined.insert(group, comm);
    }

    /// The joined group `group`. A group of one that was never joined is made on the spot,
    /// so single-rank jobs need no PrepareComm/JoinComm round.
    pub fn get(&mut self, group: CommGroup, world_size: usize) -> Result<&mut dyn Communicator> {
        use std::collections::hash_map::Entry;
        match self.joined.entry(group) {
            Entry::Occupied(e) => Ok(e.into_mut().as_mut()),
            Entry::Vacant(_) if world_size > 1 => Err(Error::invalid(format!(
                "communicator group '{group}' was not joined on this process; call \
                 PrepareComm (rank 0) and JoinComm (every rank) first"
            ))),
            Entry::Vacant(v) => Ok(v
                .insert(Box::new(TcpCommunicator::single(CommConfig::default())))
                .as_mut()),
        }
    }

    /// Two groups' communicators at once ([`Groups::get`] each): a ZeRO-3 trainer gathers
    /// through one while it sends through the other.
    pub fn pair(
        &mut self,
        a: (CommGroup, usize),
        b: (CommGroup, usize),
    ) -> Result<(&mut dyn Communicator, &mut dyn Communicator)> {
        if a.0 == b.0 {
            return Err(Error::internal(format!(
                "communicator group '{}' asked for twice at once",
                a.0
            )));
        }
        self.get(a.0, a.1)?;
        self.get(b.0, b.1)?;
        match self.joined.get_disjoint_mut([&a.0, &b.0]) {
            [Some(x), Some(y)] => Ok((x.as_mut(), y.as_mut())),
            _ => Err(Error::internal("a communicator group vanished")),
        }
    }

    /// Drops a group after a failure (a communicator refuses every op after an error).
    pub fn forget(&mut self, group: CommGroup) {
        self.joined.remove(&group);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_are_checked_with_a_clear_message() {
        let mut g = Groups::new();
        if !cfg!(feature = "nccl") {
            let err = g
                .prepare(CommGroup::Weights, CommBackend::Nccl, "127.0.0.1")
                .unwrap_err();
            assert!(
                err.to_string().contains("without the nccl feature"),
                "{err}"
            );
        }
        let err = g
            .get(CommGroup::ActorDp, 2)
            .err()
            .expect("not joined")
            .to_string();
        assert!(
            err.contains("'actor_dp'") && err.contains("PrepareComm"),
            "{err}"
        );
        assert_eq!(
            g.get(CommGroup::ActorDp, 1).expect("single").world_size(),
            1
        );
    }

    /// An NCCL group of one opens nothing: no unique id, no device, and every collective
    /// returns its input (before, the join went to NCCL and failed for want of an id).
    #[test]
    fn a_group_of_one_opens_no_nccl() {
        let mut g = Groups::new();
        g.join(&JoinSpec {
            group: CommGroup::ActorDp,
            backend: CommBackend::Nccl,
            rank: 0,
            world_size: 1,
            address: String::new(),
            unique_id: vec![],
            timeout_ms: 1234,
            secret: vec![],
        })
        .expect("a group of one joins without NCCL");
        let c = g.get(CommGroup::ActorDp, 1).expect("joined");
        assert_eq!((c.world_size(), c.backend()), (1, "tcp"));
        let mut v = [f32::NAN, 2.0];
        c.all_reduce_f32(&mut v, rlhf_collective::ReduceOp::Max)
            .expect("reduce");
        assert!(v[0].is_nan() && v[1] == 2.0);
        assert_eq!(c.all_gather(b"x").expect("gather"), vec![b"x".to_vec()]);
    }

    #[test]
    fn several_tcp_ranks_need_the_drivers_secret() {
        let mut g = Groups::new();
        g.prepare(CommGroup::ActorDp, CommBackend::Tcp, "127.0.0.1")
            .expect("prepare");
        let spec = |secret: Vec<u8>| JoinSpec {
            group: CommGroup::ActorDp,
            backend: CommBackend::Tcp,
            rank: 0,
            world_size: 2,
            address: String::new(),
            unique_id: vec![],
            timeout_ms: 100,
            secret,
        };
        let e = g.join(&spec(vec![])).unwrap_err().to_string();
        assert!(e.contains("'actor_dp'") && e.contains("no secret"), "{e}");
        let e = g.join(&spec(vec![1; 4])).unwrap_err().to_string();
        assert!(e.contains("too short"), "{e}");
    }

    #[test]
    fn two_ranks_join_through_prepare() {
        for backend in [CommBackend::Tcp, CommBackend::Shm] {
            two_ranks_join(backend);
        }
    }

    fn two_ranks_join(backend: CommBackend) {
        let mut g0 = Groups::new();
        let p = g0
            .prepare(CommGroup::Weights, backend, "127.0.0.1")
            .expect("prepare");
        let addr = p.address.clone();
        let t = std::thread::spawn(move || {
            let mut g1 = Groups::new();
            g1.join(&JoinSpec {
                group: CommGroup::Weights,
                backend,
                rank: 1,
                world_size: 2,
                address: addr,
                unique_id: vec![],
                timeout_ms: 0,
                secret: vec![9; 32],
            })
            .expect("join 1");
            let mut v = [2.0f32];
            g1.get(CommGroup::Weights, 2)
                .expect("comm")
                .all_reduce_f32(&mut v, rlhf_collective::ReduceOp::Sum)
                .expect("reduce");
            v[0]
        });
        g0.join(&JoinSpec {
            group: CommGroup::Weights,
            backend,
            rank: 0,
            world_size: 2,
            address: String::new(),
            unique_id: vec![],
            timeout_ms: 0,
            secret: vec![9; 32],
        })
        .expect("join 0");
        let mut v = [1.0f32];
        g0.get(CommGroup::Weights, 2)
            .expect("comm")
            .all_reduce_f32(&mut v, rlhf_collective::ReduceOp::Sum)
            .expect("reduce");
        assert_eq!(v[0], 3.0, "{backend}");
        assert_eq!(t.join().expect("thread"), 3.0, "{backend}");
        let comm = g0.get(CommGroup::Weights, 2).expect("comm");
        assert_eq!(comm.backend(), backend.as_str());
    }
}
