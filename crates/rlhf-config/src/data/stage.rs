//! The datasets of the stages before and beside PPO, in Hugging Face's column conventions
//! (what TRL reads): SFT rows are `prompt` + `completion` (text, or conversational message
//! lists) or a whole chat under `data.messages_key`; preference rows are `prompt` +
//! `chosen` + `rejected` (text or messages; without `prompt`, two chats' shared leading
//! turns are the prompt) with an optional margin. Every row is checked here, so a bad one
//! is named by its line (JSONL) or row (Parquet) and counted or fatal as `data.bad_rows`
//! says; chat templates and tokens are the driver's (the model crate owns them).

use std::fs::File;
use std::path::Path;

use parquet::file::reader::{FileReader, SerializedFileReader};
use serde_json::Value as Json;

use super::{rows, ChatMessage, LoadReport, PromptContent};
use crate::config::{DataConfig, DataFormat};
use crate::error::{ConfigError, Result};

/// Where an SFT example's loss goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SftExample {
    /// A text prompt and the completion the loss covers.
    Text { prompt: String, completion: String },
    /// A chat; the loss covers the assistant turns from `train_from` on (0 for a whole
    /// chat, the prompt's length for a conversational prompt + completion).
    Chat {
        messages: Vec<ChatMessage>,
        train_from: usize,
    },
}

/// A completion or a chosen/rejected answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Text(String),
    /// Turns after the prompt's, ending with the assistant's.
    Messages(Vec<ChatMessage>),
}

/// One preference pair.
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    pub prompt: PromptContent,
    pub chosen: Reply,
    pub rejected: Reply,
    /// How far the chosen score must clear the rejected one (reward models), when the data
    /// has `data.margin_key`.
    pub margin: Option<f64>,
}

/// A dataset of `T` with each record's source row (1-based line or 0-based row).
#[derive(Debug, Clone, PartialEq)]
pub struct StageDataset<T> {
    pub path: String,
    pub records: Vec<(usize, T)>,
    pub report: LoadReport,
}

pub type SftDataset = StageDataset<SftExample>;
pub type PairDataset = StageDataset<Pair>;

/// Loads SFT examples from `data.path`.
pub fn load_sft(cfg: &DataConfig) -> Result<SftDataset> {
    load(cfg, "examples", |v| sft_row(v, cfg))
}

/// Loads preference pairs from `data.path`.
pub fn load_pairs(cfg: &DataConfig) -> Result<PairDataset> {
    load(cfg, "pairs", |v| pair_row(v, cfg))
}

/// The held-out pairs of `data.eval_path`, read like `data.path`.
pub fn load_eval_pairs(cfg: &DataConfig) -> Result<Option<PairDataset>> {
    let Some(path) = cfg.eval_path.as_ref().filter(|p| !p.is_empty()) else {
        return Ok(None);
    };
    let eval = DataConfig {
        path: path.clone(),
        ..cfg.clone()
    };
    load_pairs(&eval).map(Some)
}

/// SFT examples from JSONL text (`origin` names it in errors).
pub fn sft_from_jsonl(text: &str, origin: &str, cfg: &DataConfig) -> Result<SftDataset> {
    from_rows(origin, rows::jsonl(text), cfg, "examples", |v| {
        sft_row(v, cfg)
    })
}

/// Preference pairs from JSONL text.
pub fn pairs_from_jsonl(text: &str, origin: &str, cfg: &DataConfig) -> Result<PairDataset> {
    from_rows(origin, rows::jsonl(text), cfg, "pairs", |v| {
        pair_row(v, cfg)
    })
}

fn load<T>(
    cfg: &DataConfig,
    what: &str,
    parse: impl Fn(&Json) -> std::result::Result<T, String>,
) -> Result<StageDataset<T>> {
    let path = Path::new(&cfg.path);
    let format = match cfg.format {
        DataFormat::Auto => super::detect_format(path)?,
        f => f,
    };
    let io = |source| ConfigError::Io {
        path: path.to_path_buf(),
        source,
    };
    let rows = match format {
        DataFormat::Parquet => parquet_rows(path, File::open(path).map_err(io)?)?,
        _ => rows::jsonl(&std::fs::read_to_string(path).map_err(io)?),
    };
    from_rows(&cfg.path, rows, cfg, what, parse)
}

fn from_rows<T>(
    origin: &str,
    rows: Vec<rows::Parsed<Json>>,
    cfg: &DataConfig,
    what: &str,
    parse: impl Fn(&Json) -> std::result::Result<T, String>,
) -> Result<StageDataset<T>> {
    let parsed = rows
        .into_iter()
        .map(|(n, at, v)| (n, at, v.and_then(|v| parse(&v))))
        .collect();
    let (records, report) = rows::collect(origin, parsed, cfg.bad_rows, what)?;
    Ok(StageDataset {
        path: origin.into(),
        records,
        report,
    })
}

/// Parquet rows as JSON values (strings, numbers and lists of structs map one to one).
fn parquet_rows(path: &Path, file: File) -> Result<Vec<rows::Parsed<Json>>> {
    let err = |reason: String| ConfigError::Dataset {
        path: path.display().to_string(),
        reason,
    };
    let reader =
        SerializedFileReader::new(file).map_err(|e| err(format!("not a Parquet file: {e}")))?;
    let iter = reader
        .get_row_iter(None)
        .map_err(|e| err(format!("cannot read rows: {e}")))?;
    iter.enumerate()
        .map(|(i, row)| {
            let row = row.map_err(|e| err(format!("row {i}: cannot decode: {e}")))?;
            Ok((i, format!("row {i}"), Ok(row.to_json_value())))
        })
        .collect()
}

fn field<'a>(v: &'a Json, key: &str, config_key: &str) -> std::result::Result<&'a Json, String> {
    let obj = v.as_object().ok_or("not a JSON object")?;
    obj.get(key).filter(|f| !f.is_null()).ok_or_else(|| {
        let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        format!(
            "no '{key}' ({config_key}); the row has: {}",
            keys.join(", ")
        )
    })
}

fn text(v: &Json, key: &str) -> std::result::Result<String, String> {
    match v {
        Json::String(s) if !s.trim().is_empty() => Ok(s.clone()),
        Json::String(_) => Err(format!("'{key}' is empty")),
        other => Err(format!("'{key}' is {}, expected text", kind(other))),
    }
}

fn kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "text",
        Json::Array(_) => "a list",
        Json::Object(_) => "an object",
    }
}

fn messages(v: &Json, key: &str) -> std::result::Result<Vec<ChatMessage>, String> {
    let list = v
        .as_array()
        .ok_or_else(|| format!("'{key}' is {}, expected a list of messages", kind(v)))?;
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m.get("role").and_then(Json::as_str);
            let content = m.get("content").and_then(Json::as_str);
            match (role, content) {
                (Some(r), Some(c)) if !c.trim().is_empty() => Ok(ChatMessage {
                    role: r.to_string(),
                    content: c.to_string(),
                }),
                (Some(_), Some(_)) => Err(format!("'{key}' turn {i} has empty content")),
                _ => Err(format!(
                    "'{key}' turn {i} is not {{\"role\": ..., \"content\": \"...\"}}"
                )),
            }
        })
        .collect()
}

/// Turns after an optional leading system turn alternate user, assistant, user, ...
fn check_alternation(turns: &[ChatMessage], key: &str) -> std::result::Result<(), String> {
    let start = usize::from(turns.first().is_some_and(|m| m.role == "system"));
    for (i, m) in turns.iter().enumerate().skip(start) {
        let want = if (i - start) % 2 == 0 {
            "user"
        } else {
            "assistant"
        };
        if m.role != want {
            return Err(format!(
                "'{key}' turn {i} is '{}' where '{want}' belongs; chat turns must alternate user and assistant (after an optional system turn)",
                m.role
            ));
        }
    }
    Ok(())
}

fn sft_row(v: &Json, cfg: &DataConfig) -> std::result::Result<SftExample, String> {
    if let Some(key) = &cfg.messages_key {
        let chat = messages(field(v, key, "data.messages_key")?, key)?;
        check_alternation(&chat, key)?;
        if !chat.iter().any(|m| m.role == "assistant") {
            return Err(format!("'{key}' has no assistant turn to train on"));
        }
        return Ok(SftExample::Chat {
            messages: chat,
            train_from: 0,
        });
    }
    let (pk, ck) = (&cfg.prompt_key, &cfg.completion_key);
    let prompt = field(v, pk, "data.prompt_key")?;
    let completion = field(v, ck, "data.completion_key")?;
    match (prompt, completion) {
        (Json::Array(_), Json::Array(_)) => {
            let mut chat = messages(prompt, pk)?;
            let train_from = chat.len();
            let reply = messages(completion, ck)?;
            if !reply.iter().any(|m| m.role == "assistant") {
                return Err(format!("'{ck}' has no assistant turn to train on"));
            }
            chat.extend(reply);
            check_alternation(&chat, &format!("{pk}' + '{ck}"))?;
            Ok(SftExample::Chat {
                messages: chat,
                train_from,
            })
        }
        (Json::String(_), Json::String(_)) => Ok(SftExample::Text {
            prompt: text(prompt, pk)?,
            completion: text(completion, ck)?,
        }),
        (p, c) => Err(format!(
            "'{pk}' is {} and '{ck}' is {}; both must be text or both lists of messages",
            kind(p),
            kind(c)
        )),
    }
}

fn reply(v: &Json, key: &str, prompt: &PromptContent) -> std::result::Result<Reply, String> {
    match prompt {
        PromptContent::Text(_) => Ok(Reply::Text(text(v, key)?)),
        PromptContent::Messages(p) => {
            let turns = messages(v, key)?;
            if turns.last().is_none_or(|m| m.role != "assistant") {
                return Err(format!("'{key}' must end with an assistant turn"));
            }
            let mut all = p.clone();
            all.extend(turns.iter().cloned());
            check_alternation(&all, key)?;
            Ok(Reply::Messages(turns))
        }
    }
}

fn pair_row(v: &Json, cfg: &DataConfig) -> std::result::Result<Pair, String> {
    let (ck, rk) = (&cfg.chosen_key, &cfg.rejected_key);
    let chosen = field(v, ck, "data.chosen_key")?;
    let rejected = field(v, rk, "data.rejected_key")?;
    let has_prompt = v.get(cfg.prompt_key.as_str()).is_some_and(|p| !p.is_null());
    let (prompt, chosen, rejected) = if has_prompt {
        let p = field(v, &cfg.prompt_key, "data.prompt_key")?;
        let prompt = match p {
            Json::Array(_) => PromptContent::Messages(messages(p, &cfg.prompt_key)?),
            _ => PromptContent::Text(text(p, &cfg.prompt_key)?),
        };
        let (c, r) = (reply(chosen, ck, &prompt)?, reply(rejected, rk, &prompt)?);
        (prompt, c, r)
    } else {
        // Implicit prompt: two whole chats; their shared leading turns are the prompt.
        let implicit = || {
            format!(
                "no '{}' (data.prompt_key), and '{ck}' and '{rk}' are not chats that share their prompt turns",
                cfg.prompt_key
            )
        };
        if !(chosen.is_array() && rejected.is_array()) {
            return Err(implicit());
        }
        let (c, r) = (messages(chosen, ck)?, messages(rejected, rk)?);
        let shared = c.iter().zip(&r).take_while(|(a, b)| a == b).count();
        let shared = (0..=shared)
            .rev()
            .find(|&n| c.get(n).is_some_and(|m| m.role == "assistant"))
            .unwrap_or(0);
        if shared == 0 {
            return Err(implicit());
        }
        let prompt = PromptContent::Messages(c[..shared].to_vec());
        let tail = |m: &[ChatMessage]| {
            Json::Array(
                m[shared..]
                    .iter()
                    .map(|t| serde_json::json!({"role": t.role, "content": t.content}))
                    .collect(),
            )
        };
        let (c2, r2) = (tail(&c), tail(&r));
        (
            prompt.clone(),
            reply(&c2, ck, &prompt)?,
            reply(&r2, rk, &prompt)?,
        )
    };
    if chosen == rejected {
        return Err(format!(
            "'{ck}' and '{rk}' are identical; a pair needs two different answers"
        ));
    }
    let margin = match &cfg.margin_key {
        None => None,
        Some(k) => match field(v, k, "data.margin_key")? {
            Json::Number(n) => n.as_f64().filter(|m| m.is_finite()),
            other => return Err(format!("'{k}' is {}, expected a number", kind(other))),
        },
    };
    Ok(Pair {
        prompt,
        chosen,
        rejected,
        margin,
    })
}
