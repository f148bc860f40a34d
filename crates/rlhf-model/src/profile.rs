//! Where a training step's time goes, op by op: each fused training op of a decoder layer
//! (and the LM head) timed alone at a model's shape, forward and forward + backward, next to
//! a plain matmul of the same sizes and candle's per-node gradient overhead (a zero-filled
//! tensor plus an add). For the benches only (`model_bench --parts`): the GPU machines have no
//! profiler for a process that is not PyTorch, so this is how the backward is taken apart.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var, D};

use crate::error::Result;

/// The sizes the parts are timed at.
#[derive(Debug, Clone, Copy)]
pub struct PartsShape {
    pub batch: usize,
    pub seq: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub vocab: usize,
}

/// One part: median milliseconds of its forward alone and of forward + backward (none for a
/// reference measurement with no graph).
#[derive(Debug, Clone)]
pub struct PartTiming {
    pub name: String,
    pub forward_ms: f64,
    pub forward_backward_ms: Option<f64>,
}

fn median_ms(dev: &Device, repeats: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let mut t = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t0 = Instant::now();
        f()?;
        dev.synchronize()?;
        t.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// Times `fwd(inputs)` and `fwd(inputs)` + backward of the sum of its output.
fn part(
    dev: &Device,
    name: &str,
    repeats: usize,
    fwd: impl Fn() -> Result<Tensor>,
) -> Result<PartTiming> {
    let forward_ms = median_ms(dev, repeats, || fwd().map(drop))?;
    let forward_backward_ms = median_ms(dev, repeats, || {
        let y = fwd()?;
        y.sum_all()?.backward()?;
        Ok(())
    })?;
    Ok(PartTiming {
        name: name.to_string(),
        forward_ms,
        forward_backward_ms: Some(forward_backward_ms),
    })
}

fn randn(dev: &Device, shape: &[usize], dtype: DType) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 0.02, shape, dev)?.to_dtype(dtype)?)
}

/// Every part at `shape`, activations in `dtype`, weights in f32 (mixed precision's master
/// weights) when `dtype` is bf16.
pub fn parts(dev: &Device, dtype: DType, s: PartsShape, repeats: usize) -> Result<Vec<PartTiming>> {
    let wdt = crate::ops::wide_dtype(dtype);
    let (b, t, h, i) = (s.batch, s.seq, s.hidden, s.intermediate);
    let d = h / s.heads;
    let n_rep = s.heads / s.kv_heads;
    let rows = b * t;
    let var = |shape: &[usize], dt: DType| -> Result<Var> {
        Ok(Var::from_tensor(&randn(dev, shape, dt)?)?)
    };
    let x = var(&[b, t, h], dtype)?;
    let xi = var(&[b, t, i], dtype)?;
    let w_up = var(&[i, h], wdt)?;
    let w_down = var(&[h, i], wdt)?;
    let w_norm = var(&[h], wdt)?;
    let mut out = Vec::new();

    // Plain products of the MLP's sizes: what the fused linear's own time compares with.
    let xd = x.as_tensor().detach().reshape((rows, h))?;
    let wd = w_up.as_tensor().to_dtype(dtype)?;
    let ms = median_ms(dev, repeats, || {
        xd.matmul(&wd.t()?).map(drop).map_err(Into::into)
    })?;
    out.push(PartTiming {
        name: format!("matmul [{rows}, {h}] x [{h}, {i}] (no graph)"),
        forward_ms: ms,
        forward_backward_ms: None,
    });
    // candle's backward adds a zero-filled gradient and an add per node input.
    let big = randn(dev, &[rows, i], dtype)?;
    let ms = median_ms(dev, repeats, || {
        big.zeros_like()?.add(&big)?;
        Ok(())
    })?;
    out.push(PartTiming {
        name: format!("zeros_like + add [{rows}, {i}] (candle's cost per node input)"),
        forward_ms: ms,
        forward_backward_ms: None,
    });

    out.push(part(dev, &format!("linear {h} -> {i}"), repeats, || {
        Ok(crate::kernels::linear(x.as_tensor(), w_up.as_tensor())?)
    })?);
    out.push(part(dev, &format!("linear {i} -> {h}"), repeats, || {
        Ok(crate::kernels::linear(xi.as_tensor(), w_down.as_tensor())?)
    })?);
    let w_gate = var(&[i, h], wdt)?;
    out.push(part(
        dev,
        &format!("gate + up {h} -> {i} with SwiGLU"),
        repeats,
        || {
            Ok(crate::kernels::gate_up_swiglu(
                x.as_tensor(),
                w_gate.as_tensor(),
                w_up.as_tensor(),
            )?)
        },
    )?);
    out.push(part(dev, "rms_norm", repeats, || {
        let w = w_norm.as_tensor().to_dtype(dtype)?;
        Ok(crate::kernels::rms_norm(x.as_tensor(), &w, 1e-6)?)
    })?);
    let up = var(&[b, t, i], dtype)?;
    out.push(part(dev, "swiglu", repeats, || {
        Ok(crate::kernels::swiglu(xi.as_tensor(), up.as_tensor())?)
    })?);
    let q = var(&[b, s.heads, t, d], dtype)?;
    let cos = randn(dev, &[b, t, d / 2], dtype)?;
    let sin = randn(dev, &[b, t, d / 2], dtype)?;
    out.push(part(dev, "rope (queries)", repeats, || {
        Ok(crate::kernels::rope(q.as_tensor(), &cos, &sin)?)
    })?);
    let qa = var(&[b, s.kv_heads, n_rep * t, d], dtype)?;
    let k = var(&[b, s.kv_heads, t, d], dtype)?;
    let v = var(&[b, s.kv_heads, t, d], dtype)?;
    let causal: Vec<f32> = (0..t * t)
        .map(|j| {
            if j % t > j / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(causal, (1, t, t), dev)?
        .to_dtype(dtype)?
        .broadcast_as((b, t, t))?
        .contiguous()?;
    let scale = 1.0 / (d as f64).sqrt();
    out.push(part(dev, "attention core", repeats, || {
        Ok(crate::kernels::attention(
            qa.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            &mask,
            scale,
        )?)
    })?);
    let (hq, hkv) = (s.heads * d, s.kv_heads * d);
    let (qp, kp, vp) = (
        var(&[b, t, hq], dtype)?,
        var(&[b, t, hkv], dtype)?,
        var(&[b, t, hkv], dtype)?,
    );
    out.push(part(
        dev,
        "attention block (RoPE, heads, core)",
        repeats,
        || {
            Ok(crate::kernels::attention_block(
                qp.as_tensor(),
                kp.as_tensor(),
                vp.as_tensor(),
                &cos,
                &sin,
                &mask,
                s.heads,
                s.kv_heads,
                scale,
            )?)
        },
    )?);
    // Residual adds and the reshapes around attention, as the layer makes them.
    out.push(part(dev, "residual add", repeats, || {
        Ok((x.as_tensor() + x.as_tensor())?)
    })?);
    out.push(part(dev, "heads reshape + transpose", repeats, || {
        Ok(x.as_tensor()
            .reshape((b, t, s.heads, d))?
            .transpose(1, 2)?
            .contiguous()?)
    })?);

    // The LM head: the product to the vocabulary and the fused log-probs.
    let w_head = var(&[s.vocab, h], wdt)?;
    let ids: Vec<u32> = (0..rows).map(|j| ((j * 7919) % s.vocab) as u32).collect();
    let targets = Tensor::from_vec(ids, (b, t), dev)?;
    out.push(part(
        dev,
        &format!("lm head {h} -> {} + log-probs", s.vocab),
        repeats,
        || {
            let (lp, _) =
                crate::kernels::lm_head(x.as_tensor(), w_head.as_tensor(), &targets, 1.0, false)?;
            Ok(lp)
        },
    )?);
    let logits = randn(dev, &[b, t, s.vocab], dtype)?;
    let logits = Var::from_tensor(&logits)?;
    out.push(part(dev, "log-probs kernel alone", repeats, || {
        Ok(crate::kernels::log_probs(
            logits.as_tensor(),
            &targets,
            1.0,
        )?)
    })?);
    // The embedding lookup (its backward is an index_add into a [V, H] gradient).
    out.push(part(dev, "embedding lookup", repeats, || {
        Ok(
            crate::kernels::embedding(w_head.as_tensor(), &targets.flatten_all()?, dtype)?
                .sum_keepdim(D::Minus1)?,
        )
    })?);
    Ok(out)
}

/// A field of this process's `/proc/self/status` in MiB (`VmHWM:`, the peak resident set;
/// `VmRSS:`, the current one): the memory numbers of the benches.
pub fn status_mib(key: &str) -> std::io::Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let bad = || std::io::Error::other(format!("no number for {key} in /proc/self/status"));
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .ok_or_else(bad)?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .map_err(|_| bad())?;
    Ok(kib / 1024.0)
}

/// Resets this process's peak resident set (`VmHWM`) to the current one, so a later peak
/// is of what follows.
pub fn reset_peak() -> std::io::Result<()> {
    std::fs::write("/proc/self/clear_refs", "5")
}
