//! Membership changes (`docs/protocol.md`, *Membership changes*): who the members are and
//! where they listen, and the leader's side of `rdkv-cluster add-node` and `remove-node`.
//!
//! - **Adding** node `N` (running, started with `--join`): the leader makes it a Raft
//!   learner (it catches up on the whole log, and so learns the view), commits
//!   [`ViewCommand::AddMember`] (a member `down`, never served), then makes it a voter with
//!   openraft's joint consensus (`change_membership`). The node's join loop then asks for its
//!   join, which makes it filling; it is refilled and promoted as a restarted node is.
//! - **Removing** member `N`: the leader commits [`ViewCommand::Retire`] (`N` leaving, still
//!   serving); `N`'s hand-over (`crate::handover`) copies its keys to the members that stay and
//!   asks for [`ViewCommand::RemoveMember`], which the leader commits before it takes `N` out
//!   of Raft's voters.
//!
//! One change runs at a time: the leader refuses another while a member joins or leaves.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use openraft::{BasicNode, ChangeMembers};
use rdkv_common::protocol::{
    fetch_stats, fetch_view, MemberState, MembershipChange, MonitoredNode,
};

use super::types::{PeerId, PeerRequest, ViewCommand};
use super::ViewService;

/// How long the leader gives each Raft step of a membership change (a learner catching up on
/// the log, a joint configuration committing).
const RAFT_STEP_WITHIN: Duration = Duration::from_secs(15);

/// How long, beyond twice `failure_timeout`, the leader waits for the members' sweeps before
/// it retires a member.
const SWEEPS_WITHIN: Duration = Duration::from_secs(20);

/// How a leader's refusal of a removal starts when the view moved since the hand-over.
pub const VIEW_MOVED: &str = "the view moved since the hand-over";

/// How long one member gets to answer with its view.
const MEMBER_VIEW_WITHIN: Duration = Duration::from_millis(500);

/// How often a node asks the members behind for their view again.
const MEMBER_VIEW_POLL: Duration = Duration::from_millis(20);

/// How often the leader asks the members how far they swept.
const SWEEP_POLL: Duration = Duration::from_millis(100);

impl ViewService {
    /// Whether `node_id` is a member: of the view, or, before this node has any view (it joins
    /// and has not caught up on the log yet), of its cluster file.
    pub(super) fn is_member(&self, node_id: u32) -> bool {
        let view = self.view.borrow();
        if view.members.is_empty() {
            return self.configured_addresses.contains_key(&node_id);
        }
        view.members.contains_key(&node_id)
    }

    /// The members' ids, as [`Self::is_member`] counts them.
    pub(super) fn member_ids(&self) -> Vec<u32> {
        let view = self.view.borrow();
        if view.members.is_empty() {
            return self.configured_addresses.keys().copied().collect();
        }
        view.members.keys().copied().collect()
    }

    /// The members' control addresses (those that can be found: [`Self::address_of`]).
    pub(super) fn member_addresses(&self) -> BTreeMap<u32, SocketAddr> {
        self.member_ids()
            .into_iter()
            .filter_map(|node_id| Some((node_id, self.address_of(node_id)?)))
            .collect()
    }

    /// Where member `node_id` listens: as this node's cluster file says, else as Raft's
    /// membership says (a member added after this node started).
    pub(super) fn address_of(&self, node_id: u32) -> Option<SocketAddr> {
        if let Some(address) = self.configured_addresses.get(&node_id) {
            return Some(*address);
        }
        let raft = self.raft.as_ref()?;
        let metrics = raft.metrics();
        let metrics = metrics.borrow();
        metrics
            .membership_config
            .membership()
            .get_node(&PeerId::from(node_id))
            .and_then(|node| node.addr.parse().ok())
    }

    /// Says, once, that the members refuse this node as a member (`reason`, their answer to its
    /// join or pre-vote): it was removed from the view (perhaps while it was down), the view it
    /// loaded is an old membership's, and it serves nothing.
    pub(super) fn say_removed(&self, reason: &str) {
        // A node that joins (`--join`) is refused the same way until the leader adds it: its
        // own view does not name it yet.
        if self.own_record().is_none() {
            return;
        }
        if !self.said_removed.swap(true, Ordering::AcqRel) {
            tracing::error!(
                node = self.node_id,
                %reason,
                "the members refuse this node: it was removed from the cluster's view, and serves nothing; add it back as a new member with `rdkv-cluster add-node FILE --node {}` (after removing its view state and snapshot)",
                self.node_id
            );
        }
    }

    /// Whether the view had this node as a member and no longer does: it was removed, and asks
    /// for no join.
    pub(super) fn removed(&self) -> bool {
        if self.own_record().is_some() {
            self.was_member.store(true, Ordering::Release);
            return false;
        }
        self.was_member.load(Ordering::Acquire)
    }

    /// While this node is leaving as this incarnation: the epoch its record became `leaving`
    /// (its hand-over's round).
    pub fn leaving_round(&self) -> Option<u64> {
        self.own_record()
            .filter(|record| {
                record.state == MemberState::Leaving && record.incarnation == self.incarnation
            })
            .map(|record| record.since)
    }

    /// After its hand-over for the leaving round `round`: the node stops serving data (its
    /// lease word reads 0 and its data connections are fenced) before it asks for its removal.
    /// Otherwise it would serve, to clients still routing by the view that has it leaving,
    /// until it applied the view without it, while writers of that view no longer reach it.
    /// It serves nothing again while the view has it leaving in that round.
    pub fn stop_serving_for_removal(&self, round: u64) {
        self.handed_over.store(round, Ordering::Release);
        self.refresh_serving();
    }

    /// The leaving round whose hand-over this node finished, while the view still has it
    /// leaving in that round ([`Self::stop_serving_for_removal`]).
    pub(super) fn handed_over_round(&self) -> Option<u64> {
        let round = self.handed_over.load(Ordering::Acquire);
        (round != 0 && self.leaving_round() == Some(round)).then_some(round)
    }

    /// Before this node asks for its promotion after the refill of `round`: once promoted, it
    /// serves only after [`Self::confirm_promotion`]. Until every member applied the view
    /// that promotes it, a member that was the primary of some of its keys (a stand-in, or
    /// their holder before this node joined) serves them to clients of the older view, and
    /// those clients' reads would miss writes this node committed as their new primary.
    ///
    /// The node stops serving from the request on, not from the promotion's view: a client
    /// that learned the promotion from another member would otherwise commit on this node as
    /// the key's primary while this node, behind, still serves as a filling member (the
    /// membership model's `join` counterexamples under the earlier rule).
    pub fn gate_promotion(&self, round: u64) {
        self.promotion_round.store(round, Ordering::Release);
        self.refresh_serving();
    }

    /// Every member applied the view of `epoch`, which promotes this node: it serves.
    pub fn confirm_promotion(&self, epoch: u64) {
        self.promotion_confirmed.fetch_max(epoch, Ordering::AcqRel);
        self.refresh_serving();
    }

    /// The epoch that promoted this node, while not every member is known to have applied it
    /// (not while it still asks for its promotion).
    pub fn promoted_unconfirmed(&self) -> Option<u64> {
        let epoch = self.unconfirmed_promotion()?;
        self.own_record()
            .is_some_and(|record| record.state == MemberState::Serving)
            .then_some(epoch)
    }

    /// The filling round [`Self::gate_promotion`] named while this node asks for its promotion
    /// in it, or the epoch that promoted it after that round while not every member is known
    /// to have applied it.
    pub(super) fn unconfirmed_promotion(&self) -> Option<u64> {
        let round = self.promotion_round.load(Ordering::Acquire);
        if round == 0 {
            return None;
        }
        let record = self.own_record()?;
        if record.incarnation != self.incarnation {
            return None;
        }
        match record.state {
            MemberState::Filling if record.since == round => Some(round),
            MemberState::Serving
                if record.since > round
                    && self.promotion_confirmed.load(Ordering::Acquire) < record.since =>
            {
                Some(record.since)
            }
            _ => None,
        }
    }

    /// Member `member`'s control port, to ask it for its view or stats (`None` when its
    /// address cannot be found: [`Self::address_of`]).
    fn monitored(&self, member: u32) -> Option<MonitoredNode<'_>> {
        Some(MonitoredNode {
            address: self.address_of(member)?,
            id: Some(member),
            secret: &self.secret,
        })
    }

    /// The members of the view now that are not `down`, but this node.
    pub fn members_up_but_me(&self) -> Vec<u32> {
        self.view
            .borrow()
            .members
            .iter()
            .filter(|(node_id, record)| {
                **node_id != self.node_id && record.state != MemberState::Down
            })
            .map(|(node_id, _)| *node_id)
            .collect()
    }

    /// Waits, within `within`, until every one of `members` reports a view of `epoch` or
    /// newer: it fenced the data connections of older views then.
    ///
    /// # Errors
    /// The members still behind, as a line.
    pub async fn wait_until_applied(
        &self,
        members: &[u32],
        epoch: u64,
        within: Duration,
    ) -> std::result::Result<(), String> {
        let started = Instant::now();
        let mut behind: Vec<u32> = members.to_vec();
        loop {
            let mut still = Vec::new();
            for member in behind {
                let seen = match self.monitored(member) {
                    Some(monitored) => fetch_view(monitored, MEMBER_VIEW_WITHIN)
                        .await
                        .map_or(0, |view| view.epoch),
                    None => 0,
                };
                if seen < epoch {
                    still.push(member);
                }
            }
            behind = still;
            if behind.is_empty() {
                return Ok(());
            }
            if started.elapsed() >= within || self.shutdown.is_cancelled() {
                return Err(format!(
                    "nodes {behind:?} did not apply epoch {epoch} within {within:?}"
                ));
            }
            tokio::time::sleep(MEMBER_VIEW_POLL).await;
        }
    }

    /// Asks the leader to start `change` (`rdkv-cluster add-node`, `remove-node`); the epoch
    /// of the view with it, or why not.
    pub async fn change_membership(
        &self,
        change: MembershipChange,
    ) -> std::result::Result<u64, String> {
        if self.raft.is_none() {
            return Err(
                "a one-node cluster runs no consensus: start it with two or more nodes".into(),
            );
        }
        if self.leader() == Some(self.node_id) {
            return self.lead_membership_change(change).await;
        }
        self.ask_leader_for(&PeerRequest::ChangeMembership(change))
            .await
    }

    /// Asks the leader to take this node, leaving and handed over under the view of
    /// `handed_over_at`, out of the view. A refusal that starts with [`VIEW_MOVED`] means the
    /// hand-over must run again by the newer view.
    pub async fn ask_removal(&self, handed_over_at: u64) -> std::result::Result<u64, String> {
        if self.leader() == Some(self.node_id) {
            return self
                .lead_removal(self.node_id, self.incarnation, Some(handed_over_at))
                .await;
        }
        self.ask_leader_for(&PeerRequest::RemoveMember {
            node_id: self.node_id,
            incarnation: self.incarnation,
            handed_over_at,
        })
        .await
    }

    /// A hand-over whose removal the leader refused because the view moved since: the node
    /// serves again (it missed no write: none of its keys can be written without it while the
    /// view has it leaving) and hands over again by the newer view.
    pub fn resume_serving_for_handover(&self) {
        self.handed_over.store(0, Ordering::Release);
        self.refresh_serving();
    }

    /// Sends `request` to the leader; its answer.
    async fn ask_leader_for(&self, request: &PeerRequest) -> std::result::Result<u64, String> {
        let Some(leader) = self.leader() else {
            return Err("no leader".into());
        };
        let Some(address) = self.address_of(leader) else {
            return Err(format!("the leader {leader} is not a member"));
        };
        let asked = tokio::select! {
            _ = self.shutdown.cancelled() => return Err("the node is stopping".into()),
            asked = super::ask_leader(leader, address, self.secret.clone(), request, RAFT_STEP_WITHIN * 3) => asked,
        };
        match asked {
            Ok(super::types::PeerReply::Join(outcome)) => outcome,
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(reason) => Err(reason),
        }
    }

    /// On the leader: starts `change`. The epoch of the view with it, or why not.
    pub(super) async fn lead_membership_change(
        &self,
        change: MembershipChange,
    ) -> std::result::Result<u64, String> {
        if self.leader() != Some(self.node_id) {
            return Err(format!("node {} is not the leader", self.node_id));
        }
        let node_id = match &change {
            MembershipChange::Add { node_id, .. } | MembershipChange::Remove { node_id, .. } => {
                *node_id
            }
        };
        if let Some(refusal) = self.change_refusal(node_id) {
            return Err(refusal);
        }
        // One change started at a time on this leader: the checks above run again before a
        // retirement commits, after its wait for the sweeps, and another change must not pass
        // them meanwhile.
        if self.change_starting.swap(true, Ordering::AcqRel) {
            return Err("another membership change is being started: one at a time (run it again once `rdkv-cluster status` shows that one done)".into());
        }
        let _starting = StartingChange(&self.change_starting);
        match change {
            MembershipChange::Add {
                node_id,
                control_address,
            } => self.lead_addition(node_id, control_address).await,
            MembershipChange::Remove { node_id, lose_keys } => {
                self.lead_retirement(node_id, lose_keys).await
            }
        }
    }

    /// Why the leader refuses a membership change of `node_id` now: another change under way,
    /// or a member that served does not serve.
    fn change_refusal(&self, node_id: u32) -> Option<String> {
        let under_way = self.view.borrow().changing_members();
        if let Some(other) = under_way.filter(|other| *other != node_id) {
            return Some(format!(
                "node {other} is still joining or leaving: one membership change at a time (wait for `rdkv-cluster status` to show it serving, or gone)"
            ));
        }
        let not_serving = self.view.borrow().served_and_not_serving(node_id);
        if !not_serving.is_empty() {
            // With one copy, keys moving from a member that is down to a joining one would be
            // copied from nobody, and the down member's copies swept when it returns; a
            // hand-over's next copies may be on a member that is down.
            return Some(format!(
                "nodes {not_serving:?} do not serve: a membership change runs only while every member serves (keys moving from or to a member that is down could be lost); bring them back first (`rdkv-cluster status`)"
            ));
        }
        None
    }

    /// On the leader: node `node_id` at `address` becomes a learner, a member of the view
    /// (down until it joins) and a voter. Each step is skipped when done already, so a retry
    /// finishes an interrupted addition.
    async fn lead_addition(
        &self,
        node_id: u32,
        address: String,
    ) -> std::result::Result<u64, String> {
        let parsed: SocketAddr = address.parse().map_err(|error| {
            format!("node {node_id}'s control address {address:?} is not an address: {error}")
        })?;
        let raft = self
            .raft
            .as_ref()
            .ok_or("a one-node cluster runs no consensus")?;
        let peer = PeerId::from(node_id);
        if !self.voters().contains(&peer) {
            tracing::info!(node_id, %parsed, "adding a learner: it catches up on the view's log");
            let added = tokio::time::timeout(
                RAFT_STEP_WITHIN,
                raft.add_learner(peer, BasicNode::new(parsed.to_string()), true),
            )
            .await;
            match added {
                Err(_) => {
                    return Err(format!(
                    "node {node_id} did not catch up on the view's log within {RAFT_STEP_WITHIN:?}: is it running, started with --join, at {address}?"
                ))
                }
                Ok(Err(error)) => return Err(format!("adding node {node_id} as a learner: {error}")),
                Ok(Ok(_)) => {}
            }
        }
        let mut epoch = self
            .commit(ViewCommand::AddMember {
                node_id,
                address: parsed.to_string(),
            })
            .await?;
        if !self.voters().contains(&peer) {
            let changed = tokio::time::timeout(
                RAFT_STEP_WITHIN,
                raft.change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([peer])), false),
            )
            .await;
            match changed {
                Err(_) => {
                    return Err(format!(
                    "making node {node_id} a voter was not committed within {RAFT_STEP_WITHIN:?}"
                ))
                }
                Ok(Err(error)) => return Err(format!("making node {node_id} a voter: {error}")),
                Ok(Ok(_)) => {}
            }
            epoch = self.epoch();
        }
        tracing::info!(node_id, epoch, "member added: it joins, fills, then serves");
        Ok(epoch)
    }

    /// On the leader: serving member `node_id` starts to leave; a member that never served
    /// (an addition abandoned) is removed at once, and so is one that is down
    /// ([`Self::lead_dead_removal`]).
    async fn lead_retirement(
        &self,
        node_id: u32,
        lose_keys: bool,
    ) -> std::result::Result<u64, String> {
        let (record, never_served, serving, epoch) = {
            let view = self.view.borrow();
            let record = view.members.get(&node_id).copied();
            let never_served = !view.ever_served.contains(&node_id);
            (
                record,
                never_served,
                view.serving_members().len(),
                view.epoch,
            )
        };
        let state = record.map(|record| record.state);
        if let Some(record) = record.filter(|record| {
            never_served && !matches!(record.state, MemberState::Serving | MemberState::Leaving)
        }) {
            return self.lead_removal(node_id, record.incarnation, None).await;
        }
        match state {
            None => return Err(format!("node {node_id} is not a member of the view")),
            Some(MemberState::Leaving) => return Ok(epoch),
            Some(MemberState::Serving) => {}
            Some(MemberState::Down) => return self.lead_dead_removal(node_id, lose_keys).await,
            Some(other) => {
                return Err(format!(
                    "node {node_id} is {other}: only a serving member hands its keys over (wait until it serves)"
                ))
            }
        }
        if serving < 2 {
            return Err(format!(
                "node {node_id} is the only member serving: nothing could take its keys"
            ));
        }
        self.wait_for_sweeps().await?;
        // The wait took a while: the view may have moved (a member down, another change).
        if let Some(refusal) = self.change_refusal(node_id) {
            return Err(refusal);
        }
        if self
            .view
            .borrow()
            .members
            .get(&node_id)
            .is_none_or(|record| record.state != MemberState::Serving)
        {
            return Err(format!(
                "node {node_id} stopped serving while the members swept: run remove-node again once it serves"
            ));
        }
        self.commit(ViewCommand::Retire { node_id }).await
    }

    /// On the leader: member `node_id`, down, is out of the view and of Raft's voters at once
    /// (`rdkv-cluster remove-node` of a dead node, or `replace_after`); the members that serve
    /// then copy its keys again from their other copies (`crate::rereplication`). With one
    /// copy of each key its keys have no other copy: refused unless `lose_keys`, and the view
    /// records the loss.
    pub(super) async fn lead_dead_removal(
        &self,
        node_id: u32,
        lose_keys: bool,
    ) -> std::result::Result<u64, String> {
        let Some(record) = self.view.borrow().members.get(&node_id).copied() else {
            return Err(format!("node {node_id} is not a member of the view"));
        };
        if record.state != MemberState::Down {
            return Err(format!(
                "node {node_id} is {}, not down: only a member that is down is removed without a hand-over",
                record.state
            ));
        }
        if self.store.replicas() <= 1 && !lose_keys {
            return Err(format!(
                "node {node_id} is down and holds the only copy of its keys (replicas = 1): removing it loses them; bring it back (`rdkv-cluster restart`), or pass --lose-keys to remove it anyway"
            ));
        }
        tracing::warn!(
            node_id,
            lose_keys,
            "removing a member that is down: the members that serve copy its keys again"
        );
        self.lead_removal(node_id, record.incarnation, None).await
    }

    /// Waits, within [`SWEEPS_WITHIN`] plus twice `failure_timeout`, until every serving
    /// member has swept the copies the view now no longer names on it (`crate::sweep`). A key
    /// that an earlier change moved may still have its old copy on another member until that
    /// member's sweep; a hand-over copies only what the leaving member holds, so a key deleted
    /// there (with one copy, no tombstone is left) would come back from the old copy once the
    /// leaving member is gone. Nothing to wait for when every member holds every key.
    async fn wait_for_sweeps(&self) -> std::result::Result<(), String> {
        let deadline = Instant::now() + SWEEPS_WITHIN + self.failure_timeout * 2;
        loop {
            let (epoch, serving, members) = {
                let view = self.view.borrow();
                (view.epoch, view.serving_members(), view.members.len())
            };
            if members <= self.store.replicas() {
                return Ok(());
            }
            let mut behind = Vec::new();
            for member in serving {
                let swept = match self.monitored(member) {
                    Some(monitored) => fetch_stats(monitored, Duration::from_secs(1))
                        .await
                        .map_or(0, |stats| stats.swept_epoch),
                    None => 0,
                };
                if swept < epoch {
                    behind.push(member);
                }
            }
            if behind.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "nodes {behind:?} have not swept the copies the view of epoch {epoch} no longer names on them (a sweep runs once a view has held for failure_timeout): run remove-node again shortly"
                ));
            }
            tokio::select! {
                _ = self.shutdown.cancelled() => return Err("the node is stopping".into()),
                _ = tokio::time::sleep(SWEEP_POLL) => {}
            }
        }
    }

    /// On the leader: leaving member `node_id`, handed over as `incarnation` under the view of
    /// `handed_over_at` (`None`: a member that never served, which holds nothing, or one
    /// down, whose keys the members re-replicate), is out of the view, then out of Raft's
    /// voters.
    pub(super) async fn lead_removal(
        &self,
        node_id: u32,
        incarnation: u64,
        handed_over_at: Option<u64>,
    ) -> std::result::Result<u64, String> {
        if self.leader() != Some(self.node_id) {
            return Err(format!("node {} is not the leader", self.node_id));
        }
        let (present, never_served) = {
            let view = self.view.borrow();
            let present = view.members.get(&node_id).copied();
            (present, !view.ever_served.contains(&node_id))
        };
        let now = self.epoch();
        let epoch = match present {
            None => now,
            Some(record)
                if record.state == MemberState::Leaving
                    && handed_over_at.is_some_and(|at| at != now) =>
            {
                return Err(format!(
                    "{VIEW_MOVED}: node {node_id} handed over under epoch {}, the view is at {now}",
                    handed_over_at.unwrap_or_default()
                ))
            }
            Some(record)
                if record.incarnation == incarnation
                    && (matches!(record.state, MemberState::Leaving | MemberState::Down)
                        || (never_served && record.state != MemberState::Serving)) =>
            {
                self.commit(ViewCommand::RemoveMember {
                    node_id,
                    incarnation,
                })
                .await?
            }
            Some(record) => {
                return Err(format!(
                    "node {node_id} is {} as another process: its hand-over removes nothing",
                    record.state
                ))
            }
        };
        if self.view.borrow().members.contains_key(&node_id) {
            // The command applied to a record that changed meanwhile (a member down that
            // joined again as a new process): it stays, and so does its vote.
            return Err(format!(
                "node {node_id} changed before its removal applied (back as a new process?): not removed"
            ));
        }
        self.remove_voter(node_id).await?;
        tracing::info!(node_id, epoch, "member removed");
        Ok(epoch)
    }

    /// On the leader: node `node_id` is out of Raft's voters (nothing to do when it is not
    /// one). Also for a voter the view no longer names (a leader that crashed between
    /// `RemoveMember` and this step: `replacement.rs`).
    pub(super) async fn remove_voter(&self, node_id: u32) -> std::result::Result<(), String> {
        let raft = self
            .raft
            .as_ref()
            .ok_or("a one-node cluster runs no consensus")?;
        let peer = PeerId::from(node_id);
        if !self.voters().contains(&peer) {
            return Ok(());
        }
        let changed = tokio::time::timeout(
            RAFT_STEP_WITHIN,
            raft.change_membership(ChangeMembers::RemoveVoters(BTreeSet::from([peer])), false),
        )
        .await;
        match changed {
            Err(_) => Err(format!(
                "removing node {node_id} from the voters was not committed within {RAFT_STEP_WITHIN:?}"
            )),
            Ok(Err(error)) => Err(format!("removing node {node_id} from the voters: {error}")),
            Ok(Ok(_)) => Ok(()),
        }
    }

    /// The members removed while down that this node applied in views after `epoch`, and the
    /// newest such view's epoch (0: none): what its re-replication has to make whole
    /// (`crate::rereplication`).
    pub fn dead_removals_after(&self, epoch: u64) -> (u64, Vec<u32>) {
        self.store.dead_removals_after(epoch)
    }

    /// The members this node's view has joining and leaving, for its stats.
    pub fn changing_figures(&self) -> (u64, u64) {
        let view = self.current();
        let count = |state| {
            view.members
                .iter()
                .filter(|member| member.state == state)
                .count() as u64
        };
        (count(MemberState::Joining), count(MemberState::Leaving))
    }

    /// Raft's voters, by the membership this node knows.
    pub(super) fn voters(&self) -> BTreeSet<PeerId> {
        let Some(raft) = &self.raft else {
            return BTreeSet::new();
        };
        let metrics = raft.metrics();
        let metrics = metrics.borrow();
        metrics.membership_config.membership().voter_ids().collect()
    }
}

/// Clears the leader's "a change is being started" flag when the start ends, however it ends.
struct StartingChange<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StartingChange<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}
