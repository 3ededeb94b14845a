//! A node's log file (`node-ID.log` in the run directory of `rdkv-cluster up --detach`):
//! appended to across restarts, so the lines of a run that crashed are still there after the
//! next start; and quiet about each client connection (those lines are DEBUG).

use std::process::Command;

use rdkv_integration_tests::cluster::Cluster;
use rdkv_integration_tests::process::workspace_binary;
use rdkv_integration_tests::view::{cluster_command, log_of};

/// The start line each run of a node writes first.
const START_LINE: &str = ") started: appending to this log";

#[test]
fn a_node_started_twice_keeps_the_first_runs_lines() {
    let cluster = Cluster::up("log-append");
    let first_run = log_of(&cluster, 2);
    assert!(first_run.contains("server ready"), "{first_run}");
    let restart = cluster_command(&cluster, "restart", Some(2));
    assert!(
        restart.status.success(),
        "{}",
        String::from_utf8_lossy(&restart.stderr)
    );
    // The node's log lines go through a queue to its writer thread: the ready line on stdout
    // can come first.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut log = log_of(&cluster, 2);
    while log.matches("server ready").count() < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        log = log_of(&cluster, 2);
    }
    assert!(
        log.starts_with(&first_run),
        "the first run's lines were not kept: {log}"
    );
    assert_eq!(log.matches(START_LINE).count(), 2, "{log}");
    assert_eq!(log.matches("server ready").count(), 2, "{log}");
}

#[test]
fn a_client_connection_writes_no_info_line() {
    let cluster = Cluster::up("log-quiet");
    let put = Command::new(workspace_binary("rdkv"))
        .args(["--config", cluster.file.to_str().expect("utf-8")])
        .args(["put", "quiet:1", "value"])
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run rdkv");
    assert!(
        put.status.success(),
        "{}",
        String::from_utf8_lossy(&put.stderr)
    );
    for id in 1..=3 {
        let log = log_of(&cluster, id);
        assert!(
            !log.contains("client authenticated") && !log.contains("purpose=Data"),
            "node {id} logged a client's connection at INFO: {log}"
        );
    }
}
