//! The one error enum of `rdkv-cluster-config` (the launcher).

/// A problem with a cluster file, or with launching or reaching its nodes.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The cluster file cannot be read or is invalid.
    #[error(transparent)]
    File(#[from] rdkv_cluster_file::Error),
    /// Launching, stopping or reaching a node failed.
    #[error("node {node}: {message}")]
    Node {
        /// The node's id.
        node: u32,
        /// What failed.
        message: String,
    },
    /// The cluster is in a state that refuses the command.
    #[error("{0}")]
    Refused(String),
}

/// The result type of `rdkv-cluster-config`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
