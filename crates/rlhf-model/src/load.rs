//! How a model is loaded ([`LoadOptions`]: device, dtypes, head kind, memory savers) and the
//! left-padded batches it computes on ([`Batch`]).

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::transformer::position_ids_from_mask;

/// Which head sits on the decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelKind {
    /// Logits over the vocabulary at every position (`lm_head`).
    CausalLm,
    /// One scalar per token (critic); saved as `*ForTokenClassification` with `score.*`.
    Value,
    /// One scalar per sequence read at the last non-pad token (reward model,
    /// `*ForSequenceClassification` with `score.weight`).
    Reward,
}

/// Where a critic's value head comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ValueHeadInit {
    /// The checkpoint's head when it has one (`score.*`, TRL `v_head.summary.*`, OpenRLHF
    /// `value_head.*`), otherwise fresh.
    Auto,
    /// The checkpoint must hold a head (e.g. initialising the critic from a reward model).
    FromCheckpoint,
    /// Always fresh: normal(0, std) weight, zero bias.
    Fresh { std: f64 },
}

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    pub dtype: DType,
    pub kind: ModelKind,
    /// Trainable models compute with their `Var`s; frozen ones with detached views.
    pub trainable: bool,
    /// Use candle's fused kernels (no backward). `None`: fast exactly when not trainable.
    pub fast: Option<bool>,
    /// Differentiable path built from candle's primitive ops only, even where this crate's
    /// fused kernels could run (slower; for cross-checking).
    pub composite_ops: bool,
    pub value_head_init: ValueHeadInit,
    /// Seed for any freshly initialised parameter.
    pub seed: u64,
    /// The dtype activations are computed in when it differs from `dtype`, the dtype the
    /// parameters are kept in: mixed precision keeps f32 master weights (and f32 AdamW state)
    /// and computes in bf16. `None`: `dtype`.
    pub compute_dtype: Option<DType>,
    /// Tokens per chunk of the LM head when computing log-probs and entropies, so that the
    /// `[B, T, V]` logits never exist at once. `None`: the whole batch at once.
    pub logits_chunk: Option<usize>,
    /// Activation checkpointing per decoder layer: only each layer's input is kept for
    /// backward, which recomputes the layer. Trainable models only.
    pub gradient_checkpointing: bool,
    /// LoRA adapters on the decoder's linear layers: the base is frozen (kept in the compute
    /// dtype, outside the autograd graph) and only the adapters (and a value or score head)
    /// train, sync and save. `None`: the full model.
    pub lora: Option<crate::lora::LoraConfig>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            dtype: DType::F32,
            kind: ModelKind::CausalLm,
            trainable: false,
            fast: None,
            composite_ops: false,
            value_head_init: ValueHeadInit::Auto,
            seed: 0,
            compute_dtype: None,
            logits_chunk: None,
            gradient_checkpointing: false,
            lora: None,
        }
    }
}

impl LoadOptions {
    /// Frozen causal LM in f32 on CPU.
    pub fn inference() -> Self {
        Self::default()
    }

    /// Trainable model of the given kind in f32 on CPU.
    pub fn training(kind: ModelKind) -> Self {
        Self {
            kind,
            trainable: true,
            ..Self::default()
        }
    }

    pub fn with_kind(mut self, kind: ModelKind) -> Self {
        self.kind = kind;
        self
    }

    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    pub fn with_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    pub fn with_lora(mut self, lora: Option<crate::lora::LoraConfig>) -> Self {
        self.lora = lora;
        self
    }

    pub fn with_fast(mut self, fast: bool) -> Self {
        self.fast = Some(fast);
        self
    }

    /// bf16 the way the roles use it: a trainable model keeps f32 master weights and computes
    /// in bf16 (mixed precision); a frozen one holds its weights in bf16. `false`: f32.
    pub fn with_bf16(mut self, bf16: bool) -> Self {
        match (bf16, self.trainable) {
            (false, _) => {
                self.dtype = DType::F32;
                self.compute_dtype = None;
            }
            (true, true) => {
                self.dtype = DType::F32;
                self.compute_dtype = Some(DType::BF16);
            }
            (true, false) => {
                self.dtype = DType::BF16;
                self.compute_dtype = None;
            }
        }
        self
    }

    /// The dtype activations are computed in.
    pub fn compute(&self) -> DType {
        self.compute_dtype.unwrap_or(self.dtype)
    }
}

/// A left-padded batch: `input_ids` `[B, T]` u32, `attention_mask` `[B, T]` u32 (1 = token),
/// `position_ids` `[B, T]` u32.
#[derive(Debug, Clone)]
pub struct Batch {
    pub input_ids: Tensor,
    pub attention_mask: Tensor,
    pub position_ids: Tensor,
}

impl Batch {
    /// Left-pads token sequences to a common length.
    pub fn left_padded(seqs: &[Vec<u32>], pad_id: u32, device: &Device) -> Result<Self> {
        let b = seqs.len();
        let t = seqs.iter().map(Vec::len).max().unwrap_or(0);
        if b == 0 || t == 0 {
            return Err(Error::InvalidArgument(
                "cannot build a batch from no tokens".to_string(),
            ));
        }
        let mut ids = Vec::with_capacity(b * t);
        let mut mask = Vec::with_capacity(b * t);
        for s in seqs {
            let pad = t - s.len();
            ids.extend(std::iter::repeat_n(pad_id, pad));
            ids.extend_from_slice(s);
            mask.extend(std::iter::repeat_n(0u32, pad));
            mask.extend(std::iter::repeat_n(1u32, s.len()));
        }
        let attention_mask = Tensor::from_vec(mask, (b, t), device)?;
        Ok(Self {
            input_ids: Tensor::from_vec(ids, (b, t), device)?,
            position_ids: position_ids_from_mask(&attention_mask)?,
            attention_mask,
        })
    }

    /// From ready tensors; position ids derived from the mask.
    pub fn from_mask(input_ids: Tensor, attention_mask: Tensor) -> Result<Self> {
        let position_ids = position_ids_from_mask(&attention_mask)?;
        Ok(Self {
            input_ids,
            attention_mask,
            position_ids,
        })
    }
}
