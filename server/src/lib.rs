//! rdkv-server: allocates, pins and registers the table, runs the control plane, and manages
//! each client connection's queue pair and keys.
//!
//! - [`config`]: settings and their validation.
//! - [`table`]: the registered region (index + heap).
//! - [`heap`]: chunk allocation and the collector that reclaims unreferenced chunks.
//! - [`collector`]: the task that reclaims and compacts the heap, at a pace that follows its work.
//! - [`compactor`]: moves the few live blocks out of sparse chunks so they can be reclaimed.
//! - `session`: one client's session, a file per role: handshake, serve (chunks, lease,
//!   heartbeats), ordered teardown.
//! - [`server`]: start, run, shutdown.
//! - [`gate`]: what a stopping server still waits for, named in its logs.
//! - [`pending`]: the limits on connections that have not authenticated yet.
//! - `log_budget`: at most a line a second for what an outsider can cause at will.
//! - [`metrics`]: Prometheus gauges served over HTTP.
//! - [`stats`](crate::stats): counters.
//! - [`view`]: the cluster view, agreed by the nodes with Raft (`openraft`).
//!
//! The server never handles a GET, PUT, DELETE or CAS: the fabric's NIC engine serves clients'
//! one-sided requests against the registered table, and gives server code no callback for them.
#![forbid(unsafe_code)]

pub mod announce;
pub mod collector;
pub mod compactor;
pub mod config;
pub mod error;
pub mod gate;
pub mod heap;
mod log_budget;
pub mod metrics;
pub mod pending;
mod refill;
pub mod server;
mod session;
pub mod stats;
mod sweep;
pub mod table;
pub mod view;

pub use config::ServerConfig;
pub use error::{Error, Result};
pub use server::{run, start, RunningServer};
