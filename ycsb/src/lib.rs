//! rdkv-ycsb: the YCSB-style load generator (skeleton).
//!
//! Workloads A–F, the rdkv, Redis and in-process drivers and YCSB's output format come with the
//! YCSB issue; the `rdkv-ycsb` binary ships then.
#![forbid(unsafe_code)]

pub use rdkv_common::fabric::Backend;
