//! rdkv-cluster-config: the local launcher, `rdkv-cluster up | down | status`.
//!
//! - [`launcher`]: starting, stopping and reporting on the nodes of a cluster on this machine.
//! - [`error`]: the one error enum.
//!
//! The cluster file itself (schema, units, validation) is the crate `rdkv-cluster-file`,
//! re-exported here as [`config`] and [`units`].
#![forbid(unsafe_code)]

pub mod error;
pub mod launcher;

pub use error::{Error, Result};
pub use rdkv_cluster_file::{config, load, units, ClusterConfig, NodeConfig};
