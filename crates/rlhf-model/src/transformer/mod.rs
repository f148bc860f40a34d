//! Llama-family decoder (Llama 2/3, Qwen2): config, weights and forward pass.
//!
//! References: Touvron et al., "LLaMA" (2023) and the transformers `modeling_llama.py` /
//! `modeling_qwen2.py` checkpoints, whose tensor names are mirrored here
//! (`model.layers.N.self_attn.q_proj.weight`, ...). Qwen2 differs from Llama only by the q/k/v
//! biases and its defaults, so both share this file.
//!
//! The forward pass takes left-padded batches: an attention mask `[B, S]` (1 = token, 0 = pad,
//! `S` = cached + new tokens) and per-row position ids `[B, T]`. Its non-matmul ops come from one of three
//! [`Kernels`]: candle's fused kernels (no backward pass: inference only), this crate's fused
//! differentiable kernels (training on the CPU and on CUDA GPUs), or candle's primitive ops
//! (explicit RMSNorm, rotate-half RoPE, softmax from exp/sum: training anywhere).

use candle_core::{DType, Device, Tensor};

use crate::config::Config;
use crate::error::{Error, Result};
pub use crate::kv_cache::KvCache;
pub(crate) use crate::linear::{Linear, LoraSetup};
use crate::weights::{Init, ParamBuilder};

mod layer;
mod layout;

use layer::{rms_norm, Layer, Rope};

/// Which implementation of the non-matmul ops a decoder uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernels {
    /// candle's fused kernels: fastest for inference, no backward pass.
    Inference,
    /// This crate's fused differentiable kernels: f32/f64 on the CPU, f32/f64/bf16 on a
    /// CUDA GPU (builds with the `cuda` feature).
    FusedTraining,
    /// candle's primitive differentiable ops: any device and dtype.
    Composite,
}

impl Kernels {
    /// The one place the implementation is chosen, per device and compute dtype. A frozen
    /// model (`fast`) takes candle's fused kernels on every device. A trainable one never does
    /// (they drop gradients silently): where this crate's fused kernels run (f32/f64 on the
    /// CPU; f32/f64/bf16 on a CUDA GPU) it takes those, which have a backward pass; elsewhere
    /// (bf16/f16 on the CPU) candle's primitive ops; `composite_ops` forces those everywhere
    /// (for cross-checking).
    pub fn choose(device: &Device, compute: DType, fast: bool, composite_ops: bool) -> Kernels {
        if fast {
            Kernels::Inference
        } else if !composite_ops && crate::kernels::supported_on(device, compute) {
            Kernels::FusedTraining
        } else {
            Kernels::Composite
        }
    }
}

/// The decoder stack (`model.*` tensors): embeddings, layers and the final norm.
#[derive(Debug, Clone)]
pub struct Transformer {
    cfg: Config,
    embed_tokens: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    inv_freq: Tensor,
    kernels: Kernels,
    /// The kernels were forced to candle's primitive ops (`LoadOptions::composite_ops`): kept
    /// when the decoder moves to another device.
    composite_ops: bool,
    /// Activations' dtype; the weights may be kept in another (f32 master weights).
    compute: DType,
    /// Activation checkpointing per layer (training only).
    checkpoint: bool,
    /// ZeRO stage 3: the parameters live there, sharded; `embed_tokens` and `norm` are then
    /// empty placeholders, `layers` is empty, and each call works on a shell made by
    /// [`Transformer::with_edges`].
    zero3: Option<std::sync::Arc<crate::zero3::Zero3>>,
    /// A sharded LoRA model's adapters config and switch: each gathered layer is built with
    /// them.
    sharded_lora: Option<LoraSetup>,
}

/// Standard deviation of randomly initialised weights (HF's `initializer_range` default).
pub(crate) const INIT_STD: f64 = 0.02;

/// Large negative score for masked positions; finite so fully masked (padding) rows stay
/// finite instead of turning into NaN.
fn mask_value(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => -3.0e4,
        _ => -1.0e9,
    }
}

impl Transformer {
    pub(crate) fn load(
        cfg: &Config,
        pb: &mut ParamBuilder,
        (kernels, composite_ops): (Kernels, bool),
        compute: DType,
        checkpoint: bool,
        lora: Option<&LoraSetup>,
    ) -> Result<Self> {
        let h = cfg.hidden_size;
        let embed_tokens = pb.get(
            "model.embed_tokens.weight",
            &[cfg.vocab_size, h],
            Init::Normal(INIT_STD),
        )?;
        // A checkpoint must hold exactly the layers config.json announces.
        let layer = |i: usize| format!("model.layers.{i}.input_layernorm.weight");
        if pb.has_checkpoint() {
            let n = cfg.num_hidden_layers;
            if n == 0 || !pb.contains(&layer(n - 1)) || pb.contains(&layer(n)) {
                let present = (0..=n).take_while(|&i| pb.contains(&layer(i))).count();
                return Err(Error::Config(format!(
                    "config.json says num_hidden_layers={n} but the weights hold {present} layer(s); the config does not belong to these weights"
                )));
            }
            layout::check_attention_layout(cfg, pb)?;
        }
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            layers.push(Layer::load(cfg, pb, i, lora)?);
        }
        let norm = pb.get("model.norm.weight", &[h], Init::Ones)?;
        let inv = cfg.inv_freq();
        let inv_freq = Tensor::from_vec(inv.clone(), inv.len(), pb.device())?;
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm,
            inv_freq,
            kernels,
            composite_ops,
            compute,
            checkpoint,
            zero3: None,
            sharded_lora: None,
        })
    }

    /// This decoder with its parameters in `z` (ZeRO stage 3): the whole tensors it held are
    /// dropped here, and kept only as `z`'s pieces.
    /// A LoRA model's layers are built with `lora`'s adapters (its switch shared).
    pub(crate) fn into_sharded(
        mut self,
        z: std::sync::Arc<crate::zero3::Zero3>,
        lora: Option<LoraSetup>,
    ) -> Result<Self> {
        let from = self.embed_tokens.device().clone();
        if !from.same_device(z.device()) {
            // Loaded in host memory, computing on the sharded model's device: the rotary
            // frequencies follow, and the kernels are chosen again for that device (a forced
            // choice of candle's primitive ops stays).
            self.inv_freq = self.inv_freq.to_device(z.device())?;
            self.kernels = Kernels::choose(z.device(), self.compute, false, self.composite_ops);
        }
        // In the dtype of the weights it stands for (a LoRA base's: the compute dtype).
        let empty = Tensor::zeros(0, self.embed_tokens.dtype(), z.device())?;
        self.embed_tokens = empty.clone();
        self.norm = empty;
        self.layers.clear();
        self.zero3 = Some(z);
        self.sharded_lora = lora;
        Ok(self)
    }

    /// The ZeRO-3 parameters, when this decoder is sharded.
    pub(crate) fn zero3(&self) -> Option<&std::sync::Arc<crate::zero3::Zero3>> {
        self.zero3.as_ref()
    }

    /// A shell of a sharded decoder for one call: the gathered embeddings and final norm;
    /// the layers are gathered one by one as the call reaches them.
    pub(crate) fn with_edges(&self, embed_tokens: Tensor, norm: Tensor) -> Self {
        Self {
            cfg: self.cfg.clone(),
            embed_tokens,
            layers: Vec::new(),
            norm,
            inv_freq: self.inv_freq.clone(),
            kernels: self.kernels,
            composite_ops: self.composite_ops,
            compute: self.compute,
            checkpoint: self.checkpoint,
            zero3: self.zero3.clone(),
            sharded_lora: self.sharded_lora.clone(),
        }
    }

    /// The decoder config.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Input embedding matrix `[V, H]` (used by tied LM heads).
    pub fn embed_tokens(&self) -> &Tensor {
        &self.embed_tokens
    }

    /// Which op implementations the forward uses.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// The dtype activations are computed in.
    pub fn compute_dtype(&self) -> DType {
        self.compute
    }

    /// Final hidden states `[B, T, H]` (after the last norm).
    ///
    /// `attention_mask` is `[B, S]` with `S = cached + T`; `position_ids` is `[B, T]`.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let out = self.forward_inner(input_ids, attention_mask, position_ids, cache);
        if let (Err(e), Some(z)) = (&out, &self.zero3) {
            // A ZeRO-3 inference call that failed before its last layer (an invalid token,
            // out of device memory): the group's other ranks still gather the layers it did
            // not, so this rank takes part in those gathers before it reports its error.
            if !z.in_pass() {
                if let Err(late) = z.finish_failed_call() {
                    return Err(Error::InvalidArgument(format!(
                        "{e} (and the layers' gathers after it failed too: {late})"
                    )));
                }
            }
        }
        out
    }

    fn forward_inner(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        mut cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        let past = cache.as_ref().map(|c| c.seq_len()).unwrap_or(0);
        let (mb, s) = attention_mask.dims2()?;
        if mb != b || s != past + t {
            return Err(Error::InvalidArgument(format!(
                "attention_mask has shape [{mb}, {s}] but input_ids is [{b}, {t}] with {past} cached positions; expected [{b}, {}]",
                past + t
            )));
        }
        if position_ids.dims() != [b, t] {
            return Err(Error::InvalidArgument(format!(
                "position_ids has shape {:?}, expected [{b}, {t}]",
                position_ids.dims()
            )));
        }
        let num_layers = self.cfg.num_hidden_layers;
        if let Some(c) = cache.as_ref() {
            if c.layers.len() != num_layers {
                return Err(Error::InvalidArgument(format!(
                    "KV cache has {} layers, the model {num_layers}",
                    c.layers.len(),
                )));
            }
        }
        let dtype = self.compute;
        let device = self.embed_tokens.device().clone();
        let mask = build_mask(attention_mask, t, past, dtype, &device)?;
        let rope = Rope::new(&self.inv_freq, position_ids, dtype, self.kernels)?;
        let ids = input_ids.to_dtype(DType::U32)?.flatten_all()?;
        // Gather first, then cast: only the looked-up rows are converted. Training takes the
        // lookup with its own backward (kernels/embedding.rs).
        let rows = if self.kernels == Kernels::FusedTraining {
            crate::kernels::embedding(&self.embed_tokens, &ids, dtype)?
        } else {
            self.embed_tokens.index_select(&ids, 0)?.to_dtype(dtype)?
        };
        let mut xs = rows.reshape((b, t, self.cfg.hidden_size))?;
        let eps = self.cfg.rms_norm_eps;
        let kernels = self.kernels;
        if let Some(z) = &self.zero3 {
            if z.in_pass() && cache.is_none() && !xs.track_op() {
                // A LoRA model's embeddings are frozen, so its first layer's input has no
                // graph, and the layers' backwards (attached to their inputs) would never
                // run: the input becomes a variable of its own, whose gradient is dropped.
                xs = candle_core::Var::from_tensor(&xs)?.as_tensor().clone();
            }
            for i in 0..num_layers {
                let slot = cache.as_mut().map(|c| &mut c.layers[i]);
                xs = self.sharded_layer(z, i, &xs, &rope, &mask, slot)?;
            }
            return rms_norm(&xs, &self.norm, eps, kernels);
        }
        for (i, layer) in self.layers.iter().enumerate() {
            let slot = cache.as_mut().map(|c| &mut c.layers[i]);
            xs = if self.checkpoint && slot.is_none() && xs.track_op() {
                layer.forward_checkpointed(&xs, &rope, &mask, eps, kernels)?
            } else {
                layer.forward(&xs, &rope, &mask, slot, eps, kernels)?
            };
        }
        rms_norm(&xs, &self.norm, eps, kernels)
    }
}

impl Transformer {
    /// Decoder layer `i` of a ZeRO-3 model on `xs`: gathered, run and dropped. In a training
    /// pass the output's backward gathers the layer again as variables, recomputes it, and
    /// reduce-scatters its weight gradients before returning the input's.
    fn sharded_layer(
        &self,
        z: &std::sync::Arc<crate::zero3::Zero3>,
        i: usize,
        xs: &Tensor,
        rope: &Rope,
        mask: &Tensor,
        slot: Option<&mut Option<(Tensor, Tensor)>>,
    ) -> Result<Tensor> {
        let (eps, kernels) = (self.cfg.rms_norm_eps, self.kernels);
        let lora = self.sharded_lora.as_ref();
        let layer = gathered_layer(&self.cfg, z, i, z.gather_layer(i, false)?.tensors, lora)?;
        // The next layer's gather overlaps this one's compute.
        if i + 1 < self.cfg.num_hidden_layers {
            z.prefetch_layer(i + 1, false)?;
        }
        let training = slot.is_none() && xs.track_op() && z.in_pass();
        let input = if training { xs.detach() } else { xs.clone() };
        let out = layer.forward(&input, rope, mask, slot, eps, kernels)?;
        drop(layer);
        if !training {
            return Ok(out);
        }
        let (z, cfg, rope, mask) = (z.clone(), self.cfg.clone(), rope.clone(), mask.clone());
        let lora = self.sharded_lora.clone();
        crate::replay::attach1("zero3-decoder-layer", xs, &out, move |x, g| {
            let run = || -> Result<Option<Tensor>> {
                let gathered = z.gather_layer(i, true)?;
                // The backward walks the layers down: the one below is gathered meanwhile.
                if i > 0 {
                    z.prefetch_layer(i - 1, true)?;
                }
                let layer = gathered_layer(&cfg, &z, i, gathered.tensors, lora.as_ref())?;
                let x = candle_core::Var::from_tensor(&x.detach())?;
                let y = layer.forward(x.as_tensor(), &rope, &mask, None, eps, kernels)?;
                let mut grads = (y * g.detach())?.sum_all()?.backward()?;
                drop(layer);
                let dx = grads.remove(x.as_tensor());
                // Only the weights' gradients stay while they are reduce-scattered.
                let weights: Vec<Option<Tensor>> = gathered
                    .vars
                    .iter()
                    .map(|(_, v)| grads.remove(v.as_tensor()))
                    .collect();
                drop(grads);
                drop(gathered.vars);
                z.scatter_layer(i, weights)?;
                Ok(dx)
            };
            run().map_err(|e| candle_core::Error::Msg(e.to_string()))
        })
    }
}

/// Decoder layer `i` of a ZeRO-3 model built from its gathered parameters (variables or plain
/// tensors, used as they are), with `lora`'s adapters (gathered too) on a LoRA model.
fn gathered_layer(
    cfg: &Config,
    z: &crate::zero3::Zero3,
    i: usize,
    tensors: std::collections::BTreeMap<String, Tensor>,
    lora: Option<&LoraSetup>,
) -> Result<Layer> {
    let mut pb = ParamBuilder::from_tensors(tensors, z.device(), z.dtype(), false);
    Layer::load(cfg, &mut pb, i, lora)
}

/// Additive mask `[B, 1, 1, T, S]`: a query at absolute position `past + i` sees key `j` when
/// `j <= past + i` and key `j` is not padding (mask 0). A mask value above 1 is a segment id
/// (packed rows: several sequences back to back in one row): a query then sees only the keys
/// of its own segment, so each packed sequence is computed as if it were alone. Binary masks
/// (every value 0 or 1) are the ordinary case.
fn build_mask(
    attention_mask: &Tensor,
    t: usize,
    past: usize,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let am = attention_mask.to_dtype(DType::U32)?.to_vec2::<u32>()?;
    let b = am.len();
    let s = past + t;
    let neg = mask_value(dtype);
    let mut data = vec![0f32; b * t * s];
    for (bi, row) in am.iter().enumerate() {
        for i in 0..t {
            let base = (bi * t + i) * s;
            // A padding query (segment 0) sees every token before it, as before packing.
            let seg = row[past + i];
            for (j, &m) in row.iter().enumerate() {
                if j > past + i || m == 0 || (seg != 0 && m != seg) {
                    data[base + j] = neg;
                }
            }
        }
    }
    Ok(Tensor::from_vec(data, (b, 1, 1, t, s), device)?.to_dtype(dtype)?)
}

/// Position ids `cumsum(mask) - 1`, clamped at 0, for a left-padded batch (`[B, T]`, u32).
/// With segment ids in the mask (packed rows, see `build_mask`), positions restart at 0 where
/// a new segment begins; a binary mask is one segment.
pub fn position_ids_from_mask(attention_mask: &Tensor) -> Result<Tensor> {
    let am = attention_mask.to_dtype(DType::U32)?.to_vec2::<u32>()?;
    let (b, t) = attention_mask.dims2()?;
    let mut out = Vec::with_capacity(b * t);
    for row in am {
        let (mut c, mut seg): (i64, u32) = (-1, 0);
        for m in row {
            if m != 0 {
                if seg != 0 && m != seg {
                    c = -1;
                }
                seg = m;
                c += 1;
            }
            out.push(c.max(0) as u32);
        }
    }
    Ok(Tensor::from_vec(out, (b, t), attention_mask.device())?)
}
