//! Fuzzing of the batch decoders with proptest: whatever bytes or chunks a peer sends, the
//! decoder answers Ok or a clear error, never a panic or an allocation the input did not
//! pay for. Cases per property: `RLHF_FUZZ_CASES` (default 64, what CI runs); for a long
//! run: `RLHF_FUZZ_CASES=100000 cargo test --release --workspace --test fuzz_decoders`.

use proptest::prelude::*;
use rlhf_core::batch::{decode, encode, encode_chunks, Assembler, DataBatch, TensorData};
use rlhf_proto::v1 as pb;

fn cases() -> u32 {
    std::env::var("RLHF_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

fn sample() -> DataBatch {
    let ids: Vec<i64> = (0..24).collect();
    let f: Vec<f32> = (0..24).map(|i| i as f32 * 0.5).collect();
    DataBatch::new()
        .with_tensor("input_ids", TensorData::from_i64(vec![4, 6], &ids).unwrap())
        .with_tensor("values", TensorData::from_f32(vec![4, 6], &f).unwrap())
        .with_column(
            "text",
            (0..4)
                .map(|i| serde_json::json!(format!("row {i}")))
                .collect(),
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn mutated_batches_decode_or_fail_cleanly(
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
        extra in proptest::collection::vec(any::<u8>(), 0..16),
    ) {
        let mut bytes = encode(&sample()).unwrap();
        for (at, v) in flips {
            let n = bytes.len();
            bytes[at % n] = v;
        }
        bytes.truncate(cut % (bytes.len() + 1));
        bytes.extend_from_slice(&extra);
        if let Ok(b) = decode(&bytes) {
            // Whatever decoded is a consistent batch.
            let _ = b.len();
        }
    }

    #[test]
    fn chunk_streams_never_panic_and_respect_the_limit(
        chunks in proptest::collection::vec(
            (0u32..6, any::<u64>(), proptest::collection::vec(any::<u8>(), 0..256)),
            0..8,
        ),
    ) {
        let mut a = Assembler::new(1 << 16);
        for (index, total_bytes, data) in chunks {
            let r = a.push(pb::BatchChunk { index, total_bytes, data: data.into(), shared: None });
            prop_assert!(a.received_bytes() <= 1 << 16);
            if r.is_err() {
                break;
            }
        }
    }

    #[test]
    fn a_real_stream_with_one_bad_chunk_fails_cleanly(at in any::<usize>(), v in any::<u8>()) {
        let mut chunks = encode_chunks(&sample(), 64).unwrap();
        let n = chunks.len();
        let c = &mut chunks[at % n];
        if !c.data.is_empty() {
            let mut d = c.data.to_vec();
            let k = at % d.len();
            d[k] ^= v | 1;
            c.data = d.into();
        }
        let mut a = Assembler::new(1 << 20);
        let mut ok = true;
        for c in chunks {
            if a.push(c).is_err() {
                ok = false;
                break;
            }
        }
        if ok {
            let _ = a.finish();
        }
    }
}
