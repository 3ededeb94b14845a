//! rdkv-common: everything the server and the client share.
//!
//! - [`fabric`]: the verbs model (protection domains, memory regions and windows, RC queue pairs,
//!   completion queues) with its backends: `soft`, a user-space RNIC over TCP, and `loopback`,
//!   the same model in one process.
//! - [`memory`]: page-aligned, pinned memory that the fabric registers, with the memlock, RAM
//!   and hugepage checks done before anything is pinned.
//! - [`layout`]: the table layout (buckets, slots, blocks) shared by server and client.
//! - [`protocol`]: the control-plane messages, their framing and the HMAC handshake.
//! - [`process`]: logging and shutdown signals shared by the binaries.
//! - [`sharding`]: rendezvous hashing of keys to nodes.
//! - [`error`]: the crate's error enum (and its control-plane part).
//!
//! `unsafe` code lives only in `fabric` and `memory`; each block carries a `// SAFETY:` argument.

pub mod error;
pub mod fabric;
pub mod layout;
pub mod memory;
pub mod process;
pub mod protocol;
pub mod sharding;

pub use error::{ControlError, Error, Result};
