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

use std::sync::atomic::{AtomicBool, Ordering};

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
}

impl Progress {
    /// A list of `kind` is about to be posted.
    pub(crate) fn posting(&self, kind: StepKind) {
        if !matches!(kind, StepKind::ReadBuckets | StepKind::ReadBlocks) {
            self.cas_posted.store(true, Ordering::Release);
        }
        if kind.publishes() {
            self.may_have_applied.store(true, Ordering::Release);
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
}
