//! Batched generation: seeds, samples per prompt, stop tokens, min/max lengths, left padding.

mod common;

use common::{fixture, tiny_config, to_vec2};
use rlhf_model::{
    generate, Batch, Device, Family, FinishReason, GenerationConfig, LoadOptions, Model,
};

fn model() -> Model {
    Model::load(fixture("tiny-llama"), &LoadOptions::inference()).unwrap()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![288, 296, 81, 90],
        vec![42, 298, 78, 81, 284, 290, 78, 70, 3],
        vec![7],
    ]
}

fn sampling(seed: u64) -> GenerationConfig {
    GenerationConfig {
        max_new_tokens: 10,
        temperature: 1.0,
        seed,
        pad_token_id: Some(0),
        ..GenerationConfig::default()
    }
}

#[test]
fn sampling_is_reproducible_from_the_seed() {
    let m = model();
    let a = generate(&m, &prompts(), &sampling(11)).unwrap();
    let b = generate(&m, &prompts(), &sampling(11)).unwrap();
    let c = generate(&m, &prompts(), &sampling(12)).unwrap();
    assert_eq!(a, b);
    assert_ne!(
        a.sequences.iter().map(|s| &s.token_ids).collect::<Vec<_>>(),
        c.sequences.iter().map(|s| &s.token_ids).collect::<Vec<_>>()
    );
}

#[test]
fn n_samples_per_prompt_are_prompt_major_and_distinct() {
    let m = model();
    let cfg = GenerationConfig {
        n: 3,
        ..sampling(5)
    };
    let out = generate(&m, &prompts(), &cfg).unwrap();
    assert_eq!(out.sequences.len(), 9);
    for (k, s) in out.sequences.iter().enumerate() {
        assert_eq!(s.prompt_index, k / 3);
        assert_eq!(s.sample_index, k % 3);
        assert_eq!(s.prompt_ids, prompts()[k / 3]);
        assert_eq!(s.token_ids.len(), s.logprobs.len());
    }
    let first: Vec<_> = out.sequences[..3].iter().map(|s| &s.token_ids).collect();
    assert!(
        first[0] != first[1] || first[1] != first[2],
        "samples identical"
    );
}

#[test]
fn sampled_log_probs_are_at_the_sampling_temperature() {
    let m = model();
    let cfg = GenerationConfig {
        temperature: 0.7,
        top_k: 20,
        top_p: 0.9,
        ..sampling(3)
    };
    let out = generate(&m, &prompts(), &cfg).unwrap();
    for s in &out.sequences {
        let full: Vec<u32> = s.prompt_ids.iter().chain(&s.token_ids).copied().collect();
        let b = Batch::left_padded(&[full], 0, &Device::Cpu).unwrap();
        let lp = to_vec2(&m.token_log_probs(&b, 0.7).unwrap()).remove(0);
        for (a, e) in s.logprobs.iter().zip(&lp[s.prompt_ids.len() - 1..]) {
            assert!((a - e).abs() < 1e-4, "{a} vs {e}");
        }
    }
}

#[test]
fn top_k_one_equals_greedy() {
    let m = model();
    let greedy = generate(&m, &prompts(), &GenerationConfig::greedy(8)).unwrap();
    let topk = generate(
        &m,
        &prompts(),
        &GenerationConfig {
            top_k: 1,
            max_new_tokens: 8,
            ..sampling(9)
        },
    )
    .unwrap();
    for (g, t) in greedy.sequences.iter().zip(&topk.sequences) {
        assert_eq!(g.token_ids, t.token_ids);
    }
}

#[test]
fn stop_token_truncates_and_pads_the_rest() {
    let m = model();
    let p = vec![prompts()[0].clone()];
    let free = generate(&m, &p, &GenerationConfig::greedy(8)).unwrap();
    let toks = &free.sequences[0].token_ids;
    // First position whose token did not occur before it.
    let k = (1..toks.len())
        .find(|&i| !toks[..i].contains(&toks[i]))
        .expect("a fresh token in the greedy continuation");
    let stop = toks[k];
    let cfg = GenerationConfig {
        stop_token_ids: vec![stop],
        pad_token_id: Some(0),
        ..GenerationConfig::greedy(8)
    };
    let out = generate(&m, &p, &cfg).unwrap();
    let s = &out.sequences[0];
    assert_eq!(s.token_ids, toks[..=k].to_vec());
    assert_eq!(s.finish_reason, FinishReason::Stop(stop));
    let (ids, mask, lps) = out.response_tensors(&Device::Cpu).unwrap();
    let ids = ids.to_vec2::<u32>().unwrap().remove(0);
    let mask = mask.to_vec2::<u32>().unwrap().remove(0);
    let lps = lps.to_vec2::<f32>().unwrap().remove(0);
    assert_eq!(ids.len(), 8);
    for j in 0..8 {
        if j <= k {
            assert_eq!((ids[j], mask[j]), (toks[j], 1));
        } else {
            assert_eq!((ids[j], mask[j], lps[j]), (0, 0, 0.0));
        }
    }

    // min_new_tokens suppresses the stop token until enough tokens exist.
    let cfg = GenerationConfig {
        stop_token_ids: vec![toks[0]],
        min_new_tokens: 3,
        ..cfg
    };
    let out = generate(&m, &p, &cfg).unwrap();
    let s = &out.sequences[0];
    assert!(s.token_ids.len() >= 3);
    assert!(!s.token_ids[..2].contains(&toks[0]));
}

#[test]
fn max_new_tokens_without_stop_reports_length() {
    let m = model();
    let cfg = GenerationConfig {
        min_new_tokens: 6,
        eos_token_ids: vec![0],
        ..GenerationConfig::greedy(6)
    };
    let out = generate(&m, &prompts(), &cfg).unwrap();
    for s in &out.sequences {
        assert_eq!(s.token_ids.len(), 6);
        assert_eq!(s.finish_reason, FinishReason::Length);
    }
}

#[test]
fn left_padding_does_not_change_a_prompts_continuation() {
    let m = model();
    let all = prompts();
    let batched = generate(&m, &all, &GenerationConfig::greedy(8)).unwrap();
    for (i, p) in all.iter().enumerate() {
        let alone = generate(&m, std::slice::from_ref(p), &GenerationConfig::greedy(8)).unwrap();
        assert_eq!(alone.sequences[0].token_ids, batched.sequences[i].token_ids);
        for (a, b) in alone.sequences[0]
            .logprobs
            .iter()
            .zip(&batched.sequences[i].logprobs)
        {
            assert!((a - b).abs() < 1e-4);
        }
    }
}

#[test]
fn generation_works_on_random_qwen2_and_in_bf16() {
    let cfg = tiny_config(Family::Qwen2);
    for dtype in [rlhf_model::DType::F32, rlhf_model::DType::BF16] {
        let m = Model::random(&cfg, &LoadOptions::inference().with_dtype(dtype)).unwrap();
        let out = generate(&m, &[vec![1, 2, 3]], &GenerationConfig::greedy(5)).unwrap();
        assert_eq!(out.sequences[0].token_ids.len(), 5);
        assert!(out.sequences[0]
            .logprobs
            .iter()
            .all(|l| l.is_finite() && *l <= 0.0));
    }
}

#[test]
fn samples_share_the_prefill_correctly() {
    let m = model();
    let one = generate(&m, &prompts(), &GenerationConfig::greedy(6)).unwrap();
    let three = generate(
        &m,
        &prompts(),
        &GenerationConfig {
            n: 3,
            ..GenerationConfig::greedy(6)
        },
    )
    .unwrap();
    for (k, s) in three.sequences.iter().enumerate() {
        let base = &one.sequences[k / 3];
        assert_eq!(s.token_ids, base.token_ids, "row {k}");
        for (a, b) in s.logprobs.iter().zip(&base.logprobs) {
            assert!((a - b).abs() < 1e-5);
        }
    }
    // Sampled rows teacher-force to the same log-probs as reported.
    let cfg = GenerationConfig {
        n: 4,
        ..sampling(21)
    };
    let out = generate(&m, &prompts(), &cfg).unwrap();
    for s in &out.sequences {
        let full: Vec<u32> = s.prompt_ids.iter().chain(&s.token_ids).copied().collect();
        let b = Batch::left_padded(&[full], 0, &Device::Cpu).unwrap();
        let lp = to_vec2(&m.token_log_probs(&b, 1.0).unwrap()).remove(0);
        for (a, e) in s.logprobs.iter().zip(&lp[s.prompt_ids.len() - 1..]) {
            assert!((a - e).abs() < 1e-4, "{a} vs {e}");
        }
    }
}
