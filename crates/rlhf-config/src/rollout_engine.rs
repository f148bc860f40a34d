//! `actor_rollout.engine` and `actor_rollout.vllm`: which engine the rollout ranks generate
//! with (our candle loop, or a vLLM server each rollout rank runs as its child) and what a
//! user tunes of the server. Which Python runs vLLM is the worker's setting, never the
//! job's: a job names no executable, and its extra engine arguments come from a fixed list
//! of tuning flags, none of which loads code.

use serde::{Deserialize, Serialize};

/// The rollout ranks' engine (`actor_rollout.engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutEngine {
    /// Our own generation loop on the role's device (no Python).
    #[default]
    Candle,
    /// A vLLM server per rollout rank, spoken to token in and token out.
    Vllm,
}

impl std::fmt::Display for RolloutEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RolloutEngine::Candle => "candle",
            RolloutEngine::Vllm => "vllm",
        })
    }
}

/// vLLM engine arguments a job may add (`actor_rollout.vllm.extra_args`): tuning only.
/// Arguments that load code (`--trust-remote-code`, `--middleware`, plugins, worker
/// classes), choose files, or that the role sets itself (model, socket, key, dtype, lengths)
/// are not on it.
pub const VLLM_EXTRA_ARGS: &[&str] = &[
    "--block-size",
    "--swap-space",
    "--kv-cache-dtype",
    "--max-num-batched-tokens",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
    "--max-num-partial-prefills",
    "--cpu-offload-gb",
    "--quantization",
    "--disable-log-stats",
    "--max-logprobs",
    "--num-gpu-blocks-override",
    "--scheduling-policy",
    "--async-scheduling",
    "--disable-cascade-attn",
    "--max-seq-len-to-capture",
    "--cuda-graph-sizes",
];

/// Most entries of `actor_rollout.vllm.extra_args`, and the longest one.
const MAX_EXTRA_ARGS: usize = 32;
const MAX_EXTRA_ARG_LEN: usize = 200;

/// `actor_rollout.vllm.*`: the server of each rollout rank when `engine: vllm`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VllmOptions {
    /// Share of the GPU's memory vLLM takes for weights, activations and KV cache.
    pub gpu_memory_utilization: f64,
    /// KV cache of vLLM's CPU build in whole GiB (`VLLM_CPU_KVCACHE_SPACE`).
    pub kv_cache_gb: u32,
    /// Most sequences the engine runs at once.
    pub max_num_seqs: u32,
    /// Reuse the KV cache of a shared prompt prefix (a GRPO group's prompt is computed once).
    pub enable_prefix_caching: bool,
    /// Further engine arguments, `--name` or `--name=value`, from [`VLLM_EXTRA_ARGS`].
    pub extra_args: Vec<String>,
    /// Seconds the server may take to start (load, and the first compile on the CPU).
    pub start_timeout_s: f64,
    /// Seconds one generation request may take.
    pub request_timeout_s: f64,
}

impl Default for VllmOptions {
    fn default() -> Self {
        Self {
            gpu_memory_utilization: 0.5,
            kv_cache_gb: 1,
            max_num_seqs: 256,
            enable_prefix_caching: true,
            extra_args: Vec::new(),
            start_timeout_s: 600.0,
            request_timeout_s: 600.0,
        }
    }
}

impl VllmOptions {
    /// Problems with these settings, as `key: why; fix` lines.
    pub fn problems(&self) -> Vec<String> {
        let mut e = Vec::new();
        let k = "actor_rollout.vllm";
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            e.push(format!(
                "{k}.gpu_memory_utilization ({}) must be in (0, 1]: the share of the GPU vLLM takes",
                self.gpu_memory_utilization
            ));
        }
        if !(1..=4096).contains(&self.kv_cache_gb) {
            e.push(format!(
                "{k}.kv_cache_gb ({}) must be a whole number of GiB from 1 to 4096 (vLLM's CPU build takes whole GiB)",
                self.kv_cache_gb
            ));
        }
        if self.max_num_seqs == 0 {
            e.push(format!(
                "{k}.max_num_seqs must be at least 1 (sequences vLLM runs at once)"
            ));
        }
        for (key, v) in [
            ("start_timeout_s", self.start_timeout_s),
            ("request_timeout_s", self.request_timeout_s),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
                e.push(format!(
                    "{k}.{key} ({v}) must be a number of seconds in (0, 86400]"
                ));
            }
        }
        if self.extra_args.len() > MAX_EXTRA_ARGS {
            e.push(format!(
                "{k}.extra_args has {} entries; at most {MAX_EXTRA_ARGS}",
                self.extra_args.len()
            ));
        }
        for (i, a) in self.extra_args.iter().enumerate() {
            if let Err(why) = check_extra_arg(a) {
                e.push(format!("{k}.extra_args[{i}] ({a:?}): {why}"));
            }
        }
        e
    }
}

/// One extra engine argument: `--name` or `--name=value`, the name on the list, the value
/// plain (letters, digits, `._:,+-`).
fn check_extra_arg(a: &str) -> Result<(), String> {
    if a.len() > MAX_EXTRA_ARG_LEN {
        return Err(format!("longer than {MAX_EXTRA_ARG_LEN} characters"));
    }
    let (name, value) = match a.split_once('=') {
        Some((n, v)) => (n, Some(v)),
        None => (a, None),
    };
    if !VLLM_EXTRA_ARGS.contains(&name) {
        return Err(format!(
            "not an engine argument a job may set; write it as --name or --name=value with a name from: {}",
            VLLM_EXTRA_ARGS.join(", ")
        ));
    }
    if let Some(v) = value {
        let plain = |c: char| c.is_ascii_alphanumeric() || "._:,+-".contains(c);
        if v.is_empty() || !v.chars().all(plain) {
            return Err(
                "its value must be non-empty letters, digits or ._:,+- (no spaces, quotes or paths)"
                    .into(),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_pass_and_each_bad_setting_is_named() {
        let mut v = VllmOptions::default();
        assert!(v.problems().is_empty(), "{:?}", v.problems());
        v.extra_args = vec!["--block-size=32".into(), "--enable-chunked-prefill".into()];
        assert!(v.problems().is_empty(), "{:?}", v.problems());
        v.gpu_memory_utilization = 1.5;
        v.kv_cache_gb = 0;
        v.max_num_seqs = 0;
        v.start_timeout_s = f64::INFINITY;
        v.extra_args = vec![
            "--trust-remote-code".into(),
            "--block-size=$(rm -rf ~)".into(),
            "--middleware=evil.mod".into(),
            "--kv-cache-dtype=".into(),
        ];
        let p = v.problems().join("\n");
        for want in [
            "gpu_memory_utilization (1.5)",
            "kv_cache_gb (0)",
            "max_num_seqs must be at least 1",
            "start_timeout_s (inf)",
            "extra_args[0] (\"--trust-remote-code\"): not an engine argument",
            "extra_args[1]",
            "extra_args[2] (\"--middleware=evil.mod\")",
            "extra_args[3]",
        ] {
            assert!(p.contains(want), "missing {want:?} in:\n{p}");
        }
        v = VllmOptions {
            extra_args: vec!["--block-size=16".into(); 33],
            ..Default::default()
        };
        assert!(v.problems().join("\n").contains("at most 32"));
    }
}
