//! Whole parameters of a ZeRO-3 model, outside its computations: every parameter gathered
//! (a save, a weight sync, a checksum; exact `f32`, one decoder layer at a time, kept or
//! handed out parameter by parameter in name order), a rank's
//! part in a gather another rank keeps, and a whole tensor set into this rank's piece (a
//! received sync; a checkpoint's weights are read piece by piece: `load.rs`).
//!
//! "Every parameter" here is every parameter that trains: a LoRA model's frozen base is
//! never saved, synced or checked with its adapters, so its whole-model gathers are of the
//! adapters (and any value or score head) only, as its [`crate::Model::vars`] are.

use candle_core::{DType, Device, Tensor};

use super::Zero3;
use crate::error::{Error, Result};

impl Zero3 {
    /// Sets parameter `name` to the whole tensor `t` (this rank keeps its piece): how a
    /// checkpoint or a weight sync reaches a stage-3 model. No collective.
    pub(crate) fn set_whole(&self, name: &str, t: &Tensor) -> Result<()> {
        let st = self.lock()?;
        let p = st
            .pieces
            .iter()
            .find(|p| p.name == name && p.trainable)
            .ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
                location: "this model's parameters".to_string(),
            })?;
        if t.dims() != p.shape.as_slice() {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                expected: p.shape.clone(),
                found: t.dims().to_vec(),
            });
        }
        let mine = &p.ranges[self.rank];
        if mine.is_empty() {
            // Nothing of it here (and casting an empty tensor on a CUDA device fails).
            return Ok(());
        }
        let piece = t
            .flatten_all()?
            .narrow(0, mine.start, mine.len())?
            .reshape(p.var.shape())?
            .to_dtype(p.var.dtype())?
            .to_device(p.var.device())?;
        p.var.set(&piece)?;
        Ok(())
    }

    /// Every parameter, whole, sorted by name (a collective), on the model's device. One
    /// decoder layer is gathered at a time, so the peak is the result plus a layer.
    pub fn gather_all(&self) -> Result<Vec<(String, Tensor)>> {
        self.gather_all_to(&self.device)
    }

    /// [`Zero3::gather_all`] into host memory: what a save takes, so the device never holds
    /// the whole model.
    pub fn gather_all_host(&self) -> Result<Vec<(String, Tensor)>> {
        self.gather_all_to(&Device::Cpu)
    }

    /// This rank's part in another rank's [`Zero3::gather_all_host`] or
    /// [`Zero3::gather_each_host`]: the same collectives, each gathered piece dropped at once,
    /// so this rank never holds more than one layer (a save or a weight sync that rank 0
    /// writes or sends).
    pub fn gather_all_for_others(&self) -> Result<()> {
        self.gather_each(&Device::Cpu, |_, _| Ok(()))
    }

    /// Every parameter, whole, in host memory, handed to `take` one at a time in name order
    /// (a collective): only the edges and one decoder layer are held at once, so a weight
    /// sync sends each layer before the next is gathered. `take` failing stops nothing: the
    /// remaining gathers still happen (the other ranks are in them), and the first error is
    /// returned at the end.
    pub fn gather_each_host(&self, take: impl FnMut(String, Tensor) -> Result<()>) -> Result<()> {
        self.gather_each(&Device::Cpu, take)
    }

    /// `rlhf_collective::checksum` of the whole weights as `f32`, in name order (that of
    /// [`Zero3::gather_all_host`]'s tensors), hashed a decoder layer at a time as the group
    /// gathers them (a collective; the group's communicator lent), so no rank holds the
    /// whole model.
    pub fn gathered_checksum(&self) -> Result<u64> {
        let mut hash = rlhf_collective::ChecksumStream::new(self.param_shapes()?.len());
        self.gather_each_host(|name, t| hash_param(&mut hash, &name, &t).map(drop))?;
        hash.finish()
            .map_err(|e| Error::InvalidArgument(e.to_string()))
    }

    /// The name and whole shape of every parameter, sorted by name: the order
    /// [`Zero3::gather_each_host`] hands them out in.
    pub fn param_shapes(&self) -> Result<Vec<(String, Vec<usize>)>> {
        Ok(self
            .lock()?
            .pieces
            .iter()
            .filter(|p| p.trainable)
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect())
    }

    fn gather_all_to(&self, on: &Device) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        self.gather_each(on, |name, t| {
            out.push((name, t));
            Ok(())
        })?;
        Ok(out)
    }

    /// Gathers the edges, then each decoder layer in the order of their parameters' names
    /// (layer 10 before layer 2), onto `on`, exact `f32` values whatever the model computes
    /// in, and hands every parameter to `take` sorted by name: the edges named before the
    /// layers (`lm_head`, `model.embed_tokens`) first, those after (`model.norm`, a head)
    /// last. Every whole-model gather makes these collectives in this order.
    fn gather_each(
        &self,
        on: &Device,
        mut take: impl FnMut(String, Tensor) -> Result<()>,
    ) -> Result<()> {
        let mut failed = None;
        let mut give = |name: String, t: Tensor| {
            if failed.is_none() {
                failed = take(name, t).err();
            }
        };
        let (mut edges, n) = {
            let mut st = self.lock()?;
            let which = st.trained(&st.edges);
            let edges = self.gather_to(&mut st, &which, false, on, DType::F32)?;
            (edges.tensors, st.layers.len())
        };
        let later = edges.split_off(LAYERS);
        for (name, t) in edges {
            give(name, t);
        }
        for i in layer_order(n) {
            for (name, t) in self
                .gather_layer_to(i, false, on, DType::F32, true)?
                .tensors
            {
                give(name, t);
            }
        }
        for (name, t) in later {
            give(name, t);
        }
        failed.map_or(Ok(()), Err)
    }
}

/// Hashes gathered parameter `name` into `hash` as `rlhf_collective::checksum` does (its
/// `f32` values, name and shape), and returns the values.
pub(crate) fn hash_param(
    hash: &mut rlhf_collective::ChecksumStream,
    name: &str,
    t: &Tensor,
) -> Result<Vec<f32>> {
    let data = crate::train::host_f32(t)?;
    let p = rlhf_collective::Param::f32(name.to_string(), t.dims(), &data)
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    hash.add(&p);
    Ok(data)
}

/// Where the decoder layers' parameter names begin.
const LAYERS: &str = "model.layers.";

/// Decoder layers `0..n` in the order their parameters' names sort in (`model.layers.10.*`
/// before `model.layers.2.*`), each layer's names being contiguous in that order.
fn layer_order(n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|i| i.to_string());
    order
}

#[cfg(test)]
mod tests {
    use super::{layer_order, LAYERS};

    #[test]
    fn layers_come_in_the_order_of_their_names() {
        let order = layer_order(12);
        assert_eq!(order, [0, 1, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9]);
        let names: Vec<String> = order
            .iter()
            .map(|i| format!("{LAYERS}{i}.mlp.up_proj.weight"))
            .collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
        assert!("model.embed_tokens.weight" < LAYERS && "lm_head.weight" < LAYERS);
        assert!("model.norm.weight" > "model.layers.99.x" && "score.weight" > LAYERS);
    }
}
