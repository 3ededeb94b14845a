//! [`Client`]: the public handle. It maps each key to its node by rendezvous hashing, opens a
//! connection to the node per runtime worker that uses it (a lane, [`crate::lanes`]) on first
//! use (or all at once, [`Client::connect_all`]) and re-establishes it after a failure, applies
//! the per-operation deadline, retries an operation on a fresh connection only when the failure came before any compare-and-swap of it was posted, and says
//! goodbye to every node when closed or dropped.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rdkv_cluster_file::ClusterConfig;
use rdkv_common::protocol::{fetch_stats, fetch_view, ClusterView, MonitoredNode, ServerStats};
use rdkv_common::sharding;
use rdkv_common::ControlError;

use crate::connection::{
    shared_slot_cache, ClientConfig, NodeConnection, SlotCache, WriterStripes, DEFAULT_CONCURRENCY,
};
use crate::counters::{CounterSnapshot, Counters};
use crate::deadline;
use crate::error::{Error, Result};
use crate::fairness::yield_if_never_waited;
use crate::lanes::{current_lane, lanes_for, Lane};
use crate::operations::{self, CasOutcome, InsertOutcome, Mutation, MutationOutcome};
use crate::progress::{Progress, Waiting};
use crate::replicated::{self, Attempt, Held, Patience, Resumed, Write};

/// One node of the client's cluster.
#[derive(Debug)]
struct Node {
    /// The node's id (the rendezvous hashing input).
    id: u32,
    /// How to reach it.
    config: ClientConfig,
    /// Its lanes: a connection per runtime worker, each opened on the first operation that
    /// runs on its worker (`lanes`).
    lanes: Box<[Lane]>,
    /// This process's writer turns on the node, shared by its lanes.
    writer_stripes: Arc<WriterStripes>,
    /// The node's view of the process's slot cache (shared by every node and client of the
    /// process).
    slot_cache: Arc<SlotCache>,
    /// Bumped when the client takes its connections out (close, drop): a connection that an
    /// opening begun before then brings back says goodbye instead of being stored.
    generation: std::sync::atomic::AtomicU64,
    /// The node's own operation deadline (from its welcome; 0 until the first connection):
    /// operations on it never run longer, whatever the client's deadline.
    server_deadline_ms: std::sync::atomic::AtomicU64,
}

impl Node {
    /// A node with `lanes` lanes, none connected.
    fn new(id: u32, config: ClientConfig, lanes: usize) -> Self {
        let slot_cache = shared_slot_cache(config.node.control_address, config.slot_cache_entries);
        Self {
            id,
            config,
            lanes: (0..lanes.max(1)).map(|_| Lane::new()).collect(),
            writer_stripes: Arc::new(WriterStripes::default()),
            slot_cache,
            generation: std::sync::atomic::AtomicU64::new(0),
            server_deadline_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The lane of the calling thread.
    fn lane(&self) -> usize {
        current_lane(self.lanes.len())
    }

    /// The node as a monitoring connection reaches it (no queue pair, no keys).
    fn monitored(&self) -> MonitoredNode<'_> {
        MonitoredNode {
            address: self.config.node.control_address,
            id: self.config.node.id,
            secret: &self.config.secret,
        }
    }

    /// A live connection of any lane.
    fn any_healthy_connection(&self) -> Option<Arc<NodeConnection>> {
        self.lanes.iter().find_map(Lane::healthy_connection)
    }
}

/// The cluster view as a client knows it: the epoch and the serving members, whose ranking
/// places each key (`docs/protocol.md`, *Placement*).
#[derive(Debug, Clone)]
struct Membership {
    /// The view's epoch (0: the cluster file's nodes, all serving, before any fetch).
    epoch: u64,
    /// The serving members' ids, in id order.
    serving: Vec<u32>,
    /// The filling members' ids (back after a restart or an absence), in id order.
    filling: Vec<u32>,
}

impl Membership {
    /// `key`'s copies under this view, primary first: the first `count` of its ranking over
    /// the serving members; while members fill, also those of the ranking over serving and
    /// filling members, which the view is heading for (so a filling node gets every write of
    /// the keys it will hold). A filling node is never the primary.
    fn write_replicas(&self, key: &[u8], count: usize) -> Vec<u32> {
        let mut replicas: Vec<u32> = sharding::replicas(key, &self.serving, count)
            .into_iter()
            .map(|index| self.serving[index])
            .collect();
        if !self.filling.is_empty() {
            let mut heading: Vec<u32> = self.serving.clone();
            heading.extend(&self.filling);
            heading.sort_unstable();
            for index in sharding::replicas(key, &heading, count) {
                if !replicas.contains(&heading[index]) {
                    replicas.push(heading[index]);
                }
            }
        }
        replicas
    }
}

/// How a client learns the cluster view: its nodes, and the membership it routes by. Shared
/// with the tasks that fetch the view.
#[derive(Debug)]
struct ViewFollower {
    /// The nodes' control addresses and ids, for monitoring connections.
    nodes: Vec<(std::net::SocketAddr, Option<u32>)>,
    /// The cluster secret.
    secret: Vec<u8>,
    /// Their ids.
    node_ids: Vec<u32>,
    /// The view the client routes by.
    membership: Mutex<Membership>,
    /// The client's counters (view refreshes).
    counters: Arc<Counters>,
    /// Held by the fetch in progress.
    refreshing: tokio::sync::Mutex<()>,
    /// When the last fetch of the view reached no node: the first node's error.
    unanswered: Mutex<Option<String>>,
    /// Whether the last fetch of the view found every node refusing the connection outright
    /// (nothing listens on any node's port: the cluster is down).
    all_refused: std::sync::atomic::AtomicBool,
}

impl ViewFollower {
    /// The newest view the nodes answer with, all asked at once (epochs only grow, and a view
    /// is committed before any node shows it). It returns once a majority of the nodes
    /// answered, or every node answered or failed, each within [`VIEW_FETCH_TIMEOUT`]: a
    /// paused or cut-off node costs the fetch nothing (waiting for its timeout stalled every
    /// operation that needed the view for half a second while it was being marked down).
    async fn newest_view(&self) -> Option<ClusterView> {
        use futures_util::stream::StreamExt;
        let majority = self.nodes.len() / 2 + 1;
        let mut fetches: futures_util::stream::FuturesUnordered<_> = self
            .nodes
            .iter()
            .map(|(address, id)| async move {
                let node = MonitoredNode {
                    address: *address,
                    id: *id,
                    secret: &self.secret,
                };
                fetch_view(node, VIEW_FETCH_TIMEOUT).await.map_err(|error| {
                    let refused = matches!(
                        &error,
                        ControlError::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused
                    );
                    (format!("node at {address}: {error}"), refused)
                })
            })
            .collect();
        let mut answers = Vec::with_capacity(self.nodes.len());
        let mut answered = 0;
        while let Some(answer) = fetches.next().await {
            answered += usize::from(answer.is_ok());
            answers.push(answer);
            if answered >= majority {
                break;
            }
        }
        let all_refused = answers.len() == self.nodes.len()
            && answers
                .iter()
                .all(|answer| matches!(answer, Err((_, true))));
        self.all_refused
            .store(all_refused, std::sync::atomic::Ordering::Relaxed);
        let unanswered = if answers.iter().all(Result::is_err) {
            answers
                .iter()
                .find_map(|answer| answer.as_ref().err().map(|(text, _)| text.clone()))
        } else {
            None
        };
        *self
            .unanswered
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = unanswered;
        answers.into_iter().flatten().max_by_key(|view| view.epoch)
    }

    /// When the last fetch of the view reached no node: the first node's error.
    fn unanswered(&self) -> Option<String> {
        self.unanswered
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Fetches the cluster view and routes by it from now on, if it is newer than the one the
    /// client has. Whether it was newer.
    async fn refresh(&self) -> bool {
        // One fetch at a time: the others wait for it, and find the view it brought.
        let _refreshing = self.refreshing.lock().await;
        self.counters.view_refreshes.add(1);
        let Some(view) = self.newest_view().await else {
            return false;
        };
        let mut membership = self
            .membership
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if view.epoch <= membership.epoch {
            return false;
        }
        let mut members: Vec<u32> = view.members.iter().map(|member| member.node_id).collect();
        let mut known = self.node_ids.clone();
        members.sort_unstable();
        known.sort_unstable();
        if members != known {
            // Nodes that are not one cluster (each its own one-node view, as in-process test
            // nodes are): keep routing by the cluster file, and do not ask again for this epoch.
            membership.epoch = view.epoch;
            return false;
        }
        let serving = view.serving();
        let filling: Vec<u32> = view
            .members
            .iter()
            .filter(|member| member.state == rdkv_common::protocol::MemberState::Filling)
            .map(|member| member.node_id)
            .collect();
        tracing::debug!(
            epoch = view.epoch,
            ?serving,
            ?filling,
            "routing by a new cluster view"
        );
        *membership = Membership {
            epoch: view.epoch,
            serving,
            filling,
        };
        true
    }
}

/// How long a client waits before it asks for the view again while a node it needs does not
/// answer and the view still names it (the failure detector has not committed it down yet).
const VIEW_POLL_INTERVAL: Duration = Duration::from_millis(50);

/// How long a replicated operation runs before the client checks, and then every this long,
/// whether the view moved its key (a node that stopped answering without failing its
/// connections, as a paused or cut-off one does, is committed down meanwhile).
const VIEW_WATCH_INTERVAL: Duration = Duration::from_millis(250);

/// How long one node may take to answer a view fetch (all are asked at once).
const VIEW_FETCH_TIMEOUT: Duration = Duration::from_millis(500);

/// How long a dropped client's goodbye may take to be handed to a connection's control task
/// (which then finishes it on its own): a full control channel never holds the task for long.
const GOODBYE_TIMEOUT: Duration = Duration::from_secs(1);

/// Says goodbye on `connection` in a task of its own, bounded by `GOODBYE_TIMEOUT` (best
/// effort: on a timeout it closes without the goodbye): a connection an opening brought back
/// that nothing will use.
fn say_goodbye_later(connection: Arc<NodeConnection>) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(GOODBYE_TIMEOUT, connection.close()).await;
    });
}

/// What a connection of lane `lane` says it is for. Lane 0 is the client's first connection to
/// the node; the others are extra lanes, which a node more than half full refuses (its first
/// lane serves). A node's refill client takes the peers' reserved slots on every lane.
fn purpose_of_lane(config: &ClientConfig, lane: usize) -> rdkv_common::protocol::Purpose {
    use rdkv_common::protocol::Purpose;
    if config.refill_peer {
        Purpose::Refill
    } else if lane == 0 {
        Purpose::Data
    } else {
        Purpose::Lane
    }
}

/// An rdkv client: a connection per node and runtime worker ([`crate::lanes`]), opened on
/// first use (or up front with [`Client::connect_all`]); keys map to nodes by rendezvous
/// hashing. On a current-thread runtime that is one connection per node. Share it behind an `Arc`;
/// every method takes `&self`.
///
/// [`Client::close`] says goodbye to every node and waits until each goodbye is written.
/// Dropping the client does the same without waiting, in tasks spawned on the current tokio
/// runtime (if there is none, the connections just close; the servers notice at once, but
/// the counters since the last heartbeat are lost).
#[derive(Debug)]
pub struct Client {
    /// The nodes, in cluster-file order. Shared with the tasks of [`Client::connect_all`].
    nodes: Vec<Arc<Node>>,
    /// Node ids, in the same order, for rendezvous hashing.
    node_ids: Vec<u32>,
    /// Copies of each key (the cluster file's `replicas`): with more than one, operations
    /// route by the cluster view and writes go through [`crate::replicated`].
    replicas: usize,
    /// The cluster view as this client last learned it, and how it learns a newer one.
    follower: Arc<ViewFollower>,
    /// Counters.
    counters: Arc<Counters>,
    /// The per-operation deadline.
    deadline: Duration,
}

impl Client {
    /// Connects to one node and authenticates at once.
    ///
    /// # Errors
    /// [`Error::NodeUnreachable`], [`Error::AuthenticationFailed`], or the fabric's errors
    /// (for example a memlock limit too low for even one scratch buffer).
    pub async fn connect(config: ClientConfig) -> Result<Self> {
        let counters = Arc::new(Counters::default());
        let lanes = lanes_for(config.lanes);
        let node = Node::new(1, config, lanes);
        let connection = NodeConnection::open(
            &node.config,
            purpose_of_lane(&node.config, 0),
            counters.clone(),
            node.writer_stripes.clone(),
            node.slot_cache.clone(),
        )
        .await?;
        // Never longer than the server's: it reuses heap space and clears abandoned tentative
        // slots on the assumption that no operation outlives its deadline.
        let server_deadline = Duration::from_millis(connection.welcome.operation_deadline_ms);
        let deadline = node
            .config
            .operation_deadline
            .map_or(server_deadline, |deadline| deadline.min(server_deadline));
        node.server_deadline_ms
            .store(connection.welcome.operation_deadline_ms, Ordering::Relaxed);
        // The first lane; the others open in the background as workers use them.
        *rdkv_fabric::lock(&node.lanes[0].connection) = Some(connection);
        Ok(Self {
            node_ids: vec![1],
            nodes: vec![Arc::new(node)],
            replicas: 1,
            follower: Arc::new(ViewFollower {
                nodes: Vec::new(),
                secret: Vec::new(),
                node_ids: vec![1],
                membership: Mutex::new(Membership {
                    epoch: 0,
                    serving: vec![1],
                    filling: Vec::new(),
                }),
                counters: counters.clone(),
                refreshing: tokio::sync::Mutex::new(()),
                unanswered: Mutex::new(None),
                all_refused: std::sync::atomic::AtomicBool::new(false),
            }),
            counters,
            deadline,
        })
    }

    /// A client of every node of a cluster; connections open on first use, so the first
    /// operation on each node pays the handshake inside its deadline. Call
    /// [`Client::connect_all`] to connect up front.
    pub fn for_cluster(cluster: &ClusterConfig) -> Self {
        Self::for_cluster_with_concurrency(cluster, DEFAULT_CONCURRENCY)
    }

    /// As [`Client::for_cluster`], with at most `concurrency` operations in flight per connection
    /// (each lane has its own).
    /// Each holds a 64 KiB registered scratch buffer while it runs, from the process's shared
    /// pool, which grows with the operations in flight and shrinks back (`docs/memory.md`).
    pub fn for_cluster_with_concurrency(cluster: &ClusterConfig, concurrency: usize) -> Self {
        Self::for_cluster_with(cluster, concurrency, crate::SharedMemory::Auto)
    }

    /// As [`Client::for_cluster_with_concurrency`], with `shared_memory` for every node whose
    /// cluster-file entry allows `shm` (`Off` there wins).
    pub fn for_cluster_with(
        cluster: &ClusterConfig,
        concurrency: usize,
        shared_memory: crate::SharedMemory,
    ) -> Self {
        Self::for_cluster_with_lanes(cluster, concurrency, shared_memory, None)
    }

    /// As [`Client::for_cluster_with`], with at most `lanes` connections to each node (as
    /// [`ClientConfig::lanes`]: `None` is one per tokio worker of the current runtime, at most
    /// [`crate::lanes::MAX_LANES`]).
    pub fn for_cluster_with_lanes(
        cluster: &ClusterConfig,
        concurrency: usize,
        shared_memory: crate::SharedMemory,
        lanes: Option<usize>,
    ) -> Self {
        Self::for_cluster_configured(cluster, concurrency, shared_memory, lanes, false)
    }

    /// A node's own client for its refill (`rdkv-server`): one lane per peer, never shared
    /// memory, and connections that take the peers' reserved slots ([`ClientConfig::refill_peer`]).
    pub fn for_refill(cluster: &ClusterConfig, concurrency: usize) -> Self {
        Self::for_cluster_configured(
            cluster,
            concurrency,
            crate::SharedMemory::Off,
            Some(1),
            true,
        )
    }

    fn for_cluster_configured(
        cluster: &ClusterConfig,
        concurrency: usize,
        shared_memory: crate::SharedMemory,
        lanes: Option<usize>,
        refill_peer: bool,
    ) -> Self {
        let lanes = lanes_for(lanes);
        let nodes: Vec<Arc<Node>> = cluster
            .nodes
            .iter()
            .map(|node| {
                let mut config =
                    ClientConfig::new(node.control_address, cluster.fabric, &cluster.secret);
                config.node.id = Some(node.id);
                config.routes_by_view = true;
                // A node's shm = "off" turns auto off; a required shm stays required (and
                // fails at connect, naming the node's setting).
                config.node.shared_memory = match (node.shm, shared_memory) {
                    (rdkv_cluster_file::ShmMode::Off, crate::SharedMemory::Auto) => {
                        crate::SharedMemory::Off
                    }
                    (_, choice) => choice,
                };
                config.operation_deadline = Some(cluster.operation_deadline);
                config.poll_spin = cluster.poll_spin;
                config.concurrency = concurrency.max(1);
                config.refill_peer = refill_peer;
                Arc::new(Node::new(node.id, config, lanes))
            })
            .collect();
        let mut serving: Vec<u32> = nodes.iter().map(|node| node.id).collect();
        serving.sort_unstable();
        let counters = Arc::new(Counters::default());
        Self {
            node_ids: nodes.iter().map(|node| node.id).collect(),
            follower: Arc::new(ViewFollower {
                nodes: nodes
                    .iter()
                    .map(|node| (node.config.node.control_address, node.config.node.id))
                    .collect(),
                secret: cluster.secret.clone(),
                node_ids: nodes.iter().map(|node| node.id).collect(),
                membership: Mutex::new(Membership {
                    epoch: 0,
                    serving,
                    filling: Vec::new(),
                }),
                counters: counters.clone(),
                refreshing: tokio::sync::Mutex::new(()),
                unanswered: Mutex::new(None),
                all_refused: std::sync::atomic::AtomicBool::new(false),
            }),
            nodes,
            replicas: cluster.replicas.max(1),
            counters,
            deadline: cluster.operation_deadline,
        }
    }

    /// A client of the cluster in a cluster file.
    ///
    /// # Errors
    /// [`Error::Config`] when the file is invalid.
    pub fn from_file(path: &std::path::Path) -> Result<Self> {
        Self::from_file_with(path, crate::FabricChoice::Auto)
    }

    /// A client of the cluster in a cluster file, on the fabric `choice` names.
    ///
    /// # Errors
    /// [`Error::Config`] when the file is invalid or the choice names a fabric the cluster
    /// does not run.
    pub fn from_file_with(path: &std::path::Path, choice: crate::FabricChoice) -> Result<Self> {
        Self::from_file_with_concurrency(path, choice, DEFAULT_CONCURRENCY)
    }

    /// As [`Client::from_file_with`], with at most `concurrency` operations in flight per
    /// connection (as [`Client::for_cluster_with_concurrency`]): an application that runs more
    /// tasks than the default (16) at once sets it to its task count, or its
    /// tasks wait for each other's scratch buffers.
    ///
    /// # Errors
    /// As [`Client::from_file_with`].
    pub fn from_file_with_concurrency(
        path: &std::path::Path,
        choice: crate::FabricChoice,
        concurrency: usize,
    ) -> Result<Self> {
        let cluster = rdkv_cluster_file::load(path).map_err(|error| {
            // The reason keeps the causes ("cannot read the cluster file: No such file ...").
            let mut reason = error.to_string();
            let mut cause = std::error::Error::source(&error);
            while let Some(inner) = cause {
                reason.push_str(": ");
                reason.push_str(&inner.to_string());
                cause = inner.source();
            }
            Error::Config { reason }
        })?;
        let shared_memory = choice
            .shared_memory(cluster.fabric)
            .map_err(|reason| Error::Config { reason })?;
        Ok(Self::for_cluster_with(&cluster, concurrency, shared_memory))
    }

    /// Gives every node's connections `injector` (tests of failures at chosen steps:
    /// [`crate::fault`]). Call it before the first operation.
    ///
    /// # Panics
    /// When a connection is open already.
    #[doc(hidden)]
    pub fn with_fault_injector(mut self, injector: Arc<dyn crate::fault::FaultInjector>) -> Self {
        for node in &mut self.nodes {
            Arc::get_mut(node)
                .expect("with_fault_injector before any connection")
                .config
                .fault_injector = Some(injector.clone());
        }
        self
    }

    /// The node that owns `key`.
    fn node_for(&self, key: &[u8]) -> &Arc<Node> {
        let index = sharding::owner(key, &self.node_ids).unwrap_or(0);
        &self.nodes[index]
    }

    /// The id of the node that owns `key`.
    pub fn node_of(&self, key: &[u8]) -> u32 {
        self.node_for(key).id
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
        let mut tasks = tokio::task::JoinSet::new();
        for (index, node) in self.nodes.iter().enumerate() {
            let node = node.clone();
            let counters = self.counters.clone();
            // The first lane; the others open in the background below.
            tasks.spawn(async move {
                if node.lanes[0].healthy_connection().is_some() {
                    return (index, Ok(()));
                }
                (index, Self::establish(node, 0, counters).await.map(drop))
            });
        }
        let mut first_failure: Option<(usize, Error)> = None;
        while let Some(joined) = tasks.join_next().await {
            // A panic in a connecting task is a bug: pass it on.
            let (index, outcome) =
                joined.unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()));
            if let Err(error) = outcome {
                if first_failure
                    .as_ref()
                    .is_none_or(|(first, _)| index < *first)
                {
                    first_failure = Some((index, error));
                }
            }
        }
        // The other lanes open in the background: a node at max_connections would hold each
        // for the 5 s handshake timeout, and the first lane serves their operations meanwhile.
        for node in &self.nodes {
            if node.lanes[0].healthy_connection().is_none() {
                continue;
            }
            for lane in 1..node.lanes.len() {
                if node.lanes[lane].healthy_connection().is_none() {
                    self.open_in_background(node, lane);
                }
            }
        }
        match first_failure {
            None => Ok(()),
            Some((index, error)) => {
                let node = &self.nodes[index];
                Err(Error::ConnectFailed {
                    node: node.id,
                    address: node.config.node.control_address,
                    source: Box::new(error),
                })
            }
        }
    }

    /// The live connection of the calling thread's lane to `node`, (re-)established if needed.
    async fn connection(&self, node: &Arc<Node>) -> Result<Arc<NodeConnection>> {
        let lane = node.lane();
        if let Some(connection) = node.lanes[lane].healthy_connection() {
            return Ok(connection);
        }
        // Another lane serves while this one opens in the background (`lanes`).
        if let Some(connection) = node.any_healthy_connection() {
            self.open_in_background(node, lane);
            return Ok(connection);
        }
        // None is connected: the first lane opens on the operation's path.
        Self::establish(node.clone(), 0, self.counters.clone()).await
    }

    /// Opens `node`'s lane `lane` in a task of its own, unless an attempt is in flight or
    /// failed within the retry interval.
    fn open_in_background(&self, node: &Arc<Node>, lane: usize) {
        if !node.lanes[lane].claim_background_attempt() {
            return;
        }
        let node = node.clone();
        let counters = self.counters.clone();
        tokio::spawn(async move {
            let outcome = Self::establish(node.clone(), lane, counters).await;
            if let Err(error) = &outcome {
                tracing::debug!(%error, node = node.id, lane, "a lane did not open; another serves");
            }
            node.lanes[lane].end_background_attempt(outcome.is_ok());
        });
    }

    /// (Re-)establishes the connection of `node`'s lane `lane`, unless another caller did
    /// meanwhile. The connection is opened by a task of its own (bounded by the handshake's
    /// timeout), which stores it even if the operation that asked is cancelled by its
    /// deadline: a client with a deadline shorter than a handshake still gets connected (found
    /// by attacking it with 1 ms deadlines).
    async fn establish(
        node: Arc<Node>,
        lane: usize,
        counters: Arc<Counters>,
    ) -> Result<Arc<NodeConnection>> {
        let connecting = node.lanes[lane]
            .connecting
            .clone()
            .acquire_owned()
            .await
            .expect("the connection gate is never closed");
        // Another operation may have connected while this one waited.
        if let Some(connection) = node.lanes[lane].healthy_connection() {
            return Ok(connection);
        }
        let address = node.config.node.control_address;
        // A node that just refused (or was down) is not asked again at once: each operation
        // would try a connect of its own (`lanes::RECONNECT_BACKOFF_FIRST`).
        if let Some((reason, refused, ago, left)) = node.lanes[lane].backing_off() {
            let reason = format!(
                "{reason} (the last attempt, {} ms ago; the next in {} ms)",
                ago.as_millis(),
                left.as_millis().max(1)
            );
            return Err(if refused {
                Error::Refused { reason }
            } else {
                Error::NodeUnreachable { address, reason }
            });
        }
        let generation = node.generation.load(Ordering::Acquire);
        let opening = tokio::spawn(async move {
            let purpose = purpose_of_lane(&node.config, lane);
            // In this task, so an operation cancelled meanwhile still records the outcome.
            let opened = NodeConnection::open(
                &node.config,
                purpose,
                counters.clone(),
                node.writer_stripes.clone(),
                node.slot_cache.clone(),
            )
            .await;
            let fresh = match opened {
                Ok(fresh) => {
                    node.lanes[lane].connect_succeeded();
                    fresh
                }
                Err(error) => {
                    // An unreachable node and a refusing one (full) earn a pause: each
                    // operation would otherwise try a handshake of its own (a client against
                    // a full node made 14,800 a second). A wrong secret fails every attempt
                    // the same way, and its error says so each time.
                    match &error {
                        Error::NodeUnreachable { reason, .. } => {
                            node.lanes[lane].connect_failed(reason.clone(), false)
                        }
                        Error::Refused { reason } => {
                            node.lanes[lane].connect_failed(reason.clone(), true)
                        }
                        _ => {}
                    }
                    return Err(error);
                }
            };
            node.server_deadline_ms
                .store(fresh.welcome.operation_deadline_ms, Ordering::Relaxed);
            let slot = &node.lanes[lane];
            let mut current = rdkv_fabric::lock(&slot.connection);
            if node.generation.load(Ordering::Acquire) != generation {
                // The client was closed (or dropped) while this connection opened.
                drop(current);
                say_goodbye_later(fresh);
                return Err(Error::NodeUnreachable {
                    address,
                    reason: "the client was closed while this connection opened".to_string(),
                });
            }
            if current.is_some() || slot.retired.swap(false, Ordering::AcqRel) {
                counters.reconnects.add(1);
            }
            *current = Some(fresh.clone());
            drop(current);
            drop(connecting);
            Ok::<_, Error>(fresh)
        });
        opening.await.map_err(|error| Error::NodeUnreachable {
            address,
            reason: format!("the connecting task failed: {error}"),
        })?
    }

    /// Runs one operation under the deadline. A failure is retried on a fresh connection only
    /// when it is retryable and the operation posted no CAS yet, at most once per lane (each
    /// failed connection is marked broken, and a node that restarted took every lane's down:
    /// one retry could land on another lane's dead connection); a failure after a
    /// publishing CAS was posted becomes [`Error::Unresolved`], and a deadline says whether the
    /// operation may have applied.
    async fn run<T, Attempt, Outcome>(
        &self,
        operation: &'static str,
        key: &[u8],
        mut attempt: Attempt,
    ) -> Result<T>
    where
        Attempt: FnMut(Arc<NodeConnection>, Arc<Progress>) -> Outcome,
        Outcome: std::future::Future<Output = Result<T>>,
    {
        let node = self.node_for(key);
        let progress = Arc::new(Progress::default());
        // Never longer than the node's own deadline: its heap reuse and its clearing of
        // abandoned tentative slots rely on it.
        let deadline = match node.server_deadline_ms.load(Ordering::Relaxed) {
            0 => self.deadline,
            server => self.deadline.min(Duration::from_millis(server)),
        };
        // Retires the connection if the operation ends, fails or is cancelled (by this
        // deadline or by its caller dropping the future) with its tentative slot outstanding.
        let guard = RetireOnAbandon {
            client: self,
            node,
            progress: progress.clone(),
            latest: Mutex::new(None),
        };
        let work = async {
            let mut retries = 0;
            loop {
                progress.wait_for(Waiting::Connection);
                let connection = self.connection(node).await?;
                *guard
                    .latest
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(connection.clone());
                match attempt(connection.clone(), progress.clone()).await {
                    Err(error)
                        if error.is_retryable()
                            && retries < node.lanes.len()
                            && !progress.cas_posted() =>
                    {
                        tracing::debug!(%error, operation, "retrying on a fresh connection");
                        connection.mark_broken();
                        retries += 1;
                    }
                    Err(error) if progress.may_have_applied() && !error.may_have_applied() => {
                        return Err(Error::Unresolved {
                            operation,
                            source: Box::new(error),
                        })
                    }
                    outcome => return outcome,
                }
            }
        };
        let outcome = yield_if_never_waited(deadline::timeout(deadline, work))
            .await
            .unwrap_or_else(|_| {
                // Out of heap for the whole deadline (the node answered that chunks were on
                // their way back, and none came): the heap is too small for this write rate,
                // which is TableFull, not a timeout. Nothing was published: a block is placed
                // first. A node that never answered the request (stopped, or this process
                // stopped past its deadline) is a timeout that says so.
                if progress.waiting_for() == Waiting::HeapReclaim && !progress.may_have_applied() {
                    return Err(Error::TableFull {
                        reason: format!(
                            "heap full: no heap chunk came back within the {deadline:?} deadline; \
                             raise heap_size (docs/operations.md, Sizing the heap)"
                        ),
                    });
                }
                Err(Error::TimedOut {
                    operation,
                    deadline,
                    waiting_for: progress.waiting_for().describe(),
                    unanswered: None,
                    may_have_applied: progress.may_have_applied(),
                })
            });
        drop(guard);
        // Every operation ends counted, under its kind too (a GET counts itself only once it
        // has looked: a failed one is counted here; mutations count themselves either way).
        self.counters.operations.add(1);
        if outcome.is_err() {
            self.counters.failures.add(1);
            if operation == "get" {
                self.counters.gets.add(1);
            }
        }
        outcome
    }

    /// The nodes holding `key`'s copies under the client's view, primary first: `count` of
    /// them, and while members fill, those too ([`Membership::write_replicas`]); a GET asks for
    /// one, the primary.
    fn replica_nodes(&self, key: &[u8], count: usize) -> Vec<Arc<Node>> {
        let membership = self
            .follower
            .membership
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut ids = membership.write_replicas(key, count);
        if count == 1 {
            ids.truncate(1);
        }
        let nodes: Vec<Arc<Node>> = ids
            .into_iter()
            .filter_map(|id| self.node_by_id(id).cloned())
            .collect();
        if nodes.is_empty() {
            // No member serving (the view says the whole cluster is down): try the file's.
            vec![self.node_for(key).clone()]
        } else {
            nodes
        }
    }

    /// Runs `attempt` on `key`'s copies `planned` (node ids, primary first), checking every
    /// [`VIEW_WATCH_INTERVAL`] whether a newer view moved them; `None`: it did, and the
    /// attempt was dropped (the caller decides from the operation's progress what that means).
    async fn watched<T>(
        &self,
        key: &[u8],
        count: usize,
        planned: &[u32],
        attempt: impl std::future::Future<Output = T>,
    ) -> Option<T> {
        let attempt = std::pin::pin!(attempt);
        let mut attempt = attempt;
        let start = tokio::time::Instant::now() + VIEW_WATCH_INTERVAL;
        let mut ticks = tokio::time::interval_at(start, VIEW_WATCH_INTERVAL);
        loop {
            tokio::select! {
                outcome = &mut attempt => return Some(outcome),
                _ = ticks.tick() => {
                    if self.refresh_membership().await {
                        let now: Vec<u32> =
                            self.replica_nodes(key, count).iter().map(|node| node.id).collect();
                        if now != planned {
                            return None;
                        }
                    }
                }
            }
        }
    }

    /// The view's epoch the client routes by.
    fn membership_epoch(&self) -> u64 {
        self.follower
            .membership
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .epoch
    }

    /// Fetches the cluster view and routes by it from now on, if it is newer than the one the
    /// client has. Whether it was newer. The fetch runs in a task of its own, so that it
    /// completes even when the operation that asked is cancelled by its deadline (an operation
    /// with a deadline shorter than a fetch would otherwise never let the client learn a view:
    /// found with 1 ms deadlines).
    async fn refresh_membership(&self) -> bool {
        let follower = self.follower.clone();
        tokio::spawn(async move { follower.refresh().await })
            .await
            .unwrap_or(false)
    }

    /// After an operation met a node that failed: fetch the view; if it did not change, wait a
    /// little (the failure detector commits a dead node down within `failure_timeout`). The
    /// operation's deadline bounds the waiting.
    async fn await_new_view(&self) {
        if !self.refresh_membership().await {
            tokio::time::sleep(VIEW_POLL_INTERVAL).await;
        }
    }

    /// The live connections of the calling thread's lanes to `nodes`, in order.
    async fn connections_to(&self, nodes: &[Arc<Node>]) -> Result<Vec<Arc<NodeConnection>>> {
        let mut connections = Vec::with_capacity(nodes.len());
        for node in nodes {
            connections.push(self.connection(node).await?);
        }
        Ok(connections)
    }

    /// The deadline of an operation on a replicated cluster: the client's, never longer than
    /// any node's.
    fn replicated_deadline(&self) -> Duration {
        self.nodes
            .iter()
            .map(|node| node.server_deadline_ms.load(Ordering::Relaxed))
            .filter(|server| *server > 0)
            .map(Duration::from_millis)
            .fold(self.deadline, Duration::min)
    }

    /// A GET on a replicated cluster: from the key's primary under the view. A node that fails
    /// (before the view shows it down) is retried under the next view, within the deadline.
    async fn get_replicated(&self, key: &[u8]) -> Result<Option<Bytes>> {
        let progress = Arc::new(Progress::default());
        let deadline = self.replicated_deadline();
        let work = async {
            loop {
                progress.wait_for(Waiting::View);
                self.follow_reported_epoch().await;
                let primary = self.replica_nodes(key, 1);
                let planned: Vec<u32> = primary.iter().map(|node| node.id).collect();
                progress.wait_for(Waiting::Connection);
                let attempt = async {
                    let connections = self.connections_to(&primary).await?;
                    if self.view_epoch() > self.membership_epoch()
                        && self.refresh_membership().await
                    {
                        // A connection just made names a newer view: route by it.
                        return Ok(None);
                    }
                    operations::get(&connections[0], progress.clone(), key)
                        .await
                        .map(Some)
                };
                match self.watched(key, 1, &planned, attempt).await {
                    // The view moved the key, or a connection named a newer view: again.
                    None | Some(Ok(None)) => {}
                    Some(Ok(Some(value))) => return Ok(value),
                    Some(Err(error)) if error.is_retryable() => {
                        progress.wait_for(Waiting::View);
                        self.await_new_view().await;
                        if let Some(down) = self.cluster_down("get") {
                            return Err(down);
                        }
                    }
                    Some(Err(error)) => return Err(error),
                }
            }
        };
        let outcome = self.within_deadline("get", deadline, &progress, work).await;
        self.counters.operations.add(1);
        if outcome.is_err() {
            self.counters.failures.add(1);
            self.counters.gets.add(1);
        }
        outcome
    }

    /// When the last view fetch found every node of the cluster file refusing the connection
    /// outright, the error that says the cluster is down: nothing listens on any node, so
    /// waiting out the deadline for a view would only cost the caller its deadline.
    fn cluster_down(&self, operation: &'static str) -> Option<Error> {
        if !self
            .follower
            .all_refused
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return None;
        }
        let address = self.follower.nodes.first()?.0;
        Some(Error::NodeUnreachable {
            address,
            reason: format!(
                "{operation}: every node of the cluster refused the connection: the cluster is down (start it with `rdkv-cluster up FILE`); it did not apply"
            ),
        })
    }

    /// Routes by the view the nodes reported in heartbeats, if it is newer than the client's.
    async fn follow_reported_epoch(&self) {
        if self.view_epoch() > self.membership_epoch() {
            self.refresh_membership().await;
        }
    }

    /// A mutation on a replicated cluster ([`crate::replicated`]): on the key's replicas
    /// under the view. A failure before any CAS that could show the write, or a stolen lock,
    /// starts it again (under the next view after a node failure); a failure after one is
    /// [`Error::Unresolved`].
    async fn mutate_replicated(
        &self,
        operation: &'static str,
        key: &[u8],
        write: Write<'_>,
    ) -> Result<MutationOutcome> {
        let progress = Arc::new(Progress::default());
        let deadline = self.replicated_deadline();
        let work = async {
            let mut patience = Patience::default();
            let mut held: Option<Held> = None;
            // The key's primary in the last pass.
            let mut last_primary: Option<std::net::SocketAddr> = None;
            for again in 0..operations::RACE_ATTEMPTS {
                progress.wait_for(Waiting::View);
                self.follow_reported_epoch().await;
                let nodes = self.replica_nodes(key, self.replicas);
                let planned: Vec<u32> = nodes.iter().map(|node| node.id).collect();
                progress.wait_for(Waiting::Connection);
                let connecting = self.connections_to(&nodes);
                let connections = match self.watched(key, self.replicas, &planned, connecting).await
                {
                    None => continue,
                    Some(Ok(connections)) => connections,
                    Some(Err(error)) if error.is_retryable() => {
                        progress.wait_for(Waiting::View);
                        self.await_new_view().await;
                        if !progress.may_have_applied() {
                            if let Some(down) = self.cluster_down(operation) {
                                return Err(down);
                            }
                        }
                        continue;
                    }
                    Some(Err(error)) => return Err(error),
                };
                if self.view_epoch() > self.membership_epoch() && self.refresh_membership().await {
                    // A connection just made names a newer view: route by it.
                    continue;
                }
                let previous_primary = last_primary.replace(connections[0].address);
                if let Some(primary) = previous_primary.filter(|_| progress.backup_posted()) {
                    if primary != connections[0].address {
                        // A backup may hold this write's value: one whose lock was taken over
                        // keeps it until the thief rolls it back, and the view may have made that
                        // backup the primary first (found by the model check).
                        return Err(Error::Unresolved {
                            operation,
                            source: Box::new(Error::NodeUnreachable {
                                address: primary,
                                reason: format!(
                                    "a new cluster view moved the key's primary (to the node at {}) after a backup took the write",
                                    connections[0].address
                                ),
                            }),
                        });
                    }
                }
                if let Some(mut lock) = held.take() {
                    // The last attempt's connections failed while it held its lock: go on from
                    // there if the key's primary is still that node.
                    if connections[0].address != lock.primary {
                        if progress.may_have_applied() {
                            return Err(Error::Unresolved {
                                operation,
                                source: Box::new(Error::NodeUnreachable {
                                    address: lock.primary,
                                    reason: format!(
                                        "a new cluster view moved the key's primary (to the node at {}) while the write held its lock there",
                                        connections[0].address
                                    ),
                                }),
                            });
                        }
                        continue;
                    }
                    let resuming = replicated::resume(
                        &connections,
                        progress.clone(),
                        operation,
                        key,
                        write,
                        &mut lock,
                    );
                    let Some(resumed) = self.watched(key, self.replicas, &planned, resuming).await
                    else {
                        // The view moved the key meanwhile: decided on the next pass.
                        held = Some(lock);
                        continue;
                    };
                    match resumed {
                        Ok(Resumed::Applied) => return Ok(MutationOutcome::Applied),
                        Ok(Resumed::Again) => continue,
                        Ok(Resumed::Unknown) => return Err(Error::Unresolved {
                            operation,
                            source: Box::new(Error::Refused {
                                reason: "the write's commit was cut, and its lock was gone when it looked again (committed and overwritten since, or taken over)".into(),
                            }),
                        }),
                        Err(error) if error.is_retryable() => {
                            held = Some(lock);
                            {
                                progress.wait_for(Waiting::View);
                                self.await_new_view().await
                            };
                            continue;
                        }
                        Err(error) if progress.may_have_applied() && !error.may_have_applied() => {
                            // As for a first attempt (found by review: a resume's failed commit
                            // or backup was reported as certainly not applied).
                            return Err(Error::Unresolved {
                                operation,
                                source: Box::new(error),
                            })
                        }
                        Err(error) => return Err(error),
                    }
                }
                let attempting = replicated::mutate(
                    &connections,
                    progress.clone(),
                    operation,
                    key,
                    write,
                    &mut patience,
                    &mut held,
                );
                let Some(attempt) = self.watched(key, self.replicas, &planned, attempting).await
                else {
                    // The view moved the key while the attempt ran (a node stopped answering
                    // without failing its connections). With its lock placed, the next pass
                    // resumes it or reports it; with a backup written and no lock, it is
                    // unresolved; else it starts again.
                    if held.is_none() && progress.may_have_applied() {
                        return Err(Error::Unresolved {
                            operation,
                            source: Box::new(Error::Refused {
                                reason: "the view moved the key while the write ran".into(),
                            }),
                        });
                    }
                    continue;
                };
                match attempt {
                    Ok(Attempt::Done(outcome)) => return Ok(outcome),
                    Ok(Attempt::Steal(locked)) => {
                        // The takeover has a progress of its own: none of it is this write.
                        let takeover = Arc::new(Progress::default());
                        if let Err(error) =
                            replicated::steal(&connections, takeover, operation, key, &locked).await
                        {
                            if !error.is_retryable() {
                                return Err(error);
                            }
                            {
                                progress.wait_for(Waiting::View);
                                self.await_new_view().await
                            };
                        }
                        patience = Patience::default();
                    }
                    Ok(Attempt::Again) => operations::back_off(again).await,
                    Err(error) if error.is_retryable() && held.is_some() => {
                        // Cut while it held (or placed) its lock: resumed on the next pass.
                        {
                            progress.wait_for(Waiting::View);
                            self.await_new_view().await
                        };
                    }
                    Err(error) if error.is_retryable() && !progress.may_have_applied() => {
                        // Nothing of the write can be visible: its lock, if placed, is taken
                        // over after the patience.
                        {
                            progress.wait_for(Waiting::View);
                            self.await_new_view().await
                        };
                    }
                    Err(error) if progress.may_have_applied() && !error.may_have_applied() => {
                        return Err(Error::Unresolved {
                            operation,
                            source: Box::new(error),
                        })
                    }
                    Err(error) => return Err(error),
                }
            }
            Err(Error::Contention {
                operation,
                attempts: operations::RACE_ATTEMPTS,
            })
        };
        let outcome = self
            .within_deadline(operation, deadline, &progress, work)
            .await;
        self.counters.operations.add(1);
        if outcome.is_err() {
            self.counters.failures.add(1);
        }
        outcome
    }

    /// Fetches the cluster view and routes by it from now on (a node refilling itself uses
    /// this to include itself as filling). The view, or why none could be fetched.
    ///
    /// # Errors
    /// As [`Client::view`].
    #[doc(hidden)]
    pub async fn follow_view(&self) -> Result<ClusterView> {
        self.refresh_membership().await;
        self.view().await
    }

    /// The combined buckets of node `node_id`'s index (connecting to it if needed).
    ///
    /// # Errors
    /// [`Error::Config`] for a node not in the cluster; connection errors.
    #[doc(hidden)]
    pub async fn combined_buckets_of(&self, node_id: u32) -> Result<u64> {
        let node = self.node_by_id(node_id).ok_or_else(|| Error::Config {
            reason: format!("node {node_id} is not in the cluster"),
        })?;
        let connection = self.connection(node).await?;
        Ok(connection.welcome.geometry.combined_bucket_count())
    }

    /// The keys and values in combined buckets `first ..` (at most [`crate::SCAN_BUCKETS`])
    /// of node `node_id`'s index, read one-sided (refill, `docs/protocol.md`).
    ///
    /// # Errors
    /// As [`Client::get`].
    #[doc(hidden)]
    pub async fn scan_node(
        &self,
        node_id: u32,
        first: u64,
        count: u64,
    ) -> Result<Vec<(Bytes, Bytes)>> {
        let node = self
            .node_by_id(node_id)
            .ok_or_else(|| Error::Config {
                reason: format!("node {node_id} is not in the cluster"),
            })?
            .clone();
        let progress = Arc::new(Progress::default());
        let deadline = self.replicated_deadline();
        let work = async {
            let connection = self.connection(&node).await?;
            crate::scan::scan_buckets(&connection, progress.clone(), first, count).await
        };
        self.within_deadline("scan", deadline, &progress, work)
            .await
    }

    /// Whether node `me` must copy `key` from node `source` while it fills: `source` is the
    /// key's primary and `me` one of the copies the view is heading for.
    #[doc(hidden)]
    pub fn refill_target(&self, key: &[u8], source: u32, me: u32) -> bool {
        let membership = self
            .follower
            .membership
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let replicas = membership.write_replicas(key, self.replicas);
        replicas.first() == Some(&source) && replicas.contains(&me)
    }

    /// Copies `key`'s `value` to every replica the view is heading for, through the primary's
    /// lock (a compare-and-swap of the value with itself): `Ok(false)` when the value changed
    /// meanwhile (its writer wrote every replica already).
    ///
    /// # Errors
    /// As [`Client::compare_and_swap`].
    #[doc(hidden)]
    pub async fn refill_copy(&self, key: &[u8], value: &[u8]) -> Result<bool> {
        let outcome = self
            .mutate_replicated(
                "refill",
                key,
                Write::Value(value, Mutation::CompareAndSwap { expected: value }),
            )
            .await;
        // Counted under its kind like any write, so that a node's counters add up (a
        // restarted node's refill copies showed as operations of no kind in `rdkv stats`).
        self.counters.mutations.add(1);
        Ok(outcome? == MutationOutcome::Applied)
    }

    /// Runs `work` under `deadline`; past it, the error says what the operation waited for and
    /// whether it may have applied.
    async fn within_deadline<T>(
        &self,
        operation: &'static str,
        deadline: Duration,
        progress: &Progress,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        yield_if_never_waited(deadline::timeout(deadline, work))
            .await
            .unwrap_or_else(|_| {
                let waiting_for = progress.waiting_for();
                Err(Error::TimedOut {
                    operation,
                    deadline,
                    waiting_for: waiting_for.describe(),
                    unanswered: (waiting_for == Waiting::View)
                        .then(|| self.follower.unanswered())
                        .flatten(),
                    may_have_applied: progress.may_have_applied(),
                })
            })
    }

    /// Takes `connection` out of service: the next operation opens a new one, and once the
    /// operations still using it finish, its control connection closes, so the server tears it
    /// down and seals its chunk. Used after an operation failed with a tentative slot of its own
    /// still in the index: the server's collector clears it a quarantine after the seal.
    fn retire(&self, node: &Node, connection: &Arc<NodeConnection>) {
        connection.mark_broken();
        for lane in &node.lanes {
            if lane.remove(connection) {
                lane.retired.store(true, Ordering::Release);
            }
        }
    }

    async fn mutate(
        &self,
        operation: &'static str,
        key: &[u8],
        value: &[u8],
        mutation: Mutation<'_>,
    ) -> Result<MutationOutcome> {
        if self.replicas > 1 {
            let outcome = self
                .mutate_replicated(operation, key, Write::Value(value, mutation))
                .await;
            self.counters.mutations.add(1);
            return outcome;
        }
        let outcome = self
            .run(operation, key, |connection, progress| async move {
                operations::mutate(&connection, progress, operation, key, value, mutation).await
            })
            .await;
        self.counters.mutations.add(1);
        outcome
    }

    /// The value of `key`, if present. One round trip when the process's slot cache guesses the
    /// key's slot right (`docs/protocol.md`, *Guessed blocks*), else two (one when no slot has
    /// its fingerprint).
    ///
    /// # Errors
    /// [`Error::InvalidKey`], [`Error::TimedOut`], [`Error::NodeUnreachable`],
    /// [`Error::Corrupt`], or a typed work-completion failure.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Bytes>> {
        if self.replicas > 1 {
            return self.get_replicated(key).await;
        }
        self.run("get", key, |connection, progress| async move {
            operations::get(&connection, progress, key).await
        })
        .await
    }

    /// The values of several keys, fetched concurrently.
    ///
    /// # Errors
    /// The first error of any key.
    pub async fn batch_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Bytes>>> {
        let work = async {
            let mut tasks = tokio::task::JoinSet::new();
            for (index, key) in keys.iter().enumerate() {
                let node = match self.replicas {
                    1 => self.node_for(key).clone(),
                    _ => self.replica_nodes(key, 1).swap_remove(0),
                };
                let connection = self.connection(&node).await?;
                let key = key.to_vec();
                tasks.spawn(async move {
                    let progress = Arc::new(Progress::default());
                    (index, operations::get(&connection, progress, &key).await)
                });
            }
            let mut values = vec![None; keys.len()];
            while let Some(joined) = tasks.join_next().await {
                let (index, value) = joined.map_err(|error| Error::Refused {
                    reason: format!("batch task failed: {error}"),
                })?;
                values[index] = value?;
            }
            Ok::<_, Error>(values)
        };
        let gets_before = self.counters.gets.total();
        let values = deadline::timeout(self.deadline, work)
            .await
            .unwrap_or(Err(Error::TimedOut {
                operation: "batch_get",
                deadline: self.deadline,
                waiting_for: "the GETs of the batch",
                unanswered: None,
                may_have_applied: false,
            }));
        let count = keys.len() as u64;
        self.counters.operations.add(count);
        if values.is_err() {
            // Each key that did not complete its GET failed with the batch. (Another task's
            // GETs may land in between: the split is approximate under concurrency, the total
            // is exact.)
            let looked = self
                .counters
                .gets
                .total()
                .saturating_sub(gets_before)
                .min(count);
            self.counters.gets.add(count - looked);
            self.counters.failures.add(count - looked);
        }
        values
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
        if self.replicas > 1 {
            let outcome = self
                .mutate_replicated("delete", key, Write::Delete)
                .await
                .map(|outcome| outcome == MutationOutcome::Applied);
            self.counters.mutations.add(1);
            return outcome;
        }
        let outcome = self
            .run("delete", key, |connection, progress| async move {
                operations::delete(&connection, progress, key).await
            })
            .await;
        self.counters.mutations.add(1);
        outcome
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
        self.counters
            .view_epoch
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// This client's node with id `node_id`.
    fn node_by_id(&self, node_id: u32) -> Option<&Arc<Node>> {
        self.nodes.iter().find(|node| node.id == node_id)
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
        let node = &self.nodes[0];
        self.connection(node).await?.stats().await
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
            .flat_map(|node| {
                // Under each lane's lock, so an opening either stored its connection before
                // (taken here) or sees the new generation (and says goodbye itself).
                node.lanes.iter().filter_map(|lane| {
                    let mut connection = rdkv_fabric::lock(&lane.connection);
                    node.generation.fetch_add(1, Ordering::AcqRel);
                    connection.take()
                })
            })
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

/// Retires the operation's connection when it is dropped with the operation's tentative slot
/// still outstanding: after a failure, a deadline, or the caller cancelling the operation (found
/// by attacking the client: a cancelled insert's slot stayed until the client disconnected).
struct RetireOnAbandon<'client> {
    /// The client.
    client: &'client Client,
    /// The key's node.
    node: &'client Node,
    /// The operation's progress.
    progress: Arc<Progress>,
    /// The connection of the latest attempt.
    latest: Mutex<Option<Arc<NodeConnection>>>,
}

impl Drop for RetireOnAbandon<'_> {
    fn drop(&mut self) {
        if !self.progress.tentative_outstanding() {
            return;
        }
        let connection = self
            .latest
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(connection) = connection {
            self.client.retire(self.node, &connection);
        }
    }
}
