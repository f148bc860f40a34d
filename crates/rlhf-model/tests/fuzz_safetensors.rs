//! Fuzzing of the weight-file reader with proptest: a model directory whose
//! `model.safetensors` has a damaged header (length prefix, JSON, offsets) or is cut short
//! loads with a clear error, never a panic or an allocation the file did not pay for.
//! Cases: `RLHF_FUZZ_CASES` (default 32); for a long run:
//! `RLHF_FUZZ_CASES=20000 cargo test --release --workspace --test fuzz_safetensors`.

mod common;

use proptest::prelude::*;
use rlhf_model::{LoadOptions, Model};

fn cases() -> u32 {
    std::env::var("RLHF_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(32, |n: u32| n.div_ceil(2))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn damaged_weight_files_fail_cleanly(
        flips in proptest::collection::vec((0usize..512, any::<u8>()), 1..6),
        cut in proptest::option::of(any::<usize>()),
    ) {
        let src = common::fixture("tiny-llama");
        let dir = tempfile::tempdir().unwrap();
        for e in std::fs::read_dir(&src).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
        }
        let path = dir.path().join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        // The header: an 8-byte length and the JSON that names every tensor's offsets.
        for (at, v) in flips {
            let n = bytes.len();
            bytes[at % n] = v;
        }
        if let Some(c) = cut {
            bytes.truncate(c % (bytes.len() + 1));
        }
        std::fs::write(&path, &bytes).unwrap();
        let _ = Model::load(dir.path(), &LoadOptions::inference());
    }
}
