//! `rdkv-ycsb compare`: rdkv and Redis side by side in one run, on this machine.
//!
//! It starts a local rdkv cluster (a generated cluster file on reserved loopback ports, through the
//! same launcher as `rdkv-cluster`) and `redis-server` (loopback TCP and a Unix socket,
//! persistence off), loads the same records into each store, runs the chosen workloads against
//! each in turn at equal concurrency, prints one table with the ratios, and stops what it
//! started. With `--rounds N` it does all of that N times over, store after store and then
//! again, so that drift on the machine hits every store alike; [`crate::comparison`] keeps the
//! rounds and sums them up. The stores (`--stores`, all by default): rdkv over its `shm` fabric (this process is
//! on the nodes' host), rdkv over `soft`, Redis over TCP, Redis over its Unix socket (the same
//! multiplexed client), the `memory` ceiling (an in-process rdkv server on `loopback`), and the
//! `map`, an in-process hash map: the harness's own ceiling, which every line is also measured
//! against.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use rdkv_common::ports::ReservedPorts;
use serde::{Deserialize, Serialize};

use crate::comparison::{Comparison, Settings};
use crate::driver::Driver;
use crate::exit::OperationsFailed;
use crate::properties::{Properties, Workload};
use crate::runner::{self, RunOptions};
use crate::workloads;

/// Knobs of a comparison.
#[derive(Debug, Clone)]
pub struct CompareOptions {
    /// Records loaded into each store.
    pub records: u64,
    /// Seconds each workload runs per store and round.
    pub seconds: f64,
    /// Rounds: each runs every store in turn, every workload once per store.
    pub rounds: usize,
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
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
    /// An in-process hash map: the harness's own ceiling.
    Map,
}

impl Store {
    /// Every store, in the default order.
    pub const ALL: [Store; 6] = [
        Store::RdkvShm,
        Store::RdkvSoft,
        Store::RedisTcp,
        Store::RedisUnix,
        Store::Memory,
        Store::Map,
    ];

    /// The name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Store::RdkvShm => "rdkv shm",
            Store::RdkvSoft => "rdkv soft",
            Store::RedisTcp => "Redis TCP",
            Store::RedisUnix => "Redis unix",
            Store::Memory => "memory (ceiling)",
            Store::Map => "map",
        }
    }

    /// The store whose table name is `name`.
    pub fn from_name(name: &str) -> Option<Store> {
        Store::ALL.into_iter().find(|store| store.name() == name)
    }

    /// Whether the store is Redis (TCP or Unix socket): the stores the others are compared to.
    pub fn is_redis(self) -> bool {
        matches!(self, Store::RedisTcp | Store::RedisUnix)
    }
}

/// Stops a child on drop.
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

/// Records the workloads may insert during their runs (D inserts 5% of its operations), each
/// stopping at its [`insert_bound`]: the heap must hold them too, or a fast store's inserts
/// fill it and a later workload fails where a slower store's would not.
pub fn inserted_records(options: &CompareOptions) -> u64 {
    options
        .workloads
        .iter()
        .filter_map(|letter| workload(letter, options).ok())
        .filter_map(|workload| {
            insert_bound(&workload, options)
                .map(|bound| (workload.proportions.insert * bound as f64).ceil() as u64)
        })
        .sum()
}

/// The rate, in operations per second, the inserts are sized for: a workload that inserts runs
/// at most `seconds` times this many operations ([`insert_bound`]). rdkv over `shm` reaches
/// 0.9 to 1.2 million in D with direct GETs, so D stops before its time there.
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
    // The index holds the inserts too: sized for the records alone, a fast store's inserts in
    // D filled both candidate buckets of a key (`table full`) at 56% of the slots.
    let per_node = ((options.records + inserted_records(options)) * options.replicas.max(1) as u64)
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
    let unbounded = Workload::from_properties(&name, &properties)?;
    match insert_bound(&unbounded, options) {
        None => Ok(unbounded),
        Some(bound) => {
            properties.set_override(&format!("operationcount={bound}"))?;
            Ok(Workload::from_properties(&name, &properties)?)
        }
    }
}

/// The operations a workload that inserts may run: the heap and the index hold the inserts of
/// `seconds` at [`ASSUMED_OPERATIONS_PER_SECOND`] and no more, so a store faster than that
/// stops at this count before its time is up (a time alone let the inserts of D fill a
/// faster machine's heap, and the workloads after it failed). `None` for a workload without
/// inserts, which runs for its time.
pub fn insert_bound(workload: &Workload, options: &CompareOptions) -> Option<u64> {
    (workload.proportions.insert > 0.0)
        .then(|| (options.seconds * ASSUMED_OPERATIONS_PER_SECOND as f64).ceil() as u64)
}

/// Runs the comparison: `options.rounds` rounds, each running every store in turn (a fresh
/// cluster for each rdkv store, loaded), every workload once per store.
///
/// # Errors
/// Starting a store, a refused workload (E), or a load with errors ([`OperationsFailed`]).
pub async fn compare(options: &CompareOptions) -> anyhow::Result<Comparison> {
    let workloads: Vec<Workload> = options
        .workloads
        .iter()
        .map(|letter| workload(letter, options))
        .collect::<anyhow::Result<_>>()?;
    let record_size = workloads
        .first()
        .ok_or_else(|| anyhow::anyhow!("no workloads to compare"))?
        .record_size();
    anyhow::ensure!(!options.stores.is_empty(), "no stores to compare");
    anyhow::ensure!(options.rounds >= 1, "--rounds must be at least 1");
    let directory = std::env::temp_dir().join(format!("rdkv-ycsb-compare-{}", std::process::id()));
    std::fs::create_dir_all(&directory)?;
    // Removed however this function ends (a refused start included); the servers are dropped
    // first, so they stop before their files go.
    let _directory = RemovedOnDrop(directory.clone());
    let servers = Servers::start(options, directory, record_size)?;
    let settings = Settings {
        records: options.records,
        record_size,
        seconds: options.seconds,
        threads: options.threads,
        nodes: options.nodes,
        replicas: options.replicas.max(1),
        heap_size: node_heap_size(options, record_size),
        rounds: options.rounds,
    };
    let mut comparison = Comparison::new(settings, &options.workloads, &options.stores);
    for round in 1..=options.rounds {
        for &store in &options.stores {
            // Dropped at the end of its turn: an rdkv store's nodes stop before the next start.
            let started = servers.start_store(store, options, round).await?;
            measure(&started, store, &workloads, options, round, &mut comparison).await?;
            started.driver.close().await;
        }
    }
    Ok(comparison)
}

/// What the stores share over the rounds: the cluster's configuration (each rdkv store's turn
/// starts fresh nodes from it, so that the dead blocks a write-heavy run left cannot slow the
/// next) and one `redis-server` for both Redis stores.
struct Servers {
    /// The comparison's directory: the cluster file, the Redis socket, the nodes' run
    /// directories.
    directory: PathBuf,
    /// Bytes of each record's value (the `memory` store is sized for them).
    record_size: usize,
    /// The rdkv cluster, when an rdkv store is compared.
    cluster: Option<rdkv_cluster_config::ClusterConfig>,
    /// The cluster's ports, held until every cluster started from its file is stopped (the
    /// stores' cluster guards drop first: they live in `StartedStore`s).
    _cluster_ports: Option<ReservedPorts>,
    /// `redis-server`, when a Redis store is compared.
    redis: Option<RedisServer>,
}

/// A running `redis-server`.
struct RedisServer {
    /// Stops it on drop.
    child: ChildGuard,
    /// Its loopback TCP URL.
    tcp_url: String,
    /// Its Unix socket URL.
    unix_url: String,
}

/// A store started for one turn of one round.
struct StartedStore {
    /// Its driver.
    driver: Arc<Driver>,
    /// The server processes each run's server CPU is read from (none for `memory` and `map`:
    /// their store is this process).
    server_pids: Vec<u32>,
    /// Whether its turn loads the records (the Unix socket's Redis reads those loaded over TCP).
    load: bool,
    /// Its rdkv nodes, stopped on drop (after the driver, declared above).
    _cluster: Option<ClusterGuard>,
}

impl Servers {
    /// Writes the cluster file and starts `redis-server`, for the stores `options` compares.
    fn start(
        options: &CompareOptions,
        directory: PathBuf,
        record_size: usize,
    ) -> anyhow::Result<Self> {
        let wants = |store: Store| options.stores.contains(&store);
        let rdkv_wanted = wants(Store::RdkvShm) || wants(Store::RdkvSoft);
        let redis_wanted = wants(Store::RedisTcp) || wants(Store::RedisUnix);
        let started: Vec<String> = [
            rdkv_wanted.then(|| format!("rdkv ({} node(s))", options.nodes)),
            redis_wanted.then(|| "redis-server".to_string()),
        ]
        .into_iter()
        .flatten()
        .collect();
        if !started.is_empty() {
            eprintln!("starting {} on loopback", started.join(" and "));
        }
        let (cluster, cluster_ports) = if rdkv_wanted {
            let (cluster_file, ports) = write_cluster_file(&directory, options, record_size)?;
            let cluster = rdkv_cluster_config::config::load_to_start(&cluster_file, None, None)?;
            (Some(cluster), Some(ports))
        } else {
            (None, None)
        };
        let redis = if redis_wanted {
            let (child, tcp_url, unix_url) = start_redis(&options.redis_server, &directory)?;
            Some(RedisServer {
                child,
                tcp_url,
                unix_url,
            })
        } else {
            None
        };
        Ok(Self {
            directory,
            record_size,
            cluster,
            _cluster_ports: cluster_ports,
            redis,
        })
    }

    /// Starts `store` for its turn of `round`.
    async fn start_store(
        &self,
        store: Store,
        options: &CompareOptions,
        round: usize,
    ) -> anyhow::Result<StartedStore> {
        Ok(match store {
            Store::RdkvShm | Store::RdkvSoft => self.start_rdkv(store, options, round).await?,
            Store::RedisTcp | Store::RedisUnix => {
                let redis = self
                    .redis
                    .as_ref()
                    .expect("redis-server runs whenever a Redis store is compared");
                let url = if store == Store::RedisTcp {
                    &redis.tcp_url
                } else {
                    &redis.unix_url
                };
                StartedStore {
                    driver: Arc::new(Driver::redis(url).await?),
                    server_pids: vec![redis.child.child.id()],
                    // Both Redis stores are one server: TCP loads, Unix reads the same records.
                    load: store == Store::RedisTcp || !options.stores.contains(&Store::RedisTcp),
                    _cluster: None,
                }
            }
            Store::Memory => StartedStore {
                // Sized, as the nodes, for the records and the inserts the workloads may make.
                driver: Arc::new(
                    Driver::memory(
                        options.records + inserted_records(options),
                        self.record_size,
                        options.threads,
                    )
                    .await?,
                ),
                server_pids: Vec::new(),
                load: true,
                _cluster: None,
            },
            Store::Map => StartedStore {
                driver: Arc::new(Driver::map(options.records + inserted_records(options))),
                server_pids: Vec::new(),
                load: true,
                _cluster: None,
            },
        })
    }

    /// Starts fresh rdkv nodes and a client over `shm` or `soft`, as `store` says.
    async fn start_rdkv(
        &self,
        store: Store,
        options: &CompareOptions,
        round: usize,
    ) -> anyhow::Result<StartedStore> {
        let cluster = self
            .cluster
            .as_ref()
            .expect("the cluster is loaded whenever an rdkv store is compared");
        let run_directory = self
            .directory
            .join(format!("run-{}-{round}", store.name().replace(' ', "-")));
        let guard = ClusterGuard {
            nodes: rdkv_cluster_config::launcher::start(cluster, &run_directory, true)?,
            run_directory,
        };
        let not_serving = rdkv_cluster_config::status::wait_serving(
            cluster,
            &cluster.nodes.iter().map(|node| node.id).collect::<Vec<_>>(),
            rdkv_cluster_config::status::SERVING_TIMEOUT,
            &|_| {},
        )
        .await;
        if let Some((id, reason)) = not_serving.first() {
            anyhow::bail!("node {id} of the benchmark's cluster does not serve data: {reason}");
        }
        let server_pids = guard
            .nodes
            .iter()
            .filter_map(|node| node.child.as_ref().map(Child::id))
            .collect();
        let fabric = if store == Store::RdkvShm {
            rdkv_client::FabricChoice::Shm
        } else {
            rdkv_client::FabricChoice::Cluster(cluster.fabric)
        };
        let client = rdkv_client::ClientBuilder::cluster(cluster)
            .concurrency(options.threads)
            .fabric(fabric)
            .build()?;
        Ok(StartedStore {
            driver: Arc::new(Driver::Rdkv {
                client: Arc::new(client),
                _server: None,
                name: store.name(),
            }),
            server_pids,
            load: true,
            _cluster: Some(guard),
        })
    }
}

/// One turn of `store` in `round`: loads the records (when its turn does), then runs each
/// workload and records its report.
async fn measure(
    started: &StartedStore,
    store: Store,
    workloads: &[Workload],
    options: &CompareOptions,
    round: usize,
    comparison: &mut Comparison,
) -> anyhow::Result<()> {
    let name = store.name();
    let prefix = if options.rounds > 1 {
        format!("round {round}/{}: ", options.rounds)
    } else {
        String::new()
    };
    let run_options = RunOptions {
        threads: options.threads,
        target: None,
        max_execution_time: Some(Duration::from_secs_f64(options.seconds)),
        progress: options.progress,
    };
    if let (true, Some(first)) = (started.load, workloads.first()) {
        eprintln!(
            "{prefix}{name}: loading {} records of {} bytes",
            first.record_count,
            first.record_size()
        );
        let load_options = RunOptions {
            max_execution_time: None,
            ..run_options
        };
        let loaded = runner::load(first, started.driver.clone(), load_options).await?;
        // Missing records would make the comparison unfair: stop, whatever --allow-errors says.
        if let Some(failed) = OperationsFailed::from_reports(&format!("{name} load"), &[&loaded]) {
            return Err(failed.into());
        }
    }
    let pids = &started.server_pids;
    for (index, workload) in workloads.iter().enumerate() {
        eprintln!(
            "{prefix}{name}: running {} for {} s with {} tasks",
            workload.name, options.seconds, options.threads
        );
        let servers_before = servers_cpu_time(pids);
        let mut report = runner::run(workload, started.driver.clone(), run_options).await?;
        if insert_bound(workload, options) == Some(report.operations) {
            eprintln!(
                "{prefix}{name}: {} stopped at its bound of {} operations after {:.2} s (the heap holds the inserts of that many)",
                workload.name,
                report.operations,
                report.runtime_ms as f64 / 1000.0
            );
        }
        report.server_cpu_us_per_operation = servers_before
            .zip(servers_cpu_time(pids))
            .filter(|_| report.operations > 0 && !pids.is_empty())
            .map(|(before, after)| (after - before).as_secs_f64() * 1e6 / report.operations as f64);
        comparison.record(index, store, report);
    }
    Ok(())
}

/// The CPU time the processes `pids` used so far, together; `None` if one cannot be read.
fn servers_cpu_time(pids: &[u32]) -> Option<Duration> {
    pids.iter()
        .map(|pid| rdkv_common::process::cpu_time(Some(*pid)))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(workloads: &[&str]) -> CompareOptions {
        CompareOptions {
            records: 20_000,
            seconds: 3.0,
            rounds: 1,
            threads: 64,
            nodes: 1,
            replicas: 1,
            workloads: workloads.iter().map(|letter| letter.to_string()).collect(),
            redis_server: PathBuf::from("redis-server"),
            progress: false,
            heap_size: None,
            stores: vec![Store::RdkvShm],
        }
    }

    #[test]
    fn a_workload_that_inserts_stops_at_the_count_its_heap_was_sized_for() {
        let options = options(&["c", "d"]);
        let read_only = workload("c", &options).expect("workload C is built in");
        let inserting = workload("d", &options).expect("workload D is built in");
        assert_eq!(insert_bound(&read_only, &options), None);
        assert_eq!(read_only.operation_count, u64::MAX / 4);
        let bound = insert_bound(&inserting, &options).expect("D inserts: it has a bound");
        assert_eq!(inserting.operation_count, bound);
        // The heap holds D's inserts at that count: 5% of it.
        assert_eq!(
            inserted_records(&options),
            (inserting.proportions.insert * bound as f64).ceil() as u64
        );
        let block = rdkv_cluster_file::sizing::block_size(24, 1000);
        assert!(
            node_heap_size(&options, 1000)
                >= 2 * (options.records + inserted_records(&options)) * block
        );
    }
}
