//! Refill: a node back after a restart or an absence joins the view as `filling`
//! (`crate::view`), empty or stale. From then on every write of a key it is heading to hold
//! reaches it too (clients route writes to the copies of the view the cluster is heading for),
//! and this task copies the rest: it reads each serving peer's table with one-sided READs (no
//! peer CPU), and for every key whose primary is that peer and whose copies will include this
//! node, it rewrites the value through the primary's lock (a compare-and-swap of the value
//! with itself), which puts a copy here without ever crossing a concurrent write. Then it asks
//! the leader to promote the node: a new view, in which it serves again. Progress is in the
//! stats (`refill_*`) and the metrics. `docs/protocol.md`, *Refill*.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use rdkv_client::{Client, ClientBuilder, SCAN_BUCKETS};
use rdkv_common::protocol::{ClusterView, MemberState};
use tokio_util::sync::CancellationToken;

use crate::node::Node;
use crate::reconcile;
use crate::view::RESUME_BOUND;

/// How often the task looks at the view for this node filling, and waits between tries.
const REFILL_POLL: Duration = Duration::from_millis(200);

/// Client connections per peer the refill uses (one operation in flight each).
const REFILL_CONCURRENCY: usize = 4;

/// How long one try of a promotion's confirmation waits before it lists the members again.
const CONFIRM_TRY_WITHIN: Duration = Duration::from_secs(1);

/// Copies a refill, a hand-over or a re-replication keeps in flight at once.
const COPIES_IN_FLIGHT: usize = 16;

/// How long the refill waits for every serving peer to apply the view that has this node
/// filling.
const PEERS_APPLY_WITHIN: Duration = Duration::from_secs(10);

/// The longest pause after failed refills in a row (the first waits `REFILL_POLL`, each
/// failure doubles it): a peer that refuses the refill for a while (its slots all taken) gets
/// a try every few seconds, and the log a line each, not five a second.
const REFILL_RETRY_MOST: Duration = Duration::from_secs(5);

/// Tries of one key's copy before the refill starts over.
const COPY_ATTEMPTS: u32 = 5;

/// Runs until `shutdown`: whenever the view has this node filling as this incarnation, refills
/// it and asks for its promotion.
pub(crate) async fn refill_loop(node: Arc<Node>, shutdown: CancellationToken) {
    let Some(cluster) = node.config.cluster.clone() else {
        return;
    };
    let mut pause = REFILL_POLL;
    // Failed refills in a row.
    let mut failures: u32 = 0;
    // The filling round and when this loop first saw it.
    let mut round_seen: Option<(u64, Instant)> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = REFILL_POLL;
        // The round names this spell of filling: one that ends (the node marked down) and
        // another that starts while this refill runs must be refilled again.
        let Some(round) = node.view.filling_round() else {
            failures = 0;
            continue;
        };
        if node.view.resumed_round() == Some(round) {
            // Back from a cluster stop with its snapshot: nothing to copy.
            if resume(&node, round, &shutdown).await.is_err() {
                return;
            }
            continue;
        }
        let started = Instant::now();
        if round_seen.is_none_or(|(seen, _)| seen != round) {
            round_seen = Some((round, started));
        }
        let waited = round_seen.map_or(Duration::ZERO, |(_, since)| since.elapsed());
        // One lane to each peer, as before soft got a lane per worker: a refill is one copy
        // loop, and each lane would be a connection and a heap chunk on the peer. Its
        // connections take the peers' reserved slots: a peer full of clients still lets this
        // node fill.
        let client = ClientBuilder::cluster(&cluster)
            .concurrency(REFILL_CONCURRENCY)
            .refill_peer()
            .build()
            .expect("a client of a cluster, with no fabric choice, is always made");
        let outcome = tokio::select! {
            _ = shutdown.cancelled() => return,
            outcome = refill(&node, &client, round, waited) => outcome,
        };
        client.close().await;
        match outcome {
            Ok(Refilled::Waiting(reason)) => {
                failures = 0;
                tracing::debug!(node = node.config.node_id, %reason, "reconciled: waiting");
            }
            Ok(refilled) => {
                failures = 0;
                tracing::info!(
                    node = node.config.node_id,
                    ?refilled,
                    elapsed = ?started.elapsed(),
                    "refill complete: asking for promotion"
                );
                if ask_promotion(&node, round, refilled, &shutdown)
                    .await
                    .is_err()
                {
                    return;
                }
            }
            Err(RefillStop::Wait(reason)) => {
                // An expected wait (a normal `up`: members resumed from a stop serve first).
                tracing::info!(node = node.config.node_id, %reason, "refill waiting");
                failures += 1;
                pause = REFILL_POLL
                    .saturating_mul(1 << failures.min(5))
                    .min(REFILL_RETRY_MOST);
            }
            Err(RefillStop::Failed(reason)) => {
                tracing::warn!(node = node.config.node_id, %reason, "refill failed; starting over");
                failures += 1;
                pause = REFILL_POLL
                    .saturating_mul(1 << failures.min(5))
                    .min(REFILL_RETRY_MOST);
            }
        }
    }
}

/// Asks for this node's promotion until the view no longer has it filling in `round`: its own
/// after a refill, every filling member's at once when nobody serves and every one of them
/// reconciled under the view's epoch (a view that moved past that epoch sends the node back to
/// reconcile again). `Err` when the node stops meanwhile.
async fn ask_promotion(
    node: &Node,
    round: u64,
    refilled: Refilled,
    shutdown: &CancellationToken,
) -> Result<(), ()> {
    if matches!(refilled, Refilled::Copied(_)) {
        node.view.gate_promotion(round);
    }
    while node.view.filling_round() == Some(round) {
        let asked = match refilled {
            Refilled::Copied(_) => node.view.promote(round).await,
            Refilled::NobodyServes { epoch } if node.view.epoch() > epoch => return Ok(()),
            Refilled::NobodyServes { epoch } => node.view.promote_reconciled(epoch).await,
            Refilled::Waiting(_) => return Ok(()),
        };
        match asked {
            Ok(epoch) => {
                if matches!(refilled, Refilled::Copied(_)) {
                    confirm_promotion(node, epoch, shutdown).await?;
                }
                tracing::info!(node = node.config.node_id, epoch, "promoted: serving");
                break;
            }
            Err(reason) => {
                tracing::debug!(%reason, "promotion not committed yet");
                tokio::select! {
                    _ = shutdown.cancelled() => return Err(()),
                    _ = tokio::time::sleep(REFILL_POLL) => {}
                }
            }
        }
    }
    // The promotion may have committed although its answer was lost (a timeout, a leader
    // change): confirm it all the same, or the node would never serve again.
    if let Some(epoch) = node.view.promoted_unconfirmed() {
        confirm_promotion(node, epoch, shutdown).await?;
    }
    Ok(())
}

/// After the promotion at `epoch`: waits until every member applied it (each fenced the data
/// connections of older views, so none serves a key whose primary this node became to a client
/// of an older view), then serves. A member behind that does not catch up is one the view will
/// have down (its lease runs out): the wait goes on by the newer view. `Err` when the node
/// stops meanwhile.
async fn confirm_promotion(
    node: &Node,
    epoch: u64,
    shutdown: &CancellationToken,
) -> Result<(), ()> {
    for tries in 1u64.. {
        let members = node.view.members_up_but_me();
        // A short bound per try: the members are listed again each time, so one committed down
        // meanwhile drops out of the wait.
        match node
            .view
            .wait_until_applied(&members, epoch, CONFIRM_TRY_WITHIN)
            .await
        {
            Ok(()) => {
                node.view.confirm_promotion(epoch);
                return Ok(());
            }
            Err(reason) if tries % 10 == 0 => {
                tracing::warn!(node = node.config.node_id, %reason, "promoted: still waiting for every member to apply the view before serving (a member the leader reaches and this node does not keeps it waiting)");
            }
            Err(_) => {}
        }
        if shutdown.is_cancelled() {
            return Err(());
        }
    }
    Err(())
}

/// Why a refill stopped before it copied: each starts it over after a pause.
#[derive(Debug)]
enum RefillStop {
    /// An expected wait: for a member that is down, or for members resumed from a stop to
    /// serve (logged at info: a normal `up` waits so).
    Wait(String),
    /// A failure (a peer unreachable, the view moved, a copy that failed).
    Failed(String),
}

impl From<String> for RefillStop {
    fn from(reason: String) -> Self {
        Self::Failed(reason)
    }
}

/// How a refill ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Refilled {
    /// It copied this many keys from the serving peers.
    Copied(u64),
    /// No member serves (every node of the cluster started again after a crash), and every
    /// filling member reconciled under the view of `epoch` (`crate::reconcile`): they are to
    /// serve at once, with what they hold.
    NobodyServes {
        /// The epoch they reconciled under.
        epoch: u64,
    },
    /// No member serves, and this node reconciled, but these filling members have not reported
    /// it under the same epoch yet (the reason): look again after a poll.
    Waiting(String),
}

/// How long a filling node with no serving peer waits for members that are down (their keys
/// may be only there): longer than resumed members wait for the rest of their stop
/// ([`RESUME_BOUND`]), so that they, whose snapshots are the stop's, serve first.
const DOWN_MEMBERS_BOUND: Duration = Duration::from_secs(60);

/// How long a filling node with no serving peer, and no member down, waits before every
/// filling member serves: members resumed from a stop are promoted within a poll of the last
/// one's return, and this node then refills from them instead. (It cannot tell a resumed
/// member from a joined one after its own restart: the stop's record is in memory only.)
const NOBODY_SERVES_GRACE: Duration = Duration::from_secs(5);

/// A node resumed from the stop of `stopped_at` (`crate::view`, `stop.rs`): waits until no
/// member is left down since the stop, or [`RESUME_BOUND`], then asks for the resumed members'
/// promotion, all at once. `Err` when the node stops meanwhile.
async fn resume(node: &Node, stopped_at: u64, shutdown: &CancellationToken) -> Result<(), ()> {
    let me = node.config.node_id;
    let started = Instant::now();
    let mut last_report = Instant::now();
    tracing::info!(
        node = me,
        stopped_at,
        "resumed from the cluster stop's snapshot: waiting for the other members of the stop"
    );
    while node.view.resumed_round() == Some(stopped_at) {
        let missing = node.view.not_back_from(stopped_at);
        let due = missing.is_empty() || started.elapsed() >= RESUME_BOUND;
        if due {
            if !missing.is_empty() {
                tracing::error!(
                    node = me,
                    ?missing,
                    waited = ?RESUME_BOUND,
                    "serving without the members of the stop that did not come back: keys only they held are missing until they return"
                );
            }
            match node.view.promote_resumed(stopped_at).await {
                Ok(epoch) => {
                    tracing::info!(node = me, epoch, took = ?started.elapsed(), "resumed members serve")
                }
                Err(reason) => {
                    tracing::debug!(%reason, "promotion of the resumed members not committed yet")
                }
            }
        } else if last_report.elapsed() >= Duration::from_secs(5) {
            last_report = Instant::now();
            tracing::info!(node = me, ?missing, waited = ?started.elapsed(), bound = ?RESUME_BOUND, "still waiting for members of the stop to come back");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Err(()),
            _ = tokio::time::sleep(REFILL_POLL) => {}
        }
    }
    Ok(())
}

/// One refill for the filling round that began at epoch `round`: every serving peer's table
/// scanned, the keys this node will hold copied. Returns the keys copied. With no serving peer
/// while some member is down, it waits for them (their keys may be only there) unless
/// past [`DOWN_MEMBERS_BOUND`] since the round began (`waited`).
async fn refill(
    node: &Node,
    client: &Client,
    round: u64,
    waited: Duration,
) -> Result<Refilled, RefillStop> {
    let me = node.config.node_id;
    let counters = &node.counters;
    // Route by the view that has this node filling, and wait until every serving peer knows
    // it too: each then fenced the connections of older views, so every write from here on
    // reaches this node, and every write before is in the peers' tables.
    let view = client
        .follow_view()
        .await
        .map_err(|error| format!("cannot fetch the view: {error}"))?;
    let filling = view
        .members
        .iter()
        .any(|member| member.node_id == me && member.state.is_filling());
    if !filling {
        return Err(RefillStop::Failed(format!(
            "the view (epoch {}) does not have this node filling",
            view.epoch
        )));
    }
    if view.epoch < round {
        // A view of an earlier round: a peer that knows only it may still take writes that
        // miss this node.
        return Err(RefillStop::Failed(format!(
            "the view (epoch {}) is older than this round of filling (epoch {round})",
            view.epoch
        )));
    }
    let peers: Vec<u32> = view.serving();
    if !peers_to_copy_from(node, &view, &peers, waited).await? {
        return Ok(reconciled(node, client, &view).await?);
    }
    // Connected to every serving peer first (a peer refuses while it does not serve: one whose
    // record still says `serving` after a crash of every node, restarted and not rejoined yet),
    // so that this node never empties itself for peers it cannot copy from.
    let mut totals = Vec::with_capacity(peers.len());
    for peer in &peers {
        let buckets = client
            .combined_buckets_of(*peer)
            .await
            .map_err(|error| format!("node {peer}: {error}"))?;
        totals.push(buckets);
    }
    // A peer that restarted after a crash of every node and rejoined (filling, with only its
    // snapshot) since the view was fetched accepts the connection: its welcome names the
    // newer epoch, and the refill starts over by that view before it empties anything.
    ensure_view_holds(client, &view, "while it connected to its peers").await?;
    // A node back from `down` with its memory (paused, or cut off) may hold values deleted or
    // replaced meanwhile, and a copy of a key that is absent now would not replace them: it
    // forgets them first. Writes since the join are on the primaries too, and copied again.
    // With one copy of each key, no peer holds this node's keys (a stand-in holds only the
    // ones written while it was away, which the copy below brings over): what it loaded from
    // its snapshot stays.
    node.snapshots.table_touched();
    let one_copy = node
        .config
        .cluster
        .as_ref()
        .is_some_and(|cluster| cluster.replicas == 1);
    let forgotten = if one_copy {
        0
    } else {
        node.table().clear_slots()
    };
    if forgotten > 0 {
        tracing::info!(
            node = me,
            slots = forgotten,
            "refill: emptied what the node held before"
        );
    }
    counters
        .refill_buckets_total
        .store(totals.iter().sum(), Ordering::Relaxed);
    counters.refill_buckets_scanned.store(0, Ordering::Relaxed);
    tracing::info!(
        node = me,
        epoch = view.epoch,
        ?peers,
        buckets = totals.iter().sum::<u64>(),
        "refilling from the serving peers"
    );
    let mut copied = 0u64;
    let progress = CopyProgress {
        buckets_scanned: &counters.refill_buckets_scanned,
        keys_copied: &counters.refill_keys_copied,
        bytes_copied: &counters.refill_bytes_copied,
    };
    for (peer, total) in peers.iter().zip(totals) {
        copied += copy_scanned(client, *peer, total, &progress, |key| {
            client.refill_target(key, *peer, me)
        })
        .await?;
    }
    // Which keys it copied, and where each copy went, followed the client's view: one that
    // moved during the scan (a peer restarted, another node promoted) may have left keys out.
    ensure_view_holds(client, &view, "during the copy").await?;
    Ok(Refilled::Copied(copied))
}

/// Checks that `client` still routes by `view`, the view the refill planned by (its serving
/// peers, which keys to copy and where the copies go), and that no node has told it of a
/// newer one (`when` says at which step, for the error).
///
/// # Errors
/// A line saying that the view moved: the refill starts over by the new one.
pub(crate) async fn ensure_view_holds(
    client: &Client,
    view: &ClusterView,
    when: &str,
) -> Result<(), String> {
    let now = client
        .follow_view()
        .await
        .map_err(|error| format!("cannot fetch the view: {error}"))?;
    if now.epoch == view.epoch && client.routes_only_by(view.epoch) {
        return Ok(());
    }
    Err(format!(
        "the view moved from epoch {} (to {}, {} reported) {when}: starting over by the new one",
        view.epoch,
        now.epoch,
        client.view_epoch()
    ))
}

/// Whether the refill copies from `peers` (it waits for them to apply its view first):
/// `Ok(false)` when no member serves and every filling member is to serve with what it holds;
/// an error (the refill starts over) while it waits for a member that is down
/// ([`DOWN_MEMBERS_BOUND`]) or for resumed members to serve ([`NOBODY_SERVES_GRACE`]).
async fn peers_to_copy_from(
    node: &Node,
    view: &ClusterView,
    peers: &[u32],
    waited: Duration,
) -> Result<bool, RefillStop> {
    let me = node.config.node_id;
    if !peers.is_empty() {
        node.view
            .wait_until_applied(peers, view.epoch, PEERS_APPLY_WITHIN)
            .await?;
        return Ok(true);
    }
    let down: Vec<u32> = view
        .members
        .iter()
        .filter(|member| member.state == MemberState::Down)
        .map(|member| member.node_id)
        .collect();
    if !down.is_empty() && waited < DOWN_MEMBERS_BOUND {
        return Err(RefillStop::Wait(format!(
            "no serving peer to copy from while nodes {down:?} are down: waiting for them (at most {DOWN_MEMBERS_BOUND:?})"
        )));
    }
    if waited < NOBODY_SERVES_GRACE {
        return Err(RefillStop::Wait(format!(
            "no serving peer yet: waiting up to {NOBODY_SERVES_GRACE:?} for one (members resumed from a clean stop serve first; with none, after a crash of every node, the nodes then reconcile)"
        )));
    }
    // Nobody newer to copy from (every node of a cluster started again after a crash): what
    // the nodes hold, loaded from their snapshots, is the best copy there is. Copies of a key
    // on two nodes may be from different moments: they reconcile, the newest winning, and all
    // serve at once (`crate::reconcile`).
    tracing::warn!(
        node = me,
        ?down,
        keys = node.table().count_keys(),
        "no member serves: the filling members reconcile what they hold (their snapshots), then serve together; keys only the members down held are missing until they return"
    );
    Ok(false)
}

/// With no member serving: reconciles this node under `view` (unless it did under its epoch
/// already), then whether every filling member did too.
async fn reconciled(node: &Node, client: &Client, view: &ClusterView) -> Result<Refilled, String> {
    let filling = reconcile::filling_members(view);
    let others: Vec<u32> = filling
        .iter()
        .copied()
        .filter(|member| *member != node.config.node_id)
        .collect();
    if node.counters.reconciled_epoch.load(Ordering::Acquire) != view.epoch {
        // Every filling peer must know the view first: one that lags may still load its
        // snapshot, or refuse this node's scan.
        node.view
            .wait_until_applied(&others, view.epoch, PEERS_APPLY_WITHIN)
            .await?;
        reconcile::reconcile(node, client, view).await?;
    }
    let timeout = node
        .config
        .cluster
        .as_ref()
        .map_or(Duration::from_secs(1), |cluster| cluster.operation_deadline);
    let waiting = reconcile::not_reconciled(node, view, timeout).await;
    if waiting.is_empty() {
        Ok(Refilled::NobodyServes { epoch: view.epoch })
    } else {
        Ok(Refilled::Waiting(format!(
            "filling members {waiting:?} have not reconciled under epoch {} yet",
            view.epoch
        )))
    }
}

/// Where a scan-and-copy ([`copy_scanned`]) counts its progress: the refill's, the
/// hand-over's or the re-replication's counters.
pub(crate) struct CopyProgress<'a> {
    /// Index buckets scanned.
    pub(crate) buckets_scanned: &'a AtomicU64,
    /// Keys copied.
    pub(crate) keys_copied: &'a AtomicU64,
    /// Bytes of the keys and values copied.
    pub(crate) bytes_copied: &'a AtomicU64,
}

/// The copy loop that the refill, the hand-over and the re-replication share: scans the
/// `total` combined buckets of node `node_id`'s index one-sided, and copies every key that
/// `wanted` picks through its primary's lock ([`copy`]). The keys copied.
///
/// # Errors
/// A line: the scan or a copy failed (the caller starts over).
pub(crate) async fn copy_scanned(
    client: &Client,
    node_id: u32,
    total: u64,
    progress: &CopyProgress<'_>,
    wanted: impl Fn(&[u8]) -> bool,
) -> Result<u64, String> {
    let mut copied = 0u64;
    let mut first = 0;
    while first < total {
        let count = SCAN_BUCKETS.min(total - first);
        let entries = client
            .scan_node(node_id, first, count)
            .await
            .map_err(|error| format!("scanning node {node_id}: {error}"))?;
        // Keys are independent: their copies run side by side, each one a replicated write
        // through its primary's lock (one at a time, a copy waited a round trip per step).
        let mut copies =
            futures_util::stream::iter(entries.into_iter().filter(|entry| wanted(&entry.key)))
                .map(|entry| async move {
                    copy(client, &entry.key, &entry.value).await?;
                    Ok::<u64, String>((entry.key.len() + entry.value.len()) as u64)
                })
                .buffer_unordered(COPIES_IN_FLIGHT);
        while let Some(bytes) = copies.next().await {
            let bytes = bytes?;
            copied += 1;
            progress.keys_copied.fetch_add(1, Ordering::Relaxed);
            progress.bytes_copied.fetch_add(bytes, Ordering::Relaxed);
        }
        first += count;
        progress.buckets_scanned.fetch_add(count, Ordering::Relaxed);
    }
    Ok(copied)
}

/// Copies one key (a rewrite of its value through its primary's lock). A value that changed
/// meanwhile was written to this node by its writer: nothing to copy.
pub(crate) async fn copy(client: &Client, key: &[u8], value: &[u8]) -> Result<(), String> {
    let mut last_error = String::new();
    for _ in 0..COPY_ATTEMPTS {
        match client.refill_copy(key, value).await {
            Ok(_) => return Ok(()),
            Err(error) => last_error = error.to_string(),
        }
    }
    Err(format!(
        "copying a key failed {COPY_ATTEMPTS} times: {last_error}"
    ))
}
