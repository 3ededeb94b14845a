//! The heap collector: one task that settles sealed extents, scans the index, clears abandoned
//! tentative slots, returns unreferenced extents and compacts sparse segments
//! (`docs/layout.md`, *Heap extents and grants*; `docs/protocol.md`, *Heap space*).
//!
//! Its pace follows what it finds. While writes change the index, or extents wait to settle or
//! to come back, or a tentative slot is in the index, it passes every `collector_interval`
//! (25 ms by default). A pass that finds the index exactly as the pass before (same slots,
//! compared by a digest taken during the scan) and nothing waiting doubles the interval, up to
//! [`IDLE_STRETCH`] times the base (the pace, `collector_pace.rs`, is what the node holds): a node that only serves GETs (which the server never sees)
//! then spends a few passes a second on an index that cannot have moved. Anything that brings
//! work (a client asking for heap space, a connection ending) wakes it back to the base
//! interval at once; a write that needs no new space is found by the next pass, at most the
//! stretched interval later.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkv_common::layout::Slot;
use rdkv_fabric::lock;
use tokio_util::sync::CancellationToken;

pub use crate::collector_pace::{Pace, IDLE_STRETCH};
use crate::node::Node;

/// How long the collector rests after a pass, in multiples of the pass's own time: at most a
/// fifth of a core, however large the index (a 256 MiB one used a whole core while idle).
const REST_FACTOR: u32 = 4;

/// How often, at most, the collector warns that the heap is low.
const LOW_HEAP_WARNING_EVERY: Duration = Duration::from_secs(10);

/// What one pass saw, for the pace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PassActivity {
    /// A digest of every non-empty slot word and its position.
    digest: u64,
    /// Something waits for a later pass: an extent sealed or quarantined, a tentative slot in
    /// the index, or this pass reclaimed or moved something.
    waiting: bool,
}

/// Mixes one slot into a scan's digest (order-dependent; the scan's order is the index's).
fn mix(digest: u64, index_offset: u64, slot: Slot) -> u64 {
    (digest ^ slot.0 ^ index_offset.rotate_left(32)).wrapping_mul(0x0000_0100_0000_01b3)
}

/// Clears tentative slots whose block lies in a chunk sealed a quarantine ago: their inserter
/// failed or passed its deadline and can never commit them (`docs/protocol.md`, *Abandoned
/// tentative slots*). The CAS expects the exact tentative word, so a slot committed or changed
/// meanwhile is left alone. Cleared slots no longer reference their chunk.
fn clear_abandoned_tentatives(node: &Node, slots: &mut Vec<(u64, Slot)>) {
    slots.retain(|(index_offset, slot)| {
        if !slot.is_tentative() || !node.heap.writer_gone(slot.offset()) {
            return true;
        }
        if !node.table().empty_slot(*index_offset, *slot) {
            return true;
        }
        node.heap.tentatives_cleared.fetch_add(1, Ordering::Relaxed);
        false
    });
}

/// Clears committed tombstone slots (a replicated delete's; `docs/protocol.md`, *Replication*)
/// that every pass has seen for longer than the quarantine: no operation that read the key
/// before the tombstone was there can still run, so none can take the empty slot for the
/// absence it saw then. Their blocks are then unreferenced and come back. The CAS expects the
/// exact word, so a tombstone replaced or locked meanwhile is left alone. Returns whether some
/// tombstone waits for a later pass.
fn clear_old_tombstones(node: &Node, slots: &mut Vec<(u64, Slot)>, now: Instant) -> bool {
    let pace = &node.collector;
    let quarantine = node.heap.quarantine();
    let mut seen = lock(&pace.tombstones);
    let mut current = HashMap::new();
    slots.retain(|(index_offset, slot)| {
        if !(slot.is_committed() && slot.is_tombstone()) {
            return true;
        }
        let since = seen.get(&(*index_offset, slot.0)).copied().unwrap_or(now);
        if now.duration_since(since) < quarantine {
            current.insert((*index_offset, slot.0), since);
            return true;
        }
        if !node.table().empty_slot(*index_offset, *slot) {
            return true;
        }
        pace.tombstones_cleared.fetch_add(1, Ordering::Relaxed);
        false
    });
    let waiting = !current.is_empty();
    *seen = current;
    waiting
}

/// One pass: settle, scan, clear abandoned tentatives and old tombstones, sweep extra copies
/// (`crate::sweep`), collect, compact. Returns the slots (kept for the next pass's
/// allocation), the keys counted and what the pass saw.
fn pass(node: &Node, mut slots: Vec<(u64, Slot)>) -> (Vec<(u64, Slot)>, u64, PassActivity) {
    // Settle first: a chunk whose writers are done becomes a candidate in this scan.
    node.heap.settle(&node.announcements, Instant::now());
    slots.clear();
    let mut digest = 0u64;
    let mut tentative = false;
    let mut tombstone = false;
    node.table().for_each_slot(|index_offset, slot| {
        digest = mix(digest, index_offset, slot);
        tentative |= slot.is_tentative();
        tombstone |= slot.is_tombstone();
        slots.push((index_offset, slot));
    });
    // After the scan: every operation that read a slot the scan found changed had announced
    // its start by now (docs/protocol.md, Heap space).
    let snapshot = node.announcements.snapshot();
    let now = Instant::now();
    // Each of these walks the slots again only when the scan found one it acts on.
    if tentative {
        clear_abandoned_tentatives(node, &mut slots);
    }
    let tombstones_waiting = if tombstone {
        clear_old_tombstones(node, &mut slots, now)
    } else {
        // None in the index: none is remembered either (what the walk would leave).
        lock(&node.collector.tombstones).clear();
        false
    };
    // While this node re-replicates (a member removed while down), the placement's copies
    // are being made whole: nothing is swept until it is done.
    let extra_copies_removed = if node.rereplication_pending() {
        0
    } else {
        node.sweep
            .run(&node.config, &node.view, node.table(), &mut slots)
    };
    let report = node.heap.collect(
        slots
            .iter()
            .map(|(_, slot)| (slot.offset(), slot.block_length(), slot.is_committed())),
        &snapshot,
        &node.announcements,
        now,
    );
    let moved = node
        .compactor
        .compact(node.table(), &node.heap, &slots, Instant::now());
    let activity = PassActivity {
        digest,
        waiting: tentative
            || tombstones_waiting
            || report.awaiting
            || report.reclaimed > 0
            || extra_copies_removed > 0
            || moved > 0,
    };
    (slots, report.keys, activity)
}

/// The collector task: passes at the pace's interval until `shutdown`.
pub(crate) async fn collect_loop(node: Arc<Node>, shutdown: CancellationToken) {
    let pace = &node.collector;
    let mut interval = pace.base;
    let mut last_low_warning = None;
    let mut last_digest = None;
    // The slots of the last pass, kept so that each pass reuses the allocation (a fresh
    // 100,000-slot vector 40 times a second cost more in page faults than the scan itself).
    let mut kept_slots: Vec<(u64, Slot)> = Vec::new();
    let mut last_pass_end = tokio::time::Instant::now();
    let mut next_pass = last_pass_end + interval;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep_until(next_pass) => {}
            _ = pace.wake.notified() => {
                // Work may be coming: the base interval again, counted from the last pass
                // (however often clients ask, passes stay at most one per base interval).
                interval = pace.base;
                pace.set_interval(interval);
                next_pass = next_pass.min(last_pass_end + interval);
                continue;
            }
        }
        let pass_started = Instant::now();
        let gate_pass = node.gate.enter("collector".into());
        gate_pass.step("collection pass: index scan, reclaim, compaction");
        let slots = std::mem::take(&mut kept_slots);
        let passing = node.clone();
        let outcome = tokio::task::spawn_blocking(move || {
            let _gate_pass = gate_pass;
            pass(&passing, slots)
        })
        .await;
        pace.passes.fetch_add(1, Ordering::Relaxed);
        let quiet = match outcome {
            Ok((slots, keys, activity)) => {
                kept_slots = slots;
                node.counters.collector_keys.store(keys, Ordering::Relaxed);
                let quiet = !activity.waiting && last_digest == Some(activity.digest);
                last_digest = Some(activity.digest);
                quiet
            }
            Err(_) => false,
        };
        if node.heap.free_bytes() * 10 < node.heap.size_bytes()
            && last_low_warning
                .is_none_or(|warned: Instant| warned.elapsed() >= LOW_HEAP_WARNING_EVERY)
        {
            last_low_warning = Some(Instant::now());
            tracing::warn!(
                free_bytes = node.heap.free_bytes(),
                heap_bytes = node.heap.size_bytes(),
                "heap under 10% free: writes may wait for reclamation; raise heap_size (docs/operations.md, Sizing the heap)"
            );
        }
        interval = pace.after_pass(interval, quiet);
        pace.set_interval(interval);
        let elapsed = pass_started.elapsed();
        last_pass_end = tokio::time::Instant::now();
        next_pass = last_pass_end
            + interval
                .saturating_sub(elapsed)
                .max(elapsed.saturating_mul(REST_FACTOR));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_sees_a_changed_word_and_a_moved_one() {
        let slots = [(0u64, Slot(7)), (8, Slot(9))];
        let digest = |slots: &[(u64, Slot)]| {
            slots
                .iter()
                .fold(0, |digest, (offset, slot)| mix(digest, *offset, *slot))
        };
        let original = digest(&slots);
        assert_eq!(original, digest(&slots));
        assert_ne!(original, digest(&[(0, Slot(7)), (8, Slot(10))]));
        assert_ne!(original, digest(&[(0, Slot(7)), (16, Slot(9))]));
        assert_ne!(original, digest(&[(0, Slot(7))]));
    }
}
