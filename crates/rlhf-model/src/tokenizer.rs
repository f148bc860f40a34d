//! The tokenizer lives in the candle-free `rlhf-tokenizer` crate (so the head can tokenize
//! without linking candle); this module keeps `rlhf_model::Tokenizer` with methods that return
//! this crate's [`Error`], so model code can mix both with `?`.

use std::ops::Deref;
use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};

pub use rlhf_tokenizer::{ChatMessage, TOKENIZER_FILES};

/// A tokenizer loaded from an HF directory: [`rlhf_tokenizer::Tokenizer`] whose fallible
/// methods return [`crate::Error`]. The infallible ones (`eos_token_id`, `pad_token_id`,
/// `vocab_size`, ...) come through `Deref`. (No `Debug`, as before the move: tests written
/// against the old type call `.err().expect(..)`, which clippy rejects once `Debug` exists.)
#[derive(Clone)]
pub struct Tokenizer(rlhf_tokenizer::Tokenizer);

impl Tokenizer {
    /// See [`rlhf_tokenizer::Tokenizer::from_dir`].
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        Ok(Self(rlhf_tokenizer::Tokenizer::from_dir(dir)?))
    }

    /// See [`rlhf_tokenizer::Tokenizer::from_files`].
    pub fn from_files(
        tokenizer_json: impl AsRef<Path>,
        tokenizer_config: Option<&Path>,
    ) -> Result<Self> {
        Ok(Self(rlhf_tokenizer::Tokenizer::from_files(
            tokenizer_json,
            tokenizer_config,
        )?))
    }

    /// The candle-free tokenizer this wraps.
    pub fn into_inner(self) -> rlhf_tokenizer::Tokenizer {
        self.0
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(self.0.encode(text, add_special_tokens)?)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        Ok(self.0.decode(ids, skip_special_tokens)?)
    }

    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        Ok(self
            .0
            .apply_chat_template(messages, add_generation_prompt)?)
    }

    pub fn apply_chat_template_json(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<String> {
        Ok(self
            .0
            .apply_chat_template_json(messages, add_generation_prompt)?)
    }

    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        Ok(self.0.encode_chat(messages, add_generation_prompt)?)
    }
}

impl Deref for Tokenizer {
    type Target = rlhf_tokenizer::Tokenizer;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl From<rlhf_tokenizer::Tokenizer> for Tokenizer {
    fn from(t: rlhf_tokenizer::Tokenizer) -> Self {
        Self(t)
    }
}

/// Renders an HF chat template; see [`rlhf_tokenizer::render_chat_template`].
pub fn render_chat_template(
    template: &str,
    messages: &Value,
    add_generation_prompt: bool,
    special_tokens: &[(&str, Option<&str>)],
) -> Result<String> {
    Ok(rlhf_tokenizer::render_chat_template(
        template,
        messages,
        add_generation_prompt,
        special_tokens,
    )?)
}

/// Copies the tokenizer files present in `src` into `dst` (tokenizer.json is required).
pub fn copy_tokenizer_files(src: &Path, dst: &Path) -> Result<()> {
    Ok(rlhf_tokenizer::copy_tokenizer_files(src, dst)?)
}

impl From<rlhf_tokenizer::Error> for Error {
    fn from(e: rlhf_tokenizer::Error) -> Self {
        use rlhf_tokenizer::Error as T;
        match e {
            T::MissingFile { path, hint } => Error::MissingFile { path, hint },
            T::Io { path, source } => Error::Io { path, source },
            T::Json { path, message } => Error::Json { path, message },
            T::Tokenizer(m) => Error::Tokenizer(m),
            T::NoChatTemplate { path } => Error::NoChatTemplate { path },
            T::Template(m) => Error::Template(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_errors_keep_their_variant() {
        let e: Error = rlhf_tokenizer::Error::NoChatTemplate {
            path: "x/tokenizer_config.json".into(),
        }
        .into();
        assert!(matches!(e, Error::NoChatTemplate { .. }));
        let e: Error = rlhf_tokenizer::Error::Json {
            path: "c.json".into(),
            message: "bad".into(),
        }
        .into();
        assert_eq!(e.to_string(), "cannot parse c.json: bad");
        let dir = tempfile::tempdir().unwrap();
        let Err(e) = Tokenizer::from_dir(dir.path()) else {
            panic!("an empty directory has no tokenizer");
        };
        assert!(matches!(e, Error::MissingFile { .. }), "{e:?}");
    }
}
