//! rdkv-cluster-config: the cluster file and the local launcher.
//!
//! - [`config`]: the TOML schema and its validation (errors name file, line and field).
//! - [`units`]: sizes and durations.
//! - [`launcher`]: `rdkv-cluster up | down | status` for nodes on this machine.
//! - [`error`]: the one error enum.
#![forbid(unsafe_code)]

pub mod config;
pub mod error;
pub mod launcher;
pub mod units;

pub use config::{load, ClusterConfig, NodeConfig};
pub use error::{Error, Result};
