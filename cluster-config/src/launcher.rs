//! `rdkv-cluster up | down | restart | logs` for the nodes of a cluster file: local nodes as
//! child processes, remote nodes through ssh ([`crate::remote`]).
//!
//! - `up` starts the nodes (all, or `--node N`) in file order. A local node is an
//!   `rdkv-server --config FILE --node ID` child in its own process group, with `node-ID.pid`
//!   under the run directory; `up` waits for each node's ready line (no sleeping). In the
//!   foreground it forwards local nodes' log lines with a `[node ID]` prefix, reports and
//!   reaps a node that exits ([`crate::foreground`]), and stops the nodes in order on Ctrl-C or
//!   SIGTERM; with `--detach` each node logs into `node-ID.log` (`rdkv-server --log-file`:
//!   appended to, never truncated, rotated by size) and the launcher exits. A remote node
//!   always runs in the background on its host, logging the same way.
//! - `down` (and the stop half of `restart`) first asks each node to shut down over the
//!   control plane, authenticated with the cluster secret: no pid file and no ssh needed. A
//!   node that does not answer is stopped by its pid file (SIGTERM, SIGKILL after 15 s), or
//!   through ssh on its host. A node that exited counts as stopped whether or not it has been
//!   reaped.
use std::collections::VecDeque;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use rdkv_common::protocol::{probe_node, request_shutdown, Probe};
use rdkv_common::ControlError;

use crate::config::{ClusterConfig, NodeConfig};
use crate::error::{Error, Result};
use crate::remote;

/// How long a node may take to print its ready line.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a node may take to stop after SIGTERM or a `Shutdown` before it gets SIGKILL. A
/// node bounds its connections' teardown at 10 s (`rdkv_server::server::SHUTDOWN_BOUND`), then
/// writes its final snapshot ([`stop_timeout`] adds the time for that).
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// [`STOP_TIMEOUT`] and a second per 100 MiB of the node's heap: its final snapshot, written
/// at disk speed (`docs/operations.md`, *Persistence*).
fn stop_timeout(node: &NodeConfig) -> Duration {
    STOP_TIMEOUT + Duration::from_secs(node.heap_size.div_ceil(100 << 20))
}
/// How long a node has to acknowledge a `Shutdown`.
const SHUTDOWN_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

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

/// The nodes a command acts on: `only` or every node, in file order.
///
/// # Errors
/// [`Error::Refused`] when `only` names no node of the file.
pub fn select(config: &ClusterConfig, only: Option<u32>) -> Result<Vec<&NodeConfig>> {
    match only {
        None => Ok(config.nodes.iter().collect()),
        Some(id) => config.node(id).map(|node| vec![node]).ok_or_else(|| {
            let ids: Vec<String> = config
                .nodes
                .iter()
                .map(|node| node.id.to_string())
                .collect();
            Error::Refused(format!(
                "cluster `{}` has no node {id}; its nodes are {}",
                config.name,
                ids.join(", ")
            ))
        }),
    }
}

fn pid_file(run_directory: &Path, node: u32) -> PathBuf {
    run_directory.join(format!("node-{node}.pid"))
}

/// The node's `shm` socket when the cluster file names none.
pub fn shm_socket_file(run_directory: &Path, node: u32) -> PathBuf {
    run_directory.join(format!("node-{node}.sock"))
}

/// Where a local node keeps its part of the cluster view's consensus (vote and log) across
/// restarts.
pub fn view_state_file(run_directory: &Path, node: u32) -> PathBuf {
    run_directory.join(format!("node-{node}.view"))
}

/// Where a node keeps its snapshots when the cluster file does not say.
pub fn data_dir(run_directory: &Path, node: u32) -> PathBuf {
    run_directory.join(format!("node-{node}.data"))
}

/// Where a detached local node logs.
pub fn log_file(run_directory: &Path, node: u32) -> PathBuf {
    run_directory.join(format!("node-{node}.log"))
}

/// Whether a process runs: it exists and is not a zombie (an exited process that nobody has
/// reaped yet has stopped, as far as `down` is concerned).
pub fn is_alive(pid: i32) -> bool {
    if kill(Pid::from_raw(pid), None).is_err() {
        return false;
    }
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses and may hold any byte.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_none_or(|state| state != "Z" && state != "X"),
        Err(_) => true,
    }
}

/// The pid in a pid file: a positive number above 1 (never 0, -1 or init, which `kill` would
/// read as a process group or every process).
fn read_pid(path: &Path) -> Option<i32> {
    fs::read_to_string(path)
        .ok()?
        .trim()
        .parse()
        .ok()
        .filter(|pid| *pid > 1)
}

/// Whether `pid` is node `node`'s `rdkv-server`, running: its command line is `…rdkv-server
/// … --node N`. A pid file outlives its process (a crash, a reboot), and the pid may since
/// belong to anything: it is never signalled unless this holds.
pub fn is_node_process(pid: i32, node: u32) -> bool {
    if !is_alive(pid) {
        return false;
    }
    let Ok(command_line) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let arguments: Vec<&[u8]> = command_line.split(|byte| *byte == 0).collect();
    let program = arguments.first().copied().unwrap_or_default();
    let node = node.to_string();
    program.ends_with(b"rdkv-server")
        && arguments
            .windows(2)
            .any(|pair| pair[0] == b"--node" && pair[1] == node.as_bytes())
}

/// The pid of node `node`'s running `rdkv-server`, from its pid file.
pub(crate) fn node_pid(run_directory: &Path, node: u32) -> Option<i32> {
    read_pid(&pid_file(run_directory, node)).filter(|pid| is_node_process(*pid, node))
}

fn answers(address: SocketAddr) -> bool {
    TcpStream::connect_timeout(&address, Duration::from_millis(300)).is_ok()
}

/// Nodes among `nodes` that are running now (a live pid file, or an rdkv node answering on
/// the control port), or whose control port another program holds: one line each.
pub fn running_nodes(nodes: &[&NodeConfig], run_directory: &Path) -> Vec<(u32, String)> {
    nodes
        .iter()
        .filter_map(|node| {
            if let Some(pid) = node_pid(run_directory, node.id) {
                return Some((node.id, format!("pid {pid}")));
            }
            let address = node.control_address;
            match probe_node(address, Duration::from_millis(500)) {
                Probe::Nothing => None,
                Probe::Node(id) if id == node.id => {
                    Some((node.id, format!("answers at {address}")))
                }
                Probe::Node(id) => Some((
                    node.id,
                    format!("{address} is taken by node {id} of another cluster"),
                )),
                Probe::Other => Some((
                    node.id,
                    format!("{address} is taken by another program (not an rdkv node)"),
                )),
            }
        })
        .collect()
}

/// What a node printed when it became ready.
#[derive(Debug, Clone)]
pub struct ReadyNode {
    /// The node's id.
    pub id: u32,
    /// Its process id (on its own host).
    pub pid: u32,
    /// The ssh destination of a remote node.
    pub host: Option<String>,
    /// The ready line.
    pub ready_line: String,
}

/// A node started by `up`.
pub struct StartedNode {
    /// The node.
    pub ready: ReadyNode,
    /// The child process of a local node (a remote node runs under its host's init).
    pub child: Option<Child>,
}

/// Starts node `node`, a new member, in the background with `--join`: it learns the view from
/// the running cluster's leader once `rdkv-cluster add-node` has the leader add it.
///
/// # Errors
/// [`Error::Refused`] when it already runs, runs on another host (not supported yet), or has
/// a view state or a snapshot from an earlier membership;
/// [`Error::Node`] when it fails to start.
pub fn start_joining(
    config: &ClusterConfig,
    run_directory: &Path,
    node: u32,
) -> Result<StartedNode> {
    let nodes = select(config, Some(node))?;
    let running = running_nodes(&nodes, run_directory);
    if !running.is_empty() {
        return Err(already_running(config, Some(node), &running));
    }
    let chosen = nodes[0];
    if chosen.host.is_some() {
        return Err(Error::Refused(format!(
            "node {node} runs on another host: add-node starts local nodes only; start it there with `rdkv-server --config FILE --node {node} --join`"
        )));
    }
    // The caller found the node not a member of the running view: a view state or a snapshot
    // is from an earlier membership (a member removed, perhaps while it was down). A joining
    // node would replay that view as the old member, or load the snapshot and serve keys
    // deleted since it was written.
    let snapshot = chosen
        .data_dir
        .clone()
        .unwrap_or_else(|| data_dir(run_directory, node))
        .join("snapshot.rdkv");
    let state = view_state_file(run_directory, node);
    let leftovers: Vec<String> = [state, snapshot]
        .into_iter()
        .filter(|path| path.exists())
        .map(|path| path.display().to_string())
        .collect();
    if !leftovers.is_empty() {
        return Err(Error::Refused(format!(
            "node {node} has a view state or a snapshot from an earlier membership ({}): a joining node starts empty and is filled from the members; remove them (they hold nothing the members lack) and run add-node again",
            leftovers.join(", ")
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
    start_local(&binary, &config_path, chosen, run_directory, true, true)
}

/// Refuses to start a local node that has no view state while other local nodes of the file
/// have one: the cluster runs (or ran) without it, and started as a member it would begin a
/// view of its own from the file's nodes instead of joining (`docs/operations.md`, *Growing
/// and shrinking a cluster*). A cluster's first start has no view state anywhere.
fn refuse_never_added(
    config: &ClusterConfig,
    run_directory: &Path,
    nodes: &[&NodeConfig],
) -> Result<()> {
    let has_state = |node: &&NodeConfig| view_state_file(run_directory, node.id).exists();
    let members: Vec<u32> = config
        .nodes
        .iter()
        .filter(|node| node.host.is_none() && has_state(node))
        .map(|node| node.id)
        .collect();
    let first = first_members(run_directory);
    if members.is_empty() {
        // A first start: the nodes it starts with are the view's first members, whatever
        // happens to the start (a node that fails to start is still one of them).
        if first.is_empty() {
            let ids: Vec<String> = config
                .nodes
                .iter()
                .map(|node| node.id.to_string())
                .collect();
            let _ = fs::create_dir_all(run_directory);
            let _ = fs::write(first_members_file(run_directory), ids.join("\n") + "\n");
        }
        return Ok(());
    }
    let strangers: Vec<u32> = nodes
        .iter()
        .filter(|node| node.host.is_none() && !has_state(node) && !first.contains(&node.id))
        .map(|node| node.id)
        .collect();
    if strangers.is_empty() {
        return Ok(());
    }
    Err(Error::Refused(format!(
        "nodes {strangers:?} have no view state in {} while nodes {members:?} do: they never joined this cluster; add each with `rdkv-cluster add-node {} --node N` (or take them out of the file)",
        run_directory.display(),
        config.path.display()
    )))
}

/// The file that lists the nodes of the run directory's first start, one id a line.
fn first_members_file(run_directory: &Path) -> PathBuf {
    run_directory.join("first-members")
}

/// The nodes of the run directory's first start (none when it was not recorded).
fn first_members(run_directory: &Path) -> Vec<u32> {
    fs::read_to_string(first_members_file(run_directory))
        .map(|text| {
            text.lines()
                .filter_map(|line| line.trim().parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Starts every node and waits for each to be ready.
///
/// # Errors
/// As [`start_nodes`].
pub fn start(
    config: &ClusterConfig,
    run_directory: &Path,
    detach: bool,
) -> Result<Vec<StartedNode>> {
    start_nodes(config, run_directory, detach, None)
}

/// Starts the nodes (`only` one, or all) in file order and waits for each to be ready.
///
/// # Errors
/// [`Error::Refused`] when a chosen node already runs; [`Error::Node`] when a node fails to
/// start (the nodes this call started are stopped again).
pub fn start_nodes(
    config: &ClusterConfig,
    run_directory: &Path,
    detach: bool,
    only: Option<u32>,
) -> Result<Vec<StartedNode>> {
    let nodes = select(config, only)?;
    let running = running_nodes(&nodes, run_directory);
    if !running.is_empty() {
        return Err(already_running(config, only, &running));
    }
    let new_run_directory = !run_directory.exists();
    refuse_never_added(config, run_directory, &nodes)?;
    fs::create_dir_all(run_directory).map_err(|error| {
        Error::Refused(format!(
            "create the run directory {}: {error}",
            run_directory.display()
        ))
    })?;
    if new_run_directory && nodes.iter().any(|node| node.data_dir.is_none()) {
        // A cluster started from another directory keeps its snapshots in that one's: say
        // where this one's go, so an empty cluster is not a surprise.
        say(&format!(
            "new run directory {}: the nodes' snapshots, logs and pid files go there, and they start empty (a cluster run from another directory keeps its own: pass its `--run-dir`, or set `data_dir` in the cluster file)",
            fs::canonicalize(run_directory)
                .unwrap_or_else(|_| run_directory.to_path_buf())
                .display()
        ));
    }
    let binary = if nodes.iter().any(|node| node.host.is_none()) {
        Some(server_binary()?)
    } else {
        None
    };
    let config_path = fs::canonicalize(&config.path).unwrap_or_else(|_| config.path.clone());
    let mut started: Vec<StartedNode> = Vec::new();
    for node in nodes {
        let outcome = match (&node.host, &binary) {
            (Some(host), _) => start_remote(config, node, host),
            (None, Some(binary)) => {
                start_local(binary, &config_path, node, run_directory, detach, false)
            }
            (None, None) => Err(Error::Refused("rdkv-server was not located".into())),
        };
        match outcome {
            Ok(node) => started.push(node),
            Err(error) => {
                for node in started.iter_mut().rev() {
                    stop_started(config, node, run_directory);
                }
                if started.is_empty() {
                    return Err(error);
                }
                let ids: Vec<String> = started
                    .iter()
                    .map(|node| node.ready.id.to_string())
                    .collect();
                return Err(Error::Refused(format!(
                    "{error}; the nodes started before it ({}) were stopped again",
                    ids.join(", ")
                )));
            }
        }
    }
    Ok(started)
}

/// Why nodes that already run (or whose ports are taken) are not started, and the fix.
fn already_running(config: &ClusterConfig, only: Option<u32>, running: &[(u32, String)]) -> Error {
    let list: Vec<String> = running
        .iter()
        .map(|(id, how)| format!("node {id} ({how})"))
        .collect();
    if running.iter().all(|(_, how)| how.contains(" is taken by ")) {
        let list: Vec<String> = running
            .iter()
            .map(|(id, how)| format!("node {id}: {how}"))
            .collect();
        return Error::Refused(format!(
            "cannot start cluster `{}`: {}; free the port, or change control_address in {}",
            config.name,
            list.join(", "),
            config.path.display()
        ));
    }
    let fix = match only {
        Some(id) => format!(
            "restart it with `rdkv-cluster restart {} --node {id}`",
            config.path.display()
        ),
        None => format!(
            "stop it with `rdkv-cluster down {}`, or start a stopped node with `up --node N`",
            config.path.display()
        ),
    };
    Error::Refused(format!(
        "cluster `{}` is already running: {}; {fix}",
        config.name,
        list.join(", "),
    ))
}

/// Starts a node on another host through ssh and confirms its control port from here.
fn start_remote(config: &ClusterConfig, node: &NodeConfig, host: &str) -> Result<StartedNode> {
    let (ready_line, pid) = remote::start(config, node, host)?;
    confirm_control_port(node)?;
    Ok(StartedNode {
        ready: ReadyNode {
            id: node.id,
            pid,
            host: Some(host.to_string()),
            ready_line,
        },
        child: None,
    })
}

/// The ready line comes after the control listener is bound; confirm over the port itself
/// (which the node does not log: a probe that says nothing is not a client).
fn confirm_control_port(node: &NodeConfig) -> Result<()> {
    if TcpStream::connect_timeout(&node.control_address, Duration::from_secs(5)).is_ok() {
        return Ok(());
    }
    Err(Error::Node {
        node: node.id,
        message: format!(
            "printed its ready line but its control port {} does not accept connections from here",
            node.control_address
        ),
    })
}

/// Starts a node on this machine and waits for its ready line and its control port.
fn start_local(
    binary: &Path,
    config_path: &Path,
    node: &NodeConfig,
    run_directory: &Path,
    detach: bool,
    join: bool,
) -> Result<StartedNode> {
    let failure = |message: String| Error::Node {
        node: node.id,
        message,
    };
    let mut command = server_command(binary, config_path, node, run_directory);
    if join {
        command.arg("--join");
    }
    if detach {
        // The node appends to its log and rotates it by size (`rdkv_server::log_file`);
        // what it writes before it has opened the file (a command-line error) is appended
        // here: the earlier runs' lines stay.
        let path = log_file(run_directory, node.id);
        let log = fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
            .open(&path)
            .map_err(|error| failure(format!("open its log file {}: {error}", path.display())))?;
        command.arg("--log-file").arg(&path).stderr(log);
    } else {
        command.stderr(Stdio::piped());
    }
    let mut child = command
        .spawn()
        .map_err(|error| failure(format!("spawn {}: {error}", binary.display())))?;
    let pid = child.id();
    let log = ForwardedLog::start(child.stderr.take(), node.id);
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
            discard_child(&mut child, run_directory, node.id);
            // Its last line says why (`rdkv-server: error: …`): the report stays one line.
            let last_line = log.last_line(run_directory, node.id);
            let detail = if last_line.trim().is_empty() {
                String::new()
            } else {
                format!(": {}", last_line.trim())
            };
            let why = match outcome {
                Err(_) => format!("no ready line within {READY_TIMEOUT:?}"),
                Ok(_) => "it exited before it was ready".to_string(),
            };
            return Err(failure(format!("failed to start: {why}{detail}")));
        }
    };
    if let Err(error) = confirm_control_port(node) {
        discard_child(&mut child, run_directory, node.id);
        return Err(error);
    }
    Ok(StartedNode {
        ready: ReadyNode {
            id: node.id,
            pid,
            host: None,
            ready_line,
        },
        child: Some(child),
    })
}

/// The `rdkv-server` command line of a local node (its stderr is the caller's to set).
fn server_command(
    binary: &Path,
    config_path: &Path,
    node: &NodeConfig,
    run_directory: &Path,
) -> Command {
    let mut command = Command::new(binary);
    command
        .args(["--config"])
        .arg(config_path)
        .args(["--node", &node.id.to_string()])
        .arg("--view-state")
        .arg(view_state_file(run_directory, node.id))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        // Its own process group: Ctrl-C reaches only the launcher, which stops nodes in order.
        .process_group(0);
    if node.data_dir.is_none() {
        // The node's snapshots live in the run directory too, unless the file says where.
        command
            .arg("--data-dir")
            .arg(data_dir(run_directory, node.id));
    }
    if node.shm == rdkv_cluster_file::ShmMode::Auto && node.shm_socket.is_none() {
        // The node's shm socket lives in the run directory, next to its pid and log files
        // (the node ignores it when its file sets shm = "off").
        command
            .arg("--shm-socket")
            .arg(shm_socket_file(run_directory, node.id));
    }
    command
}

/// Kills a node that failed to start, reaps it and removes its pid file.
fn discard_child(child: &mut Child, run_directory: &Path, id: u32) {
    let _ = child.kill();
    let _ = child.wait();
    let _ = fs::remove_file(pid_file(run_directory, id));
}

/// A foreground node's log, forwarded from the start: a pipe nobody reads fills up, and a node
/// that logs into a full pipe waits (rdkv-server drops lines rather than wait, but other
/// servers may not). The last lines are kept for a failure report.
struct ForwardedLog {
    /// The thread that forwards the lines; `None` for a detached node (its log is a file).
    forwarder: Option<std::thread::JoinHandle<()>>,
    /// The last 8 lines.
    recent: Arc<Mutex<VecDeque<String>>>,
}

impl ForwardedLog {
    /// Forwards `stderr`, when piped, each line prefixed with the node's id.
    fn start(stderr: Option<std::process::ChildStderr>, id: u32) -> Self {
        let recent: Arc<Mutex<VecDeque<String>>> = Arc::default();
        let forwarder = stderr.map(|stderr| {
            let recent = recent.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr)
                    .lines()
                    .map_while(std::result::Result::ok)
                {
                    eprintln!("[node {id}] {line}");
                    let mut recent = recent
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                    if recent.len() == 8 {
                        recent.pop_front();
                    }
                    recent.push_back(line);
                }
            })
        });
        Self { forwarder, recent }
    }

    /// The log's last line once the node has exited: the last forwarded, or the log file's.
    fn last_line(self, run_directory: &Path, id: u32) -> String {
        match self.forwarder {
            Some(forwarder) => {
                let _ = forwarder.join();
                let recent = self
                    .recent
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                recent.back().cloned().unwrap_or_default()
            }
            None => fs::read_to_string(log_file(run_directory, id))
                .unwrap_or_default()
                .lines()
                .last()
                .unwrap_or_default()
                .to_string(),
        }
    }
}

/// Stops one started local child: SIGTERM, wait, SIGKILL after the timeout; removes its pid
/// file. Returns false when it had already exited (and signals nothing: once reaped, its pid
/// may be another process's). A remote node is left alone here (see [`stop_started`]).
pub fn stop_child(node: &mut StartedNode, run_directory: &Path) -> bool {
    let Some(child) = node.child.as_mut() else {
        return false;
    };
    let was_running = matches!(child.try_wait(), Ok(None));
    if was_running {
        let pid = Pid::from_raw(node.ready.pid as i32);
        let _ = kill(pid, Signal::SIGTERM);
        let started = Instant::now();
        loop {
            match child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if started.elapsed() > STOP_TIMEOUT => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
    // A `restart` from another shell may have replaced the node: its pid file is not ours.
    let path = pid_file(run_directory, node.ready.id);
    if read_pid(&path) == Some(node.ready.pid as i32) {
        let _ = fs::remove_file(path);
    }
    was_running
}

/// Stops a node this launcher started: a local child by signal, a remote node through ssh.
pub fn stop_started(config: &ClusterConfig, node: &mut StartedNode, run_directory: &Path) {
    match (&node.ready.host, config.node(node.ready.id)) {
        (Some(host), Some(node_config)) => {
            let _ = remote::stop(config, node_config, host);
        }
        _ => {
            stop_child(node, run_directory);
        }
    }
}

/// How a node was stopped, for `down`'s report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stopped {
    /// It acknowledged a `Shutdown` and exited.
    ByRequest,
    /// A signal or ssh stopped it (the line says how).
    Otherwise(String),
    /// It was not running.
    NotRunning(String),
}

/// Stops one node: an authenticated `Shutdown` over the control plane, then waiting until it
/// has exited; signals by its pid file, or ssh, when it does not answer.
///
/// # Errors
/// [`Error::Node`] when it answers but cannot be stopped, or ssh fails.
pub async fn stop_node(
    config: &ClusterConfig,
    node: &NodeConfig,
    run_directory: &Path,
) -> Result<Stopped> {
    let path = pid_file(run_directory, node.id);
    let pid = node_pid(run_directory, node.id).filter(|_| node.host.is_none());
    let monitored = rdkv_common::protocol::MonitoredNode {
        address: node.control_address,
        id: Some(node.id),
        secret: &config.secret,
    };
    let refused = match request_shutdown(monitored, SHUTDOWN_REQUEST_TIMEOUT).await {
        Ok(_) => {
            let started = Instant::now();
            loop {
                let running = match pid {
                    Some(pid) => is_alive(pid),
                    None => answers(node.control_address),
                };
                if !running {
                    break;
                }
                if started.elapsed() > stop_timeout(node) {
                    let why = format!(
                        "it acknowledged the shutdown but did not exit within {:?}",
                        stop_timeout(node)
                    );
                    return stop_by_signal(config, node, run_directory, &why).await;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let _ = fs::remove_file(&path);
            if let Some(host) = &node.host {
                remote::forget(config, node, host);
            }
            return Ok(Stopped::ByRequest);
        }
        // Refused after the secret checked out (every slot it may give a monitor taken): it
        // is this file's node, so the signal may stop it.
        Err(ControlError::Refused { reason }) if !crate::status::refused_the_secret(&reason) => {
            let why = format!("it refused the shutdown request: {reason}");
            return stop_by_signal(config, node, run_directory, &why).await;
        }
        Err(ControlError::Refused { reason }) => reason,
        Err(_) => {
            let why = match probe_node(node.control_address, Duration::from_millis(500)) {
                Probe::Other => format!(
                    "another program holds its control port {}",
                    node.control_address
                ),
                _ => "it did not answer on its control port".to_string(),
            };
            return stop_by_signal(config, node, run_directory, &why).await;
        }
    };
    // It answers but refuses this file's secret: this file is not that node's (another
    // cluster on these ports, or a stale secret). Signalling it anyway would stop a node the
    // caller cannot prove is theirs.
    Err(Error::Node {
        node: node.id,
        message: format!(
            "refused the shutdown request ({refused}); not signalling it: check that {} is this node's cluster file and its secret",
            config.path.display()
        ),
    })
}

async fn stop_by_signal(
    config: &ClusterConfig,
    node: &NodeConfig,
    run_directory: &Path,
    why: &str,
) -> Result<Stopped> {
    if let Some(host) = &node.host {
        let line = tokio::task::block_in_place(|| remote::stop(config, node, host))?;
        return Ok(
            if line.starts_with("not running") || line.starts_with("already stopped") {
                Stopped::NotRunning(line)
            } else {
                Stopped::Otherwise(format!("{line}; {why}"))
            },
        );
    }
    let path = pid_file(run_directory, node.id);
    let Some(pid) = read_pid(&path) else {
        return Ok(Stopped::NotRunning(format!(
            "not running ({why}; no pid file in {})",
            run_directory.display()
        )));
    };
    if !is_node_process(pid, node.id) {
        let _ = fs::remove_file(&path);
        return Ok(Stopped::NotRunning(format!(
            "already stopped (stale pid file: pid {pid} is not node {}'s rdkv-server; removed)",
            node.id
        )));
    }
    let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
    let started = Instant::now();
    while is_alive(pid) && started.elapsed() < stop_timeout(node) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let line = if is_alive(pid) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        format!("killed (pid {pid}) after {:?} ({why})", stop_timeout(node))
    } else {
        format!("stopped by SIGTERM (pid {pid}; {why})")
    };
    let _ = fs::remove_file(&path);
    Ok(Stopped::Otherwise(line))
}

/// `down`: stops the nodes (`only` one, or all) in order. Returns one line per node.
///
/// # Errors
/// [`Error::Refused`] with every node's line when any node could not be stopped (the others
/// were stopped all the same).
pub async fn stop(
    config: &ClusterConfig,
    run_directory: &Path,
    only: Option<u32>,
) -> Result<Vec<String>> {
    let mut report = Vec::new();
    // A cluster with no node running has no view to stop.
    let mut failed = false;
    if only.is_none()
        && config
            .nodes
            .iter()
            .any(|node| answers(node.control_address))
    {
        match stop_the_view(config).await {
            Ok(line) => report.push(line),
            Err(warning) => {
                // The nodes are stopped all the same; the exit says the stop was not clean.
                failed = true;
                report.push(warning);
            }
        }
    }
    // Every node is tried: one that cannot be stopped does not keep the others running.
    for node in select(config, only)? {
        let started = Instant::now();
        let since = std::time::SystemTime::now();
        // A node started by hand without a `data_dir` (README, *Run a single server by hand*)
        // writes no snapshot: only one this launcher started, or one the file gives a
        // `data_dir`, is checked for its final snapshot.
        let snapshots = node.data_dir.is_some() || pid_file(run_directory, node.id).exists();
        let line = match stop_node(config, node, run_directory).await {
            Ok(Stopped::ByRequest)
                if snapshots && !final_snapshot_written(node, run_directory, since).await =>
            {
                failed = true;
                format!(
                    "stopped, but wrote no final snapshot (a full disk?): its log ({}) says why; its previous snapshot is kept",
                    log_file(run_directory, node.id).display()
                )
            }
            Ok(Stopped::ByRequest) => format!(
                "stopped (shutdown over the control plane, {:.1}s)",
                started.elapsed().as_secs_f64()
            ),
            Ok(Stopped::Otherwise(line) | Stopped::NotRunning(line)) => line,
            Err(error) => {
                failed = true;
                format!("not stopped: {error}")
            }
        };
        report.push(format!("node {}: {line}", node.id));
    }
    if failed {
        return Err(Error::Refused(report.join("; ")));
    }
    Ok(report)
}

/// How long `down` waits for a node's final snapshot once its control port is closed (without
/// its pid file, that is all `down` sees of its exit).
const FINAL_SNAPSHOT_WITHIN: Duration = Duration::from_secs(5);

/// Whether a local node that stopped on request wrote its final snapshot (its file changed
/// since `since`, within [`FINAL_SNAPSHOT_WITHIN`]); a node on another host is not checked.
async fn final_snapshot_written(
    node: &NodeConfig,
    run_directory: &Path,
    since: std::time::SystemTime,
) -> bool {
    if node.host.is_some() {
        return true;
    }
    let file = node
        .data_dir
        .clone()
        .unwrap_or_else(|| data_dir(run_directory, node.id))
        .join("snapshot.rdkv");
    let started = Instant::now();
    loop {
        let written = fs::metadata(&file)
            .and_then(|metadata| metadata.modified())
            // File times advance by the kernel's tick: allow one.
            .is_ok_and(|modified| modified + Duration::from_millis(50) >= since);
        if written || started.elapsed() >= FINAL_SNAPSHOT_WITHIN {
            return written;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How long `down` waits for every node to apply the cluster's stop.
const STOP_APPLIED_WITHIN: Duration = Duration::from_secs(5);

/// The whole cluster's clean stop (`docs/operations.md`, *Persistence*): the view's leader
/// commits it, every serving node fences its clients at once and keeps its keys, and `down`
/// waits until each running node has applied it before it stops them, so that each final
/// snapshot holds every acknowledged write. The line to print, or, when no node could commit
/// it, the warning to print (the nodes then stop one by one, and a key deleted while one of
/// them was out may come back).
///
/// # Errors
/// The warning, when the stop was not committed within [`stop_commit_bound`] while some node
/// still answered (a leader that just left or died: the others elect a new one within a few
/// failure timeouts, and it is asked again), or when no node answered at all.
pub async fn stop_the_view(config: &ClusterConfig) -> std::result::Result<String, String> {
    let timeout = config.failure_timeout + Duration::from_secs(2);
    let bound = stop_commit_bound(config);
    let asked = Instant::now();
    let mut last_error = String::from("no node answered");
    let mut stopped_at = None;
    let mut said_waiting = false;
    while stopped_at.is_none() {
        for node in &config.nodes {
            let monitored = rdkv_common::protocol::MonitoredNode {
                address: node.control_address,
                id: Some(node.id),
                secret: &config.secret,
            };
            match rdkv_common::protocol::request_cluster_stop(monitored, timeout).await {
                Ok(epoch) => {
                    stopped_at = Some(epoch);
                    break;
                }
                Err(error) => last_error = format!("node {}: {error}", node.id),
            }
        }
        let anyone_answers = config
            .nodes
            .iter()
            .any(|node| answers(node.control_address));
        if stopped_at.is_some() || !anyone_answers || asked.elapsed() >= bound {
            break;
        }
        if !said_waiting {
            said_waiting = true;
            eprintln!(
                "rdkv-cluster: the view's stop was not committed yet ({last_error}): asking again while the nodes elect a leader (up to {bound:?})"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let Some(epoch) = stopped_at else {
        return Err(format!(
            "warning: the cluster's view was not stopped ({last_error}): the nodes stop one by one, and each keeps its last snapshot; nodes started again refill from each other or reconcile, and a key deleted while one of them was out may come back"
        ));
    };
    let started = Instant::now();
    for node in &config.nodes {
        let monitored = rdkv_common::protocol::MonitoredNode {
            address: node.control_address,
            id: Some(node.id),
            secret: &config.secret,
        };
        while started.elapsed() < STOP_APPLIED_WITHIN {
            match rdkv_common::protocol::fetch_view(monitored, Duration::from_secs(1)).await {
                Ok(view) if view.epoch < epoch => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                // Applied, or not running (nothing of it can be served).
                _ => break,
            }
        }
    }
    Ok(format!(
        "cluster stopped at view epoch {epoch}: every node fences its clients and writes its final snapshot as it stops"
    ))
}

/// How long `down` asks for the view's stop: a leader that just left or died is replaced
/// within a few failure timeouts.
fn stop_commit_bound(config: &ClusterConfig) -> Duration {
    config.failure_timeout * 3 + Duration::from_secs(3)
}

/// The last `lines` lines of a node's log: its log file under the run directory (a detached
/// local node), or on its host.
///
/// # Errors
/// [`Error::Refused`] when there is no log to show, naming why.
pub fn logs(config: &ClusterConfig, run_directory: &Path, id: u32, lines: usize) -> Result<String> {
    let node = select(config, Some(id))?[0];
    if let Some(host) = &node.host {
        return remote::logs(config, node, host, lines);
    }
    let path = log_file(run_directory, id);
    let bytes = fs::read(&path).map_err(|error| {
        Error::Refused(format!(
            "no log for node {id} at {} ({error}): a node started in the foreground logs to the `up` terminal; start with `--detach` to keep a log file",
            path.display()
        ))
    })?;
    // A log may hold any bytes (a client's name is escaped, a crash's output is not).
    let text = String::from_utf8_lossy(&bytes);
    let all: Vec<&str> = text.lines().collect();
    let first = all.len().saturating_sub(lines);
    Ok(all[first..].join("\n") + "\n")
}

/// Writes a line to stdout, ignoring a closed pipe.
pub fn say(line: &str) {
    let stdout = std::io::stdout();
    let mut handle = stdout.lock();
    let _ = writeln!(handle, "{line}");
}
