//! The server's configuration and its validation.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use rdkv_common::layout::{
    TableGeometry, COMBINED_BUCKET_SIZE, MAX_BLOCK_SIZE, MAX_HEAP_SIZE, MIN_HEAP_CHUNKS,
};
use rdkv_fabric::memory::HugepagePolicy;
use rdkv_fabric::{Backend, VerbsOptions};

use crate::error::{Error, Result};

/// Everything a server needs to start.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The node's id in its cluster.
    pub node_id: u32,
    /// Where the control plane listens (port 0 picks one).
    pub control_address: SocketAddr,
    /// The fabric backend.
    pub fabric: Backend,
    /// Where the soft NIC listens (port 0 picks one); unused by loopback and verbs.
    pub fabric_address: SocketAddr,
    /// The RDMA device, port and GID index (verbs only).
    pub verbs: VerbsOptions,
    /// Where the node also offers its memory to clients on its host over the `shm` fabric (a
    /// Unix-domain socket, mode 0600); `None`: it does not.
    pub shm_socket: Option<PathBuf>,
    /// How long the NIC's completion side busy-polls before it sleeps (soft: the engine
    /// threads; verbs: the CQ poller); zero never spins.
    pub poll_spin: Duration,
    /// Index bytes; rounded down to a power-of-two number of 64-byte buckets.
    pub index_size: u64,
    /// Heap bytes; rounded down to whole chunks.
    pub heap_size: u64,
    /// Bytes per heap chunk handed to a client.
    pub chunk_size: u64,
    /// Hugepage policy for the table region.
    pub hugepages: HugepagePolicy,
    /// The largest share of MemAvailable the table may pin.
    pub max_pinned_share: f64,
    /// The cluster secret clients prove with HMAC.
    pub secret: Vec<u8>,
    /// A client that sends nothing for this long loses its connection and keys.
    pub lease_timeout: Duration,
    /// The deadline of one client operation; heap space whose clients stopped announcing waits
    /// at most 2.5 × this before reuse (`docs/protocol.md`, *Heap space*).
    pub operation_deadline: Duration,
    /// Most control connections at once.
    pub max_connections: usize,
    /// The budget of unauthenticated connections and the handshake deadline
    /// (`crate::pending`); its `max_connections` is not used (the field above is).
    pub limits: rdkv_cluster_file::config::ConnectionLimits,
    /// The hash seed; random when absent.
    pub hash_seed: Option<u64>,
    /// How often the heap collector scans the index.
    pub collector_interval: Duration,
    /// Where Prometheus metrics are served, if anywhere.
    pub metrics_address: Option<SocketAddr>,
    /// What one outsider can make the metrics endpoint hold (`crate::metrics`).
    pub metrics_limits: MetricsLimits,
    /// Fault injection for tests: each session's teardown is held this long after its drain,
    /// as a verbs drain that waits for the NIC's flushes can be (up to `retry_timeout` + 1 s).
    /// Zero, the default, everywhere else; neither the command line nor the cluster file sets
    /// it.
    pub teardown_stall: Duration,
    /// Every node of the cluster with its control address, this one included; fewer than two:
    /// no consensus, the node's view is itself (`crate::view`).
    pub members: Vec<(u32, SocketAddr)>,
    /// A member silent this long is committed down by the view's leader.
    pub failure_timeout: Duration,
    /// Where the view's consensus keeps its vote and log across restarts.
    pub view_state_file: Option<PathBuf>,
    /// Where the node keeps its snapshots; `None`: it writes none and starts empty
    /// (`crate::persistence`).
    pub data_dir: Option<PathBuf>,
    /// How often it writes one; zero: only on request and at a clean shutdown.
    pub snapshot_interval: Duration,
    /// Which snapshot it starts from.
    pub start_from: StartFrom,
    /// The node joins a running cluster (`--join`, `rdkv-cluster add-node`): it learns the
    /// view from the leader instead of starting one from the cluster file (`crate::view`,
    /// `membership.rs`).
    pub joining: bool,
    /// Where the cluster file is, when the node was started from one: a leaving node's
    /// hand-over reads it again, for the members added since it started (`crate::handover`).
    pub cluster_file: Option<PathBuf>,
    /// The cluster file the node was started from: a node filling after a restart copies
    /// its keys from its peers through a client of this cluster (`crate::refill`). `None`
    /// for a node started without one.
    pub cluster: Option<std::sync::Arc<rdkv_cluster_file::ClusterConfig>>,
}

/// Which snapshot a node loads at start (`--from-snapshot`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum StartFrom {
    /// The last one written (the default); a damaged one stops the start with the choices.
    #[default]
    Latest,
    /// The one before it, kept beside it.
    Previous,
    /// None: the node starts empty (its files stay until its next snapshot replaces them).
    Empty,
}

/// The bounds of the metrics endpoint, which anyone who reaches its address can connect to
/// (`docs/operations.md`, *Metrics*).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricsLimits {
    /// Connections open at once; a new one past this closes the oldest open one.
    pub max_connections: usize,
    /// The time a connection has to send a whole request head, from its accept or from the end
    /// of its previous response: it bounds slow heads and idle keep-alive alike.
    pub header_read_timeout: Duration,
    /// How long one connection is served: then it finishes the response it is writing (within
    /// `header_read_timeout` more) and is closed.
    pub connection_lifetime: Duration,
}

impl Default for MetricsLimits {
    fn default() -> Self {
        Self {
            max_connections: 64,
            header_read_timeout: Duration::from_secs(5),
            connection_lifetime: Duration::from_secs(60),
        }
    }
}

/// How often the collector settles, scans and frees heap chunks by default: a chunk comes back
/// about two intervals after its last block dies, once no operation that saw it is running.
pub const DEFAULT_COLLECTOR_INTERVAL: Duration = Duration::from_millis(25);

/// The failure timeout of a node started without a cluster file.
pub const DEFAULT_FAILURE_TIMEOUT: Duration = Duration::from_secs(2);

impl ServerConfig {
    /// A configuration for tests and examples: loopback addresses with port 0, a small table.
    pub fn local(secret: &[u8]) -> Self {
        Self {
            node_id: 1,
            control_address: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            fabric: Backend::Soft,
            fabric_address: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            verbs: VerbsOptions::default(),
            shm_socket: None,
            poll_spin: Duration::ZERO,
            index_size: 256 * 1024,
            heap_size: 4 * 1024 * 1024,
            chunk_size: 64 * 1024,
            hugepages: HugepagePolicy::Auto,
            max_pinned_share: 0.5,
            secret: secret.to_vec(),
            lease_timeout: Duration::from_secs(10),
            operation_deadline: Duration::from_secs(2),
            max_connections: 1024,
            limits: rdkv_cluster_file::config::ConnectionLimits::default(),
            hash_seed: None,
            collector_interval: DEFAULT_COLLECTOR_INTERVAL,
            metrics_address: None,
            metrics_limits: MetricsLimits::default(),
            teardown_stall: Duration::ZERO,
            members: Vec::new(),
            failure_timeout: DEFAULT_FAILURE_TIMEOUT,
            view_state_file: None,
            data_dir: None,
            snapshot_interval: Duration::ZERO,
            start_from: StartFrom::Latest,
            joining: false,
            cluster_file: None,
            cluster: None,
        }
    }

    /// The configuration of node `node_id` of a cluster file.
    ///
    /// # Errors
    /// [`Error::Config`] when the file has no such node.
    pub fn from_cluster(cluster: &rdkv_cluster_file::ClusterConfig, node_id: u32) -> Result<Self> {
        let node = cluster.node(node_id).ok_or_else(|| Error::Config {
            field: "node",
            reason: format!(
                "{} has no node with id {node_id} (ids: {:?})",
                cluster.path.display(),
                cluster.nodes.iter().map(|node| node.id).collect::<Vec<_>>()
            ),
        })?;
        Ok(Self {
            node_id,
            control_address: node.control_address,
            fabric: cluster.fabric,
            fabric_address: node
                .fabric_address
                .unwrap_or_else(|| SocketAddr::from((Ipv4Addr::LOCALHOST, 0))),
            verbs: VerbsOptions {
                device: node.device.clone(),
                port: None,
                gid_index: node.gid_index,
            },
            shm_socket: node.offered_shm_socket(cluster),
            poll_spin: cluster.poll_spin,
            index_size: node.index_size,
            heap_size: node.heap_size,
            chunk_size: node.chunk_size,
            hugepages: node.hugepages,
            max_pinned_share: node.max_pinned_share,
            secret: cluster.secret.clone(),
            lease_timeout: cluster.lease_timeout,
            operation_deadline: cluster.operation_deadline,
            max_connections: cluster.limits.max_connections,
            limits: cluster.limits,
            hash_seed: None,
            collector_interval: DEFAULT_COLLECTOR_INTERVAL,
            metrics_address: node.metrics_address,
            metrics_limits: MetricsLimits::default(),
            teardown_stall: Duration::ZERO,
            members: cluster
                .nodes
                .iter()
                .map(|node| (node.id, node.control_address))
                .collect(),
            failure_timeout: cluster.failure_timeout,
            view_state_file: None,
            data_dir: node.data_dir.clone(),
            snapshot_interval: cluster.snapshot_interval,
            start_from: StartFrom::Latest,
            joining: false,
            cluster_file: None,
            cluster: Some(std::sync::Arc::new(cluster.clone())),
        })
    }

    /// How long a data connection may hold heap reuse back, with an operation in flight and
    /// nothing announced, once the heap is under pressure, before the node fences it: half
    /// the operation deadline (an operation that runs longer is past most of its deadline),
    /// and at most a quarter of the lease (`docs/protocol.md`, *Heap space*). 1 s with the
    /// defaults (deadline 2 s, lease 10 s).
    pub fn heap_hold_limit(&self) -> Duration {
        (self.operation_deadline / 2).min(self.lease_timeout / 4)
    }

    /// Checks the configuration and derives the table geometry.
    ///
    /// # Errors
    /// [`Error::Config`] naming the field and what would be valid.
    pub fn geometry(&self, hash_seed: u64) -> Result<TableGeometry> {
        if self.secret.is_empty() {
            return Err(Error::Config {
                field: "secret",
                reason: "the cluster secret is empty; set one (clients must present the same)"
                    .into(),
            });
        }
        if self.index_size < 2 * COMBINED_BUCKET_SIZE {
            return Err(Error::Config {
                field: "index_size",
                reason: format!(
                    "{} bytes is too small: the index needs at least {} bytes (two combined buckets)",
                    self.index_size,
                    2 * COMBINED_BUCKET_SIZE
                ),
            });
        }
        if self.chunk_size < MAX_BLOCK_SIZE || self.chunk_size % 4096 != 0 {
            return Err(Error::Config {
                field: "chunk_size",
                reason: format!(
                    "{} bytes: a chunk must be a multiple of 4096 and hold the largest block ({MAX_BLOCK_SIZE} bytes)",
                    self.chunk_size
                ),
            });
        }
        if self.heap_size < MIN_HEAP_CHUNKS * self.chunk_size || self.heap_size > MAX_HEAP_SIZE {
            return Err(Error::Config {
                field: "heap_size",
                reason: format!(
                    "{} bytes: the heap must hold at least {MIN_HEAP_CHUNKS} chunks ({} bytes; one is the compactor's, one its reserve) and at most 2^48 bytes; raise heap_size or lower chunk_size",
                    self.heap_size,
                    MIN_HEAP_CHUNKS * self.chunk_size
                ),
            });
        }
        if !(0.0..=1.0).contains(&self.max_pinned_share) {
            return Err(Error::Config {
                field: "max_pinned_share",
                reason: format!(
                    "{} is not a share between 0.0 and 1.0",
                    self.max_pinned_share
                ),
            });
        }
        if self.metrics_limits.max_connections == 0
            || self.metrics_limits.header_read_timeout.is_zero()
            || self.metrics_limits.connection_lifetime.is_zero()
        {
            return Err(Error::Config {
                field: "metrics_limits",
                reason: format!(
                    "{:?}: the metrics endpoint needs at least one connection and non-zero timeouts",
                    self.metrics_limits
                ),
            });
        }
        let buckets = self.index_size / 64;
        let bucket_count = 1u64 << (63 - buckets.leading_zeros());
        let chunks = self.heap_size / self.chunk_size;
        Ok(TableGeometry {
            bucket_count,
            heap_size: chunks * self.chunk_size,
            chunk_size: self.chunk_size,
            hash_seed,
        })
    }
}

/// The soft NIC's address when only the control address is given (`rdkv-server --listen`):
/// the same IP, the next port (7400 gives 7401), or port 0 for port 0.
///
/// # Errors
/// [`Error::Config`] for control port 65535, which has no next port.
pub fn fabric_address_beside(control_address: SocketAddr) -> Result<SocketAddr> {
    let port = match control_address.port() {
        0 => 0,
        port => port.checked_add(1).ok_or_else(|| Error::Config {
            field: "fabric_listen",
            reason: format!(
                "the control port {port} has no next port for the fabric: pass --fabric-listen ADDRESS"
            ),
        })?,
    };
    Ok(SocketAddr::new(control_address.ip(), port))
}

/// Makes `directory` the private directory of a node's default `shm` socket: created mode
/// 0700 when absent, and refused unless it is a directory (not a link) that this user owns
/// and nobody else may enter, so that no other user can put a socket of theirs in the node's
/// place.
///
/// # Errors
/// [`Error::Config`] naming the directory and the fix.
pub fn prepare_private_directory(directory: &std::path::Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let refuse = |reason: String| Error::Config {
        field: "shm_socket",
        reason,
    };
    if let Err(error) = std::fs::DirBuilder::new().mode(0o700).create(directory) {
        if error.kind() != std::io::ErrorKind::AlreadyExists {
            return Err(refuse(format!(
                "create {} (mode 0700) for the node's shm socket: {error}; set shm_socket in the cluster file (or pass --shm-socket)",
                directory.display()
            )));
        }
    }
    let metadata = std::fs::symlink_metadata(directory)
        .map_err(|error| refuse(format!("inspect {}: {error}", directory.display())))?;
    // The owner of /proc/self is this process's effective user.
    let user = std::fs::metadata("/proc/self").map_or(u32::MAX, |own| own.uid());
    if !metadata.is_dir() || metadata.uid() != user || metadata.mode() & 0o077 != 0 {
        return Err(refuse(format!(
            "{} is not a private directory of this user (owner uid {}, mode {:o}; it must be a directory of uid {user} with mode 0700): remove it, or set shm_socket in the cluster file (or pass --shm-socket)",
            directory.display(),
            metadata.uid(),
            metadata.mode() & 0o7777
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fabric_port_follows_the_control_port() {
        let beside = |text: &str| fabric_address_beside(text.parse().expect("an address"));
        assert_eq!(
            beside("127.0.0.1:7400").expect("valid"),
            "127.0.0.1:7401".parse().expect("an address")
        );
        assert_eq!(
            beside("10.0.0.2:9000").expect("valid"),
            "10.0.0.2:9001".parse().expect("an address")
        );
        assert_eq!(
            beside("127.0.0.1:0").expect("valid"),
            "127.0.0.1:0".parse().expect("an address")
        );
        let error = beside("127.0.0.1:65535")
            .expect_err("no next port")
            .to_string();
        assert!(error.contains("--fabric-listen"), "{error}");
    }

    #[test]
    fn the_private_socket_directory_is_made_0700_and_a_shared_one_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let parent = std::env::temp_dir().join(format!("rdkv-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&parent);
        std::fs::create_dir_all(&parent).expect("a test directory");
        let private = parent.join("rdkv");
        prepare_private_directory(&private).expect("created");
        let mode = std::fs::metadata(&private)
            .expect("made")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        prepare_private_directory(&private).expect("an existing private directory is kept");
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let error = prepare_private_directory(&private)
            .expect_err("others may enter")
            .to_string();
        assert!(
            error.contains("remove it") && error.contains("mode 777"),
            "{error}"
        );
        let link = parent.join("link");
        std::os::unix::fs::symlink(&private, &link).expect("a link");
        assert!(
            prepare_private_directory(&link).is_err(),
            "a link is not the directory"
        );
        let _ = std::fs::remove_dir_all(&parent);
    }

    #[test]
    fn geometry_rounds_to_powers_of_two_and_whole_chunks() {
        let mut config = ServerConfig::local(b"s");
        config.index_size = 100_000;
        config.heap_size = 300_000;
        config.chunk_size = 64 * 1024;
        let geometry = config.geometry(1).expect("valid");
        assert_eq!(geometry.bucket_count, 1024);
        assert_eq!(geometry.heap_size, 4 * 64 * 1024);
    }

    #[test]
    fn bad_sizes_name_the_field() {
        let mut config = ServerConfig::local(b"s");
        config.index_size = 64;
        assert!(config
            .geometry(1)
            .unwrap_err()
            .to_string()
            .contains("index_size"));
        let mut config = ServerConfig::local(b"s");
        config.chunk_size = 1000;
        assert!(config
            .geometry(1)
            .unwrap_err()
            .to_string()
            .contains("chunk_size"));
        let mut config = ServerConfig::local(b"s");
        config.heap_size = 4096;
        assert!(config
            .geometry(1)
            .unwrap_err()
            .to_string()
            .contains("heap_size"));
        let config = ServerConfig::local(b"");
        assert!(config
            .geometry(1)
            .unwrap_err()
            .to_string()
            .contains("secret"));
        let mut config = ServerConfig::local(b"s");
        config.metrics_limits.max_connections = 0;
        assert!(config
            .geometry(1)
            .unwrap_err()
            .to_string()
            .contains("metrics_limits"));
    }
}
