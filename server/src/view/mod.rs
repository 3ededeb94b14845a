//! The cluster view (`docs/architecture.md`, *Cluster view*): which nodes serve, agreed by the
//! nodes with Raft (`openraft`, embedded: nothing else to run).
//!
//! - `types.rs`: the Raft type configuration, the view's commands and state, peer messages.
//! - `storage.rs`: the vote, log and view, persisted to the node's state file.
//! - `network.rs`: Raft's messages over authenticated control connections, and who answered
//!   when ([`network::Liveness`]).
//! - `membership.rs`: who the members are and where they listen, and the leader's side of
//!   adding and removing one (`docs/protocol.md`, *Membership changes*).
//!
//! Tasks run beside Raft on every node of a cluster of two or more:
//! - **the election timer** (`election.rs`): openraft's own is off; a node that has heard no
//!   leader for its election timeout stands for election only if a majority answers yes to
//!   its pre-vote, so a node that comes back never makes a live leader step down;
//! - **the failure detector** (`failure_detector.rs`), active on the leader (it checks every
//!   100 ms): a member not heard from for `failure_timeout` (its lease requests where nodes
//!   hold leases, else its answers to the leader's heartbeats) is committed `down`, a new epoch;
//! - **the join loop**: a node whose record in the view is not `serving` under its own
//!   incarnation (it started, restarted, or was marked down while cut off) asks the leader to
//!   commit its join, a new epoch.
//!
//! - **the lease** (`lease.rs`): a node serves data only while it holds a lease from the
//!   cluster's majority and the view has it as this incarnation; otherwise it fences its data
//!   connections and refuses new ones.
//!
//! A one-node cluster runs no consensus: its view is itself, serving, at epoch 1.

mod complete;
mod election;
mod failure_detector;
mod lease;
mod leave;
mod losses;
mod membership;
mod network;
mod peer_link;
mod published;
mod replacement;
mod stop;
mod storage;
pub mod types;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use openraft::error::{ClientWriteError, RaftError};
use openraft::storage::Adaptor;
use openraft::{BasicNode, Raft, SnapshotPolicy};
use rdkv_common::protocol::{ClusterView, MemberState, ViewMember};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{Error, Result};
pub use lease::Serving;
pub use membership::VIEW_MOVED;
use network::{ask_leader, Liveness, Network};
pub use stop::RESUME_BOUND;
use storage::Store;
use types::{PeerId, PeerReply, PeerRequest, TypeConfig, ViewCommand};

/// Raft's heartbeat interval, and the failure detector's and join loop's tick.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(100);
/// Raft's election timeout range, in milliseconds. Followers stand for election
/// (`election.rs`) `election_timeout_max` (openraft's leader lease) plus this long after the
/// leader's last heartbeat: 0.65 to 0.8 s, so a new leader grants the other nodes' leases
/// (0.9 s at the shortest `failure_timeout`) before they run out, and a leader change alone
/// stops no one.
const ELECTION_TIMEOUT_MILLISECONDS: (u64, u64) = (250, 400);
/// How far ahead of a node's own term a peer's message may be. Elections raise the term by one
/// each; a million is decades of failed elections.
const MAX_TERM_JUMP: u64 = 1 << 20;
/// The shortest `failure_timeout`: well above the election timeout, so that a leader change
/// alone never marks anyone down.
pub const MIN_FAILURE_TIMEOUT: Duration = Duration::from_secs(1);

/// What the view service needs from the node's configuration.
#[derive(Debug, Clone)]
pub struct ViewSettings {
    /// This node.
    pub node_id: u32,
    /// Every node of the cluster with its control address, this one included.
    pub members: Vec<(u32, SocketAddr)>,
    /// The cluster secret (peer connections authenticate like clients).
    pub secret: Vec<u8>,
    /// A member silent this long is committed down.
    pub failure_timeout: Duration,
    /// Where the vote, log and view are kept across restarts (`None`: in memory only, which
    /// is safe only for a node that never restarts into a running cluster).
    pub state_file: Option<std::path::PathBuf>,
    /// The epoch of the cluster stop whose snapshot the node loaded, if it did: it asks to
    /// resume rather than join (`stop.rs`).
    pub resume_from: Option<u64>,
    /// The cluster's `replicas`: this many members down at once lose keys (the view records
    /// it).
    pub replicas: usize,
    /// A member `down` this long is removed and its keys re-replicated (`replacement.rs`);
    /// `None`: never.
    pub replace_after: Option<Duration>,
    /// The node joins a running cluster (`rdkv-cluster add-node`): it does not initialize
    /// Raft with the cluster file's nodes, and learns the view from the leader's log once the
    /// leader adds it (`membership.rs`).
    pub joining: bool,
}

/// The node's part in the cluster view.
pub struct ViewService {
    /// This node.
    node_id: u32,
    /// This process's incarnation (random per start).
    incarnation: u64,
    /// The stop whose snapshot the node loaded (`stop.rs`).
    resume_from: Option<u64>,
    /// Raft; `None` in a one-node cluster.
    raft: Option<Raft<TypeConfig>>,
    /// The applied view.
    view: tokio::sync::watch::Receiver<types::ViewState>,
    /// The control addresses of the cluster file's nodes, as this node was started with it;
    /// a member added later is reached at the address in Raft's membership
    /// ([`Self::address_of`]).
    configured_addresses: BTreeMap<u32, SocketAddr>,
    /// The cluster secret.
    secret: Arc<[u8]>,
    /// A member silent this long is committed down.
    failure_timeout: Duration,
    /// A member down this long is removed (`replacement.rs`); `None`: never.
    replace_after: Option<Duration>,
    /// Views this node committed as leader (downs and joins).
    committed: AtomicU64,
    /// When each peer was last heard from: answers to this node's Raft messages (the leader's
    /// heartbeats), the leader's heartbeats to this node, and joins.
    liveness: Arc<Liveness>,
    /// Cancelled when the node stops: a commit or a join in flight gives up at once.
    shutdown: CancellationToken,
    /// Whether the state file held a vote or log at start (a restart, not a first start).
    had_history: bool,
    /// Raft's storage, shared with Raft: the pre-vote compares logs by it.
    store: Store,
    /// How long a lease grant lasts (`lease.rs`).
    lease: Duration,
    /// When this node's lease ends (`None`: it never held one).
    lease_until: std::sync::Mutex<Option<Instant>>,
    /// Whether the lease was last extended as the leader: such a lease ends when the node
    /// stops leading (`lease.rs`).
    lease_as_leader: std::sync::atomic::AtomicBool,
    /// On the leader: members it decided to commit down, until its view has them down or it
    /// stops leading. It grants them no lease meanwhile (`lease.rs`), under this lock, which
    /// the decision takes too.
    /// Each with its record's `since` at the decision: the entry ends when the record changed.
    pending_down: std::sync::Mutex<std::collections::BTreeMap<u32, u64>>,
    /// Whether this node serves data now, and if not, why.
    serving: tokio::sync::watch::Sender<Serving>,
    /// Times this node stopped serving data.
    serving_stops: AtomicU64,
    /// Of `serving_stops`, those for want of a lease (`lease.rs`).
    lease_lapses: AtomicU64,
    /// The node's clock, in which its lease word counts (`published.rs`).
    clock: rdkv_common::lease::NodeClock,
    /// The lease word last published (`published.rs`).
    published: std::sync::Mutex<published::Published>,
    /// Set when the node leaves cleanly: it serves nothing from then on (`leave.rs`).
    leaving: std::sync::atomic::AtomicBool,
    /// The epoch at which the node last stopped serving data while the view had it serving
    /// as this process (`complete.rs`).
    stopped_serving_at: std::sync::Mutex<Option<crate::snapshot::file::Fence>>,
    /// Times the node dropped a lease before its end (it stopped leading): a published
    /// serving interval does not continue across a drop.
    lease_drops: AtomicU64,
    /// Set once the view has had this node as a member: a node removed from the view asks
    /// for no join afterwards (`membership.rs`).
    was_member: std::sync::atomic::AtomicBool,
    /// Set once this node said that the members refuse it as a member (it was removed from
    /// the view, perhaps while it was down): said once (`membership.rs`).
    said_removed: std::sync::atomic::AtomicBool,
    /// The leaving round (epoch) whose hand-over this node finished: it serves nothing while
    /// the view still has it leaving in that round, so no client reads it by an older view
    /// once the view without it is committed (0: none; `membership.rs`).
    handed_over: AtomicU64,
    /// The filling round of a promotion this node asked for after its refill (0: none): once
    /// the view promotes it, it serves only after every member applied that view
    /// (`promotion_confirmed`), so no client reads the key's former primary by an older view
    /// meanwhile (`membership.rs`).
    promotion_round: AtomicU64,
    /// The epoch up to which every member applied the view, as this node checked for its
    /// promotion.
    promotion_confirmed: AtomicU64,
    /// Set on the leader while a membership change is being started (`membership.rs`).
    change_starting: std::sync::atomic::AtomicBool,
    /// Held while the node works out whether it serves and says so (`lease.rs`).
    serving_refresh: std::sync::Mutex<()>,
}

impl std::fmt::Debug for ViewService {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ViewService")
            .field("node_id", &self.node_id)
            .field("consensus", &self.raft.is_some())
            .field("view", &self.current().summary())
            .finish()
    }
}

impl ViewService {
    /// Starts the view service: Raft (initialized on first start with every node as a voter),
    /// the failure detector and the join loop, as tasks of `tasks` that end at `shutdown`.
    ///
    /// # Errors
    /// [`Error::ViewState`] when the state file cannot be read; [`Error::Consensus`] when Raft
    /// does not start.
    pub async fn start(
        settings: ViewSettings,
        tasks: &TaskTracker,
        shutdown: CancellationToken,
    ) -> Result<Arc<Self>> {
        let node_ids: Vec<u32> = settings.members.iter().map(|(id, _)| *id).collect();
        let store = Store::open(
            settings.state_file.clone(),
            &node_ids,
            settings.replicas,
            settings.joining,
        )?;
        let had_history = store.has_history();
        let view = store.view();
        let addresses: BTreeMap<u32, SocketAddr> = settings.members.iter().copied().collect();
        let secret: Arc<[u8]> = settings.secret.clone().into();
        let liveness = Arc::new(Liveness::default());
        let raft = if settings.members.len() < 2 {
            None
        } else {
            Some(start_raft(&settings, store.clone(), secret.clone(), liveness.clone()).await?)
        };
        let service = Arc::new(Self {
            node_id: settings.node_id,
            incarnation: rand::random::<u64>() | 1,
            resume_from: settings.resume_from,
            raft,
            view,
            configured_addresses: addresses,
            secret,
            failure_timeout: settings.failure_timeout,
            replace_after: settings.replace_after,
            committed: AtomicU64::new(0),
            liveness,
            shutdown: shutdown.clone(),
            had_history,
            store,
            lease: Self::lease_for(settings.failure_timeout),
            lease_until: std::sync::Mutex::new(None),
            lease_as_leader: std::sync::atomic::AtomicBool::new(false),
            pending_down: std::sync::Mutex::new(std::collections::BTreeMap::new()),
            serving: tokio::sync::watch::Sender::new(Ok(())),
            serving_stops: AtomicU64::new(0),
            lease_lapses: AtomicU64::new(0),
            clock: rdkv_common::lease::NodeClock::new(),
            published: std::sync::Mutex::default(),
            lease_drops: AtomicU64::new(0),
            leaving: std::sync::atomic::AtomicBool::new(false),
            stopped_serving_at: std::sync::Mutex::new(None),
            was_member: std::sync::atomic::AtomicBool::new(false),
            said_removed: std::sync::atomic::AtomicBool::new(false),
            handed_over: AtomicU64::new(0),
            promotion_round: AtomicU64::new(0),
            promotion_confirmed: AtomicU64::new(0),
            change_starting: std::sync::atomic::AtomicBool::new(false),
            serving_refresh: std::sync::Mutex::new(()),
        });
        let _initial = service.serving.send_replace(service.evaluate_serving());
        if service.raft.is_some() {
            tasks.spawn(service.clone().stand_for_election(shutdown.clone()));
            tasks.spawn(service.clone().detect_failures(shutdown.clone()));
            tasks.spawn(service.clone().keep_joined(shutdown.clone()));
            tasks.spawn(service.clone().watch_serving(shutdown.clone()));
            if service.needs_lease() {
                tasks.spawn(service.clone().keep_lease(shutdown.clone()));
            }
            let stopping = service.clone();
            tasks.spawn(async move {
                shutdown.cancelled().await;
                if let Some(raft) = &stopping.raft {
                    let _ = raft.shutdown().await;
                }
            });
        }
        Ok(service)
    }

    /// The leader this node knows of.
    fn leader(&self) -> Option<u32> {
        match &self.raft {
            None => Some(self.node_id),
            Some(raft) => {
                let metrics = raft.metrics();
                let metrics = metrics.borrow();
                // A Raft that stopped on a fatal error knows no leader.
                if metrics.running_state.is_err() {
                    return None;
                }
                metrics
                    .current_leader
                    .and_then(|leader| u32::try_from(leader).ok())
            }
        }
    }

    /// Why a peer's Raft message is refused before Raft sees it, if it is: its sender is not a
    /// member, or its term is implausibly far ahead of this node's. Raft trusts terms; a
    /// message with term 2^64 - 1 would leave no term to elect a leader in, for good (found by
    /// attack: the term is persisted).
    fn refuse_vote(
        &self,
        raft: &Raft<TypeConfig>,
        vote: &openraft::Vote<PeerId>,
        terms: &[u64],
    ) -> Option<String> {
        let sender = vote.leader_id.node_id;
        if !u32::try_from(sender).is_ok_and(|sender| self.is_member(sender)) {
            return Some(format!("node {sender} is not a member of this cluster"));
        }
        let current = raft.metrics().borrow().current_term;
        let term = vote.leader_id.term;
        if term > current.saturating_add(MAX_TERM_JUMP) {
            return Some(format!(
                "term {term} is more than {MAX_TERM_JUMP} ahead of this node's ({current})"
            ));
        }
        if terms.iter().any(|log_term| *log_term > term) {
            return Some("a log entry's term is ahead of the message's".into());
        }
        None
    }

    /// The view as this node knows it.
    pub fn current(&self) -> ClusterView {
        if self.raft.is_none() {
            return ClusterView {
                epoch: 1,
                leader: Some(self.node_id),
                members: vec![ViewMember {
                    node_id: self.node_id,
                    state: MemberState::Serving,
                }],
                losses: Vec::new(),
            };
        }
        let leader = self.leader();
        self.view.borrow().public(leader)
    }

    /// The epoch of the view this node knows.
    pub fn epoch(&self) -> u64 {
        match &self.raft {
            None => 1,
            Some(_) => self.view.borrow().epoch,
        }
    }

    /// The view's figures for the node's stats: epoch, leader (0: none), members down, views
    /// this node committed as leader.
    pub fn figures(&self) -> (u64, u32, u64, u64) {
        let view = self.current();
        let down = view
            .members
            .iter()
            .filter(|member| member.state == MemberState::Down)
            .count() as u64;
        (
            view.epoch,
            view.leader.unwrap_or(0),
            down,
            self.committed.load(Ordering::Relaxed),
        )
    }

    /// Serves one message from a peer node; the answer is encoded for its `Peer` reply.
    pub async fn handle_peer(&self, payload: &[u8]) -> Vec<u8> {
        let reply = match (bincode::deserialize::<PeerRequest>(payload), &self.raft) {
            (Err(error), _) => PeerReply::Malformed(error.to_string()),
            (Ok(_), None) => PeerReply::Malformed("a one-node cluster runs no consensus".into()),
            (Ok(request), Some(raft)) => self.answer_peer(raft, request).await,
        };
        Self::encode(&reply)
    }

    /// The answer to one peer message: Raft's own go to Raft, once [`Self::refuse_vote`] let
    /// them through; the view's to the service.
    async fn answer_peer(&self, raft: &Raft<TypeConfig>, request: PeerRequest) -> PeerReply {
        match request {
            PeerRequest::AppendEntries(request) => self.answer_append_entries(raft, request).await,
            PeerRequest::Vote(request) => {
                let terms: Vec<u64> = request
                    .last_log_id
                    .map(|log_id| log_id.leader_id.term)
                    .into_iter()
                    .collect();
                if let Some(reason) = self.refuse_vote(raft, &request.vote, &terms) {
                    return PeerReply::Malformed(reason);
                }
                PeerReply::Vote(raft.vote(request).await)
            }
            PeerRequest::InstallSnapshot(request) => {
                if let Some(reason) = self.refuse_vote(raft, &request.vote, &[]) {
                    return PeerReply::Malformed(reason);
                }
                PeerReply::InstallSnapshot(raft.install_snapshot(request).await)
            }
            PeerRequest::Join {
                node_id,
                incarnation,
            } => PeerReply::Join(self.answer_join(node_id, incarnation).await),
            PeerRequest::Lease { node_id, epoch } => self.grant_lease(node_id, epoch),
            request @ (PeerRequest::Stop
            | PeerRequest::Resume { .. }
            | PeerRequest::PromoteResumed { .. }
            | PeerRequest::PromoteFilling
            | PeerRequest::PromoteReconciled { .. }
            | PeerRequest::AcknowledgeLosses { .. }) => self.answer_stop_request(request).await,
            PeerRequest::Leave {
                node_id,
                incarnation,
            } => self.commit_leave(node_id, incarnation).await,
            PeerRequest::ChangeMembership(change) => {
                PeerReply::Join(self.lead_membership_change(change).await)
            }
            PeerRequest::RemoveMember {
                node_id,
                incarnation,
                handed_over_at,
            } => PeerReply::Join(
                self.lead_removal(node_id, incarnation, Some(handed_over_at))
                    .await,
            ),
            PeerRequest::PreVote {
                node_id,
                last_log_id,
            } => self.grant_pre_vote(node_id, last_log_id).await,
            PeerRequest::Promote {
                node_id,
                incarnation,
                filling_since,
            } => {
                if !self.is_member(node_id) {
                    return PeerReply::Join(Err(format!(
                        "node {node_id} is not a member of this cluster"
                    )));
                }
                PeerReply::Join(
                    self.commit_promotion(node_id, incarnation, filling_since)
                        .await,
                )
            }
        }
    }

    /// Hands the leader's entries (or heartbeat) to Raft, unless [`Self::refuse_vote`] refuses
    /// them; one that Raft accepts is a sign that the leader is alive.
    async fn answer_append_entries(
        &self,
        raft: &Raft<TypeConfig>,
        request: openraft::raft::AppendEntriesRequest<TypeConfig>,
    ) -> PeerReply {
        let terms: Vec<u64> = request
            .entries
            .iter()
            .map(|entry| entry.log_id.leader_id.term)
            .chain(request.prev_log_id.map(|log_id| log_id.leader_id.term))
            .collect();
        if let Some(reason) = self.refuse_vote(raft, &request.vote, &terms) {
            return PeerReply::Malformed(reason);
        }
        let outcome = raft.append_entries(request).await;
        if outcome.as_ref().is_ok_and(|response| response.is_success()) {
            // Only the leader sends entries: it is alive.
            if let Some(leader) = self.leader() {
                self.liveness.heard(leader);
            }
        }
        PeerReply::AppendEntries(outcome)
    }

    /// On the leader: commits a member's join, and answers with the epoch of a view that has
    /// it as `incarnation`, or why not.
    async fn answer_join(
        &self,
        node_id: u32,
        incarnation: u64,
    ) -> std::result::Result<u64, String> {
        if !self.is_member(node_id) {
            return Err(format!("node {node_id} is not a member of this cluster"));
        }
        // A node that cannot hear the leader could not apply its join (`lease.rs`).
        if let Some(reason) = self.missed_heartbeats(node_id) {
            return Err(reason);
        }
        // A node asking to join is alive, whatever the heartbeats' last answer says, and is
        // counted as if it had asked for a lease: it holds none (its view has it down, or it
        // restarted), and its first request comes only once it has applied the join; counted
        // from its last request before, it was committed down again at once, over and over.
        self.liveness.heard(node_id);
        self.liveness.lease_requested(node_id);
        if let Some(epoch) = self.back_as(node_id, incarnation) {
            // Already in the view (the joiner has not applied it yet): nothing to log, so a
            // node that keeps asking never grows the log.
            return Ok(epoch);
        }
        self.commit(ViewCommand::Join {
            node_id,
            incarnation,
        })
        .await
    }

    /// The epoch of the view this node knows, if it has `node_id` back as `incarnation`
    /// (serving or filling): a join or resume asked again needs no new log entry.
    fn back_as(&self, node_id: u32, incarnation: u64) -> Option<u64> {
        let view = self.view.borrow();
        view.members
            .get(&node_id)
            .is_some_and(|record| {
                record.state != MemberState::Down && record.incarnation == incarnation
            })
            .then_some(view.epoch)
    }

    /// A reply, encoded for its `Peer` frame.
    fn encode(reply: &PeerReply) -> Vec<u8> {
        bincode::serialize(reply).unwrap_or_default()
    }

    /// Commits `command` through Raft on this node (the leader), within the failure timeout.
    async fn commit(&self, command: ViewCommand) -> std::result::Result<u64, String> {
        let Some(raft) = &self.raft else {
            return Err("a one-node cluster runs no consensus".into());
        };
        let timeout = self.failure_timeout.max(MIN_FAILURE_TIMEOUT);
        let written = tokio::select! {
            _ = self.shutdown.cancelled() => return Err("the node is stopping".into()),
            written = tokio::time::timeout(timeout, raft.client_write(command.clone())) => written,
        };
        match written {
            Err(_) => Err(format!(
                "not committed within {timeout:?} (no quorum of nodes answering?)"
            )),
            Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(forward)))) => {
                Err(format!(
                    "node {} is not the leader ({:?} is)",
                    self.node_id, forward.leader_id
                ))
            }
            Ok(Err(error)) => Err(error.to_string()),
            Ok(Ok(written)) => {
                self.committed.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    node = self.node_id,
                    ?command,
                    epoch = written.data.epoch,
                    "view committed"
                );
                Ok(written.data.epoch)
            }
        }
    }

    /// On every node: while the view does not have this node as this incarnation (serving, or
    /// filling after a restart or an absence), asks the leader to commit its join.
    async fn keep_joined(self: Arc<Self>, shutdown: CancellationToken) {
        let mut ticks = tokio::time::interval(HEARTBEAT_INTERVAL * 2);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticks.tick() => {}
            }
            let joined = self.own_record().is_some_and(|record| {
                record.state != MemberState::Down && record.incarnation == self.incarnation
            });
            // A node the whole cluster's stop took down stays down until it exits: its final
            // snapshot names the stop, and its next process resumes from it (`stop.rs`).
            if joined || self.stop_applied_here().is_some() || self.removed() {
                continue;
            }
            let (command, request) = self.join_command();
            if let Err(reason) = self.ask_leader_to_commit(command, &request).await {
                if reason.contains("not a member") {
                    self.say_removed(&reason);
                }
                tracing::debug!(node = self.node_id, %reason, "join not committed yet");
            }
        }
    }

    /// This node's record in the view it knows.
    fn own_record(&self) -> Option<types::MemberRecord> {
        self.view.borrow().members.get(&self.node_id).copied()
    }

    /// Whether this node is filling as this incarnation (its refill's turn).
    pub fn filling(&self) -> bool {
        self.filling_round().is_some()
    }

    /// Whether this node is filling while no member serves: every node came back after a stop
    /// or crash of all of them, and the filling members reconcile their copies before any of
    /// them serves (`crate::reconcile`). Nobody but their reconciliation reads or writes then.
    pub fn reconciling(&self) -> bool {
        self.filling()
            && !self
                .view
                .borrow()
                .members
                .values()
                .any(|record| record.state.serves_data())
    }

    /// While this node is filling as this incarnation: the epoch its record became `filling`,
    /// which names this round of filling (a node marked down and back fills again, a new
    /// round, and must be refilled again).
    pub fn filling_round(&self) -> Option<u64> {
        self.own_record()
            .filter(|record| {
                record.state == MemberState::Filling && record.incarnation == self.incarnation
            })
            .map(|record| record.since)
    }

    /// On the leader, before it commits a promotion: `Some(epoch)` if the node already serves
    /// as `incarnation`, `None` if it fills as `incarnation` since `filling_since` (the
    /// promotion is due), and an error if it is in another round or state (a refill of an
    /// earlier round: the node was down since). Applying the command checks the same.
    fn promotion_due(
        &self,
        node_id: u32,
        incarnation: u64,
        filling_since: u64,
    ) -> std::result::Result<Option<u64>, String> {
        let view = self.view.borrow();
        match view.members.get(&node_id) {
            Some(record)
                if record.state == MemberState::Serving && record.incarnation == incarnation =>
            {
                Ok(Some(view.epoch))
            }
            Some(record)
                if record.state == MemberState::Filling
                    && record.incarnation == incarnation
                    && record.since == filling_since =>
            {
                Ok(None)
            }
            Some(record) => Err(format!(
                "node {node_id} is not filling since epoch {filling_since} as this process: the view (epoch {}) has it {:?} since epoch {}",
                view.epoch, record.state, record.since
            )),
            None => Err(format!("node {node_id} is not a member of this cluster")),
        }
    }

    /// On the leader: commits a promotion that is due, and answers with the epoch once the
    /// view has the node serving, or why not (a promotion that changed nothing is an error,
    /// so the node does not think itself promoted).
    async fn commit_promotion(
        &self,
        node_id: u32,
        incarnation: u64,
        filling_since: u64,
    ) -> std::result::Result<u64, String> {
        if let Some(epoch) = self.promotion_due(node_id, incarnation, filling_since)? {
            return Ok(epoch);
        }
        self.commit(ViewCommand::Promote {
            node_id,
            incarnation,
            filling_since,
        })
        .await?;
        match self.promotion_due(node_id, incarnation, filling_since)? {
            Some(epoch) => Ok(epoch),
            None => Err(format!(
                "the promotion of node {node_id} is committed but not applied here yet"
            )),
        }
    }

    /// Asks the leader to commit this node's promotion (filling → serving) for the filling
    /// round `filling_since`, whose refill is complete. The epoch after it, or why not.
    pub async fn promote(&self, filling_since: u64) -> std::result::Result<u64, String> {
        if self.leader() == Some(self.node_id) {
            return self
                .commit_promotion(self.node_id, self.incarnation, filling_since)
                .await;
        }
        let command = ViewCommand::Promote {
            node_id: self.node_id,
            incarnation: self.incarnation,
            filling_since,
        };
        let request = PeerRequest::Promote {
            node_id: self.node_id,
            incarnation: self.incarnation,
            filling_since,
        };
        self.ask_leader_to_commit(command, &request).await
    }

    /// Commits `command` if this node leads, else sends `request` to the leader.
    async fn ask_leader_to_commit(
        &self,
        command: ViewCommand,
        request: &PeerRequest,
    ) -> std::result::Result<u64, String> {
        let Some(leader) = self.leader() else {
            return Err("no leader".into());
        };
        if leader == self.node_id {
            return self.commit(command).await;
        }
        let Some(address) = self.address_of(leader) else {
            return Err(format!("the leader {leader} is not a member"));
        };
        let asked = tokio::select! {
            _ = self.shutdown.cancelled() => return Err("the node is stopping".into()),
            asked = ask_leader(leader, address, self.secret.clone(), request, self.failure_timeout) => asked,
        };
        match asked {
            Ok(PeerReply::Join(outcome)) => outcome,
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(reason) => Err(reason),
        }
    }

    /// The applied view as it changes; `None` in a one-node cluster (its view never changes).
    pub fn subscribe(&self) -> Option<tokio::sync::watch::Receiver<types::ViewState>> {
        self.raft.as_ref().map(|_| self.view.clone())
    }
}

/// Creates this node's Raft, on a first start (no vote, no log) with every node as a voter
/// (`Store::initialize`). Every node does the same with the same membership, which Raft
/// allows.
async fn start_raft(
    settings: &ViewSettings,
    store: Store,
    secret: Arc<[u8]>,
    liveness: Arc<Liveness>,
) -> Result<Raft<TypeConfig>> {
    let consensus = |reason: String| Error::Consensus { reason };
    let config = openraft::Config {
        cluster_name: "rdkv".into(),
        heartbeat_interval: HEARTBEAT_INTERVAL.as_millis() as u64,
        election_timeout_min: ELECTION_TIMEOUT_MILLISECONDS.0,
        election_timeout_max: ELECTION_TIMEOUT_MILLISECONDS.1,
        // The log is a handful of entries per failure: never compacted.
        snapshot_policy: SnapshotPolicy::Never,
        // Elections start only after a pre-vote that a majority answered yes (`election.rs`):
        // openraft's own timer would raise the term of a node that merely came back, and the
        // live leader would step down.
        enable_elect: false,
        ..openraft::Config::default()
    }
    .validate()
    .map_err(|error| consensus(error.to_string()))?;
    if !store.has_history() && !settings.joining {
        let members: BTreeMap<PeerId, BasicNode> = settings
            .members
            .iter()
            .map(|(id, address)| (PeerId::from(*id), BasicNode::new(address.to_string())))
            .collect();
        store
            .initialize(members)
            .map_err(|error| consensus(error.to_string()))?;
    }
    let (log_store, state_machine) = Adaptor::new(store);
    let network = Network {
        addresses: Arc::new(settings.members.iter().copied().collect()),
        secret,
        liveness,
    };
    let raft = Raft::new(
        PeerId::from(settings.node_id),
        Arc::new(config),
        network,
        log_store,
        state_machine,
    )
    .await
    .map_err(|error| consensus(error.to_string()))?;
    Ok(raft)
}
