//! What every dataset reader shares: rows parsed one by one with where they came from, bad
//! rows counted and listed, and `data.bad_rows` applied (fail lists them, skip keeps going).

use super::{BadRow, LoadReport};
use crate::config::BadRows;
use crate::error::{ConfigError, Result};

/// Bad rows listed in a `BadRows` error (the count covers them all).
const MAX_LISTED_BAD_ROWS: usize = 20;

/// One parsed row: its 1-based line (JSONL) or 0-based row (Parquet), that location as
/// text, and the record or why it is bad.
pub(crate) type Parsed<T> = (usize, String, std::result::Result<T, String>);

/// The good rows with their source rows, and the report; an error when `bad` is `fail` and
/// a row is bad, or when no row is usable. `what` names the records (`prompts`, `pairs`).
pub(crate) fn collect<T>(
    origin: &str,
    rows: Vec<Parsed<T>>,
    bad: BadRows,
    what: &str,
) -> Result<(Vec<(usize, T)>, LoadReport)> {
    let mut report = LoadReport {
        rows: rows.len(),
        ..LoadReport::default()
    };
    let mut good = Vec::new();
    for (source_row, location, parsed) in rows {
        match parsed {
            Ok(r) => good.push((source_row, r)),
            Err(reason) => report.bad.push(BadRow { location, reason }),
        }
    }
    report.loaded = good.len();
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
    if good.is_empty() {
        return Err(ConfigError::Dataset {
            path: origin.into(),
            reason: format!(
                "no usable {what} ({} rows, {} bad)",
                report.rows,
                report.bad.len()
            ),
        });
    }
    Ok((good, report))
}

/// JSONL text as rows of JSON values; blank lines are not rows.
pub(crate) fn jsonl(text: &str) -> Vec<Parsed<serde_json::Value>> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            let v = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"));
            (i + 1, format!("line {}", i + 1), v)
        })
        .collect()
}
