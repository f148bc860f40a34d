//! One decoder layer of the Llama family: RMSNorm, rotary embeddings, grouped-query
//! attention (with Qwen3's per-head RMSNorm of q and k before RoPE) and the SwiGLU MLP, each
//! with the op implementations [`Kernels`] picks, and the layer's activation-checkpointed
//! forward.

use candle_core::{DType, Tensor, D};

use super::{Kernels, INIT_STD};
use crate::config::Config;
use crate::error::Result;
use crate::linear::{Linear, LoraSetup};
use crate::weights::{Init, ParamBuilder};

pub(super) fn rms_norm(xs: &Tensor, w: &Tensor, eps: f64, kernels: Kernels) -> Result<Tensor> {
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
pub(super) struct Rope {
    cos: Tensor,
    sin: Tensor,
    kernels: Kernels,
}

impl Rope {
    pub(super) fn new(
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
    /// Qwen3: RMSNorm weights `[head_dim]` applied to every head of q and of k before RoPE.
    qk_norm: Option<(Tensor, Tensor)>,
    eps: f64,
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
            qk_norm: if cfg.qk_norm {
                Some((
                    pb.get(&format!("{prefix}.q_norm.weight"), &[d], Init::Ones)?,
                    pb.get(&format!("{prefix}.k_norm.weight"), &[d], Init::Ones)?,
                ))
            } else {
                None
            },
            eps: cfg.rms_norm_eps,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
        })
    }

    /// q `[B, T, heads * D]` and k `[B, T, kv_heads * D]` with each head RMS-normed (Qwen3),
    /// or as they are.
    fn norm_qk(&self, q: Tensor, k: Tensor, kernels: Kernels) -> Result<(Tensor, Tensor)> {
        let Some((qn, kn)) = &self.qk_norm else {
            return Ok((q, k));
        };
        let (b, t, _) = q.dims3()?;
        let d = self.head_dim;
        let norm = |x: Tensor, w: &Tensor, heads: usize| -> Result<Tensor> {
            let x = x.reshape((b, t, heads, d))?;
            Ok(rms_norm(&x, w, self.eps, kernels)?.reshape((b, t, heads * d))?)
        };
        Ok((
            norm(q, qn, self.num_heads)?,
            norm(k, kn, self.num_kv_heads)?,
        ))
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
        let fused = kernels == Kernels::FusedTraining;
        let scale = 1.0 / (d as f64).sqrt();
        if fused && cache.is_none() {
            // Training: RoPE, the head transposes and the core as one graph node (see
            // kernels/attention.rs).
            let q = self.q_proj.forward_with(xs, fused)?;
            let k = self.k_proj.forward_with(xs, fused)?;
            let (q, k) = self.norm_qk(q, k, kernels)?;
            let v = self.v_proj.forward_with(xs, fused)?;
            let mask = mask.reshape((b, t, t))?;
            let ys = crate::kernels::attention_block(
                &q, &k, &v, &rope.cos, &rope.sin, &mask, nh, nkv, scale,
            )?;
            return self.o_proj.forward_with(&ys, fused);
        }
        let (q, k) = self.norm_qk(
            self.q_proj.forward_with(xs, fused)?,
            self.k_proj.forward_with(xs, fused)?,
            kernels,
        )?;
        let q = q.reshape((b, t, nh, d))?.transpose(1, 2)?;
        let k = k.reshape((b, t, nkv, d))?.transpose(1, 2)?;
        let v = self
            .v_proj
            .forward_with(xs, fused)?
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
        if fused {
            // Decoding with a training model's kernels: the core as one node.
            let q = q.contiguous()?.reshape((b, nkv, n_rep * t, d))?;
            let ys = crate::kernels::attention(&q, &k, &v, &mask.reshape((b, t, s))?, scale)?
                .reshape((b, nh, t, d))?
                .transpose(1, 2)?
                .reshape((b, t, nh * d))?;
            return self.o_proj.forward_with(&ys, fused);
        }
        let q = (q.contiguous()? * scale)?.reshape((b, nkv, n_rep * t, d))?;
        let att = q.matmul(&k.t()?)?.reshape((b, nkv, n_rep, t, s))?;
        // Inference on a GPU takes the fused masked softmax: one kernel instead of the mask's
        // broadcast add, two casts and candle's softmax.
        let fused_softmax = kernels == Kernels::Inference
            && !att.device().is_cpu()
            && crate::kernels::supported(&att);
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
        let fused = kernels == Kernels::FusedTraining;
        let (g, u) = (&self.gate_proj, &self.up_proj);
        let plain = |l: &Linear| l.lora.is_none() && l.b.is_none();
        if fused && plain(g) && plain(u) && (g.w.track_op() || u.w.track_op()) {
            // Training: both products and the activation as one graph node (kernels/mlp.rs).
            let h = crate::kernels::gate_up_swiglu(xs, &g.w, &u.w)?;
            return self.down_proj.forward_with(&h, fused);
        }
        let gate = self.gate_proj.forward_with(xs, fused)?;
        let up = self.up_proj.forward_with(xs, fused)?;
        let h = if fused {
            crate::kernels::swiglu(&gate, &up)?
        } else {
            (gate.silu()? * up)?
        };
        self.down_proj.forward_with(&h, fused)
    }
}

#[derive(Debug, Clone)]
pub(super) struct Layer {
    input_layernorm: Tensor,
    self_attn: Attention,
    post_attention_layernorm: Tensor,
    mlp: Mlp,
}

impl Layer {
    /// Decoder layer `i` (`model.layers.{i}.*`).
    pub(super) fn load(
        cfg: &Config,
        pb: &mut ParamBuilder,
        i: usize,
        lora: Option<&LoraSetup>,
    ) -> Result<Self> {
        let (std, h) = (INIT_STD, cfg.hidden_size);
        let p = format!("model.layers.{i}");
        Ok(Layer {
            input_layernorm: pb.get(&format!("{p}.input_layernorm.weight"), &[h], Init::Ones)?,
            self_attn: Attention::load(cfg, pb, &format!("{p}.self_attn"), std, lora)?,
            post_attention_layernorm: pb.get(
                &format!("{p}.post_attention_layernorm.weight"),
                &[h],
                Init::Ones,
            )?,
            mlp: Mlp::load(cfg, pb, &format!("{p}.mlp"), std, lora)?,
        })
    }

    pub(super) fn forward(
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
        if let Some((qn, kn)) = &a.qk_norm {
            out.push(qn.clone());
            out.push(kn.clone());
        }
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
    pub(super) fn forward_checkpointed(
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
