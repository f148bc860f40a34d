//! Prompt datasets: JSONL, Parquet, bad rows, length policy, shuffling, resume.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use rlhf_config::data::{
    apply_length_policy, batch_records, ChatMessage, Columns, DataCursor, LengthDecision,
    PromptContent, PromptDataset, PromptSampler,
};
use rlhf_config::{BadRows, ConfigError, DataConfig, DataFormat, PromptOverflow};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn cols() -> Columns {
    Columns {
        prompt_key: "prompt".into(),
        messages_key: None,
        ground_truth_key: None,
    }
}

/// One column of a row group: leaf values with their definition and
/// repetition levels.
struct Column {
    values: Vec<ByteArray>,
    defs: Vec<i16>,
    reps: Option<Vec<i16>>,
}

fn write_parquet(path: &Path, schema: &str, columns: Vec<Column>) {
    let schema = Arc::new(parse_message_type(schema).unwrap());
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .build(),
    );
    let mut w = SerializedFileWriter::new(File::create(path).unwrap(), schema, props).unwrap();
    let mut rg = w.next_row_group().unwrap();
    let mut it = columns.into_iter();
    while let Some(mut col) = rg.next_column().unwrap() {
        let c = it.next().expect("a column per leaf");
        col.typed::<ByteArrayType>()
            .write_batch(&c.values, Some(&c.defs), c.reps.as_deref())
            .unwrap();
        col.close().unwrap();
    }
    rg.close().unwrap();
    w.close().unwrap();
}

fn ba(s: &str) -> ByteArray {
    ByteArray::from(s)
}

#[test]
fn shipped_tiny_dataset_loads() {
    let cfg = DataConfig {
        path: repo().join("data/prompts_tiny.jsonl").display().to_string(),
        ..DataConfig::default()
    };
    let ds = PromptDataset::load(&cfg).unwrap();
    assert_eq!(ds.len(), 64);
    assert!(ds.report.bad.is_empty());
    assert_eq!(ds.records[2].content, PromptContent::Text("2+3=".into()));
    assert_eq!(ds.records[2].source_row, 3);
    assert_eq!(ds.records[2].index, 2);
    // The shipped tiny config points at it and its batch fits.
    let job = rlhf_config::load(&repo().join("configs"), "ppo_tiny", &[]).unwrap();
    assert_eq!(job.data.path, "data/prompts_tiny.jsonl");
    let mut s = PromptSampler::for_config(&job, ds.len()).unwrap();
    assert_eq!(s.next_batch().len(), 8);
}

#[test]
fn jsonl_prompts_and_messages() {
    let text = r#"{"prompt": "Count to five:"}

{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3="}]}
{"prompt": "Write a number:", "extra": 1}
"#;
    let ds = PromptDataset::from_jsonl_str(text, "t.jsonl", &cols(), BadRows::Fail).unwrap();
    assert_eq!(ds.len(), 3);
    assert_eq!(ds.report.rows, 3, "blank lines are not rows");
    assert_eq!(ds.records[1].source_row, 3);
    assert_eq!(
        ds.records[1].content,
        PromptContent::Messages(vec![
            ChatMessage {
                role: "system".into(),
                content: "Be brief.".into()
            },
            ChatMessage {
                role: "user".into(),
                content: "2+3=".into()
            },
        ])
    );
    // A messages column is read instead of the prompt column.
    let text = r#"{"prompt": "ignored", "messages": [{"role": "user", "content": "hi"}]}"#;
    let c = Columns {
        prompt_key: "prompt".into(),
        messages_key: Some("messages".into()),
        ground_truth_key: None,
    };
    let ds = PromptDataset::from_jsonl_str(text, "m.jsonl", &c, BadRows::Fail).unwrap();
    assert!(matches!(&ds.records[0].content, PromptContent::Messages(m) if m[0].content == "hi"));
}

const WITH_BAD: &str = r#"{"prompt": "ok 1"}
{"prompt": 5}
not json
{"question": "wrong key"}
{"prompt": "ok 2"}
{"prompt": [{"role": "user"}]}
{"prompt": ""}
"#;

#[test]
fn bad_jsonl_rows_are_counted_with_line_numbers_when_skipped() {
    let ds = PromptDataset::from_jsonl_str(WITH_BAD, "bad.jsonl", &cols(), BadRows::Skip).unwrap();
    assert_eq!(ds.len(), 2);
    assert_eq!(ds.report.rows, 7);
    let locs: Vec<&str> = ds.report.bad.iter().map(|b| b.location.as_str()).collect();
    assert_eq!(locs, ["line 2", "line 3", "line 4", "line 6", "line 7"]);
    assert!(
        ds.report.bad[0].reason.contains("got a number"),
        "{:?}",
        ds.report.bad
    );
    assert!(ds.report.bad[1].reason.contains("not JSON"));
    assert!(ds.report.bad[2]
        .reason
        .contains("no 'prompt' key (keys: question)"));
    assert!(ds.report.bad[3].reason.contains("'prompt'[0]"));
    assert!(ds.report.bad[4].reason.contains("empty prompt"));
    // Surviving records are re-indexed densely, keeping their source line.
    assert_eq!((ds.records[1].index, ds.records[1].source_row), (1, 5));
    let summary = ds.summary();
    assert!(
        summary.contains("2 prompts from 7 rows")
            && summary.contains("skipped 5 bad row(s): line 2"),
        "{summary}"
    );
}

#[test]
fn bad_jsonl_rows_are_fatal_when_configured() {
    let err =
        PromptDataset::from_jsonl_str(WITH_BAD, "bad.jsonl", &cols(), BadRows::Fail).unwrap_err();
    match &err {
        ConfigError::BadRows { count, first, .. } => {
            assert_eq!(*count, 5);
            assert!(first[0].starts_with("line 2:"), "{first:?}");
        }
        other => panic!("wrong error: {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("bad.jsonl: 5 bad row(s)") && msg.contains("data.bad_rows=skip"),
        "{msg}"
    );
    // Nothing usable at all is an error even when skipping.
    let err = PromptDataset::from_jsonl_str("x\n", "e.jsonl", &cols(), BadRows::Skip).unwrap_err();
    assert!(err.to_string().contains("no usable prompts"), "{err}");
}

#[test]
fn parquet_prompt_column_with_null_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.parquet");
    // Rows: "a", null, "b", "c" (null has definition level 0).
    write_parquet(
        &path,
        "message schema { OPTIONAL BYTE_ARRAY prompt (UTF8); OPTIONAL BYTE_ARRAY other (UTF8); }",
        vec![
            Column {
                values: vec![ba("2+3="), ba("Count to five:"), ba("Write a number:")],
                defs: vec![1, 0, 1, 1],
                reps: None,
            },
            Column {
                values: vec![ba("x"), ba("y"), ba("z"), ba("w")],
                defs: vec![1, 1, 1, 1],
                reps: None,
            },
        ],
    );
    let mut cfg = DataConfig {
        path: path.display().to_string(),
        bad_rows: BadRows::Skip,
        ..DataConfig::default()
    };
    let ds = PromptDataset::load(&cfg).unwrap();
    let texts: Vec<_> = ds.records.iter().map(|r| r.content.clone()).collect();
    assert_eq!(
        texts,
        ["2+3=", "Count to five:", "Write a number:"].map(|s| PromptContent::Text(s.into()))
    );
    assert_eq!(ds.records[1].source_row, 2, "parquet rows are 0-based");
    assert_eq!(ds.report.bad.len(), 1);
    assert_eq!(ds.report.bad[0].location, "row 1");
    assert!(ds.report.bad[0].reason.contains("null"));

    cfg.bad_rows = BadRows::Fail;
    let err = PromptDataset::load(&cfg).unwrap_err().to_string();
    assert!(err.contains("row 1: 'prompt' is null"), "{err}");

    // A missing column is named with the ones that exist.
    cfg.prompt_key = "question".into();
    let err = PromptDataset::load(&cfg).unwrap_err().to_string();
    assert!(
        err.contains("no column 'question'; columns are [prompt, other]"),
        "{err}"
    );

    // Binary (non-UTF8-annotated) columns are read as text when they are UTF-8.
    let raw = dir.path().join("raw.parquet");
    write_parquet(
        &raw,
        "message schema { REQUIRED BYTE_ARRAY prompt; }",
        vec![Column {
            values: vec![ba("1+1="), ByteArray::from(vec![0xff, 0xfe])],
            defs: vec![0, 0],
            reps: None,
        }],
    );
    let ds = PromptDataset::from_parquet(&raw, &cols(), BadRows::Skip).unwrap();
    assert_eq!(ds.records[0].content, PromptContent::Text("1+1=".into()));
    assert_eq!(ds.report.bad[0].location, "row 1");
    assert!(
        ds.report.bad[0].reason.contains("not UTF-8"),
        "{:?}",
        ds.report.bad
    );

    // Not a parquet file; format forced by config.
    let fake = dir.path().join("fake.data");
    std::fs::write(&fake, "hello").unwrap();
    let cfg = DataConfig {
        path: fake.display().to_string(),
        format: DataFormat::Parquet,
        ..DataConfig::default()
    };
    let err = PromptDataset::load(&cfg).unwrap_err().to_string();
    assert!(err.contains("not a Parquet file"), "{err}");
    let cfg = DataConfig {
        path: fake.display().to_string(),
        ..DataConfig::default()
    };
    let err = PromptDataset::load(&cfg).unwrap_err().to_string();
    assert!(err.contains("set data.format"), "{err}");
}

#[test]
fn parquet_chat_messages() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.parquet");
    // verl-style: a list of {role, content} structs per row.
    // Row 0: [system, user]; row 1: [user].
    let schema = "message schema {
        OPTIONAL group prompt (LIST) {
            REPEATED group list {
                OPTIONAL group element {
                    OPTIONAL BYTE_ARRAY role (UTF8);
                    OPTIONAL BYTE_ARRAY content (UTF8);
                }
            }
        }
    }";
    write_parquet(
        &path,
        schema,
        vec![
            Column {
                values: vec![ba("system"), ba("user"), ba("user")],
                defs: vec![4, 4, 4],
                reps: Some(vec![0, 1, 0]),
            },
            Column {
                values: vec![ba("Be brief."), ba("2+3="), ba("Count to five:")],
                defs: vec![4, 4, 4],
                reps: Some(vec![0, 1, 0]),
            },
        ],
    );
    let ds = PromptDataset::from_parquet(&path, &cols(), BadRows::Fail).unwrap();
    assert_eq!(ds.len(), 2);
    let PromptContent::Messages(m) = &ds.records[0].content else {
        panic!("expected messages, got {:?}", ds.records[0].content)
    };
    assert_eq!(m.len(), 2);
    assert_eq!(
        (m[0].role.as_str(), m[1].content.as_str()),
        ("system", "2+3=")
    );
    let PromptContent::Messages(m) = &ds.records[1].content else {
        panic!("expected messages")
    };
    assert_eq!(m[0].content, "Count to five:");
}

#[test]
fn length_policy_counts() {
    let lengths = [3, 10, 11, 40, 10];
    let (d, s) = apply_length_policy(&lengths, 10, PromptOverflow::Truncate);
    assert_eq!(
        d,
        [
            LengthDecision::Keep,
            LengthDecision::Keep,
            LengthDecision::TruncateFront(1),
            LengthDecision::TruncateFront(30),
            LengthDecision::Keep
        ]
    );
    assert_eq!((s.kept, s.truncated, s.skipped), (3, 2, 0));
    let (d, s) = apply_length_policy(&lengths, 10, PromptOverflow::Skip);
    assert_eq!(d[3], LengthDecision::Skip);
    assert_eq!((s.kept, s.truncated, s.skipped), (3, 0, 2));
}

#[test]
fn shuffling_is_reproducible_by_seed_and_reshuffles_per_epoch() {
    let take = |seed: u64, n: usize| {
        let mut s = PromptSampler::new(20, 4, true, seed).unwrap();
        (0..n).map(|_| s.next_batch()).collect::<Vec<_>>()
    };
    let a = take(7, 10);
    assert_eq!(a, take(7, 10), "same seed, same batches");
    assert_ne!(a, take(8, 10), "another seed, another order");
    // Epoch 0 is batches 0..5 and covers every prompt once.
    let mut epoch0: Vec<usize> = a[..5].concat();
    assert_ne!(epoch0, (0..20).collect::<Vec<_>>(), "shuffled");
    epoch0.sort();
    assert_eq!(epoch0, (0..20).collect::<Vec<_>>());
    assert_ne!(a[..5], a[5..10], "epoch 1 has a new order");
    // Without shuffling the order is the file order.
    let mut s = PromptSampler::new(10, 4, false, 7).unwrap();
    assert_eq!(s.next_batch(), [0, 1, 2, 3]);
    assert_eq!(s.next_batch(), [4, 5, 6, 7]);
    // The 2-prompt tail is kept: the batch is completed from the next epoch, so every
    // prompt is drawn once per epoch.
    assert_eq!(s.next_batch(), [8, 9, 0, 1]);
    assert_eq!((s.cursor().epoch, s.cursor().position), (1, 2));
    assert_eq!(s.next_batch(), [2, 3, 4, 5]);
    // Shuffled, over many epochs: each epoch's 23 draws are every prompt once.
    let mut s = PromptSampler::new(23, 5, true, 3).unwrap();
    let all: Vec<usize> = (0..23).flat_map(|_| s.next_batch()).collect();
    for epoch in all.chunks(23) {
        let mut e = epoch.to_vec();
        e.sort_unstable();
        assert_eq!(e, (0..23).collect::<Vec<_>>());
    }
}

#[test]
fn cursor_resume_gives_the_same_next_batch() {
    let mut straight = PromptSampler::new(23, 5, true, 99).unwrap();
    for _ in 0..6 {
        straight.next_batch();
    }
    let saved = serde_json::to_string(&straight.cursor()).unwrap();
    let expected: Vec<Vec<usize>> = (0..8).map(|_| straight.next_batch()).collect();

    let mut resumed = PromptSampler::new(23, 5, true, 99).unwrap();
    let cursor: DataCursor = serde_json::from_str(&saved).unwrap();
    assert_eq!(
        cursor.epoch, 1,
        "6 batches of 5 over 23 prompts cross an epoch"
    );
    resumed.restore(cursor).unwrap();
    let got: Vec<Vec<usize>> = (0..8).map(|_| resumed.next_batch()).collect();
    assert_eq!(got, expected);

    // A cursor from another dataset size or seed is refused.
    let mut other = PromptSampler::new(24, 5, true, 99).unwrap();
    let err = other.restore(cursor).unwrap_err().to_string();
    assert!(
        err.contains("saved for 23 prompts") && err.contains("24 prompts"),
        "{err}"
    );
    let mut other = PromptSampler::new(23, 5, true, 1).unwrap();
    assert!(other.restore(cursor).is_err());

    // Batches resolve to records.
    let ds = PromptDataset::from_jsonl_str(
        &(0..23)
            .map(|i| format!("{{\"prompt\": \"p{i}\"}}\n"))
            .collect::<String>(),
        "g.jsonl",
        &cols(),
        BadRows::Fail,
    )
    .unwrap();
    let recs = batch_records(&ds, &got[0]);
    assert_eq!(recs.len(), 5);
    assert_eq!(
        recs[0].content,
        PromptContent::Text(format!("p{}", got[0][0]))
    );
}

#[test]
fn sampler_refuses_a_dataset_smaller_than_a_batch() {
    let err = PromptSampler::new(3, 8, true, 1).unwrap_err().to_string();
    assert!(
        err.contains("3 prompts, fewer than one batch of 8"),
        "{err}"
    );
    assert!(PromptSampler::new(3, 0, true, 1).is_err());
}

#[test]
fn ground_truth_column_is_read_and_required_when_named() {
    let text = "{\"prompt\": \"2+3=\", \"answer\": 5}\n{\"prompt\": \"4+4=\", \"answer\": \"8\"}\n{\"prompt\": \"1+1=\"}\n";
    let c = Columns {
        prompt_key: "prompt".into(),
        messages_key: None,
        ground_truth_key: Some("answer".into()),
    };
    let ds = PromptDataset::from_jsonl_str(text, "gt.jsonl", &c, BadRows::Skip).unwrap();
    let gts: Vec<_> = ds.records.iter().map(|r| r.ground_truth.clone()).collect();
    assert_eq!(gts, vec![Some("5".to_string()), Some("8".to_string())]);
    assert_eq!(ds.report.bad.len(), 1);
    assert!(ds.report.bad[0].location == "line 3" && ds.report.bad[0].reason.contains("answer"));
    // Without the key nothing is read.
    let ds = PromptDataset::from_jsonl_str(text, "gt.jsonl", &cols(), BadRows::Fail).unwrap();
    assert!(ds.records.iter().all(|r| r.ground_truth.is_none()));
}

/// A dataset written by another implementation: pyarrow, the writer behind HF datasets'
/// `to_parquet` (snappy pages, dictionary encoding, three row groups, a null row, verl-style
/// message lists, a reference-answer column), made by scripts/data_fixtures.py. The expected
/// rows are what pyarrow reads back from the same file.
#[test]
fn parquet_written_by_pyarrow() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let path = dir.join("pyarrow_prompts.parquet");
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("pyarrow_prompts.json")).unwrap())
            .unwrap();
    assert!(want["writer"].as_str().unwrap().contains("arrow"));
    assert!(want["row_groups"].as_u64().unwrap() > 1);
    let rows = want["rows"].as_array().unwrap();
    let ok: Vec<(usize, &serde_json::Value)> = rows
        .iter()
        .enumerate()
        .filter(|(_, r)| !r["prompt"].is_null())
        .collect();
    assert!(ok.len() < rows.len(), "the fixture has a null row");

    // Plain prompts with their answers; the null row is reported by its row number.
    let text_cols = Columns {
        prompt_key: "prompt".into(),
        messages_key: None,
        ground_truth_key: Some("answer".into()),
    };
    let ds = PromptDataset::from_parquet(&path, &text_cols, BadRows::Skip).unwrap();
    assert_eq!(ds.len(), ok.len());
    for (rec, (row, r)) in ds.records.iter().zip(&ok) {
        assert_eq!(rec.source_row, *row);
        assert_eq!(
            rec.content,
            PromptContent::Text(r["prompt"].as_str().unwrap().into())
        );
        assert_eq!(rec.ground_truth.as_deref(), r["answer"].as_str());
    }
    let null_row = rows.iter().position(|r| r["prompt"].is_null()).unwrap();
    assert_eq!(ds.report.bad.len(), 1);
    assert_eq!(ds.report.bad[0].location, format!("row {null_row}"));

    // The message lists, role and content in order.
    let msg_cols = Columns {
        prompt_key: "prompt".into(),
        messages_key: Some("messages".into()),
        ground_truth_key: None,
    };
    let ds = PromptDataset::from_parquet(&path, &msg_cols, BadRows::Skip).unwrap();
    assert_eq!(ds.len(), ok.len());
    for (rec, (_, r)) in ds.records.iter().zip(&ok) {
        let PromptContent::Messages(m) = &rec.content else {
            panic!("expected messages, got {:?}", rec.content)
        };
        let want: Vec<(&str, &str)> = r["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| (x["role"].as_str().unwrap(), x["content"].as_str().unwrap()))
            .collect();
        let got: Vec<(&str, &str)> = m
            .iter()
            .map(|x| (x.role.as_str(), x.content.as_str()))
            .collect();
        assert_eq!(got, want);
    }
}
