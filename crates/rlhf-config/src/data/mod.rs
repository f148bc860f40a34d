//! Prompt datasets: JSONL and Parquet readers, the prompt-length policy,
//! seeded per-epoch shuffling and a resumable cursor.
//!
//! A row holds either a prompt string or chat messages (`[{role, content}]`).
//! Rendering messages with the model's chat template and tokenizing are the
//! caller's job (the model crate owns tokenizers and templates), so records
//! expose the raw text or messages. The caller then applies
//! `max_prompt_length` with [`apply_length_policy`].

use std::fs::File;
use std::path::Path;

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::{Field, Row};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::config::{BadRows, DataConfig, DataFormat, PromptOverflow};
use crate::error::{ConfigError, Result};

mod rows;
mod sampler;
pub mod stage;

pub use sampler::{DataCursor, PromptSampler};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

/// A prompt as stored in the dataset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PromptContent {
    /// Plain prompt text.
    Text(String),
    /// Chat messages, to be rendered with the model's chat template.
    Messages(Vec<ChatMessage>),
}

/// One prompt and where it came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptRecord {
    /// 0-based index among the rows that loaded (what batches refer to).
    pub index: usize,
    /// 1-based line (JSONL) or 0-based row number (Parquet) in the file.
    pub source_row: usize,
    /// The prompt.
    pub content: PromptContent,
    /// The reference answer from `data.ground_truth_key`, when set.
    #[serde(default)]
    pub ground_truth: Option<String>,
}

/// A row that failed to parse.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadRow {
    /// `line N` (JSONL, 1-based) or `row N` (Parquet, 0-based).
    pub location: String,
    /// Why it failed.
    pub reason: String,
}

/// What loading found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadReport {
    /// Rows read (blank JSONL lines excluded).
    pub rows: usize,
    /// Rows that became prompts.
    pub loaded: usize,
    /// Rows skipped as bad (only with `data.bad_rows: skip`).
    pub bad: Vec<BadRow>,
}

/// An in-memory prompt dataset.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptDataset {
    /// The dataset file.
    pub path: String,
    /// Prompts in file order.
    pub records: Vec<PromptRecord>,
    /// Counts and bad rows.
    pub report: LoadReport,
}

/// Which columns hold the prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Columns {
    /// Prompt column: a string or a list of messages.
    pub prompt_key: String,
    /// Messages column; read instead of `prompt_key` when set.
    pub messages_key: Option<String>,
    /// Reference-answer column, when set.
    pub ground_truth_key: Option<String>,
}

impl Columns {
    /// From `data.*`.
    pub fn from_config(cfg: &DataConfig) -> Self {
        Self {
            prompt_key: cfg.prompt_key.clone(),
            messages_key: cfg.messages_key.clone(),
            ground_truth_key: cfg.ground_truth_key.clone(),
        }
    }

    fn key(&self) -> &str {
        self.messages_key.as_deref().unwrap_or(&self.prompt_key)
    }
}

impl PromptDataset {
    /// Loads `data.path` in `data.format` with `data.bad_rows` applied.
    pub fn load(cfg: &DataConfig) -> Result<Self> {
        let path = Path::new(&cfg.path);
        let format = match cfg.format {
            DataFormat::Auto => detect_format(path)?,
            f => f,
        };
        let cols = Columns::from_config(cfg);
        match format {
            DataFormat::Parquet => Self::from_parquet(path, &cols, cfg.bad_rows),
            _ => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
                    path: path.to_path_buf(),
                    source,
                })?;
                Self::from_jsonl_str(&text, &cfg.path, &cols, cfg.bad_rows)
            }
        }
    }

    /// Parses JSONL text; `origin` names it in errors.
    pub fn from_jsonl_str(text: &str, origin: &str, cols: &Columns, bad: BadRows) -> Result<Self> {
        let rows = rows::jsonl(text)
            .into_iter()
            .map(|(n, at, v)| (n, at, v.and_then(|v| json_record(&v, cols))))
            .collect();
        Self::collect(origin, rows, bad)
    }

    /// Reads a Parquet file (plain or snappy-compressed).
    pub fn from_parquet(path: &Path, cols: &Columns, bad: BadRows) -> Result<Self> {
        let origin = path.display().to_string();
        let ds_err = |reason: String| ConfigError::Dataset {
            path: origin.clone(),
            reason,
        };
        let file = File::open(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let reader = SerializedFileReader::new(file)
            .map_err(|e| ds_err(format!("not a Parquet file: {e}")))?;
        let schema = reader.metadata().file_metadata().schema_descr();
        let names: Vec<String> = schema
            .root_schema()
            .get_fields()
            .iter()
            .map(|f| f.name().to_string())
            .collect();
        if !names.iter().any(|n| n == cols.key()) {
            return Err(ds_err(format!(
                "no column '{}'; columns are [{}]; set data.prompt_key or data.messages_key",
                cols.key(),
                names.join(", ")
            )));
        }
        let iter = reader
            .get_row_iter(None)
            .map_err(|e| ds_err(format!("cannot read rows: {e}")))?;
        let mut rows = Vec::new();
        for (i, row) in iter.enumerate() {
            let row = row.map_err(|e| ds_err(format!("row {i}: cannot decode: {e}")))?;
            rows.push((i, format!("row {i}"), parquet_record(&row, cols)));
        }
        Self::collect(&origin, rows, bad)
    }

    fn collect(
        origin: &str,
        rows: Vec<(usize, String, std::result::Result<Parsed, String>)>,
        bad: BadRows,
    ) -> Result<Self> {
        let (good, report) = rows::collect(origin, rows, bad, "prompts")?;
        let records = good
            .into_iter()
            .enumerate()
            .map(
                |(index, (source_row, (content, ground_truth)))| PromptRecord {
                    index,
                    source_row,
                    content,
                    ground_truth,
                },
            )
            .collect();
        Ok(Self {
            path: origin.into(),
            records,
            report,
        })
    }

    /// Number of prompts.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether there are no prompts (never true for a loaded dataset).
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// One line for the console: counts and the first bad rows.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "{}: {} prompts from {} rows",
            self.path, self.report.loaded, self.report.rows
        );
        if !self.report.bad.is_empty() {
            let first: Vec<String> = self
                .report
                .bad
                .iter()
                .take(5)
                .map(|b| format!("{}: {}", b.location, b.reason))
                .collect();
            s.push_str(&format!(
                "; skipped {} bad row(s): {}",
                self.report.bad.len(),
                first.join("; ")
            ));
        }
        s
    }
}

pub(crate) fn detect_format(path: &Path) -> Result<DataFormat> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("jsonl" | "json" | "ndjson") => Ok(DataFormat::Jsonl),
        Some("parquet") => Ok(DataFormat::Parquet),
        _ => Err(ConfigError::Dataset {
            path: path.display().to_string(),
            reason:
                "cannot tell the format from the extension; set data.format to jsonl or parquet"
                    .into(),
        }),
    }
}

/// A parsed row: the prompt and its reference answer.
type Parsed = (PromptContent, Option<String>);

fn json_record(v: &Json, cols: &Columns) -> std::result::Result<Parsed, String> {
    let content = json_prompt(v, cols)?;
    let Some(key) = &cols.ground_truth_key else {
        return Ok((content, None));
    };
    let answer = match v.get(key.as_str()) {
        Some(Json::String(s)) => s.clone(),
        Some(Json::Number(n)) => n.to_string(),
        Some(Json::Bool(b)) => b.to_string(),
        Some(other) => {
            return Err(format!(
                "'{key}' (data.ground_truth_key) is not text: {other}"
            ))
        }
        None => return Err(format!("no '{key}' key (data.ground_truth_key)")),
    };
    Ok((content, Some(answer)))
}

fn parquet_record(row: &Row, cols: &Columns) -> std::result::Result<Parsed, String> {
    let content = parquet_prompt(row, cols)?;
    let Some(key) = &cols.ground_truth_key else {
        return Ok((content, None));
    };
    let field = row
        .get_column_iter()
        .find(|(name, _)| name.as_str() == key.as_str())
        .map(|(_, f)| f)
        .ok_or_else(|| format!("no '{key}' column (data.ground_truth_key)"))?;
    let answer = match field {
        Field::Str(s) => s.clone(),
        Field::Int(x) => x.to_string(),
        Field::Long(x) => x.to_string(),
        Field::Double(x) => x.to_string(),
        Field::Float(x) => x.to_string(),
        Field::Bool(x) => x.to_string(),
        other => {
            return Err(format!(
                "'{key}' (data.ground_truth_key) is not text: {other}"
            ))
        }
    };
    Ok((content, Some(answer)))
}

fn json_prompt(v: &Json, cols: &Columns) -> std::result::Result<PromptContent, String> {
    let obj = v
        .as_object()
        .ok_or_else(|| "not a JSON object".to_string())?;
    let key = cols.key();
    let field = obj.get(key).ok_or_else(|| {
        let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        format!("no '{key}' key (keys: {})", keys.join(", "))
    })?;
    match field {
        Json::String(s) if cols.messages_key.is_none() => non_empty_text(s),
        Json::Array(items) => {
            let mut msgs = Vec::with_capacity(items.len());
            for (j, item) in items.iter().enumerate() {
                let role = item.get("role").and_then(Json::as_str);
                let content = item.get("content").and_then(Json::as_str);
                match (role, content) {
                    (Some(r), Some(c)) => msgs.push(ChatMessage {
                        role: r.into(),
                        content: c.into(),
                    }),
                    _ => {
                        return Err(format!(
                        "'{key}'[{j}] is not a {{\"role\": string, \"content\": string}} message"
                    ))
                    }
                }
            }
            non_empty_messages(key, msgs)
        }
        other => Err(format!(
            "'{key}' must be {}, got {}",
            if cols.messages_key.is_some() {
                "a list of messages"
            } else {
                "a string or a list of messages"
            },
            json_kind(other)
        )),
    }
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "a list",
        Json::Object(_) => "an object",
    }
}

fn non_empty_text(s: &str) -> std::result::Result<PromptContent, String> {
    if s.trim().is_empty() {
        Err("empty prompt".into())
    } else {
        Ok(PromptContent::Text(s.to_string()))
    }
}

fn non_empty_messages(
    key: &str,
    msgs: Vec<ChatMessage>,
) -> std::result::Result<PromptContent, String> {
    if msgs.is_empty() {
        Err(format!("'{key}' is an empty message list"))
    } else {
        Ok(PromptContent::Messages(msgs))
    }
}

fn parquet_prompt(row: &Row, cols: &Columns) -> std::result::Result<PromptContent, String> {
    let key = cols.key();
    let field = row
        .get_column_iter()
        .find(|(name, _)| name.as_str() == key)
        .map(|(_, f)| f)
        .ok_or_else(|| format!("no '{key}' column"))?;
    match field {
        Field::Str(s) if cols.messages_key.is_none() => non_empty_text(s),
        // Binary columns without the UTF8 annotation, as some writers emit.
        Field::Bytes(b) if cols.messages_key.is_none() => match std::str::from_utf8(b.data()) {
            Ok(s) => non_empty_text(s),
            Err(e) => Err(format!("'{key}' is not UTF-8 text: {e}")),
        },
        Field::ListInternal(list) => {
            let mut msgs = Vec::new();
            for (j, item) in list.elements().iter().enumerate() {
                let Field::Group(g) = item else {
                    return Err(format!("'{key}'[{j}] is not a {{role, content}} struct"));
                };
                let get = |n: &str| {
                    g.get_column_iter().find_map(|(name, f)| match f {
                        Field::Str(s) if name == n => Some(s.clone()),
                        _ => None,
                    })
                };
                match (get("role"), get("content")) {
                    (Some(role), Some(content)) => msgs.push(ChatMessage { role, content }),
                    _ => {
                        return Err(format!(
                            "'{key}'[{j}] lacks string fields 'role' and 'content'"
                        ))
                    }
                }
            }
            non_empty_messages(key, msgs)
        }
        Field::Null => Err(format!("'{key}' is null")),
        other => Err(format!("'{key}' has unsupported type: {other}")),
    }
}

/// What to do with one prompt after tokenization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LengthDecision {
    /// Fits: use as is.
    Keep,
    /// Too long: drop this many tokens from the front (keep the last
    /// `max_prompt_length`).
    TruncateFront(usize),
    /// Too long: leave it out of the batch.
    Skip,
}

/// Counts of [`apply_length_policy`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LengthSummary {
    /// Prompts that fit.
    pub kept: usize,
    /// Prompts cut to `max_prompt_length`.
    pub truncated: usize,
    /// Prompts left out.
    pub skipped: usize,
}

/// Applies `data.max_prompt_length_policy` to tokenized prompt lengths.
///
/// The caller tokenizes (after rendering the chat template), passes the
/// lengths, and acts on one decision per prompt: `truncate` keeps the last
/// `max_len` tokens, because the end of a prompt is what the response
/// continues; `skip` drops the prompt, so a batch can come out smaller than
/// `global_batch_size` — the caller refills it or logs the counts.
pub fn apply_length_policy(
    lengths: &[usize],
    max_len: usize,
    policy: PromptOverflow,
) -> (Vec<LengthDecision>, LengthSummary) {
    let mut summary = LengthSummary::default();
    let decisions = lengths
        .iter()
        .map(|&n| {
            if n <= max_len {
                summary.kept += 1;
                LengthDecision::Keep
            } else if policy == PromptOverflow::Truncate {
                summary.truncated += 1;
                LengthDecision::TruncateFront(n - max_len)
            } else {
                summary.skipped += 1;
                LengthDecision::Skip
            }
        })
        .collect();
    (decisions, summary)
}

/// A batch of records by index.
pub fn batch_records<'a>(ds: &'a PromptDataset, indices: &[usize]) -> Vec<&'a PromptRecord> {
    indices.iter().filter_map(|i| ds.records.get(*i)).collect()
}
