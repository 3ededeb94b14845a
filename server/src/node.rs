//! The node's state, which every session, the collector, the sweep, the refill and the metrics
//! share: the configuration, the heap, the counters, the announce words, the cluster view, and
//! the fabric **attachments** the node serves on.
//!
//! An attachment is everything the node holds per fabric: the table as registered on that
//! fabric's device (its domain and the device), the announce words registered in that domain,
//! the completion queue of the queue pairs of its clients, and a gauge of its data connections.
//! The first is the node's main fabric (the cluster's); a node that offers shared memory to
//! clients of its host, and whose main fabric does not, has a second on an `shm` device over the
//! same memory. A session keeps the index of the attachment its client came through, and asks
//! the attachment's capabilities (`rdkv_fabric::Capabilities`) where the fabric matters.
//!
//! This module sits in the middle of the crate's dependency order (`lib.rs`): it imports the
//! state it holds, and the tasks that use it (`session`, `collector`, `refill`, `server`)
//! import it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rdkv_common::protocol::ServerStats;
use rdkv_fabric::{Capabilities, CompletionQueue, Device, MemoryRegion};

use crate::announce::Announcements;
use crate::collector_pace::Pace;
use crate::compactor::Compactor;
use crate::config::ServerConfig;
use crate::error::Result;
use crate::gate::Gate;
use crate::heap::Heap;
use crate::log_budget::LogBudget;
use crate::pending::PendingHandshakes;
use crate::stats::Counters;
use crate::sweep::Sweep;
use crate::table::TableRegion;
use crate::view::ViewService;

/// The send queue depth of a server queue pair: the server posts only window binds, one at a
/// time, on it (clients post their one-sided requests on their own queue pairs).
pub(crate) const SEND_QUEUE_DEPTH: u32 = 4;

/// The index of the node's main attachment (the cluster's fabric) in [`Node::attachments`].
pub(crate) const MAIN_ATTACHMENT: usize = 0;

/// One fabric the node serves on.
#[derive(Debug)]
pub(crate) struct Attachment {
    /// The table, registered on this fabric's device (`table.device`), in its domain.
    pub(crate) table: TableRegion,
    /// The announce words, registered in that domain (the main attachment's registration is
    /// the announcements' own).
    pub(crate) announce_region: MemoryRegion,
    /// The completion queue of this attachment's clients' queue pairs (the server posts
    /// nothing on them, but a NIC needs one per queue pair).
    pub(crate) completion_queue: CompletionQueue,
    /// Data connections (with a queue pair) on this attachment now.
    pub(crate) data_connections: AtomicU64,
}

impl Attachment {
    /// The attachment of the table's own device: its announce words are `announcements`'
    /// registration, its completion queue has `completion_queue_size` entries.
    ///
    /// # Errors
    /// The device's, creating the completion queue.
    pub(crate) fn main(
        table: TableRegion,
        announcements: &Announcements,
        completion_queue_size: usize,
    ) -> Result<Self> {
        Ok(Self {
            announce_region: announcements.region().clone(),
            completion_queue: table
                .device
                .create_completion_queue(completion_queue_size)?,
            table,
            data_connections: AtomicU64::new(0),
        })
    }

    /// An attachment on `device` over the same memory as `main`: the table and the announce
    /// words registered on it too (both must have been allocated shareable when `device`
    /// shares memory).
    ///
    /// # Errors
    /// Registration errors, and the device's creating the completion queue.
    pub(crate) fn also_on(
        device: &Device,
        main: &Attachment,
        announcements: &Announcements,
        completion_queue_size: usize,
    ) -> Result<Self> {
        let table = main.table.also_on(device)?;
        Ok(Self {
            announce_region: announcements.register_in(&table.domain)?,
            completion_queue: device.create_completion_queue(completion_queue_size)?,
            table,
            data_connections: AtomicU64::new(0),
        })
    }

    /// The device this attachment's clients' queue pairs live on.
    pub(crate) fn device(&self) -> &Device {
        &self.table.device
    }

    /// What this attachment's provider states about itself.
    pub(crate) fn capabilities(&self) -> Capabilities {
        self.device().capabilities()
    }
}

/// The node's state, which every connection and task shares.
#[derive(Debug)]
pub(crate) struct Node {
    /// The configuration.
    pub(crate) config: ServerConfig,
    /// The fabrics the node serves on: [`MAIN_ATTACHMENT`] first, never empty.
    pub(crate) attachments: Vec<Attachment>,
    /// Heap chunks.
    pub(crate) heap: Heap,
    /// Counters.
    pub(crate) counters: Counters,
    /// The next connection id.
    pub(crate) next_connection: AtomicU64,
    /// Moves live blocks out of sparse chunks.
    pub(crate) compactor: Compactor,
    /// The collector's pace (and what wakes it).
    pub(crate) collector: Pace,
    /// Removes the copies the view no longer names on this node.
    pub(crate) sweep: Sweep,
    /// Each data connection's announce word (what it has in flight).
    pub(crate) announcements: Announcements,
    /// What a shutdown waits for: every connection and collector pass, with its step.
    pub(crate) gate: Arc<Gate>,
    /// Connections that have not authenticated yet.
    pub(crate) pending: PendingHandshakes,
    /// The log lines of unauthenticated connections that ended badly: one a second.
    pub(crate) unauthenticated_ends: LogBudget,
    /// Clients' connections opened and closed, for the summary line a minute.
    pub(crate) connection_summary: crate::connection_summary::ConnectionSummary,
    /// The node's part in the cluster view.
    pub(crate) view: Arc<ViewService>,
    /// Its snapshots (`crate::persistence`).
    pub(crate) snapshots: crate::snapshot::SnapshotState,
}

impl Node {
    /// The snapshot figures of `stats`.
    fn snapshot_figures(&self, stats: &mut ServerStats) {
        let snapshots = &self.snapshots;
        (stats.snapshots_written, stats.snapshots_failed) = snapshots.counts();
        stats.snapshot_failing = snapshots.last_failure().is_some();
        stats.snapshot_keys_loaded = snapshots.loaded_keys.load(Ordering::Relaxed);
        if let Some(fence) = snapshots.loaded_fence() {
            stats.snapshot_loaded_fenced_at = fence.epoch;
            stats.snapshot_loaded_fenced_unix_ms = fence.unix_ms;
        }
        stats.copy_sets_lost = self.view.losses_total();
        if let Some(last) = snapshots.last() {
            stats.last_snapshot_unix_ms = last.finished_unix_ms;
            stats.last_snapshot_duration_ms = last.duration.as_millis() as u64;
            stats.last_snapshot_bytes = last.bytes;
            stats.last_snapshot_keys = last.keys;
        }
    }

    /// The attachment at `index` (a session's), or the main one for an index the node does
    /// not have.
    pub(crate) fn attachment(&self, index: usize) -> &Attachment {
        self.attachments
            .get(index)
            .unwrap_or_else(|| self.main_attachment())
    }

    /// The node's main attachment (the cluster's fabric).
    pub(crate) fn main_attachment(&self) -> &Attachment {
        self.attachments
            .first()
            .expect("a node is built with its main attachment")
    }

    /// The registered table, as the control plane reads and writes it (the memory is the
    /// same on every attachment).
    pub(crate) fn table(&self) -> &TableRegion {
        &self.main_attachment().table
    }

    /// The attachment a client that asks for shared memory gets: one beside the main
    /// fabric whose device shares memory with the node's host, if the node has one. (A node
    /// whose main fabric shares memory serves every client on it, and offers nothing
    /// beside it.)
    pub(crate) fn same_host_attachment(&self) -> Option<usize> {
        self.attachments
            .iter()
            .enumerate()
            .skip(MAIN_ATTACHMENT + 1)
            .find(|(_, attachment)| attachment.capabilities().shares_memory)
            .map(|(index, _)| index)
    }

    /// The Unix socket of the same-host attachment, which the challenge advertises.
    pub(crate) fn same_host_socket(&self) -> Option<std::path::PathBuf> {
        self.same_host_attachment()
            .and_then(|index| self.attachment(index).device().shm_socket())
    }

    /// Committed keys now, exact when no write is in flight (an index scan; see
    /// [`Counters::exact_keys`]).
    pub(crate) async fn exact_keys(self: &Arc<Self>) -> u64 {
        let node = self.clone();
        self.counters
            .exact_keys(move || node.table().count_keys())
            .await
    }

    /// The node's stats, with `keys` as counted by the caller.
    pub(crate) fn stats(&self, keys: u64) -> ServerStats {
        let mut stats = self
            .counters
            .snapshot(self.config.node_id, self.table(), &self.heap, keys);
        let main = self.main_attachment();
        stats.data_connections = main.data_connections.load(Ordering::Relaxed);
        for attachment in self.attachments.iter().skip(MAIN_ATTACHMENT + 1) {
            // The other devices' queue pairs, regions and windows count too; their data
            // connections are the same-host ones.
            let gauges = attachment.device().gauges();
            for (total, count) in stats.queue_pairs.iter_mut().zip(gauges.queue_pairs) {
                *total += count;
            }
            stats.live_memory_regions += gauges.live_memory_regions;
            stats.live_memory_windows += gauges.live_memory_windows;
            stats.shm_data_connections += attachment.data_connections.load(Ordering::Relaxed);
        }
        self.snapshot_figures(&mut stats);
        stats.collector_passes = self.collector.passes();
        stats.tombstones_cleared = self.collector.tombstones_cleared();
        stats.extra_copies_removed = self.sweep.removed();
        stats.swept_epoch = self.sweep.swept_epoch();
        stats.index_slots =
            self.table().geometry.bucket_count * rdkv_common::layout::SLOTS_PER_BUCKET as u64;
        stats.collector_interval_ms = self.collector.interval().as_millis() as u64;
        stats.pending_handshakes = self.pending.count() as u64;
        stats.authenticated_connections = self.pending.authenticated_count() as u64;
        stats.connections_refused_full = self.pending.refused_full.load(Ordering::Relaxed);
        stats.handshakes_evicted = self.pending.evicted.load(Ordering::Relaxed);
        (
            stats.view_epoch,
            stats.view_leader,
            stats.view_members_down,
            stats.views_committed,
        ) = self.view.figures();
        (stats.view_members_joining, stats.view_members_leaving) = self.view.changing_figures();
        // A reconciling node admits no data client (`session`): it does not serve data yet.
        stats.serving_data = self.view.serving().is_ok() && !self.view.reconciling();
        stats.serving_stops = self.view.serving_stops();
        stats.lease_lapses = self.view.lease_lapses();
        stats
    }
}
