//! rdkv's cross-crate test support.
//!
//! [`conformance`] is the fabric conformance suite: one set of checks, written once against the
//! verbs model and instantiated per backend by `tests/conformance.rs`.
#![forbid(unsafe_code)]

pub mod conformance;
