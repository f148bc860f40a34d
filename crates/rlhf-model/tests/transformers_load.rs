//! Saved directories load back in transformers with the same outputs.
//!
//! Needs a Python with torch + transformers (scripts/model_fixtures.sh creates `.venv-ref`), so
//! it is ignored by default:
//! `RLHF_REF_PYTHON=.venv-ref/bin/python cargo test -p rlhf-model --test transformers_load -- --ignored`

mod common;

use common::{fixture, tiny_batch, to_vec2, to_vec3};
use rlhf_model::{Device, LoadOptions, Model, ModelKind, ValueHeadInit};

const SCRIPT: &str = r#"
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoModelForSequenceClassification
d = json.load(open(sys.argv[1]))
ids = torch.tensor(d["input_ids"]); mask = torch.tensor(d["attention_mask"]); pos = torch.tensor(d["position_ids"])
out = {}
with torch.no_grad():
    m = AutoModelForCausalLM.from_pretrained(d["causal"], dtype=torch.float32)
    out["logits"] = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits.tolist()
    m = AutoModelForTokenClassification.from_pretrained(d["critic"], dtype=torch.float32)
    out["values"] = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits[..., 0].tolist()
    m = AutoModelForSequenceClassification.from_pretrained(d["reward"], dtype=torch.float32)
    out["scores"] = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits[..., 0].tolist()
json.dump(out, open(sys.argv[2], "w"))
"#;

#[test]
#[ignore = "needs RLHF_REF_PYTHON pointing at a Python with torch and transformers"]
fn transformers_loads_what_we_save() {
    let python = std::env::var("RLHF_REF_PYTHON").expect("set RLHF_REF_PYTHON");
    let tmp = tempfile::tempdir().unwrap();
    let b = tiny_batch(&Device::Cpu);

    let causal = Model::load(fixture("tiny-qwen2"), &LoadOptions::inference()).unwrap();
    causal
        .save(tmp.path().join("causal"), Some(&fixture("tiny-qwen2")))
        .unwrap();
    let critic = Model::load(
        fixture("tiny-llama"),
        &LoadOptions {
            value_head_init: ValueHeadInit::Fresh { std: 0.1 },
            ..LoadOptions::inference().with_kind(ModelKind::Value)
        },
    )
    .unwrap();
    critic.save(tmp.path().join("critic"), None).unwrap();
    let reward = Model::load(
        fixture("tiny-llama-reward"),
        &LoadOptions::inference().with_kind(ModelKind::Reward),
    )
    .unwrap();
    reward.save(tmp.path().join("reward"), None).unwrap();

    let input = serde_json::json!({
        "input_ids": b.input_ids.to_vec2::<u32>().unwrap(),
        "attention_mask": b.attention_mask.to_vec2::<u32>().unwrap(),
        "position_ids": b.position_ids.to_vec2::<u32>().unwrap(),
        "causal": tmp.path().join("causal"),
        "critic": tmp.path().join("critic"),
        "reward": tmp.path().join("reward"),
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
    let out: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&outp).unwrap()).unwrap();
    let mask = b.attention_mask.to_vec2::<u32>().unwrap();

    let ours = to_vec3(&causal.logits(&b).unwrap());
    let mut d = 0f32;
    for (i, row) in ours.iter().enumerate() {
        for (t, v) in row.iter().enumerate() {
            if mask[i][t] == 1 {
                for (k, x) in v.iter().enumerate() {
                    let y = out["logits"][i][t][k].as_f64().unwrap() as f32;
                    d = d.max((x - y).abs());
                }
            }
        }
    }
    println!("causal logits max abs diff {d:e}");
    assert!(d <= 1e-4);

    let ours = to_vec2(&critic.values(&b).unwrap());
    let mut d = 0f32;
    for (i, row) in ours.iter().enumerate() {
        for (t, x) in row.iter().enumerate() {
            if mask[i][t] == 1 {
                d = d.max((x - out["values"][i][t].as_f64().unwrap() as f32).abs());
            }
        }
    }
    println!("critic values max abs diff {d:e}");
    assert!(d <= 1e-4);

    let ours = reward.scores(&b).unwrap().to_vec1::<f32>().unwrap();
    for (i, x) in ours.iter().enumerate() {
        let y = out["scores"][i].as_f64().unwrap() as f32;
        println!("reward score {x} vs transformers {y}");
        assert!((x - y).abs() <= 1e-4);
    }
}
