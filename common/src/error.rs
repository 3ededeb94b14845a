//! The control-plane error enum of `rdkv-common` (the fabric's errors are `rdkv_fabric::Error`).

use std::io;

/// Control-plane failures (see [`crate::protocol`]).
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// A frame announced more bytes than the limit.
    #[error("control frame of {length} bytes exceeds the maximum of {max} bytes")]
    FrameTooLarge {
        /// The announced length.
        length: u32,
        /// The limit.
        max: u32,
    },
    /// A frame's bytes are not a valid message.
    #[error("malformed control frame: {reason}")]
    Malformed {
        /// What the decoder said.
        reason: String,
    },
    /// The peer speaks another protocol version.
    #[error("protocol version mismatch: this side speaks {ours}, the peer {theirs}")]
    VersionMismatch {
        /// Our version.
        ours: u32,
        /// The peer's.
        theirs: u32,
    },
    /// The peer closed the connection.
    #[error("the control connection was closed by the peer")]
    Closed,
    /// Reading or writing the socket failed.
    #[error("control connection I/O: {0}")]
    Io(#[source] io::Error),
    /// The node refused the request (a wrong secret, another protocol version); the reason
    /// names the fix.
    #[error("refused: {reason}")]
    Refused {
        /// The node's reason.
        reason: String,
    },
    /// The node did not answer in time.
    #[error("no answer within {timeout:?}")]
    TimedOut {
        /// The time allowed.
        timeout: std::time::Duration,
    },
    /// The node's port accepted the connection, but the node did not answer within `timeout`:
    /// its kernel accepts into the listen backlog for a process that is stopped (SIGSTOP), hung
    /// or starved, and nothing reads. Apart from [`ControlError::TimedOut`], which does not say
    /// whether anything accepted.
    #[error("the connection was accepted, but the node did not answer within {timeout:?}")]
    NoAnswer {
        /// The time allowed, from the start of the connect.
        timeout: std::time::Duration,
    },
    /// The peer sent a message that is not valid at this point of the conversation.
    #[error("unexpected control message: {0}")]
    Unexpected(String),
}
