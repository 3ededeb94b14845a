//! `rdkv-ycsb compare`: rdkv and Redis side by side in one run, on this machine.
//!
//! It starts a local rdkv cluster (a generated cluster file on free loopback ports, through the
//! same launcher as `rdkv-cluster`) and `redis-server` (loopback, persistence off), loads the
//! same records into both, runs the chosen workloads against each in turn at equal concurrency,
//! prints one table with the ratios, and stops what it started.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

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
    /// Workloads, by letter.
    pub workloads: Vec<String>,
    /// The `redis-server` program.
    pub redis_server: PathBuf,
    /// Show progress.
    pub progress: bool,
    /// Each node's heap, in bytes; `None` sizes it by the rule (`docs/operations.md`).
    pub heap_size: Option<u64>,
}

/// One row of the comparison.
#[derive(Debug, Clone, Serialize)]
pub struct ComparisonRow {
    /// The workload letter.
    pub workload: String,
    /// rdkv's report.
    pub rdkv: Report,
    /// Redis's report.
    pub redis: Report,
    /// Bytes of each record's value.
    pub record_size: usize,
}

impl ComparisonRow {
    /// rdkv throughput / Redis throughput.
    pub fn ratio(&self) -> f64 {
        self.rdkv.throughput / self.redis.throughput.max(1e-9)
    }
}

/// Stops a child on drop.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
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
        if let Some(parent) = self.run_directory.parent() {
            let _ = std::fs::remove_dir_all(parent);
        }
    }
}

/// Each node's chunk size.
const CHUNK_SIZE: u64 = 1 << 20;

/// Each node's heap: `--heap-size`, or the sizing rule for its share of the records.
pub fn node_heap_size(options: &CompareOptions, record_size: usize) -> u64 {
    // YCSB keys ("user" and up to 20 digits) and values.
    let block = rdkv_cluster_file::sizing::block_size(24, record_size as u64);
    let per_node = options.records.div_ceil(u64::from(options.nodes.max(1)));
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

fn write_cluster_file(
    directory: &Path,
    options: &CompareOptions,
    record_size: usize,
) -> anyhow::Result<PathBuf> {
    let per_node = options.records.div_ceil(u64::from(options.nodes.max(1)));
    let heap = node_heap_size(options, record_size);
    let index = (per_node * 64).max(1 << 20).next_power_of_two();
    let mut text = String::from(
        "[cluster]\nname = \"ycsb-compare\"\nsecret = \"rdkv-ycsb-compare\"\nfabric = \"soft\"\noperation_deadline = \"2s\"\n",
    );
    let nodes = options.nodes.max(1);
    let ports = rdkv_common::process::free_loopback_ports(2 * nodes as usize)?;
    for (node, pair) in (1..=nodes).zip(ports.chunks(2)) {
        text.push_str(&format!(
            "\n[[node]]\nid = {node}\ncontrol_address = \"127.0.0.1:{}\"\nfabric_address = \"127.0.0.1:{}\"\nindex_size = {index}\nheap_size = {heap}\nchunk_size = {CHUNK_SIZE}\n",
            pair[0],
            pair[1]
        ));
    }
    let path = directory.join("cluster.toml");
    std::fs::write(&path, text)?;
    Ok(path)
}

fn start_redis(program: &Path) -> anyhow::Result<(ChildGuard, String)> {
    let port = rdkv_common::process::free_loopback_ports(1)?[0];
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
        ])
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
    let guard = ChildGuard(child);
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
    Ok((guard, format!("redis://127.0.0.1:{port}")))
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
/// Starting either store, a refused workload (E), or a load with errors ([`OperationsFailed`]).
pub async fn compare(options: &CompareOptions) -> anyhow::Result<Vec<ComparisonRow>> {
    let workloads: Vec<Workload> = options
        .workloads
        .iter()
        .map(|letter| workload(letter, options))
        .collect::<anyhow::Result<_>>()?;
    let first = workloads
        .first()
        .ok_or_else(|| anyhow::anyhow!("no workloads to compare"))?;
    let directory = std::env::temp_dir().join(format!("rdkv-ycsb-compare-{}", std::process::id()));
    std::fs::create_dir_all(&directory)?;
    // Removed however this function ends (a refused start included); the cluster guard below
    // is dropped first, so the nodes stop before their files go.
    let _directory = RemovedOnDrop(directory.clone());
    let cluster_file = write_cluster_file(&directory, options, first.record_size())?;
    let cluster = rdkv_cluster_config::config::load_to_start(&cluster_file, None, None)?;
    let run_directory = directory.join("run");
    eprintln!(
        "starting rdkv ({} node(s)) and redis-server on loopback",
        options.nodes
    );
    let cluster_guard = ClusterGuard {
        nodes: rdkv_cluster_config::launcher::start(&cluster, &run_directory, true)?,
        run_directory,
    };
    let (redis_guard, redis_url) = start_redis(&options.redis_server)?;
    // The server processes whose CPU each run is charged with.
    let rdkv_pids: Vec<u32> = cluster_guard
        .nodes
        .iter()
        .filter_map(|node| node.child.as_ref().map(Child::id))
        .collect();
    let redis_pids = vec![redis_guard.0.id()];
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
    let rdkv = Arc::new(Driver::Rdkv {
        client: Arc::new(rdkv_client::Client::for_cluster_with_concurrency(
            &cluster,
            options.threads,
        )),
        _server: None,
        name: "rdkv",
    });
    let redis = Arc::new(Driver::redis(&redis_url).await?);
    let mut reports: Vec<(Report, Report)> = Vec::new();
    for (store, driver, pids) in [
        ("rdkv", rdkv.clone(), &rdkv_pids),
        ("redis", redis.clone(), &redis_pids),
    ] {
        eprintln!(
            "{store}: loading {} records of {} bytes",
            first.record_count,
            first.record_size()
        );
        let loaded = runner::load(first, driver.clone(), load_options).await?;
        // Missing records would make the comparison unfair: stop, whatever --allow-errors says.
        if let Some(failed) = OperationsFailed::from_reports(&format!("{store} load"), &[&loaded]) {
            return Err(failed.into());
        }
        for (index, workload) in workloads.iter().enumerate() {
            eprintln!(
                "{store}: running {} for {} s with {} tasks",
                workload.name, options.seconds, options.threads
            );
            let servers_before = servers_cpu_time(pids);
            let mut report = runner::run(workload, driver.clone(), run_options).await?;
            report.server_cpu_us_per_operation = servers_before
                .zip(servers_cpu_time(pids))
                .filter(|_| report.operations > 0)
                .map(|(before, after)| {
                    (after - before).as_secs_f64() * 1e6 / report.operations as f64
                });
            if store == "rdkv" {
                reports.push((report.clone(), report));
            } else {
                reports[index].1 = report;
            }
        }
    }
    rdkv.close().await;
    Ok(reports
        .into_iter()
        .zip(&options.workloads)
        .map(|((rdkv, redis), letter)| ComparisonRow {
            workload: letter.to_uppercase(),
            rdkv,
            redis,
            record_size: first.record_size(),
        })
        .collect())
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

/// The comparison table.
pub fn table(rows: &[ComparisonRow], options: &CompareOptions) -> String {
    let mut out = format!(
        "{} records of {} bytes, {} tasks per store, {} s per workload, rdkv on {} node(s) (soft fabric, {} heap each), Redis with one multiplexed connection\n\n",
        options.records,
        rows.first().map_or(0, |row| row.record_size),
        options.threads,
        options.seconds,
        options.nodes,
        rdkv_cluster_file::units::format_bytes(node_heap_size(
            options,
            rows.first().map_or(0, |row| row.record_size)
        ))
    );
    out.push_str("| workload | rdkv ops/s | Redis ops/s | rdkv/Redis | rdkv READ p50 µs | Redis READ p50 µs | rdkv READ p99 µs | Redis READ p99 µs | rdkv round trips/op | rdkv round trips/READ | client CPU µs/op rdkv/Redis | server CPU µs/op rdkv/Redis | errors rdkv/Redis |\n");
    out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for row in rows {
        let (rdkv_p50, rdkv_p99) = read_percentiles(&row.rdkv);
        let (redis_p50, redis_p99) = read_percentiles(&row.redis);
        let figures = row.rdkv.rdkv.unwrap_or(crate::measurement::RdkvFigures {
            round_trips_per_operation: 0.0,
            round_trips_per_read: 0.0,
            verbs_per_operation: 0.0,
            cas_failures: 0,
            checksum_retries: 0,
        });
        let cpu =
            |value: Option<f64>| value.map_or_else(|| "-".to_string(), |us| format!("{us:.1}"));
        out.push_str(&format!(
            "| {} | {:.0} | {:.0} | {:.2}× | {} | {} | {} | {} | {:.2} | {:.2} | {} / {} | {} / {} | {}/{} |\n",
            row.workload,
            row.rdkv.throughput,
            row.redis.throughput,
            row.ratio(),
            rdkv_p50,
            redis_p50,
            rdkv_p99,
            redis_p99,
            figures.round_trips_per_operation,
            figures.round_trips_per_read,
            cpu(row.rdkv.client_cpu_us_per_operation),
            cpu(row.redis.client_cpu_us_per_operation),
            cpu(row.rdkv.server_cpu_us_per_operation),
            cpu(row.redis.server_cpu_us_per_operation),
            errors(&row.rdkv),
            errors(&row.redis)
        ));
    }
    out
}
