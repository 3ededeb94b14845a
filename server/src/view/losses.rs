//! Loss records: a view in which every copy of some keys was down at once (`replicas` members
//! down, or filling, together) is recorded in the replicated view state
//! ([`super::types::ViewState::record_loss`]), logged at ERROR by every node that applies it,
//! shown by `rdkv-cluster status` and `rdkv stats`, and counted by
//! `rdkv_copy_sets_lost_total`, until an operator acknowledges it with `rdkv-cluster ack-loss`
//! (`docs/operations.md`, *When copies are lost*).

use super::types::{PeerRequest, ViewCommand};
use super::ViewService;

impl ViewService {
    /// Asks the leader to clear the loss records of epochs up to `up_to_epoch`; how many of
    /// them this node's view held.
    ///
    /// # Errors
    /// Why not (no leader, no quorum).
    pub async fn acknowledge_losses(&self, up_to_epoch: u64) -> std::result::Result<u64, String> {
        let held = self
            .view
            .borrow()
            .losses
            .iter()
            .filter(|loss| loss.epoch <= up_to_epoch)
            .count() as u64;
        if self.raft.is_none() {
            // A one-node cluster's view never changes: it records nothing.
            return Ok(0);
        }
        self.ask_leader_to_commit(
            ViewCommand::AcknowledgeLosses { up_to_epoch },
            &PeerRequest::AcknowledgeLosses { up_to_epoch },
        )
        .await?;
        Ok(held)
    }

    /// Loss records ever committed in this view (the metric `rdkv_copy_sets_lost_total`).
    pub fn losses_total(&self) -> u64 {
        self.view.borrow().losses_total
    }
}
