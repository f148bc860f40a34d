//! PPO role actors: the processes `rlhf-worker actor --kind actor_rollout|ref|critic|reward`
//! runs, each serving `RoleService` (proto/rlhf/v1/role.proto) plus `ActorService` (Ping).
//!
//! The role logic is plain synchronous structs — [`Trainer`] (trainable policy, PPO update
//! with data-parallel exact loss scaling), [`Rollout`] (generation, receives weights),
//! [`RefPolicy`], [`Critic`] and [`Reward`] (rules, HTTP, reward model) — owned by
//! [`RoleActor`] on one compute thread; [`server`] is the thin gRPC adapter.
//!
//! Tensors per call (B rows, P = max_prompt_length, R = max_response_length; ids and masks
//! I64, the rest F32):
//!
//! | call | request | response |
//! | --- | --- | --- |
//! | Generate | `prompt_ids`, `prompt_mask` [B,P]; meta `seed`, `step` | `responses`, `response_mask`, `rollout_log_probs` [B,R] |
//! | ComputeLogProbs | `input_ids`, `attention_mask` [B,P+R]; meta `response_length` | `log_probs`, `entropy` [B,R] |
//! | ComputeValues | `input_ids`, `attention_mask` [B,P+R] | `values` [B,R] |
//! | ComputeScores | `input_ids`, `attention_mask`, `responses`, `response_mask`; columns `prompt_text`, `response_text` (and `ground_truth` for `exact_match`) | `scores` [B] |
//! | UpdateActor | `input_ids`, `attention_mask`, `response_mask`, `old_log_probs`, `advantages` (+ `ref_log_probs` with use_kl_loss); meta `step` | no rows; meta: metrics |
//! | UpdateCritic | `input_ids`, `attention_mask`, `response_mask`, `values`, `returns`; meta `step` | no rows; meta: metrics |

pub mod actor;
pub mod comm;
pub mod convert;
pub mod error;
pub mod reward;
pub mod roles;
pub mod server;
pub mod train;
pub mod weights;

pub use actor::{BatchCall, RoleActor};
pub use comm::Groups;
pub use error::{Error, Result};
pub use reward::{HttpReward, Reward, Rule};
pub use roles::{Critic, RefPolicy, Rollout, Shapes, Trainer};
pub use server::{run, serve, ServeOptions};
