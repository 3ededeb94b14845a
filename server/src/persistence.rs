//! Persistence: the node's snapshots written (every `snapshot_interval`, on request, and at a
//! clean shutdown once its clients are fenced) and loaded back before it serves
//! (`docs/operations.md`, *Persistence*). The file format is `crate::snapshot::file`; reading
//! the live table safely is `crate::snapshot::table_io`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkv_common::protocol::ServerMessage;
use tokio_util::sync::CancellationToken;

use crate::config::StartFrom;
use crate::error::{Error, Result};
use crate::heap::Heap;
use crate::node::Node;
use crate::snapshot::file::{
    read_snapshot, verify_snapshot, LoadedSnapshot, SnapshotMeta, SnapshotWriter, WrittenSnapshot,
    PREVIOUS_FILE, REPLACED_FILE, SNAPSHOT_FILE,
};
use crate::snapshot::table_io::{scan_table, Loader};
use crate::snapshot::LastSnapshot;
use crate::table::TableRegion;

/// The most bytes a second a snapshot writes: the scan sleeps to keep to it, so a snapshot
/// takes at most about half a core and leaves the disk to others (100,000 × 1 KB, about
/// 110 MB, takes about 2 s).
pub const SNAPSHOT_BYTES_PER_SECOND: u64 = 64 << 20;

/// How often the pace is checked, in bytes written.
const PACE_STEP: u64 = 1 << 20;

/// Why a snapshot is written, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// `snapshot_interval` passed.
    Interval,
    /// `rdkv-cluster snapshot`.
    Requested,
    /// A clean shutdown, after every connection of the node was torn down.
    Shutdown,
    /// A shutdown whose teardowns passed their bound: a write may be missing, so it names no
    /// cluster stop.
    ShutdownUnfenced,
}

impl std::fmt::Display for Reason {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(match self {
            Reason::Interval => "interval",
            Reason::Requested => "requested",
            Reason::Shutdown => "shutdown",
            Reason::ShutdownUnfenced => "shutdown, teardowns unfinished",
        })
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}

/// Writes a snapshot of the node's table now (blocking: run it on a blocking thread), one at a
/// time. `Ok(None)` when the node has no data directory.
///
/// # Errors
/// [`Error::Snapshot`] when it cannot be written: the previous snapshot is left as it was.
pub(crate) fn take_snapshot(node: &Node, reason: Reason) -> Result<Option<WrittenSnapshot>> {
    let state = &node.snapshots;
    let Some(data_dir) = state.data_dir.as_deref() else {
        return Ok(None);
    };
    let _one_at_a_time = rdkv_fabric::lock(&state.writing);
    let started = Instant::now();
    let mut meta = SnapshotMeta {
        cluster: node
            .config
            .cluster
            .as_ref()
            .map(|cluster| cluster.name.clone())
            .unwrap_or_default(),
        node_id: node.config.node_id,
        view_epoch: node.view.epoch(),
        // Only a snapshot written once every connection is torn down holds every write the
        // node acknowledged before the stop.
        stopped_at: (reason == Reason::Shutdown)
            .then(|| node.view.stopped_at())
            .flatten(),
        created_unix_ms: unix_ms(),
        // Only a final snapshot, every connection torn down, of a node that stopped serving
        // while the view had it serving holds every acknowledged write up to that epoch.
        fenced_at: (reason == Reason::Shutdown)
            .then(|| node.view.stopped_serving_at())
            .flatten(),
        replicas: node
            .config
            .cluster
            .as_ref()
            .and_then(|cluster| u32::try_from(cluster.replicas).ok()),
    };
    if let Some(loaded) = state.carried() {
        // The table holds exactly what this node loaded (it has served nothing since): the new
        // file holds the same copies, and says what the loaded one said of them (or when this
        // process stopped serving, later).
        meta.view_epoch = loaded.view_epoch;
        meta.fenced_at = meta.fenced_at.or(loaded.fenced_at);
        meta.created_unix_ms = loaded.created_unix_ms;
    }
    let shutting_down = matches!(reason, Reason::Shutdown | Reason::ShutdownUnfenced);
    // A shutdown's snapshot runs at disk speed (no client is left to share the machine with);
    // the others keep to the pace and give way to it.
    let pace = (!shutting_down).then_some(&state.stopping);
    let outcome = write_paced(node.table(), data_dir, &meta, pace);
    match outcome {
        Ok(None) => {
            tracing::info!(node = node.config.node_id, %reason, "snapshot abandoned: the node is stopping, and writes its final one");
            Ok(None)
        }
        Ok(Some(written)) => {
            state.succeeded(LastSnapshot {
                finished_unix_ms: unix_ms(),
                duration: started.elapsed(),
                bytes: written.bytes,
                keys: written.keys,
            });
            tracing::info!(
                node = node.config.node_id,
                %reason,
                keys = written.keys,
                bytes = written.bytes,
                took = ?started.elapsed(),
                stopped_at = ?meta.stopped_at,
                fenced_at = ?meta.fenced_at.map(|fence| fence.epoch),
                file = %written.path.display(),
                "snapshot written"
            );
            Ok(Some(written))
        }
        Err(error) => {
            state.failed(error.to_string());
            let next = if shutting_down {
                "the node stops, and the writes since that snapshot are lost unless its copies elsewhere hold them; free space in data_dir before the next stop"
            } else {
                "the node keeps serving; free space in data_dir, then `rdkv-cluster snapshot FILE`"
            };
            tracing::warn!(
                node = node.config.node_id,
                %reason,
                %error,
                "snapshot failed: the previous one is kept; {next}"
            );
            Err(error)
        }
    }
}

/// Scans `table` into a new snapshot in `data_dir`; with `pace`, at most
/// [`SNAPSHOT_BYTES_PER_SECOND`], and abandoned (`Ok(None)`, the previous snapshot kept) once
/// `pace` is set (the node is stopping).
fn write_paced(
    table: &TableRegion,
    data_dir: &Path,
    meta: &SnapshotMeta,
    pace: Option<&AtomicBool>,
) -> Result<Option<WrittenSnapshot>> {
    let mut writer = SnapshotWriter::create(data_dir, meta)?;
    let started = Instant::now();
    let mut next_check = PACE_STEP;
    let mut abandoned = false;
    let counts = scan_table(table, |key, value, version| {
        writer.append(key, value, version)?;
        let Some(stopping) = pace else {
            return Ok(());
        };
        let written = writer.bytes_written();
        if written >= next_check {
            next_check = written + PACE_STEP;
            if stopping.load(Ordering::Acquire) {
                abandoned = true;
                return Err(Error::Snapshot {
                    path: data_dir.to_path_buf(),
                    reason: "abandoned".into(),
                });
            }
            let due = Duration::from_secs_f64(written as f64 / SNAPSHOT_BYTES_PER_SECOND as f64);
            if let Some(ahead) = due.checked_sub(started.elapsed()) {
                std::thread::sleep(ahead);
            }
        }
        Ok::<(), Error>(())
    });
    match counts {
        // Dropping the writer removes its temporary file.
        Err(_) if abandoned => Ok(None),
        Err(error) => Err(error),
        Ok(counts) => {
            if counts.skipped > 0 {
                tracing::warn!(
                    skipped = counts.skipped,
                    "snapshot: keys whose slot changed on every read are not in it (written thousands of times a second); the next snapshot takes them"
                );
            }
            writer.finish().map(Some)
        }
    }
}

/// Writes a snapshot every `interval` of the node's [`crate::snapshot::SnapshotState`] until
/// `shutdown` (the shutdown's own snapshot is [`final_snapshot`]'s).
pub(crate) async fn snapshot_loop(node: Arc<Node>, shutdown: CancellationToken) {
    let interval = node.snapshots.interval;
    if node.snapshots.data_dir.is_none() || interval.is_zero() {
        return;
    }
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let writing = node.clone();
        let gate = node.gate.enter("snapshot".into());
        gate.step("writing a snapshot");
        let _ = tokio::task::spawn_blocking(move || {
            let _gate = gate;
            take_snapshot(&writing, Reason::Interval)
        })
        .await;
    }
}

/// The snapshot a shutdown writes once the node serves nothing: `complete` when every
/// connection was torn down (then every write it acknowledged is in it, and it names the
/// cluster's stop, if any). Logged; a failure is kept in the node's snapshot state.
pub(crate) async fn final_snapshot(node: &Arc<Node>, complete: bool) {
    let writing = node.clone();
    let reason = if complete {
        Reason::Shutdown
    } else {
        Reason::ShutdownUnfenced
    };
    let _ = tokio::task::spawn_blocking(move || take_snapshot(&writing, reason)).await;
}

/// A snapshot written because a client asked (`rdkv-cluster snapshot`): the answer to send.
pub(crate) async fn snapshot_on_request(node: &Arc<Node>) -> ServerMessage {
    let node_id = node.config.node_id;
    if node.snapshots.data_dir.is_none() {
        return ServerMessage::Refused {
            reason: format!("node {node_id} has no data directory: start it with --data-dir (rdkv-cluster gives every node one)"),
        };
    }
    let started = Instant::now();
    let writing = node.clone();
    let outcome =
        tokio::task::spawn_blocking(move || take_snapshot(&writing, Reason::Requested)).await;
    match outcome {
        Ok(Ok(Some(written))) => ServerMessage::SnapshotWritten {
            node_id,
            path: written.path.display().to_string(),
            keys: written.keys,
            bytes: written.bytes,
            took_ms: started.elapsed().as_millis() as u64,
        },
        Ok(Ok(None)) => ServerMessage::Refused {
            reason: format!(
                "node {node_id} wrote no snapshot: it is stopping, and writes its final one"
            ),
        },
        Ok(Err(error)) => ServerMessage::Refused {
            reason: error.to_string(),
        },
        Err(error) => ServerMessage::Refused {
            reason: format!("the snapshot task failed: {error}"),
        },
    }
}

/// The snapshot a node starts from, checked whole: `Ok(None)` when there is none to load (no
/// data directory, no file, or `StartFrom::Empty`).
///
/// # Errors
/// [`Error::Snapshot`] when the file is damaged, of another node, or of another format: one
/// line naming the file and the choices.
pub fn snapshot_to_load(
    data_dir: Option<&Path>,
    start_from: StartFrom,
    node_id: u32,
    cluster: &str,
    cluster_file: Option<&Path>,
) -> Result<Option<(PathBuf, LoadedSnapshot)>> {
    let Some(data_dir) = data_dir else {
        return Ok(None);
    };
    let path = match start_from {
        StartFrom::Empty => return Ok(None),
        StartFrom::Latest => data_dir.join(SNAPSHOT_FILE),
        StartFrom::Previous => data_dir.join(PREVIOUS_FILE),
    };
    if !path.exists() {
        if start_from == StartFrom::Previous {
            return Err(Error::Snapshot {
                path,
                reason: format!(
                    "no previous snapshot to start from: start the node without RDKV_FROM_SNAPSHOT if {} loads, or empty with RDKV_FROM_SNAPSHOT=empty (rdkv-server --from-snapshot empty; with replicas ≥ 2 its peers refill it)",
                    data_dir.join(SNAPSHOT_FILE).display()
                ),
            });
        }
        return Ok(None);
    }
    let loaded = verify_snapshot(&path)
        .map_err(|error| with_choices(error, start_from, node_id, cluster_file))?;
    if loaded.meta.node_id != node_id {
        return Err(Error::Snapshot {
            path,
            reason: format!(
                "written by node {}, not node {node_id}: check data_dir in the cluster file",
                loaded.meta.node_id
            ),
        });
    }
    if !cluster.is_empty() && !loaded.meta.cluster.is_empty() && loaded.meta.cluster != cluster {
        return Err(Error::Snapshot {
            path,
            reason: format!(
                "written by a node of cluster `{}`, not `{cluster}`: check data_dir in the cluster file",
                loaded.meta.cluster
            ),
        });
    }
    Ok(Some((path, loaded)))
}

/// A damaged snapshot's error, with what the operator may do: `up` names the cluster file and
/// the node (`rdkv-cluster up FILE --node N`), the server's own flag otherwise.
fn with_choices(
    error: Error,
    start_from: StartFrom,
    node_id: u32,
    cluster_file: Option<&Path>,
) -> Error {
    let Error::Snapshot { path, reason } = error else {
        return error;
    };
    let command = |choice: &str| {
        match cluster_file {
        Some(file) => format!(
            "`RDKV_FROM_SNAPSHOT={choice} rdkv-cluster up {} --node {node_id}` (with this `up`'s --run-dir and --detach)",
            file.display()
        ),
        None => format!("`rdkv-server --from-snapshot {choice}`"),
    }
    };
    // `previous` only where there is one (a node stopped once has none).
    let previous_exists = path
        .parent()
        .is_some_and(|directory| directory.join(PREVIOUS_FILE).exists());
    let choices = if start_from == StartFrom::Latest && previous_exists {
        format!(
            "start the node from its previous snapshot with {} (its peers refill what that lacks), or empty with {}",
            command("previous"),
            command("empty")
        )
    } else {
        format!("start the node empty with {}", command("empty"))
    };
    Error::Snapshot {
        path,
        reason: format!("{reason}; {choices}"),
    }
}

/// Starting from the previous snapshot (or none) replaces the latest: it is kept as
/// `snapshot.replaced.rdkv`, and the previous one becomes the latest, so that a restart before
/// the node's next snapshot starts from the same one, not from the file it was told to skip.
fn replace_latest(data_dir: &Path, start_from: StartFrom) -> Result<()> {
    let latest = data_dir.join(SNAPSHOT_FILE);
    if start_from == StartFrom::Latest || !latest.exists() {
        return Ok(());
    }
    let step = |what: &str, outcome: std::io::Result<()>| {
        outcome.map_err(|error| Error::Snapshot {
            path: latest.clone(),
            reason: format!("{what}: {error}"),
        })
    };
    step(
        "keep it as snapshot.replaced.rdkv",
        std::fs::rename(&latest, data_dir.join(REPLACED_FILE)),
    )?;
    if start_from == StartFrom::Previous {
        step(
            "make the previous snapshot the latest",
            std::fs::hard_link(data_dir.join(PREVIOUS_FILE), &latest),
        )?;
    }
    tracing::warn!(file = %latest.display(), ?start_from, "the latest snapshot is set aside as snapshot.replaced.rdkv");
    Ok(())
}

/// What a node loaded at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    /// Keys loaded.
    pub keys: u64,
    /// The snapshot's header (the cluster stop it was written at, when its node stopped
    /// serving, ...).
    pub meta: SnapshotMeta,
}

/// Checks the node's snapshot whole and loads it into the empty table and heap; `None` when
/// there is none to load.
///
/// # Errors
/// As [`snapshot_to_load`] and [`load_snapshot`].
pub fn start_from_snapshot(
    config: &crate::config::ServerConfig,
    table: &TableRegion,
    heap: &Heap,
) -> Result<Option<Loaded>> {
    let cluster = config
        .cluster
        .as_ref()
        .map(|cluster| cluster.name.as_str())
        .unwrap_or_default();
    let cluster_file = config
        .cluster
        .as_ref()
        .map(|cluster| cluster.path.as_path());
    let Some((path, checked)) = snapshot_to_load(
        config.data_dir.as_deref(),
        config.start_from,
        config.node_id,
        cluster,
        cluster_file,
    )?
    else {
        if let Some(data_dir) = config.data_dir.as_deref() {
            replace_latest(data_dir, config.start_from)?;
        }
        return Ok(None);
    };
    refuse_more_copies_than_written(config, &path, &checked.meta)?;
    let keys = load_snapshot(&path, table, heap)?;
    if let Some(data_dir) = config.data_dir.as_deref() {
        replace_latest(data_dir, config.start_from)?;
    }
    Ok(Some(Loaded {
        keys,
        meta: checked.meta,
    }))
}

/// Refuses to resume from a stop's snapshot written with fewer copies of each key than the
/// cluster file now asks for: the resumed nodes would serve with the copies of then, nothing
/// would make the others, and a node's crash would lose keys with no record of it.
///
/// # Errors
/// [`Error::Snapshot`], naming the setting and the choices.
fn refuse_more_copies_than_written(
    config: &crate::config::ServerConfig,
    path: &Path,
    meta: &SnapshotMeta,
) -> Result<()> {
    let now = config
        .cluster
        .as_ref()
        .map_or(1, |cluster| cluster.replicas);
    match meta.replicas {
        Some(written) if meta.stopped_at.is_some() && (written as usize) < now => {
            Err(Error::Snapshot {
                path: path.to_path_buf(),
                reason: format!(
                    "written at the cluster's stop with replicas = {written}, and the cluster file now says replicas = {now}: raising replicas across a stop is not supported yet (the nodes would resume with {written} cop{} of each key, nothing would make the others, and a node's crash would lose keys); put replicas = {written} back in the file (docs/operations.md, Persistence)",
                    if written == 1 { "y" } else { "ies" }
                ),
            })
        }
        _ => Ok(()),
    }
}

/// Loads the checked snapshot at `path` into the empty table; the keys loaded.
///
/// # Errors
/// [`Error::Snapshot`]: the file changed since it was checked, or the table cannot hold it
/// (the message names the setting to raise).
pub fn load_snapshot(path: &Path, table: &TableRegion, heap: &Heap) -> Result<u64> {
    let started = Instant::now();
    let mut loader = Loader::new(table, heap);
    let mut failure = None;
    let loaded = read_snapshot(path, |key, value, version| {
        if failure.is_none() {
            if let Err(reason) = loader.insert(key, value, version) {
                failure = Some(reason);
            }
        }
    })?;
    if let Some(reason) = failure {
        return Err(Error::Snapshot {
            path: path.to_path_buf(),
            reason,
        });
    }
    let keys = loader.finish();
    tracing::info!(
        file = %path.display(),
        keys,
        bytes = loaded.bytes,
        written_at_ms = loaded.meta.created_unix_ms,
        stopped_at = ?loaded.meta.stopped_at,
        fenced_at = ?loaded.meta.fenced_at.map(|fence| fence.epoch),
        took = ?started.elapsed(),
        "snapshot loaded"
    );
    Ok(keys)
}
