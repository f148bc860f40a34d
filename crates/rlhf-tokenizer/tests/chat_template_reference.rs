//! Qwen3's chat template (thinking tags, reasoning stripped from earlier turns,
//! `enable_thinking`, tool calls and responses) renders byte for byte as transformers renders
//! it: tests/fixtures/qwen3_chat_template.json holds transformers' own renders of each case,
//! made by scripts/chat_template_reference.py with the same tokenizer and template.

use std::path::{Path, PathBuf};

use rlhf_tokenizer::Tokenizer;
use serde_json::{Map, Value};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The committed tiny tokenizer with Qwen3's template in its tokenizer_config.json (the
/// tokenizer the reference script gives transformers), in `dir`.
fn qwen3_tokenizer(dir: &Path) -> Tokenizer {
    let src = fixtures().join("tokenizer");
    std::fs::copy(src.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    let mut cfg = read_json(&src.join("tokenizer_config.json"));
    let template = std::fs::read_to_string(fixtures().join("qwen3_chat_template.jinja")).unwrap();
    cfg["chat_template"] = Value::String(template);
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string(&cfg).unwrap(),
    )
    .unwrap();
    Tokenizer::from_dir(dir).unwrap()
}

#[test]
fn qwen3_template_renders_as_transformers_renders_it() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = qwen3_tokenizer(tmp.path());
    let reference = read_json(&fixtures().join("qwen3_chat_template.json"));
    let cases = reference["cases"].as_array().unwrap();
    assert!(cases.len() >= 10, "{} cases", cases.len());
    let mut failed = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let mut extra: Map<String, Value> = case["kwargs"].as_object().unwrap().clone();
        if !case["tools"].is_null() {
            extra.insert("tools".into(), case["tools"].clone());
        }
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let got = tok
            .apply_chat_template_json_with(&case["messages"], agp, &extra)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = case["text"].as_str().unwrap();
        if got != want {
            failed.push(format!(
                "{name}:\n--- ours\n{got}\n--- transformers\n{want}"
            ));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}

/// `enable_thinking` changes what the prompt ends with, and only that: the tokens the policy
/// is asked to continue from.
#[test]
fn enable_thinking_false_closes_an_empty_think_block_in_the_prompt() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = qwen3_tokenizer(tmp.path());
    let chat = [rlhf_tokenizer::ChatMessage::user("What is 2+3?")];
    let off: Map<String, Value> = serde_json::from_str(r#"{"enable_thinking": false}"#).unwrap();
    let plain = tok.encode_chat(&chat, true).unwrap();
    let thinking_off = tok.encode_chat_with(&chat, true, &off).unwrap();
    assert_eq!(thinking_off[..plain.len()], plain[..]);
    let tail = tok.decode(&thinking_off[plain.len()..], false).unwrap();
    assert_eq!(tail, "<think>\n\n</think>\n\n");
}
