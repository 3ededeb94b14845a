//! `rdkv-server`: runs one rdkv node until SIGINT or SIGTERM.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{CommandFactory, Parser};
use rdkv_fabric::memory::HugepagePolicy;
use rdkv_fabric::{Backend, VerbsOptions};
use rdkv_server::config::StartFrom;
use rdkv_server::ServerConfig;
use tokio_util::sync::CancellationToken;

/// Run one rdkv node: pin and register the table, then serve clients until SIGINT/SIGTERM.
///
/// Either from a cluster file (`--config FILE --node ID`, as `rdkv-cluster up` does) or from
/// the flags below.
#[derive(Debug, Parser)]
#[command(version, about, after_help = EXIT_CODES)]
struct Arguments {
    /// A cluster file; the node's settings and the secret come from it.
    #[arg(long, requires = "node")]
    config: Option<PathBuf>,
    /// With --config: which node of the file to run.
    #[arg(long)]
    node: Option<u32>,
    /// The node's id (from 1).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    node_id: u32,
    /// Prometheus metrics listen address (GET /metrics).
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Control-plane listen address.
    #[arg(long, default_value = "127.0.0.1:7400")]
    listen: SocketAddr,
    /// The fabric: `soft` (the software RNIC over TCP), `verbs` (an RDMA NIC; needs a build
    /// with `--features verbs`) or `shm` (clients on this host only).
    #[arg(long, default_value = "soft", value_parser = parse_fabric)]
    fabric: Backend,
    /// Soft NIC listen address (one-sided requests arrive here); by default the --listen IP
    /// and the next port (7401 beside 7400; port 0 beside port 0).
    #[arg(long)]
    fabric_listen: Option<SocketAddr>,
    /// Verbs: the RDMA device (`ibv_devices` lists them); the first one by default.
    #[arg(long)]
    rdma_device: Option<String>,
    /// Verbs: the port number (from 1).
    #[arg(long)]
    rdma_port: Option<u8>,
    /// Verbs: the GID index (`show_gids` lists them); by default the first RoCE v2 IPv4 GID.
    #[arg(long)]
    gid_index: Option<u32>,
    /// Busy-poll the fabric this many microseconds before sleeping (lower latency, more CPU).
    #[arg(long, default_value_t = 0)]
    poll_spin_us: u64,
    /// Index size in bytes (K, M, G suffixes allowed).
    #[arg(long, default_value = "4M", value_parser = rdkv_cluster_file::units::parse_size)]
    index_size: u64,
    /// Heap size in bytes (K, M, G suffixes allowed).
    #[arg(long, default_value = "64M", value_parser = rdkv_cluster_file::units::parse_size)]
    heap_size: u64,
    /// Heap chunk size in bytes (K, M suffixes allowed).
    #[arg(long, default_value = "1M", value_parser = rdkv_cluster_file::units::parse_size)]
    chunk_size: u64,
    /// Hugepage policy: auto, require or off.
    #[arg(long, default_value = "auto")]
    hugepages: HugepagePolicy,
    /// The largest share of MemAvailable the table may pin.
    #[arg(long, default_value_t = 0.5)]
    max_pinned_share: f64,
    /// A file holding the cluster secret (else the RDKV_SECRET environment variable). With
    /// --config it replaces the file's secret (a systemd credential, say).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Lease timeout in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    lease_timeout_ms: u64,
    /// Per-operation deadline in milliseconds.
    #[arg(long, default_value_t = 2_000)]
    deadline_ms: u64,
    /// Authenticated control connections at once: clients and their lanes (the cluster file's
    /// `max_connections`; with --config, set it there). Unauthenticated connections have their
    /// own budget; monitors (status, stats) 32 more slots, and peer nodes 64 of their own.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(2..), conflicts_with = "config")]
    max_connections: u32,
    /// Unauthenticated control connections at once, apart from and below --max-connections; a
    /// new one evicts the oldest silent one (`max_unauthenticated_connections`; default 256, or a quarter of
    /// a smaller --max-connections).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), conflicts_with = "config")]
    max_unauthenticated_connections: Option<u32>,
    /// Unauthenticated control connections at once from one source address
    /// (`max_pending_per_address`).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..), conflicts_with = "config")]
    max_pending_per_address: u32,
    /// Also offer the node's memory to clients on this host over the `shm` fabric, on this
    /// Unix-domain socket (created mode 0600). With --config it replaces the file's
    /// `shm_socket` (`rdkv-cluster` passes one in its run directory); without it, no `shm`.
    #[arg(long)]
    shm_socket: Option<PathBuf>,
    /// The soft NIC's engine threads, 0 to 256; 0 means one per core
    /// (`fabric_engine_threads`).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=256), conflicts_with = "config")]
    fabric_engine_threads: u32,
    /// With --config: where the cluster view's consensus keeps this node's vote and log
    /// across restarts (`rdkv-cluster` passes one in its run directory). Without it they are
    /// kept in memory, which is safe only for a node that never rejoins a running cluster.
    #[arg(long, requires = "config")]
    view_state: Option<PathBuf>,
    /// With --config: join the running cluster as a new member (`rdkv-cluster add-node`
    /// passes it): learn the view from its leader instead of starting one with the file's
    /// nodes. The node serves once the leader has added it and it is refilled.
    #[arg(long, requires = "config")]
    join: bool,
    /// Where the node keeps its snapshots, and loads the last one from at start (with
    /// --config it replaces the file's `data_dir`; `rdkv-cluster` passes one in its run
    /// directory). Without one, the node writes none and starts empty.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Which snapshot to start from: `latest`, `previous` (the one before, kept beside it) or
    /// `empty` (none), when the latest one is damaged. `rdkv-cluster up` passes the
    /// environment variable on to its nodes.
    #[arg(long, value_enum, default_value_t = StartFrom::Latest, env = "RDKV_FROM_SNAPSHOT")]
    from_snapshot: StartFrom,
    /// Log into this file instead of stderr: appended to (a restart keeps the earlier runs'
    /// lines), rotated by size; stderr is pointed at it too (`rdkv-cluster` passes
    /// `node-ID.log` in its run directory for a node it starts in the background).
    #[arg(long)]
    log_file: Option<PathBuf>,
    /// With --log-file: the size at which the file is rotated to FILE.1 (K, M, G suffixes).
    #[arg(long, default_value = "16M", value_parser = rdkv_cluster_file::units::parse_size, requires = "log_file")]
    log_rotate_size: u64,
    /// With --log-file: how many rotated files (FILE.1 … FILE.N) are kept; older ones are
    /// deleted.
    #[arg(long, default_value_t = rdkv_server::log_file::DEFAULT_KEPT_FILES, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100), requires = "log_file")]
    log_kept_files: usize,
    /// Without --config: seconds between snapshots (0: only at a clean stop).
    #[arg(long, default_value_t = 60, conflicts_with = "config")]
    snapshot_interval_s: u64,
}

impl Arguments {
    /// The unauthenticated budget: given, or the default for --max-connections.
    fn max_unauthenticated(&self) -> usize {
        self.max_unauthenticated_connections.map_or_else(
            || rdkv_cluster_file::config::default_unauthenticated(self.max_connections as usize),
            |given| given as usize,
        )
    }
}

/// The exit codes, for `--help` (and `docs/operations.md`).
const EXIT_CODES: &str = "Exit codes:
  0  stopped cleanly (SIGINT, SIGTERM, or an authenticated Shutdown from `rdkv-cluster down`)
  1  could not start or failed while running (the one-line error names the cause and the fix)
  2  invalid command line";

/// The log level when `RUST_LOG` says none. openraft logs every failed heartbeat to a dead peer
/// (1-2 KB/s while a node is down); the view's own lines say what matters
/// (`RUST_LOG=info,openraft=warn` shows them).
const DEFAULT_LOG_LEVEL: &str = "info,openraft=off";

fn main() -> std::process::ExitCode {
    let arguments = Arguments::parse();
    let _logging = match &arguments.log_file {
        None => rdkv_common::process::init_logging(DEFAULT_LOG_LEVEL),
        Some(path) => {
            match rdkv_server::log_file::RotatingLog::open(
                path,
                arguments.log_rotate_size,
                arguments.log_kept_files,
                true,
            ) {
                Ok(log) => rdkv_common::process::init_logging_to(DEFAULT_LOG_LEVEL, log, false),
                Err(error) => {
                    return rdkv_common::process::exit_with(Err(error.into()), "rdkv-server")
                }
            }
        }
    };
    if arguments.max_unauthenticated() >= arguments.max_connections as usize {
        // A command-line mistake: clap's error and exit code 2, like any other.
        Arguments::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                format!(
                    "--max-unauthenticated-connections ({}) must be below --max-connections ({}): the unauthenticated budget is the smaller one",
                    arguments.max_unauthenticated(),
                    arguments.max_connections
                ),
            )
            .exit();
    }
    let outcome = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")
        .and_then(|runtime| {
            let outcome = runtime.block_on(serve(&arguments));
            // Whatever a blocking task still does (a collector pass), the process exits.
            runtime.shutdown_timeout(Duration::from_secs(1));
            outcome
        });
    rdkv_common::process::exit_with(outcome, "rdkv-server")
}

/// Raises the open-files soft limit to the hard limit: every client connection holds a
/// control and a fabric socket, and the common soft default (1,024) is below what
/// `max_connections` allows. (Past the limit, accepts back off rather than spin.)
fn raise_open_files_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                Ok(()) => tracing::debug!(from = soft, to = hard, "raised the open-files limit"),
                Err(error) => {
                    tracing::warn!(%error, soft, hard, "could not raise the open-files limit")
                }
            }
        }
    }
}

async fn serve(arguments: &Arguments) -> anyhow::Result<()> {
    raise_open_files_limit();
    let config = match (&arguments.config, arguments.node) {
        (Some(path), Some(node)) => config_from_file(arguments, path, node)?,
        _ => config_from_flags(arguments)?,
    };
    let config = ServerConfig {
        start_from: arguments.from_snapshot,
        ..config
    };
    let node_id = config.node_id;
    let shutdown = CancellationToken::new();
    let signals = shutdown.clone();
    // Until the node is ready, a signal ends the process at once: no client holds anything
    // yet, and pinning a large table takes seconds (it is pinned in pieces, so this task
    // runs meanwhile).
    let starting = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let still_starting = starting.clone();
    tokio::spawn(async move {
        rdkv_common::process::shutdown_signal().await;
        if still_starting.load(std::sync::atomic::Ordering::Acquire) {
            tracing::info!("signal during start-up: exiting before serving anyone");
            rdkv_common::process::exit_now(0);
        }
        signals.cancel();
    });
    rdkv_server::run(config, shutdown, |server| {
        starting.store(false, std::sync::atomic::Ordering::Release);
        // One machine-readable line on stdout: launchers and tests wait for it.
        println!(
            "rdkv-server ready node={} control={} fabric={} metrics={}",
            node_id,
            server.control_address(),
            server
                .fabric_address()
                .map_or_else(|| "-".to_string(), |address| address.to_string()),
            server
                .metrics_address()
                .map_or_else(|| "-".to_string(), |address| address.to_string())
        );
    })
    .await
    .context("run rdkv-server")?;
    Ok(())
}

/// The configuration of node `node` of the cluster file at `path`, with the command line's
/// replacements (secret file, view state, data directory, shm socket).
fn config_from_file(
    arguments: &Arguments,
    path: &std::path::Path,
    node: u32,
) -> anyhow::Result<ServerConfig> {
    let secret = arguments
        .secret_file
        .as_deref()
        .map(read_secret_file)
        .transpose()?;
    let cluster = rdkv_cluster_file::config::load_to_start(path, secret, Some(node))?;
    for warning in &cluster.warnings {
        tracing::warn!("{warning}");
    }
    let mut config = ServerConfig::from_cluster(&cluster, node)?;
    config.view_state_file = arguments.view_state.clone();
    config.joining = arguments.join;
    config.cluster_file = Some(path.to_path_buf());
    if let Some(data_dir) = &arguments.data_dir {
        config.data_dir = Some(data_dir.clone());
    }
    if config.shm_socket.is_some() {
        // The file offers shm (not "off"): the command line says where.
        if let Some(socket) = &arguments.shm_socket {
            config.shm_socket = Some(socket.clone());
        }
    }
    // The default socket's directory is this user's alone: nobody else can squat the path.
    let private = rdkv_cluster_file::config::private_socket_directory();
    if let Some(socket) = &config.shm_socket {
        if socket.parent() == Some(private.as_path()) {
            rdkv_server::config::prepare_private_directory(&private)?;
        }
    }
    Ok(config)
}

fn parse_fabric(text: &str) -> Result<Backend, String> {
    let backend: Backend = text.parse().map_err(|error| format!("{error}"))?;
    if !backend.crosses_processes() {
        return Err(format!(
            "fabric `{backend}` works only inside one process: a node needs soft or verbs"
        ));
    }
    Ok(backend)
}

fn read_secret_file(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    let secret = std::fs::read(path)
        .with_context(|| format!("read the secret file {}", path.display()))?
        .trim_ascii()
        .to_vec();
    check_secret_length(&secret, &format!("the secret file {}", path.display()))?;
    Ok(secret)
}

/// Refuses a secret shorter than the cluster file's rule allows, naming how to make one.
fn check_secret_length(secret: &[u8], source: &str) -> anyhow::Result<()> {
    let minimum = rdkv_cluster_file::config::MIN_SECRET_LENGTH;
    anyhow::ensure!(
        secret.len() >= minimum,
        "{source} holds {} bytes, fewer than {minimum}: make a secret with `head -c 32 /dev/urandom | base64 > secret && chmod 600 secret` and pass `--secret-file secret`",
        secret.len()
    );
    Ok(())
}

fn config_from_flags(arguments: &Arguments) -> anyhow::Result<ServerConfig> {
    let secret = match &arguments.secret_file {
        Some(path) => read_secret_file(path)?,
        None => {
            let secret = std::env::var("RDKV_SECRET")
                .context("no secret: pass --secret-file FILE or set RDKV_SECRET (or use --config FILE --node ID)")?
                .into_bytes();
            check_secret_length(&secret, "RDKV_SECRET")?;
            secret
        }
    };
    let fabric_address = match arguments.fabric_listen {
        Some(address) => address,
        None => rdkv_server::config::fabric_address_beside(arguments.listen)?,
    };
    Ok(ServerConfig {
        node_id: arguments.node_id,
        control_address: arguments.listen,
        fabric: arguments.fabric,
        fabric_address,
        verbs: VerbsOptions {
            device: arguments.rdma_device.clone(),
            port: arguments.rdma_port,
            gid_index: arguments.gid_index,
        },
        shm_socket: arguments.shm_socket.clone(),
        poll_spin: Duration::from_micros(arguments.poll_spin_us),
        index_size: arguments.index_size,
        heap_size: arguments.heap_size,
        chunk_size: arguments.chunk_size,
        hugepages: arguments.hugepages,
        max_pinned_share: arguments.max_pinned_share,
        secret,
        lease_timeout: Duration::from_millis(arguments.lease_timeout_ms),
        operation_deadline: Duration::from_millis(arguments.deadline_ms),
        max_connections: arguments.max_connections as usize,
        limits: rdkv_cluster_file::config::ConnectionLimits {
            max_connections: arguments.max_connections as usize,
            max_unauthenticated: arguments.max_unauthenticated(),
            max_pending_per_address: (arguments.max_pending_per_address as usize)
                .min(arguments.max_unauthenticated()),
            fabric_engine_threads: arguments.fabric_engine_threads as usize,
            ..rdkv_cluster_file::config::ConnectionLimits::default()
        },
        hash_seed: None,
        collector_interval: rdkv_server::config::DEFAULT_COLLECTOR_INTERVAL,
        metrics_address: arguments.metrics_listen,
        metrics_limits: rdkv_server::config::MetricsLimits::default(),
        teardown_stall: Duration::ZERO,
        // A node started from flags is a cluster of one.
        members: Vec::new(),
        failure_timeout: rdkv_server::config::DEFAULT_FAILURE_TIMEOUT,
        view_state_file: None,
        data_dir: arguments.data_dir.clone(),
        snapshot_interval: Duration::from_secs(arguments.snapshot_interval_s),
        start_from: arguments.from_snapshot,
        joining: false,
        cluster_file: None,
        cluster: None,
    })
}
