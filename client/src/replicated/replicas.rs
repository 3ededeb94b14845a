//! Each replica's part of a replicated operation ([`Replica`]): a scratch buffer on its
//! connection, a copy of the operation's block placed in its heap ([`prepare`]), and the lookup
//! of the key on every replica at once ([`lookup_all`]), whose round trips that ran alongside
//! others are counted as overlapped.

use std::sync::Arc;

use futures_util::future::try_join_all;
use rdkv_common::layout::{KeyLocation, Slot};
use rdkv_fabric::{RemoteSegment, WorkRequest};

use crate::block::{Block, BlockShape, STAMP_OFFSET};
use crate::connection::{NodeConnection, Scratch, StepList, WRITE_BLOCK_AT};
use crate::error::Result;
use crate::fault::StepKind;
use crate::operations::{
    block_write_request, lookup, Candidates, FirstList, View, LOOKUP_REQUESTS,
};
use crate::progress::{Progress, Waiting};

/// One replica's part of an operation: its scratch buffer, the key's place in its index, and
/// the block placed there for the operation.
pub(super) struct Replica {
    /// The scratch buffer on the replica's connection.
    pub(super) scratch: Scratch,
    /// The key's buckets and fingerprint in the replica's index.
    pub(super) location: KeyLocation,
    /// The committed slot word of the block placed on the replica.
    pub(super) slot: Slot,
    /// The block's WRITE, until the replica's first list carries it.
    pub(super) write: Option<WorkRequest>,
    /// Where the block lies in the replica's heap.
    pub(super) block_at: RemoteSegment,
    /// The WRITE of the block's version and checksum, once the write learnt a version above the
    /// one its block was written with ([`Replica::restamp`]), until the list of the CAS that
    /// publishes the block carries it.
    pub(super) stamp: Option<WorkRequest>,
    /// A second block placed right after the first (the primary only): its committed slot
    /// word and where it goes.
    pub(super) extra: Option<(Slot, RemoteSegment)>,
}

/// Takes a scratch buffer on every replica, in control-address order (so two operations never
/// each hold a buffer the other waits for), writes `block` into each, and places it in each
/// replica's heap; on the primary, room for a block of shape `extra` follows it.
pub(super) async fn prepare(
    replicas: &[Arc<NodeConnection>],
    progress: &Arc<Progress>,
    key: &[u8],
    block: &Block<'_>,
    extra: BlockShape,
) -> Result<Vec<Replica>> {
    let mut order: Vec<usize> = (0..replicas.len()).collect();
    order.sort_by_key(|index| replicas[*index].address);
    let mut copies: Vec<Option<Replica>> = replicas.iter().map(|_| None).collect();
    let shape = block.shape();
    let length = shape.length();
    for index in order {
        let connection = &replicas[index];
        progress.wait_for(Waiting::ScratchBuffer);
        let mut scratch = connection.scratch(progress.clone()).await?;
        block.write(&scratch, scratch.base + WRITE_BLOCK_AT)?;
        let extra_length = if index == 0 { extra.length() } else { 0 };
        progress.wait_for(Waiting::HeapChunk);
        let place = scratch.place_block(length + extra_length).await?;
        let location = connection.welcome.geometry.locate(key);
        let second = (index == 0).then(|| {
            (
                extra.slot(location.fingerprint, place.heap_offset + length),
                place.remote.at(place.offset_in_chunk + length),
            )
        });
        copies[index] = Some(Replica {
            write: Some(block_write_request(&scratch, shape, place)),
            block_at: place.remote.at(place.offset_in_chunk),
            stamp: None,
            scratch,
            slot: shape.slot(location.fingerprint, place.heap_offset),
            location,
            extra: second,
        });
    }
    Ok(copies.into_iter().flatten().collect())
}

impl Replica {
    /// Gives the replica's block `version`: its stamp (version and checksum) into the scratch
    /// buffer's copy of the block, and a WRITE of it over the block's, which the list of the
    /// CAS that publishes the block carries ahead of it ([`Replica::take_stamp`]). The block's
    /// own WRITE went before, in the lookup's first list.
    pub(super) fn restamp(&mut self, block: &Block<'_>, version: u64) -> Result<()> {
        self.restamp_at(block, version, self.block_at)
    }

    /// [`Replica::restamp`] of a copy of the block at `block_at` (a thief's second copy on the
    /// primary).
    pub(super) fn restamp_at(
        &mut self,
        block: &Block<'_>,
        version: u64,
        block_at: RemoteSegment,
    ) -> Result<()> {
        let at = self.scratch.base + WRITE_BLOCK_AT + STAMP_OFFSET;
        let stamp = block.stamp(version);
        self.scratch.region().write(at, &stamp)?;
        let remote = RemoteSegment {
            address: block_at.address + STAMP_OFFSET,
            remote_key: block_at.remote_key,
        };
        self.stamp = Some(
            WorkRequest::write(
                u64::MAX,
                self.scratch.region().segment(at, stamp.len() as u32),
                remote,
            )
            .with_signaled(false),
        );
        Ok(())
    }

    /// A list that starts with the stamp's WRITE, if one is due, with room for `more`.
    pub(super) fn take_stamp(&mut self, more: usize) -> StepList {
        StepList::starting_with(self.stamp.take(), more)
    }
}

/// The newest version among the key's copies that `views` found (one view per replica).
pub(super) fn newest_version(views: &[View]) -> Option<u64> {
    views
        .iter()
        .flat_map(|view| view.committed.iter())
        .map(|found| found.version)
        .max()
}

/// Looks the key up on every replica at once; each replica's first list carries its block's
/// WRITE.
pub(super) async fn lookup_all(
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
        let first = FirstList::new(
            StepKind::ReadBuckets,
            StepList::starting_with(write.take(), LOOKUP_REQUESTS),
        );
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
pub(super) fn round_trips(copies: &[Replica]) -> Vec<u64> {
    copies.iter().map(|copy| copy.scratch.round_trips).collect()
}

/// Counts the round trips that ran alongside others since `before`: all but the longest
/// replica's (an operation's own sequence is its round trips less these).
pub(super) fn count_overlap(copies: &[Replica], before: &[u64]) {
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
