//! The one error enum of `rdkv-server`.

use std::io;
use std::net::SocketAddr;

/// Everything that can stop a server from starting or running.
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
    #[error("bind control listener on {address}")]
    BindControl {
        /// The address.
        address: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// The result type of `rdkv-server`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
