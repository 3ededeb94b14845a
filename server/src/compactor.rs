//! Compaction: live blocks are moved out of sparse segments of settled extents so the collector can
//! reclaim them.
//!
//! Out-of-place updates leave dead blocks behind; an extent (4 KiB, `heap.rs`) is reclaimed only
//! when no slot references it, so one long-lived block (a key updated once and then left alone,
//! common under zipfian workloads) pins its extent. Most space comes back without compaction,
//! but what comes back that way is scattered single extents, and a grant is a contiguous run:
//! a heap whose free space is scattered hands out one-extent grants, one control round trip
//! every few writes. So the compactor empties whole segments (a segment is one chunk's extents,
//! aligned), as a log-structured store's cleaner does: after each scan it picks the emptiest
//! segment that nobody writes into and whose live bytes are under half of it (three quarters
//! when under a quarter of the heap is free), takes its extents settled for half a second
//! ([`COMPACTION_AGE`]; a tenth of a second when the heap is nearly full), copies each live
//! block touching them (verified by its checksum) into a grant the server owns, and CASes the
//! slot from the old block to the copy. The segment comes back whole. When the heap is nearly
//! full and no segment is sparse enough, it takes sparse extents wherever they are.
//!
//! Why this is safe: blocks are immutable, so the copy holds the same key and value; a reader
//! that read the old slot still finds the old block (the extent is freed only once every
//! operation that could have read the old slot has finished); a client CAS that expected the
//! old slot value fails and re-reads, as after any lost race. If a client changed the slot first, the server's CAS fails and the copy is simply
//! dead. This is control-plane maintenance on the server's own memory, like reclaiming; the
//! server still never handles a client's GET, PUT, DELETE or CAS.

use std::sync::atomic::Ordering;

use rdkv_common::layout::Slot;
use rdkv_fabric::lock;

pub use crate::heap::COMPACTOR;
use crate::heap::{Grant, Heap, EXTENT_SIZE};
use crate::table::TableRegion;

/// Segments with less than this share of live bytes are compacted.
pub const MAX_LIVE_SHARE: f64 = 0.5;
/// The live share under which a segment is compacted when under a quarter of the heap is free
/// ([`PRESSURE_FREE_SHARE`]): a heap twice its live data settles at about 55% live per
/// segment, so a cleaner that waits for half-empty segments falls behind the writers and the
/// free space left is scattered extents (one-extent grants). Dense segments then still give
/// their dead bytes back, a little at a time. Not higher: moving
/// blocks out of a 90%-live extent wins almost nothing and would use up the compactor's reserve
/// (found by `a_heap_full_of_live_data_answers_table_full_within_the_deadline`, which spun).
pub const FULL_HEAP_LIVE_SHARE: f64 = 0.75;

/// Under this share of the heap free, the cleaner works harder: segments up to
/// [`FULL_HEAP_LIVE_SHARE`] live are compacted, [`PRESSURE_EXTENTS_PER_PASS`] per pass.
pub const PRESSURE_FREE_SHARE: f64 = 0.25;

/// Whether the heap is under pressure (see [`PRESSURE_FREE_SHARE`]).
pub fn under_pressure(heap: &Heap) -> bool {
    (heap.free_bytes() as f64) < heap.size_bytes() as f64 * PRESSURE_FREE_SHARE
}

/// Whether the heap is nearly full: two chunks' worth free or less.
pub fn nearly_full(heap: &Heap) -> bool {
    heap.free_bytes() <= 2 * heap.chunk_size()
}

/// The live share under which segments are compacted now: [`MAX_LIVE_SHARE`], or
/// [`FULL_HEAP_LIVE_SHARE`] when the heap is under pressure.
pub fn live_share_now(heap: &Heap) -> f64 {
    if under_pressure(heap) || nearly_full(heap) {
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

/// The same under pressure (4 MiB per pass: at 40 passes a second, a cleaner that can keep up
/// with writers filling 100 MB/s of a heap twice its live data).
const PRESSURE_EXTENTS_PER_PASS: usize = 1024;

/// The grant the server is moving blocks into and how much of it is used.
#[derive(Debug)]
struct Destination {
    /// The grant.
    grant: Grant,
    /// Bytes used.
    used: u64,
}

/// Moves live blocks out of sparse segments into one server-owned grant at a time. The
/// destination stays open across passes until it is full, so compaction never churns: a
/// destination is sealed only when full (dense), and every segment it empties was under half
/// live (three quarters under pressure), so each destination filled frees more than it takes.
#[derive(Debug, Default)]
pub struct Compactor {
    destination: std::sync::Mutex<Option<Destination>>,
}

impl Compactor {
    /// One compaction pass over the slots of the scan just made, at `now`; returns the blocks
    /// moved.
    pub fn compact(
        &self,
        table: &TableRegion,
        heap: &Heap,
        slots: &[(u64, Slot)],
        now: std::time::Instant,
    ) -> u64 {
        let candidates = candidates(heap, now);
        if candidates.is_empty() {
            return 0;
        }
        let heap_base = table.geometry.heap_offset();
        let mut destination = lock(&self.destination);
        let mut moved = 0u64;
        let mut block = Vec::new();
        for (extent, (index_offset, slot)) in blocks_to_move(&candidates, slots) {
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
            if table.read_block(*slot, &mut block).is_none() {
                // Not an intact block (a slot changing under us): leave it to the next scan.
                continue;
            }
            let new_offset = place.grant.heap_offset() + place.used;
            if table.region.write(heap_base + new_offset, &block).is_err() {
                continue;
            }
            place.used += length;
            let mut relocated = Slot::new(slot.fingerprint(), slot.units(), new_offset);
            if slot.is_tombstone() {
                // Still a tombstone: the collector clears it after its quarantine.
                relocated = relocated.tombstone();
            }
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

/// The extents to empty in this pass, sparsest first: settled ones (no client is still
/// writing a block it placed there) of sparse segments, or when the heap is nearly full and no
/// whole segment is sparse enough, any sparse extent (any room is worth more than contiguous
/// room).
fn candidates(heap: &Heap, now: std::time::Instant) -> Vec<u64> {
    let share = live_share_now(heap);
    let min_age = if nearly_full(heap) {
        FULL_HEAP_COMPACTION_AGE
    } else {
        COMPACTION_AGE
    };
    let limit = if under_pressure(heap) {
        PRESSURE_EXTENTS_PER_PASS
    } else {
        EXTENTS_PER_PASS
    };
    let candidates = heap.compaction_candidates(share, min_age, now, limit);
    if candidates.is_empty() && nearly_full(heap) {
        heap.sparse_extents(share, min_age, now, limit)
    } else {
        candidates
    }
}

/// The committed blocks of `slots` that touch the `candidates` extents, each with the first
/// candidate it touches, in the candidates' order.
///
/// Only committed blocks move: a tentative slot belongs to an inserter that may still commit
/// it, which would fail against a moved word (its extent stays referenced instead). One
/// extent at a time, sparsest first: an extent comes back only once every block that touches
/// it is out (a block may start in the extent before and end in this one), and a full heap has
/// room to move only a few. A block touching two candidates moves once.
fn blocks_to_move<'slots>(
    candidates: &[u64],
    slots: &'slots [(u64, Slot)],
) -> Vec<(u64, &'slots (u64, Slot))> {
    // Each candidate's rank, by extent: a look-up per slot is an index, not a hash (a hash
    // per committed slot and pass was a fifth of the collector's instructions).
    let Some(last_candidate) = candidates.iter().max() else {
        return Vec::new();
    };
    let mut rank = vec![usize::MAX; *last_candidate as usize + 1];
    for (position, extent) in candidates.iter().enumerate() {
        rank[*extent as usize] = rank[*extent as usize].min(position);
    }
    let mut by_candidate: Vec<Vec<&(u64, Slot)>> = vec![Vec::new(); candidates.len()];
    for entry in slots.iter().filter(|(_, slot)| slot.is_committed()) {
        let first = entry.1.offset() / EXTENT_SIZE;
        if first > *last_candidate {
            continue;
        }
        let last = (entry.1.offset() + entry.1.block_length().max(1) - 1) / EXTENT_SIZE;
        for extent in first..=last.min(*last_candidate) {
            if let Some(blocks) = by_candidate.get_mut(rank[extent as usize]) {
                blocks.push(entry);
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    candidates
        .iter()
        .zip(by_candidate)
        .flat_map(|(extent, blocks)| blocks.into_iter().map(move |entry| (*extent, entry)))
        .filter(|(_, (index_offset, _))| seen.insert(*index_offset))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::announce::Announcements;
    use rdkv_common::layout::{encode_block, TableGeometry};
    use rdkv_fabric::memory::{HugepagePolicy, PinLimits};
    use rdkv_fabric::{Device, DeviceConfig};
    use std::time::{Duration, Instant};

    /// An extent whose only live bytes are the tail of a block that starts in the extent
    /// before is compacted: the block moves, and the extent is no longer referenced. (The
    /// compactor used to move only blocks that start in a candidate, so such extents stayed
    /// candidates forever and each pass moved nothing: a heap of 1 KB values filled up.)
    #[test]
    fn a_block_reaching_into_a_sparse_extent_is_moved_out_of_it() {
        let device = Device::loopback(DeviceConfig::default());
        let geometry = TableGeometry {
            bucket_count: 4,
            heap_size: 16 * EXTENT_SIZE,
            chunk_size: 4 * EXTENT_SIZE,
            hash_seed: 0,
        };
        let table = TableRegion::allocate(
            &device,
            geometry,
            HugepagePolicy::Off,
            PinLimits::default(),
            false,
        )
        .expect("a table");
        let heap = Heap::new(&geometry, Duration::from_secs(1));
        let announcements =
            Announcements::allocate(&table.domain, 4, false).expect("announce words");
        let grant = heap.allocate(1, 0, 2 * EXTENT_SIZE).expect("a grant");
        assert_eq!(grant.extents, 2);
        // A block from the middle of extent 0 into extent 1: half of extent 0 is live, under
        // a quarter of extent 1.
        let mut block = Vec::new();
        let units = encode_block(b"key", &[7u8; 2900], &mut block);
        let offset = grant.heap_offset() + EXTENT_SIZE / 2;
        table
            .region
            .write(table.geometry.heap_offset() + offset, &block)
            .expect("write the block");
        let slot = Slot::new(9, units, offset);
        let index_offset = 0;
        table
            .region
            .compare_exchange_u64(index_offset, 0, slot.0)
            .expect("publish the slot");
        heap.seal_owned_by(1);
        let now = Instant::now();
        heap.settle(&announcements, now);
        let slots = vec![(index_offset, slot)];
        heap.collect(
            slots
                .iter()
                .map(|(_, slot)| (slot.offset(), slot.block_length(), true)),
            &announcements.snapshot(),
            &announcements,
            now,
        );
        let later = now + Duration::from_secs(1);
        assert_eq!(
            heap.compaction_candidates(MAX_LIVE_SHARE, COMPACTION_AGE, later, 8),
            vec![grant.first_extent + 1, grant.first_extent],
            "the segment's extents with live bytes, the sparsest (the block's tail) first"
        );
        let moved = Compactor::default().compact(&table, &heap, &slots, later);
        assert_eq!(moved, 1, "the block reaching into the sparse extent moved");
        let relocated = Slot(table.region.load_u64(index_offset).expect("read the slot"));
        assert_ne!(relocated.offset(), offset);
        assert!(
            !(grant.first_extent..grant.first_extent + 2)
                .contains(&(relocated.offset() / EXTENT_SIZE)),
            "the block left both of its old extents"
        );
        let mut copy = vec![0u8; block.len()];
        table
            .region
            .read(table.geometry.heap_offset() + relocated.offset(), &mut copy)
            .expect("read the copy");
        assert_eq!(copy, block);
    }
}
