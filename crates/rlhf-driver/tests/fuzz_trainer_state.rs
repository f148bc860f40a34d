//! Fuzzing of the trainer-state reader with proptest: a checkpoint whose
//! `trainer_state.json` (or `latest_checkpointed_iteration.txt`) was damaged resolves to an
//! error that names the file, never a panic, whether its signature is checked (a damaged
//! file no longer matches it) or trusted (the parser sees the damage). Cases: `RLHF_FUZZ_CASES` (default 64).

use proptest::prelude::*;
use rlhf_core::seal::CheckpointKey;
use rlhf_driver::checkpoint::{self, Seal, TrainerState, LATEST_FILE, STATE_FILE};

fn cases() -> u32 {
    std::env::var("RLHF_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn damaged_trainer_states_fail_cleanly(
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
        cut in proptest::option::of(any::<usize>()),
        latest in proptest::option::of(".{0,24}"),
    ) {
        let root = tempfile::tempdir().unwrap();
        let mut st = TrainerState::new("ppo", 3, Default::default(), 7, "job");
        st.kl_ctl = Some(rlhf_algo::KlController::Fixed { value: 0.1 });
        let key = CheckpointKey::from_secret(b"token", "the cluster token");
        let dir = checkpoint::commit(root.path(), &st, &key).unwrap();
        let path = dir.join(STATE_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        for (at, v) in flips {
            let n = bytes.len();
            bytes[at % n] = v;
        }
        if let Some(c) = cut {
            bytes.truncate(c % (bytes.len() + 1));
        }
        std::fs::write(&path, &bytes).unwrap();
        if let Some(l) = latest {
            std::fs::write(root.path().join(LATEST_FILE), l).unwrap();
        }
        for seal in [Seal::Verify(&key), Seal::Trust] {
            if let Err(e) = checkpoint::resolve(root.path(), "latest", seal) {
                // The error says where: the checkpoint directory or the file in it.
                let e = e.to_string();
                prop_assert!(e.contains(&root.path().display().to_string()), "{}", e);
            }
        }
    }
}
