//! `rlhf-head check`'s memory estimate for ZeRO stage 3 against what two trainer ranks
//! really use (`common::peak`): each holds half of the parameters, of their summed gradient
//! and of AdamW's moments, and gathers a layer at a time; the process's peak while they
//! train is within 25 % of two ranks' estimates. One test in this binary, so that no other
//! test's memory is counted.

mod common;

use common::peak::{compare, sft_peak};

#[test]
fn check_estimates_the_peak_of_two_stage_3_ranks_within_25_percent() {
    let (row, used) = sft_peak(2, |cfg| cfg.training.zero_stage = 3);
    compare("stage 3", &row, used, 2, 0.25);
}
