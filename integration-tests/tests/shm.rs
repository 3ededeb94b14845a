//! The `shm` fabric with real processes: a local cluster started as the README says serves the
//! CLI over shared memory by default (and `rdkv stats` says so), and a client killed with
//! SIGKILL in the middle of a load over shm leaves every node's gauges at their baseline and
//! every record readable.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rdkv_client::{Client, ClientBuilder, FabricChoice};
use rdkv_common::protocol::ServerStats;
use rdkv_integration_tests::cluster::Cluster;
use rdkv_integration_tests::process::{workspace_binary, ServerProcess};

fn text(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

fn rdkv(file: &Path, arguments: &[&str]) -> std::process::Output {
    Command::new(workspace_binary("rdkv"))
        .args(["--config", text(file)])
        .args(arguments)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run rdkv")
}

fn stdout(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The `via` column of `rdkv stats` for each node line (`node state uptime via ...`).
fn via_column(stats: &str) -> Vec<String> {
    stats
        .lines()
        .filter(|line| line.split_whitespace().nth(1) == Some("up"))
        .filter_map(|line| line.split_whitespace().nth(3).map(str::to_string))
        .collect()
}

#[test]
fn a_local_cluster_serves_the_cli_over_shm_by_default_and_stats_says_so() {
    let cluster = Cluster::up("shm-cli");
    let put = rdkv(&cluster.file, &["put", "shm-key", "shm-value"]);
    assert!(put.status.success(), "{put:?}");
    let get = rdkv(&cluster.file, &["get", "shm-key"]);
    assert_eq!(stdout(&get), "shm-value");

    let stats = rdkv(&cluster.file, &["stats"]);
    assert!(stats.status.success(), "{stats:?}");
    let report = stdout(&stats);
    assert_eq!(via_column(&report), ["shm", "shm", "shm"], "{report}");
    assert_eq!(report.matches("shm 1").count(), 3, "{report}");

    let over_soft = rdkv(&cluster.file, &["--fabric", "soft", "stats"]);
    assert_eq!(
        via_column(&stdout(&over_soft)),
        ["soft", "soft", "soft"],
        "{}",
        stdout(&over_soft)
    );
    let soft_get = rdkv(&cluster.file, &["--fabric", "soft", "get", "shm-key"]);
    assert_eq!(stdout(&soft_get), "shm-value", "one store, either fabric");
}

/// What must come back once a client is gone.
#[derive(Debug, PartialEq, Eq)]
struct Baseline {
    data_connections: u64,
    shm_data_connections: u64,
    queue_pairs: i64,
    live_memory_windows: i64,
}

impl From<&ServerStats> for Baseline {
    fn from(stats: &ServerStats) -> Self {
        Self {
            data_connections: stats.data_connections,
            shm_data_connections: stats.shm_data_connections,
            queue_pairs: stats.queue_pairs.iter().sum(),
            live_memory_windows: stats.live_memory_windows,
        }
    }
}

impl Baseline {
    /// Whether every gauge is at or below `baseline`'s. A node's own connections (a refill's,
    /// after a node missed heartbeats on a busy machine) may be in the baseline and gone later:
    /// what a killed client left behind shows as a gauge above it.
    fn at_or_below(&self, baseline: &Self) -> bool {
        self.data_connections <= baseline.data_connections
            && self.shm_data_connections <= baseline.shm_data_connections
            && self.queue_pairs <= baseline.queue_pairs
            && self.live_memory_windows <= baseline.live_memory_windows
    }
}

async fn baselines(monitor: &Client) -> Vec<Baseline> {
    monitor
        .cluster_stats()
        .await
        .iter()
        .map(|(node, stats)| match stats {
            Ok(stats) => Baseline::from(stats),
            Err(error) => panic!("node {node}: {error}"),
        })
        .collect()
}

async fn keys(monitor: &Client) -> u64 {
    monitor
        .cluster_stats()
        .await
        .iter()
        .filter_map(|(_, stats)| stats.as_ref().ok().map(|stats| stats.keys))
        .sum::<u64>()
        / monitor.replicas() as u64
}

const RECORDS: u64 = 20_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_killed_mid_load_over_shm_leaves_the_gauges_at_baseline_and_every_record_valid() {
    let cluster = Cluster::up("shm-kill");
    let monitor = ClientBuilder::cluster_file(&cluster.file)
        .fabric(FabricChoice::Auto)
        .build()
        .expect("the file");
    let before = baselines(&monitor).await;
    assert!(before.iter().all(|node| node.shm_data_connections == 0));

    // A load over shm, 16 tasks, in its own process.
    let mut load = Command::new(workspace_binary("rdkv-ycsb"))
        .args(["load", "--config", text(&cluster.file), "--fabric", "shm"])
        .args(["-P", "workloada", "--threads", "16"])
        .args(["-p", &format!("recordcount={RECORDS}")])
        .args(["-p", "insertorder=ordered", "-p", "fieldlength=50"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start rdkv-ycsb load");
    // Mid-load: some records are in, the load is still running.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let loaded = keys(&monitor).await;
        assert!(
            load.try_wait().expect("wait").is_none(),
            "the load ended before it was killed ({loaded} keys): raise RECORDS"
        );
        if loaded >= 2_000 {
            break;
        }
        assert!(Instant::now() < deadline, "only {loaded} keys after 60 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let during = monitor.cluster_stats().await;
    assert!(
        during.iter().any(|(_, stats)| stats
            .as_ref()
            .is_ok_and(|stats| stats.shm_data_connections > 0)),
        "the load runs over shm: {during:?}"
    );
    load.kill().expect("SIGKILL the load");
    load.wait().expect("reap the load");

    // The nodes see the control connections close, drain the queue pairs (waiting for a
    // request the kill cut short at most retry_timeout) and revoke the windows.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = baselines(&monitor).await;
        if now
            .iter()
            .zip(&before)
            .all(|(node, baseline)| node.at_or_below(baseline))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "gauges not back at baseline after 30 s: {now:?}, baseline {before:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Every record the load wrote reads back whole (checksummed) over shm; none is corrupt.
    let reader = ClientBuilder::cluster_file(&cluster.file)
        .fabric(FabricChoice::Shm)
        .build()
        .expect("the file");
    let mut found = 0;
    for number in 0..RECORDS {
        let key = format!("user{number}");
        match reader.get(key.as_bytes()).await {
            Ok(Some(value)) => {
                assert_eq!(value.len(), 10 * 50, "{key}: a whole record");
                found += 1;
            }
            Ok(None) => {}
            Err(error) => panic!("{key}: {error}"),
        }
    }
    assert!(found >= 2_000, "only {found} records found");
    eprintln!("{found} of {RECORDS} records loaded before the kill, all valid");
    reader.close().await;
}

/// A node killed with SIGKILL answers nothing more over shm, although its memory files stay
/// mapped in the client: the client finds the attach connection closed at its first doorbell
/// after the peek window and fails fast, as over soft.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_answers_nothing_over_shm() {
    let socket = rdkv_integration_tests::process::shm_socket_path("killed");
    let mut server = rdkv_integration_tests::process::ServerProcess::start(
        "killed-node-test-secret",
        &["--shm-socket", text(&socket)],
    );
    let mut config = rdkv_client::ClientConfig::new(
        server.control_address,
        rdkv_client::Backend::Soft,
        b"killed-node-test-secret",
    );
    config.node.shared_memory = rdkv_client::SharedMemory::Require;
    let client = Client::connect(config).await.expect("connect over shm");
    client.put(b"key", b"value").await.expect("put");
    assert_eq!(
        client.get(b"key").await.expect("get").as_deref(),
        Some(&b"value"[..])
    );
    server.kill();
    // The client peeks at the attach connection at most once per `SHM_PEER_CHECK_EVERY`
    // (documented: a request within that window of the death may still run on the dead
    // node's mapped memory). The GET just before the kill may have peeked, and SIGKILL plus
    // reaping can take less than the window, so wait it out once: after it, nothing answers.
    tokio::time::sleep(rdkv_fabric::SHM_PEER_CHECK_EVERY * 2).await;
    let started = Instant::now();
    let error = client.get(b"key").await.expect_err("the node is dead");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    assert!(error.is_retryable(), "{error}");
}

/// Connections to a node's shm socket that never say hello (a same-user process can open them)
/// hold its accept thread 500 ms each: a client in `auto` mode still gets through, over shm
/// once they are cut off or over the cluster's fabric when its attach times out first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_to_the_shm_socket_never_keep_a_client_out() {
    let socket = rdkv_integration_tests::process::shm_socket_path("silent");
    let server = rdkv_integration_tests::process::ServerProcess::start(
        "silent-shm-test-secret",
        &["--shm-socket", text(&socket)],
    );
    // Six silent connections: three seconds of stalls, one after another.
    let silent: Vec<std::os::unix::net::UnixStream> = (0..6)
        .map(|_| std::os::unix::net::UnixStream::connect(&socket).expect("connect"))
        .collect();
    let started = Instant::now();
    let config = rdkv_client::ClientConfig::new(
        server.control_address,
        rdkv_client::Backend::Soft,
        b"silent-shm-test-secret",
    );
    let client = Client::connect(config).await.expect("connect in auto mode");
    client.put(b"key", b"value").await.expect("put");
    assert_eq!(
        client.get(b"key").await.expect("get").as_deref(),
        Some(&b"value"[..])
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    drop(silent);
    // Once they are gone, a new client gets shm again.
    let mut config = rdkv_client::ClientConfig::new(
        server.control_address,
        rdkv_client::Backend::Soft,
        b"silent-shm-test-secret",
    );
    config.node.shared_memory = rdkv_client::SharedMemory::Require;
    let over_shm = Client::connect(config).await.expect("connect over shm");
    assert_eq!(
        over_shm.get(b"key").await.expect("get").as_deref(),
        Some(&b"value"[..])
    );
}

/// `rdkv-ycsb` measures nothing and exits 2 when the fabric asked for is not offered (`--fabric
/// shm` against a node started without an shm socket), and says why on one line, naming the
/// fix. (A node that does not answer at all is measured as failed operations, exit 1:
/// `ycsb/tests/exit_codes.rs`.)
#[test]
fn rdkv_ycsb_exits_2_when_a_node_refuses_the_fabric_asked_for() {
    let secret = "ycsb-exit-secret";
    let node = ServerProcess::start(secret, &[]);
    let directory = std::env::temp_dir().join(format!("rdkv-ycsb-exit-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("directory");
    let cluster_file = |name: &str, control: String, fabric: String| {
        let path = directory.join(name);
        std::fs::write(
            &path,
            format!(
                "[cluster]\nname = \"ycsb-exit\"\nsecret = \"{secret}\"\nfabric = \"soft\"\n\n\
                 [[node]]\nid = 1\ncontrol_address = \"{control}\"\nfabric_address = \"{fabric}\"\n\
                 index_size = \"1M\"\nheap_size = \"4M\"\nchunk_size = \"256K\"\n"
            ),
        )
        .expect("write the cluster file");
        path
    };
    let run = |file: &Path, fabric: &str| {
        Command::new(workspace_binary("rdkv-ycsb"))
            .args(["run", "--config", text(file), "--fabric", fabric])
            .args([
                "-P",
                "workloadc",
                "-p",
                "recordcount=100",
                "-p",
                "operationcount=100",
            ])
            .env("RUST_BACKTRACE", "0")
            .output()
            .expect("run rdkv-ycsb")
    };
    let reachable = cluster_file(
        "node.toml",
        node.control_address.to_string(),
        node.fabric_address.to_string(),
    );
    let over_soft = run(&reachable, "soft");
    assert_eq!(
        over_soft.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&over_soft.stderr)
    );

    let refused = run(&reachable, "shm");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("nothing measured: the server refused: node 1"),
        "{stderr}"
    );
    assert!(stderr.contains("--fabric soft"), "names the fix: {stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");

    let _ = std::fs::remove_dir_all(&directory);
}
