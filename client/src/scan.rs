//! Reading a node's whole table with one-sided READs, a range of combined buckets at a time:
//! how a node that comes back after a restart finds the keys to copy from its peers (refill,
//! `docs/protocol.md`, *Refill*). The node's CPU takes no part, as in every other operation.

use std::sync::Arc;

use bytes::Bytes;
use rdkv_common::layout::{
    decode_block, parse_combined_bucket, Slot, COMBINED_BUCKET_SIZE, SLOTS_PER_COMBINED_BUCKET,
};
use rdkv_fabric::WorkRequest;

use crate::connection::{NodeConnection, READ_BLOCKS_AT, READ_BLOCKS_SIZE};
use crate::error::Result;
use crate::fault::StepKind;
use crate::operations::step_failure;
use crate::progress::{Progress, Waiting};

/// Combined buckets one scan step READs (16 KiB).
pub const SCAN_BUCKETS: u64 = 128;

/// Reads of a range that may meet a block failing its checksum (moved or replaced while it
/// was read) before the range is given up as it was read.
const SCAN_ATTEMPTS: u32 = 4;

/// The keys and values held in combined buckets `first .. first + count` of the node
/// (`count` ≤ [`SCAN_BUCKETS`], clamped to the index): every committed or locked slot whose
/// block is intact, holds a key that lives in that bucket, and is not a tombstone. A range
/// whose blocks changed while they were read is read again.
pub(crate) async fn scan_buckets(
    connection: &Arc<NodeConnection>,
    progress: Arc<Progress>,
    first: u64,
    count: u64,
) -> Result<Vec<(Bytes, Bytes)>> {
    let geometry = &connection.welcome.geometry;
    let count = count
        .min(SCAN_BUCKETS)
        .min(geometry.combined_bucket_count().saturating_sub(first));
    if count == 0 {
        return Ok(Vec::new());
    }
    progress.wait_for(Waiting::ScratchBuffer);
    let mut scratch = connection.scratch(progress).await?;
    let mut found = Vec::new();
    for _ in 0..SCAN_ATTEMPTS {
        found.clear();
        let length = count * COMBINED_BUCKET_SIZE;
        let request = WorkRequest::read(
            0,
            scratch
                .region()
                .segment(scratch.base + READ_BLOCKS_AT, length as u32),
            connection
                .keys
                .index_key
                .at(geometry.combined_bucket_offset(first)),
        );
        scratch
            .execute("scan", StepKind::ReadBuckets, vec![request])
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
        let mut intact = true;
        let mut remaining = slots.as_slice();
        while !remaining.is_empty() && intact {
            let mut used = 0u64;
            let mut taken = 0;
            for (_, slot) in remaining {
                if used + slot.block_length() > READ_BLOCKS_SIZE && taken > 0 {
                    break;
                }
                used += slot.block_length();
                taken += 1;
            }
            let (round, rest) = remaining.split_at(taken);
            remaining = rest;
            let mut at = 0u64;
            let list: Vec<WorkRequest> = round
                .iter()
                .enumerate()
                .map(|(index, (_, slot))| {
                    let request = WorkRequest::read(
                        index as u64,
                        scratch.region().segment(
                            scratch.base + READ_BLOCKS_AT + at,
                            slot.block_length() as u32,
                        ),
                        connection.keys.heap_key.at(slot.offset()),
                    )
                    .with_signaled(index + 1 == round.len());
                    at += slot.block_length();
                    request
                })
                .collect();
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
                match decode_block(&block) {
                    Ok(decoded) => {
                        let lives_here = geometry
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
                    // Moved or replaced while it was read: read the range again.
                    Err(_) => intact = false,
                }
            }
        }
        if intact {
            break;
        }
    }
    Ok(found)
}
