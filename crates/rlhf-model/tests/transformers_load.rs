//! Saved directories load in transformers with the same outputs, checked on every run.
//!
//! Five directories are saved the way the roles save them: two causal LMs (Qwen2: tied
//! embeddings, q/k/v biases; Qwen3: per-head q/k norms, head_dim 32 on hidden 64), a critic with a biased value head (`*ForTokenClassification`), a
//! critic started from a reward model (no bias: `*ForSequenceClassification`, TRL's value
//! model) and a reward model. Every input is deterministic (fixtures, no random head), so the
//! saved bytes are too.
//!
//! `transformers_output_matches_the_committed_reference` (CI) saves them, checks that the
//! bytes are the ones transformers was shown (a content hash per file), that transformers
//! reported no missing, unexpected or mismatched tensor, and that our outputs equal the ones
//! transformers computed from those files (`tests/fixtures/transformers_load.json`).
//!
//! `regenerate_with_transformers` (ignored; needs a Python with torch + transformers, e.g. the
//! `.venv-ref` of scripts/model_fixtures.sh) loads the directories in transformers and writes
//! that file. Rerun it when the save format changes:
//! `RLHF_REF_PYTHON=.venv-ref/bin/python cargo test -p rlhf-model --test transformers_load -- --ignored`

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{fixture, to_vec2, to_vec3};
use rlhf_model::{Batch, Device, LoadOptions, Model, ModelKind, Tensor, ValueHeadInit};
use serde_json::{json, Value};

const SCRIPT: &str = r#"
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoModelForSequenceClassification
d = json.load(open(sys.argv[1]))
ids = torch.tensor(d["input_ids"]); mask = torch.tensor(d["attention_mask"]); pos = torch.tensor(d["position_ids"])
classes = {"ForCausalLM": AutoModelForCausalLM, "ForTokenClassification": AutoModelForTokenClassification,
           "ForSequenceClassification": AutoModelForSequenceClassification}
out = {"transformers": transformers.__version__, "torch": torch.__version__, "models": {}}
with torch.no_grad():
    for name, path in d["dirs"].items():
        arch = json.load(open(path + "/config.json"))["architectures"][0]
        auto = next(c for suffix, c in classes.items() if arch.endswith(suffix))
        m, info = auto.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
        o = m(input_ids=ids, attention_mask=mask, position_ids=pos)
        # Token classifiers give one value per position; sequence classifiers are read per
        # position too (TRL reads its value model that way): score applied to hidden states.
        if arch.endswith("ForSequenceClassification") and name != "reward":
            h = m.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
            logits = m.score(h)
        else:
            logits = o.logits
        out["models"][name] = {
            "class": type(m).__name__,
            "missing_keys": sorted(info["missing_keys"]),
            "unexpected_keys": sorted(info["unexpected_keys"]),
            "mismatched_keys": [list(map(str, k)) for k in info["mismatched_keys"]],
            "output": logits.tolist(),
        }
json.dump(out, open(sys.argv[2], "w"))
"#;

fn reference_path() -> PathBuf {
    fixture("transformers_load.json")
}

/// The inputs every model is run on, left-padded with 0. The last row ends with token 0,
/// which is both the EOS and the pad token of the tiny fixtures (as in models/tiny and
/// Qwen2.5 base): a sequence classifier reads it at the token before (transformers' rule).
fn batch() -> Batch {
    let seqs = vec![
        vec![5, 9, 12, 3, 40],
        vec![7, 8, 1, 33, 20, 11, 2, 60],
        vec![14, 15, 16],
        vec![21, 22, 23, 0],
    ];
    Batch::left_padded(&seqs, 0, &Device::Cpu).unwrap()
}

/// FNV-1a, 64-bit: enough to tell that the saved bytes changed.
fn fnv64(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}

/// A critic checkpoint with a biased head, made without randomness: tiny-llama's body, the
/// head taken from a row of its LM head, bias 0.25.
fn biased_critic_source(dir: &Path) -> PathBuf {
    let src = fixture("tiny-llama");
    let out = dir.join("critic-src");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::copy(src.join("config.json"), out.join("config.json")).unwrap();
    let data = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&data).unwrap();
    let mut tensors: std::collections::HashMap<String, Tensor> = Default::default();
    for (name, view) in st.tensors() {
        let v: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let t = Tensor::from_vec(v, view.shape(), &Device::Cpu).unwrap();
        if name == "lm_head.weight" {
            tensors.insert("score.weight".into(), t.narrow(0, 5, 1).unwrap());
        } else {
            tensors.insert(name, t);
        }
    }
    tensors.insert(
        "score.bias".into(),
        Tensor::new(&[0.25f32], &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, out.join("model.safetensors")).unwrap();
    out
}

/// Saves the four directories under `root`; returns (name, directory, model).
fn save_dirs(root: &Path) -> Vec<(&'static str, PathBuf, Model)> {
    let from_ckpt = |kind| LoadOptions {
        value_head_init: ValueHeadInit::FromCheckpoint,
        ..LoadOptions::inference().with_kind(kind)
    };
    let models = [
        (
            "causal",
            Model::load(fixture("tiny-qwen2"), &LoadOptions::inference()).unwrap(),
        ),
        (
            "causal_qwen3",
            Model::load(fixture("tiny-qwen3"), &LoadOptions::inference()).unwrap(),
        ),
        (
            "critic",
            Model::load(biased_critic_source(root), &from_ckpt(ModelKind::Value)).unwrap(),
        ),
        (
            "critic_from_rm",
            Model::load(fixture("tiny-llama-reward"), &from_ckpt(ModelKind::Value)).unwrap(),
        ),
        (
            "reward",
            Model::load(
                fixture("tiny-llama-reward"),
                &LoadOptions::inference().with_kind(ModelKind::Reward),
            )
            .unwrap(),
        ),
    ];
    models
        .into_iter()
        .map(|(name, m)| {
            let dir = root.join(name);
            m.save(&dir, None).unwrap();
            (name, dir, m)
        })
        .collect()
}

fn file_hashes(dir: &Path) -> BTreeMap<String, String> {
    ["config.json", "model.safetensors"]
        .into_iter()
        .map(|f| (f.to_string(), fnv64(&std::fs::read(dir.join(f)).unwrap())))
        .collect()
}

/// Our output for a saved model, `[B, T]` per position (or `[B]` scores for the reward),
/// flattened over the valid positions, in the same order as transformers' output is read.
fn ours(name: &str, m: &Model, b: &Batch) -> Vec<f32> {
    let mask = b.attention_mask.to_vec2::<u32>().unwrap();
    match name {
        "causal" | "causal_qwen3" => {
            let l = to_vec3(&m.logits(b).unwrap());
            valid3(&l, &mask)
        }
        "reward" => m.scores(b).unwrap().to_vec1::<f32>().unwrap(),
        _ => valid2(&to_vec2(&m.values(b).unwrap()), &mask),
    }
}

fn valid3(x: &[Vec<Vec<f32>>], mask: &[Vec<u32>]) -> Vec<f32> {
    let mut out = Vec::new();
    for (i, row) in x.iter().enumerate() {
        for (t, v) in row.iter().enumerate() {
            if mask[i][t] == 1 {
                out.extend_from_slice(v);
            }
        }
    }
    out
}

fn valid2(x: &[Vec<f32>], mask: &[Vec<u32>]) -> Vec<f32> {
    let mut out = Vec::new();
    for (i, row) in x.iter().enumerate() {
        for (t, &v) in row.iter().enumerate() {
            if mask[i][t] == 1 {
                out.push(v);
            }
        }
    }
    out
}

/// transformers' output in the same layout as [`ours`].
fn theirs(name: &str, out: &Value, mask: &[Vec<u32>]) -> Vec<f32> {
    let f = |v: &Value| v.as_f64().unwrap() as f32;
    match name {
        "causal" | "causal_qwen3" => {
            let l: Vec<Vec<Vec<f32>>> = out
                .as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    r.as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t.as_array().unwrap().iter().map(f).collect())
                        .collect()
                })
                .collect();
            valid3(&l, mask)
        }
        // Sequence classification picks the last non-pad token; with left padding that is
        // the last position.
        "reward" => out
            .as_array()
            .unwrap()
            .iter()
            .map(|r| f(&r.as_array().unwrap()[0]))
            .collect(),
        _ => {
            let l: Vec<Vec<f32>> = out
                .as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    r.as_array()
                        .unwrap()
                        .iter()
                        .map(|t| f(&t.as_array().unwrap()[0]))
                        .collect()
                })
                .collect();
            valid2(&l, mask)
        }
    }
}

#[test]
fn transformers_output_matches_the_committed_reference() {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(reference_path()).unwrap()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let b = batch();
    let mask = b.attention_mask.to_vec2::<u32>().unwrap();
    let saved = save_dirs(tmp.path());
    assert_eq!(saved.len(), reference["models"].as_object().unwrap().len());
    for (name, dir, model) in &saved {
        let r = &reference["models"][*name];
        let hashes = serde_json::to_value(file_hashes(dir)).unwrap();
        assert_eq!(
            hashes, r["files"],
            "{name}: the saved files differ from the ones transformers loaded; if the save \
             format changed on purpose, rerun the ignored regenerate_with_transformers test \
             (see this file's header)"
        );
        let cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        let arch = cfg["architectures"][0].as_str().unwrap();
        assert_eq!(
            r["class"], arch,
            "{name}: transformers built {}",
            r["class"]
        );
        for k in ["missing_keys", "unexpected_keys", "mismatched_keys"] {
            assert_eq!(r[k], json!([]), "{name}: transformers reported {k}");
        }
        let (a, t) = (ours(name, model, &b), theirs(name, &r["output"], &mask));
        assert_eq!(a.len(), t.len(), "{name}");
        let d = a
            .iter()
            .zip(&t)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        println!("{name} ({arch}): max abs diff to transformers {d:e}");
        assert!(d <= 1e-4, "{name}: {d}");
    }
    // The layouts the roles rely on.
    let arch = |n: &str| {
        reference["models"][n]["class"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(arch("critic"), "LlamaForTokenClassification");
    assert_eq!(arch("critic_from_rm"), "LlamaForSequenceClassification");
    assert_eq!(arch("reward"), "LlamaForSequenceClassification");
}

#[test]
#[ignore = "needs RLHF_REF_PYTHON pointing at a Python with torch and transformers"]
fn regenerate_with_transformers() {
    let python = std::env::var("RLHF_REF_PYTHON").expect("set RLHF_REF_PYTHON");
    let tmp = tempfile::tempdir().unwrap();
    let b = batch();
    let saved = save_dirs(tmp.path());
    let dirs: BTreeMap<&str, String> = saved
        .iter()
        .map(|(n, d, _)| (*n, d.display().to_string()))
        .collect();
    let input = json!({
        "input_ids": b.input_ids.to_vec2::<u32>().unwrap(),
        "attention_mask": b.attention_mask.to_vec2::<u32>().unwrap(),
        "position_ids": b.position_ids.to_vec2::<u32>().unwrap(),
        "dirs": dirs,
    });
    let inp = tmp.path().join("in.json");
    let outp = tmp.path().join("out.json");
    std::fs::write(&inp, input.to_string()).unwrap();
    let st = std::process::Command::new(&python)
        .arg("-c")
        .arg(SCRIPT)
        .arg(&inp)
        .arg(&outp)
        .status()
        .unwrap();
    assert!(st.success(), "python failed");
    let mut out: Value = serde_json::from_str(&std::fs::read_to_string(&outp).unwrap()).unwrap();
    for (name, dir, _) in &saved {
        out["models"][*name]["files"] = serde_json::to_value(file_hashes(dir)).unwrap();
    }
    out["about"] = json!(
        "transformers loading directories saved by rlhf-model; made by the ignored \
         regenerate_with_transformers test in tests/transformers_load.rs"
    );
    std::fs::write(
        reference_path(),
        serde_json::to_string_pretty(&out).unwrap() + "\n",
    )
    .unwrap();
}

/// With the pad token as EOS, a trailing EOS is not where the reward is read: the score of
/// `x + [EOS]` is the score of `x` (the model is causal, so the hidden state at `x`'s last
/// token is the same), and a row made only of pads is still scored.
#[test]
fn a_trailing_eos_that_is_the_pad_token_is_not_read() {
    let m = Model::load(
        fixture("tiny-llama-reward"),
        &LoadOptions::inference().with_kind(ModelKind::Reward),
    )
    .unwrap();
    assert_eq!(m.config().pad_token_id, Some(0));
    let score = |seqs: Vec<Vec<u32>>| {
        m.scores(&Batch::left_padded(&seqs, 0, &Device::Cpu).unwrap())
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let plain = score(vec![vec![21, 22, 23], vec![5, 9, 12, 3, 40]]);
    let with_eos = score(vec![vec![21, 22, 23, 0], vec![5, 9, 12, 3, 40, 0]]);
    for (a, b) in plain.iter().zip(&with_eos) {
        assert!((a - b).abs() < 1e-6, "{plain:?} vs {with_eos:?}");
    }
    // Reading at the EOS itself would differ: the hidden state there has seen one more token.
    let at_eos = m
        .score_logits(&Batch::left_padded(&[vec![21, 22, 23, 0]], 0, &Device::Cpu).unwrap())
        .unwrap()
        .to_dtype(rlhf_model::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!((at_eos[3] - plain[0]).abs() > 1e-4, "{at_eos:?} {plain:?}");
    assert_eq!(score(vec![vec![0, 0]]).len(), 1);
}
