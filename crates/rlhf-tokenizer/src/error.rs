//! The crate's single error type.

use std::path::{Path, PathBuf};

/// Everything that can go wrong when loading a tokenizer, encoding, decoding or rendering a
/// chat template.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file the tokenizer directory must contain is not there.
    #[error("missing file {path}: {hint}")]
    MissingFile { path: PathBuf, hint: String },

    /// A file exists but could not be read or written.
    #[error("cannot access {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A JSON file (tokenizer_config.json, chat_template.json) is malformed.
    #[error("cannot parse {path}: {message}")]
    Json { path: PathBuf, message: String },

    /// The `tokenizers` library refused a file or an encode/decode call.
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
}

/// Crate-wide result alias.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An I/O error on `path`; a missing file becomes [`Error::MissingFile`].
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
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
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}
