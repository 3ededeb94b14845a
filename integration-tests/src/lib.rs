//! rdkv's cross-crate test support.
//!
//! - [`conformance`]: the fabric conformance suite, written once against the verbs model and
//!   instantiated per backend by `tests/conformance.rs`.
//! - [`linearizability`]: a linearizability checker for key-value histories.
//! - [`process`]: real `rdkv-server` processes for tests, stopped on drop.
#![forbid(unsafe_code)]

pub mod conformance;
pub mod linearizability;
pub mod process;
