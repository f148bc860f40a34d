//! HF fast tokenizers without candle: `tokenizer.json` + `tokenizer_config.json` (special
//! tokens, chat template), so that processes which only tokenize prompts and decode responses
//! (the PPO driver in the head) do not link a tensor library.
//!
//! ```
//! # fn main() -> rlhf_tokenizer::Result<()> {
//! # let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
//! use rlhf_tokenizer::{ChatMessage, Tokenizer};
//! let tok = Tokenizer::from_dir(&dir)?;
//! let ids = tok.encode("hello world", false)?;
//! assert_eq!(tok.decode(&ids, true)?, "hello world");
//! let chat = tok.encode_chat(&[ChatMessage::user("hello")], true)?;
//! assert!(chat.len() > ids.len());
//! assert_eq!(tok.pad_token_id(), tok.eos_token_id());
//! # Ok(())
//! # }
//! ```

pub mod error;
mod template;

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

pub use error::{Error, Result};
pub use template::{render_chat_template, render_chat_template_with, RESERVED_TEMPLATE_VARS};

use error::read_json;

/// Files that make up a tokenizer, copied when a model is saved.
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
];

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A tokenizer loaded from an HF directory.
/// A tokenizer loaded from an HF directory.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    dir: PathBuf,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    unk_token: Option<String>,
    chat_template: Option<String>,
    model_max_length: Option<usize>,
}

impl std::fmt::Debug for Tokenizer {
    // The inner tokenizer's Debug prints the whole vocabulary.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("dir", &self.dir)
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("pad_token", &self.pad_token)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

fn template_from(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        // A list of named templates: use "default".
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(String::from),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json` (and
    /// `chat_template.jinja` / `chat_template.json`, where newer transformers put the template).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = cfg_path.is_file().then_some(cfg_path.as_path());
        let mut tok = Self::from_files(dir.join("tokenizer.json"), cfg)?;
        tok.dir = dir.to_path_buf();
        if tok.chat_template.is_none() {
            let jinja = dir.join("chat_template.jinja");
            let json = dir.join("chat_template.json");
            if jinja.is_file() {
                tok.chat_template =
                    Some(std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?);
            } else if json.is_file() {
                let v: Value = read_json(&json)?;
                tok.chat_template = template_from(v.get("chat_template"));
            }
        }
        Ok(tok)
    }

    /// Loads a `tokenizer.json` file and, optionally, a `tokenizer_config.json` file (special
    /// tokens, chat template, `model_max_length`) from anywhere.
    pub fn from_files(
        tokenizer_json: impl AsRef<Path>,
        tokenizer_config: Option<&Path>,
    ) -> Result<Self> {
        let tok_path = tokenizer_json.as_ref();
        if !tok_path.is_file() {
            return Err(Error::MissingFile {
                path: tok_path.to_path_buf(),
                hint: "only fast tokenizers (tokenizer.json) are supported; save one with \
                       transformers' AutoTokenizer.save_pretrained"
                    .to_string(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(tok_path)
            .map_err(|e| Error::Tokenizer(format!("cannot load {}: {e}", tok_path.display())))?;
        let cfg: Value = match tokenizer_config {
            Some(p) => read_json(p)?,
            None => Value::Object(Default::default()),
        };
        Ok(Self {
            inner,
            dir: tok_path.parent().map(Path::to_path_buf).unwrap_or_default(),
            bos_token: token_string(cfg.get("bos_token")),
            eos_token: token_string(cfg.get("eos_token")),
            pad_token: token_string(cfg.get("pad_token")),
            unk_token: token_string(cfg.get("unk_token")),
            chat_template: template_from(cfg.get("chat_template")),
            model_max_length: cfg
                .get("model_max_length")
                .and_then(Value::as_u64)
                .map(|n| n as usize),
        })
    }

    /// Directory the tokenizer was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("cannot encode text: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of each text, in order.
    pub fn encode_batch(&self, texts: &[&str], add_special_tokens: bool) -> Result<Vec<Vec<u32>>> {
        texts
            .iter()
            .map(|t| self.encode(t, add_special_tokens))
            .collect()
    }

    /// Text of `ids`. Ids outside the tokenizer's vocabulary decode to nothing, as in
    /// transformers: models often pad their embedding matrix past the vocabulary, and a
    /// sampled padding row must not abort a rollout.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("cannot decode ids: {e}")))
    }

    /// Text of each id sequence, in order.
    pub fn decode_batch(&self, ids: &[Vec<u32>], skip_special_tokens: bool) -> Result<Vec<String>> {
        ids.iter()
            .map(|s| self.decode(s, skip_special_tokens))
            .collect()
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The pad token as configured (no fallback; see [`Tokenizer::pad_token_id`]).
    pub fn pad_token(&self) -> Option<&str> {
        self.pad_token.as_deref()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token.as_deref().and_then(|t| self.token_to_id(t))
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_to_id(t))
    }

    /// The pad token's id, or the EOS id when no pad token is set (the usual choice for
    /// decoder-only models, whose pads are masked out anyway).
    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad_token
            .as_deref()
            .and_then(|t| self.token_to_id(t))
            .or_else(|| self.eos_token_id())
    }

    pub fn model_max_length(&self) -> Option<usize> {
        self.model_max_length
    }

    /// The raw chat template, if the tokenizer has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders the chat template for `messages`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let msgs = serde_json::to_value(messages).map_err(|e| Error::Template(e.to_string()))?;
        self.apply_chat_template_json(&msgs, add_generation_prompt)
    }

    /// Renders the chat template for messages given as JSON (extra keys such as tool calls are
    /// passed through to the template).
    pub fn apply_chat_template_json(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_json_with(messages, add_generation_prompt, &Map::new())
    }

    /// [`Tokenizer::apply_chat_template_json`] with extra template variables, as the keyword
    /// arguments of transformers' `apply_chat_template` (`enable_thinking`, `tools`); see
    /// [`render_chat_template_with`].
    pub fn apply_chat_template_json_with(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
        extra: &Map<String, Value>,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| Error::NoChatTemplate {
                path: self.dir.join("tokenizer_config.json"),
            })?;
        render_chat_template_with(
            template,
            messages,
            add_generation_prompt,
            &[
                ("bos_token", self.bos_token.as_deref()),
                ("eos_token", self.eos_token.as_deref()),
                ("pad_token", self.pad_token.as_deref()),
                ("unk_token", self.unk_token.as_deref()),
            ],
            extra,
        )
    }

    /// Token ids of the rendered chat (the template adds the special tokens itself).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        self.encode_chat_with(messages, add_generation_prompt, &Map::new())
    }

    /// [`Tokenizer::encode_chat`] with extra template variables (`data.chat_template_kwargs`).
    pub fn encode_chat_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &Map<String, Value>,
    ) -> Result<Vec<u32>> {
        let msgs = serde_json::to_value(messages).map_err(|e| Error::Template(e.to_string()))?;
        let text = self.apply_chat_template_json_with(&msgs, add_generation_prompt, extra)?;
        self.encode(&text, false)
    }
}

/// Copies the tokenizer files present in `src` into `dst` (tokenizer.json is required).
pub fn copy_tokenizer_files(src: &Path, dst: &Path) -> Result<()> {
    if !src.join("tokenizer.json").is_file() {
        return Err(Error::MissingFile {
            path: src.join("tokenizer.json"),
            hint: "cannot copy the tokenizer into the saved model".to_string(),
        });
    }
    let same = match (src.canonicalize(), dst.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same {
        return Ok(());
    }
    for name in TOKENIZER_FILES {
        let from = src.join(name);
        if from.is_file() {
            let to = dst.join(name);
            std::fs::copy(&from, &to).map_err(|e| Error::io(&from, e))?;
        }
    }
    Ok(())
}
