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
use crate::error::{Error, Result};
use crate::fault::StepKind;
use crate::operations::step_failure;
use crate::progress::{Progress, Waiting};

/// Combined buckets one scan step READs (16 KiB).
pub const SCAN_BUCKETS: u64 = 128;

/// Reads of a range that may meet a block failing its checksum (moved or replaced while it
/// was read) before the scan fails ([`Error::Corrupt`]).
const SCAN_ATTEMPTS: u32 = 4;

/// The keys and values held in combined buckets `first .. first + count` of the node
/// (`count` ≤ [`SCAN_BUCKETS`], clamped to the index): every committed or locked slot whose
/// block is intact, holds a key that lives in that bucket, and is not a tombstone. A range
/// whose blocks changed while they were read is read again; after [`SCAN_ATTEMPTS`] the scan
/// fails ([`Error::Corrupt`]) rather than leave a key out.
pub(crate) async fn scan_buckets(
    connection: &Arc<NodeConnection>,
    progress: Arc<Progress>,
    first: u64,
    count: u64,
) -> Result<Vec<(Bytes, Bytes)>> {
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
    for _ in 0..SCAN_ATTEMPTS {
        found.clear();
        let slots = read_range(&mut scratch, first, count).await?;
        if read_entries(&mut scratch, &slots, &mut found).await? {
            return Ok(found);
        }
    }
    // Never a range with a key left out: the caller (a refill) starts over.
    Err(Error::Corrupt {
        operation: "scan",
        attempts: SCAN_ATTEMPTS,
    })
}

/// READs combined buckets `first .. first + count` in one list: their readable slots, each
/// with its combined bucket.
async fn read_range(scratch: &mut Scratch, first: u64, count: u64) -> Result<Vec<(u64, Slot)>> {
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
    let mut slots: Vec<(u64, Slot)> = Vec::new();
    for (index, bucket) in bytes
        .chunks_exact(COMBINED_BUCKET_SIZE as usize)
        .enumerate()
    {
        let parsed: [Slot; SLOTS_PER_COMBINED_BUCKET] = parse_combined_bucket(bucket);
        slots.extend(
            parsed
                .into_iter()
                .filter(|slot| slot.is_readable())
                .map(|slot| (first + index as u64, slot)),
        );
    }
    Ok(slots)
}

/// READs the blocks of `slots` (as many at once as fit the read area) and adds to `found` the
/// key and value of each that is intact, lives in its slot's bucket and is not a tombstone.
/// `Ok(false)`: a block was moved or replaced while it was read (the range is read again).
async fn read_entries(
    scratch: &mut Scratch,
    slots: &[(u64, Slot)],
    found: &mut Vec<(Bytes, Bytes)>,
) -> Result<bool> {
    let connection = scratch.connection().clone();
    let mut remaining = slots;
    let mut intact = true;
    while !remaining.is_empty() && intact {
        let taken = blocks_that_fit(remaining.iter().map(|(_, slot)| *slot));
        let (round, rest) = remaining.split_at(taken);
        remaining = rest;
        let list = block_reads(scratch, round.iter().map(|(_, slot)| *slot));
        scratch
            .execute("scan", StepKind::ReadBlocks, list)
            .await
            .map_err(step_failure("scan"))?;
        let mut at = 0u64;
        for (bucket, slot) in round {
            let mut block = vec![0u8; slot.block_length() as usize];
            scratch
                .region()
                .read(scratch.base + READ_BLOCKS_AT + at, &mut block)?;
            at += slot.block_length();
            let Ok(decoded) = decode_block(&block) else {
                // Moved or replaced while it was read: the range is read again.
                intact = false;
                continue;
            };
            let lives_here = connection
                .welcome
                .geometry
                .locate(decoded.key)
                .combined_buckets
                .contains(bucket);
            if lives_here && !decoded.tombstone {
                found.push((
                    Bytes::copy_from_slice(decoded.key),
                    Bytes::copy_from_slice(decoded.value),
                ));
            }
        }
    }
    Ok(intact)
}
