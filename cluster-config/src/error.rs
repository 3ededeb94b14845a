//! The one error enum of `rdkv-cluster-config`.

use std::path::PathBuf;

/// A problem with a cluster file, or with launching or reaching its nodes.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file cannot be read.
    #[error("{file}: cannot read the cluster file")]
    Read {
        /// The file.
        file: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid: where and why.
    #[error("{file}:{line}: {field}: {message}")]
    Invalid {
        /// The file.
        file: PathBuf,
        /// The 1-based line.
        line: usize,
        /// The field (`node[2].heap_size`).
        field: String,
        /// What is wrong and how to fix it.
        message: String,
    },
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
