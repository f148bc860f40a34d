//! Cutting a model into a ZeRO-3 rank's pieces: which elements of each parameter each rank
//! holds (the parameters that train and a LoRA model's frozen base partitioned apart), which
//! decoder layer each parameter belongs to, and the pieces made from a model's variables or
//! read out of its files.

use std::ops::Range;
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor, Var};

use super::comm::Slot;
use super::{Comm, Piece, Placement, State, Zero3};
use crate::error::{Error, Result};
use crate::train::partition;

/// Elements `range` of parameter `var`, flattened: a rank's piece of it, a copy of its own.
pub(super) fn cut(var: &Var, range: Range<usize>) -> Result<Tensor> {
    let flat = var.as_tensor().detach().flatten_all()?;
    Ok(flat.narrow(0, range.start, range.len())?.copy()?)
}

/// Rank `r`'s elements of each parameter (`[r][k]`): the parameters that train and the
/// frozen ones (a LoRA model's base) each laid end to end and cut into `world` equal
/// ranges ([`partition`]) on their own, so the optimizer's layout over the trained ones is
/// that of ZeRO stages 1 and 2, which see only those.
fn partition_split(sizes: &[usize], trains: &[bool], world: usize) -> Vec<Vec<Range<usize>>> {
    let mut out = vec![vec![0..0; sizes.len()]; world];
    for group in [true, false] {
        let idx: Vec<usize> = (0..sizes.len()).filter(|&k| trains[k] == group).collect();
        let part: Vec<usize> = idx.iter().map(|&k| sizes[k]).collect();
        for (r, ranges) in out.iter_mut().enumerate() {
            for (&k, range) in idx.iter().zip(partition(&part, r, world)) {
                ranges[k] = range;
            }
        }
    }
    out
}

/// The decoder layer a parameter belongs to, from its HF name.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

impl Zero3 {
    /// Cuts `vars` (every parameter of a model, sorted by name) into this rank's pieces and
    /// keeps those; `num_layers` decoder layers are gathered one at a time, onto `target`
    /// when given (the vars' device otherwise), where the pieces live too.
    /// With `offload`, the pieces (and so the optimizer's moments and the summed gradients)
    /// live in host memory, and only what a computation gathers is on the model's device.
    /// The parameters named in `frozen` (a LoRA model's base) keep their own dtype and
    /// never train; the others are kept in the dtype of the first of them.
    pub(crate) fn new(
        vars: Vec<(String, Var)>,
        num_layers: usize,
        comm: Comm,
        offload: bool,
        target: Option<&Device>,
        compute: DType,
        frozen: &std::collections::BTreeSet<String>,
    ) -> Result<Self> {
        let first = vars
            .iter()
            .find(|(name, _)| !frozen.contains(name))
            .map(|(_, v)| v.clone())
            .ok_or_else(|| Error::InvalidArgument("a model without parameters".into()))?;
        let frozen = vars
            .iter()
            .filter(|(name, _)| frozen.contains(name))
            .map(|(name, v)| (name.clone(), v.dtype()))
            .collect();
        let params = vars
            .iter()
            .map(|(name, v)| (name.clone(), v.dims().to_vec()))
            .collect();
        let at = Placement {
            num_layers,
            offload,
            device: target.unwrap_or(first.device()).clone(),
            dtype: first.dtype(),
            compute,
            frozen,
        };
        Self::from_source(params, at, comm, |k, _, mine| cut(&vars[k].1, mine))
    }

    /// A stage-3 model over `params` (every parameter's name and whole shape, sorted by
    /// name) whose pieces `piece` makes: for parameter `k`, named so, the flattened
    /// elements `range` as a 1-D tensor (any dtype or device: it is converted and moved).
    pub(crate) fn from_source(
        params: Vec<(String, Vec<usize>)>,
        at: Placement,
        comm: Comm,
        mut piece: impl FnMut(usize, &str, Range<usize>) -> Result<Tensor>,
    ) -> Result<Self> {
        let (comm, rank, world) = match comm {
            Comm::Own(c) => {
                let (rank, world) = (c.rank(), c.world_size());
                (Slot::Owned(c), rank, world)
            }
            Comm::Lent { rank, world } => (Slot::Unbound, rank, world),
        };
        if world == 0 || rank >= world {
            return Err(Error::InvalidArgument(format!(
                "ZeRO-3: cannot shard a model as rank {rank} of {world}"
            )));
        }
        if params.is_empty() {
            return Err(Error::InvalidArgument("a model without parameters".into()));
        }
        let sizes: Vec<usize> = params
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .collect();
        let trains: Vec<bool> = params
            .iter()
            .map(|(name, _)| !at.frozen.contains_key(name))
            .collect();
        if !trains.contains(&true) {
            return Err(Error::InvalidArgument(
                "ZeRO-3: a model with no parameter to train".into(),
            ));
        }
        let per_rank = partition_split(&sizes, &trains, world);
        let mut pieces = Vec::with_capacity(params.len());
        let mut layers = vec![Vec::new(); at.num_layers];
        let mut edges = Vec::new();
        let home = if at.offload { &Device::Cpu } else { &at.device };
        for (k, (name, shape)) in params.into_iter().enumerate() {
            let mine = per_rank[rank][k].clone();
            let made = piece(k, &name, mine.clone())?;
            if made.dims() != [mine.len()] {
                return Err(Error::InvalidArgument(format!(
                    "ZeRO-3: the piece of {name} has shape {:?}, not [{}]",
                    made.dims(),
                    mine.len()
                )));
            }
            let made = if shape.len() > 1 {
                made.reshape((1, mine.len()))?
            } else {
                made
            };
            let dtype = at.frozen.get(&name).copied().unwrap_or(at.dtype);
            let made = made.to_dtype(dtype)?.to_device(home)?;
            match layer_of(&name) {
                Some(i) if i < at.num_layers => layers[i].push(k),
                Some(i) => {
                    return Err(Error::InvalidArgument(format!(
                        "{name} belongs to layer {i}, the model has {}",
                        at.num_layers
                    )))
                }
                None => edges.push(k),
            }
            pieces.push(Piece {
                name,
                shape,
                ranges: per_rank.iter().map(|p| p[k].clone()).collect(),
                var: Var::from_tensor(&made)?,
                grad: None,
                trainable: trains[k],
            });
        }
        Ok(Self {
            state: Mutex::new(State {
                comm,
                pieces,
                layers,
                edges,
                pass: None,
            }),
            training: Default::default(),
            calls: Default::default(),
            taken: Default::default(),
            gather_failed: Default::default(),
            prefetched: Mutex::new(None),
            worker: Mutex::new(None),
            device: at.device,
            dtype: at.dtype,
            has_frozen: !at.frozen.is_empty(),
            wire: match (at.dtype, at.compute) {
                (DType::F32, DType::BF16 | DType::F16) => at.compute,
                _ => DType::F32,
            },
            rank,
            world,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::layer_of;

    #[test]
    fn parameters_belong_to_their_layer_or_to_the_edges() {
        assert_eq!(layer_of("model.layers.12.mlp.up_proj.weight"), Some(12));
        assert_eq!(layer_of("model.layers.0.input_layernorm.weight"), Some(0));
        assert_eq!(layer_of("model.embed_tokens.weight"), None);
        assert_eq!(layer_of("model.norm.weight"), None);
        assert_eq!(layer_of("lm_head.weight"), None);
        assert_eq!(layer_of("model.layers.x.mlp"), None);
    }
}
