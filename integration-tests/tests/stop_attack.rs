//! Lost or resurrected data across whole-cluster stops mixed with a node's stop or death just
//! before them (`docs/operations.md`, *Persistence*; found by attacking issue 38's stops).
//!
//! Writers each own disjoint keys and write them one operation at a time, recording every
//! outcome; after the restart each key must read as its last acknowledged operation left it, or
//! as one of the operations after it that failed (it may have applied).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use rdkv_client::Client;
use rdkv_integration_tests::cluster::Cluster;
use rdkv_integration_tests::history::{
    assert_none_wrong, delete_or_overwrite, join_writers, key_of, start_writers,
    stop_and_wait_down, summary, write_first, wrong_keys, History, Op,
};
use rdkv_integration_tests::view::{
    cluster_command, nodes_of, output_text, pid_of, signal, succeeded, wait_serving, wait_torn_down,
};

/// One cluster at a time: each test starts three nodes, kills and stops them, and two at once
/// on a loaded 2-core machine would time each other out.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn cluster_with(tag: &str, replicas: usize, extra: &str) -> Cluster {
    Cluster::up_with(&format!("stop-attack-{tag}-r{replicas}"), |text| {
        text.replace("replicas = 2", &format!("replicas = {replicas}"))
            .replace(
                "operation_deadline = \"2s\"",
                &format!("operation_deadline = \"2s\"\n{extra}"),
            )
    })
}

/// Writers run right up to (and through) `rdkv-cluster down`; after `up` every acknowledged
/// write and delete holds.
async fn writes_racing_down(replicas: usize) {
    writes_racing_down_with(replicas, "").await;
}

async fn writes_racing_down_with(replicas: usize, extra: &str) {
    let _serial = SERIAL.lock().await;
    let cluster = cluster_with("racing-down", replicas, extra);
    let client = Arc::new(Client::from_file(&cluster.file).expect("a client"));
    let stop = Arc::new(AtomicBool::new(false));
    let handles = start_writers(&client, 4, 200, &stop, Duration::from_secs(30));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let down = {
        let cluster_file = cluster.file.clone();
        let run = cluster.run_directory.clone();
        tokio::task::spawn_blocking(move || {
            rdkv_integration_tests::cluster::rdkv_cluster(&[
                "down",
                cluster_file.to_str().unwrap(),
                "--run-dir",
                run.to_str().unwrap(),
            ])
        })
        .await
        .expect("down")
    };
    // Keep writing a little after `down` returned, to catch late acks.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Release);
    let history = join_writers(handles).await;
    client.close().await;
    succeeded(&down, "down");
    eprintln!("ops {:?}", summary(&history));
    succeeded(&cluster_command(&cluster, "up", None), "up");
    wait_serving(&cluster, Duration::from_secs(60)).await;
    let wrong = wrong_keys(&cluster, &history).await;
    assert_none_wrong(&wrong, history.len(), "after down (racing writes) and up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_racing_down_survive_up_with_two_copies() {
    writes_racing_down(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_racing_down_survive_up_with_one_copy() {
    writes_racing_down(1).await;
}

/// `down --node` of node 1 or of the leader, deletes and overwrites, then `rdkv-cluster down`
/// of the rest and `up`.
async fn node_down_then_cluster_down(replicas: usize, leader_first: bool) {
    let _serial = SERIAL.lock().await;
    let cluster = cluster_with(
        if leader_first {
            "leader-down-delete"
        } else {
            "node-down-delete"
        },
        replicas,
        "snapshot_interval = \"0s\"",
    );
    let client = Client::from_file(&cluster.file).expect("a client");
    let mut history = write_first(&client, 8).await;
    let (nodes, secret) = nodes_of(&cluster);
    let leader = rdkv_integration_tests::view::view_of(&nodes, &secret, 2)
        .await
        .and_then(|view| view.leader);
    eprintln!("leader before down --node: {leader:?}");
    let victim = if leader_first {
        leader.expect("a leader")
    } else {
        1
    };
    succeeded(
        &cluster_command(&cluster, "down", Some(victim)),
        "down --node",
    );
    delete_or_overwrite(&client, 8, &mut history).await;
    client.close().await;
    eprintln!("ops {:?}", summary(&history));
    let down = cluster_command(&cluster, "down", None);
    eprintln!(
        "down (exit {:?}): {}",
        down.status.code(),
        output_text(&down)
    );
    succeeded(&down, "down");
    let up = succeeded(&cluster_command(&cluster, "up", None), "up");
    eprintln!("up: {up}");
    wait_serving(&cluster, Duration::from_secs(90)).await;
    let wrong = wrong_keys(&cluster, &history).await;
    assert_none_wrong(
        &wrong,
        history.len(),
        &format!("down --node {victim}, deletes, down, up"),
    );
}

/// `down --node L` of the view's leader, deletes, then `rdkv-cluster down` at once: the others
/// have no leader yet. `down` asks again while they elect one, so the stop is committed, and
/// after `up` the nodes resume from it: no deleted key comes back from the left node's copy
/// (when `down` gave up at once, they reconciled, and the deletes were undone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_after_the_leader_left_stay_deleted_across_down_and_up() {
    node_down_then_cluster_down(2, true).await;
}

/// A snapshot of every node, then deletes and overwrites, then `kill -9` of the view's leader
/// and `rdkv-cluster down` at once (the others stop cleanly); then `up`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_before_the_leader_is_killed_and_the_cluster_stopped_stay_deleted() {
    let _serial = SERIAL.lock().await;
    let cluster = cluster_with("leader-killed-down", 2, "snapshot_interval = \"0s\"");
    let client = Client::from_file(&cluster.file).expect("a client");
    let mut history = write_first(&client, 5).await;
    succeeded(&cluster_command(&cluster, "snapshot", None), "snapshot");
    delete_or_overwrite(&client, 5, &mut history).await;
    client.close().await;
    let (nodes, secret) = nodes_of(&cluster);
    let leader = rdkv_integration_tests::view::view_of(&nodes, &secret, 1)
        .await
        .and_then(|view| view.leader)
        .expect("a leader");
    eprintln!("killing the leader, node {leader}");
    signal(&cluster, leader, Signal::SIGKILL);
    wait_torn_down(pid_of(&cluster, leader), Duration::from_secs(10));
    let down = cluster_command(&cluster, "down", None);
    eprintln!(
        "down (exit {:?}): {}",
        down.status.code(),
        output_text(&down)
    );
    let up = output_text(&cluster_command(&cluster, "up", None));
    eprintln!("up: {up}");
    wait_serving(&cluster, Duration::from_secs(90)).await;
    let wrong = wrong_keys(&cluster, &history).await;
    assert_none_wrong(&wrong, history.len(), "leader killed, down at once, up");
}

/// `kill -9` of the view's leader, `rdkv-cluster down` a second later (before the others mark
/// it down: the stop takes it down with them), then `up`: the killed node is started by the
/// same `up` and joins (its snapshot is not the stop's), so the resumed members do not wait
/// out the 30 s resume bound for it (`serving without the members of the stop that did not
/// come back`). Before, the replayed log told the new process the stop was its own, and it
/// never asked to join.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_killed_before_the_stop_joins_at_the_next_up() {
    let _serial = SERIAL.lock().await;
    let cluster = cluster_with("killed-leader-up", 2, "snapshot_interval = \"0s\"");
    let client = Client::from_file(&cluster.file).expect("a client");
    for index in 0..100 {
        client.put(&key_of(2, index), b"value").await.expect("put");
    }
    client.close().await;
    succeeded(&cluster_command(&cluster, "snapshot", None), "snapshot");
    let (nodes, secret) = nodes_of(&cluster);
    let leader = rdkv_integration_tests::view::view_of(&nodes, &secret, 1)
        .await
        .and_then(|view| view.leader)
        .expect("a leader");
    signal(&cluster, leader, Signal::SIGKILL);
    wait_torn_down(pid_of(&cluster, leader), Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let down = cluster_command(&cluster, "down", None);
    eprintln!("down: {}", output_text(&down));
    let up = output_text(&cluster_command(&cluster, "up", None));
    eprintln!("up: {up}");
    wait_serving(&cluster, Duration::from_secs(90)).await;
    for id in 1..=3 {
        let log = rdkv_integration_tests::view::log_of(&cluster, id);
        assert!(
            !log.contains("serving without the members of the stop that did not come back"),
            "node {id} waited out the resume bound for the killed leader {leader}"
        );
    }
    let client = Client::from_file(&cluster.file).expect("a client");
    for index in 0..100 {
        let read = client.get(&key_of(2, index)).await.expect("get");
        assert_eq!(read.as_deref(), Some(&b"value"[..]), "key {index}");
    }
    client.close().await;
}

/// A snapshot of every node (values v1), then v2 written to every key, then `kill -9` of the
/// view's leader and `rdkv-cluster down` a second later (the stop takes the killed node down
/// with the others). `up`: the killed node loads its v1 snapshot, which names no stop; `down`
/// again, then `up` again: every key must read v2. Before, its replayed view log said the stop
/// took it down, so it did not join, its final snapshot at the second `down` named the stop,
/// and the second `up` resumed from its v1 copies (about a third of the keys read v1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_killed_before_the_stop_never_passes_its_older_snapshot_for_the_stop_s() {
    stale_snapshot_relabelled(true).await;
}

/// The same with a follower killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_killed_before_the_stop_never_passes_its_older_snapshot_for_the_stop_s() {
    stale_snapshot_relabelled(false).await;
}

async fn stale_snapshot_relabelled(kill_leader: bool) {
    let _serial = SERIAL.lock().await;
    let tag = if kill_leader {
        "relabelled-leader"
    } else {
        "relabelled-follower"
    };
    let cluster = cluster_with(tag, 2, "snapshot_interval = \"0s\"");
    let client = Client::from_file(&cluster.file).expect("a client");
    let mut history = History::new();
    for index in 0..300 {
        let key = key_of(1, index);
        let value = format!("v1-{index}").into_bytes();
        client.put(&key, &value).await.expect("put v1");
        history.entry(key).or_default().push(Op {
            value: Some(value),
            ok: true,
        });
    }
    succeeded(&cluster_command(&cluster, "snapshot", None), "snapshot");
    for index in 0..300 {
        let key = key_of(1, index);
        let value = format!("v2-{index}").into_bytes();
        client.put(&key, &value).await.expect("put v2");
        history.entry(key).or_default().push(Op {
            value: Some(value),
            ok: true,
        });
    }
    client.close().await;
    let (nodes, secret) = nodes_of(&cluster);
    let leader = rdkv_integration_tests::view::view_of(&nodes, &secret, 1)
        .await
        .and_then(|view| view.leader)
        .expect("a leader");
    let leader = if kill_leader {
        leader
    } else {
        (1..=3).find(|id| *id != leader).expect("a follower")
    };
    signal(&cluster, leader, Signal::SIGKILL);
    wait_torn_down(pid_of(&cluster, leader), Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(if kill_leader { 1000 } else { 300 })).await;
    let down = cluster_command(&cluster, "down", None);
    eprintln!("killed node {leader}; down: {}", output_text(&down));
    let up = output_text(&cluster_command(&cluster, "up", None));
    eprintln!("first up: {up}");
    let down = cluster_command(&cluster, "down", None);
    eprintln!("second down: {}", output_text(&down));
    let up = output_text(&cluster_command(&cluster, "up", None));
    eprintln!("second up: {up}");
    wait_serving(&cluster, Duration::from_secs(90)).await;
    let wrong = wrong_keys(&cluster, &history).await;
    assert_none_wrong(
        &wrong,
        history.len(),
        &format!("node {leader} killed, down, up, down (while it waits), up"),
    );
}

/// Every node stopped one at a time (SIGTERM, as `systemctl stop` of each does) with two
/// copies: node 1, then deletes and overwrites, node 2, then writes to a third of the keys
/// (those whose copies are nodes 1 and 2 have none serving: they fail), node 3; then `up`.
/// Every acknowledged write holds and no deleted key comes back: node 2's final snapshot holds
/// every write of its keys until it stopped, so it decides over node 1's older copies (and
/// their absence does). Before, newest-wins kept node 1's copies of the keys deleted after it
/// stopped (about 95 of 300 came back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_stopped_one_at_a_time_keep_every_delete_and_write() {
    let _serial = SERIAL.lock().await;
    let cluster = cluster_with("one-at-a-time", 2, "snapshot_interval = \"0s\"");
    let client = Client::from_file(&cluster.file).expect("a client");
    let mut history = write_first(&client, 6).await;
    let (nodes, secret) = nodes_of(&cluster);
    stop_and_wait_down(&cluster, &nodes, &secret, 1, 3, true).await;
    delete_or_overwrite(&client, 6, &mut history).await;
    stop_and_wait_down(&cluster, &nodes, &secret, 2, 3, false).await;
    for index in (0..300).step_by(3) {
        let key = key_of(6, index);
        let value = format!("third-{index}").into_bytes();
        let ok = client.put(&key, &value).await.is_ok();
        history.entry(key).or_default().push(Op {
            value: Some(value),
            ok,
        });
    }
    client.close().await;
    eprintln!("ops {:?}", summary(&history));
    signal(&cluster, 3, Signal::SIGTERM);
    wait_torn_down(pid_of(&cluster, 3), Duration::from_secs(20));
    let up = output_text(&cluster_command(&cluster, "up", None));
    eprintln!("up: {up}");
    wait_serving(&cluster, Duration::from_secs(90)).await;
    let wrong = wrong_keys(&cluster, &history).await;
    assert_none_wrong(
        &wrong,
        history.len(),
        "nodes 1, 2 and 3 stopped one at a time (SIGTERM), deletes between, up",
    );
    // Node 1 held every key deleted after it stopped whose copies include it: removed there.
    let mut removed = 0;
    for id in 1..=3 {
        let stats = rdkv_integration_tests::view::stats_of(&nodes, &secret, id)
            .await
            .expect("stats");
        eprintln!(
            "node {id}: reconciled_removed {} reconciled_keys {}",
            stats.reconciled_removed, stats.reconciled_keys
        );
        removed += stats.reconciled_removed;
    }
    assert!(removed > 0, "no node removed a decided-over copy");
}
