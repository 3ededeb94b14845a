//! Taking over another writer's lock ([`steal`]): a writer that finds a lock older than
//! [`super::STEAL_PATIENCE`] rolls its write back, so a writer that stalls or dies holding a
//! lock blocks its key for the patience at most.

use std::sync::Arc;

use rdkv_fabric::WorkRequest;

use super::backups::{cas_after, settle, Rollback};
use super::replicas::prepare;
use super::Locked;
use crate::block::Block;
use crate::connection::{NodeConnection, StepList, WRITE_BLOCK_AT};
use crate::error::Result;
use crate::fault::StepKind;
use crate::operations::{cas_original, slot_cas, step_failure};
use crate::progress::Progress;
use crate::version::next_version;

/// Takes over `locked` and rolls its write back: WRITE two copies of the old block on the
/// primary and CAS the lock to a lock on the first (every lock word is then unique to its
/// holder); put a copy of the old value in every backup by READ, check, CAS; then CAS the lock
/// to the second copy, committed. The lock's copy keeps the old value's version; the copies
/// the rollback puts in place get a version above it and above every backup copy read before
/// its swap (a rolled-back write's copy there, perhaps in a snapshot already), so that after a
/// crash of every node the newest copy is never a rolled-back write's that a later write tied
/// with (`docs/protocol.md`, *Versions*; the model's `rollback-keeps-version`). Returns once the lock is gone, released here or taken over
/// by another thief first. `progress` is the takeover's own: nothing of it is the caller's
/// operation.
pub(super) async fn steal(
    replicas: &[Arc<NodeConnection>],
    progress: Arc<Progress>,
    operation: &'static str,
    key: &[u8],
    locked: &Locked,
) -> Result<()> {
    let block = Block::new(key, &locked.value, locked.tombstone, locked.version);
    let mut copies = prepare(replicas, &progress, key, &block, block.shape()).await?;
    let (primary_copy, backups) = copies
        .split_first_mut()
        .expect("a replicated write has replicas");
    let (unlocked, second) = primary_copy
        .extra
        .expect("the primary's placement has room for the second copy");
    let mine = primary_copy.slot.locked();
    // The block's WRITE, a second copy's, and the lock's CAS.
    let mut list = StepList::starting_with(primary_copy.write.take(), 2);
    let scratch = &mut primary_copy.scratch;
    let copy_source = scratch
        .region()
        .segment(scratch.base + WRITE_BLOCK_AT, block.shape().length() as u32);
    list.push(WorkRequest::write(u64::MAX, copy_source, second).with_signaled(false));
    list.push(slot_cas(scratch, 0, locked.position, locked.lock, mine));
    scratch
        .execute(operation, StepKind::Steal, list)
        .await
        .map_err(step_failure(operation))?;
    if cas_original(scratch, 0)? != locked.lock {
        // Released or taken over meanwhile.
        scratch.lost_race(StepKind::Steal);
        return Ok(());
    }
    scratch.connection().counters.locks_stolen.add(1);
    let mut rollback = Rollback {
        block,
        version: next_version(locked.version.saturating_add(1)),
    };
    for copy in backups.iter_mut() {
        let lock = (locked.position, mine);
        if !settle(scratch, copy, (operation, key), lock, Some(&mut rollback)).await? {
            return Ok(());
        }
    }
    primary_copy.restamp_at(&rollback.block, rollback.version, second)?;
    let stamp = primary_copy.take_stamp(1);
    cas_after(
        &mut primary_copy.scratch,
        operation,
        StepKind::Unlock,
        (locked.position, mine, unlocked),
        stamp,
    )
    .await?;
    Ok(())
}
