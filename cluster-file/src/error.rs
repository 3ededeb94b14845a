//! The one error enum of `rdkv-cluster-file`.

use std::path::PathBuf;

/// A problem with a cluster file.
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
}

/// The result type of `rdkv-cluster-file`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
