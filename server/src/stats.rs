//! The server's counters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use std::sync::Mutex;

use rdkv_common::protocol::{ClientCounters, ServerStats};

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
    /// One-sided requests handled by server application code. Nothing in this crate can
    /// increment it: the fabric gives server code no callback for data-path requests.
    pub data_path_requests: AtomicU64,
    /// The sum of what clients reported about their one-sided work.
    pub client_counters: Mutex<ClientCounters>,
}

impl Counters {
    /// Fresh counters.
    pub fn new() -> Self {
        Self {
            started: Instant::now(),
            connections: AtomicU64::new(0),
            control_messages: AtomicU64::new(0),
            authentication_failures: AtomicU64::new(0),
            data_path_requests: AtomicU64::new(0),
            client_counters: Mutex::new(ClientCounters::default()),
        }
    }

    /// Adds a client's report.
    pub fn add_client_report(&self, report: &ClientCounters) {
        self.client_counters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .add(report);
    }

    /// A snapshot with the table's and heap's figures. It scans the index to count the keys
    /// (about 1 ms per 4 MiB of index): call it off the async workers.
    pub fn snapshot(&self, node_id: u32, table: &TableRegion, heap: &Heap) -> ServerStats {
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
            keys: table.count_keys(),
            chunk_allocations: heap.allocations.load(Ordering::Relaxed),
            extents_reclaimed: heap.reclaimed.load(Ordering::Relaxed),
            blocks_relocated: heap.blocks_relocated.load(Ordering::Relaxed),
            tentatives_cleared: heap.tentatives_cleared.load(Ordering::Relaxed),
            control_messages: self.control_messages.load(Ordering::Relaxed),
            data_path_requests: self.data_path_requests.load(Ordering::Relaxed),
            fabric_frames_sent: gauges.frames_sent,
            authentication_failures: self.authentication_failures.load(Ordering::Relaxed),
            client_counters: *self
                .client_counters
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        }
    }
}

impl Default for Counters {
    fn default() -> Self {
        Self::new()
    }
}
