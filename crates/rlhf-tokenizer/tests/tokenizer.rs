//! Loading, encoding, decoding and chat templates against the committed BPE fixture.

use std::path::{Path, PathBuf};

use rlhf_tokenizer::{copy_tokenizer_files, ChatMessage, Error, Tokenizer};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

#[test]
fn loads_special_tokens_and_round_trips_text() {
    let tok = Tokenizer::from_dir(fixture()).unwrap();
    assert_eq!(tok.vocab_size(), 320);
    assert_eq!(tok.eos_token(), Some("<|endoftext|>"));
    assert_eq!(tok.eos_token_id(), Some(0));
    assert_eq!(tok.bos_token_id(), Some(0));
    assert_eq!(tok.pad_token_id(), Some(0));
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.id_to_token(2).as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.model_max_length(), Some(128));
    // Ids computed by transformers for this fixture (crates/rlhf-model/tests/fixtures/reference.json).
    assert_eq!(
        tok.encode("Hello world!", false).unwrap(),
        vec![42, 298, 78, 81, 284, 290, 78, 70, 3]
    );
    for text in [
        "Count to five:",
        "  two  spaces, tabs\tand\nnewlines",
        "Café naïve 🙂 42",
    ] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    let batch = tok.encode_batch(&["a b", "7+8="], false).unwrap();
    assert_eq!(
        tok.decode_batch(&batch, true).unwrap(),
        vec!["a b".to_string(), "7+8=".to_string()]
    );
}

#[test]
fn special_tokens_are_skipped_on_request() {
    let tok = Tokenizer::from_dir(fixture()).unwrap();
    let mut ids = tok.encode("hi", false).unwrap();
    ids.push(tok.eos_token_id().unwrap());
    assert_eq!(tok.decode(&ids, true).unwrap(), "hi");
    assert_eq!(tok.decode(&ids, false).unwrap(), "hi<|endoftext|>");
}

#[test]
fn chat_encoding_uses_the_template_and_its_special_tokens() {
    let tok = Tokenizer::from_dir(fixture()).unwrap();
    let text = tok
        .apply_chat_template(&[ChatMessage::user("Hi there")], true)
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok
        .encode_chat(&[ChatMessage::user("Hi there")], true)
        .unwrap();
    assert_eq!(ids[0], 1, "template starts with <|im_start|>");
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2);
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}

#[test]
fn from_files_takes_paths_anywhere_and_config_is_optional() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("my-tok.json");
    let cfg = tmp.path().join("my-cfg.json");
    std::fs::copy(fixture().join("tokenizer.json"), &json).unwrap();
    std::fs::copy(fixture().join("tokenizer_config.json"), &cfg).unwrap();
    let tok = Tokenizer::from_files(&json, Some(cfg.as_path())).unwrap();
    assert_eq!(tok.eos_token_id(), Some(0));
    assert!(tok.chat_template().is_some());

    let bare = Tokenizer::from_files(&json, None).unwrap();
    assert_eq!(bare.eos_token_id(), None);
    assert_eq!(bare.pad_token_id(), None);
    assert_eq!(bare.encode("Hello world!", false).unwrap().len(), 9);
}

#[test]
fn pad_falls_back_to_eos_and_template_comes_from_jinja_file() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture().join("tokenizer.json"),
        tmp.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        tmp.path().join("tokenizer_config.json"),
        r#"{"eos_token": {"content": "<|im_end|>", "special": true}, "bos_token": null}"#,
    )
    .unwrap();
    std::fs::write(
        tmp.path().join("chat_template.jinja"),
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}",
    )
    .unwrap();
    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    assert_eq!(tok.pad_token(), None);
    assert_eq!(tok.eos_token_id(), Some(2));
    assert_eq!(tok.pad_token_id(), Some(2));
    assert_eq!(tok.bos_token_id(), None);
    let text = tok
        .apply_chat_template(&[ChatMessage::assistant("ok")], false)
        .unwrap();
    assert_eq!(text, "[assistant]ok<|im_end|>");
}

#[test]
fn missing_and_malformed_files_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let err = Tokenizer::from_dir(tmp.path()).unwrap_err();
    assert!(matches!(err, Error::MissingFile { .. }), "{err:?}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    assert!(err.to_string().contains("save_pretrained"), "{err}");

    std::fs::write(tmp.path().join("tokenizer.json"), "{not json").unwrap();
    let err = Tokenizer::from_dir(tmp.path()).unwrap_err();
    assert!(matches!(err, Error::Tokenizer(_)), "{err:?}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    std::fs::copy(
        fixture().join("tokenizer.json"),
        tmp.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(tmp.path().join("tokenizer_config.json"), "[1, 2").unwrap();
    let err = Tokenizer::from_dir(tmp.path()).unwrap_err();
    assert!(matches!(err, Error::Json { .. }), "{err:?}");
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
}

#[test]
fn no_chat_template_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture().join("tokenizer.json"),
        tmp.path().join("tokenizer.json"),
    )
    .unwrap();
    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    let err = tok
        .encode_chat(&[ChatMessage::user("hi")], true)
        .unwrap_err();
    assert!(matches!(err, Error::NoChatTemplate { .. }), "{err:?}");
    assert!(err.to_string().contains("no chat_template"), "{err}");
}

#[test]
fn copy_tokenizer_files_copies_what_exists() {
    let tmp = tempfile::tempdir().unwrap();
    copy_tokenizer_files(&fixture(), tmp.path()).unwrap();
    assert!(tmp.path().join("tokenizer.json").is_file());
    assert!(tmp.path().join("tokenizer_config.json").is_file());
    assert!(!tmp.path().join("merges.txt").exists());
    let a = Tokenizer::from_dir(fixture()).unwrap();
    let b = Tokenizer::from_dir(tmp.path()).unwrap();
    assert_eq!(
        a.encode("copy me", false).unwrap(),
        b.encode("copy me", false).unwrap()
    );

    let empty = tempfile::tempdir().unwrap();
    let err = copy_tokenizer_files(empty.path(), tmp.path()).unwrap_err();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}

#[test]
fn tokenizer_is_send_sync_and_clone() {
    fn check<T: Send + Sync + Clone>() {}
    check::<Tokenizer>();
}
