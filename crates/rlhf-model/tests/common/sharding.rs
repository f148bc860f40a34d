//! What the ZeRO-3 tests share: what the ranks load (random weights or a committed
//! checkpoint), a TCP group of ranks on threads, a batch whose rows the ranks split, the loss
//! each rank computes as its share of the whole batch's, the AdamW they step, and the
//! comparison of the weights they end with.

use std::collections::BTreeMap;
use std::path::PathBuf;

use rlhf_collective::{CommConfig, TcpCommunicator};
use rlhf_model::{
    AdamW, AdamWConfig, Batch, Config, DType, Device, Gradients, LoadOptions, Model, ModelKind,
    Tensor,
};

/// What every rank (and the unsharded model) loads: random weights for a config (seeded by
/// the options), or a checkpoint directory such as tests/fixtures/tiny-qwen3.
#[derive(Clone)]
pub enum Source {
    Random(Box<Config>),
    Dir(PathBuf),
}

impl Source {
    pub fn model(&self, o: &LoadOptions) -> Model {
        match self {
            Source::Random(cfg) => Model::random(cfg, o),
            Source::Dir(dir) => Model::load(dir, o),
        }
        .unwrap()
    }
}

impl From<Config> for Source {
    fn from(cfg: Config) -> Self {
        Source::Random(Box::new(cfg))
    }
}

/// `n` connected TCP communicators, rank order.
pub fn group(n: usize) -> Vec<TcpCommunicator> {
    TcpCommunicator::loopback_group(n, CommConfig::default()).unwrap()
}

/// Four rows of different lengths; rank `r` of `world` trains on rows `r, r + world, ...`.
pub fn rows() -> Vec<Vec<u32>> {
    vec![
        vec![5, 9, 12, 3, 40, 17],
        vec![7, 8, 1, 33, 20, 11, 2, 60],
        vec![14, 15, 16],
        vec![21, 22, 23, 24, 25],
    ]
}

pub fn mine(rank: usize, world: usize) -> Vec<Vec<u32>> {
    rows().into_iter().skip(rank).step_by(world).collect()
}

/// The loss of `seqs` as a share of the whole batch's: the sum over their rows, divided by
/// the batch's row count, so the ranks' losses add up to the one-rank loss.
pub fn loss(model: &Model, seqs: &[Vec<u32>]) -> Tensor {
    let batch = Batch::left_padded(seqs, 0, model.device()).unwrap();
    let n = rows().len() as f64;
    let am = batch.attention_mask.to_dtype(DType::F32).unwrap();
    let t = am.dim(1).unwrap();
    match model.kind() {
        ModelKind::CausalLm => {
            // Entry t predicts token t + 1: scored where both are real tokens.
            let m = (am.narrow(1, 0, t - 1).unwrap() * am.narrow(1, 1, t - 1).unwrap()).unwrap();
            let (lp, ent) = model.log_probs_and_entropy(&batch, 0.9, true).unwrap();
            let per = (lp + (ent.unwrap() * 0.1).unwrap()).unwrap();
            ((per * m).unwrap().sum_all().unwrap() / n).unwrap()
        }
        _ => {
            let v = model.values(&batch).unwrap();
            let d = (v - 0.5).unwrap().sqr().unwrap();
            ((d * am).unwrap().sum_all().unwrap() / n).unwrap()
        }
    }
}

pub fn adamw() -> AdamWConfig {
    AdamWConfig {
        lr: 0.01,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    }
}

pub const STEPS: usize = 3;
/// The gradient is clipped to this norm: the tiny models' first gradients are above it.
pub const CLIP: f64 = 0.5;

pub type Weights = BTreeMap<String, Vec<f32>>;

pub fn host(named: Vec<(String, Tensor)>) -> Weights {
    named
        .into_iter()
        .map(|(n, t)| {
            let t = t.to_device(&Device::Cpu).unwrap().flatten_all().unwrap();
            (n, t.to_vec1::<f32>().unwrap())
        })
        .collect()
}

pub fn max_diff(a: &Weights, b: &Weights) -> (f64, String) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "the same parameters"
    );
    let mut worst = (0.0, String::new());
    for (name, x) in a {
        for (p, q) in x.iter().zip(&b[name]) {
            let d = f64::from((p - q).abs());
            if d > worst.0 {
                worst = (d, name.clone());
            }
        }
    }
    worst
}

/// [`STEPS`] clipped AdamW steps of one unsharded `model` on the whole batch: the gradient
/// norm of each.
pub fn train_whole(model: &Model) -> Vec<f64> {
    let vars = model.vars();
    let mut opt = AdamW::new(vars.clone(), adamw()).unwrap();
    let mut norms = Vec::new();
    for _ in 0..STEPS {
        let mut g = Gradients::backward(&loss(model, &rows()), &vars).unwrap();
        norms.push(g.clip_global_norm(CLIP).unwrap());
        opt.step(&g).unwrap();
    }
    norms
}
