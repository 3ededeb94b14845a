//! One attempt at a replicated write ([`mutate`]): look the key up on every replica (RT 1-2),
//! lock it on the primary (RT 3; an absent key first gets a committed tombstone to lock), put
//! the block in every backup (RT 4), commit on the primary (RT 5). The blocks are written in
//! RT 1 with a version of the hybrid clock; when the lookup finds a copy of that version or
//! newer, each block's CAS carries a WRITE of a higher version (its stamp) ahead of it.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use rdkv_common::layout::{check_key_value, Slot, SlotPosition};
use rdkv_fabric::WorkRequest;

use super::backups::cas_after;
use super::backups::write_backups;
use super::replicas::{lookup_all, newest_version, prepare, Replica};
use super::{Attempt, Held, Locked, Patience, Write};
use crate::block::Block;
use crate::connection::{NodeConnection, StepList, READ_BLOCKS_AT, READ_BLOCKS_SIZE};
use crate::error::{Error, Result};
use crate::fault::StepKind;
use crate::operations::{
    back_off, cas_step, empty_slot, insert_absent, layout_error, Inserted, Mutation,
    MutationOutcome, View, RACE_ATTEMPTS,
};
use crate::progress::{Progress, Waiting};
use crate::version::next_version;

/// One attempt at a replicated write on `replicas` (primary first): its blocks placed once,
/// then passes ([`ReplicatedWrite::once`]) until one decides, each after a back-off.
pub(crate) async fn mutate(
    replicas: &[Arc<NodeConnection>],
    progress: Arc<Progress>,
    operation: &'static str,
    key: &[u8],
    write: Write<'_>,
    patience: &mut Patience,
    held: &mut Option<Held>,
) -> Result<Attempt> {
    check_key_value(key, write.value()).map_err(layout_error)?;
    let primary = &replicas[0];
    let location = primary.welcome.geometry.locate(key);
    progress.wait_for(Waiting::WriterTurn);
    let _turn = primary.writer_turn(&location).await;
    let block = Block::new(key, write.value(), write.is_delete(), next_version(0));
    let tombstone = Block::new(key, &[], true, block.version());
    // The primary's placement has room for the tombstone after the block.
    let mut copies = prepare(replicas, &progress, key, &block, tombstone.shape()).await?;
    let mut attempt = ReplicatedWrite {
        operation,
        key,
        write,
        block,
        version: block.version(),
        tombstone,
        tombstone_used: false,
        primary: primary.address,
        progress,
    };
    for pass in 0..RACE_ATTEMPTS {
        if let Some(outcome) = attempt.once(&mut copies, patience, held, pass).await? {
            return Ok(outcome);
        }
        back_off(pass).await;
    }
    Err(Error::Contention {
        operation,
        attempts: RACE_ATTEMPTS,
    })
}

/// A replicated write whose blocks are placed on every replica.
struct ReplicatedWrite<'a> {
    /// The operation's name, for errors.
    operation: &'static str,
    /// The key.
    key: &'a [u8],
    /// What it writes.
    write: Write<'a>,
    /// Its block (every replica holds a copy).
    block: Block<'a>,
    /// The version of the copies: the block's, or the last stamp's.
    version: u64,
    /// The tombstone an absent key is locked on (placed right after the primary's block).
    tombstone: Block<'a>,
    /// The tombstone went into the primary's index once: its place is used up.
    tombstone_used: bool,
    /// The primary's control address.
    primary: SocketAddr,
    /// What the operation has posted.
    progress: Arc<Progress>,
}

/// The slot word an attempt locks, when the key is absent on the primary.
enum LockTarget {
    /// This slot, holding this committed word (the tombstone committed for the key just now).
    Slot(SlotPosition, Slot),
    /// Look again after a back-off (every candidate slot is held by inserts in progress).
    LookAgain,
    /// Start the write again with new blocks.
    StartAgain,
}

impl ReplicatedWrite<'_> {
    /// One pass: look the key up everywhere and decide from the primary's view; `None` to look
    /// again after a back-off (read while the key moved, another writer's lock not yet old
    /// enough to steal, or a lost race for the lock).
    async fn once(
        &mut self,
        copies: &mut [Replica],
        patience: &mut Patience,
        held: &mut Option<Held>,
        attempt: u32,
    ) -> Result<Option<Attempt>> {
        let views = lookup_all(copies, self.operation, self.key).await?;
        self.version_above(copies, &views)?;
        let primary_view = views.first().expect("one view per replica");
        let current = match primary_view.committed.as_slice() {
            [] => None,
            [current] => Some(current),
            // Read while the key moved: look again.
            _ => return Ok(None),
        };
        if let Some(other) = current.filter(|current| current.slot.is_locked()) {
            let exhausted = patience.exhausted(other.slot);
            return Ok(exhausted.then(|| Attempt::Steal(Locked::from(other))));
        }
        let present = current
            .filter(|current| !current.tombstone)
            .map(|current| current.value.to_bytes());
        if let Some(outcome) = decide(self.write, present) {
            return Ok(Some(Attempt::Done(outcome)));
        }
        // The word to lock: the key's slot, or a tombstone committed for it now.
        let (position, seen) = match current {
            Some(current) => (current.position, current.slot),
            None => match self
                .commit_tombstone(&mut copies[0], primary_view, attempt)
                .await?
            {
                LockTarget::Slot(position, seen) => (position, seen),
                LockTarget::LookAgain => return Ok(None),
                LockTarget::StartAgain => return Ok(Some(Attempt::Again)),
            },
        };
        let (value, tombstone, version) = current
            .map_or((Bytes::new(), true, self.tombstone.version()), |current| {
                (current.value.to_bytes(), current.tombstone, current.version)
            });
        let locked = Locked {
            position,
            lock: seen.locked(),
            value,
            tombstone,
            version,
        };
        self.lock_and_commit(copies, &views, locked, seen, patience, held)
            .await
    }

    /// Gives the copies a version above every copy of the key that `views` found (a stamp
    /// ahead of each block's CAS), unless theirs is already.
    fn version_above(&mut self, copies: &mut [Replica], views: &[View]) -> Result<()> {
        let Some(newest) = newest_version(views) else {
            return Ok(());
        };
        if newest < self.version {
            return Ok(());
        }
        self.version = next_version(newest.saturating_add(1));
        for copy in copies.iter_mut() {
            copy.restamp(&self.block, self.version)?;
        }
        Ok(())
    }

    /// Commits a tombstone for the absent key in the primary's first empty candidate slot (it
    /// reads as absence), so that the write has a word to lock.
    async fn commit_tombstone(
        &mut self,
        primary: &mut Replica,
        view: &View,
        attempt: u32,
    ) -> Result<LockTarget> {
        if self.tombstone_used {
            return Ok(LockTarget::StartAgain);
        }
        let Some(empty) = empty_slot(view, primary.scratch.connection(), attempt)? else {
            return Ok(LockTarget::LookAgain);
        };
        let (tombstone_slot, remote) = primary
            .extra
            .expect("the primary's placement has room for a tombstone");
        // From the end of the read area: the insert reads blocks there only after this list.
        let scratch = &mut primary.scratch;
        let length = self.tombstone.shape().length();
        let at = scratch.base + READ_BLOCKS_AT + READ_BLOCKS_SIZE - length;
        self.tombstone.write(scratch, at)?;
        let write_tombstone = WorkRequest::write(
            u64::MAX,
            scratch.region().segment(at, length as u32),
            remote,
        )
        .with_signaled(false);
        self.tombstone_used = true;
        let inserted = insert_absent(
            scratch,
            self.operation,
            self.key,
            &primary.location,
            empty,
            tombstone_slot,
            StepList::of(write_tombstone),
        )
        .await;
        // The tombstone's commit publishes nothing: a tombstone reads as absence, and no
        // earlier step of this attempt published (found by review: a cut there ended the write
        // `Unresolved`).
        self.progress.lost();
        Ok(match inserted? {
            Inserted::Committed => LockTarget::Slot(empty, tombstone_slot),
            Inserted::Present(_) | Inserted::Lost => LockTarget::StartAgain,
        })
    }

    /// Locks `locked` on the primary, from the committed word `seen` (RT 3), puts the block in
    /// every backup (RT 4) and commits (RT 5). `None`: the lock's race was lost.
    async fn lock_and_commit(
        &self,
        copies: &mut [Replica],
        views: &[View],
        locked: Locked,
        seen: Slot,
        patience: &mut Patience,
        held: &mut Option<Held>,
    ) -> Result<Option<Attempt>> {
        let (primary, backups) = copies
            .split_first_mut()
            .expect("a replicated write has replicas");
        let (position, lock) = (locked.position, locked.lock);
        // Recorded first: a failure while it is posted leaves it unknown.
        *held = Some(Held {
            primary: self.primary,
            locked,
            new: primary.slot,
            version: self.version,
            confirmed: false,
            commit_posted: false,
        });
        let scratch = &mut primary.scratch;
        if !cas_step(
            scratch,
            self.operation,
            StepKind::Lock,
            position,
            seen,
            lock,
        )
        .await?
        {
            *held = None;
            return Ok(None);
        }
        if let Some(held) = held.as_mut() {
            held.confirmed = true;
        }
        patience.seen = None;
        let (operation, key) = (self.operation, self.key);
        if !write_backups(
            scratch,
            backups,
            &views[1..],
            operation,
            key,
            position,
            lock,
        )
        .await?
        {
            *held = None;
            self.progress.lost();
            return Ok(Some(Attempt::Again));
        }
        self.commit(primary, position, lock, held).await.map(Some)
    }

    /// Commits the primary's block in place of the lock (RT 5), its stamp ahead of the CAS if
    /// one is due: fails only when the lock was stolen since the last check.
    async fn commit(
        &self,
        primary: &mut Replica,
        position: SlotPosition,
        lock: Slot,
        held: &mut Option<Held>,
    ) -> Result<Attempt> {
        if let Some(held) = held.as_mut() {
            held.commit_posted = true;
        }
        let stamp = primary.take_stamp(1);
        let scratch = &mut primary.scratch;
        let committed = cas_after(
            scratch,
            self.operation,
            StepKind::Commit,
            (position, lock, primary.slot),
            stamp,
        )
        .await
        .inspect_err(|_| {
            if !scratch.reached_fabric() {
                if let Some(held) = held.as_mut() {
                    held.commit_posted = false;
                }
            }
        })?;
        *held = None;
        Ok(if committed {
            Attempt::Done(MutationOutcome::Applied)
        } else {
            Attempt::Again
        })
    }
}

/// What a write that found `present` (the key's value; `None`: absent) reports without
/// writing, or `None` when it writes.
fn decide(write: Write<'_>, present: Option<Bytes>) -> Option<MutationOutcome> {
    match (write, present) {
        (Write::Delete, None) => Some(MutationOutcome::Absent),
        (Write::Value(_, Mutation::Insert), Some(present)) => {
            Some(MutationOutcome::Present(present))
        }
        (Write::Value(_, Mutation::Update), None) => Some(MutationOutcome::Absent),
        (Write::Value(_, Mutation::CompareAndSwap { .. }), None) => {
            Some(MutationOutcome::Mismatch(None))
        }
        (Write::Value(_, Mutation::CompareAndSwap { expected }), Some(present))
            if present.as_ref() != expected =>
        {
            Some(MutationOutcome::Mismatch(Some(present)))
        }
        _ => None,
    }
}
