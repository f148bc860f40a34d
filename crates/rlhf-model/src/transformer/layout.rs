//! A checkpoint's attention tensors against config.json's head layout, checked by name and
//! shape before anything is read, so that a mislabeled or mis-sized checkpoint is refused
//! with the numbers and the fix instead of a bare "tensor not found" or "shape [a, b]":
//! Qwen3 needs its per-head q/k norms (a checkpoint without them is likely a Qwen2 one
//! labeled Qwen3, and one with them labeled otherwise likely a Qwen3 one), and `head_dim`
//! must agree with the q/k projections and with the norms' length.

use crate::config::{Config, Family};
use crate::error::{Error, Result};
use crate::weights::ParamBuilder;

/// Where `head_dim` came from, for the messages: config.json or the family's default.
fn head_dim_source(cfg: &Config) -> String {
    let d = cfg.head_dim;
    let explicit = cfg.raw.get("head_dim").is_some_and(|v| !v.is_null());
    match (explicit, cfg.family) {
        (true, _) => format!("config.json's head_dim={d}"),
        (false, Family::Qwen3) => {
            format!("head_dim={d} (config.json has no head_dim; Qwen3 then takes 128)")
        }
        (false, _) => {
            format!("head_dim={d} (config.json has no head_dim: hidden_size / num_attention_heads)")
        }
    }
}

/// Checks every layer's q/k projections and, for Qwen3, its q/k norms; see the module doc.
pub(super) fn check_attention_layout(cfg: &Config, pb: &ParamBuilder) -> Result<()> {
    let (h, d) = (cfg.hidden_size, cfg.head_dim);
    let fix = "set head_dim in config.json to the checkpoint's";
    for i in 0..cfg.num_hidden_layers {
        let attn = format!("model.layers.{i}.self_attn");
        let q_norm = pb.shape_in_checkpoint(&format!("{attn}.q_norm.weight"));
        for (proj, heads, key) in [
            ("q_proj", cfg.num_attention_heads, "num_attention_heads"),
            ("k_proj", cfg.num_key_value_heads, "num_key_value_heads"),
        ] {
            let name = format!("{attn}.{proj}.weight");
            let Some(shape) = pb.shape_in_checkpoint(&name) else {
                continue; // the load names it missing
            };
            if shape == [heads * d, h] {
                continue;
            }
            let mut fits = String::new();
            if let [rows, cols] = shape[..] {
                if cols == h && rows % heads == 0 {
                    fits = format!("; the weights fit head_dim={}", rows / heads);
                }
            }
            if let (true, Some(n)) = (cfg.qk_norm, &q_norm) {
                fits.push_str(&format!(" ({attn}.q_norm.weight has shape {n:?})"));
            }
            return Err(Error::Config(format!(
                "{name} has shape {shape:?} but {} with {key}={heads} and hidden_size={h} \
                 implies [{}, {h}]{fits}; {fix}",
                head_dim_source(cfg),
                heads * d,
            )));
        }
        if cfg.qk_norm {
            for norm in ["q_norm", "k_norm"] {
                let name = format!("{attn}.{norm}.weight");
                match pb.shape_in_checkpoint(&name) {
                    None => {
                        return Err(Error::Config(format!(
                            "{name} is not in the weights: {} (Qwen3) needs a per-head RMSNorm \
                             of q and of k (self_attn.q_norm and self_attn.k_norm, [head_dim] \
                             each) in every layer. A checkpoint without them may be a Qwen2 one \
                             labeled Qwen3: check config.json's architectures and model_type \
                             (Qwen2ForCausalLM / qwen2 for a Qwen2 checkpoint)",
                            cfg.architecture
                        )))
                    }
                    Some(shape) if shape != [d] => {
                        return Err(Error::Config(format!(
                            "{name} has shape {shape:?} but {} implies [{d}] (one weight per \
                             dimension of a head); {fix}",
                            head_dim_source(cfg)
                        )))
                    }
                    Some(_) => {}
                }
            }
        } else if i == 0 && q_norm.is_some() {
            // Another family would load without the norms and compute something else.
            return Err(Error::Config(format!(
                "{attn}.q_norm.weight is in the weights but config.json says {} (model_type \
                 {}), which has no q/k norms: the checkpoint may be a Qwen3 one mislabeled; \
                 check config.json's architectures and model_type (Qwen3ForCausalLM / qwen3 \
                 for a Qwen3 checkpoint)",
                cfg.architecture,
                cfg.family.model_type()
            )));
        }
    }
    Ok(())
}
