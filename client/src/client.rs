//! [`Client`]: the public handle, a facade over the parts that do the work:
//!
//! - [`crate::builder`]: how a client is made ([`crate::ClientBuilder`]);
//! - `node`: each node's lanes, and how their connections open, re-open and retire;
//! - `runner`: every operation's deadline, retries on a fresh connection and counts;
//! - `view_following`: the cluster view the client routes by, and how it learns a newer one;
//! - `replicated`: writes (and GETs) on a replicated cluster;
//! - `operations`: the one-sided algorithms of a single copy;
//! - `refill`: the hidden methods a node's refill uses.
//!
//! Keys map to nodes by rendezvous hashing (by the cluster view's ranking when each key has
//! copies); the client says goodbye to every node when closed or dropped.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rdkv_common::protocol::{fetch_stats, fetch_view, ClusterView, ServerStats};
use rdkv_common::sharding;
use rdkv_common::ControlError;

use crate::builder::ClientBuilder;
use crate::connection::{ClientConfig, NodeConnection};
use crate::counters::{CounterSnapshot, Counters};
use crate::error::{Error, Result};
use crate::fairness;
use crate::node::{connect_first_lanes, Node, GOODBYE_TIMEOUT};
use crate::operations::{self, CasOutcome, InsertOutcome, Mutation, MutationOutcome};
use crate::replicated::Write;
use crate::runner::Kind;
use crate::value::Value;
use crate::view_following::ViewFollower;

/// An rdkv client: a connection per node and runtime worker ([`crate::lanes`]), opened on
/// first use (or up front with [`Client::connect_all`]); keys map to nodes by rendezvous
/// hashing. On a current-thread runtime that is one connection per node. Share it behind an
/// `Arc`; every method takes `&self`. Made by a [`ClientBuilder`] (or [`Client::connect`],
/// [`Client::from_file`]).
///
/// [`Client::close`] says goodbye to every node and waits until each goodbye is written.
/// Dropping the client does the same without waiting, in tasks spawned on the current tokio
/// runtime (if there is none, the connections just close; the servers notice at once, but
/// the counters since the last heartbeat are lost).
#[derive(Debug)]
pub struct Client {
    /// The nodes, in cluster-file order. Shared with the tasks that open their connections.
    pub(crate) nodes: Vec<Arc<Node>>,
    /// Node ids, in the same order, for rendezvous hashing.
    pub(crate) node_ids: Vec<u32>,
    /// Copies of each key (the cluster file's `replicas`): with more than one, operations
    /// route by the cluster view and writes go through [`crate::replicated`].
    pub(crate) replicas: usize,
    /// The cluster view as this client last learned it, and how it learns a newer one.
    pub(crate) follower: Arc<ViewFollower>,
    /// Counters.
    pub(crate) counters: Arc<Counters>,
    /// The per-operation deadline.
    pub(crate) deadline: Duration,
}

impl Client {
    /// Connects to one node and authenticates at once: `ClientBuilder::node(config).connect()`.
    ///
    /// # Errors
    /// As [`ClientBuilder::connect`].
    pub async fn connect(config: ClientConfig) -> Result<Self> {
        ClientBuilder::node(config).connect().await
    }

    /// A client of the cluster in a cluster file, whose connections open on first use:
    /// `ClientBuilder::cluster_file(path).build()`.
    ///
    /// # Errors
    /// [`Error::Config`] when the file is invalid.
    pub fn from_file(path: &std::path::Path) -> Result<Self> {
        ClientBuilder::cluster_file(path).build()
    }

    /// Connects the first lane of every node that has none, concurrently, waits for them, and
    /// starts opening the other lanes in the background: afterwards no operation pays a
    /// handshake inside its deadline (until a connection fails and is re-established; an
    /// operation whose lane is still opening uses the first). Each handshake step is bounded
    /// by the connection timeout (5 s), not by the operation deadline. A lane after the first
    /// that cannot connect (the node at `max_connections`) fails nothing.
    ///
    /// # Errors
    /// [`Error::ConnectFailed`] naming the first node, in cluster-file order, whose first lane
    /// could not be connected, with the cause as its source; the other nodes stay connected.
    pub async fn connect_all(&self) -> Result<()> {
        connect_first_lanes(&self.nodes).await
    }

    /// The id of the node that owns `key`.
    pub fn node_of(&self, key: &[u8]) -> u32 {
        self.node_for(key).id
    }

    /// The node that owns `key` by the cluster file.
    pub(crate) fn node_for(&self, key: &[u8]) -> &Arc<Node> {
        let index = sharding::owner(key, &self.node_ids).unwrap_or(0);
        &self.nodes[index]
    }

    /// This client's node with id `node_id`.
    pub(crate) fn node_by_id(&self, node_id: u32) -> Option<&Arc<Node>> {
        self.nodes.iter().find(|node| node.id == node_id)
    }

    /// The nodes holding `key`'s copies under the client's view, primary first
    /// ([`ViewFollower::replica_ids`]); a GET asks for one, the primary.
    pub(crate) fn replica_nodes(
        &self,
        key: &[u8],
        route: crate::view_following::Route,
    ) -> Vec<Arc<Node>> {
        self.follower
            .replica_ids(key, route)
            .into_iter()
            .filter_map(|id| self.node_by_id(id).cloned())
            .collect()
    }

    /// The live connections of the calling thread's lanes to `nodes`, in order.
    pub(crate) async fn connections_to(
        &self,
        nodes: &[Arc<Node>],
    ) -> Result<Vec<Arc<NodeConnection>>> {
        let mut connections = Vec::with_capacity(nodes.len());
        for node in nodes {
            connections.push(node.connection().await?);
        }
        Ok(connections)
    }

    /// The deadline of an operation on a replicated cluster: the client's, never longer than
    /// any node's.
    pub(crate) fn replicated_deadline(&self) -> Duration {
        self.nodes
            .iter()
            .filter_map(|node| node.server_deadline())
            .fold(self.deadline, Duration::min)
    }

    /// Whether operations route by the view and take the replicated paths: with two copies or
    /// more of each key, and with one while a member joins or leaves or once the view's
    /// members differ from the cluster file's nodes (`docs/protocol.md`, *Membership
    /// changes*).
    async fn replicated(&self) -> bool {
        if self.replicas > 1 {
            return true;
        }
        if self.nodes.len() > 1 {
            self.follower.follow_view_with_one_copy().await;
        }
        self.follower.single_copy_by_view()
    }

    /// Every mutation but delete, on a single copy or on the key's replicas.
    async fn mutate(
        &self,
        operation: &'static str,
        key: &[u8],
        value: &[u8],
        mutation: Mutation<'_>,
    ) -> Result<MutationOutcome> {
        let outcome = self.mutate_once(operation, key, value, mutation).await;
        match outcome {
            Err(error) if error.is_view_moved() => {
                let write = Write::Value(value, mutation);
                Box::pin(self.mutate_replicated(operation, key, write)).await
            }
            outcome => outcome,
        }
    }

    /// [`Client::mutate`], on the path the client's view gives.
    async fn mutate_once(
        &self,
        operation: &'static str,
        key: &[u8],
        value: &[u8],
        mutation: Mutation<'_>,
    ) -> Result<MutationOutcome> {
        if self.replicated().await {
            let write = Write::Value(value, mutation);
            // On the heap: the replicated write's future is several times a single copy's, and
            // inline it sized every single-copy write's too (a debug build's test thread ran
            // out of its 2 MiB stack). One allocation per replicated write, of five round trips.
            return Box::pin(self.mutate_replicated(operation, key, write)).await;
        }
        if matches!(mutation, Mutation::Upsert | Mutation::Update) {
            if let Some(outcome) = self.update_direct(operation, key, value) {
                fairness::after_direct_operation().await;
                return outcome;
            }
        }
        self.run(
            Kind::Mutation,
            operation,
            key,
            |connection, progress| async move {
                operations::mutate(&connection, progress, operation, key, value, mutation).await
            },
        )
        .await
    }

    /// The value of `key`, if present. One round trip when the process's slot cache guesses the
    /// key's slot right (`docs/protocol.md`, *Guessed blocks*), else two (one when no slot has
    /// its fingerprint).
    ///
    /// # Errors
    /// [`Error::InvalidKey`], [`Error::TimedOut`], [`Error::NodeUnreachable`],
    /// [`Error::Corrupt`], or a typed work-completion failure.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Bytes>> {
        if self.replicated().await {
            return self.get_replicated(key).await;
        }
        let mut value = Vec::new();
        if let Some(present) = self.get_direct(key, &mut value) {
            fairness::after_direct_operation().await;
            return Ok(present.then(|| Bytes::from(value)));
        }
        match self.get_by_lists(key).await {
            Err(error) if error.is_view_moved() => self.get_replicated(key).await,
            found => Ok(found?.map(|found| found.to_bytes())),
        }
    }

    /// A single-copy GET by posted lists (no direct access: `operations::get`).
    async fn get_by_lists(&self, key: &[u8]) -> Result<Option<Value>> {
        self.run(Kind::Get, "get", key, |connection, progress| async move {
            operations::get(&connection, progress, key).await
        })
        .await
    }

    /// GET into `value`, which it empties first: whether the key is present, its value then in
    /// `value`. A GET done by direct access to the node's memory (`shm`, `docs/protocol.md`,
    /// *Direct GETs*) allocates nothing when `value` has the room: a loop that reuses one
    /// vector reads with no allocation per GET. Otherwise as [`Client::get`], with the value
    /// copied into `value`.
    ///
    /// # Errors
    /// As [`Client::get`].
    pub async fn get_into(&self, key: &[u8], value: &mut Vec<u8>) -> Result<bool> {
        value.clear();
        let found = if self.replicated().await {
            self.get_replicated(key).await?
        } else if let Some(present) = self.get_direct(key, value) {
            fairness::after_direct_operation().await;
            return Ok(present);
        } else {
            match self.get_by_lists(key).await {
                Err(error) if error.is_view_moved() => self.get_replicated(key).await?,
                found => {
                    // Into the caller's vector by a swap: its old one goes back to this
                    // thread's spare value vectors (`value.rs`), for the next GET's copy.
                    let found = found?;
                    value.clear();
                    return Ok(found.map(|found| found.swap_into(value)).is_some());
                }
            }
        };
        value.clear();
        if let Some(found) = &found {
            value.extend_from_slice(found);
        }
        Ok(found.is_some())
    }

    /// The values of several keys, fetched concurrently, each by a GET of its own (with its
    /// own deadline, retries and counts, as [`Client::get`]).
    ///
    /// # Errors
    /// The first error, in the keys' order, of any key.
    pub async fn batch_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Bytes>>> {
        let gets = keys.iter().map(|key| self.get(key));
        futures_util::future::join_all(gets)
            .await
            .into_iter()
            .collect()
    }

    /// Inserts or replaces.
    ///
    /// # Errors
    /// [`Error::ValueTooLarge`] (naming the limit), [`Error::InvalidKey`], [`Error::TableFull`],
    /// [`Error::TimedOut`], [`Error::Unresolved`], [`Error::NodeUnreachable`].
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.mutate("put", key, value, Mutation::Upsert)
            .await
            .map(drop)
    }

    /// Inserts only if absent; `Ok(false)` when the key was present.
    /// [`Client::insert_or_get`] also returns the value that was present.
    ///
    /// # Errors
    /// As [`Client::put`].
    pub async fn insert(&self, key: &[u8], value: &[u8]) -> Result<bool> {
        Ok(self.insert_or_get(key, value).await? == InsertOutcome::Inserted)
    }

    /// Inserts only if absent, like [`Client::insert`]; when the key is present, returns the
    /// value it held at the moment the insert found it ([`InsertOutcome::Present`]), in the
    /// same round trips.
    ///
    /// # Errors
    /// As [`Client::put`].
    pub async fn insert_or_get(&self, key: &[u8], value: &[u8]) -> Result<InsertOutcome> {
        match self.mutate("insert", key, value, Mutation::Insert).await? {
            MutationOutcome::Applied => Ok(InsertOutcome::Inserted),
            MutationOutcome::Present(present) => Ok(InsertOutcome::Present(present)),
            other => unreachable!("an insert ended {other:?}"),
        }
    }

    /// Replaces only if present; `Ok(false)` when the key was absent.
    ///
    /// # Errors
    /// As [`Client::put`].
    pub async fn update(&self, key: &[u8], value: &[u8]) -> Result<bool> {
        Ok(self.mutate("update", key, value, Mutation::Update).await? == MutationOutcome::Applied)
    }

    /// Replaces the value with `new` only if it equals `expected`; linearized at the slot CAS.
    /// An absent key is a mismatch (`CasOutcome::Mismatch(None)`); to require absence, use
    /// [`Client::compare_and_swap_expecting`] with `None`.
    ///
    /// # Errors
    /// As [`Client::put`].
    pub async fn compare_and_swap(
        &self,
        key: &[u8],
        expected: &[u8],
        new: &[u8],
    ) -> Result<CasOutcome> {
        self.compare_and_swap_expecting(key, Some(expected), new)
            .await
    }

    /// Sets the value to `new` only if the current one is `expected`, where `None` expects the
    /// key to be absent (then it is an insert: [`Client::insert_or_get`]). On a mismatch,
    /// returns the current value (`None`: absent), so a retry loop needs no extra GET.
    ///
    /// ```no_run
    /// # async fn example(client: &rdkv_client::Client) -> rdkv_client::Result<()> {
    /// use rdkv_client::CasOutcome;
    /// // Create the counter if it is absent, else add one to it.
    /// let mut expected: Option<bytes::Bytes> = None;
    /// loop {
    ///     let next = expected.as_deref().map_or(0u64, |bytes| {
    ///         u64::from_le_bytes(bytes.try_into().unwrap_or_default()) + 1
    ///     });
    ///     match client
    ///         .compare_and_swap_expecting(b"counter", expected.as_deref(), &next.to_le_bytes())
    ///         .await?
    ///     {
    ///         CasOutcome::Swapped => break,
    ///         CasOutcome::Mismatch(current) => expected = current,
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`Client::put`].
    pub async fn compare_and_swap_expecting(
        &self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: &[u8],
    ) -> Result<CasOutcome> {
        let mutation = match expected {
            Some(expected) => Mutation::CompareAndSwap { expected },
            None => Mutation::Insert,
        };
        match self.mutate("compare_and_swap", key, new, mutation).await? {
            MutationOutcome::Applied => Ok(CasOutcome::Swapped),
            MutationOutcome::Mismatch(current) => Ok(CasOutcome::Mismatch(current)),
            MutationOutcome::Present(current) => Ok(CasOutcome::Mismatch(Some(current))),
            MutationOutcome::Absent => Ok(CasOutcome::Mismatch(None)),
        }
    }

    /// Deletes; `Ok(false)` when the key was absent.
    ///
    /// # Errors
    /// As [`Client::get`], plus [`Error::Unresolved`].
    pub async fn delete(&self, key: &[u8]) -> Result<bool> {
        if !self.replicated().await {
            let deleted = self
                .run(
                    Kind::Mutation,
                    "delete",
                    key,
                    |connection, progress| async move {
                        operations::delete(&connection, progress, key).await
                    },
                )
                .await;
            match deleted {
                Err(error) if error.is_view_moved() => {}
                deleted => return deleted,
            }
        }
        let outcome = Box::pin(self.mutate_replicated("delete", key, Write::Delete)).await?;
        Ok(outcome == MutationOutcome::Applied)
    }

    /// This client's counters.
    pub fn counters(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }

    /// Every node's counters, over monitoring connections (no queue pair, no keys); a node that
    /// does not answer gives its error.
    pub async fn cluster_stats(&self) -> Vec<(u32, Result<ServerStats>)> {
        let mut stats = Vec::new();
        for node in &self.nodes {
            let address = node.config.node.control_address;
            let fetched = fetch_stats(node.monitored(), self.deadline)
                .await
                .map_err(|error| match error {
                    // The node answered, and refused the secret or the version: say so, not
                    // that it is unreachable.
                    ControlError::Refused { reason }
                        if reason.starts_with("authentication failed")
                            || reason.starts_with("protocol version mismatch") =>
                    {
                        Error::AuthenticationFailed { address, reason }
                    }
                    error => Error::NodeUnreachable {
                        address,
                        reason: error.to_string(),
                    },
                });
            stats.push((node.id, fetched));
        }
        stats
    }

    /// The cluster view (`docs/architecture.md`, *Cluster view*): the epoch, the consensus
    /// leader and each node's state, as the leader knows it when the first node that answers
    /// names one that answers too, else as that first node knows it. Over monitoring
    /// connections, each bounded by the operation deadline.
    ///
    /// # Errors
    /// [`Error::NodeUnreachable`] naming the last node tried, when none answers.
    pub async fn view(&self) -> Result<ClusterView> {
        let mut last_error = None;
        let mut first: Option<ClusterView> = None;
        for node in &self.nodes {
            let address = node.config.node.control_address;
            match fetch_view(node.monitored(), self.deadline).await {
                Ok(view) if view.leader == Some(node.id) => return Ok(view),
                Ok(view) => {
                    let leader = view.leader;
                    first.get_or_insert(view);
                    // Ask the leader next, if it is a node of this client's.
                    if let Some(leader) = leader.and_then(|leader| self.node_by_id(leader)) {
                        if let Ok(view) = fetch_view(leader.monitored(), self.deadline).await {
                            return Ok(view);
                        }
                    }
                    break;
                }
                Err(error) => {
                    last_error = Some(Error::NodeUnreachable {
                        address,
                        reason: error.to_string(),
                    })
                }
            }
        }
        match (first, last_error) {
            (Some(view), _) => Ok(view),
            (None, Some(error)) => Err(error),
            (None, None) => Err(Error::Config {
                reason: "the client has no nodes".into(),
            }),
        }
    }

    /// The newest cluster-view epoch any node reported to this client, in the answers to its
    /// heartbeats (every `lease_timeout` / 3 on each connection; 0 before the first). When it
    /// grows, the view changed: [`Client::view`] fetches it.
    pub fn view_epoch(&self) -> u64 {
        self.counters.view_epoch.load(Ordering::Relaxed)
    }

    /// Copies of each key: the cluster file's `replicas` (1 for a client of one node).
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// The ids of the cluster's nodes, in the cluster file's order.
    pub fn node_ids(&self) -> &[u32] {
        &self.node_ids
    }

    /// The fabric of this client's live connection to node `node_id` (`shm` when it uses the
    /// node's shared-memory fabric); `None` when it has none.
    pub fn connection_fabric(&self, node_id: u32) -> Option<rdkv_fabric::Backend> {
        self.node_by_id(node_id)?
            .any_healthy_connection()
            .map(|connection| connection.welcome.server_endpoint.backend())
    }

    /// The counters of the first node (the only one for a client made with
    /// [`Client::connect`]); [`Client::cluster_stats`] asks every node.
    ///
    /// # Errors
    /// [`Error::NodeUnreachable`] when the node cannot be reached.
    pub async fn server_stats(&self) -> Result<ServerStats> {
        self.nodes[0].connection().await?.stats().await
    }

    /// Reports the last counters and says goodbye to every connected node, and waits until
    /// each goodbye is written (at most the connection timeout, 5 s, per node); the servers
    /// tear the connections down at once. Dropping the client does the same without waiting
    /// (see [`Client`]). An operation after `close` connects again.
    pub async fn close(&self) {
        let mut closing = tokio::task::JoinSet::new();
        for connection in self.take_connections() {
            closing.spawn(async move { connection.close().await });
        }
        while closing.join_next().await.is_some() {}
    }

    /// Takes every node's open connections, of every lane, out of the client (the next
    /// operation connects again).
    fn take_connections(&self) -> Vec<Arc<NodeConnection>> {
        self.nodes
            .iter()
            .flat_map(|node| node.take_connections())
            .collect()
    }
}

impl Drop for Client {
    /// Says goodbye to every connected node in tasks spawned on the current tokio runtime, each
    /// bounded by `GOODBYE_TIMEOUT` (1 s; the connection's control task then writes the last
    /// counters and the goodbye on its own). Outside a runtime, the connections just close.
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for connection in self.take_connections() {
            runtime.spawn(async move {
                // Best effort: on a timeout the connection closes without the goodbye.
                let _ = tokio::time::timeout(GOODBYE_TIMEOUT, connection.close()).await;
            });
        }
    }
}
