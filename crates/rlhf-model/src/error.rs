//! The crate's single error type.

use std::path::PathBuf;

/// Everything that can go wrong when loading, running, training or saving a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file the model directory must contain is not there.
    #[error("missing file {path}: {hint}")]
    MissingFile { path: PathBuf, hint: String },

    /// A file exists but could not be read or written.
    #[error("cannot access {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A JSON file (config.json, tokenizer_config.json, ...) is malformed.
    #[error("cannot parse {path}: {message}")]
    Json { path: PathBuf, message: String },

    /// The checkpoint's architecture is not implemented here.
    #[error(
        "unsupported architecture {name:?}; supported: {}{}",
        supported.join(", "),
        closest_hint(name, supported)
    )]
    UnsupportedArchitecture {
        name: String,
        supported: Vec<&'static str>,
    },

    /// A config value is missing, inconsistent or unsupported.
    #[error("invalid model config: {0}")]
    Config(String),

    /// A tensor the architecture needs is absent from the weights.
    #[error("tensor {name} not found in {location}")]
    MissingTensor { name: String, location: String },

    /// A tensor in the weights does not have the shape the config implies.
    #[error(
        "tensor {name} has shape {found:?} in the weights but the config implies {expected:?}"
    )]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    /// Tokenizer or chat-template problem.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// The tokenizer has no chat template but one was requested.
    #[error(
        "{path} has no chat_template; pass plain prompts or use a tokenizer with a chat template"
    )]
    NoChatTemplate { path: PathBuf },

    /// Rendering the chat template failed.
    #[error("chat template: {0}")]
    Template(String),

    /// A prompt does not fit in the model's context window.
    #[error(
        "prompt {index} has {len} tokens but only {limit} fit (context {context}, max_new_tokens {max_new_tokens}); \
         shorten it or set truncate_prompts to keep its last tokens"
    )]
    PromptTooLong {
        index: usize,
        len: usize,
        limit: usize,
        context: usize,
        max_new_tokens: usize,
    },

    /// Caller passed inconsistent arguments (shapes, options).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A trainable parameter received no gradient or a non-finite one.
    #[error("gradient problem: {0}")]
    Gradient(String),

    /// Handing device memory to another process (CUDA IPC) failed.
    #[error("device memory hand-over: {0}")]
    Ipc(String),

    /// An error raised by candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// A model name that is neither a directory nor a repo id the Hugging Face cache holds
    /// (or can download).
    #[error(transparent)]
    Hub(#[from] rlhf_hub::Error),
}

/// Crate-wide result alias.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            Error::MissingFile {
                path,
                hint: "the file does not exist".to_string(),
            }
        } else {
            Error::Io { path, source }
        }
    }
}

/// Reads and parses a JSON file, naming the file in every error.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// `; the closest is X` for the supported architecture nearest to `name` by edit distance
/// (case-insensitive), with why a mixture-of-experts variant of it is refused.
fn closest_hint(name: &str, supported: &[&'static str]) -> String {
    let lower = name.to_lowercase();
    let Some((best, d)) = supported
        .iter()
        .map(|s| (*s, edit_distance(&lower, &s.to_lowercase())))
        .min_by_key(|&(_, d)| d)
    else {
        return String::new();
    };
    if d > lower.len().max(best.len()) / 2 {
        return String::new();
    }
    let moe = if lower.contains("moe") {
        " (dense models only: mixture-of-experts layers are not implemented)"
    } else {
        ""
    };
    format!("; the closest is {best}{moe}")
}

/// Levenshtein distance over chars.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unsupported_architecture_names_the_closest_supported_one() {
        let supported = &["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"];
        let e = Error::UnsupportedArchitecture {
            name: "Qwen3MoeForCausalLM".into(),
            supported: supported.to_vec(),
        }
        .to_string();
        assert!(
            e.ends_with(
                "the closest is Qwen3ForCausalLM (dense models only: mixture-of-experts layers are not implemented)"
            ),
            "{e}"
        );
        let e = Error::UnsupportedArchitecture {
            name: "MistralForCausalLM".into(),
            supported: supported.to_vec(),
        }
        .to_string();
        assert!(
            e.contains("supported: LlamaForCausalLM") && e.contains("closest is"),
            "{e}"
        );
        let e = Error::UnsupportedArchitecture {
            name: "model_type bert".into(),
            supported: supported.to_vec(),
        }
        .to_string();
        assert!(!e.contains("closest"), "{e}");
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }
}
