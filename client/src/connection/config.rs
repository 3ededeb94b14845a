//! How a client reaches one node: [`ClientConfig`] and [`NodeAddress`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rdkv_fabric::{Backend, VerbsOptions};

use super::slot_cache_entries_from_environment;
use crate::fault::FaultInjector;

/// Operations in flight per connection unless configured otherwise.
pub const DEFAULT_CONCURRENCY: usize = 16;

/// The most operations in flight per connection: a larger `concurrency` is taken as this (and
/// 0 as 1). 4,096 operations hold 256 MiB of scratch buffers; more would only queue for them.
pub const MAX_CONCURRENCY: usize = 4096;

/// How a client reaches one node.
#[derive(Debug, Clone)]
pub struct NodeAddress {
    /// The control-plane address.
    pub control_address: SocketAddr,
    /// The fabric the node runs.
    pub fabric: Backend,
    /// The node's id, when known (from the cluster file): the client refuses a node whose
    /// challenge names another id (a wrong address, or a relay to another node).
    pub id: Option<u32>,
    /// Whether to use the node's `shm` fabric when it offers one on this host.
    pub shared_memory: SharedMemory,
}

/// Whether a client uses a node's `shm` fabric (one-sided over shared memory, for clients on the
/// node's host) instead of the cluster's fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SharedMemory {
    /// When the node advertises an `shm` socket that this process can reach on this host (the
    /// default).
    #[default]
    Auto,
    /// Never: the cluster's fabric (the node's `shm = "off"`, or `--fabric soft`).
    Off,
    /// Always: connecting fails when the node offers no `shm` fabric here (`--fabric shm`).
    Require,
}

/// Settings of a client.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The node.
    pub node: NodeAddress,
    /// The cluster secret.
    pub secret: Vec<u8>,
    /// This client's RDMA device, port and GID index (verbs only); by default the
    /// `RDKV_RDMA_DEVICE`, `RDKV_RDMA_PORT` and `RDKV_GID_INDEX` environment variables, else the
    /// first device and an automatic GID.
    pub verbs: VerbsOptions,
    /// How long the client's completion poller busy-polls before it sleeps (verbs; a soft
    /// client's engine task does not spin); zero never spins.
    pub poll_spin: Duration,
    /// A name for the server's logs.
    pub name: String,
    /// Operations in flight at once per connection (each holds one 64 KiB scratch buffer from
    /// the process's shared pool while it runs; idle connections hold none), from 1 to
    /// [`MAX_CONCURRENCY`] (values outside are taken as the nearer bound).
    pub concurrency: usize,
    /// Connections (lanes) to the node: by default one per tokio worker of the runtime the
    /// client is made on, at most [`crate::lanes::MAX_LANES`]. An operation uses its thread's lane
    /// (`lanes`); `Some(1)` keeps one connection per client, for a node with many clients.
    pub lanes: Option<usize>,
    /// The per-operation deadline; the server's when absent. An operation on a node never runs
    /// longer than that node's own deadline (from its welcome), which the node's heap reuse and
    /// its clearing of abandoned tentative slots rely on.
    pub operation_deadline: Option<Duration>,
    /// Stalls or fails chosen steps of operations (tests and chaos experiments; see
    /// [`crate::fault`]). None in production.
    pub fault_injector: Option<Arc<dyn FaultInjector>>,
    /// Whether the client routes by the cluster view (a cluster client's connections do):
    /// it then reads no node the view has filling. A client of one node alone does not, and a
    /// filling node refuses it (its table is partial until its refill is done).
    pub routes_by_view: bool,
    /// Entries of the process's slot cache (24 bytes each, rounded up to a power of two; by
    /// default the `RDKV_SLOT_CACHE_ENTRIES` environment variable, else
    /// [`crate::DEFAULT_SLOT_CACHE_ENTRIES`]): where this process last saw each key's committed
    /// slot. Every client and node of the process with the same setting shares one cache. A
    /// lookup of a cached key READs its block in the same list as its buckets, so a GET of a key
    /// unchanged since takes one round trip instead of two. Zero turns guessing off.
    pub slot_cache_entries: usize,
    /// Whether this is a node's own refill client (`rdkv-server` sets it): its connections say
    /// `Purpose::Refill` and take the peers' reserved slots, so a peer full of clients cannot
    /// keep a restarted node filling. Applications leave it false.
    pub refill_peer: bool,
}

impl ClientConfig {
    /// A configuration for one node.
    pub fn new(control_address: SocketAddr, fabric: Backend, secret: &[u8]) -> Self {
        Self {
            node: NodeAddress {
                control_address,
                fabric,
                id: None,
                shared_memory: SharedMemory::Auto,
            },
            secret: secret.to_vec(),
            verbs: VerbsOptions::from_environment(),
            poll_spin: Duration::ZERO,
            name: format!("rdkv-client-{}", std::process::id()),
            concurrency: DEFAULT_CONCURRENCY,
            lanes: None,
            operation_deadline: None,
            fault_injector: None,
            routes_by_view: false,
            slot_cache_entries: slot_cache_entries_from_environment(),
            refill_peer: false,
        }
    }
}

/// Which fabric a program's clients use, as `--fabric` says it: `auto` (each node's `shm`
/// fabric where it offers one on this host, else the cluster's), `shm` (required), or the
/// cluster's fabric by name (`soft`, `verbs`: never `shm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FabricChoice {
    /// `auto`.
    #[default]
    Auto,
    /// `shm`.
    Shm,
    /// The cluster's fabric.
    Cluster(Backend),
}

impl std::str::FromStr for FabricChoice {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, Self::Err> {
        match text {
            "auto" => Ok(Self::Auto),
            "shm" => Ok(Self::Shm),
            other => other.parse::<Backend>().map(Self::Cluster).map_err(|_| {
                format!("unknown fabric `{other}`: expected auto, shm, soft or verbs")
            }),
        }
    }
}

impl FabricChoice {
    /// What the choice means for the nodes of a cluster whose fabric is `cluster_fabric`.
    ///
    /// # Errors
    /// The reason, when the choice names a fabric the cluster does not run.
    pub fn shared_memory(
        self,
        cluster_fabric: Backend,
    ) -> std::result::Result<SharedMemory, String> {
        match self {
            Self::Auto => Ok(SharedMemory::Auto),
            Self::Shm => Ok(SharedMemory::Require),
            Self::Cluster(fabric) if fabric == cluster_fabric => Ok(SharedMemory::Off),
            Self::Cluster(fabric) => Err(format!(
                "--fabric {fabric}: the cluster runs {cluster_fabric} (choose auto, shm or {cluster_fabric})"
            )),
        }
    }
}
