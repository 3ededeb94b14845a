//! rdkv-client: the async client library (skeleton).
//!
//! It will run GET, PUT, DELETE and compare-and-swap with one-sided READ, WRITE and CAS on the
//! fabric (issue "The store"). No binary ships until the CLI exists.
#![forbid(unsafe_code)]

pub use rdkv_common::fabric;
