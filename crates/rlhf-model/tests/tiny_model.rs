//! The committed demo policy `models/tiny` (made by `examples/make_tiny_model.rs`): complete,
//! small, loadable, its tokenizer round-trips the demo prompts with one token per digit, and
//! its samples are text that contains a digit only sometimes (the PPO demo's reward signal).

use std::path::{Path, PathBuf};

use rlhf_model::{generate, FinishReason, GenerationConfig, LoadOptions, Model, Tokenizer};

const FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tiny() -> PathBuf {
    repo().join("models/tiny")
}

fn prompts() -> Vec<String> {
    let text = std::fs::read_to_string(repo().join("data/prompts_tiny.jsonl")).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["prompt"].as_str().unwrap().to_string()
        })
        .collect()
}

#[test]
fn files_are_complete_and_small() {
    let mut total = 0;
    for f in FILES {
        let meta = std::fs::metadata(tiny().join(f))
            .unwrap_or_else(|e| panic!("models/tiny/{f}: {e}; rerun make_tiny_model"));
        assert!(meta.len() > 0, "{f} is empty");
        total += meta.len();
    }
    assert!(total < 1_500_000, "models/tiny holds {total} bytes");
    let model = Model::load(tiny(), &LoadOptions::inference()).unwrap();
    let tok = Tokenizer::from_dir(tiny()).unwrap();
    let cfg = model.config();
    assert_eq!(cfg.vocab_size, tok.vocab_size());
    assert!(cfg.max_position_embeddings >= 64);
    assert!((256..=512).contains(&tok.vocab_size()));
    let eos = tok.eos_token_id().expect("an EOS token");
    assert_eq!(tok.pad_token_id(), Some(eos));
    assert_eq!(cfg.eos_token_ids, vec![eos]);
    assert_eq!(model.generation_config().eos_token_ids, vec![eos]);
    assert_eq!(model.generation_config().max_new_tokens, 16);
}

#[test]
fn tokenizer_round_trips_prompts_with_one_token_per_digit() {
    let tok = Tokenizer::from_dir(tiny()).unwrap();
    let prompts = prompts();
    assert_eq!(prompts.len(), 64);
    for p in &prompts {
        let ids = tok.encode(p, true).unwrap();
        assert!(!ids.is_empty());
        assert_eq!(&tok.decode(&ids, true).unwrap(), p);
        let digits = p.bytes().filter(u8::is_ascii_digit).count();
        let digit_tokens = ids
            .iter()
            .filter(|&&i| {
                tok.decode(&[i], false)
                    .unwrap()
                    .bytes()
                    .any(|b| b.is_ascii_digit())
            })
            .count();
        assert_eq!(digit_tokens, digits, "{p:?} -> {ids:?}");
    }
    // No token of the vocabulary holds a digit next to anything else, so a digit in a response
    // is always one sampled token.
    for id in 0..tok.vocab_size() as u32 {
        let text = tok.decode(&[id], false).unwrap();
        if text.bytes().any(|b| b.is_ascii_digit()) {
            assert_eq!(text.len(), 1, "token {id} is {text:?}");
        }
    }
    let eos = tok.eos_token_id().unwrap();
    let mut ids = tok.encode("7+8=", false).unwrap();
    ids.push(eos);
    assert_eq!(tok.decode(&ids, true).unwrap(), "7+8=");
}

#[test]
fn samples_are_text_with_digits_only_sometimes() {
    let tok = Tokenizer::from_dir(tiny()).unwrap();
    let model = Model::load(tiny(), &LoadOptions::inference()).unwrap();
    let prompts: Vec<Vec<u32>> = prompts()
        .iter()
        .map(|p| tok.encode(p, true).unwrap())
        .collect();
    let eos = tok.eos_token_id().unwrap();
    let cfg = GenerationConfig {
        max_new_tokens: 16,
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        n: 4,
        seed: 7,
        eos_token_ids: vec![eos],
        pad_token_id: Some(eos),
        ..GenerationConfig::default()
    };
    let out = generate(&model, &prompts, &cfg).unwrap();
    assert_eq!(out.sequences.len(), 256);
    let (mut digit, mut wordy, mut stopped) = (0, 0, 0);
    for s in &out.sequences {
        assert!(!s.token_ids.is_empty() && s.token_ids.len() <= 16);
        if let FinishReason::Stop(t) = s.finish_reason {
            assert_eq!(t, eos);
            stopped += 1;
        }
        let text = tok.decode(&s.token_ids, true).unwrap();
        digit += usize::from(text.bytes().any(|b| b.is_ascii_digit()));
        let letters = text.chars().filter(char::is_ascii_alphabetic).count();
        wordy += usize::from(letters >= 3 && !text.contains('\u{fffd}'));
    }
    let rate = digit as f64 / 256.0;
    // make_tiny_model measured 0.20 on the committed weights; the band leaves room for other
    // CPU kernels changing which tokens are sampled.
    assert!(
        (0.08..=0.45).contains(&rate),
        "contains_digit rate {rate}: the demo needs some signal and room to climb"
    );
    assert!(wordy >= 128, "only {wordy}/256 samples look like words");
    assert!(stopped >= 128, "only {stopped}/256 samples ended with EOS");
}

#[test]
fn critic_and_reference_load_from_the_same_directory() {
    // ppo_tiny builds the reference and the critic (fresh value head) from models/tiny too.
    let tok = Tokenizer::from_dir(tiny()).unwrap();
    let ids = tok.encode("2+3= five", true).unwrap();
    let batch =
        rlhf_model::Batch::left_padded(std::slice::from_ref(&ids), 0, &rlhf_model::Device::Cpu)
            .unwrap();
    let critic = Model::load(tiny(), &LoadOptions::training(rlhf_model::ModelKind::Value)).unwrap();
    assert_eq!(critic.values(&batch).unwrap().dims(), &[1, ids.len()]);
    let reference = Model::load(tiny(), &LoadOptions::inference()).unwrap();
    let lp = reference.token_log_probs(&batch, 1.0).unwrap();
    let lp: Vec<f32> = lp.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(lp.len(), ids.len() - 1);
    assert!(lp.iter().all(|x| x.is_finite() && *x <= 0.0), "{lp:?}");
}
