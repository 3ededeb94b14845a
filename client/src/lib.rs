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
//! A [`ClientBuilder`] makes every client: of one node ([`ClientBuilder::node`]), of a cluster
//! ([`ClientBuilder::cluster`], [`ClientBuilder::cluster_file`]), with its settings
//! (concurrency, lanes, fabric). A client of a cluster connects to each node on first use, or
//! to all of them with [`Client::connect_all`] (or [`ClientBuilder::connect`]).
//! [`Client::close`] says goodbye to every node and waits; dropping the client says it without
//! waiting.
//!
//! - [`client`]: the handle, a facade over the parts below.
//! - [`builder`]: the one way to make a client, [`ClientBuilder`].
//! - `node`: a node's lanes and how their connections open, re-open and retire.
//! - [`lanes`]: a connection per runtime worker to each node.
//! - `runner`: every operation's deadline, safe retries and counts.
//! - `view_following`: the cluster view the client routes by.
//! - `replicated`: writes on a replicated cluster (a folder, a file per part).
//! - `connection`: the handshake, queue pair, scratch buffers, step lists, chunks and control
//!   task.
//! - `operations`: the one-sided algorithms of a single copy.
//! - `block`: writing blocks into, and reading them to, scratch buffers; `version`: the
//!   versions the blocks carry (a hybrid clock).
//! - `refill`: what a node's refill asks of its client; `scan`: reading a node's whole table.
//! - `progress`: what an operation has posted, for safe retries and truthful errors.
//! - [`counters`]: per-client counters.
//! - [`error`]: the one error enum.
//! - `deadline`: operation deadlines kept by one watchdog thread per process, not a timer each.
//! - `fairness`: an operation that never waited yields once before it returns.
//! - [`fault`]: fault injection between the steps of an operation (tests).
#![forbid(unsafe_code)]

mod block;
pub mod builder;
pub mod client;
mod connection;
pub mod counters;
mod deadline;
pub mod error;
mod fairness;
pub mod fault;
pub mod lanes;
mod node;
mod operations;
mod progress;
mod refill;
mod replicated;
mod runner;
mod scan;
mod spare;
mod value;
mod version;
mod view_following;
pub use scan::{ScannedKey, SCAN_BUCKETS};

pub use builder::ClientBuilder;
pub use client::Client;
pub use connection::{
    ClientConfig, FabricChoice, NodeAddress, SharedMemory, DEFAULT_CONCURRENCY,
    DEFAULT_SLOT_CACHE_ENTRIES, MAX_CONCURRENCY, MAX_SLOT_CACHE_ENTRIES,
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
