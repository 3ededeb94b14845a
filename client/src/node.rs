//! [`Node`]: one node of a client, with its lanes (a connection per runtime worker,
//! [`crate::lanes`]), and how their connections open on first use (the first lane on the
//! operation's path, the others in the background), are re-established after a failure, are
//! retired, and are taken out when the client closes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkv_common::protocol::{MonitoredNode, Purpose};

use crate::connection::{
    shared_slot_cache, ClientConfig, NodeConnection, SlotCache, WriterStripes,
};
use crate::counters::Counters;
use crate::error::{Error, Result};
use crate::lanes::{current_lane, Lane};

/// How long a dropped client's goodbye may take to be handed to a connection's control task
/// (which then finishes it on its own): a full control channel never holds the task for long.
pub(crate) const GOODBYE_TIMEOUT: Duration = Duration::from_secs(1);

/// Says goodbye on `connection` in a task of its own, bounded by `GOODBYE_TIMEOUT` (best
/// effort: on a timeout it closes without the goodbye).
pub(crate) fn say_goodbye_later(connection: Arc<NodeConnection>) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(GOODBYE_TIMEOUT, connection.close()).await;
    });
}

/// What a connection of lane `lane` says it is for. Lane 0 is the client's first connection to
/// the node; the others are extra lanes, which a node more than half full refuses (its first
/// lane serves). A node's refill client takes the peers' reserved slots on every lane.
fn purpose_of_lane(config: &ClientConfig, lane: usize) -> Purpose {
    if config.refill_peer {
        Purpose::Refill
    } else if lane == 0 {
        Purpose::Data
    } else {
        Purpose::Lane
    }
}

/// One node of the client's cluster.
#[derive(Debug)]
pub(crate) struct Node {
    /// The node's id (the rendezvous hashing input).
    pub(crate) id: u32,
    /// How to reach it.
    pub(crate) config: ClientConfig,
    /// Its lanes: a connection per runtime worker, each opened on the first operation that
    /// runs on its worker (`lanes`).
    pub(crate) lanes: Box<[Lane]>,
    /// This process's writer turns on the node, shared by its lanes.
    writer_stripes: Arc<WriterStripes>,
    /// The node's view of the process's slot cache (shared by every node and client of the
    /// process).
    slot_cache: Arc<SlotCache>,
    /// Bumped when the client takes its connections out (close, drop): a connection that an
    /// opening begun before then brings back says goodbye instead of being stored.
    generation: AtomicU64,
    /// The node's own operation deadline (from its welcome; 0 until the first connection):
    /// operations on it never run longer, whatever the client's deadline.
    server_deadline_ms: AtomicU64,
    /// The client's counters, which its connections count into.
    counters: Arc<Counters>,
}

impl Node {
    /// A node with `lanes` lanes, none connected, counting into `counters`.
    pub(crate) fn new(
        id: u32,
        config: ClientConfig,
        lanes: usize,
        counters: Arc<Counters>,
    ) -> Self {
        let slot_cache = shared_slot_cache(config.node.control_address, config.slot_cache_entries);
        Self {
            id,
            config,
            lanes: (0..lanes.max(1)).map(|_| Lane::new()).collect(),
            writer_stripes: Arc::new(WriterStripes::default()),
            slot_cache,
            generation: AtomicU64::new(0),
            server_deadline_ms: AtomicU64::new(0),
            counters,
        }
    }

    /// The node as a monitoring connection reaches it (no queue pair, no keys).
    pub(crate) fn monitored(&self) -> MonitoredNode<'_> {
        MonitoredNode {
            address: self.config.node.control_address,
            id: self.config.node.id,
            secret: &self.config.secret,
        }
    }

    /// A live connection of any lane.
    pub(crate) fn any_healthy_connection(&self) -> Option<Arc<NodeConnection>> {
        self.lanes.iter().find_map(Lane::healthy_connection)
    }

    /// The node's own operation deadline, once a connection brought it.
    pub(crate) fn server_deadline(&self) -> Option<Duration> {
        match self.server_deadline_ms.load(Ordering::Relaxed) {
            0 => None,
            milliseconds => Some(Duration::from_millis(milliseconds)),
        }
    }

    /// Opens the first lane's connection on the caller's path (a client of one node, which
    /// connects at once).
    pub(crate) async fn connect_first_lane(&self) -> Result<()> {
        let connection = self.open(0).await?;
        *rdkv_fabric::lock(&self.lanes[0].connection) = Some(connection);
        Ok(())
    }

    /// Opens a connection for lane `lane` and records the node's deadline from its welcome.
    async fn open(&self, lane: usize) -> Result<Arc<NodeConnection>> {
        let connection = NodeConnection::open(
            &self.config,
            purpose_of_lane(&self.config, lane),
            self.counters.clone(),
            self.writer_stripes.clone(),
            self.slot_cache.clone(),
        )
        .await?;
        self.server_deadline_ms
            .store(connection.welcome.operation_deadline_ms, Ordering::Relaxed);
        Ok(connection)
    }

    /// The live connection of the calling thread's lane, (re-)established if needed.
    pub(crate) async fn connection(self: &Arc<Self>) -> Result<Arc<NodeConnection>> {
        let lane = current_lane(self.lanes.len());
        if let Some(connection) = self.lanes[lane].healthy_connection() {
            return Ok(connection);
        }
        // Another lane serves while this one opens in the background (`lanes`).
        if let Some(connection) = self.any_healthy_connection() {
            self.open_in_background(lane);
            return Ok(connection);
        }
        // None is connected: the first lane opens on the operation's path.
        self.clone().establish(0).await
    }

    /// Starts opening every lane after the first that has no live connection, in the
    /// background, once the first lane is connected.
    pub(crate) fn open_other_lanes_in_background(self: &Arc<Self>) {
        if self.lanes[0].healthy_connection().is_none() {
            return;
        }
        for lane in 1..self.lanes.len() {
            if self.lanes[lane].healthy_connection().is_none() {
                self.open_in_background(lane);
            }
        }
    }

    /// Opens lane `lane` in a task of its own, unless an attempt is in flight or failed within
    /// the retry interval.
    fn open_in_background(self: &Arc<Self>, lane: usize) {
        if !self.lanes[lane].claim_background_attempt() {
            return;
        }
        let node = self.clone();
        tokio::spawn(async move {
            let outcome = node.clone().establish(lane).await;
            if let Err(error) = &outcome {
                tracing::debug!(%error, node = node.id, lane, "a lane did not open; another serves");
            }
            node.lanes[lane].end_background_attempt(outcome.is_ok());
        });
    }

    /// (Re-)establishes the connection of lane `lane`, unless another caller did meanwhile.
    /// The connection is opened by a task of its own (bounded by the handshake's timeout),
    /// which stores it even if the operation that asked is cancelled by its deadline: a client
    /// with a deadline shorter than a handshake still gets connected (found by attacking it
    /// with 1 ms deadlines).
    pub(crate) async fn establish(self: Arc<Self>, lane: usize) -> Result<Arc<NodeConnection>> {
        let connecting = self.lanes[lane]
            .connecting
            .clone()
            .acquire_owned()
            .await
            .expect("the connection gate is never closed");
        // Another operation may have connected while this one waited.
        if let Some(connection) = self.lanes[lane].healthy_connection() {
            return Ok(connection);
        }
        let address = self.config.node.control_address;
        // A node that just refused (or was down) is not asked again at once: each operation
        // would try a connect of its own (`lanes::RECONNECT_BACKOFF_FIRST`).
        if let Some((reason, refused, ago, left)) = self.lanes[lane].backing_off() {
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
        let generation = self.generation.load(Ordering::Acquire);
        let opening = tokio::spawn(async move {
            // In this task, so an operation cancelled meanwhile still records the outcome.
            let outcome = self.open_and_store(lane, generation).await;
            drop(connecting);
            outcome
        });
        opening.await.map_err(|error| Error::NodeUnreachable {
            address,
            reason: format!("the connecting task failed: {error}"),
        })?
    }

    /// Opens lane `lane`'s connection and stores it, unless the client took its connections
    /// out since `generation` (the connection then says goodbye). A failure to reach the node,
    /// or its refusal, earns the lane a pause before the next attempt.
    async fn open_and_store(&self, lane: usize, generation: u64) -> Result<Arc<NodeConnection>> {
        let fresh = match self.open(lane).await {
            Ok(fresh) => {
                self.lanes[lane].connect_succeeded();
                fresh
            }
            Err(error) => {
                // An unreachable node and a refusing one (full) earn a pause: each operation
                // would otherwise try a handshake of its own (a client against a full node made
                // 14,800 a second). A wrong secret fails every attempt the same way, and its
                // error says so each time.
                match &error {
                    Error::NodeUnreachable { reason, .. } => {
                        self.lanes[lane].connect_failed(reason.clone(), false)
                    }
                    Error::Refused { reason } => {
                        self.lanes[lane].connect_failed(reason.clone(), true)
                    }
                    _ => {}
                }
                return Err(error);
            }
        };
        let slot = &self.lanes[lane];
        let mut current = rdkv_fabric::lock(&slot.connection);
        if self.generation.load(Ordering::Acquire) != generation {
            // The client was closed (or dropped) while this connection opened.
            drop(current);
            say_goodbye_later(fresh);
            return Err(Error::NodeUnreachable {
                address: self.config.node.control_address,
                reason: "the client was closed while this connection opened".to_string(),
            });
        }
        if current.is_some() || slot.retired.swap(false, Ordering::AcqRel) {
            self.counters.reconnects.add(1);
        }
        *current = Some(fresh.clone());
        Ok(fresh)
    }

    /// Takes `connection` out of service: the next operation opens a new one, and once the
    /// operations still using it finish, its control connection closes, so the server tears it
    /// down and seals its chunk. Used after an operation failed with a tentative slot of its
    /// own still in the index: the server's collector clears it a quarantine after the seal.
    pub(crate) fn retire(&self, connection: &Arc<NodeConnection>) {
        connection.mark_broken();
        for lane in &self.lanes {
            if lane.remove(connection) {
                lane.retired.store(true, Ordering::Release);
            }
        }
    }

    /// Takes the node's open connections, of every lane, out (the next operation connects
    /// again). Under each lane's lock, so an opening either stored its connection before
    /// (taken here) or sees the new generation (and says goodbye itself).
    pub(crate) fn take_connections(&self) -> impl Iterator<Item = Arc<NodeConnection>> + '_ {
        self.lanes.iter().filter_map(|lane| {
            let mut connection = rdkv_fabric::lock(&lane.connection);
            self.generation.fetch_add(1, Ordering::AcqRel);
            connection.take()
        })
    }
}

/// Connects the first lane of every node of `nodes` that has none, concurrently, waits for
/// them, and starts opening the other lanes in the background (see
/// [`crate::Client::connect_all`]).
///
/// # Errors
/// [`Error::ConnectFailed`] naming the first node, in `nodes`' order, whose first lane could
/// not be connected, with the cause as its source.
pub(crate) async fn connect_first_lanes(nodes: &[Arc<Node>]) -> Result<()> {
    let mut tasks = tokio::task::JoinSet::new();
    for (index, node) in nodes.iter().enumerate() {
        let node = node.clone();
        tasks.spawn(async move {
            if node.lanes[0].healthy_connection().is_some() {
                return (index, Ok(()));
            }
            (index, node.establish(0).await.map(drop))
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
    // The other lanes open in the background: a node at max_connections would hold each for
    // the 5 s handshake timeout, and the first lane serves their operations meanwhile.
    for node in nodes {
        node.open_other_lanes_in_background();
    }
    match first_failure {
        None => Ok(()),
        Some((index, error)) => {
            let node = &nodes[index];
            Err(Error::ConnectFailed {
                node: node.id,
                address: node.config.node.control_address,
                source: Box::new(error),
            })
        }
    }
}
