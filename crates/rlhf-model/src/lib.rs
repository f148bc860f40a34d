//! Models on candle: Llama/Qwen2-family policy, value and score models.
//!
//! Load an HF model directory ([`Model::load`]) as a causal LM (policy, reference), a critic
//! with a per-token value head, or a reward model with a score head; run forward passes on
//! left-padded batches ([`Batch`]), compute token log-probs and entropies, train with
//! [`AdamW`], clipping, schedules and gradient accumulation, generate with a KV cache
//! ([`generate`]) and save back as an HF directory ([`Model::save`]). Tokenizers and chat
//! templates come from `tokenizer.json` + `tokenizer_config.json` ([`Tokenizer`]).
//!
//! Trainable models compute with differentiable ops only: candle's fused kernels
//! (softmax_last_dim, rms_norm, rope) silently drop gradients, so they are used for frozen
//! (inference) models only.

pub mod error;
pub mod generation;
mod kernels;
pub mod model;
pub mod ops;
pub mod tokenizer;
pub mod train;
pub mod transformer;
pub mod weights;

pub use candle_core::{DType, Device, Tensor, Var};
pub use error::{Error, Result};
pub use generation::{generate, FinishReason, GeneratedSequence, Generation, GenerationConfig};
pub use model::{Batch, LoadOptions, Model, ModelKind, ValueHeadInit};
pub use ops::{entropy_from_logits, log_probs_from_logits, masked_mean};
pub use tokenizer::{ChatMessage, Tokenizer};
pub use train::{AdamW, AdamWConfig, GradAccumulator, Gradients, LrSchedule, LrScheduler};
pub use transformer::{
    position_ids_from_mask, Config, Family, Kernels, KvCache, RopeScaling, SUPPORTED_ARCHITECTURES,
};
