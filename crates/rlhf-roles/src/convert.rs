//! What the engines share between a typed request and their model: the checks of a
//! request's geometry against the job's shapes (errors name the call, the tensor and the
//! config key), its tensors on the device, and row selection for micro-batches. The
//! host ↔ tensor conversion itself lives once, in `rlhf_core::calls::candle`.

use candle_core::{Device, Tensor};
use rlhf_config::Shapes;
use rlhf_core::calls::candle::{f32_tensor, ids_tensor};
use rlhf_core::calls::{Mat, Sequences};

use crate::error::{Error, Result};
use crate::train::Ident;

/// Checks that `seq` has this job's geometry and returns its ids and mask on `device`.
pub fn sequences(
    call: &str,
    seq: &Sequences,
    shapes: Shapes,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    if seq.input_ids.cols != shapes.seq_len() || seq.response_len != shapes.response_len {
        return Err(Error::invalid(format!(
            "{call}: sequences of {} columns with {} response columns, but this job has \
             actor_rollout.max_prompt_length={} + max_response_length={}",
            seq.input_ids.cols, seq.response_len, shapes.prompt_len, shapes.response_len
        )));
    }
    Ok((
        ids_tensor(&seq.input_ids, "input_ids", device)?,
        ids_tensor(&seq.attention_mask, "attention_mask", device)?,
    ))
}

/// A `[B, R]` token matrix of a request, checked against the rows and response length.
pub fn tokens(
    call: &str,
    name: &str,
    m: &Mat<f32>,
    rows: usize,
    shapes: Shapes,
    device: &Device,
) -> Result<Tensor> {
    if m.shape() != [rows, shapes.response_len] {
        return Err(Error::invalid(format!(
            "{call}: tensor '{name}' has shape {:?}, expected [{rows}, {}] \
             (rows x actor_rollout.max_response_length)",
            m.shape(),
            shapes.response_len
        )));
    }
    Ok(f32_tensor(m, name, device)?)
}

/// Refuses NaN / inf at valid positions of a token matrix (only valid positions matter).
pub fn check_finite_masked(
    name: &str,
    m: &Mat<f32>,
    mask: &[f32],
    who: &Ident,
    step: u64,
) -> Result<()> {
    if m.data
        .iter()
        .zip(mask)
        .any(|(x, &k)| k != 0.0 && !x.is_finite())
    {
        return Err(Error::NonFinite {
            tensor: name.to_string(),
            role: who.role,
            rank: who.rank,
            step,
        });
    }
    Ok(())
}

/// Rows `idx` of `t` (dim 0).
pub fn rows(t: &Tensor, idx: &[usize]) -> Result<Tensor> {
    let ids: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
    let ids = Tensor::from_vec(ids, idx.len(), t.device())?;
    Ok(t.index_select(&ids, 0)?)
}

/// Runs `f` over row chunks of `chunk` rows and concatenates the outputs along dim 0.
pub fn chunked(
    b: usize,
    chunk: usize,
    mut f: impl FnMut(&[usize]) -> Result<Vec<Tensor>>,
) -> Result<Vec<Tensor>> {
    let all: Vec<usize> = (0..b).collect();
    let mut parts: Vec<Vec<Tensor>> = Vec::new();
    for idx in all.chunks(chunk.max(1)) {
        parts.push(f(idx)?);
    }
    let n = parts.first().map_or(0, Vec::len);
    (0..n)
        .map(|i| {
            let ts: Vec<&Tensor> = parts.iter().map(|p| &p[i]).collect();
            Ok(Tensor::cat(&ts, 0)?.detach())
        })
        .collect()
}

/// How an engine loads its model from its spec: device, seed, precision (`training.bf16`:
/// mixed precision when trained, bf16 weights when frozen), the LM head's chunking and,
/// for trained engines, activation checkpointing. One rule for every engine.
pub fn load_options(
    spec: &rlhf_config::RoleSpec,
    device: &candle_core::Device,
    base: rlhf_model::LoadOptions,
) -> rlhf_model::LoadOptions {
    let trainable = base.trainable;
    rlhf_model::LoadOptions {
        seed: spec.seed,
        device: device.clone(),
        logits_chunk: spec.logits_chunk,
        gradient_checkpointing: trainable && spec.gradient_checkpointing,
        lora: spec.lora.as_ref().map(|l| rlhf_model::LoraConfig {
            rank: l.rank as usize,
            alpha: l.alpha,
            dropout: l.dropout,
            target_modules: l.target_modules.clone(),
            rslora: false,
        }),
        ..base
    }
    .with_bf16(spec.dtype == rlhf_types::DType::BF16)
}
