//! The dense layer of the decoder and the heads, `y = x W^T (+ b)` in HF's weight layout,
//! with an optional LoRA adapter (`+ s (x A^T) B^T`, see [`crate::lora`]).

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::lora::{AdapterSwitch, LoraConfig, LoraPair};
use crate::weights::{Init, ParamBuilder};

/// The adapters a model loads with: their config and the switch all its layers share.
pub(crate) type LoraSetup = (LoraConfig, AdapterSwitch);

/// Dense layer `y = x W^T (+ b)` with HF weight layout `[out, in]`, plus `s (x A^T) B^T`
/// when it carries a LoRA adapter.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    pub w: Tensor,
    pub b: Option<Tensor>,
    pub lora: Option<LoraPair>,
}

impl Linear {
    /// A layer without adapter.
    pub fn plain(w: Tensor, b: Option<Tensor>) -> Self {
        Self { w, b, lora: None }
    }

    /// Loads `{prefix}.weight` (and `.bias`); when `lora` targets the module (the last
    /// component of `prefix`), adds `{prefix}.lora_A.weight` (PEFT's init: uniform with
    /// bound 1/sqrt(in)) and `{prefix}.lora_B.weight` (zeros: the adapter starts as a no-op),
    /// trainable even though the builder is loading a frozen base.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        pb: &mut ParamBuilder,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
        std: f64,
        lora: Option<&LoraSetup>,
    ) -> Result<Self> {
        let w = pb.get(
            &format!("{prefix}.weight"),
            &[out_dim, in_dim],
            Init::Normal(std),
        )?;
        let b = if bias {
            Some(pb.get(&format!("{prefix}.bias"), &[out_dim], Init::Normal(std))?)
        } else {
            None
        };
        let module = prefix.rsplit('.').next().unwrap_or(prefix);
        let lora = match lora {
            Some((cfg, switch)) if cfg.targets(module) => {
                let base = pb.set_base(None);
                let r = cfg.rank;
                let a = pb.fresh(
                    &format!("{prefix}.lora_A.weight"),
                    &[r, in_dim],
                    Init::Uniform(1.0 / (in_dim as f64).sqrt()),
                );
                let bm = pb.fresh(
                    &format!("{prefix}.lora_B.weight"),
                    &[out_dim, r],
                    Init::Zeros,
                );
                pb.set_base(base);
                Some(LoraPair {
                    a: a?,
                    b: bm?,
                    scale: cfg.scale(),
                    switch: switch.clone(),
                    dropout: cfg.dropout,
                    id: crate::lora::layer_id(prefix),
                })
            }
            _ => None,
        };
        Ok(Self { w, b, lora })
    }

    /// Computes in the dtype of `xs`: weights kept in another dtype (f32 master weights under
    /// mixed precision) are cast on the way, differentiably.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward_with(xs, false)
    }

    /// [`Linear::forward`]; with `fused` (a model training through the fused kernels), a
    /// trainable weight without adapter takes the one-node product of
    /// [`crate::kernels::linear`] instead of candle's five.
    pub fn forward_with(&self, xs: &Tensor, fused: bool) -> Result<Tensor> {
        if fused && self.lora.is_none() && self.w.track_op() {
            let ys = crate::kernels::linear(xs, &self.w)?;
            return Ok(match &self.b {
                Some(b) => ys.broadcast_add(&b.to_dtype(xs.dtype())?)?,
                None => ys,
            });
        }
        let dims = xs.dims().to_vec();
        let in_dim = *dims
            .last()
            .ok_or_else(|| Error::InvalidArgument("empty input".into()))?;
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let w = self.w.to_dtype(xs.dtype())?;
        // The reshape also packs strided rows (a narrowed position of [B, T, H]), which
        // CUDA's matmul refuses and the CPU's takes.
        let x2 = xs.reshape((rows, in_dim))?;
        let ys = if self.w.track_op() || !x2.track_op() {
            x2.matmul(&w.t()?)?
        } else {
            // A frozen weight in a graph (a LoRA model's base): candle's matmul backward
            // would also compute the weight's gradient, a weight-sized tensor per layer held
            // until the backward ends. Attached instead with a backward for the input only.
            let out = x2.detach().matmul(&w.t()?)?;
            let wk = w.detach();
            crate::replay::attach1("frozen-linear", &x2, &out, move |_, g| {
                Ok(Some(g.contiguous()?.matmul(&wk)?))
            })?
        };
        let ys = match &self.b {
            Some(b) => ys.broadcast_add(&b.to_dtype(xs.dtype())?)?,
            None => ys,
        };
        let ys = match &self.lora {
            Some(l) if l.switch.enabled() => (ys + l.delta(&x2)?)?,
            _ => ys,
        };
        let mut out = dims;
        let last = out.len() - 1;
        out[last] = self.w.dim(0)?;
        Ok(ys.reshape(out)?)
    }
}
