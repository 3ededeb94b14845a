//! rdkv-server: the server library (skeleton).
//!
//! It will allocate, pin and register the table, run the control plane and manage each
//! connection's memory-region lifecycle (issue "The store"). Until then it only re-exports the
//! fabric it will be built on, and ships no binary, so no user can reach an unfinished path.
#![forbid(unsafe_code)]

pub use rdkv_common::fabric;
