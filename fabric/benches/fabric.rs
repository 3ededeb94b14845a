//! Fabric micro-benchmark: the `soft` backend over loopback TCP and the `shm` backend (the
//! requester on the responder's shared memory) against the in-process `loopback` backend (the
//! ceiling), in one run; with `--features verbs`, also the `verbs` backend on the RDMA device
//! named by `RDKV_RDMA_DEVICE` (the first one by default). The memory is shareable
//! (`PinnedMemory::allocate_shared`) for every backend, as `shm` needs it.
//!
//! Scenarios: READ 64 B, READ 1 KiB, CAS, and lists of 4 READs of 64 B (one doorbell, last one
//! signaled); at queue depth 1 and 64 (lists outstanding per queue pair); over 1 and 8 queue
//! pairs. Reported: operations per second (a list of 4 counts 4), p50 and p99 latency of one
//! post-to-completion, and for `soft` the frames per `write` call (how well posts coalesce).
//!
//! Run: `cargo bench -p rdkv-fabric --bench fabric -- --seconds 2`
//! (`--backend verbs --backend soft` to compare a NIC with the soft fabric on one machine).

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use rdkv_fabric::memory::{HugepagePolicy, PinLimits, PinnedMemory};
use rdkv_fabric::{
    AccessFlags, Backend, Device, DeviceConfig, MemoryRegion, QueuePair, QueuePairConfig,
    VerbsOptions, WorkCompletionStatus, WorkRequest,
};

/// `chosen`, or `default` when nothing was chosen.
fn or_default<'a>(chosen: &'a [usize], default: &'a [usize]) -> &'a [usize] {
    if chosen.is_empty() {
        default
    } else {
        chosen
    }
}

/// Command-line options.
#[derive(Debug, Parser)]
#[command(about = "rdkv fabric benchmark: soft and shm vs loopback")]
struct Options {
    /// Measured seconds per scenario.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Only these backends (loopback, shm, soft, verbs); default loopback, shm and soft, plus
    /// verbs in a build with the feature.
    #[arg(long)]
    backend: Vec<Backend>,
    /// Busy-poll budget of the soft engine threads, in microseconds (DeviceConfig::poll_spin).
    #[arg(long, default_value_t = 0)]
    spin_us: u64,
    /// Only these queue pair counts (default 1 and 8).
    #[arg(long)]
    queue_pairs: Vec<usize>,
    /// Only these depths (default 1 and 64).
    #[arg(long)]
    depth: Vec<usize>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operation {
    Read64,
    Read1K,
    CompareAndSwap,
    ReadBatch4,
}

impl Operation {
    fn name(self) -> &'static str {
        match self {
            Self::Read64 => "READ 64 B",
            Self::Read1K => "READ 1 KiB",
            Self::CompareAndSwap => "CAS",
            Self::ReadBatch4 => "4 × READ 64 B",
        }
    }

    /// The list one task posts; `slot` is the task's private 4 KiB of local memory.
    fn list(self, local: &MemoryRegion, remote: &MemoryRegion, slot: u64) -> Vec<WorkRequest> {
        let base = slot * 4096;
        let remote_at = |offset: u64| remote.remote_key().at(offset);
        match self {
            Self::Read64 => vec![WorkRequest::read(
                0,
                local.segment(base, 64),
                remote_at(slot % 64 * 1024),
            )],
            Self::Read1K => vec![WorkRequest::read(
                0,
                local.segment(base, 1024),
                remote_at(slot % 64 * 1024),
            )],
            Self::CompareAndSwap => vec![WorkRequest::compare_and_swap(
                0,
                local.segment(base, 8),
                remote_at(slot % 64 * 8),
                0,
                0,
            )],
            Self::ReadBatch4 => (0..4u64)
                .map(|index| {
                    WorkRequest::read(
                        index,
                        local.segment(base + index * 64, 64),
                        remote_at(index * 64),
                    )
                    .with_signaled(index == 3)
                })
                .collect(),
        }
    }
}

struct Row {
    backend: &'static str,
    operation: Operation,
    queue_pairs: usize,
    depth: usize,
    operations_per_second: f64,
    p50_microseconds: f64,
    p99_microseconds: f64,
    frames_per_write: Option<f64>,
}

struct Setup {
    devices: (Device, Device),
    pairs: Vec<(QueuePair, QueuePair)>,
    local: MemoryRegion,
    remote: MemoryRegion,
}

async fn setup(backend: &str, queue_pairs: usize, slots: usize, spin: Duration) -> Setup {
    let backend: Backend = backend.parse().expect("a name from Backend::ALL");
    let config = DeviceConfig {
        poll_spin: spin,
        ..DeviceConfig::default()
    };
    let options = VerbsOptions::from_environment();
    let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let devices = (
        Device::open(backend, Some(listen), &options, config).expect("open the server device"),
        Device::open(backend, None, &options, config).expect("open the client device"),
    );
    let (server, client) = &devices;
    let server_domain = server.allocate_protection_domain();
    let client_domain = client.allocate_protection_domain();
    let server_queue = server
        .create_completion_queue(8 * 256)
        .expect("create completion queue");
    let client_queue = client
        .create_completion_queue(8 * 256)
        .expect("create completion queue");
    let pin = |length| {
        Arc::new(
            PinnedMemory::allocate_shared(length, HugepagePolicy::Auto, PinLimits::default())
                .expect("pin"),
        )
    };
    let remote = server_domain
        .register_all(
            &pin(1 << 20),
            // Verbs requires LOCAL_WRITE on a region that grants REMOTE_ATOMIC.
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
        )
        .expect("register remote");
    let local = client_domain
        .register_all(&pin((slots as u64) * 4096), AccessFlags::LOCAL_WRITE)
        .expect("register local");
    let mut pairs = Vec::new();
    for _ in 0..queue_pairs {
        let server_pair = server_domain
            .create_queue_pair(&server_queue, QueuePairConfig::default())
            .expect("qp");
        let client_pair = client_domain
            .create_queue_pair(&client_queue, QueuePairConfig::default())
            .expect("qp");
        let (server_endpoint, client_endpoint) = (server_pair.endpoint(), client_pair.endpoint());
        let (first, second) = tokio::join!(
            server_pair.connect(&client_endpoint),
            client_pair.connect(&server_endpoint)
        );
        first.expect("connect server");
        second.expect("connect client");
        pairs.push((server_pair, client_pair));
    }
    Setup {
        devices,
        pairs,
        local,
        remote,
    }
}

async fn scenario(
    backend: &'static str,
    operation: Operation,
    queue_pairs: usize,
    depth: usize,
    seconds: f64,
    spin: Duration,
) -> Row {
    let tasks = queue_pairs * depth;
    let setup = Arc::new(setup(backend, queue_pairs, tasks, spin).await);
    let warmup = Duration::from_secs_f64(seconds * 0.2);
    let measured = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let measure_from = start + warmup;
    let deadline = measure_from + measured;
    let before = setup.devices.0.gauges();
    let client_before = setup.devices.1.gauges();
    let mut handles = Vec::new();
    for task in 0..tasks {
        let setup = setup.clone();
        handles.push(tokio::spawn(async move {
            let (_, queue_pair) = &setup.pairs[task % queue_pairs];
            let list = operation.list(&setup.local, &setup.remote, task as u64);
            let per_list = list.len() as u64;
            let mut histogram = Histogram::<u64>::new(3).expect("histogram");
            let mut operations = 0u64;
            // Bounded in time and in count.
            for _ in 0..50_000_000u64 {
                let posted_at = Instant::now();
                if posted_at >= deadline {
                    break;
                }
                let completions = queue_pair.execute(list.clone()).await.expect("post");
                if completions
                    .iter()
                    .any(|completion| completion.status != WorkCompletionStatus::Success)
                {
                    panic!("benchmark request failed: {completions:?}");
                }
                if posted_at >= measure_from {
                    let _ = histogram.record(posted_at.elapsed().as_nanos() as u64);
                    operations += per_list;
                }
            }
            (histogram, operations)
        }));
    }
    let mut histogram = Histogram::<u64>::new(3).expect("histogram");
    let mut operations = 0u64;
    for handle in handles {
        let (task_histogram, task_operations) = handle.await.expect("task");
        histogram.add(task_histogram).expect("merge");
        operations += task_operations;
    }
    let after = setup.devices.0.gauges();
    let client_after = setup.devices.1.gauges();
    let frames = (after.frames_sent - before.frames_sent)
        + (client_after.frames_sent - client_before.frames_sent);
    let writes = (after.transport_writes - before.transport_writes)
        + (client_after.transport_writes - client_before.transport_writes);
    Row {
        backend,
        operation,
        queue_pairs,
        depth,
        operations_per_second: operations as f64 / measured.as_secs_f64(),
        p50_microseconds: histogram.value_at_quantile(0.5) as f64 / 1000.0,
        p99_microseconds: histogram.value_at_quantile(0.99) as f64 / 1000.0,
        frames_per_write: (writes > 0).then(|| frames as f64 / writes as f64),
    }
}

fn main() {
    let options = Options::parse();
    let backends: Vec<&'static str> = [
        Backend::Loopback,
        Backend::Shm,
        Backend::Soft,
        Backend::Verbs,
    ]
    .into_iter()
    .filter(|backend| {
        if options.backend.is_empty() {
            *backend != Backend::Verbs || Device::verbs_built()
        } else {
            options.backend.contains(backend)
        }
    })
    .map(Backend::name)
    .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let cores = std::thread::available_parallelism()
        .map(|count| count.get())
        .unwrap_or(1);
    println!(
        "rdkv fabric benchmark: {cores} cores, {} s per scenario",
        options.seconds
    );
    println!();
    println!("| backend | operation | QPs | depth | ops/s | p50 µs | p99 µs | frames/write |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    for operation in [
        Operation::Read64,
        Operation::Read1K,
        Operation::CompareAndSwap,
        Operation::ReadBatch4,
    ] {
        for &queue_pairs in or_default(&options.queue_pairs, &[1, 8]) {
            for &depth in or_default(&options.depth, &[1, 64]) {
                for backend in &backends {
                    let row = runtime.block_on(scenario(
                        backend,
                        operation,
                        queue_pairs,
                        depth,
                        options.seconds,
                        Duration::from_micros(options.spin_us),
                    ));
                    println!(
                        "| {} | {} | {} | {} | {:.0} | {:.1} | {:.1} | {} |",
                        row.backend,
                        row.operation.name(),
                        row.queue_pairs,
                        row.depth,
                        row.operations_per_second,
                        row.p50_microseconds,
                        row.p99_microseconds,
                        row.frames_per_write
                            .map_or("-".to_string(), |ratio| format!("{ratio:.1}")),
                    );
                    rows.push(row);
                }
            }
        }
    }
    if backends.len() >= 2 {
        let base = backends[0];
        println!();
        println!("throughput relative to {base}:");
        for group in rows.chunks(backends.len()) {
            let reference = group[0].operations_per_second;
            let ratios: Vec<String> = group[1..]
                .iter()
                .map(|row| {
                    format!(
                        "{} {:.2}",
                        row.backend,
                        row.operations_per_second / reference
                    )
                })
                .collect();
            println!(
                "  {:<14} QPs {} depth {:>2}: {}",
                group[0].operation.name(),
                group[0].queue_pairs,
                group[0].depth,
                ratios.join(", ")
            );
        }
    }
}
