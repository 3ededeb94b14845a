//! `rdkv-ycsb compare`: rdkv and Redis side by side in one run, on this machine.
//!
//! It starts a local rdkv cluster (a generated cluster file on reserved loopback ports, through the
//! same launcher as `rdkv-cluster`) and `redis-server` (loopback TCP and a Unix socket,
//! persistence off), loads the same records into each store, runs the chosen workloads against
//! each in turn at equal concurrency, prints one table with the ratios, and stops what it
//! started. The stores (`--stores`, all by default): rdkv over its `shm` fabric (this process is
//! on the nodes' host), rdkv over `soft`, Redis over TCP, Redis over its Unix socket (the same
//! multiplexed client), and the `memory` ceiling (an in-process rdkv server on `loopback`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use rdkv_common::ports::ReservedPorts;
use serde::Serialize;

use crate::driver::Driver;
use crate::exit::OperationsFailed;
use crate::measurement::{OperationKind, Report};
use crate::properties::{Properties, Workload};
use crate::runner::{self, RunOptions};
use crate::workloads;

/// Knobs of a comparison.
#[derive(Debug, Clone)]
pub struct CompareOptions {
    /// Records loaded into each store.
    pub records: u64,
    /// Seconds each workload runs per store.
    pub seconds: f64,
    /// Concurrent tasks per store.
    pub threads: usize,
    /// rdkv nodes.
    pub nodes: u32,
    /// Copies of each key (the cluster file's `replicas`; 1 to 3, at most `nodes`).
    pub replicas: usize,
    /// Workloads, by letter.
    pub workloads: Vec<String>,
    /// The `redis-server` program.
    pub redis_server: PathBuf,
    /// Show progress.
    pub progress: bool,
    /// Each node's heap, in bytes; `None` sizes it by the rule (`docs/operations.md`).
    pub heap_size: Option<u64>,
    /// The stores, in the order they run.
    pub stores: Vec<Store>,
}

/// A store of the comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Store {
    /// rdkv over the nodes' `shm` fabric.
    RdkvShm,
    /// rdkv over `soft` (loopback TCP).
    RdkvSoft,
    /// Redis over loopback TCP.
    RedisTcp,
    /// Redis over its Unix socket.
    RedisUnix,
    /// An in-process rdkv server on the `loopback` fabric: the ceiling.
    Memory,
}

impl Store {
    /// Every store, in the default order.
    pub const ALL: [Store; 5] = [
        Store::RdkvShm,
        Store::RdkvSoft,
        Store::RedisTcp,
        Store::RedisUnix,
        Store::Memory,
    ];

    /// The name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Store::RdkvShm => "rdkv shm",
            Store::RdkvSoft => "rdkv soft",
            Store::RedisTcp => "Redis TCP",
            Store::RedisUnix => "Redis unix",
            Store::Memory => "memory (ceiling)",
        }
    }

    fn is_redis(self) -> bool {
        matches!(self, Store::RedisTcp | Store::RedisUnix)
    }
}

/// One workload's reports. `rdkv` and `redis` keep the names of the two-store comparison
/// (rdkv over `soft`, Redis over TCP), so scripts that read them (`before-after.sh`) go on
/// working.
#[derive(Debug, Clone, Serialize)]
pub struct ComparisonRow {
    /// The workload letter.
    pub workload: String,
    /// rdkv over `soft`.
    pub rdkv: Option<Report>,
    /// Redis over TCP.
    pub redis: Option<Report>,
    /// rdkv over `shm`.
    pub rdkv_shm: Option<Report>,
    /// Redis over its Unix socket.
    pub redis_unix: Option<Report>,
    /// The in-process ceiling.
    pub memory: Option<Report>,
    /// Bytes of each record's value.
    pub record_size: usize,
}

impl ComparisonRow {
    fn new(workload: String, record_size: usize) -> Self {
        Self {
            workload,
            rdkv: None,
            redis: None,
            rdkv_shm: None,
            redis_unix: None,
            memory: None,
            record_size,
        }
    }

    /// The report of `store`.
    pub fn report(&self, store: Store) -> Option<&Report> {
        match store {
            Store::RdkvShm => self.rdkv_shm.as_ref(),
            Store::RdkvSoft => self.rdkv.as_ref(),
            Store::RedisTcp => self.redis.as_ref(),
            Store::RedisUnix => self.redis_unix.as_ref(),
            Store::Memory => self.memory.as_ref(),
        }
    }

    fn slot(&mut self, store: Store) -> &mut Option<Report> {
        match store {
            Store::RdkvShm => &mut self.rdkv_shm,
            Store::RdkvSoft => &mut self.rdkv,
            Store::RedisTcp => &mut self.redis,
            Store::RedisUnix => &mut self.redis_unix,
            Store::Memory => &mut self.memory,
        }
    }

    /// The better Redis throughput (TCP or Unix socket), if either ran.
    pub fn best_redis(&self) -> Option<f64> {
        [Store::RedisTcp, Store::RedisUnix]
            .into_iter()
            .filter_map(|store| self.report(store))
            .map(|report| report.throughput)
            .reduce(f64::max)
    }

    /// Every report that ran.
    pub fn reports(&self) -> impl Iterator<Item = &Report> {
        Store::ALL
            .into_iter()
            .filter_map(|store| self.report(store))
    }
}

/// Stops a child on drop, then releases the ports reserved for it.
struct ChildGuard {
    /// The child.
    child: Child,
    /// Its ports (`rdkv_common::ports`): held until it is stopped, as fields drop after `drop`.
    _ports: ReservedPorts,
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Stops the started nodes on drop.
struct ClusterGuard {
    nodes: Vec<rdkv_cluster_config::launcher::StartedNode>,
    run_directory: PathBuf,
}

/// A directory removed when dropped.
struct RemovedOnDrop(PathBuf);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Drop for ClusterGuard {
    fn drop(&mut self) {
        for node in self.nodes.iter_mut().rev() {
            rdkv_cluster_config::launcher::stop_child(node, &self.run_directory);
        }
        // Only this cluster's run directory: the cluster file next to it serves the next
        // store's cluster (the comparison's directory goes with `RemovedOnDrop`).
        let _ = std::fs::remove_dir_all(&self.run_directory);
    }
}

/// Each node's chunk size.
const CHUNK_SIZE: u64 = 1 << 20;

/// Records the workloads may insert during their runs (D inserts 5% of its operations), at the
/// highest rate one store reaches here: the heap must hold them too, or the faster store's
/// inserts fill it and a later workload fails where a slower store's would not.
pub fn inserted_records(options: &CompareOptions) -> u64 {
    options
        .workloads
        .iter()
        .filter_map(|letter| workload(letter, options).ok())
        .map(|workload| {
            (workload.proportions.insert * options.seconds * ASSUMED_OPERATIONS_PER_SECOND as f64)
                .ceil() as u64
        })
        .sum()
}

/// The highest rate, in operations per second, one store is assumed to reach (rdkv over `shm`
/// and Redis reach about 250,000 on this 2-core machine).
const ASSUMED_OPERATIONS_PER_SECOND: u64 = 300_000;

/// Each node's heap: `--heap-size`, or the sizing rule for its share of the records and of
/// those the workloads may insert.
pub fn node_heap_size(options: &CompareOptions, record_size: usize) -> u64 {
    // YCSB keys ("user" and up to 20 digits) and values.
    let block = rdkv_cluster_file::sizing::block_size(24, record_size as u64);
    // Each node holds its share of every copy.
    let per_node = ((options.records + inserted_records(options)) * options.replicas.max(1) as u64)
        .div_ceil(u64::from(options.nodes.max(1)));
    options.heap_size.unwrap_or_else(|| {
        rdkv_cluster_file::sizing::heap_size(&rdkv_cluster_file::sizing::HeapDemand {
            live_bytes: per_node * block,
            // One client process: one connection per node.
            writers: 1,
            chunk_size: CHUNK_SIZE,
            // Above what one node of this machine sustains (about 60k updates/s in YCSB-A).
            write_bytes_per_second: (ASSUMED_WRITES_PER_SECOND * block) as f64,
        })
    })
}
/// The peak write rate per node the heap is sized for, when not given.
const ASSUMED_WRITES_PER_SECOND: u64 = 100_000;

/// Writes the benchmark's cluster file into `directory`; returns its path and the ports it
/// names, reserved: hold them until the last cluster started from the file is stopped.
///
/// The nodes' ports must be in the file before they start (peers and clients read it), so they
/// are bound to port 0 here and held while the nodes bind them alongside (`rdkv_common::ports`):
/// none can be taken by another process before a node binds it, or between one store's
/// cluster and the next one's on the same ports.
fn write_cluster_file(
    directory: &Path,
    options: &CompareOptions,
    record_size: usize,
) -> anyhow::Result<(PathBuf, ReservedPorts)> {
    let per_node = (options.records * options.replicas.max(1) as u64)
        .div_ceil(u64::from(options.nodes.max(1)));
    let heap = node_heap_size(options, record_size);
    let index = (per_node * 64).max(1 << 20).next_power_of_two();
    let mut text = format!(
        "[cluster]\nname = \"ycsb-compare\"\nsecret = \"rdkv-ycsb-compare\"\nfabric = \"soft\"\noperation_deadline = \"2s\"\nreplicas = {}\n",
        options.replicas.max(1)
    );
    let nodes = options.nodes.max(1);
    let reserved = ReservedPorts::loopback(2 * nodes as usize)?;
    for (node, pair) in (1..=nodes).zip(reserved.ports().chunks(2)) {
        text.push_str(&format!(
            "\n[[node]]\nid = {node}\ncontrol_address = \"127.0.0.1:{}\"\nfabric_address = \"127.0.0.1:{}\"\nindex_size = {index}\nheap_size = {heap}\nchunk_size = {CHUNK_SIZE}\n",
            pair[0],
            pair[1]
        ));
    }
    let path = directory.join("cluster.toml");
    std::fs::write(&path, text)?;
    Ok((path, reserved))
}

/// Starts `redis-server` on a reserved loopback port (held by the guard) and on a Unix socket in `directory`; returns
/// its TCP and Unix-socket URLs.
fn start_redis(program: &Path, directory: &Path) -> anyhow::Result<(ChildGuard, String, String)> {
    // Reserved before redis-server binds it, which it does alongside the reservation
    // (`rdkv_common::ports`: redis-server sets SO_REUSEADDR).
    let reserved = ReservedPorts::loopback(1)?;
    let port = reserved.ports()[0];
    let socket = directory.join("redis.sock");
    let mut child = Command::new(program)
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--unixsocketperm",
            "700",
        ])
        .arg("--unixsocket")
        .arg(&socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|error| {
            anyhow::anyhow!(
                "start {}: {error}; install Redis with `apt-get install redis-server`",
                program.display()
            )
        })?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("redis-server has no stdout"))?;
    let guard = ChildGuard {
        child,
        _ports: reserved,
    };
    let (sender, receiver) = std::sync::mpsc::sync_channel(1);
    std::thread::spawn(move || {
        let mut ready = false;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if !ready && line.contains("Ready to accept connections") {
                ready = true;
                let _ = sender.send(());
            }
        }
    });
    receiver
        .recv_timeout(Duration::from_secs(15))
        .map_err(|_| {
            anyhow::anyhow!("redis-server did not report `Ready to accept connections` within 15 s")
        })?;
    Ok((
        guard,
        format!("redis://127.0.0.1:{port}"),
        format!("unix://{}", socket.display()),
    ))
}

fn workload(letter: &str, options: &CompareOptions) -> anyhow::Result<Workload> {
    let name = format!("workload{letter}");
    let text = workloads::builtin(&name)
        .ok_or_else(|| anyhow::anyhow!("unknown workload `{letter}`: use a, b, c, d, e or f"))?;
    let mut properties = Properties::parse(&name, text)?;
    properties.set_override(&format!("recordcount={}", options.records))?;
    properties.set_override(&format!("operationcount={}", u64::MAX / 4))?;
    Ok(Workload::from_properties(&name, &properties)?)
}

/// Runs the comparison and returns one row per workload.
///
/// # Errors
/// Starting a store, a refused workload (E), or a load with errors ([`OperationsFailed`]).
pub async fn compare(options: &CompareOptions) -> anyhow::Result<Vec<ComparisonRow>> {
    let workloads: Vec<Workload> = options
        .workloads
        .iter()
        .map(|letter| workload(letter, options))
        .collect::<anyhow::Result<_>>()?;
    let first = workloads
        .first()
        .ok_or_else(|| anyhow::anyhow!("no workloads to compare"))?;
    anyhow::ensure!(!options.stores.is_empty(), "no stores to compare");
    let directory = std::env::temp_dir().join(format!("rdkv-ycsb-compare-{}", std::process::id()));
    std::fs::create_dir_all(&directory)?;
    // Removed however this function ends (a refused start included); the guards below are
    // dropped first, so the servers stop before their files go.
    let _directory = RemovedOnDrop(directory.clone());
    let wants = |store: Store| options.stores.contains(&store);
    let rdkv_wanted = wants(Store::RdkvShm) || wants(Store::RdkvSoft);
    let redis_wanted = wants(Store::RedisTcp) || wants(Store::RedisUnix);
    eprintln!(
        "starting {} on loopback",
        [
            rdkv_wanted.then(|| format!("rdkv ({} node(s))", options.nodes)),
            redis_wanted.then(|| "redis-server".to_string()),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(" and ")
    );
    // The ports are held until the end (dropped after every cluster guard declared below).
    let (cluster, _cluster_ports) = if rdkv_wanted {
        let (cluster_file, ports) = write_cluster_file(&directory, options, first.record_size())?;
        (
            Some(rdkv_cluster_config::config::load_to_start(
                &cluster_file,
                None,
                None,
            )?),
            Some(ports),
        )
    } else {
        (None, None)
    };
    let redis = if redis_wanted {
        Some(start_redis(&options.redis_server, &directory)?)
    } else {
        None
    };
    let redis_pids: Vec<u32> = redis.iter().map(|(guard, ..)| guard.child.id()).collect();
    // Each rdkv store gets a fresh cluster (started when its turn comes): the heap a store left
    // behind (a write-heavy run's dead blocks) must not slow the next one.
    let mut cluster_guard: Option<ClusterGuard> = None;
    let mut rdkv_pids: Vec<u32>;
    let run_options = RunOptions {
        threads: options.threads,
        target: None,
        max_execution_time: Some(Duration::from_secs_f64(options.seconds)),
        progress: options.progress,
    };
    let load_options = RunOptions {
        max_execution_time: None,
        ..run_options
    };
    let mut rows: Vec<ComparisonRow> = options
        .workloads
        .iter()
        .map(|letter| ComparisonRow::new(letter.to_uppercase(), first.record_size()))
        .collect();
    for &store in &options.stores {
        let (driver, pids): (Arc<Driver>, &[u32]) = match store {
            Store::RdkvShm | Store::RdkvSoft => {
                let Some(cluster) = &cluster else {
                    continue;
                };
                // Stop the previous rdkv store's nodes before starting fresh ones.
                drop(cluster_guard.take());
                let run_directory =
                    directory.join(format!("run-{}", store.name().replace(' ', "-")));
                let guard = ClusterGuard {
                    nodes: rdkv_cluster_config::launcher::start(cluster, &run_directory, true)?,
                    run_directory,
                };
                let not_serving = rdkv_cluster_config::status::wait_serving(
                    cluster,
                    &cluster.nodes.iter().map(|node| node.id).collect::<Vec<_>>(),
                    rdkv_cluster_config::status::SERVING_TIMEOUT,
                )
                .await;
                if let Some((id, reason)) = not_serving.first() {
                    anyhow::bail!(
                        "node {id} of the benchmark's cluster does not serve data: {reason}"
                    );
                }
                // The server processes whose CPU each run is charged with.
                rdkv_pids = guard
                    .nodes
                    .iter()
                    .filter_map(|node| node.child.as_ref().map(Child::id))
                    .collect();
                cluster_guard = Some(guard);
                let shared_memory = if store == Store::RdkvShm {
                    rdkv_client::SharedMemory::Require
                } else {
                    rdkv_client::SharedMemory::Off
                };
                let client =
                    rdkv_client::Client::for_cluster_with(cluster, options.threads, shared_memory);
                let driver = Arc::new(Driver::Rdkv {
                    client: Arc::new(client),
                    _server: None,
                    name: store.name(),
                });
                (driver, &rdkv_pids)
            }
            Store::RedisTcp | Store::RedisUnix => {
                let Some((_, tcp, unix)) = &redis else {
                    continue;
                };
                let url = if store == Store::RedisTcp { tcp } else { unix };
                (Arc::new(Driver::redis(url).await?), &redis_pids)
            }
            Store::Memory => {
                // Sized, as the nodes, for the records and the inserts the workloads may make.
                let driver = Driver::memory(
                    options.records + inserted_records(options),
                    first.record_size(),
                    options.threads,
                )
                .await?;
                // In-process: its server's CPU is the client's.
                (Arc::new(driver), &[])
            }
        };
        let load = match store {
            Store::RdkvShm | Store::RdkvSoft => true,
            // Both Redis stores are one server: TCP loads, Unix reads the same records.
            Store::RedisUnix => !wants(Store::RedisTcp),
            Store::RedisTcp | Store::Memory => true,
        };
        let name = store.name();
        if load {
            eprintln!(
                "{name}: loading {} records of {} bytes",
                first.record_count,
                first.record_size()
            );
            let loaded = runner::load(first, driver.clone(), load_options).await?;
            // Missing records would make the comparison unfair: stop, whatever
            // --allow-errors says.
            if let Some(failed) =
                OperationsFailed::from_reports(&format!("{name} load"), &[&loaded])
            {
                return Err(failed.into());
            }
        }
        for (workload, row) in workloads.iter().zip(rows.iter_mut()) {
            eprintln!(
                "{name}: running {} for {} s with {} tasks",
                workload.name, options.seconds, options.threads
            );
            let servers_before = servers_cpu_time(pids);
            let mut report = runner::run(workload, driver.clone(), run_options).await?;
            report.server_cpu_us_per_operation = servers_before
                .zip(servers_cpu_time(pids))
                .filter(|_| report.operations > 0 && !pids.is_empty())
                .map(|(before, after)| {
                    (after - before).as_secs_f64() * 1e6 / report.operations as f64
                });
            *row.slot(store) = Some(report);
        }
        driver.close().await;
    }
    drop(redis);
    drop(cluster_guard);
    Ok(rows)
}

/// The CPU time the processes `pids` used so far, together; `None` if one cannot be read.
fn servers_cpu_time(pids: &[u32]) -> Option<Duration> {
    pids.iter()
        .map(|pid| rdkv_common::process::cpu_time(Some(*pid)))
        .sum()
}

/// Operations that did not return OK or NOT_FOUND.
pub fn errors(report: &Report) -> u64 {
    report.errors()
}

fn read_percentiles(report: &Report) -> (u64, u64) {
    report
        .kind(OperationKind::Read)
        .or_else(|| report.kinds.first())
        .map_or((0, 0), |kind| (kind.p50_us, kind.p99_us))
}

/// The comparison table: one line per workload and store, each against the better Redis.
pub fn table(rows: &[ComparisonRow], options: &CompareOptions) -> String {
    let record_size = rows.first().map_or(0, |row| row.record_size);
    let mut out = format!(
        "{} records of {} bytes, {} tasks per store, {} s per workload; rdkv on {} node(s), {} cop{} of each key ({} heap each; shm: this process is on the nodes' host), Redis with one multiplexed connection\n\n",
        options.records,
        record_size,
        options.threads,
        options.seconds,
        options.nodes,
        options.replicas.max(1),
        if options.replicas > 1 { "ies" } else { "y" },
        rdkv_cluster_file::units::format_bytes(node_heap_size(options, record_size))
    );
    out.push_str("| workload | store | ops/s | vs better Redis | READ p50 µs | READ p99 µs | round trips/op | round trips/READ | client CPU µs/op | server CPU µs/op | server CPU % of a core | errors |\n");
    out.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for row in rows {
        let best_redis = row.best_redis();
        for store in &options.stores {
            let Some(report) = row.report(*store) else {
                continue;
            };
            let (p50, p99) = read_percentiles(report);
            let cpu =
                |value: Option<f64>| value.map_or_else(|| "-".to_string(), |us| format!("{us:.1}"));
            let server_share = report.server_cpu_us_per_operation.map_or_else(
                || "-".to_string(),
                |us| format!("{:.1}", us * report.throughput / 1e6 * 100.0),
            );
            let (round_trips, round_trips_per_read) = match (&report.rdkv, store.is_redis()) {
                (Some(figures), false) => (
                    format!("{:.2}", figures.round_trips_per_operation),
                    format!("{:.2}", figures.round_trips_per_read),
                ),
                _ => ("-".to_string(), "-".to_string()),
            };
            let ratio = best_redis.map_or_else(
                || "-".to_string(),
                |best| format!("{:.2}×", report.throughput / best.max(1e-9)),
            );
            out.push_str(&format!(
                "| {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                row.workload,
                store.name(),
                report.throughput,
                ratio,
                p50,
                p99,
                round_trips,
                round_trips_per_read,
                cpu(report.client_cpu_us_per_operation),
                cpu(report.server_cpu_us_per_operation),
                server_share,
                errors(report),
            ));
        }
    }
    out
}
