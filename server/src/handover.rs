//! Hand-over: a member that `rdkv-cluster remove-node` retires is `leaving` in the view
//! (`crate::view`, `membership.rs`). It keeps serving its keys, every write of them also
//! reaches the copies of the ranking without it (clients route writes to the placement the
//! view is heading for), and this task copies the rest: it scans this node's own table with
//! one-sided READs and rewrites every key it is a copy of through the key's primary lock (a
//! compare-and-swap of the value with itself, as a refill does), which puts the value on the
//! key's next copies without crossing a concurrent write. Then the node stops serving data (a
//! client still routing by the view that has it leaving would otherwise read it after writes
//! of the view without it) and asks the leader to take it out of the view and of Raft. Progress is in the stats (`handover_keys_copied`).
//! `docs/protocol.md`, *Membership changes*.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkv_client::{Client, ClientBuilder, SCAN_BUCKETS};
use rdkv_cluster_file::ClusterConfig;
use rdkv_common::protocol::MemberState;
use tokio_util::sync::CancellationToken;

use crate::node::Node;
use crate::refill::{copy, ensure_view_holds};
use crate::view::VIEW_MOVED;

/// How often the task looks at the view for this node leaving, and waits between tries.
const HANDOVER_POLL: Duration = Duration::from_millis(200);

/// Client connections per member the hand-over uses.
const HANDOVER_CONCURRENCY: usize = 4;

/// How long the hand-over waits for every member to apply the view that has this node
/// leaving.
const MEMBERS_APPLY_WITHIN: Duration = Duration::from_secs(10);

/// The longest pause after failed hand-overs in a row.
const HANDOVER_RETRY_MOST: Duration = Duration::from_secs(5);

/// Runs until `shutdown`: whenever the view has this node leaving as this incarnation, hands
/// its keys over and asks to be removed.
pub(crate) async fn handover_loop(node: Arc<Node>, shutdown: CancellationToken) {
    if node.config.cluster.is_none() {
        return;
    }
    let mut pause = HANDOVER_POLL;
    let mut failures: u32 = 0;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = HANDOVER_POLL;
        let Some(round) = node.view.leaving_round() else {
            failures = 0;
            continue;
        };
        let cluster = current_cluster(&node);
        let Ok(client) = ClientBuilder::cluster(&cluster)
            .concurrency(HANDOVER_CONCURRENCY)
            .refill_peer()
            .build()
        else {
            tracing::error!("hand-over: the cluster file no longer makes a client");
            pause = HANDOVER_RETRY_MOST;
            continue;
        };
        let started = Instant::now();
        let outcome = tokio::select! {
            _ = shutdown.cancelled() => return,
            outcome = hand_over(&node, &client, round) => outcome,
        };
        client.close().await;
        match outcome {
            Ok((copied, handed_over_at)) => {
                failures = 0;
                tracing::info!(
                    node = node.config.node_id,
                    copied,
                    elapsed = ?started.elapsed(),
                    "hand-over complete: this node stops serving and asks to be removed from the view"
                );
                node.view.stop_serving_for_removal(round);
                if ask_removal(&node, round, handed_over_at, &shutdown).await == Removal::ViewMoved
                {
                    node.view.resume_serving_for_handover();
                }
            }
            Err(reason) => {
                tracing::warn!(node = node.config.node_id, %reason, "hand-over failed; starting over");
                failures += 1;
                pause = HANDOVER_POLL
                    .saturating_mul(1 << failures.min(5))
                    .min(HANDOVER_RETRY_MOST);
            }
        }
    }
}

/// The cluster file as it is now: members added since this node started are in it (the
/// operator edits it before `add-node`), with the secret the node was started with. The
/// file the node started from when it cannot be read.
fn current_cluster(node: &Node) -> Arc<ClusterConfig> {
    let started_with = node
        .config
        .cluster
        .clone()
        .expect("the loop runs only for a node of a cluster");
    let Some(path) = &node.config.cluster_file else {
        return started_with;
    };
    match rdkv_cluster_file::config::load_with_secret(path, Some(started_with.secret.clone())) {
        Ok(cluster)
            if cluster
                .nodes
                .iter()
                .any(|listed| listed.id == node.config.node_id) =>
        {
            Arc::new(cluster)
        }
        Ok(_) => {
            tracing::warn!("hand-over: the cluster file no longer lists this node; using the one the node started with (keep its [[node]] section until it is removed)");
            started_with
        }
        Err(error) => {
            tracing::warn!(%error, "hand-over: reading the cluster file again failed; using the one the node started with");
            started_with
        }
    }
}

/// How asking for the removal ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Removal {
    /// Removed, or no longer leaving in that round, or the node stops.
    Ended,
    /// The view moved since the hand-over: it must run again by the newer view.
    ViewMoved,
}

/// Asks the leader to remove this node, handed over under the view of `handed_over_at`, until
/// the view no longer has it leaving in `round`.
async fn ask_removal(
    node: &Node,
    round: u64,
    handed_over_at: u64,
    shutdown: &CancellationToken,
) -> Removal {
    while node.view.leaving_round() == Some(round) {
        match node.view.ask_removal(handed_over_at).await {
            Ok(epoch) => {
                tracing::info!(
                    node = node.config.node_id,
                    epoch,
                    "removed from the view: it serves nothing from now on"
                );
                return Removal::Ended;
            }
            Err(reason) if reason.starts_with(VIEW_MOVED) => {
                tracing::info!(node = node.config.node_id, %reason, "serving again to hand over by the newer view");
                return Removal::ViewMoved;
            }
            Err(reason) => tracing::debug!(%reason, "removal not committed yet"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Removal::Ended,
            _ = tokio::time::sleep(HANDOVER_POLL) => {}
        }
    }
    Removal::Ended
}

/// One hand-over for the leaving round that began at epoch `round`: this node's table
/// scanned, every key it is a copy of rewritten through its primary. The keys copied, and the
/// epoch of the view it ran under.
async fn hand_over(node: &Node, client: &Client, round: u64) -> Result<(u64, u64), String> {
    let me = node.config.node_id;
    let view = client
        .follow_view()
        .await
        .map_err(|error| format!("cannot fetch the view: {error}"))?;
    let leaving = view
        .members
        .iter()
        .any(|member| member.node_id == me && member.state == MemberState::Leaving);
    if !leaving || view.epoch < round {
        return Err(format!(
            "the view (epoch {}) does not have this node leaving since epoch {round}",
            view.epoch
        ));
    }
    // Every member fences the connections of older views when it applies this one: from then
    // on every write of this node's keys reaches their next copies too.
    let members: Vec<u32> = view
        .members
        .iter()
        .filter(|member| member.state != MemberState::Down)
        .map(|member| member.node_id)
        .collect();
    node.view
        .wait_until_applied(&members, view.epoch, MEMBERS_APPLY_WITHIN)
        .await?;
    let total = client
        .combined_buckets_of(me)
        .await
        .map_err(|error| format!("connecting to this node: {error}"))?;
    ensure_view_holds(client, &view, "while it connected").await?;
    node.counters
        .handover_buckets_total
        .store(total, Ordering::Relaxed);
    node.counters
        .handover_buckets_scanned
        .store(0, Ordering::Relaxed);
    tracing::info!(
        node = me,
        epoch = view.epoch,
        buckets = total,
        "handing over this node's keys"
    );
    let mut copied = 0u64;
    let mut first = 0;
    while first < total {
        let count = SCAN_BUCKETS.min(total - first);
        let entries = client
            .scan_node(me, first, count)
            .await
            .map_err(|error| format!("scanning this node: {error}"))?;
        for entry in entries {
            if !client.handover_target(&entry.key, me) {
                continue;
            }
            copy(client, &entry.key, &entry.value).await?;
            copied += 1;
            node.counters
                .handover_keys_copied
                .fetch_add(1, Ordering::Relaxed);
            node.counters.handover_bytes_copied.fetch_add(
                (entry.key.len() + entry.value.len()) as u64,
                Ordering::Relaxed,
            );
        }
        first += count;
        node.counters
            .handover_buckets_scanned
            .fetch_add(count, Ordering::Relaxed);
    }
    ensure_view_holds(client, &view, "during the hand-over").await?;
    Ok((copied, view.epoch))
}
