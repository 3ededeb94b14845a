//! How a client reaches one node: [`ClientConfig`] and [`NodeAddress`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rdkv_fabric::{Backend, VerbsOptions};

use crate::fault::FaultInjector;

/// Operations in flight per connection unless configured otherwise.
pub const DEFAULT_CONCURRENCY: usize = 16;

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
    /// the process's shared pool while it runs; idle connections hold none).
    pub concurrency: usize,
    /// The per-operation deadline; the server's when absent. An operation on a node never runs
    /// longer than that node's own deadline (from its welcome), which the node's heap reuse and
    /// its clearing of abandoned tentative slots rely on.
    pub operation_deadline: Option<Duration>,
    /// Stalls or fails chosen steps of operations (tests and chaos experiments; see
    /// [`crate::fault`]). None in production.
    pub fault_injector: Option<Arc<dyn FaultInjector>>,
}

impl ClientConfig {
    /// A configuration for one node.
    pub fn new(control_address: SocketAddr, fabric: Backend, secret: &[u8]) -> Self {
        Self {
            node: NodeAddress {
                control_address,
                fabric,
                id: None,
            },
            secret: secret.to_vec(),
            verbs: VerbsOptions::from_environment(),
            poll_spin: Duration::ZERO,
            name: format!("rdkv-client-{}", std::process::id()),
            concurrency: DEFAULT_CONCURRENCY,
            operation_deadline: None,
            fault_injector: None,
        }
    }
}
