//! `rlhf-head check`'s memory estimate for ZeRO stage 3 with LoRA against what two trainer
//! ranks really use (`common::peak`): each holds half of the frozen base and of the adapters
//! and gathers a layer at a time; the process's peak while they train is within 25 % of two
//! ranks' estimates. One test in this binary, so that no other test's memory is counted.

mod common;

use common::peak::{compare, sft_peak};

#[test]
fn check_estimates_the_peak_of_two_stage_3_lora_ranks_within_25_percent() {
    let (row, used) = sft_peak(2, |cfg| {
        cfg.training.zero_stage = 3;
        let l = &mut cfg.actor_rollout.lora;
        l.rank = 8;
        l.alpha = 16.0;
        l.target_modules = vec!["all-linear".into()];
    });
    compare("stage 3 with LoRA", &row, used, 2, 0.25);
}
