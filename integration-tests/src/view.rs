//! The cluster view, seen from outside by tests: a cluster of real nodes with a short
//! `failure_timeout`, each node's view fetched over a monitoring connection, and signals sent
//! to node processes (`tests/view.rs`, `tests/view_attack.rs`).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rdkv_common::protocol::{
    fetch_stats, fetch_view, ClusterView, MemberState, MonitoredNode, ServerStats,
};

use crate::cluster::{rdkv_cluster, Cluster};

/// The failure timeout the tests' cluster files set.
pub const FAILURE_TIMEOUT: Duration = Duration::from_secs(1);

/// Every node's id and control address.
pub type Nodes = Vec<(u32, SocketAddr)>;

/// A cluster of `count` (2 or 3) nodes from the example, with `failure_timeout = "1s"`.
pub fn up(tag: &str, count: usize) -> (Cluster, Nodes, Vec<u8>) {
    up_edited(tag, count, |text| text)
}

/// As [`up`], with `edit` applied to the file's text first.
pub fn up_edited(
    tag: &str,
    count: usize,
    edit: impl FnOnce(String) -> String,
) -> (Cluster, Nodes, Vec<u8>) {
    let cluster = Cluster::up_with(tag, |text| {
        let text = edit(text).replace("failure_timeout = \"2s\"", "failure_timeout = \"1s\"");
        if count == 2 {
            let cut = text
                .find("[[node]]\nid = 3")
                .expect("node 3 in the example");
            text[..cut].to_string()
        } else {
            text
        }
    });
    let (nodes, secret) = nodes_of(&cluster);
    (cluster, nodes, secret)
}

/// Every node of `cluster`'s file with its control address, and the cluster secret.
pub fn nodes_of(cluster: &Cluster) -> (Nodes, Vec<u8>) {
    let config = rdkv_cluster_config::load(&cluster.file).expect("the generated file is valid");
    let nodes = config
        .nodes
        .iter()
        .map(|node| (node.id, node.control_address))
        .collect();
    (nodes, config.secret)
}

/// Node `id`'s control address.
pub fn address(nodes: &Nodes, id: u32) -> SocketAddr {
    nodes
        .iter()
        .find(|(node, _)| *node == id)
        .expect("a node")
        .1
}

/// The view node `id` knows, if it answers within 500 ms.
pub async fn view_of(nodes: &Nodes, secret: &[u8], id: u32) -> Option<ClusterView> {
    let node = MonitoredNode {
        address: address(nodes, id),
        id: Some(id),
        secret,
    };
    fetch_view(node, Duration::from_millis(500)).await.ok()
}

/// Node `id`'s stats, if it answers within 500 ms.
pub async fn stats_of(nodes: &Nodes, secret: &[u8], id: u32) -> Option<ServerStats> {
    let node = MonitoredNode {
        address: address(nodes, id),
        id: Some(id),
        secret,
    };
    fetch_stats(node, Duration::from_millis(500)).await.ok()
}

/// Polls node `id` every 20 ms until its view satisfies `wanted`, for at most `limit`.
pub async fn wait_for_view(
    nodes: &Nodes,
    secret: &[u8],
    id: u32,
    limit: Duration,
    wanted: impl Fn(&ClusterView) -> bool,
) -> Result<(ClusterView, Instant), Option<ClusterView>> {
    let started = Instant::now();
    let mut last = None;
    while started.elapsed() < limit {
        if let Some(view) = view_of(nodes, secret, id).await {
            if wanted(&view) {
                return Ok((view, Instant::now()));
            }
            last = Some(view);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(last)
}

/// Waits until every node of `ids` answers with the same epoch and the same leader, every
/// member serving; returns that view, or every node's last view.
pub async fn wait_settled(
    nodes: &Nodes,
    secret: &[u8],
    ids: &[u32],
    limit: Duration,
) -> Result<ClusterView, Vec<Option<ClusterView>>> {
    let started = Instant::now();
    loop {
        let mut views = Vec::new();
        for id in ids {
            views.push(view_of(nodes, secret, *id).await);
        }
        let first = views[0].clone();
        if let Some(first) = first {
            let agreed = views.iter().all(|view| {
                view.as_ref().is_some_and(|view| {
                    view.epoch == first.epoch
                        && view.leader == first.leader
                        && view.leader.is_some()
                        && all_serving(view)
                })
            });
            if agreed && first.epoch >= nodes.len() as u64 {
                return Ok(first);
            }
        }
        if started.elapsed() > limit {
            return Err(views);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether every member of `view` serves.
pub fn all_serving(view: &ClusterView) -> bool {
    view.members
        .iter()
        .all(|member| member.state == MemberState::Serving)
}

/// Node `id`'s state in `view`.
pub fn state_of(view: &ClusterView, id: u32) -> Option<MemberState> {
    view.members
        .iter()
        .find(|member| member.node_id == id)
        .map(|member| member.state)
}

/// Node `id`'s process, from its pid file.
pub fn pid_of(cluster: &Cluster, id: u32) -> nix::unistd::Pid {
    let pid_file = cluster.run_directory.join(format!("node-{id}.pid"));
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .expect("pid file")
        .trim()
        .parse()
        .expect("a pid");
    nix::unistd::Pid::from_raw(pid)
}

/// Sends `signal` to node `id`'s process; returns when it was sent.
pub fn signal(cluster: &Cluster, id: u32, signal: Signal) -> Instant {
    nix::sys::signal::kill(pid_of(cluster, id), signal).expect("signal");
    Instant::now()
}

/// Waits (at most `bound`) until a killed process is torn down: reaped, or a zombie with no
/// thread left. Until then its memory is still mapped by clients over shm (as a NIC answers
/// READs of a killed process's regions until they are deregistered) and its sockets are open.
pub fn wait_torn_down(pid: nix::unistd::Pid, bound: Duration) {
    let gone_by = Instant::now() + bound;
    let directory = format!("/proc/{pid}");
    let torn_down = || {
        let zombie = std::fs::read_to_string(format!("{directory}/stat")).map(|stat| {
            stat.rsplit(')')
                .next()
                .is_some_and(|rest| rest.trim_start().starts_with('Z'))
        });
        let threads = std::fs::read_dir(format!("{directory}/task")).map(Iterator::count);
        match (zombie, threads) {
            (Err(_), _) | (_, Err(_)) => true,
            (Ok(zombie), Ok(threads)) => zombie && threads <= 1,
        }
    };
    while !torn_down() {
        assert!(
            Instant::now() < gone_by,
            "{pid} still runs {bound:?} after SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Sends SIGCONT to a stopped node when dropped (a failing test must not leave it stopped:
/// `rdkv-cluster down` would wait 15 s for it).
pub struct Resume(pub nix::unistd::Pid);

impl Drop for Resume {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(self.0, Signal::SIGCONT);
    }
}

/// The size of node `id`'s view state file (0 when absent).
pub fn state_file_size(cluster: &Cluster, id: u32) -> u64 {
    std::fs::metadata(cluster.run_directory.join(format!("node-{id}.view")))
        .map(|metadata| metadata.len())
        .unwrap_or(0)
}

/// Node `id`'s log so far.
pub fn log_of(cluster: &Cluster, id: u32) -> String {
    std::fs::read_to_string(cluster.run_directory.join(format!("node-{id}.log")))
        .unwrap_or_default()
}

/// `rdkv-cluster up FILE --run-dir … --detach` on a thread of its own: `up` waits until the
/// nodes serve (after a crash, their reconciliation), and a test acts meanwhile.
pub fn up_in_background(cluster: &Cluster) -> std::thread::JoinHandle<std::process::Output> {
    up_later(cluster, None, Duration::ZERO)
}

/// `rdkv-cluster up FILE --run-dir … --detach` (with `--node N`) on a thread of its own,
/// `after` a wait.
pub fn up_later(
    cluster: &Cluster,
    node: Option<u32>,
    after: Duration,
) -> std::thread::JoinHandle<std::process::Output> {
    let mut arguments: Vec<String> = [
        "up",
        cluster.file.to_str().expect("utf-8"),
        "--run-dir",
        cluster.run_directory.to_str().expect("utf-8"),
        "--detach",
    ]
    .map(String::from)
    .to_vec();
    if let Some(node) = node {
        arguments.extend(["--node".to_string(), node.to_string()]);
    }
    std::thread::spawn(move || {
        std::thread::sleep(after);
        let arguments: Vec<&str> = arguments.iter().map(String::as_str).collect();
        crate::cluster::rdkv_cluster(&arguments)
    })
}

/// Runs `rdkv-cluster COMMAND FILE --run-dir DIR` (with `--node N`; `up` detached, `restart`
/// without waiting for the node to serve).
pub fn cluster_command(
    cluster: &Cluster,
    command: &str,
    node: Option<u32>,
) -> std::process::Output {
    let file = cluster.file.to_str().expect("utf-8").to_string();
    let run = cluster.run_directory.to_str().expect("utf-8").to_string();
    let node = node.map(|id| id.to_string());
    let mut arguments = vec![command, file.as_str(), "--run-dir", run.as_str()];
    if let Some(node) = &node {
        arguments.extend(["--node", node.as_str()]);
    }
    if command == "up" {
        arguments.push("--detach");
    }
    if command == "restart" {
        // The tests watch the refill themselves.
        arguments.push("--no-wait");
    }
    if matches!(command, "restart" | "down") && node.is_some() {
        // The tests stop nodes on purpose, whatever else is out of service
        // (`loss.rs` runs the guard without it).
        arguments.push("--force");
    }
    rdkv_cluster(&arguments)
}

/// A cluster that is up and settled: every node agrees on one view, every member serving.
pub struct Settled {
    /// The cluster (stopped on drop).
    pub cluster: Cluster,
    /// Every node's id and control address.
    pub nodes: Nodes,
    /// The cluster secret.
    pub secret: Vec<u8>,
    /// Every node's id.
    pub ids: Vec<u32>,
    /// The view they agree on.
    pub view: ClusterView,
    /// Its leader.
    pub leader: u32,
}

impl Settled {
    /// Its parts: the cluster, the nodes, the secret, the ids, the view and the leader.
    pub fn parts(self) -> (Cluster, Nodes, Vec<u8>, Vec<u32>, ClusterView, u32) {
        (
            self.cluster,
            self.nodes,
            self.secret,
            self.ids,
            self.view,
            self.leader,
        )
    }

    /// The first node that is not the leader.
    pub fn follower(&self) -> u32 {
        *self
            .ids
            .iter()
            .find(|id| **id != self.leader)
            .expect("a node other than the leader")
    }
}

/// [`up`], then waits (20 s at most) until every node agrees on one view and serves data (it
/// holds its lease: a view agreed on may still be a moment ahead of a node's first grant).
pub async fn up_settled(tag: &str, count: usize) -> Settled {
    up_settled_edited(tag, count, |text| text).await
}

/// As [`up_settled`], with `edit` applied to the file's text first.
pub async fn up_settled_edited(
    tag: &str,
    count: usize,
    edit: impl FnOnce(String) -> String,
) -> Settled {
    let (cluster, nodes, secret) = up_edited(tag, count, edit);
    let ids: Vec<u32> = nodes.iter().map(|(id, _)| *id).collect();
    let view = wait_settled(&nodes, &secret, &ids, Duration::from_secs(20))
        .await
        .expect("the cluster settles");
    let started = Instant::now();
    for id in &ids {
        while !stats_of(&nodes, &secret, *id)
            .await
            .is_some_and(|stats| stats.serving_data)
        {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "node {id} does not serve data 20 s after the cluster settled"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let leader = view.leader.expect("a leader");
    Settled {
        cluster,
        nodes,
        secret,
        ids,
        view,
        leader,
    }
}

/// Waits (10 s at most) until node `observer`'s view has node `id` in `state`; returns that
/// view and when it was seen.
pub async fn wait_for_state(
    nodes: &Nodes,
    secret: &[u8],
    observer: u32,
    id: u32,
    state: MemberState,
) -> (ClusterView, Instant) {
    wait_for_view(nodes, secret, observer, Duration::from_secs(10), |seen| {
        state_of(seen, id) == Some(state)
    })
    .await
    .unwrap_or_else(|last| panic!("node {observer} never saw node {id} {state}; last: {last:?}"))
}

/// Waits until every node of `cluster`'s file serves (after an `up` or a restart), within
/// `limit`; panics otherwise.
pub async fn wait_serving(cluster: &Cluster, limit: Duration) {
    let (nodes, secret) = nodes_of(cluster);
    let ids: Vec<u32> = nodes.iter().map(|(id, _)| *id).collect();
    wait_settled(&nodes, &secret, &ids, limit)
        .await
        .expect("every node serves again");
}

/// A command's stdout then stderr, as text.
pub fn output_text(output: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The output of a command that must have succeeded (panics naming `what` and the output
/// otherwise).
pub fn succeeded(output: &std::process::Output, what: &str) -> String {
    let text = output_text(output);
    assert!(output.status.success(), "{what} failed: {text}");
    text
}
