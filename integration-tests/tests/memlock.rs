//! Client memory that fits: ten `Client`s of a three-node cluster in one process run under the
//! common 8 MiB `ulimit -l`, because the process's clients share one scratch pool that grows
//! with the operations in flight (`client/src/connection/pool.rs`). Before the pool, each
//! `Client` pinned 16 × 64 KiB per node, 3 MiB each, and the third one failed.
//!
//! The parent test starts the cluster (`rdkv-cluster up`, its nodes are processes of their
//! own), then runs [`ten_clients_child`] in a child process of this test binary under
//! `prlimit --memlock=8 MiB`, and as root also without `CAP_IPC_LOCK` (`setpriv`), which would
//! otherwise lift the limit.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkv_client::Client;
use rdkv_integration_tests::cluster::Cluster;

/// The limit: 8 MiB, the default `ulimit -l` of many distributions.
const MEMLOCK_LIMIT: u64 = 8 * 1024 * 1024;
/// Names the cluster file for the child.
const CLUSTER_FILE_VARIABLE: &str = "RDKV_MEMLOCK_TEST_CLUSTER_FILE";
/// Clients in the child.
const CLIENTS: usize = 10;
/// Tasks per client: 160 operations in flight would need 10 MiB of scratch buffers, so the
/// pool also has to wait at its limit.
const TASKS_PER_CLIENT: usize = 16;
/// Operations per task (a put and a get each).
const ROUNDS: usize = 60;

#[test]
fn ten_clients_fit_under_an_8_mib_memlock_limit() {
    // The example's 2 s operation deadline is there to end a hang, not to time the pool: 160
    // operations in flight queue for a scratch pool sized to the limit, and with both cores
    // busy one of them waited past 2 s ("put timed out after 2s"). What is checked is that all
    // of them complete under the limit, so the deadline is far above any wait.
    //
    // A node lends each connection that writes a chunk of its heap: the example's 16 chunks
    // of 256 KiB serve 16 writing connections, and these 10 clients open up to 2 lanes to each
    // node (one per runtime worker), so on a busy machine, where both workers' lanes opened,
    // a first put waited out the deadline for a chunk ("waiting for the server's answer to a
    // request for heap space"). 64 KiB chunks give each node 64, in the same 4 MiB heap.
    let cluster = Cluster::up_with("memlock", |text| {
        text.replace(
            "operation_deadline = \"2s\"",
            "operation_deadline = \"30s\"",
        )
        .replace("chunk_size = \"256K\"", "chunk_size = \"64K\"")
    });
    let test_binary = std::env::current_exe().expect("the test binary");
    let root = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .any(|line| line.starts_with("Uid:") && line.split_whitespace().nth(1) == Some("0"));
    let mut command = Command::new("prlimit");
    command.arg(format!("--memlock={MEMLOCK_LIMIT}:{MEMLOCK_LIMIT}"));
    command.arg("--");
    if root {
        // Root holds CAP_IPC_LOCK, which ignores the limit: drop it for the child.
        command.args(["setpriv", "--bounding-set=-ipc_lock", "--"]);
    }
    let output = command
        .arg(&test_binary)
        .args(["--exact", "ten_clients_child", "--ignored", "--nocapture"])
        .env(CLUSTER_FILE_VARIABLE, &cluster.file)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run prlimit (util-linux)");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "the child failed:\n{stdout}\n{stderr}"
    );
    for line in stderr.lines().filter(|line| line.starts_with("memlock:")) {
        eprintln!("{line}");
    }
}

/// Run by the test above in a child process under the limit; skipped on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by ten_clients_fit_under_an_8_mib_memlock_limit in a child process"]
async fn ten_clients_child() {
    let file = std::env::var(CLUSTER_FILE_VARIABLE).expect("run by the parent test");
    let figures = rdkv_fabric::memory::limits::read_memlock_figures();
    assert_eq!(
        figures.soft_limit, MEMLOCK_LIMIT,
        "the child runs under the limit"
    );
    assert!(
        !figures.has_ipc_lock_capability,
        "the child cannot lift the limit"
    );
    let clients: Vec<Arc<Client>> = (0..CLIENTS)
        .map(|_| Arc::new(Client::from_file(std::path::Path::new(&file)).expect("client")))
        .collect();
    let began = Instant::now();
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(
                    rdkv_fabric::memory::pinned_bytes(),
                    std::sync::atomic::Ordering::Relaxed,
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let mut tasks = Vec::new();
    for (client_index, client) in clients.iter().enumerate() {
        for task in 0..TASKS_PER_CLIENT {
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                for round in 0..ROUNDS {
                    let key = format!("memlock-{client_index}-{task}-{round}");
                    let value = format!("value-{round}");
                    client
                        .put(key.as_bytes(), value.as_bytes())
                        .await
                        .unwrap_or_else(|error| panic!("put {key}: {error:#}"));
                    let read = client
                        .get(key.as_bytes())
                        .await
                        .unwrap_or_else(|error| panic!("get {key}: {error:#}"));
                    assert_eq!(read.as_deref(), Some(value.as_bytes()), "{key}");
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("a client task");
    }
    sampler.abort();
    let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
    let after = rdkv_fabric::memory::pinned_bytes();
    eprintln!(
        "memlock: {CLIENTS} clients x {TASKS_PER_CLIENT} tasks x {ROUNDS} puts and gets on 3 nodes in {:?}; pinned peak {} KiB, after {} KiB, limit {} KiB",
        began.elapsed(),
        peak / 1024,
        after / 1024,
        MEMLOCK_LIMIT / 1024
    );
    assert!(peak <= MEMLOCK_LIMIT);
    assert!(after < peak, "the pool shrank back when the load ended");
}
