//! A reporter that keeps every event as data ([`Recorder`]), for callers that inspect a run
//! without reading its output: the driver's tests, programs that embed the driver.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rlhf_core::Result;

use super::{DatasetReport, Event, Reporter};

/// An owned copy of an event, as a [`Recorder`] keeps it.
#[derive(Debug, Clone, PartialEq)]
pub enum Recorded {
    Dataset(DatasetReport),
    Resumed {
        dir: PathBuf,
        step: u64,
    },
    NothingToDo {
        step: u64,
        total: u64,
    },
    Placed {
        processes: usize,
    },
    RoleReady {
        who: String,
        device: String,
        note: String,
    },
    Step {
        step: u64,
        metrics: BTreeMap<String, f64>,
        samples: usize,
    },
    Stopped {
        steps_run: u64,
    },
    WeightSync {
        path: String,
    },
    DataParallel {
        part: String,
        backend: String,
    },
    Restart {
        error: String,
        restart: u32,
        from: Option<PathBuf>,
    },
    Restored {
        part: String,
        source: String,
    },
}

/// Keeps every event, for callers that inspect a run as data (tests, embedding programs).
#[derive(Clone, Default)]
pub struct Recorder(pub Arc<Mutex<Vec<Recorded>>>);

impl Recorder {
    pub fn events(&self) -> Vec<Recorded> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

impl Reporter for Recorder {
    fn report(&mut self, event: &Event<'_>) -> Result<()> {
        let r = match *event {
            Event::Dataset(d) => Recorded::Dataset(d.clone()),
            Event::Resumed { dir, step } => Recorded::Resumed {
                dir: dir.to_path_buf(),
                step,
            },
            Event::NothingToDo { step, total } => Recorded::NothingToDo { step, total },
            Event::Placed { processes, .. } => Recorded::Placed { processes },
            Event::RoleReady {
                who, device, note, ..
            } => Recorded::RoleReady {
                who: who.into(),
                device: device.into(),
                note: note.into(),
            },
            Event::Step {
                step,
                metrics,
                samples,
                ..
            } => Recorded::Step {
                step,
                metrics: metrics.clone(),
                samples: samples.map_or(0, |s| s.len()),
            },
            Event::Stopped { steps_run } => Recorded::Stopped { steps_run },
            Event::WeightSync { path, .. } => Recorded::WeightSync { path: path.into() },
            Event::DataParallel { part, backend, .. } => Recorded::DataParallel {
                part: part.into(),
                backend: backend.into(),
            },
            Event::Restart {
                error,
                restart,
                from,
                ..
            } => Recorded::Restart {
                error: error.into(),
                restart,
                from: from.map(Path::to_path_buf),
            },
            Event::Restored { part, source } => Recorded::Restored {
                part: part.into(),
                source: source.into(),
            },
        };
        if let Ok(mut v) = self.0.lock() {
            v.push(r);
        }
        Ok(())
    }
}
