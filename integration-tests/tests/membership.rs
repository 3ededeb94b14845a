//! Membership changes under load (issue 40): three nodes under a bounded load of get, put,
//! delete and compare-and-swap from separate clients; a fourth node is added
//! (`rdkv-cluster add-node`: it joins, fills and serves), then node 1 is removed
//! (`rdkv-cluster remove-node`: it hands its keys over, leaves the view and is stopped), while
//! the load goes on. The history must be linearizable, every acknowledged write of a preloaded
//! set of keys must read back afterwards, and each remaining node must hold its even share of
//! the keys' copies within ±15% once the extra copies are swept. With `replicas = 2` and 1.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkv_client::{Client, ClientBuilder};
use rdkv_common::ports::ReservedPorts;
use rdkv_common::protocol::MemberState;
use rdkv_integration_tests::cluster::{rdkv_cluster, Cluster};
use rdkv_integration_tests::linearizability::{check, Verdict};
use rdkv_integration_tests::membership::{
    assert_read_back, assert_refused, fourth_node, load, membership_command, preload,
    three_nodes_and_a_fourth_listed, KEYS,
};
use rdkv_integration_tests::view::{
    log_of, output_text, state_of, stats_of, up_settled_edited, wait_for_view, Nodes,
};

/// Keys written before the changes and read back after them (and counted per node).
const PRELOADED: usize = 1_000;

/// One real cluster at a time: two at once on a 2-core machine would time each other out.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The shape of one run.
struct Run {
    /// Test tag (directory name).
    tag: &'static str,
    /// `replicas` in the cluster file.
    replicas: usize,
    /// Load clients.
    clients: u64,
    /// When, from the load's start, the fourth node is added.
    add_at: Duration,
    /// When node 1 is removed (or a second after the addition is done, if that is later).
    remove_at: Duration,
    /// When the load ends (or a second after the removal is done, if that is later).
    end_at: Duration,
    /// Whether the cluster is then stopped (`down`, node 1 out of the file) and started
    /// again (`up`), and the preloaded keys read back once more.
    restart: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_added_and_a_node_removed_under_load_with_two_copies() {
    membership_run(Run {
        tag: "membership-two-copies",
        replicas: 2,
        clients: 6,
        add_at: Duration::from_secs(1),
        remove_at: Duration::from_secs(2),
        end_at: Duration::from_secs(3),
        restart: false,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_added_and_a_node_removed_under_load_with_one_copy() {
    membership_run(Run {
        tag: "membership-one-copy",
        replicas: 1,
        clients: 6,
        add_at: Duration::from_secs(1),
        remove_at: Duration::from_secs(2),
        end_at: Duration::from_secs(3),
        restart: false,
    })
    .await;
}

/// A grown and shrunk cluster stops and starts again from its snapshots: the members are the
/// view's (2, 3 and 4), and every acknowledged write is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_cluster_stops_and_starts_again_with_its_members_and_keys() {
    membership_run(Run {
        tag: "membership-restart",
        replicas: 2,
        clients: 2,
        add_at: Duration::from_secs(1),
        remove_at: Duration::from_secs(2),
        end_at: Duration::from_secs(3),
        restart: true,
    })
    .await;
}

/// What `add-node` and `remove-node` refuse, each with one line naming the fix and exit 1; and
/// an `add-node` of a member that serves already, which has nothing to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_commands_refuse_what_they_cannot_do_and_name_the_fix() {
    let _serial = SERIAL.lock().await;
    let settled = up_settled_edited("membership-refusals", 3, |text| text).await;
    let (cluster, ..) = settled.parts();
    let file = cluster.file.to_str().expect("utf-8").to_string();
    let run_directory = cluster.run_directory.to_str().expect("utf-8").to_string();
    let refusals = [
        ("add-node", 9, "add its [[node]] section"),
        ("remove-node", 9, "keep its [[node]] section"),
    ];
    for (command, node, says) in refusals {
        assert_refused(command, file.clone(), run_directory.clone(), node, says).await;
    }
    // Node 4 listed and started by `up` instead of `add-node`: it would begin a view of its
    // own from the file's four nodes.
    let fourth_ports = ReservedPorts::loopback(3).expect("reserve ports for node 4");
    let mut text = std::fs::read_to_string(&cluster.file).expect("read the cluster file");
    text.push_str(&fourth_node(&fourth_ports));
    std::fs::write(&cluster.file, text).expect("write the cluster file");
    assert_refused(
        "up",
        file.clone(),
        run_directory.clone(),
        4,
        "never joined this cluster; add each with `rdkv-cluster add-node",
    )
    .await;
    let output = membership_command("add-node", file, run_directory, 2).await;
    let text = output_text(&output);
    assert_eq!(output.status.code(), Some(0), "add-node --node 2: {text}");
    assert!(
        text.contains("node 2 is a member already, serving"),
        "add-node --node 2: {text}"
    );
}

/// With one copy, keys deleted right after they moved to an added member stay deleted when
/// that member is removed at once: the keys' old copies on their earlier members are extra
/// until those members' sweeps, and a delete leaves no tombstone to hand over, so the leader
/// retires a member only once every member swept the newest view (`docs/protocol.md`,
/// *Membership changes*). Without that wait the removal brought them back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_deleted_after_they_moved_stay_deleted_when_their_new_member_leaves() {
    let _serial = SERIAL.lock().await;
    let (cluster, _nodes, _secret, _, stale, _fourth_ports) =
        three_nodes_and_a_fourth_listed("membership-deleted", 1).await;
    stale.close().await;
    let preloaded = preload(&cluster.file, PRELOADED).await;
    let file = cluster.file.to_str().expect("utf-8").to_string();
    let run_directory = cluster.run_directory.to_str().expect("utf-8").to_string();
    let added = membership_command("add-node", file.clone(), run_directory.clone(), 4).await;
    assert!(added.status.success(), "add-node: {}", output_text(&added));
    let client = ClientBuilder::cluster_file(&cluster.file)
        .build()
        .expect("client");
    for (key, _) in &preloaded {
        client
            .delete(key.as_bytes())
            .await
            .unwrap_or_else(|error| panic!("deleting {key}: {error}"));
    }
    client.close().await;
    let removed = membership_command("remove-node", file, run_directory, 4).await;
    assert!(
        removed.status.success(),
        "remove-node: {}",
        output_text(&removed)
    );
    let client = ClientBuilder::cluster_file(&cluster.file)
        .build()
        .expect("client");
    let mut back = Vec::new();
    for (key, _) in &preloaded {
        match client.get(key.as_bytes()).await {
            Ok(None) => {}
            other => back.push(format!("{key}: {other:?}")),
        }
    }
    client.close().await;
    assert!(
        back.is_empty(),
        "{} of {} deleted keys are back after the removal: {:?}",
        back.len(),
        preloaded.len(),
        &back[..back.len().min(8)]
    );
}

/// The issue's run: 16 clients for 60 s, the fourth node added at 15 s, node 1 removed at
/// 35 s (`cargo test -p rdkv-integration-tests --test membership -- --ignored`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a minute of load: run by hand"]
async fn the_issue_run_with_two_copies() {
    membership_run(Run {
        tag: "membership-long-two",
        replicas: 2,
        clients: 16,
        add_at: Duration::from_secs(15),
        remove_at: Duration::from_secs(35),
        end_at: Duration::from_secs(60),
        restart: false,
    })
    .await;
}

/// As [`the_issue_run_with_two_copies`], with one copy of each key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a minute of load: run by hand"]
async fn the_issue_run_with_one_copy() {
    membership_run(Run {
        tag: "membership-long-one",
        replicas: 1,
        clients: 16,
        add_at: Duration::from_secs(15),
        remove_at: Duration::from_secs(35),
        end_at: Duration::from_secs(60),
        restart: false,
    })
    .await;
}

async fn membership_run(run: Run) {
    let _serial = SERIAL.lock().await;
    let (cluster, nodes, secret, leader, stale, _fourth_ports) =
        three_nodes_and_a_fourth_listed(run.tag, run.replicas).await;
    let preloaded = preload(&cluster.file, PRELOADED).await;
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for index in 0..run.clients {
        // One client per task, made from the file that lists node 4: a client of the file
        // before it cannot route to the new member.
        let client = ClientBuilder::cluster_file(&cluster.file)
            .build()
            .expect("client");
        tasks.push(tokio::spawn(load(client, index, start, stop.clone())));
    }
    let said = change_members(&run, &cluster, start, stale).await;
    let end = run.end_at.max(start.elapsed() + Duration::from_secs(1));
    tokio::time::sleep(end.saturating_sub(start.elapsed())).await;
    stop.store(true, Ordering::Relaxed);
    let mut history = Vec::new();
    let mut errors = Vec::new();
    for task in tasks {
        let seen = task.await.expect("load task");
        history.extend(seen.events);
        errors.extend(seen.errors);
    }
    let observer = if leader == 1 { 2 } else { leader };
    let (view, _) = wait_for_view(&nodes, &secret, observer, Duration::from_secs(10), |view| {
        view.members.len() == 3
            && view
                .members
                .iter()
                .all(|member| member.state == MemberState::Serving)
    })
    .await
    .expect("nodes 2, 3 and 4 serve");
    assert_eq!(state_of(&view, 1), None, "node 1 is out of the view");
    eprintln!(
        "{} operations in {:?}; {said}; {} errors; view {}",
        history.len(),
        start.elapsed(),
        errors.len(),
        view.summary()
    );
    for error in errors.iter().take(8) {
        eprintln!("  error: {error}");
    }
    assert_eq!(check(&history), Verdict::Linearizable);
    assert_read_back(&cluster.file, &preloaded, "after the changes").await;
    let refilled = stats_of(&nodes, &secret, 4)
        .await
        .map_or(0, |stats| stats.refill_keys_copied);
    assert!(refilled > 0, "node 4 copied no key when it joined");
    assert_even_shares(&nodes, &secret, run.replicas).await;
    if run.restart {
        restart_without_node_1(&cluster, &nodes, &secret, &preloaded).await;
    }
}

/// Adds node 4 at `run.add_at` and removes node 1 at `run.remove_at` (from `start`), each
/// with its `rdkv-cluster` command, which must succeed; checks meanwhile that `stale`, a
/// client of the file before node 4, fails naming the fix. What happened, as a line.
async fn change_members(run: &Run, cluster: &Cluster, start: Instant, stale: Client) -> String {
    let file = cluster.file.to_str().expect("utf-8").to_string();
    let run_directory = cluster.run_directory.to_str().expect("utf-8").to_string();
    tokio::time::sleep(run.add_at.saturating_sub(start.elapsed())).await;
    let added_at = start.elapsed();
    let added = membership_command("add-node", file.clone(), run_directory.clone(), 4).await;
    let added_text = output_text(&added);
    assert!(added.status.success(), "add-node failed: {added_text}");
    let add_took = start.elapsed() - added_at;
    // It cannot reach node 4: its operations fail, naming the fix, and write nothing.
    let refused = stale.put(b"stale-client-key", b"lost?").await;
    match &refused {
        Err(error)
            if error
                .to_string()
                .contains("make the client from the cluster file") => {}
        other => panic!("a client of the older file wrote: {other:?}"),
    }
    stale.close().await;

    let remove_at = run.remove_at.max(start.elapsed() + Duration::from_secs(1));
    tokio::time::sleep(remove_at.saturating_sub(start.elapsed())).await;
    let removed_at = start.elapsed();
    let removed = membership_command("remove-node", file, run_directory, 1).await;
    let removed_text = output_text(&removed);
    assert!(
        removed.status.success(),
        "remove-node failed: {removed_text}"
    );
    assert!(
        removed_text.contains("bytes) handed over"),
        "remove-node reports the hand-over: {removed_text}"
    );
    assert_stopped_serving_before_removal(&log_of(cluster, 1));
    eprintln!("add-node said:\n{added_text}remove-node said:\n{removed_text}");
    format!(
        "add-node at {added_at:?} took {add_took:?}; remove-node at {removed_at:?} took {:?}",
        start.elapsed() - removed_at
    )
}

/// The leaving node stopped serving data after its hand-over and before the view without it
/// was committed (it asks for that view only once it stopped): otherwise a client still
/// routing by the view that had it leaving reads it after a write of the view without it
/// (`docs/protocol.md`, *Membership changes*; the model's `leave` scenario fails without it).
fn assert_stopped_serving_before_removal(log: &str) {
    let stopped = log
        .find("reason=this node handed its keys over and leaves the cluster view")
        .unwrap_or_else(|| panic!("node 1 never stopped serving after its hand-over:\n{log}"));
    // The leader logs its commit; a follower, the answer to its request. Either may be
    // missing: `remove-node` stops the node once the others' views lack it.
    let removed = [
        "command=RemoveMember",
        "removed from the view: it serves nothing",
    ]
    .iter()
    .filter_map(|text| log.find(text))
    .min();
    assert!(
        removed.is_none_or(|removed| stopped < removed),
        "node 1 was removed before it stopped serving:\n{log}"
    );
}

/// Takes node 1 out of the cluster file, stops the cluster and starts it again: nodes 2, 3 and
/// 4 serve, and every preloaded key reads back.
async fn restart_without_node_1(
    cluster: &Cluster,
    nodes: &Nodes,
    secret: &[u8],
    preloaded: &[(String, String)],
) {
    let text = std::fs::read_to_string(&cluster.file).expect("read the cluster file");
    let start = text.find("[[node]]\nid = 1\n").expect("node 1's section");
    let end = start
        + 1
        + text[start + 1..]
            .find("[[node]]")
            .expect("a section after node 1's");
    std::fs::write(&cluster.file, format!("{}{}", &text[..start], &text[end..]))
        .expect("write the cluster file");
    let file = cluster.file.to_str().expect("utf-8");
    let run_directory = cluster.run_directory.to_str().expect("utf-8");
    let down = tokio::task::spawn_blocking({
        let (file, run_directory) = (file.to_string(), run_directory.to_string());
        move || rdkv_cluster(&["down", &file, "--run-dir", &run_directory])
    })
    .await
    .expect("down's thread");
    assert!(down.status.success(), "down failed: {}", output_text(&down));
    let up = tokio::task::spawn_blocking({
        let (file, run_directory) = (file.to_string(), run_directory.to_string());
        move || rdkv_cluster(&["up", &file, "--run-dir", &run_directory, "--detach"])
    })
    .await
    .expect("up's thread");
    assert!(up.status.success(), "up failed: {}", output_text(&up));
    let (view, _) = wait_for_view(nodes, secret, 2, Duration::from_secs(60), |view| {
        view.members.len() == 3
            && view
                .members
                .iter()
                .all(|member| member.state == MemberState::Serving)
    })
    .await
    .expect("nodes 2, 3 and 4 serve again");
    assert_eq!(state_of(&view, 1), None, "node 1 is still out of the view");
    assert_read_back(&cluster.file, preloaded, "after down and up").await;
}

/// Waits (30 s at most: each node sweeps its extra copies once the view settles) until each
/// of nodes 2, 3 and 4 holds its even share of the keys' copies within ±15%.
async fn assert_even_shares(nodes: &Nodes, secret: &[u8], replicas: usize) {
    let started = Instant::now();
    loop {
        let mut counts = Vec::new();
        for id in [2, 3, 4] {
            counts.push(
                stats_of(nodes, secret, id)
                    .await
                    .map_or(0, |stats| stats.keys),
            );
        }
        // The load's keys present at the end add at most `KEYS` to the preloaded ones.
        let copies = (PRELOADED as u64 + KEYS / 2) * replicas as u64;
        let share = copies as f64 / 3.0;
        let within = counts
            .iter()
            .all(|count| (*count as f64 - share).abs() <= share * 0.15);
        if within {
            eprintln!("keys on nodes 2, 3, 4: {counts:?} (even share {share:.0})");
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "keys on nodes 2, 3, 4: {counts:?}, not within 15% of an even share of {share:.0}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
