//! `rlhf-head run` and `rlhf-head check`: the PPO job driver's command line.

use std::path::PathBuf;

use rlhf_core::{Error, Result};

use crate::Connect;

#[derive(clap::Args, Clone)]
pub(crate) struct JobConfigArgs {
    /// Directory of job configs.
    #[arg(long, default_value = "configs")]
    pub(crate) config_dir: PathBuf,
    /// Config name: <config-dir>/<NAME>.yaml (no .yaml).
    #[arg(long, required_unless_present = "bundle")]
    pub(crate) config_name: Option<String>,
    /// A resolved config bundle (what `submit` hands to the head); replaces --config-name.
    #[arg(long, hide = true, conflicts_with = "config_name")]
    pub(crate) bundle: Option<PathBuf>,
    /// key.path=value overrides, e.g. actor_rollout.ppo_epochs=2.
    pub(crate) overrides: Vec<String>,
}

#[derive(clap::Args, Clone)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) config: JobConfigArgs,
    #[command(flatten)]
    pub(crate) conn: Connect,
    /// Continue from a checkpoint: `latest` or a global_step_N directory.
    #[arg(long)]
    pub(crate) resume: Option<String>,
    /// Job id (set by the head for submitted jobs).
    #[arg(long, hide = true)]
    pub(crate) job_id: Option<String>,
}

#[derive(clap::Args, Clone)]
pub(crate) struct CheckArgs {
    #[command(flatten)]
    pub(crate) config: JobConfigArgs,
}

pub(crate) async fn run(_args: RunArgs) -> Result<()> {
    Err(Error::invalid("rlhf-head run is not implemented yet"))
}

pub(crate) async fn check(_args: CheckArgs) -> Result<()> {
    Err(Error::invalid("rlhf-head check is not implemented yet"))
}
