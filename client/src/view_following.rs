//! How a client follows the cluster view ([`ViewFollower`]): the membership it routes by
//! ([`Membership`]: the epoch, the serving and the filling members, whose ranking places each
//! key, `docs/protocol.md`, *Placement*), fetching a newer view when a node's heartbeat
//! answer reports one or an operation meets a node that failed, and watching a replicated
//! operation's key while it runs, so that a view that moves the key ends the attempt.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkv_common::protocol::{fetch_view, ClusterView, MemberState, MonitoredNode};
use rdkv_common::sharding;
use rdkv_common::ControlError;

use crate::counters::Counters;
use crate::error::Error;

/// The cluster view as a client knows it: the epoch and the serving members, whose ranking
/// places each key (`docs/protocol.md`, *Placement*).
#[derive(Debug, Clone)]
struct Membership {
    /// The view's epoch (0: the cluster file's nodes, all serving, before any fetch).
    epoch: u64,
    /// The ids of the members serving data (serving or leaving), in id order.
    serving: Vec<u32>,
    /// The filling members' ids (back after a restart or an absence, or joining), in id
    /// order.
    filling: Vec<u32>,
    /// The leaving members' ids (`rdkv-cluster remove-node`), in id order: among `serving`,
    /// and out of the ranking the view is heading for.
    leaving: Vec<u32>,
    /// Every member but those joining, in id order: with one copy of each key, the ranking
    /// that places a key now (a member down or back after a restart keeps its keys: they
    /// are unavailable while it is down, as by the cluster file, and never move to a
    /// stand-in).
    holding: Vec<u32>,
    /// Every member but those leaving, in id order: with one copy, the ranking the view is
    /// heading for.
    staying: Vec<u32>,
    /// Whether a member joins or leaves: a client of one copy per key routes by the view
    /// then, and writes every copy of the key's current and next placement.
    changing: bool,
    /// Whether the view's members are not the cluster file's nodes (a member added or
    /// removed since): a client of one copy per key routes by the view.
    members_differ: bool,
}

/// Which of a key's copies an operation uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// The primary alone (a GET, with two copies or more).
    Primary,
    /// The key's one copy (a GET, with one copy of each key: [`Membership::single_copy`]).
    OnlyCopy,
    /// Every copy a write reaches, with the cluster's `replicas`.
    Copies(usize),
}

impl Route {
    /// The route of a GET, with `replicas` copies of each key.
    pub(crate) fn read(replicas: usize) -> Self {
        if replicas > 1 {
            Route::Primary
        } else {
            Route::OnlyCopy
        }
    }
}

impl Membership {
    /// With one copy of each key: its member by the ranking over the members that hold keys
    /// (all but those joining), then, while a member joins or leaves, its member by the
    /// ranking the view is heading for (all but those leaving). Before any view, the cluster
    /// file's nodes ([`Membership::write_replicas`]).
    fn single_copy(&self, key: &[u8]) -> Vec<u32> {
        if self.holding.is_empty() {
            return self.write_replicas(key, 1);
        }
        let mut replicas = Vec::with_capacity(2);
        for members in [&self.holding, &self.staying] {
            if let Some(index) = sharding::replicas(key, members, 1).first() {
                if !replicas.contains(&members[*index]) {
                    replicas.push(members[*index]);
                }
            }
        }
        replicas
    }

    /// Members filling and none serving ([`ViewFollower::replica_ids`] routes nothing then).
    fn reconciling(&self) -> bool {
        self.serving.is_empty() && !self.filling.is_empty()
    }

    /// `key`'s copies under this view, primary first: the first `count` of its ranking over
    /// the serving members; while members fill, also those of the ranking over serving and
    /// filling members, which the view is heading for (so a filling node gets every write of
    /// the keys it will hold). A filling node is never the primary.
    fn write_replicas(&self, key: &[u8], count: usize) -> Vec<u32> {
        let mut replicas: Vec<u32> = sharding::replicas(key, &self.serving, count)
            .into_iter()
            .map(|index| self.serving[index])
            .collect();
        if !self.filling.is_empty() || !self.leaving.is_empty() {
            let mut heading: Vec<u32> = self
                .serving
                .iter()
                .copied()
                .filter(|member| !self.leaving.contains(member))
                .collect();
            heading.extend(&self.filling);
            heading.sort_unstable();
            for index in sharding::replicas(key, &heading, count) {
                if !replicas.contains(&heading[index]) {
                    replicas.push(heading[index]);
                }
            }
        }
        replicas
    }
}

/// How a client learns the cluster view: its nodes, and the membership it routes by. Shared
/// with the tasks that fetch the view.
#[derive(Debug)]
pub(crate) struct ViewFollower {
    /// The nodes' control addresses and ids, for monitoring connections.
    nodes: Vec<(SocketAddr, Option<u32>)>,
    /// The cluster secret.
    secret: Vec<u8>,
    /// Their ids.
    node_ids: Vec<u32>,
    /// The view the client routes by.
    membership: Mutex<Membership>,
    /// The client's counters (view refreshes).
    counters: Arc<Counters>,
    /// Held by the fetch in progress.
    refreshing: tokio::sync::Mutex<()>,
    /// When the last fetch of the view reached no node: the first node's error.
    unanswered: Mutex<Option<String>>,
    /// Whether the last fetch of the view found every node refusing the connection outright
    /// (nothing listens on any node's port: the cluster is down).
    all_refused: AtomicBool,
    /// Whether a client of one copy per key has asked for the view once (it routes by the
    /// cluster file until a view says otherwise: [`ViewFollower::follow_view_with_one_copy`]).
    first_view_asked: AtomicBool,
    /// The members named by the newest view seen that this client's cluster file does not
    /// list (added after the file was read): the client cannot reach every copy of a key, so
    /// its operations fail, naming the fix ([`ViewFollower::cluster_down`]), instead of
    /// writing fewer copies than the view has.
    unknown_members: Mutex<Vec<u32>>,
    /// The epoch of the view the client routes by, as `membership` has it: read without its
    /// lock on every single-copy operation ([`ViewFollower::newer_view_reported`]).
    routed_epoch: AtomicU64,
    /// Whether a client of one copy per key routes by the view
    /// ([`ViewFollower::single_copy_by_view`]), kept by [`ViewFollower::adopt`]: read without
    /// a lock on every single-copy operation.
    by_view: AtomicBool,
    /// Whether `unknown_members` names any: read without its lock on every replicated
    /// operation.
    any_unknown: AtomicBool,
}

impl ViewFollower {
    /// A follower of the view of the nodes at `nodes` (control addresses and ids, for
    /// monitoring connections; none for a client of one node), whose ids are `node_ids` in
    /// cluster-file order, all serving until a view says otherwise.
    pub(crate) fn new(
        nodes: Vec<(SocketAddr, Option<u32>)>,
        secret: Vec<u8>,
        node_ids: Vec<u32>,
        counters: Arc<Counters>,
    ) -> Self {
        let mut serving = node_ids.clone();
        serving.sort_unstable();
        Self {
            nodes,
            secret,
            node_ids,
            membership: Mutex::new(Membership {
                epoch: 0,
                serving,
                filling: Vec::new(),
                leaving: Vec::new(),
                holding: Vec::new(),
                staying: Vec::new(),
                changing: false,
                members_differ: false,
            }),
            counters,
            refreshing: tokio::sync::Mutex::new(()),
            unanswered: Mutex::new(None),
            all_refused: AtomicBool::new(false),
            first_view_asked: AtomicBool::new(false),
            unknown_members: Mutex::new(Vec::new()),
            routed_epoch: AtomicU64::new(0),
            by_view: AtomicBool::new(false),
            any_unknown: AtomicBool::new(false),
        }
    }

    /// The membership the client routes by.
    fn membership(&self) -> std::sync::MutexGuard<'_, Membership> {
        self.membership
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The view's epoch the client routes by.
    pub(crate) fn epoch(&self) -> u64 {
        self.membership().epoch
    }

    /// Whether the view the client routes by has members filling and none serving: every
    /// node came back after a stop or crash of all of them, and they reconcile their copies
    /// before any serves (`docs/protocol.md`, *Reconciliation*). A replicated operation then
    /// reads and writes no node, and waits for a view that serves: a filling node's copy may
    /// be older than another's, and a node whose own view lags the client's would admit it.
    #[cfg(test)]
    pub(crate) fn reconciling(&self) -> bool {
        self.membership().reconciling()
    }

    /// Whether one of `connections` (the key's copies, just connected) was welcomed under a
    /// newer view than the one the client routes by: the operation waits for that view
    /// (the welcome of the connection itself, not the highest epoch any node ever reported,
    /// which a cluster started again with new view state never reaches).
    pub(crate) fn behind(&self, connections: &[Arc<crate::connection::NodeConnection>]) -> bool {
        let epoch = self.epoch();
        connections
            .iter()
            .any(|connection| connection.welcome.view_epoch > epoch)
    }

    /// Whether a node reported a newer view, in a heartbeat's answer, than the one the client
    /// routes by.
    pub(crate) fn newer_view_reported(&self) -> bool {
        self.counters.view_epoch.load(Ordering::Relaxed) > self.routed_epoch.load(Ordering::Relaxed)
    }

    /// `key`'s copies under the view (node ids, primary first): `count` of them, and while
    /// members fill, those too ([`Membership::write_replicas`]); one, the primary, when
    /// `count` is 1. None while the view is reconciling ([`ViewFollower::reconciling`]: the
    /// caller waits for a view that serves), decided under the same read of the view. With
    /// no member serving or filling (the view says the whole cluster is down), the key's node
    /// by the cluster file.
    pub(crate) fn replica_ids(&self, key: &[u8], route: Route) -> Vec<u32> {
        if self.any_unknown.load(Ordering::Relaxed) {
            // Some copies are on members this client cannot reach: none is used.
            return Vec::new();
        }
        let mut ids = {
            let membership = self.membership();
            if membership.reconciling() {
                return Vec::new();
            }
            match route {
                Route::Primary => membership.write_replicas(key, 1),
                Route::OnlyCopy | Route::Copies(1) => membership.single_copy(key),
                Route::Copies(count) => membership.write_replicas(key, count),
            }
        };
        if matches!(route, Route::Primary | Route::OnlyCopy) {
            ids.truncate(1);
        }
        ids.retain(|id| self.node_ids.contains(id));
        if ids.is_empty() {
            let owner = sharding::owner(key, &self.node_ids).unwrap_or(0);
            ids.extend(self.node_ids.get(owner));
        }
        ids
    }

    /// `key`'s copies under the view, primary first, with the filling members' that the view
    /// is heading for ([`Membership::write_replicas`]).
    pub(crate) fn write_replicas(&self, key: &[u8], count: usize) -> Vec<u32> {
        let membership = self.membership();
        if count == 1 {
            return membership.single_copy(key);
        }
        membership.write_replicas(key, count)
    }

    /// Whether a client of one copy per key routes by the view, through the replicated
    /// operations (`docs/protocol.md`, *Membership changes*): while a member joins or leaves
    /// (a write reaches the key's current and next copies), and once the view's members
    /// differ from the cluster file's nodes (the cluster file's ranking no longer places
    /// keys).
    pub(crate) fn single_copy_by_view(&self) -> bool {
        self.by_view.load(Ordering::Relaxed)
    }

    /// The members of the newest view seen that the client's cluster file does not list.
    fn unknown(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        self.unknown_members
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The newest view the nodes answer with, all asked at once (epochs only grow, and a view
    /// is committed before any node shows it). It returns once a majority of the nodes
    /// answered, or every node answered or failed, each within [`VIEW_FETCH_TIMEOUT`]: a
    /// paused or cut-off node costs the fetch nothing (waiting for its timeout stalled every
    /// operation that needed the view for half a second while it was being marked down).
    async fn newest_view(&self) -> Option<ClusterView> {
        use futures_util::stream::StreamExt;
        let majority = self.nodes.len() / 2 + 1;
        let mut fetches: futures_util::stream::FuturesUnordered<_> = self
            .nodes
            .iter()
            .map(|(address, id)| async move {
                let node = MonitoredNode {
                    address: *address,
                    id: *id,
                    secret: &self.secret,
                };
                fetch_view(node, VIEW_FETCH_TIMEOUT).await.map_err(|error| {
                    let refused = matches!(
                        &error,
                        ControlError::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused
                    );
                    (format!("node at {address}: {error}"), refused)
                })
            })
            .collect();
        let mut answers = Vec::with_capacity(self.nodes.len());
        let mut answered = 0;
        while let Some(answer) = fetches.next().await {
            answered += usize::from(answer.is_ok());
            answers.push(answer);
            if answered >= majority {
                break;
            }
        }
        let all_refused = answers.len() == self.nodes.len()
            && answers
                .iter()
                .all(|answer| matches!(answer, Err((_, true))));
        self.all_refused.store(all_refused, Ordering::Relaxed);
        let unanswered = if answers.iter().all(Result::is_err) {
            answers
                .iter()
                .find_map(|answer| answer.as_ref().err().map(|(text, _)| text.clone()))
        } else {
            None
        };
        *self
            .unanswered
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = unanswered;
        answers.into_iter().flatten().max_by_key(|view| view.epoch)
    }

    /// When the last fetch of the view reached no node: the first node's error.
    pub(crate) fn unanswered(&self) -> Option<String> {
        self.unanswered
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Fetches the cluster view and routes by it from now on, if it is newer than the one the
    /// client has. Whether it was newer.
    async fn refresh(&self) -> bool {
        // One fetch at a time: the others wait for it, and find the view it brought.
        let _refreshing = self.refreshing.lock().await;
        self.counters.view_refreshes.add(1);
        let Some(view) = self.newest_view().await else {
            return false;
        };
        self.adopt(&view)
    }

    /// Routes by `view` from now on, if it is newer than the one the client has. Whether it
    /// was newer.
    pub(crate) fn adopt(&self, view: &ClusterView) -> bool {
        let mut membership = self.membership();
        if view.epoch <= membership.epoch {
            return false;
        }
        let mut members: Vec<u32> = view.members.iter().map(|member| member.node_id).collect();
        let mut known = self.node_ids.clone();
        members.sort_unstable();
        known.sort_unstable();
        let listed = members.iter().all(|member| known.contains(member));
        // Nodes that are not one cluster (each its own one-node view, as in-process test nodes
        // are), or a view naming a member this client's cluster file lacks (added since the
        // client was made): keep routing by what the client has, and do not ask again for
        // this epoch. Writes by the older view are fenced by the nodes.
        let one_node_views = members.len() == 1 && known.len() > 1;
        if !listed {
            let unknown: Vec<u32> = members
                .iter()
                .copied()
                .filter(|member| !known.contains(member))
                .collect();
            tracing::error!(
                epoch = view.epoch,
                ?unknown,
                "the cluster view names members this client's cluster file does not list: make the client from the cluster file that lists every member"
            );
            *self.unknown() = unknown;
            self.any_unknown.store(true, Ordering::Relaxed);
            self.by_view.store(true, Ordering::Relaxed);
        }
        if !listed || one_node_views {
            membership.epoch = view.epoch;
            self.routed_epoch.store(view.epoch, Ordering::Relaxed);
            return false;
        }
        self.unknown().clear();
        self.any_unknown.store(false, Ordering::Relaxed);
        let serving = view.serving();
        let filling = view.filling();
        let leaving = view.in_state(MemberState::Leaving);
        let joining = view.in_state(MemberState::Joining);
        tracing::debug!(
            epoch = view.epoch,
            ?serving,
            ?filling,
            "routing by a new cluster view"
        );
        *membership = Membership {
            epoch: view.epoch,
            serving,
            filling,
            holding: members
                .iter()
                .copied()
                .filter(|member| !joining.contains(member))
                .collect(),
            staying: members
                .iter()
                .copied()
                .filter(|member| !leaving.contains(member))
                .collect(),
            leaving,
            changing: view.changing_members(),
            members_differ: members != known,
        };
        self.by_view.store(
            membership.changing || membership.members_differ,
            Ordering::Relaxed,
        );
        self.routed_epoch.store(view.epoch, Ordering::Relaxed);
        true
    }
}

/// How long a client waits before it asks for the view again while a node it needs does not
/// answer and the view still names it (the failure detector has not committed it down yet).
const VIEW_POLL_INTERVAL: Duration = Duration::from_millis(50);

/// How long a replicated operation runs before the client checks, and then every this long,
/// whether the view moved its key (a node that stopped answering without failing its
/// connections, as a paused or cut-off one does, is committed down meanwhile).
const VIEW_WATCH_INTERVAL: Duration = Duration::from_millis(250);

/// How long one node may take to answer a view fetch (all are asked at once).
const VIEW_FETCH_TIMEOUT: Duration = Duration::from_millis(500);

impl ViewFollower {
    /// Fetches the cluster view and routes by it from now on, if it is newer than the one the
    /// client has. Whether it was newer. The fetch runs in a task of its own, so that it
    /// completes even when the operation that asked is cancelled by its deadline (an operation
    /// with a deadline shorter than a fetch would otherwise never let the client learn a view:
    /// found with 1 ms deadlines).
    pub(crate) async fn refresh_in_task(self: &Arc<Self>) -> bool {
        let follower = self.clone();
        tokio::spawn(async move { follower.refresh().await })
            .await
            .unwrap_or(false)
    }

    /// After an operation met a node that failed: fetch the view; if it did not change, wait a
    /// little (the failure detector commits a dead node down within `failure_timeout`). The
    /// operation's deadline bounds the waiting.
    pub(crate) async fn await_new_view(self: &Arc<Self>) {
        if !self.refresh_in_task().await {
            tokio::time::sleep(VIEW_POLL_INTERVAL).await;
        }
    }

    /// Routes by the view the nodes reported in heartbeats, if it is newer than the client's.
    /// For a client of one copy per key, before an operation: asks for the view once (a
    /// member added or removed since the cluster file was written changes the placement),
    /// then whenever a node reports a newer one.
    pub(crate) async fn follow_view_with_one_copy(self: &Arc<Self>) {
        if !self.first_view_asked.load(Ordering::Relaxed)
            && !self.first_view_asked.swap(true, Ordering::Relaxed)
        {
            self.refresh_in_task().await;
            return;
        }
        self.follow_reported_epoch().await;
    }

    /// Routes by the view the nodes reported in heartbeats, if it is newer than the client's.
    pub(crate) async fn follow_reported_epoch(self: &Arc<Self>) {
        if self.newer_view_reported() {
            self.refresh_in_task().await;
        }
    }

    /// When the newest view names a member the client's cluster file does not list, the error
    /// that names the fix (the client cannot reach every copy); when the last view fetch found
    /// every node of the cluster file refusing the connection outright, the error that says the
    /// cluster is down: nothing listens on any node, so waiting out the deadline for a view
    /// would only cost the caller its deadline.
    pub(crate) fn cluster_down(&self, operation: &'static str) -> Option<Error> {
        let unknown = self.unknown().clone();
        if !unknown.is_empty() {
            return Some(Error::Config {
                reason: format!(
                    "{operation}: the cluster view names node {unknown:?}, which this client's cluster file does not list (added since): make the client from the cluster file that lists every member; it did not apply"
                ),
            });
        }
        if !self.all_refused.load(Ordering::Relaxed) {
            return None;
        }
        let address = self.nodes.first()?.0;
        Some(Error::NodeUnreachable {
            address,
            reason: format!(
                "{operation}: every node of the cluster refused the connection: the cluster is down (start it with `rdkv-cluster up FILE`); it did not apply"
            ),
        })
    }

    /// Runs `attempt` on `key`'s copies `planned` (node ids, primary first, `count` asked
    /// for), checking every [`VIEW_WATCH_INTERVAL`] whether a newer view moved them; `None`:
    /// it did, and the attempt was dropped (the caller decides from the operation's progress
    /// what that means).
    pub(crate) async fn watched<T>(
        self: &Arc<Self>,
        key: &[u8],
        route: Route,
        planned: &[u32],
        attempt: impl std::future::Future<Output = T>,
    ) -> Option<T> {
        let mut attempt = std::pin::pin!(attempt);
        let start = tokio::time::Instant::now() + VIEW_WATCH_INTERVAL;
        let mut ticks = tokio::time::interval_at(start, VIEW_WATCH_INTERVAL);
        loop {
            tokio::select! {
                outcome = &mut attempt => return Some(outcome),
                _ = ticks.tick() => {
                    if self.refresh_in_task().await && self.replica_ids(key, route) != planned {
                        return None;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkv_common::protocol::ViewMember;

    /// A follower of nodes 1 to 3 (no addresses: nothing is fetched).
    fn follower() -> ViewFollower {
        ViewFollower::new(Vec::new(), Vec::new(), vec![1, 2, 3], Arc::default())
    }

    /// A view of nodes 1 to 3 in `states`, at `epoch`.
    fn view(epoch: u64, states: [MemberState; 3]) -> ClusterView {
        ClusterView {
            epoch,
            leader: Some(1),
            members: (1..=3)
                .zip(states)
                .map(|(node_id, state)| ViewMember { node_id, state })
                .collect(),
            losses: Vec::new(),
        }
    }

    /// Every member filling and none serving: the client routes to nobody until a view
    /// serves (a filling node's copy may be older, and its own view may lag the client's).
    #[test]
    fn a_view_with_every_member_filling_is_reconciling_until_one_serves() {
        use MemberState::{Down, Filling, Serving};
        let follower = follower();
        assert!(!follower.reconciling(), "the cluster file's nodes serve");
        assert!(follower.adopt(&view(5, [Filling, Serving, Filling])));
        assert!(!follower.reconciling());
        assert_eq!(
            follower.replica_ids(b"key", Route::Primary),
            [2],
            "a filling node is never the primary"
        );
        assert!(follower.adopt(&view(6, [Filling, Filling, Down])));
        assert!(follower.reconciling());
        assert!(
            !follower.adopt(&view(5, [Serving, Serving, Serving])),
            "an older view is not adopted"
        );
        assert!(follower.reconciling());
        assert!(follower.adopt(&view(7, [Serving, Serving, Down])));
        assert!(!follower.reconciling());
        assert!(follower.adopt(&view(8, [Down, Down, Down])));
        assert!(
            !follower.reconciling(),
            "nobody filling: the cluster is down, not reconciling"
        );
    }

    /// `replica_ids` under a view with every member filling and none serving: the doc says
    /// "with no member serving, the key's node by the cluster file", but the heading ranking
    /// names a filling node as the primary. A GET that checked `reconciling()` under the
    /// previous view and routes (`replica_nodes`, a separate lock) after another task adopted
    /// the all-filling view reads that filling node: its unreconciled copy if its own view
    /// lags (it admits cluster clients then). And `watched` does not end an attempt when the
    /// view turns all-filling, because the primary it plans is the same node.
    #[test]
    fn a_reconciling_view_routes_no_operation_to_a_filling_node() {
        use MemberState::{Filling, Serving};
        let follower = follower();
        let before = follower.replica_ids(b"key", Route::Primary);
        assert!(follower.adopt(&view(5, [Serving, Serving, Serving])));
        assert!(follower.adopt(&view(6, [Filling, Filling, Filling])));
        assert!(follower.reconciling());
        let primary = follower.replica_ids(b"key", Route::Primary);
        assert!(
            primary.is_empty(),
            "a reconciling view routes a GET to filling node {primary:?} (the all-serving view's primary was {before:?}: `watched` sees no change and lets an attempt run on)"
        );
    }
    /// A member leaving: reads stay on the ranking over the members serving data (it among
    /// them), and writes reach the copies of the ranking without it too; a client of one copy
    /// routes by the view meanwhile, and once the members differ from the cluster file's.
    #[test]
    fn a_leaving_member_serves_and_writes_reach_the_ranking_without_it() {
        use MemberState::{Leaving, Serving};
        let follower = follower();
        assert!(!follower.single_copy_by_view());
        assert!(follower.adopt(&view(5, [Leaving, Serving, Serving])));
        assert!(follower.single_copy_by_view(), "a member leaves");
        for index in 0..200 {
            let key = format!("key-{index}");
            let all = [1, 2, 3];
            let current: Vec<u32> = sharding::replicas(key.as_bytes(), &all, 1)
                .into_iter()
                .map(|at| all[at])
                .collect();
            let staying = [2, 3];
            let next = staying[sharding::replicas(key.as_bytes(), &staying, 1)[0]];
            assert_eq!(
                follower.replica_ids(key.as_bytes(), Route::Primary),
                current,
                "{key}: GETs read the primary over the serving and leaving members"
            );
            let copies = follower.replica_ids(key.as_bytes(), Route::Copies(1));
            assert_eq!(copies[0], current[0], "{key}: the primary first");
            assert!(
                copies.contains(&next),
                "{key}: {copies:?} lacks its next copy {next}"
            );
        }
    }

    /// A view whose members the cluster file lists only in part (a member removed, or one not
    /// added yet) is adopted; one naming a member the file lacks is not (the client cannot
    /// reach it), and a one-node view of a multi-node file is not one cluster.
    #[test]
    fn a_view_of_some_of_the_files_nodes_is_adopted_and_one_of_an_unknown_node_is_not() {
        let follower = follower();
        let two = ClusterView {
            epoch: 4,
            leader: Some(2),
            members: vec![
                ViewMember {
                    node_id: 2,
                    state: MemberState::Serving,
                },
                ViewMember {
                    node_id: 3,
                    state: MemberState::Serving,
                },
            ],
            losses: Vec::new(),
        };
        assert!(follower.adopt(&two));
        assert!(
            follower.single_copy_by_view(),
            "the members differ from the file's nodes"
        );
        assert!(!follower.replica_ids(b"key", Route::Copies(2)).contains(&1));
        let mut unknown = two.clone();
        unknown.epoch = 5;
        unknown.members.push(ViewMember {
            node_id: 9,
            state: MemberState::Joining,
        });
        assert!(!follower.adopt(&unknown), "node 9 is not in the file");
        assert!(
            follower.replica_ids(b"key", Route::Copies(2)).is_empty(),
            "no copy is used while one is out of reach"
        );
        assert!(follower.single_copy_by_view());
        let error = follower
            .cluster_down("put")
            .expect("an error naming the fix");
        assert!(
            error
                .to_string()
                .contains("make the client from the cluster file"),
            "{error}"
        );
        let mut alone = two.clone();
        alone.epoch = 6;
        alone.members.truncate(1);
        assert!(!follower.adopt(&alone), "one node's own view");
        let mut without_it = two;
        without_it.epoch = 7;
        assert!(follower.adopt(&without_it), "node 9 is gone again");
        assert!(follower.cluster_down("put").is_none());
        assert_eq!(follower.replica_ids(b"key", Route::Copies(2)).len(), 2);
    }
    /// With one copy of each key, a member down keeps its keys (they are unavailable, as by
    /// the cluster file: no stand-in takes a write that its return would not bring back), and
    /// a member joining gets each key it will hold as the second copy of every write.
    #[test]
    fn with_one_copy_a_down_member_keeps_its_keys_and_a_joining_one_gets_its_writes() {
        use MemberState::{Down, Serving};
        let follower = follower();
        assert!(follower.adopt(&view(4, [Serving, Down, Serving])));
        let all = [1, 2, 3];
        for index in 0..100 {
            let key = format!("key-{index}");
            let owner = all[sharding::replicas(key.as_bytes(), &all, 1)[0]];
            assert_eq!(
                follower.replica_ids(key.as_bytes(), Route::OnlyCopy),
                [owner],
                "{key}"
            );
            assert_eq!(
                follower.replica_ids(key.as_bytes(), Route::Copies(1)),
                [owner],
                "{key}: no stand-in"
            );
        }
        let mut joining = view(5, [Serving, Serving, Serving]);
        joining.members.push(ViewMember {
            node_id: 4,
            state: MemberState::Joining,
        });
        let follower = ViewFollower::new(Vec::new(), Vec::new(), vec![1, 2, 3, 4], Arc::default());
        assert!(follower.adopt(&joining));
        assert!(follower.single_copy_by_view());
        let four = [1, 2, 3, 4];
        let moving = (0..100)
            .map(|index| format!("key-{index}"))
            .filter(|key| four[sharding::replicas(key.as_bytes(), &four, 1)[0]] == 4)
            .inspect(|key| {
                let copies = follower.replica_ids(key.as_bytes(), Route::Copies(1));
                assert_eq!(copies.len(), 2, "{key}: {copies:?}");
                assert_eq!(copies[1], 4, "{key}: the joining member second");
                assert_eq!(
                    follower.replica_ids(key.as_bytes(), Route::OnlyCopy),
                    copies[..1],
                    "{key}: read where it is now"
                );
            })
            .count();
        assert!(moving > 10, "about a quarter of the keys move: {moving}");
    }
}
