//! Re-replication: after a view that removed a member that was `down` (`rdkv-cluster
//! remove-node` of a dead node, or `replace_after`: `crate::view`, `replacement.rs`), each key
//! it held is one copy short. Every member that serves then scans its own table with one-sided
//! READs and rewrites each key that the removed member held (it was among the key's first
//! `replicas` of the ranking with it) and whose primary it is (so each key is copied once,
//! and about `replicas / n` of the keys are copied) through the
//! key's primary lock (a compare-and-swap of the value with itself, as the refill and the
//! hand-over copy: `crate::refill::copy_scanned`), which puts the value on the key's full set
//! of copies without crossing a concurrent write. A view that moves during the scan starts it
//! over by the new one. While it is pending the sweep of extra copies waits (`collector.rs`).
//! Progress is in the stats (`rereplication_*`) and `rdkv-cluster status`.
//! `docs/protocol.md`, *Membership changes*.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkv_client::{Client, ClientBuilder};
use rdkv_common::protocol::MemberState;
use rdkv_common::sharding;
use tokio_util::sync::CancellationToken;

use crate::node::Node;
use crate::refill::{copy_scanned, ensure_view_holds, CopyProgress};

/// How often a pending re-replication is tried again, at first.
const RETRY_FIRST: Duration = Duration::from_millis(200);

/// The longest pause after failed re-replications in a row.
const RETRY_MOST: Duration = Duration::from_secs(5);

/// Client connections per member the re-replication uses.
const CONCURRENCY: usize = 4;

/// Runs until `shutdown`: whenever this node applied the removal of a member that was down
/// after its last re-replication, re-replicates this node's keys (see the module).
pub(crate) async fn rereplication_loop(node: Arc<Node>, shutdown: CancellationToken) {
    let Some(cluster) = node.config.cluster.clone() else {
        return;
    };
    let Some(mut views) = node.view.subscribe() else {
        return;
    };
    let mut failures: u32 = 0;
    // The round this loop last said it started (logged once per round).
    let mut announced = 0;
    loop {
        let pending = node.rereplication_pending();
        let pause = RETRY_FIRST
            .saturating_mul(1 << failures.min(5))
            .min(RETRY_MOST);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = views.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(pause), if pending => {}
        }
        if !node.rereplication_pending() || node.view.serving_now().is_err() {
            continue;
        }
        let done = node.counters.rereplicated_epoch.load(Ordering::Acquire);
        let (round, removed) = node.view.dead_removals_after(done);
        if announced != round {
            announced = round;
            tracing::info!(
                node = node.config.node_id,
                ?removed,
                epoch = round,
                "members removed while down: copying the keys they held that this node is the primary of to their full set of copies"
            );
        }
        match run_once(&node, &cluster, round, &removed, &shutdown).await {
            Some(Ok((epoch, copied, started))) => {
                failures = 0;
                node.counters
                    .rereplicated_epoch
                    .store(epoch, Ordering::Release);
                tracing::info!(
                    node = node.config.node_id,
                    epoch,
                    copied,
                    elapsed = ?started.elapsed(),
                    "re-replication complete: every key this node is the primary of has its full set of copies"
                );
            }
            Some(Err(reason)) => {
                failures += 1;
                tracing::warn!(node = node.config.node_id, %reason, "re-replication failed; starting over");
            }
            None => return,
        }
    }
}

/// One re-replication with a client of its own; `None` at `shutdown`.
async fn run_once(
    node: &Node,
    cluster: &Arc<rdkv_cluster_file::ClusterConfig>,
    round: u64,
    removed: &[u32],
    shutdown: &CancellationToken,
) -> Option<Result<(u64, u64, Instant), String>> {
    let Ok(client) = ClientBuilder::cluster(cluster)
        .concurrency(CONCURRENCY)
        .refill_peer()
        .build()
    else {
        return Some(Err("the cluster file no longer makes a client".into()));
    };
    let started = Instant::now();
    let outcome = tokio::select! {
        _ = shutdown.cancelled() => None,
        outcome = rereplicate(node, &client, round, removed) => Some(outcome.map(|(epoch, copied)| (epoch, copied, started))),
    };
    client.close().await;
    outcome
}

/// This node's table scanned, every key it is the primary of and one of `removed` held
/// rewritten through its lock, under one view, of epoch `round` or later: that view's epoch
/// and the keys copied.
async fn rereplicate(
    node: &Node,
    client: &Client,
    round: u64,
    removed: &[u32],
) -> Result<(u64, u64), String> {
    let me = node.config.node_id;
    let view = client
        .follow_view()
        .await
        .map_err(|error| format!("cannot fetch the view: {error}"))?;
    let serving = view
        .members
        .iter()
        .any(|member| member.node_id == me && member.state == MemberState::Serving);
    if !serving || view.epoch < round {
        return Err(format!(
            "the view (epoch {}) does not have this node serving, or is older than the removal (epoch {round})",
            view.epoch
        ));
    }
    let total = client
        .combined_buckets_of(me)
        .await
        .map_err(|error| format!("connecting to this node: {error}"))?;
    ensure_view_holds(client, &view, "while it connected").await?;
    let counters = &node.counters;
    counters
        .rereplication_buckets_total
        .store(total, Ordering::Relaxed);
    counters
        .rereplication_buckets_scanned
        .store(0, Ordering::Relaxed);
    let progress = CopyProgress {
        buckets_scanned: &counters.rereplication_buckets_scanned,
        keys_copied: &counters.rereplication_keys_copied,
        bytes_copied: &counters.rereplication_bytes_copied,
    };
    // The ranking with the removed members back in it: a key they held has one of them among
    // its first `replicas` (removing a node keeps the others in order).
    let mut with_removed = view.serving();
    with_removed.extend(removed);
    with_removed.sort_unstable();
    with_removed.dedup();
    let replicas = node
        .config
        .cluster
        .as_ref()
        .map_or(1, |cluster| cluster.replicas);
    let held_by_removed = |key: &[u8]| {
        sharding::replicas(key, &with_removed, replicas)
            .into_iter()
            .any(|index| removed.contains(&with_removed[index]))
    };
    let copied = copy_scanned(client, me, total, &progress, |key| {
        client.rereplication_target(key, me) && held_by_removed(key)
    })
    .await?;
    ensure_view_holds(client, &view, "during the re-replication").await?;
    Ok((view.epoch, copied))
}
