//! Going on with a replicated write whose connections failed while it held (or was placing)
//! its lock on the primary ([`resume`]): a fence at a view change cuts operations on keys it
//! does not move, and this lets them finish.

use std::sync::Arc;

use rdkv_common::layout::Slot;

use super::backups::{holds_lock, settle};
use super::replicas::prepare;
use super::{steal, Held, Resumed, Write, CHECK_AT};
use crate::block::Block;
use crate::connection::{NodeConnection, StepList};
use crate::error::Result;
use crate::fault::StepKind;
use crate::operations::cas_step;
use crate::progress::Progress;

/// Goes on with a write whose connections failed while it held (or was placing) its lock
/// `held`, on `replicas` under the view now (the same primary): READ the slot; the write's own
/// word means it committed; its lock means it still holds the key, so it puts its value in
/// every backup of the view now (READ, check, CAS) and commits a fresh copy of its block (the
/// first one lies in the failed connection's heap grant, which the server may reclaim while no
/// slot points into it). A fence at a view change cuts operations on keys it does not move, and
/// this lets them finish. `held` is updated as it goes, for a next try if this one fails too.
///
/// A lock whose CAS never completed may be another writer's lock on the same old block: it is
/// taken over ([`steal`], safe at any moment), and the write starts again.
pub(super) async fn resume(
    replicas: &[Arc<NodeConnection>],
    progress: Arc<Progress>,
    operation: &'static str,
    key: &[u8],
    write: Write<'_>,
    held: &mut Held,
) -> Result<Resumed> {
    let block = Block::new(key, write.value(), write.is_delete(), held.version);
    let mut copies = prepare(replicas, &progress, key, &block, block.shape()).await?;
    let (primary_copy, backups) = copies
        .split_first_mut()
        .expect("a replicated write has replicas");
    let scratch = &mut primary_copy.scratch;
    let (position, lock) = (held.locked.position, held.locked.lock);
    // The fresh block's WRITE goes with the check (the commit below follows it on the queue
    // pair).
    let write_block = StepList::starting_with(primary_copy.write.take(), 1);
    if !holds_lock(scratch, operation, position, lock, write_block).await? {
        let word = Slot(scratch.region().load_u64(scratch.base + CHECK_AT)?);
        if word == held.new {
            return Ok(Resumed::Applied);
        }
        if held.commit_posted {
            // Committed and overwritten since, or taken over: nobody can tell.
            return Ok(Resumed::Unknown);
        }
        // Only a commit or a takeover ends a lock, and no commit of this one was posted: it
        // was taken over, and its thief rolls every backup back to the value under it.
        progress.lost();
        return Ok(Resumed::Again);
    }
    if !held.confirmed {
        drop(copies);
        steal(
            replicas,
            Arc::new(Progress::default()),
            operation,
            key,
            &held.locked,
        )
        .await?;
        progress.lost();
        return Ok(Resumed::Again);
    }
    for copy in backups.iter_mut() {
        if !settle(scratch, copy, (operation, key), (position, lock), None).await? {
            progress.lost();
            return Ok(Resumed::Again);
        }
    }
    // The lock is still this write's, so no earlier commit of it applied: this one decides.
    let previous = (held.new, held.commit_posted);
    held.new = primary_copy.slot;
    held.commit_posted = true;
    let committed = cas_step(
        &mut primary_copy.scratch,
        operation,
        StepKind::Commit,
        position,
        lock,
        held.new,
    )
    .await
    .inspect_err(|_| {
        if !primary_copy.scratch.reached_fabric() {
            (held.new, held.commit_posted) = previous;
        }
    })?;
    Ok(if committed {
        Resumed::Applied
    } else {
        Resumed::Again
    })
}
