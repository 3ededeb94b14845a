//! rdkv-common: the server–client contract.
//!
//! - [`layout`]: the table layout (buckets, slots, blocks) shared by server and client.
//! - [`protocol`]: the control-plane messages, their framing and the HMAC handshake.
//! - [`sharding`]: rendezvous hashing of keys to nodes.
//! - [`lease`]: the node's lease word and the reader's rule (a value is returned only if the
//!   node held its lease when it was read).
//! - [`process`]: logging and shutdown signals shared by the binaries (cargo feature `process`,
//!   so that the client library does not pull in a logging backend).
//! - [`ports`]: loopback ports held for the processes a test or a benchmark starts, so none is
//!   lost between choosing it and binding it.
//! - [`error`]: the control-plane error enum.
//!
//! The fabric (verbs model, registered memory, providers) is the crate `rdkv-fabric`; this crate
//! has no `unsafe` code.
#![forbid(unsafe_code)]

pub mod error;
pub mod layout;
pub mod lease;
pub mod ports;
#[cfg(feature = "process")]
pub mod process;
pub mod protocol;
pub mod sharding;

pub use error::ControlError;
