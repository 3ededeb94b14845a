//! rdkv-client: the async client library.
//!
//! GET, PUT, INSERT, UPDATE, DELETE and compare-and-swap run as one-sided READ, WRITE and CAS
//! against the server's registered table; the server's CPU handles none of them.
//!
//! ```no_run
//! # async fn example() -> Result<(), rdkv_client::Error> {
//! use rdkv_client::{Client, ClientConfig};
//! use rdkv_fabric::Backend;
//! let address = std::net::SocketAddr::from(([127, 0, 0, 1], 7400));
//! let client = Client::connect(ClientConfig::new(address, Backend::Soft, b"secret")).await?;
//! client.put(b"user:1", b"ada").await?;
//! assert_eq!(client.get(b"user:1").await?.as_deref(), Some(&b"ada"[..]));
//! # Ok(()) }
//! ```
//!
//! A client of a cluster ([`Client::for_cluster`], [`Client::from_file`]) connects to each node
//! on first use, or to all of them with [`Client::connect_all`]. [`Client::close`] says goodbye
//! to every node and waits; dropping the client says it without waiting.
//!
//! - [`client`]: the handle, deadlines, reconnects and safe retries.
//! - `connection`: the handshake, queue pair, scratch buffers, chunks and control task.
//! - `operations`: the one-sided algorithms.
//! - `progress`: what an operation has posted, for safe retries and truthful errors.
//! - [`counters`]: per-client counters.
//! - [`error`]: the one error enum.
//! - `deadline`: operation deadlines kept by one watchdog task per client, not a timer each.
//! - `fairness`: an operation that never waited yields once before it returns.
//! - [`lanes`]: a connection per runtime worker to each node.
//! - [`fault`]: fault injection between the steps of an operation (tests).
#![forbid(unsafe_code)]

pub mod client;
mod connection;
pub mod counters;
mod deadline;
pub mod error;
mod fairness;
pub mod fault;
pub mod lanes;
mod operations;
mod progress;
mod replicated;
mod scan;
pub use scan::SCAN_BUCKETS;

pub use client::Client;
pub use connection::{
    ClientConfig, FabricChoice, NodeAddress, SharedMemory, DEFAULT_CONCURRENCY,
    DEFAULT_SLOT_CACHE_ENTRIES, MAX_SLOT_CACHE_ENTRIES,
};
pub use counters::CounterSnapshot;
pub use error::{Error, Result};
pub use operations::{CasOutcome, InsertOutcome};
/// What an application needs besides the client, so that one dependency is enough: the
/// fabric's name and the cluster file.
pub use rdkv_cluster_file::{load as load_cluster_file, ClusterConfig, ShmMode};
pub use rdkv_fabric::Backend;

/// The README's code examples, compiled as doctests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
