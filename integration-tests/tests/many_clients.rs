//! 1,000 clients on one node (issue 14): 1,000 client connections to one `rdkv-server`
//! process, then 1,000 operations at once across them, every result checked. The node's
//! threads stay at what it had before the clients came (its soft NIC serves every connection
//! from a fixed engine pool), and its memory per connection is measured and printed.

use std::time::{Duration, Instant};

use rdkv_client::{Client, ClientConfig};
use rdkv_fabric::Backend;
use rdkv_integration_tests::process::{raise_open_files, ServerProcess};

const SECRET: &str = "many-clients-secret";
const CLIENTS: usize = 1_000;
/// Handshakes in flight at once while the clients connect.
const CONNECTING_AT_ONCE: usize = 50;

/// A `/proc/PID/status` field, in its own unit (kB for memory).
fn status_field(pid: u32, name: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("the node's /proc status")
        .lines()
        .find_map(|line| line.strip_prefix(name))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
}

/// The node's threads by name, with counts.
fn thread_names(pid: u32) -> String {
    let mut names = std::collections::BTreeMap::<String, usize>::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("tasks")
        .flatten()
    {
        if let Ok(name) = std::fs::read_to_string(task.path().join("comm")) {
            *names.entry(name.trim().to_string()).or_default() += 1;
        }
    }
    format!("{names:?}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_clients_on_one_node() {
    raise_open_files();
    let server = ServerProcess::start(
        SECRET,
        &[
            "--heap-size",
            "64M",
            "--chunk-size",
            "16K",
            "--index-size",
            "4M",
            "--max-connections",
            "2048",
            "--max-unauthenticated-connections",
            "1024",
            "--max-pending-per-address",
            "1024",
            // The node's deadline caps the clients' (10 s below): the default 2 s ends a hang,
            // and with both cores busy a put of the thousand-at-once burst waited past it.
            "--deadline-ms",
            "10000",
        ],
    );
    let pid = server.id();
    let threads_before = status_field(pid, "Threads:");
    let resident_before = status_field(pid, "VmRSS:");

    // Connect 1,000 clients, 50 handshakes at a time (bounded in time).
    let started = Instant::now();
    let mut clients = Vec::with_capacity(CLIENTS);
    let mut most_threads = threads_before;
    while clients.len() < CLIENTS {
        let batch = (CLIENTS - clients.len()).min(CONNECTING_AT_ONCE);
        let connecting: Vec<_> = (0..batch)
            .map(|_| {
                let mut config =
                    ClientConfig::new(server.control_address, Backend::Soft, SECRET.as_bytes());
                config.concurrency = 1;
                // One connection per client (by default a client opens one per tokio worker).
                config.lanes = Some(1);
                config.operation_deadline = Some(Duration::from_secs(10));
                tokio::spawn(Client::connect(config))
            })
            .collect();
        for handle in connecting {
            let client = handle
                .await
                .expect("the connect task")
                .unwrap_or_else(|error| panic!("client {}: {error}", clients.len()));
            clients.push(std::sync::Arc::new(client));
        }
        most_threads = most_threads.max(status_field(pid, "Threads:"));
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{} clients connected in 120 s",
            clients.len()
        );
    }
    let connect_time = started.elapsed();

    // 1,000 operations at once, one per client, then every value read back.
    let started = Instant::now();
    let puts: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(index, client)| {
            let client = client.clone();
            tokio::spawn(async move {
                client
                    .put(
                        format!("many-{index}").as_bytes(),
                        format!("value-{index}").as_bytes(),
                    )
                    .await
            })
        })
        .collect();
    for (index, put) in puts.into_iter().enumerate() {
        put.await
            .expect("the put task")
            .unwrap_or_else(|error| panic!("put {index}: {error}"));
    }
    let gets: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(index, client)| {
            // Each client reads another client's key.
            let client = client.clone();
            let key = format!("many-{}", (index + 1) % CLIENTS);
            tokio::spawn(async move { client.get(key.as_bytes()).await })
        })
        .collect();
    for (index, get) in gets.into_iter().enumerate() {
        let value = get
            .await
            .expect("the get task")
            .unwrap_or_else(|error| panic!("get {index}: {error}"));
        assert_eq!(
            value.as_deref(),
            Some(format!("value-{}", (index + 1) % CLIENTS).as_bytes()),
            "client {index} read another's key"
        );
    }
    let operation_time = started.elapsed();

    let threads_with_clients = status_field(pid, "Threads:").max(most_threads);
    let resident_with_clients = status_field(pid, "VmRSS:");
    let per_connection_kib =
        resident_with_clients.saturating_sub(resident_before) as f64 / CLIENTS as f64;
    println!(
        "{CLIENTS} clients: connected in {connect_time:.2?}, 2,000 operations in {operation_time:.2?}; \
         node threads {threads_before} before, at most {threads_with_clients} with them; \
         node RSS {resident_before} KiB before, {resident_with_clients} KiB with them \
         = {per_connection_kib:.1} KiB per client connection (control and fabric)"
    );
    // No thread per connection: at most a few more than before (the runtime may start a
    // blocking thread or two for the collector and the log).
    assert!(
        threads_with_clients <= threads_before + 4,
        "node threads {threads_before} before, {threads_with_clients} with {CLIENTS} clients: {}",
        thread_names(pid)
    );
    // Measured about 18 KiB per connection; a thread stack or an unbounded buffer per
    // connection would be well past this bound.
    assert!(
        per_connection_kib < 256.0,
        "{per_connection_kib:.1} KiB per connection"
    );
    for client in clients {
        client.close().await;
    }
}
