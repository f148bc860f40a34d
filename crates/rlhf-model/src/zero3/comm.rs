//! The communicator a ZeRO-3 model's collectives go through: its own (tests, benches), or
//! one lent by the caller for the span of a call ([`Zero3::lend`]): a role process keeps its
//! group's communicator and lends it to the model for an update, a save or a load, and meanwhile
//! reaches it through [`Lent`], so both sides take turns on one connection.

use std::sync::PoisonError;

use rlhf_collective::{Communicator, Op, ReduceOp};

use super::Zero3;
use crate::error::{Error, Result};

pub(super) enum Slot {
    /// Nothing lent: a collective now is an error (a call outside an update, save or load).
    Unbound,
    Owned(Box<dyn Communicator>),
    /// Lent by [`Zero3::lend`] for the duration of its closure.
    Lent(*mut (dyn Communicator + 'static)),
}

// SAFETY: the pointer of `Lent` stands for a `&mut dyn Communicator` (and `Communicator` is
// `Send`); it is dereferenced only under the state's mutex, so by one thread at a time.
unsafe impl Send for Slot {}

impl Slot {
    pub(super) fn get(&mut self) -> Result<&mut dyn Communicator> {
        match self {
            Slot::Owned(c) => Ok(c.as_mut()),
            // SAFETY: `Zero3::lend` set the pointer from a `&mut dyn Communicator` that it
            // borrows for as long as the slot holds it, and resets the slot before that borrow
            // ends (on unwinding too); the reference returned here lives under the state's
            // mutex, and the lender reaches the communicator only through that mutex
            // ([`Lent`]), so it is the only reference in use.
            Slot::Lent(p) => Ok(unsafe { &mut **p }),
            Slot::Unbound => Err(Error::InvalidArgument(
                "ZeRO-3: a collective with no communicator lent: this stage-3 model gathers \
                 its parameters only inside its group's calls (update, save, load)"
                    .into(),
            )),
        }
    }
}

impl Zero3 {
    /// Lends `comm` (this model's group) to the model for the span of `f`, which reaches the
    /// same communicator through the argument it is given. Every collective of the model and
    /// of `f` is then made on it, in the order they happen.
    pub fn lend<R>(
        &self,
        comm: &mut dyn Communicator,
        f: impl FnOnce(&mut dyn Communicator) -> R,
    ) -> Result<R> {
        if (comm.rank(), comm.world_size()) != (self.rank, self.world) {
            return Err(Error::InvalidArgument(format!(
                "ZeRO-3: lent the communicator of rank {} of {}, the model is sharded as rank {} of {}",
                comm.rank(),
                comm.world_size(),
                self.rank,
                self.world
            )));
        }
        {
            let mut st = self.lock()?;
            match st.comm {
                Slot::Unbound => {}
                Slot::Owned(_) => {
                    return Err(Error::InvalidArgument(
                        "ZeRO-3: this model owns its communicator; nothing to lend".into(),
                    ))
                }
                Slot::Lent(_) => {
                    return Err(Error::InvalidArgument(
                        "ZeRO-3: a communicator is already lent to this model".into(),
                    ))
                }
            }
            let p: *mut (dyn Communicator + '_) = comm;
            // SAFETY: only the trait object's lifetime bound is erased; `Slot::get` says how
            // long the pointer is used, and `Reset` below ends that before `comm`'s borrow.
            let p = unsafe {
                std::mem::transmute::<*mut (dyn Communicator + '_), *mut (dyn Communicator + 'static)>(
                    p,
                )
            };
            st.comm = Slot::Lent(p);
        }
        struct Reset<'z>(&'z Zero3);
        impl Drop for Reset<'_> {
            fn drop(&mut self) {
                let mut st = self.0.state.lock().unwrap_or_else(PoisonError::into_inner);
                st.comm = Slot::Unbound;
            }
        }
        let _reset = Reset(self);
        Ok(f(&mut Lent(self)))
    }
}

/// The lender's way to its communicator while it is lent ([`Zero3::lend`]).
pub struct Lent<'z>(&'z Zero3);

impl Lent<'_> {
    fn with<R>(
        &self,
        op: Op,
        f: impl FnOnce(&mut dyn Communicator) -> rlhf_collective::Result<R>,
    ) -> rlhf_collective::Result<R> {
        let mut st = self.0.state.lock().unwrap_or_else(PoisonError::into_inner);
        match st.comm.get() {
            Ok(c) => f(c),
            Err(e) => Err(rlhf_collective::Error::InvalidArgument {
                op,
                detail: e.to_string(),
            }),
        }
    }
}

impl Communicator for Lent<'_> {
    fn rank(&self) -> usize {
        self.0.rank
    }

    fn world_size(&self) -> usize {
        self.0.world
    }

    fn backend(&self) -> &'static str {
        self.with(Op::Barrier, |c| Ok(c.backend()))
            .unwrap_or("lent")
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> rlhf_collective::Result<()> {
        self.with(Op::Broadcast, |c| c.broadcast(buf, root))
    }

    fn broadcast_send_parts(&mut self, parts: &[&[u8]]) -> rlhf_collective::Result<()> {
        self.with(Op::Broadcast, |c| c.broadcast_send_parts(parts))
    }

    fn broadcast_recv_parts(
        &mut self,
        parts: &mut [&mut [u8]],
        root: usize,
    ) -> rlhf_collective::Result<()> {
        self.with(Op::Broadcast, |c| c.broadcast_recv_parts(parts, root))
    }

    fn all_reduce_f32(&mut self, buf: &mut [f32], op: ReduceOp) -> rlhf_collective::Result<()> {
        self.with(Op::AllReduce, |c| c.all_reduce_f32(buf, op))
    }

    fn all_reduce_f64(&mut self, buf: &mut [f64], op: ReduceOp) -> rlhf_collective::Result<()> {
        self.with(Op::AllReduce, |c| c.all_reduce_f64(buf, op))
    }

    fn reduce_scatter_f32(
        &mut self,
        buf: &mut [f32],
        counts: &[usize],
        op: ReduceOp,
    ) -> rlhf_collective::Result<()> {
        self.with(Op::ReduceScatter, |c| c.reduce_scatter_f32(buf, counts, op))
    }

    fn all_gather(&mut self, data: &[u8]) -> rlhf_collective::Result<Vec<Vec<u8>>> {
        self.with(Op::AllGather, |c| c.all_gather(data))
    }

    fn barrier(&mut self) -> rlhf_collective::Result<()> {
        self.with(Op::Barrier, |c| c.barrier())
    }
}
