//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

pub mod grad;
pub mod sharding;

use rlhf_model::{Batch, Config, Device, Family, Tensor};

/// The devices the model tests run on: the CPU, and the first GPU when this build has the
/// `cuda` feature and the machine a driver and a GPU.
pub fn devices() -> Vec<Device> {
    let mut out = vec![Device::Cpu];
    if let Ok(d) = Device::new_cuda(0) {
        out.push(d);
    }
    out
}

/// `tests/fixtures/NAME`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
        .join(name)
}

/// The reference numbers written by scripts/model_fixtures.py.
pub fn reference() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture("reference.json")).expect("reference.json");
    serde_json::from_str(&text).expect("reference.json parses")
}

/// A tiny GQA config: vocab 61, hidden 16, 2 layers, 4 query / 2 KV heads.
pub fn tiny_config(family: Family) -> Config {
    let cfg = Config::tiny_llama(61, 16, 24, 2, 4, 2, 64).unwrap();
    cfg.with_family(family).unwrap()
}

/// Three left-padded rows of different lengths.
pub fn tiny_batch(device: &Device) -> Batch {
    let seqs = vec![
        vec![5, 9, 12, 3, 40],
        vec![7, 8, 1, 33, 20, 11, 2, 60],
        vec![14, 15, 16],
    ];
    Batch::left_padded(&seqs, 0, device).unwrap()
}

pub fn to_vec3(t: &rlhf_model::Tensor) -> Vec<Vec<Vec<f32>>> {
    t.to_dtype(rlhf_model::DType::F32)
        .unwrap()
        .to_vec3::<f32>()
        .unwrap()
}

pub fn to_vec2(t: &rlhf_model::Tensor) -> Vec<Vec<f32>> {
    t.to_dtype(rlhf_model::DType::F32)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap()
}

pub fn json_u32_2d(v: &serde_json::Value) -> Vec<Vec<u32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

pub fn json_f32_2d(v: &serde_json::Value) -> Vec<Vec<f32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect()
}

/// max |a - b| over all elements, in f64 (any float dtype, same shape).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    let wide = |t: &Tensor| t.to_dtype(rlhf_model::DType::F64).unwrap();
    (wide(a) - wide(b))
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// A reference.json batch (input ids, attention mask, position ids) on the CPU, and its mask.
pub fn batch_from(r: &serde_json::Value) -> (Batch, Vec<Vec<u32>>) {
    let ids = json_u32_2d(&r["input_ids"]);
    let mask = json_u32_2d(&r["attention_mask"]);
    let pos = json_u32_2d(&r["position_ids"]);
    let (b, t) = (ids.len(), ids[0].len());
    let dev = Device::Cpu;
    let flat = |v: &Vec<Vec<u32>>| v.iter().flatten().copied().collect::<Vec<u32>>();
    let batch = Batch {
        input_ids: Tensor::from_vec(flat(&ids), (b, t), &dev).unwrap(),
        attention_mask: Tensor::from_vec(flat(&mask), (b, t), &dev).unwrap(),
        position_ids: Tensor::from_vec(flat(&pos), (b, t), &dev).unwrap(),
    };
    (batch, mask)
}
