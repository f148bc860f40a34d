//! The crate's single error type.

/// Everything that can go wrong in the PPO math. Every variant names the tensor,
/// key or input at fault so the caller can report it without parsing strings.
#[derive(Debug, thiserror::Error)]
pub enum AlgoError {
    /// Two tensors that must have the same shape do not.
    #[error("{tensor}: shape {got:?} does not match {other} {expected:?}")]
    ShapeMismatch {
        tensor: &'static str,
        got: Vec<usize>,
        other: &'static str,
        expected: Vec<usize>,
    },
    /// A tensor has the wrong number of dimensions.
    #[error("{tensor}: expected {expected}, got shape {got:?}")]
    BadRank {
        tensor: &'static str,
        expected: &'static str,
        got: Vec<usize>,
    },
    /// A tensor has a dtype this crate does not compute in.
    #[error("{tensor}: dtype {got} is not supported; convert it to f32 first")]
    DType { tensor: &'static str, got: String },
    /// A NaN or infinity was found in an input.
    #[error("{tensor}: contains {kind} at {index:?}; the producer of this tensor overflowed or divided by zero")]
    NonFinite {
        tensor: &'static str,
        kind: &'static str,
        index: Vec<usize>,
    },
    /// A mask selects nothing, so every masked statistic would divide by zero.
    #[error(
        "{tensor}: mask has no valid (1.0) position; every batch needs at least one response token"
    )]
    EmptyMask { tensor: &'static str },
    /// A mask holds something other than 0.0 and 1.0.
    #[error("{tensor}: mask values must be 0.0 or 1.0, found {value} at {index:?}")]
    NonBinaryMask {
        tensor: &'static str,
        value: f32,
        index: Vec<usize>,
    },
    /// A name (estimator, KL penalty, aggregation mode, ...) is not known.
    #[error("unknown {kind} `{got}`; valid names: {valid}")]
    UnknownName {
        kind: &'static str,
        got: String,
        valid: String,
    },
    /// A configuration value is out of its valid range.
    #[error("invalid {key} = {value}: {reason}")]
    InvalidConfig {
        key: &'static str,
        value: String,
        reason: String,
    },
    /// A non-tensor input (group ids, EOS flags, ...) is inconsistent with the batch.
    #[error("{input}: {reason}")]
    InvalidInput { input: &'static str, reason: String },
    /// An error from candle itself (device, allocation, ...).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, AlgoError>;
