//! Snapshots against faults (`docs/operations.md`, *Persistence*): a disk that fills up fails
//! the snapshot, not the node, and leaves the previous snapshot whole; a node killed (SIGKILL)
//! in the middle of writing one starts again from a whole snapshot every time.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rdkv_client::{Client, ClientConfig};
use rdkv_common::protocol::{fetch_stats, request_snapshot, MonitoredNode, ServerStats};
use rdkv_fabric::Backend;
use rdkv_integration_tests::process::{server_binary, ServerProcess};

const SECRET: &str = "snapshot-faults-secret";

fn data_dir(name: &str) -> PathBuf {
    let directory = std::env::temp_dir().join(format!("rdkv-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&directory);
    directory
}

/// `rdkv-server` with its snapshots in `data_dir`, none on a schedule, through `bash` so that a
/// test can set a limit first (`limit`: shell commands, or empty).
fn server(data_dir: &Path, limit: &str, control: &str, fabric: &str) -> ServerProcess {
    let mut command = Command::new("bash");
    command.args([
        "-c",
        &format!(
            "{limit} exec \"$0\" --listen {control} --fabric-listen {fabric} --heap-size 32M --index-size 4M --data-dir \"$1\" --snapshot-interval-s 0"
        ),
        server_binary().to_str().expect("utf-8 path"),
        data_dir.to_str().expect("utf-8 path"),
    ]);
    ServerProcess::start_command(SECRET, command)
}

async fn client_of(server: &ServerProcess) -> Client {
    let mut config = ClientConfig::new(server.control_address, Backend::Soft, SECRET.as_bytes());
    config.operation_deadline = Some(Duration::from_secs(5));
    Client::connect(config).await.expect("connect")
}

fn monitored(server: &ServerProcess) -> MonitoredNode<'static> {
    MonitoredNode {
        address: server.control_address,
        id: None,
        secret: SECRET.as_bytes(),
    }
}

async fn stats(server: &ServerProcess) -> ServerStats {
    fetch_stats(monitored(server), Duration::from_secs(5))
        .await
        .expect("stats")
}

async fn put_many(client: &Client, prefix: &str, count: usize, value_length: usize) {
    for index in 0..count {
        let value = vec![(index % 251) as u8; value_length];
        client
            .put(format!("{prefix}-{index}").as_bytes(), &value)
            .await
            .expect("put");
    }
}

/// `ulimit -f` (the file size limit, with SIGXFSZ ignored, as a full disk's ENOSPC would)
/// fails the second, larger snapshot: the request says why, the node keeps serving, its
/// figures show the failure, and the first snapshot is what a restart loads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_the_snapshot_not_the_node_and_keeps_the_previous_one() {
    let directory = data_dir("snapshot-disk-full");
    // 256 KiB files at most (bash counts 1024-byte blocks).
    let limit = "trap '' XFSZ; ulimit -f 256;";
    let mut node = server(&directory, limit, "127.0.0.1:0", "127.0.0.1:0");
    let client = client_of(&node).await;
    put_many(&client, "small", 20, 100).await;
    let first = request_snapshot(monitored(&node), Duration::from_secs(30))
        .await
        .expect("a small snapshot fits");
    assert_eq!(first.keys, 20);

    put_many(&client, "large", 500, 1000).await;
    let error = request_snapshot(monitored(&node), Duration::from_secs(30))
        .await
        .expect_err("500 KB does not fit under the limit");
    let message = error.to_string();
    assert!(message.contains("snapshot"), "{message}");
    assert!(!message.contains('\n'), "one line: {message}");
    let value = client.get(b"large-499").await.expect("the node serves");
    assert_eq!(value.as_deref(), Some(&[(499 % 251) as u8; 1000][..]));
    let figures = stats(&node).await;
    assert!(figures.snapshot_failing, "{figures:?}");
    assert_eq!(
        (figures.snapshots_written, figures.snapshots_failed),
        (1, 1)
    );
    assert_eq!(figures.last_snapshot_keys, 20);
    client.close().await;

    // Killed: no final snapshot. Started again without the limit, it loads the first one.
    node.kill();
    let restarted = server(&directory, "", "127.0.0.1:0", "127.0.0.1:0");
    assert_eq!(stats(&restarted).await.snapshot_keys_loaded, 20);
    let client = client_of(&restarted).await;
    assert!(client.get(b"small-19").await.expect("get").is_some());
    assert!(client.get(b"large-0").await.expect("get").is_none());
    client.close().await;
    let _ = std::fs::remove_dir_all(&directory);
}

/// SIGKILL at 20 moments of a snapshot's write (about 8 MB, at most 64 MiB/s): every restart
/// loads a whole snapshot with every key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_while_writing_a_snapshot_starts_from_a_whole_one_every_time() {
    const KEYS: u64 = 2_000;
    let directory = data_dir("snapshot-torn");
    let mut node = server(&directory, "", "127.0.0.1:0", "127.0.0.1:0");
    let client = client_of(&node).await;
    put_many(&client, "torn", KEYS as usize, 4000).await;
    client.close().await;
    let first = request_snapshot(monitored(&node), Duration::from_secs(60))
        .await
        .expect("the first snapshot");
    assert_eq!(first.keys, KEYS);
    let mut completed = 0;
    for round in 0..20u64 {
        node.kill();
        node = server(&directory, "", "127.0.0.1:0", "127.0.0.1:0");
        let loaded = stats(&node).await.snapshot_keys_loaded;
        assert_eq!(loaded, KEYS, "round {round}: the snapshot loaded is whole");
        let writing = tokio::spawn(request_snapshot(monitored(&node), Duration::from_secs(60)));
        // Spread over the write's ~0.15 s, and past its end now and then.
        tokio::time::sleep(Duration::from_millis(round * 9)).await;
        if writing.is_finished() {
            completed += 1;
        }
        node.kill();
        let _ = writing.await;
    }
    node.kill();
    let last = server(&directory, "", "127.0.0.1:0", "127.0.0.1:0");
    assert_eq!(stats(&last).await.snapshot_keys_loaded, KEYS);
    eprintln!("20 kills, {completed} after the snapshot was complete");
    drop(last);
    let _ = std::fs::remove_dir_all(&directory);
}
