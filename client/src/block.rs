//! Blocks in a scratch buffer. [`Block`] is the one block writer of every write: a
//! single-copy write's block, each replica's copy of a replicated write's block, the tombstone
//! a replicated write locks an absent key on, and a takeover's copy of the old block are all
//! written by [`Block::write`], straight into the operation's scratch buffer. [`blocks_that_fit`] and
//! [`block_reads`] make the lists that READ slots' blocks into the read area (a lookup's
//! candidates, a scan's range).

use rdkv_common::layout::{
    block_head, block_stamp, BlockHead, BlockHeader, Slot, BLOCK_HEADER_SIZE, BLOCK_STAMP_AT,
    BLOCK_STAMP_SIZE, BLOCK_UNIT,
};
use rdkv_fabric::WorkRequest;

use crate::connection::{Scratch, StepList, READ_BLOCKS_AT, READ_BLOCKS_SIZE};
use crate::error::Result;

/// A block's length in units and whether it is a tombstone: what its slot word says of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockShape {
    /// Its length in 64-byte units.
    pub(crate) units: u8,
    /// Whether it is a tombstone (a replicated delete: the key is absent).
    pub(crate) tombstone: bool,
}

impl BlockShape {
    /// Its length in bytes.
    pub(crate) fn length(self) -> u64 {
        u64::from(self.units) * BLOCK_UNIT
    }

    /// The committed slot word of a block of this shape at heap offset `offset`.
    pub(crate) fn slot(self, fingerprint: u8, offset: u64) -> Slot {
        let slot = Slot::new(fingerprint, self.units, offset);
        if self.tombstone {
            slot.tombstone()
        } else {
            slot
        }
    }
}

/// A block to write: its head (header word and checksum without the version) computed once,
/// then written with its key and value into as many scratch buffers as the operation needs (one
/// per replica). A replicated write learns its version only after its blocks are written
/// ([`Block::stamp`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Block<'a> {
    /// The header word and the checksum without the version.
    head: BlockHead,
    /// The version its [`Block::write`] writes.
    version: u64,
    /// The key.
    key: &'a [u8],
    /// The value (empty for a tombstone).
    value: &'a [u8],
    /// Its length and kind.
    shape: BlockShape,
}

impl<'a> Block<'a> {
    /// The block of `key` and `value` at `version`, a tombstone if `tombstone` (its value is
    /// then empty).
    pub(crate) fn new(key: &'a [u8], value: &'a [u8], tombstone: bool, version: u64) -> Self {
        let head = block_head(key, value, tombstone);
        Self {
            head,
            version,
            key,
            value,
            shape: BlockShape {
                units: head.units,
                tombstone,
            },
        }
    }

    /// The version its [`Block::write`] writes.
    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    /// The block's last [`BLOCK_STAMP_SIZE`] header bytes (from [`BLOCK_STAMP_AT`]) at
    /// `version`: what a WRITE puts over a block already written to give it that version.
    pub(crate) fn stamp(&self, version: u64) -> [u8; BLOCK_STAMP_SIZE] {
        block_stamp(self.head.unversioned, version)
    }

    /// Its length and kind.
    pub(crate) fn shape(&self) -> BlockShape {
        self.shape
    }

    /// The key.
    pub(crate) fn key(&self) -> &'a [u8] {
        self.key
    }

    /// The value.
    pub(crate) fn value(&self) -> &'a [u8] {
        self.value
    }

    /// The header bytes ahead of the key, at its version.
    pub(crate) fn head_bytes(&self) -> [u8; BLOCK_HEADER_SIZE] {
        self.head.bytes(self.version)
    }

    /// Writes the block to offset `at` of the scratch buffer's region, part by part, as
    /// [`rdkv_common::layout::encode_block_with`] lays it out but without building it in a
    /// vector first (one copy of the value, not two).
    ///
    /// # Errors
    /// [`crate::Error::Fabric`] when the block does not fit the region at `at`.
    pub(crate) fn write(&self, scratch: &Scratch, at: u64) -> Result<()> {
        let region = scratch.region();
        let mut next = at;
        for part in [&self.head.bytes(self.version)[..], self.key, self.value] {
            region.write(next, part)?;
            next += part.len() as u64;
        }
        // Zeros up to the units, as `encode_block_with` pads: the buffer's last contents never
        // reach the node's heap.
        let used = (BLOCK_HEADER_SIZE + self.key.len() + self.value.len()) as u64;
        let padding = [0u8; BLOCK_UNIT as usize];
        let pad = self.shape.length().saturating_sub(used).min(BLOCK_UNIT) as usize;
        region.write(next, &padding[..pad])?;
        Ok(())
    }
}

/// The header of a block read to `at` in the scratch buffer, of which `length` bytes were read;
/// `None` when it is no block's (torn, reused, or never written). The one parse of a block
/// header on the client.
pub(crate) fn parse_header(scratch: &Scratch, at: u64, length: u64) -> Result<Option<BlockHeader>> {
    if length < BLOCK_HEADER_SIZE as u64 {
        // A torn slot word can claim a block of zero units.
        return Ok(None);
    }
    let mut header_bytes = [0u8; BLOCK_HEADER_SIZE];
    scratch.region().read(at, &mut header_bytes)?;
    Ok(BlockHeader::parse(&header_bytes, length as usize).ok())
}

/// Where a block's stamp goes in the block, in bytes from its start.
pub(crate) const STAMP_OFFSET: u64 = BLOCK_STAMP_AT as u64;

/// The most block READs in one list: half the send queue a client's queue pair has
/// (`DEFAULT_MAX_SEND_WR`), leaving room for the requests a list carries besides (the
/// announce, the lease word). A list longer than the send queue is refused whole: a scan of
/// small blocks (hundreds fit the read area) failed every time.
pub(crate) const MOST_BLOCK_READS: usize = rdkv_fabric::DEFAULT_MAX_SEND_WR as usize / 2;

/// How many of `slots`' blocks, from the first, fit the scratch buffer's read area together,
/// [`MOST_BLOCK_READS`] at most: at least one (every block fits alone).
pub(crate) fn blocks_that_fit(slots: impl Iterator<Item = Slot>) -> usize {
    let mut used = 0u64;
    let mut count = 0;
    for slot in slots {
        let length = slot.block_length();
        if count == MOST_BLOCK_READS || (used + length > READ_BLOCKS_SIZE && count > 0) {
            break;
        }
        used += length;
        count += 1;
    }
    count
}

/// The READs of `slots`' blocks into the read area, one after another from its start, the
/// last one signaled; request `index` has id `index`.
pub(crate) fn block_reads(
    scratch: &Scratch,
    slots: impl ExactSizeIterator<Item = Slot>,
) -> StepList {
    let heap_key = scratch.connection().keys.heap_key;
    let count = slots.len();
    let mut list = StepList::with_room_for(count);
    let mut at = scratch.base + READ_BLOCKS_AT;
    list.extend(slots.enumerate().map(|(index, slot)| {
        let length = slot.block_length();
        let request = WorkRequest::read(
            index as u64,
            scratch.region().segment(at, length as u32),
            heap_key.at(slot.offset()),
        )
        .with_signaled(index + 1 == count);
        at += length;
        request
    }));
    list
}

#[cfg(test)]
mod tests {
    use rdkv_common::layout::Slot;

    use super::{blocks_that_fit, MOST_BLOCK_READS};
    use crate::connection::READ_BLOCKS_SIZE;

    #[test]
    fn a_list_of_small_blocks_stays_within_the_send_queue() {
        // 64-byte blocks: hundreds fit the read area, more than a send queue holds.
        let small: Vec<Slot> = (0..1_000)
            .map(|index| Slot::new(1, 1, index * 64))
            .collect();
        assert!(READ_BLOCKS_SIZE / 64 > rdkv_fabric::DEFAULT_MAX_SEND_WR as u64);
        assert_eq!(blocks_that_fit(small.into_iter()), MOST_BLOCK_READS);
        // Large blocks: the read area bounds the list.
        let large: Vec<Slot> = (0..100)
            .map(|index| Slot::new(1, 200, index * 12_800))
            .collect();
        let fit = blocks_that_fit(large.into_iter());
        assert_eq!(fit as u64, (READ_BLOCKS_SIZE / 12_800).max(1));
    }
}
