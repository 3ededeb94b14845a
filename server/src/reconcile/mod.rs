//! Newest-wins reconciliation when the whole cluster starts again with nobody serving (every
//! node crashed, or every node stopped one at a time, each back with its own snapshot, taken at
//! its own moment): before any member serves, the copies of each key must agree, and the
//! newest, by the version its block carries, wins, except the copies that a later stop's
//! final snapshot decides over (`authority.rs`; `docs/protocol.md`, *Reconciliation*).
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

mod authority;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

use rdkv_client::{Client, SCAN_BUCKETS};
use rdkv_common::protocol::{fetch_stats, ClusterView, MonitoredNode};
use rdkv_common::sharding;

use crate::node::Node;
use crate::snapshot::file::Fence;
use crate::snapshot::table_io::{scan_table, Loader};
use authority::{Authority, Provenance};

/// How long a peer has to say what its snapshot holds.
const ASK_PEER_WITHIN: Duration = Duration::from_secs(2);

/// The filling members of `view`, in id order: the members that serve once it is promoted.
pub(crate) fn filling_members(view: &ClusterView) -> Vec<u32> {
    view.members
        .iter()
        .filter(|member| member.state.is_filling())
        .map(|member| member.node_id)
        .collect()
}

/// Scans every filling peer of `view` and keeps, in this node's table, each copy newer than
/// its own of the keys it will hold, except the copies another member's decides over
/// ([`authority`]): a key this node holds such a copy of takes the newest copy no other
/// decides over, or is removed when there is none. Then records `view.epoch` as reconciled.
/// The keys taken from peers.
///
/// # Errors
/// A line saying why (a peer could not be scanned or asked, the table is full): the caller
/// starts over.
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
    let authority = Authority {
        members: view.members.iter().map(|member| member.node_id).collect(),
        replicas,
        provenance: provenances(node, &members).await?,
    };
    let holds = |key: &[u8]| {
        sharding::replicas(key, &members, replicas)
            .into_iter()
            .any(|index| members[index] == me)
    };
    let mut taking = Taking {
        // This node's copies that another member's decides over: replaced by the first copy
        // no other decides over, or removed at the end.
        superseded: superseded_here(node, &authority, &holds)?,
        loader: Loader::new(node.table(), &node.heap),
        node,
        authority: &authority,
        holds: &holds,
        taken: 0,
        scanned: 0,
    };
    let peers: Vec<u32> = members.iter().copied().filter(|peer| *peer != me).collect();
    let totals = peer_sizes(node, client, &peers).await?;
    for (peer, total) in peers.iter().copied().zip(totals) {
        let mut first = 0;
        while first < total {
            let count = SCAN_BUCKETS.min(total - first);
            let entries = client
                .scan_node(peer, first, count)
                .await
                .map_err(|error| format!("scanning node {peer}: {error}"))?;
            for entry in entries {
                taking.consider(peer, &entry.key, &entry.value, entry.version)?;
            }
            first += count;
            node.counters
                .refill_buckets_scanned
                .fetch_add(count, Ordering::Relaxed);
        }
    }
    let (taken, scanned, removed) = taking.finish()?;
    node.counters
        .reconciled_epoch
        .store(view.epoch, Ordering::Release);
    tracing::info!(
        node = me,
        epoch = view.epoch,
        ?members,
        scanned,
        taken,
        removed,
        "reconciled: this node holds the newest copy the filling members loaded of each of its keys, of those no later stop decides over"
    );
    Ok(taken)
}

/// Each peer's combined buckets, for the progress a refill shows (`rdkv-cluster status` and
/// `up` read it): none shown until every size is known.
///
/// # Errors
/// A line naming the peer that could not be asked.
async fn peer_sizes(node: &Node, client: &Client, peers: &[u32]) -> Result<Vec<u64>, String> {
    let counters = &node.counters;
    counters.refill_buckets_total.store(0, Ordering::Relaxed);
    counters.refill_buckets_scanned.store(0, Ordering::Relaxed);
    let mut totals = Vec::with_capacity(peers.len());
    for peer in peers {
        let total = client
            .combined_buckets_of(*peer)
            .await
            .map_err(|error| format!("node {peer}: {error}"))?;
        totals.push(total);
    }
    counters
        .refill_buckets_total
        .store(totals.iter().sum(), Ordering::Relaxed);
    Ok(totals)
}

/// One reconciliation pass's taking of peers' copies into this node's table.
struct Taking<'pass, Holds> {
    node: &'pass Node,
    loader: Loader<'pass>,
    authority: &'pass Authority,
    /// Whether this node holds a key under the view that will serve.
    holds: &'pass Holds,
    /// This node's copies that another member's decides over, not replaced yet.
    superseded: HashSet<Vec<u8>>,
    taken: u64,
    scanned: u64,
}

impl<Holds: Fn(&[u8]) -> bool> Taking<'_, Holds> {
    /// Takes `peer`'s copy of `key` when this node holds the key, no other member's copy
    /// decides over it, and it is newer than this node's (or this node's is decided over).
    fn consider(
        &mut self,
        peer: u32,
        key: &[u8],
        value: &[u8],
        version: u64,
    ) -> Result<(), String> {
        self.scanned += 1;
        if !(self.holds)(key) || self.authority.superseded(peer, key) {
            return Ok(());
        }
        let took = if self.superseded.remove(key) {
            self.loader.replace(key, value, version)?;
            true
        } else {
            self.loader.keep_newest(key, value, version)?
        };
        if took {
            // Counted as it is taken: a pass that fails later keeps what it took, and the
            // next finds those copies equal.
            self.taken += 1;
            self.node
                .counters
                .reconciled_keys
                .fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Removes this node's decided-over copies that no copy replaced (the key is absent):
    /// the keys taken, scanned and removed.
    fn finish(mut self) -> Result<(u64, u64, u64), String> {
        let mut removed = 0u64;
        for key in &self.superseded {
            if self.loader.remove(key)? {
                removed += 1;
                self.node
                    .counters
                    .reconciled_removed
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok((self.taken, self.scanned, removed))
    }
}

/// The keys of this node's table that it will hold (`holds`) and whose copy here another
/// member's decides over.
///
/// # Errors
/// Never in practice (the scan's sink does not fail); typed as the caller's.
fn superseded_here(
    node: &Node,
    authority: &Authority,
    holds: &impl Fn(&[u8]) -> bool,
) -> Result<HashSet<Vec<u8>>, String> {
    let me = node.config.node_id;
    let mut superseded = HashSet::new();
    if !authority
        .provenance
        .values()
        .any(|provenance| provenance.fenced_at.is_some())
    {
        return Ok(superseded);
    }
    scan_table(node.table(), |key, _value, _version| {
        if holds(key) && authority.superseded(me, key) {
            superseded.insert(key.to_vec());
        }
        Ok::<(), String>(())
    })?;
    Ok(superseded)
}

/// Every filling member's [`Provenance`]: this node's from its own loaded snapshot, each
/// peer's from its stats.
///
/// # Errors
/// A line naming the peer that could not be asked.
async fn provenances(node: &Node, members: &[u32]) -> Result<BTreeMap<u32, Provenance>, String> {
    let mut provenance = BTreeMap::new();
    provenance.insert(
        node.config.node_id,
        Provenance {
            fenced_at: node.snapshots.loaded_fence(),
        },
    );
    let Some(cluster) = node.config.cluster.as_ref() else {
        return Ok(provenance);
    };
    for member in members {
        if *member == node.config.node_id {
            continue;
        }
        let Some(peer) = cluster.nodes.iter().find(|peer| peer.id == *member) else {
            continue;
        };
        let monitored = MonitoredNode {
            address: peer.control_address,
            id: Some(peer.id),
            secret: &cluster.secret,
        };
        let stats = fetch_stats(monitored, ASK_PEER_WITHIN)
            .await
            .map_err(|error| format!("asking node {member} what its snapshot holds: {error}"))?;
        provenance.insert(
            *member,
            Provenance {
                fenced_at: (stats.snapshot_loaded_fenced_at != 0).then_some(Fence {
                    epoch: stats.snapshot_loaded_fenced_at,
                    unix_ms: stats.snapshot_loaded_fenced_unix_ms,
                }),
            },
        );
    }
    Ok(provenance)
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
