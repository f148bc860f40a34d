//! The seam between the loop and what a step does. The loop (`super`) owns the roles, the
//! prompt sampler, the rollout source, weight sync, checkpoints and reporting; an
//! [`Algorithm`] owns the math of one step and the state it keeps across steps. PPO and the
//! critic-free estimators (GRPO, RLOO, REINFORCE++) are one implementation, `super::ppo`;
//! a new one (DPO, say) is a new type here, not a new loop. Async rollout is the loop's
//! (`super::pipeline`): an algorithm gets each step's batch and never sees when it was made.

use std::collections::BTreeMap;

use rlhf_core::{Error, Result};

use crate::checkpoint::TrainerState;
use crate::output::Sample;

use super::rollout::Rollout;
use super::{Loop, Res};

/// What one step gives the loop.
pub(crate) struct StepOutput {
    /// Metrics under the names of `rlhf_algo::metric`.
    pub metrics: BTreeMap<String, f64>,
    /// The first `logging.sample_rows` samples of the step, for the sample table.
    pub samples: Vec<Sample>,
}

/// One training algorithm over the job's worker groups.
pub(crate) trait Algorithm {
    /// Its name in checkpoints: a checkpoint resumes only under the algorithm that wrote it.
    const NAME: &'static str;

    /// Takes the state it keeps across steps from the checkpoint being resumed (written by
    /// this algorithm: [`check_resume`] ran first).
    fn resume(&mut self, state: &TrainerState) -> Result<()>;

    /// Puts that state into the checkpoint being written.
    fn save(&self, state: &mut TrainerState);

    /// One step, from the step's batch (admitted by the loop) to updated trainer weights;
    /// the loop syncs them to the rollout ranks on its schedule. `step` counts from 1.
    async fn step(&mut self, cx: &mut Loop<'_>, step: u64, ro: Rollout) -> Res<StepOutput>;
}

/// Refuses a checkpoint another algorithm wrote (its state would be read as this one's).
pub(crate) fn check_resume<A: Algorithm>(
    state: &TrainerState,
    dir: &std::path::Path,
) -> Result<()> {
    if state.algorithm != A::NAME {
        return Err(Error::invalid(format!(
            "{} was written by algorithm {:?}, and this job runs {:?}; resume it with the config that wrote it, or start without --resume",
            dir.display(),
            state.algorithm,
            A::NAME
        )));
    }
    Ok(())
}
