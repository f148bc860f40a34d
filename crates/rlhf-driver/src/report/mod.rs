//! How a job tells what it does. The loop and the algorithm never print: they emit closed
//! [`Event`]s to a [`Reporter`]. The default reporters are the console (progress line with
//! ETA, sample tables, one line per milestone), the JSONL metrics file and the JSONL samples
//! file (`logging.backends`), and TensorBoard event files (`logging.tensorboard_dir`); a
//! caller adds its own (a test records events, a tracker backend sends metrics elsewhere)
//! through [`crate::DriverOptions::reporters`]. Every event is also a `tracing`
//! record under the target `rlhf::job`, so the log file of a submitted job has them whatever
//! the console shows.

use std::collections::BTreeMap;
use std::path::Path;

use rlhf_config::PpoConfig;
use rlhf_core::Result;

use crate::output::{
    sample_table, LedgerEntry, LedgerLog, MetricsLog, Progress, Sample, SampleLog,
};
use crate::tensorboard::EventWriter;

mod recorder;
pub use recorder::{Recorded, Recorder};

/// The prompt set as loaded.
#[derive(Debug, Clone, PartialEq)]
pub struct DatasetReport {
    pub path: String,
    pub rows: usize,
    pub prompts: usize,
    pub kept: usize,
    pub truncated: usize,
    pub skipped: usize,
    pub max_prompt_length: u32,
    /// One line per malformed row skipped (`data.bad_rows: skip`).
    pub bad_rows: Vec<String>,
    /// `data.packing`: the rows the examples were packed into.
    pub packed_rows: Option<usize>,
}

/// Something worth telling about a job, in the order it happens.
#[derive(Debug, Clone, Copy)]
pub enum Event<'a> {
    /// The prompts were loaded and filtered.
    Dataset(&'a DatasetReport),
    /// The run continues from a checkpoint.
    Resumed { dir: &'a Path, step: u64 },
    /// The checkpoint is already at the last step.
    NothingToDo { step: u64, total: u64 },
    /// The head placed every role process.
    Placed { processes: usize, secs: f64 },
    /// A role rank loaded its model; `note` says what the user should know (empty if none).
    RoleReady {
        who: &'a str,
        model: &'a str,
        params: u64,
        device: &'a str,
        note: &'a str,
    },
    /// How trainer → rollout weights travel in this job, chosen once (`path`), and why.
    WeightSync { path: &'a str, why: &'a str },
    /// The collective backend of a trained part's data-parallel group (`actor`, `critic`,
    /// `reward`), and why.
    DataParallel {
        part: &'a str,
        backend: &'a str,
        why: &'a str,
    },
    /// A step ended. `samples` is set on the steps whose samples are due
    /// (`logging.sample_every`).
    Step {
        step: u64,
        metrics: &'a BTreeMap<String, f64>,
        samples: Option<&'a [Sample]>,
        /// The prompts the step consumed (PPO-family jobs).
        ledger: Option<&'a LedgerEntry>,
    },
    /// The run stopped early as asked (`--stop-after`).
    Stopped { steps_run: u64 },
    /// A role died and the job restarts by itself (`fault_tolerance`): from checkpoint
    /// `from`, or from the start without one.
    Restart {
        error: &'a str,
        restart: u32,
        max: u32,
        from: Option<&'a Path>,
        backoff_s: f64,
    },
    /// A checkpoint part was loaded into its ranks; `source` says from where (`disk`, or a
    /// memory snapshot and its size).
    Restored { part: &'a str, source: &'a str },
}

/// Receives a job's events. An error stops the job (a metrics file that cannot be written
/// is a failed run, not a silent one).
pub trait Reporter: Send + Sync {
    fn report(&mut self, event: &Event<'_>) -> Result<()>;
}

/// Sends every event to each reporter in turn, and to `tracing`.
#[derive(Default)]
pub struct Reporters {
    all: Vec<Box<dyn Reporter>>,
    /// The JSONL files, opened anew by each (re)start of the roles.
    files: Vec<Box<dyn Reporter>>,
}

impl Reporters {
    /// The console alone; the files come with [`Reporters::add_files`] once the roles run.
    pub fn console(cfg: &PpoConfig, first_step: u64) -> Self {
        let mut all = Reporters::default();
        all.push(Console::new(
            cfg.logging.progress,
            first_step,
            cfg.training.train_iters,
        ));
        all
    }

    /// The files the config asks for: with the `jsonl` backend `logging.metrics_file` and
    /// `logging.samples_file`, with `logging.tensorboard_dir` a new TensorBoard event file.
    /// `keep_through`: the last step of the run being resumed (later steps belong to an
    /// abandoned run: their JSONL lines go, and TensorBoard hides their points).
    pub fn add_files(&mut self, cfg: &PpoConfig, keep_through: Option<u64>) -> Result<()> {
        let logging = &cfg.logging;
        // A restart reopens them: the lines of steps after the checkpoint go.
        self.files.clear();
        if logging.jsonl() {
            self.files.push(Box::new(MetricsFile(MetricsLog::open(
                Path::new(&logging.metrics_file),
                keep_through,
            )?)));
            if !logging.samples_file.is_empty() {
                self.files.push(Box::new(SamplesFile(SampleLog::open(
                    Path::new(&logging.samples_file),
                    keep_through,
                )?)));
            }
            if !logging.ledger_file.is_empty() {
                self.files.push(Box::new(LedgerFile(LedgerLog::open(
                    Path::new(&logging.ledger_file),
                    keep_through,
                )?)));
            }
        }
        if logging.tensorboard() {
            // This attempt's first step: TensorBoard drops the points of that step and
            // later ones from the older files of the directory.
            let first = keep_through.unwrap_or(0).saturating_add(1);
            self.files
                .push(Box::new(TensorBoardFile(EventWriter::create(
                    Path::new(&logging.tensorboard_dir),
                    first,
                )?)));
        }
        Ok(())
    }

    pub fn push(&mut self, r: impl Reporter + 'static) {
        self.all.push(Box::new(r));
    }

    pub fn extend(&mut self, more: Vec<Box<dyn Reporter>>) {
        self.all.extend(more);
    }
}

impl Reporter for Reporters {
    fn report(&mut self, event: &Event<'_>) -> Result<()> {
        trace(event);
        for r in self.all.iter_mut().chain(&mut self.files) {
            r.report(event)?;
        }
        Ok(())
    }
}

fn trace(event: &Event<'_>) {
    const T: &str = "rlhf::job";
    match *event {
        Event::Dataset(d) => {
            tracing::debug!(target: T, path = %d.path, prompts = d.prompts, bad_rows = d.bad_rows.len(), "dataset")
        }
        Event::Resumed { dir, step } => {
            tracing::debug!(target: T, dir = %dir.display(), step, "resumed")
        }
        Event::NothingToDo { step, total } => {
            tracing::debug!(target: T, step, total, "nothing to do")
        }
        Event::Placed { processes, secs } => tracing::debug!(target: T, processes, secs, "placed"),
        Event::RoleReady {
            who,
            model,
            params,
            device,
            note,
        } => {
            tracing::info!(target: T, "{who}: {model} ({params} parameters, {device}){}", if note.is_empty() { String::new() } else { format!("; {note}") })
        }
        Event::Step { step, metrics, .. } => {
            tracing::debug!(target: T, step, metrics = metrics.len(), "step")
        }
        Event::Stopped { steps_run } => tracing::debug!(target: T, steps_run, "stopped"),
        Event::Restart { restart, max, .. } => {
            tracing::warn!(target: T, restart, max, "restarting after a role death")
        }
        Event::WeightSync { path, why } => {
            tracing::info!(target: T, "weight sync: {path} ({why})")
        }
        Event::DataParallel { part, backend, why } => {
            tracing::info!(target: T, "{part} data-parallel group: {backend} ({why})")
        }
        Event::Restored { part, source } => {
            tracing::info!(target: T, part, source, "checkpoint loaded")
        }
    }
}

/// What a person watching the terminal sees: milestones, a progress line with ETA and key
/// metrics, and the sample table when samples are due.
pub struct Console {
    progress: Progress,
}

impl Console {
    pub fn new(progress: bool, first_step: u64, total: u64) -> Self {
        Self {
            progress: Progress::new(progress, first_step, total),
        }
    }

    /// The console text for an event other than a step (`None`: nothing to say).
    pub fn text(event: &Event<'_>) -> Option<String> {
        Some(match *event {
            Event::Dataset(d) => {
                let mut s = format!(
                    "dataset {}: {} rows, {} prompts ({} kept, {} truncated, {} skipped by actor_rollout.max_prompt_length={})",
                    d.path, d.rows, d.prompts, d.kept, d.truncated, d.skipped, d.max_prompt_length
                );
                if let Some(n) = d.packed_rows {
                    s.push_str(&format!(", packed into {n} rows (data.packing)"));
                }
                if !d.bad_rows.is_empty() {
                    s.push_str(&format!(
                        "\n{} bad row(s) skipped (data.bad_rows: skip):",
                        d.bad_rows.len()
                    ));
                    for b in d.bad_rows.iter().take(20) {
                        s.push_str(&format!("\n  {b}"));
                    }
                    if d.bad_rows.len() > 20 {
                        s.push_str(&format!("\n  ... and {} more", d.bad_rows.len() - 20));
                    }
                }
                s
            }
            Event::Resumed { dir, step } => {
                format!("resuming from {} (step {step})", dir.display())
            }
            Event::NothingToDo { step, total } => format!(
                "nothing to do: the checkpoint is at step {step} of training.train_iters={total}"
            ),
            Event::Placed { processes, secs } => {
                format!("placed {processes} role processes in {secs:.1} s")
            }
            Event::RoleReady { who, note, .. } if !note.is_empty() => {
                format!("warning: {who}: {note}")
            }
            Event::Stopped { steps_run } => {
                format!("stopping after {steps_run} step(s) as asked (--stop-after)")
            }
            Event::WeightSync { path, why } => format!("weight sync: {path} ({why})"),
            Event::DataParallel { part, backend, why } => {
                format!("{part} data-parallel group: {backend} ({why})")
            }
            Event::Restored { part, source } => format!("{part}: checkpoint loaded from {source}"),
            Event::Restart {
                error,
                restart,
                max,
                from,
                backoff_s,
            } => format!(
                "{error}\nrestart {restart}/{max} (fault_tolerance.max_restarts) in {backoff_s} s: every role placed again, from {}",
                match from {
                    Some(d) => d.display().to_string(),
                    None => "the start (no checkpoint yet)".to_string(),
                }
            ),
            Event::RoleReady { .. } | Event::Step { .. } => return None,
        })
    }
}

impl Reporter for Console {
    fn report(&mut self, event: &Event<'_>) -> Result<()> {
        match *event {
            Event::Step {
                step,
                metrics,
                samples,
                ..
            } => {
                self.progress.update(step, metrics);
                if let Some(s) = samples {
                    self.progress.println(&sample_table(step, s));
                }
            }
            ref other => {
                if let Some(text) = Console::text(other) {
                    self.progress.println(&text);
                }
            }
        }
        Ok(())
    }
}

/// One JSON object per step (`logging.metrics_file`).
pub struct MetricsFile(pub MetricsLog);

impl Reporter for MetricsFile {
    fn report(&mut self, event: &Event<'_>) -> Result<()> {
        match event {
            Event::Step { step, metrics, .. } => self.0.write(*step, metrics),
            _ => Ok(()),
        }
    }
}

/// The due samples as JSONL (`logging.samples_file`).
pub struct SamplesFile(pub SampleLog);

impl Reporter for SamplesFile {
    fn report(&mut self, event: &Event<'_>) -> Result<()> {
        match event {
            Event::Step {
                step,
                samples: Some(s),
                ..
            } => self.0.write(*step, s),
            _ => Ok(()),
        }
    }
}

/// The prompts each step consumed as JSONL (`logging.ledger_file`).
pub struct LedgerFile(pub LedgerLog);

impl Reporter for LedgerFile {
    fn report(&mut self, event: &Event<'_>) -> Result<()> {
        match event {
            Event::Step {
                step,
                ledger: Some(e),
                ..
            } => self.0.write(*step, e),
            _ => Ok(()),
        }
    }
}

/// Every step's metrics as TensorBoard scalars and the due samples as a text table
/// (`logging.tensorboard_dir`).
pub struct TensorBoardFile(pub EventWriter);

impl Reporter for TensorBoardFile {
    fn report(&mut self, event: &Event<'_>) -> Result<()> {
        match event {
            Event::Step {
                step,
                metrics,
                samples,
                ..
            } => self.0.write_step(*step, metrics, *samples),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlhf_algo::metric;

    #[test]
    fn fan_out_reaches_every_reporter_and_files_get_steps_only() {
        let d = tempfile::tempdir().unwrap();
        let mut cfg = PpoConfig::default();
        cfg.logging.metrics_file = d.path().join("m.jsonl").to_string_lossy().into();
        cfg.logging.samples_file = d.path().join("s.jsonl").to_string_lossy().into();
        cfg.logging.progress = false;
        let mut all = Reporters::console(&cfg, 0);
        all.add_files(&cfg, None).unwrap();
        let rec = Recorder::default();
        all.push(rec.clone());
        let data = DatasetReport {
            path: "p.jsonl".into(),
            rows: 3,
            prompts: 2,
            kept: 2,
            truncated: 0,
            skipped: 0,
            max_prompt_length: 8,
            bad_rows: vec!["line 3: not JSON".into()],
            packed_rows: None,
        };
        all.report(&Event::Dataset(&data)).unwrap();
        let metrics: BTreeMap<String, f64> = [(metric::OBJECTIVE_SCORES.to_string(), 0.25)].into();
        let samples = [Sample {
            prompt: "q".into(),
            response: "a".into(),
            score: 1.0,
        }];
        all.report(&Event::Step {
            step: 1,
            metrics: &metrics,
            samples: Some(&samples),
            ledger: None,
        })
        .unwrap();
        all.report(&Event::Step {
            step: 2,
            metrics: &metrics,
            samples: None,
            ledger: None,
        })
        .unwrap();
        all.report(&Event::Stopped { steps_run: 2 }).unwrap();
        let ev = rec.events();
        assert_eq!(ev.len(), 4, "{ev:?}");
        assert_eq!(ev[0], Recorded::Dataset(data.clone()));
        assert!(
            matches!(&ev[1], Recorded::Step { step: 1, samples: 1, metrics } if metrics[metric::OBJECTIVE_SCORES] == 0.25)
        );
        assert!(matches!(
            &ev[2],
            Recorded::Step {
                step: 2,
                samples: 0,
                ..
            }
        ));
        let m = std::fs::read_to_string(d.path().join("m.jsonl")).unwrap();
        assert_eq!(m.lines().count(), 2, "{m}");
        let s = std::fs::read_to_string(d.path().join("s.jsonl")).unwrap();
        assert_eq!(s.lines().count(), 1, "only the step with due samples: {s}");
        assert!(s.contains("\"step\":1"), "{s}");
    }

    #[test]
    fn backends_choose_the_files_and_a_tensorboard_dir_adds_an_event_file() {
        let d = tempfile::tempdir().unwrap();
        let mut cfg = PpoConfig::default();
        cfg.logging.progress = false;
        cfg.logging.metrics_file = d.path().join("m.jsonl").to_string_lossy().into();
        cfg.logging.samples_file = d.path().join("s.jsonl").to_string_lossy().into();
        let tb = d.path().join("tb");
        let event_files = || {
            std::fs::read_dir(&tb).map_or(0, |r| {
                r.filter(|e| {
                    e.as_ref()
                        .is_ok_and(|e| e.file_name().to_string_lossy().contains("tfevents"))
                })
                .count()
            })
        };
        let metrics: BTreeMap<String, f64> = [(metric::OBJECTIVE_SCORES.to_string(), 0.5)].into();
        let step = |all: &mut Reporters, step| {
            all.report(&Event::Step {
                step,
                metrics: &metrics,
                samples: None,
                ledger: None,
            })
            .unwrap()
        };
        // A tensorboard_dir alone: both the JSONL files and an event file.
        cfg.logging.tensorboard_dir = tb.to_string_lossy().into();
        let mut all = Reporters::console(&cfg, 0);
        all.add_files(&cfg, None).unwrap();
        step(&mut all, 1);
        assert!(d.path().join("m.jsonl").exists());
        assert_eq!(event_files(), 1);
        // Each (re)start opens a new event file.
        all.add_files(&cfg, Some(1)).unwrap();
        assert_eq!(event_files(), 2);
        // Without jsonl in backends no JSONL file is opened.
        std::fs::remove_file(d.path().join("m.jsonl")).unwrap();
        cfg.logging.backends = vec![rlhf_config::LogBackend::Tensorboard];
        let mut all = Reporters::console(&cfg, 0);
        all.add_files(&cfg, None).unwrap();
        step(&mut all, 1);
        assert!(!d.path().join("m.jsonl").exists());
        assert_eq!(event_files(), 3);
        // jsonl alone, no directory: no event file.
        cfg.logging.backends = vec![rlhf_config::LogBackend::Jsonl];
        cfg.logging.tensorboard_dir.clear();
        let mut all = Reporters::console(&cfg, 0);
        all.add_files(&cfg, None).unwrap();
        step(&mut all, 1);
        assert!(d.path().join("m.jsonl").exists());
        assert_eq!(event_files(), 3);
    }

    #[test]
    fn console_text_names_the_config_keys() {
        let data = DatasetReport {
            path: "p.jsonl".into(),
            rows: 30,
            prompts: 1,
            kept: 1,
            truncated: 0,
            skipped: 0,
            max_prompt_length: 8,
            bad_rows: (0..25).map(|i| format!("line {i}: bad")).collect(),
            packed_rows: None,
        };
        let t = Console::text(&Event::Dataset(&data)).unwrap();
        assert!(t.contains("actor_rollout.max_prompt_length=8"), "{t}");
        assert!(
            t.contains("25 bad row(s) skipped (data.bad_rows: skip)"),
            "{t}"
        );
        assert!(
            t.contains("... and 5 more") && !t.contains("line 21:"),
            "{t}"
        );
        let t = Console::text(&Event::NothingToDo { step: 5, total: 5 }).unwrap();
        assert!(t.contains("training.train_iters=5"), "{t}");
        let ready = |note| Event::RoleReady {
            who: "critic rank 0",
            model: "tiny",
            params: 10,
            device: "cpu",
            note,
        };
        assert_eq!(Console::text(&ready("")), None);
        assert_eq!(
            Console::text(&ready("bf16 asked, f32 used")).unwrap(),
            "warning: critic rank 0: bf16 asked, f32 used"
        );
    }
}
