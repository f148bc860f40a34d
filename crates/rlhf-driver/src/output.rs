//! What the user sees: a progress line with ETA and key metrics, JSONL metrics per step,
//! and a sample table (query, response, score) every N steps.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rlhf_algo::metric;
use rlhf_core::{Error, Result};
use serde_json::json;

/// Appends one JSON object per step.
pub struct MetricsLog {
    path: PathBuf,
    file: File,
}

/// Creates `path` (and its directory) holding only the lines a resumed run keeps.
fn open_keeping(path: &Path, keep_through: Option<u64>) -> Result<File> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    }
    let kept = lines_through(path, keep_through);
    let mut file =
        File::create(path).map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
    for l in kept {
        writeln!(file, "{l}").map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    }
    Ok(file)
}

/// The JSON lines of `path` whose `step` is at most `keep_through` (none for a fresh run or
/// a missing file): what a resumed run keeps of a metrics or samples file.
fn lines_through(path: &Path, keep_through: Option<u64>) -> Vec<String> {
    let Some(last) = keep_through else {
        return vec![];
    };
    File::open(path)
        .map(|f| {
            BufReader::new(f)
                .lines()
                .map_while(|l| l.ok())
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v["step"].as_u64())
                        .is_some_and(|s| s <= last)
                })
                .collect()
        })
        .unwrap_or_default()
}

impl MetricsLog {
    /// Opens `path`. A fresh run starts the file anew; a resumed run keeps the lines of steps
    /// up to `keep_through` and drops later ones (they belong to the abandoned run).
    pub fn open(path: &Path, keep_through: Option<u64>) -> Result<Self> {
        Ok(Self {
            path: path.to_path_buf(),
            file: open_keeping(path, keep_through)?,
        })
    }

    pub fn write(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> Result<()> {
        let mut obj = serde_json::Map::new();
        obj.insert("step".into(), json!(step));
        for (k, v) in metrics {
            // JSON has no NaN/inf; write null rather than an unparsable line.
            let val = if v.is_finite() {
                json!(v)
            } else {
                serde_json::Value::Null
            };
            obj.insert(k.clone(), val);
        }
        writeln!(self.file, "{}", serde_json::Value::Object(obj))
            .and_then(|_| self.file.flush())
            .map_err(|e| Error::io(format!("writing {}", self.path.display()), e))
    }
}

/// The prompts one step consumed (`logging.ledger_file`): the dataset rows of the groups it
/// trained on, of those dynamic sampling dropped (every response alike) and of those it
/// generated beyond the full batch, and the data cursor after the step.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LedgerEntry {
    pub epoch: u64,
    pub position: usize,
    pub trained: Vec<usize>,
    pub dropped: Vec<usize>,
    pub surplus: Vec<usize>,
}

/// Appends one ledger line per step; a resumed run keeps the lines of the steps it keeps.
pub struct LedgerLog {
    path: PathBuf,
    file: File,
}

impl LedgerLog {
    /// Opens `path` as [`MetricsLog::open`] does.
    pub fn open(path: &Path, keep_through: Option<u64>) -> Result<Self> {
        Ok(Self {
            path: path.to_path_buf(),
            file: open_keeping(path, keep_through)?,
        })
    }

    pub fn write(&mut self, step: u64, e: &LedgerEntry) -> Result<()> {
        let line = json!({
            "step": step,
            "epoch": e.epoch,
            "position": e.position,
            "trained": e.trained,
            "dropped": e.dropped,
            "surplus": e.surplus,
        });
        writeln!(self.file, "{line}")
            .and_then(|_| self.file.flush())
            .map_err(|e| Error::io(format!("writing {}", self.path.display()), e))
    }
}

/// One generated sample for the table.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub prompt: String,
    pub response: String,
    pub score: f64,
}

/// Appends samples as JSONL and prints them as a table.
pub struct SampleLog {
    path: PathBuf,
    file: File,
}

impl SampleLog {
    /// Opens `path` as [`MetricsLog::open`] does: a resumed run keeps the rows of steps up to
    /// `keep_through`, so steps run again after a restart are written once.
    pub fn open(path: &Path, keep_through: Option<u64>) -> Result<Self> {
        Ok(Self {
            path: path.to_path_buf(),
            file: open_keeping(path, keep_through)?,
        })
    }

    pub fn write(&mut self, step: u64, samples: &[Sample]) -> Result<()> {
        for s in samples {
            let line =
                json!({"step": step, "query": s.prompt, "response": s.response, "score": s.score});
            writeln!(self.file, "{line}")
                .map_err(|e| Error::io(format!("writing {}", self.path.display()), e))?;
        }
        self.file
            .flush()
            .map_err(|e| Error::io(format!("writing {}", self.path.display()), e))
    }
}

fn one_line(s: &str, width: usize) -> String {
    let flat: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= width {
        format!("{flat:width$}")
    } else {
        let cut: String = flat.chars().take(width.saturating_sub(1)).collect();
        format!("{cut}…")
    }
}

/// The sample table as text.
pub fn sample_table(step: u64, samples: &[Sample]) -> String {
    let (qw, rw) = (30, 40);
    let mut out = format!("samples at step {step}\n");
    out.push_str(&format!(
        "  {} | {} | score\n",
        one_line("query", qw),
        one_line("response", rw)
    ));
    out.push_str(&format!(
        "  {}-+-{}-+------\n",
        "-".repeat(qw),
        "-".repeat(rw)
    ));
    for s in samples {
        out.push_str(&format!(
            "  {} | {} | {:.3}\n",
            one_line(&s.prompt, qw),
            one_line(&s.response, rw),
            s.score
        ));
    }
    out
}

/// Progress with ETA. On a terminal an indicatif bar (redrawn in place, with text printed
/// above it); elsewhere (logs, CI) a plain line per step.
pub struct Progress {
    enabled: bool,
    bar: Option<ProgressBar>,
    total: u64,
    first_step: u64,
    started: Instant,
}

/// The short names of the metrics on the progress line.
const SHOWN: [(&str, &str); 5] = [
    (metric::OBJECTIVE_SCORES, "score"),
    (metric::OBJECTIVE_KL, "kl"),
    (metric::LOSS_POLICY_AVG, "pg_loss"),
    (metric::LOSS_VALUE_AVG, "vf_loss"),
    (metric::RESPONSE_LENGTH_MEAN, "len"),
];

impl Progress {
    pub fn new(enabled: bool, first_step: u64, total: u64) -> Self {
        let bar = (enabled && std::io::stderr().is_terminal()).then(|| {
            let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            // The template is a constant: a bad one is a bug caught by the test below.
            if let Ok(style) = ProgressStyle::with_template(BAR_TEMPLATE) {
                b.set_style(style.progress_chars("#>."));
            }
            b.set_position(first_step);
            b.reset_eta();
            b
        });
        Self {
            enabled,
            bar,
            total,
            first_step,
            started: Instant::now(),
        }
    }

    fn per_step(&self, step: u64) -> f64 {
        let done = step.saturating_sub(self.first_step);
        if done > 0 {
            self.started.elapsed().as_secs_f64() / done as f64
        } else {
            0.0
        }
    }

    /// The metrics part of the line: ` | score 0.5000 | kl ...`.
    fn shown(metrics: &BTreeMap<String, f64>) -> String {
        let mut s = String::new();
        for (k, short) in SHOWN {
            if let Some(v) = metrics.get(k) {
                s.push_str(&format!(" | {short} {v:.4}"));
            }
        }
        s
    }

    /// The plain line (not a terminal).
    pub fn line(&self, step: u64, metrics: &BTreeMap<String, f64>) -> String {
        let per = self.per_step(step);
        let left = self.total.saturating_sub(step);
        let width = 20usize;
        let filled = if self.total > 0 {
            (step as usize * width / self.total as usize).min(width)
        } else {
            width
        };
        let bar = format!("{}{}", "#".repeat(filled), ".".repeat(width - filled));
        format!(
            "step {step}/{} [{bar}] {:.1} s/step ETA {}{}",
            self.total,
            per,
            fmt_duration(per * left as f64),
            Self::shown(metrics)
        )
    }

    pub fn update(&self, step: u64, metrics: &BTreeMap<String, f64>) {
        if !self.enabled {
            return;
        }
        match &self.bar {
            Some(b) => {
                b.set_message(format!(
                    "{:.1} s/step{}",
                    self.per_step(step),
                    Self::shown(metrics)
                ));
                b.set_position(step);
                if step >= self.total {
                    b.finish();
                }
            }
            None => eprintln!("{}", self.line(step, metrics)),
        }
    }

    /// Prints text without tearing the progress bar.
    pub fn println(&self, text: &str) {
        let text = text.strip_suffix('\n').unwrap_or(text);
        match &self.bar {
            Some(b) if !b.is_finished() => b.println(text),
            _ => eprintln!("{text}"),
        }
    }
}

const BAR_TEMPLATE: &str = "step {pos}/{len} [{bar:20}] ETA {eta} {msg}";

fn fmt_duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_log_resume_drops_abandoned_steps() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("m/metrics.jsonl");
        let mut m = MetricsLog::open(&p, None).unwrap();
        for s in 1..=4 {
            m.write(
                s,
                &[(metric::OBJECTIVE_SCORES.to_string(), s as f64)].into(),
            )
            .unwrap();
        }
        drop(m);
        let mut m = MetricsLog::open(&p, Some(2)).unwrap();
        m.write(3, &[("x".to_string(), f64::NAN)].into()).unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        let steps: Vec<u64> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(steps, vec![1, 2, 3]);
        assert!(text.lines().last().unwrap().contains("\"x\":null"));
    }

    #[test]
    fn progress_line_and_table() {
        let p = Progress::new(true, 0, 40);
        let l = p.line(10, &[(metric::OBJECTIVE_SCORES.to_string(), 0.5)].into());
        assert!(l.starts_with("step 10/40 [#####..............."), "{l}");
        assert!(l.contains("score 0.5000") && l.contains("ETA"), "{l}");
        let t = sample_table(
            5,
            &[Sample {
                prompt: "2+3=".into(),
                response: "5\nand a very long response that must be cut to fit the table".into(),
                score: 1.0,
            }],
        );
        assert!(
            t.contains("2+3=") && t.contains("…") && t.contains("1.000"),
            "{t}"
        );
        // The newline inside the response does not break the row: the table is exactly
        // title, column header, rule and one row, and that row holds every cell.
        assert_eq!(t.matches('\n').count(), 4, "{t:?}");
        let row = t.lines().nth(3).unwrap();
        assert!(
            row.trim_start().starts_with("2+3=")
                && row.contains("| 5 and a very long response that must be… |")
                && row.ends_with("| 1.000"),
            "{row:?}"
        );
        assert_eq!(fmt_duration(3725.0), "1h02m");
        assert!(ProgressStyle::with_template(BAR_TEMPLATE).is_ok());
    }
}
