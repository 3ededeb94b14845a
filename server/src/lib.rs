//! rdkv-server: allocates, pins and registers the table, runs the control plane, and manages
//! each client connection's queue pair and keys.
//!
//! - [`config`]: settings and their validation.
//! - [`table`]: the registered region (index + heap).
//! - [`heap`]: extent allocation, sealing and reclaiming.
//! - [`announce`]: each data connection's announce word, and the node's lease word.
//! - [`compactor`]: moves the few live blocks out of sparse chunks so they can be reclaimed.
//! - `collector_pace`: the collector's pace and what it remembers between passes.
//! - `sweep`: removes the copies the view no longer names on this node.
//! - [`view`]: the cluster view, agreed by the nodes with Raft (`openraft`).
//! - [`stats`](crate::stats): counters.
//! - [`gate`]: what a stopping server still waits for, named in its logs.
//! - [`pending`]: the limits on connections that have not authenticated yet.
//! - `log_budget`: at most a line a second for what an outsider can cause at will.
//! - `connection_summary`: clients' connections in one log line a minute.
//! - `node`: the node's state, which every task shares, with its fabric attachments (table,
//!   announce words and completion queue per fabric).
//! - [`collector`]: the task that reclaims and compacts the heap, at a pace that follows its work.
//! - `session`: one client's session, a file per role: handshake, serve (chunks, lease,
//!   heartbeats), ordered teardown.
//! - `refill`: a returning node copies its keys from its peers.
//! - `handover`: a leaving member copies its keys to the members that take them.
//! - `reconcile`: at a whole-cluster start with nobody serving, the newest copy of each key
//!   wins on every replica before any member serves.
//! - [`snapshot`]: the snapshot file and reading and loading the table for it.
//! - `persistence`: snapshots written (on a schedule, on request, at a clean shutdown) and
//!   loaded before the node serves.
//! - [`metrics`]: Prometheus gauges served over HTTP.
//! - [`server`]: start, run, shutdown.
//!
//! # Module dependency order
//!
//! No module imports one above it, so there are no import circles (check:
//! `grep -rn "crate::" server/src`, per module):
//!
//! ```text
//! error, gate, log_budget, pending, collector_pace   (import no other module)
//! log_file                                           (error)
//! announce, table, config                            (error)
//! heap                                               (announce)
//! compactor, stats                                   (heap, table)
//! view                                               (announce, error)
//! sweep                                              (config, table, view)
//! snapshot                                           (error, heap, table)
//! node                                               (the state it holds: all of the above)
//! collector, session, refill, persistence            (node, and the state modules)
//! connection_summary                                 (node)
//! metrics                                            (config, pending)
//! server                                             (everything: it builds the node, starts the tasks)
//! ```
//!
//! The server never handles a GET, PUT, DELETE or CAS: the fabric's NIC engine serves clients'
//! one-sided requests against the registered table, and gives server code no callback for them.
#![forbid(unsafe_code)]

pub mod announce;
pub mod collector;
mod collector_pace;
pub mod compactor;
pub mod config;
mod connection_summary;
pub mod error;
pub mod gate;
mod handover;
pub mod heap;
mod log_budget;
pub mod log_file;
pub mod metrics;
mod node;
pub mod pending;
mod persistence;
mod reconcile;
mod refill;
mod rereplication;
pub mod server;
mod session;
pub mod snapshot;
pub mod stats;
mod sweep;
pub mod table;
pub mod view;

pub use config::ServerConfig;
pub use error::{Error, Result};
pub use server::{run, start, RunningServer};
