//! Losing every copy of a key is said out loud (`docs/operations.md`, *When copies are lost*):
//! with `replicas = 2`, two of three nodes killed at once and started again come back empty
//! and refill from the third, which lacks the keys only they held. The view records the loss;
//! `rdkv-cluster status` names it and exits 4, `rdkv stats` says why a key reads as not found,
//! every node counts it (`copy_sets_lost`), and `rdkv-cluster ack-loss` clears it.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rdkv_client::Client;
use rdkv_integration_tests::cluster::{rdkv_cluster, Cluster};
use rdkv_integration_tests::process::workspace_binary;
use rdkv_integration_tests::view::{
    cluster_command, nodes_of, pid_of, signal, stats_of, wait_torn_down,
};

const LOSS_LINE: &str = "keys may have been lost: the copies on nodes 2 and 3 were down together";

fn text(output: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Runs `rdkv-cluster status` until `done` holds for its output and exit code, or `bound`.
fn status_until(
    cluster: &Cluster,
    bound: Duration,
    done: impl Fn(&str, Option<i32>) -> bool,
) -> (String, Option<i32>) {
    let deadline = Instant::now() + bound;
    loop {
        let status = cluster_command(cluster, "status", None);
        let output = text(&status);
        if done(&output, status.status.code()) || Instant::now() >= deadline {
            return (output, status.status.code());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_down_at_once_are_recorded_shown_and_acknowledged() {
    let cluster = Cluster::up("loss");
    let client = Client::from_file(&cluster.file).expect("a client");
    for index in 0..300 {
        client
            .put(format!("loss-{index}").as_bytes(), b"value")
            .await
            .expect("put");
    }
    client.close().await;
    let (_, code) = status_until(&cluster, Duration::from_secs(30), |_, code| code == Some(0));
    assert_eq!(code, Some(0), "a healthy cluster records no loss");

    for node in [2, 3] {
        let pid = pid_of(&cluster, node);
        signal(&cluster, node, Signal::SIGKILL);
        wait_torn_down(pid, Duration::from_secs(10));
    }
    for node in [2, 3] {
        let up = cluster_command(&cluster, "up", Some(node));
        assert!(up.status.success(), "up --node {node}: {}", text(&up));
    }
    let (output, code) = status_until(&cluster, Duration::from_secs(90), |output, code| {
        output.contains(LOSS_LINE) && code == Some(4)
    });
    assert!(output.contains(LOSS_LINE), "{output}");
    assert!(output.contains("rdkv-cluster ack-loss FILE"), "{output}");
    assert_eq!(
        code,
        Some(4),
        "every node answers, and a loss is recorded: {output}"
    );

    let (nodes, secret) = nodes_of(&cluster);
    for (id, _) in &nodes {
        // Each node counts the loss once it applied its view (a loaded machine: a few tries).
        let mut lost = 0;
        for _ in 0..50 {
            lost = stats_of(&nodes, &secret, *id)
                .await
                .map_or(0, |stats| stats.copy_sets_lost);
            if lost >= 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(lost >= 1, "node {id} counts no lost copy set");
    }
    let stats = std::process::Command::new(workspace_binary("rdkv"))
        .args(["--config", cluster.file.to_str().expect("utf-8"), "stats"])
        .output()
        .expect("run rdkv stats");
    assert!(text(&stats).contains(LOSS_LINE), "{}", text(&stats));

    let acknowledged = cluster_command(&cluster, "ack-loss", None);
    assert!(acknowledged.status.success(), "{}", text(&acknowledged));
    assert!(
        text(&acknowledged).contains(&format!("acknowledged: {LOSS_LINE}")),
        "{}",
        text(&acknowledged)
    );
    let (output, code) = status_until(&cluster, Duration::from_secs(60), |output, code| {
        !output.contains("keys may have been lost") && code == Some(0)
    });
    assert!(!output.contains("keys may have been lost"), "{output}");
    assert_eq!(code, Some(0), "{output}");
    let again = cluster_command(&cluster, "ack-loss", None);
    assert!(again.status.success(), "{}", text(&again));
    assert!(
        text(&again).contains("no loss recorded"),
        "{}",
        text(&again)
    );
}

/// `down --node` (and `restart`) refuse to take a node out of service when that would leave
/// `replicas` members out at once: each empties itself and refills from its serving peers
/// when it comes back, so the keys whose copies were all on them would be lost (found by a
/// new user: `down --node 2`, `down --node 3`, then both up again lost 9 of 30 keys, silently).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_a_second_node_of_two_copies_is_refused_unless_forced() {
    let cluster = Cluster::up("loss-guard");
    let file = cluster.file.to_str().expect("utf-8").to_string();
    let run = cluster.run_directory.to_str().expect("utf-8").to_string();
    let down = |node: &str, force: bool| {
        let mut arguments = vec![
            "down",
            file.as_str(),
            "--run-dir",
            run.as_str(),
            "--node",
            node,
        ];
        if force {
            arguments.push("--force");
        }
        rdkv_cluster(&arguments)
    };
    let first = down("2", false);
    assert!(first.status.success(), "down --node 2: {}", text(&first));
    // Until the view has node 2 out of service (a clean stop commits it at once).
    let (output, _) = status_until(&cluster, Duration::from_secs(30), |output, _| {
        output.contains("2 down") || output.contains("2 filling")
    });
    assert!(output.contains("2 down"), "{output}");
    let second = down("3", false);
    assert_eq!(second.status.code(), Some(1), "{}", text(&second));
    assert!(
        text(&second).contains("refusing to stop node 3: node 2 is not serving"),
        "{}",
        text(&second)
    );
    assert!(text(&second).contains("--force"), "{}", text(&second));
    let restart = rdkv_cluster(&[
        "restart",
        file.as_str(),
        "--run-dir",
        run.as_str(),
        "--node",
        "3",
        "--no-wait",
    ]);
    assert_eq!(restart.status.code(), Some(1), "{}", text(&restart));
    // Node 3 still serves.
    let (output, _) = status_until(&cluster, Duration::from_secs(5), |_, _| true);
    assert!(!output.contains("3 down"), "{output}");
    let forced = down("3", true);
    assert!(
        forced.status.success(),
        "down --node 3 --force: {}",
        text(&forced)
    );
}
