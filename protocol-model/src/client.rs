//! A client's local state between two of its atomic steps.
//!
//! Each client runs a fixed script of operations in order. Between steps it remembers only what
//! the real client keeps on its stack: which operation it is in, what it does next
//! ([`Phase`]), its copy of the slots read so far, and how many times the operation restarted.
//! Keeping this small keeps the state space small.

use crate::bucket::{Bucket, Slot};
use crate::key_value::Outcome;

/// Names one operation of one client in the linearizability history.
///
/// Every operation gets its own history "thread": an operation that gives up stays pending
/// forever (it may or may not have taken effect), while its client goes on with its script. The
/// tester still orders a client's operations, because each one returned before the next began.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OperationId {
    /// The client, numbered from 1.
    pub client: u8,
    /// The operation's position in the client's script, from 0.
    pub index: u8,
}

/// What a client does at its next step. Each phase is one atomic access to one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The next operation has not been invoked yet; its first step invokes it and reads slot 0.
    Start,
    /// Reading the bucket, one slot per step; `next` is the slot read at this step.
    Read {
        /// The slot read at this step.
        next: u8,
    },
    /// CAS `slot` from `expected` to `replacement`; success reports `outcome`, failure restarts.
    /// Both protocols: update in place; new protocol: delete of the committed slot.
    Replace {
        /// The slot swapped.
        slot: u8,
        /// The word read earlier.
        expected: Slot,
        /// The word written.
        replacement: Slot,
        /// Reported when the swap succeeds.
        outcome: Outcome,
    },
    /// Put or insert of an absent key: CAS the first empty slot to the new block (old: committed,
    /// new: tentative).
    Place {
        /// The slot that was empty.
        slot: u8,
    },
    /// After placing: re-reading the bucket, one slot per step (old: resolve duplicates, new:
    /// confirm the placement).
    Reread {
        /// The slot read at this step.
        next: u8,
        /// The slot this operation placed its block in.
        mine: u8,
    },
    /// Old protocol, losing put: CAS the winner (lowest match) from `expected` to my block.
    OverwriteWinner {
        /// The lowest-position match.
        winner: u8,
        /// The winner's word as re-read.
        expected: Slot,
        /// The slot this operation placed its block in.
        mine: u8,
    },
    /// Old protocol, losing insert or put: CAS my own slot back to empty, then report `outcome`
    /// whether or not that CAS succeeded.
    RemoveDuplicate {
        /// The slot this operation placed its block in.
        mine: u8,
        /// Reported after this step.
        outcome: Outcome,
    },
    /// Old protocol delete: CAS the matching `slot` to empty; matches go highest position first
    /// and the lowest (the winner) last.
    ClearForDelete {
        /// The slot cleared at this step.
        slot: u8,
    },
    /// New protocol: kill (withdraw) another operation's tentative slot of my key: CAS it to
    /// empty. The kills go out together, one slot per step, and are judged after the last one.
    Kill {
        /// The tentative slot killed at this step.
        slot: u8,
        /// The slot this operation placed its block in.
        mine: u8,
        /// What the kills so far found.
        tally: KillTally,
    },
    /// New protocol: another slot holds my key committed; CAS my tentative slot back to empty.
    Abort {
        /// The slot this operation placed its block in.
        mine: u8,
    },
    /// New protocol: CAS my tentative slot to committed.
    Commit {
        /// The slot this operation placed its block in.
        mine: u8,
    },
    /// The script is done.
    Finished,
}

/// What a round of kills found, judged once the last kill of the round has run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KillTally {
    /// A kill failed because its inserter committed that very block first.
    pub rival_committed: bool,
    /// A kill failed and found anything else (killed by someone else, or committed and then
    /// replaced in place, or reused).
    pub slot_changed: bool,
}

/// One client's local state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ClientState {
    /// The position of the current operation in the script.
    pub operation_index: u8,
    /// What the next step does.
    pub phase: Phase,
    /// The slots read so far in the current (re)read; the rest are kept empty so that equal
    /// situations are equal states.
    pub snapshot: Bucket,
    /// How many times the current operation restarted (bounded by the model's retry budget).
    pub restarts: u8,
}

impl ClientState {
    /// A client about to start its script (or already finished, if the script is empty).
    pub fn new(slot_count: usize, script_length: usize) -> Self {
        Self {
            operation_index: 0,
            phase: if script_length == 0 {
                Phase::Finished
            } else {
                Phase::Start
            },
            snapshot: Bucket::empty(slot_count),
            restarts: 0,
        }
    }
}
