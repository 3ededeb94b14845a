//! `rdkv-cluster up | down | status` for nodes on this machine.
//!
//! - `up` starts every node as an `rdkv-server --config FILE --node ID` child in its own process
//!   group, writes `node-ID.pid` under the run directory, and waits for each node's ready line
//!   (no sleeping). In the foreground it forwards each node's log lines with a `[node ID]`
//!   prefix and stops the nodes in order on Ctrl-C or SIGTERM; with `--detach` the logs go to
//!   `node-ID.log` and the launcher exits.
//! - `down` sends SIGTERM to each node in order and waits for it to exit (SIGKILL after a
//!   timeout).
//! - `status` asks each node for its stats over a monitoring connection (no queue pair, no
//!   keys); a node that does not answer is `down`.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use rdkv_common::protocol::{fetch_stats, ServerStats};

use crate::config::{ClusterConfig, NodeConfig};
use crate::error::{Error, Result};
use crate::units::format_bytes;

/// How long a node may take to print its ready line.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a node may take to stop after SIGTERM before it gets SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// The `rdkv-server` binary next to the running executable.
///
/// # Errors
/// [`Error::Refused`] naming the build command when it is missing.
pub fn server_binary() -> Result<PathBuf> {
    let executable = std::env::current_exe()
        .map_err(|error| Error::Refused(format!("locate this program: {error}")))?;
    let directory = executable.parent().unwrap_or(Path::new("."));
    let candidates = [
        directory.join("rdkv-server"),
        directory.join("../rdkv-server"),
    ];
    candidates
        .into_iter()
        .find(|candidate| candidate.exists())
        .ok_or_else(|| {
            Error::Refused(format!(
                "rdkv-server was not found next to {}; build it with `cargo build --release -p rdkv-server` (or run rdkv-cluster through `cargo run`)",
                executable.display()
            ))
        })
}

/// Refuses nodes on other hosts.
///
/// # Errors
/// [`Error::Refused`] naming the node and what to do instead.
pub fn check_local(config: &ClusterConfig) -> Result<()> {
    for node in &config.nodes {
        let ip = node.control_address.ip();
        if !(ip.is_loopback() || ip.is_unspecified()) {
            return Err(Error::Refused(format!(
                "node {} ({}) is on another host: remote hosts (over ssh) are not supported yet; start it there with `rdkv-server --config FILE --node {}`",
                node.id, node.control_address, node.id
            )));
        }
    }
    Ok(())
}

fn pid_file(run_directory: &Path, node: u32) -> PathBuf {
    run_directory.join(format!("node-{node}.pid"))
}

fn log_file(run_directory: &Path, node: u32) -> PathBuf {
    run_directory.join(format!("node-{node}.log"))
}

fn is_alive(pid: i32) -> bool {
    kill(Pid::from_raw(pid), None).is_ok()
}

fn read_pid(path: &Path) -> Option<i32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn answers(address: SocketAddr) -> bool {
    TcpStream::connect_timeout(&address, Duration::from_millis(300)).is_ok()
}

/// Nodes of this cluster that are running now: a live pid file, or a control port that answers.
pub fn running_nodes(config: &ClusterConfig, run_directory: &Path) -> Vec<(u32, String)> {
    config
        .nodes
        .iter()
        .filter_map(|node| {
            if let Some(pid) =
                read_pid(&pid_file(run_directory, node.id)).filter(|pid| is_alive(*pid))
            {
                return Some((node.id, format!("pid {pid}")));
            }
            answers(node.control_address)
                .then(|| (node.id, format!("{} answers", node.control_address)))
        })
        .collect()
}

/// What a node printed when it became ready.
#[derive(Debug, Clone)]
pub struct ReadyNode {
    /// The node's id.
    pub id: u32,
    /// Its process id.
    pub pid: u32,
    /// The ready line.
    pub ready_line: String,
}

/// A node started by `up`.
pub struct StartedNode {
    /// The node.
    pub ready: ReadyNode,
    /// The child process.
    pub child: Child,
}

/// Starts every node and waits for each to be ready.
///
/// # Errors
/// [`Error::Refused`] when the cluster already runs or a node is remote; [`Error::Node`] when a
/// node fails to start (the nodes already started are stopped again).
pub fn start(
    config: &ClusterConfig,
    run_directory: &Path,
    detach: bool,
) -> Result<Vec<StartedNode>> {
    check_local(config)?;
    let running = running_nodes(config, run_directory);
    if !running.is_empty() {
        let list: Vec<String> = running
            .iter()
            .map(|(id, how)| format!("node {id} ({how})"))
            .collect();
        return Err(Error::Refused(format!(
            "cluster `{}` is already running: {}; stop it with `rdkv-cluster down {}`",
            config.name,
            list.join(", "),
            config.path.display()
        )));
    }
    fs::create_dir_all(run_directory).map_err(|error| {
        Error::Refused(format!(
            "create the run directory {}: {error}",
            run_directory.display()
        ))
    })?;
    let binary = server_binary()?;
    let config_path = fs::canonicalize(&config.path).unwrap_or_else(|_| config.path.clone());
    let mut started: Vec<StartedNode> = Vec::new();
    for node in &config.nodes {
        match start_node(&binary, &config_path, node, run_directory, detach) {
            Ok(node) => started.push(node),
            Err(error) => {
                for node in started.iter_mut().rev() {
                    stop_child(node, run_directory);
                }
                return Err(error);
            }
        }
    }
    Ok(started)
}

fn start_node(
    binary: &Path,
    config_path: &Path,
    node: &NodeConfig,
    run_directory: &Path,
    detach: bool,
) -> Result<StartedNode> {
    let failure = |message: String| Error::Node {
        node: node.id,
        message,
    };
    let mut command = Command::new(binary);
    command
        .args(["--config"])
        .arg(config_path)
        .args(["--node", &node.id.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        // Its own process group: Ctrl-C reaches only the launcher, which stops nodes in order.
        .process_group(0);
    if detach {
        let log = fs::File::create(log_file(run_directory, node.id))
            .map_err(|error| failure(format!("create its log file: {error}")))?;
        command.stderr(log);
    } else {
        command.stderr(Stdio::piped());
    }
    let mut child = command
        .spawn()
        .map_err(|error| failure(format!("spawn {}: {error}", binary.display())))?;
    let pid = child.id();
    fs::write(pid_file(run_directory, node.id), format!("{pid}\n"))
        .map_err(|error| failure(format!("write its pid file: {error}")))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| failure("no stdout".into()))?;
    let (sender, receiver) = mpsc::sync_channel(1);
    std::thread::spawn(move || {
        let mut line = String::new();
        let outcome = BufReader::new(stdout).read_line(&mut line).map(|_| line);
        let _ = sender.send(outcome);
    });
    let ready_line = match receiver.recv_timeout(READY_TIMEOUT) {
        Ok(Ok(line)) if line.starts_with("rdkv-server ready") => line.trim().to_string(),
        outcome => {
            let _ = child.kill();
            let _ = child.wait();
            let _ = fs::remove_file(pid_file(run_directory, node.id));
            let mut detail = String::new();
            if let Some(stderr) = child.stderr.take() {
                let lines: Vec<String> = BufReader::new(stderr)
                    .lines()
                    .map_while(std::result::Result::ok)
                    .collect();
                detail = lines
                    .iter()
                    .rev()
                    .take(8)
                    .rev()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join("\n  ");
            } else if detach {
                detail = fs::read_to_string(log_file(run_directory, node.id)).unwrap_or_default();
            }
            let why = match outcome {
                Err(_) => format!("no ready line within {READY_TIMEOUT:?}"),
                Ok(_) => "it exited before it was ready".to_string(),
            };
            return Err(failure(format!("failed to start: {why}\n  {detail}")));
        }
    };
    // The ready line comes after the control listener is bound; confirm over the port itself.
    if TcpStream::connect_timeout(&node.control_address, Duration::from_secs(5)).is_err() {
        let _ = child.kill();
        let _ = child.wait();
        let _ = fs::remove_file(pid_file(run_directory, node.id));
        return Err(failure(format!(
            "printed its ready line but its control port {} does not accept connections",
            node.control_address
        )));
    }
    Ok(StartedNode {
        ready: ReadyNode {
            id: node.id,
            pid,
            ready_line,
        },
        child,
    })
}

/// Stops one started child: SIGTERM, wait, SIGKILL after the timeout; removes its pid file.
pub fn stop_child(node: &mut StartedNode, run_directory: &Path) {
    let pid = Pid::from_raw(node.ready.pid as i32);
    let _ = kill(pid, Signal::SIGTERM);
    let started = Instant::now();
    loop {
        match node.child.try_wait() {
            Ok(Some(_)) | Err(_) => break,
            Ok(None) if started.elapsed() > STOP_TIMEOUT => {
                let _ = node.child.kill();
                let _ = node.child.wait();
                break;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    let _ = fs::remove_file(pid_file(run_directory, node.ready.id));
}

/// `down`: stops every node with a pid file, in order. Returns one line per node.
///
/// # Errors
/// [`Error::Refused`] when no node of the cluster is running from this run directory.
pub fn stop(config: &ClusterConfig, run_directory: &Path) -> Result<Vec<String>> {
    let mut report = Vec::new();
    let mut any = false;
    for node in &config.nodes {
        let path = pid_file(run_directory, node.id);
        let Some(pid) = read_pid(&path) else {
            report.push(format!(
                "node {}: not started from {}",
                node.id,
                run_directory.display()
            ));
            continue;
        };
        any = true;
        if !is_alive(pid) {
            let _ = fs::remove_file(&path);
            report.push(format!(
                "node {}: already stopped (stale pid {pid})",
                node.id
            ));
            continue;
        }
        let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        let started = Instant::now();
        while is_alive(pid) && started.elapsed() < STOP_TIMEOUT {
            std::thread::sleep(Duration::from_millis(20));
        }
        if is_alive(pid) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            report.push(format!(
                "node {}: killed (pid {pid}) after {STOP_TIMEOUT:?}",
                node.id
            ));
        } else {
            report.push(format!("node {}: stopped (pid {pid})", node.id));
        }
        let _ = fs::remove_file(&path);
    }
    if !any {
        return Err(Error::Refused(format!(
            "cluster `{}` has no pid files in {}: was it started with `rdkv-cluster up` from this directory?",
            config.name,
            run_directory.display()
        )));
    }
    Ok(report)
}

/// One node's state for `status`.
#[derive(Debug, Clone)]
pub struct NodeStatus {
    /// The node's id.
    pub id: u32,
    /// Its control address.
    pub address: SocketAddr,
    /// Its stats, or why it is down.
    pub state: std::result::Result<ServerStats, String>,
}

/// Asks every node for its stats.
pub async fn status(config: &ClusterConfig) -> Vec<NodeStatus> {
    let mut statuses = Vec::new();
    for node in &config.nodes {
        let state = fetch_stats(node.control_address, &config.secret, Duration::from_secs(2))
            .await
            .map_err(|error| error.to_string());
        statuses.push(NodeStatus {
            id: node.id,
            address: node.control_address,
            state,
        });
    }
    statuses
}

/// Renders rows as a table with aligned columns.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|title| title.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(padded.join("  ").trim_end());
        out.push('\n');
    };
    line(header.iter().map(|title| title.to_string()).collect());
    for row in rows {
        line(row.clone());
    }
    out
}

/// The `status` table.
pub fn status_table(statuses: &[NodeStatus]) -> String {
    let rows: Vec<Vec<String>> = statuses
        .iter()
        .map(|status| match &status.state {
            Ok(stats) => vec![
                status.id.to_string(),
                "up".into(),
                status.address.to_string(),
                format!("{}s", stats.uptime_seconds),
                stats.connections.to_string(),
                format!(
                    "{}/{}/{}",
                    stats.queue_pairs[3],
                    stats.queue_pairs[2] + stats.queue_pairs[1] + stats.queue_pairs[0],
                    stats.queue_pairs[4]
                ),
                stats.live_memory_regions.to_string(),
                stats.live_memory_windows.to_string(),
                format_bytes(stats.pinned_bytes),
                format!(
                    "{} / {}",
                    format_bytes(stats.heap_used_bytes),
                    format_bytes(stats.heap_size_bytes)
                ),
                stats.keys_estimate.to_string(),
            ],
            Err(reason) => {
                let mut row = vec![
                    status.id.to_string(),
                    "down".into(),
                    status.address.to_string(),
                ];
                row.extend(std::iter::repeat_n("-".to_string(), 7));
                row.push(reason.clone());
                row
            }
        })
        .collect();
    table(
        &[
            "node",
            "state",
            "control",
            "uptime",
            "conns",
            "QPs rts/setup/err",
            "MRs",
            "MWs",
            "pinned",
            "heap used",
            "keys",
        ],
        &rows,
    ) + &heap_warnings(statuses)
}

/// One line per node whose heap is under 10% free, naming the fix.
fn heap_warnings(statuses: &[NodeStatus]) -> String {
    statuses
        .iter()
        .filter_map(|status| {
            let stats = status.state.as_ref().ok()?;
            stats.heap_low().then(|| {
                format!(
                    "warning: node {} heap under 10% free ({} of {}): writes may wait for reclamation; raise heap_size (docs/operations.md, Sizing the heap)\n",
                    status.id,
                    rdkv_cluster_file::units::format_bytes(stats.heap_free_bytes),
                    rdkv_cluster_file::units::format_bytes(stats.heap_size_bytes)
                )
            })
        })
        .collect()
}

/// Writes a line to stdout, ignoring a closed pipe.
pub fn say(line: &str) {
    let stdout = std::io::stdout();
    let mut handle = stdout.lock();
    let _ = writeln!(handle, "{line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_nodes_are_refused_with_what_to_do_instead() {
        let text = "[cluster]\nname = \"t\"\nsecret = \"s\"\nfabric = \"soft\"\n\n[[node]]\nid = 4\ncontrol_address = \"192.0.2.10:7400\"\nfabric_address = \"192.0.2.10:7401\"\nindex_size = \"1M\"\nheap_size = \"4M\"\n";
        let figures = rdkv_fabric::memory::limits::MemlockFigures {
            soft_limit: u64::MAX,
            hard_limit: u64::MAX,
            locked_bytes: 0,
            has_ipc_lock_capability: true,
        };
        let config = crate::config::parse(Path::new("remote.toml"), text, figures, u64::MAX)
            .expect("valid file");
        let message = check_local(&config).unwrap_err().to_string();
        assert!(
            message.contains("node 4") && message.contains("another host"),
            "{message}"
        );
        assert!(message.contains("--config FILE --node 4"), "{message}");
    }

    #[test]
    fn tables_align_columns() {
        let text = table(&["a", "long header"], &[vec!["value".into(), "x".into()]]);
        assert_eq!(text, "a      long header\nvalue  x\n");
    }
}
