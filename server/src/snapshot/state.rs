//! What a node knows of its snapshots: where they go, how often, the last one written, and
//! the failures; the figures `rdkv stats`, `rdkv-cluster status` and the metrics show.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rdkv_fabric::lock;

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
    /// The view epoch of the snapshot loaded at start (0: none loaded).
    pub(crate) loaded_epoch: AtomicU64,
    /// The epoch at which the node that wrote the loaded snapshot stopped serving (0: not a
    /// final snapshot of a node the view had serving; `crate::snapshot::file`).
    pub(crate) loaded_fenced_at: AtomicU64,
    /// When the loaded snapshot's writing began, in milliseconds since the Unix epoch.
    pub(crate) loaded_created_unix_ms: AtomicU64,
    /// Whether the table still holds only what was loaded and what a whole-cluster start's
    /// reconciliation took: no data connection was admitted outside a reconciliation and no
    /// refill ran. While it does, the loaded snapshot's epochs describe it (`crate::reconcile`).
    loaded_untouched: AtomicBool,
    /// Whether the table holds exactly what was loaded: untouched, and the reconciliation
    /// changed nothing. A snapshot written meanwhile carries the loaded one's epochs.
    loaded_unchanged: AtomicBool,
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

    /// Records what the node loaded at start.
    pub(crate) fn record_loaded(&self, loaded: &crate::persistence::Loaded) {
        self.loaded_untouched.store(true, Ordering::Release);
        self.loaded_unchanged.store(true, Ordering::Release);
        self.loaded_keys.store(loaded.keys, Ordering::Relaxed);
        self.loaded_epoch
            .store(loaded.view_epoch, Ordering::Relaxed);
        self.loaded_fenced_at
            .store(loaded.fenced_at.unwrap_or(0), Ordering::Relaxed);
        self.loaded_created_unix_ms
            .store(loaded.created_unix_ms, Ordering::Relaxed);
    }

    /// The table may have changed by a client's write or a refill: the loaded snapshot no
    /// longer describes it.
    pub(crate) fn table_touched(&self) {
        self.loaded_untouched.store(false, Ordering::Release);
        self.loaded_unchanged.store(false, Ordering::Release);
    }

    /// A reconciliation took or removed copies: a snapshot written from now on is not the
    /// loaded one.
    pub(crate) fn table_reconciled(&self) {
        self.loaded_unchanged.store(false, Ordering::Release);
    }

    /// What the loaded snapshot says of the table, while it still describes it: its view
    /// epoch, the epoch its node stopped serving at (0: none) and when it was written. All 0
    /// once the table was touched: it then decides over no copy and none decides over it.
    pub fn loaded_provenance(&self) -> (u64, u64, u64) {
        if !self.loaded_untouched.load(Ordering::Acquire) {
            return (0, 0, 0);
        }
        (
            self.loaded_epoch.load(Ordering::Relaxed),
            self.loaded_fenced_at.load(Ordering::Relaxed),
            self.loaded_created_unix_ms.load(Ordering::Relaxed),
        )
    }

    /// The loaded snapshot's view epoch, stop epoch and writing time, while the table holds
    /// exactly what it loaded and that snapshot had a stop epoch: a snapshot written now holds
    /// the same copies, and says the same of them.
    pub(crate) fn carried_provenance(&self) -> Option<(u64, u64, u64)> {
        let fenced_at = self.loaded_fenced_at.load(Ordering::Relaxed);
        (self.loaded_unchanged.load(Ordering::Acquire) && fenced_at != 0).then(|| {
            (
                self.loaded_epoch.load(Ordering::Relaxed),
                fenced_at,
                self.loaded_created_unix_ms.load(Ordering::Relaxed),
            )
        })
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
