//! The crate's error type and its mapping to the control plane's failure kinds.

use rlhf_core::FailureKind;

/// Everything a role can fail with. Messages name the role, rank, tensor and shape
/// where they are known (the RPC layer adds the role and rank as context).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request the role cannot serve as sent (missing tensor, wrong shape, bad config).
    #[error("{0}")]
    Invalid(String),
    /// A bug or an unexpected state on this side.
    #[error("{0}")]
    Internal(String),
    /// A NaN or infinity in a loss, gradient or input.
    #[error("non-finite {tensor} in {role} rank {rank} at step {step}")]
    NonFinite {
        tensor: String,
        role: rlhf_core::RoleKind,
        rank: usize,
        step: u64,
    },
    /// The reward endpoint failed or answered something unusable.
    #[error("reward endpoint {url}: {reason}")]
    Http { url: String, reason: String },
    #[error(transparent)]
    Model(#[from] rlhf_model::Error),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Algo(#[from] rlhf_algo::AlgoError),
    #[error(transparent)]
    Collective(#[from] rlhf_collective::Error),
    #[error(transparent)]
    Config(#[from] rlhf_config::ConfigError),
    #[error(transparent)]
    Core(#[from] rlhf_core::Error),
    /// Another error with what was being done.
    #[error("{context}: {source}")]
    Context {
        context: String,
        #[source]
        source: Box<Error>,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::Invalid(msg.into())
    }

    pub fn internal(msg: impl Into<String>) -> Self {
        Error::Internal(msg.into())
    }

    /// The failure kind the driver sees; nothing here is worth retrying as is except
    /// a collective timeout (a peer may have been slow to join).
    pub fn kind(&self) -> FailureKind {
        match self {
            Error::Invalid(_) | Error::Config(_) | Error::Algo(_) => FailureKind::InvalidArgument,
            Error::Model(e) => match e {
                rlhf_model::Error::InvalidArgument(_)
                | rlhf_model::Error::MissingFile { .. }
                | rlhf_model::Error::ShapeMismatch { .. }
                | rlhf_model::Error::MissingTensor { .. }
                | rlhf_model::Error::Config(_)
                | rlhf_model::Error::UnsupportedArchitecture { .. }
                | rlhf_model::Error::PromptTooLong { .. } => FailureKind::InvalidArgument,
                _ => FailureKind::Internal,
            },
            Error::Collective(e) => match e.kind() {
                rlhf_collective::ErrorKind::Timeout => FailureKind::Timeout,
                rlhf_collective::ErrorKind::Auth => FailureKind::Unauthenticated,
                rlhf_collective::ErrorKind::InvalidArgument
                | rlhf_collective::ErrorKind::Mismatch => FailureKind::InvalidArgument,
                _ => FailureKind::Internal,
            },
            Error::Core(e) => e.kind(),
            Error::Context { source, .. } => source.kind(),
            Error::NonFinite { .. } | Error::Internal(_) | Error::Candle(_) => {
                FailureKind::Internal
            }
            Error::Http { .. } => FailureKind::Internal,
        }
    }

    /// Whether the device ran out of memory (CUDA's `CUDA_ERROR_OUT_OF_MEMORY`, as candle
    /// and cudarc report it), here or in an error this one wraps.
    pub fn is_out_of_memory(&self) -> bool {
        let s = self.to_string();
        s.contains("CUDA_ERROR_OUT_OF_MEMORY") || s.contains("out of memory")
    }

    /// Wraps the error with what was being done.
    pub fn context(self, context: impl Into<String>) -> Self {
        Error::Context {
            context: context.into(),
            source: Box::new(self),
        }
    }
}

impl From<Error> for rlhf_core::Error {
    fn from(e: Error) -> Self {
        rlhf_core::Error::new(e.kind(), e.to_string())
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        rlhf_core::Error::from(e).into()
    }
}

/// `.ctx("what")` on any result whose error converts into [`Error`].
pub trait Ctx<T> {
    fn ctx(self, context: impl Into<String>) -> Result<T>;
    fn with_ctx<F: FnOnce() -> String>(self, f: F) -> Result<T>;
}

impl<T, E: Into<Error>> Ctx<T> for std::result::Result<T, E> {
    fn ctx(self, context: impl Into<String>) -> Result<T> {
        self.map_err(|e| e.into().context(context))
    }
    fn with_ctx<F: FnOnce() -> String>(self, f: F) -> Result<T> {
        self.map_err(|e| e.into().context(f()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_survive_context_and_reach_the_status() {
        let e = Error::invalid("missing tensor 'input_ids'").context("actor_rollout rank 1");
        assert_eq!(e.kind(), FailureKind::InvalidArgument);
        assert_eq!(
            e.to_string(),
            "actor_rollout rank 1: missing tensor 'input_ids'"
        );
        let status: tonic::Status = e.into();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        let nf = Error::NonFinite {
            tensor: "loss".into(),
            role: rlhf_core::RoleKind::Critic,
            rank: 0,
            step: 3,
        };
        assert_eq!(nf.to_string(), "non-finite loss in critic rank 0 at step 3");
        assert!(!nf.kind().retryable());
    }

    #[test]
    fn out_of_memory_is_seen_through_contexts_and_gets_the_remedy_of_its_call() {
        // How candle reports cudarc's driver error.
        let oom = Error::Candle(candle_core::Error::Msg(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
        ))
        .context("generating");
        assert!(oom.is_out_of_memory());
        assert!(!Error::invalid("a bad prompt")
            .context("x")
            .is_out_of_memory());
        let gen = crate::host::out_of_memory_remedy(rlhf_proto::BatchCall::Generate);
        assert!(
            gen.contains("actor_rollout.max_response_length")
                && gen.contains("actor_rollout.offload=true"),
            "{gen}"
        );
        let train = crate::host::out_of_memory_remedy(rlhf_proto::BatchCall::UpdateActor);
        assert!(
            train.contains("training.micro_batch_size")
                && train.contains("training.gradient_checkpointing=true"),
            "{train}"
        );
    }
}
