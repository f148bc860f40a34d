//! Training utilities: gradients by parameter name, accumulation over micro-batches, global-norm
//! clipping (`grads`), AdamW with decoupled weight decay (`adamw`, with its offload and ZeRO
//! sharding), and learning-rate schedules (`schedule`).

mod adamw;
mod grads;
mod offload;
mod schedule;
mod step;
mod zero;

use adamw::Moments;

pub use adamw::{AdamW, AdamWConfig};
pub(crate) use grads::add_to;
pub use grads::{GradAccumulator, Gradients};
pub use schedule::{LrSchedule, LrScheduler};
#[cfg(feature = "cuda")]
pub(crate) use step::StepScalars;
pub(crate) use zero::host as host_f32;
pub use zero::{partition, span as shard_span};
