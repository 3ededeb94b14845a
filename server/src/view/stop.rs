//! A clean stop of the whole cluster, and its start from the stop's snapshots
//! (`docs/operations.md`, *Persistence*).
//!
//! `rdkv-cluster down` asks the leader to commit [`ViewCommand::Stop`]: every serving member is
//! `down` at one epoch, so each node fences its clients and no key moves to another node. Each
//! node then writes its final snapshot, naming the stop, and exits. Started again, a node
//! whose snapshot names the stop that its record is still `down` since asks to **resume**
//! ([`ViewCommand::Resume`]): it is `filling` in the stop's round, with what it loaded and no
//! refill. Once no member is left `down` since the stop (each resumed, or joined to be filled)
//! or [`RESUME_BOUND`] has passed, a resumed node asks for [`ViewCommand::PromoteResumed`]:
//! the resumed members serve together, so no GET reads a node that lacks a key its other copy
//! holds. A member that was filling at the stop, or whose record changed since, joins and is
//! refilled, as after any restart.

use std::time::Duration;

use rdkv_common::protocol::MemberState;

use super::types::{PeerReply, PeerRequest, ViewCommand};
use super::ViewService;

/// How long the resumed members wait for the others of the stop before they serve without
/// them (a node that never comes back): its keys' other copies serve them, and a key it held
/// alone is missing until it returns, which the log says.
pub const RESUME_BOUND: Duration = Duration::from_secs(30);

impl ViewService {
    /// Asks the leader to commit the stop of the whole cluster; the epoch after it.
    ///
    /// # Errors
    /// Why not (no leader, no quorum): the caller stops the nodes one by one instead.
    pub async fn stop_cluster(&self) -> std::result::Result<u64, String> {
        if self.raft.is_none() {
            // A one-node cluster: its view never changes, and its own snapshot is the store.
            return Ok(self.epoch());
        }
        self.ask_leader_to_commit(ViewCommand::Stop, &PeerRequest::Stop)
            .await
    }

    /// The epoch of the stop this node served until, while its record is still `down` since
    /// it: a snapshot written now holds every acknowledged write of its keys.
    pub fn stopped_at(&self) -> Option<u64> {
        // Started from a stop's snapshot and not serving since (resumed and waiting, or not
        // resumed yet: no leader): what it holds is still that stop's.
        if let Some(stopped_at) = self.resume_from {
            let unchanged = self.own_record().is_some_and(|record| {
                record.state != MemberState::Serving && record.since == stopped_at
            });
            if unchanged {
                return Some(stopped_at);
            }
        }
        self.stop_applied_here()
    }

    /// The epoch of the stop this process applied while it served, while its record is still
    /// `down` since it: the process does not rejoin (its next one resumes). The record must
    /// be this process's own (its incarnation): a node killed just before the stop, started
    /// again after it, replays the log that names its record in the stop, but what it holds is
    /// its older snapshot, which must not pass for the stop's (an attack found it written out
    /// as the stop's snapshot, and the next start resumed from it, losing acknowledged writes).
    pub(super) fn stop_applied_here(&self) -> Option<u64> {
        let (epoch, stopped) = self.store.last_stop()?;
        let record = self.own_record()?;
        (stopped.contains(&self.node_id)
            && record.incarnation == self.incarnation
            && record.state == MemberState::Down
            && record.since == epoch)
            .then_some(epoch)
    }

    /// The stop's epoch while this node, started from that stop's snapshot, is resumed and
    /// not serving yet.
    pub fn resumed_round(&self) -> Option<u64> {
        let round = self.filling_round()?;
        (self.resume_from == Some(round)).then_some(round)
    }

    /// The members still `down` since the stop of `stopped_at`: not back yet.
    pub fn not_back_from(&self, stopped_at: u64) -> Vec<u32> {
        self.view
            .borrow()
            .members
            .iter()
            .filter(|(_, record)| record.state == MemberState::Down && record.since == stopped_at)
            .map(|(node_id, _)| *node_id)
            .collect()
    }

    /// Asks the leader to let every member resumed from the stop of `stopped_at` serve.
    ///
    /// # Errors
    /// Why not.
    pub async fn promote_resumed(&self, stopped_at: u64) -> std::result::Result<u64, String> {
        self.ask_leader_to_commit(
            ViewCommand::PromoteResumed { stopped_at },
            &PeerRequest::PromoteResumed { stopped_at },
        )
        .await
    }

    /// Asks the leader to let every filling member serve, while no member serves.
    ///
    /// # Errors
    /// Why not.
    pub async fn promote_filling(&self) -> std::result::Result<u64, String> {
        self.ask_leader_to_commit(ViewCommand::PromoteFilling, &PeerRequest::PromoteFilling)
            .await
    }

    /// Asks the leader to let every filling member serve, while no member serves and the view
    /// is still at `epoch`, under which every filling member reconciled (`crate::reconcile`).
    ///
    /// # Errors
    /// Why not.
    pub async fn promote_reconciled(&self, epoch: u64) -> std::result::Result<u64, String> {
        self.ask_leader_to_commit(
            ViewCommand::PromoteReconciled { epoch },
            &PeerRequest::PromoteReconciled { epoch },
        )
        .await
    }

    /// The command and request that bring this node back into the view: a resume when it
    /// started from the snapshot of the stop its record is still `down` since, else a join.
    pub(super) fn join_command(&self) -> (ViewCommand, PeerRequest) {
        let resumes = self.resume_from.filter(|stopped_at| {
            self.own_record().is_some_and(|record| {
                matches!(record.state, MemberState::Down | MemberState::Filling)
                    && record.since == *stopped_at
            })
        });
        match resumes {
            Some(stopped_at) => (
                ViewCommand::Resume {
                    node_id: self.node_id,
                    incarnation: self.incarnation,
                    stopped_at,
                },
                PeerRequest::Resume {
                    node_id: self.node_id,
                    incarnation: self.incarnation,
                    stopped_at,
                },
            ),
            None => (
                ViewCommand::Join {
                    node_id: self.node_id,
                    incarnation: self.incarnation,
                },
                PeerRequest::Join {
                    node_id: self.node_id,
                    incarnation: self.incarnation,
                },
            ),
        }
    }

    /// On the leader: the answer to a stop, a resume or a promotion of the resumed.
    pub(super) async fn answer_stop_request(&self, request: PeerRequest) -> PeerReply {
        let command = match request {
            PeerRequest::Stop => ViewCommand::Stop,
            PeerRequest::PromoteResumed { stopped_at } => {
                ViewCommand::PromoteResumed { stopped_at }
            }
            PeerRequest::PromoteFilling => ViewCommand::PromoteFilling,
            PeerRequest::PromoteReconciled { epoch } => ViewCommand::PromoteReconciled { epoch },
            PeerRequest::AcknowledgeLosses { up_to_epoch } => {
                ViewCommand::AcknowledgeLosses { up_to_epoch }
            }
            PeerRequest::Resume {
                node_id,
                incarnation,
                stopped_at,
            } => {
                if !self.is_member(node_id) {
                    return PeerReply::Join(Err(format!(
                        "node {node_id} is not a member of this cluster"
                    )));
                }
                // Alive, as a joiner is (`answer_join`).
                self.liveness.heard(node_id);
                self.liveness.lease_requested(node_id);
                if let Some(epoch) = self.back_as(node_id, incarnation) {
                    // Back already (the node has not applied it yet): nothing to log.
                    return PeerReply::Join(Ok(epoch));
                }
                ViewCommand::Resume {
                    node_id,
                    incarnation,
                    stopped_at,
                }
            }
            other => return PeerReply::Malformed(format!("not a stop request: {other:?}")),
        };
        PeerReply::Join(self.commit(command).await)
    }
}
