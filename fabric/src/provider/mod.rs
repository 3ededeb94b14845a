//! The providers: the transports behind the verbs model.
//!
//! - [`engine`]: the emulated responder (key checks in rxe's order, atomic access to registered
//!   memory) that `soft` and `loopback` share.
//! - [`soft`]: a user-space RNIC over TCP: listener, connections, and the wire format.
//! - `verbs` (cargo feature `verbs`): real ibverbs through `sideway`.
//!
//! `loopback` has no module of its own yet: it is the in-process transport of
//! `queue_pair.rs`.

pub(crate) mod engine;
pub(crate) mod soft;
#[cfg(feature = "verbs")]
pub(crate) mod verbs;
