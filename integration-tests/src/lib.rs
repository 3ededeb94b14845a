//! rdkv's cross-crate test support.
//!
//! - [`linearizability`]: a linearizability checker for key-value histories.
//! - [`process`]: real `rdkv-server` processes for tests, stopped on drop.
#![forbid(unsafe_code)]

pub mod linearizability;
pub mod process;
