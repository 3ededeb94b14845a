//! [`ClientBuilder`]: the one way to make a [`Client`]. It names what the client connects to
//! (one node, a cluster, or a cluster file) and how (operations in flight per connection,
//! lanes, fabric), then either builds a client whose connections open on first use
//! ([`ClientBuilder::build`]) or connects it at once ([`ClientBuilder::connect`]).
//!
//! ```no_run
//! # async fn example() -> Result<(), rdkv_client::Error> {
//! use rdkv_client::{ClientBuilder, FabricChoice};
//! let client = ClientBuilder::cluster_file("cluster.toml")
//!     .fabric(FabricChoice::Auto)
//!     .concurrency(64)
//!     .connect()
//!     .await?;
//! client.put(b"user:1", b"ada").await?;
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rdkv_cluster_file::{ClusterConfig, NodeConfig, ShmMode};

use crate::client::Client;
use crate::connection::{
    ClientConfig, FabricChoice, SharedMemory, DEFAULT_CONCURRENCY, MAX_CONCURRENCY,
};
use crate::counters::Counters;
use crate::error::{Error, Result};
use crate::fault::FaultInjector;
use crate::lanes::lanes_for;
use crate::node::Node;
use crate::view_following::ViewFollower;

/// How to make a [`Client`]: what it connects to, and the settings every node's connections
/// get. Start from [`ClientBuilder::node`], [`ClientBuilder::cluster`] or
/// [`ClientBuilder::cluster_file`].
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    /// What the client connects to.
    target: Target,
    /// The settings the builder's methods changed.
    settings: Settings,
}

/// What a client connects to.
#[derive(Debug, Clone)]
enum Target {
    /// One node alone (no cluster view, no replication).
    Node(Box<ClientConfig>),
    /// The nodes of a cluster.
    Cluster(Box<ClusterConfig>),
    /// The nodes of the cluster in a cluster file, read when the client is made.
    File(PathBuf),
}

/// The settings a builder's methods change; `None` leaves the node configuration's (for
/// [`ClientBuilder::node`]) or the default.
#[derive(Debug, Clone, Default)]
struct Settings {
    /// Operations in flight at once per connection.
    concurrency: Option<usize>,
    /// Connections (lanes) to each node.
    lanes: Option<usize>,
    /// Which fabric the client uses.
    fabric: Option<FabricChoice>,
    /// A node's own refill client: one lane per node, never shared memory, and connections
    /// that take the peers' reserved slots.
    refill_peer: bool,
    /// Stalls or fails chosen steps of operations (tests).
    fault_injector: Option<Arc<dyn FaultInjector>>,
}

impl ClientBuilder {
    /// A client of one node, as `config` says; [`ClientBuilder::connect`] makes it.
    pub fn node(config: ClientConfig) -> Self {
        Self::with_target(Target::Node(Box::new(config)))
    }

    /// A client of every node of `cluster`: keys map to nodes by rendezvous hashing, and with
    /// more than one copy of each key, operations route by the cluster view.
    pub fn cluster(cluster: &ClusterConfig) -> Self {
        Self::with_target(Target::Cluster(Box::new(cluster.clone())))
    }

    /// A client of the cluster in the cluster file at `path` (read when the client is made).
    pub fn cluster_file(path: impl AsRef<Path>) -> Self {
        Self::with_target(Target::File(path.as_ref().to_path_buf()))
    }

    /// A builder of a client of `target`, with the default settings.
    fn with_target(target: Target) -> Self {
        Self {
            target,
            settings: Settings::default(),
        }
    }

    /// At most `concurrency` operations in flight per connection (each lane has its own; by
    /// default [`DEFAULT_CONCURRENCY`], 16). Each holds a 64 KiB registered scratch buffer
    /// while it runs, from the process's shared pool, which grows with the operations in
    /// flight and shrinks back (`docs/memory.md`): an application that runs more tasks than
    /// this at once sets it to its task count, or its tasks wait for each other's buffers. From
    /// 1 to [`MAX_CONCURRENCY`] (4,096): values outside are taken as the nearer bound.
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.settings.concurrency = Some(concurrency);
        self
    }

    /// At most `lanes` connections to each node (as [`ClientConfig::lanes`]; by default one
    /// per tokio worker of the runtime the client is made on, at most
    /// [`crate::lanes::MAX_LANES`]). `1` keeps one connection per node, for a node with many
    /// clients.
    pub fn lanes(mut self, lanes: usize) -> Self {
        self.settings.lanes = Some(lanes);
        self
    }

    /// The fabric `choice` names (by default [`FabricChoice::Auto`]: each node's `shm` fabric
    /// where it offers one on this host and its cluster-file entry allows it, else the
    /// cluster's). A node's `shm = "off"` wins over `auto`; a required `shm` fails at connect,
    /// naming the node's setting.
    pub fn fabric(mut self, choice: FabricChoice) -> Self {
        self.settings.fabric = Some(choice);
        self
    }

    /// Makes a node's own client for its refill (`rdkv-server`): one lane per node, never
    /// shared memory, and connections that take the peers' reserved slots
    /// ([`ClientConfig::refill_peer`]).
    #[doc(hidden)]
    pub fn refill_peer(mut self) -> Self {
        self.settings.refill_peer = true;
        self
    }

    /// Gives every node's connections `injector` (tests of failures at chosen steps:
    /// [`crate::fault`]).
    #[doc(hidden)]
    pub fn fault_injector(mut self, injector: Arc<dyn FaultInjector>) -> Self {
        self.settings.fault_injector = Some(injector);
        self
    }

    /// A client of a cluster whose connections open on first use, so the first operation on
    /// each node pays the handshake inside its deadline ([`Client::connect_all`] connects up
    /// front).
    ///
    /// # Errors
    /// [`Error::Config`] when the cluster file is invalid, when the fabric choice names a
    /// fabric the cluster does not run, or for a client of one node, which connects at once
    /// to learn the node's deadline ([`ClientBuilder::connect`]).
    pub fn build(self) -> Result<Client> {
        match self.target {
            Target::Node(_) => Err(Error::Config {
                reason: "a client of one node connects at once: use ClientBuilder::connect".into(),
            }),
            Target::Cluster(cluster) => self.settings.cluster_client(&cluster),
            Target::File(path) => self.settings.cluster_client(&load(&path)?),
        }
    }

    /// Makes the client and connects it: a client of one node connects its first lane and
    /// authenticates (its deadline is then never longer than the node's); a client of a
    /// cluster connects the first lane of every node ([`Client::connect_all`]). The other
    /// lanes open as the runtime's workers use them.
    ///
    /// # Errors
    /// As [`ClientBuilder::build`]; [`Error::NodeUnreachable`], [`Error::AuthenticationFailed`]
    /// or the fabric's errors (for example a memlock limit too low for even one scratch buffer)
    /// for a client of one node; [`Error::ConnectFailed`] for a cluster.
    pub async fn connect(self) -> Result<Client> {
        let client = match self.target {
            Target::Node(config) => return self.settings.node_client(*config).await,
            Target::Cluster(cluster) => self.settings.cluster_client(&cluster)?,
            Target::File(path) => self.settings.cluster_client(&load(&path)?)?,
        };
        client.connect_all().await?;
        Ok(client)
    }
}

impl Settings {
    /// The client's counters: a refill peer's are never reported to the nodes.
    fn counters(&self) -> Counters {
        if self.refill_peer {
            Counters::unreported()
        } else {
            Counters::default()
        }
    }

    /// A client of one node, connected.
    async fn node_client(self, mut config: ClientConfig) -> Result<Client> {
        if let Some(choice) = self.fabric {
            config.node.shared_memory = choice
                .shared_memory(config.node.fabric)
                .map_err(|reason| Error::Config { reason })?;
        }
        if self.refill_peer {
            config.refill_peer = true;
            config.node.shared_memory = SharedMemory::Off;
        }
        config.concurrency = self.concurrency.unwrap_or(config.concurrency);
        config.lanes = self.lanes.or(config.lanes);
        let counters = Arc::new(self.counters());
        config.fault_injector = self.fault_injector.or(config.fault_injector);
        let lanes = lanes_for(if self.refill_peer {
            Some(1)
        } else {
            config.lanes
        });
        let node = Node::new(1, config, lanes, counters.clone());
        node.connect_first_lane().await?;
        // Never longer than the server's: it reuses heap space and clears abandoned tentative
        // slots on the assumption that no operation outlives its deadline.
        let server_deadline = node
            .server_deadline()
            .expect("a connected node's welcome gave its deadline");
        let deadline = node
            .config
            .operation_deadline
            .map_or(server_deadline, |deadline| deadline.min(server_deadline));
        let follower = ViewFollower::new(Vec::new(), Vec::new(), vec![1], counters.clone());
        Ok(Client {
            node_ids: vec![1],
            nodes: vec![Arc::new(node)],
            replicas: 1,
            follower: Arc::new(follower),
            counters,
            deadline,
        })
    }

    /// A client of every node of `cluster`, none connected.
    fn cluster_client(self, cluster: &ClusterConfig) -> Result<Client> {
        let shared_memory = match (self.refill_peer, self.fabric) {
            (true, _) => SharedMemory::Off,
            (false, None) => SharedMemory::Auto,
            (false, Some(choice)) => choice
                .shared_memory(cluster.fabric)
                .map_err(|reason| Error::Config { reason })?,
        };
        let lanes = lanes_for(if self.refill_peer {
            Some(1)
        } else {
            self.lanes
        });
        let counters = Arc::new(self.counters());
        let nodes: Vec<Arc<Node>> = cluster
            .nodes
            .iter()
            .map(|node| {
                let config = self.node_config(cluster, node, shared_memory);
                Arc::new(Node::new(node.id, config, lanes, counters.clone()))
            })
            .collect();
        let node_ids: Vec<u32> = nodes.iter().map(|node| node.id).collect();
        let addresses = nodes
            .iter()
            .map(|node| (node.config.node.control_address, node.config.node.id))
            .collect();
        let follower = ViewFollower::new(
            addresses,
            cluster.secret.clone(),
            node_ids.clone(),
            counters.clone(),
        );
        Ok(Client {
            nodes,
            node_ids,
            replicas: cluster.replicas.max(1),
            follower: Arc::new(follower),
            counters,
            deadline: cluster.operation_deadline,
        })
    }

    /// How the client reaches `node` of `cluster`, using the node's `shm` fabric as
    /// `shared_memory` says.
    fn node_config(
        &self,
        cluster: &ClusterConfig,
        node: &NodeConfig,
        shared_memory: SharedMemory,
    ) -> ClientConfig {
        let mut config = ClientConfig::new(node.control_address, cluster.fabric, &cluster.secret);
        config.node.id = Some(node.id);
        config.routes_by_view = true;
        // A node's shm = "off" turns auto off; a required shm stays required (and fails at
        // connect, naming the node's setting).
        config.node.shared_memory = match (node.shm, shared_memory) {
            (ShmMode::Off, SharedMemory::Auto) => SharedMemory::Off,
            (_, choice) => choice,
        };
        config.operation_deadline = Some(cluster.operation_deadline);
        config.poll_spin = cluster.poll_spin;
        config.concurrency = self
            .concurrency
            .unwrap_or(DEFAULT_CONCURRENCY)
            .clamp(1, MAX_CONCURRENCY);
        config.refill_peer = self.refill_peer;
        config.fault_injector.clone_from(&self.fault_injector);
        config
    }
}

/// Reads the cluster file at `path`.
///
/// # Errors
/// [`Error::Config`] when the file is invalid; its reason keeps the causes ("cannot read the
/// cluster file: No such file ...").
fn load(path: &Path) -> Result<ClusterConfig> {
    rdkv_cluster_file::load(path).map_err(|error| {
        let mut reason = error.to_string();
        let mut cause = std::error::Error::source(&error);
        while let Some(inner) = cause {
            reason.push_str(": ");
            reason.push_str(&inner.to_string());
            cause = inner.source();
        }
        Error::Config { reason }
    })
}
