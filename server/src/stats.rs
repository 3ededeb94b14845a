//! The server's counters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use std::sync::Mutex;

use rdkv_common::protocol::{ClientCounters, ServerStats};
use rdkv_fabric::lock;

use crate::heap::Heap;
use crate::table::TableRegion;

/// Counters the control plane updates.
#[derive(Debug)]
pub struct Counters {
    /// When the server started.
    started: Instant,
    /// Control connections open now.
    pub connections: AtomicU64,
    /// Control messages handled.
    pub control_messages: AtomicU64,
    /// Failed authentications.
    pub authentication_failures: AtomicU64,
    /// Control connections closed because their handshake passed `handshake_deadline` (or a
    /// handshake message took longer than its own timeout).
    pub handshakes_timed_out: AtomicU64,
    /// One-sided requests handled by server application code. Nothing in this crate can
    /// increment it: the fabric gives server code no callback for data-path requests.
    pub data_path_requests: AtomicU64,
    /// The sum of what clients reported about their one-sided work.
    pub client_counters: Mutex<ClientCounters>,
    /// Data connections fenced by a view change.
    pub connections_fenced: AtomicU64,
    /// Data connections fenced for holding heap reuse back under pressure (`session/serve.rs`).
    pub heap_fences: AtomicU64,
    /// Torn-down data connections kept because their client stopped inside a request
    /// (`shm`): queue pair, announce word and grants, until it is out (`session/teardown.rs`).
    pub connections_held: AtomicU64,
    /// Data connections refused because the node was not serving data (no lease, down, or
    /// not rejoined after a restart).
    pub connections_refused_not_serving: AtomicU64,
    /// Extra lanes (`Purpose::Lane`) refused because over half of `max_connections` were open.
    pub lanes_refused: AtomicU64,
    /// Refill: peers' index buckets scanned, of `refill_buckets_total`.
    pub refill_buckets_scanned: AtomicU64,
    /// Refill: peers' index buckets to scan.
    pub refill_buckets_total: AtomicU64,
    /// Refill: keys copied.
    pub refill_keys_copied: AtomicU64,
    /// Refill: bytes of the keys and values copied.
    pub refill_bytes_copied: AtomicU64,
    /// Hand-over: bytes of the keys and values copied.
    pub handover_bytes_copied: AtomicU64,
    /// Hand-over of this leaving node: keys copied to the members that take them.
    pub handover_keys_copied: AtomicU64,
    /// Hand-over: this node's index buckets scanned, of `handover_buckets_total`.
    pub handover_buckets_scanned: AtomicU64,
    /// Hand-over: this node's index buckets to scan.
    pub handover_buckets_total: AtomicU64,
    /// The view epoch at which this node last finished reconciling (`crate::reconcile`).
    pub reconciled_epoch: AtomicU64,
    /// Reconciliation: keys taken from a peer whose copy was newer.
    pub reconciled_keys: AtomicU64,
    /// Reconciliation: copies of this node removed because a later stop's copy decided the
    /// key was absent.
    pub reconciled_removed: AtomicU64,
    /// Committed keys found by the collector's last pass (every `collector_interval`, up to
    /// 8 times that while the index does not change).
    pub collector_keys: AtomicU64,
    /// One exact key count at a time, shared by the requests that wait for it.
    key_scans: KeyScans,
}

/// Exact key counts for `Stats` requests: an index scan (about 1 ms per 4 MiB of index, 55 ms
/// for 256 MiB), one at a time. A request waits for the next scan that starts after it arrived
/// and shares its result with every request waiting alongside, so a flood of requests costs
/// one scanning thread, not one per request.
#[derive(Debug)]
struct KeyScans {
    /// Held by the one scan in progress.
    scanning: tokio::sync::Semaphore,
    /// When the last scan started, and what it counted.
    last: Mutex<Option<(Instant, u64)>>,
}

impl Counters {
    /// Fresh counters.
    pub fn new() -> Self {
        Self {
            started: Instant::now(),
            connections: AtomicU64::new(0),
            control_messages: AtomicU64::new(0),
            authentication_failures: AtomicU64::new(0),
            handshakes_timed_out: AtomicU64::new(0),
            data_path_requests: AtomicU64::new(0),
            client_counters: Mutex::new(ClientCounters::default()),
            collector_keys: AtomicU64::new(0),
            connections_fenced: AtomicU64::new(0),
            heap_fences: AtomicU64::new(0),
            connections_held: AtomicU64::new(0),
            connections_refused_not_serving: AtomicU64::new(0),
            lanes_refused: AtomicU64::new(0),
            refill_buckets_scanned: AtomicU64::new(0),
            refill_buckets_total: AtomicU64::new(0),
            refill_keys_copied: AtomicU64::new(0),
            refill_bytes_copied: AtomicU64::new(0),
            handover_bytes_copied: AtomicU64::new(0),
            handover_keys_copied: AtomicU64::new(0),
            handover_buckets_scanned: AtomicU64::new(0),
            handover_buckets_total: AtomicU64::new(0),
            reconciled_epoch: AtomicU64::new(0),
            reconciled_keys: AtomicU64::new(0),
            reconciled_removed: AtomicU64::new(0),
            key_scans: KeyScans {
                scanning: tokio::sync::Semaphore::new(1),
                last: Mutex::new(None),
            },
        }
    }

    /// Committed keys now, exact when no write is in flight: the result of an index scan
    /// (`count_keys`, run on the blocking pool) that started after this call (see
    /// [`KeyScans`]).
    pub(crate) async fn exact_keys(
        &self,
        count_keys: impl FnOnce() -> u64 + Send + 'static,
    ) -> u64 {
        let asked = Instant::now();
        let last = |scans: &KeyScans| *lock(&scans.last);
        let Ok(_scan) = self.key_scans.scanning.acquire().await else {
            return self.collector_keys.load(Ordering::Relaxed);
        };
        if let Some((started, keys)) = last(&self.key_scans) {
            if started >= asked {
                return keys;
            }
        }
        let started = Instant::now();
        let keys = tokio::task::spawn_blocking(count_keys)
            .await
            .unwrap_or_else(|_| self.collector_keys.load(Ordering::Relaxed));
        *lock(&self.key_scans.last) = Some((started, keys));
        keys
    }

    /// Adds a client's report.
    pub fn add_client_report(&self, report: &ClientCounters) {
        lock(&self.client_counters).add(report);
    }

    /// A snapshot with the table's and heap's figures, and `keys` as counted by the caller
    /// ([`Counters::exact_keys`], or the collector's last count).
    pub fn snapshot(
        &self,
        node_id: u32,
        table: &TableRegion,
        heap: &Heap,
        keys: u64,
    ) -> ServerStats {
        let gauges = table.device.gauges();
        ServerStats {
            node_id,
            uptime_seconds: self.started.elapsed().as_secs(),
            connections: self.connections.load(Ordering::Relaxed),
            queue_pairs: gauges.queue_pairs,
            live_memory_regions: gauges.live_memory_regions,
            live_memory_windows: gauges.live_memory_windows,
            pinned_bytes: gauges.pinned_bytes,
            heap_used_bytes: heap.used_bytes(),
            heap_size_bytes: heap.size_bytes(),
            heap_free_bytes: heap.free_bytes(),
            heap_reuse_delay_ms: heap.reuse_delay_summary(),
            keys,
            chunk_allocations: heap.allocations.load(Ordering::Relaxed),
            extents_reclaimed: heap.reclaimed.load(Ordering::Relaxed),
            blocks_relocated: heap.blocks_relocated.load(Ordering::Relaxed),
            tentatives_cleared: heap.tentatives_cleared.load(Ordering::Relaxed),
            // Filled in by `Node::stats`, which knows the collector.
            collector_passes: 0,
            tombstones_cleared: 0,
            extra_copies_removed: 0,
            swept_epoch: 0,
            index_slots: 0,
            collector_interval_ms: 0,
            control_messages: self.control_messages.load(Ordering::Relaxed),
            data_path_requests: self.data_path_requests.load(Ordering::Relaxed),
            fabric_frames_sent: gauges.frames_sent,
            fabric_hellos_refused: gauges.hellos_refused,
            fabric_hellos_timed_out: gauges.hellos_timed_out,
            fabric_hellos_pending: gauges.hellos_pending,
            fabric_connections: gauges.soft_connections,
            fabric_engine_threads: gauges.engine_threads,
            fabric_output_stalls: gauges.output_stalls,
            fabric_responder_errors: gauges.responder_errors,
            fabric: Some(table.device.backend()),
            // Filled in by `Node::stats`, which knows the attachments.
            data_connections: 0,
            shm_data_connections: 0,
            authentication_failures: self.authentication_failures.load(Ordering::Relaxed),
            handshakes_timed_out: self.handshakes_timed_out.load(Ordering::Relaxed),
            // Filled in by `Node::stats`, which knows the pending handshakes.
            pending_handshakes: 0,
            handshakes_evicted: 0,
            authenticated_connections: 0,
            connections_refused_full: 0,
            // Filled in by `Node::stats`, which knows the view.
            view_epoch: 0,
            view_leader: 0,
            view_members_down: 0,
            views_committed: 0,
            connections_fenced: self.connections_fenced.load(Ordering::Relaxed),
            heap_fences: self.heap_fences.load(Ordering::Relaxed),
            heap_held_bytes: heap.held_bytes(),
            connections_held: self.connections_held.load(Ordering::Relaxed),
            connections_refused_not_serving: self
                .connections_refused_not_serving
                .load(Ordering::Relaxed),
            lanes_refused: self.lanes_refused.load(Ordering::Relaxed),
            // Filled in by `Node::stats`, which knows the view.
            serving_data: true,
            serving_stops: 0,
            lease_lapses: 0,
            refill_buckets_scanned: self.refill_buckets_scanned.load(Ordering::Relaxed),
            refill_buckets_total: self.refill_buckets_total.load(Ordering::Relaxed),
            refill_keys_copied: self.refill_keys_copied.load(Ordering::Relaxed),
            refill_bytes_copied: self.refill_bytes_copied.load(Ordering::Relaxed),
            handover_bytes_copied: self.handover_bytes_copied.load(Ordering::Relaxed),
            handover_keys_copied: self.handover_keys_copied.load(Ordering::Relaxed),
            handover_buckets_scanned: self.handover_buckets_scanned.load(Ordering::Relaxed),
            handover_buckets_total: self.handover_buckets_total.load(Ordering::Relaxed),
            reconciled_epoch: self.reconciled_epoch.load(Ordering::Relaxed),
            reconciled_keys: self.reconciled_keys.load(Ordering::Relaxed),
            reconciled_removed: self.reconciled_removed.load(Ordering::Relaxed),
            client_counters: *lock(&self.client_counters),
            // The node's snapshot state fills these (`Node::stats`).
            ..ServerStats::default()
        }
    }
}

impl Default for Counters {
    fn default() -> Self {
        Self::new()
    }
}
