//! Joining a shared-memory group: rank 0 makes the segment and publishes its address, the
//! other ranks open it through /proc, and with a secret each side proves it holds it before
//! any data moves (see the module header in `shm`).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::map::Mapping;
use super::{
    alive, load_bytes, store_bytes, unavailable, Header, ShmCommunicator, CLAIMED, DATA_OFFSET,
    JOINED, MAGIC, MAX_RANKS, SLOTS,
};
use crate::error::{Error, Op, Result};
use crate::tcp::auth::{self, Side};
use crate::CommConfig;

/// The pieces both ends of the handshake tag: the segment's nonce and a rank.
fn transcript(nonce: &[u8], world: usize, rank: usize) -> Vec<u8> {
    let mut t = nonce.to_vec();
    t.extend_from_slice(&(world as u64).to_le_bytes());
    t.extend_from_slice(&(rank as u64).to_le_bytes());
    t
}

/// Rank 0's segment between PrepareComm (made, address published) and JoinComm.
pub struct ShmRendezvous {
    pub(super) map: Mapping,
    address: String,
}

impl ShmRendezvous {
    /// Makes a segment of [`SLOTS`] slots of `slot_bytes` (rounded up to 64 bytes).
    pub fn create(slot_bytes: usize) -> Result<Self> {
        if slot_bytes == 0 {
            return Err(Error::InvalidArgument {
                op: Op::Rendezvous,
                detail: "shared-memory slot_bytes must be at least 1".into(),
            });
        }
        let slot_bytes = slot_bytes.div_ceil(64) * 64;
        let (map, fd) = Mapping::create(DATA_OFFSET + SLOTS * slot_bytes)
            .map_err(|e| unavailable(format!("cannot make a shared-memory segment: {e}")))?;
        let h = map.header();
        h.slots.store(SLOTS as u64, Ordering::Relaxed);
        h.slot_bytes.store(slot_bytes as u64, Ordering::Relaxed);
        store_bytes(&h.nonce, &auth::nonce());
        h.magic.store(MAGIC, Ordering::Release);
        Ok(Self {
            address: format!("memfd:{}/{fd}", std::process::id()),
            map,
        })
    }

    /// What the other ranks pass to [`ShmCommunicator::connect`].
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Rank 0 joins; returns once all `world` ranks joined (each proving the secret when
    /// the config has one) or fails at the timeout naming the missing rank.
    pub fn accept(self, world: usize, config: CommConfig) -> Result<ShmCommunicator> {
        check_world(world)?;
        let h = self.map.header();
        h.world.store(world as u64, Ordering::Relaxed);
        let nonce = load_bytes(&h.nonce);
        if let Some(secret) = &config.secret {
            let tag = secret.tag(Side::ShmRoot, &transcript(&nonce, world, 0));
            store_bytes(&h.root_tag, &tag);
        }
        let me = &h.ranks[0];
        me.pid
            .store(u64::from(std::process::id()), Ordering::Relaxed);
        me.joined.store(JOINED, Ordering::Release);
        let mut comm = ShmCommunicator::new(0, world, config, self.map);
        let r = comm.wait_joined(|c, r| {
            // Each rank's tag is checked once, when it shows up (rank 0 is this process).
            let Some(secret) = c.config.secret.as_ref().filter(|_| r != 0) else {
                return Ok(());
            };
            let tag = load_bytes(&c.map.header().ranks[r].tag);
            if secret.verify(Side::ShmRank, &transcript(&nonce, world, r), &tag) {
                Ok(())
            } else {
                Err(Error::Auth {
                    rank: 0,
                    peer: Some(r),
                    detail: "the process that joined the shared-memory segment as this rank \
                             does not hold the communicator's secret"
                        .into(),
                })
            }
        });
        comm.finish(r)?;
        Ok(comm)
    }
}

fn check_world(world: usize) -> Result<()> {
    if world == 0 || world > MAX_RANKS {
        return Err(Error::InvalidArgument {
            op: Op::Rendezvous,
            detail: format!("a shared-memory communicator has 1 to {MAX_RANKS} ranks, not {world}"),
        });
    }
    Ok(())
}

/// Parses `memfd:PID/FD`.
fn parse_address(address: &str) -> Result<(u32, u32)> {
    let bad = || {
        Error::InvalidArgument {
        op: Op::Rendezvous,
        detail: format!(
            "'{address}' is not a shared-memory segment address; expected memfd:PID/FD from rank 0's PrepareComm"
        ),
    }
    };
    let rest = address.strip_prefix("memfd:").ok_or_else(bad)?;
    let (pid, fd) = rest.split_once('/').ok_or_else(bad)?;
    Ok((
        pid.parse().map_err(|_| bad())?,
        fd.parse().map_err(|_| bad())?,
    ))
}

impl ShmCommunicator {
    /// Rank `rank` (≥ 1) joins the segment at `address` (rank 0's
    /// [`ShmRendezvous::address`]); returns once every rank joined.
    pub fn connect(rank: usize, world: usize, address: &str, config: CommConfig) -> Result<Self> {
        check_world(world)?;
        if rank == 0 || rank >= world {
            return Err(Error::InvalidArgument {
                op: Op::Rendezvous,
                detail: format!(
                    "rank {rank} cannot connect to a shared-memory group of {world}: rank 0 \
                     accepts, ranks 1..{world} connect"
                ),
            });
        }
        let (pid, fd) = parse_address(address)?;
        let path = format!("/proc/{pid}/fd/{fd}");
        let map = Mapping::open(&path, DATA_OFFSET).map_err(|e| {
            unavailable(format!(
                "rank {rank} cannot open rank 0's shared-memory segment {path} ({e}): every \
                 rank of a shared-memory group must run on rank 0's host, as the same user and \
                 in the same process namespace; across hosts use the tcp or nccl backend"
            ))
        })?;
        let h = map.header();
        let slots = h.slots.load(Ordering::Relaxed) as usize;
        let slot_bytes = h.slot_bytes.load(Ordering::Relaxed) as usize;
        // The header is another process's word: a size that is zero or overflows is no
        // segment of ours either.
        let expected = SLOTS
            .checked_mul(slot_bytes)
            .and_then(|d| d.checked_add(DATA_OFFSET));
        if h.magic.load(Ordering::Acquire) != MAGIC
            || slots != SLOTS
            || slot_bytes == 0
            || expected != Some(map.len())
        {
            return Err(unavailable(format!(
                "{path} is not a shared-memory segment of this version of rlhf-collective"
            )));
        }
        let mut comm = Self::new(rank, world, config, map);
        let r = comm.join_as(rank, u64::from(pid));
        comm.finish(r)?;
        Ok(comm)
    }

    fn join_as(&mut self, rank: usize, root_pid: u64) -> Result<()> {
        let world = self.world;
        let h = self.map.header();
        let timeout = self.config.timeout;
        let deadline = Instant::now() + timeout;
        // Rank 0 joins first: it sets the world and its tag.
        while h.ranks[0].joined.load(Ordering::Acquire) != JOINED {
            if !alive(root_pid) {
                return Err(Error::PeerClosed {
                    op: Op::Rendezvous,
                    rank,
                    peer: 0,
                    detail: format!("process {root_pid} that owns the segment exited"),
                });
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    op: Op::Rendezvous,
                    rank,
                    peer: Some(0),
                    timeout,
                    detail: "; rank 0 made the segment but never joined it".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let theirs = h.world.load(Ordering::Relaxed) as usize;
        if theirs != world {
            return Err(Error::Mismatch {
                op: Op::Rendezvous,
                rank,
                peer: Some(0),
                detail: format!("rank 0 made a group of {theirs} ranks, this rank expects {world}"),
            });
        }
        let nonce = load_bytes(&h.nonce);
        if let Some(secret) = &self.config.secret {
            let tag = load_bytes(&h.root_tag);
            if !secret.verify(Side::ShmRoot, &transcript(&nonce, world, 0), &tag) {
                return Err(Error::Auth {
                    rank,
                    peer: Some(0),
                    detail: "the shared-memory segment's owner does not hold the communicator's \
                             secret"
                        .into(),
                });
            }
        }
        let me = &h.ranks[rank];
        if me
            .joined
            .compare_exchange(0, CLAIMED, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(Error::Mismatch {
                op: Op::Rendezvous,
                rank,
                peer: None,
                detail: format!("another process already joined the group as rank {rank}"),
            });
        }
        me.pid
            .store(u64::from(std::process::id()), Ordering::Relaxed);
        if let Some(secret) = &self.config.secret {
            store_bytes(
                &me.tag,
                &secret.tag(Side::ShmRank, &transcript(&nonce, world, rank)),
            );
        }
        me.joined.store(JOINED, Ordering::Release);
        self.wait_joined(|_, _| Ok(()))
    }

    /// Waits until every rank joined; `check` runs once per rank as it shows up.
    fn wait_joined(&mut self, mut check: impl FnMut(&Self, usize) -> Result<()>) -> Result<()> {
        for r in 0..self.world {
            let ready = |h: &Header| h.ranks[r].joined.load(Ordering::Acquire) == JOINED;
            self.wait(Op::Rendezvous, r, ready)?;
            check(self, r)?;
        }
        Ok(())
    }
}
