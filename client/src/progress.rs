//! What an operation has done so far, shared between the operation and [`crate::Client`]'s
//! retry and deadline logic, so that every failure can say truthfully whether the operation may
//! have applied.
//!
//! - Once any CAS of an operation has been posted, it is never retried internally: a tentative
//!   slot it placed, or a publishing CAS, belongs to this attempt.
//! - A *publishing* CAS (commit, replace, remove: the linearization points) marks the operation
//!   "may have applied" from the moment it is posted until its completion shows that it lost its
//!   race. A failure or a deadline in between leaves the mark, and the error says so
//!   ([`crate::Error::may_have_applied`]).
//!
//! - A tentative slot placed and not yet committed or withdrawn is recorded too: if the
//!   operation fails or passes its deadline then, the client retires the connection, so that
//!   the server seals its chunk and clears the abandoned slot (`docs/protocol.md`, *Abandoned
//!   tentative slots*).
//!
//! The flags are atomics because the deadline drops the operation's future and reads them
//! afterwards.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

use crate::fault::StepKind;

/// The progress of one operation.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    /// A CAS of this operation was posted.
    cas_posted: AtomicBool,
    /// A tentative slot may be in the index that this operation has not yet committed or
    /// withdrawn.
    tentative_outstanding: AtomicBool,
    /// A publishing CAS was posted and not (yet) seen to lose.
    may_have_applied: AtomicBool,
    /// A replicated write's backup CAS was posted, in any attempt: never cleared. A backup may
    /// keep the value after its lock was taken over, until the thief rolls it back; a view that
    /// makes that backup the primary first shows it.
    backup_posted: AtomicBool,
    /// What the operation is waiting for now ([`Waiting`] as a number), for a deadline's error.
    waiting: AtomicU8,
}

thread_local! {
    /// This thread's records of operations that ended, for the next ones ([`Progress::start`],
    /// [`Progress::recycle`]): no allocation per operation on the steady path.
    static SPARE: std::cell::RefCell<Vec<Arc<Progress>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

impl Progress {
    /// The record of a new operation: one this thread kept ([`Progress::recycle`]), or a new
    /// one.
    pub(crate) fn start() -> Arc<Progress> {
        crate::spare::take(&SPARE, |_| true).unwrap_or_default()
    }

    /// Keeps the record of an operation that ended, when nothing else holds it, reset, for
    /// a later operation of this thread.
    pub(crate) fn recycle(mut progress: Arc<Progress>) {
        let Some(record) = Arc::get_mut(&mut progress) else {
            return;
        };
        *record = Progress::default();
        crate::spare::keep(&SPARE, progress);
    }
}

/// What an operation waits for; a deadline's error names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Waiting {
    /// The connection to the node (connect, handshake).
    Connection,
    /// This process's turn to write the key.
    WriterTurn,
    /// A free scratch buffer (all are in use by other operations).
    ScratchBuffer,
    /// Heap space: the server's answer to a request for a chunk.
    HeapChunk,
    /// Heap space the server said it is reclaiming (it answered that none is free now).
    HeapReclaim,
    /// The completions of a posted list of this kind.
    Step(StepKind),
    /// The cluster view (a replicated operation whose node failed, or whose view is old).
    View,
    /// A view with a member serving, while every member fills and reconciles.
    Reconciliation,
    /// The key's node to serve data (it answered that it does not yet).
    NodeServing,
}

impl Waiting {
    /// Every value, in encoding order.
    const ALL: [Waiting; 21] = [
        Waiting::Connection,
        Waiting::WriterTurn,
        Waiting::ScratchBuffer,
        Waiting::HeapChunk,
        Waiting::HeapReclaim,
        Waiting::Step(StepKind::ReadBuckets),
        Waiting::Step(StepKind::ReadBlocks),
        Waiting::Step(StepKind::PlaceTentative),
        Waiting::Step(StepKind::KillTentatives),
        Waiting::Step(StepKind::AbortTentative),
        Waiting::Step(StepKind::Commit),
        Waiting::Step(StepKind::Replace),
        Waiting::Step(StepKind::Remove),
        Waiting::Step(StepKind::Lock),
        Waiting::Step(StepKind::Backup),
        Waiting::Step(StepKind::CheckLock),
        Waiting::Step(StepKind::Steal),
        Waiting::Step(StepKind::Unlock),
        Waiting::View,
        Waiting::Reconciliation,
        Waiting::NodeServing,
    ];

    /// What a deadline's error says.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Waiting::Connection => "the connection to the node",
            Waiting::WriterTurn => "this process's turn to write the key",
            Waiting::ScratchBuffer => "a free scratch buffer",
            Waiting::HeapChunk => "the server's answer to a request for heap space",
            Waiting::HeapReclaim => "heap space the server is reclaiming",
            Waiting::Step(StepKind::ReadBuckets) => "the READ of the key's buckets",
            Waiting::Step(StepKind::ReadBlocks) => "the READ of candidate blocks",
            Waiting::Step(StepKind::PlaceTentative) => "the CAS that places a tentative slot",
            Waiting::Step(StepKind::KillTentatives) => {
                "the CASes that withdraw other inserters' slots"
            }
            Waiting::Step(StepKind::AbortTentative) => "the CAS that withdraws its tentative slot",
            Waiting::Step(StepKind::Commit) => "the commit CAS",
            Waiting::Step(StepKind::Replace) => "the CAS that replaces the value",
            Waiting::Step(StepKind::Remove) => "the CAS that removes the key",
            Waiting::Step(StepKind::Lock) => "the CAS that locks the key on its primary",
            Waiting::Step(StepKind::Backup) => "the CAS that writes the key on a backup",
            Waiting::Step(StepKind::CheckLock) => "the READ that checks the primary's lock",
            Waiting::Step(StepKind::Steal) => "the CAS that takes over a stalled writer's lock",
            Waiting::Step(StepKind::Unlock) => "the CAS that releases a taken-over lock",
            Waiting::View => "the cluster view (a node of the key failed or the view changed)",
            Waiting::NodeServing => {
                "the key's node to serve data: it answers, but is starting, resuming after a stop of the cluster, or reconciling (`rdkv-cluster status` shows it)"
            }
            Waiting::Reconciliation => {
                "the cluster's start: every node is filling or resuming after a stop or crash of all of them, and none serves until the members are back and agree on the newest copy of each key (`rdkv-cluster status` shows what they wait for)"
            }
        }
    }
}

impl Progress {
    /// A list of `kind` is about to be posted.
    pub(crate) fn posting(&self, kind: StepKind) {
        if !matches!(
            kind,
            StepKind::ReadBuckets | StepKind::ReadBlocks | StepKind::CheckLock
        ) {
            self.cas_posted.store(true, Ordering::Release);
        }
        if kind.publishes() {
            self.may_have_applied.store(true, Ordering::Release);
        }
        if kind == StepKind::Backup {
            self.backup_posting();
        }
        if kind == StepKind::PlaceTentative {
            self.tentative_outstanding.store(true, Ordering::Release);
        }
    }

    /// The operation's tentative slot is gone: committed, withdrawn (by itself or another
    /// inserter), or never placed (the place CAS lost).
    pub(crate) fn tentative_resolved(&self) {
        self.tentative_outstanding.store(false, Ordering::Release);
    }

    /// Whether a tentative slot of this operation may be left in the index. The client then
    /// retires the connection, so that its chunk is sealed and the server's collector clears the
    /// slot a quarantine later.
    pub(crate) fn tentative_outstanding(&self) -> bool {
        self.tentative_outstanding.load(Ordering::Acquire)
    }

    /// The operation now waits for `what`.
    pub(crate) fn wait_for(&self, what: Waiting) {
        // The index of `what` in `Waiting::ALL`: the five waits, then the steps in
        // `StepKind` declaration order (the order of `StepKind::ALL`).
        let code = match what {
            Waiting::Connection => 0,
            Waiting::WriterTurn => 1,
            Waiting::ScratchBuffer => 2,
            Waiting::HeapChunk => 3,
            Waiting::HeapReclaim => 4,
            Waiting::Step(kind) => 5 + kind as u8,
            Waiting::View => 5 + StepKind::ALL.len() as u8,
            Waiting::Reconciliation => 6 + StepKind::ALL.len() as u8,
            Waiting::NodeServing => 7 + StepKind::ALL.len() as u8,
        };
        self.waiting.store(code, Ordering::Release);
    }

    /// What the operation was waiting for last.
    pub(crate) fn waiting_for(&self) -> Waiting {
        Waiting::ALL[usize::from(self.waiting.load(Ordering::Acquire)) % Waiting::ALL.len()]
    }

    /// The list of `kind` was refused before anything was posted.
    pub(crate) fn not_posted(&self, kind: StepKind) {
        if kind.publishes() {
            self.may_have_applied.store(false, Ordering::Release);
        }
    }

    /// The publishing CAS completed and did not swap: it had no effect.
    pub(crate) fn lost(&self) {
        self.may_have_applied.store(false, Ordering::Release);
    }

    /// Whether any CAS was posted.
    pub(crate) fn cas_posted(&self) -> bool {
        self.cas_posted.load(Ordering::Acquire)
    }

    /// Whether the operation may have applied.
    pub(crate) fn may_have_applied(&self) -> bool {
        self.may_have_applied.load(Ordering::Acquire)
    }

    /// A replicated write's value is about to go to a backup.
    pub(crate) fn backup_posting(&self) {
        self.backup_posted.store(true, Ordering::Release);
    }

    /// Whether a backup CAS of this operation was ever posted.
    pub(crate) fn backup_posted(&self) -> bool {
        self.backup_posted.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wait_round_trips_through_its_code() {
        let progress = Progress::default();
        for what in Waiting::ALL {
            progress.wait_for(what);
            assert_eq!(progress.waiting_for(), what);
        }
    }
}
