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

use candle_core::{DType, Device, Tensor, D};

use crate::config::Config;
use crate::error::{Error, Result};
pub use crate::kv_cache::KvCache;
pub(crate) use crate::linear::{Linear, LoraSetup};
use crate::weights::{Init, ParamBuilder};

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

fn rms_norm(xs: &Tensor, w: &Tensor, eps: f64, kernels: Kernels) -> Result<Tensor> {
    let w = &w.to_dtype(xs.dtype())?;
    match kernels {
        Kernels::Inference => {
            return Ok(candle_nn::ops::rms_norm(&xs.contiguous()?, w, eps as f32)?)
        }
        Kernels::FusedTraining => return Ok(crate::kernels::rms_norm(xs, w, eps)?),
        Kernels::Composite => {}
    }
    // Computed in f32 like transformers, then cast back before the weight multiply.
    let dtype = xs.dtype();
    let x = xs.to_dtype(crate::ops::wide_dtype(dtype))?;
    let var = x.sqr()?.mean_keepdim(D::Minus1)?;
    let x = x.broadcast_mul(&(var + eps)?.sqrt()?.recip()?)?;
    Ok(x.to_dtype(dtype)?.broadcast_mul(w)?)
}

fn softmax_last(xs: &Tensor, fast: bool) -> Result<Tensor> {
    let dtype = xs.dtype();
    let x = xs.to_dtype(crate::ops::wide_dtype(dtype))?;
    let p = if fast {
        candle_nn::ops::softmax_last_dim(&x)?
    } else {
        candle_nn::ops::softmax(&x, D::Minus1)?
    };
    Ok(p.to_dtype(dtype)?)
}

fn rotate_half(xs: &Tensor) -> Result<Tensor> {
    let last = xs.dim(D::Minus1)?;
    let x1 = xs.narrow(D::Minus1, 0, last / 2)?;
    let x2 = xs.narrow(D::Minus1, last / 2, last - last / 2)?;
    Ok(Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?)
}

/// cos/sin for one forward: half-width `[B, T, D/2]` tables (fused kernels) or full-width
/// `[B, 1, T, D]` (explicit rotation).
#[derive(Clone)]
struct Rope {
    cos: Tensor,
    sin: Tensor,
    kernels: Kernels,
}

impl Rope {
    fn new(
        inv_freq: &Tensor,
        position_ids: &Tensor,
        dtype: DType,
        kernels: Kernels,
    ) -> Result<Self> {
        let (b, t) = position_ids.dims2()?;
        let half = inv_freq.dim(0)?;
        let pos = position_ids.to_dtype(DType::F32)?.reshape((b, t, 1))?;
        let freqs = pos.broadcast_mul(&inv_freq.reshape((1, 1, half))?)?;
        if kernels == Kernels::Composite {
            let emb = Tensor::cat(&[&freqs, &freqs], D::Minus1)?.unsqueeze(1)?;
            Ok(Self {
                cos: emb.cos()?.to_dtype(dtype)?,
                sin: emb.sin()?.to_dtype(dtype)?,
                kernels,
            })
        } else {
            Ok(Self {
                cos: freqs.cos()?.to_dtype(dtype)?.contiguous()?,
                sin: freqs.sin()?.to_dtype(dtype)?.contiguous()?,
                kernels,
            })
        }
    }

    fn apply(&self, xs: &Tensor) -> Result<Tensor> {
        match self.kernels {
            Kernels::Inference => Ok(candle_nn::rotary_emb::rope(
                &xs.contiguous()?,
                &self.cos,
                &self.sin,
            )?),
            Kernels::FusedTraining => Ok(crate::kernels::rope(xs, &self.cos, &self.sin)?),
            Kernels::Composite => {
                Ok((xs.broadcast_mul(&self.cos)? + rotate_half(xs)?.broadcast_mul(&self.sin)?)?)
            }
        }
    }
}

#[derive(Debug, Clone)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    fn load(
        cfg: &Config,
        pb: &mut ParamBuilder,
        prefix: &str,
        std: f64,
        lora: Option<&LoraSetup>,
    ) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        Ok(Self {
            q_proj: Linear::load(
                pb,
                &format!("{prefix}.q_proj"),
                h,
                nh * d,
                cfg.qkv_bias,
                std,
                lora,
            )?,
            k_proj: Linear::load(
                pb,
                &format!("{prefix}.k_proj"),
                h,
                nkv * d,
                cfg.qkv_bias,
                std,
                lora,
            )?,
            v_proj: Linear::load(
                pb,
                &format!("{prefix}.v_proj"),
                h,
                nkv * d,
                cfg.qkv_bias,
                std,
                lora,
            )?,
            o_proj: Linear::load(
                pb,
                &format!("{prefix}.o_proj"),
                nh * d,
                h,
                cfg.o_bias,
                std,
                lora,
            )?,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
        })
    }

    fn forward(
        &self,
        xs: &Tensor,
        rope: &Rope,
        mask: &Tensor,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
        kernels: Kernels,
    ) -> Result<Tensor> {
        let (b, t, _) = xs.dims3()?;
        let (nh, nkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let q = self
            .q_proj
            .forward(xs)?
            .reshape((b, t, nh, d))?
            .transpose(1, 2)?;
        let k = self
            .k_proj
            .forward(xs)?
            .reshape((b, t, nkv, d))?
            .transpose(1, 2)?;
        let v = self
            .v_proj
            .forward(xs)?
            .reshape((b, t, nkv, d))?
            .transpose(1, 2)?;
        let q = rope.apply(&q)?;
        let k = rope.apply(&k)?.contiguous()?;
        let v = v.contiguous()?;
        let (k, v) = match cache {
            Some(slot) => {
                let kv = match slot.take() {
                    Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
                    None => (k, v),
                };
                // The cache serves decoding only: keep no autograd graph alive through it.
                *slot = Some((kv.0.detach(), kv.1.detach()));
                kv
            }
            None => (k, v),
        };
        let s = k.dim(2)?;
        let n_rep = nh / nkv;
        // Grouped-query attention without copying K/V: the n_rep query heads that share a KV
        // head are stacked along the sequence axis.
        let scale = 1.0 / (d as f64).sqrt();
        let q = (q.contiguous()? * scale)?.reshape((b, nkv, n_rep * t, d))?;
        let att = q.matmul(&k.t()?)?.reshape((b, nkv, n_rep, t, s))?;
        // The fused masked softmax also serves inference on a GPU: one kernel instead of the
        // mask's broadcast add, two casts and candle's softmax.
        let fused_softmax = kernels == Kernels::FusedTraining
            || (kernels == Kernels::Inference
                && !att.device().is_cpu()
                && crate::kernels::supported(&att));
        let att = if fused_softmax {
            crate::kernels::masked_softmax(&att, &mask.reshape((b, t, s))?)?
        } else {
            softmax_last(&att.broadcast_add(mask)?, kernels == Kernels::Inference)?
        };
        let att = att.reshape((b, nkv, n_rep * t, s))?;
        let ys = att.matmul(&v)?;
        let ys = ys
            .reshape((b, nh, t, d))?
            .transpose(1, 2)?
            .reshape((b, t, nh * d))?;
        self.o_proj.forward(&ys)
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn load(
        cfg: &Config,
        pb: &mut ParamBuilder,
        prefix: &str,
        std: f64,
        lora: Option<&LoraSetup>,
    ) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let bias = cfg.mlp_bias;
        Ok(Self {
            gate_proj: Linear::load(pb, &format!("{prefix}.gate_proj"), h, i, bias, std, lora)?,
            up_proj: Linear::load(pb, &format!("{prefix}.up_proj"), h, i, bias, std, lora)?,
            down_proj: Linear::load(pb, &format!("{prefix}.down_proj"), i, h, bias, std, lora)?,
        })
    }

    fn forward(&self, xs: &Tensor, kernels: Kernels) -> Result<Tensor> {
        let gate = self.gate_proj.forward(xs)?;
        let up = self.up_proj.forward(xs)?;
        let h = if kernels == Kernels::FusedTraining {
            crate::kernels::swiglu(&gate, &up)?
        } else {
            (gate.silu()? * up)?
        };
        self.down_proj.forward(&h)
    }
}

#[derive(Debug, Clone)]
struct Layer {
    input_layernorm: Tensor,
    self_attn: Attention,
    post_attention_layernorm: Tensor,
    mlp: Mlp,
}

impl Layer {
    fn forward(
        &self,
        xs: &Tensor,
        rope: &Rope,
        mask: &Tensor,
        slot: Option<&mut Option<(Tensor, Tensor)>>,
        eps: f64,
        kernels: Kernels,
    ) -> Result<Tensor> {
        let h = rms_norm(xs, &self.input_layernorm, eps, kernels)?;
        let h = self.self_attn.forward(&h, rope, mask, slot, kernels)?;
        let xs = (xs + h)?;
        let h = rms_norm(&xs, &self.post_attention_layernorm, eps, kernels)?;
        let h = self.mlp.forward(&h, kernels)?;
        Ok((xs + h)?)
    }

    /// Every parameter tensor of the layer.
    fn params(&self) -> Vec<Tensor> {
        let a = &self.self_attn;
        let m = &self.mlp;
        let mut out = vec![
            self.input_layernorm.clone(),
            self.post_attention_layernorm.clone(),
        ];
        for l in [
            &a.q_proj,
            &a.k_proj,
            &a.v_proj,
            &a.o_proj,
            &m.gate_proj,
            &m.up_proj,
            &m.down_proj,
        ] {
            out.push(l.w.clone());
            out.extend(l.b.clone());
            if let Some(p) = &l.lora {
                out.push(p.a.clone());
                out.push(p.b.clone());
            }
        }
        out
    }

    /// The layer with activation checkpointing: only `xs` is kept for backward, which runs
    /// the layer again (with a graph this time) and hands the parameters' gradients to
    /// [`crate::checkpoint`], since a custom op returns gradients for its inputs only.
    fn forward_checkpointed(
        &self,
        xs: &Tensor,
        rope: &Rope,
        mask: &Tensor,
        eps: f64,
        kernels: Kernels,
    ) -> Result<Tensor> {
        let out = self.forward(&xs.detach(), rope, mask, None, eps, kernels)?;
        let (layer, rope, mask) = (self.clone(), rope.clone(), mask.clone());
        crate::replay::attach1("checkpointed-decoder-layer", xs, &out, move |x, g| {
            let x = candle_core::Var::from_tensor(&x.detach())?;
            let y = layer
                .forward(x.as_tensor(), &rope, &mask, None, eps, kernels)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            let grads = (y * g.detach())?.sum_all()?.backward()?;
            crate::checkpoint::stash(&layer.params(), &grads)?;
            Ok(grads.get(x.as_tensor()).cloned())
        })
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
    /// Activations' dtype; the weights may be kept in another (f32 master weights).
    compute: DType,
    /// Activation checkpointing per layer (training only).
    checkpoint: bool,
}

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
        kernels: Kernels,
        compute: DType,
        checkpoint: bool,
        lora: Option<&LoraSetup>,
    ) -> Result<Self> {
        let std = 0.02;
        let h = cfg.hidden_size;
        let embed_tokens = pb.get(
            "model.embed_tokens.weight",
            &[cfg.vocab_size, h],
            Init::Normal(std),
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
        }
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                input_layernorm: pb.get(
                    &format!("{p}.input_layernorm.weight"),
                    &[h],
                    Init::Ones,
                )?,
                self_attn: Attention::load(cfg, pb, &format!("{p}.self_attn"), std, lora)?,
                post_attention_layernorm: pb.get(
                    &format!("{p}.post_attention_layernorm.weight"),
                    &[h],
                    Init::Ones,
                )?,
                mlp: Mlp::load(cfg, pb, &format!("{p}.mlp"), std, lora)?,
            });
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
            compute,
            checkpoint,
        })
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
        if let Some(c) = cache.as_ref() {
            if c.layers.len() != self.layers.len() {
                return Err(Error::InvalidArgument(format!(
                    "KV cache has {} layers, the model {}",
                    c.layers.len(),
                    self.layers.len()
                )));
            }
        }
        let dtype = self.compute;
        let device = self.embed_tokens.device().clone();
        let mask = build_mask(attention_mask, t, past, dtype, &device)?;
        let rope = Rope::new(&self.inv_freq, position_ids, dtype, self.kernels)?;
        let ids = input_ids.to_dtype(DType::U32)?.flatten_all()?;
        // Gather first, then cast: only the looked-up rows are converted.
        let mut xs = self
            .embed_tokens
            .index_select(&ids, 0)?
            .reshape((b, t, self.cfg.hidden_size))?
            .to_dtype(dtype)?;
        let eps = self.cfg.rms_norm_eps;
        let kernels = self.kernels;
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
