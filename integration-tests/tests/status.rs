//! `rdkv-cluster status` against a node that is alive but silent: a SIGSTOPped process, whose
//! kernel still accepts connections into its listen backlog while nothing reads them. Its row
//! says `no answer`, the others are shown as usual, the `view:` line comes from the nodes that
//! answer, and the command returns within its deadline
//! (`rdkv_cluster_config::status::ANSWER_DEADLINE`) instead of waiting for the SIGCONT.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rdkv_cluster_config::status::ANSWER_DEADLINE;
use rdkv_integration_tests::view::{cluster_command, pid_of, signal, up_settled, Resume};

/// How long `status` may take in all with a node stopped: its one deadline (every node is asked
/// at once) plus the start of a debug binary and the reading of the cluster file, with four
/// seconds to spare for a machine whose two cores are busy with other tests. Not a latency
/// figure: before the deadline `status` waited until the node was resumed.
const STATUS_BOUND: Duration = Duration::from_secs(5);

/// The leader is the node stopped: the others still name it in their stats and their view
/// until they elect another, and `status` used to ask the leader for the view first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_says_no_answer_for_a_stopped_node_and_returns_within_its_deadline() {
    let settled = up_settled("status-stopped", 3).await;
    let stopped = settled.leader;
    let (cluster, _, _, ids, view, _) = settled.parts();
    // Declared after the cluster, so dropped before it: the node is resumed even when an
    // assertion fails, and `down` (the cluster's drop) finds it answering.
    let _resume = Resume(pid_of(&cluster, stopped));
    signal(&cluster, stopped, Signal::SIGSTOP);

    let started = Instant::now();
    let status = cluster_command(&cluster, "status", None);
    let took = started.elapsed();
    let printed = String::from_utf8_lossy(&status.stdout);
    eprintln!("status with node {stopped} stopped took {took:?}:\n{printed}");
    assert!(
        took < STATUS_BOUND,
        "status took {took:?} with node {stopped} stopped (deadline {ANSWER_DEADLINE:?}):\n{printed}"
    );
    assert_eq!(
        status.status.code(),
        Some(1),
        "a stopped node is not a healthy one: {printed}{}",
        String::from_utf8_lossy(&status.stderr)
    );

    let row = |id: u32| {
        printed
            .lines()
            .find(|line| line.split_whitespace().next() == Some(id.to_string().as_str()))
            .unwrap_or_else(|| panic!("no row for node {id}:\n{printed}"))
    };
    let silent = row(stopped);
    assert!(
        silent.contains("no answer") && !silent.contains("down"),
        "{printed}"
    );
    for id in ids.iter().copied().filter(|id| *id != stopped) {
        // `up`, or `not-serving` for the moment the others take to elect a new leader and
        // take leases from it; either way its figures are there (the uptime column).
        let columns: Vec<&str> = row(id).split_whitespace().collect();
        assert!(
            matches!(columns.get(1), Some(&"up") | Some(&"not-serving")),
            "node {id}: {printed}"
        );
        assert!(
            columns.get(3).is_some_and(|uptime| uptime.ends_with('s')),
            "node {id}: {printed}"
        );
    }

    // The view line is a view (not `no node answered`), and one the answering nodes know: at
    // least the settled epoch, with every member named.
    let view_line = printed
        .lines()
        .find(|line| line.starts_with("view: "))
        .unwrap_or_else(|| panic!("no view line:\n{printed}"));
    let epoch: u64 = view_line
        .strip_prefix("view: epoch ")
        .and_then(|rest| rest.split(',').next())
        .and_then(|epoch| epoch.parse().ok())
        .unwrap_or_else(|| panic!("not a view: {view_line}"));
    assert!(epoch >= view.epoch, "{view_line} (settled at {view:?})");
    for id in &ids {
        assert!(
            view_line.contains(&format!(" {id} serving"))
                || view_line.contains(&format!(" {id} down")),
            "{view_line}"
        );
    }
}
