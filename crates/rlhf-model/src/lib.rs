//! Models on candle: Llama/Qwen2-family policy, value and score models.
//!
//! Load an HF model directory ([`Model::load`]) as a causal LM (policy, reference), a critic
//! with a per-token value head, or a reward model with a score head; run forward passes on
//! left-padded batches ([`Batch`]), compute token log-probs and entropies, train with
//! [`AdamW`], clipping, schedules and gradient accumulation, generate with a KV cache
//! ([`generate`]) and save back as an HF directory ([`Model::save`]). Tokenizers and chat
//! templates come from `tokenizer.json` + `tokenizer_config.json` ([`Tokenizer`]). Hub
//! names such as `Qwen/Qwen2.5-0.5B-Instruct` resolve through the local Hugging Face cache
//! ([`hub`], [`Model::load_spec`]).
//!
//! Trainable models compute with differentiable ops only: candle's fused kernels
//! (softmax_last_dim, rms_norm, rope) silently drop gradients, so they are used for frozen
//! (inference) models only. On the CPU in f32/f64 and on CUDA GPUs in f32/f64/bf16, training
//! uses this crate's own fused kernels, which do have a backward pass ([`Kernels`]).
//!
//! ```
//! use rlhf_model::*;
//! # fn main() -> rlhf_model::Result<()> {
//! # let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
//! // Rollout: a frozen policy generates from chat prompts.
//! let tok = Tokenizer::from_dir(&dir)?;
//! let policy = Model::load(&dir, &LoadOptions::inference())?;
//! let prompt = tok.encode_chat(&[ChatMessage::user("Hello")], true)?;
//! let cfg = GenerationConfig { max_new_tokens: 4, temperature: 0.7, seed: 1, n: 2,
//!                              ..policy.generation_config().clone() };
//! let out = generate(&policy, &[prompt], &cfg)?;
//! let text = tok.decode(&out.sequences[0].token_ids, true)?;
//!
//! // Training: recompute log-probs of a sequence with a trainable copy and step AdamW.
//! let actor = Model::load(&dir, &LoadOptions::training(ModelKind::CausalLm))?;
//! let s = &out.sequences[0];
//! let seq: Vec<u32> = s.prompt_ids.iter().chain(&s.token_ids).copied().collect();
//! let batch = Batch::left_padded(&[seq], 0, &Device::Cpu)?;
//! let loss = actor.token_log_probs(&batch, cfg.temperature)?.mean_all()?.neg()?;
//! let vars = actor.vars();
//! let mut grads = Gradients::backward(&loss, &vars)?;
//! grads.clip_global_norm(1.0)?;
//! let mut opt = AdamW::new(vars, AdamWConfig::default())?;
//! opt.step(&grads)?;
//! policy.set_weights(&actor.named_tensors())?; // weight sync to the rollout model
//! # let _ = text;
//! # Ok(())
//! # }
//! ```

mod checkpoint;
pub mod config;
mod device_pool;
pub mod error;
mod gen_config;
pub mod generation;
mod head;
pub mod hub;
mod image;
pub mod ipc;
mod kernels;
mod kv_cache;
mod linear;
mod load;
pub mod lora;
mod lora_model;
pub mod model;
pub mod ops;
#[doc(hidden)]
pub mod profile;
mod replay;
pub mod safetensors_writer;
pub mod tokenizer;
pub mod train;
pub mod transformer;
pub mod weights;
pub mod zero3;

pub use candle_core::{DType, Device, Tensor, Var};
pub use config::{Config, Family, MemoryEstimate, RopeScaling, SUPPORTED_ARCHITECTURES};
pub use device_pool::keep_freed_device_memory;
pub use error::{Error, Result};
pub use generation::{generate, FinishReason, GeneratedSequence, Generation, GenerationConfig};
pub use lora::LoraConfig;
pub use lora_model::DropoutPass;
pub use model::{Batch, LoadOptions, Model, ModelImage, ModelKind, ValueHeadInit};
pub use ops::{entropy_from_logits, lm_head_log_probs, log_probs_from_logits, masked_mean};
pub use safetensors_writer::SafetensorsWriter;
pub use tokenizer::{ChatMessage, Tokenizer};
pub use train::{
    partition, shard_span, AdamW, AdamWConfig, GradAccumulator, Gradients, LrSchedule, LrScheduler,
};
pub use transformer::{position_ids_from_mask, Kernels, KvCache};
