//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while loading a config or a dataset.
///
/// Each variant names the file, key or row at fault and, where there is one,
/// the fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },

    /// A config file is not valid YAML.
    #[error("{origin}: invalid YAML{}: {message}", line_suffix(*line))]
    Yaml {
        /// The file (or override) the text came from.
        origin: String,
        /// 1-based line, when the parser reports one.
        line: Option<usize>,
        /// The parser's message.
        message: String,
    },

    /// A key that the schema does not know.
    #[error("{origin}: unknown key '{key}'{}{}", line_suffix(*line), suggestion_suffix(suggestion))]
    UnknownKey {
        /// The file, or `override 'a.b=c'`.
        origin: String,
        /// Full dotted key path.
        key: String,
        /// 1-based line in the file, when it could be located.
        line: Option<usize>,
        /// The closest valid key (full path), if one is close enough.
        suggestion: Option<String>,
    },

    /// A value of the wrong type.
    #[error("{origin}: key '{key}'{}: expected {expected}, got {got}", line_suffix(*line))]
    BadValue {
        /// The file or override.
        origin: String,
        /// Full dotted key path.
        key: String,
        /// 1-based line, when known.
        line: Option<usize>,
        /// What the schema wants.
        expected: String,
        /// What was found.
        got: String,
    },

    /// A malformed `key.path=value` override.
    #[error("override '{text}': {reason}")]
    BadOverride {
        /// The override as given.
        text: String,
        /// What is wrong and how to write it.
        reason: String,
    },

    /// A model named in `defaults` or by a role is missing or malformed.
    #[error("{origin}: {reason}")]
    Model {
        /// The config or model file.
        origin: String,
        /// What is wrong.
        reason: String,
    },

    /// A role rank's spec cannot be resolved (or read back in the role process).
    #[error("{0}")]
    Spec(String),

    /// One or more validation rules failed; every failure is listed.
    #[error("{origin}: {} invalid setting(s):\n  - {}", errors.len(), errors.join("\n  - "))]
    Invalid {
        /// The config that was validated.
        origin: String,
        /// One line per failed rule, naming keys and numbers.
        errors: Vec<String>,
    },

    /// The cluster lacks the devices the resource pool asks for.
    #[error(
        "cannot place the job: resource '{resource}' is short by {shortfall} \
         (needs {required}, the cluster has {available} free){}",
        if detail.is_empty() { String::new() } else { format!("; {detail}") }
    )]
    Placement {
        /// Resource name (`GPU`, `NPU`, `CPU`).
        resource: String,
        /// Devices the job needs in total.
        required: f64,
        /// Devices the nodes offer in total.
        available: f64,
        /// `required - available` (or the per-role gap when it is a packing problem).
        shortfall: f64,
        /// Which role could not be placed and what to change.
        detail: String,
    },

    /// A dataset could not be opened or has the wrong shape.
    #[error("dataset {path}: {reason}")]
    Dataset {
        /// The dataset file.
        path: String,
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// Rows failed to parse and `data.bad_rows` is `fail`.
    #[error(
        "dataset {path}: {count} bad row(s) (data.bad_rows=fail; set data.bad_rows=skip to drop them):\n  - {}",
        first.join("\n  - ")
    )]
    BadRows {
        /// The dataset file.
        path: String,
        /// Number of bad rows.
        count: usize,
        /// The first few, each `line N: reason` / `row N: reason`.
        first: Vec<String>,
    },

    /// A saved data cursor does not match the dataset it is restored into.
    #[error("data cursor: {0}")]
    Cursor(String),
}

fn line_suffix(line: Option<usize>) -> String {
    line.map(|l| format!(" at line {l}")).unwrap_or_default()
}

fn suggestion_suffix(s: &Option<String>) -> String {
    s.as_ref()
        .map(|s| format!("; did you mean '{s}'?"))
        .unwrap_or_default()
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, ConfigError>;
