//! The crate's one error type.

use std::fmt;
use std::time::Duration;

/// Which collective operation an error happened in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Connecting the ranks to each other.
    Rendezvous,
    /// `broadcast` and its typed and multi-part variants.
    Broadcast,
    /// `all_reduce_f32` / `all_reduce_f64`.
    AllReduce,
    /// `all_gather`.
    AllGather,
    /// `barrier`.
    Barrier,
    /// A [`crate::BucketedSync`] weight transfer (manifest check or a bucket).
    WeightSync,
    /// `reduce_scatter_f32`.
    ReduceScatter,
}

impl Op {
    /// Stable one-byte id used in the wire header.
    pub(crate) fn wire_id(self) -> u8 {
        match self {
            Op::Rendezvous => 1,
            Op::Broadcast => 2,
            Op::AllReduce => 3,
            Op::AllGather => 4,
            Op::Barrier => 5,
            Op::WeightSync => 6,
            Op::ReduceScatter => 7,
        }
    }

    pub(crate) fn from_wire_id(id: u8) -> Option<Op> {
        Some(match id {
            1 => Op::Rendezvous,
            2 => Op::Broadcast,
            3 => Op::AllReduce,
            4 => Op::AllGather,
            5 => Op::Barrier,
            6 => Op::WeightSync,
            7 => Op::ReduceScatter,
            _ => return None,
        })
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Rendezvous => "rendezvous",
            Op::Broadcast => "broadcast",
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::Barrier => "barrier",
            Op::WeightSync => "weight_sync",
            Op::ReduceScatter => "reduce_scatter",
        })
    }
}

/// Coarse classification of an [`Error`], for callers that branch on it
/// (for example: retry the rendezvous on `Timeout`, abort the job on `Mismatch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A peer made no progress within the configured timeout.
    Timeout,
    /// A peer closed its connection (it exited, crashed or aborted the op).
    PeerClosed,
    /// Any other I/O failure.
    Io,
    /// Ranks disagree about the call (op, sequence number, length, root, parameters).
    Mismatch,
    /// The backend cannot be used (library missing, communicator broken by an earlier error).
    Unavailable,
    /// The caller passed an argument that can never work (root out of range, ...).
    InvalidArgument,
    /// A peer failed the communicator's authentication (wrong or missing secret).
    Auth,
}

/// Formats an optional peer rank for messages.
struct PeerName(Option<usize>);

impl fmt::Display for PeerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(p) => write!(f, "peer rank {p}"),
            None => f.write_str("an unknown peer"),
        }
    }
}

/// Errors from every communicator backend and from [`crate::BucketedSync`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A wait for a peer made no progress within the timeout.
    #[error(
        "{op} timed out on rank {rank}: {} made no progress within {timeout:?}{detail}",
        PeerName(*.peer)
    )]
    Timeout {
        op: Op,
        rank: usize,
        peer: Option<usize>,
        timeout: Duration,
        /// Cause and advice, starting with "; " when not empty.
        detail: String,
    },

    /// A peer closed its end of the connection.
    #[error(
        "{op} failed on rank {rank}: peer rank {peer} closed the connection ({detail}); \
         it exited or aborted after its own error: check that rank's log"
    )]
    PeerClosed {
        op: Op,
        rank: usize,
        peer: usize,
        detail: String,
    },

    /// Any other I/O error.
    #[error("{op} failed on rank {rank} ({context}, {}): {source}", PeerName(*.peer))]
    Io {
        op: Op,
        rank: usize,
        peer: Option<usize>,
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// The ranks disagree about what is being called.
    #[error("{op} mismatch on rank {rank} with {}: {detail}", PeerName(*.peer))]
    Mismatch {
        op: Op,
        rank: usize,
        peer: Option<usize>,
        detail: String,
    },

    /// The backend cannot be used.
    #[error("{backend} communicator unavailable: {reason}")]
    Unavailable {
        backend: &'static str,
        reason: String,
    },

    /// An argument that can never work.
    #[error("invalid argument to {op}: {detail}")]
    InvalidArgument { op: Op, detail: String },

    /// A peer could not prove it holds the communicator's secret.
    #[error("rendezvous authentication failed on rank {rank} with {}: {detail}", PeerName(*.peer))]
    Auth {
        rank: usize,
        peer: Option<usize>,
        detail: String,
    },
}

impl Error {
    /// The coarse kind of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::PeerClosed { .. } => ErrorKind::PeerClosed,
            Error::Io { .. } => ErrorKind::Io,
            Error::Mismatch { .. } => ErrorKind::Mismatch,
            Error::Unavailable { .. } => ErrorKind::Unavailable,
            Error::InvalidArgument { .. } => ErrorKind::InvalidArgument,
            Error::Auth { .. } => ErrorKind::Auth,
        }
    }

    /// The peer rank the error is about, when known.
    pub fn peer(&self) -> Option<usize> {
        match self {
            Error::Timeout { peer, .. }
            | Error::Io { peer, .. }
            | Error::Mismatch { peer, .. }
            | Error::Auth { peer, .. } => *peer,
            Error::PeerClosed { peer, .. } => Some(*peer),
            Error::Unavailable { .. } | Error::InvalidArgument { .. } => None,
        }
    }

    /// The op the error happened in, when there is one.
    pub fn op(&self) -> Option<Op> {
        match self {
            Error::Timeout { op, .. }
            | Error::PeerClosed { op, .. }
            | Error::Io { op, .. }
            | Error::Mismatch { op, .. }
            | Error::InvalidArgument { op, .. } => Some(*op),
            Error::Auth { .. } => Some(Op::Rendezvous),
            Error::Unavailable { .. } => None,
        }
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
