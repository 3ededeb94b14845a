//! Compaction: live blocks are moved out of sparse sealed extents so the collector can reclaim
//! them.
//!
//! Out-of-place updates leave dead blocks behind; an extent (4 KiB, `heap.rs`) is reclaimed only
//! when no slot references it, so one long-lived block (a key updated once and then left alone,
//! common under zipfian workloads) pins its extent. Extents are small, so that costs little, and
//! most space comes back without compaction; what is left is a heap of half-empty extents after
//! many short-lived writers. After each scan, the server picks extents settled for half a second
//! ([`COMPACTION_AGE`]; a tenth of a second when the heap is nearly full) whose live bytes are under half an
//! extent, copies each live block (verified by its checksum) into a grant the
//! server owns, and CASes the slot from the old block to the copy.
//!
//! Why this is safe: blocks are immutable, so the copy holds the same key and value; a reader
//! that read the old slot still finds the old block (the extent is freed only once every
//! operation that could have read the old slot has finished); a client CAS that expected the
//! old slot value fails and re-reads, as after any lost race. If a client changed the slot first, the server's CAS fails and the copy is simply
//! dead. This is control-plane maintenance on the server's own memory, like reclaiming; the
//! server still never handles a client's GET, PUT, DELETE or CAS.

use std::sync::atomic::Ordering;

use rdkv_common::layout::{decode_block, Slot};

use crate::heap::{Grant, Heap, EXTENT_SIZE};
use crate::table::TableRegion;

/// The owner id of the server's own compaction grants (client connections start at 1).
pub const COMPACTOR: u64 = 0;
/// Extents with less than this share of live bytes are compacted.
pub const MAX_LIVE_SHARE: f64 = 0.5;
/// The live share under which an extent is compacted when the heap is nearly full (two chunks'
/// worth free or less): dense extents then still give their dead bytes back, a little at a
/// time, instead of the heap staying full of extents that are 60% live. Not higher: moving
/// blocks out of a 90%-live extent wins almost nothing and would use up the compactor's reserve
/// (found by `a_heap_full_of_live_data_answers_table_full_within_the_deadline`, which spun).
pub const FULL_HEAP_LIVE_SHARE: f64 = 0.75;

/// The live share under which extents are compacted now: [`MAX_LIVE_SHARE`], or
/// [`FULL_HEAP_LIVE_SHARE`] when the heap has two chunks' worth free or less.
pub fn live_share_now(heap: &Heap) -> f64 {
    if heap.free_bytes() <= 2 * heap.chunk_size() {
        FULL_HEAP_LIVE_SHARE
    } else {
        MAX_LIVE_SHARE
    }
}
/// How long an extent must have been settled before it is compacted while the heap has room:
/// blocks that young are often about to be replaced (copying them is wasted work, and makes
/// their writers' CAS fail once), and their extents come back by themselves.
pub const COMPACTION_AGE: std::time::Duration = std::time::Duration::from_millis(500);

/// The same when the heap is nearly full: short, but hot keys' blocks (replaced every few
/// milliseconds) are still left alone, so moving them does not make their writers lose races.
pub const FULL_HEAP_COMPACTION_AGE: std::time::Duration = std::time::Duration::from_millis(100);

/// Most extents compacted per pass, to bound the work of one scan (512 KiB).
const EXTENTS_PER_PASS: usize = 128;

/// The grant the server is moving blocks into and how much of it is used.
#[derive(Debug)]
struct Destination {
    /// The grant.
    grant: Grant,
    /// Bytes used.
    used: u64,
}

/// Moves live blocks out of sparse extents into one server-owned grant at a time. The
/// destination stays open across passes until it is full, so compaction never churns: a
/// destination is sealed only when full (dense), and every extent it empties was under half
/// full, so each destination filled frees at least twice its size.
#[derive(Debug, Default)]
pub struct Compactor {
    destination: std::sync::Mutex<Option<Destination>>,
}

impl Compactor {
    /// One compaction pass over the slots of the scan just made; returns the blocks moved.
    pub fn compact(&self, table: &TableRegion, heap: &Heap, slots: &[(u64, Slot)]) -> u64 {
        // Settled: no client is still writing a block it placed there.
        let share = live_share_now(heap);
        let min_age = if share == FULL_HEAP_LIVE_SHARE {
            FULL_HEAP_COMPACTION_AGE
        } else {
            COMPACTION_AGE
        };
        let candidates =
            heap.compaction_candidates(share, min_age, std::time::Instant::now(), EXTENTS_PER_PASS);
        if candidates.is_empty() {
            return 0;
        }
        let heap_base = table.geometry.heap_offset();
        let mut destination = self
            .destination
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut moved = 0u64;
        let mut block = Vec::new();
        // Only committed blocks move: a tentative slot belongs to an inserter that may still
        // commit it, which would fail against a moved word (its extent stays referenced instead).
        // One extent at a time, sparsest first: an extent comes back only once all its blocks
        // are out, and a full heap has room to move only a few. A block is moved with the
        // extent it starts in.
        let mut by_extent: std::collections::HashMap<u64, Vec<&(u64, Slot)>> = candidates
            .iter()
            .map(|extent| (*extent, Vec::new()))
            .collect();
        for entry in slots.iter().filter(|(_, slot)| slot.is_committed()) {
            if let Some(blocks) = by_extent.get_mut(&(entry.1.offset() / EXTENT_SIZE)) {
                blocks.push(entry);
            }
        }
        let ordered = candidates.iter().flat_map(|extent| {
            by_extent
                .remove(extent)
                .unwrap_or_default()
                .into_iter()
                .map(move |entry| (*extent, entry))
        });
        for (extent, (index_offset, slot)) in ordered {
            let length = slot.block_length();
            if destination
                .as_ref()
                .is_none_or(|place| place.used + length > place.grant.length())
            {
                // The full destination is sealed by the allocation of the next one.
                // The compactor writes synchronously: its sealed grant has no writer left (it
                // has no announce word, so it counts as gone).
                let Some(grant) = heap.allocate(COMPACTOR, 0, length) else {
                    tracing::debug!("compaction paused: no free extent to move live blocks into");
                    break;
                };
                *destination = Some(Destination { grant, used: 0 });
            }
            let Some(place) = destination.as_mut() else {
                break;
            };
            if place.grant.contains(extent) {
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
            let new_offset = place.grant.heap_offset() + place.used;
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
            tracing::debug!(
                moved,
                extents = candidates.len(),
                "compacted sparse extents"
            );
        }
        moved
    }
}
