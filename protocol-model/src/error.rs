//! The crate's one error type.

/// What can go wrong setting up a check.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No built-in scenario has this name.
    #[error("unknown scenario {name:?}; known scenarios: {known}")]
    UnknownScenario {
        /// The name asked for.
        name: String,
        /// The names that exist, comma-separated.
        known: String,
    },
    /// The protocol name is not `old`, `new` or `new-draft`.
    #[error("unknown protocol {name:?}: expected old, new or new-draft")]
    UnknownProtocol {
        /// The name asked for.
        name: String,
    },
    /// The replication protocol name is not one of `replication::ReplicationProtocol::ALL`.
    #[error("unknown replication protocol {name:?}: expected lock, unchecked-rollback, unfenced, intent, commit-first, empty-deletes, read-intent-new or exact-only")]
    UnknownReplicationProtocol {
        /// The name asked for.
        name: String,
    },
    /// The reader rule name is not one of `lease::ReaderRule::ALL`.
    #[error("unknown reader rule {name:?}: expected old, lease, lease-inclusive, lease-no-since or lease-before")]
    UnknownReaderRule {
        /// The name asked for.
        name: String,
    },
    /// The scenario does not fit the model's limits or conventions.
    #[error("scenario {scenario}: {reason}")]
    InvalidScenario {
        /// The scenario's name.
        scenario: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// This crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
