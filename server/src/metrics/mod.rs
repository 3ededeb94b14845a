//! Prometheus metrics over HTTP: `GET /metrics` on the node's metrics address returns the
//! server's counters in the Prometheus text format (encoded by the `prometheus` crate).
//!
//! - this file: the registry, and every metric read from a stats snapshot;
//! - `endpoint`: the HTTP endpoint (`hyper`) and its bounds;
//! - `connections`: its open connections, oldest first, and the limit on them.

mod connections;
mod endpoint;

pub(crate) use endpoint::{bind, serve};

use prometheus::{Encoder, IntCounter, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};
use rdkv_common::protocol::ServerStats;
use rdkv_fabric::QueuePairState;

use connections::EndpointCounters;

/// Reads one gauge's value from a snapshot.
type Reader = fn(&ServerStats) -> i64;

/// The gauges and counters (every `*_total`), refreshed from a stats snapshot at every scrape.
pub struct Metrics {
    registry: Registry,
    gauges: Vec<(IntGauge, Reader)>,
    counters: Vec<(IntCounter, Reader)>,
    queue_pairs: IntGaugeVec,
    /// What the metrics endpoint reports about itself, kept live by the endpoint (not read from
    /// a snapshot).
    endpoint: EndpointCounters,
    /// One render at a time: a counter gains what its figure gained since the last render
    /// (read, then add), and two at once would both add it.
    rendering: std::sync::Mutex<()>,
}

impl Metrics {
    /// Registers every gauge, labelled with the node's id.
    ///
    /// # Panics
    /// Never in practice: metric names are static and registered once.
    pub fn new(node_id: u32) -> Self {
        let registry = Registry::new_custom(Some("rdkv".into()), None).expect("a valid prefix");
        let node = node_id.to_string();
        let mut gauges = Vec::new();
        let mut counters = Vec::new();
        for (name, help, read) in definitions() {
            let options = Opts::new(name, help).const_label("node", node.clone());
            // Prometheus's convention: a `_total` is a counter (it only grows).
            if name.ends_with("_total") {
                let counter = IntCounter::with_opts(options).expect("a valid counter");
                registry
                    .register(Box::new(counter.clone()))
                    .expect("registered once");
                counters.push((counter, read));
            } else {
                let gauge = IntGauge::with_opts(options).expect("a valid gauge");
                registry
                    .register(Box::new(gauge.clone()))
                    .expect("registered once");
                gauges.push((gauge, read));
            }
        }
        let queue_pairs = IntGaugeVec::new(
            Opts::new("queue_pairs", "Queue pairs by state").const_label("node", node.clone()),
            &["state"],
        )
        .expect("a valid gauge vector");
        registry
            .register(Box::new(queue_pairs.clone()))
            .expect("registered once");
        let endpoint = endpoint_counters(&registry, &node);
        Self {
            registry,
            gauges,
            counters,
            queue_pairs,
            endpoint,
            rendering: std::sync::Mutex::new(()),
        }
    }

    /// The text exposition of `stats`.
    pub fn render(&self, stats: &ServerStats) -> Vec<u8> {
        let _one_at_a_time = rdkv_fabric::lock(&self.rendering);
        for (gauge, read) in &self.gauges {
            gauge.set(read(stats));
        }
        for (counter, read) in &self.counters {
            // The snapshot's figure only grows: add what it gained since the last scrape.
            let value = u64::try_from(read(stats)).unwrap_or(0);
            counter.inc_by(value.saturating_sub(counter.get()));
        }
        for state in QueuePairState::ALL {
            self.queue_pairs
                .with_label_values(&[state.verbs_name()])
                .set(stats.queue_pairs[state.index()]);
        }
        let mut body = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut body);
        body
    }
}

/// Registers the metrics endpoint's own gauge and counters, labelled with the node's id.
fn endpoint_counters(registry: &Registry, node: &str) -> EndpointCounters {
    let options = |name: &str, help: &str| Opts::new(name, help).const_label("node", node);
    let counter = |name: &str, help: &str| {
        let counter = IntCounter::with_opts(options(name, help)).expect("a valid counter");
        registry
            .register(Box::new(counter.clone()))
            .expect("registered once");
        counter
    };
    let connections = IntGauge::with_opts(options(
        "metrics_connections",
        "Connections to this metrics endpoint open now (at most its max_connections)",
    ))
    .expect("a valid gauge");
    registry
        .register(Box::new(connections.clone()))
        .expect("registered once");
    EndpointCounters {
        connections,
        evicted: counter(
            "metrics_connections_evicted_total",
            "Metrics connections closed to make room for a newer one (max_connections were open)",
        ),
        timed_out: counter(
            "metrics_connections_timed_out_total",
            "Metrics connections closed because no whole request head arrived within header_read_timeout (a slow head, or an idle keep-alive connection)",
        ),
    }
}

/// Every gauge and counter: its name (without the `rdkv_` prefix), its help, and how it is read
/// from a stats snapshot. A name ending in `_total` is a counter.
#[allow(
    clippy::too_many_lines,
    reason = "a table: one entry per metric, and nothing else"
)]
fn definitions() -> [(&'static str, &'static str, Reader); 73] {
    [
        (
            "uptime_seconds",
            "Seconds since the server started",
            |stats| stats.uptime_seconds as i64,
        ),
        ("connections", "Control connections open now", |stats| {
            stats.connections as i64
        }),
        ("memory_regions", "Live memory regions", |stats| {
            stats.live_memory_regions
        }),
        (
            "memory_windows",
            "Live memory windows (per-client keys)",
            |stats| stats.live_memory_windows,
        ),
        ("pinned_bytes", "Bytes pinned (mlocked)", |stats| {
            stats.pinned_bytes as i64
        }),
        (
            "heap_used_bytes",
            "Heap bytes owned, sealed or quarantined",
            |stats| stats.heap_used_bytes as i64,
        ),
        ("heap_size_bytes", "Heap bytes", |stats| {
            stats.heap_size_bytes as i64
        }),
        ("heap_free_bytes", "Heap bytes free now", |stats| {
            stats.heap_free_bytes as i64
        }),
        (
            "heap_reuse_delay_p99_milliseconds",
            "Over the last 1,024 heap extents reclaimed: 99th percentile of the milliseconds from the scan that found an extent unreferenced to its reuse",
            |stats| stats.heap_reuse_delay_ms[1] as i64,
        ),
        ("keys", "Committed keys at the collector's last pass (every 25 ms, up to 200 ms while the index does not change)", |stats| {
            stats.keys as i64
        }),
        (
            "chunk_allocations_total",
            "Heap grants handed out",
            |stats| stats.chunk_allocations as i64,
        ),
        ("heap_extents_reclaimed_total", "Heap extents (4 KiB) reclaimed", |stats| {
            stats.extents_reclaimed as i64
        }),
        (
            "blocks_relocated_total",
            "Live blocks moved out of sparse heap segments by compaction",
            |stats| stats.blocks_relocated as i64,
        ),
        (
            "tentatives_cleared_total",
            "Abandoned tentative slots cleared by the collector",
            |stats| stats.tentatives_cleared as i64,
        ),
        (
            "tombstones_cleared_total",
            "Tombstone slots of replicated deletes cleared by the collector a quarantine after they were written",
            |stats| stats.tombstones_cleared as i64,
        ),
        (
            "extra_copies_removed_total",
            "Committed keys removed because the view no longer names this node among their copies (a stand-in's, once the member it stood in for serves again)",
            |stats| stats.extra_copies_removed as i64,
        ),
        (
            "index_slots",
            "The index's slots (buckets x slots per bucket): keys over this is its load factor",
            |stats| stats.index_slots as i64,
        ),
        (
            "swept_epoch",
            "The epoch of the last view under which this node swept its extra copies to the end (a removal waits for every member's sweep of the newest view)",
            |stats| stats.swept_epoch as i64,
        ),
        (
            "snapshots_written_total",
            "Snapshots written since start (docs/operations.md, Persistence)",
            |stats| stats.snapshots_written as i64,
        ),
        (
            "snapshots_failed_total",
            "Snapshots that failed since start (the previous one is kept; the log says why)",
            |stats| stats.snapshots_failed as i64,
        ),
        (
            "snapshot_failing",
            "1 while the last snapshot tried failed",
            |stats| i64::from(stats.snapshot_failing),
        ),
        (
            "last_snapshot_timestamp_seconds",
            "When the last snapshot was complete, Unix time (0: none since start)",
            |stats| (stats.last_snapshot_unix_ms / 1000) as i64,
        ),
        (
            "last_snapshot_duration_milliseconds",
            "How long the last snapshot took",
            |stats| stats.last_snapshot_duration_ms as i64,
        ),
        (
            "last_snapshot_bytes",
            "The last snapshot's size",
            |stats| stats.last_snapshot_bytes as i64,
        ),
        (
            "last_snapshot_keys",
            "Keys in the last snapshot",
            |stats| stats.last_snapshot_keys as i64,
        ),
        (
            "snapshot_keys_loaded",
            "Keys loaded from a snapshot at start",
            |stats| stats.snapshot_keys_loaded as i64,
        ),
        (
            "copy_sets_lost_total",
            "Views committed with every copy of some keys down at once (rdkv-cluster status names them until ack-loss)",
            |stats| stats.copy_sets_lost as i64,
        ),
        (
            "collector_passes_total",
            "Heap collector passes (index scans)",
            |stats| stats.collector_passes as i64,
        ),
        (
            "collector_interval_milliseconds",
            "The collector's interval now: collector_interval while it has work, up to 8 times that while the index does not change",
            |stats| stats.collector_interval_ms as i64,
        ),
        (
            "control_messages_total",
            "Control-plane messages handled",
            |stats| stats.control_messages as i64,
        ),
        (
            "data_path_requests_total",
            "One-sided requests handled by server code (always 0)",
            |stats| stats.data_path_requests as i64,
        ),
        (
            "authentication_failures_total",
            "Refused authentications",
            |stats| stats.authentication_failures as i64,
        ),
        (
            "pending_handshakes",
            "Control connections that have not authenticated yet",
            |stats| stats.pending_handshakes as i64,
        ),
        (
            "handshakes_evicted_total",
            "Unauthenticated control connections evicted by newer ones (too many at once)",
            |stats| stats.handshakes_evicted as i64,
        ),
        (
            "handshakes_timed_out_total",
            "Control connections closed because their handshake passed handshake_deadline",
            |stats| stats.handshakes_timed_out as i64,
        ),
        (
            "authenticated_connections",
            "Authenticated control connections (of max_connections): clients, their lanes, monitors, peers",
            |stats| stats.authenticated_connections as i64,
        ),
        (
            "connections_refused_full_total",
            "Connections refused after authenticating because all max_connections authenticated slots were taken",
            |stats| stats.connections_refused_full as i64,
        ),
        (
            "view_epoch",
            "The epoch of the cluster view this node knows",
            |stats| stats.view_epoch as i64,
        ),
        (
            "view_leader",
            "The cluster view's consensus leader this node knows of (0: none)",
            |stats| i64::from(stats.view_leader),
        ),
        (
            "view_members_down",
            "Members this node's cluster view has down",
            |stats| stats.view_members_down as i64,
        ),
        (
            "view_members_joining",
            "Members this node's cluster view has joining (rdkv-cluster add-node)",
            |stats| stats.view_members_joining as i64,
        ),
        (
            "view_members_leaving",
            "Members this node's cluster view has leaving (rdkv-cluster remove-node)",
            |stats| stats.view_members_leaving as i64,
        ),
        (
            "connections_fenced_total",
            "Data connections ended because the cluster view moved keys (their clients fetch the view and reconnect)",
            |stats| stats.connections_fenced as i64,
        ),
        (
            "heap_fences_total",
            "Data connections fenced because, with the heap under pressure, they held its reuse back with an operation in flight and announced nothing for heap_hold_limit (a stopped or hung client; it reconnects)",
            |stats| stats.heap_fences as i64,
        ),
        (
            "heap_held_bytes",
            "Heap bytes in sealed grants held for a client stopped inside a request with them (shm: its WRITE may still land), until it leaves the request or its process ends",
            |stats| stats.heap_held_bytes as i64,
        ),
        (
            "connections_held",
            "Torn-down data connections kept because their client stopped inside a request (shm): queue pair, announce word and grants stay until it leaves it or its process ends",
            |stats| stats.connections_held as i64,
        ),
        (
            "serving_data",
            "1 while the node serves data (it holds its lease from the cluster's majority and the view has it), else 0",
            |stats| i64::from(stats.serving_data),
        ),
        (
            "serving_stops_total",
            "Times the node stopped serving data (lost its lease, or the view had it down); its data connections were fenced",
            |stats| stats.serving_stops as i64,
        ),
        (
            "lease_lapses_total",
            "Of serving_stops_total, the stops for want of a lease (no renewal from the majority in time, or a leader that stepped down)",
            |stats| stats.lease_lapses as i64,
        ),
        (
            "connections_refused_not_serving_total",
            "Data connections refused while the node was not serving data",
            |stats| stats.connections_refused_not_serving as i64,
        ),
        (
            "lanes_refused_total",
            "Extra client lanes refused because over half of max_connections were open (their clients use their first connection)",
            |stats| stats.lanes_refused as i64,
        ),
        (
            "refill_buckets_scanned",
            "Refill after a restart: peers' index buckets scanned so far (of rdkv_refill_buckets_total)",
            |stats| stats.refill_buckets_scanned as i64,
        ),
        (
            "refill_buckets_total",
            "Refill after a restart: peers' index buckets to scan (0: no refill since start)",
            |stats| stats.refill_buckets_total as i64,
        ),
        (
            "refill_keys_copied_total",
            "Refill after a restart: keys copied from their primaries",
            |stats| stats.refill_keys_copied as i64,
        ),
        (
            "refill_bytes_copied_total",
            "Refill: bytes of the keys and values copied from their primaries",
            |stats| stats.refill_bytes_copied as i64,
        ),
        (
            "handover_keys_copied_total",
            "Hand-over of a leaving member (rdkv-cluster remove-node): its keys copied to the members that take them",
            |stats| stats.handover_keys_copied as i64,
        ),
        (
            "handover_bytes_copied_total",
            "Hand-over of a leaving member: bytes of the keys and values copied",
            |stats| stats.handover_bytes_copied as i64,
        ),
        (
            "handover_buckets_scanned",
            "Hand-over of a leaving member: its index buckets scanned so far",
            |stats| stats.handover_buckets_scanned as i64,
        ),
        (
            "handover_buckets_total",
            "Hand-over of a leaving member: its index buckets to scan (0: no hand-over since start)",
            |stats| stats.handover_buckets_total as i64,
        ),
        (
            "reconciled_keys_total",
            "Whole-cluster start: keys taken from a peer whose copy was newer (newest wins)",
            |stats| stats.reconciled_keys as i64,
        ),
        (
            "reconciled_removed_total",
            "Whole-cluster start: keys removed because a later stop's copy decided they were absent",
            |stats| stats.reconciled_removed as i64,
        ),
        (
            "views_committed_total",
            "Views this node committed as the consensus leader (members down and joins)",
            |stats| stats.views_committed as i64,
        ),
        (
            "data_connections",
            "Data connections (with a queue pair) on the node's main fabric now",
            |stats| stats.data_connections as i64,
        ),
        (
            "shm_data_connections",
            "Data connections on the node's shm fabric now (clients on its host)",
            |stats| stats.shm_data_connections as i64,
        ),
        (
            "soft_hellos_pending",
            "Soft NIC connections reading their hello now (bounded by fabric_max_pending_hellos)",
            |stats| stats.fabric_hellos_pending,
        ),
        (
            "soft_connections",
            "Soft NIC connections being served now",
            |stats| stats.fabric_connections,
        ),
        (
            "soft_engine_threads",
            "The soft NIC's engine threads, which serve every connection",
            |stats| stats.fabric_engine_threads,
        ),
        (
            "soft_output_stalls_total",
            "Times a soft NIC connection stopped being read because its peer did not take its answers (fabric_response_buffer)",
            |stats| stats.fabric_output_stalls,
        ),
        (
            "soft_responder_errors_total",
            "Soft NIC connections whose responder refused a request (longer than max_message_size, malformed, or outside its key's rights), moving the queue pair to ERROR",
            |stats| stats.fabric_responder_errors,
        ),
        (
            "soft_hellos_timed_out_total",
            "Soft NIC connections closed because their whole hello missed fabric_hello_deadline",
            |stats| stats.fabric_hellos_timed_out,
        ),
        (
            "soft_hellos_refused_total",
            "Soft NIC connections closed before their hello: evicted by newer ones, too many pending",
            |stats| stats.fabric_hellos_refused,
        ),
        (
            "client_operations_total",
            "Operations this node's clients reported as ended (succeeded or failed)",
            |stats| stats.client_counters.operations as i64,
        ),
        (
            "client_failures_total",
            "Operations this node's clients reported as failed",
            |stats| stats.client_counters.failures as i64,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_are_counters_and_the_rest_gauges() {
        let metrics = Metrics::new(3);
        let mut stats = ServerStats {
            control_messages: 5,
            keys: 7,
            ..ServerStats::default()
        };
        let first = String::from_utf8(metrics.render(&stats)).expect("text");
        assert!(
            first.contains("# TYPE rdkv_control_messages_total counter"),
            "{first}"
        );
        assert!(first.contains("# TYPE rdkv_keys gauge"), "{first}");
        assert!(
            first.contains("rdkv_control_messages_total{node=\"3\"} 5"),
            "{first}"
        );
        assert!(!first.contains("_total gauge"), "{first}");
        stats.control_messages = 9;
        let second = String::from_utf8(metrics.render(&stats)).expect("text");
        assert!(
            second.contains("rdkv_control_messages_total{node=\"3\"} 9"),
            "{second}"
        );
    }
}
