//! The one error enum of `rdkv-client`.

use std::net::SocketAddr;
use std::time::Duration;

use rdkv_common::fabric::WorkCompletionStatus;

/// Everything a client call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The key is empty or too long.
    #[error("invalid key of {length} bytes: keys must be 1 to {limit} bytes")]
    InvalidKey {
        /// The key's length.
        length: usize,
        /// The longest key.
        limit: usize,
    },
    /// The value is too long.
    #[error("value too large: {length} bytes exceeds the limit of {limit} bytes")]
    ValueTooLarge {
        /// The value's length.
        length: usize,
        /// The longest value.
        limit: usize,
    },
    /// No room: every candidate slot of the key is taken, or the heap has no free chunk.
    #[error("table full: {reason}")]
    TableFull {
        /// Which part is full and what to change.
        reason: String,
    },
    /// The server refused the secret (or the protocol version).
    #[error("authentication failed at {address}: {reason}")]
    AuthenticationFailed {
        /// The node's control address.
        address: SocketAddr,
        /// The server's reason.
        reason: String,
    },
    /// The node cannot be reached or its connection was lost and could not be re-established.
    #[error("node unreachable at {address}: {reason}")]
    NodeUnreachable {
        /// The node's control address.
        address: SocketAddr,
        /// What failed.
        reason: String,
    },
    /// The operation passed its deadline. For a mutation, its effect is unknown.
    #[error("{operation} timed out after {deadline:?}")]
    TimedOut {
        /// The operation.
        operation: &'static str,
        /// The deadline.
        deadline: Duration,
    },
    /// The final compare-and-swap was posted but its completion failed: the mutation may or
    /// may not have happened. It is never retried silently.
    #[error("{operation} outcome unknown: its compare-and-swap completed with {status}")]
    Unresolved {
        /// The operation.
        operation: &'static str,
        /// The completion status.
        status: WorkCompletionStatus,
    },
    /// A one-sided request failed where a retry is not safe or retries ran out.
    #[error("{operation}: a one-sided request completed with {status}")]
    WorkCompletion {
        /// The operation.
        operation: &'static str,
        /// The completion status.
        status: WorkCompletionStatus,
    },
    /// The operation lost its slot CAS race too many times in a row.
    #[error("{operation}: gave up after {attempts} lost compare-and-swap races on one key")]
    Contention {
        /// The operation.
        operation: &'static str,
        /// Attempts made.
        attempts: u32,
    },
    /// Blocks kept failing their checksum after the bounded retries.
    #[error("{operation}: block checksum mismatch after {attempts} attempts")]
    Corrupt {
        /// The operation.
        operation: &'static str,
        /// Attempts made.
        attempts: u32,
    },
    /// The server refused a control request.
    #[error("the server refused: {reason}")]
    Refused {
        /// The server's reason.
        reason: String,
    },
    /// The cluster file is invalid.
    #[error("{reason}")]
    Config {
        /// The validation error (file, line, field).
        reason: String,
    },
    /// The control plane failed.
    #[error("control plane: {0}")]
    Control(#[from] rdkv_common::ControlError),
    /// The fabric or memory layer failed (memlock, connecting the queue pair, ...).
    #[error(transparent)]
    Fabric(#[from] rdkv_common::Error),
}

impl Error {
    /// Whether the failed operation may have taken effect. `false` means it certainly did not.
    pub fn may_have_applied(&self) -> bool {
        matches!(self, Error::Unresolved { .. } | Error::TimedOut { .. })
    }

    /// Whether retrying on a fresh connection is safe and may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::NodeUnreachable { .. } | Error::Control(_))
            || matches!(self, Error::WorkCompletion { status, .. } if status.is_retryable())
    }
}

/// The result type of `rdkv-client`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
