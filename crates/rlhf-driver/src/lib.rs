//! The job driver (single controller, as in verl): places the roles on the cluster as
//! actor processes, then runs an algorithm's steps; for PPO
//!
//! generate → (old log-probs, ref log-probs, values, scores: concurrently) → token rewards
//! and advantages (rlhf-algo, here) → critic and actor updates (concurrently) → weight sync
//! trainer → rollout → metrics → checkpoint,
//!
//! with a resumable trainer state, JSONL metrics under TRL's names plus `timing_s/*` and
//! `perf/*`, a progress line and a sample table, all through `report`'s reporters. It never
//! loads a model itself: the head runs it without candle-nn or CUDA.

pub mod checkpoint;
pub mod cluster;
pub mod group;
mod job;
pub mod output;
pub mod prompts;
pub mod report;
pub mod role_env;
pub mod snapshot;
pub mod tensorboard;

pub use job::{run, DriverOptions, JobSummary, RunError};
/// The metric names the job logs (rlhf-algo owns them).
pub use rlhf_algo::metric;
