//! One error type for the control plane. Failures that drive scheduling carry a
//! [`FailureKind`] and a retryable flag as data, so callers never parse message text.

use rlhf_proto::v1 as pb;

/// What went wrong, as data the scheduler and clients can act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    InvalidArgument,
    NotFound,
    Unauthenticated,
    VersionMismatch,
    InsufficientResources,
    Timeout,
    Unavailable,
    ActorDied,
    Internal,
}

impl FailureKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::InvalidArgument => "invalid_argument",
            FailureKind::NotFound => "not_found",
            FailureKind::Unauthenticated => "unauthenticated",
            FailureKind::VersionMismatch => "version_mismatch",
            FailureKind::InsufficientResources => "insufficient_resources",
            FailureKind::Timeout => "timeout",
            FailureKind::Unavailable => "unavailable",
            FailureKind::ActorDied => "actor_died",
            FailureKind::Internal => "internal",
        }
    }

    /// Whether retrying the same call later may succeed.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            FailureKind::Timeout | FailureKind::Unavailable | FailureKind::InsufficientResources
        )
    }

    pub fn parse(s: &str) -> Option<Self> {
        use FailureKind::*;
        [
            InvalidArgument,
            NotFound,
            Unauthenticated,
            VersionMismatch,
            InsufficientResources,
            Timeout,
            Unavailable,
            ActorDied,
            Internal,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }

    fn code(self) -> tonic::Code {
        match self {
            FailureKind::InvalidArgument => tonic::Code::InvalidArgument,
            FailureKind::NotFound => tonic::Code::NotFound,
            FailureKind::Unauthenticated => tonic::Code::Unauthenticated,
            FailureKind::VersionMismatch => tonic::Code::FailedPrecondition,
            FailureKind::InsufficientResources => tonic::Code::ResourceExhausted,
            FailureKind::Timeout => tonic::Code::DeadlineExceeded,
            FailureKind::Unavailable => tonic::Code::Unavailable,
            FailureKind::ActorDied => tonic::Code::Aborted,
            FailureKind::Internal => tonic::Code::Internal,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{message}")]
    Failure { kind: FailureKind, message: String },
    #[error("protocol version mismatch: this side speaks version {ours}, the peer speaks {theirs}; run the same rlhf release on every node")]
    VersionMismatch { ours: u32, theirs: u32 },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Error::Failure {
            kind,
            message: message.into(),
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(FailureKind::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(FailureKind::NotFound, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(FailureKind::Internal, message)
    }
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    pub fn kind(&self) -> FailureKind {
        match self {
            Error::Failure { kind, .. } => *kind,
            Error::VersionMismatch { .. } => FailureKind::VersionMismatch,
            Error::Io { .. } => FailureKind::Internal,
        }
    }

    /// The failure as protocol data.
    pub fn to_failure(&self) -> pb::Failure {
        pb::Failure {
            kind: self.kind().as_str().to_string(),
            retryable: self.kind().retryable(),
            message: self.to_string(),
        }
    }
}

/// The failure kind travels in a metadata entry so the client side rebuilds the same kind.
pub const FAILURE_KIND_HEADER: &str = "rlhf-failure-kind";

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        let kind = e.kind();
        let mut status = tonic::Status::new(kind.code(), e.to_string());
        if let Ok(v) = kind.as_str().parse() {
            status.metadata_mut().insert(FAILURE_KIND_HEADER, v);
        }
        status
    }
}

impl From<tonic::Status> for Error {
    fn from(s: tonic::Status) -> Self {
        let kind = s
            .metadata()
            .get(FAILURE_KIND_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(FailureKind::parse)
            .unwrap_or(match s.code() {
                tonic::Code::Unauthenticated => FailureKind::Unauthenticated,
                tonic::Code::Unavailable => FailureKind::Unavailable,
                tonic::Code::DeadlineExceeded => FailureKind::Timeout,
                tonic::Code::NotFound => FailureKind::NotFound,
                tonic::Code::InvalidArgument => FailureKind::InvalidArgument,
                tonic::Code::ResourceExhausted => FailureKind::InsufficientResources,
                _ => FailureKind::Internal,
            });
        Error::new(kind, s.message().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_through_status() {
        for kind in [
            FailureKind::InvalidArgument,
            FailureKind::InsufficientResources,
            FailureKind::VersionMismatch,
            FailureKind::ActorDied,
            FailureKind::Timeout,
        ] {
            let status: tonic::Status = Error::new(kind, "boom").into();
            let back: Error = status.into();
            assert_eq!(back.kind(), kind);
            assert_eq!(back.to_failure().retryable, kind.retryable());
        }
    }

    #[test]
    fn retryable_only_for_transient_kinds() {
        assert!(FailureKind::Unavailable.retryable());
        assert!(FailureKind::InsufficientResources.retryable());
        assert!(!FailureKind::Unauthenticated.retryable());
        assert!(!FailureKind::VersionMismatch.retryable());
    }

    #[test]
    fn version_mismatch_names_both_versions() {
        let msg = Error::VersionMismatch { ours: 1, theirs: 7 }.to_string();
        assert!(msg.contains("version 1") && msg.contains('7'), "{msg}");
    }
}
