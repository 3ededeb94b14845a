//! Starting, running and stopping a server: the table is registered before the control listener
//! accepts anyone; the accept loop caps connections with a semaphore; a collector task reclaims
//! heap chunks; shutdown cancels everything and waits for every connection's teardown.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use rand::RngCore;
use rdkv_common::protocol::ServerStats;
use rdkv_fabric::memory::PinLimits;
use rdkv_fabric::{Backend, Device, DeviceConfig};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::announce::Announcements;
use crate::collector_pace::Pace;
use crate::compactor::Compactor;
use crate::config::ServerConfig;
use crate::error::{Error, Result};
use crate::heap::Heap;
use crate::log_budget::LogBudget;
use crate::metrics;
use crate::node::{Attachment, Node, MAIN_ATTACHMENT, SEND_QUEUE_DEPTH};
use crate::pending::{PendingHandshakes, ACCEPT_BACKOFF, ACCEPT_WARNING_EVERY};
use crate::session;
use crate::snapshot::SnapshotState;
use crate::stats::Counters;
use crate::sweep::Sweep;
use crate::table::TableRegion;

/// A started server. Dropping it cancels it; [`RunningServer::shutdown`] also waits for every
/// connection's teardown and then deregisters the table.
#[derive(Debug)]
pub struct RunningServer {
    /// Where the control plane listens.
    control_address: SocketAddr,
    /// Where the soft NIC listens.
    fabric_address: Option<SocketAddr>,
    /// Where metrics are served.
    metrics_address: Option<SocketAddr>,
    /// Cancels every task.
    shutdown: CancellationToken,
    /// Tracks every task, so shutdown can wait for them.
    tasks: TaskTracker,
    /// The node's state, which its connections and tasks share.
    node: Arc<Node>,
}

impl RunningServer {
    /// The bound control address.
    pub fn control_address(&self) -> SocketAddr {
        self.control_address
    }

    /// The soft NIC's bound address (none for loopback).
    pub fn fabric_address(&self) -> Option<SocketAddr> {
        self.fabric_address
    }

    /// The bound metrics address, if metrics are served.
    pub fn metrics_address(&self) -> Option<SocketAddr> {
        self.metrics_address
    }

    /// Whether the node offers an `shm` fabric next to its main one.
    pub fn offers_shm(&self) -> bool {
        self.node.same_host_attachment().is_some()
    }

    /// The node's `shm` socket, when it offers one next to its main fabric.
    pub fn shm_socket(&self) -> Option<std::path::PathBuf> {
        self.node.same_host_socket()
    }

    /// The counters now.
    pub fn stats(&self) -> ServerStats {
        // Tests call this: an index scan on the caller's thread gives the exact key count.
        self.node.stats(self.node.table().count_keys())
    }

    /// A token that stops the server when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Stops accepting, tears every connection down in order, waits for it, then releases the
    /// table (deregistered and unpinned when the last reference goes).
    ///
    /// The wait is bounded by [`SHUTDOWN_BOUND`]. Past one second it logs, once a second, what
    /// it still waits for: each connection and its step (a drain on verbs is bounded by the
    /// device's `retry_timeout` plus a second). Past the bound it logs what is left and
    /// returns; the process then exits and the kernel releases what remains.
    pub async fn shutdown(self) {
        // A snapshot on a schedule or on request gives way to the final one.
        self.node.snapshots.stop_writing();
        self.shutdown.cancel();
        self.tasks.close();
        let node = self.node.config.node_id;
        let started = Instant::now();
        while tokio::time::timeout(SHUTDOWN_REPORT_EVERY, self.tasks.wait())
            .await
            .is_err()
        {
            let waiting = self.node.gate.describe();
            if started.elapsed() >= SHUTDOWN_BOUND {
                tracing::error!(
                    node,
                    waited = ?SHUTDOWN_BOUND,
                    still = %waiting.join("; "),
                    "shutdown bound reached: stopping without these"
                );
                // The best copy there is, though a write of those connections may miss it (it
                // names no stop: a node started from it refills).
                crate::persistence::final_snapshot(&self.node, false).await;
                return;
            }
            tracing::warn!(
                node,
                waited = ?started.elapsed(),
                waiting_for = %waiting.join("; "),
                "shutdown still waiting"
            );
        }
        // Every connection is torn down: no client can write, so every write the node
        // acknowledged is in the table, and goes into the final snapshot.
        crate::persistence::final_snapshot(&self.node, true).await;
        tracing::info!(node, "server stopped");
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// How long a shutdown waits for teardowns before it gives up on them.
pub const SHUTDOWN_BOUND: std::time::Duration = std::time::Duration::from_secs(10);
/// How often a slow shutdown says what it waits for.
const SHUTDOWN_REPORT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Registers the table, binds the listeners and starts serving.
///
/// # Errors
/// [`Error::Config`] for invalid settings; the fabric's errors (memlock, hugepages, RAM share,
/// listener); [`Error::BindControl`].
pub async fn start(config: ServerConfig) -> Result<RunningServer> {
    let hash_seed = config
        .hash_seed
        .unwrap_or_else(|| rand::thread_rng().next_u64());
    let geometry = config.geometry(hash_seed)?;
    let (main_device, other_devices) = open_devices(&config)?;
    // The table and the announce words are memory files when a device offers them to
    // processes of this host, and are then registered on every device.
    let shareable = std::iter::once(&main_device)
        .chain(&other_devices)
        .any(|device| device.capabilities().shares_memory);
    let table = TableRegion::allocate(
        &main_device,
        geometry,
        config.hugepages,
        PinLimits {
            max_pinned_share: config.max_pinned_share,
        },
        shareable,
    )?;
    let heap = Heap::new(&geometry, config.operation_deadline.mul_f64(1.25));
    // Before the view starts (a node that resumes from a stop must hold what it says it does)
    // and before any client: the snapshot is checked whole, then loaded; a damaged one, or one
    // the table cannot hold, stops the start.
    let loaded = crate::persistence::start_from_snapshot(&config, &table, &heap)?;
    let listener = TcpListener::bind(config.control_address)
        .await
        .map_err(|source| Error::BindControl {
            address: config.control_address,
            source,
        })?;
    let control_address = listener.local_addr().map_err(|source| Error::BindControl {
        address: config.control_address,
        source,
    })?;
    // A data connection each: clients' (max_connections) and refilling peers' (their reserve).
    let data_connections = config.max_connections + crate::pending::PEER_RESERVE;
    let announcements = Announcements::allocate(&table.domain, data_connections, shareable)?;
    // Room for every connection's send queue: on a NIC, a CQ overrun breaks them all.
    let completion_queue_size = (data_connections * SEND_QUEUE_DEPTH as usize).max(1024);
    let attachments = attach(table, &other_devices, &announcements, completion_queue_size)?;
    let shutdown = CancellationToken::new();
    let tasks = TaskTracker::new();
    let view = crate::view::ViewService::start(
        view_settings(
            &config,
            loaded.as_ref().and_then(|loaded| loaded.meta.stopped_at),
        ),
        &tasks,
        shutdown.clone(),
    )
    .await?;
    let node = Arc::new(Node {
        heap,
        announcements,
        attachments,
        counters: Counters::new(),
        compactor: Compactor::default(),
        collector: Pace::new(config.collector_interval),
        sweep: Sweep::default(),
        next_connection: AtomicU64::new(1),
        gate: Arc::default(),
        pending: PendingHandshakes::new(config.limits, config.max_connections),
        unauthenticated_ends: LogBudget::new(std::time::Duration::from_secs(1)),
        connection_summary: crate::connection_summary::ConnectionSummary::default(),
        view,
        snapshots: SnapshotState::new(config.data_dir.clone(), config.snapshot_interval),
        config,
    });
    if let Some(loaded) = loaded {
        let replicas = node
            .config
            .cluster
            .as_ref()
            .map_or(1, |cluster| cluster.replicas);
        node.snapshots
            .record_loaded(loaded.keys, loaded.meta, replicas);
    }
    spawn_tasks(&node, listener, &tasks, &shutdown);
    let metrics_address = serve_metrics(&node, &tasks, &shutdown).await?;
    let fabric_address = main_device.listen_address();
    tracing::info!(
        node = node.config.node_id,
        control = %control_address,
        fabric = ?fabric_address,
        shm_socket = ?node.same_host_socket(),
        "server ready"
    );
    Ok(RunningServer {
        control_address,
        metrics_address,
        fabric_address,
        shutdown,
        tasks,
        node,
    })
}

/// The node's tasks: accepting clients, collecting the heap, refilling, snapshots, the
/// connections' summary line.
fn spawn_tasks(
    node: &Arc<Node>,
    listener: TcpListener,
    tasks: &TaskTracker,
    shutdown: &CancellationToken,
) {
    // Every list a client posts ends with a READ of this word (`rdkv_common::lease`).
    node.view.set_lease_sink(node.announcements.lease_sink());
    tasks.spawn(accept_loop(
        listener,
        node.clone(),
        shutdown.clone(),
        tasks.clone(),
    ));
    tasks.spawn(crate::collector::collect_loop(
        node.clone(),
        shutdown.clone(),
    ));
    tasks.spawn(crate::refill::refill_loop(node.clone(), shutdown.clone()));
    tasks.spawn(crate::rereplication::rereplication_loop(
        node.clone(),
        shutdown.clone(),
    ));
    tasks.spawn(crate::handover::handover_loop(
        node.clone(),
        shutdown.clone(),
    ));
    tasks.spawn(crate::persistence::snapshot_loop(
        node.clone(),
        shutdown.clone(),
    ));
    tasks.spawn(crate::connection_summary::summary_loop(
        node.clone(),
        shutdown.clone(),
    ));
}

/// The node's devices: its main fabric's (the cluster's), and the others it serves on. A node
/// given an `shm` socket offers its memory to clients of its host there: on its main device if
/// that is `shm`, else on an `shm` device beside it.
fn open_devices(config: &ServerConfig) -> Result<(Device, Vec<Device>)> {
    let device_config = DeviceConfig {
        poll_spin: config.poll_spin,
        engine_threads: config.limits.fabric_engine_threads,
        hello_deadline: config.limits.fabric_hello_deadline,
        max_pending_hellos: config.limits.fabric_max_pending_hellos,
        response_buffer: config.limits.fabric_response_buffer,
        ..DeviceConfig::default()
    };
    let main = match (&config.shm_socket, config.fabric) {
        // A node whose main fabric is shm offers it on its socket.
        (Some(socket), Backend::Shm) => Device::shm(Some(socket.clone()), device_config)?,
        _ => Device::open(
            config.fabric,
            Some(config.fabric_address),
            &config.verbs,
            device_config,
        )?,
    };
    let mut others = Vec::new();
    if let Some(socket) = &config.shm_socket {
        if !main.capabilities().shares_memory {
            others.push(Device::shm(
                Some(socket.clone()),
                DeviceConfig {
                    hello_deadline: config.limits.fabric_hello_deadline,
                    ..DeviceConfig::default()
                },
            )?);
        }
    }
    Ok((main, others))
}

/// The node's attachments: the table's own device first, then `others`, on each of which the
/// table and the announce words are registered too.
fn attach(
    table: TableRegion,
    others: &[Device],
    announcements: &Announcements,
    completion_queue_size: usize,
) -> Result<Vec<Attachment>> {
    let main = Attachment::main(table, announcements, completion_queue_size)?;
    let mut attachments = Vec::with_capacity(1 + others.len());
    for device in others {
        attachments.push(Attachment::also_on(
            device,
            &main,
            announcements,
            completion_queue_size,
        )?);
    }
    attachments.insert(MAIN_ATTACHMENT, main);
    Ok(attachments)
}

/// Serves the metrics when the configuration names an address; returns the bound address.
///
/// # Errors
/// [`Error::BindMetrics`].
async fn serve_metrics(
    node: &Arc<Node>,
    tasks: &TaskTracker,
    shutdown: &CancellationToken,
) -> Result<Option<SocketAddr>> {
    let Some(address) = node.config.metrics_address else {
        return Ok(None);
    };
    let listener = metrics::bind(address)
        .await
        .map_err(|source| Error::BindMetrics { address, source })?;
    let bound = listener.local_addr().ok();
    let gauges = Arc::new(metrics::Metrics::new(node.config.node_id));
    let state = node.clone();
    tasks.spawn(metrics::serve(
        listener,
        gauges,
        move || {
            // Metrics are unauthenticated: no index scan per scrape, the collector's count (at
            // most one collector interval old).
            state.stats(state.counters.collector_keys.load(Ordering::Relaxed))
        },
        node.config.metrics_limits,
        shutdown.clone(),
    ));
    Ok(bound)
}

/// Starts a server and runs it until `shutdown` is cancelled, then stops it in order.
///
/// # Errors
/// As [`start`].
pub async fn run(
    config: ServerConfig,
    shutdown: CancellationToken,
    ready: impl FnOnce(&RunningServer),
) -> Result<()> {
    let server = start(config).await?;
    let requested = server.shutdown_token();
    if !shutdown.is_cancelled() {
        ready(&server);
    }
    // A signal (`shutdown`) or an authenticated `Shutdown` over the control plane
    // (`requested`).
    let signalled = tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = requested.cancelled() => false,
    };
    if signalled {
        // A signal (SIGTERM, `systemctl stop`): out of the view first, so the node's keys move
        // at once (`view/leave.rs`); a `Shutdown` frame did this before it cancelled.
        server.node.view.leave().await;
    }
    let node = server.node.clone();
    server.shutdown().await;
    // A final snapshot that failed (a full disk) is the process's failure: `rdkv-server`
    // exits 1 with the reason, and the node's previous snapshot is what a start loads.
    match node.snapshots.last_failure() {
        Some(reason) => Err(Error::Snapshot {
            path: node.snapshots.data_dir.clone().unwrap_or_default(),
            reason: format!("the final snapshot failed, the previous one is kept: {reason}"),
        }),
        None => Ok(()),
    }
}

async fn accept_loop(
    listener: TcpListener,
    node: Arc<Node>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
) {
    // Authenticated slots and the unauthenticated budget are counted apart (`crate::pending`);
    // this bounds the sockets of both, with one to spare so a new connection can evict.
    let limit = Arc::new(Semaphore::new(node.pending.accept_limit()));
    let mut last_accept_warning = None;
    loop {
        let permit = tokio::select! {
            _ = shutdown.cancelled() => return,
            permit = limit.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
        };
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let node = node.clone();
                let shutdown = shutdown.clone();
                tasks.spawn(async move {
                    session::serve(node, stream, peer, shutdown).await;
                    drop(permit);
                });
            }
            Err(error) => {
                // Out of file descriptors (EMFILE) or memory: retrying at once would spin and
                // flood the log. Back off, and say so at most once a second.
                if last_accept_warning
                    .is_none_or(|warned: Instant| warned.elapsed() >= ACCEPT_WARNING_EVERY)
                {
                    last_accept_warning = Some(Instant::now());
                    tracing::warn!(%error, "accept failed: backing off");
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                }
            }
        }
    }
}

/// The view service's settings from the node's configuration; `resume_from`: the stop whose
/// snapshot the node loaded.
fn view_settings(config: &ServerConfig, resume_from: Option<u64>) -> crate::view::ViewSettings {
    let cluster = config.cluster.as_ref();
    crate::view::ViewSettings {
        node_id: config.node_id,
        members: config.members.clone(),
        secret: config.secret.clone(),
        failure_timeout: config.failure_timeout,
        state_file: config.view_state_file.clone(),
        resume_from,
        replicas: cluster.map_or(1, |cluster| cluster.replicas),
        replace_after: cluster.and_then(|cluster| cluster.replace_after),
        joining: config.joining,
    }
}
