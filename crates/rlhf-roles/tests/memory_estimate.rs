//! `rlhf-head check`'s per-device memory estimate against what a trainer really uses
//! (`common::peak`): one SFT rank, stage 0, within 25 % of the estimate's total for the
//! trainer rank. One test in this binary, so that no other test's memory is counted.

mod common;

use common::peak::{compare, sft_peak};

#[test]
fn check_estimates_a_trainers_peak_memory_within_25_percent() {
    let (row, used) = sft_peak(1, |_| {});
    compare("stage 0", &row, used, 1, 0.25);
}
