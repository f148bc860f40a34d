//! ZeRO stage 3: parameters sharded across a data-parallel group, each decoder layer gathered
//! just before its forward and again before its backward, and freed after each.
//!
//! A stage-3 model keeps, on every rank, only its piece of each parameter: the flattened
//! parameters laid end to end (by name, the optimizer's order) and cut into `world` equal
//! contiguous ranges ([`crate::train::partition`]), exactly the split ZeRO stages 1 and 2 give
//! AdamW's moments, so the optimizer state of all three stages is laid out alike and a
//! checkpoint written under one stage reads back under another. The pieces are the model's
//! variables ([`crate::Model::vars`]): a plain AdamW over them is the sharded optimizer.
//!
//! The model gathers what a computation needs from the group (an all-gather of every rank's
//! pieces) and drops it afterwards:
//! - the edges (embeddings, final norm, LM, value or score head) for a whole call, since they
//!   are used at both ends of the network;
//! - each decoder layer for its forward only. In a training pass the layer's output carries a
//!   backward of its own ([`crate::replay`]) that gathers the layer again, recomputes it (so a
//!   stage-3 model is always activation-checkpointed), and reduce-scatters the layer's weight
//!   gradients at once: a rank keeps only its piece of the group's summed gradient.
//!
//! Every gather and reduce-scatter is a collective, so every rank of the group must make the
//! same calls in the same order: the same number of forward calls and training passes, on
//! models of the same structure. The rows may differ. Each collective has the communicator's
//! deadline, so a rank that stops calling makes the others fail with a timeout, not hang.
//!
//! Memory per rank: the pieces and their gradients (2/world of the parameters), AdamW's moments
//! over the pieces (2/world), the gathered edges for the call, and one or two gathered layers.
//! With `offload_params` the pieces live in host memory (and so do their gradients and AdamW's
//! moments): the device holds only what is gathered.
//!
//! A LoRA model's frozen base is sharded too (the point of stage 3 with LoRA: a 7B base split
//! over the ranks): its pieces are kept in the compute dtype, gathered with each layer for the
//! computations, and never differentiated. The adapters (and a value or score head) are the
//! pieces that train, partitioned apart from the base, so the optimizer's layout over them is
//! that of stages 1 and 2 over the same adapters, and their whole-model gathers (saves, syncs,
//! checksums) are of them alone.

mod comm;
mod load;
mod model;
mod pass;
mod prefetch;
mod shard;
mod whole;
mod wire;

pub use comm::Lent;
use comm::Slot;
pub(crate) use model::Parts;
pub(crate) use whole::hash_param;
use wire::{wire_bytes, Whole};

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor, Var};
use rlhf_collective::{Communicator, ReduceOp};

use crate::error::{Error, Result};
use crate::train::host_f32 as host;

/// One parameter: its whole shape and this rank's piece of it.
struct Piece {
    name: String,
    shape: Vec<usize>,
    /// The elements of the flattened parameter each rank holds, in rank order.
    ranges: Vec<Range<usize>>,
    /// This rank's piece: `[n]` for a vector parameter, `[1, n]` for a matrix, so that what
    /// decides AdamW's weight decay (the parameter's rank) is the same as for the whole one.
    var: Var,
    /// This rank's piece of the group's summed gradient, since [`Zero3::take_grads`].
    grad: Option<Vec<f32>>,
    /// Whether it trains: false for a LoRA model's frozen base, whose pieces are kept in the
    /// compute dtype, gathered for the computations, and never differentiated, saved or
    /// synced.
    trainable: bool,
}

/// Whole parameters gathered from the group's pieces.
#[derive(Default)]
pub(crate) struct Gathered {
    /// By name: what a layer or head is built from.
    pub tensors: BTreeMap<String, Tensor>,
    /// When gathered as variables: the same tensors' variables, for their gradients, in the
    /// order the parameters were asked for.
    pub vars: Vec<(String, Var)>,
}

struct State {
    comm: Slot,
    pieces: Vec<Piece>,
    /// The parameters of each decoder layer (indices into `pieces`).
    layers: Vec<Vec<usize>>,
    /// Every other parameter (embeddings, final norm, heads).
    edges: Vec<usize>,
    /// Inside a training pass: the edge variables handed out, waiting for their gradients.
    pass: Option<Pass>,
}

/// An open training pass.
#[derive(Default)]
struct Pass {
    /// The edge variables handed out, waiting for their gradients.
    edges: Vec<(usize, Var)>,
    /// Forward calls of the model in this pass.
    calls: usize,
}

/// Where a stage-3 model's pieces live and what it computes in.
pub(crate) struct Placement {
    /// Decoder layers, gathered one at a time.
    pub num_layers: usize,
    /// Pieces in host memory (`training.offload_params`), gathers onto `device`.
    pub offload: bool,
    /// Where the model computes (and its pieces live without `offload`).
    pub device: Device,
    /// The pieces' dtype (the trained parameters' dtype).
    pub dtype: DType,
    /// The dtype the model computes in.
    pub compute: DType,
    /// A LoRA model's frozen base: those parameters, and the dtype their pieces are kept in
    /// (empty for a full model).
    pub frozen: BTreeMap<String, DType>,
}

/// Where a stage-3 model's collectives go.
pub enum Comm {
    /// Its own communicator.
    Own(Box<dyn Communicator>),
    /// The caller's, lent for each call that needs it ([`Zero3::lend`]), as `rank` of `world`.
    Lent { rank: usize, world: usize },
}

/// The sharded parameters of one stage-3 model and the communicator of its group.
pub struct Zero3 {
    state: Mutex<State>,
    /// Whether a training pass is open (the state's `pass`, readable while a prefetch holds
    /// the state).
    training: std::sync::atomic::AtomicBool,
    /// Model calls so far (each gathers the edges once): what keeps a group's inference calls
    /// in step ([`Zero3::calls`]).
    calls: std::sync::atomic::AtomicUsize,
    /// Decoder layers taken for a forward since the call's edges were gathered: where a
    /// failed call's remaining gathers start ([`Zero3::finish_failed_call`]).
    taken: std::sync::atomic::AtomicUsize,
    /// Whether a gather failed since the call's edges were gathered (the group is broken).
    gather_failed: std::sync::atomic::AtomicBool,
    /// A layer being gathered ahead of its use ([`prefetch`]).
    prefetched: Mutex<Option<prefetch::Prefetch>>,
    /// The thread that gathers ahead, started by the first prefetch.
    worker: Mutex<Option<prefetch::Worker>>,
    device: Device,
    dtype: DType,
    /// Whether some parameters are frozen (a LoRA model's base).
    has_frozen: bool,
    /// What a computation's gathers send: the model's compute dtype when that is 16-bit
    /// (`training.bf16`), half the bytes of the `f32` pieces, and exact, since every use
    /// casts the weights to the compute dtype first; `f32` otherwise. Whole-model gathers
    /// (saves, syncs, checksums) always send `f32`.
    wire: DType,
    rank: usize,
    world: usize,
}

impl std::fmt::Debug for Zero3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Zero3(rank {} of {})", self.rank, self.world)
    }
}

/// `loss` times zero, still differentiated through `loss`: a pass whose collectives must
/// happen but whose gradients must add nothing. (candle's backward does not walk past a
/// multiplication by the constant 0, so the product is with a zero tensor.)
pub fn zero_loss(loss: &Tensor) -> Result<Tensor> {
    let zero = Tensor::zeros(loss.shape(), loss.dtype(), loss.device())?;
    Ok(loss.mul(&zero)?)
}

impl State {
    /// Those of the parameters `which` that train.
    fn trained(&self, which: &[usize]) -> Vec<usize> {
        which
            .iter()
            .copied()
            .filter(|&k| self.pieces[k].trainable)
            .collect()
    }
}

impl Zero3 {
    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| Error::InvalidArgument("ZeRO-3 state: lock poisoned".into()))
    }

    /// Model calls made so far (forwards, training passes' forwards, idle calls): every rank
    /// of the group must make the same number, so a caller whose rows need fewer calls than
    /// another rank's makes up the difference with [`crate::Model::zero3_idle_forward`].
    pub fn calls(&self) -> usize {
        self.calls.load(Relaxed)
    }

    /// What a computation's gathers send (see the field).
    pub fn wire_dtype(&self) -> DType {
        self.wire
    }

    /// This rank and the group's size.
    pub fn rank_world(&self) -> (usize, usize) {
        (self.rank, self.world)
    }

    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// This rank's pieces, by parameter name, and whether each trains (the model's
    /// variables are those that do).
    pub(crate) fn piece_vars(&self) -> Result<Vec<(String, Var, bool)>> {
        Ok(self
            .lock()?
            .pieces
            .iter()
            .map(|p| (p.name.clone(), p.var.clone(), p.trainable))
            .collect())
    }

    /// Elements of the whole parameters that train (all of them but a LoRA model's frozen
    /// base): what the optimizer over the pieces is a share of ([`crate::AdamW::new_pieces`]).
    pub fn trained_len(&self) -> Result<usize> {
        let shapes = self.param_shapes()?;
        Ok(shapes
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum())
    }

    /// Elements of this rank's pieces, and of the whole parameters (a LoRA model's frozen
    /// base included).
    pub fn sizes(&self) -> Result<(usize, usize)> {
        let st = self.lock()?;
        let mine = st.pieces.iter().map(|p| p.var.elem_count()).sum();
        let all = st
            .pieces
            .iter()
            .map(|p| p.shape.iter().product::<usize>())
            .sum();
        Ok((mine, all))
    }

    /// The whole parameters `which`, gathered from every rank's pieces (a collective); with
    /// `vars`, each is also a fresh variable (its tensor is the variable's, no copy), so a
    /// graph computed with it yields its gradient. On the model's device, sent as the values
    /// a computation uses ([`Zero3::wire`]).
    fn gather(&self, st: &mut State, which: &[usize], vars: bool) -> Result<Gathered> {
        self.gather_to(st, which, vars, &self.device, self.wire)
    }

    /// [`Zero3::gather`] onto `on`, the values sent as `wire` (`f32`: exact).
    fn gather_to(
        &self,
        st: &mut State,
        which: &[usize],
        vars: bool,
        on: &Device,
        wire: DType,
    ) -> Result<Gathered> {
        let size = if wire == DType::F32 { 4 } else { 2 };
        let mine = wire_bytes(&st.pieces, which, wire)?;
        let all = st.comm.get()?.all_gather(&mine).map_err(|e| {
            self.gather_failed.store(true, Relaxed);
            Error::InvalidArgument(format!("ZeRO-3: gathering parameters: {e}"))
        })?;
        drop(mine);
        if let Some((r, b)) = all.iter().enumerate().find(|(_, b)| b.len() % size != 0) {
            return Err(Error::InvalidArgument(format!(
                "rank {r} sent {} bytes of parameters, not whole {wire:?} values",
                b.len()
            )));
        }
        // Decoded straight into each parameter: no second copy of the layer.
        let mut at = vec![0usize; self.world];
        let mut out = Gathered::default();
        for &k in which {
            let p = &st.pieces[k];
            let mut full = Whole::with_capacity(wire, p.shape.iter().product());
            for (r, vals) in all.iter().enumerate() {
                let n = p.ranges[r].len();
                let bytes = vals.get(at[r] * size..(at[r] + n) * size).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "ZeRO-3: rank {r} sent {} values, fewer than its pieces; the ranks disagree on the model",
                        vals.len() / size
                    ))
                })?;
                full.extend(bytes);
                at[r] += n;
            }
            let shape = p.shape.as_slice();
            // Only what trains becomes a variable: a frozen base stays out of the graph.
            let as_var = vars && p.trainable;
            let dtype = p.var.dtype();
            let t = match full {
                Whole::F32(v) if dtype == DType::F32 && as_var => {
                    let var = Var::from_vec(v, shape, on)?;
                    out.vars.push((p.name.clone(), var.clone()));
                    var.as_tensor().clone()
                }
                full => {
                    let t = full.into_tensor(shape, on)?.to_dtype(dtype)?;
                    if as_var {
                        let var = Var::from_tensor(&t)?;
                        out.vars.push((p.name.clone(), var.clone()));
                        var.as_tensor().clone()
                    } else {
                        t
                    }
                }
            };
            out.tensors.insert(p.name.clone(), t);
        }
        if let Some(r) = (0..self.world).find(|&r| at[r] * size != all[r].len()) {
            return Err(Error::InvalidArgument(format!(
                "ZeRO-3: rank {r} sent {} values for pieces of {}; the ranks disagree on the model",
                all[r].len() / size,
                at[r]
            )));
        }
        Ok(out)
    }

    /// Sums the whole gradients `grads` of parameters `which` (`None`: zeros) over the group
    /// and adds this rank's piece of the sum to its gradients (a reduce-scatter).
    fn scatter(&self, st: &mut State, which: &[usize], grads: Vec<Option<Tensor>>) -> Result<()> {
        let counts: Vec<usize> = (0..self.world)
            .map(|r| which.iter().map(|&k| st.pieces[k].ranges[r].len()).sum())
            .collect();
        // The buffer is rank after rank, each rank's pieces parameter after parameter: each
        // gradient comes to the host on its own and is spread to its places, then dropped.
        let mut buf = vec![0f32; counts.iter().sum()];
        // Where each rank's next piece goes.
        let mut next: Vec<usize> = counts
            .iter()
            .scan(0, |off, &c| {
                let start = *off;
                *off += c;
                Some(start)
            })
            .collect();
        for (&k, g) in which.iter().zip(grads) {
            let p = &st.pieces[k];
            if let Some(g) = g {
                let g = host(&g)?;
                if g.len() != p.shape.iter().product::<usize>() {
                    return Err(Error::InvalidArgument(format!(
                        "ZeRO-3: the gradient of {} has {} values, its parameter {}",
                        p.name,
                        g.len(),
                        p.shape.iter().product::<usize>()
                    )));
                }
                for (r, &at) in next.iter().enumerate() {
                    let range = p.ranges[r].clone();
                    buf[at..at + range.len()].copy_from_slice(&g[range]);
                }
            }
            for (at, range) in next.iter_mut().zip(&p.ranges) {
                *at += range.len();
            }
        }
        st.comm
            .get()?
            .reduce_scatter_f32(&mut buf, &counts, ReduceOp::Sum)
            .map_err(|e| {
                Error::InvalidArgument(format!("ZeRO-3: reduce-scattering gradients: {e}"))
            })?;
        let mut at: usize = counts[..self.rank].iter().sum();
        for &k in which {
            let n = st.pieces[k].ranges[self.rank].len();
            let part = &buf[at..at + n];
            at += n;
            match &mut st.pieces[k].grad {
                Some(acc) => acc.iter_mut().zip(part).for_each(|(a, g)| *a += *g),
                None => st.pieces[k].grad = Some(part.to_vec()),
            }
        }
        Ok(())
    }

    /// Decoder layer `i`'s whole parameters (a collective), as variables with `vars`.
    pub(crate) fn gather_layer(&self, i: usize, vars: bool) -> Result<Gathered> {
        self.gather_layer_to(i, vars, &self.device, self.wire, false)
    }

    /// [`Zero3::gather_layer`] onto `on`, sent as `wire`; with `trained`, only the
    /// parameters that train (a whole-model gather: a LoRA model's adapters). A layer
    /// gathered ahead ([`prefetch`], as the computation's values) is on the model's device
    /// and moves (its collective happened already).
    fn gather_layer_to(
        &self,
        i: usize,
        vars: bool,
        on: &Device,
        wire: DType,
        trained: bool,
    ) -> Result<Gathered> {
        if !vars {
            self.taken.fetch_add(1, Relaxed);
        }
        let same = wire == self.wire && !(trained && self.has_frozen);
        if let Some(mut g) = self.take_prefetched(i, vars, same)? {
            for t in g.tensors.values_mut() {
                *t = t.to_device(on)?;
            }
            return Ok(g);
        }
        let mut st = self.lock()?;
        let which =
            st.layers.get(i).cloned().ok_or_else(|| {
                Error::InvalidArgument(format!("ZeRO-3: no layer {i} in this model"))
            })?;
        let which = if trained { st.trained(&which) } else { which };
        self.gather_to(&mut st, &which, vars, on, wire)
    }

    /// Reduce-scatters layer `i`'s whole weight gradients, in the order of its gathered
    /// variables ([`Zero3::gather_layer`]: the parameters that train; `None`: no gradient,
    /// zeros).
    pub(crate) fn scatter_layer(&self, i: usize, grads: Vec<Option<Tensor>>) -> Result<()> {
        let mut st = self.lock()?;
        let which =
            st.layers.get(i).cloned().ok_or_else(|| {
                Error::InvalidArgument(format!("ZeRO-3: no layer {i} in this model"))
            })?;
        let which = st.trained(&which);
        if which.is_empty() {
            // Nothing of this layer trains, on any rank (they hold the same model).
            return Ok(());
        }
        if grads.len() != which.len() {
            return Err(Error::InvalidArgument(format!(
                "ZeRO-3: {} gradients for the {} parameters of layer {i}",
                grads.len(),
                which.len()
            )));
        }
        self.scatter(&mut st, &which, grads)
    }

    /// The edge parameters (embeddings, final norm, heads), whole, for one call (a
    /// collective). Inside a training pass they are fresh variables whose gradients
    /// [`Zero3::backward`] collects.
    pub(crate) fn gather_edges(&self) -> Result<BTreeMap<String, Tensor>> {
        let mut st = self.lock()?;
        self.calls.fetch_add(1, Relaxed);
        self.taken.store(0, Relaxed);
        self.gather_failed.store(false, Relaxed);
        let which = st.edges.clone();
        let training = st.pass.is_some();
        let out = self.gather(&mut st, &which, training)?;
        let trained = st.trained(&which);
        if let Some(pass) = st.pass.as_mut() {
            // Those that train gathered as variables, in `which`'s order.
            let vars = out.vars.into_iter().map(|(_, v)| v);
            pass.edges.extend(trained.into_iter().zip(vars));
            pass.calls += 1;
        }
        Ok(out.tensors)
    }

    /// After an inference call failed between its gathers (its rows could not be computed),
    /// takes part in the gathers of the decoder layers it did not take, dropping each, so
    /// the group's other ranks finish their own call instead of waiting for the deadline.
    /// Nothing when a gather failed (the group is broken, and the others see it too).
    pub(crate) fn finish_failed_call(&self) -> Result<()> {
        if self.gather_failed.load(Relaxed) {
            return Ok(());
        }
        let (from, n) = (self.taken.load(Relaxed), self.lock()?.layers.len());
        for i in from..n {
            self.gather_layer(i, false)?;
        }
        Ok(())
    }
}
