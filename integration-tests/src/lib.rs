//! rdkv's cross-crate test support.
//!
//! - [`cluster`]: a three-node cluster from the example file, through `rdkv-cluster`.
//! - [`linearizability`]: a linearizability checker for key-value histories.
//! - [`membership`]: a fourth node listed, a checked load, `add-node` and `remove-node`.
//! - [`process`]: real `rdkv-server` processes for tests, stopped on drop.
//! - [`view`]: the cluster view seen by tests: views fetched, nodes signalled.
#![forbid(unsafe_code)]

pub mod cluster;
pub mod history;
pub mod linearizability;
pub mod membership;
pub mod process;
pub mod view;
pub mod workload;
