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

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::try_join_all;
use rdkv_common::layout::{
    check_key_value, encode_block_with, KeyLocation, Slot, SlotPosition, BLOCK_UNIT,
};
use rdkv_fabric::{RemoteSegment, WorkRequest};

use crate::connection::{
    NodeConnection, Scratch, CAS_RESULTS_AT, READ_BLOCKS_AT, READ_BLOCKS_SIZE, WRITE_BLOCK_AT,
};
use crate::error::{Error, Result};
use crate::fault::StepKind;
use crate::operations::{
    back_off, cas_original, cas_step, empty_slot, insert_absent, layout_error, lookup, slot_cas,
    step_failure, Candidates, FirstList, Inserted, Mutation, MutationOutcome, View, RACE_ATTEMPTS,
};
use crate::progress::{Progress, Waiting};

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

/// One replica's part of an operation: its scratch buffer, the key's place in its index, and
/// the block placed there for the operation.
struct Replica {
    /// The scratch buffer on the replica's connection.
    scratch: Scratch,
    /// The key's buckets and fingerprint in the replica's index.
    location: KeyLocation,
    /// The committed slot word of the block placed on the replica.
    slot: Slot,
    /// The block's WRITE, until the replica's first list carries it.
    write: Option<WorkRequest>,
    /// A second block placed right after the first (the primary only): its committed slot
    /// word and where it goes.
    extra: Option<(Slot, RemoteSegment)>,
}

/// What a block placed for an operation is: its length in units, and whether it is a
/// tombstone (its slot word says so too).
#[derive(Debug, Clone, Copy)]
struct Shape {
    /// 64-byte units.
    units: u8,
    /// A tombstone.
    tombstone: bool,
}

impl Shape {
    /// The committed slot word of a block of this shape at `offset`.
    fn slot(self, fingerprint: u8, offset: u64) -> Slot {
        let slot = Slot::new(fingerprint, self.units, offset);
        if self.tombstone {
            slot.tombstone()
        } else {
            slot
        }
    }
}

/// Takes a scratch buffer on every replica, in control-address order (so two operations never
/// each hold a buffer the other waits for), writes `block` into each, and places it in each
/// replica's heap; on the primary, a block of shape `extra` follows it.
async fn prepare(
    replicas: &[Arc<NodeConnection>],
    progress: &Arc<Progress>,
    key: &[u8],
    block: &[u8],
    shape: Shape,
    extra: Shape,
) -> Result<Vec<Replica>> {
    let mut order: Vec<usize> = (0..replicas.len()).collect();
    order.sort_by_key(|index| replicas[*index].address);
    let mut copies: Vec<Option<Replica>> = replicas.iter().map(|_| None).collect();
    let length = block.len() as u64;
    for index in order {
        let connection = &replicas[index];
        progress.wait_for(Waiting::ScratchBuffer);
        let mut scratch = connection.scratch(progress.clone()).await?;
        scratch
            .region()
            .write(scratch.base + WRITE_BLOCK_AT, block)?;
        let extra_length = if index == 0 {
            u64::from(extra.units) * BLOCK_UNIT
        } else {
            0
        };
        progress.wait_for(Waiting::HeapChunk);
        let place = scratch.place_block(length + extra_length).await?;
        let location = connection.welcome.geometry.locate(key);
        let write = WorkRequest::write(
            u64::MAX,
            scratch
                .region()
                .segment(scratch.base + WRITE_BLOCK_AT, length as u32),
            place.remote.at(place.offset_in_chunk),
        )
        .with_signaled(false);
        let extra = (index == 0).then(|| {
            (
                extra.slot(location.fingerprint, place.heap_offset + length),
                place.remote.at(place.offset_in_chunk + length),
            )
        });
        copies[index] = Some(Replica {
            scratch,
            slot: shape.slot(location.fingerprint, place.heap_offset),
            location,
            write: Some(write),
            extra,
        });
    }
    Ok(copies.into_iter().flatten().collect())
}

/// Looks the key up on every replica at once; each replica's first list carries its block's
/// WRITE.
async fn lookup_all(
    copies: &mut [Replica],
    operation: &'static str,
    key: &[u8],
) -> Result<Vec<View>> {
    let before = round_trips(copies);
    let views = try_join_all(copies.iter_mut().map(|copy| {
        let Replica {
            scratch,
            location,
            write,
            ..
        } = copy;
        let first = FirstList::new(StepKind::ReadBuckets, write.take().into_iter().collect());
        lookup(
            scratch,
            operation,
            key,
            location,
            first,
            Candidates::Committed,
        )
    }))
    .await?;
    count_overlap(copies, &before);
    Ok(views)
}

/// Each replica's round trips so far.
fn round_trips(copies: &[Replica]) -> Vec<u64> {
    copies.iter().map(|copy| copy.scratch.round_trips).collect()
}

/// Counts the round trips that ran alongside others since `before`: all but the longest
/// replica's (an operation's own sequence is its round trips less these).
fn count_overlap(copies: &[Replica], before: &[u64]) {
    let made: Vec<u64> = copies
        .iter()
        .zip(before)
        .map(|(copy, before)| copy.scratch.round_trips - before)
        .collect();
    let longest = made.iter().copied().max().unwrap_or(0);
    if let Some(copy) = copies.first() {
        copy.scratch
            .connection()
            .counters
            .overlapped_round_trips
            .add(made.iter().sum::<u64>() - longest);
    }
}

/// One try at putting the operation's block in a backup's slot, from exactly what `view` read
/// there: a CAS of the key's slot, or an insert where the backup lacks the key. `Ok(false)`:
/// the slot changed first.
async fn swap_once(
    copy: &mut Replica,
    view: &View,
    operation: &'static str,
    key: &[u8],
    attempt: u32,
) -> Result<bool> {
    match view.committed.as_slice() {
        [current] => {
            cas_step(
                &mut copy.scratch,
                operation,
                StepKind::Backup,
                current.position,
                current.slot,
                copy.slot,
            )
            .await
        }
        [] => {
            let Some(empty) = empty_slot(view, copy.scratch.connection(), attempt)? else {
                return Ok(false);
            };
            let before = copy.write.take().into_iter().collect();
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

/// READs the primary's slot at `position` (after `before`, in the same list): whether it
/// still holds `lock`.
async fn holds_lock(
    primary: &mut Scratch,
    operation: &'static str,
    position: SlotPosition,
    lock: Slot,
    before: Vec<WorkRequest>,
) -> Result<bool> {
    let connection = primary.connection().clone();
    let mut list = before;
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

/// Puts the operation's block in a backup by READ, check, CAS: READ the backup's slot, check
/// that the primary still holds `lock`, and only then swap from what was just read; until it
/// swaps. `Ok(false)`: the lock is no longer the operation's (stolen), so the backup is not
/// its to touch. (Swapping without the check lets a stalled thief undo the next writer's
/// value: the model's `unchecked-rollback`.)
async fn settle(
    primary: &mut Scratch,
    copy: &mut Replica,
    operation: &'static str,
    key: &[u8],
    position: SlotPosition,
    lock: Slot,
) -> Result<bool> {
    for attempt in 0..RACE_ATTEMPTS {
        let first = FirstList::new(
            StepKind::ReadBuckets,
            copy.write.take().into_iter().collect(),
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
        if !holds_lock(primary, operation, position, lock, Vec::new()).await? {
            return Ok(false);
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
async fn write_backups(
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
        if !swapped && !settle(primary, copy, operation, key, position, lock).await? {
            return Ok(false);
        }
    }
    Ok(true)
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

/// One attempt at a replicated write on `replicas` (primary first): look the key up on all
/// (RT 1-2), lock it on the primary (RT 3; an absent key first gets a committed tombstone to
/// lock), write every backup (RT 4), commit (RT 5).
pub(crate) async fn mutate(
    replicas: &[Arc<NodeConnection>],
    progress: Arc<Progress>,
    operation: &'static str,
    key: &[u8],
    write: Write<'_>,
    patience: &mut Patience,
    held: &mut Option<Held>,
) -> Result<Attempt> {
    let value = match write {
        Write::Value(value, _) => value,
        Write::Delete => &[],
    };
    check_key_value(key, value).map_err(layout_error)?;
    let primary = &replicas[0];
    let location = primary.welcome.geometry.locate(key);
    progress.wait_for(Waiting::WriterTurn);
    let _turn = primary.writer_turn(&location).await;
    let mut block = Vec::with_capacity(value.len() + key.len() + 64);
    let units = encode_block_with(key, value, matches!(write, Write::Delete), &mut block);
    let mut tombstone = Vec::with_capacity(key.len() + 64);
    let tombstone_units = encode_block_with(key, &[], true, &mut tombstone);
    let shape = Shape {
        units,
        tombstone: matches!(write, Write::Delete),
    };
    let extra = Shape {
        units: tombstone_units,
        tombstone: true,
    };
    let mut copies = prepare(replicas, &progress, key, &block, shape, extra).await?;
    let mut tombstone_used = false;
    for attempt in 0..RACE_ATTEMPTS {
        let views = lookup_all(&mut copies, operation, key).await?;
        let (primary_copy, backups) = copies
            .split_first_mut()
            .expect("a replicated write has replicas");
        let (primary_view, backup_views) = views.split_first().expect("one view per replica");
        let current = match primary_view.committed.as_slice() {
            [] => None,
            [current] => Some(current),
            _ => {
                // Read while the key moved: look again.
                back_off(attempt).await;
                continue;
            }
        };
        if let Some(held) = current.filter(|current| current.slot.is_locked()) {
            if patience.exhausted(held.slot) {
                return Ok(Attempt::Steal(Locked {
                    position: held.position,
                    lock: held.slot,
                    value: held.value.clone(),
                    tombstone: held.tombstone,
                }));
            }
            back_off(attempt).await;
            continue;
        }
        let present = current
            .filter(|current| !current.tombstone)
            .map(|current| current.value.clone());
        if let Some(outcome) = decide(write, present) {
            return Ok(Attempt::Done(outcome));
        }
        // The word to lock: the key's slot, or a tombstone committed for it now.
        let (position, seen) = match current {
            Some(current) => (current.position, current.slot),
            None if tombstone_used => return Ok(Attempt::Again),
            None => {
                let Some(empty) =
                    empty_slot(primary_view, primary_copy.scratch.connection(), attempt)?
                else {
                    back_off(attempt).await;
                    continue;
                };
                let (tombstone_slot, remote) = primary_copy
                    .extra
                    .expect("the primary's placement has room for a tombstone");
                // From the end of the read area: the insert reads blocks there only after
                // this list.
                let scratch = &mut primary_copy.scratch;
                let at = scratch.base + READ_BLOCKS_AT + READ_BLOCKS_SIZE - tombstone.len() as u64;
                scratch.region().write(at, &tombstone)?;
                let write_tombstone = WorkRequest::write(
                    u64::MAX,
                    scratch.region().segment(at, tombstone.len() as u32),
                    remote,
                )
                .with_signaled(false);
                tombstone_used = true;
                let inserted = insert_absent(
                    scratch,
                    operation,
                    key,
                    &location,
                    empty,
                    tombstone_slot,
                    vec![write_tombstone],
                )
                .await;
                // The tombstone's commit publishes nothing: a tombstone reads as absence, and
                // no earlier step of this attempt published (found by review: a cut there
                // ended the write `Unresolved`).
                progress.lost();
                match inserted? {
                    Inserted::Committed => (empty, tombstone_slot),
                    Inserted::Present(_) | Inserted::Lost => return Ok(Attempt::Again),
                }
            }
        };
        // Lock (RT 3). Recorded first: a failure while it is posted leaves it unknown.
        let lock = seen.locked();
        let (old_value, old_tombstone) = match current {
            Some(current) => (current.value.clone(), current.tombstone),
            None => (Bytes::new(), true),
        };
        *held = Some(Held {
            primary: primary.address,
            locked: Locked {
                position,
                lock,
                value: old_value,
                tombstone: old_tombstone,
            },
            new: primary_copy.slot,
            confirmed: false,
            commit_posted: false,
        });
        if !cas_step(
            &mut primary_copy.scratch,
            operation,
            StepKind::Lock,
            position,
            seen,
            lock,
        )
        .await?
        {
            *held = None;
            back_off(attempt).await;
            continue;
        }
        if let Some(held) = held.as_mut() {
            held.confirmed = true;
        }
        patience.seen = None;
        // Backups (RT 4).
        if !write_backups(
            &mut primary_copy.scratch,
            backups,
            backup_views,
            operation,
            key,
            position,
            lock,
        )
        .await?
        {
            *held = None;
            progress.lost();
            return Ok(Attempt::Again);
        }
        // Commit (RT 5): fails only when the lock was stolen since the last check.
        let new = primary_copy.slot;
        if let Some(held) = held.as_mut() {
            held.commit_posted = true;
        }
        let committed = cas_step(
            &mut primary_copy.scratch,
            operation,
            StepKind::Commit,
            position,
            lock,
            new,
        )
        .await
        .inspect_err(|_| {
            if !primary_copy.scratch.reached_fabric() {
                if let Some(held) = held.as_mut() {
                    held.commit_posted = false;
                }
            }
        })?;
        *held = None;
        return Ok(if committed {
            Attempt::Done(MutationOutcome::Applied)
        } else {
            Attempt::Again
        });
    }
    Err(Error::Contention {
        operation,
        attempts: RACE_ATTEMPTS,
    })
}

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
pub(crate) async fn resume(
    replicas: &[Arc<NodeConnection>],
    progress: Arc<Progress>,
    operation: &'static str,
    key: &[u8],
    write: Write<'_>,
    held: &mut Held,
) -> Result<Resumed> {
    let value = match write {
        Write::Value(value, _) => value,
        Write::Delete => &[],
    };
    let mut block = Vec::with_capacity(value.len() + key.len() + 64);
    let tombstone = matches!(write, Write::Delete);
    let units = encode_block_with(key, value, tombstone, &mut block);
    let shape = Shape { units, tombstone };
    let mut copies = prepare(replicas, &progress, key, &block, shape, shape).await?;
    let (primary_copy, backups) = copies
        .split_first_mut()
        .expect("a replicated write has replicas");
    let scratch = &mut primary_copy.scratch;
    let (position, lock) = (held.locked.position, held.locked.lock);
    // The fresh block's WRITE goes with the check (the commit below follows it on the queue
    // pair).
    let write_block = primary_copy.write.take().into_iter().collect();
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
        if !settle(scratch, copy, operation, key, position, lock).await? {
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

/// Takes over `locked` and rolls its write back: WRITE two copies of the old block on the
/// primary and CAS the lock to a lock on the first (every lock word is then unique to its
/// holder); put a copy of the old value in every backup by READ, check, CAS; then CAS the lock
/// to the second copy, committed. Returns once the lock is gone, released here or taken over
/// by another thief first. `progress` is the takeover's own: nothing of it is the caller's
/// operation.
pub(crate) async fn steal(
    replicas: &[Arc<NodeConnection>],
    progress: Arc<Progress>,
    operation: &'static str,
    key: &[u8],
    locked: &Locked,
) -> Result<()> {
    let mut block = Vec::with_capacity(locked.value.len() + key.len() + 64);
    let units = encode_block_with(key, &locked.value, locked.tombstone, &mut block);
    let shape = Shape {
        units,
        tombstone: locked.tombstone,
    };
    let mut copies = prepare(replicas, &progress, key, &block, shape, shape).await?;
    let (primary_copy, backups) = copies
        .split_first_mut()
        .expect("a replicated write has replicas");
    let (unlocked, second) = primary_copy
        .extra
        .expect("the primary's placement has room for the second copy");
    let mine = primary_copy.slot.locked();
    let mut list: Vec<WorkRequest> = primary_copy.write.take().into_iter().collect();
    let scratch = &mut primary_copy.scratch;
    let copy_source = scratch
        .region()
        .segment(scratch.base + WRITE_BLOCK_AT, block.len() as u32);
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
    for copy in backups.iter_mut() {
        if !settle(scratch, copy, operation, key, locked.position, mine).await? {
            return Ok(());
        }
    }
    cas_step(
        scratch,
        operation,
        StepKind::Unlock,
        locked.position,
        mine,
        unlocked,
    )
    .await?;
    Ok(())
}
