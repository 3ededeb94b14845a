//! Store-level properties against an in-process server: the data path is one-sided, the heap
//! reaches a steady state under updates, and a full table fails clearly without losing data.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkv_client::{Client, ClientConfig, Error};
use rdkv_fabric::Backend;
use rdkv_server::{RunningServer, ServerConfig};

const SECRET: &[u8] = b"store-test-secret";

async fn start(config: ServerConfig) -> (RunningServer, Arc<Client>) {
    let fabric = config.fabric;
    let server = rdkv_server::start(config).await.expect("start server");
    let client = connect(&server, fabric).await;
    (server, Arc::new(client))
}

/// Another client of `server`, on `fabric`.
async fn connect(server: &RunningServer, fabric: Backend) -> Client {
    Client::connect(ClientConfig::new(server.control_address(), fabric, SECRET))
        .await
        .expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_code_handles_no_data_path_request() {
    let (server, client) = start(ServerConfig::local(SECRET)).await;
    let before = server.stats();
    for index in 0..5_000u32 {
        client
            .put(&index.to_le_bytes(), b"one-sided value")
            .await
            .expect("put");
    }
    for index in 0..5_000u32 {
        assert!(client
            .get(&index.to_le_bytes())
            .await
            .expect("get")
            .is_some());
    }
    let after = server.stats();
    assert_eq!(after.data_path_requests, 0);
    let control = after.control_messages - before.control_messages;
    assert!(
        control < 50,
        "10,000 GETs and PUTs took {control} control messages (chunk allocations and heartbeats only)"
    );
    let answered = after.fabric_frames_sent - before.fabric_frames_sent;
    assert!(
        answered >= 20_000,
        "the NIC engine answered {answered} one-sided requests"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heap_use_reaches_a_steady_state_under_updates() {
    let mut config = ServerConfig::local(SECRET);
    config.heap_size = 32 * 1024 * 1024;
    config.chunk_size = 64 * 1024;
    // Reuse waits for the connections' announce words, not for the deadline (which bounds it
    // only for a client that stopped announcing, `server/src/heap.rs`), so the deadline only
    // ends a hang: with both cores busy, puts took over 500 ms.
    config.operation_deadline = Duration::from_secs(10);
    config.collector_interval = Duration::from_millis(50);
    let (server, client) = start(config).await;
    let value = vec![7u8; 200];
    let tasks = 16u64;
    let updates = 200_000u64;
    let mut handles = Vec::new();
    for task in 0..tasks {
        let client = client.clone();
        let value = value.clone();
        handles.push(tokio::spawn(async move {
            for round in 0..updates / tasks {
                let key = format!("key-{:04}", (round * 7 + task * 131) % 1000);
                client.put(key.as_bytes(), &value).await.expect("update");
            }
        }));
    }
    let mut peak = 0;
    let mut ticks = tokio::time::interval(Duration::from_millis(20));
    let updaters = async {
        for handle in handles {
            handle.await.expect("updater");
        }
    };
    tokio::pin!(updaters);
    loop {
        tokio::select! {
            _ = &mut updaters => break,
            _ = ticks.tick() => peak = peak.max(server.stats().heap_used_bytes),
        }
    }
    let stats = server.stats();
    let written = updates * 256;
    assert!(
        written > stats.heap_size_bytes * 3 / 2,
        "the updates wrote {written} bytes, more than the heap holds, so chunks must be reused"
    );
    assert!(
        stats.extents_reclaimed > 0,
        "chunks were reclaimed and reused"
    );
    let bound = stats.heap_size_bytes * 3 / 4;
    assert!(
        peak <= bound,
        "heap use peaked at {peak} bytes, over the bound of {bound}"
    );
    for index in 0..1000 {
        let key = format!("key-{index:04}");
        assert_eq!(
            client.get(key.as_bytes()).await.expect("get").as_deref(),
            Some(value.as_slice())
        );
    }
    eprintln!(
        "steady state: peak heap use {peak} of {} bytes, {} extents reclaimed",
        stats.heap_size_bytes, stats.extents_reclaimed
    );
}

/// Under a steady update load, extents whose last block died come back: 8 tasks update 500
/// keys until they have written three times the heap, which they can only do by reusing it,
/// and no update fails. How soon an extent comes back (from the scan that found it unreferenced
/// to its reuse) is printed, not asserted: it is a speed, for docs/benchmarks.md, and with both
/// cores busy the collector's scans wait for a core.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_extents_come_back_under_load() {
    const TASKS: u64 = 8;
    let mut config = ServerConfig::local(SECRET);
    config.heap_size = 2 * 1024 * 1024;
    config.chunk_size = 16 * 1024;
    let interval = config.collector_interval;
    let heap = config.heap_size;
    let (server, client) = start(config).await;
    let value = vec![3u8; 200];
    // Keys are `key-NNN`: 7 bytes.
    let block = rdkv_cluster_file::sizing::block_size(7, value.len() as u64);
    let per_task = (3 * heap / block).div_ceil(TASKS);
    let started = Instant::now();
    let mut handles = Vec::new();
    for task in 0..TASKS {
        let client = client.clone();
        let value = value.clone();
        handles.push(tokio::spawn(async move {
            for round in 0..per_task {
                let key = format!("key-{:03}", (round * 13 + task * 61) % 500);
                client.put(key.as_bytes(), &value).await.expect("update");
            }
        }));
    }
    for handle in handles {
        handle.await.expect("updater");
    }
    let elapsed = started.elapsed();
    let stats = server.stats();
    assert!(
        stats.extents_reclaimed >= 20,
        "{} extents reclaimed after {} updates of {block}-byte blocks on a {heap}-byte heap",
        stats.extents_reclaimed,
        per_task * TASKS
    );
    let [median, p99, largest] = stats.heap_reuse_delay_ms;
    eprintln!(
        "{} updates in {elapsed:?}, {} extents reclaimed; scan to reuse: median {median} ms, p99 {p99} ms, largest {largest} ms (plus up to {interval:?} from death to scan)",
        per_task * TASKS,
        stats.extents_reclaimed
    );
}

/// The sizing rule holds: on a heap sized by `rdkv_cluster_file::sizing::heap_size` for the
/// live data, the writers and the write rate, a write-heavy run never stalls: 8 tasks write
/// three times the heap, and every update succeeds (a write that finds no room fails with
/// `TableFull`, or with a timeout at its deadline). How many writes each quarter second
/// completed is printed, not asserted: an even pace is a speed, and with both cores busy the
/// pace follows the scheduler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heap_sized_by_the_rule_never_stalls() {
    use rdkv_cluster_file::sizing::{block_size, heap_size, HeapDemand};
    const TASKS: u64 = 8;
    let keys = 2_000u64;
    let value = vec![5u8; 300];
    let chunk_size = 16 * 1024;
    let block = block_size(10, value.len() as u64);
    let mut config = ServerConfig::local(SECRET);
    config.chunk_size = chunk_size;
    config.heap_size = heap_size(&HeapDemand {
        live_bytes: keys * block,
        writers: 1,
        chunk_size,
        // Well above what a debug build does here (a few thousand writes per second).
        write_bytes_per_second: 20_000.0 * block as f64,
    });
    let heap = config.heap_size;
    let (server, client) = start(config).await;
    for index in 0..keys {
        client
            .put(format!("key-{index:05}").as_bytes(), &value)
            .await
            .expect("load");
    }
    let per_task = (3 * heap / block).div_ceil(TASKS);
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut handles = Vec::new();
    for task in 0..TASKS {
        let client = client.clone();
        let value = value.clone();
        let done = done.clone();
        handles.push(tokio::spawn(async move {
            for round in 0..per_task {
                let key = format!("key-{:05}", (round * 7919 + task * 131) % keys);
                client.put(key.as_bytes(), &value).await.expect("update");
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }));
    }
    let updaters = async {
        for handle in handles {
            handle.await.expect("updater");
        }
    };
    tokio::pin!(updaters);
    let mut quarters = Vec::new();
    let mut last = 0;
    let mut ticks = tokio::time::interval(Duration::from_millis(250));
    ticks.tick().await;
    loop {
        tokio::select! {
            _ = &mut updaters => break,
            _ = ticks.tick() => {
                let now = done.load(std::sync::atomic::Ordering::Relaxed);
                quarters.push(now - last);
                last = now;
            }
        }
    }
    let stats = server.stats();
    let updates = done.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(updates, per_task * TASKS, "every update completed");
    assert!(
        stats.extents_reclaimed > 0,
        "the run reused the heap ({heap} bytes)"
    );
    eprintln!(
        "heap {heap} bytes for {keys} keys: {updates} updates, per quarter second {quarters:?}, {} extents reclaimed",
        stats.extents_reclaimed
    );
}

/// Short-lived clients (one write each, as a shell loop of `rdkv put` makes) each take a chunk
/// for their first write; once they are gone, their chunks settle at once, the compactor moves
/// the one live block out of each, and the heap comes back to about the live data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_short_lived_clients_leave_only_their_blocks() {
    let mut config = ServerConfig::local(SECRET);
    // Room for the live blocks twice over (2.2 MB), and 1,000 chunks' worth of first writes
    // passes through it.
    config.heap_size = 160 * 16 * 1024;
    config.chunk_size = 16 * 1024;
    let (server, admin) = start(config).await;
    let value = vec![4u8; 1000];
    let clients = 1_000u32;
    for index in 0..clients {
        let client = connect(&server, Backend::Soft).await;
        client
            .put(format!("short-{index:04}").as_bytes(), &value)
            .await
            .unwrap_or_else(|error| panic!("client {index}: {error}"));
        client.close().await;
    }
    // The live data: 1,000 blocks of 1,088 bytes.
    let live = u64::from(clients) * 1088;
    let settle_until = std::time::Instant::now() + Duration::from_secs(10);
    let mut used = server.stats().heap_used_bytes;
    while used > live * 2 && std::time::Instant::now() < settle_until {
        tokio::time::sleep(Duration::from_millis(50)).await;
        used = server.stats().heap_used_bytes;
    }
    assert!(
        used <= live * 2,
        "heap use {used} bytes for {live} bytes of live blocks after {clients} short-lived clients"
    );
    for index in (0..clients).step_by(97) {
        assert_eq!(
            admin
                .get(format!("short-{index:04}").as_bytes())
                .await
                .expect("get")
                .as_deref(),
            Some(value.as_slice())
        );
    }
    eprintln!(
        "heap use {used} bytes for {live} bytes of live blocks after {clients} short-lived clients; {} extents reclaimed, {} blocks relocated",
        server.stats().extents_reclaimed,
        server.stats().blocks_relocated
    );
}

/// A node whose heap holds 10 chunks serves 100 writing clients at once: grants are sized by
/// demand (a first grant is what the block needs, later ones at most an eighth of what is free),
/// so no client holds a whole chunk it does not fill, and dead extents come back in
/// milliseconds. (Before, each writing connection took a whole chunk, and a node served at most
/// heap_size / chunk_size - 1 writers: the rest got TableFull on a nearly empty heap.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_writers_share_a_heap_of_ten_chunks() {
    let mut config = ServerConfig::local(SECRET);
    config.chunk_size = 64 * 1024;
    config.heap_size = 10 * config.chunk_size;
    let (server, _) = start(config).await;
    let writers = 100usize;
    let rounds = 40usize;
    let value = vec![3u8; 200];
    let mut tasks = Vec::new();
    for writer in 0..writers {
        let client = connect(&server, Backend::Soft).await;
        let value = value.clone();
        tasks.push(tokio::spawn(async move {
            let mut errors = Vec::new();
            for round in 0..rounds {
                // Each writer's own four keys. (Not one hot key: 100 clients replacing one key
                // at once lose CAS races, up to the client's limit of 64, whatever the heap.)
                let key = format!("writer-{writer:03}-{}", round % 4);
                if let Err(error) = client.put(key.as_bytes(), &value).await {
                    errors.push(format!("{key}: {error}"));
                }
            }
            client.close().await;
            errors
        }));
    }
    let mut errors = Vec::new();
    for task in tasks {
        errors.extend(task.await.expect("writer"));
    }
    let stats = server.stats();
    eprintln!(
        "{writers} writers x {rounds} puts on a heap of 10 chunks: {} errors; {} grants, {} extents reclaimed, {} blocks relocated",
        errors.len(),
        stats.chunk_allocations,
        stats.extents_reclaimed,
        stats.blocks_relocated
    );
    assert!(
        errors.is_empty(),
        "{} errors, first {:?}",
        errors.len(),
        errors.first()
    );
    assert!(
        stats.extents_reclaimed > 0,
        "the writes passed through the heap more than once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_index_fails_clearly_and_keeps_its_keys() {
    let mut config = ServerConfig::local(SECRET);
    config.index_size = 256;
    let (_server, client) = start(config).await;
    let mut stored = Vec::new();
    let error = loop {
        let key = format!("key-{}", stored.len());
        match client.put(key.as_bytes(), key.as_bytes()).await {
            Ok(()) => stored.push(key),
            Err(error) => break error,
        }
        assert!(stored.len() <= 32, "4 buckets hold at most 32 slots");
    };
    assert!(matches!(error, Error::TableFull { .. }), "{error}");
    assert!(
        error.to_string().contains("index_size"),
        "the error names the fix: {error}"
    );
    assert!(
        stored.len() >= 16,
        "a full index holds at least its first combined bucket's slots"
    );
    for key in &stored {
        assert_eq!(
            client.get(key.as_bytes()).await.expect("get").as_deref(),
            Some(key.as_bytes())
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_heap_fails_clearly_and_keeps_its_keys() {
    let mut config = ServerConfig::local(SECRET);
    config.heap_size = 64 * 1024;
    config.chunk_size = 16 * 1024;
    let (_server, client) = start(config).await;
    let value = vec![1u8; 4000];
    let mut stored = Vec::new();
    let error = loop {
        let key = format!("big-{}", stored.len());
        let began = std::time::Instant::now();
        match client.put(key.as_bytes(), &value).await {
            Ok(()) => stored.push(key),
            Err(error) => {
                assert!(
                    began.elapsed() < Duration::from_millis(500),
                    "nothing could come back, so TableFull comes at once, not after {:?}",
                    began.elapsed()
                );
                break error;
            }
        }
        assert!(
            stored.len() < 100,
            "one 64 KiB chunk cannot hold 100 blocks of 4 KiB"
        );
    };
    assert!(matches!(error, Error::TableFull { .. }), "{error}");
    assert!(
        error.to_string().contains("heap_size"),
        "the error names the fix: {error}"
    );
    eprintln!("{} blocks of 4,032 bytes stored", stored.len());
    assert!(
        (10..=12).contains(&stored.len()),
        "{} blocks: 48 KiB is the clients' (16 KiB is the compactor's reserve)",
        stored.len()
    );
    for key in &stored {
        assert_eq!(
            client.get(key.as_bytes()).await.expect("get").as_deref(),
            Some(value.as_slice())
        );
    }
    // Many writers of one client at once: each fails on its own, none waits its turn behind
    // the others' confirmations (they used to, 60 ms each, up to the whole deadline).
    let mut writers = Vec::new();
    for writer in 0..32 {
        let client = client.clone();
        let value = value.clone();
        writers.push(tokio::spawn(async move {
            let began = std::time::Instant::now();
            let outcome = client
                .put(format!("late-{writer}").as_bytes(), &value)
                .await;
            (outcome, began.elapsed())
        }));
    }
    for writer in writers {
        let (outcome, took) = writer.await.expect("a writer");
        assert!(
            matches!(outcome, Err(Error::TableFull { .. })),
            "{outcome:?}"
        );
        assert!(
            took < Duration::from_millis(800),
            "a writer took {took:?} to get TableFull"
        );
    }
}

/// A heap full of live data, written by several connections: the writes that find no room get
/// `TableFull` within their deadline (never a timeout), and every stored key stays readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heap_full_of_live_data_answers_table_full_within_the_deadline() {
    let mut config = ServerConfig::local(SECRET);
    config.heap_size = 8 * 16 * 1024;
    config.chunk_size = 16 * 1024;
    config.operation_deadline = Duration::from_millis(600);
    let deadline = config.operation_deadline;
    let (server, _) = start(config).await;
    let value = vec![9u8; 900];
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(connect(&server, Backend::Soft).await);
    }
    let mut stored = Vec::new();
    let mut failures = 0;
    for round in 0..400u32 {
        let client = &clients[round as usize % clients.len()];
        let key = format!("live-{round}");
        let began = std::time::Instant::now();
        match client.put(key.as_bytes(), &value).await {
            Ok(()) => stored.push(key),
            Err(error) => {
                assert!(matches!(error, Error::TableFull { .. }), "{error}");
                assert!(error.to_string().contains("heap_size"), "{error}");
                // The deadline plus a second: the bound is that a full heap answers at its
                // deadline, not after the writer's retries ran on for seconds; a loaded
                // machine (load average 3.5) took 897 ms against 600 + 200.
                assert!(
                    began.elapsed() < deadline + Duration::from_secs(1),
                    "TableFull after {:?}, past the {deadline:?} deadline",
                    began.elapsed()
                );
                failures += 1;
            }
        }
    }
    assert!(failures > 0, "the heap never filled");
    assert!(stored.len() > 50, "only {} writes fit", stored.len());
    for key in &stored {
        assert_eq!(
            clients[0]
                .get(key.as_bytes())
                .await
                .expect("get")
                .as_deref(),
            Some(value.as_slice()),
            "{key}"
        );
    }
}

/// A heap filled to the brim, then a third of its keys deleted: every chunk is about two thirds
/// live, over the compactor's usual threshold (half). With two free chunks or fewer it compacts
/// dense chunks too, so the dead third comes back and writes succeed again (found by an attack
/// run: after a killed client, a full heap of 60%-live chunks stayed full for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_heap_of_dense_chunks_gives_its_dead_bytes_back() {
    let mut config = ServerConfig::local(SECRET);
    config.heap_size = 12 * 16 * 1024;
    config.chunk_size = 16 * 1024;
    config.operation_deadline = Duration::from_millis(1500);
    let (server, client) = start(config).await;
    let value = vec![6u8; 900];
    let mut stored = 0u32;
    loop {
        match client
            .put(format!("dense-{stored:04}").as_bytes(), &value)
            .await
        {
            Ok(()) => stored += 1,
            Err(Error::TableFull { .. }) => break,
            Err(error) => panic!("filling the heap: {error}"),
        }
        assert!(stored < 1_000, "the heap never filled");
    }
    for index in (0..stored).step_by(3) {
        assert!(client
            .delete(format!("dense-{index:04}").as_bytes())
            .await
            .expect("delete"));
    }
    // Writes that find no chunk wait (chunks are on their way back) and then succeed: half of
    // what the deletes freed. (A quarter of the keys, three quarters of it, failed at times on
    // a loaded machine: the heap is then 90% live, and extents over 75% live are not compacted.)
    let began = std::time::Instant::now();
    for index in 0..stored / 6 {
        client
            .put(format!("after-{index:04}").as_bytes(), &value)
            .await
            .unwrap_or_else(|error| {
                panic!(
                    "write {index} after freeing a third, {:?} in: {error}; stats {:?}",
                    began.elapsed(),
                    server.stats()
                )
            });
    }
    for index in (1..stored).step_by(3) {
        assert_eq!(
            client
                .get(format!("dense-{index:04}").as_bytes())
                .await
                .expect("get")
                .as_deref(),
            Some(value.as_slice())
        );
    }
    eprintln!(
        "{stored} keys filled the heap; a third deleted; {} more written in {:?}; {} blocks relocated",
        stored / 6,
        began.elapsed(),
        server.stats().blocks_relocated
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_fabric_serves_the_same_store() {
    let mut config = ServerConfig::local(SECRET);
    config.fabric = Backend::Loopback;
    let (server, client) = start(config).await;
    for index in 0..1000u32 {
        client
            .put(&index.to_le_bytes(), &index.to_be_bytes())
            .await
            .expect("put");
    }
    for index in 0..1000u32 {
        assert_eq!(
            client
                .get(&index.to_le_bytes())
                .await
                .expect("get")
                .as_deref(),
            Some(&index.to_be_bytes()[..])
        );
    }
    assert_eq!(server.stats().data_path_requests, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_lived_blocks_do_not_pin_their_chunks() {
    // Every chunk written during the updates keeps about three long-lived blocks (cold keys
    // written once) among dead versions of a hot key. Without compaction each such chunk stays
    // pinned and the 8 MiB heap (128 chunks) fills after about 384 of the 450 rounds.
    let mut config = ServerConfig::local(SECRET);
    config.heap_size = 8 * 1024 * 1024;
    config.chunk_size = 64 * 1024;
    config.operation_deadline = Duration::from_millis(300);
    config.collector_interval = Duration::from_millis(20);
    let (server, client) = start(config).await;
    let value = vec![3u8; 1000];
    let rounds = 450u32;
    let mut written = 0u64;
    for round in 0..rounds {
        client
            .put(format!("cold-{round}").as_bytes(), &value)
            .await
            .unwrap_or_else(|error| panic!("round {round}: cold put: {error}"));
        for _ in 0..20 {
            client
                .put(b"hot", &value)
                .await
                .unwrap_or_else(|error| panic!("round {round}: hot put: {error}"));
        }
        written += 21 * 1088;
    }
    let stats = server.stats();
    assert!(
        written > stats.heap_size_bytes,
        "wrote {written} bytes through a {}-byte heap",
        stats.heap_size_bytes
    );
    assert!(
        stats.blocks_relocated >= 100,
        "compaction moved {} live blocks",
        stats.blocks_relocated
    );
    for round in 0..rounds {
        assert_eq!(
            client
                .get(format!("cold-{round}").as_bytes())
                .await
                .expect("get")
                .as_deref(),
            Some(value.as_slice()),
            "cold-{round} survived its moves"
        );
    }
}

/// 64 tasks of one client hammer one key: every put succeeds (writers of a key in one process
/// take turns instead of losing CAS races to each other), and 32 tasks' compare-and-swap
/// increments of one counter add up exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hot_key_under_many_writers_loses_nothing() {
    let (_server, client) = start(ServerConfig::local(SECRET)).await;
    let mut tasks = Vec::new();
    for task in 0..64u32 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            for round in 0..50u32 {
                client
                    .put(b"hot", format!("{task}:{round}").as_bytes())
                    .await
                    .expect("every put of a hot key succeeds");
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }

    client.put(b"counter", b"0").await.expect("put");
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..20 {
                // An application-level read-modify-write: retry on a mismatch.
                for _attempt in 0..10_000 {
                    let current = client.get(b"counter").await.expect("get").expect("present");
                    let value: u64 = std::str::from_utf8(&current)
                        .expect("utf-8")
                        .parse()
                        .expect("number");
                    let next = (value + 1).to_string();
                    match client
                        .compare_and_swap(b"counter", &current, next.as_bytes())
                        .await
                        .expect("compare_and_swap never gives up")
                    {
                        rdkv_client::CasOutcome::Swapped => break,
                        rdkv_client::CasOutcome::Mismatch(_) => continue,
                    }
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    let total = client.get(b"counter").await.expect("get").expect("present");
    assert_eq!(&total[..], b"640", "32 tasks × 20 increments");
}

/// `Client::cluster_stats` (what `rdkv stats` and `rdkv-cluster status` show) counts the data
/// connections, not the monitoring connection that asks. One runtime thread: the client's
/// one lane.
#[tokio::test(flavor = "current_thread")]
async fn stats_do_not_count_the_asking_connection() {
    let (_server, client) = start(ServerConfig::local(SECRET)).await;
    client.put(b"key", b"value").await.expect("put");
    let stats = client.cluster_stats().await;
    let [(_, Ok(stats))] = &stats[..] else {
        panic!("one node's stats: {stats:?}");
    };
    assert_eq!(stats.connections, 1, "the client's one data connection");
}

/// Polls the node's stats until `done` holds, for at most 10 s.
async fn wait_for_stats(
    server: &RunningServer,
    what: &str,
    done: impl Fn(&rdkv_common::protocol::ServerStats) -> bool,
) {
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let stats = server.stats();
        if done(&stats) {
            return;
        }
        assert!(
            std::time::Instant::now() < until,
            "{what}: not within 10 s (collector interval {} ms, {} passes)",
            stats.collector_interval_ms,
            stats.collector_passes
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A node whose index does not change (it serves only GETs, which it never sees, or nothing)
/// stretches its collector's interval to 8 times the base; GETs leave it stretched, and a write
/// that needs no new heap space (the digest of the scan changes) brings it back. One runtime
/// thread: one lane, whose grant the update fits (another lane's first write takes a chunk).
#[tokio::test(flavor = "current_thread")]
async fn an_idle_collector_stretches_its_interval_and_a_write_brings_it_back() {
    let mut config = ServerConfig::local(SECRET);
    // Long enough that each step of the interval is seen by polling on a loaded machine.
    config.collector_interval = Duration::from_millis(100);
    let base = config.collector_interval.as_millis() as u64;
    let stretched = base * u64::from(rdkv_server::collector::IDLE_STRETCH);
    let (server, client) = start(config).await;
    client.put(b"key", b"first").await.expect("put");
    wait_for_stats(
        &server,
        "the idle collector stretches its interval",
        |stats| stats.collector_interval_ms == stretched,
    )
    .await;
    let passes = server.stats().collector_passes;
    for _ in 0..500 {
        assert_eq!(
            client.get(b"key").await.expect("get").as_deref(),
            Some(&b"first"[..])
        );
    }
    let stats = server.stats();
    assert_eq!(
        stats.collector_interval_ms, stretched,
        "GETs do not wake the collector"
    );
    assert!(
        stats.collector_passes >= passes,
        "{} passes, then {passes}",
        stats.collector_passes
    );
    let allocations = stats.chunk_allocations;
    client.put(b"key", b"second").await.expect("update");
    assert_eq!(
        server.stats().chunk_allocations,
        allocations,
        "the update fit its grant: no heap request woke the collector"
    );
    wait_for_stats(&server, "a write brings the interval back", |stats| {
        stats.collector_interval_ms < stretched
    })
    .await;
    wait_for_stats(&server, "and it stretches again once idle", |stats| {
        stats.collector_interval_ms == stretched
    })
    .await;
}
