//! A node failure in the middle of a membership change (issue 40), under a checked load with
//! `replicas = 2`: node 4 is SIGKILLed while it joins (the addition is abandoned:
//! `remove-node` takes the never-served member out at once), then node 1 is SIGKILLed while it
//! leaves (the removal is abandoned: it is down, its keys on their other copies), restarted,
//! refilled, and removed again. The history must be linearizable and every preloaded
//! acknowledged write must read back. And the changes it refuses: a node added back with an
//! old snapshot, and any change while a member that served is down.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rdkv_client::ClientBuilder;
use rdkv_common::protocol::MemberState;
use rdkv_integration_tests::cluster::Cluster;
use rdkv_integration_tests::linearizability::{check, Verdict};
use rdkv_integration_tests::membership::{
    assert_read_back, assert_refused, load, membership_command, preload,
    three_nodes_and_a_fourth_listed,
};
use rdkv_integration_tests::process::workspace_binary;
use rdkv_integration_tests::view::{
    cluster_command, output_text, pid_of, signal, wait_torn_down, Nodes,
};

/// Keys written first and read back at the end: enough that a refill and a hand-over last
/// long enough to be interrupted.
const PRELOADED: usize = 3_000;

/// `rdkv-cluster COMMAND FILE --node N --run-dir DIR` started in the background.
fn start_command(cluster: &Cluster, command: &str, node: u32) -> Child {
    Command::new(workspace_binary("rdkv-cluster"))
        .args([command, cluster.file.to_str().expect("utf-8")])
        .args(["--node", &node.to_string()])
        .args(["--run-dir", cluster.run_directory.to_str().expect("utf-8")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start rdkv-cluster")
}

/// Waits (30 s at most) until node 2's view has node `id` in `state`.
async fn wait_state(nodes: &Nodes, secret: &[u8], id: u32, state: Option<MemberState>) {
    rdkv_integration_tests::membership::wait_state(nodes, secret, 2, id, state).await;
}

/// SIGKILLs node `id` (its command, `command`, is killed too: it would wait for what will not
/// happen) and waits until the view has it down.
async fn kill_mid_change(
    cluster: &Cluster,
    nodes: &Nodes,
    secret: &[u8],
    id: u32,
    mut command: Child,
) {
    let pid = pid_of(cluster, id);
    signal(cluster, id, Signal::SIGKILL);
    wait_torn_down(pid, Duration::from_secs(10));
    let _ = command.kill();
    let _ = command.wait();
    wait_state(nodes, secret, id, Some(MemberState::Down)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_while_it_joins_or_leaves_loses_no_acknowledged_write() {
    let (cluster, nodes, secret, _, stale, _fourth_ports) =
        three_nodes_and_a_fourth_listed("membership-failures", 2).await;
    stale.close().await;
    let preloaded = preload(&cluster.file, PRELOADED).await;
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for index in 0..4 {
        let client = ClientBuilder::cluster_file(&cluster.file)
            .build()
            .expect("client");
        tasks.push(tokio::spawn(load(client, index, start, stop.clone())));
    }
    let file = cluster.file.to_str().expect("utf-8").to_string();
    let run_directory = cluster.run_directory.to_str().expect("utf-8").to_string();

    // Node 4 killed while it joins: the addition is abandoned.
    let adding = start_command(&cluster, "add-node", 4);
    wait_state(&nodes, &secret, 4, Some(MemberState::Joining)).await;
    kill_mid_change(&cluster, &nodes, &secret, 4, adding).await;
    let abandoned = membership_command("remove-node", file.clone(), run_directory.clone(), 4).await;
    assert!(
        abandoned.status.success(),
        "remove-node of the never-served node 4: {}",
        output_text(&abandoned)
    );
    wait_state(&nodes, &secret, 4, None).await;

    // Node 1 killed while it leaves: the removal is abandoned, node 1 is down.
    let removing = start_command(&cluster, "remove-node", 1);
    wait_state(&nodes, &secret, 1, Some(MemberState::Leaving)).await;
    kill_mid_change(&cluster, &nodes, &secret, 1, removing).await;
    let restart = cluster_command(&cluster, "restart", Some(1));
    assert!(restart.status.success(), "{}", output_text(&restart));
    wait_state(&nodes, &secret, 1, Some(MemberState::Serving)).await;
    let removed = membership_command("remove-node", file, run_directory, 1).await;
    assert!(
        removed.status.success(),
        "remove-node of node 1, back: {}",
        output_text(&removed)
    );
    wait_state(&nodes, &secret, 1, None).await;

    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let mut history = Vec::new();
    let mut errors = Vec::new();
    for task in tasks {
        let seen = task.await.expect("load task");
        history.extend(seen.events);
        errors.extend(seen.errors);
    }
    eprintln!(
        "{} operations in {:?}, {} errors",
        history.len(),
        start.elapsed(),
        errors.len()
    );
    for error in errors.iter().take(8) {
        eprintln!("  error: {error}");
    }
    assert_eq!(check(&history), Verdict::Linearizable);
    assert_read_back(&cluster.file, &preloaded, "after both failures").await;
}

/// Two refusals found by a review (`docs/protocol.md`, *Membership changes*): a node id added
/// back with a snapshot from an earlier membership (it would load it, and with one copy serve
/// keys deleted since), and a change while a member that served is down (with one copy, the
/// keys moving from it to a joining node were copied from nobody, and its copies swept when it
/// returned). Once the member serves again, the addition runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_membership_change_refuses_an_old_snapshot_and_a_member_down() {
    let (cluster, nodes, secret, _, stale, _fourth_ports) =
        three_nodes_and_a_fourth_listed("membership-guards", 1).await;
    stale.close().await;
    let file = cluster.file.to_str().expect("utf-8").to_string();
    let run_directory = cluster.run_directory.to_str().expect("utf-8").to_string();
    let snapshot =
        rdkv_cluster_config::launcher::data_dir(&cluster.run_directory, 4).join("snapshot.rdkv");
    std::fs::create_dir_all(snapshot.parent().expect("a data directory")).expect("data dir");
    std::fs::write(&snapshot, b"an earlier membership's").expect("write a snapshot");
    assert_refused(
        "add-node",
        file.clone(),
        run_directory.clone(),
        4,
        "snapshot from an earlier membership",
    )
    .await;
    std::fs::remove_file(&snapshot).expect("remove it");

    let pid = pid_of(&cluster, 3);
    signal(&cluster, 3, Signal::SIGKILL);
    wait_torn_down(pid, Duration::from_secs(10));
    wait_state(&nodes, &secret, 3, Some(MemberState::Down)).await;
    assert_refused(
        "add-node",
        file.clone(),
        run_directory.clone(),
        4,
        "do not serve",
    )
    .await;
    assert_refused(
        "remove-node",
        file.clone(),
        run_directory.clone(),
        1,
        "do not serve",
    )
    .await;

    let restart = cluster_command(&cluster, "restart", Some(3));
    assert!(restart.status.success(), "{}", output_text(&restart));
    wait_state(&nodes, &secret, 3, Some(MemberState::Serving)).await;
    let added = membership_command("add-node", file, run_directory, 4).await;
    assert!(
        added.status.success(),
        "add-node 4: {}",
        output_text(&added)
    );
}
