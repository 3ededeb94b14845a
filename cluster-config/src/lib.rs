//! rdkv-cluster-config: the launcher, `rdkv-cluster up | down | restart | status | logs |
//! systemd`.
//!
//! - [`launcher`]: starting and stopping the nodes of a cluster;
//! - [`foreground`]: what the foreground `up` says when a node exits or is started again;
//! - [`remote`]: nodes on other hosts, through OpenSSH;
//! - [`resize`]: a node's table sizes grown in the cluster file (`rdkv-cluster resize`);
//! - [`status`]: each node's state and stats, and `status`'s exit code;
//! - [`systemd`]: a service unit per node;
//! - [`error`]: the one error enum.
//!
//! The cluster file itself (schema, units, validation) is the crate `rdkv-cluster-file`,
//! re-exported here as [`config`] and [`units`].
#![forbid(unsafe_code)]

pub mod error;
pub mod foreground;
pub mod launcher;
pub mod membership;
pub mod remote;
pub mod resize;
pub mod status;
pub mod systemd;

pub use error::{Error, Result};
pub use rdkv_cluster_file::{config, load, units, ClusterConfig, NodeConfig};
