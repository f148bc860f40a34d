//! The event files of `logging.tensorboard_dir`, written through the job's reporters (a
//! first attempt, then a restart from a checkpoint), read by the real `tensorboard` Python
//! package: every metric a scalar per step, each step once after the restart's purge, the
//! sample tables as text. The interpreter is `RLHF_TB_PYTHON` (CI points it at a venv with
//! tensorboard, see `.ci/run`), else `python3`; without tensorboard the test records a skip.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use rlhf_config::{LogBackend, PpoConfig};
use rlhf_driver::output::Sample;
use rlhf_driver::report::{Event, Reporter, Reporters};

/// Loads the directory with tensorboard's two accumulators and prints, as JSON, what each
/// holds per tag in load order: `EventAccumulator` (the reader of `simple_value` scalars)
/// its scalars as (step, value); `plugin_event_accumulator.EventAccumulator` (what the
/// TensorBoard server's plugins read, everything as tensors) each tag's plugin and its
/// (step, value or text). Size guidance 0 keeps every point.
const READER: &str = r#"
import json, sys
from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.util import tensor_util
ea = event_accumulator.EventAccumulator(
    sys.argv[1], size_guidance={k: 0 for k in event_accumulator.DEFAULT_SIZE_GUIDANCE})
ea.Reload()
out = {"scalars": {}, "tensors": {}}
for t in ea.Tags()["scalars"]:
    out["scalars"][t] = [[e.step, e.value] for e in ea.Scalars(t)]
pa = plugin_event_accumulator.EventAccumulator(
    sys.argv[1],
    size_guidance={k: 0 for k in plugin_event_accumulator.DEFAULT_SIZE_GUIDANCE},
    tensor_size_guidance={})
pa.Reload()
for t in pa.Tags()["tensors"]:
    plugin = pa.SummaryMetadata(t).plugin_data.plugin_name
    points = []
    for e in pa.Tensors(t):
        v = tensor_util.make_ndarray(e.tensor_proto).item()
        points.append([e.step, v.decode("utf-8") if isinstance(v, bytes) else float(v)])
    out["tensors"][t] = {"plugin": plugin, "points": points}
print(json.dumps(out))
"#;

/// Records a skip where CI lists them (`target/tmp/skipped/<test>`).
fn skip(test: &str, reason: &str) {
    eprintln!("SKIPPED {test}: {reason}");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("skipped");
    let file = dir.join(test);
    if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&file, reason)) {
        eprintln!("could not record the skip in {}: {e}", file.display());
    }
}

/// The metrics of `step` in attempt `attempt` (values differ between attempts, so a point
/// of the abandoned attempt that survives the purge is seen).
fn metrics(step: u64, attempt: u64) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::from([
        (
            "objective/scores".to_string(),
            0.125 * step as f64 + attempt as f64,
        ),
        (
            "timing_s/step".to_string(),
            10.0 * step as f64 - attempt as f64,
        ),
    ]);
    // A tag the restarted attempt never writes: only the START purge can drop its later points.
    if attempt == 0 {
        m.insert("only/first_attempt".into(), step as f64);
    }
    m
}

fn samples(step: u64, attempt: u64) -> Vec<Sample> {
    vec![
        Sample {
            prompt: format!("prompt {step}"),
            response: format!("response of attempt {attempt}"),
            score: 0.5,
        },
        Sample {
            prompt: "a | b".into(),
            response: "second".into(),
            score: -1.0,
        },
    ]
}

fn run_steps(r: &mut Reporters, steps: std::ops::RangeInclusive<u64>, attempt: u64, with: &[u64]) {
    for step in steps {
        let m = metrics(step, attempt);
        let s = samples(step, attempt);
        r.report(&Event::Step {
            step,
            metrics: &m,
            samples: with.contains(&step).then_some(s.as_slice()),
            ledger: None,
        })
        .unwrap();
    }
}

#[test]
fn tensorboard_reads_scalars_and_samples_once_per_step_after_a_restart() {
    const TEST: &str = "tensorboard_reads_scalars_and_samples_once_per_step_after_a_restart";
    let python = std::env::var("RLHF_TB_PYTHON").unwrap_or_else(|_| "python3".into());
    match Command::new(&python)
        .args(["-c", "import tensorboard"])
        .output()
    {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            let why = String::from_utf8_lossy(&o.stderr);
            let last = why.lines().last().unwrap_or_default();
            skip(
                TEST,
                &format!("{python} cannot import tensorboard ({last}); set RLHF_TB_PYTHON to a Python with `pip install tensorboard`"),
            );
            return;
        }
        Err(e) => {
            skip(
                TEST,
                &format!("cannot run {python} ({e}); set RLHF_TB_PYTHON"),
            );
            return;
        }
    }

    let d = tempfile::tempdir().unwrap();
    let tb = d.path().join("tb");
    let mut cfg = PpoConfig::default();
    cfg.logging.progress = false;
    cfg.logging.backends = vec![LogBackend::Tensorboard];
    cfg.logging.tensorboard_dir = tb.to_string_lossy().into_owned();
    cfg.logging.metrics_file = d.path().join("m.jsonl").to_string_lossy().into_owned();
    cfg.logging.samples_file = d.path().join("s.jsonl").to_string_lossy().into_owned();

    // The first attempt runs steps 1..=5 and dies; the checkpoint is at step 3, so the
    // restart runs 4..=6 again with other values.
    let mut r = Reporters::console(&cfg, 0);
    r.add_files(&cfg, None).unwrap();
    run_steps(&mut r, 1..=5, 0, &[1, 4]);
    r.add_files(&cfg, Some(3)).unwrap();
    run_steps(&mut r, 4..=6, 1, &[4]);
    drop(r);

    // Without `jsonl` in backends no JSONL file is written.
    assert!(!d.path().join("m.jsonl").exists());
    assert!(!d.path().join("s.jsonl").exists());
    let files: Vec<_> = std::fs::read_dir(&tb)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(files.len(), 2, "one event file per start: {files:?}");
    assert!(
        files.iter().all(|f| f.starts_with("events.out.tfevents.")),
        "{files:?}"
    );

    let out = Command::new(&python)
        .args(["-c", READER])
        .arg(&tb)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the tensorboard reader failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();

    // What each tag should show: steps up to the checkpoint from the first attempt, the
    // later ones from the restart, each step once.
    let mut want: BTreeMap<String, Vec<(u64, f64)>> = BTreeMap::new();
    for (steps, attempt) in [(1..=3, 0), (4..=6, 1)] {
        for step in steps {
            for (k, v) in metrics(step, attempt) {
                want.entry(k).or_default().push((step, v));
            }
        }
    }
    // The scalars, as EventAccumulator and as the server's plugins see them.
    let scalars = got["scalars"].as_object().expect("scalars");
    let tensors = got["tensors"].as_object().expect("tensors");
    assert_eq!(
        scalars.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{got}"
    );
    for (tag, points) in &want {
        assert_eq!(tensors[tag]["plugin"], "scalars", "{tag}: {got}");
        for (reader, seen) in [
            ("EventAccumulator", &scalars[tag]),
            ("plugin_event_accumulator", &tensors[tag]["points"]),
        ] {
            let seen: Vec<(u64, f64)> = seen
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
                .collect();
            assert_eq!(
                seen.iter().map(|p| p.0).collect::<Vec<_>>(),
                points.iter().map(|p| p.0).collect::<Vec<_>>(),
                "{reader}: steps of {tag}: {seen:?}"
            );
            for ((step, got), (_, want)) in seen.iter().zip(points) {
                // Scalars travel as f32.
                assert!(
                    (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "{reader}: {tag} at step {step}: {got} != {want}"
                );
            }
        }
    }

    // The sample tables: step 1 of the first attempt, step 4 of the restart (the first
    // attempt's step 4 is purged).
    assert_eq!(tensors["samples"]["plugin"], "text", "{got}");
    let texts = tensors["samples"]["points"].as_array().expect("samples");
    let steps: Vec<u64> = texts.iter().map(|t| t[0].as_u64().unwrap()).collect();
    assert_eq!(steps, [1, 4], "{got}");
    for (t, attempt) in texts.iter().zip([0, 1]) {
        let text = t[1].as_str().unwrap();
        let step = t[0].as_u64().unwrap();
        let rows: Vec<&str> = text.lines().collect();
        assert_eq!(rows.len(), 4, "{text}");
        assert_eq!(rows[0], "| prompt | response | score |");
        assert_eq!(
            rows[2],
            format!("| prompt {step} | response of attempt {attempt} | 0.500 |")
        );
        assert_eq!(rows[3], "| a \\| b | second | -1.000 |");
    }
}
