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

/// Bad rows listed in a `BadRows` error (the count covers them all).
const MAX_LISTED_BAD_ROWS: usize = 20;

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
        let mut rows = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let parsed = serde_json::from_str::<Json>(line)
                .map_err(|e| format!("not JSON: {e}"))
                .and_then(|v| json_record(&v, cols));
            rows.push((i + 1, format!("line {}", i + 1), parsed));
        }
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
        let mut report = LoadReport {
            rows: rows.len(),
            ..LoadReport::default()
        };
        let mut records = Vec::new();
        for (source_row, location, parsed) in rows {
            match parsed {
                Ok((content, ground_truth)) => records.push(PromptRecord {
                    index: records.len(),
                    source_row,
                    content,
                    ground_truth,
                }),
                Err(reason) => report.bad.push(BadRow { location, reason }),
            }
        }
        report.loaded = records.len();
        if bad == BadRows::Fail && !report.bad.is_empty() {
            return Err(ConfigError::BadRows {
                path: origin.into(),
                count: report.bad.len(),
                first: report
                    .bad
                    .iter()
                    .take(MAX_LISTED_BAD_ROWS)
                    .map(|b| format!("{}: {}", b.location, b.reason))
                    .collect(),
            });
        }
        if records.is_empty() {
            return Err(ConfigError::Dataset {
                path: origin.into(),
                reason: format!(
                    "no usable prompts ({} rows, {} bad)",
                    report.rows,
                    report.bad.len()
                ),
            });
        }
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

fn detect_format(path: &Path) -> Result<DataFormat> {
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

/// Position in the prompt stream; save it with a checkpoint and restore it
/// to get exactly the same next batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataCursor {
    /// Completed passes over the dataset.
    pub epoch: u64,
    /// Index of the next prompt in this epoch's order.
    pub position: usize,
    /// Dataset size the cursor was taken on (checked at restore).
    pub dataset_len: usize,
    /// Shuffle seed the cursor was taken with (checked at restore).
    pub seed: u64,
}

/// Deterministic batches of prompt indices, reshuffled every epoch.
///
/// Epoch `e`'s order is a Fisher–Yates permutation driven by SplitMix64
/// seeded from `(seed, e)`, so it depends only on the seed, the epoch and the
/// dataset size, not on library versions. A batch never spans two epochs:
/// the tail of an epoch shorter than a batch is dropped.
#[derive(Debug, Clone)]
pub struct PromptSampler {
    len: usize,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    epoch: u64,
    position: usize,
    order: Vec<usize>,
}

impl PromptSampler {
    /// A sampler over `len` prompts in batches of `batch_size`.
    pub fn new(len: usize, batch_size: usize, shuffle: bool, seed: u64) -> Result<Self> {
        if batch_size == 0 {
            return Err(ConfigError::Cursor(
                "batch size is 0; set training.global_batch_size > 0".into(),
            ));
        }
        if len < batch_size {
            return Err(ConfigError::Cursor(format!(
                "the dataset has {len} prompts, fewer than one batch of {batch_size} \
                 (training.global_batch_size); add prompts or lower the batch"
            )));
        }
        let mut s = Self {
            len,
            batch_size,
            shuffle,
            seed,
            epoch: 0,
            position: 0,
            order: Vec::new(),
        };
        s.order = s.epoch_order(0);
        Ok(s)
    }

    /// A sampler with the job's batch (`training.global_batch_size` as the
    /// actor resolves it), `data.shuffle` and seed.
    pub fn for_config(cfg: &crate::PpoConfig, dataset_len: usize) -> Result<Self> {
        Self::new(
            dataset_len,
            cfg.prompts_per_step() as usize,
            cfg.data.shuffle,
            cfg.data_seed(),
        )
    }

    /// The order of prompt indices in `epoch`.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = SplitMix64(self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            for i in (1..order.len()).rev() {
                let j = (rng.next() % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
        }
        order
    }

    /// The next batch of prompt indices.
    pub fn next_batch(&mut self) -> Vec<usize> {
        if self.position + self.batch_size > self.len {
            self.epoch += 1;
            self.position = 0;
            self.order = self.epoch_order(self.epoch);
        }
        let batch = self.order[self.position..self.position + self.batch_size].to_vec();
        self.position += self.batch_size;
        batch
    }

    /// Where the stream stands (before the next batch).
    pub fn cursor(&self) -> DataCursor {
        DataCursor {
            epoch: self.epoch,
            position: self.position,
            dataset_len: self.len,
            seed: self.seed,
        }
    }

    /// Continues from a saved cursor; refuses one taken on another dataset
    /// size or seed, since the order would differ.
    pub fn restore(&mut self, c: DataCursor) -> Result<()> {
        if c.dataset_len != self.len || c.seed != self.seed {
            return Err(ConfigError::Cursor(format!(
                "saved for {} prompts with seed {}, but the dataset has {} prompts and the seed is {}; \
                 resume with the same data.path and data.seed / training.seed",
                c.dataset_len, c.seed, self.len, self.seed
            )));
        }
        if c.position > self.len {
            return Err(ConfigError::Cursor(format!(
                "position {} is past the end of a {}-prompt epoch",
                c.position, self.len
            )));
        }
        self.epoch = c.epoch;
        self.position = c.position;
        self.order = self.epoch_order(c.epoch);
        Ok(())
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and fixed forever, which
/// is what reproducible shuffles across versions need.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// A batch of records by index.
pub fn batch_records<'a>(ds: &'a PromptDataset, indices: &[usize]) -> Vec<&'a PromptRecord> {
    indices.iter().filter_map(|i| ds.records.get(*i)).collect()
}
