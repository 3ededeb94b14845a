//! rdkv-cluster-config: the cluster file and launcher (skeleton).
//!
//! It will parse and validate the TOML cluster file and start, stop and report on local nodes
//! (issue "Cluster"). No binary ships until the launcher exists.
#![forbid(unsafe_code)]

pub use rdkv_common::memory::HugepagePolicy;
