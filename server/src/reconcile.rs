//! Newest-wins reconciliation when the whole cluster starts again with nobody serving (every
//! node crashed, each back with its own snapshot, taken at its own moment): before any member
//! serves, the copies of each key must agree, and the newest, by the version its block carries,
//! wins (`docs/protocol.md`, *Reconciliation*).
//!
//! Each filling node scans every filling peer's table with one-sided READs (`client/src/scan.rs`,
//! as a refill does) and keeps, in its own table, every copy newer than its own of the keys it
//! is a replica of under the view that will serve: the first `replicas` of each key's ranking
//! over the filling members. Nobody writes meanwhile (no member serves, so no write has a
//! primary), and a node only ever replaces a copy with a newer one, so whatever order the
//! nodes run in, each ends with the newest copy any of them loaded. It then reports the view
//! epoch it reconciled under ([`rdkv_common::protocol::ServerStats::reconciled_epoch`]); the
//! filling members are promoted together only once every one of them reports the current
//! epoch, and only if the epoch is still that one when the leader applies the promotion
//! (`ViewCommand::PromoteReconciled`): a member that joined or restarted since changes the epoch
//! and everyone reconciles again.

use std::sync::atomic::Ordering;
use std::time::Duration;

use rdkv_client::{Client, SCAN_BUCKETS};
use rdkv_common::protocol::{fetch_stats, ClusterView, MemberState, MonitoredNode};
use rdkv_common::sharding;

use crate::node::Node;
use crate::snapshot::table_io::Loader;

/// The filling members of `view`, in id order: the members that serve once it is promoted.
pub(crate) fn filling_members(view: &ClusterView) -> Vec<u32> {
    view.members
        .iter()
        .filter(|member| member.state == MemberState::Filling)
        .map(|member| member.node_id)
        .collect()
}

/// Scans every filling peer of `view` and keeps, in this node's table, each copy newer than
/// its own of the keys it will hold; then records `view.epoch` as reconciled. The keys taken
/// from peers.
///
/// # Errors
/// A line saying why (a peer could not be scanned, the table is full): the caller starts over.
pub(crate) async fn reconcile(
    node: &Node,
    client: &Client,
    view: &ClusterView,
) -> Result<u64, String> {
    let me = node.config.node_id;
    let members = filling_members(view);
    let replicas = node
        .config
        .cluster
        .as_ref()
        .map_or(1, |cluster| cluster.replicas);
    let mut loader = Loader::new(node.table(), &node.heap);
    let mut taken = 0u64;
    let mut scanned = 0u64;
    let peers: Vec<u32> = members.iter().copied().filter(|peer| *peer != me).collect();
    // Its progress, as a refill's (`rdkv-cluster status` and `up` read them): none shown
    // until the peers' sizes are known.
    let counters = &node.counters;
    counters.refill_buckets_total.store(0, Ordering::Relaxed);
    counters.refill_buckets_scanned.store(0, Ordering::Relaxed);
    let mut totals = Vec::with_capacity(peers.len());
    for peer in &peers {
        let total = client
            .combined_buckets_of(*peer)
            .await
            .map_err(|error| format!("node {peer}: {error}"))?;
        totals.push(total);
    }
    counters
        .refill_buckets_total
        .store(totals.iter().sum(), Ordering::Relaxed);
    for (peer, total) in peers.iter().copied().zip(totals) {
        let mut first = 0;
        while first < total {
            let count = SCAN_BUCKETS.min(total - first);
            let entries = client
                .scan_node(peer, first, count)
                .await
                .map_err(|error| format!("scanning node {peer}: {error}"))?;
            for entry in entries {
                scanned += 1;
                let holds = sharding::replicas(&entry.key, &members, replicas)
                    .into_iter()
                    .any(|index| members[index] == me);
                if holds && loader.keep_newest(&entry.key, &entry.value, entry.version)? {
                    // Counted as it is taken: a pass that fails later keeps what it took, and
                    // the next finds those copies equal.
                    taken += 1;
                    counters.reconciled_keys.fetch_add(1, Ordering::Relaxed);
                }
            }
            first += count;
            counters
                .refill_buckets_scanned
                .fetch_add(count, Ordering::Relaxed);
        }
    }
    drop(loader);
    node.counters
        .reconciled_epoch
        .store(view.epoch, Ordering::Release);
    tracing::info!(
        node = me,
        epoch = view.epoch,
        ?members,
        scanned,
        taken,
        "reconciled: this node holds the newest copy the filling members loaded of each of its keys"
    );
    Ok(taken)
}

/// The filling members of `view` that do not report `view.epoch` as reconciled yet (asked
/// each within `timeout`; one that cannot be asked counts as not reconciled).
pub(crate) async fn not_reconciled(node: &Node, view: &ClusterView, timeout: Duration) -> Vec<u32> {
    let Some(cluster) = node.config.cluster.as_ref() else {
        return Vec::new();
    };
    let mut waiting = Vec::new();
    for member in filling_members(view) {
        if member == node.config.node_id {
            if node.counters.reconciled_epoch.load(Ordering::Acquire) != view.epoch {
                waiting.push(member);
            }
            continue;
        }
        let Some(peer) = cluster.nodes.iter().find(|peer| peer.id == member) else {
            continue;
        };
        let monitored = MonitoredNode {
            address: peer.control_address,
            id: Some(peer.id),
            secret: &cluster.secret,
        };
        let reconciled = fetch_stats(monitored, timeout)
            .await
            .is_ok_and(|stats| stats.reconciled_epoch == view.epoch);
        if !reconciled {
            waiting.push(member);
        }
    }
    waiting
}
