//! Replicated writes (`replicas` ≥ 2; `docs/protocol.md`, *Replication*). A write locks the
//! key's slot on its primary (the same block, both state bits set: readers still read the old
//! value), puts its own copy of the new block in every backup's slot by CAS, and commits on the
//! primary: 5 round trips, all one-sided. A writer that finds another writer's lock for longer
//! than [`STEAL_PATIENCE`] steals it ([`steal`]): it locks the slot on a fresh copy of the old
//! block, rolls every backup back to a copy of the old value, and unlocks, so a writer that
//! stalls or dies holding a lock blocks its key for the patience at most.
//!
//! Readers read the primary only, with [`crate::operations::get`]: a locked slot reads as the
//! value it held, a tombstone (a replicated delete) as absence. Every CAS expects an exact word,
//! and every block is new, so a stalled lock holder's CAS can never land after anyone else
//! changed the slot. The protocol is model-checked in `protocol-model/src/replication.rs`.
//!
//! A file per part (here: what they share):
//!
//! - `replicas`: a scratch buffer and a placed copy of the block on each replica, and the
//!   lookup of the key on all of them at once;
//! - `backups`: putting the block in the backups (one CAS each, then READ, check, CAS);
//! - `write`: one attempt at a write (lookup, lock, backups, commit);
//! - `resume`: going on with a write whose connections failed while it held its lock;
//! - `steal`: taking over another writer's lock and rolling its write back;
//! - `operation`: the client's side: a GET and a write on a replicated cluster, under the
//!   view, within the deadline.

use std::time::{Duration, Instant};

use bytes::Bytes;
use rdkv_common::layout::{Slot, SlotPosition};

use crate::connection::CAS_RESULTS_AT;
use crate::operations::{Match, Mutation, MutationOutcome};

mod backups;
mod operation;
mod replicas;
mod resume;
mod steal;
mod write;

use resume::resume;
use steal::steal;
use write::mutate;

/// How long a writer waits for another writer's lock to go before it steals it. A write holds
/// its lock for two round trips (the backups' CAS, the commit), so a lock this old belongs to
/// a writer that stalled or died.
pub(crate) const STEAL_PATIENCE: Duration = Duration::from_millis(10);

/// Where in the CAS result area the lock check READs the primary's slot (the last of 32).
const CHECK_AT: u64 = CAS_RESULTS_AT + 31 * 8;

/// What a replicated mutation writes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Write<'a> {
    /// A value, under a condition.
    Value(&'a [u8], Mutation<'a>),
    /// A tombstone: a delete.
    Delete,
}

impl<'a> Write<'a> {
    /// The value it writes (empty for a delete).
    fn value(self) -> &'a [u8] {
        match self {
            Write::Value(value, _) => value,
            Write::Delete => &[],
        }
    }

    /// Whether it writes a tombstone (a delete).
    fn is_delete(self) -> bool {
        matches!(self, Write::Delete)
    }
}

/// What one replicated attempt came to.
#[derive(Debug)]
pub(crate) enum Attempt {
    /// Done: a delete reports `Applied` (it deleted) or `Absent`.
    Done(MutationOutcome),
    /// Another writer's lock outlived [`STEAL_PATIENCE`]: [`steal`] it, then start again.
    Steal(Locked),
    /// The operation's lock was stolen before its commit (nothing of it is visible), or its
    /// blocks were used up: start again with new ones.
    Again,
}

/// A lock found on the primary.
#[derive(Debug, Clone)]
pub(crate) struct Locked {
    /// The slot.
    position: SlotPosition,
    /// The locked word.
    lock: Slot,
    /// The value under the lock.
    value: Bytes,
    /// Whether it is a tombstone.
    tombstone: bool,
    /// The version of the block under it (a rollback's copies keep it).
    version: u64,
}

impl From<&Match> for Locked {
    /// The lock `found` in the primary's slot.
    fn from(found: &Match) -> Self {
        Self {
            position: found.position,
            lock: found.slot,
            value: found.value.to_bytes(),
            tombstone: found.tombstone,
            version: found.version,
        }
    }
}

/// The lock an operation placed on the primary, kept across a failure of its connections (a
/// fence at a view change) so that it can go on from where it was ([`resume`]).
#[derive(Debug, Clone)]
pub(crate) struct Held {
    /// The primary's control address.
    pub(crate) primary: std::net::SocketAddr,
    /// The lock as another writer finds it: the key's slot there, the lock word, and the value
    /// under it (what a takeover puts back).
    locked: Locked,
    /// The committed word of the operation's block there.
    new: Slot,
    /// The version of the operation's blocks (a fresh copy after a failure keeps it).
    version: u64,
    /// The lock's CAS completed and swapped: the lock word in the slot is this operation's.
    /// Until then, the same word may be another writer's lock on the same old block.
    confirmed: bool,
    /// A commit of this lock was posted (and its outcome is unknown). Only a commit or a
    /// takeover ends a lock, so a lock gone without one was taken over.
    commit_posted: bool,
}

/// How [`resume`] ended.
#[derive(Debug)]
pub(crate) enum Resumed {
    /// The write is done (committed now or before the failure).
    Applied,
    /// The lock is gone and the write never showed: start it again.
    Again,
    /// The slot holds neither the lock nor the write: it was taken over, or committed and then
    /// overwritten. Which, nobody can tell.
    Unknown,
}

/// The lock a writer keeps finding on the primary, and since when (across its attempts).
#[derive(Debug, Default)]
pub(crate) struct Patience {
    /// The word, and when it was first seen.
    seen: Option<(Slot, Instant)>,
}

impl Patience {
    /// Whether `lock` has been seen for [`STEAL_PATIENCE`] (starting the clock if it is new).
    fn exhausted(&mut self, lock: Slot) -> bool {
        match self.seen {
            Some((seen, since)) if seen == lock => since.elapsed() >= STEAL_PATIENCE,
            _ => {
                self.seen = Some((lock, Instant::now()));
                false
            }
        }
    }
}
