//! The cluster file: its TOML schema, and validation with errors that name the file, the line
//! and the field.
//!
//! ```toml
//! [cluster]
//! name = "local"
//! secret = "change-me"            # or secret_file = "path" (should be mode 0600)
//! fabric = "soft"                 # soft | verbs (| shm: same-host clients only)
//! lease_timeout = "10s"
//! failure_timeout = "2s"          # a node silent this long leaves the cluster view (1s to 60s)
//! replicas = 2                    # copies of each key, 1 to 3 and at most the nodes (default 1)
//! poll_spin = "30us"              # optional busy-poll before sleeping (default 0: never)
//! operation_deadline = "2s"
//! snapshot_interval = "60s"       # a snapshot of each node's keys this often ("0s": only at
//!                                 # a clean stop and on request; default 60s)
//! ssh_user = "rdkv"               # remote nodes only: ssh as this user (default: your ssh config)
//! ssh_options = ["-p", "2222"]    # remote nodes only: extra ssh arguments
//! remote_binary = "rdkv-server"   # remote nodes only: the server binary there (default: on PATH)
//! remote_run_dir = ".rdkv/local"  # remote nodes only: pid, log and cluster file there
//!
//! [[node]]
//! id = 1
//! host = "db1"                        # optional: an ssh destination; local when absent
//!                                     # (and the control address is loopback) or "localhost"
//! control_address = "127.0.0.1:7400"
//! fabric_address = "127.0.0.1:7401"   # soft; for verbs: device = "mlx5_0", gid_index = 3
//! metrics_address = "127.0.0.1:7402"
//! index_size = "1M"
//! heap_size = "4M"
//! chunk_size = "256K"
//! hugepages = "auto"                  # auto | require | off
//! shm = "auto"                        # auto | off: clients on this host use shared memory
//! shm_socket = "/run/rdkv/node-1.sock" # optional (default: in rdkv-cluster's run directory)
//! data_dir = "/var/lib/rdkv/node-1"   # optional: its snapshots (default: in rdkv-cluster's
//!                                     # run directory, node-1.data)
//! ```
//!
//! This file holds the schema, the validated types and the entry points; `cluster_section`
//! checks `[cluster]` and `node_section` each `[[node]]`, in file order.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rdkv_fabric::memory::limits::{read_meminfo, read_memlock_figures, MemlockFigures};
use rdkv_fabric::memory::HugepagePolicy;
use rdkv_fabric::Backend;
use serde::Deserialize;
use toml::Spanned;

use crate::error::{Error, Result};
use crate::units::{parse_duration, parse_size};

mod cluster_section;
mod node_section;

use cluster_section::{parse_cluster_section, parse_replicas, warn_of_late_failure_timeout};
use node_section::parse_node_sections;

/// A size written as a number of bytes or as text with a unit.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum RawSize {
    /// Bytes.
    Bytes(u64),
    /// `"64M"`.
    Text(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    cluster: Spanned<RawCluster>,
    #[serde(rename = "node", default)]
    nodes: Vec<Spanned<RawNode>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    name: Spanned<String>,
    secret: Option<Spanned<String>>,
    secret_file: Option<Spanned<String>>,
    fabric: Spanned<String>,
    lease_timeout: Option<Spanned<String>>,
    failure_timeout: Option<Spanned<String>>,
    replicas: Option<Spanned<u64>>,
    operation_deadline: Option<Spanned<String>>,
    snapshot_interval: Option<Spanned<String>>,
    poll_spin: Option<Spanned<String>>,
    max_connections: Option<Spanned<u64>>,
    max_unauthenticated_connections: Option<Spanned<u64>>,
    max_pending_per_address: Option<Spanned<u64>>,
    handshake_deadline: Option<Spanned<String>>,
    fabric_engine_threads: Option<Spanned<u64>>,
    fabric_hello_deadline: Option<Spanned<String>>,
    fabric_max_pending_hellos: Option<Spanned<u64>>,
    fabric_response_buffer: Option<Spanned<RawSize>>,
    ssh_user: Option<Spanned<String>>,
    ssh_options: Option<Spanned<Vec<String>>>,
    remote_binary: Option<Spanned<String>>,
    remote_run_dir: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    id: Spanned<u32>,
    host: Option<Spanned<String>>,
    control_address: Spanned<String>,
    fabric_address: Option<Spanned<String>>,
    device: Option<Spanned<String>>,
    gid_index: Option<Spanned<u32>>,
    metrics_address: Option<Spanned<String>>,
    index_size: Spanned<RawSize>,
    heap_size: Spanned<RawSize>,
    chunk_size: Option<Spanned<RawSize>>,
    hugepages: Option<Spanned<String>>,
    max_pinned_share: Option<Spanned<f64>>,
    shm: Option<Spanned<String>>,
    shm_socket: Option<Spanned<String>>,
    data_dir: Option<Spanned<String>>,
}

/// The shortest secret a cluster accepts, in bytes: an HMAC key too long to guess.
pub const MIN_SECRET_LENGTH: usize = 16;

/// The failure timeout when the file gives none.
pub const DEFAULT_FAILURE_TIMEOUT: Duration = Duration::from_secs(2);
/// The shortest failure timeout: above Raft's election timeout (400-800 ms).
pub const MIN_FAILURE_TIMEOUT: Duration = Duration::from_secs(1);
/// The longest failure timeout.
pub const MAX_FAILURE_TIMEOUT: Duration = Duration::from_secs(60);

/// How often a node writes a snapshot when the file does not say: a crash of every node
/// loses at most about this much (a whole-cluster stop by `rdkv-cluster down` loses nothing),
/// for a scan and a write of the node's keys once a minute (64 MiB/s at most).
pub const DEFAULT_SNAPSHOT_INTERVAL: Duration = Duration::from_secs(60);

/// The most copies of a key a cluster file may ask for.
pub const MAX_REPLICAS: usize = 3;

/// A validated cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The file it came from.
    pub path: PathBuf,
    /// The cluster's name.
    pub name: String,
    /// The shared secret.
    pub secret: Vec<u8>,
    /// The fabric.
    pub fabric: Backend,
    /// Lease timeout.
    pub lease_timeout: Duration,
    /// A node that misses its peers' heartbeats this long is committed down in the cluster
    /// view.
    pub failure_timeout: Duration,
    /// Copies of each key (1 to [`MAX_REPLICAS`], at most the nodes): the first nodes of the
    /// key's rendezvous ranking over the serving members of the cluster view.
    pub replicas: usize,
    /// Per-operation deadline.
    pub operation_deadline: Duration,
    /// How often each node writes a snapshot of its keys; zero: only at a clean stop and on
    /// request (`docs/operations.md`, *Persistence*).
    pub snapshot_interval: Duration,
    /// How long the fabric busy-polls before it sleeps: soft, the nodes' engine threads; verbs,
    /// every completion queue poller (clients' included).
    pub poll_spin: Duration,
    /// What one node allows its control-plane clients.
    pub limits: ConnectionLimits,
    /// How remote nodes are reached.
    pub ssh: SshSettings,
    /// The nodes, in file order.
    pub nodes: Vec<NodeConfig>,
    /// Things worth fixing that do not stop the cluster (an over-readable secret file).
    pub warnings: Vec<String>,
}

/// A node's connection limits. Control plane (`docs/protocol.md`, *Control frames*):
/// unauthenticated connections get their own, smaller budget, so that anyone who can reach
/// the port cannot take authenticated clients' slots. Soft fabric port (`docs/fabric.md`):
/// a fixed engine pool, and a deadline and a bound on hellos.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Control connections at once, authenticated or not.
    pub max_connections: usize,
    /// Unauthenticated connections at once; a new one evicts the oldest.
    pub max_unauthenticated: usize,
    /// Unauthenticated connections at once from one source address; a new one evicts that
    /// address's oldest.
    pub max_pending_per_address: usize,
    /// From accept to the end of the whole handshake.
    pub handshake_deadline: Duration,
    /// The soft NIC's engine threads; zero means one per core.
    pub fabric_engine_threads: usize,
    /// From accept to the end of a soft fabric connection's whole hello.
    pub fabric_hello_deadline: Duration,
    /// Soft fabric connections reading their hello at once; a new one closes the oldest.
    pub fabric_max_pending_hellos: usize,
    /// Response bytes one soft fabric connection holds or leaves unsent before the node stops
    /// reading it.
    pub fabric_response_buffer: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_unauthenticated: 256,
            max_pending_per_address: 64,
            handshake_deadline: Duration::from_secs(10),
            fabric_engine_threads: 0,
            fabric_hello_deadline: rdkv_fabric::DEFAULT_HELLO_DEADLINE,
            fabric_max_pending_hellos: rdkv_fabric::DEFAULT_MAX_PENDING_HELLOS,
            fabric_response_buffer: rdkv_fabric::DEFAULT_RESPONSE_BUFFER,
        }
    }
}

/// How `rdkv-cluster` reaches nodes on other hosts: OpenSSH in batch mode, with the user's own
/// ssh config and agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SshSettings {
    /// `ssh -l USER` (else the ssh config's user).
    pub user: Option<String>,
    /// Extra arguments for every ssh call (`-p 2222`, `-F file`, `-i key`).
    pub options: Vec<String>,
    /// The `rdkv-server` binary on the remote hosts.
    pub remote_binary: String,
    /// The run directory on the remote hosts (relative paths are from the login directory).
    pub remote_run_dir: String,
}

/// One validated node.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeConfig {
    /// The node's id.
    pub id: u32,
    /// The ssh destination of a node on another host; `None` for a node on this machine.
    pub host: Option<String>,
    /// Control-plane address.
    pub control_address: SocketAddr,
    /// Soft NIC address.
    pub fabric_address: Option<SocketAddr>,
    /// RDMA device (verbs).
    pub device: Option<String>,
    /// GID index (verbs).
    pub gid_index: Option<u32>,
    /// Prometheus metrics address.
    pub metrics_address: Option<SocketAddr>,
    /// Index bytes.
    pub index_size: u64,
    /// Heap bytes.
    pub heap_size: u64,
    /// Chunk bytes.
    pub chunk_size: u64,
    /// Hugepage policy.
    pub hugepages: HugepagePolicy,
    /// Largest share of MemAvailable to pin.
    pub max_pinned_share: f64,
    /// Whether clients on the node's host use its `shm` fabric.
    pub shm: ShmMode,
    /// The node's `shm` socket, when the file names one.
    pub shm_socket: Option<PathBuf>,
    /// Where the node keeps its snapshots, when the file names it (else `rdkv-cluster` gives
    /// it one in its run directory).
    pub data_dir: Option<PathBuf>,
}

/// Whether a node offers its `shm` fabric to clients on its host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShmMode {
    /// It does, and such clients use it (the default).
    Auto,
    /// It does not: every client uses the cluster's fabric.
    Off,
}

impl NodeConfig {
    /// Where the node offers its `shm` fabric: `shm_socket`, or by default
    /// `rdkv-<cluster>-node-<id>.sock` in [`private_socket_directory`] (`rdkv-cluster` passes
    /// a path in its run directory instead); `None` with `shm = "off"`, or when the cluster's
    /// fabric shares memory itself (`shm`).
    pub fn offered_shm_socket(&self, cluster: &ClusterConfig) -> Option<PathBuf> {
        if self.shm == ShmMode::Off || cluster.fabric.capabilities().shares_memory {
            return None;
        }
        Some(self.shm_socket.clone().unwrap_or_else(|| {
            private_socket_directory().join(format!("rdkv-{}-node-{}.sock", cluster.name, self.id))
        }))
    }
}

/// The directory of a node's default `shm` socket, which only its user may enter (the node
/// creates it mode 0700 and refuses one that another user owns or others may enter, so that
/// nobody else can put a socket in its place): `$XDG_RUNTIME_DIR/rdkv` (a per-user directory
/// that the login manager made 0700) when that is set, else `rdkv-<uid>` in the temporary
/// directory.
pub fn private_socket_directory() -> PathBuf {
    if let Some(runtime) = std::env::var_os("XDG_RUNTIME_DIR").filter(|runtime| !runtime.is_empty())
    {
        return PathBuf::from(runtime).join("rdkv");
    }
    // The owner of /proc/self is this process's effective user.
    let user = std::fs::metadata("/proc/self").map_or_else(
        |_| "user".to_string(),
        |metadata| std::os::unix::fs::MetadataExt::uid(&metadata).to_string(),
    );
    std::env::temp_dir().join(format!("rdkv-{user}"))
}

impl ClusterConfig {
    /// The node with this id.
    pub fn node(&self, id: u32) -> Option<&NodeConfig> {
        self.nodes.iter().find(|node| node.id == id)
    }
}

/// The default chunk size.
pub const DEFAULT_CHUNK_SIZE: u64 = 1 << 20;

/// 1-based line of a byte offset.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// Builds errors that point into one file.
struct Locator<'a> {
    path: &'a Path,
    text: &'a str,
}

impl Locator<'_> {
    fn error(
        &self,
        span: std::ops::Range<usize>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Error {
        Error::Invalid {
            file: self.path.to_path_buf(),
            line: line_of(self.text, span.start),
            field: field.into(),
            message: message.into(),
        }
    }

    fn size(&self, value: &Spanned<RawSize>, field: String) -> Result<u64> {
        match value.get_ref() {
            RawSize::Bytes(bytes) => Ok(*bytes),
            RawSize::Text(text) => {
                parse_size(text).map_err(|message| self.error(value.span(), field, message))
            }
        }
    }

    fn duration(
        &self,
        value: &Option<Spanned<String>>,
        field: &str,
        default: Duration,
    ) -> Result<Duration> {
        match value {
            None => Ok(default),
            Some(value) => parse_duration(value.get_ref())
                .map_err(|message| self.error(value.span(), field, message)),
        }
    }

    /// A count of connections or hellos: at least 1, `default` when absent.
    fn count(&self, value: &Option<Spanned<u64>>, field: &str, default: usize) -> Result<usize> {
        match value {
            None => Ok(default),
            Some(value) if *value.get_ref() == 0 => Err(self.error(
                value.span(),
                field,
                "0 would refuse every client: at least 1",
            )),
            Some(value) => Ok(usize::try_from(*value.get_ref()).unwrap_or(usize::MAX)),
        }
    }

    fn address(&self, value: &Spanned<String>, field: String) -> Result<SocketAddr> {
        value.get_ref().parse().map_err(|_| {
            self.error(
                value.span(),
                field,
                format!(
                    "`{}` is not an address: use ip:port, for example \"127.0.0.1:7400\"",
                    value.get_ref()
                ),
            )
        })
    }
}

/// Loads and validates a cluster file, for a program that uses the cluster (a client, the
/// CLI, `status`, `down`): this machine's memlock limit and memory are not checked, since it
/// pins no table (see [`load_to_start`]).
///
/// # Errors
/// [`Error::Read`] or [`Error::Invalid`] naming the file, line and field.
pub fn load(path: &Path) -> Result<ClusterConfig> {
    let text = read(path)?;
    parse_with_secret(path, &text, None, None)
}

/// Loads and validates a cluster file to start nodes on this machine (`rdkv-server --config`,
/// `rdkv-cluster up` and `restart`): as [`load`], and each local node among `only` (or every
/// local node) must fit this machine's memlock limit and memory, since its process pins its
/// table here. `secret`, when given, replaces the file's `secret` or `secret_file`
/// (`rdkv-server --secret-file PATH`: a systemd credential, the copy `rdkv-cluster` leaves on a
/// remote host).
///
/// # Errors
/// As [`load`], and [`Error::Invalid`] on `heap_size` when a node's table cannot be pinned.
pub fn load_to_start(
    path: &Path,
    secret: Option<Vec<u8>>,
    only: Option<u32>,
) -> Result<ClusterConfig> {
    let text = read(path)?;
    let (available, _) = read_meminfo();
    let machine = MachineCheck {
        memlock: read_memlock_figures(),
        available_memory: available,
        only,
    };
    parse_with_secret(path, &text, Some(machine), secret)
}

/// Loads and validates a cluster file as [`load`] does, with `secret` replacing the file's
/// secret when given, and no check against this machine: a running node reading its file
/// again (a member added since it started) has pinned its own table already, which the
/// memlock check of [`load_to_start`] would count against the file's nodes.
///
/// # Errors
/// As [`load`].
pub fn load_with_secret(path: &Path, secret: Option<Vec<u8>>) -> Result<ClusterConfig> {
    let text = read(path)?;
    parse_with_secret(path, &text, None, secret)
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| Error::Read {
        file: path.to_path_buf(),
        source,
    })
}

/// What to check local nodes' tables against.
#[derive(Debug, Clone, Copy)]
struct MachineCheck {
    memlock: MemlockFigures,
    available_memory: u64,
    /// Only this node (else every local node).
    only: Option<u32>,
}

/// Validates cluster file text with given machine figures (tests inject them); every local
/// node must fit them.
///
/// # Errors
/// [`Error::Invalid`] naming the file, line and field.
pub fn parse(
    path: &Path,
    text: &str,
    memlock: MemlockFigures,
    available_memory: u64,
) -> Result<ClusterConfig> {
    let machine = MachineCheck {
        memlock,
        available_memory,
        only: None,
    };
    parse_with_secret(path, text, Some(machine), None)
}

/// Validates a cluster file's text section by section: `[cluster]`, then each `[[node]]`, then
/// what needs both (`replicas`, the two-node warning). Local nodes' tables must fit `machine`,
/// when given; `secret_override`, when given, replaces the file's secret.
fn parse_with_secret(
    path: &Path,
    text: &str,
    machine: Option<MachineCheck>,
    secret_override: Option<Vec<u8>>,
) -> Result<ClusterConfig> {
    let locator = Locator { path, text };
    let raw: RawFile = toml::from_str(text).map_err(|error| {
        let span = error.span().unwrap_or(0..0);
        locator.error(span, "syntax", error.message().to_string())
    })?;
    let mut config = parse_cluster_section(&locator, &raw.cluster, secret_override)?;
    config.nodes = parse_node_sections(&locator, &raw, config.fabric, machine)?;
    config.replicas = parse_replicas(&locator, raw.cluster.get_ref(), config.nodes.len())?;
    warn_of_late_failure_timeout(&locator, raw.cluster.get_ref(), &mut config);
    if config.nodes.len() == 2 {
        config.warnings.push(format!(
            "{}: two nodes: when one dies, the other cannot commit a view without it (the view's Raft needs a majority); use three nodes to survive the loss of one (docs/operations.md, The cluster view)",
            path.display()
        ));
    }
    Ok(config)
}

/// Where an optional key is in the file (the file's start when it is absent: the error is
/// then about a default).
fn span_of<T>(value: &Option<Spanned<T>>) -> std::ops::Range<usize> {
    value.as_ref().map_or(0..0, Spanned::span)
}

/// The default unauthenticated budget for `max_connections`: 256, or a quarter of a smaller
/// total (at least 1).
pub fn default_unauthenticated(max_connections: usize) -> usize {
    ConnectionLimits::default()
        .max_unauthenticated
        .min((max_connections / 4).max(1))
}
