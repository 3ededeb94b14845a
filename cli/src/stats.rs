//! `rdkv stats`: a row per node (its counters, or why it did not answer), the clients' totals,
//! then the cluster view and the losses it records. Exit 2 when a node is down or refused the
//! secret.

use std::process::ExitCode;

use rdkv_client::Client;
use rdkv_cluster_file::units::format_bytes;
use rdkv_common::protocol::{ClientCounters, ServerStats};

use crate::output;

/// Prints the table, the totals and the view.
pub async fn stats(client: &Client) -> ExitCode {
    let mut total = ClientCounters::default();
    let mut down = 0;
    // Data connections first, as every other command opens them: the table then shows the
    // fabric this host's clients get from each node (a node that is down shows so below).
    let _ = client.connect_all().await;
    rdkv_common::outln!(
        "{:<5} {:<6} {:>9} {:<5} {:>6} {:<18} {:>8} {:>10} {:>14} {:>12} {:>10}",
        "node",
        "state",
        "uptime",
        "via",
        "conns",
        "data conns",
        "keys",
        "heap used",
        "client ops",
        "round trips",
        "rt/op"
    );
    for (id, stats) in client.cluster_stats().await {
        match stats {
            Ok(stats) => {
                total.add(&stats.client_counters);
                print_node(client, id, &stats);
            }
            Err(rdkv_client::Error::AuthenticationFailed { reason, .. }) => {
                down += 1;
                rdkv_common::outln!("{id:<5} {:<6} {reason}", "auth failed");
            }
            Err(error) => {
                down += 1;
                rdkv_common::outln!("{id:<5} {:<6} {error}", "down");
            }
        }
    }
    print_total(&total);
    match client.view().await {
        Ok(view) => {
            rdkv_common::outln!("view: {}", view.summary());
            // Why a key written before may now read as not found.
            for loss in &view.losses {
                rdkv_common::outln!("{loss}: a key whose copies were all there reads as not found, or older, unless they come back with it (`rdkv-cluster status`, `ack-loss`)");
            }
        }
        Err(error) => rdkv_common::outln!("view: {error}"),
    }
    if down > 0 {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}

/// The row of a node that answered, and a warning line under it when its heap is low.
fn print_node(client: &Client, id: u32, stats: &ServerStats) {
    let counters = &stats.client_counters;
    rdkv_common::outln!(
        "{:<5} {:<6} {:>8}s {:<5} {:>6} {:<18} {:>8} {:>10} {:>14} {:>12} {:>10.2}",
        id,
        "up",
        stats.uptime_seconds,
        client
            .connection_fabric(id)
            .map_or_else(|| "-".to_string(), |fabric| fabric.to_string()),
        stats.connections,
        output::data_connections(stats),
        stats.keys,
        format_bytes(stats.heap_used_bytes),
        counters.operations,
        counters.round_trips,
        counters.round_trips_per_operation()
    );
    rdkv_common::outln!("      {}", snapshot_line(stats));
    if stats.heap_low() {
        rdkv_common::outln!(
            "      warning: heap under 10% free ({} of {}): writes may wait for reclamation; raise heap_size (docs/operations.md, Sizing the heap)",
            format_bytes(stats.heap_free_bytes),
            format_bytes(stats.heap_size_bytes)
        );
    }
}

/// `snapshot: 12 s ago, 1234 keys, 1.2 MiB in 0.10 s (3 written, 0 failed)`, and a warning
/// while the last one failed (`docs/operations.md`, *Persistence*).
fn snapshot_line(stats: &ServerStats) -> String {
    let last = if stats.last_snapshot_unix_ms == 0 {
        "none since start".to_string()
    } else {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_millis() as u64);
        format!(
            "{} s ago, {} key{}, {} in {:.2} s",
            now_ms.saturating_sub(stats.last_snapshot_unix_ms) / 1000,
            stats.last_snapshot_keys,
            if stats.last_snapshot_keys == 1 {
                ""
            } else {
                "s"
            },
            format_bytes(stats.last_snapshot_bytes),
            stats.last_snapshot_duration_ms as f64 / 1000.0
        )
    };
    let failing = if stats.snapshot_failing {
        "; warning: the last snapshot failed (the node's log says why)"
    } else {
        ""
    };
    format!(
        "snapshot: {last} ({} written, {} failed since start; {} keys loaded at start){failing}",
        stats.snapshots_written, stats.snapshots_failed, stats.snapshot_keys_loaded
    )
}

/// The clients' one-sided work over every node that answered.
fn print_total(total: &ClientCounters) {
    rdkv_common::outln!(
        "cluster: {} client operations ({} GETs, {} mutations, {} failed), {:.2} round trips per operation, {:.2} per GET, {:.2} work requests per operation, {} CAS races lost, {} checksum retries",
        total.operations,
        total.gets,
        total.mutations,
        total.failures,
        total.round_trips_per_operation(),
        total.round_trips_per_get(),
        total.verbs_per_operation(),
        total.cas_failures,
        total.checksum_retries
    );
}
