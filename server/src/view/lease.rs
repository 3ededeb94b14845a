//! Whether this node may serve data now (`docs/protocol.md`, *Views and fencing*): a node
//! serves only while it holds a **lease** from the cluster's majority, and, after a restart,
//! only once the view has its rejoin. A node that loses either fences every data connection
//! and refuses new ones until it has both again.
//!
//! The lease is what stops a node that is alive but cut off (partitioned, or paused) before a
//! view without it is used:
//! - **a follower** asks the leader for its lease every 50 ms. A grant lasts
//!   `lease = 9/10 × failure_timeout` from when the follower *sent* its request, and never past
//!   the leader's own lease. The leader records the request as a sign of life when it
//!   arrives, after it was sent, so the leader commits the follower down (`failure_timeout`
//!   of silence) only after the follower's lease ran out. A grant names the leader's view
//!   epoch, and counts only on a follower that has applied that view: a node back from a cut
//!   reaches the leader before its log catches up, and must not serve by its old view (found
//!   by the partition test: it served a replaced value from a view that had it serving). A
//!   follower that has accepted none of the leader's heartbeats for `failure_timeout` gets no
//!   grant either: it cannot follow the view, and its pre-vote cannot unseat the leader
//!   (`election.rs`), so it must leave the view.
//! - **the leader** holds its lease from when it sent the newest heartbeat that a majority
//!   accepted. Every such majority includes a node that voted for the next leader, and a
//!   follower refuses to vote for `election_timeout_max` after it last accepted a leader
//!   (openraft's leader lease); a new leader counts the old leader's silence from no earlier
//!   than that before its election
//!   (`ViewService::old_leader_lease_floor`): so the old leader's lease has run out before
//!   the new leader can commit it down. The one voter that may not refuse is the old leader
//!   itself (openraft's leader votes for a newer term once it has led that long), so a node
//!   that stops leading drops the lease it held as the leader at once.
//! - **the decision to commit a member down** and a lease grant take one lock: the leader
//!   grants nothing to a member it is committing down, until its view has it down.
//!
//! Only a cluster of three or more nodes needs leases: with two, no majority exists without
//! this node, so no view without it can be committed while it lives.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkv_common::protocol::MemberState;
use rdkv_fabric::lock;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use super::network::PeerClient;
use super::types::{LeaseGrant, PeerReply, PeerRequest};
use super::{ViewService, HEARTBEAT_INTERVAL};

/// How often a follower asks the leader for its lease: half a heartbeat interval, so that
/// after an election the new leader's first grant comes soon.
const LEASE_REQUEST_INTERVAL: Duration = Duration::from_millis(50);

/// How often the node checks whether it may still serve.
const SERVING_CHECK_INTERVAL: Duration = Duration::from_millis(20);

/// Whether the node serves data: `Ok`, or why not (a line for logs and for the client).
pub type Serving = Result<(), String>;

/// Why a node does not serve data, as [`ViewService::watch_serving`] counts its stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StopCause {
    /// It leaves, or its view does not have it serving as this process.
    View,
    /// A step of a membership change or a refill: it handed its keys over and waits for its
    /// removal, or it was promoted and waits for every member to apply that view.
    Planned,
    /// It holds no lease: none came from the majority in time, or it dropped the one it held
    /// as the leader when it stopped leading (`rdkv_lease_lapses_total`).
    Lease,
}

impl ViewService {
    /// The lease's length for a failure timeout: a grant ends this long after it was asked
    /// for, well before the leader can commit the node down.
    pub(super) fn lease_for(failure_timeout: Duration) -> Duration {
        failure_timeout * 9 / 10
    }

    /// Whether this node may serve data now, and if not, why.
    pub fn serving(&self) -> Serving {
        self.serving.borrow().clone()
    }

    /// Whether this node may serve data at this instant, worked out from its lease's expiry now
    /// ([`ViewService::serving`] is the last periodic check's, up to 20 ms old, and older
    /// still right after the process was paused). For work that must not outlive the lease:
    /// the sweep of extra copies checks it before each removal.
    pub fn serving_now(&self) -> Serving {
        self.evaluate_serving()
    }

    /// The node's serving state as it changes (fencing reads it).
    pub fn serving_changes(&self) -> tokio::sync::watch::Receiver<Serving> {
        self.serving.subscribe()
    }

    /// How many times this node stopped serving data since it started.
    pub fn serving_stops(&self) -> u64 {
        self.serving_stops.load(Ordering::Relaxed)
    }

    /// How many of [`Self::serving_stops`] were for want of a lease.
    pub fn lease_lapses(&self) -> u64 {
        self.lease_lapses.load(Ordering::Relaxed)
    }

    /// Whether this node may serve data, from its view and its lease. A lease held as the
    /// leader ends here when the node no longer leads.
    pub(super) fn evaluate_serving(&self) -> Serving {
        self.serving_with_cause().map_err(|(_, reason)| reason)
    }

    /// [`Self::evaluate_serving`], with the cause of a refusal: the view's first, then the
    /// lease's.
    fn serving_with_cause(&self) -> Result<(), (StopCause, String)> {
        self.planned_standing()
            .map_err(|reason| (StopCause::Planned, reason))?;
        self.view_standing()
            .map_err(|reason| (StopCause::View, reason))?;
        self.lease_standing()
            .map_err(|reason| (StopCause::Lease, reason))
    }

    /// Whether a step of a membership change or a refill keeps this node from serving for a
    /// moment (`membership.rs`).
    fn planned_standing(&self) -> Serving {
        if let Some(round) = self.handed_over_round() {
            return Err(format!(
                "this node handed its keys over and leaves the cluster view (leaving since epoch {round}): it serves nothing until the view without it"
            ));
        }
        if let Some(epoch) = self.unconfirmed_promotion() {
            return Err(format!(
                "promoted at epoch {epoch}: it serves once every member applied that view (a client of an older view could read a key's former primary meanwhile)"
            ));
        }
        Ok(())
    }

    /// Whether the view lets this node serve: it is not leaving, and the view has it serving
    /// as this process. A lease held as the leader ends here when the node no longer leads.
    fn view_standing(&self) -> Serving {
        if self.leaving.load(Ordering::Acquire) {
            return Err("this node is leaving the cluster (a clean stop)".into());
        }
        if self.raft.is_none() {
            return Ok(());
        }
        self.end_leader_lease_if_stepped_down();
        let epoch = self.epoch();
        match self.own_record() {
            None => return Err("this node is not in its own cluster view".into()),
            Some(record) if record.state == MemberState::Down => {
                return Err(format!(
                    "the cluster view (epoch {epoch}) has this node down; it rejoins (refilled from its peers, or resumed with its peers after a stop of the whole cluster) before it serves"
                ))
            }
            Some(record)
                if record.incarnation != self.incarnation
                    && (record.incarnation != 0 || self.had_history) =>
            {
                return Err(format!(
                    "this node restarted and the cluster view (epoch {epoch}) does not have its rejoin yet; it is refilled before it serves"
                ))
            }
            Some(_) => {}
        }
        Ok(())
    }

    /// Whether this node holds a lease, where it needs one (a lease it held as the leader was
    /// ended by [`Self::view_standing`] if it no longer leads).
    fn lease_standing(&self) -> Serving {
        if self.needs_lease() {
            let until = *lock(&self.lease_until);
            if until.is_none_or(|until| until <= Instant::now()) {
                return Err(format!(
                    "no lease: this node has not reached a majority of the cluster's nodes within {:?} (cut off, or the cluster is electing a leader)",
                    self.lease
                ));
            }
        }
        Ok(())
    }

    /// Whether a majority of the members exists without this node (three or more).
    pub(super) fn needs_lease(&self) -> bool {
        self.member_ids().len() >= 3
    }

    /// A leader's lease rests on heartbeats that a majority accepted, and a new leader counts
    /// the old one's silence from `election_timeout_max` before its election, since a voter
    /// refuses votes that long after it accepted a heartbeat. The old leader itself does not:
    /// openraft's leader grants a vote for a newer term once it has led that long, so the
    /// voters of the next leader may be the old leader and a node that never heard it lately.
    /// A node that stopped leading (it voted, or saw a newer term) therefore drops the lease
    /// it held as the leader at once, and serves again only on a grant from the new leader.
    fn end_leader_lease_if_stepped_down(&self) {
        if !self.lease_as_leader.load(Ordering::Acquire) || self.leader() == Some(self.node_id) {
            return;
        }
        let mut lease = lock(&self.lease_until);
        // Checked again under the lock: keep_lease sets both under it.
        if self.lease_as_leader.swap(false, Ordering::AcqRel) {
            *lease = None;
            self.lease_drops.fetch_add(1, Ordering::AcqRel);
            tracing::info!(
                node = self.node_id,
                "no longer the leader: its lease as the leader ends"
            );
        }
    }

    /// Extends this node's lease to `until`, if that is later; `as_leader`: a lease held as
    /// the leader, which ends when the node stops leading (set under the lease's lock).
    fn extend_lease(&self, until: Instant, as_leader: bool) {
        {
            let mut lease = lock(&self.lease_until);
            if lease.is_none_or(|current| current < until) {
                *lease = Some(until);
            }
            if as_leader {
                self.lease_as_leader.store(true, Ordering::Release);
            }
        }
        self.publish_lease();
    }

    /// On the leader: when its own lease ends, from the newest heartbeat a majority accepted.
    pub(super) fn leader_lease_until(&self) -> Option<Instant> {
        if self.leader() != Some(self.node_id) {
            return None;
        }
        self.quorum_accepted().map(|accepted| accepted + self.lease)
    }

    /// On the leader: when it sent the newest heartbeat that a majority (itself included)
    /// accepted.
    pub(super) fn quorum_accepted(&self) -> Option<Instant> {
        let members = self.member_ids();
        let quorum = members.len() / 2 + 1;
        let peers: Vec<u32> = members
            .into_iter()
            .filter(|id| *id != self.node_id)
            .collect();
        self.liveness.quorum_accepted(&peers, quorum)
    }

    /// On the leader of a cluster of three or more: why `node_id`'s requests (for a lease, or
    /// to join) are no sign of life, if it has accepted none of this leader's heartbeats for
    /// the failure timeout. It missed them, whatever its requests say: it cannot follow the
    /// view, and its pre-vote finds the others hearing this leader (`election.rs`), so it
    /// cannot take over either. Its requests get no grant and no join: it stops serving and
    /// leaves the view (found by attack: before the pre-vote, such a follower won an election
    /// with the old leader's vote; with it, it stayed in the view, kept alive by its lease or
    /// join requests, unable to learn the next view).
    pub(super) fn missed_heartbeats(&self, node_id: u32) -> Option<String> {
        if !self.needs_lease() || self.leader() != Some(self.node_id) {
            return None;
        }
        self.liveness
            .last_accepted(node_id)
            .is_none_or(|sent| sent.elapsed() > self.failure_timeout)
            .then(|| {
                format!(
                    "node {node_id} has accepted none of the leader's heartbeats within {:?}",
                    self.failure_timeout
                )
            })
    }

    /// On the leader: a follower's lease request, from a follower that applied the view of
    /// `epoch`. From a follower as current as the leader, it is a sign of life (recorded as it
    /// arrives); the grant is the leader's own lease's remaining time. A follower behind gets
    /// none and counts as silent: the leader's messages do not reach it (found by attack: a
    /// follower deaf to the leader kept asking, and stayed in the view 2.7 s, its keys
    /// unserved).
    pub(super) fn grant_lease(&self, node_id: u32, epoch: u64) -> PeerReply {
        if !self.is_member(node_id) {
            return PeerReply::Lease(Err(format!(
                "node {node_id} is not a member of this cluster"
            )));
        }
        if self.leader() != Some(self.node_id) {
            return PeerReply::Lease(Err(format!("node {} is not the leader", self.node_id)));
        }
        if epoch < self.epoch() {
            return PeerReply::Lease(Err(format!(
                "node {node_id}'s view (epoch {epoch}) is behind the leader's (epoch {})",
                self.epoch()
            )));
        }
        if let Some(reason) = self.missed_heartbeats(node_id) {
            return PeerReply::Lease(Err(reason));
        }
        // Under the lock the failure detector decides under: no grant to a member it is
        // committing down.
        let pending = self.pending_down_lock();
        self.liveness.lease_requested(node_id);
        if pending.contains_key(&node_id) {
            return PeerReply::Lease(Err(format!(
                "node {node_id} is being committed down: it rejoins and is refilled first"
            )));
        }
        let now = Instant::now();
        match self.leader_lease_until() {
            Some(until) if until > now => PeerReply::Lease(Ok(LeaseGrant {
                remaining_ms: (until - now).as_millis() as u64,
                epoch: self.epoch(),
            })),
            _ => PeerReply::Lease(Err("the leader holds no lease: it hears no majority".into())),
        }
    }

    /// On every node of a cluster of three or more: renews this node's lease every 50 ms (the
    /// leader from its majority's answers, a follower by asking the leader).
    pub(super) async fn keep_lease(self: Arc<Self>, shutdown: CancellationToken) {
        let mut ticks = tokio::time::interval(LEASE_REQUEST_INTERVAL);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut client: Option<PeerClient> = None;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticks.tick() => {}
            }
            let Some(leader) = self.leader() else {
                continue;
            };
            if leader == self.node_id {
                if let Some(until) = self.leader_lease_until() {
                    self.extend_lease(until, true);
                }
                continue;
            }
            let Some(address) = self.address_of(leader) else {
                continue;
            };
            if client
                .as_ref()
                .is_none_or(|client| client.target() != leader)
            {
                client = Some(PeerClient::to(leader, address, self.secret.clone()));
            }
            let Some(client) = client.as_mut() else {
                continue;
            };
            let sent = Instant::now();
            let request = PeerRequest::Lease {
                node_id: self.node_id,
                epoch: self.epoch(),
            };
            let asked = tokio::select! {
                _ = shutdown.cancelled() => return,
                asked = client.ask(&request, HEARTBEAT_INTERVAL * 3) => asked,
            };
            match asked {
                Ok(PeerReply::Lease(Ok(grant))) if grant.epoch > self.epoch() => {
                    // Behind the leader's view (back from a cut, its log still catching up):
                    // no lease until it has applied that view, which may have it down.
                    tracing::debug!(
                        node = self.node_id,
                        leader,
                        epoch = self.epoch(),
                        leader_epoch = grant.epoch,
                        "lease not renewed: this node's view is behind the leader's"
                    );
                }
                Ok(PeerReply::Lease(Ok(grant))) => {
                    let granted = self.lease.min(Duration::from_millis(grant.remaining_ms));
                    self.extend_lease(sent + granted, false);
                }
                Ok(PeerReply::Lease(Err(reason))) | Err(reason) => {
                    tracing::debug!(node = self.node_id, leader, %reason, "lease not renewed");
                }
                Ok(other) => {
                    tracing::debug!(node = self.node_id, leader, ?other, "lease not renewed");
                }
            }
        }
    }

    /// On every node of a cluster: publishes whether it serves data, as its view and lease
    /// change, and logs each change.
    pub(super) async fn watch_serving(self: Arc<Self>, shutdown: CancellationToken) {
        let mut ticks = tokio::time::interval(SERVING_CHECK_INTERVAL);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticks.tick() => {}
            }
            self.refresh_serving();
        }
    }

    /// Writes the lease word and, when whether the node serves changed, says so to the data
    /// path (which fences every data connection when it stops) and logs it.
    pub(super) fn refresh_serving(&self) {
        // One caller at a time: the periodic check and a hand-over's stop would otherwise both
        // count and log one change.
        let _refreshing = lock(&self.serving_refresh);
        self.publish_lease();
        let now = self.serving_with_cause();
        if now.is_ok() == self.serving.borrow().is_ok() {
            return;
        }
        self.note_serving_change(now.as_ref().err().map(|(cause, _)| *cause));
        match &now {
            Ok(()) => tracing::info!(node = self.node_id, "serving data"),
            Err((StopCause::Planned, reason)) => {
                tracing::info!(node = self.node_id, %reason, "not serving data for a moment: data connections fenced, new ones refused");
            }
            Err((cause, reason)) => {
                self.serving_stops.fetch_add(1, Ordering::Relaxed);
                if *cause == StopCause::Lease {
                    self.lease_lapses.fetch_add(1, Ordering::Relaxed);
                }
                tracing::warn!(
                    node = self.node_id,
                    %reason,
                    "stopped serving data: data connections fenced, new ones refused"
                );
            }
        }
        let _previous = self.serving.send_replace(now.map_err(|(_, reason)| reason));
    }
}
