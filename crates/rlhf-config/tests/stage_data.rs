//! SFT and preference datasets: HF column conventions in JSONL and in Parquet written by
//! pyarrow, and every bad row named by its line with `data.bad_rows` applied.

use std::path::Path;

use rlhf_config::data::stage::{
    load_pairs, pairs_from_jsonl, sft_from_jsonl, Pair, Reply, SftExample,
};
use rlhf_config::data::{ChatMessage, PromptContent};
use rlhf_config::{BadRows, ConfigError, DataConfig};

fn turn(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

fn skip() -> DataConfig {
    DataConfig {
        bad_rows: BadRows::Skip,
        ..DataConfig::default()
    }
}

#[test]
fn sft_rows_in_every_shape() {
    let text = r#"{"prompt": "2+3=", "completion": "5"}

{"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2="}], "completion": [{"role": "assistant", "content": "4"}]}
"#;
    let ds = sft_from_jsonl(text, "sft.jsonl", &DataConfig::default()).unwrap();
    assert_eq!(ds.records.len(), 2);
    assert_eq!(
        ds.records[0],
        (
            1,
            SftExample::Text {
                prompt: "2+3=".into(),
                completion: "5".into()
            }
        )
    );
    // Line 3 (after a blank line); the loss covers only the completion's turns.
    let (
        line,
        SftExample::Chat {
            messages,
            train_from,
        },
    ) = &ds.records[1]
    else {
        panic!("{:?}", ds.records[1])
    };
    assert_eq!((*line, *train_from, messages.len()), (3, 3, 4));

    let chats = DataConfig {
        messages_key: Some("messages".into()),
        ..DataConfig::default()
    };
    let text = r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3="}, {"role": "assistant", "content": "5"}]}"#;
    let ds = sft_from_jsonl(text, "chat.jsonl", &chats).unwrap();
    assert!(
        matches!(&ds.records[0].1, SftExample::Chat { train_from: 0, messages } if messages.len() == 3)
    );
}

#[test]
fn bad_sft_rows_are_named_by_line() {
    let text = [
        r#"{"prompt": "a", "completion": "b"}"#,
        r#"{"prompt": "a"}"#,
        r#"{"prompt": "a", "completion": ""}"#,
        r#"{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}"#,
        r#"not json"#,
    ]
    .join("\n");
    let err = sft_from_jsonl(&text, "sft.jsonl", &DataConfig::default()).unwrap_err();
    let ConfigError::BadRows { count, first, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(*count, 4);
    assert!(
        first[0].starts_with("line 2")
            && first[0].contains("no 'completion' (data.completion_key)"),
        "{first:?}"
    );
    assert!(
        first[1].starts_with("line 3") && first[1].contains("empty"),
        "{first:?}"
    );
    assert!(
        first[2].starts_with("line 4") && first[2].contains("both must be text or both lists"),
        "{first:?}"
    );
    assert!(
        first[3].starts_with("line 5") && first[3].contains("not JSON"),
        "{first:?}"
    );
    // skip: counted, the good row kept.
    let ds = sft_from_jsonl(&text, "sft.jsonl", &skip()).unwrap();
    assert_eq!(
        (ds.records.len(), ds.report.bad.len(), ds.report.rows),
        (1, 4, 5)
    );

    let chats = DataConfig {
        messages_key: Some("messages".into()),
        ..DataConfig::default()
    };
    let text =
        r#"{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}"#;
    let err = sft_from_jsonl(text, "chat.jsonl", &chats)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("line 1") && err.contains("turn 1 is 'user' where 'assistant' belongs"),
        "{err}"
    );
    let text = r#"{"messages": [{"role": "user", "content": "a"}]}"#;
    let err = sft_from_jsonl(text, "chat.jsonl", &chats)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no assistant turn"), "{err}");
}

#[test]
fn pairs_explicit_and_implicit_prompts() {
    let text = [
        r#"{"prompt": "2+3=", "chosen": "5", "rejected": "6"}"#,
        r#"{"prompt": [{"role": "user", "content": "2+3="}], "chosen": [{"role": "assistant", "content": "5"}], "rejected": [{"role": "assistant", "content": "6"}]}"#,
        r#"{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "good"}], "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "bad"}]}"#,
    ]
    .join("\n");
    let ds = pairs_from_jsonl(&text, "pairs.jsonl", &DataConfig::default()).unwrap();
    assert_eq!(
        ds.records[0].1,
        Pair {
            prompt: PromptContent::Text("2+3=".into()),
            chosen: Reply::Text("5".into()),
            rejected: Reply::Text("6".into()),
            margin: None,
        }
    );
    assert_eq!(
        ds.records[1].1.prompt,
        PromptContent::Messages(vec![turn("user", "2+3=")])
    );
    // TRL's implicit prompt: the chats' shared leading turns.
    assert_eq!(
        ds.records[2].1,
        Pair {
            prompt: PromptContent::Messages(vec![turn("user", "q")]),
            chosen: Reply::Messages(vec![turn("assistant", "good")]),
            rejected: Reply::Messages(vec![turn("assistant", "bad")]),
            margin: None,
        }
    );
}

#[test]
fn bad_pairs_are_named_by_line() {
    let text = [
        r#"{"prompt": "a", "chosen": "b"}"#,
        r#"{"prompt": "a", "chosen": "b", "rejected": "b"}"#,
        r#"{"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}], "rejected": [{"role": "assistant", "content": "c"}]}"#,
        r#"{"chosen": "b", "rejected": "c"}"#,
        r#"{"prompt": "a", "chosen": "b", "rejected": "c", "margin": "big"}"#,
    ]
    .join("\n");
    let cfg = DataConfig {
        margin_key: Some("margin".into()),
        ..DataConfig::default()
    };
    let err = pairs_from_jsonl(&text, "pairs.jsonl", &cfg).unwrap_err();
    let ConfigError::BadRows { count, first, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(*count, 5, "{first:?}");
    let want = [
        ("line 1", "no 'rejected' (data.rejected_key)"),
        ("line 2", "identical"),
        ("line 3", "must end with an assistant turn"),
        ("line 4", "no 'prompt' (data.prompt_key)"),
        ("line 5", "'margin' is text, expected a number"),
    ];
    for (got, (line, why)) in first.iter().zip(want) {
        assert!(
            got.starts_with(line) && got.contains(why),
            "{got} (wanted {line}: {why})"
        );
    }
}

#[test]
fn pairs_from_a_pyarrow_parquet_file() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pyarrow_pairs.parquet");
    let cfg = DataConfig {
        path: path.display().to_string(),
        margin_key: Some("margin".into()),
        bad_rows: BadRows::Skip,
        ..DataConfig::default()
    };
    let ds = load_pairs(&cfg).unwrap();
    assert_eq!(ds.records.len(), 2);
    assert_eq!(
        ds.records[0],
        (
            0,
            Pair {
                prompt: PromptContent::Messages(vec![
                    turn("system", "Be brief."),
                    turn("user", "2+3=")
                ]),
                chosen: Reply::Messages(vec![turn("assistant", "5")]),
                rejected: Reply::Messages(vec![turn("assistant", "six")]),
                margin: Some(1.5),
            }
        )
    );
    assert_eq!(
        ds.records[1].1.prompt,
        PromptContent::Messages(vec![turn("user", "Écris un nombre 🙂")])
    );
    assert_eq!(ds.report.bad.len(), 1);
    assert!(
        ds.report.bad[0].location == "row 2" && ds.report.bad[0].reason.contains("identical"),
        "{:?}",
        ds.report.bad
    );
}
