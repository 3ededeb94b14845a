//! A flood of unauthenticated control connections (issue 14): 2,000 connections that never
//! say anything, reopened as soon as the node closes them, while 100 `rdkv put`s run one after
//! another as separate processes. Unauthenticated connections have their own, smaller budget
//! with oldest-first eviction (`server/src/pending.rs`), so every put succeeds; the node's
//! counters show the flood was really evicted. And silent connections cannot hold the last
//! slots of a node whose authenticated connections fill the rest; a node whose authenticated
//! slots are all taken refuses a new client with a reason, and still answers its monitors.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkv_common::protocol::{fetch_stats, MonitoredNode};
use rdkv_integration_tests::process::{raise_open_files, workspace_binary, ServerProcess};

const SECRET: &str = "flood-test-secret";
const FLOOD: usize = 2_000;
const PUTS: usize = 100;

/// Holds `FLOOD` silent connections to `address`, reopening each one the node closes, until
/// `stop` (bounded by 120 s). Returns how many it reopened.
fn flood(address: SocketAddr, stop: Arc<AtomicBool>, opened: Arc<AtomicU64>) -> u64 {
    let connect = || {
        let stream = TcpStream::connect(address).ok()?;
        stream.set_nonblocking(true).ok()?;
        opened.fetch_add(1, Ordering::Relaxed);
        Some(stream)
    };
    let mut streams: Vec<Option<TcpStream>> = (0..FLOOD).map(|_| connect()).collect();
    let started = Instant::now();
    let mut reopened = 0;
    let mut buffer = [0u8; 256];
    while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(120) {
        for slot in &mut streams {
            let closed = match slot {
                None => true,
                Some(stream) => match stream.read(&mut buffer) {
                    Ok(0) => true,
                    Ok(_) => false,
                    Err(error) => error.kind() != std::io::ErrorKind::WouldBlock,
                },
            };
            if closed {
                *slot = connect();
                reopened += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    reopened
}

#[test]
fn legitimate_clients_get_through_a_flood_of_unauthenticated_connections() {
    raise_open_files();
    let server = ServerProcess::start(SECRET, &["--heap-size", "16M", "--index-size", "1M"]);
    let directory = std::env::temp_dir().join(format!("rdkv-flood-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("directory");
    let file = directory.join("one-node.toml");
    std::fs::write(
        &file,
        format!(
            "[cluster]\nname = \"flood\"\nsecret = \"{SECRET}\"\nfabric = \"soft\"\n\n[[node]]\nid = 1\ncontrol_address = \"{}\"\nfabric_address = \"{}\"\nindex_size = \"1M\"\nheap_size = \"16M\"\n",
            server.control_address, server.fabric_address
        ),
    )
    .expect("the cluster file");

    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicU64::new(0));
    let attacker = {
        let (stop, opened) = (stop.clone(), opened.clone());
        let address = server.control_address;
        std::thread::spawn(move || flood(address, stop, opened))
    };
    // The flood is up: all of its first connections are open.
    let started = Instant::now();
    while opened.load(Ordering::Relaxed) < FLOOD as u64 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the flood did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }

    let mut failures = Vec::new();
    for index in 0..PUTS {
        let put = Command::new(workspace_binary("rdkv"))
            .args(["--config", file.to_str().expect("utf-8")])
            .args(["put", &format!("flood-{index}"), "value"])
            .env("RUST_BACKTRACE", "0")
            .output()
            .expect("run rdkv");
        if !put.status.success() {
            failures.push(String::from_utf8_lossy(&put.stderr).trim().to_string());
        }
    }
    let stats = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(fetch_stats(
            MonitoredNode {
                address: server.control_address,
                id: Some(1),
                secret: SECRET.as_bytes(),
            },
            Duration::from_secs(5),
        ))
        .expect("stats during the flood");
    stop.store(true, Ordering::Relaxed);
    let reopened = attacker.join().expect("the flood");
    let _ = std::fs::remove_dir_all(&directory);

    assert!(
        failures.is_empty(),
        "{} of {PUTS} puts failed during the flood; the first: {}",
        failures.len(),
        failures[0]
    );
    assert!(
        stats.handshakes_evicted >= (FLOOD - 256) as u64,
        "the flood was not evicted: {} evicted, {reopened} reopened",
        stats.handshakes_evicted
    );
    assert!(
        stats.pending_handshakes <= 256,
        "{}",
        stats.pending_handshakes
    );
    assert_eq!(stats.keys, PUTS as u64);
}

/// Runs `rdkv put KEY value` against the one-node cluster `file`: its stderr when it failed.
fn put_with_the_cli(file: &std::path::Path, key: &str) -> Result<(), String> {
    let put = Command::new(workspace_binary("rdkv"))
        .args(["--config", file.to_str().expect("utf-8")])
        .args(["put", key, "value"])
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run rdkv");
    if put.status.success() {
        Ok(())
    } else {
        Err(format!(
            "exit {:?}: {}",
            put.status.code(),
            String::from_utf8_lossy(&put.stderr).trim()
        ))
    }
}

/// The node's stats once it counts `clients` authenticated connections besides the monitor
/// that asks (polled: a connection's slot is freed when the node has handled its close, not
/// when the client process exits). Bounded only to end a hang.
async fn wait_for_authenticated(
    node: MonitoredNode<'_>,
    clients: u64,
) -> rdkv_common::protocol::ServerStats {
    let started = Instant::now();
    loop {
        let stats = fetch_stats(node, Duration::from_secs(30))
            .await
            .expect("stats (monitors have a reserve of their own)");
        if stats.authenticated_connections == clients + 1 {
            return stats;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the node counts {} authenticated connections, not {clients} clients and this monitor",
            stats.authenticated_connections
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A client of one lane (one authenticated connection) to `address`, with a key put.
async fn one_lane_client(address: SocketAddr, key: String) -> rdkv_client::Client {
    let mut config =
        rdkv_client::ClientConfig::new(address, rdkv_fabric::Backend::Soft, SECRET.as_bytes());
    config.lanes = Some(1);
    let client = rdkv_client::Client::connect(config).await.expect("connect");
    client
        .put(key.as_bytes(), b"value")
        .await
        .expect("a held client's put");
    client
}

/// A nearly full node (seven of eight authenticated slots taken) whose unauthenticated budget
/// silent connections fill. With one shared budget, the silent ones held the last slots: the
/// node accepted nothing more, so eviction (which runs only for an accepted connection) never
/// made room, and every new client waited in the accept backlog until its deadline (0 of 3
/// puts in a helper's attack). Authenticated slots are now apart from the unauthenticated
/// budget, and the node always accepts one more connection, which evicts a silent one. With
/// all eight slots taken, the next client is refused with a reason that names the setting,
/// and monitors still get in from their reserve.
#[test]
fn silent_connections_cannot_hold_the_last_slots_of_a_nearly_full_node() {
    raise_open_files();
    let server = ServerProcess::start(
        SECRET,
        &[
            "--heap-size",
            "16M",
            "--index-size",
            "1M",
            "--max-connections",
            "8",
            "--max-unauthenticated-connections",
            "4",
            "--max-pending-per-address",
            "4",
        ],
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut clients: Vec<rdkv_client::Client> = runtime.block_on(async {
        let mut clients = Vec::new();
        for index in 0..7 {
            clients.push(one_lane_client(server.control_address, format!("held-{index}")).await);
        }
        clients
    });
    let directory = std::env::temp_dir().join(format!("rdkv-full-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("directory");
    let file = directory.join("one-node.toml");
    std::fs::write(
        &file,
        format!(
            "[cluster]\nname = \"full\"\nsecret = \"{SECRET}\"\nfabric = \"soft\"\n\n[[node]]\nid = 1\ncontrol_address = \"{}\"\nfabric_address = \"{}\"\nindex_size = \"1M\"\nheap_size = \"16M\"\n",
            server.control_address, server.fabric_address
        ),
    )
    .expect("the cluster file");
    let node = MonitoredNode {
        address: server.control_address,
        id: Some(1),
        secret: SECRET.as_bytes(),
    };
    // Each newcomer finds the node as the test means it: seven of eight slots taken (the
    // previous newcomer's slot is free again: the node frees it when it has handled the
    // goodbye, which on a loaded machine can come after the next `rdkv` process connects), and
    // the unauthenticated budget full of silent connections, opened after the monitor that
    // checked the slots (its handshake may evict one of them).
    let mut silent: Vec<TcpStream> = Vec::new();
    let mut failures = Vec::new();
    for index in 0..3 {
        runtime.block_on(wait_for_authenticated(node, 7));
        silent.extend(
            (0..4)
                .map(|_| TcpStream::connect(server.control_address).expect("a silent connection")),
        );
        if let Err(failure) = put_with_the_cli(&file, &format!("newcomer-{index}")) {
            failures.push(failure);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of 3 puts failed against the nearly full node; the first: {}",
        failures.len(),
        failures[0]
    );
    let stats = runtime.block_on(wait_for_authenticated(node, 7));
    assert!(
        stats.handshakes_evicted >= 1,
        "room was made by evicting a silent connection: {} evicted",
        stats.handshakes_evicted
    );

    // The eighth slot taken: the node is full, and says so.
    clients.push(runtime.block_on(one_lane_client(server.control_address, "held-7".into())));
    runtime.block_on(wait_for_authenticated(node, 8));
    let refused = put_with_the_cli(&file, "refused").expect_err("a full node refuses");
    assert!(
        refused.contains("exit Some(2)")
            && refused.contains("the node is full")
            && refused.contains("max_connections"),
        "{refused}"
    );
    assert_eq!(refused.lines().count(), 1, "one line: {refused}");
    // Monitors use their reserve: the stats still come, and count the eight clients and this
    // monitor (an earlier monitor's connection may still be closing: waited for).
    let stats = runtime.block_on(wait_for_authenticated(node, 8));
    assert!(stats.connections_refused_full >= 1);
    let _ = std::fs::remove_dir_all(&directory);
    drop(silent);
    runtime.block_on(async {
        for client in clients {
            client.close().await;
        }
    });
}

/// Garbage before authentication, many times a second, does not become as many log lines: a
/// helper's attack got an info line for each one. At most a line a second now, which counts
/// the ones it left out.
#[test]
fn garbage_before_authentication_is_logged_at_most_once_a_second() {
    const CONNECTIONS: usize = 300;
    let (mut server, address) = rdkv_integration_tests::process::ObservedServer::start(
        SECRET,
        &["--heap-size", "16M", "--index-size", "1M"],
    );
    let started = Instant::now();
    for _ in 0..CONNECTIONS {
        let mut stream = TcpStream::connect(address).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        // A frame length far past any message, then junk.
        let _ = std::io::Write::write_all(&mut stream, &[0xFF; 64]);
        let mut sink = Vec::new();
        let _ = stream.read_to_end(&mut sink);
    }
    let seconds = started.elapsed().as_secs() as usize;
    server.terminate();
    let stopped = server.wait_exit(Duration::from_secs(15));
    let lines = stopped.lines_with("connection closed before authenticating");
    assert!(
        (1..=seconds + 2).contains(&lines),
        "{lines} log lines for {CONNECTIONS} garbage connections in {seconds} s"
    );
    assert!(
        stopped.stderr.contains("left_out="),
        "the lines count the others"
    );
}
