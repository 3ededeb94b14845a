//! Replicated writes (`replicas` ≥ 2) against in-process nodes: every write reaches each of the
//! key's replicas and no other node, deletes leave tombstones that read as absence, a GET
//! stays at 2 round trips and an update takes 5, and a writer stalled while it holds its lock
//! is taken over: the key is never blocked for long, and the replicas agree afterwards; the
//! blocks' versions rise with each write, and a key's copies carry the same one.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod support;

use bytes::Bytes;
use rdkv_client::fault::{FaultInjector, Injection, Moment, Step, StepKind};
use rdkv_client::{CasOutcome, Client, ClientBuilder, ClusterConfig, InsertOutcome};
use rdkv_fabric::{Backend, WorkCompletionStatus};
use rdkv_server::RunningServer;
use support::replicas::replica_ids;
use tokio::sync::{Notify, Semaphore};

const SECRET: &[u8] = b"replication-test-secret";

/// Three in-process nodes, ids 1 to 3.
async fn start_nodes() -> Vec<RunningServer> {
    support::replicas::start_three(SECRET).await
}

/// The cluster of `nodes` with `replicas` copies of each key.
fn cluster(nodes: &[RunningServer], replicas: usize) -> ClusterConfig {
    let addresses: Vec<SocketAddr> = nodes.iter().map(RunningServer::control_address).collect();
    let mut cluster = support::cluster("replication-test", SECRET, Backend::Soft, &addresses);
    cluster.replicas = replicas;
    cluster
}

/// A client of node `id` alone (ids from 1): what that node's table holds for a key.
async fn node_client(nodes: &[RunningServer], id: u32) -> Client {
    support::replicas::node_client(nodes, SECRET, id).await
}

/// Which nodes hold `key` (a committed value or a tombstone, read as absence by a GET; so this
/// asks for values) and with what value.
async fn holders(direct: &[Client], key: &[u8]) -> Vec<(u32, Option<Bytes>)> {
    let mut found = Vec::new();
    for (index, client) in direct.iter().enumerate() {
        found.push((index as u32 + 1, client.get(key).await.expect("direct get")));
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_write_reaches_each_replica_and_no_other_node() {
    let nodes = start_nodes().await;
    for replicas in [2usize, 3] {
        let client = ClientBuilder::cluster(&cluster(&nodes, replicas))
            .build()
            .expect("a cluster client");
        let direct = [
            node_client(&nodes, 1).await,
            node_client(&nodes, 2).await,
            node_client(&nodes, 3).await,
        ];
        for index in 0..60u32 {
            let key = format!("r{replicas}-key-{index}");
            let key = key.as_bytes();
            let expected = replica_ids(key, replicas);
            // Insert (absent), update, compare-and-swap, insert of a present key, delete.
            assert!(client.insert(key, b"one").await.expect("insert"));
            assert!(client.update(key, b"two").await.expect("update"));
            assert_eq!(
                client
                    .compare_and_swap(key, b"two", b"three")
                    .await
                    .expect("cas"),
                CasOutcome::Swapped
            );
            assert_eq!(
                client
                    .compare_and_swap(key, b"two", b"x")
                    .await
                    .expect("cas"),
                CasOutcome::Mismatch(Some(Bytes::from_static(b"three")))
            );
            assert_eq!(
                client.insert_or_get(key, b"x").await.expect("insert"),
                InsertOutcome::Present(Bytes::from_static(b"three"))
            );
            assert_eq!(
                client.get(key).await.expect("get"),
                Some(Bytes::from_static(b"three"))
            );
            for (id, value) in holders(&direct, key).await {
                let wanted = expected.contains(&id).then(|| Bytes::from_static(b"three"));
                assert_eq!(value, wanted, "node {id} for {expected:?}");
            }
            // A delete leaves tombstones: absent everywhere, and a second delete finds nothing.
            assert!(client.delete(key).await.expect("delete"));
            assert!(!client.delete(key).await.expect("delete again"));
            assert!(!client.update(key, b"y").await.expect("update absent"));
            assert_eq!(client.get(key).await.expect("get"), None);
            for (id, value) in holders(&direct, key).await {
                assert_eq!(value, None, "node {id} after the delete");
            }
            // And the key comes back on its replicas.
            client
                .put(key, b"four")
                .await
                .expect("put over the tombstone");
            for (id, value) in holders(&direct, key).await {
                let wanted = expected.contains(&id).then(|| Bytes::from_static(b"four"));
                assert_eq!(value, wanted, "node {id} after the put");
            }
        }
        client.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_keys_leave_tombstones_that_the_collectors_clear_after_a_quarantine() {
    let nodes = start_nodes().await;
    let client = ClientBuilder::cluster(&cluster(&nodes, 2))
        .build()
        .expect("a cluster client");
    for index in 0..100u32 {
        client
            .put(format!("gone-{index}").as_bytes(), b"value")
            .await
            .expect("put");
    }
    for index in 0..100u32 {
        assert!(client
            .delete(format!("gone-{index}").as_bytes())
            .await
            .expect("delete"));
    }
    // Each delete left a tombstone on both replicas: 200 slots, gone a quarantine (1.25 × the
    // 2 s deadline) later, with every key still absent.
    let started = Instant::now();
    loop {
        let stats: Vec<_> = nodes.iter().map(RunningServer::stats).collect();
        let cleared: u64 = stats.iter().map(|stats| stats.tombstones_cleared).sum();
        let keys: u64 = stats.iter().map(|stats| stats.keys).sum();
        if cleared >= 200 && keys == 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{cleared} tombstones cleared, {keys} slots left"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("tombstones cleared after {:?}", started.elapsed());
    for index in 0..100u32 {
        assert_eq!(
            client
                .get(format!("gone-{index}").as_bytes())
                .await
                .expect("get"),
            None
        );
    }
    // A key put again after its tombstone went is there.
    client.put(b"gone-0", b"back").await.expect("put again");
    assert_eq!(
        client.get(b"gone-0").await.expect("get"),
        Some(Bytes::from_static(b"back"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_takes_two_round_trips_and_an_update_five() {
    let nodes = start_nodes().await;
    let client = ClientBuilder::cluster(&cluster(&nodes, 2))
        .build()
        .expect("a cluster client");
    client.connect_all().await.expect("connect");
    client.put(b"counted", b"v1").await.expect("put");
    let before = client.counters();
    client.get(b"counted").await.expect("get");
    let after = client.counters();
    assert_eq!(after.round_trips - before.round_trips, 2, "a GET");
    let before = client.counters();
    client.put(b"counted", b"v2").await.expect("update");
    let after = client.counters();
    let in_sequence = (after.round_trips - before.round_trips)
        - (after.overlapped_round_trips - before.overlapped_round_trips);
    assert_eq!(in_sequence, 5, "an update of a present key, replicas = 2");
}

/// Holds the first writer of `key` right after its step `kind` (its lock, its backup's CAS)
/// until the test releases it.
#[derive(Debug)]
struct HoldAfterLock {
    /// The step after which it holds the writer.
    kind: StepKind,
    /// Released by the test.
    gate: Arc<Semaphore>,
    /// Set once a writer is held.
    held: Mutex<bool>,
    /// Told when it holds one.
    reached: Arc<Notify>,
}

impl FaultInjector for HoldAfterLock {
    fn inject(&self, step: &Step) -> Injection {
        if step.kind != self.kind || step.moment != Moment::After {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_stalled_holding_its_lock_is_taken_over_and_the_replicas_agree() {
    let nodes = start_nodes().await;
    let gate = Arc::new(Semaphore::new(0));
    let reached = Arc::new(Notify::new());
    let stalled = Arc::new(
        ClientBuilder::cluster(&cluster(&nodes, 2))
            .fault_injector(Arc::new(HoldAfterLock {
                kind: StepKind::Lock,
                gate: gate.clone(),
                held: Mutex::new(false),
                reached: reached.clone(),
            }))
            .build()
            .expect("a cluster client"),
    );
    let other = ClientBuilder::cluster(&cluster(&nodes, 2))
        .build()
        .expect("a cluster client");
    let key = b"contended";
    other.put(key, b"before").await.expect("put");
    let writer = {
        let stalled = stalled.clone();
        tokio::spawn(async move { stalled.put(key, b"stalled").await })
    };
    // Wait until the stalled writer holds its lock: the other writer then has to take it over.
    tokio::time::timeout(Duration::from_secs(5), reached.notified())
        .await
        .expect("the writer locked");
    let taking_over = Instant::now();
    other
        .put(key, b"after")
        .await
        .expect("a put over a stalled lock");
    let took = taking_over.elapsed();
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert_eq!(other.counters().locks_stolen, 1);
    assert_eq!(
        other.get(key).await.expect("get"),
        Some(Bytes::from_static(b"after"))
    );
    // The stalled writer goes on: its lock is gone, so it starts again, and its write lands
    // after the other one.
    gate.add_permits(1);
    writer
        .await
        .expect("join")
        .expect("the stalled put completes");
    let direct = [
        node_client(&nodes, 1).await,
        node_client(&nodes, 2).await,
        node_client(&nodes, 3).await,
    ];
    let expected = replica_ids(key, 2);
    for (id, value) in holders(&direct, key).await {
        let wanted = expected
            .contains(&id)
            .then(|| Bytes::from_static(b"stalled"));
        assert_eq!(value, wanted, "node {id}");
    }
}

/// Fails the first step of `kind` after it ran (its completion lost, the connection broken),
/// as a fence at a view change does to an operation in flight.
#[derive(Debug)]
struct FailOnceAfter {
    /// The step to fail.
    kind: StepKind,
    /// Whether it failed one already.
    done: Mutex<bool>,
}

impl FaultInjector for FailOnceAfter {
    fn inject(&self, step: &Step) -> Injection {
        if step.kind != self.kind || step.moment != Moment::After {
            return Injection::Proceed;
        }
        let mut done = self.done.lock().expect("done");
        if *done {
            return Injection::Proceed;
        }
        *done = true;
        Injection::Fail(WorkCompletionStatus::RetryExceededError)
    }
}

/// A write whose connection fails after it locked the key, after a backup took its value, or
/// after its commit ran, goes on from its lock on a fresh connection and succeeds: a fence at
/// a view change that does not move the key costs it nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_cut_while_it_holds_its_lock_resumes_and_succeeds() {
    let nodes = start_nodes().await;
    let direct = [
        node_client(&nodes, 1).await,
        node_client(&nodes, 2).await,
        node_client(&nodes, 3).await,
    ];
    for (index, kind) in [StepKind::Lock, StepKind::Backup, StepKind::Commit]
        .into_iter()
        .enumerate()
    {
        // One lane per node: the cut connection's reconnect is what this watches (with a lane
        // per worker, the retry could take the other lane instead).
        let client = ClientBuilder::cluster(&cluster(&nodes, 2))
            .lanes(1)
            .fault_injector(Arc::new(FailOnceAfter {
                kind,
                done: Mutex::new(false),
            }))
            .build()
            .expect("a cluster client");
        let key = format!("resumed-{index}");
        let key = key.as_bytes();
        // Present first (the failure then hits an update's lock, backup or commit).
        ClientBuilder::cluster(&cluster(&nodes, 2))
            .build()
            .expect("a cluster client")
            .put(key, b"before")
            .await
            .expect("put");
        client
            .put(key, b"after")
            .await
            .unwrap_or_else(|error| panic!("a put cut after its {kind:?} step: {error}"));
        assert!(
            client.counters().reconnects >= 1,
            "{kind:?}: a new connection"
        );
        // A lock whose CAS completion was lost may be another writer's on the same old block:
        // the write takes it over (its own, here) and starts again.
        let stolen = u64::from(kind == StepKind::Lock);
        assert_eq!(client.counters().locks_stolen, stolen, "{kind:?}");
        let expected = replica_ids(key, 2);
        for (id, value) in holders(&direct, key).await {
            let wanted = expected.contains(&id).then(|| Bytes::from_static(b"after"));
            assert_eq!(value, wanted, "{kind:?}: node {id}");
        }
    }
}

/// Fails the first Backup step after it ran, then holds the write before its next step (the
/// resume's check of its lock) until the test releases it.
#[derive(Debug)]
struct CutAfterBackupThenHold {
    /// Released by the test.
    gate: Arc<Semaphore>,
    /// 0: not cut yet; 1: cut, not held yet; 2: done.
    stage: Mutex<u8>,
    /// Told when it holds the write.
    reached: Arc<Notify>,
}

impl FaultInjector for CutAfterBackupThenHold {
    fn inject(&self, step: &Step) -> Injection {
        let mut stage = self.stage.lock().expect("stage");
        match (*stage, step.kind, step.moment) {
            (0, StepKind::Backup, Moment::After) => {
                *stage = 1;
                Injection::Fail(WorkCompletionStatus::RetryExceededError)
            }
            (1, _, Moment::Before) => {
                *stage = 2;
                self.reached.notify_one();
                Injection::WaitFor(self.gate.clone())
            }
            _ => Injection::Proceed,
        }
    }
}

/// A write cut after a backup took its value, whose lock another writer takes over before it
/// looks again, was rolled back by the thief (no commit of it was posted): it starts again and
/// succeeds, instead of ending `Unresolved`, and its value lands after the thief's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_cut_before_its_commit_whose_lock_was_taken_over_starts_again() {
    let nodes = start_nodes().await;
    let gate = Arc::new(Semaphore::new(0));
    let reached = Arc::new(Notify::new());
    let cut = Arc::new(
        ClientBuilder::cluster(&cluster(&nodes, 2))
            .fault_injector(Arc::new(CutAfterBackupThenHold {
                gate: gate.clone(),
                stage: Mutex::new(0),
                reached: reached.clone(),
            }))
            .build()
            .expect("a cluster client"),
    );
    let other = ClientBuilder::cluster(&cluster(&nodes, 2))
        .build()
        .expect("a cluster client");
    let key = b"taken-over-while-cut";
    other.put(key, b"before").await.expect("put");
    let writer = {
        let cut = cut.clone();
        tokio::spawn(async move { cut.put(key, b"cut").await })
    };
    tokio::time::timeout(Duration::from_secs(5), reached.notified())
        .await
        .expect("the write was cut and held");
    other
        .put(key, b"thief")
        .await
        .expect("a put over the cut writer's lock");
    assert_eq!(other.counters().locks_stolen, 1, "the lock was taken over");
    gate.add_permits(1);
    writer
        .await
        .expect("join")
        .unwrap_or_else(|error| panic!("the cut write: {error}"));
    let direct = [
        node_client(&nodes, 1).await,
        node_client(&nodes, 2).await,
        node_client(&nodes, 3).await,
    ];
    let expected = replica_ids(key, 2);
    for (id, value) in holders(&direct, key).await {
        let wanted = expected.contains(&id).then(|| Bytes::from_static(b"cut"));
        assert_eq!(value, wanted, "node {id}");
    }
}

/// `key`'s copy on each node, as a one-sided scan of its whole table reads it: (node, value,
/// version).
async fn copies_of(client: &Client, key: &[u8]) -> Vec<(u32, Bytes, u64)> {
    let mut copies = Vec::new();
    for node in 1..=3u32 {
        let buckets = client.combined_buckets_of(node).await.expect("buckets");
        let mut first = 0;
        while first < buckets {
            let count = rdkv_client::SCAN_BUCKETS.min(buckets - first);
            for entry in client.scan_node(node, first, count).await.expect("scan") {
                if entry.key.as_ref() == key {
                    copies.push((node, entry.value, entry.version));
                }
            }
            first += count;
        }
    }
    copies
}

/// Each write gives a key's copies one version, above the last one; a writer stalled after its
/// backup took its value (before its commit) is taken over, and the write after the takeover
/// is above the stalled write's copy, on every replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_rise_with_each_write_and_a_takeover_goes_above_the_stalled_copy() {
    let nodes = start_nodes().await;
    let other = ClientBuilder::cluster(&cluster(&nodes, 2))
        .build()
        .expect("a cluster client");
    let key = b"versioned";
    let replicas = replica_ids(key, 2);
    let mut last = 0;
    for value in [&b"one"[..], b"two", b"three"] {
        other.put(key, value).await.expect("put");
        let copies = copies_of(&other, key).await;
        assert_eq!(copies.len(), 2, "{copies:?}");
        for (node, read, version) in &copies {
            assert!(replicas.contains(node), "{copies:?}");
            assert_eq!(read.as_ref(), value);
            assert!(*version > last, "{copies:?} after version {last}");
        }
        assert_eq!(
            copies[0].2, copies[1].2,
            "one version per write: {copies:?}"
        );
        last = copies[0].2;
    }
    let gate = Arc::new(Semaphore::new(0));
    let reached = Arc::new(Notify::new());
    let stalled = Arc::new(
        ClientBuilder::cluster(&cluster(&nodes, 2))
            .fault_injector(Arc::new(HoldAfterLock {
                kind: StepKind::Backup,
                gate: gate.clone(),
                held: Mutex::new(false),
                reached: reached.clone(),
            }))
            .build()
            .expect("a cluster client"),
    );
    let writer = {
        let stalled = stalled.clone();
        tokio::spawn(async move { stalled.put(key, b"stalled").await })
    };
    tokio::time::timeout(Duration::from_secs(5), reached.notified())
        .await
        .expect("the writer put its value in the backup");
    let copies = copies_of(&other, key).await;
    let stalled_version = copies
        .iter()
        .find(|(_, value, _)| value.as_ref() == b"stalled")
        .map(|(_, _, version)| *version)
        .unwrap_or_else(|| panic!("the backup holds the stalled write: {copies:?}"));
    assert!(stalled_version > last);
    other.put(key, b"after").await.expect("a put over the lock");
    assert_eq!(other.counters().locks_stolen, 1);
    let copies = copies_of(&other, key).await;
    assert!(
        copies
            .iter()
            .all(|(_, value, version)| value.as_ref() == b"after" && *version > stalled_version),
        "{copies:?} after the stalled write's version {stalled_version}"
    );
    gate.add_permits(1);
    writer
        .await
        .expect("join")
        .expect("the stalled put completes");
}

/// A key whose copies carry a version above this process's clock (loaded from snapshots
/// written by a host whose clock ran ahead): the next write reads it and stamps its blocks
/// above it (a WRITE of version and checksum ahead of each block's CAS), and a GET returns the
/// new value from a block that passes its checksum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_over_a_copy_newer_than_the_clock_stamps_its_blocks_above_it() {
    use rdkv_server::snapshot::file::{SnapshotMeta, SnapshotWriter};
    let key = b"ahead-of-the-clock";
    let ahead = 1u64 << 60;
    let directory = std::env::temp_dir().join(format!("rdkv-stamp-{}", std::process::id()));
    let mut nodes = Vec::new();
    for id in 1..=3u32 {
        let data_dir = directory.join(format!("node-{id}"));
        let meta = SnapshotMeta {
            cluster: String::new(),
            node_id: id,
            view_epoch: 0,
            created_unix_ms: 0,
            stopped_at: None,
            replicas: None,
            fenced_at: None,
        };
        let mut writer = SnapshotWriter::create(&data_dir, &meta).expect("a snapshot");
        writer.append(key, b"loaded", ahead).expect("append");
        writer.finish().expect("finish");
        let mut config = rdkv_server::ServerConfig::local(SECRET);
        config.node_id = id;
        config.data_dir = Some(data_dir);
        nodes.push(rdkv_server::start(config).await.expect("start a node"));
    }
    let client = ClientBuilder::cluster(&cluster(&nodes, 2))
        .build()
        .expect("a cluster client");
    assert_eq!(
        client.get(key).await.expect("get"),
        Some(Bytes::from_static(b"loaded"))
    );
    for (round, value) in [&b"first"[..], b"second"].into_iter().enumerate() {
        client.put(key, value).await.expect("put");
        assert_eq!(client.get(key).await.expect("get").as_deref(), Some(value));
        let copies = copies_of(&client, key).await;
        let replicas = replica_ids(key, 2);
        assert_eq!(
            copies.len(),
            3,
            "the other node keeps its loaded copy: {copies:?}"
        );
        for (node, read, version) in copies {
            if replicas.contains(&node) {
                assert_eq!(read.as_ref(), value);
                assert!(version > ahead + round as u64, "node {node}: {version}");
            } else {
                assert_eq!((read.as_ref(), version), (&b"loaded"[..], ahead));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&directory);
}
