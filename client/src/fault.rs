//! Fault injection between the steps of an operation.
//!
//! Every one-sided operation is a short sequence of steps, each one posted list and its
//! completions (a round trip). A [`FaultInjector`] in [`crate::ClientConfig`] is asked before a
//! step is posted and again after its completions arrive, and may let it proceed, stall it, or
//! fail it with a work-completion status:
//!
//! - a failure **before** a step means the step never reached the fabric;
//! - a failure **after** a step means it executed at the responder but its completion was lost,
//!   which is what a real RC queue pair reports as `RETRY_EXC_ERR` when an ACK is lost.
//!
//! Tests use it to stall writers between any two steps (so that slow writers race fast ones, the
//! shape that broke linearizability before the tentative-slot protocol) and to check that every
//! error says truthfully whether the operation may have applied
//! ([`crate::Error::may_have_applied`]). Production clients leave it unset; the cost is one
//! branch per round trip.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use rdkv_fabric::WorkCompletionStatus;
use tokio::sync::Semaphore;

/// Which step of an operation (`docs/protocol.md`, *One-sided operations*).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StepKind {
    /// READ the key's combined buckets (a mutation's first one also WRITEs the new block).
    ReadBuckets,
    /// READ the blocks of fingerprint matches.
    ReadBlocks,
    /// CAS an empty slot to a tentative slot (invisible to readers), then READ the buckets.
    PlaceTentative,
    /// CAS other writers' tentative slots of the key to empty.
    KillTentatives,
    /// CAS this operation's own tentative slot back to empty.
    AbortTentative,
    /// CAS this operation's tentative slot to committed: an insert's linearization point.
    Commit,
    /// CAS the key's committed slot to the new block: an update's linearization point.
    Replace,
    /// CAS the key's committed slot to empty: a delete's linearization point.
    Remove,
    /// Replicated write: CAS the primary's committed slot to locked (same block).
    Lock,
    /// Replicated write: CAS a backup's slot to the new block (visible there only after a
    /// failover).
    Backup,
    /// Replicated write: READ the primary's slot, to check that a lock is still the
    /// operation's own before it swaps a backup again.
    CheckLock,
    /// Replicated write: WRITE two copies of the old block on the primary and CAS another
    /// writer's lock to a lock on the first copy.
    Steal,
    /// Replicated write: CAS a stolen lock to the second copy, committed, once every backup
    /// was rolled back.
    Unlock,
}

impl StepKind {
    /// Every kind, in declaration order.
    pub const ALL: [StepKind; 13] = [
        StepKind::ReadBuckets,
        StepKind::ReadBlocks,
        StepKind::PlaceTentative,
        StepKind::KillTentatives,
        StepKind::AbortTentative,
        StepKind::Commit,
        StepKind::Replace,
        StepKind::Remove,
        StepKind::Lock,
        StepKind::Backup,
        StepKind::CheckLock,
        StepKind::Steal,
        StepKind::Unlock,
    ];

    /// The kinds of the single-copy operations (`replicas = 1`), for tests that walk them.
    pub const SINGLE_COPY: [StepKind; 8] = [
        StepKind::ReadBuckets,
        StepKind::ReadBlocks,
        StepKind::PlaceTentative,
        StepKind::KillTentatives,
        StepKind::AbortTentative,
        StepKind::Commit,
        StepKind::Replace,
        StepKind::Remove,
    ];

    /// Whether the step can make the operation's effect visible (a linearization point).
    pub fn publishes(self) -> bool {
        matches!(
            self,
            StepKind::Commit | StepKind::Replace | StepKind::Remove | StepKind::Backup
        )
    }
}

/// When the injector is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Moment {
    /// Before the step's list is posted.
    Before,
    /// After its completions arrived, all successful.
    After,
}

/// One step of one operation, as shown to a [`FaultInjector`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// The operation (`get`, `put`, `insert`, `update`, `compare_and_swap`, `delete`).
    pub operation: &'static str,
    /// The step.
    pub kind: StepKind,
    /// Its number within this attempt of the operation, from 0.
    pub number: u32,
    /// Before or after it ran.
    pub moment: Moment,
}

/// What to do with a step.
#[derive(Debug, Clone)]
pub enum Injection {
    /// Run it normally.
    Proceed,
    /// Wait this long first (before) or afterwards (after).
    Stall(Duration),
    /// Wait until the test adds a permit to this semaphore (the permit is consumed): a
    /// deterministic way to hold an operation between two steps while others run.
    WaitFor(Arc<Semaphore>),
    /// Fail it with this status: before, without posting it; after, although it ran.
    Fail(WorkCompletionStatus),
}

/// Decides, for each step of each operation, whether to stall or fail it. See the module docs.
pub trait FaultInjector: Send + Sync + Debug {
    /// What to do at `step`.
    fn inject(&self, step: &Step) -> Injection;
}
