//! Reading a node's whole table with one-sided READs, a range of combined buckets at a time:
//! how a node that comes back after a restart finds the keys to copy from its peers (refill,
//! `docs/protocol.md`, *Refill*). The node's CPU takes no part, as in every other operation.

use std::sync::Arc;

use bytes::Bytes;
use rdkv_common::layout::{
    decode_block, parse_combined_bucket, Slot, COMBINED_BUCKET_SIZE, SLOTS_PER_COMBINED_BUCKET,
};
use rdkv_fabric::WorkRequest;

use crate::block::{block_reads, blocks_that_fit};
use crate::connection::{NodeConnection, Scratch, StepList, READ_BLOCKS_AT};
use crate::error::Result;
use crate::fault::StepKind;
use crate::operations::step_failure;
use crate::progress::{Progress, Waiting};

/// Combined buckets one scan step READs (16 KiB).
pub const SCAN_BUCKETS: u64 = 128;

/// A key found by a scan, with its value and its block's version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedKey {
    /// The key.
    pub key: Bytes,
    /// Its value.
    pub value: Bytes,
    /// Its block's version: of two copies of the key, the higher is the newer.
    pub version: u64,
}

/// Reads of a range's changed slots (a block moved by the compactor, or rewritten) before the
/// scan leaves them to their writers.
const SCAN_ATTEMPTS: u32 = 8;

/// A readable slot of a scanned range: its place in the range (combined bucket `first +
/// place / SLOTS_PER_COMBINED_BUCKET`) and its word.
type RangeSlot = (usize, Slot);

/// The keys and values held in combined buckets `first .. first + count` of the node
/// (`count` ≤ [`SCAN_BUCKETS`], clamped to the index): every committed or locked slot whose
/// block holds a key that lives in that bucket and is not a tombstone.
///
/// An entry counts only if its slot held the same word before and after its block was read:
/// a referenced block is never reused, so the block read is the slot's. (Without the second
/// read, a block that the compactor moved, and whose old place a new block then took, read as
/// another key, and the slot's own key was left out of a refill.) A slot that changed is read
/// again with its new word. One still changing after [`SCAN_ATTEMPTS`] reads is a key written
/// that often: every write under the view a refill runs by reaches the filling node too, so it
/// is left to its writers (logged); a slot whose word stays but whose block never passes its
/// checksum is damaged on the peer, and is logged as a warning.
pub(crate) async fn scan_buckets(
    connection: &Arc<NodeConnection>,
    progress: Arc<Progress>,
    first: u64,
    count: u64,
) -> Result<Vec<ScannedKey>> {
    let count = count.min(SCAN_BUCKETS).min(
        connection
            .welcome
            .geometry
            .combined_bucket_count()
            .saturating_sub(first),
    );
    if count == 0 {
        return Ok(Vec::new());
    }
    progress.wait_for(Waiting::ScratchBuffer);
    let mut scratch = connection.scratch(progress).await?;
    let mut found = Vec::new();
    let mut pending = read_range(&mut scratch, first, count).await?;
    for attempt in 0..SCAN_ATTEMPTS {
        let blocks = read_blocks(&mut scratch, &pending).await?;
        let now = read_range(&mut scratch, first, count).await?;
        let mut changed = Vec::new();
        let mut unreadable = 0usize;
        for ((place, slot), block) in pending.iter().zip(blocks) {
            let current = now
                .binary_search_by_key(place, |(at, _)| *at)
                .ok()
                .map(|index| now[index].1);
            match (current, block) {
                (Some(word), Some(entry)) if word == *slot => {
                    let bucket = first + (place / SLOTS_PER_COMBINED_BUCKET) as u64;
                    let lives_here = connection
                        .welcome
                        .geometry
                        .locate(&entry.key)
                        .combined_buckets
                        .contains(&bucket);
                    if lives_here {
                        found.push(entry);
                    }
                }
                // Unchanged, and a tombstone: the key is absent.
                (Some(word), None) if word == *slot && slot.is_tombstone() => {}
                // Unchanged, and its block failed its checksum: a torn read, or damage.
                (Some(word), None) if word == *slot => {
                    unreadable += 1;
                    changed.push((*place, word));
                }
                // Changed (moved, rewritten): read again by its new word.
                (Some(word), _) => changed.push((*place, word)),
                // Emptied meanwhile: the key was deleted or swept.
                (None, _) => {}
            }
        }
        if changed.is_empty() {
            return Ok(found);
        }
        if attempt + 1 == SCAN_ATTEMPTS {
            if unreadable > 0 {
                tracing::warn!(
                    node = %connection.address,
                    first_bucket = first,
                    slots = unreadable,
                    "scan: blocks that fail their checksum on every read (damaged on that node): their keys are not copied"
                );
            }
            let changing = changed.len() - unreadable;
            if changing > 0 {
                tracing::info!(
                    node = %connection.address,
                    first_bucket = first,
                    slots = changing,
                    "scan: slots still changing after {SCAN_ATTEMPTS} reads are left to their writers (each write reaches the node being filled)"
                );
            }
        }
        pending = changed;
    }
    Ok(found)
}

/// READs combined buckets `first .. first + count` in one list: their readable slots, in
/// place order.
async fn read_range(scratch: &mut Scratch, first: u64, count: u64) -> Result<Vec<RangeSlot>> {
    let connection = scratch.connection().clone();
    let length = count * COMBINED_BUCKET_SIZE;
    let request = WorkRequest::read(
        0,
        scratch
            .region()
            .segment(scratch.base + READ_BLOCKS_AT, length as u32),
        connection
            .keys
            .index_key
            .at(connection.welcome.geometry.combined_bucket_offset(first)),
    );
    scratch
        .execute("scan", StepKind::ReadBuckets, StepList::of(request))
        .await
        .map_err(step_failure("scan"))?;
    let mut bytes = vec![0u8; length as usize];
    scratch
        .region()
        .read(scratch.base + READ_BLOCKS_AT, &mut bytes)?;
    let mut slots = Vec::new();
    for (index, bucket) in bytes
        .chunks_exact(COMBINED_BUCKET_SIZE as usize)
        .enumerate()
    {
        let parsed: [Slot; SLOTS_PER_COMBINED_BUCKET] = parse_combined_bucket(bucket);
        slots.extend(
            parsed
                .into_iter()
                .enumerate()
                .filter(|(_, slot)| slot.is_readable())
                .map(|(position, slot)| (index * SLOTS_PER_COMBINED_BUCKET + position, slot)),
        );
    }
    Ok(slots)
}

/// READs the blocks of `slots` (as many at once as fit the read area): for each, its key and
/// value, or `None` when it is a tombstone or fails its checksum (moved or replaced while it
/// was read).
async fn read_blocks(
    scratch: &mut Scratch,
    slots: &[RangeSlot],
) -> Result<Vec<Option<ScannedKey>>> {
    let mut blocks = Vec::with_capacity(slots.len());
    let mut remaining = slots;
    while !remaining.is_empty() {
        let taken = blocks_that_fit(remaining.iter().map(|(_, slot)| *slot));
        let (round, rest) = remaining.split_at(taken);
        remaining = rest;
        let list = block_reads(scratch, round.iter().map(|(_, slot)| *slot));
        scratch
            .execute("scan", StepKind::ReadBlocks, list)
            .await
            .map_err(step_failure("scan"))?;
        let mut at = 0u64;
        for (_, slot) in round {
            let mut block = vec![0u8; slot.block_length() as usize];
            scratch
                .region()
                .read(scratch.base + READ_BLOCKS_AT + at, &mut block)?;
            at += slot.block_length();
            blocks.push(
                decode_block(&block)
                    .ok()
                    .filter(|decoded| !decoded.tombstone)
                    .map(|decoded| ScannedKey {
                        key: Bytes::copy_from_slice(decoded.key),
                        value: Bytes::copy_from_slice(decoded.value),
                        version: decoded.version,
                    }),
            );
        }
    }
    Ok(blocks)
}
