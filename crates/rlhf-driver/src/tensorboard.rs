//! TensorBoard event files (`logging.tensorboard_dir`), written natively.
//!
//! Users coming from TRL or verl watch their curves in TensorBoard; this writes the files
//! TensorBoard reads without TensorFlow, Python or protoc in the job: TFRecord framing
//! (length, masked CRC32C of the length, data, masked CRC32C of the data) around `Event`
//! messages declared here with prost under the field numbers of TensorFlow's `event.proto`
//! and `summary.proto`. Each step is one event holding every metric as a scalar (the
//! metric name is the tag) and, when samples are due, the sample table as a text summary.
//!
//! Restarts: every (re)start of the roles opens a new file whose first event after the
//! file version is a `SessionLog START` at the first step this attempt runs. TensorBoard
//! then drops every point at that step or later read from older files (they belong to an
//! abandoned attempt, or to an earlier run into the same directory), so each step shows once.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use rlhf_core::{Error, Result};

use crate::output::Sample;

/// The messages of TensorFlow's `event.proto` and `summary.proto` this writer uses, with
/// their field numbers (fields it never writes are left out).
pub mod proto {
    /// `tensorflow.Event`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Event {
        #[prost(double, tag = "1")]
        pub wall_time: f64,
        #[prost(int64, tag = "2")]
        pub step: i64,
        #[prost(oneof = "What", tags = "3, 5, 7")]
        pub what: Option<What>,
    }

    /// `Event.what`.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum What {
        #[prost(string, tag = "3")]
        FileVersion(String),
        #[prost(message, tag = "5")]
        Summary(Summary),
        // 6 is the deprecated `log_message`.
        #[prost(message, tag = "7")]
        SessionLog(SessionLog),
    }

    /// `tensorflow.Summary`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Summary {
        #[prost(message, repeated, tag = "1")]
        pub value: Vec<Value>,
    }

    /// `tensorflow.Summary.Value`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Value {
        #[prost(string, tag = "1")]
        pub tag: String,
        #[prost(message, optional, tag = "9")]
        pub metadata: Option<SummaryMetadata>,
        #[prost(oneof = "Kind", tags = "2, 8")]
        pub value: Option<Kind>,
    }

    /// `Summary.Value.value`.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Kind {
        #[prost(float, tag = "2")]
        SimpleValue(f32),
        #[prost(message, tag = "8")]
        Tensor(TensorProto),
    }

    /// `tensorflow.SummaryMetadata`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct SummaryMetadata {
        #[prost(message, optional, tag = "1")]
        pub plugin_data: Option<PluginData>,
    }

    /// `SummaryMetadata.PluginData`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PluginData {
        #[prost(string, tag = "1")]
        pub plugin_name: String,
        #[prost(bytes = "vec", tag = "2")]
        pub content: Vec<u8>,
    }

    /// `tensorflow.TensorProto` (strings only).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TensorProto {
        /// A `tensorflow.DataType`.
        #[prost(int32, tag = "1")]
        pub dtype: i32,
        #[prost(message, optional, tag = "2")]
        pub tensor_shape: Option<TensorShapeProto>,
        #[prost(bytes = "vec", repeated, tag = "8")]
        pub string_val: Vec<Vec<u8>>,
    }

    /// `tensorflow.TensorShapeProto`; no dimensions is a scalar.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TensorShapeProto {
        #[prost(message, repeated, tag = "2")]
        pub dim: Vec<Dim>,
    }

    /// `TensorShapeProto.Dim`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Dim {
        #[prost(int64, tag = "1")]
        pub size: i64,
    }

    /// `tensorflow.SessionLog`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct SessionLog {
        /// A `SessionLog.SessionStatus`.
        #[prost(int32, tag = "1")]
        pub status: i32,
    }

    /// `DataType.DT_STRING`.
    pub const DT_STRING: i32 = 7;
    /// `SessionLog.SessionStatus.START`.
    pub const SESSION_START: i32 = 1;
}

/// What the first record of every event file says.
pub const FILE_VERSION: &str = "brain.Event:2";
/// The tag of the sample tables.
pub const SAMPLES_TAG: &str = "samples";
/// The file name prefix TensorBoard looks for.
pub const FILE_PREFIX: &str = "events.out.tfevents.";

/// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), one byte per table lookup.
const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut bit = 0;
        while bit < 8 {
            c = if c & 1 == 1 {
                (c >> 1) ^ 0x82F6_3B78
            } else {
                c >> 1
            };
            bit += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

/// The CRC32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    !data.iter().fold(!0u32, |c, &b| {
        CRC32C_TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8)
    })
}

/// The CRC as TFRecord stores it: rotated right by 15 bits plus a constant.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Appends one TFRecord holding `data` to `out`.
pub fn frame_record(data: &[u8], out: &mut Vec<u8>) {
    let len = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
}

/// Writes one run's events into a new event file.
pub struct EventWriter {
    path: PathBuf,
    file: File,
}

impl EventWriter {
    /// Creates a new event file in `dir` (and `dir` if missing), named as TensorFlow names
    /// them, holding the file version and a `SessionLog START` at `first_step`: TensorBoard
    /// then drops the points of steps `>= first_step` that older files in `dir` hold.
    pub fn create(dir: &Path, first_step: u64) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        // `<secs>.<host>.<pid>.<n>`: readers take the files of a directory in name order,
        // so a later file of this process in the same second gets a larger n.
        let stem = format!(
            "{FILE_PREFIX}{now:010}.{}.{}.",
            hostname(),
            std::process::id()
        );
        let mut n = std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    .filter(|e| e.file_name().to_string_lossy().starts_with(&stem))
                    .count()
            })
            .unwrap_or(0);
        let (path, file) = loop {
            let path = dir.join(format!("{stem}{n}"));
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(f) => break (path, f),
                Err(e) if e.kind() == ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(e) => return Err(Error::io(format!("creating {}", path.display()), e)),
            }
        };
        let mut w = Self { path, file };
        let version = proto::Event {
            wall_time: wall_time(),
            step: 0,
            what: Some(proto::What::FileVersion(FILE_VERSION.into())),
        };
        let start = proto::Event {
            wall_time: wall_time(),
            step: step_i64(first_step),
            what: Some(proto::What::SessionLog(proto::SessionLog {
                status: proto::SESSION_START,
            })),
        };
        w.write_events(&[version, start])?;
        Ok(w)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event for `step`: every metric as a scalar under its name, and the sample table
    /// as text under [`SAMPLES_TAG`] when `samples` is set. Flushed before it returns.
    pub fn write_step(
        &mut self,
        step: u64,
        metrics: &BTreeMap<String, f64>,
        samples: Option<&[Sample]>,
    ) -> Result<()> {
        let mut value: Vec<proto::Value> = metrics
            .iter()
            .map(|(tag, &v)| proto::Value {
                tag: tag.clone(),
                metadata: None,
                value: Some(proto::Kind::SimpleValue(v as f32)),
            })
            .collect();
        if let Some(samples) = samples {
            value.push(text_value(SAMPLES_TAG, &markdown_table(samples)));
        }
        let event = proto::Event {
            wall_time: wall_time(),
            step: step_i64(step),
            what: Some(proto::What::Summary(proto::Summary { value })),
        };
        self.write_events(&[event])
    }

    fn write_events(&mut self, events: &[proto::Event]) -> Result<()> {
        let mut buf = Vec::new();
        for e in events {
            frame_record(&prost::Message::encode_to_vec(e), &mut buf);
        }
        self.file
            .write_all(&buf)
            .and_then(|()| self.file.flush())
            .map_err(|e| Error::io(format!("writing {}", self.path.display()), e))
    }
}

/// A text summary (TensorBoard's text plugin): a scalar string tensor.
fn text_value(tag: &str, text: &str) -> proto::Value {
    proto::Value {
        tag: tag.into(),
        metadata: Some(proto::SummaryMetadata {
            plugin_data: Some(proto::PluginData {
                plugin_name: "text".into(),
                content: Vec::new(),
            }),
        }),
        value: Some(proto::Kind::Tensor(proto::TensorProto {
            dtype: proto::DT_STRING,
            tensor_shape: Some(proto::TensorShapeProto::default()),
            string_val: vec![text.as_bytes().to_vec()],
        })),
    }
}

/// The samples as a markdown table (prompt | response | score), as the text plugin renders it.
pub fn markdown_table(samples: &[Sample]) -> String {
    let mut s = String::from("| prompt | response | score |\n| --- | --- | --- |\n");
    for x in samples {
        s.push_str(&format!(
            "| {} | {} | {:.3} |\n",
            markdown_cell(&x.prompt),
            markdown_cell(&x.response),
            x.score
        ));
    }
    s
}

/// `text` as it should read inside one table cell: markdown and HTML characters escaped,
/// line breaks as `<br>`, other control characters as spaces.
fn markdown_cell(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\n' => out.push_str("<br>"),
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\\' | '`' | '*' | '_' | '[' | ']' | '|' | '#' => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn step_i64(step: u64) -> i64 {
    i64::try_from(step).unwrap_or(i64::MAX)
}

/// This machine's name as a file name part (`localhost` when unknown).
fn hostname() -> String {
    let name = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    let clean: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if clean.is_empty() {
        "localhost".into()
    } else {
        clean
    }
}

#[cfg(test)]
#[path = "tensorboard_tests.rs"]
mod tests;
