//! Direct operations leave their connection idle by themselves (`docs/protocol.md`, *Heap
//! space* and *Direct GETs*): a direct GET or update announces its start and its finish with
//! stores of its own, so a client whose runtime runs nothing between its calls (a `block_on`
//! per call, then other work) shows no operation in flight and holds no heap space back. The
//! node fences a connection that, with the heap under pressure, holds reuse back with an
//! operation in flight and announces nothing for `heap_hold_limit` (1 s here); so while that
//! client's thread sleeps (no task of it, the announce flusher included, can run) and another
//! client's updates fill a small heap, the node fences nothing, and the sleeping client's
//! next call succeeds on its connection.
//!
//! Checked to fail without the finish's store (the word then shows the last direct operation
//! running): the node fenced the sleeping client's connection.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use rdkv_client::{Client, ClientConfig, SharedMemory};
use rdkv_fabric::Backend;
use rdkv_server::ServerConfig;

const SECRET: &[u8] = b"direct-announce-test-secret";
/// Direct updates and GETs of one key before the sleep.
const ROUNDS: usize = 200;
/// How long the client sleeps: well past `heap_hold_limit`.
const SLEEP: Duration = Duration::from_secs(4);

/// A client of the node at `address` with one connection.
fn client_config(address: std::net::SocketAddr, shared_memory: SharedMemory) -> ClientConfig {
    let mut config = ClientConfig::new(address, Backend::Soft, SECRET);
    config.node.shared_memory = shared_memory;
    config.lanes = Some(1);
    config
}

/// The sleeping client, on its own thread and current-thread runtime, one call per
/// `block_on`: direct updates and GETs, a report of its counters, a sleep until `wake` (or
/// a bound), then one more update, whose outcome it returns.
fn sleeping_client(
    address: std::net::SocketAddr,
    report: mpsc::SyncSender<rdkv_client::CounterSnapshot>,
    wake: mpsc::Receiver<()>,
) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime");
    let client = runtime
        .block_on(Client::connect(client_config(
            address,
            SharedMemory::Require,
        )))
        .expect("connect");
    let value = vec![b'v'; 1_000];
    for round in 0..ROUNDS {
        let mut written = value.clone();
        written[0] = round as u8;
        runtime
            .block_on(client.put(b"sleeper", &written))
            .expect("update");
        let read = runtime.block_on(client.get(b"sleeper")).expect("get");
        assert_eq!(read.as_deref(), Some(&written[..]));
    }
    report
        .send(client.counters())
        .expect("the test waits for the report");
    // Nothing of this runtime runs meanwhile.
    let _ = wake.recv_timeout(SLEEP + Duration::from_secs(60));
    let after = runtime.block_on(client.put(b"sleeper", &value));
    runtime.block_on(client.close());
    after.map_err(|error| error.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_operations_leave_the_connection_idle_without_a_task_running() {
    let mut config = ServerConfig::local(SECRET);
    config.fabric = Backend::Soft;
    config.shm_socket = Some(
        std::env::temp_dir().join(format!("rdkv-direct-announce-{}.sock", std::process::id())),
    );
    config.heap_size = 2 * 1024 * 1024;
    config.chunk_size = 64 * 1024;
    let server = rdkv_server::start(config).await.expect("start server");
    let address = server.control_address();

    let (report, reported) = mpsc::sync_channel(1);
    let (wake, woken) = mpsc::sync_channel::<()>(1);
    let sleeper = std::thread::spawn(move || sleeping_client(address, report, woken));
    let counters =
        tokio::task::spawn_blocking(move || reported.recv_timeout(Duration::from_secs(300)))
            .await
            .expect("the wait")
            .expect("the sleeping client's report");
    assert!(
        counters.direct_updates as usize > ROUNDS / 2 && counters.direct_gets as usize > ROUNDS / 2,
        "most operations were direct (else this shows nothing): {counters:?}"
    );

    // Meanwhile another client updates eight keys of 1 KB as fast as it can: a 2 MiB heap
    // fills within a second when nothing comes back.
    let writer = Client::connect(client_config(address, SharedMemory::Off))
        .await
        .expect("connect the writer");
    let value = vec![b'w'; 1_000];
    let started = Instant::now();
    let mut updates = 0u64;
    while started.elapsed() < SLEEP && updates < 2_000_000 {
        let key = format!("writer-{}", updates % 8);
        writer
            .put(key.as_bytes(), &value)
            .await
            .expect("the writer's update");
        updates += 1;
    }
    let fences = server.stats().heap_fences;
    let _ = wake.send(());
    let after = sleeper.join().expect("the sleeping client");
    writer.close().await;
    server.shutdown().await;
    assert_eq!(
        fences, 0,
        "the node fenced a connection ({updates} updates by the writer): the sleeping client's direct operations left it showing one in flight"
    );
    assert_eq!(after, Ok(()), "the sleeping client's next update failed");
}
