//! Putting a replicated write's block in the backups: one CAS each, all at once, from what the
//! lookup read ([`write_backups`]); then, for each whose slot changed first, READ, check that
//! the primary still holds the lock, and only then CAS ([`settle`]). A backup that lacks the
//! key gets it by an insert ([`swap_once`]).

use rdkv_common::layout::{Slot, SlotPosition};
use rdkv_fabric::WorkRequest;

use super::replicas::{count_overlap, newest_version, round_trips, Replica};
use super::CHECK_AT;
use crate::block::Block;
use crate::connection::{Scratch, StepList};
use crate::error::{Error, Result};
use crate::fault::StepKind;
use crate::operations::{
    back_off, cas_original, empty_slot, insert_absent, lookup, slot_cas, step_failure, Candidates,
    FirstList, Inserted, View, LOOKUP_REQUESTS, RACE_ATTEMPTS,
};
use crate::version::next_version;
use futures_util::future::try_join_all;

/// One try at putting the operation's block in a backup's slot, from exactly what `view` read
/// there: a CAS of the key's slot, or an insert where the backup lacks the key. `Ok(false)`:
/// the slot changed first.
pub(super) async fn swap_once(
    copy: &mut Replica,
    view: &View,
    operation: &'static str,
    key: &[u8],
    attempt: u32,
) -> Result<bool> {
    match view.committed.as_slice() {
        [current] => {
            let stamp = copy.take_stamp(1);
            cas_after(
                &mut copy.scratch,
                operation,
                StepKind::Backup,
                (current.position, current.slot, copy.slot),
                stamp,
            )
            .await
        }
        [] => {
            let Some(empty) = empty_slot(view, copy.scratch.connection(), attempt)? else {
                return Ok(false);
            };
            // The block's WRITE (if still due), then its stamp, then the insert.
            let mut before = StepList::starting_with(copy.write.take(), 2 + LOOKUP_REQUESTS);
            if let Some(stamp) = copy.stamp.take() {
                before.push(stamp);
            }
            copy.scratch.backup_posting();
            let inserted = insert_absent(
                &mut copy.scratch,
                operation,
                key,
                &copy.location,
                empty,
                copy.slot,
                before,
            )
            .await?;
            Ok(inserted == Inserted::Committed)
        }
        // Read while the key moved: read again.
        _ => Ok(false),
    }
}

/// One CAS of one slot, `(position, expected, new)`, as its own step after `before` (a block's
/// stamp) in the same list; `Ok(true)` when it swapped.
pub(super) async fn cas_after(
    scratch: &mut Scratch,
    operation: &'static str,
    kind: StepKind,
    (position, expected, new): (SlotPosition, Slot, Slot),
    mut before: StepList,
) -> Result<bool> {
    before.reserve(1);
    before.push(slot_cas(scratch, 0, position, expected, new));
    scratch
        .execute(operation, kind, before)
        .await
        .map_err(step_failure(operation))?;
    let swapped = cas_original(scratch, 0)? == expected;
    if !swapped {
        scratch.lost_race(kind);
    }
    Ok(swapped)
}

/// READs the primary's slot at `position` (after `before`, in the same list): whether it
/// still holds `lock`.
pub(super) async fn holds_lock(
    primary: &mut Scratch,
    operation: &'static str,
    position: SlotPosition,
    lock: Slot,
    before: StepList,
) -> Result<bool> {
    let connection = primary.connection().clone();
    let mut list = before;
    list.reserve(1);
    list.push(WorkRequest::read(
        0,
        primary.region().segment(primary.base + CHECK_AT, 8),
        connection
            .keys
            .index_key
            .at(connection.welcome.geometry.slot_offset(position)),
    ));
    primary
        .execute(operation, StepKind::CheckLock, list)
        .await
        .map_err(step_failure(operation))?;
    Ok(Slot(primary.region().load_u64(primary.base + CHECK_AT)?) == lock)
}

/// A thief's rollback ([`super::steal`]): the block of the old value it puts back, and the
/// version its copies get, raised above every backup copy it reads before swapping it.
pub(super) struct Rollback<'a> {
    /// The old value's block.
    pub(super) block: Block<'a>,
    /// The rollback's version so far.
    pub(super) version: u64,
}

impl Rollback<'_> {
    /// Raises the version above the copy `view` found on `copy`'s node, and stamps `copy`'s
    /// block with it (its block was written with the old value's version).
    fn stamp_above(&mut self, copy: &mut Replica, view: &View) -> Result<()> {
        if let Some(newest) = newest_version(std::slice::from_ref(view)) {
            if newest >= self.version {
                self.version = next_version(newest.saturating_add(1));
            }
        }
        copy.restamp(&self.block, self.version)
    }
}

/// Puts the operation's block in a backup by READ, check, CAS: READ the backup's slot, check
/// that the primary still holds `lock`, and only then swap from what was just read; until it
/// swaps. `Ok(false)`: the lock is no longer the operation's (stolen), so the backup is not
/// its to touch. (Swapping without the check lets a stalled thief undo the next writer's
/// value: the model's `unchecked-rollback`.) A `rollback` stamps its copy above what it read
/// there (the model's `rollback-keeps-version` shows why).
pub(super) async fn settle(
    primary: &mut Scratch,
    copy: &mut Replica,
    (operation, key): (&'static str, &[u8]),
    (position, lock): (SlotPosition, Slot),
    mut rollback: Option<&mut Rollback<'_>>,
) -> Result<bool> {
    for attempt in 0..RACE_ATTEMPTS {
        let first = FirstList::new(
            StepKind::ReadBuckets,
            StepList::starting_with(copy.write.take(), LOOKUP_REQUESTS),
        );
        let view = lookup(
            &mut copy.scratch,
            operation,
            key,
            &copy.location,
            first,
            Candidates::Committed,
        )
        .await?;
        if !holds_lock(primary, operation, position, lock, StepList::new()).await? {
            return Ok(false);
        }
        if let Some(rollback) = rollback.as_deref_mut() {
            rollback.stamp_above(copy, &view)?;
        }
        if swap_once(copy, &view, operation, key, attempt).await? {
            return Ok(true);
        }
        back_off(attempt).await;
    }
    Err(Error::Contention {
        operation,
        attempts: RACE_ATTEMPTS,
    })
}

/// Writes every backup: one CAS each, all at once, from what the lookup read; then READ,
/// check, CAS for each whose slot changed first. `Ok(false)`: the lock was stolen.
pub(super) async fn write_backups(
    primary: &mut Scratch,
    backups: &mut [Replica],
    views: &[View],
    operation: &'static str,
    key: &[u8],
    position: SlotPosition,
    lock: Slot,
) -> Result<bool> {
    let before = round_trips(backups);
    let swapped = try_join_all(
        backups
            .iter_mut()
            .zip(views)
            .map(|(copy, view)| swap_once(copy, view, operation, key, 0)),
    )
    .await?;
    count_overlap(backups, &before);
    for (copy, swapped) in backups.iter_mut().zip(swapped) {
        if !swapped && !settle(primary, copy, (operation, key), (position, lock), None).await? {
            return Ok(false);
        }
    }
    Ok(true)
}
