//! The one error enum of `rdkv-client`.
//!
//! Every variant says whether the failed operation **certainly did not apply** or **may have
//! applied**, and [`Error::may_have_applied`] answers it for a value. Only two variants may have
//! applied: [`Error::Unresolved`] (a failure after a publishing CAS was posted) and
//! [`Error::TimedOut`] with `may_have_applied: true`. An operation is never retried internally
//! once any CAS of it has been posted (`docs/protocol.md`, *Failures*).

use std::net::SocketAddr;
use std::time::Duration;

use rdkv_fabric::WorkCompletionStatus;

/// Everything a client call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The key is empty or too long. Did not apply.
    #[error("invalid key of {length} bytes: keys must be 1 to {limit} bytes")]
    InvalidKey {
        /// The key's length.
        length: usize,
        /// The longest key.
        limit: usize,
    },
    /// The value is too long. Did not apply.
    #[error("value too large: {length} bytes exceeds the limit of {limit} bytes")]
    ValueTooLarge {
        /// The value's length.
        length: usize,
        /// The longest value.
        limit: usize,
    },
    /// No room: every candidate slot of the key is taken, or the heap has no free chunk. Did
    /// not apply.
    #[error("table full: {reason}")]
    TableFull {
        /// Which part is full and what to change.
        reason: String,
    },
    /// The server refused the secret (or the protocol version). Did not apply.
    #[error("authentication failed at {address}: {reason}")]
    AuthenticationFailed {
        /// The node's control address.
        address: SocketAddr,
        /// The server's reason.
        reason: String,
    },
    /// The node cannot be reached or its connection was lost and could not be re-established.
    /// Did not apply: a connection fails this way only before the operation posted anything
    /// (afterwards, the failure is [`Error::Unresolved`] or [`Error::WorkCompletion`]).
    #[error("node unreachable at {address}: {reason}")]
    NodeUnreachable {
        /// The node's control address.
        address: SocketAddr,
        /// What failed.
        reason: String,
    },
    /// The operation passed its deadline. `may_have_applied` says whether a publishing CAS had
    /// been posted without a completion showing that it lost.
    #[error("{operation} timed out after {deadline:?} waiting for {waiting_for}{}{}", unanswered.as_ref().map(|reason| format!("; no node of the cluster answered: {reason}")).unwrap_or_default(), if *may_have_applied { " (it may have applied)" } else { " (it did not apply)" })]
    TimedOut {
        /// The operation.
        operation: &'static str,
        /// The deadline.
        deadline: Duration,
        /// What the operation was waiting for when the deadline struck.
        waiting_for: &'static str,
        /// When it waited for the cluster view and the last fetch of it reached no node: why
        /// (the first node's error), as a cluster that is down entirely shows.
        unanswered: Option<String>,
        /// Whether the operation may have applied.
        may_have_applied: bool,
    },
    /// A failure struck after the operation's publishing CAS (its linearization point) was
    /// posted and before its completion showed the outcome: the mutation may or may not have
    /// happened. Never retried. May have applied.
    #[error("{operation} outcome unknown (it may have applied; read the key to see): {source}")]
    Unresolved {
        /// The operation.
        operation: &'static str,
        /// What failed.
        #[source]
        source: Box<Error>,
    },
    /// A one-sided request failed before the operation could apply (a READ, a block WRITE, or
    /// a CAS of a tentative slot, which readers never see). Did not apply.
    #[error("{operation}: a one-sided request completed with {status}")]
    WorkCompletion {
        /// The operation.
        operation: &'static str,
        /// The completion status.
        status: WorkCompletionStatus,
    },
    /// The operation lost its slot CAS race too many times in a row; every lost CAS had no
    /// effect. Did not apply.
    #[error("{operation}: gave up after {attempts} lost compare-and-swap races on one key")]
    Contention {
        /// The operation.
        operation: &'static str,
        /// Attempts made.
        attempts: u32,
    },
    /// Reads kept meeting blocks that fail their checksum (or torn slots) after the bounded
    /// re-reads of one lookup. Did not apply.
    #[error("{operation}: block checksum mismatch after {attempts} reads of the buckets")]
    Corrupt {
        /// The operation.
        operation: &'static str,
        /// Attempts made.
        attempts: u32,
    },
    /// The server refused a control request. Did not apply.
    #[error("the server refused: {reason}")]
    Refused {
        /// The server's reason.
        reason: String,
    },
    /// [`Client::connect_all`](crate::Client::connect_all) could not connect to a node; `source`
    /// says why ([`Error::NodeUnreachable`], [`Error::AuthenticationFailed`], a fabric error).
    /// Did not apply.
    #[error("connecting to node {node} at {address} failed")]
    ConnectFailed {
        /// The node's id in the cluster file.
        node: u32,
        /// The node's control address.
        address: SocketAddr,
        /// What failed.
        #[source]
        source: Box<Error>,
    },
    /// The cluster file is invalid. Did not apply.
    #[error("{reason}")]
    Config {
        /// The validation error (file, line, field).
        reason: String,
    },
    /// The control plane failed (asking for a heap chunk, which comes before any CAS). Did not
    /// apply.
    #[error("control plane: {0}")]
    Control(#[from] rdkv_common::ControlError),
    /// The fabric or memory layer failed (memlock, connecting the queue pair, a list the queue
    /// pair refused to post). Did not apply.
    #[error(transparent)]
    Fabric(#[from] rdkv_fabric::Error),
}

/// Why a single-copy operation gave way to the replicated path ([`Error::is_view_moved`]).
pub(crate) const VIEW_MOVED: &str =
    "the cluster view changed its members: the operation routes by the view";

impl Error {
    /// The error and each of its causes, on one line (`what failed: why: why`): what to print
    /// for a user, since `Display` alone leaves the causes out (`ConnectFailed` says which node,
    /// its cause says why).
    pub fn with_causes(&self) -> String {
        let mut line = self.to_string();
        let mut cause = std::error::Error::source(self);
        while let Some(inner) = cause {
            let text = inner.to_string();
            if !line.ends_with(&text) {
                line.push_str(": ");
                line.push_str(&text);
            }
            cause = inner.source();
        }
        line
    }

    /// Whether retrying on a fresh connection is safe and may succeed, for an operation that
    /// posted no CAS yet.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::NodeUnreachable { .. } | Error::Control(_) => true,
            Error::WorkCompletion { status, .. } => status.is_retryable(),
            Error::ConnectFailed { source, .. } => source.is_retryable(),
            _ => false,
        }
    }

    /// Whether the node answered that it does not serve data now (starting, resuming from a
    /// stop, filling or reconciling): worth waiting for within the deadline, unlike a node
    /// that does not answer at all.
    pub(crate) fn is_not_serving(&self) -> bool {
        matches!(self, Error::NodeUnreachable { reason, .. }
            if reason.contains(crate::connection::NOT_SERVING)
                // Not a wait: a client of one node never gets a filling node's data.
                && !reason.contains("connect with a cluster client"))
    }

    /// Whether a single-copy operation stopped, before any CAS, because the view it learned
    /// routes the key by the view (a member joins or leaves): it runs again that way.
    pub(crate) fn is_view_moved(&self) -> bool {
        matches!(self, Error::NodeUnreachable { reason, .. } if reason == VIEW_MOVED)
    }

    /// Whether the failed operation may have taken effect. `false` means that it certainly did
    /// not: no reader ever saw it and none ever will. `true` comes only from
    /// [`Error::Unresolved`] and from [`Error::TimedOut`] after a publishing CAS was posted.
    pub fn may_have_applied(&self) -> bool {
        match self {
            Error::Unresolved { .. } => true,
            Error::TimedOut {
                may_have_applied, ..
            } => *may_have_applied,
            Error::InvalidKey { .. }
            | Error::ValueTooLarge { .. }
            | Error::TableFull { .. }
            | Error::AuthenticationFailed { .. }
            | Error::NodeUnreachable { .. }
            | Error::WorkCompletion { .. }
            | Error::Contention { .. }
            | Error::Corrupt { .. }
            | Error::Refused { .. }
            | Error::ConnectFailed { .. }
            | Error::Config { .. }
            | Error::Control(_)
            | Error::Fabric(_) => false,
        }
    }
}

/// The result type of `rdkv-client`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
