//! A three-node cluster started from `examples/local-3node.toml` through the `rdkv-cluster`
//! binary (on reserved ports, in a generated copy of the file): 10,000 keys written and read back by
//! a fresh client, spread over all nodes; one node killed with SIGKILL: its keys fail fast with
//! `node unreachable`, the others keep working, and `status` shows it down; the metrics
//! endpoint is scraped and parsed.

use std::collections::HashMap;
use std::io::Write;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkv_client::Client;
use rdkv_integration_tests::cluster::{generate_cluster_file, rdkv_cluster, scrape, Cluster};
use rdkv_integration_tests::process::workspace_binary;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_node_cluster_from_the_example_file() {
    let directory = std::env::temp_dir().join(format!("rdkv-cluster-test-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("directory");
    let (file, ports) = generate_cluster_file(&directory);
    let run_directory = directory.join("run");
    let file_text = file.to_str().expect("utf-8 path").to_string();
    let run_text = run_directory.to_str().expect("utf-8 path").to_string();
    let up = rdkv_cluster(&["up", &file_text, "--detach", "--run-dir", &run_text]);
    assert!(
        up.status.success(),
        "up failed: {}",
        String::from_utf8_lossy(&up.stderr)
    );
    let _cluster = Cluster {
        file: file.clone(),
        run_directory: run_directory.clone(),
        ports,
    };
    let table = String::from_utf8_lossy(&up.stdout);
    assert_eq!(table.matches("ready").count(), 3, "{table}");
    assert!(
        table.contains("new run directory") && table.contains("they start empty"),
        "{table}"
    );

    let again = rdkv_cluster(&["up", &file_text, "--detach", "--run-dir", &run_text]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already running"));

    // 10,000 keys through one client, read back through a fresh one.
    let writer = Arc::new(Client::from_file(&file).expect("client"));
    let mut tasks = Vec::new();
    for task in 0..16u32 {
        let writer = writer.clone();
        tasks.push(tokio::spawn(async move {
            for index in (task..10_000).step_by(16) {
                writer
                    .put(
                        format!("key-{index}").as_bytes(),
                        format!("value-{index}").as_bytes(),
                    )
                    .await
                    .expect("put");
            }
        }));
    }
    for task in tasks {
        task.await.expect("writer");
    }
    writer.close().await;
    let reader = Arc::new(Client::from_file(&file).expect("client"));
    let mut per_node: HashMap<u32, Vec<u32>> = HashMap::new();
    for index in 0..10_000u32 {
        let key = format!("key-{index}");
        let value = reader.get(key.as_bytes()).await.expect("get");
        assert_eq!(
            value.as_deref(),
            Some(format!("value-{index}").as_bytes()),
            "{key}"
        );
        per_node
            .entry(reader.node_of(key.as_bytes()))
            .or_default()
            .push(index);
    }
    assert_eq!(per_node.len(), 3, "all three nodes hold keys");
    for (node, stats) in reader.cluster_stats().await {
        let stats = stats.expect("node stats");
        assert!(
            stats.chunk_allocations > 0 && stats.heap_used_bytes > 0,
            "node {node} stores blocks"
        );
        assert!(
            per_node[&node].len() > 2_000,
            "node {node} owns {} keys",
            per_node[&node].len()
        );
    }

    // The CLI, as the README shows it, with its exit codes.
    let cli = |arguments: &[&str], stdin: Option<&str>| -> (i32, String) {
        let mut command = Command::new(workspace_binary("rdkv"));
        command.args(["--config", &file_text]).args(arguments);
        command
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        let mut child = command.spawn().expect("run rdkv");
        if let Some(input) = stdin {
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(input.as_bytes())
                .expect("write stdin");
        }
        drop(child.stdin.take());
        let output = child.wait_with_output().expect("rdkv output");
        (
            output.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&output.stdout).into_owned(),
        )
    };
    assert_eq!(cli(&["put", "user:1", "ada"], None).0, 0);
    assert_eq!(cli(&["get", "user:1"], None), (0, "ada".to_string()));
    assert_eq!(cli(&["cas", "user:1", "ada", "grace"], None).0, 0);
    assert_eq!(
        cli(&["cas", "user:1", "ada", "linus"], None).0,
        1,
        "not swapped"
    );
    assert_eq!(cli(&["put", "user:2"], Some("from stdin")).0, 0);
    assert_eq!(cli(&["get", "user:2"], None), (0, "from stdin".to_string()));
    assert_eq!(cli(&["del", "user:1"], None).0, 0);
    assert_eq!(cli(&["get", "user:1"], None).0, 1, "not found");
    assert_eq!(cli(&["del", "user:1"], None).0, 1, "not found");
    let (code, stats) = cli(&["stats"], None);
    assert_eq!(code, 0, "{stats}");
    assert!(stats.contains("round trips per operation"), "{stats}");
    let bad = Command::new(workspace_binary("rdkv"))
        .args(["--config", "/nonexistent.toml", "get", "k"])
        .output()
        .expect("run rdkv");
    assert_eq!(bad.status.code(), Some(2), "errors exit 2");

    // Metrics: scrape node 1 and check the parsed samples.
    let cluster = rdkv_cluster_config::load(&file).expect("the generated file is valid");
    let metrics_address = cluster.nodes[0].metrics_address.expect("metrics address");
    let samples = scrape(metrics_address);
    assert!(samples["rdkv_heap_used_bytes{node=\"1\"}"] > 0.0);
    assert_eq!(samples["rdkv_data_path_requests_total{node=\"1\"}"], 0.0);
    assert!(
        samples.contains_key("rdkv_queue_pairs{node=\"1\",state=\"RTS\"}"),
        "{samples:?}"
    );

    // Kill node 2 with SIGKILL.
    let pid = std::fs::read_to_string(run_directory.join("node-2.pid")).expect("pid file");
    let killed = Command::new("kill")
        .args(["-KILL", pid.trim()])
        .status()
        .expect("kill");
    assert!(killed.success());
    // Until the kernel has torn the process down, its memory is still mapped by clients over
    // shm and its sockets are open: wait for that, bounded.
    let pid = nix::unistd::Pid::from_raw(pid.trim().parse().expect("a pid"));
    rdkv_integration_tests::view::wait_torn_down(pid, Duration::from_secs(10));
    // Node 2's keys have a second copy (replicas = 2 in the example): once the view shows node
    // 2 down (failure_timeout = 1 s), they are read from it; until then a read waits, within
    // its deadline. Every one is still there.
    let failover_bound = cluster.failure_timeout + Duration::from_secs(1);
    for (read, index) in per_node[&2].iter().take(500).enumerate() {
        let started = Instant::now();
        let value = reader
            .get(format!("key-{index}").as_bytes())
            .await
            .expect("node 2's keys outlive it");
        assert_eq!(
            value.as_deref(),
            Some(format!("value-{index}").as_bytes()),
            "key-{index}"
        );
        if read == 0 {
            let failover = started.elapsed();
            eprintln!("the first read of a dead node's key took {failover:?} (failover)");
            assert!(failover <= failover_bound, "took {failover:?}");
        }
    }
    for node in [1u32, 3] {
        for index in per_node[&node].iter().take(500) {
            let key = format!("key-{index}");
            assert!(reader
                .get(key.as_bytes())
                .await
                .expect("survivors keep working")
                .is_some());
            reader
                .put(key.as_bytes(), b"updated")
                .await
                .expect("survivors take writes");
        }
    }
    let status = rdkv_cluster(&["status", &file_text]);
    let status_text = String::from_utf8_lossy(&status.stdout);
    let row = |node: &str| {
        status_text
            .lines()
            .find(|line| line.split_whitespace().next() == Some(node))
            .unwrap_or_default()
            .to_string()
    };
    assert!(row("2").contains("down"), "{status_text}");
    assert!(row("1").contains(" up "), "{status_text}");
    assert!(row("3").contains(" up "), "{status_text}");

    let down = rdkv_cluster(&["down", &file_text, "--run-dir", &run_text]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    let report = String::from_utf8_lossy(&down.stdout);
    assert!(
        report.contains("node 1: stopped") && report.contains("node 3: stopped"),
        "{report}"
    );
    assert!(report.contains("node 2: already stopped"), "{report}");
}
