//! What a node knows of its snapshots: where they go, how often, the last one written, and
//! the failures; the figures `rdkv stats`, `rdkv-cluster status` and the metrics show.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rdkv_fabric::lock;

use crate::snapshot::file::{Fence, SnapshotMeta};

/// The snapshot a node wrote last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastSnapshot {
    /// When it was complete, in milliseconds since the Unix epoch.
    pub finished_unix_ms: u64,
    /// How long writing it took.
    pub duration: Duration,
    /// The file's bytes.
    pub bytes: u64,
    /// The keys in it.
    pub keys: u64,
}

/// A node's snapshots.
#[derive(Debug, Default)]
pub struct SnapshotState {
    /// Where they are written; `None`: nowhere (a node started without a data directory).
    pub data_dir: Option<PathBuf>,
    /// How often one is written; zero: only on request and at a clean shutdown.
    pub interval: Duration,
    /// Held while one is written: one at a time.
    pub(crate) writing: Mutex<()>,
    last: Mutex<Option<LastSnapshot>>,
    last_failure: Mutex<Option<String>>,
    written: AtomicU64,
    failed: AtomicU64,
    /// Keys loaded from a snapshot at start.
    pub(crate) loaded_keys: AtomicU64,
    /// The header of the snapshot loaded at start, if any.
    loaded: Mutex<Option<SnapshotMeta>>,
    /// Whether the table still holds only what was loaded and what a whole-cluster start's
    /// reconciliation took: no data connection was admitted outside a reconciliation and no
    /// refill ran. While it does, the loaded snapshot's epochs describe it (`crate::reconcile`).
    loaded_untouched: AtomicBool,
    /// Set when the node stops: a snapshot on a schedule or on request gives way to the final
    /// one.
    pub(crate) stopping: AtomicBool,
}

impl SnapshotState {
    /// Snapshots into `data_dir` every `interval`.
    pub fn new(data_dir: Option<PathBuf>, interval: Duration) -> Self {
        Self {
            data_dir,
            interval,
            ..Self::default()
        }
    }

    /// Records what the node loaded at start. A snapshot written with another `replicas`
    /// than the cluster's now names no stop here: its node was a copy of other keys then, and
    /// its absences say nothing of the keys it is a copy of now (`crate::reconcile`).
    pub(crate) fn record_loaded(&self, keys: u64, mut meta: SnapshotMeta, replicas_now: usize) {
        self.loaded_keys.store(keys, Ordering::Relaxed);
        let same_copies = meta
            .replicas
            .is_some_and(|written| written as usize == replicas_now);
        if !same_copies {
            meta.fenced_at = None;
        }
        *lock(&self.loaded) = Some(meta);
        self.loaded_untouched.store(true, Ordering::Release);
    }

    /// The table may have changed by a client's write or a refill: the loaded snapshot no
    /// longer describes it.
    pub(crate) fn table_touched(&self) {
        self.loaded_untouched.store(false, Ordering::Release);
    }

    /// When the node that wrote the loaded snapshot stopped serving, while that snapshot
    /// still describes the table (`None` once it was touched, or for a snapshot that names no
    /// such stop): the table then decides over no copy, and none decides over it.
    pub fn loaded_fence(&self) -> Option<Fence> {
        if !self.loaded_untouched.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.loaded).as_ref().and_then(|meta| meta.fenced_at)
    }

    /// The loaded snapshot's header, while it still describes the table and names a stop: a
    /// snapshot written now says the same of its copies. A reconciliation's changes keep it
    /// true: a copy taken here is the newest that no other copy decided over, and its own
    /// holder keeps it (a copy nothing decides over is never dropped), so a later start that
    /// drops it here still finds it there; a key removed here was decided absent
    /// (`crate::reconcile`). An interrupted reconciliation therefore leaves a file as good as
    /// the one it started from (a file that named no stop would let its stale copies win).
    pub(crate) fn carried(&self) -> Option<SnapshotMeta> {
        if !self.loaded_untouched.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.loaded)
            .clone()
            .filter(|meta| meta.fenced_at.is_some())
    }

    /// Makes a snapshot on a schedule or on request give way: the node stops, and writes its
    /// final one.
    pub(crate) fn stop_writing(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// Records a snapshot written.
    pub(crate) fn succeeded(&self, snapshot: LastSnapshot) {
        *lock(&self.last) = Some(snapshot);
        *lock(&self.last_failure) = None;
        self.written.fetch_add(1, Ordering::Relaxed);
    }

    /// Records a snapshot that failed, and why.
    pub(crate) fn failed(&self, reason: String) {
        *lock(&self.last_failure) = Some(reason);
        self.failed.fetch_add(1, Ordering::Relaxed);
    }

    /// The last snapshot written by this process.
    pub fn last(&self) -> Option<LastSnapshot> {
        lock(&self.last).clone()
    }

    /// Why the last snapshot failed, while no later one succeeded.
    pub fn last_failure(&self) -> Option<String> {
        lock(&self.last_failure).clone()
    }

    /// Snapshots written, and failed, by this process.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.written.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}
