//! rdkv-cluster-file: the cluster file's schema and validation, shared by the client library,
//! the server and the launcher. It has no launcher or CLI dependencies, so an application that
//! links `rdkv-client` pulls in only `toml` and `serde` for it.
//!
//! - [`config`]: the TOML schema and its validation (errors name file, line and field).
//! - [`units`]: sizes and durations.
//! - [`sizing`]: the heap sizing rule.
//! - [`error`]: the one error enum.
#![forbid(unsafe_code)]

pub mod config;
pub mod error;
pub mod sizing;
pub mod units;

pub use config::{load, load_to_start, ClusterConfig, NodeConfig, ShmMode};
pub use error::{Error, Result};
