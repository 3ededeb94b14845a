//! Compaction: live blocks are moved out of sparse sealed chunks so the collector can reclaim
//! them.
//!
//! Out-of-place updates leave dead blocks behind; a chunk is reclaimed only when no slot
//! references it, so one long-lived block (a key updated once and then left alone, common under
//! zipfian workloads) would pin a whole chunk forever. After each scan, the server picks sealed
//! chunks whose live bytes are under half the chunk, copies each live block (verified by its
//! checksum) into a chunk the server owns, and CASes the slot from the old block to the copy.
//!
//! Why this is safe: blocks are immutable, so the copy holds the same key and value; a reader
//! that read the old slot still finds the old block (the chunk is freed only once every
//! operation that could have read the old slot has finished); a client CAS that expected the old slot value fails and re-reads, as after any
//! lost race. If a client changed the slot first, the server's CAS fails and the copy is simply
//! dead. This is control-plane maintenance on the server's own memory, like reclaiming; the
//! server still never handles a client's GET, PUT, DELETE or CAS.

use std::sync::atomic::Ordering;

use rdkv_common::layout::{decode_block, Slot};

use crate::heap::Heap;
use crate::table::TableRegion;

/// The owner id of the server's own compaction chunks (client connections start at 1).
pub const COMPACTOR: u64 = 0;
/// Chunks with less than this share of live bytes are compacted.
pub const MAX_LIVE_SHARE: f64 = 0.5;
/// The live share under which a chunk is compacted when the heap is nearly full (two free
/// chunks or fewer): dense chunks then still give their dead bytes back, a little at a time,
/// instead of the heap staying full of chunks that are 60% live.
pub const FULL_HEAP_LIVE_SHARE: f64 = 0.95;

/// The live share under which chunks are compacted now: [`MAX_LIVE_SHARE`], or
/// [`FULL_HEAP_LIVE_SHARE`] when the heap has two free chunks or fewer.
pub fn live_share_now(heap: &Heap) -> f64 {
    if heap.free_chunks() <= 2 {
        FULL_HEAP_LIVE_SHARE
    } else {
        MAX_LIVE_SHARE
    }
}
/// Most chunks compacted per pass, to bound the work of one scan.
const CHUNKS_PER_PASS: usize = 8;

/// The chunk the server is moving blocks into and how much of it is used.
#[derive(Debug)]
struct Destination {
    /// Heap offset of the chunk.
    heap_offset: u64,
    /// Bytes used.
    used: u64,
}

/// Moves live blocks out of sparse chunks into one server-owned chunk at a time. The destination
/// stays open across passes until it is full, so compaction never churns chunks: a destination is
/// sealed only when full (dense), and every chunk it empties was under half full, so each
/// destination filled frees at least two chunks.
#[derive(Debug, Default)]
pub struct Compactor {
    destination: std::sync::Mutex<Option<Destination>>,
}

impl Compactor {
    /// One compaction pass over the slots of the scan just made; returns the blocks moved.
    pub fn compact(&self, table: &TableRegion, heap: &Heap, slots: &[(u64, Slot)]) -> u64 {
        // Settled: no client is still writing a block it placed there.
        let candidates = heap.compaction_candidates(live_share_now(heap), CHUNKS_PER_PASS);
        if candidates.is_empty() {
            return 0;
        }
        let chunk_size = heap.chunk_size();
        let heap_base = table.geometry.heap_offset();
        let mut destination = self
            .destination
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut moved = 0u64;
        let mut block = Vec::new();
        // Only committed blocks move: a tentative slot belongs to an inserter that may still
        // commit it, which would fail against a moved word (its chunk stays referenced instead).
        // One chunk at a time, sparsest first: a chunk comes back only once all its blocks are
        // out, and a full heap has room to move only a few.
        let mut by_chunk: std::collections::HashMap<u64, Vec<&(u64, Slot)>> = candidates
            .iter()
            .map(|chunk| (*chunk, Vec::new()))
            .collect();
        for entry in slots.iter().filter(|(_, slot)| slot.is_committed()) {
            if let Some(blocks) = by_chunk.get_mut(&(entry.1.offset() / chunk_size)) {
                blocks.push(entry);
            }
        }
        let ordered = candidates.iter().flat_map(|chunk| {
            by_chunk
                .remove(chunk)
                .unwrap_or_default()
                .into_iter()
                .map(move |entry| (*chunk, entry))
        });
        for (chunk, (index_offset, slot)) in ordered {
            let length = slot.block_length();
            if destination
                .as_ref()
                .is_none_or(|place| place.used + length > chunk_size)
            {
                // The full destination is sealed by the allocation of the next one.
                // The compactor writes synchronously: its sealed chunk has no writer left (it
                // has no announce word, so it counts as gone).
                let Some(next) = heap.allocate(COMPACTOR, 0) else {
                    tracing::debug!("compaction paused: no free chunk to move live blocks into");
                    break;
                };
                *destination = Some(Destination {
                    heap_offset: next * chunk_size,
                    used: 0,
                });
            }
            let Some(place) = destination.as_mut() else {
                break;
            };
            if place.heap_offset / chunk_size == chunk {
                continue;
            }
            block.resize(length as usize, 0);
            if table
                .region
                .read(heap_base + slot.offset(), &mut block)
                .is_err()
                || decode_block(&block).is_err()
            {
                // Not an intact block (a slot changing under us): leave it to the next scan.
                continue;
            }
            let new_offset = place.heap_offset + place.used;
            if table.region.write(heap_base + new_offset, &block).is_err() {
                continue;
            }
            place.used += length;
            let relocated = Slot::new(slot.fingerprint(), slot.units(), new_offset);
            if let Ok(original) =
                table
                    .region
                    .compare_exchange_u64(*index_offset, slot.0, relocated.0)
            {
                if original == slot.0 {
                    moved += 1;
                }
            }
        }
        heap.blocks_relocated.fetch_add(moved, Ordering::Relaxed);
        if moved > 0 {
            tracing::debug!(moved, chunks = candidates.len(), "compacted sparse chunks");
        }
        moved
    }
}
