//! Tests of the TensorBoard event writer: CRC-32C against its standard check value, the
//! records read back (tags, values, the sample table) and checked against both CRCs, the
//! wire field numbers of event.proto, and the files each start makes.

use super::proto::{Event, Kind, What};
use super::*;

/// The records of an event file, each checked against both CRCs.
fn read_records(bytes: &[u8]) -> std::result::Result<Vec<Vec<u8>>, String> {
    let mut out = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        if rest.len() < 12 {
            return Err(format!("{} trailing bytes", rest.len()));
        }
        let (len_bytes, tail) = rest.split_at(8);
        let len_crc = u32::from_le_bytes(tail[..4].try_into().unwrap());
        if len_crc != masked_crc32c(len_bytes) {
            return Err(format!("record {}: bad length CRC", out.len()));
        }
        let len = usize::try_from(u64::from_le_bytes(len_bytes.try_into().unwrap()))
            .map_err(|e| e.to_string())?;
        let tail = &tail[4..];
        if tail.len() < len + 4 {
            return Err(format!("record {}: truncated", out.len()));
        }
        let (data, tail) = tail.split_at(len);
        let data_crc = u32::from_le_bytes(tail[..4].try_into().unwrap());
        if data_crc != masked_crc32c(data) {
            return Err(format!("record {}: bad data CRC", out.len()));
        }
        out.push(data.to_vec());
        rest = &tail[4..];
    }
    Ok(out)
}

fn events(path: &Path) -> Vec<Event> {
    let bytes = std::fs::read(path).unwrap();
    read_records(&bytes)
        .unwrap()
        .iter()
        .map(|r| <Event as prost::Message>::decode(r.as_slice()).unwrap())
        .collect()
}

fn metrics(step: u64) -> BTreeMap<String, f64> {
    [
        ("objective/scores".to_string(), 0.1 * step as f64),
        ("timing_s/step".to_string(), 2.0 + step as f64),
    ]
    .into()
}

#[test]
fn crc32c_matches_the_standard_check_value() {
    // The check value of CRC-32C (RFC 3720, B.4): the CRC of the ASCII digits 1..9.
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    // RFC 3720 B.4: 32 bytes of zeros.
    assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    assert_eq!(crc32c(b""), 0);
}

#[test]
fn steps_read_back_with_tags_values_and_the_sample_table() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("tb/run");
    let mut w = EventWriter::create(&dir, 1).unwrap();
    let samples = [
        Sample {
            prompt: "1+1=".into(),
            response: "2 | two\nlines".into(),
            score: 1.0,
        },
        Sample {
            prompt: "<b>".into(),
            response: "x".into(),
            score: -0.25,
        },
    ];
    for step in 1..=3 {
        w.write_step(step, &metrics(step), (step == 2).then_some(&samples[..]))
            .unwrap();
    }
    let name = w.path().file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with(FILE_PREFIX), "{name}");
    assert_eq!(w.path().parent(), Some(dir.as_path()));
    let ev = events(w.path());
    assert_eq!(ev.len(), 5, "{ev:?}");
    assert_eq!(ev[0].what, Some(What::FileVersion(FILE_VERSION.into())));
    assert_eq!(ev[1].step, 1);
    assert!(matches!(&ev[1].what, Some(What::SessionLog(s)) if s.status == proto::SESSION_START));
    for (i, e) in ev[2..].iter().enumerate() {
        let step = i as u64 + 1;
        assert_eq!(e.step, step as i64);
        assert!(e.wall_time > 1.0e9, "{}", e.wall_time);
        let Some(What::Summary(s)) = &e.what else {
            panic!("step {step}: {e:?}")
        };
        let mut scalars = BTreeMap::new();
        let mut texts = Vec::new();
        for v in &s.value {
            match &v.value {
                Some(Kind::SimpleValue(x)) => {
                    scalars.insert(v.tag.clone(), f64::from(*x));
                }
                Some(Kind::Tensor(t)) => {
                    assert_eq!(v.tag, SAMPLES_TAG);
                    assert_eq!(t.dtype, proto::DT_STRING);
                    let plugin = v.metadata.as_ref().and_then(|m| m.plugin_data.as_ref());
                    assert_eq!(plugin.map(|p| p.plugin_name.as_str()), Some("text"));
                    texts.push(String::from_utf8(t.string_val.concat()).unwrap());
                }
                None => panic!("empty value {v:?}"),
            }
        }
        let want = metrics(step);
        assert_eq!(
            scalars.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>()
        );
        for (k, x) in &want {
            assert!(
                (scalars[k] - x).abs() < 1e-6,
                "{k} at {step}: {}",
                scalars[k]
            );
        }
        if step == 2 {
            assert_eq!(texts.len(), 1);
            let t = &texts[0];
            let rows: Vec<&str> = t.lines().collect();
            assert_eq!(rows.len(), 4, "{t}");
            assert_eq!(rows[0], "| prompt | response | score |");
            assert_eq!(rows[2], "| 1+1= | 2 \\| two<br>lines | 1.000 |");
            assert_eq!(rows[3], "| &lt;b&gt; | x | -0.250 |");
        } else {
            assert!(texts.is_empty(), "{texts:?}");
        }
    }
}

#[test]
fn the_wire_field_numbers_are_those_of_event_proto() {
    // The first byte of an encoded message is the key of its first field:
    // field number << 3 | wire type (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).
    let key = |e: &Event| prost::Message::encode_to_vec(e)[0];
    let bare = |what| Event {
        wall_time: 0.0,
        step: 0,
        what: Some(what),
    };
    assert_eq!(key(&bare(What::FileVersion("x".into()))), 3 << 3 | 2);
    let summary = proto::Summary { value: vec![] };
    assert_eq!(key(&bare(What::Summary(summary))), 5 << 3 | 2);
    let start = proto::SessionLog {
        status: proto::SESSION_START,
    };
    assert_eq!(key(&bare(What::SessionLog(start.clone()))), 7 << 3 | 2);
    assert_eq!(prost::Message::encode_to_vec(&start), [1 << 3, 1]);
    let timed = Event {
        wall_time: 1.0,
        step: 0,
        what: None,
    };
    assert_eq!(key(&timed), 1 << 3 | 1);
    let stepped = Event {
        wall_time: 0.0,
        step: 1,
        what: None,
    };
    assert_eq!(prost::Message::encode_to_vec(&stepped), [2 << 3, 1]);
    let v = text_value("t", "x");
    let bytes = prost::Message::encode_to_vec(&v);
    // tag (1), then the tensor (8) and metadata (9) as prost orders them by number.
    assert_eq!(bytes[0], 1 << 3 | 2);
    let scalar = proto::Value {
        tag: String::new(),
        metadata: None,
        value: Some(Kind::SimpleValue(1.0)),
    };
    assert_eq!(prost::Message::encode_to_vec(&scalar)[0], 2 << 3 | 5);
    let tensor = proto::TensorProto {
        dtype: proto::DT_STRING,
        tensor_shape: None,
        string_val: vec![b"s".to_vec()],
    };
    assert_eq!(
        prost::Message::encode_to_vec(&tensor),
        [1 << 3, 7, 8 << 3 | 2, 1, b's']
    );
}

#[test]
fn a_corrupted_byte_fails_the_crc_check() {
    let d = tempfile::tempdir().unwrap();
    let mut w = EventWriter::create(d.path(), 1).unwrap();
    w.write_step(1, &metrics(1), None).unwrap();
    let good = std::fs::read(w.path()).unwrap();
    assert_eq!(read_records(&good).unwrap().len(), 3);
    // Every single-byte change anywhere in the file is caught by one of the two CRCs.
    for i in 0..good.len() {
        let mut bad = good.clone();
        bad[i] ^= 0x01;
        assert!(read_records(&bad).is_err(), "byte {i} changed unnoticed");
    }
}

#[test]
fn each_start_gets_a_new_file_that_sorts_after_the_previous_one() {
    let d = tempfile::tempdir().unwrap();
    let first = EventWriter::create(d.path(), 1).unwrap();
    let second = EventWriter::create(d.path(), 4).unwrap();
    assert_ne!(first.path(), second.path());
    assert!(first.path() < second.path());
    let ev = events(second.path());
    assert_eq!(ev.len(), 2);
    assert_eq!(ev[1].step, 4);
    assert!(matches!(&ev[1].what, Some(What::SessionLog(_))));
}

#[test]
fn a_directory_that_cannot_be_made_is_an_error_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let blocker = d.path().join("file");
    std::fs::write(&blocker, b"x").unwrap();
    let err = EventWriter::create(&blocker.join("tb"), 1)
        .err()
        .expect("a directory under a file")
        .to_string();
    assert!(err.contains(&blocker.display().to_string()), "{err}");
}
