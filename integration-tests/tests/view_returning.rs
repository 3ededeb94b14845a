//! A node that comes back costs the others nothing (`docs/protocol.md`, *Views and fencing*,
//! *Elections*): a follower resumed after a SIGSTOP past the failure timeout, a follower killed
//! with SIGKILL and started again once the view has it down, and the last node of a fresh
//! cluster to start never make the leader step down, so the leader never stops serving data.
//! Each test watches `rdkv_serving_stops_total` on the leader's metrics endpoint. Before the
//! pre-vote, a resume and a fresh start each made the leader step down and stop serving for
//! 0.3–0.7 s. The tests of this file run one at a time (a lock), so that the 2-core CI
//! machines see one cluster at a time.
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rdkv_common::protocol::MemberState;
use rdkv_integration_tests::cluster::scrape;
use rdkv_integration_tests::view::*;

/// One cluster at a time (a tokio mutex: each test has its own runtime, and a failed test
/// does not poison it).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How long a node is kept stopped: well past the failure timeout, so that it is committed
/// down and comes back as a node the view has down.
const STOPPED_FOR: Duration = Duration::from_millis(2_500);

/// The bound on each wait for the cluster to get somewhere (a rejoin, a refill, a promotion:
/// a second or two unloaded), generous for a loaded 2-core machine.
const WAIT_LIMIT: Duration = Duration::from_secs(20);

/// Node `id`'s metrics address, from the cluster file.
fn metrics_address(file: &std::path::Path, id: u32) -> SocketAddr {
    rdkv_cluster_config::load(file)
        .expect("the generated file is valid")
        .nodes
        .iter()
        .find(|node| node.id == id)
        .and_then(|node| node.metrics_address)
        .expect("the example gives every node a metrics address")
}

/// Node `id`'s `rdkv_serving_stops_total`, from its metrics endpoint.
fn serving_stops(file: &std::path::Path, id: u32) -> u64 {
    let samples = scrape(metrics_address(file, id));
    let name = format!("rdkv_serving_stops_total{{node=\"{id}\"}}");
    *samples.get(&name).unwrap_or_else(|| panic!("no {name}")) as u64
}

/// Waits until every node of `ids` says it serves data (its stats); panics past
/// [`WAIT_LIMIT`] with what each said last.
async fn wait_serving(nodes: &Nodes, secret: &[u8], ids: &[u32], what: &str) {
    let started = Instant::now();
    loop {
        let mut serving = Vec::new();
        for id in ids {
            let stats = stats_of(nodes, secret, *id).await;
            serving.push((*id, stats.map(|stats| stats.serving_data)));
        }
        if serving.iter().all(|(_, serving)| *serving == Some(true)) {
            return;
        }
        assert!(
            started.elapsed() < WAIT_LIMIT,
            "{what}: not every node serves data after {WAIT_LIMIT:?}: {serving:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What the nodes of `ids` logged about serving, leases and elections, for a failure's message.
fn view_logs(cluster: &rdkv_integration_tests::cluster::Cluster, ids: &[u32]) -> String {
    let mut logs = String::new();
    for id in ids {
        logs.push_str(&format!("node {id}:\n"));
        for line in log_of(cluster, *id).lines().filter(|line| {
            ["serving", "lease", "leader", "election", "view committed"]
                .iter()
                .any(|word| line.contains(word))
        }) {
            logs.push_str(line);
            logs.push('\n');
        }
    }
    logs
}

/// Panics unless every node of `ids` names `leader` as the leader.
async fn assert_leader(nodes: &Nodes, secret: &[u8], ids: &[u32], leader: u32, when: &str) {
    for id in ids {
        let view = view_of(nodes, secret, *id)
            .await
            .unwrap_or_else(|| panic!("{when}: node {id} does not answer"));
        assert_eq!(
            view.leader,
            Some(leader),
            "{when}: node {id} names another leader: {view:?}"
        );
    }
}

/// A follower stopped past the failure timeout and resumed, then another killed and started
/// again once the view has it down: each comes back, is refilled and serves, and the leader
/// neither changes nor stops serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_and_a_restarted_follower_leave_the_leader_serving() {
    let _serial = SERIAL.lock().await;
    let (cluster, nodes, secret, ids, _, leader) = up_settled("vr-return", 3).await.parts();
    wait_serving(&nodes, &secret, &ids, "at start").await;
    let stops_before = serving_stops(&cluster.file, leader);
    let followers: Vec<u32> = ids.iter().copied().filter(|id| *id != leader).collect();

    // A follower stopped past the failure timeout: committed down, then resumed.
    let stopped = followers[0];
    let stopped_at = signal(&cluster, stopped, Signal::SIGSTOP);
    let resume = Resume(pid_of(&cluster, stopped));
    let (down, _) = wait_for_state(&nodes, &secret, leader, stopped, MemberState::Down).await;
    tokio::time::sleep((stopped_at + STOPPED_FOR).saturating_duration_since(Instant::now())).await;
    let resumed_at = signal(&cluster, stopped, Signal::SIGCONT);
    drop(resume);
    let (back, _) = wait_for_view(&nodes, &secret, leader, WAIT_LIMIT, |view| {
        view.epoch > down.epoch && state_of(view, stopped) == Some(MemberState::Serving)
    })
    .await
    .unwrap_or_else(|last| panic!("node {stopped} never served again after SIGCONT: {last:?}"));
    wait_serving(&nodes, &secret, &ids, "after the resume").await;
    eprintln!(
        "node {stopped}, stopped {:?}, serving again {:?} after SIGCONT",
        resumed_at - stopped_at,
        resumed_at.elapsed()
    );
    assert_eq!(
        serving_stops(&cluster.file, leader),
        stops_before,
        "the leader {leader} stopped serving when node {stopped} came back; the logs:\n{}",
        view_logs(&cluster, &ids)
    );
    assert_leader(&nodes, &secret, &ids, leader, "after the resume").await;

    // Another follower killed, committed down, and started again: its log is behind, and the
    // leader's messages to it have been failing (openraft backs off 500 ms after each).
    let restarted = followers[1];
    let pid = pid_of(&cluster, restarted);
    let killed_at = signal(&cluster, restarted, Signal::SIGKILL);
    wait_torn_down(pid, Duration::from_secs(10));
    let (_, _) = wait_for_state(&nodes, &secret, leader, restarted, MemberState::Down).await;
    let restart = cluster_command(&cluster, "restart", Some(restarted));
    assert!(
        restart.status.success(),
        "{}",
        String::from_utf8_lossy(&restart.stderr)
    );
    wait_for_view(&nodes, &secret, leader, WAIT_LIMIT, |view| {
        view.epoch > back.epoch && state_of(view, restarted) == Some(MemberState::Serving)
    })
    .await
    .unwrap_or_else(|last| {
        panic!("node {restarted} never served again after its restart: {last:?}")
    });
    wait_serving(&nodes, &secret, &ids, "after the restart").await;
    eprintln!(
        "node {restarted}, killed, serving again {:?} later",
        killed_at.elapsed()
    );
    assert_eq!(
        serving_stops(&cluster.file, leader),
        stops_before,
        "the leader {leader} stopped serving when node {restarted} came back; the logs:\n{}",
        view_logs(&cluster, &ids)
    );
    assert_leader(&nodes, &secret, &ids, leader, "after the restart").await;
}

/// In a fresh cluster, the nodes that elect the first leader do not wait for the last one, and
/// that one's start disturbs nobody: once all three serve, the leader has never stopped
/// serving and no node has stepped down as the leader, and two failure timeouts later still.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_cluster_s_first_leader_never_stops_serving() {
    let _serial = SERIAL.lock().await;
    let (cluster, nodes, secret, ids, _, leader) = up_settled("vr-fresh", 3).await.parts();
    wait_serving(&nodes, &secret, &ids, "at start").await;
    let check = |when: &str| {
        // A leader that steps down logs it (and drops its lease): the first leader, whichever
        // node it was, did not.
        let stepped_down: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|id| log_of(&cluster, *id).contains("no longer the leader"))
            .collect();
        let stops = serving_stops(&cluster.file, leader);
        assert!(
            stops == 0 && stepped_down.is_empty(),
            "{when}: the leader {leader} stopped serving {stops} times; nodes that stepped down as the leader: {stepped_down:?}; the logs:\n{}",
            view_logs(&cluster, &ids)
        );
    };
    check("once all three serve");
    tokio::time::sleep(FAILURE_TIMEOUT * 2).await;
    check("two failure timeouts later");
    assert_leader(&nodes, &secret, &ids, leader, "two failure timeouts later").await;
}
