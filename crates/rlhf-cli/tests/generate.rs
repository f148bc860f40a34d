//! Runs the built `rlhf` binary against the tiny reference checkpoints of rlhf-model
//! (crates/rlhf-model/tests/fixtures, written by scripts/model_fixtures.py with transformers).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../rlhf-model/tests/fixtures")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixtures().join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn rlhf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rlhf"))
        .args(args)
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "rlhf failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn json_lines(out: &Output) -> Vec<Value> {
    stdout(out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Runs a command that must fail; returns its stderr.
fn failure(args: &[&str]) -> String {
    let out = rlhf(args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !out.status.success(),
        "expected failure, got success: {err}"
    );
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(out.stdout.is_empty(), "failure printed to stdout");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "error is not one line: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn model_dir(name: &str) -> String {
    fixtures().join(name).to_string_lossy().into_owned()
}

fn write_prompts(dir: &Path, lines: &[Value]) -> String {
    let path = dir.join("prompts.jsonl");
    let text: Vec<String> = lines.iter().map(|v| v.to_string()).collect();
    std::fs::write(&path, text.join("\n") + "\n").unwrap();
    path.to_string_lossy().into_owned()
}

fn log_softmax_at(logits: &[f64], idx: usize) -> f64 {
    let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + logits.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
    logits[idx] - lse
}

#[test]
fn greedy_matches_transformers_for_every_causal_fixture() {
    let reference = reference();
    let tmp = tempfile::tempdir().unwrap();
    for name in ["tiny-llama", "tiny-llama3-rope", "tiny-qwen2"] {
        let r = &reference["models"][name];
        let prompts: Vec<Value> = r["prompts"].as_array().unwrap().clone();
        let file = write_prompts(tmp.path(), &prompts);
        let n_new = r["greedy_new_tokens"].as_u64().unwrap().to_string();
        let out = rlhf(&[
            "generate",
            "--model",
            &model_dir(name),
            "--prompts",
            &file,
            "--max-new-tokens",
            &n_new,
            "--temperature",
            "0",
            "--format",
            "json",
        ]);
        let rows = json_lines(&out);
        assert_eq!(rows.len(), prompts.len(), "{name}");
        let eos = ids(&r["greedy_eos_token_ids"]);
        let t = r["logits_shape"][1].as_u64().unwrap() as usize;
        for (b, row) in rows.iter().enumerate() {
            assert_eq!(row["index"], b, "{name}");
            assert_eq!(row["prompt"], prompts[b], "{name}");
            assert_eq!(
                ids(&row["prompt_token_ids"]),
                ids(&r["prompt_token_ids"][b]),
                "{name} row {b}: prompt tokens"
            );
            // transformers' greedy tokens, cut after the first stop token as the CLI does.
            let mut expected = Vec::new();
            for tok in ids(&r["greedy_no_stop"][b]) {
                expected.push(tok);
                if eos.contains(&tok) {
                    break;
                }
            }
            let got = ids(&row["completion_token_ids"]);
            assert_eq!(
                got, expected,
                "{name} row {b}: greedy tokens differ from transformers"
            );
            let lps: Vec<f64> = row["logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            assert_eq!(lps.len(), got.len());
            assert!(lps.iter().all(|x| x.is_finite() && *x <= 0.0), "{lps:?}");
            // The first completion token's log-prob follows from the reference logits at the
            // last prompt position.
            let last: Vec<f64> = r["logits"][b][t - 1]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            let want = log_softmax_at(&last, got[0] as usize);
            assert!(
                (lps[0] - want).abs() < 1e-4,
                "{name} row {b}: first log-prob {} vs reference {want}",
                lps[0]
            );
            let finish = if eos.contains(got.last().unwrap()) {
                "stop"
            } else {
                "length"
            };
            assert_eq!(row["finish_reason"], finish);
        }
    }
}

#[test]
fn text_format_prints_the_json_text() {
    let model = model_dir("tiny-llama");
    let base = [
        "generate",
        "--model",
        model.as_str(),
        "--prompt",
        "The fox",
        "--max-new-tokens",
        "8",
    ];
    let json = json_lines(&rlhf(&[&base[..], &["--format", "json"]].concat()));
    assert_eq!(json.len(), 1);
    let text = stdout(&rlhf(&base));
    assert_eq!(text, format!("{}\n", json[0]["text"].as_str().unwrap()));
    // Default temperature comes from generation_config.json, which asks for greedy.
    let r = reference();
    let mut want = ids(&r["models"]["tiny-llama"]["greedy_no_stop"][0]);
    want.truncate(8);
    assert_eq!(ids(&json[0]["completion_token_ids"]), want);
}

#[test]
fn chat_renders_the_template_like_transformers() {
    let reference = reference();
    let tmp = tempfile::tempdir().unwrap();
    let chat = reference["tokenizer"]["chat_template"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "two_turns_default_system")
        .unwrap()
        .clone();
    let file = write_prompts(
        tmp.path(),
        &[serde_json::json!({"messages": chat["messages"]})],
    );
    for name in ["tiny-qwen2", "tiny-llama"] {
        let rows = json_lines(&rlhf(&[
            "generate",
            "--model",
            &model_dir(name),
            "--prompts",
            &file,
            "--chat",
            "--max-new-tokens",
            "3",
            "--format",
            "json",
        ]));
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0]["prompt"], chat["text"], "{name}");
        assert_eq!(
            ids(&rows[0]["prompt_token_ids"]),
            ids(&chat["ids"]),
            "{name}"
        );
    }
    // A plain prompt becomes one user turn after the given system message.
    let rows = json_lines(&rlhf(&[
        "generate",
        "--model",
        &model_dir("tiny-qwen2"),
        "--prompt",
        "Hi",
        "--chat",
        "--system",
        "Be brief.",
        "--max-new-tokens",
        "2",
        "--format",
        "json",
    ]));
    assert_eq!(
        rows[0]["prompt"],
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    // Chat messages without --chat are refused.
    let err = failure(&[
        "generate",
        "--model",
        &model_dir("tiny-qwen2"),
        "--prompts",
        &file,
    ]);
    assert!(err.contains("pass --chat"), "{err}");
}

#[test]
fn stop_token_truncates_the_completion() {
    let reference = reference();
    let greedy = ids(&reference["models"]["tiny-llama"]["greedy_no_stop"][0]);
    let tok = rlhf_model::Tokenizer::from_dir(fixtures().join("tiny-llama")).unwrap();
    let stop = tok.inner().id_to_token(greedy[1] as u32).unwrap();
    let rows = json_lines(&rlhf(&[
        "generate",
        "--model",
        &model_dir("tiny-llama"),
        "--prompt",
        "The fox",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
        "--stop-token",
        &stop,
        "--format",
        "json",
    ]));
    let first_stop = greedy.iter().position(|&t| t == greedy[1]).unwrap();
    assert_eq!(
        ids(&rows[0]["completion_token_ids"]),
        greedy[..=first_stop].to_vec()
    );
    assert_eq!(rows[0]["finish_reason"], "stop");

    let err = failure(&[
        "generate",
        "--model",
        &model_dir("tiny-llama"),
        "--prompt",
        "x",
        "--stop-token",
        "<|nope|>",
    ]);
    assert!(
        err.contains("<|nope|>") && err.contains("not a token"),
        "{err}"
    );
}

#[test]
fn sampling_is_reproducible_from_the_seed() {
    let model = model_dir("tiny-qwen2");
    let args = |seed: &'static str| {
        rlhf(&[
            "generate",
            "--model",
            &model,
            "--prompt",
            "Hello world!",
            "--temperature",
            "1.0",
            "--top-k",
            "50",
            "--top-p",
            "0.9",
            "--n",
            "3",
            "--seed",
            seed,
            "--max-new-tokens",
            "12",
            "--format",
            "json",
        ])
    };
    let a = json_lines(&args("7"));
    let b = json_lines(&args("7"));
    assert_eq!(a, b);
    assert_eq!(a.len(), 3);
    for (j, row) in a.iter().enumerate() {
        assert_eq!(row["index"], 0);
        assert_eq!(row["sample"], j);
    }
    let c = json_lines(&args("8"));
    assert_ne!(
        a.iter()
            .map(|r| r["completion_token_ids"].clone())
            .collect::<Vec<_>>(),
        c.iter()
            .map(|r| r["completion_token_ids"].clone())
            .collect::<Vec<_>>(),
        "different seeds gave the same 3 samples of 12 tokens"
    );
}

#[test]
fn long_prompts_are_refused_or_truncated_as_asked() {
    let model = model_dir("tiny-llama");
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(3);
    let tok = rlhf_model::Tokenizer::from_dir(fixtures().join("tiny-llama")).unwrap();
    let full = tok.encode(&prompt, true).unwrap();
    // Context 128 minus 100 new tokens leaves 28 for the prompt.
    assert!(full.len() > 28);
    let args = [
        "generate",
        "--model",
        model.as_str(),
        "--prompt",
        prompt.as_str(),
        "--max-new-tokens",
        "100",
    ];
    let err = failure(&args);
    assert!(
        err.contains(&format!("{} tokens", full.len())) && err.contains("--truncate-prompt"),
        "{err}"
    );
    let rows = json_lines(&rlhf(
        &[&args[..], &["--truncate-prompt", "--format", "json"]].concat(),
    ));
    let kept: Vec<u64> = full[full.len() - 28..].iter().map(|&x| x as u64).collect();
    assert_eq!(ids(&rows[0]["prompt_token_ids"]), kept);
    assert!(!ids(&rows[0]["completion_token_ids"]).is_empty());
}

#[test]
fn bad_input_fails_with_one_clear_line() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-model");
    let err = failure(&[
        "generate",
        "--model",
        missing.to_str().unwrap(),
        "--prompt",
        "x",
    ]);
    assert!(
        err.contains("no-such-model") && err.contains("does not exist"),
        "{err}"
    );

    let missing_file = tmp.path().join("absent.jsonl");
    let err = failure(&[
        "generate",
        "--model",
        &model_dir("tiny-llama"),
        "--prompts",
        missing_file.to_str().unwrap(),
    ]);
    assert!(err.contains("absent.jsonl"), "{err}");

    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "\"fine\"\n[1, 2]\n").unwrap();
    let err = failure(&[
        "generate",
        "--model",
        &model_dir("tiny-llama"),
        "--prompts",
        bad.to_str().unwrap(),
    ]);
    assert!(err.contains("bad.jsonl line 2"), "{err}");

    let err = failure(&[
        "generate",
        "--model",
        &model_dir("tiny-llama-reward"),
        "--prompt",
        "x",
    ]);
    assert!(
        err.contains("LlamaForSequenceClassification") && err.contains("causal LM"),
        "{err}"
    );

    let err = failure(&[
        "generate",
        "--model",
        &model_dir("tiny-llama"),
        "--prompt",
        "x",
        "--max-new-tokens",
        "128",
    ]);
    assert!(
        err.contains("--max-new-tokens 128") && err.contains("128"),
        "{err}"
    );

    let err = failure(&[
        "generate",
        "--model",
        &model_dir("tiny-llama"),
        "--prompt",
        "x",
        "--top-p",
        "0",
    ]);
    assert!(err.contains("--top-p"), "{err}");

    // A model directory whose tokenizer has no chat template: --chat says so.
    let no_template = tmp.path().join("no-template");
    std::fs::create_dir(&no_template).unwrap();
    let src = fixtures().join("tiny-llama");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), no_template.join(f)).unwrap();
    }
    let dir = no_template.to_str().unwrap();
    let err = failure(&["generate", "--model", dir, "--prompt", "x", "--chat"]);
    assert!(
        err.contains("no chat template") && err.contains("--chat"),
        "{err}"
    );
    // Without --chat the same directory works.
    stdout(&rlhf(&[
        "generate",
        "--model",
        dir,
        "--prompt",
        "x",
        "--max-new-tokens",
        "2",
    ]));

    // A missing weights file is named.
    std::fs::remove_file(no_template.join("model.safetensors")).unwrap();
    let err = failure(&["generate", "--model", dir, "--prompt", "x"]);
    assert!(err.contains("model.safetensors"), "{err}");
}

/// `--dtype bf16` generates (frozen bf16 weights); `--device cuda:0` in a build without the
/// `cuda` feature is one clear line naming the rebuild, never a silent CPU run.
#[test]
fn dtype_and_device_flags() {
    let model = model_dir("tiny-llama");
    let base = [
        "generate",
        "--model",
        model.as_str(),
        "--prompt",
        "hello",
        "--max-new-tokens",
        "3",
        "--format",
        "json",
    ];
    let mut args = base.to_vec();
    args.extend(["--dtype", "bf16"]);
    let lines = json_lines(&rlhf(&args));
    assert_eq!(lines.len(), 1);
    assert_eq!(
        ids(&lines[0]["completion_token_ids"]).len(),
        3,
        "{}",
        lines[0]
    );
    if !cfg!(feature = "cuda") {
        let mut args = base.to_vec();
        args.extend(["--device", "cuda:0"]);
        let err = failure(&args);
        assert!(err.contains("without the `cuda` feature"), "{err}");
        assert!(err.contains("--features cuda"), "{err}");
    }
    let mut args = base.to_vec();
    args.extend(["--device", "tpu:0"]);
    let out = rlhf(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("use cpu or cuda:N"), "{err}");
}
