//! A ZeRO-3 model's training passes: opening one, the backward that reduce-scatters the
//! edges' gradients after the layers' own, and this rank's pieces of the summed gradient.

use std::collections::BTreeMap;

use candle_core::Tensor;
use rlhf_collective::ReduceOp;

use super::{Pass, State, Zero3};
use crate::error::{Error, Result};
use crate::train::Gradients;

impl Zero3 {
    /// Whether a training pass is open ([`Zero3::begin_pass`]).
    pub(crate) fn in_pass(&self) -> bool {
        self.training.load(std::sync::atomic::Ordering::Acquire)
    }

    fn set_pass(&self, st: &mut State, pass: Option<Pass>) {
        self.training
            .store(pass.is_some(), std::sync::atomic::Ordering::Release);
        st.pass = pass;
    }

    /// Opens a training pass: the forward calls until [`Zero3::backward`] build the graph
    /// that backward differentiates. Outside a pass a stage-3 model computes with no graph.
    pub fn begin_pass(&self) -> Result<()> {
        let mut st = self.lock()?;
        if st.pass.is_some() {
            return Err(Error::InvalidArgument(
                "ZeRO-3: a training pass is already open; call backward first".into(),
            ));
        }
        self.set_pass(&mut st, Some(Pass::default()));
        Ok(())
    }

    /// Closes a pass without a backward (a failed micro-batch): its edges are dropped.
    pub fn abort_pass(&self) -> Result<()> {
        let mut st = self.lock()?;
        self.set_pass(&mut st, None);
        Ok(())
    }

    /// Differentiates `loss` (computed by this model inside a pass) and closes the pass: each
    /// layer's gradients are reduce-scattered during the backward, the edges' after it, and
    /// this rank's pieces of the group's sums add to its gradients ([`Zero3::take_grads`]).
    /// Every rank must call it for the same pass.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        let pass = {
            let mut st = self.lock()?;
            let pass = st.pass.take();
            self.set_pass(&mut st, None);
            pass
        };
        let pass = pass.ok_or_else(|| {
            Error::InvalidArgument("ZeRO-3: backward without a training pass (begin_pass)".into())
        })?;
        // Ranks that ran no rows join a pass with one forward call (`Model::zero3_idle_pass`):
        // the layers' collectives line up only when every pass has exactly one.
        if pass.calls != 1 {
            return Err(Error::InvalidArgument(format!(
                "ZeRO-3: a training pass made {} forward calls of the model; stage 3 takes \
                 exactly one per pass (one batch through the model per micro-batch)",
                pass.calls
            )));
        }
        let pending = pass.edges;
        // The layers' backwards lock the state: it must be free while candle runs.
        let store = loss.backward()?;
        let mut st = self.lock()?;
        let which = st.trained(&st.edges);
        let mut sums: Vec<Option<Tensor>> = vec![None; which.len()];
        for (k, var) in &pending {
            if let (Some(j), Some(g)) = (
                which.iter().position(|w| w == k),
                store.get(var.as_tensor()),
            ) {
                sums[j] = Some(crate::train::add_to(sums[j].take(), g.clone())?);
            }
        }
        drop(store);
        drop(pending);
        if !which.is_empty() {
            self.scatter(&mut st, &which, sums)?;
        }
        Ok(())
    }

    /// This rank's pieces of the summed gradients since the last call, by parameter name
    /// (zeros where nothing was summed), for AdamW over [`crate::Model::vars`]; the sums start
    /// again from zero.
    pub fn take_grads(&self) -> Result<Gradients> {
        let mut st = self.lock()?;
        let mut out = BTreeMap::new();
        for p in st.pieces.iter_mut().filter(|p| p.trainable) {
            let n = p.var.elem_count();
            let g = p.grad.take().unwrap_or_else(|| vec![0.0; n]);
            let t = Tensor::from_vec(g, p.var.shape(), p.var.device())?.to_dtype(p.var.dtype())?;
            out.insert(p.name.clone(), t);
        }
        Ok(Gradients::from_map(out))
    }

    /// The sum of squares of this rank's pieces of the summed gradient: the group's sum of
    /// these is the squared global norm.
    pub fn local_grad_squares(&self) -> Result<f64> {
        Ok(self
            .lock()?
            .pieces
            .iter()
            .flat_map(|p| p.grad.iter().flatten())
            .map(|&g| f64::from(g) * f64::from(g))
            .sum())
    }

    /// The first parameter whose piece of the summed gradient is not finite.
    pub fn non_finite_grad(&self) -> Result<Option<String>> {
        Ok(self
            .lock()?
            .pieces
            .iter()
            .find(|p| p.grad.iter().flatten().any(|g| !g.is_finite()))
            .map(|p| p.name.clone()))
    }

    /// Drops this rank's summed gradients (what a failed update left).
    pub fn clear_grads(&self) -> Result<()> {
        for p in self.lock()?.pieces.iter_mut() {
            p.grad = None;
        }
        Ok(())
    }

    /// The global L2 norm of the group's summed gradient (a collective).
    pub fn grad_norm(&self) -> Result<f64> {
        let mut sq = [self.local_grad_squares()?];
        let mut st = self.lock()?;
        st.comm
            .get()?
            .all_reduce_f64(&mut sq, ReduceOp::Sum)
            .map_err(|e| Error::InvalidArgument(format!("ZeRO-3: the gradient norm: {e}")))?;
        Ok(sq[0].sqrt())
    }
}
