//! The consensus's types: the Raft type configuration, the commands that change the view, the
//! view state they change, and the messages between peer nodes.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;

use openraft::error::{InstallSnapshotError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::LogId;
use rdkv_common::protocol::{ClusterView, CopySetLoss, MemberState, ViewMember, MAX_LOSSES_KEPT};
use serde::{Deserialize, Serialize};

openraft::declare_raft_types!(
    /// rdkv's Raft: node ids are the cluster file's (as `u64`), a node's address is its
    /// control address, and the replicated state is the [`ViewState`].
    pub TypeConfig:
        D = ViewCommand,
        R = ViewReply,
);

/// A node id in the consensus (the cluster file's id).
pub type PeerId = u64;

/// A change to the view, committed through the log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ViewCommand {
    /// The member missed its peers' heartbeats for `failure_timeout`, or left. A serving
    /// member's record changes epoch; a filling one keeps its round.
    MarkDown {
        /// The member.
        node_id: u32,
    },
    /// The member runs (started, restarted or reachable again) as `incarnation`: it serves
    /// at its first start, and is `filling` after a restart or an absence (its memory may
    /// lack writes), until it is promoted.
    Join {
        /// The member.
        node_id: u32,
        /// Random per process start: a restart is a new incarnation, and a new epoch.
        incarnation: u64,
    },
    /// The member, filling as `incarnation` since epoch `filling_since`, holds a copy of every
    /// key it is a replica of: it serves.
    Promote {
        /// The member.
        node_id: u32,
        /// Its incarnation (a promotion of an earlier one changes nothing).
        incarnation: u64,
        /// The epoch its record became `filling`, as the refill saw it: a refill of an earlier
        /// round (the node was marked down and joined again since, and missed writes between)
        /// promotes nothing.
        filling_since: u64,
    },
    /// The whole cluster stops cleanly (`rdkv-cluster down`): every serving member is `down`
    /// since this command's epoch, at once, so no key moves and every node's final snapshot
    /// holds every acknowledged write of its keys (`docs/operations.md`, *Persistence*).
    /// Filling and down members are left as they are: their memory is not a whole copy.
    Stop,
    /// The member, started again after the stop of `stopped_at` with the snapshot it wrote
    /// then, is back as `incarnation`: `filling` in the round `stopped_at`, without a refill;
    /// it serves at [`ViewCommand::PromoteResumed`]. A member whose record changed since the
    /// stop joins as [`ViewCommand::Join`] does.
    Resume {
        /// The member.
        node_id: u32,
        /// Its new incarnation.
        incarnation: u64,
        /// The epoch of the stop its snapshot was written at.
        stopped_at: u64,
    },
    /// Every member resumed from the stop of `stopped_at` serves, at once: a key's copies
    /// come back together, so no GET reads a node that lacks a key another one holds.
    PromoteResumed {
        /// The stop's epoch.
        stopped_at: u64,
    },
    /// While no member serves (every node of the cluster started again after a crash, with
    /// no clean stop behind it), every filling member serves, at once, with what it holds: no
    /// peer is newer to refill from, and promoted one by one, the first would be refilled from
    /// by the others, which would drop their own keys first.
    PromoteFilling,
    /// The operator has seen the loss records of epochs up to `up_to_epoch`
    /// (`rdkv-cluster ack-loss`): they are cleared. No member changes, so the epoch stays.
    AcknowledgeLosses {
        /// Records of this epoch and earlier are cleared.
        up_to_epoch: u64,
    },
    /// The member stops cleanly (`view/leave.rs`): down as [`ViewCommand::MarkDown`] makes it,
    /// and its final snapshot holds its keys (with one copy of each key, its absence loses
    /// nothing: it loads them when it is back).
    Leave {
        /// The member.
        node_id: u32,
    },
    /// [`ViewCommand::PromoteFilling`], only while the view is still at `epoch`: every filling
    /// member reported its newest-wins reconciliation done under that epoch
    /// (`crate::reconcile`), and no record changed since (a member that joined or restarted
    /// since may hold newer copies, and reconciliation starts over).
    PromoteReconciled {
        /// The epoch every filling member reconciled under.
        epoch: u64,
    },
    /// A node not in the view becomes a member (`rdkv-cluster add-node`): `down`, never
    /// served, until its join makes it fill (`membership.rs`). A member already known changes
    /// nothing.
    AddMember {
        /// The new member.
        node_id: u32,
        /// Its control address, for the members started before it (Raft's membership carries
        /// it too).
        address: String,
    },
    /// A serving member starts to leave (`rdkv-cluster remove-node`): `leaving`, still a
    /// key's primary or copy by the ranking over the members that serve data, while every
    /// write also reaches the copies of the ranking without it, and its hand-over copies the
    /// rest (`crate::handover`).
    Retire {
        /// The leaving member.
        node_id: u32,
    },
    /// A leaving member whose hand-over is complete is out of the view; so is a member that
    /// never served (an addition abandoned: it holds no key of its own), whatever its state.
    RemoveMember {
        /// The member.
        node_id: u32,
        /// The incarnation that handed its keys over (a hand-over of an earlier process
        /// removes nothing), or the never-served member's record's.
        incarnation: u64,
    },
}

/// What applying a command gives back: the epoch after it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewReply {
    /// The view's epoch once the command is applied.
    pub epoch: u64,
}

/// One member's record in the view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// Serving or down.
    pub state: MemberState,
    /// The incarnation that last joined (0: none yet).
    pub incarnation: u64,
    /// The epoch at which this record last changed (0: the initial view).
    pub since: u64,
}

/// The replicated state: the epoch and every member's record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewState {
    /// Bumped by every command that changes a record.
    pub epoch: u64,
    /// Every member: the cluster file's nodes at the first start, then as
    /// [`ViewCommand::AddMember`] and [`ViewCommand::RemoveMember`] change them.
    pub members: BTreeMap<u32, MemberRecord>,
    /// The epoch of the last [`ViewCommand::Stop`] that changed the view: members down or
    /// resumed since it hold their keys in the stop's snapshots.
    pub last_stop: Option<u64>,
    /// Views in which every copy of some keys was down at once, not acknowledged yet (the
    /// most recent [`MAX_LOSSES_KEPT`]).
    pub losses: Vec<CopySetLoss>,
    /// Every such view since the view began, acknowledged or not (a loss that widens counts
    /// again).
    pub losses_total: u64,
    /// Members that have served since the view began: one that never did held no key.
    pub ever_served: BTreeSet<u32>,
    /// Members down since a clean stop of their own ([`ViewCommand::Leave`]).
    pub left_cleanly: BTreeSet<u32>,
}

impl ViewState {
    /// The view before any command: every node serving, epoch 0.
    pub fn initial(node_ids: &[u32]) -> Self {
        Self {
            epoch: 0,
            members: node_ids
                .iter()
                .map(|id| {
                    (
                        *id,
                        MemberRecord {
                            state: MemberState::Serving,
                            incarnation: 0,
                            since: 0,
                        },
                    )
                })
                .collect(),
            ..Self::default()
        }
    }

    /// Applies `command`; returns the epoch after it. A command that changes nothing (a node
    /// marked down twice, a join of the incarnation already serving, an unknown node) keeps
    /// the epoch.
    pub fn apply(&mut self, command: &ViewCommand) -> u64 {
        let next = self.epoch + 1;
        let changed = match *command {
            ViewCommand::MarkDown { node_id } | ViewCommand::Leave { node_id } => {
                match self.members.get_mut(&node_id) {
                    Some(record) if record.state != MemberState::Down => {
                        // A filling member keeps its round: one resumed from a stop and marked down
                        // before the stop's members serve may resume again (nothing was written
                        // meanwhile: nobody served); any other comes back by a join, a new round.
                        if record.state.serves_data() {
                            record.since = next;
                        }
                        record.state = MemberState::Down;
                        true
                    }
                    _ => false,
                }
            }
            ViewCommand::Join {
                node_id,
                incarnation,
            } => self.join(node_id, incarnation, next),
            ViewCommand::Promote {
                node_id,
                incarnation,
                filling_since,
            } => match self.members.get_mut(&node_id) {
                Some(record)
                    if record.state == MemberState::Filling
                        && record.incarnation == incarnation
                        && record.since == filling_since =>
                {
                    record.state = MemberState::Serving;
                    record.since = next;
                    true
                }
                _ => false,
            },
            ViewCommand::Stop => self.stop(next),
            ViewCommand::Resume {
                node_id,
                incarnation,
                stopped_at,
            } => match self.members.get_mut(&node_id) {
                // Down since the stop, or filling in its round (resumed before, and stopped or
                // restarted before the stop's members served: nothing was written meanwhile).
                Some(record)
                    if matches!(record.state, MemberState::Down | MemberState::Filling)
                        && record.since == stopped_at =>
                {
                    if record.state == MemberState::Filling && record.incarnation == incarnation {
                        // Resumed already as this process.
                        return self.epoch;
                    }
                    // The round stays the stop's epoch: it names the members to promote.
                    record.state = MemberState::Filling;
                    record.incarnation = incarnation;
                    true
                }
                _ => self.join(node_id, incarnation, next),
            },
            ViewCommand::PromoteResumed { stopped_at } => self.promote_resumed(stopped_at, next),
            ViewCommand::AcknowledgeLosses { up_to_epoch } => {
                self.losses.retain(|loss| loss.epoch > up_to_epoch);
                false
            }
            ViewCommand::PromoteFilling => self.promote_filling(next),
            ViewCommand::PromoteReconciled { epoch } => {
                epoch == self.epoch && self.promote_filling(next)
            }
            ViewCommand::AddMember { node_id, .. } => self.add_member(node_id, next),
            ViewCommand::Retire { node_id } => match self.members.get_mut(&node_id) {
                Some(record) if record.state == MemberState::Serving => {
                    record.state = MemberState::Leaving;
                    record.since = next;
                    true
                }
                _ => false,
            },
            ViewCommand::RemoveMember {
                node_id,
                incarnation,
            } => self.remove_member(node_id, incarnation),
        };
        if changed {
            self.epoch += 1;
        }
        self.note_members(command);
        self.epoch
    }

    /// A [`ViewCommand::AddMember`] at epoch `next`: a new member, down until it joins;
    /// whether it changed the view.
    fn add_member(&mut self, node_id: u32, next: u64) -> bool {
        if self.members.contains_key(&node_id) {
            return false;
        }
        self.members.insert(
            node_id,
            MemberRecord {
                state: MemberState::Down,
                incarnation: 0,
                since: next,
            },
        );
        true
    }

    /// A [`ViewCommand::RemoveMember`]: the leaving member as `incarnation`, or a member that
    /// never served, is out of the view; whether it changed the view.
    fn remove_member(&mut self, node_id: u32, incarnation: u64) -> bool {
        let never_served = !self.ever_served.contains(&node_id);
        let leaving = self.members.get(&node_id).is_some_and(|record| {
            record.incarnation == incarnation
                && (record.state == MemberState::Leaving
                    || (never_served && record.state != MemberState::Serving))
        });
        if leaving {
            self.members.remove(&node_id);
            self.ever_served.remove(&node_id);
            self.left_cleanly.remove(&node_id);
        }
        leaving
    }

    /// The members other than `except` that served and do not serve now (down, or filling
    /// after a restart): a membership change waits for them.
    pub fn served_and_not_serving(&self, except: u32) -> Vec<u32> {
        self.members
            .iter()
            .filter(|(node_id, record)| {
                **node_id != except
                    && self.ever_served.contains(node_id)
                    && !record.state.serves_data()
            })
            .map(|(node_id, _)| *node_id)
            .collect()
    }

    /// Whether a membership change is under way: a member added that has not served yet
    /// (down until it joins, then filling), or one leaving. One change runs at a time.
    pub fn changing_members(&self) -> Option<u32> {
        self.members
            .iter()
            .find(|(node_id, record)| {
                record.state == MemberState::Leaving
                    || (record.state != MemberState::Serving && !self.ever_served.contains(node_id))
            })
            .map(|(node_id, _)| *node_id)
    }

    /// A [`ViewCommand::Stop`] at epoch `next`: every serving member down; whether it changed
    /// a record.
    fn stop(&mut self, next: u64) -> bool {
        let mut changed = false;
        for record in self.members.values_mut() {
            if record.state.serves_data() {
                record.state = MemberState::Down;
                record.since = next;
                changed = true;
            }
        }
        if changed {
            self.last_stop = Some(next);
        }
        changed
    }

    /// A [`ViewCommand::PromoteResumed`] of the stop of `stopped_at`, at epoch `next`.
    fn promote_resumed(&mut self, stopped_at: u64, next: u64) -> bool {
        let mut changed = false;
        for record in self.members.values_mut() {
            // The stop is over: a member still down since it joins, and is refilled, when it
            // comes back (its snapshot misses the writes from here on).
            if record.since == stopped_at
                && matches!(record.state, MemberState::Filling | MemberState::Down)
            {
                if record.state == MemberState::Filling {
                    record.state = MemberState::Serving;
                }
                record.since = next;
                changed = true;
            }
        }
        changed
    }

    /// A [`ViewCommand::PromoteFilling`] at epoch `next`: only while nobody serves.
    fn promote_filling(&mut self, next: u64) -> bool {
        let nobody_serves = self
            .members
            .values()
            .all(|record| record.state != MemberState::Serving);
        let mut changed = false;
        for record in self.members.values_mut() {
            if nobody_serves && record.state == MemberState::Filling {
                record.state = MemberState::Serving;
                record.since = next;
                changed = true;
            }
        }
        changed
    }

    /// Keeps [`Self::ever_served`] and [`Self::left_cleanly`] after `command`.
    fn note_members(&mut self, command: &ViewCommand) {
        for (node_id, record) in &self.members {
            if record.state == MemberState::Serving && record.incarnation != 0 {
                self.ever_served.insert(*node_id);
            }
            if record.state != MemberState::Down {
                self.left_cleanly.remove(node_id);
            }
        }
        if let ViewCommand::Leave { node_id } = *command {
            if self
                .members
                .get(&node_id)
                .is_some_and(|record| record.state == MemberState::Down)
            {
                self.left_cleanly.insert(node_id);
            }
        }
    }

    /// A [`ViewCommand::Join`] of `node_id` as `incarnation`, at epoch `next`; whether it
    /// changed the record.
    fn join(&mut self, node_id: u32, incarnation: u64, next: u64) -> bool {
        match self.members.get_mut(&node_id) {
            Some(record)
                if record.state == MemberState::Down || record.incarnation != incarnation =>
            {
                // A node's first start (never joined, serving in the initial view) serves;
                // after a restart or an absence its memory may lack writes: it fills.
                let first_start = record.incarnation == 0 && record.state == MemberState::Serving;
                record.state = if first_start {
                    MemberState::Serving
                } else {
                    MemberState::Filling
                };
                record.incarnation = incarnation;
                record.since = next;
                true
            }
            _ => false,
        }
    }

    /// The members that hold no whole copy of their keys in this view: down, or filling (a
    /// refill empties a node before it copies), except those down or resumed since the last
    /// stop (each holds the stop's snapshot: every acknowledged write of its keys).
    pub fn without_whole_copy(&self) -> BTreeSet<u32> {
        self.members
            .iter()
            .filter(|(node_id, record)| {
                // A member that never served held nothing: writes went to the others.
                self.ever_served.contains(node_id)
                    && !record.state.serves_data()
                    && Some(record.since) != self.last_stop
            })
            .map(|(node_id, _)| *node_id)
            .collect()
    }

    /// The members whose absence can lose keys with `replicas` copies of each: those
    /// [`Self::without_whole_copy`] names; with one copy, only those down without a clean stop
    /// (one that stopped cleanly comes back with its final snapshot, and a filling one keeps
    /// what it loaded).
    pub fn at_risk(&self, replicas: usize) -> BTreeSet<u32> {
        let mut members = self.without_whole_copy();
        if replicas <= 1 {
            members.retain(|node_id| {
                !self.left_cleanly.contains(node_id)
                    && self
                        .members
                        .get(node_id)
                        .is_some_and(|record| record.state == MemberState::Down)
            });
        }
        members
    }

    /// After a command, with `before` the members [`Self::at_risk`] named before it: when
    /// `replicas` or more members hold no whole copy, and one of them held one before, every
    /// copy of some keys was down at once (a key's copies can be any `replicas` members).
    /// Records it and returns the record. A loss that grows (a third node down with two)
    /// widens the last record, which then takes this epoch (an acknowledgement of what was
    /// shown before leaves it) and counts again.
    pub fn record_loss(&mut self, before: &BTreeSet<u32>, replicas: usize) -> Option<CopySetLoss> {
        let replicas = replicas.max(1);
        let now = self.at_risk(replicas);
        if now.len() < replicas || now.is_subset(before) {
            return None;
        }
        let epoch = self.epoch;
        if before.len() >= replicas {
            if let Some(last) = self.losses.last_mut() {
                let nodes: BTreeSet<u32> = last.nodes.iter().copied().chain(now).collect();
                last.nodes = nodes.into_iter().collect();
                last.epoch = epoch;
                self.losses_total += 1;
                return Some(last.clone());
            }
        }
        let loss = CopySetLoss {
            epoch: self.epoch,
            nodes: now.into_iter().collect(),
        };
        if self.losses.len() >= MAX_LOSSES_KEPT {
            self.losses.remove(0);
        }
        self.losses.push(loss.clone());
        self.losses_total += 1;
        Some(loss)
    }

    /// With one copy of each key: the member that `command` starts again with less than it
    /// acknowledged. That is a [`ViewCommand::Join`] (a new incarnation) of a member that
    /// served and that the view never saw stop (killed and started again before it was marked
    /// down; after a crash of every node, every member), or of one down since the last stop
    /// that joins instead of resuming (its final snapshot is not the one it loaded: writing it
    /// failed, or the node started from its previous snapshot or empty). It is back with an
    /// older snapshot, and the writes it took since are lost. With more copies, the
    /// members' filling is the loss rule's ([`Self::at_risk`]).
    pub fn restarted_short(&self, command: &ViewCommand, replicas: usize) -> Option<u32> {
        let ViewCommand::Join {
            node_id,
            incarnation,
        } = *command
        else {
            return None;
        };
        let record = self.members.get(&node_id)?;
        if replicas > 1 || record.incarnation == incarnation || !self.ever_served.contains(&node_id)
        {
            return None;
        }
        let unseen_crash = record.state == MemberState::Serving && record.incarnation != 0;
        let not_resumed = record.state == MemberState::Down && Some(record.since) == self.last_stop;
        (unseen_crash || not_resumed).then_some(node_id)
    }

    /// Records that member `node_id`, started again, lost what it took since its last
    /// snapshot ([`Self::restarted_short`]), once the command that started it changed the
    /// epoch from `previous`. A record made by the command just before (another member of the
    /// same crash, started again) widens instead.
    pub fn record_restart_loss(&mut self, node_id: u32, previous: u64) -> Option<CopySetLoss> {
        if self.epoch == previous {
            return None;
        }
        let epoch = self.epoch;
        self.losses_total += 1;
        if let Some(last) = self.losses.last_mut().filter(|last| last.epoch == previous) {
            if !last.nodes.contains(&node_id) {
                last.nodes.push(node_id);
                last.nodes.sort_unstable();
            }
            last.epoch = epoch;
            return Some(last.clone());
        }
        let loss = CopySetLoss {
            epoch,
            nodes: vec![node_id],
        };
        if self.losses.len() >= MAX_LOSSES_KEPT {
            self.losses.remove(0);
        }
        self.losses.push(loss.clone());
        Some(loss)
    }

    /// The members serving data (serving or leaving), by id.
    pub fn serving_members(&self) -> Vec<u32> {
        self.members
            .iter()
            .filter(|(_, record)| record.state.serves_data())
            .map(|(node_id, _)| *node_id)
            .collect()
    }

    /// Whether some member's state differs from `earlier`'s: the keys' replicas changed, and
    /// connections made under `earlier` are fenced (`docs/protocol.md`, *Views and fencing*).
    pub fn placement_differs(&self, earlier: &ViewState) -> bool {
        self.members.len() != earlier.members.len()
            || self.members.iter().any(|(node_id, record)| {
                earlier
                    .members
                    .get(node_id)
                    .is_none_or(|before| before.state != record.state)
            })
    }

    /// A member's state as clients see it: a filling member that never served is joining
    /// (added by `rdkv-cluster add-node`, or a first start that fills), which a client of one
    /// copy per key must route by the view for (`docs/protocol.md`, *Membership changes*).
    fn public_state(&self, node_id: u32, state: MemberState) -> MemberState {
        if state == MemberState::Filling && !self.ever_served.contains(&node_id) {
            MemberState::Joining
        } else {
            state
        }
    }

    /// The view as clients see it.
    pub fn public(&self, leader: Option<u32>) -> ClusterView {
        ClusterView {
            epoch: self.epoch,
            leader,
            members: self
                .members
                .iter()
                .map(|(node_id, record)| ViewMember {
                    node_id: *node_id,
                    state: self.public_state(*node_id, record.state),
                })
                .collect(),
            losses: self.losses.clone(),
        }
    }
}

/// A request from a peer node.
#[derive(Debug, Serialize, Deserialize)]
pub enum PeerRequest {
    /// Raft's log replication and heartbeat.
    AppendEntries(AppendEntriesRequest<TypeConfig>),
    /// Raft's election.
    Vote(VoteRequest<PeerId>),
    /// Raft's snapshot transfer.
    InstallSnapshot(InstallSnapshotRequest<TypeConfig>),
    /// A node asks the leader to commit its join.
    Join {
        /// The joining node.
        node_id: u32,
        /// Its incarnation.
        incarnation: u64,
    },
    /// A filling node, refilled, asks the leader to commit its promotion.
    Promote {
        /// The node.
        node_id: u32,
        /// Its incarnation.
        incarnation: u64,
        /// The epoch its record became `filling`, when its refill started.
        filling_since: u64,
    },
    /// A follower asks the leader to renew its lease on serving data (`lease.rs`).
    Lease {
        /// The follower.
        node_id: u32,
        /// The epoch of the view the follower has applied: a follower behind the leader's
        /// view gets no grant, and its request is no sign of life.
        epoch: u64,
    },
    /// A node that stops cleanly asks the leader to commit it down at once (`leave.rs`).
    Leave {
        /// The leaving node.
        node_id: u32,
        /// Its incarnation: an old process's request does not take down a new one.
        incarnation: u64,
    },
    /// A node that has heard no leader for its election timeout asks whether the peer would
    /// vote for it, before it raises its term (`election.rs`).
    PreVote {
        /// The would-be candidate.
        node_id: u32,
        /// The id of the last entry of its log: a peer with a newer log says no.
        last_log_id: Option<LogId<PeerId>>,
    },
    /// `rdkv-cluster down` asks the leader to commit [`ViewCommand::Stop`].
    Stop,
    /// A node started from the snapshot of a stop asks the leader to commit its
    /// [`ViewCommand::Resume`].
    Resume {
        /// The node.
        node_id: u32,
        /// Its incarnation.
        incarnation: u64,
        /// The stop's epoch.
        stopped_at: u64,
    },
    /// A resumed node, seeing every member of the stop back, asks the leader to commit
    /// [`ViewCommand::PromoteResumed`].
    PromoteResumed {
        /// The stop's epoch.
        stopped_at: u64,
    },
    /// A filling node that found no serving peer asks the leader to commit
    /// [`ViewCommand::PromoteFilling`].
    PromoteFilling,
    /// `rdkv-cluster ack-loss` asks the leader to commit [`ViewCommand::AcknowledgeLosses`].
    AcknowledgeLosses {
        /// Records of this epoch and earlier are cleared.
        up_to_epoch: u64,
    },
    /// A filling node that saw every filling member reconciled under `epoch` asks the leader
    /// to commit [`ViewCommand::PromoteReconciled`].
    PromoteReconciled {
        /// The epoch every filling member reconciled under.
        epoch: u64,
    },
    /// `rdkv-cluster add-node` or `remove-node`, through any node, asks the leader to start a
    /// membership change (`membership.rs`).
    ChangeMembership(rdkv_common::protocol::MembershipChange),
    /// A leaving node whose keys have their new copies asks the leader to take it out of the
    /// view and of Raft's membership.
    RemoveMember {
        /// The leaving node.
        node_id: u32,
        /// Its incarnation.
        incarnation: u64,
        /// The epoch of the view its hand-over ran under: the leader removes it only while
        /// the view is still that one (any change since may have moved keys it passed).
        handed_over_at: u64,
    },
}

/// A leader's lease grant to a follower.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct LeaseGrant {
    /// How long, in milliseconds from when the leader answered, its own lease still runs:
    /// the follower's lasts no longer.
    pub remaining_ms: u64,
    /// The epoch of the leader's view when it answered: the grant counts only on a follower
    /// that has applied that view (a node back from a cut must not serve by an older one).
    pub epoch: u64,
}

/// A peer's answer.
#[derive(Debug, Serialize, Deserialize)]
pub enum PeerReply {
    /// To [`PeerRequest::AppendEntries`].
    AppendEntries(Result<AppendEntriesResponse<PeerId>, RaftError<PeerId>>),
    /// To [`PeerRequest::Vote`].
    Vote(Result<VoteResponse<PeerId>, RaftError<PeerId>>),
    /// To [`PeerRequest::InstallSnapshot`].
    InstallSnapshot(
        Result<InstallSnapshotResponse<PeerId>, RaftError<PeerId, InstallSnapshotError>>,
    ),
    /// To [`PeerRequest::Join`], [`PeerRequest::Promote`], [`PeerRequest::Leave`],
    /// [`PeerRequest::Stop`], [`PeerRequest::Resume`], [`PeerRequest::PromoteResumed`] and
    /// [`PeerRequest::PromoteFilling`]: the
    /// epoch with the change committed, or why not.
    Join(Result<u64, String>),
    /// The request did not decode.
    Malformed(String),
    /// To [`PeerRequest::Lease`]: a grant, or why the leader gives none.
    Lease(Result<LeaseGrant, String>),
    /// To [`PeerRequest::PreVote`]: yes, or why not.
    PreVote(Result<(), String>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_change_is_an_epoch_and_a_repeat_is_not() {
        let mut view = ViewState::initial(&[1, 2, 3]);
        assert_eq!(view.epoch, 0);
        let join = |node_id, incarnation| ViewCommand::Join {
            node_id,
            incarnation,
        };
        let promote = |view: &ViewState, node_id, incarnation| ViewCommand::Promote {
            node_id,
            incarnation,
            filling_since: view.members[&node_id].since,
        };
        let state = |view: &ViewState, node_id| view.members[&node_id].state;
        let before = view.clone();
        assert_eq!(view.apply(&join(1, 7)), 1);
        assert_eq!(
            state(&view, 1),
            MemberState::Serving,
            "a first start serves"
        );
        assert!(
            !view.placement_differs(&before),
            "a first join moves no key"
        );
        assert_eq!(view.apply(&join(1, 7)), 1, "the same incarnation again");
        assert_eq!(view.apply(&ViewCommand::MarkDown { node_id: 2 }), 2);
        assert_eq!(view.apply(&ViewCommand::MarkDown { node_id: 2 }), 2);
        assert!(view.placement_differs(&before));
        assert_eq!(view.public(Some(1)).serving(), vec![1, 3]);
        assert_eq!(view.apply(&join(2, 9)), 3, "back, as a new incarnation");
        assert_eq!(
            state(&view, 2),
            MemberState::Filling,
            "back from down: it fills"
        );
        assert_eq!(view.apply(&join(2, 9)), 3, "filling already");
        assert_eq!(
            view.apply(&promote(&view, 2, 8)),
            3,
            "an earlier incarnation's promotion"
        );
        assert_eq!(view.apply(&promote(&view, 2, 9)), 4);
        assert_eq!(state(&view, 2), MemberState::Serving);
        assert_eq!(view.apply(&join(1, 8)), 5, "a restart is a new epoch");
        assert_eq!(
            state(&view, 1),
            MemberState::Filling,
            "a restarted node fills"
        );
        assert_eq!(view.apply(&promote(&view, 1, 8)), 6);
        assert_eq!(view.apply(&ViewCommand::MarkDown { node_id: 42 }), 6);
        assert_eq!(view.public(None).serving(), vec![1, 2, 3]);
    }

    /// The bug the lease attack test found: a node refilled while filling, marked down before
    /// its promotion committed, and back (the same process: the same incarnation) was promoted
    /// by its first refill's retried request, without the writes it missed while down.
    #[test]
    fn a_promotion_of_an_earlier_filling_round_changes_nothing() {
        let mut view = ViewState::initial(&[1, 2, 3]);
        view.apply(&ViewCommand::MarkDown { node_id: 3 });
        view.apply(&ViewCommand::Join {
            node_id: 3,
            incarnation: 5,
        });
        let first_round = view.members[&3].since;
        assert_eq!(view.members[&3].state, MemberState::Filling);
        view.apply(&ViewCommand::MarkDown { node_id: 3 });
        let epoch = view.apply(&ViewCommand::Join {
            node_id: 3,
            incarnation: 5,
        });
        let stale = ViewCommand::Promote {
            node_id: 3,
            incarnation: 5,
            filling_since: first_round,
        };
        assert_eq!(view.apply(&stale), epoch, "the first round's promotion");
        assert_eq!(view.members[&3].state, MemberState::Filling);
        let current = ViewCommand::Promote {
            node_id: 3,
            incarnation: 5,
            filling_since: view.members[&3].since,
        };
        assert_eq!(view.apply(&current), epoch + 1);
        assert_eq!(view.members[&3].state, MemberState::Serving);
    }

    /// A clean stop of the whole cluster and its start from the stop's snapshots: the members
    /// that served come back filling in the stop's round and serve together at one promotion;
    /// a member that filled at the stop, or whose record changed since, joins and fills.
    #[test]
    fn members_resumed_from_a_stop_serve_together_and_only_they() {
        let mut view = ViewState::initial(&[1, 2, 3]);
        view.apply(&ViewCommand::MarkDown { node_id: 3 });
        view.apply(&ViewCommand::Join {
            node_id: 3,
            incarnation: 4,
        });
        assert_eq!(view.members[&3].state, MemberState::Filling);
        let stopped_at = view.apply(&ViewCommand::Stop);
        assert_eq!(view.members[&1].state, MemberState::Down);
        assert_eq!(view.members[&2].since, stopped_at);
        assert_eq!(
            view.members[&3].state,
            MemberState::Filling,
            "not a whole copy"
        );
        assert_eq!(
            view.apply(&ViewCommand::Stop),
            stopped_at,
            "a repeat changes nothing"
        );

        let resume = |node_id, incarnation| ViewCommand::Resume {
            node_id,
            incarnation,
            stopped_at,
        };
        let epoch = view.apply(&resume(1, 11));
        assert_eq!(view.members[&1].state, MemberState::Filling);
        assert_eq!(
            view.members[&1].since, stopped_at,
            "the stop names the round"
        );
        assert_eq!(
            view.apply(&resume(1, 11)),
            epoch,
            "a repeat changes nothing"
        );
        // Node 3 claims the stop too, but it was filling then: it joins as a restart does.
        view.apply(&resume(3, 13));
        assert_eq!(view.members[&3].state, MemberState::Filling);
        assert_ne!(view.members[&3].since, stopped_at);
        view.apply(&resume(2, 12));
        view.apply(&ViewCommand::PromoteResumed { stopped_at });
        assert_eq!(view.public(None).serving(), vec![1, 2]);
        assert_eq!(
            view.members[&3].state,
            MemberState::Filling,
            "it refills from them"
        );
        let epoch = view.epoch;
        assert_eq!(
            view.apply(&ViewCommand::PromoteFilling),
            epoch,
            "node 1 and 2 serve"
        );
    }

    /// A member the stop took down that comes back after the others serve without it holds a
    /// snapshot that misses their writes since: it joins and fills.
    #[test]
    fn a_member_back_after_the_stop_ended_fills() {
        let mut view = ViewState::initial(&[1, 2, 3]);
        let stopped_at = view.apply(&ViewCommand::Stop);
        for node_id in [1, 2] {
            view.apply(&ViewCommand::Resume {
                node_id,
                incarnation: u64::from(node_id),
                stopped_at,
            });
        }
        view.apply(&ViewCommand::PromoteResumed { stopped_at });
        assert_eq!(view.members[&3].state, MemberState::Down);
        view.apply(&ViewCommand::Resume {
            node_id: 3,
            incarnation: 3,
            stopped_at,
        });
        assert_eq!(view.members[&3].state, MemberState::Filling);
        assert_ne!(
            view.members[&3].since, stopped_at,
            "a join's round, not the stop's"
        );
    }

    /// A member resumed from a stop and stopped again before the stop's members serve (an
    /// `up` that failed on another node stops the ones it started) resumes again.
    #[test]
    fn a_resumed_member_stopped_before_anyone_serves_resumes_again() {
        let mut view = ViewState::initial(&[1, 2, 3]);
        let stopped_at = view.apply(&ViewCommand::Stop);
        let resume = |incarnation| ViewCommand::Resume {
            node_id: 1,
            incarnation,
            stopped_at,
        };
        view.apply(&resume(7));
        view.apply(&ViewCommand::MarkDown { node_id: 1 });
        assert_eq!(view.members[&1].state, MemberState::Down);
        assert_eq!(view.members[&1].since, stopped_at, "the round is kept");
        view.apply(&resume(9));
        assert_eq!(view.members[&1].state, MemberState::Filling);
        assert_eq!(view.members[&1].since, stopped_at);
        // Restarted again without being marked down first.
        view.apply(&resume(11));
        assert_eq!(view.members[&1].incarnation, 11);
        assert_eq!(view.members[&1].since, stopped_at);
    }

    /// After a crash of every node (all filling, nobody serving), one command promotes them
    /// all; while any member serves, it changes nothing.
    #[test]
    fn filling_members_serve_together_only_while_nobody_serves() {
        let mut view = ViewState::initial(&[1, 2, 3]);
        // Each node's first start serves; started again (a new incarnation), each fills.
        for incarnation in [10, 20] {
            for node_id in [1, 2, 3] {
                view.apply(&ViewCommand::Join {
                    node_id,
                    incarnation: incarnation + u64::from(node_id),
                });
            }
        }
        assert_eq!(view.public(None).serving(), Vec::<u32>::new());
        let filling = view.epoch;
        assert_eq!(view.apply(&ViewCommand::PromoteFilling), filling + 1);
        assert_eq!(view.public(None).serving(), vec![1, 2, 3]);
        view.apply(&ViewCommand::MarkDown { node_id: 3 });
        view.apply(&ViewCommand::Join {
            node_id: 3,
            incarnation: 33,
        });
        let before = view.epoch;
        assert_eq!(view.apply(&ViewCommand::PromoteFilling), before);
        assert_eq!(view.members[&3].state, MemberState::Filling);
    }

    /// After a crash of every node, the filling members are promoted together only at the
    /// epoch they reconciled under: a join since (a record change) leaves them filling.
    #[test]
    fn a_reconciled_promotion_applies_only_at_its_epoch() {
        let mut view = ViewState::initial(&[1, 2, 3]);
        for incarnation in [10, 20] {
            for node_id in [1, 2] {
                view.apply(&ViewCommand::Join {
                    node_id,
                    incarnation: incarnation + u64::from(node_id),
                });
            }
        }
        view.apply(&ViewCommand::MarkDown { node_id: 3 });
        let reconciled = view.epoch;
        view.apply(&ViewCommand::Join {
            node_id: 3,
            incarnation: 33,
        });
        let before = view.epoch;
        assert_eq!(
            view.apply(&ViewCommand::PromoteReconciled { epoch: reconciled }),
            before,
            "node 3 joined since: it was not scanned"
        );
        assert_eq!(view.public(None).serving(), Vec::<u32>::new());
        assert_eq!(
            view.apply(&ViewCommand::PromoteReconciled { epoch: before }),
            before + 1
        );
        assert_eq!(view.public(None).serving(), vec![1, 2, 3]);
    }

    /// Applies `command` as the store does: the loss rules after it.
    fn apply_noting_loss(view: &mut ViewState, command: ViewCommand, replicas: usize) {
        let before = view.at_risk(replicas);
        let short = view.restarted_short(&command, replicas);
        let previous = view.epoch;
        view.apply(&command);
        if view.record_loss(&before, replicas).is_none() {
            if let Some(node_id) = short {
                view.record_restart_loss(node_id, previous);
            }
        }
    }

    /// With one copy of each key: every member killed and started again (no clean stop
    /// behind it) is one recorded loss naming them all; a clean stop and a resume from it is
    /// none; a member down since the stop that joins instead of resuming (its final snapshot
    /// failed) is one.
    #[test]
    fn with_one_copy_a_restart_without_a_clean_stop_is_a_recorded_loss() {
        let join = |node_id: u32, incarnation: u64| ViewCommand::Join {
            node_id,
            incarnation,
        };
        let mut view = ViewState::initial(&[1, 2, 3]);
        for node_id in 1..=3 {
            apply_noting_loss(&mut view, join(node_id, 10 + u64::from(node_id)), 1);
        }
        assert!(view.losses.is_empty(), "first starts: {:?}", view.losses);
        // A crash of every node: each starts again, never seen down.
        for node_id in 1..=3 {
            apply_noting_loss(&mut view, join(node_id, 20 + u64::from(node_id)), 1);
        }
        assert_eq!(view.losses.len(), 1, "{:?}", view.losses);
        assert_eq!(view.losses[0].nodes, vec![1, 2, 3]);
        assert_eq!(view.losses[0].epoch, view.epoch);
        apply_noting_loss(&mut view, ViewCommand::PromoteFilling, 1);
        let up_to_epoch = view.epoch;
        apply_noting_loss(&mut view, ViewCommand::AcknowledgeLosses { up_to_epoch }, 1);
        // A clean stop and the resume of every node: nothing lost.
        apply_noting_loss(&mut view, ViewCommand::Stop, 1);
        let stopped_at = view.epoch;
        for node_id in 1..=2 {
            apply_noting_loss(
                &mut view,
                ViewCommand::Resume {
                    node_id,
                    incarnation: 30 + u64::from(node_id),
                    stopped_at,
                },
                1,
            );
        }
        assert!(view.losses.is_empty(), "resumed: {:?}", view.losses);
        // Node 3's final snapshot failed: it joins instead of resuming.
        apply_noting_loss(&mut view, join(3, 33), 1);
        assert_eq!(view.losses.len(), 1, "{:?}", view.losses);
        assert_eq!(view.losses[0].nodes, vec![3]);
        // With two copies the filling rule decides, not this one.
        assert_eq!(view.restarted_short(&join(1, 99), 2), None);
    }

    /// With two copies of each key, two members down at once lose the keys they alone held:
    /// recorded once, widened by a third, kept until acknowledged; one member down, a clean
    /// stop and its resume, and members that never joined are no loss.
    #[test]
    fn two_members_down_at_once_with_two_copies_is_a_recorded_loss() {
        let mut view = ViewState::initial(&[1, 2, 3]);
        for node_id in 1..=3 {
            apply_noting_loss(
                &mut view,
                ViewCommand::Join {
                    node_id,
                    incarnation: 10 + u64::from(node_id),
                },
                2,
            );
        }
        apply_noting_loss(&mut view, ViewCommand::MarkDown { node_id: 2 }, 2);
        assert!(view.losses.is_empty(), "one copy of each key is left");
        apply_noting_loss(
            &mut view,
            ViewCommand::Join {
                node_id: 2,
                incarnation: 22,
            },
            2,
        );
        assert!(
            view.losses.is_empty(),
            "filling, with its peers serving every key"
        );
        apply_noting_loss(&mut view, ViewCommand::MarkDown { node_id: 3 }, 2);
        let epoch = view.epoch;
        assert_eq!(
            view.losses,
            vec![CopySetLoss {
                epoch,
                nodes: vec![2, 3]
            }]
        );
        assert_eq!(view.losses_total, 1);
        assert_eq!(
            view.losses[0].to_string(),
            format!("keys may have been lost: the copies on nodes 2 and 3 were down together at epoch {epoch}")
        );
        apply_noting_loss(&mut view, ViewCommand::MarkDown { node_id: 1 }, 2);
        assert_eq!(view.losses.len(), 1, "the same loss, wider");
        assert_eq!(view.losses[0].nodes, vec![1, 2, 3]);
        let widened = view.epoch;
        assert_eq!(view.losses[0].epoch, widened, "wider: a new epoch");
        assert_eq!(view.losses_total, 2, "and counted again");
        assert_eq!(view.public(None).losses, view.losses);

        let acknowledged = view.epoch;
        view.apply(&ViewCommand::AcknowledgeLosses { up_to_epoch: epoch });
        assert_eq!(
            view.losses.len(),
            1,
            "the widened loss was not shown at `epoch`"
        );
        assert_eq!(
            view.apply(&ViewCommand::AcknowledgeLosses {
                up_to_epoch: widened
            }),
            acknowledged,
            "no epoch: no member changed"
        );
        assert!(view.losses.is_empty());
        assert_eq!(view.losses_total, 2, "the count stays");
    }

    #[test]
    fn a_clean_stop_and_its_resume_lose_nothing_and_a_member_that_never_came_back_does() {
        let mut view = ViewState::initial(&[1, 2, 3]);
        for node_id in 1..=3 {
            apply_noting_loss(
                &mut view,
                ViewCommand::Join {
                    node_id,
                    incarnation: u64::from(node_id),
                },
                2,
            );
        }
        apply_noting_loss(&mut view, ViewCommand::Stop, 2);
        let stopped_at = view.epoch;
        assert!(
            view.losses.is_empty(),
            "every node keeps its keys in the stop's snapshot"
        );
        for node_id in [1, 2] {
            apply_noting_loss(
                &mut view,
                ViewCommand::Resume {
                    node_id,
                    incarnation: 20 + u64::from(node_id),
                    stopped_at,
                },
                2,
            );
        }
        apply_noting_loss(&mut view, ViewCommand::PromoteResumed { stopped_at }, 2);
        assert!(
            view.losses.is_empty(),
            "node 3 alone is down: one copy is left"
        );

        let mut view = ViewState::initial(&[1, 2, 3]);
        apply_noting_loss(&mut view, ViewCommand::MarkDown { node_id: 2 }, 2);
        apply_noting_loss(&mut view, ViewCommand::MarkDown { node_id: 3 }, 2);
        assert!(
            view.losses.is_empty(),
            "nodes that never joined held nothing"
        );

        let mut view = ViewState::initial(&[1, 2]);
        apply_noting_loss(
            &mut view,
            ViewCommand::Join {
                node_id: 1,
                incarnation: 1,
            },
            1,
        );
        apply_noting_loss(&mut view, ViewCommand::MarkDown { node_id: 1 }, 1);
        assert_eq!(view.losses.len(), 1, "with one copy, any member down");
    }

    /// A member that stops cleanly comes back with its final snapshot: with one copy of each
    /// key, no loss (killed, it is one); a member that starts late for its first time never
    /// held a key.
    #[test]
    fn a_clean_leave_with_one_copy_and_a_late_first_start_lose_nothing() {
        let mut view = ViewState::initial(&[1, 2, 3]);
        for node_id in 1..=2 {
            apply_noting_loss(
                &mut view,
                ViewCommand::Join {
                    node_id,
                    incarnation: u64::from(node_id),
                },
                1,
            );
        }
        apply_noting_loss(&mut view, ViewCommand::MarkDown { node_id: 3 }, 1);
        apply_noting_loss(
            &mut view,
            ViewCommand::Join {
                node_id: 3,
                incarnation: 3,
            },
            1,
        );
        assert!(
            view.losses.is_empty(),
            "node 3 never served: it held nothing"
        );
        apply_noting_loss(&mut view, ViewCommand::Leave { node_id: 2 }, 1);
        assert!(
            view.losses.is_empty(),
            "node 2 keeps its keys in its final snapshot"
        );
        apply_noting_loss(
            &mut view,
            ViewCommand::Join {
                node_id: 2,
                incarnation: 22,
            },
            1,
        );
        assert!(view.losses.is_empty(), "back, filling: still no loss");
        assert!(view.left_cleanly.is_empty());
        apply_noting_loss(&mut view, ViewCommand::MarkDown { node_id: 1 }, 1);
        assert_eq!(
            view.losses.len(),
            1,
            "node 1 killed: its writes since its snapshot"
        );
    }
    /// A membership change waits for every member that served and does not serve now
    /// (down, or filling after a restart), other than the member it changes: a member added
    /// and not yet joined never served, and does not hold it back.
    #[test]
    fn a_membership_change_waits_for_members_that_served_and_are_down() {
        let mut view = ViewState::initial(&[1, 2, 3]);
        for node_id in 1..=3 {
            view.apply(&ViewCommand::Join {
                node_id,
                incarnation: u64::from(node_id),
            });
        }
        assert!(view.served_and_not_serving(4).is_empty());
        view.apply(&ViewCommand::AddMember {
            node_id: 4,
            address: "127.0.0.1:1".into(),
        });
        assert!(
            view.served_and_not_serving(5).is_empty(),
            "node 4 never served"
        );
        view.apply(&ViewCommand::MarkDown { node_id: 2 });
        assert_eq!(view.served_and_not_serving(4), vec![2]);
        assert!(view.served_and_not_serving(2).is_empty(), "itself");
        view.apply(&ViewCommand::Join {
            node_id: 2,
            incarnation: 22,
        });
        assert_eq!(view.served_and_not_serving(4), vec![2], "filling again");
    }

    /// A member added is down until its join, then joining (filling, never served) until
    /// its promotion; a member retired is leaving (still serving data) until its removal,
    /// which only its own incarnation's hand-over makes. One change at a time is visible.
    #[test]
    fn a_member_is_added_joins_and_serves_and_another_leaves_and_is_removed() {
        let mut view = ViewState::initial(&[1, 2, 3]);
        for node_id in 1..=3 {
            apply_noting_loss(
                &mut view,
                ViewCommand::Join {
                    node_id,
                    incarnation: u64::from(node_id),
                },
                1,
            );
        }
        assert_eq!(view.changing_members(), None);
        let epoch = view.apply(&ViewCommand::AddMember {
            node_id: 4,
            address: "127.0.0.1:1".into(),
        });
        assert_eq!(view.members[&4].state, MemberState::Down);
        assert_eq!(view.changing_members(), Some(4));
        assert_eq!(
            view.apply(&ViewCommand::AddMember {
                node_id: 4,
                address: "127.0.0.1:1".into(),
            }),
            epoch,
            "added already"
        );
        assert!(view.without_whole_copy().is_empty(), "it held nothing");
        view.apply(&ViewCommand::Join {
            node_id: 4,
            incarnation: 44,
        });
        assert_eq!(view.members[&4].state, MemberState::Filling);
        let public = view.public(None);
        assert_eq!(state(&public, 4), MemberState::Joining);
        assert!(view.losses.is_empty());
        view.apply(&ViewCommand::Promote {
            node_id: 4,
            incarnation: 44,
            filling_since: view.members[&4].since,
        });
        assert_eq!(view.changing_members(), None);
        assert_eq!(state(&view.public(None), 4), MemberState::Serving);

        let before = view.clone();
        view.apply(&ViewCommand::Retire { node_id: 1 });
        assert_eq!(view.members[&1].state, MemberState::Leaving);
        assert!(view.placement_differs(&before));
        assert_eq!(
            view.public(None).serving(),
            vec![1, 2, 3, 4],
            "it serves data"
        );
        assert_eq!(view.changing_members(), Some(1));
        let epoch = view.epoch;
        assert_eq!(
            view.apply(&ViewCommand::RemoveMember {
                node_id: 1,
                incarnation: 9,
            }),
            epoch,
            "another process's hand-over removes nothing"
        );
        view.apply(&ViewCommand::RemoveMember {
            node_id: 1,
            incarnation: 1,
        });
        assert!(!view.members.contains_key(&1));
        assert!(!view.ever_served.contains(&1));
        assert_eq!(view.public(None).serving(), vec![2, 3, 4]);
        assert!(view.losses.is_empty());

        // An addition abandoned: node 5 joined, and went down before it served.
        view.apply(&ViewCommand::AddMember {
            node_id: 5,
            address: "127.0.0.1:2".into(),
        });
        view.apply(&ViewCommand::Join {
            node_id: 5,
            incarnation: 55,
        });
        view.apply(&ViewCommand::MarkDown { node_id: 5 });
        assert_eq!(view.changing_members(), Some(5));
        view.apply(&ViewCommand::RemoveMember {
            node_id: 5,
            incarnation: 55,
        });
        assert!(!view.members.contains_key(&5));
        assert_eq!(view.changing_members(), None);
        let epoch = view.epoch;
        assert_eq!(
            view.apply(&ViewCommand::RemoveMember {
                node_id: 2,
                incarnation: 2,
            }),
            epoch,
            "a serving member is removed only after its hand-over"
        );
    }

    /// A member's state in a public view.
    fn state(view: &ClusterView, node_id: u32) -> MemberState {
        view.members
            .iter()
            .find(|member| member.node_id == node_id)
            .map(|member| member.state)
            .expect("a member")
    }
}
