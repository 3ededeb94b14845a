//! When this node last stopped serving data while the view had it serving as this process:
//! a clean leave, or a lease that lapsed. From that moment on no write of its keys can be
//! acknowledged without a view that moved them elsewhere (a newer epoch), so the node's table
//! holds every acknowledged write of the keys it is a copy of up to then. Its final snapshot
//! says so (`fenced_at`), and a whole-cluster start after nodes stopped one at a time lets
//! that copy decide over older ones, absences included (`crate::reconcile`,
//! `docs/protocol.md`, *Reconciliation*).

use super::lease::StopCause;
use super::ViewService;
use crate::snapshot::file::Fence;

impl ViewService {
    /// Whether the view this node knows has it serving as this process (a record of
    /// incarnation 0 is this process's while the node has no earlier history: a cluster's
    /// first start, as `lease.rs`'s `view_standing` reads it).
    fn serving_member(&self) -> bool {
        self.own_record().is_some_and(|record| {
            record.state.serves_data()
                && (record.incarnation == self.incarnation
                    || (record.incarnation == 0 && !self.had_history))
        })
    }

    /// Records a change of whether the node serves data: stopping for want of a lease while
    /// the view has it serving records the epoch; serving again, or stopping because the view
    /// moved it, forgets it.
    pub(super) fn note_serving_change(&self, stopped: Option<StopCause>) {
        let at = match stopped {
            Some(StopCause::Lease) if self.serving_member() => Some(self.fence_now()),
            _ => None,
        };
        *rdkv_fabric::lock(&self.stopped_serving_at) = at;
    }

    /// Records a clean leave, before the node stops serving: the epoch now if it serves as a
    /// member of the view; kept as it was when it had stopped already (a lapsed lease).
    pub(super) fn note_leaving(&self) {
        if self.serving.borrow().is_ok() {
            let at = self.serving_member().then(|| self.fence_now());
            *rdkv_fabric::lock(&self.stopped_serving_at) = at;
        }
    }

    /// The view epoch now, and the clock.
    fn fence_now(&self) -> Fence {
        Fence {
            epoch: self.epoch(),
            unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |since| since.as_millis() as u64),
        }
    }

    /// When (the view epoch, and the clock) this node stopped serving data while the view had
    /// it serving as this process, if it has not served since: its table then holds every
    /// write acknowledged of its keys until then, and it accepted none later. `None` while it
    /// serves, after it stopped for the view's reason (down, filling, restarted), or in a node
    /// outside consensus.
    pub fn stopped_serving_at(&self) -> Option<Fence> {
        self.raft.as_ref()?;
        *rdkv_fabric::lock(&self.stopped_serving_at)
    }
}
