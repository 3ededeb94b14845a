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
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rdkv_common::layout::{COMBINED_BUCKET_SIZE, MAX_BLOCK_SIZE, MIN_HEAP_CHUNKS};
use rdkv_fabric::memory::limits::{
    decide_available_memory, decide_memlock, read_meminfo, read_memlock_figures, MemlockFigures,
};
use rdkv_fabric::memory::{HugepagePolicy, PinLimits};
use rdkv_fabric::Backend;
use serde::Deserialize;
use toml::Spanned;

use crate::error::{Error, Result};
use crate::units::{parse_duration, parse_size};

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
}

/// The failure timeout when the file gives none.
pub const DEFAULT_FAILURE_TIMEOUT: Duration = Duration::from_secs(2);
/// The shortest failure timeout: above Raft's election timeout (400-800 ms).
pub const MIN_FAILURE_TIMEOUT: Duration = Duration::from_secs(1);
/// The longest failure timeout.
pub const MAX_FAILURE_TIMEOUT: Duration = Duration::from_secs(60);

/// The most copies of a key a cluster file may ask for.
pub const MAX_REPLICAS: usize = 3;

/// The longest `poll_spin` a cluster file may ask for.
const MAX_POLL_SPIN: Duration = Duration::from_millis(10);

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
    /// `rdkv-<cluster>-node-<id>.sock` in the temporary directory (`rdkv-cluster` passes a
    /// path in its run directory instead); `None` with `shm = "off"`, or when the cluster's
    /// fabric is `shm` itself.
    pub fn offered_shm_socket(&self, cluster: &ClusterConfig) -> Option<PathBuf> {
        if self.shm == ShmMode::Off || cluster.fabric == Backend::Shm {
            return None;
        }
        Some(self.shm_socket.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("rdkv-{}-node-{}.sock", cluster.name, self.id))
        }))
    }
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
    if config.nodes.len() == 2 {
        config.warnings.push(format!(
            "{}: two nodes: when one dies, the other cannot commit a view without it (the view's Raft needs a majority); use three nodes to survive the loss of one (docs/operations.md, The cluster view)",
            path.display()
        ));
    }
    Ok(config)
}

/// The `[cluster]` section, checked in file order: the configuration without its nodes (and
/// one replica, until the nodes are known).
fn parse_cluster_section(
    locator: &Locator<'_>,
    section: &Spanned<RawCluster>,
    secret_override: Option<Vec<u8>>,
) -> Result<ClusterConfig> {
    let cluster = section.get_ref();
    check_cluster_name(locator, &cluster.name)?;
    let fabric = parse_fabric(locator, &cluster.fabric)?;
    let mut warnings = Vec::new();
    let secret = match secret_override {
        Some(secret) => secret,
        None => read_secret(locator, section, &mut warnings)?,
    };
    if secret.is_empty() {
        let span = cluster
            .secret
            .as_ref()
            .map(Spanned::span)
            .or_else(|| cluster.secret_file.as_ref().map(Spanned::span))
            .unwrap_or(0..0);
        return Err(locator.error(span, "cluster.secret", "the secret is empty"));
    }
    let lease_timeout = locator.duration(
        &cluster.lease_timeout,
        "cluster.lease_timeout",
        Duration::from_secs(10),
    )?;
    let failure_timeout = parse_failure_timeout(locator, cluster)?;
    let operation_deadline = locator.duration(
        &cluster.operation_deadline,
        "cluster.operation_deadline",
        Duration::from_secs(2),
    )?;
    let poll_spin = locator.duration(&cluster.poll_spin, "cluster.poll_spin", Duration::ZERO)?;
    let limits = connection_limits(locator, cluster)?;
    check_poll_spin(locator, cluster, poll_spin)?;
    Ok(ClusterConfig {
        path: locator.path.to_path_buf(),
        name: cluster.name.get_ref().clone(),
        secret,
        fabric,
        lease_timeout,
        failure_timeout,
        replicas: 1,
        operation_deadline,
        poll_spin,
        limits,
        ssh: ssh_settings(cluster),
        nodes: Vec::new(),
        warnings,
    })
}

/// `cluster.name` makes file and unit names: letters, digits, `.`, `_` and `-`, not starting
/// with `.`.
fn check_cluster_name(locator: &Locator<'_>, name: &Spanned<String>) -> Result<()> {
    let text = name.get_ref();
    let is_plain = !text.is_empty()
        && !text.starts_with('.')
        && text
            .chars()
            .all(|character| character.is_ascii_alphanumeric() || "._-".contains(character));
    if is_plain {
        return Ok(());
    }
    Err(locator.error(
        name.span(),
        "cluster.name",
        format!(
            "{text:?}: use letters, digits, '.', '_' and '-', not starting with '.' (the name makes the run directory and the systemd unit names)"
        ),
    ))
}

/// `cluster.fabric`: a backend that crosses processes.
fn parse_fabric(locator: &Locator<'_>, fabric: &Spanned<String>) -> Result<Backend> {
    match fabric.get_ref().parse::<Backend>() {
        Ok(backend) if backend.crosses_processes() => Ok(backend),
        Ok(backend) => Err(locator.error(
            fabric.span(),
            "cluster.fabric",
            format!("fabric `{backend}` works only inside one process: use \"soft\" or \"verbs\""),
        )),
        Err(error) => Err(locator.error(fabric.span(), "cluster.fabric", error.to_string())),
    }
}

/// The section's `secret`, or the contents of its `secret_file`: exactly one of them.
fn read_secret(
    locator: &Locator<'_>,
    section: &Spanned<RawCluster>,
    warnings: &mut Vec<String>,
) -> Result<Vec<u8>> {
    let cluster = section.get_ref();
    match (&cluster.secret, &cluster.secret_file) {
        (Some(_), Some(file)) => Err(locator.error(
            file.span(),
            "cluster.secret_file",
            "set either secret or secret_file, not both",
        )),
        (None, None) => Err(locator.error(
            section.span(),
            "cluster.secret",
            "missing: set secret or secret_file",
        )),
        (Some(secret), None) => Ok(secret.get_ref().as_bytes().to_vec()),
        (None, Some(file)) => read_secret_file(locator, file, warnings),
    }
}

/// `secret_file`'s contents, trimmed; the file is found from the cluster file's directory. A
/// file readable by group or others is a warning, not an error.
fn read_secret_file(
    locator: &Locator<'_>,
    file: &Spanned<String>,
    warnings: &mut Vec<String>,
) -> Result<Vec<u8>> {
    let secret_path = locator
        .path
        .parent()
        .map(|directory| directory.join(file.get_ref()))
        .unwrap_or_else(|| PathBuf::from(file.get_ref()));
    let bytes = std::fs::read(&secret_path).map_err(|error| {
        locator.error(
            file.span(),
            "cluster.secret_file",
            format!("cannot read {}: {error}", secret_path.display()),
        )
    })?;
    if let Ok(metadata) = std::fs::metadata(&secret_path) {
        use std::os::unix::fs::PermissionsExt;
        let mode = metadata.permissions().mode();
        if mode & 0o077 != 0 {
            warnings.push(format!(
                "{}:{}: cluster.secret_file: {} is readable by group or others (mode {:o}); run `chmod 600 {}`",
                locator.path.display(),
                line_of(locator.text, file.span().start),
                secret_path.display(),
                mode & 0o777,
                secret_path.display()
            ));
        }
    }
    Ok(bytes.trim_ascii().to_vec())
}

/// `cluster.failure_timeout`, between [`MIN_FAILURE_TIMEOUT`] and [`MAX_FAILURE_TIMEOUT`].
fn parse_failure_timeout(locator: &Locator<'_>, cluster: &RawCluster) -> Result<Duration> {
    let failure_timeout = locator.duration(
        &cluster.failure_timeout,
        "cluster.failure_timeout",
        DEFAULT_FAILURE_TIMEOUT,
    )?;
    if !(MIN_FAILURE_TIMEOUT..=MAX_FAILURE_TIMEOUT).contains(&failure_timeout) {
        return Err(locator.error(
            span_of(&cluster.failure_timeout),
            "cluster.failure_timeout",
            format!(
                "{failure_timeout:?} is outside {MIN_FAILURE_TIMEOUT:?} to {MAX_FAILURE_TIMEOUT:?}: shorter would mark nodes down during a leader election (400-800 ms), longer leaves a dead node's keys unserved for that long"
            ),
        ));
    }
    Ok(failure_timeout)
}

/// `cluster.poll_spin` (parsed) is at most [`MAX_POLL_SPIN`].
fn check_poll_spin(locator: &Locator<'_>, cluster: &RawCluster, poll_spin: Duration) -> Result<()> {
    if poll_spin <= MAX_POLL_SPIN {
        return Ok(());
    }
    Err(locator.error(
        span_of(&cluster.poll_spin),
        "cluster.poll_spin",
        format!(
            "{poll_spin:?} is more than the {MAX_POLL_SPIN:?} allowed: a longer spin only burns \
             a core; tens of microseconds is what cuts a wake-up (docs/benchmarks.md)"
        ),
    ))
}

/// The `[cluster]` section's ssh keys, defaults where absent.
fn ssh_settings(cluster: &RawCluster) -> SshSettings {
    SshSettings {
        user: cluster.ssh_user.as_ref().map(|user| user.get_ref().clone()),
        options: cluster
            .ssh_options
            .as_ref()
            .map(|options| options.get_ref().clone())
            .unwrap_or_default(),
        remote_binary: cluster.remote_binary.as_ref().map_or_else(
            || "rdkv-server".to_string(),
            |binary| binary.get_ref().clone(),
        ),
        remote_run_dir: cluster.remote_run_dir.as_ref().map_or_else(
            || format!(".rdkv/{}", cluster.name.get_ref()),
            |directory| directory.get_ref().clone(),
        ),
    }
}

/// `cluster.replicas`: 1 to [`MAX_REPLICAS`], and at most the nodes (1 when absent).
fn parse_replicas(locator: &Locator<'_>, cluster: &RawCluster, node_count: usize) -> Result<usize> {
    let Some(replicas) = &cluster.replicas else {
        return Ok(1);
    };
    let count = *replicas.get_ref();
    let limit = MAX_REPLICAS.min(node_count);
    if count == 0 || count > limit as u64 {
        let why = if count > MAX_REPLICAS as u64 || count == 0 {
            format!("rdkv keeps 1 to {MAX_REPLICAS} copies of a key")
        } else {
            format!(
                "the file has {node_count} node(s), and each copy of a key lives on a different node"
            )
        };
        return Err(locator.error(
            replicas.span(),
            "cluster.replicas",
            format!("{count} is not between 1 and {limit}: {why}"),
        ));
    }
    Ok(count as usize)
}

/// Every `[[node]]` section, in file order: ids and addresses must be unique across them.
fn parse_node_sections(
    locator: &Locator<'_>,
    raw: &RawFile,
    fabric: Backend,
    machine: Option<MachineCheck>,
) -> Result<Vec<NodeConfig>> {
    if raw.nodes.is_empty() {
        return Err(locator.error(
            raw.cluster.span(),
            "node",
            "no [[node]] tables: a cluster needs at least one node",
        ));
    }
    let mut nodes = Vec::new();
    let mut ids: HashMap<u32, usize> = HashMap::new();
    let mut addresses: HashMap<SocketAddr, String> = HashMap::new();
    for (index, section) in raw.nodes.iter().enumerate() {
        let node = NodeSection {
            locator,
            index,
            section,
        };
        let id = node.section.get_ref().id.get_ref();
        if let Some(first) = ids.insert(*id, index) {
            return Err(node.error(
                node.section.get_ref().id.span(),
                "id",
                format!("duplicate id {id} (also node[{first}])"),
            ));
        }
        nodes.push(node.parse(fabric, machine, &mut addresses)?);
    }
    Ok(nodes)
}

/// One `[[node]]` section being validated: its errors name `node[index].field`.
struct NodeSection<'a> {
    /// Builds errors that point into the file.
    locator: &'a Locator<'a>,
    /// The section's place among the file's `[[node]]` sections.
    index: usize,
    /// The section as read.
    section: &'a Spanned<RawNode>,
}

/// A node's addresses, parsed.
struct NodeAddresses {
    /// `control_address`.
    control: SocketAddr,
    /// `fabric_address`, when given.
    fabric: Option<SocketAddr>,
    /// `metrics_address`, when given.
    metrics: Option<SocketAddr>,
}

/// A node's table sizes in bytes, parsed and checked against each other.
struct NodeSizes {
    /// `index_size`.
    index: u64,
    /// `heap_size`.
    heap: u64,
    /// `chunk_size`, or its default for the heap.
    chunk: u64,
}

impl NodeSection<'_> {
    /// The node's configuration, its keys checked in the order the errors should come in.
    /// `addresses` holds the addresses of the nodes before it (and gets this node's).
    fn parse(
        &self,
        fabric: Backend,
        machine: Option<MachineCheck>,
        addresses: &mut HashMap<SocketAddr, String>,
    ) -> Result<NodeConfig> {
        let node = self.section.get_ref();
        let id = *node.id.get_ref();
        let parsed = self.addresses(fabric, addresses)?;
        let sizes = self.sizes()?;
        let hugepages = match &node.hugepages {
            None => HugepagePolicy::Auto,
            Some(policy) => policy
                .get_ref()
                .parse()
                .map_err(|message: String| self.error(policy.span(), "hugepages", message))?,
        };
        let max_pinned_share = node
            .max_pinned_share
            .as_ref()
            .map_or(0.5, |share| *share.get_ref());
        let shm = self.shm()?;
        let shm_socket = self.shm_socket()?;
        let host = self.host(parsed.control)?;
        // Only a node whose process starts here pins its table here.
        let checked =
            machine.filter(|machine| host.is_none() && machine.only.is_none_or(|only| only == id));
        if let Some(machine) = checked {
            self.check_fits(machine, sizes.index + sizes.heap, max_pinned_share)?;
        }
        Ok(NodeConfig {
            id,
            host,
            control_address: parsed.control,
            fabric_address: parsed.fabric,
            device: node.device.as_ref().map(|device| device.get_ref().clone()),
            gid_index: node.gid_index.as_ref().map(|index| *index.get_ref()),
            metrics_address: parsed.metrics,
            index_size: sizes.index,
            heap_size: sizes.heap,
            chunk_size: sizes.chunk,
            hugepages,
            max_pinned_share,
            shm,
            shm_socket,
        })
    }

    /// `node[index].field`.
    fn field(&self, field: &str) -> String {
        format!("node[{}].{field}", self.index)
    }

    /// An error about this node's `field`.
    fn error(
        &self,
        span: std::ops::Range<usize>,
        field: &str,
        message: impl Into<String>,
    ) -> Error {
        self.locator.error(span, self.field(field), message)
    }

    /// The node's addresses: a fabric address for the soft fabric, no port 0, none used twice
    /// in the file.
    fn addresses(
        &self,
        fabric: Backend,
        seen: &mut HashMap<SocketAddr, String>,
    ) -> Result<NodeAddresses> {
        let node = self.section.get_ref();
        let optional = |address: &Option<Spanned<String>>, field: &str| {
            address
                .as_ref()
                .map(|address| self.locator.address(address, self.field(field)))
                .transpose()
        };
        let parsed = NodeAddresses {
            control: self
                .locator
                .address(&node.control_address, self.field("control_address"))?,
            fabric: optional(&node.fabric_address, "fabric_address")?,
            metrics: optional(&node.metrics_address, "metrics_address")?,
        };
        if fabric == Backend::Soft && parsed.fabric.is_none() {
            return Err(self.error(
                self.section.span(),
                "fabric_address",
                "missing: the soft fabric needs an address per node",
            ));
        }
        let spans = [
            (
                Some(parsed.control),
                node.control_address.span(),
                "control_address",
            ),
            (
                parsed.fabric,
                span_of(&node.fabric_address),
                "fabric_address",
            ),
            (
                parsed.metrics,
                span_of(&node.metrics_address),
                "metrics_address",
            ),
        ];
        for (address, span, field) in spans {
            let Some(address) = address else { continue };
            if address.port() == 0 {
                return Err(self.error(
                    span,
                    field,
                    "port 0 is not allowed here: clients need to know the port",
                ));
            }
            if let Some(other) = seen.insert(address, self.field(field)) {
                return Err(self.error(
                    span,
                    field,
                    format!("duplicate address {address} (also {other})"),
                ));
            }
        }
        Ok(parsed)
    }

    /// The node's table sizes: an index of two combined buckets or more, chunks that hold the
    /// largest block, a heap of [`MIN_HEAP_CHUNKS`] chunks or more.
    fn sizes(&self) -> Result<NodeSizes> {
        let node = self.section.get_ref();
        let index = self
            .locator
            .size(&node.index_size, self.field("index_size"))?;
        let heap = self
            .locator
            .size(&node.heap_size, self.field("heap_size"))?;
        let chunk = node
            .chunk_size
            .as_ref()
            .map(|size| self.locator.size(size, self.field("chunk_size")))
            .transpose()?
            .unwrap_or(
                DEFAULT_CHUNK_SIZE
                    .min(heap / MIN_HEAP_CHUNKS / 4096 * 4096)
                    .max(MAX_BLOCK_SIZE.div_ceil(4096) * 4096),
            );
        if index < 2 * COMBINED_BUCKET_SIZE {
            return Err(self.error(
                node.index_size.span(),
                "index_size",
                format!(
                    "{index} bytes is too small: at least {} bytes (two combined buckets)",
                    2 * COMBINED_BUCKET_SIZE
                ),
            ));
        }
        if chunk < MAX_BLOCK_SIZE || chunk % 4096 != 0 {
            let span = node
                .chunk_size
                .as_ref()
                .map_or(self.section.span(), Spanned::span);
            return Err(self.error(
                span,
                "chunk_size",
                format!("{chunk} bytes: a chunk must be a multiple of 4096 and hold the largest block ({MAX_BLOCK_SIZE} bytes)"),
            ));
        }
        if heap < MIN_HEAP_CHUNKS * chunk {
            return Err(self.error(
                node.heap_size.span(),
                "heap_size",
                format!("{heap} bytes is too small: at least {MIN_HEAP_CHUNKS} chunks ({} bytes; one is the compactor's, one its reserve); raise heap_size or lower chunk_size", MIN_HEAP_CHUNKS * chunk),
            ));
        }
        Ok(NodeSizes { index, heap, chunk })
    }

    /// `shm`: `auto` (the default) or `off`.
    fn shm(&self) -> Result<ShmMode> {
        let Some(mode) = &self.section.get_ref().shm else {
            return Ok(ShmMode::Auto);
        };
        match mode.get_ref().as_str() {
            "auto" => Ok(ShmMode::Auto),
            "off" => Ok(ShmMode::Off),
            other => Err(self.error(
                mode.span(),
                "shm",
                format!("`{other}`: expected \"auto\" (clients on the node's host use shared memory) or \"off\""),
            )),
        }
    }

    /// `shm_socket`: a path, when given.
    fn shm_socket(&self) -> Result<Option<PathBuf>> {
        match &self.section.get_ref().shm_socket {
            Some(path) if path.get_ref().trim().is_empty() => Err(self.error(
                path.span(),
                "shm_socket",
                "empty: give a path for the node's Unix-domain socket, or leave it out",
            )),
            Some(path) => Ok(Some(PathBuf::from(path.get_ref()))),
            None => Ok(None),
        }
    }

    /// The node's ssh destination: `host`, or without it the control address's IP unless that
    /// is loopback or unspecified; `None` for this machine.
    fn host(&self, control_address: SocketAddr) -> Result<Option<String>> {
        match &self.section.get_ref().host {
            Some(host) if host.get_ref().trim().is_empty() => Err(self.error(
                host.span(),
                "host",
                "empty: name an ssh destination, or leave host out for this machine",
            )),
            Some(host) => Ok((!is_this_machine(host.get_ref())).then(|| host.get_ref().clone())),
            None => {
                let ip = control_address.ip();
                Ok((!(ip.is_loopback() || ip.is_unspecified())).then(|| ip.to_string()))
            }
        }
    }

    /// The `pinned` bytes of a node started here fit this machine's memlock limit and memory.
    fn check_fits(&self, machine: MachineCheck, pinned: u64, max_pinned_share: f64) -> Result<()> {
        let too_large = |error: &dyn std::fmt::Display| {
            self.error(
                self.section.get_ref().heap_size.span(),
                "heap_size",
                format!("index_size + heap_size is too large for this machine: {error}"),
            )
        };
        decide_memlock(pinned, machine.memlock).map_err(|error| too_large(&error))?;
        decide_available_memory(
            pinned,
            machine.available_memory,
            PinLimits { max_pinned_share },
        )
        .map_err(|error| too_large(&error))?;
        Ok(())
    }
}

/// The `[cluster]` connection limits, defaults where absent, checked against each other.
fn connection_limits(locator: &Locator<'_>, cluster: &RawCluster) -> Result<ConnectionLimits> {
    let defaults = ConnectionLimits::default();
    if let Some(value) = cluster
        .max_connections
        .as_ref()
        .filter(|value| *value.get_ref() < 2)
    {
        // Before the generic check of counts (at least 1), so 0 and 1 get the same message.
        return Err(locator.error(
            value.span(),
            "cluster.max_connections",
            format!(
                "{} is too few: at least 2 (the unauthenticated budget must stay below it)",
                value.get_ref()
            ),
        ));
    }
    let max_connections = locator.count(
        &cluster.max_connections,
        "cluster.max_connections",
        defaults.max_connections,
    )?;
    let limits = ConnectionLimits {
        max_connections,
        // Unset, it follows a smaller max_connections (a quarter of it), so lowering
        // max_connections alone never trips the check below.
        max_unauthenticated: locator.count(
            &cluster.max_unauthenticated_connections,
            "cluster.max_unauthenticated_connections",
            default_unauthenticated(max_connections),
        )?,
        max_pending_per_address: locator.count(
            &cluster.max_pending_per_address,
            "cluster.max_pending_per_address",
            defaults.max_pending_per_address,
        )?,
        handshake_deadline: locator.duration(
            &cluster.handshake_deadline,
            "cluster.handshake_deadline",
            defaults.handshake_deadline,
        )?,
        fabric_engine_threads: fabric_engine_threads(locator, cluster)?,
        fabric_hello_deadline: locator.duration(
            &cluster.fabric_hello_deadline,
            "cluster.fabric_hello_deadline",
            defaults.fabric_hello_deadline,
        )?,
        fabric_max_pending_hellos: fabric_max_pending_hellos(locator, cluster)?,
        fabric_response_buffer: fabric_response_buffer(locator, cluster)?,
    };
    check_limits_against_each_other(locator, cluster, &limits)?;
    Ok(limits.clamp_per_address())
}

/// `cluster.fabric_engine_threads`: at most [`MAX_ENGINE_THREADS`].
fn fabric_engine_threads(locator: &Locator<'_>, cluster: &RawCluster) -> Result<usize> {
    match &cluster.fabric_engine_threads {
        None => Ok(ConnectionLimits::default().fabric_engine_threads),
        Some(value) if *value.get_ref() > MAX_ENGINE_THREADS => Err(locator.error(
            value.span(),
            "cluster.fabric_engine_threads",
            format!("at most {MAX_ENGINE_THREADS} (0 means one per core)"),
        )),
        Some(value) => Ok(*value.get_ref() as usize),
    }
}

/// `cluster.fabric_max_pending_hellos`: 1 to [`MAX_PENDING_HELLOS`].
fn fabric_max_pending_hellos(locator: &Locator<'_>, cluster: &RawCluster) -> Result<usize> {
    let pending = locator.count(
        &cluster.fabric_max_pending_hellos,
        "cluster.fabric_max_pending_hellos",
        ConnectionLimits::default().fabric_max_pending_hellos,
    )?;
    if pending > MAX_PENDING_HELLOS {
        return Err(locator.error(
            span_of(&cluster.fabric_max_pending_hellos),
            "cluster.fabric_max_pending_hellos",
            format!("at most {MAX_PENDING_HELLOS}: each pending hello holds a socket"),
        ));
    }
    Ok(pending)
}

/// `cluster.fabric_response_buffer`: between [`MIN_RESPONSE_BUFFER`] and
/// [`MAX_RESPONSE_BUFFER`].
fn fabric_response_buffer(locator: &Locator<'_>, cluster: &RawCluster) -> Result<usize> {
    let Some(value) = &cluster.fabric_response_buffer else {
        return Ok(ConnectionLimits::default().fabric_response_buffer);
    };
    let bytes = locator.size(value, "cluster.fabric_response_buffer".into())?;
    if !(MIN_RESPONSE_BUFFER..=MAX_RESPONSE_BUFFER).contains(&bytes) {
        return Err(locator.error(
            value.span(),
            "cluster.fabric_response_buffer",
            "between 64K and 256M: at least a few answers, at most what a connection may hold",
        ));
    }
    Ok(bytes as usize)
}

/// The unauthenticated budget is below the total; the deadlines are within their bounds.
fn check_limits_against_each_other(
    locator: &Locator<'_>,
    cluster: &RawCluster,
    limits: &ConnectionLimits,
) -> Result<()> {
    if limits.max_unauthenticated >= limits.max_connections {
        let span = span_of(&cluster.max_unauthenticated_connections);
        return Err(locator.error(
            span,
            "cluster.max_unauthenticated_connections",
            format!(
                "{} must be below max_connections ({}): the unauthenticated budget is the smaller one",
                limits.max_unauthenticated, limits.max_connections
            ),
        ));
    }
    if !(Duration::from_secs(1)..=Duration::from_secs(120)).contains(&limits.handshake_deadline) {
        let span = span_of(&cluster.handshake_deadline);
        return Err(locator.error(
            span,
            "cluster.handshake_deadline",
            "between 1s and 120s: a handshake takes a few round trips",
        ));
    }
    if !(Duration::from_millis(100)..=Duration::from_secs(60))
        .contains(&limits.fabric_hello_deadline)
    {
        let span = span_of(&cluster.fabric_hello_deadline);
        return Err(locator.error(
            span,
            "cluster.fabric_hello_deadline",
            "between 100ms and 60s: a dialer sends its 40-byte hello at once",
        ));
    }
    Ok(())
}

/// Where an optional key is in the file (the file's start when it is absent: the error is
/// then about a default).
fn span_of<T>(value: &Option<Spanned<T>>) -> std::ops::Range<usize> {
    value.as_ref().map_or(0..0, Spanned::span)
}

/// The bounds of `fabric_response_buffer`.
const MIN_RESPONSE_BUFFER: u64 = 64 * 1024;
const MAX_RESPONSE_BUFFER: u64 = 256 << 20;

/// The most soft hellos a cluster file may let be pending at once.
const MAX_PENDING_HELLOS: usize = 65_536;

/// The most soft engine threads a cluster file may ask for.
const MAX_ENGINE_THREADS: u64 = 256;

/// The default unauthenticated budget for `max_connections`: 256, or a quarter of a smaller
/// total (at least 1).
pub fn default_unauthenticated(max_connections: usize) -> usize {
    ConnectionLimits::default()
        .max_unauthenticated
        .min((max_connections / 4).max(1))
}

impl ConnectionLimits {
    /// The per-address limit is at most the overall one.
    fn clamp_per_address(mut self) -> Self {
        self.max_pending_per_address = self.max_pending_per_address.min(self.max_unauthenticated);
        self
    }
}

/// Whether a node's `host` names this machine: `localhost`, a loopback address, or this
/// machine's host name.
fn is_this_machine(host: &str) -> bool {
    if host == "localhost" {
        return true;
    }
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return ip.is_loopback();
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .is_ok_and(|name| !name.trim().is_empty() && name.trim() == host)
}
