//! Whole parameters of a ZeRO-3 model, outside its computations: every parameter gathered
//! (a save, a weight sync, a checksum; exact `f32`, one decoder layer at a time), a rank's
//! part in a gather another rank keeps, and a whole tensor set into this rank's piece (a
//! checkpoint load or a received sync).

use std::collections::BTreeMap;

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
            .find(|p| p.name == name)
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

    /// [`Zero3::gather_all`] into host memory: what a save, a weight sync and a checksum
    /// take, so the device never holds the whole model.
    pub fn gather_all_host(&self) -> Result<Vec<(String, Tensor)>> {
        self.gather_all_to(&Device::Cpu)
    }

    /// This rank's part in another rank's [`Zero3::gather_all_host`]: the same collectives,
    /// each gathered piece dropped at once, so this rank never holds more than one layer (a
    /// save or a weight sync that rank 0 writes or sends).
    pub fn gather_all_for_others(&self) -> Result<()> {
        self.gather_all_each(&Device::Cpu, |_| {})
    }

    fn gather_all_to(&self, on: &Device) -> Result<Vec<(String, Tensor)>> {
        let mut out = BTreeMap::new();
        self.gather_all_each(on, |part| out.extend(part))?;
        Ok(out.into_iter().collect())
    }

    /// Gathers the edges, then each decoder layer, onto `on`, handing each part to `take`:
    /// exact `f32` values whatever the model computes in.
    fn gather_all_each(
        &self,
        on: &Device,
        mut take: impl FnMut(BTreeMap<String, Tensor>),
    ) -> Result<()> {
        let n = {
            let mut st = self.lock()?;
            let which = st.edges.clone();
            take(
                self.gather_to(&mut st, &which, false, on, DType::F32)?
                    .tensors,
            );
            st.layers.len()
        };
        for i in 0..n {
            take(self.gather_layer_to(i, false, on, DType::F32)?.tensors);
        }
        Ok(())
    }
}
