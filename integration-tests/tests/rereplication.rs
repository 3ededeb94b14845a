//! Re-replication (issue 40): a node SIGKILLed and never restarted is removed from the view
//! (`rdkv-cluster remove-node` of a dead member, or `replace_after` in the cluster file), and
//! the members that serve copy its keys again until every key has `replicas` copies, counted
//! over the nodes' stats; a second node killed afterwards then loses no key. The removed node
//! (the leader, in the `remove-node` run) comes back only as a new member: started by hand it
//! serves nothing and says why, `restart` refuses it, `add-node` adds it afresh. Four nodes with
//! `replicas = 2`: after the first removal three remain, so the view still has a majority when
//! the second dies. And with `replicas = 1`, `remove-node` of a dead member is refused unless
//! `--lose-keys`, which the view records as a loss.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rdkv_common::protocol::MemberState;
use rdkv_integration_tests::cluster::{rdkv_cluster, Cluster};
use rdkv_integration_tests::membership::{
    assert_read_back, assert_refused, four_nodes, membership_command, preload, wait_state,
};
use rdkv_integration_tests::process::workspace_binary;
use rdkv_integration_tests::view::{
    output_text, pid_of, signal, stats_of, up_settled_edited, view_of, wait_torn_down, Nodes,
};

/// Keys written before the first kill.
const PRELOADED: usize = 3_000;

/// The node that observes the views (never killed).
const OBSERVER: u32 = 2;

/// SIGKILLs node `id` and waits until its process is gone.
fn kill_only(cluster: &Cluster, id: u32) {
    let pid = pid_of(cluster, id);
    signal(cluster, id, Signal::SIGKILL);
    wait_torn_down(pid, Duration::from_secs(10));
}

/// SIGKILLs node `id` and waits until the observer's view has it down.
async fn kill(cluster: &Cluster, nodes: &Nodes, secret: &[u8], id: u32) {
    kill_only(cluster, id);
    wait_state(nodes, secret, OBSERVER, id, Some(MemberState::Down)).await;
}

/// `rdkv-cluster status FILE`'s output, once it says `re-replication: done` (60 s at most).
fn wait_status_done(cluster: &Cluster) -> String {
    let started = Instant::now();
    loop {
        let output = rdkv_cluster(&["status", cluster.file.to_str().expect("utf-8")]);
        let text = output_text(&output);
        if text.contains("re-replication: done") {
            return text;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "status never said that re-replication is done: {text}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The keys counted over the stats of nodes `ids` (each must answer).
async fn keys_over(nodes: &Nodes, secret: &[u8], ids: &[u32]) -> u64 {
    let mut total = 0;
    for id in ids {
        let stats = stats_of(nodes, secret, *id)
            .await
            .unwrap_or_else(|| panic!("node {id} does not answer"));
        total += stats.keys;
    }
    total
}

/// The nodes but `dead`.
fn survivors(dead: u32) -> Vec<u32> {
    (1..=4).filter(|id| *id != dead).collect()
}

/// What both runs check once node `dead` is out of the view: status says the re-replication
/// is done, and every key is on 2 of the 3 nodes left, counted over their stats.
async fn assert_every_key_twice(
    cluster: &Cluster,
    nodes: &Nodes,
    secret: &[u8],
    preloaded: &[(String, String)],
    dead: u32,
) {
    let status = tokio::task::block_in_place(|| wait_status_done(cluster));
    eprintln!("{status}");
    assert_eq!(
        keys_over(nodes, secret, &survivors(dead)).await,
        2 * preloaded.len() as u64,
        "every key on replicas = 2 nodes after the re-replication"
    );
}

/// A second node (not `dead`, not the observer) killed: every key reads back.
async fn assert_second_failure_loses_none(
    cluster: &Cluster,
    nodes: &Nodes,
    secret: &[u8],
    preloaded: &[(String, String)],
    dead: u32,
) {
    let second = survivors(dead)
        .into_iter()
        .find(|id| *id != OBSERVER)
        .expect("a second node");
    kill(cluster, nodes, secret, second).await;
    assert_read_back(&cluster.file, preloaded, "after a second node died").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_node_of_a_dead_node_copies_its_keys_again_and_a_second_failure_loses_none() {
    let (cluster, nodes, secret, _ports) = four_nodes("rereplication-remove", |text| text).await;
    let preloaded = preload(&cluster.file, PRELOADED).await;
    // The leader dies, unless the observer leads: started again after its removal, a node that
    // led takes itself for the leader, and the members refuse its entries.
    let dead = match view_of(&nodes, &secret, OBSERVER)
        .await
        .and_then(|view| view.leader)
    {
        Some(leader) if leader != OBSERVER => leader,
        _ => 4,
    };
    // remove-node right away: it waits for the view to mark the node down.
    kill_only(&cluster, dead);
    let file = cluster.file.to_str().expect("utf-8").to_string();
    let run_directory = cluster.run_directory.to_str().expect("utf-8").to_string();
    let removed = membership_command("remove-node", file, run_directory, dead).await;
    assert!(
        removed.status.success(),
        "remove-node {dead}: {}",
        output_text(&removed)
    );
    assert!(
        output_text(&removed).contains("re-replication done"),
        "{}",
        output_text(&removed)
    );
    wait_state(&nodes, &secret, OBSERVER, dead, None).await;
    assert_every_key_twice(&cluster, &nodes, &secret, &preloaded, dead).await;
    assert_comes_back_only_as_a_new_member(&cluster, &nodes, &secret, dead).await;
    assert_second_failure_loses_none(&cluster, &nodes, &secret, &preloaded, dead).await;
}

/// Node `dead`, removed while dead, is refused by `restart` (one line naming `add-node`), and
/// `add-node` refuses its old view state and snapshot; once they are gone it joins as a new
/// member, serves, and is removed again (alive: a hand-over), leaving the other three.
async fn assert_comes_back_only_as_a_new_member(
    cluster: &Cluster,
    nodes: &Nodes,
    secret: &[u8],
    dead: u32,
) {
    assert_started_by_hand_serves_nothing(cluster, nodes, secret, dead).await;
    let file = cluster.file.to_str().expect("utf-8").to_string();
    let run_directory = cluster.run_directory.to_str().expect("utf-8").to_string();
    assert_refused(
        "restart",
        file.clone(),
        run_directory.clone(),
        dead,
        "not a member of the running cluster's view (it was removed): it cannot come back as the old member; add it as a new one with `rdkv-cluster add-node",
    )
    .await;
    assert_refused(
        "add-node",
        file.clone(),
        run_directory.clone(),
        dead,
        "from an earlier membership",
    )
    .await;
    let state = rdkv_cluster_config::launcher::view_state_file(&cluster.run_directory, dead);
    let snapshot =
        rdkv_cluster_config::launcher::data_dir(&cluster.run_directory, dead).join("snapshot.rdkv");
    for leftover in [state, snapshot] {
        if leftover.exists() {
            std::fs::remove_file(&leftover).expect("remove a leftover of the dead node");
        }
    }
    let added = membership_command("add-node", file.clone(), run_directory.clone(), dead).await;
    assert!(
        added.status.success(),
        "add-node {dead}: {}",
        output_text(&added)
    );
    wait_state(nodes, secret, OBSERVER, dead, Some(MemberState::Serving)).await;
    let removed = membership_command("remove-node", file, run_directory, dead).await;
    assert!(
        removed.status.success(),
        "remove-node {dead} (alive): {}",
        output_text(&removed)
    );
    wait_state(nodes, secret, OBSERVER, dead, None).await;
}

/// Node `dead`, removed while dead, started by hand with its old view state (as a unit
/// manager would): the members refuse it, it says so once in its log, naming `add-node`, and
/// it serves nothing. It is stopped again.
async fn assert_started_by_hand_serves_nothing(
    cluster: &Cluster,
    nodes: &Nodes,
    secret: &[u8],
    dead: u32,
) {
    let run = &cluster.run_directory;
    let log = run.join(format!("node-{dead}-by-hand.log"));
    let mut server = Command::new(workspace_binary("rdkv-server"))
        .arg("--config")
        .arg(&cluster.file)
        .args(["--node", &dead.to_string(), "--view-state"])
        .arg(rdkv_cluster_config::launcher::view_state_file(run, dead))
        .arg("--data-dir")
        .arg(rdkv_cluster_config::launcher::data_dir(run, dead))
        .arg("--shm-socket")
        .arg(run.join(format!("node-{dead}-by-hand.sock")))
        .arg("--log-file")
        .arg(&log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the removed node by hand");
    let started = Instant::now();
    let said = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("the members refuse this node") {
            break text;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = server.kill();
            let _ = server.wait();
            panic!("node {dead}, removed, never said the members refuse it: {text}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        said.contains(&format!("rdkv-cluster add-node FILE --node {dead}")),
        "{said}"
    );
    let stats = stats_of(nodes, secret, dead).await;
    let _ = server.kill();
    let _ = server.wait();
    let stats = stats.expect("the removed node answers while it runs");
    assert!(!stats.serving_data, "a removed node serves nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_down_for_replace_after_is_replaced_and_a_second_failure_loses_none() {
    let (cluster, nodes, secret, _ports) = four_nodes("rereplication-replace", |text| {
        text.replace("replicas = 2", "replicas = 2\nreplace_after = \"3s\"")
    })
    .await;
    let preloaded = preload(&cluster.file, PRELOADED).await;
    kill(&cluster, &nodes, &secret, 4).await;
    wait_state(&nodes, &secret, OBSERVER, 4, None).await;
    assert_every_key_twice(&cluster, &nodes, &secret, &preloaded, 4).await;
    assert_second_failure_loses_none(&cluster, &nodes, &secret, &preloaded, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_node_of_a_dead_node_with_one_copy_is_refused_unless_lose_keys() {
    let settled = up_settled_edited("rereplication-one-copy", 3, |text| {
        text.replace("replicas = 2", "replicas = 1")
    })
    .await;
    let (cluster, nodes, secret, _, _, _) = settled.parts();
    kill(&cluster, &nodes, &secret, 3).await;
    let file = cluster.file.to_str().expect("utf-8").to_string();
    let run_directory = cluster.run_directory.to_str().expect("utf-8").to_string();
    assert_refused(
        "remove-node",
        file.clone(),
        run_directory.clone(),
        3,
        "holds the only copy of its keys",
    )
    .await;
    assert_eq!(
        state_in_view(&nodes, &secret, 3).await,
        Some(MemberState::Down),
        "refused: still a member"
    );
    let removed = tokio::task::block_in_place(|| {
        rdkv_cluster(&[
            "remove-node",
            &file,
            "--node",
            "3",
            "--run-dir",
            &run_directory,
            "--lose-keys",
        ])
    });
    assert!(
        removed.status.success(),
        "remove-node --lose-keys: {}",
        output_text(&removed)
    );
    wait_state(&nodes, &secret, OBSERVER, 3, None).await;
    let status = tokio::task::block_in_place(|| rdkv_cluster(&["status", &file]));
    assert!(
        output_text(&status).contains("keys may have been lost: the copies on node 3"),
        "the loss is on record: {}",
        output_text(&status)
    );
}

/// Node `id`'s state in the observer's view now.
async fn state_in_view(nodes: &Nodes, secret: &[u8], id: u32) -> Option<MemberState> {
    let view = rdkv_integration_tests::view::view_of(nodes, secret, OBSERVER)
        .await
        .expect("the observer answers");
    rdkv_integration_tests::view::state_of(&view, id)
}
