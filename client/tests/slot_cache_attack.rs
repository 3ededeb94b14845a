//! Adversarial tests of the process's slot cache (`client/src/connection/slot_cache.rs`,
//! `docs/protocol.md`, *Guessed blocks*): a guess must never return a wrong or stale value,
//! never make a write do the wrong thing, never break a connection, and the cache must not
//! grow memory without bound.
//!
//! Caches are shared by every client of the process with the same `slot_cache_entries`
//! setting (the raw number, not its rounding), and tests of one binary run in one process: each
//! test takes a setting of its own ([`fresh_cache`]) unless it means to share.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod support;
use support::eventually_showing;

use bytes::Bytes;
use rdkv_client::fault::{FaultInjector, Injection, Moment, Step as FaultStep, StepKind};
use rdkv_client::{CasOutcome, Client, ClientBuilder, ClientConfig, InsertOutcome, SharedMemory};
use rdkv_common::layout::{KeyLocation, TableGeometry};
use rdkv_common::ports::ReservedPorts;
use rdkv_fabric::Backend;
use rdkv_server::{RunningServer, ServerConfig};
use tokio::sync::{Notify, Semaphore};

const SECRET: &[u8] = b"slot-cache-attack-secret";

/// How a test reaches its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fabric {
    Soft,
    Loopback,
    /// The node's shm fabric (its cluster fabric is soft).
    Shm,
}

/// A distinct `slot_cache_entries` setting (8,192 entries after rounding): a cache of the
/// test's own, shared only by the clients it gives the same setting.
fn fresh_cache() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(4097);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A Unix-socket path for an shm fabric, unique in this process.
fn shm_socket_path() -> std::path::PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    std::env::temp_dir().join(format!(
        "rdkv-slot-cache-attack-{}-{}.sock",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

fn server_config(fabric: Fabric) -> ServerConfig {
    let mut config = ServerConfig::local(SECRET);
    match fabric {
        Fabric::Soft => config.fabric = Backend::Soft,
        Fabric::Loopback => config.fabric = Backend::Loopback,
        Fabric::Shm => {
            config.fabric = Backend::Soft;
            config.shm_socket = Some(shm_socket_path());
        }
    }
    config
}

/// A heap of eight 16 KiB chunks with a fast collector: space, and so slot words, recur.
fn tiny_heap_config(fabric: Fabric) -> ServerConfig {
    let mut config = server_config(fabric);
    config.chunk_size = 16 * 1024;
    config.heap_size = 8 * 16 * 1024;
    config.collector_interval = Duration::from_millis(5);
    config
}

/// A loopback control address for a node and its restart, reserved (bound, never listened on)
/// until the reservation is dropped: while the node is down between the two, no other test's
/// socket can take the port (`rdkv_common::ports`).
fn reserved_address() -> (ReservedPorts, SocketAddr) {
    let reserved = ReservedPorts::loopback(1).expect("reserve a loopback port");
    let address = reserved.addresses()[0];
    (reserved, address)
}

async fn start(config: ServerConfig) -> RunningServer {
    rdkv_server::start(config).await.expect("start server")
}

/// A client of the node at `address` with a slot cache of `entries` (0: none).
async fn connect(address: SocketAddr, fabric: Fabric, entries: usize) -> Client {
    connect_injecting(address, fabric, entries, None).await
}

/// As [`connect`], with a fault injector on its connections.
async fn connect_injecting(
    address: SocketAddr,
    fabric: Fabric,
    entries: usize,
    injector: Option<Arc<dyn FaultInjector>>,
) -> Client {
    let backend = match fabric {
        Fabric::Loopback => Backend::Loopback,
        Fabric::Soft | Fabric::Shm => Backend::Soft,
    };
    let mut config = ClientConfig::new(address, backend, SECRET);
    config.node.shared_memory = match fabric {
        Fabric::Shm => SharedMemory::Require,
        Fabric::Soft | Fabric::Loopback => SharedMemory::Off,
    };
    config.slot_cache_entries = entries;
    config.fault_injector = injector;
    Client::connect(config).await.expect("connect")
}

fn bytes(value: &str) -> Option<Bytes> {
    Some(Bytes::copy_from_slice(value.as_bytes()))
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound
    }
}

// ---------------------------------------------------------------------------------------------
// Attack 1: a node restarted at the same control address with a smaller heap. The cache still
// holds words whose blocks lie past the new heap: such a guess must never be posted (the READ
// would fail and break the connection).

async fn restart_with_a_smaller_heap(fabric: Fabric) {
    let entries = fresh_cache();
    let mut config = server_config(fabric);
    config.hash_seed = Some(0x0510_7CAC);
    config.heap_size = 4 * 1024 * 1024;
    config.chunk_size = 64 * 1024;
    let (_reserved, address) = reserved_address();
    config.control_address = address;
    let first = start(config.clone()).await;
    assert_eq!(first.control_address(), address);
    let old = connect(address, fabric, entries).await;
    // Fill well over 256 KiB of heap first (never changed again, so never compacted): the
    // targets' blocks lie past the end of a 4-chunk heap.
    let filler = vec![b'f'; 8000];
    for index in 0..48 {
        old.put(format!("filler-{index}").as_bytes(), &filler)
            .await
            .expect("put filler");
    }
    const TARGETS: usize = 8;
    for index in 0..TARGETS {
        old.put(
            format!("target-{index}").as_bytes(),
            format!("old-{index}").as_bytes(),
        )
        .await
        .expect("put target");
    }
    let before = old.counters();
    for index in 0..TARGETS {
        assert_eq!(
            old.get(format!("target-{index}").as_bytes())
                .await
                .expect("get"),
            bytes(&format!("old-{index}"))
        );
    }
    let warm = old.counters();
    assert_eq!(
        (
            warm.slot_guesses - before.slot_guesses,
            warm.slot_guess_misses - before.slot_guess_misses
        ),
        (TARGETS as u64, 0),
        "the targets' guesses are warm and true before the restart"
    );

    first.shutdown().await;
    let mut config = config.clone();
    config.control_address = address;
    config.heap_size = 4 * 64 * 1024;
    if fabric == Fabric::Shm {
        config.shm_socket = Some(shm_socket_path());
    }
    let second = start(config).await;
    assert_eq!(second.control_address(), address);

    // A new client of the same process shares the cache: its GETs of the targets find entries,
    // but every block lies past the new heap, so no guess may be posted.
    let fresh = connect(address, fabric, entries).await;
    for index in 0..TARGETS {
        assert_eq!(
            fresh
                .get(format!("target-{index}").as_bytes())
                .await
                .expect("get after restart"),
            None,
            "the restarted node is empty"
        );
    }
    let counted = fresh.counters();
    assert_eq!(
        (counted.slot_guesses, counted.reconnects, counted.failures),
        (0, 0, 0),
        "no guess past the new heap was posted, and nothing failed"
    );

    // The old client: its connection died with the first node (one reconnect per lane at
    // most), but no operation fails and no guess breaks the new connection.
    for index in 0..TARGETS {
        let key = format!("target-{index}");
        assert_eq!(
            old.get(key.as_bytes()).await.expect("old client's get"),
            None
        );
        old.put(key.as_bytes(), format!("new-{index}").as_bytes())
            .await
            .expect("old client's put");
        assert_eq!(
            old.get(key.as_bytes()).await.expect("get"),
            bytes(&format!("new-{index}"))
        );
        assert_eq!(
            fresh.get(key.as_bytes()).await.expect("get"),
            bytes(&format!("new-{index}"))
        );
    }
    let after = old.counters();
    assert_eq!(
        after.failures, warm.failures,
        "the old client failed nothing"
    );
    assert!(
        after.reconnects - warm.reconnects <= 2,
        "one reconnect per lane, no more (a broken connection reconnects again): {}",
        after.reconnects - warm.reconnects
    );
    assert!(
        after.slot_guesses > warm.slot_guesses,
        "the new blocks are guessed again"
    );
    assert!(
        fresh.counters().reconnects == 0,
        "the new client never lost its connection"
    );
}

// ---------------------------------------------------------------------------------------------
// Attack 2: a node restarted at the same address with the same table geometry, where another key
// of the same location (fingerprint and buckets) now sits in the guessed slot with the very same
// slot word (same slot, same length, same heap offset). The guess must be refused (the block
// holds another key) by every operation.

/// Two distinct keys with the same location under `geometry`.
fn colliding_keys(geometry: &TableGeometry) -> (String, String) {
    let mut seen: HashMap<(u8, [u64; 2]), String> = HashMap::new();
    for index in 0..100_000 {
        let key = format!("collide-{index:05}");
        let KeyLocation {
            fingerprint,
            combined_buckets,
        } = geometry.locate(key.as_bytes());
        if let Some(other) = seen.insert((fingerprint, combined_buckets), key.clone()) {
            return (other, key);
        }
    }
    panic!("no two keys collide");
}

async fn restart_puts_another_key_under_the_same_word(fabric: Fabric) {
    const SEED: u64 = 0x0C01_11DE;
    let entries = fresh_cache();
    let mut config = server_config(fabric);
    config.hash_seed = Some(SEED);
    config.index_size = 256; // two combined buckets: colliding keys are easy to find
    config.heap_size = 1024 * 1024;
    config.chunk_size = 64 * 1024;
    let geometry = config.geometry(SEED).expect("geometry");
    let (key, twin) = colliding_keys(&geometry);
    let (key, twin) = (key.as_bytes(), twin.as_bytes());
    // Same length: same block units, so the same slot word.
    let (value, twin_value) = (&b"value-of-the-key"[..], &b"value-of-the-twn"[..]);

    let (_reserved, address) = reserved_address();
    config.control_address = address;
    let first = start(config.clone()).await;
    assert_eq!(first.control_address(), address);
    let cached = connect(address, fabric, entries).await;
    cached.put(key, value).await.expect("put");
    assert_eq!(cached.get(key).await.expect("get").as_deref(), Some(value));
    first.shutdown().await;

    let mut config = config.clone();
    config.control_address = address;
    if fabric == Fabric::Shm {
        config.shm_socket = Some(shm_socket_path());
    }
    let _second = start(config).await;
    // The twin is the new node's first write: the first slot of the same bucket, the first
    // block of the first grant, as the key was on the first node.
    let uncached = connect(address, fabric, 0).await;
    uncached.put(twin, twin_value).await.expect("put twin");

    // The cache entry is the location's: a GET of the twin guesses the key's old word. That it
    // holds shows the attack is set up: the slot holds exactly the word the key had.
    let before = cached.counters();
    assert_eq!(
        cached.get(twin).await.expect("get twin").as_deref(),
        Some(twin_value)
    );
    let after = cached.counters();
    let (guesses, misses) = (
        after.slot_guesses - before.slot_guesses,
        after.slot_guess_misses - before.slot_guess_misses,
    );
    assert_eq!(guesses, 1, "the twin's GET guessed from the key's entry");
    let same_word = misses == 0;

    // Every operation on the key, each with the twin's word as its guess (re-warmed by a GET
    // of the twin, since a lookup that finds the key absent forgets the entry).
    let warm = || async {
        assert_eq!(
            cached.get(twin).await.expect("get twin").as_deref(),
            Some(twin_value)
        );
    };
    let before = cached.counters();
    assert_eq!(
        cached.get(key).await.expect("get key"),
        None,
        "a GET of the key must not return the twin's value"
    );
    warm().await;
    assert!(
        !cached.update(key, b"updated").await.expect("update"),
        "an update of the absent key must not replace the twin"
    );
    warm().await;
    assert!(
        !cached.delete(key).await.expect("delete"),
        "a delete of the absent key must not remove the twin"
    );
    warm().await;
    assert_eq!(
        cached
            .compare_and_swap(key, twin_value, b"hijacked")
            .await
            .expect("cas"),
        CasOutcome::Mismatch(None),
        "a CAS of the absent key expecting the twin's value must not swap the twin"
    );
    warm().await;
    assert_eq!(
        cached
            .compare_and_swap_expecting(key, None, b"now-present")
            .await
            .expect("cas expecting absent"),
        CasOutcome::Swapped
    );
    let counted = cached.counters();
    assert!(
        counted.slot_guesses - before.slot_guesses >= 5,
        "each operation on the key guessed"
    );
    assert_eq!(
        uncached.get(twin).await.expect("get twin").as_deref(),
        Some(twin_value),
        "the twin is untouched"
    );
    assert_eq!(
        uncached.get(key).await.expect("get key").as_deref(),
        Some(&b"now-present"[..])
    );
    // And the key and the twin, both present, alternate in the one entry they share.
    for round in 0..20 {
        let (client, label) = if round % 2 == 0 {
            (&cached, "cached")
        } else {
            (&uncached, "uncached")
        };
        assert_eq!(
            client.get(key).await.expect("get").as_deref(),
            Some(&b"now-present"[..]),
            "{label}"
        );
        assert_eq!(
            cached.get(twin).await.expect("get").as_deref(),
            Some(twin_value)
        );
    }
    assert_eq!(
        cached.insert_or_get(twin, b"other").await.expect("insert"),
        InsertOutcome::Present(Bytes::copy_from_slice(twin_value))
    );
    eprintln!(
        "restart collision ({fabric:?}): the twin's slot held the key's exact word: {same_word}"
    );
    assert!(
        same_word,
        "set-up: the twin landed under the key's exact slot word (same slot, same offset)"
    );
}

// ---------------------------------------------------------------------------------------------
// Attack 3: a node restarted at the same address with another hash seed and a smaller index.

async fn restart_with_another_table(fabric: Fabric) {
    let entries = fresh_cache();
    let mut config = server_config(fabric);
    config.hash_seed = Some(1);
    let (_reserved, address) = reserved_address();
    config.control_address = address;
    let first = start(config.clone()).await;
    assert_eq!(first.control_address(), address);
    let old = connect(address, fabric, entries).await;
    const KEYS: usize = 200;
    for index in 0..KEYS {
        old.put(
            format!("key-{index}").as_bytes(),
            format!("first-{index}").as_bytes(),
        )
        .await
        .expect("put");
    }
    first.shutdown().await;

    let mut config = config.clone();
    config.control_address = address;
    config.hash_seed = Some(2);
    config.index_size = 64 * 1024;
    if fabric == Fabric::Shm {
        config.shm_socket = Some(shm_socket_path());
    }
    let _second = start(config).await;
    let fresh = connect(address, fabric, entries).await;
    let uncached = connect(address, fabric, 0).await;
    // The new node holds other keys with the same value lengths, written in reverse.
    for index in (0..KEYS).rev() {
        if index % 2 == 0 {
            uncached
                .put(
                    format!("key-{}", KEYS - 1 - index).as_bytes(),
                    format!("secnd-{index}").as_bytes(),
                )
                .await
                .expect("put");
        }
    }
    for client in [&old, &fresh, &old] {
        for index in 0..KEYS {
            let expected = if (KEYS - 1 - index) % 2 == 0 {
                bytes(&format!("secnd-{}", KEYS - 1 - index))
            } else {
                None
            };
            assert_eq!(
                client
                    .get(format!("key-{index}").as_bytes())
                    .await
                    .expect("get"),
                expected,
                "key-{index}"
            );
        }
    }
    assert_eq!(fresh.counters().failures, 0);
    assert_eq!(fresh.counters().reconnects, 0);
}

// ---------------------------------------------------------------------------------------------
// Attack 4: heap reuse. One key, same-length values, a tiny heap with a fast collector: the same
// slot word comes back pointing at reused space again and again. A reader with a warm cache
// (shared with one of the writers) must never read a value older than the last write
// acknowledged before its read began, nor older than what it read before, nor a value while the
// key is deleted; an uncached client deletes and reinserts it every seventh step.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Insert,
    Update,
    Delete,
}

fn step_kind(step: u64) -> Step {
    match step % 7 {
        0 => Step::Insert,
        6 => Step::Delete,
        _ => Step::Update,
    }
}

fn step_value(step: u64) -> String {
    format!("{step:016}")
}

async fn a_warm_reader_never_goes_back(fabric: Fabric) {
    let entries = fresh_cache();
    let server = start(tiny_heap_config(fabric)).await;
    let address = server.control_address();
    let reader = Arc::new(connect(address, fabric, entries).await);
    let writer = Arc::new(connect(address, fabric, entries).await);
    let uncached = Arc::new(connect(address, fabric, 0).await);
    const KEY: &[u8] = b"hot";
    assert!(uncached
        .insert(KEY, step_value(0).as_bytes())
        .await
        .expect("insert"));

    let started = Arc::new(AtomicU64::new(0));
    let acked = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    const RUN: Duration = Duration::from_millis(1500);
    const MAX_STEPS: u64 = 40_000;
    let writing = {
        let (writer, uncached) = (writer.clone(), uncached.clone());
        let (started, acked, done) = (started.clone(), acked.clone(), done.clone());
        tokio::spawn(async move {
            let begun = Instant::now();
            let mut step = 0;
            while step < MAX_STEPS && begun.elapsed() < RUN {
                step += 1;
                started.store(step, Ordering::SeqCst);
                let value = step_value(step);
                let client = if step % 2 == 0 { &writer } else { &uncached };
                match step_kind(step) {
                    Step::Delete => assert!(
                        uncached.delete(KEY).await.expect("delete"),
                        "step {step}: the key was present"
                    ),
                    Step::Insert => assert!(
                        client.insert(KEY, value.as_bytes()).await.expect("insert"),
                        "step {step}: the key was absent"
                    ),
                    Step::Update => assert!(
                        client.update(KEY, value.as_bytes()).await.expect("update"),
                        "step {step}: the key was present"
                    ),
                }
                acked.store(step, Ordering::SeqCst);
            }
            done.store(true, Ordering::SeqCst);
            step
        })
    };
    let reading = {
        let reader = reader.clone();
        let (started, acked, done) = (started.clone(), acked.clone(), done.clone());
        tokio::spawn(async move {
            // The state is known to be at least this step.
            let mut lower = 0u64;
            let mut reads = 0u64;
            let mut absent = 0u64;
            while !done.load(Ordering::SeqCst) {
                let floor = acked.load(Ordering::SeqCst);
                let got = reader.get(KEY).await.expect("get");
                let ceiling = started.load(Ordering::SeqCst);
                let bound = floor.max(lower);
                reads += 1;
                match got {
                    Some(value) => {
                        let text = std::str::from_utf8(&value).expect("utf-8");
                        let step: u64 = text.parse().expect("a step number");
                        assert!(
                            step >= bound && step <= ceiling && step_kind(step) != Step::Delete,
                            "read {step}, but the read began after step {floor} was acknowledged, an earlier read saw step {lower}, and step {ceiling} was the newest begun"
                        );
                        lower = step;
                    }
                    None => {
                        // Some delete step in [bound, ceiling].
                        let delete =
                            (bound..=ceiling).find(|&step| step_kind(step) == Step::Delete);
                        assert!(
                            delete.is_some(),
                            "read the key absent, but no delete step lies in [{bound}, {ceiling}] (acknowledged {floor}, seen {lower})"
                        );
                        lower = delete.expect("checked");
                        absent += 1;
                    }
                }
            }
            (reads, absent)
        })
    };
    let steps = writing.await.expect("the writer ran");
    let (reads, absent) = reading.await.expect("the reader ran");
    let counted = reader.counters();
    eprintln!(
        "heap reuse ({fabric:?}): {steps} steps, {reads} reads ({absent} absent), {} guesses, {} stale, reclaimed chunks: {:?}",
        counted.slot_guesses,
        counted.slot_guess_misses,
        server.stats()
    );
    assert!(steps > 100 && reads > 50, "{steps} steps, {reads} reads");
    assert!(
        counted.slot_guesses > counted.slot_guess_misses,
        "some guesses held: {} guesses, {} stale",
        counted.slot_guesses,
        counted.slot_guess_misses
    );
    assert_eq!(
        counted.failures + writer.counters().failures + uncached.counters().failures,
        0
    );
    // The final state, through every client.
    let last = started.load(Ordering::SeqCst);
    let expected = match step_kind(last) {
        Step::Delete => None,
        _ => bytes(&step_value(last)),
    };
    for client in [&reader, &writer, &uncached] {
        assert_eq!(client.get(KEY).await.expect("get"), expected);
    }
}

// ---------------------------------------------------------------------------------------------
// Attack 4b: a counter incremented by compare-and-swap from tasks of two clients sharing a
// cache and of an uncached one, on a tiny heap that reuses space (the same slot word recurs).
// Each Mismatch's value is the next expectation (no GET in between), so stale guesses meet the
// CAS directly. Every swap must be an increment of the current value: the final count equals
// the swaps, and no task ever sees the counter go back.

async fn a_counter_incremented_by_compare_and_swap(fabric: Fabric) {
    let entries = fresh_cache();
    let server = start(tiny_heap_config(fabric)).await;
    let address = server.control_address();
    let clients = [
        Arc::new(connect(address, fabric, entries).await),
        Arc::new(connect(address, fabric, entries).await),
        Arc::new(connect(address, fabric, 0).await),
    ];
    const KEY: &[u8] = b"counter";
    let encode = |count: u64| format!("{count:016}");
    let decode = |value: &[u8]| -> u64 {
        std::str::from_utf8(value)
            .expect("utf-8")
            .parse()
            .expect("a count")
    };
    clients[2]
        .put(KEY, encode(0).as_bytes())
        .await
        .expect("put");
    const RUN: Duration = Duration::from_millis(1200);
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..6usize {
        let client = clients[task % 3].clone();
        tasks.spawn(async move {
            let begun = Instant::now();
            let mut swaps = 0u64;
            let mut seen = decode(&client.get(KEY).await.expect("get").expect("present"));
            let mut attempts = 0;
            while begun.elapsed() < RUN && attempts < 20_000 {
                attempts += 1;
                let outcome = client
                    .compare_and_swap(KEY, encode(seen).as_bytes(), encode(seen + 1).as_bytes())
                    .await
                    .expect("cas");
                match outcome {
                    CasOutcome::Swapped => {
                        swaps += 1;
                        seen += 1;
                    }
                    CasOutcome::Mismatch(Some(value)) => {
                        let now = decode(&value);
                        assert!(
                            now > seen,
                            "task {task}: a mismatch showed {now} after this task saw {seen}"
                        );
                        seen = now;
                    }
                    CasOutcome::Mismatch(None) => panic!("task {task}: the counter vanished"),
                }
            }
            swaps
        });
    }
    let mut swaps = 0;
    while let Some(joined) = tasks.join_next().await {
        swaps += joined.expect("a task ran");
    }
    let guessed = clients[0].counters().slot_guesses + clients[1].counters().slot_guesses;
    eprintln!("counter ({fabric:?}): {swaps} swaps, {guessed} guesses");
    assert!(
        swaps > 50 && guessed > 0,
        "{swaps} swaps, {guessed} guesses"
    );
    for client in &clients {
        assert_eq!(
            client
                .get(KEY)
                .await
                .expect("get")
                .map(|value| decode(&value)),
            Some(swaps),
            "every swap was one increment"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Attack 4c: the server's compactor moves live blocks (CASing their slots to the copies) and the
// emptied segments are reused, while a reader with a warm cache reads the moved keys and a
// cached writer compare-and-swaps them expecting the values it wrote.

async fn compaction_under_warm_guesses(fabric: Fabric) {
    let entries = fresh_cache();
    let mut config = server_config(fabric);
    config.chunk_size = 16 * 1024;
    config.heap_size = 16 * 16 * 1024;
    config.collector_interval = Duration::from_millis(5);
    let server = start(config).await;
    let address = server.control_address();
    let reader = connect(address, fabric, entries).await;
    let writer = connect(address, fabric, entries).await;
    let uncached = connect(address, fabric, 0).await;
    const SURVIVORS: usize = 48;
    let value = |key: usize, version: u64| format!("{key:04}-{version:08}-{}", "s".repeat(180));
    // Survivors interleaved with fillers (in the same grants) that are then deleted: sparse
    // segments.
    for index in 0..SURVIVORS {
        writer
            .put(
                format!("survivor-{index}").as_bytes(),
                value(index, 0).as_bytes(),
            )
            .await
            .expect("put");
        for filler in 0..3 {
            writer
                .put(format!("filler-{index}-{filler}").as_bytes(), &[b'f'; 200])
                .await
                .expect("put filler");
        }
    }
    for index in 0..SURVIVORS {
        for filler in 0..3 {
            assert!(uncached
                .delete(format!("filler-{index}-{filler}").as_bytes())
                .await
                .expect("delete filler"));
        }
    }
    let mut versions = vec![0u64; SURVIVORS];
    let begun = Instant::now();
    let mut rounds = 0u64;
    let mut churn = 0u64;
    let mut first_moved: Option<Instant> = None;
    while begun.elapsed() < Duration::from_secs(3) {
        rounds += 1;
        for (index, version) in versions.iter_mut().enumerate() {
            let key = format!("survivor-{index}");
            assert_eq!(
                reader.get(key.as_bytes()).await.expect("get"),
                bytes(&value(index, *version)),
                "{key} in round {rounds}"
            );
            if index < 4 && rounds % 4 == 0 {
                let next = *version + 1;
                assert_eq!(
                    writer
                        .compare_and_swap(
                            key.as_bytes(),
                            value(index, *version).as_bytes(),
                            value(index, next).as_bytes()
                        )
                        .await
                        .expect("cas"),
                    CasOutcome::Swapped,
                    "{key} in round {rounds}"
                );
                *version = next;
            }
        }
        // Churn keeps segments filling and emptying, so moved blocks' space is reused.
        for _ in 0..32 {
            churn += 1;
            uncached
                .put(format!("churn-{}", churn % 16).as_bytes(), &[b'c'; 200])
                .await
                .expect("churn");
        }
        // Go on a little after the first moves: the emptied segments are reused meanwhile.
        if server.stats().blocks_relocated > 0 {
            let first = *first_moved.get_or_insert_with(Instant::now);
            if first.elapsed() > Duration::from_millis(400) {
                break;
            }
        }
    }
    let stats = server.stats();
    let counted = reader.counters();
    eprintln!(
        "compaction ({fabric:?}): {rounds} rounds, {} blocks relocated, {} extents reclaimed, reader {} guesses {} stale",
        stats.blocks_relocated, stats.extents_reclaimed, counted.slot_guesses, counted.slot_guess_misses
    );
    assert!(
        stats.blocks_relocated > 0,
        "set-up: the compactor moved blocks under the cache"
    );
    assert!(counted.slot_guesses > counted.slot_guess_misses);
    // Over shm a direct GET follows a moved block's new word without a stale guess.
    assert!(
        fabric == Fabric::Shm || counted.slot_guess_misses > 0,
        "moves made guesses stale"
    );
}

// ---------------------------------------------------------------------------------------------
// Attack 5: clients of one process share the cache; a third, uncached, client changes keys
// under them. A random sequence of every operation by all three, checked against a model.

/// Runs `operations` random operations on keys `prefix-0 .. prefix-{keys}` by `clients`
/// (chosen at random), checking each outcome against a model of the table.
async fn random_operations(
    clients: &[&Client],
    prefix: &str,
    keys: u64,
    operations: u64,
    seed: u64,
) {
    let mut rng = Rng(seed | 1);
    let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
    for operation in 0..operations {
        let client = clients[rng.below(clients.len() as u64) as usize];
        let index = rng.below(keys);
        let key = format!("{prefix}-{index}");
        let key = key.as_bytes();
        // A few value lengths, so that blocks of one length recur.
        let value = format!(
            "{operation:0width$}",
            width = [4, 4, 20, 100][rng.below(4) as usize]
        )
        .into_bytes();
        let current = model.get(&index).cloned();
        let what = rng.below(8);
        let context = format!(
            "operation {operation} ({what}) on {prefix}-{index}, model {:?}",
            current.as_deref().map(String::from_utf8_lossy)
        );
        match what {
            0 | 1 => assert_eq!(
                client.get(key).await.expect("get").as_deref(),
                current.as_deref(),
                "get: {context}"
            ),
            2 => {
                client.put(key, &value).await.expect("put");
                model.insert(index, value);
            }
            3 => {
                assert_eq!(
                    client.delete(key).await.expect("delete"),
                    current.is_some(),
                    "delete: {context}"
                );
                model.remove(&index);
            }
            4 => {
                let outcome = client.insert_or_get(key, &value).await.expect("insert");
                match &current {
                    Some(present) => assert_eq!(
                        outcome,
                        InsertOutcome::Present(Bytes::copy_from_slice(present)),
                        "insert: {context}"
                    ),
                    None => {
                        assert_eq!(outcome, InsertOutcome::Inserted, "insert: {context}");
                        model.insert(index, value);
                    }
                }
            }
            5 => {
                assert_eq!(
                    client.update(key, &value).await.expect("update"),
                    current.is_some(),
                    "update: {context}"
                );
                if current.is_some() {
                    model.insert(index, value);
                }
            }
            6 => {
                // Expecting the current value half of the time, a stale one otherwise.
                let expected: Vec<u8> = match (&current, rng.below(2)) {
                    (Some(present), 0) => present.clone(),
                    _ => b"not-the-value".to_vec(),
                };
                let outcome = client
                    .compare_and_swap(key, &expected, &value)
                    .await
                    .expect("cas");
                if current.as_deref() == Some(&expected[..]) {
                    assert_eq!(outcome, CasOutcome::Swapped, "cas: {context}");
                    model.insert(index, value);
                } else {
                    assert_eq!(
                        outcome,
                        CasOutcome::Mismatch(current.as_deref().map(Bytes::copy_from_slice)),
                        "cas: {context}"
                    );
                }
            }
            _ => {
                let outcome = client
                    .compare_and_swap_expecting(key, None, &value)
                    .await
                    .expect("cas expecting absent");
                match &current {
                    Some(present) => assert_eq!(
                        outcome,
                        CasOutcome::Mismatch(Some(Bytes::copy_from_slice(present))),
                        "cas expecting absent: {context}"
                    ),
                    None => {
                        assert_eq!(
                            outcome,
                            CasOutcome::Swapped,
                            "cas expecting absent: {context}"
                        );
                        model.insert(index, value);
                    }
                }
            }
        }
    }
}

async fn clients_sharing_the_cache(fabric: Fabric) {
    let entries = fresh_cache();
    let server = start(server_config(fabric)).await;
    let address = server.control_address();
    let first = connect(address, fabric, entries).await;
    let second = connect(address, fabric, entries).await;
    let uncached = connect(address, fabric, 0).await;
    const KEYS: usize = 150;
    for index in 0..KEYS {
        first
            .put(
                format!("shared-{index}").as_bytes(),
                format!("first-{index}").as_bytes(),
            )
            .await
            .expect("put");
    }
    // The first client's writes warm the second's guesses.
    for index in 0..KEYS {
        assert_eq!(
            second
                .get(format!("shared-{index}").as_bytes())
                .await
                .expect("get"),
            bytes(&format!("first-{index}"))
        );
    }
    let counted = second.counters();
    assert!(
        counted.slot_guesses >= KEYS as u64 - 5 && counted.slot_guess_misses == 0,
        "the second client guessed from the first's writes: {} guesses, {} stale",
        counted.slot_guesses,
        counted.slot_guess_misses
    );
    // The uncached client changes them under both.
    for index in 0..KEYS {
        let key = format!("shared-{index}");
        match index % 3 {
            0 => uncached
                .put(key.as_bytes(), format!("third-{index}").as_bytes())
                .await
                .expect("put"),
            1 => assert!(uncached.delete(key.as_bytes()).await.expect("delete")),
            _ => {}
        }
    }
    let expected = |index: usize| match index % 3 {
        0 => bytes(&format!("third-{index}")),
        1 => None,
        _ => bytes(&format!("first-{index}")),
    };
    for client in [&first, &second] {
        for index in 0..KEYS {
            assert_eq!(
                client
                    .get(format!("shared-{index}").as_bytes())
                    .await
                    .expect("get"),
                expected(index),
                "shared-{index}"
            );
        }
    }
    random_operations(&[&first, &second, &uncached], "random", 40, 1500, 0xA11CE).await;
}

// ---------------------------------------------------------------------------------------------
// Attack 6: a cache of two entries (one set) for hundreds of keys, shared by two clients and by
// concurrent tasks: entries are evicted, and rewritten under concurrent guesses (an entry read
// while it is rewritten mixes two keys' position and word).

async fn a_two_entry_cache(fabric: Fabric) {
    // Only this test asks for 2 entries.
    let server = start(server_config(fabric)).await;
    let address = server.control_address();
    let first = Arc::new(connect(address, fabric, 2).await);
    let second = Arc::new(connect(address, fabric, 2).await);
    let uncached = Arc::new(connect(address, fabric, 0).await);
    for index in 0..300 {
        first
            .put(
                format!("tiny-{index}").as_bytes(),
                format!("v-{index}").as_bytes(),
            )
            .await
            .expect("put");
    }
    for client in [&second, &first] {
        for index in 0..300 {
            assert_eq!(
                client
                    .get(format!("tiny-{index}").as_bytes())
                    .await
                    .expect("get"),
                bytes(&format!("v-{index}"))
            );
        }
    }
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..4u64 {
        let (first, second, uncached) = (first.clone(), second.clone(), uncached.clone());
        tasks.spawn(async move {
            random_operations(
                &[&*first, &*second, &*uncached],
                &format!("task{task}"),
                12,
                400,
                0x7E57 + task,
            )
            .await;
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.expect("a task's operations all matched the model");
    }
    let counted = first.counters();
    assert!(counted.slot_guesses > 0, "the tiny cache was used");
}

// ---------------------------------------------------------------------------------------------
// Attack 7: every write with a stale guess returns the outcome of the current value.

async fn stale_guesses_give_current_outcomes(fabric: Fabric) {
    let entries = fresh_cache();
    let server = start(server_config(fabric)).await;
    let address = server.control_address();
    let cached = connect(address, fabric, entries).await;
    let uncached = connect(address, fabric, 0).await;
    const KEY: &[u8] = b"stale";
    let warm = || async {
        let value = cached.get(KEY).await.expect("warm get");
        assert!(value.is_some(), "warmed on a present key");
    };

    cached.put(KEY, b"one").await.expect("put");
    warm().await;
    uncached.put(KEY, b"two").await.expect("put");
    assert_eq!(
        cached
            .compare_and_swap(KEY, b"one", b"x")
            .await
            .expect("cas"),
        CasOutcome::Mismatch(bytes("two")),
        "CAS expecting the cached value sees the current one"
    );
    uncached.put(KEY, b"three").await.expect("put");
    assert_eq!(
        cached.insert_or_get(KEY, b"x").await.expect("insert"),
        InsertOutcome::Present(Bytes::from_static(b"three"))
    );
    uncached.put(KEY, b"four").await.expect("put");
    assert_eq!(
        cached
            .compare_and_swap(KEY, b"four", b"five")
            .await
            .expect("cas"),
        CasOutcome::Swapped,
        "CAS expecting the current value under a stale guess swaps"
    );
    assert_eq!(uncached.get(KEY).await.expect("get"), bytes("five"));

    warm().await;
    assert!(uncached.delete(KEY).await.expect("delete"));
    assert!(
        !cached.update(KEY, b"x").await.expect("update"),
        "update of a deleted key"
    );
    assert_eq!(uncached.get(KEY).await.expect("get"), None);

    cached.put(KEY, b"six").await.expect("put");
    warm().await;
    assert!(uncached.delete(KEY).await.expect("delete"));
    assert!(
        !cached.delete(KEY).await.expect("delete"),
        "delete of a deleted key"
    );

    cached.put(KEY, b"seven").await.expect("put");
    warm().await;
    assert!(uncached.delete(KEY).await.expect("delete"));
    assert_eq!(
        cached
            .compare_and_swap(KEY, b"seven", b"x")
            .await
            .expect("cas"),
        CasOutcome::Mismatch(None)
    );

    cached.put(KEY, b"eight").await.expect("put");
    warm().await;
    assert!(uncached.delete(KEY).await.expect("delete"));
    assert!(
        cached.insert(KEY, b"nine").await.expect("insert"),
        "insert of a deleted key"
    );
    assert_eq!(uncached.get(KEY).await.expect("get"), bytes("nine"));

    // Deleted and reinserted (same length: a block of the same size) behind the cache.
    warm().await;
    assert!(uncached.delete(KEY).await.expect("delete"));
    assert!(uncached.insert(KEY, b"tenn").await.expect("insert"));
    assert_eq!(
        cached
            .compare_and_swap_expecting(KEY, None, b"x")
            .await
            .expect("cas"),
        CasOutcome::Mismatch(bytes("tenn"))
    );
    warm().await;
    assert!(uncached.delete(KEY).await.expect("delete"));
    assert!(uncached.insert(KEY, b"elvn").await.expect("insert"));
    assert!(cached.update(KEY, b"twelve").await.expect("update"));
    assert_eq!(uncached.get(KEY).await.expect("get"), bytes("twelve"));
    warm().await;
    assert!(uncached.delete(KEY).await.expect("delete"));
    assert!(uncached.insert(KEY, b"thirteen").await.expect("insert"));
    assert!(cached.delete(KEY).await.expect("delete"));
    assert_eq!(uncached.get(KEY).await.expect("get"), None);
    assert_eq!(cached.get(KEY).await.expect("get"), None);
    let counted = cached.counters();
    assert!(
        counted.slot_guess_misses >= 8,
        "the writes met stale guesses: {} guesses, {} stale",
        counted.slot_guesses,
        counted.slot_guess_misses
    );
}

// ---------------------------------------------------------------------------------------------
// Attack 8: memory. Caches of distinct sizes come and go with their clients; each must be freed
// when its last client is, so a process that makes clients of ever new settings does not grow.

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .expect("resident pages")
        .parse()
        .expect("a number");
    pages * 4096
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caches_are_freed_with_their_clients() {
    const ENTRIES: usize = 1 << 22; // 96 MiB each
    let server = start(server_config(Fabric::Loopback)).await;
    let address = server.control_address();
    let baseline = resident_bytes();
    for round in 0..4usize {
        // A distinct setting each round (all round up to 2^22 entries): a cache of its own.
        let client = connect(address, Fabric::Loopback, ENTRIES - 1 - round).await;
        client.put(b"memory", b"value").await.expect("put");
        assert_eq!(
            client.get(b"memory").await.expect("get").as_deref(),
            Some(&b"value"[..])
        );
        assert!(
            client.counters().slot_guesses >= 1,
            "the cache was allocated and used"
        );
        if round == 0 {
            let grown = resident_bytes().saturating_sub(baseline);
            assert!(
                grown >= 64 * 1024 * 1024,
                "set-up: a 96 MiB cache shows in the resident size (grew {grown} bytes)"
            );
        }
        client.close().await;
        drop(client);
    }
    // Leaked, four caches would be 384 MiB.
    eventually_showing(
        "the caches of dropped clients are freed",
        resident_bytes,
        |&now| now < baseline + 160 * 1024 * 1024,
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// Attack 9: a replicated cluster. Replicated writes neither use nor update guesses (they lock
// and replace slots, and write tombstones on delete); GETs read the primary with a guess. Two
// cluster clients of the process (sharing the default cache) and concurrent tasks, checked
// against a model.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_writes_under_guessing_readers() {
    let nodes = support::replicas::start_three(SECRET).await;
    let addresses: Vec<SocketAddr> = nodes.iter().map(RunningServer::control_address).collect();
    let mut cluster = support::cluster("slot-cache-attack", SECRET, Backend::Soft, &addresses);
    cluster.replicas = 2;
    let first = Arc::new(
        ClientBuilder::cluster(&cluster)
            .build()
            .expect("a cluster client"),
    );
    let second = Arc::new(
        ClientBuilder::cluster(&cluster)
            .build()
            .expect("a cluster client"),
    );
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..3u64 {
        let (first, second) = (first.clone(), second.clone());
        tasks.spawn(async move {
            random_operations(
                &[&*first, &*second],
                &format!("replicated{task}"),
                10,
                250,
                0xBEEF + task,
            )
            .await;
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.expect("a task's operations all matched the model");
    }
    let counted = first.counters();
    assert!(
        counted.slot_guesses > 0,
        "replicated GETs guessed: {} guesses, {} stale",
        counted.slot_guesses,
        counted.slot_guess_misses
    );
}

// ---------------------------------------------------------------------------------------------
// Attack 10: narrow guesses (a GET READs only the guessed slot's word and the block) and their
// chase (a stale word is followed once to the word the slot now holds). Keys of one location
// (fingerprint and buckets) share one cache entry, so the word in the guessed slot can be a
// twin's, a tentative reservation, or the very word just disproved.

/// Holds the first step of `kind` of `operation`, after it ran, until the test adds a permit.
#[derive(Debug)]
struct HoldAfter {
    /// The operation to hold (`insert`, `put`, ...).
    operation: &'static str,
    /// The step after which it is held.
    kind: StepKind,
    /// Released by the test.
    gate: Arc<Semaphore>,
    /// Set once an operation is held.
    held: Mutex<bool>,
    /// Told when it holds one.
    reached: Arc<Notify>,
}

impl HoldAfter {
    fn new(operation: &'static str, kind: StepKind) -> Self {
        Self {
            operation,
            kind,
            gate: Arc::new(Semaphore::new(0)),
            held: Mutex::new(false),
            reached: Arc::new(Notify::new()),
        }
    }
}

impl FaultInjector for HoldAfter {
    fn inject(&self, step: &FaultStep) -> Injection {
        if step.operation != self.operation
            || step.kind != self.kind
            || step.moment != Moment::After
        {
            return Injection::Proceed;
        }
        let mut held = self.held.lock().expect("held");
        if *held {
            return Injection::Proceed;
        }
        *held = true;
        self.reached.notify_one();
        Injection::WaitFor(self.gate.clone())
    }
}

/// A server whose table has two combined buckets (colliding keys are easy to find), and two
/// distinct keys of one location under it.
fn twin_server(fabric: Fabric, seed: u64) -> (ServerConfig, String, String) {
    let mut config = server_config(fabric);
    config.hash_seed = Some(seed);
    config.index_size = 256;
    config.heap_size = 1024 * 1024;
    config.chunk_size = 64 * 1024;
    let geometry = config.geometry(seed).expect("geometry");
    let (key, twin) = colliding_keys(&geometry);
    (config, key, twin)
}

/// GETs by direct access (`client/src/connection/direct_get.rs`) serve warm reads over `shm`
/// only, and always with the current value: after the key's update by another client (whose
/// new block the direct GET follows from the slot's new word), after its delete, and after its
/// reinsert. Over `soft` and `loopback` no GET is direct.
async fn direct_gets_serve_warm_reads_over_shm_only(fabric: Fabric) {
    let server = start(server_config(fabric)).await;
    let address = server.control_address();
    let entries = fresh_cache();
    let reader = connect(address, fabric, entries).await;
    // Its own cache: its writes never teach the reader's cache the new words.
    let writer = connect(address, fabric, fresh_cache()).await;
    let keys: Vec<String> = (0..64).map(|index| format!("direct-{index}")).collect();
    for key in &keys {
        writer
            .put(key.as_bytes(), key.as_bytes())
            .await
            .expect("put");
        // Cold: the ordinary GET reads the buckets and teaches the cache.
        assert_eq!(reader.get(key.as_bytes()).await.expect("get"), bytes(key));
    }
    let before = reader.counters().direct_gets;
    // Rounds until some GET was direct: a thread's lane may still be opening on a loaded
    // machine (its GETs then go by lists on another lane), bounded.
    for _ in 0..50 {
        for key in &keys {
            assert_eq!(reader.get(key.as_bytes()).await.expect("get"), bytes(key));
        }
        if reader.counters().direct_gets > before || fabric != Fabric::Shm {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let warm = reader.counters().direct_gets - before;
    if fabric != Fabric::Shm {
        assert_eq!(warm, 0, "no direct access over {fabric:?}");
        return;
    }
    // Direct access is taken when it can be (the thread's lane connected, its queue pair
    // idle: not, say, while the announce flusher's WRITE runs), so not necessarily by all.
    assert!(warm > 0, "warm GETs are direct over shm");
    for (round, key) in keys.iter().enumerate() {
        let value = format!("{key}-updated-{round}");
        writer
            .put(key.as_bytes(), value.as_bytes())
            .await
            .expect("update");
        assert_eq!(
            reader.get(key.as_bytes()).await.expect("get"),
            bytes(&value),
            "after an update the reader did not see"
        );
    }
    for key in &keys[..8] {
        writer.delete(key.as_bytes()).await.expect("delete");
        assert_eq!(reader.get(key.as_bytes()).await.expect("get"), None);
        writer
            .put(key.as_bytes(), b"again")
            .await
            .expect("reinsert");
        assert_eq!(
            reader.get(key.as_bytes()).await.expect("get"),
            bytes("again")
        );
    }
    assert!(
        reader.counters().direct_gets - before > warm,
        "updated keys are followed directly"
    );
    server.shutdown().await;
}

/// The GET's round trips, guesses and stale guesses, with its value.
async fn counted_get(client: &Client, key: &[u8]) -> (Option<Bytes>, u64, u64, u64) {
    let before = client.counters();
    let value = client.get(key).await.expect("get");
    let after = client.counters();
    (
        value,
        after.get_round_trips - before.get_round_trips,
        after.slot_guesses - before.slot_guesses,
        after.slot_guess_misses - before.slot_guess_misses,
    )
}

/// The guessed slot holds, in turn: a tentative reservation of the key's own reinsert (invisible:
/// never chased, never read as present), the reinserted key's word (chased), and a twin's word
/// (plausible, so chased, but its block holds the twin: never returned for the key).
async fn a_chase_never_returns_a_reservation_or_a_twin(fabric: Fabric) {
    let (config, key, twin) = twin_server(fabric, 0x7A1_5EED);
    let (key, twin) = (key.as_bytes(), twin.as_bytes());
    let server = start(config).await;
    let address = server.control_address();
    let cached = connect(address, fabric, fresh_cache()).await;
    let uncached = connect(address, fabric, 0).await;
    let hold = Arc::new(HoldAfter::new("insert", StepKind::PlaceTentative));
    let holding = Arc::new(connect_injecting(address, fabric, 0, Some(hold.clone())).await);

    assert!(uncached.insert(key, b"first").await.expect("insert"));
    assert_eq!(cached.get(key).await.expect("warm"), bytes("first"));
    let (value, round_trips, guesses, misses) = counted_get(&cached, key).await;
    assert_eq!(
        (value, round_trips, guesses, misses),
        (bytes("first"), 1, 1, 0),
        "set-up: a held narrow guess"
    );

    // Deleted, and its reinsert holds a tentative slot in the guessed slot (the first empty).
    assert!(uncached.delete(key).await.expect("delete"));
    let inserting = {
        let (holding, key) = (holding.clone(), key.to_vec());
        tokio::spawn(async move { holding.insert(&key, b"again").await })
    };
    tokio::time::timeout(Duration::from_secs(5), hold.reached.notified())
        .await
        .expect("the insert placed its tentative slot");
    for _ in 0..3 {
        assert_eq!(
            cached.get(key).await.expect("get"),
            None,
            "a tentative reservation is not a value"
        );
    }
    hold.gate.add_permits(1);
    assert!(inserting
        .await
        .expect("join")
        .expect("the held insert completes"));
    assert_eq!(cached.get(key).await.expect("get"), bytes("again"));
    // The narrow guess that met the reservation ended in the buckets: GETs guess wide until
    // enough guesses held.
    for _ in 0..64 {
        assert_eq!(cached.get(key).await.expect("get"), bytes("again"));
    }
    // An in-place update: the narrow guess is stale and chased to the new word.
    uncached.put(key, b"third").await.expect("put");
    let (value, round_trips, guesses, misses) = counted_get(&cached, key).await;
    assert_eq!(value, bytes("third"));
    // Over shm a direct GET, when its queue pair is free (else the lists' GET), follows the
    // slot's new word in its one pass.
    let counted = (round_trips, guesses, misses);
    assert!(
        counted == (2, 2, 1) || (fabric == Fabric::Shm && counted == (1, 1, 0)),
        "an update is chased in two round trips (one, directly): {counted:?}"
    );

    // The key deleted and its twin inserted in the same slot: the chase finds the twin's word.
    assert!(uncached.delete(key).await.expect("delete"));
    assert!(uncached.insert(twin, b"twin!").await.expect("insert twin"));
    let (value, round_trips, guesses, misses) = counted_get(&cached, key).await;
    eprintln!(
        "twin in the guessed slot ({fabric:?}): {round_trips} round trips, {guesses} guesses, {misses} stale"
    );
    assert_eq!(value, None, "the twin's value is not the key's");
    assert_eq!(cached.get(twin).await.expect("get twin"), bytes("twin!"));
    assert_eq!(cached.get(key).await.expect("get"), None);
    // And both present, read in turn through the one entry they share.
    assert!(uncached.insert(key, b"back").await.expect("insert"));
    for round in 0..10 {
        assert_eq!(
            cached.get(key).await.expect("get"),
            bytes("back"),
            "{round}"
        );
        assert_eq!(
            cached.get(twin).await.expect("get"),
            bytes("twin!"),
            "{round}"
        );
        if round == 4 {
            uncached.put(twin, b"twin2").await.expect("put twin");
            uncached.put(key, b"bac2").await.expect("put key");
            assert_eq!(cached.get(key).await.expect("get"), bytes("bac2"));
            assert_eq!(cached.get(twin).await.expect("get"), bytes("twin2"));
            uncached.put(twin, b"twin!").await.expect("put twin");
            uncached.put(key, b"back").await.expect("put key");
        }
    }
    assert_eq!(cached.counters().failures, 0);
}

/// Two keys of one location share one cache entry, so a GET of one guesses the other's word.
/// The narrow READ finds exactly that word (it held), with the other key's block: the guess is
/// stale, and nothing about the slot changed. Chasing "the word it just saw" repeats the very
/// check that just failed, at the cost of a round trip: the GET should go to the buckets
/// (narrow guess, buckets, blocks: 3 round trips, one stale guess), not chase first (4).
async fn a_chase_does_not_repeat_the_word_it_disproved(fabric: Fabric) {
    let (config, key, twin) = twin_server(fabric, 0x5A3E_3012);
    let (key, twin) = (key.as_bytes(), twin.as_bytes());
    let server = start(config).await;
    let address = server.control_address();
    let cached = connect(address, fabric, fresh_cache()).await;
    let uncached = connect(address, fabric, 0).await;
    uncached.put(key, b"of-the-key").await.expect("put");
    uncached.put(twin, b"of-the-twin").await.expect("put twin");
    assert_eq!(cached.get(key).await.expect("warm"), bytes("of-the-key"));
    let (value, round_trips, guesses, misses) = counted_get(&cached, twin).await;
    assert_eq!(value, bytes("of-the-twin"));
    // Over shm a direct GET (when its queue pair is free) finds the key's block, forgets the
    // entry and leaves the GET to the buckets without a guess: buckets, blocks.
    let counted = (round_trips, guesses, misses);
    assert!(
        counted == (3, 1, 1) || (fabric == Fabric::Shm && counted == (2, 1, 1)),
        "the twin's GET (round trips, guesses, stale guesses): the key's word, seen unchanged, \
         was chased again: {counted:?}"
    );
}

/// Updates in place race the chase: one writer updates one key as fast as it can (two value
/// lengths, a tiny heap with a fast collector, so words recur), while reader tasks of two
/// clients sharing a cache GET it. Each read must lie between the last update acknowledged
/// before it began and the last begun, and never go back for one reader.
async fn updates_racing_the_chase(fabric: Fabric) {
    let entries = fresh_cache();
    let server = start(tiny_heap_config(fabric)).await;
    let address = server.control_address();
    let readers = [
        Arc::new(connect(address, fabric, entries).await),
        Arc::new(connect(address, fabric, entries).await),
    ];
    let writer = Arc::new(connect(address, fabric, 0).await);
    const KEY: &[u8] = b"raced";
    // Two lengths (one and two block units), so the slot's length changes too.
    let value = |step: u64| {
        if step % 3 == 0 {
            format!("{step:016}{}", "x".repeat(64))
        } else {
            format!("{step:016}")
        }
    };
    writer.put(KEY, value(0).as_bytes()).await.expect("put");
    let started = Arc::new(AtomicU64::new(0));
    let acked = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    const RUN: Duration = Duration::from_millis(1500);
    let writing = {
        let (started, acked, done) = (started.clone(), acked.clone(), done.clone());
        tokio::spawn(async move {
            let begun = Instant::now();
            let mut step = 0;
            while step < 50_000 && begun.elapsed() < RUN {
                step += 1;
                started.store(step, Ordering::SeqCst);
                assert!(writer
                    .update(KEY, value(step).as_bytes())
                    .await
                    .expect("update"));
                acked.store(step, Ordering::SeqCst);
                if step % 4 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            done.store(true, Ordering::SeqCst);
            step
        })
    };
    let mut reading = tokio::task::JoinSet::new();
    for task in 0..4usize {
        let reader = readers[task % 2].clone();
        let (started, acked, done) = (started.clone(), acked.clone(), done.clone());
        reading.spawn(async move {
            let mut lower = 0u64;
            let mut reads = 0u64;
            let begun = Instant::now();
            while !done.load(Ordering::SeqCst) && begun.elapsed() < 2 * RUN {
                let floor = acked.load(Ordering::SeqCst);
                let got = reader.get(KEY).await.expect("get").expect("never absent");
                let ceiling = started.load(Ordering::SeqCst);
                let step: u64 = std::str::from_utf8(&got[..16])
                    .expect("utf-8")
                    .parse()
                    .expect("a step");
                assert_eq!(
                    &got[..],
                    value(step).as_bytes(),
                    "task {task}: a whole value"
                );
                let bound = floor.max(lower);
                assert!(
                    step >= bound && step <= ceiling,
                    "task {task}: read {step}, but {floor} was acknowledged before the read, \
                     {lower} read earlier, and {ceiling} the newest begun"
                );
                lower = step;
                reads += 1;
            }
            reads
        });
    }
    let steps = writing.await.expect("the writer ran");
    let mut reads = 0;
    while let Some(joined) = reading.join_next().await {
        reads += joined.expect("a reader's reads were all linearizable");
    }
    let (first, second) = (readers[0].counters(), readers[1].counters());
    let (guesses, misses) = (
        first.slot_guesses + second.slot_guesses,
        first.slot_guess_misses + second.slot_guess_misses,
    );
    let gets = first.gets + second.gets;
    let round_trips = first.get_round_trips + second.get_round_trips;
    eprintln!(
        "updates racing the chase ({fabric:?}): {steps} updates, {reads} reads, {guesses} guesses, {misses} stale, {round_trips} round trips in {gets} GETs"
    );
    assert!(steps > 100 && reads > 100, "{steps} steps, {reads} reads");
    assert!(
        misses > 0 && guesses > misses,
        "guesses went stale and held: {guesses} guesses, {misses} stale"
    );
    assert!(
        round_trips <= 4 * gets,
        "no GET spent more than a narrow guess, a chase, the buckets and the blocks"
    );
    assert_eq!(first.failures + second.failures, 0);
}

/// A replicated cluster: a GET's narrow guess is chased to a lock (the old value, still
/// committed for readers), to a thief's lock on a copy of the old value, to the new committed
/// word, and to a tombstone (absent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chases_through_locks_and_tombstones() {
    let nodes = support::replicas::start_three(SECRET).await;
    let addresses: Vec<SocketAddr> = nodes.iter().map(RunningServer::control_address).collect();
    let mut cluster = support::cluster("slot-cache-chase", SECRET, Backend::Soft, &addresses);
    cluster.replicas = 2;
    let reader = ClientBuilder::cluster(&cluster)
        .build()
        .expect("a cluster client");
    let writer = ClientBuilder::cluster(&cluster)
        .build()
        .expect("a cluster client");
    let hold = Arc::new(HoldAfter::new("put", StepKind::Lock));
    let stalled = Arc::new(
        ClientBuilder::cluster(&cluster)
            .fault_injector(hold.clone())
            .build()
            .expect("a cluster client"),
    );
    const KEY: &[u8] = b"chased";

    writer.put(KEY, b"one").await.expect("put");
    assert_eq!(reader.get(KEY).await.expect("warm"), bytes("one"));
    let (value, round_trips, _, misses) = counted_get(&reader, KEY).await;
    assert_eq!(
        (value, round_trips, misses),
        (bytes("one"), 1, 0),
        "set-up: a held guess"
    );
    // Locked: readers read the old block.
    let writing = {
        let stalled = stalled.clone();
        tokio::spawn(async move { stalled.put(KEY, b"stalled").await })
    };
    tokio::time::timeout(Duration::from_secs(5), hold.reached.notified())
        .await
        .expect("the writer locked");
    for _ in 0..3 {
        assert_eq!(
            reader.get(KEY).await.expect("get"),
            bytes("one"),
            "a lock reads as the old value"
        );
    }
    // Stolen (a lock on a copy of the old value), rolled back, and replaced.
    writer
        .put(KEY, b"two")
        .await
        .expect("put over a stalled lock");
    assert_eq!(
        writer.counters().locks_stolen,
        1,
        "set-up: the lock was stolen"
    );
    assert_eq!(reader.get(KEY).await.expect("get"), bytes("two"));
    hold.gate.add_permits(1);
    writing
        .await
        .expect("join")
        .expect("the stalled put completes");
    let (value, round_trips, _, _) = counted_get(&reader, KEY).await;
    assert_eq!(value, bytes("stalled"));
    assert!(round_trips <= 2, "chased: {round_trips} round trips");
    // A tombstone in the guessed slot.
    assert!(writer.delete(KEY).await.expect("delete"));
    let (value, round_trips, _, _) = counted_get(&reader, KEY).await;
    assert_eq!(value, None, "a tombstone is absence");
    assert!(round_trips <= 2, "chased: {round_trips} round trips");
    assert_eq!(reader.get(KEY).await.expect("get"), None);
    writer
        .put(KEY, b"three")
        .await
        .expect("put over the tombstone");
    assert_eq!(reader.get(KEY).await.expect("get"), bytes("three"));
    assert!(writer.delete(KEY).await.expect("delete"));
    assert_eq!(reader.get(KEY).await.expect("get"), None);
    assert_eq!(reader.counters().failures, 0);
}

macro_rules! per_fabric {
    ($module:ident, $fabric:expr) => {
        mod $module {
            use super::Fabric;
            per_fabric!(@tests $fabric;
                restart_with_a_smaller_heap,
                restart_puts_another_key_under_the_same_word,
                restart_with_another_table,
                a_warm_reader_never_goes_back,
                a_counter_incremented_by_compare_and_swap,
                compaction_under_warm_guesses,
                clients_sharing_the_cache,
                a_two_entry_cache,
                stale_guesses_give_current_outcomes,
                a_chase_never_returns_a_reservation_or_a_twin,
                a_chase_does_not_repeat_the_word_it_disproved,
                updates_racing_the_chase,
                direct_gets_serve_warm_reads_over_shm_only,
            );
        }
    };
    (@tests $fabric:expr; $($test:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                super::$test($fabric).await;
            }
        )*
    };
}

per_fabric!(soft, Fabric::Soft);
per_fabric!(loopback, Fabric::Loopback);
per_fabric!(shm, Fabric::Shm);
