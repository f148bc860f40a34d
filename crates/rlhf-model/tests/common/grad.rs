//! The loss and the finite-difference check the gradient tests share.

use rlhf_model::{Batch, DType, Gradients, Model, ModelKind, Tensor};

/// Fixed pseudo-random weights so that the loss depends on every output.
pub fn weights(
    shape: (usize, usize),
    dtype: DType,
    seed: u64,
    device: &rlhf_model::Device,
) -> Tensor {
    let n = shape.0 * shape.1;
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let data: Vec<f64> = (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 11) as f64 / (1u64 << 53) as f64) - 0.5
        })
        .collect();
    Tensor::from_vec(data, shape, device)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// A scalar loss that exercises the model's head: log-probs (temperature 0.7) plus entropy for
/// a causal LM, weighted values for a critic, weighted scores for a reward model; padding is
/// masked out.
pub fn loss(model: &Model, batch: &Batch) -> Tensor {
    let dtype = if model.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let (b, t) = batch.input_ids.dims2().unwrap();
    let mask = batch.attention_mask.to_dtype(dtype).unwrap();
    match model.kind() {
        ModelKind::CausalLm => {
            let (lp, ent) = model.log_probs_and_entropy(batch, 0.7, true).unwrap();
            // Positions whose input and target are both real tokens: a pad position's output
            // comes from a fully masked attention row and is meaningless.
            let m =
                (mask.narrow(1, 1, t - 1).unwrap() * mask.narrow(1, 0, t - 1).unwrap()).unwrap();
            let w = weights((b, t - 1), dtype, 1, model.device());
            let a = (lp.to_dtype(dtype).unwrap() * &m).unwrap() * &w;
            let e = (ent.unwrap().to_dtype(dtype).unwrap() * &m).unwrap() * 0.3;
            (a.unwrap().sum_all().unwrap() + e.unwrap().sum_all().unwrap()).unwrap()
        }
        ModelKind::Value => {
            let v = model.values(batch).unwrap().to_dtype(dtype).unwrap();
            let w = weights((b, t), dtype, 2, model.device());
            ((v * &mask).unwrap() * w).unwrap().sum_all().unwrap()
        }
        ModelKind::Reward => {
            let s = model.scores(batch).unwrap().to_dtype(dtype).unwrap();
            let w = weights((1, b), dtype, 3, model.device())
                .squeeze(0)
                .unwrap();
            (s * w).unwrap().sum_all().unwrap()
        }
    }
}

pub fn set_elem(t: &Tensor, idx: usize, value: f64) -> Tensor {
    let shape = t.shape().clone();
    let mut v = t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    v[idx] = value;
    Tensor::from_vec(v, shape, t.device()).unwrap()
}

/// Central differences against autograd for a few elements of each parameter in `names`.
pub fn finite_difference_check(model: &Model, batch: &Batch, names: &[&str]) -> f64 {
    let vars = model.vars();
    let grads = Gradients::backward(&loss(model, batch), &vars).unwrap();
    // f64 round-off in the loss is ~1e-14; 1e-5 keeps both it and the O(eps^2) error small.
    let eps = 1e-5;
    let mut worst = 0f64;
    for name in names {
        let (_, var) = vars
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no parameter {name}"));
        let g = grads
            .get(name)
            .unwrap_or_else(|| panic!("no gradient for {name}"))
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let orig = var.as_tensor().detach().copy().unwrap();
        let n = g.len();
        // Embedding rows of tokens in the batch (5, 7) and spread-out elements elsewhere.
        let hidden = model.config().hidden_size;
        let picks: Vec<usize> = if name.contains("embed_tokens") {
            vec![5 * hidden + 3, 7 * hidden + 11]
        } else {
            vec![0, n / 2, n - 1]
        };
        for idx in picks {
            let x0 = orig.flatten_all().unwrap().to_vec1::<f64>().unwrap()[idx];
            var.set(&set_elem(&orig, idx, x0 + eps)).unwrap();
            let lp = loss(model, batch).to_scalar::<f64>().unwrap();
            var.set(&set_elem(&orig, idx, x0 - eps)).unwrap();
            let lm = loss(model, batch).to_scalar::<f64>().unwrap();
            var.set(&orig).unwrap();
            let numeric = (lp - lm) / (2.0 * eps);
            let err = (numeric - g[idx]).abs() / (numeric.abs() + g[idx].abs()).max(1e-4);
            assert!(
                err < 1e-4,
                "{name}[{idx}]: autograd {} vs finite difference {numeric} (rel err {err:e})",
                g[idx]
            );
            worst = worst.max(err);
        }
    }
    worst
}

pub const BODY: &[&str] = &[
    "model.embed_tokens.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.self_attn.q_proj.weight",
    "model.norm.weight",
];
