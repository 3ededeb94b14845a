//! The one error enum of `rdkv-server`.

use std::io;
use std::net::SocketAddr;

/// Everything that can stop a server from starting or running, or end one client's session
/// before it is served (the handshake's failures; the session logs them as its end reason).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is invalid; the message names the field and the fix.
    #[error("invalid server configuration: {field}: {reason}")]
    Config {
        /// The field.
        field: &'static str,
        /// What is wrong and what would be valid.
        reason: String,
    },
    /// The fabric or the memory layer failed (memlock, hugepages, listener, ...).
    #[error(transparent)]
    Fabric(#[from] rdkv_fabric::Error),
    /// The control listener could not be bound.
    #[error("bind the control listener on {address}")]
    BindControl {
        /// The address.
        address: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The client sent nothing within the handshake's timeout.
    #[error("handshake timed out after {timeout:?}")]
    HandshakeTimedOut {
        /// The timeout.
        timeout: std::time::Duration,
    },
    /// Too many unauthenticated connections: a newer one took this one's place.
    #[error("evicted before authenticating: too many unauthenticated connections")]
    Evicted,
    /// The server began to shut down during the handshake.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The metrics listener could not be bound.
    #[error("bind the metrics listener on {address}")]
    BindMetrics {
        /// The address.
        address: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The view's state file cannot be read.
    #[error("the view state file {path}: {reason}")]
    ViewState {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong, and the fix.
        reason: String,
    },
    /// A snapshot file cannot be written, read, or trusted (`snapshot/file.rs`).
    #[error("snapshot {}: {reason}", path.display())]
    Snapshot {
        /// The file (or the data directory, when creating it failed).
        path: std::path::PathBuf,
        /// What is wrong, concretely: the step and the OS error, or the damage and where it
        /// is. The caller adds the fix.
        reason: String,
    },

    /// The view's consensus did not start.
    #[error("the cluster view's consensus: {reason}")]
    Consensus {
        /// What failed.
        reason: String,
    },

    /// The client closed the connection during the handshake.
    #[error("client disconnected during the handshake")]
    ClientDisconnected,
    /// A frame from the client could not be read or decoded.
    #[error("bad frame from the client")]
    BadFrame {
        /// What was wrong with it.
        #[source]
        source: rdkv_common::ControlError,
    },
    /// The client sent a message the handshake does not expect at this step.
    #[error("expected {expected} from the client")]
    UnexpectedMessage {
        /// What the step expects.
        expected: &'static str,
    },
    /// The client was refused (the reason was sent to it too).
    #[error("{reason}")]
    Refused {
        /// Why: a protocol version mismatch or a failed proof, with the fix.
        reason: String,
    },
    /// A message to the client could not be sent.
    #[error("send to the client")]
    Send {
        /// The write or encoding error.
        #[source]
        source: rdkv_common::ControlError,
    },
    /// The client's queue pair or its windows could not be set up.
    #[error("{step} for connection {connection_id}")]
    QueuePairSetup {
        /// What failed: create, init, connect or bind.
        step: &'static str,
        /// The session.
        connection_id: u64,
        /// The fabric's error.
        #[source]
        source: rdkv_fabric::Error,
    },
    /// The node's log file cannot be opened or written.
    #[error("the log file {}: {reason}", path.display())]
    LogFile {
        /// The file.
        path: std::path::PathBuf,
        /// What failed, and the fix.
        reason: String,
    },
}

/// The result type of `rdkv-server`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
