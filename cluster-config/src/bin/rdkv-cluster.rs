//! `rdkv-cluster`: start, stop, restart and inspect an rdkv cluster from its cluster file.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use rdkv_cluster_config::launcher::{self, say};
use rdkv_cluster_config::{membership, status, systemd, ClusterConfig};

/// The exit codes, for `--help` (and `docs/operations.md`).
const EXIT_CODES: &str = "Exit codes:
  0  done; for `status`, every node answers (up, or not-serving while it rejoins) and no
     loss is recorded
  1  failed (one line on stderr names the cause and the fix); for `status`, a node is down,
     does not answer within 1 s (`no answer`: stopped, hung or starved), or refuses for a
     reason other than the secret; for `restart`, the node is not serving within 5 minutes
  2  invalid command line
  3  `status`, `down`, `restart`: a node refused the cluster file's secret (authentication
     failed); `down` and `restart` then stop nothing
  4  `status`: every node answers, and the view records a loss (every copy of some keys down
     at once) not acknowledged yet (`ack-loss`)";

/// Start, stop, restart, snapshot and inspect an rdkv cluster from its cluster file: nodes on
/// this machine as child processes, nodes on other hosts through ssh.
#[derive(Debug, Parser)]
#[command(version, about, after_help = EXIT_CODES)]
struct Arguments {
    /// Where pid and log files go, and the nodes' snapshots unless the cluster file sets
    /// data_dir (default: .rdkv/<cluster name> in the current directory: start and stop a
    /// cluster from the same directory, or its snapshots are not found).
    #[arg(long, global = true)]
    run_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Action,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// Start every node (or one), wait until each is ready, print the nodes, then forward the
    /// local nodes' logs until Ctrl-C (which stops the nodes in order), with a line for a node
    /// that exits and the log of one that `restart` starts again.
    Up {
        /// The cluster file.
        file: PathBuf,
        /// Start only this node (the others may be running).
        #[arg(long)]
        node: Option<u32>,
        /// Leave the nodes running in the background, logging to the run directory.
        #[arg(long)]
        detach: bool,
    },
    /// Stop every node (or one), in order: an authenticated Shutdown over the control plane,
    /// signals by pid file (or ssh) for a node that does not answer. Stopping every node first
    /// stops the cluster's view, so each node's final snapshot holds every acknowledged write
    /// and `up` starts from them (docs/operations.md, Persistence).
    ///
    /// What survives (each node's snapshots are in its data_dir, on disk):
    ///   down, then up               every acknowledged write and delete
    ///   down --node N, or a restart replicas >= 2: everything (it refills from its peers);
    ///                               replicas = 1: everything (its final snapshot), but its
    ///                               keys are unavailable while it is down
    ///   one node killed, or its     replicas >= 2: everything; replicas = 1: its last
    ///   host rebooted               snapshot (up to snapshot_interval of writes lost)
    ///   every node killed at once   each key as of its last snapshot (replicas >= 2: the
    ///                               newest among its copies wins); status says so (ack-loss)
    ///   `replicas` nodes killed     the keys whose copies were all on them are lost, and
    ///   at once                     status says so (ack-loss)
    /// Ctrl-C on a foreground `up` stops the cluster as `down` does.
    /// With --node and replicas >= 2, `down` refuses (exit 1) to leave `replicas` members out
    /// of service at once (their keys would be lost when they refill); --force stops it anyway.
    #[command(verbatim_doc_comment)]
    Down {
        /// The cluster file.
        file: PathBuf,
        /// Stop only this node.
        #[arg(long)]
        node: Option<u32>,
        /// Stop the node even when `replicas` members would then be out of service at once
        /// (the keys whose copies are all on them are lost when they come back and refill).
        #[arg(long)]
        force: bool,
    },
    /// Stop one node and start it again in the background; the others keep serving. The
    /// restarted node copies its keys back from its peers before it serves; `restart` waits
    /// until it does (at most 5 minutes, with its refill's progress every 5 s), so that a
    /// rolling restart never stops the next node while this one is still filling. Exits 1 if
    /// it is not serving by then.
    Restart {
        /// The cluster file.
        file: PathBuf,
        /// The node to restart.
        #[arg(long)]
        node: u32,
        /// Return once the node is started, without waiting for it to serve.
        #[arg(long)]
        no_wait: bool,
        /// Restart the node even when `replicas` members would then be out of service at once
        /// (it refills from its serving peers, so the keys whose copies are all on it and on
        /// the members already out are lost).
        #[arg(long)]
        force: bool,
    },
    /// Add node N, listed in the edited cluster file and not a member of the running view:
    /// start it here, have the view's leader add it, and wait until it has copied the keys it
    /// now holds and serves (about 1/n of the keys move to it). Exits 0 once it serves
    /// (docs/operations.md, Growing and shrinking a cluster).
    AddNode {
        /// The cluster file, listing the new node.
        file: PathBuf,
        /// The node to add.
        #[arg(long)]
        node: u32,
    },
    /// Remove member N from the running view: it keeps serving while every key it holds gets
    /// its new copies on the other members, then it leaves the view and is stopped. A member
    /// that is down is removed at once, and the others copy its keys again (re-replication).
    /// Exits 0 once it is out of the view (and its keys re-replicated); then take it out of the
    /// cluster file.
    RemoveNode {
        /// The cluster file.
        file: PathBuf,
        /// The node to remove.
        #[arg(long)]
        node: u32,
        /// Remove a member that is down even with `replicas = 1`, where it holds the only copy
        /// of its keys: they are lost (the view records the loss).
        #[arg(long)]
        lose_keys: bool,
    },
    /// Grow node N's table: write its new `index_size` and `heap_size` into the cluster file
    /// (checked first against this machine's memlock limit and memory, as `up` checks), then
    /// restart it with them and wait until it serves. With `replicas` ≥ 2 its keys stay
    /// readable and writable on their other copies meanwhile, and it is refilled into its new
    /// table; with one copy its keys are unavailable while it restarts, and it loads the
    /// snapshot it wrote as it stopped (docs/operations.md, Growing a node's table).
    Resize {
        /// The cluster file the nodes run from.
        file: PathBuf,
        /// The node to grow.
        #[arg(long)]
        node: u32,
        /// The new index size, as the file writes sizes (`4M`).
        #[arg(long)]
        index_size: Option<String>,
        /// The new heap size (`64M`).
        #[arg(long)]
        heap_size: Option<String>,
        /// Restart the node even when `replicas` members would then be out of service at once.
        #[arg(long)]
        force: bool,
    },
    /// Write a snapshot of every node's keys (or one node's) now, into its data directory;
    /// exits 0 when every node wrote one.
    Snapshot {
        /// The cluster file.
        file: PathBuf,
        /// Only this node.
        #[arg(long)]
        node: Option<u32>,
    },
    /// One row per node: up, not-serving, down, no answer or auth failed, uptime, connections,
    /// queue pairs, keys, memory; then the newest view the answering nodes know, and any loss
    /// it records (every copy of some keys down at once). Every node is asked at once and
    /// given 1 s, so `status` returns within about a second even when a node is stopped or
    /// hung (`no answer`). Exits 0 when every node answers (up or not-serving) and no loss is
    /// recorded, 1 when a node does not, 3 when a node refused the secret, 4 when every node
    /// answers but a loss is recorded and not acknowledged (`ack-loss`).
    Status {
        /// The cluster file.
        file: PathBuf,
    },
    /// Acknowledge the losses `status` shows (views in which every copy of some keys was
    /// down at once): they are cleared from the view, and `status` exits 0 again. The
    /// metric `rdkv_copy_sets_lost_total` keeps counting them.
    AckLoss {
        /// The cluster file.
        file: PathBuf,
        /// Clear the losses of this epoch and earlier only (default: every loss shown now).
        #[arg(long)]
        epoch: Option<u64>,
    },
    /// The last lines of a node's log (a detached local node's log file, or through ssh).
    Logs {
        /// The cluster file.
        file: PathBuf,
        /// The node.
        #[arg(long)]
        node: u32,
        /// How many lines.
        #[arg(long, default_value_t = 50)]
        lines: usize,
    },
    /// Print a systemd service unit that runs one node (docs/operations.md, Running under
    /// systemd).
    Systemd {
        /// The cluster file (its absolute path goes into the unit).
        file: PathBuf,
        /// The node.
        #[arg(long)]
        node: u32,
        /// The rdkv-server binary on the node's host (default: the one next to this program).
        #[arg(long)]
        binary: Option<PathBuf>,
        /// The file holding the cluster secret on the node's host, loaded as a systemd
        /// credential.
        #[arg(long)]
        credential: Option<PathBuf>,
    },
}

impl Action {
    fn file(&self) -> &Path {
        match self {
            Action::Up { file, .. }
            | Action::Down { file, .. }
            | Action::Restart { file, .. }
            | Action::AddNode { file, .. }
            | Action::RemoveNode { file, .. }
            | Action::Resize { file, .. }
            | Action::Snapshot { file, .. }
            | Action::Status { file }
            | Action::AckLoss { file, .. }
            | Action::Logs { file, .. }
            | Action::Systemd { file, .. } => file,
        }
    }
}

fn main() -> ExitCode {
    let arguments = Arguments::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("rdkv-cluster: error: start the async runtime: {error}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(arguments)) {
        Ok(code) => ExitCode::from(code),
        Err(error) => {
            eprintln!("rdkv-cluster: error: {error:#}");
            ExitCode::from(1)
        }
    }
}

/// Loads the cluster file (checked against this machine for the commands that start nodes
/// here) and runs the command.
async fn run(arguments: Arguments) -> anyhow::Result<u8> {
    let file = arguments.command.file().to_path_buf();
    // Starting nodes here pins their tables here: check the machine's memlock limit and
    // memory for those (the other commands only talk to the nodes).
    let config = match &arguments.command {
        Action::Up { node, .. } => rdkv_cluster_config::config::load_to_start(&file, None, *node)?,
        Action::Restart { node, .. } | Action::AddNode { node, .. } => {
            rdkv_cluster_config::config::load_to_start(&file, None, Some(*node))?
        }
        _ => rdkv_cluster_config::load(&file)?,
    };
    for warning in &config.warnings {
        eprintln!("warning: {warning}");
    }
    let run_directory = arguments
        .run_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(".rdkv").join(&config.name));
    // The commands to repeat, with the run directory when it is not the default.
    let run_dir_flag = arguments
        .run_dir
        .as_ref()
        .map(|directory| format!(" --run-dir {}", directory.display()))
        .unwrap_or_default();
    match arguments.command {
        Action::Up { detach, node, .. } => {
            start(&config, &run_directory, detach, node, &file, &run_dir_flag).await
        }
        Action::Down { node, force, .. } => down(&config, &run_directory, node, force).await,
        Action::Restart {
            node,
            no_wait,
            force,
            ..
        } => checked_restart(&config, &run_directory, node, no_wait, force).await,
        Action::Snapshot { node, .. } => snapshot(&config, node).await,
        Action::Resize {
            node,
            index_size,
            heap_size,
            force,
            ..
        } => {
            let sizes = rdkv_cluster_config::resize::NewSizes {
                index_size: index_size.as_deref(),
                heap_size: heap_size.as_deref(),
            };
            resize(&config, &run_directory, node, sizes, force).await
        }
        Action::AddNode { node, .. } => {
            membership::add_node(&config, &run_directory, node, say).await?;
            Ok(0)
        }
        Action::RemoveNode {
            node, lose_keys, ..
        } => {
            if let Some(refusal) = status::secret_refusal(&config, Some(node)).await {
                eprintln!("rdkv-cluster: error: {refusal}");
                return Ok(3);
            }
            membership::remove_node(&config, &run_directory, node, lose_keys, say).await?;
            Ok(0)
        }
        Action::Status { .. } => print_status(&config).await,
        Action::AckLoss { epoch, .. } => acknowledge_losses(&config, epoch).await,
        Action::Logs { node, lines, .. } => {
            let text = tokio::task::block_in_place(|| {
                launcher::logs(&config, &run_directory, node, lines)
            })?;
            rdkv_common::out!("{text}");
            Ok(0)
        }
        Action::Systemd {
            node,
            binary,
            credential,
            ..
        } => print_systemd_unit(&config, node, binary, credential, &file),
    }
}

/// Why `down`, `restart` or `resize` must not stop `node` (or the cluster), said in one line:
/// the nodes refuse the file's secret (exit 3), or stopping the node would lose keys and
/// `force` was not given (exit 1). The exit code, or `None` to go on.
async fn stop_refusal(config: &ClusterConfig, node: Option<u32>, force: bool) -> Option<u8> {
    if let Some(refusal) = status::secret_refusal(config, node).await {
        eprintln!("rdkv-cluster: error: {refusal}");
        return Some(3);
    }
    if let (Some(node), false) = (node, force) {
        if let Some(refusal) = status::stop_would_lose(config, node).await {
            eprintln!("rdkv-cluster: error: {refusal}");
            return Some(1);
        }
    }
    None
}

/// `down`: stops the cluster, or one node (refused when that would lose keys, unless
/// `force`).
async fn down(
    config: &ClusterConfig,
    run_directory: &Path,
    node: Option<u32>,
    force: bool,
) -> anyhow::Result<u8> {
    if let Some(code) = stop_refusal(config, node, force).await {
        return Ok(code);
    }
    for line in launcher::stop(config, run_directory, node).await? {
        say(&line);
    }
    if let (Some(node), 1) = (node, config.replicas) {
        say(&format!(
            "node {node}'s keys have no other copy (replicas = 1): operations on them fail with `node unreachable` until `up --node {node}` loads its final snapshot"
        ));
    }
    Ok(0)
}

/// `restart`: refused when stopping the node would lose keys, unless `force`.
async fn checked_restart(
    config: &ClusterConfig,
    run_directory: &Path,
    node: u32,
    no_wait: bool,
    force: bool,
) -> anyhow::Result<u8> {
    if let Some(code) = stop_refusal(config, Some(node), force).await {
        return Ok(code);
    }
    restart(config, run_directory, node, !no_wait).await
}

/// `resize`: refused when stopping the node would lose keys, unless `force`; the new sizes
/// written (checked first), then the node restarted with them.
async fn resize(
    config: &ClusterConfig,
    run_directory: &Path,
    node: u32,
    sizes: rdkv_cluster_config::resize::NewSizes<'_>,
    force: bool,
) -> anyhow::Result<u8> {
    if let Some(code) = stop_refusal(config, Some(node), force).await {
        return Ok(code);
    }
    let (resized, said) = rdkv_cluster_config::resize::write_sizes(config, node, sizes)?;
    say(&said);
    restart(&resized, run_directory, node, true).await
}

/// `status`: the nodes' table, the view, membership changes, refills and losses; exit 4 when
/// a loss is on record, else the status's own code.
async fn print_status(config: &ClusterConfig) -> anyhow::Result<u8> {
    let statuses = status::status(config).await;
    say(&status::status_table(&statuses));
    let view = status::view(&statuses);
    say(&status::view_line(view, &statuses));
    for line in status::membership_lines(view, &statuses) {
        say(&line);
    }
    for line in status::refill_lines(view, &statuses) {
        say(&line);
    }
    for line in status::rereplication_lines(view, &statuses) {
        say(&line);
    }
    let losses = status::loss_lines(view);
    for line in &losses {
        say(line);
    }
    match status::exit_code(&statuses) {
        0 if !losses.is_empty() => Ok(4),
        code => Ok(code),
    }
}

/// Why `up` refuses `RDKV_FROM_SNAPSHOT` (which its nodes read): a value the server does not
/// know (its own error would be lost behind clap's last line), or a choice other than
/// `latest` for more than one node, which sets every node's good snapshot aside (it is meant
/// for the one whose snapshot is damaged: `--node N`).
fn snapshot_choice_refusal(
    config: &ClusterConfig,
    node: Option<u32>,
    file: &Path,
) -> Option<String> {
    let choice = std::env::var("RDKV_FROM_SNAPSHOT").ok()?;
    if !["latest", "previous", "empty"].contains(&choice.as_str()) {
        return Some(format!(
            "RDKV_FROM_SNAPSHOT={choice}: not a choice; use latest, previous (the node's snapshot before its latest) or empty"
        ));
    }
    (choice != "latest" && node.is_none() && config.nodes.len() > 1).then(|| {
        format!(
            "RDKV_FROM_SNAPSHOT={choice} would set aside every node's latest snapshot: it is for the node whose snapshot is damaged; run `RDKV_FROM_SNAPSHOT={choice} rdkv-cluster up {} --node N` for that node, and `up` the others without it",
            file.display()
        )
    })
}

/// `up`: starts the nodes (Ctrl-C during start-up stops those started), then [`up`].
async fn start(
    config: &ClusterConfig,
    run_directory: &Path,
    detach: bool,
    node: Option<u32>,
    file: &Path,
    run_dir_flag: &str,
) -> anyhow::Result<u8> {
    if let Some(refusal) = snapshot_choice_refusal(config, node, file) {
        eprintln!("rdkv-cluster: error: {refusal}");
        return Ok(1);
    }
    if node.is_some() {
        if let Some(refusal) = membership::not_a_member(config, run_directory, node).await {
            eprintln!("rdkv-cluster: error: {refusal}");
            return Ok(1);
        }
    }
    // Listen for Ctrl-C from the start: one during start-up stops the nodes started.
    let mut signal = tokio::spawn(rdkv_common::process::shutdown_signal());
    let starting = {
        let (config, run_directory) = (config.clone(), run_directory.to_path_buf());
        tokio::task::spawn_blocking(move || {
            launcher::start_nodes(&config, &run_directory, detach, node)
        })
    };
    let mut nodes = starting.await.context("the start-up task")??;
    if signal.is_finished() {
        stop_all(config, &mut nodes, run_directory).await;
        anyhow::bail!("interrupted during start-up: the nodes started were stopped again");
    }
    up(
        config,
        nodes,
        run_directory,
        detach,
        file,
        run_dir_flag,
        &mut signal,
    )
    .await
}

/// `snapshot`: asks each node to write a snapshot now; a line per node.
async fn snapshot(config: &ClusterConfig, only: Option<u32>) -> anyhow::Result<u8> {
    // A snapshot writes at most 64 MiB/s: ten minutes cover a 37 GiB table.
    const SNAPSHOT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);
    let mut code = 0;
    for node in launcher::select(config, only)? {
        let monitored = rdkv_common::protocol::MonitoredNode {
            address: node.control_address,
            id: Some(node.id),
            secret: &config.secret,
        };
        match rdkv_common::protocol::request_snapshot(monitored, SNAPSHOT_TIMEOUT).await {
            Ok(report) => say(&format!(
                "node {}: snapshot {}: {} key{}, {}, {:.2} s",
                node.id,
                report.path,
                report.keys,
                if report.keys == 1 { "" } else { "s" },
                rdkv_cluster_file::units::format_bytes(report.bytes),
                report.took_ms as f64 / 1000.0
            )),
            Err(error) => {
                code = 1;
                eprintln!(
                    "rdkv-cluster: error: node {}: no snapshot: {error}{}",
                    node.id,
                    if matches!(&error, rdkv_common::ControlError::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused)
                    {
                        format!(
                            " (the node is not running: `rdkv-cluster up FILE --node {}` starts it)",
                            node.id
                        )
                    } else {
                        String::new()
                    }
                );
            }
        }
    }
    Ok(code)
}

/// `ack-loss`: clears the view's loss records up to `epoch` (default: the newest shown now).
async fn acknowledge_losses(config: &ClusterConfig, epoch: Option<u64>) -> anyhow::Result<u8> {
    let statuses = status::status(config).await;
    let shown = status::view(&statuses).map(|view| view.losses.clone());
    let Some(shown) = shown else {
        eprintln!(
            "rdkv-cluster: error: no node answered, so nothing was acknowledged (is the cluster up? `rdkv-cluster status FILE`)"
        );
        return Ok(1);
    };
    let Some(up_to_epoch) = epoch.or_else(|| shown.iter().map(|loss| loss.epoch).max()) else {
        say("no loss recorded: nothing to acknowledge");
        return Ok(0);
    };
    let mut last_error = String::from("no node answered");
    for node in &config.nodes {
        let monitored = rdkv_common::protocol::MonitoredNode {
            address: node.control_address,
            id: Some(node.id),
            secret: &config.secret,
        };
        let timeout = config.failure_timeout + std::time::Duration::from_secs(2);
        match rdkv_common::protocol::request_loss_acknowledgement(monitored, up_to_epoch, timeout)
            .await
        {
            Ok(_) => {
                for loss in shown.iter().filter(|loss| loss.epoch <= up_to_epoch) {
                    say(&format!("acknowledged: {loss}"));
                }
                return Ok(0);
            }
            Err(error) => last_error = format!("node {}: {error}", node.id),
        }
    }
    eprintln!("rdkv-cluster: error: the acknowledgement was not committed: {last_error}; try again (`rdkv-cluster status FILE` shows the view)");
    Ok(1)
}

/// `restart`: stops one node and starts it again in the background.
async fn restart(
    config: &ClusterConfig,
    run_directory: &Path,
    node: u32,
    wait: bool,
) -> anyhow::Result<u8> {
    if let Some(refusal) = membership::not_a_member(config, run_directory, Some(node)).await {
        eprintln!("rdkv-cluster: error: {refusal}");
        return Ok(1);
    }
    let line = launcher::stop(config, run_directory, Some(node)).await?;
    say(&line.join("\n"));
    // A node found not running (killed, crashed) wrote no final snapshot.
    let was_running = !line.iter().any(|line| line.contains("already stopped"));
    let started = launcher::start_nodes(config, run_directory, true, Some(node))?;
    for started in &started {
        let keys = if config.replicas >= 2 {
            "it rejoins the view and is refilled from its peers before it serves (`status` shows the refill)"
        } else if was_running {
            "it loads the snapshot it wrote as it stopped, and copies what other nodes took for it meanwhile, before it serves"
        } else {
            "it was not running, so it wrote no final snapshot: it loads its last one (the writes it took since are lost; `status` shows the loss), and copies what other nodes took for it meanwhile, before it serves"
        };
        say(&format!(
            "node {}: started (pid {}{}); {keys}",
            started.ready.id,
            started.ready.pid,
            started
                .ready
                .host
                .as_ref()
                .map(|host| format!(" on {host}"))
                .unwrap_or_default()
        ));
    }
    if !wait {
        return Ok(0);
    }
    // A rolling restart must not stop the next node before this one holds its keys again: it
    // waits until the view has it serving.
    match status::wait_member_serving(config, node, status::REFILL_WAIT, say).await {
        Ok(()) => {
            say(&format!("node {node}: serving again"));
            Ok(0)
        }
        Err(last) => {
            say(&format!(
                "node {node}: not serving after {:?} ({last}); `status` shows its refill",
                status::REFILL_WAIT
            ));
            Ok(1)
        }
    }
}

/// `systemd`: prints the unit that runs `node`.
fn print_systemd_unit(
    config: &ClusterConfig,
    node: u32,
    binary: Option<PathBuf>,
    credential: Option<PathBuf>,
    file: &Path,
) -> anyhow::Result<u8> {
    let node = launcher::select(config, Some(node))?[0];
    let binary = match binary {
        Some(binary) => binary,
        None => launcher::server_binary()?,
    };
    let absolute = |path: &Path| {
        std::fs::canonicalize(path).with_context(|| format!("resolve {}", path.display()))
    };
    let credential =
        credential.unwrap_or_else(|| PathBuf::from(format!("/etc/rdkv/{}.secret", config.name)));
    rdkv_common::out!(
        "{}",
        systemd::unit(
            config,
            node,
            &absolute(&binary)?,
            &absolute(file)?,
            &credential
        )
    );
    Ok(0)
}

/// `up`: the table of started nodes, then (in the foreground) their logs until a signal.
async fn up(
    config: &ClusterConfig,
    nodes: Vec<launcher::StartedNode>,
    run_directory: &Path,
    detach: bool,
    file: &Path,
    run_dir_flag: &str,
    signal: &mut tokio::task::JoinHandle<()>,
) -> anyhow::Result<u8> {
    let rows: Vec<Vec<String>> = nodes
        .iter()
        .map(|node| {
            let field = |name: &str| {
                node.ready
                    .ready_line
                    .split_whitespace()
                    .find_map(|part| part.strip_prefix(name))
                    .unwrap_or("-")
                    .to_string()
            };
            vec![
                node.ready.id.to_string(),
                node.ready.host.clone().unwrap_or_else(|| "local".into()),
                node.ready.pid.to_string(),
                field("control="),
                field("fabric="),
                field("metrics="),
                "ready".into(),
            ]
        })
        .collect();
    // The nodes serve data once they agree on the view and hold their leases (about a
    // second for a new cluster). One node started alone (`--node N`) may be waiting for the
    // others: `status` shows it.
    let ids: Vec<u32> = nodes.iter().map(|node| node.ready.id).collect();
    let not_serving = if ids.len() == config.nodes.len() {
        status::wait_serving(config, &ids, status::SERVING_TIMEOUT, &|line| say(line)).await
    } else {
        Vec::new()
    };
    for (id, reason) in &not_serving {
        say(&format!(
            "warning: node {id} does not serve data yet: {reason}; see `rdkv-cluster status {}{run_dir_flag}` and its log",
            file.display()
        ));
    }
    say(&format!(
        "cluster `{}` is up ({} of {} nodes started, fabric {}):",
        config.name,
        nodes.len(),
        config.nodes.len(),
        config.fabric
    ));
    say(&status::table(
        &[
            "node", "host", "pid", "control", "fabric", "metrics", "state",
        ],
        &rows,
    ));
    // After a crash of every node (or of a key's every copy), the view's loss records: what
    // `status` shows, said here too.
    if ids.len() == config.nodes.len() {
        let statuses = status::status(config).await;
        for line in status::loss_lines(status::view(&statuses)) {
            say(&line);
        }
    }
    if detach {
        say(&format!(
            "detached; logs and pid files in {}. Stop with `rdkv-cluster down {}{run_dir_flag}`.",
            run_directory.display(),
            file.display()
        ));
        return Ok(if not_serving.is_empty() { 0 } else { 1 });
    }
    foreground(config, nodes, run_directory, file, run_dir_flag, signal).await;
    Ok(0)
}

/// The foreground half of `up`: the nodes' logs and what becomes of them, until a signal;
/// then the nodes stopped in order.
async fn foreground(
    config: &ClusterConfig,
    mut nodes: Vec<launcher::StartedNode>,
    run_directory: &Path,
    file: &Path,
    run_dir_flag: &str,
    signal: &mut tokio::task::JoinHandle<()>,
) {
    say("forwarding node logs; Ctrl-C stops the cluster");
    for node in &nodes {
        if let Some(host) = &node.ready.host {
            say(&format!(
                "node {} runs on {host}: `rdkv-cluster logs {} --node {}{run_dir_flag}` shows its log",
                node.ready.id,
                file.display(),
                node.ready.id
            ));
        }
    }
    // Until Ctrl-C: a node that exits gets a line (and is reaped); one that another command
    // starts again has its log followed here.
    let restart_command = |id: u32| {
        format!(
            "`rdkv-cluster restart {}{run_dir_flag} --node {id}` starts it again",
            file.display()
        )
    };
    let _ = rdkv_cluster_config::foreground::report_until(
        &mut nodes,
        run_directory,
        restart_command,
        signal,
    )
    .await;
    say("stopping the cluster");
    stop_all(config, &mut nodes, run_directory).await;
}

/// Stops the nodes this launcher started, in order, saying so: the cluster's view first, as
/// `down` does, so that each node's final snapshot holds every acknowledged write and `up`
/// resumes from them (stopped one by one, each node's keys would move to the others, and the
/// last ones would be refilled from nothing).
async fn stop_all(
    config: &ClusterConfig,
    nodes: &mut [launcher::StartedNode],
    run_directory: &Path,
) {
    // Only when this launcher runs the whole cluster: `up --node N` stops its node alone.
    let whole_cluster = nodes.len() == config.nodes.len();
    if whole_cluster && nodes.iter().any(|node| node.child.is_some()) {
        match launcher::stop_the_view(config).await {
            Ok(line) => say(&line),
            Err(warning) => eprintln!("rdkv-cluster: {warning}"),
        }
    }
    for node in nodes {
        if node.child.is_some() {
            if launcher::stop_child(node, run_directory) {
                say(&format!("node {}: stopped", node.ready.id));
            } else {
                say(&format!("node {}: had already exited", node.ready.id));
            }
            // A `restart --node` from another shell replaced this child: stop the new one too.
            if let Some(node_config) = config.node(node.ready.id) {
                if !launcher::running_nodes(&[node_config], run_directory).is_empty() {
                    match launcher::stop_node(config, node_config, run_directory).await {
                        Ok(_) => say(&format!(
                            "node {}: stopped its restarted process",
                            node.ready.id
                        )),
                        Err(error) => say(&format!("node {}: {error:#}", node.ready.id)),
                    }
                }
            }
        } else if let Some(node_config) = config.node(node.ready.id) {
            match launcher::stop_node(config, node_config, run_directory).await {
                Ok(_) => say(&format!("node {}: stopped", node.ready.id)),
                Err(error) => say(&format!("node {}: {error:#}", node.ready.id)),
            }
        }
    }
}
