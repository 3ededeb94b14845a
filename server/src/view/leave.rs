//! A clean leave (`rdkv-cluster down --node N`, SIGTERM, `systemctl stop`): the node stops
//! serving, then asks the leader to commit it `down` at once, so its keys move to their next
//! copies without waiting for `failure_timeout` of silence (`docs/protocol.md`, *Views and
//! fencing*).
//!
//! The order is what makes it safe: the node stops serving first (its lease word reads "not
//! serving" and its data connections are fenced), so no client reads or writes it by the old
//! view once a view without it is committed. On the leader, the commit goes through the same
//! pending-down lock as the failure detector's: it grants the leaving node no lease meanwhile.

use std::time::Duration;

use super::types::{PeerReply, PeerRequest, ViewCommand};
use super::ViewService;

/// How long a leaving node waits for the view without it: a commit takes milliseconds; a node
/// that cannot reach a quorum stops anyway, and the others mark it down after
/// `failure_timeout`, as after a crash.
pub const LEAVE_BOUND: Duration = Duration::from_secs(2);

impl ViewService {
    /// Stops serving, then asks the leader to commit this node down, within [`LEAVE_BOUND`].
    /// Logs the outcome; a node outside consensus (one node) does nothing here.
    pub async fn leave(&self) {
        if self.raft.is_none() {
            // One node: no view to leave and no copies to move to; the shutdown's teardown
            // ends its connections (as `server shutting down`).
            return;
        }
        self.note_leaving();
        self.leaving
            .store(true, std::sync::atomic::Ordering::Release);
        self.publish_lease();
        let reason = "this node is leaving the cluster (a clean stop)".to_string();
        let _previous = self.serving.send_replace(Err(reason));
        if self.own_record().is_none()
            || self.resumed_round().is_some()
            || self
                .own_record()
                .is_some_and(|record| record.state == rdkv_common::protocol::MemberState::Down)
        {
            // Removed from the view (`remove-node`), down already (the whole cluster's stop, or
            // the leader's decision), or resumed from a stop and not serving yet (it resumes
            // again, `stop.rs`): nothing moves.
            return;
        }
        let started = std::time::Instant::now();
        let command = ViewCommand::Leave {
            node_id: self.node_id,
        };
        let request = PeerRequest::Leave {
            node_id: self.node_id,
            incarnation: self.incarnation,
        };
        let asked =
            tokio::time::timeout(LEAVE_BOUND, self.ask_leader_to_commit(command, &request)).await;
        match asked {
            Ok(Ok(epoch)) => tracing::info!(
                node = self.node_id,
                epoch,
                took = ?started.elapsed(),
                "left the cluster view: its keys moved to their next copies"
            ),
            // Info, not a warning: when the whole cluster stops, the leader is often gone
            // first, and nobody is left to move the keys to.
            Ok(Err(reason)) => tracing::info!(
                node = self.node_id,
                %reason,
                "could not leave the cluster view cleanly: the others, if any run, mark this node down after failure_timeout"
            ),
            Err(_) => tracing::warn!(
                node = self.node_id,
                bound = ?LEAVE_BOUND,
                "no view without this node within the bound: the others mark it down after failure_timeout"
            ),
        }
    }

    /// On the leader: a member asks to leave as `incarnation`. Commits it down (as the failure
    /// detector does, under the lock lease grants take), or says why not.
    pub(super) async fn commit_leave(&self, node_id: u32, incarnation: u64) -> PeerReply {
        let record_since = {
            let view = self.view.borrow();
            match view.members.get(&node_id) {
                None => {
                    return PeerReply::Join(Err(format!(
                        "node {node_id} is not a member of this cluster"
                    )))
                }
                Some(record) if record.incarnation != incarnation => {
                    return PeerReply::Join(Err(format!(
                        "node {node_id} is not in the view as that process"
                    )))
                }
                Some(record) => record.since,
            }
        };
        self.pending_down_lock().insert(node_id, record_since);
        PeerReply::Join(self.commit(ViewCommand::Leave { node_id }).await)
    }
}
