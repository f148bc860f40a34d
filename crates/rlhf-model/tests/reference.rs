//! Numbers from transformers (tests/fixtures/reference.json, written by
//! scripts/model_fixtures.py) reproduced by rlhf-model.

mod common;

use common::{batch_from, fixture, json_f32_2d, json_u32_2d, reference, to_vec2, to_vec3};
use rlhf_model::{
    generate, Batch, ChatMessage, Device, GenerationConfig, Kernels, LoadOptions, Model, ModelKind,
    Tokenizer,
};

const CAUSAL: &[&str] = &["tiny-llama", "tiny-llama3-rope", "tiny-qwen2", "tiny-qwen3"];

/// Max |a - b| over positions where `keep(b, t)`.
fn max_diff_2d(a: &[Vec<f32>], b: &[Vec<f32>], keep: impl Fn(usize, usize) -> bool) -> f32 {
    let mut m = 0f32;
    for (i, (ra, rb)) in a.iter().zip(b).enumerate() {
        assert_eq!(ra.len(), rb.len());
        for (t, (x, y)) in ra.iter().zip(rb).enumerate() {
            if keep(i, t) {
                m = m.max((x - y).abs());
            }
        }
    }
    m
}

/// Load options that give a causal LM computing with `kernels`.
fn causal_options(kernels: Kernels) -> LoadOptions {
    match kernels {
        Kernels::Inference => LoadOptions::inference(),
        Kernels::FusedTraining => LoadOptions::training(ModelKind::CausalLm),
        Kernels::Composite => LoadOptions {
            composite_ops: true,
            ..LoadOptions::training(ModelKind::CausalLm)
        },
    }
}

fn check_causal(name: &str, kernels: Kernels) {
    let reference = reference();
    let r = &reference["models"][name];
    let model = Model::load(fixture(name), &causal_options(kernels)).unwrap();
    assert_eq!(model.kernels(), kernels);
    let fast = format!("{kernels:?}");
    let (batch, mask) = batch_from(r);
    let logits = to_vec3(&model.logits(&batch).unwrap());
    let expected: Vec<Vec<Vec<f32>>> = r["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(json_f32_2d)
        .collect();
    let mut max_diff = 0f32;
    for b in 0..logits.len() {
        for t in 0..logits[b].len() {
            if mask[b][t] == 1 {
                for (x, y) in logits[b][t].iter().zip(&expected[b][t]) {
                    max_diff = max_diff.max((x - y).abs());
                }
            }
        }
    }
    println!("{name} {fast}: logits max abs diff {max_diff:e}");
    assert!(max_diff <= 1e-4, "{name}: logits differ by {max_diff}");

    let keep = |b: usize, t: usize| mask[b][t] == 1;
    let (lp, ent) = model.log_probs_and_entropy(&batch, 1.0, true).unwrap();
    let d = max_diff_2d(&to_vec2(&lp), &json_f32_2d(&r["next_token_logprobs"]), keep);
    println!("{name} {fast}: log-probs max abs diff {d:e}");
    assert!(d <= 1e-4, "{name}: log-probs differ by {d}");
    // Reference entropies cover all T positions; ours the T-1 that predict a next token.
    let ref_ent: Vec<Vec<f32>> = json_f32_2d(&r["entropy"]);
    let full =
        to_vec2(&rlhf_model::entropy_from_logits(&model.logits(&batch).unwrap(), 1.0).unwrap());
    let d = max_diff_2d(&full, &ref_ent, keep);
    assert!(d <= 1e-4, "{name}: entropy (all positions) differs by {d}");
    let ref_head: Vec<Vec<f32>> = ref_ent.iter().map(|r| r[..r.len() - 1].to_vec()).collect();
    let d = max_diff_2d(&to_vec2(&ent.unwrap()), &ref_head, keep);
    println!("{name} {fast}: entropy max abs diff {d:e}");
    assert!(d <= 1e-4, "{name}: entropy differs by {d}");
    let lp07 = model.token_log_probs(&batch, 0.7).unwrap();
    let d = max_diff_2d(
        &to_vec2(&lp07),
        &json_f32_2d(&r["next_token_logprobs_temp_0_7"]),
        keep,
    );
    println!("{name} {fast}: log-probs@0.7 max abs diff {d:e}");
    assert!(
        d <= 1e-4,
        "{name}: log-probs at temperature 0.7 differ by {d}"
    );
}

fn check_greedy(name: &str) {
    let reference = reference();
    let r = &reference["models"][name];
    let model = Model::load(fixture(name), &LoadOptions::inference()).unwrap();
    let prompts = json_u32_2d(&r["prompt_token_ids"]);
    let new = r["greedy_new_tokens"].as_u64().unwrap() as usize;
    let eos: Vec<u32> = r["greedy_eos_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();

    // Defaults from generation_config.json: greedy, its eos ids, its pad id.
    let mut cfg = model.generation_config().clone();
    assert_eq!(
        cfg.temperature, 0.0,
        "{name}: generation_config.json has no do_sample"
    );
    assert_eq!(
        cfg.eos_token_ids, eos,
        "{name}: eos ids from generation_config.json"
    );
    cfg.max_new_tokens = new;
    let out = generate(&model, &prompts, &cfg).unwrap();
    let (ids, _, _) = out.response_tensors(&Device::Cpu).unwrap();
    let ids = ids.to_vec2::<u32>().unwrap();
    assert_eq!(
        ids,
        json_u32_2d(&r["greedy_hf_generate"]),
        "{name}: greedy with stop"
    );

    cfg.eos_token_ids.clear();
    let out = generate(&model, &prompts, &cfg).unwrap();
    let ids: Vec<Vec<u32>> = out.sequences.iter().map(|s| s.token_ids.clone()).collect();
    assert_eq!(
        ids,
        json_u32_2d(&r["greedy_no_stop"]),
        "{name}: greedy without stop"
    );

    // Reported log-probs equal a teacher-forced recomputation over prompt + response.
    for s in &out.sequences {
        let full: Vec<u32> = s.prompt_ids.iter().chain(&s.token_ids).copied().collect();
        let b = Batch::left_padded(&[full], 0, &Device::Cpu).unwrap();
        let lp = to_vec2(&model.token_log_probs(&b, 1.0).unwrap()).remove(0);
        let tail = &lp[s.prompt_ids.len() - 1..];
        for (a, e) in s.logprobs.iter().zip(tail) {
            assert!(
                (a - e).abs() < 1e-4,
                "{name}: generation log-prob {a} vs {e}"
            );
        }
    }
}

#[test]
fn causal_models_match_transformers_inference_kernels() {
    for name in CAUSAL {
        check_causal(name, Kernels::Inference);
    }
}

#[test]
fn causal_models_match_transformers_fused_training_kernels() {
    for name in CAUSAL {
        check_causal(name, Kernels::FusedTraining);
    }
}

#[test]
fn causal_models_match_transformers_composite_ops() {
    for name in CAUSAL {
        check_causal(name, Kernels::Composite);
    }
}

#[test]
fn greedy_generation_matches_transformers() {
    for name in CAUSAL {
        check_greedy(name);
    }
}

#[test]
fn rope_config_forms_and_sharding_are_read() {
    let reference = reference();
    let legacy = Model::load(fixture("tiny-llama3-rope"), &LoadOptions::inference()).unwrap();
    assert_eq!(
        reference["models"]["tiny-llama3-rope"]["rope_config_form"],
        "legacy"
    );
    assert!(matches!(
        legacy.config().rope_scaling,
        rlhf_model::RopeScaling::Llama3 { factor, .. } if factor == 8.0
    ));
    assert!(legacy.config().tie_word_embeddings);
    let newer = Model::load(fixture("tiny-llama"), &LoadOptions::inference()).unwrap();
    assert_eq!(
        reference["models"]["tiny-llama"]["rope_config_form"],
        "rope_parameters"
    );
    assert_eq!(newer.config().rope_theta, 10000.0);
    let qwen = Model::load(fixture("tiny-qwen2"), &LoadOptions::inference()).unwrap();
    assert_eq!(qwen.config().rope_theta, 1_000_000.0);
    assert!(qwen.config().qkv_bias);
}

#[test]
fn reward_scores_match_transformers() {
    let reference = reference();
    let r = &reference["reward"];
    for (trainable, composite_ops) in [(false, false), (true, false), (true, true)] {
        let mut opts = LoadOptions::inference().with_kind(ModelKind::Reward);
        opts.trainable = trainable;
        opts.composite_ops = composite_ops;
        let model = Model::load(fixture("tiny-llama-reward"), &opts).unwrap();
        for padding in ["left_padded", "right_padded"] {
            let (batch, _) = batch_from(&r[padding]);
            let got = model.scores(&batch).unwrap().to_vec1::<f32>().unwrap();
            let want: Vec<f32> = r[padding]["scores"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect();
            let d = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            println!("reward {padding} {:?}: max abs diff {d:e}", model.kernels());
            assert!(d <= 1e-4, "{padding}: scores {got:?} vs {want:?}");
        }
    }
}

#[test]
fn critic_initialised_from_reward_model_matches_its_scores() {
    let reference = reference();
    let r = &reference["reward"]["left_padded"];
    let opts = LoadOptions::training(ModelKind::Value);
    let opts = rlhf_model::LoadOptions {
        value_head_init: rlhf_model::ValueHeadInit::FromCheckpoint,
        ..opts
    };
    let critic = Model::load(fixture("tiny-llama-reward"), &opts).unwrap();
    let (batch, _) = batch_from(r);
    let values = to_vec2(&critic.values(&batch).unwrap());
    let want = r["scores"].as_array().unwrap();
    for (row, w) in values.iter().zip(want) {
        // Left-padded: the last position is the last token.
        let last = *row.last().unwrap();
        assert!((last - w.as_f64().unwrap() as f32).abs() <= 1e-4);
    }
}

#[test]
fn tokenizer_encodings_match() {
    let reference = reference();
    let r = &reference["tokenizer"];
    let tok = Tokenizer::from_dir(fixture("tokenizer")).unwrap();
    assert_eq!(tok.vocab_size(), r["vocab_size"].as_u64().unwrap() as usize);
    assert_eq!(tok.eos_token(), r["eos_token"].as_str());
    assert_eq!(tok.eos_token_id(), Some(0));
    for case in r["encode_without_special_tokens"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids = tok.encode(text, false).unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids, want, "encoding of {text:?}");
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            case["decoded"].as_str().unwrap()
        );
    }
}

#[test]
fn chat_templates_match() {
    let reference = reference();
    // Template inline in tokenizer_config.json and in chat_template.jinja.
    for dir in ["tokenizer", "tiny-llama"] {
        let tok = Tokenizer::from_dir(fixture(dir)).unwrap();
        for case in reference["tokenizer"]["chat_template"].as_array().unwrap() {
            let messages: Vec<ChatMessage> =
                serde_json::from_value(case["messages"].clone()).unwrap();
            let agp = case["add_generation_prompt"].as_bool().unwrap();
            let text = tok.apply_chat_template(&messages, agp).unwrap();
            assert_eq!(
                text,
                case["text"].as_str().unwrap(),
                "{dir}: {}",
                case["name"]
            );
            let ids = tok.encode_chat(&messages, agp).unwrap();
            let want: Vec<u32> = case["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(ids, want, "{dir}: {}", case["name"]);
        }
    }
}

#[test]
fn generation_config_defaults_are_read() {
    let m = Model::load(fixture("tiny-qwen2"), &LoadOptions::inference()).unwrap();
    let g: &GenerationConfig = m.generation_config();
    assert_eq!(g.eos_token_ids, vec![0, 2]);
    assert_eq!(g.pad_token_id, Some(0));
}

/// Packed rows (segment ids in the attention mask, `data.packing`): every sequence of the row
/// gets the logits it gets alone, on every kernel path, and its positions restart at 0.
#[test]
fn packed_rows_give_each_sequence_its_own_logits() {
    let seqs: [&[u32]; 3] = [&[5, 9, 12, 3, 40], &[7, 8, 1, 33], &[14, 15]];
    let mut ids: Vec<u32> = seqs.concat();
    let mut mask: Vec<u32> = seqs
        .iter()
        .enumerate()
        .flat_map(|(k, s)| std::iter::repeat_n(k as u32 + 1, s.len()))
        .collect();
    ids.extend([0, 0]);
    mask.extend([0, 0]);
    let n = ids.len();
    let dev = Device::Cpu;
    let row = Batch::from_mask(
        rlhf_model::Tensor::from_vec(ids, (1, n), &dev).unwrap(),
        rlhf_model::Tensor::from_vec(mask, (1, n), &dev).unwrap(),
    )
    .unwrap();
    assert_eq!(
        row.position_ids.to_vec2::<u32>().unwrap()[0],
        vec![0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 1, 1]
    );
    for kernels in [
        Kernels::Inference,
        Kernels::FusedTraining,
        Kernels::Composite,
    ] {
        let model = Model::load(fixture("tiny-qwen2"), &causal_options(kernels)).unwrap();
        let packed = to_vec3(&model.logits(&row).unwrap()).remove(0);
        let mut off = 0;
        for s in seqs {
            let alone = Batch::left_padded(&[s.to_vec()], 0, &dev).unwrap();
            let alone = to_vec3(&model.logits(&alone).unwrap()).remove(0);
            let d = max_diff_2d(&alone, &packed[off..off + s.len()], |_, _| true);
            assert!(d < 1e-4, "{kernels:?}: sequence at {off} differs by {d}");
            off += s.len();
        }
    }
}
