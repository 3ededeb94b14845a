//! Persistence (`docs/operations.md`, *Persistence*): a whole cluster stopped by
//! `rdkv-cluster down` and started again by `up` keeps every key with its last value, with one
//! copy of each key and with two; a damaged snapshot stops the start with one line that names
//! the file and the choices, and the previous snapshot can be chosen instead; after a crash of
//! every node, each key is as of its last snapshot or later, and with two copies, the copies
//! agree, the newest winning (`docs/protocol.md`, *Reconciliation*).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use nix::sys::signal::Signal;
use rdkv_client::Client;
use rdkv_common::sharding;
use rdkv_integration_tests::cluster::{scrape, Cluster};
use rdkv_integration_tests::view::{
    cluster_command, pid_of, signal, succeeded, wait_serving, wait_torn_down,
};

/// Keys written before the stop, by default; `RDKV_PERSISTENCE_KEYS=100000` runs the issue's
/// full size (with 64 MiB heaps and 8 MiB indexes). A tenth of them are overwritten and a hundredth deleted.
const KEYS: usize = 2_000;

fn keys() -> usize {
    std::env::var("RDKV_PERSISTENCE_KEYS")
        .ok()
        .and_then(|keys| keys.parse().ok())
        .unwrap_or(KEYS)
}

/// The example's heaps, or larger ones for the full size.
fn sized(text: String) -> String {
    if keys() > KEYS {
        text.replace("heap_size = \"4M\"", "heap_size = \"64M\"")
            .replace("index_size = \"1M\"", "index_size = \"8M\"")
    } else {
        text
    }
}

fn key(index: usize) -> Vec<u8> {
    format!("persist-{index:05}").into_bytes()
}

/// Writes the keys, overwrites some and deletes some; the values the cluster must hold.
async fn write_history(client: &Client) -> BTreeMap<Vec<u8>, Option<Vec<u8>>> {
    let mut expected = BTreeMap::new();
    let keys = keys();
    for index in 0..keys {
        let value = format!("first-{index}").into_bytes();
        client.put(&key(index), &value).await.expect("put");
        expected.insert(key(index), Some(value));
    }
    for index in (0..keys).step_by(10) {
        let value = vec![b'x'; 100 + index % 900];
        client.put(&key(index), &value).await.expect("overwrite");
        expected.insert(key(index), Some(value));
    }
    for index in (1..keys).step_by(100) {
        client.delete(&key(index)).await.expect("delete");
        expected.insert(key(index), None);
    }
    expected
}

/// The keys that do not read back as `expected` says, nor as `newer` does where it names the
/// key (a fresh client: the cluster's processes are new).
async fn keys_read_wrong(
    cluster: &Cluster,
    expected: &BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    newer: &BTreeMap<Vec<u8>, Vec<u8>>,
) -> Vec<String> {
    let client = Client::from_file(&cluster.file).expect("a client");
    let mut wrong = Vec::new();
    for (key, value) in expected {
        let read = client.get(key).await.expect("get after the restart");
        let fine = read.as_deref() == value.as_deref()
            || newer
                .get(key)
                .is_some_and(|after| read.as_deref() == Some(after));
        if !fine {
            let shown = |bytes: Option<&[u8]>| {
                bytes.map_or("absent".to_string(), |bytes| {
                    String::from_utf8_lossy(bytes).chars().take(24).collect()
                })
            };
            wrong.push(format!(
                "{} (read {}, expected {})",
                String::from_utf8_lossy(key),
                shown(read.as_deref()),
                shown(value.as_deref())
            ));
        }
    }
    client.close().await;
    wrong
}

/// Every key reads back as `expected` says, once every node serves again.
async fn check(cluster: &Cluster, expected: &BTreeMap<Vec<u8>, Option<Vec<u8>>>) {
    // A refill of the full size's 67,000 copies takes about 10 s on a quiet machine.
    let limit = if keys() > KEYS { 300 } else { 60 };
    wait_serving(cluster, Duration::from_secs(limit)).await;
    let wrong = keys_read_wrong(cluster, expected, &BTreeMap::new()).await;
    assert!(
        wrong.is_empty(),
        "{} of {} keys differ after the restart: {:?}",
        wrong.len(),
        expected.len(),
        &wrong[..wrong.len().min(5)]
    );
}

async fn clean_restart_keeps_every_key(replicas: usize) {
    let cluster = Cluster::up_with(&format!("persistence-{replicas}"), |text| {
        sized(text.replace("replicas = 2", &format!("replicas = {replicas}")))
    });
    let client = Client::from_file(&cluster.file).expect("a client");
    let expected = write_history(&client).await;
    client.close().await;
    let down = succeeded(&cluster_command(&cluster, "down", None), "down");
    assert!(down.contains("cluster stopped at view epoch"), "{down}");
    succeeded(&cluster_command(&cluster, "up", None), "up");
    check(&cluster, &expected).await;
    let status = succeeded(&cluster_command(&cluster, "status", None), "status");
    assert!(
        status.contains("1 serving, 2 serving, 3 serving"),
        "{status}"
    );
    // Each node loaded its copies: `replicas` of every key that was not deleted.
    let config = rdkv_cluster_config::load(&cluster.file).expect("the generated file is valid");
    let loaded: f64 = config
        .nodes
        .iter()
        .map(|node| {
            let samples = scrape(node.metrics_address.expect("a metrics address"));
            samples[&format!("rdkv_snapshot_keys_loaded{{node=\"{}\"}}", node.id)]
        })
        .sum();
    assert_eq!(loaded as usize, replicas * (keys() - keys() / 100));
    let stats =
        std::process::Command::new(rdkv_integration_tests::process::workspace_binary("rdkv"))
            .args(["--config", cluster.file.to_str().expect("utf-8"), "stats"])
            .output()
            .expect("run rdkv stats");
    let text = succeeded(&stats, "rdkv stats");
    assert_eq!(text.matches("keys loaded at start").count(), 3, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_restart_of_the_whole_cluster_keeps_every_key_with_two_copies() {
    clean_restart_keeps_every_key(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_restart_of_the_whole_cluster_keeps_every_key_with_one_copy() {
    clean_restart_keeps_every_key(1).await;
}

fn snapshot_file(cluster: &Cluster, node: u32, name: &str) -> PathBuf {
    cluster
        .run_directory
        .join(format!("node-{node}.data"))
        .join(name)
}

/// A flipped byte in node 2's latest snapshot stops `up` with the file and the choices (after
/// node 1 started and resumed: `up` stops it again, and it resumes again later); with
/// `RDKV_FROM_SNAPSHOT=previous` node 2 starts from the snapshot before it, and every key is
/// there (node 2 refills from the others, which resume from the stop).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_snapshot_is_refused_and_the_previous_one_can_be_chosen() {
    let cluster = Cluster::up_with("persistence-damaged", sized);
    let client = Client::from_file(&cluster.file).expect("a client");
    let expected = write_history(&client).await;
    client.close().await;
    let snapshot = succeeded(&cluster_command(&cluster, "snapshot", None), "snapshot");
    assert_eq!(snapshot.matches("keys").count(), 3, "{snapshot}");
    succeeded(&cluster_command(&cluster, "down", None), "down");
    let latest = snapshot_file(&cluster, 2, "snapshot.rdkv");
    let mut bytes = std::fs::read(&latest).expect("node 2's snapshot");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 1;
    std::fs::write(&latest, bytes).expect("damage it");

    let refused = cluster_command(&cluster, "up", None);
    let text = String::from_utf8_lossy(&refused.stderr).to_string();
    assert!(
        !refused.status.success(),
        "up started from a damaged snapshot"
    );
    assert!(
        text.contains(latest.to_str().expect("utf-8"))
            && text.contains("RDKV_FROM_SNAPSHOT=previous"),
        "{text}"
    );
    assert!(!text.contains("panicked"), "{text}");
    // The choice is refused for every node at once (it would set their good snapshots aside),
    // and a value that is no choice is named.
    let up_with = |choice: &str| {
        std::process::Command::new(rdkv_integration_tests::process::workspace_binary(
            "rdkv-cluster",
        ))
        .args([
            "up",
            cluster.file.to_str().expect("utf-8"),
            "--run-dir",
            cluster.run_directory.to_str().expect("utf-8"),
            "--detach",
        ])
        .env("RDKV_FROM_SNAPSHOT", choice)
        .output()
        .expect("run rdkv-cluster")
    };
    for (choice, says) in [
        ("previous", "would set aside every node's latest snapshot"),
        ("bogus", "not a choice; use latest, previous"),
    ] {
        let refused = up_with(choice);
        let text = String::from_utf8_lossy(&refused.stderr).to_string();
        assert_eq!(refused.status.code(), Some(1), "{text}");
        assert!(text.contains(says), "{text}");
    }
    assert!(
        !snapshot_file(&cluster, 1, "snapshot.replaced.rdkv").exists(),
        "nothing was set aside"
    );
    // Nodes 1 and 3 start from the stop's snapshots and wait for node 2; node 2 starts from
    // its previous snapshot, joins, and is refilled from them.
    for node in ["1", "3"] {
        let file = cluster.file.to_str().expect("utf-8");
        let run = cluster.run_directory.to_str().expect("utf-8");
        succeeded(
            &rdkv_integration_tests::cluster::rdkv_cluster(&[
                "up",
                file,
                "--run-dir",
                run,
                "--node",
                node,
                "--detach",
            ]),
            "up of a node with an intact snapshot",
        );
    }
    let output = std::process::Command::new(rdkv_integration_tests::process::workspace_binary(
        "rdkv-cluster",
    ))
    .args([
        "up",
        cluster.file.to_str().expect("utf-8"),
        "--run-dir",
        cluster.run_directory.to_str().expect("utf-8"),
        "--node",
        "2",
        "--detach",
    ])
    .env("RDKV_FROM_SNAPSHOT", "previous")
    .output()
    .expect("run rdkv-cluster");
    succeeded(&output, "up of node 2 from its previous snapshot");
    check(&cluster, &expected).await;
    assert!(
        snapshot_file(&cluster, 2, "snapshot.replaced.rdkv").exists(),
        "the damaged snapshot is set aside"
    );
}

/// After a snapshot and more writes, `kill -9` of every node, then `up`: with one copy of each
/// key, every key is at its snapshot value or newer (the writes after the snapshot may be
/// lost, as Redis's RDB loses them), and a key deleted before the snapshot stays deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_of_every_node_keeps_every_key_as_of_the_snapshot_with_one_copy() {
    let cluster = Cluster::up_with("persistence-crash", |text| {
        sized(text.replace("replicas = 2", "replicas = 1").replace(
            "operation_deadline = \"2s\"",
            "operation_deadline = \"2s\"\nsnapshot_interval = \"0s\"",
        ))
    });
    let client = Client::from_file(&cluster.file).expect("a client");
    let expected = write_history(&client).await;
    succeeded(&cluster_command(&cluster, "snapshot", None), "snapshot");
    // 500 of the default 2,000 keys; the 5,000 at the full size.
    let mut newer = BTreeMap::new();
    for index in 0..(keys() / 4).min(5_000) {
        let value = format!("after-{index}").into_bytes();
        client.put(&key(index), &value).await.expect("put after");
        newer.insert(key(index), value);
    }
    client.close().await;
    for node in 1..=3 {
        signal(&cluster, node, Signal::SIGKILL);
        // Until the kernel has torn the process down, its ports still answer.
        wait_torn_down(pid_of(&cluster, node), Duration::from_secs(10));
    }
    let up = succeeded(&cluster_command(&cluster, "up", None), "up after the crash");
    wait_serving(&cluster, Duration::from_secs(90)).await;
    let wrong = keys_read_wrong(&cluster, &expected, &newer).await;
    assert!(
        wrong.is_empty(),
        "{} keys are older than the snapshot, first {:?}",
        wrong.len(),
        wrong.first()
    );
    // The writes after the snapshot are lost, and said so: the view records the crash as a
    // loss naming every node (one record, or one per epoch at which the nodes rejoined when
    // their starts spread out: 100,000 keys take a second each to load), `up` prints it, and
    // `status` exits 4.
    let losses: Vec<&str> = up
        .lines()
        .filter(|line| line.starts_with("keys may have been lost: the copies on node"))
        .collect();
    for node in ["1", "2", "3"] {
        assert!(
            losses.iter().any(|line| {
                let named = line
                    .split(" were down")
                    .next()
                    .unwrap_or_default()
                    .replace(',', " ");
                named.split_whitespace().any(|word| word == node)
            }),
            "node {node} is named in no loss line: {up}"
        );
    }
    let status = cluster_command(&cluster, "status", None);
    assert_eq!(
        status.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&status.stdout)
    );
}

/// A cluster stopped cleanly with one copy of each key, started again with `replicas = 2`:
/// the nodes would resume with one copy each, nothing would make the second, and a node's
/// crash would then lose keys silently. The start is refused with one line naming the
/// setting; with the file as it was, every key is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raising_replicas_across_a_stop_is_refused_naming_the_setting() {
    let cluster = Cluster::up_with("persistence-raise", |text| {
        text.replace("replicas = 2", "replicas = 1")
    });
    let client = Client::from_file(&cluster.file).expect("a client");
    for index in 0..50 {
        client.put(&key(index), b"one copy").await.expect("put");
    }
    client.close().await;
    succeeded(&cluster_command(&cluster, "down", None), "down");
    let text = std::fs::read_to_string(&cluster.file).expect("the file");
    std::fs::write(&cluster.file, text.replace("replicas = 1", "replicas = 2")).expect("edit");
    let raised = cluster_command(&cluster, "up", None);
    let stderr = String::from_utf8_lossy(&raised.stderr);
    assert_eq!(raised.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("raising replicas across a stop is not supported yet")
            && stderr.contains("put replicas = 1 back"),
        "{stderr}"
    );
    std::fs::write(&cluster.file, text).expect("restore");
    succeeded(&cluster_command(&cluster, "up", None), "up as it was");
    wait_serving(&cluster, Duration::from_secs(30)).await;
    let client = Client::from_file(&cluster.file).expect("a client");
    for index in 0..50 {
        let read = client.get(&key(index)).await.expect("get");
        assert_eq!(read.as_deref(), Some(&b"one copy"[..]), "key {index}");
    }
    client.close().await;
}

/// Every node's keys, as a scan of its table reads them: node id → key → (value, version).
type Tables = BTreeMap<u32, BTreeMap<Vec<u8>, (Vec<u8>, u64)>>;

/// Tries of one scan step that failed for a reason worth another (a lease renewal late on a
/// loaded machine: the client asks for the view and goes on).
const SCAN_TRIES: u32 = 10;

/// Reads every node's whole table one-sided (the scan a refill uses).
async fn tables(client: &Client, nodes: &[u32]) -> Tables {
    let mut tables = Tables::new();
    for node in nodes {
        let buckets = client.combined_buckets_of(*node).await.expect("buckets");
        let table = tables.entry(*node).or_default();
        let mut first = 0;
        while first < buckets {
            let count = rdkv_client::SCAN_BUCKETS.min(buckets - first);
            let mut tries = 0;
            let entries = loop {
                tries += 1;
                match client.scan_node(*node, first, count).await {
                    Ok(entries) => break entries,
                    Err(error) if error.is_retryable() && tries < SCAN_TRIES => {}
                    Err(error) => panic!("scan of node {node} at bucket {first}: {error}"),
                }
            };
            for entry in entries {
                table.insert(entry.key.to_vec(), (entry.value.to_vec(), entry.version));
            }
            first += count;
        }
    }
    tables
}

/// The keys of `keys` whose copies on their two replicas (of nodes 1 to 3) differ in value or
/// version, or of which one replica lacks a copy the other has.
fn copies_that_differ<'a>(tables: &Tables, keys: impl Iterator<Item = &'a Vec<u8>>) -> Vec<String> {
    let ids = [1u32, 2, 3];
    let mut differ = Vec::new();
    for key in keys {
        let copies: Vec<Option<&(Vec<u8>, u64)>> = sharding::replicas(key, &ids, 2)
            .into_iter()
            .map(|index| tables[&ids[index]].get(key))
            .collect();
        if copies.windows(2).any(|pair| pair[0] != pair[1]) {
            differ.push(format!(
                "{}: {:?}",
                String::from_utf8_lossy(key),
                copies
                    .iter()
                    .map(|copy| copy.map(|(value, version)| (value.len(), *version)))
                    .collect::<Vec<_>>()
            ));
        }
    }
    differ
}

/// With two copies of each key, snapshots of different moments on different nodes: a snapshot
/// of every node, then 1,000 overwrites (5,000 at `RDKV_PERSISTENCE_KEYS=100000`) and a
/// snapshot of node 1 alone, then writes in no snapshot, then `kill -9` of every node and
/// `up`. Each key whose copies include node 1 reads
/// as node 1's later snapshot has it (the newest copy wins, also where the other copy is the
/// primary's), every other key as the first snapshot has it, and the two copies of every key
/// agree, value and version, before anyone reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_of_every_node_with_two_copies_keeps_the_newest_snapshot_of_each_key_on_every_copy()
{
    let cluster = Cluster::up_with("persistence-crash-two", |text| {
        sized(text.replace(
            "operation_deadline = \"2s\"",
            "operation_deadline = \"2s\"\nsnapshot_interval = \"0s\"",
        ))
    });
    let client = Client::from_file(&cluster.file).expect("a client");
    let expected = write_history(&client).await;
    succeeded(&cluster_command(&cluster, "snapshot", None), "snapshot");
    // 1,000 of the default 2,000 keys; the 5,000 at the full size.
    let overwritten = (keys() / 2).min(5_000);
    let mut later = BTreeMap::new();
    for index in 0..overwritten {
        let value = format!("later-{index}").into_bytes();
        client.put(&key(index), &value).await.expect("put after");
        later.insert(key(index), value);
    }
    succeeded(
        &cluster_command(&cluster, "snapshot", Some(1)),
        "snapshot of node 1",
    );
    // In no snapshot: lost with the processes.
    for index in 0..overwritten / 5 {
        let value = format!("lost-{index}").into_bytes();
        client.put(&key(index), &value).await.expect("put lost");
    }
    client.close().await;
    // Each key is as of the newest snapshot that holds it.
    let ids = [1u32, 2, 3];
    let mut newest = expected.clone();
    for (key, value) in &later {
        let on_node_1 = sharding::replicas(key, &ids, 2)
            .into_iter()
            .any(|index| ids[index] == 1);
        if on_node_1 {
            newest.insert(key.clone(), Some(value.clone()));
        }
    }
    for node in 1..=3 {
        signal(&cluster, node, Signal::SIGKILL);
        wait_torn_down(pid_of(&cluster, node), Duration::from_secs(10));
    }
    // `up` waits until the nodes serve, after their reconciliation: the reads run meanwhile.
    let up = rdkv_integration_tests::view::up_in_background(&cluster);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // While the nodes reconcile, nobody reads an older copy: each read fails (the nodes admit
    // no data client then) or, once they serve, returns the newest.
    let early = Client::from_file(&cluster.file).expect("a client");
    let reads = later.keys().map(|key| early.get(key));
    let outcomes = futures_util::future::join_all(reads).await;
    succeeded(&up.join().expect("the up thread"), "up after the crash");
    let stale: Vec<_> = later
        .keys()
        .zip(&outcomes)
        .filter_map(|(key, outcome)| match outcome {
            Ok(read) if read.as_deref() != newest[key].as_deref() => Some(format!(
                "{} read {:?}, newest {:?}",
                String::from_utf8_lossy(key),
                read.as_deref().map(String::from_utf8_lossy),
                newest[key].as_deref().map(String::from_utf8_lossy)
            )),
            _ => None,
        })
        .collect();
    early.close().await;
    assert!(
        stale.is_empty(),
        "{} keys read an older copy while the nodes reconciled, first {:?}",
        stale.len(),
        &stale[..stale.len().min(5)]
    );
    wait_serving(&cluster, Duration::from_secs(120)).await;

    // The copies agree before anyone reads (the scan reads the tables, not through a primary).
    let client = Client::from_file(&cluster.file).expect("a client");
    let tables = tables(&client, &[1, 2, 3]).await;
    let differ = copies_that_differ(&tables, expected.keys());
    assert!(
        differ.is_empty(),
        "{} keys have copies that differ, first {:?}",
        differ.len(),
        &differ[..differ.len().min(5)]
    );
    client.close().await;
    let wrong = keys_read_wrong(&cluster, &newest, &BTreeMap::new()).await;
    assert!(
        wrong.is_empty(),
        "{} of {} keys are not as of their newest snapshot, first {:?}",
        wrong.len(),
        newest.len(),
        &wrong[..wrong.len().min(5)]
    );
    // Nodes 2 and 3 took node 1's newer copies.
    let config = rdkv_cluster_config::load(&cluster.file).expect("the generated file is valid");
    let taken: f64 = config
        .nodes
        .iter()
        .map(|node| {
            let samples = scrape(node.metrics_address.expect("a metrics address"));
            samples[&format!("rdkv_reconciled_keys_total{{node=\"{}\"}}", node.id)]
        })
        .sum();
    assert!(taken > 0.0, "no node took a newer copy from a peer");
}
