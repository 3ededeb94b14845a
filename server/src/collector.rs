//! The heap collector: one task that settles sealed extents, scans the index, clears abandoned
//! tentative slots, returns unreferenced extents and compacts sparse segments
//! (`docs/layout.md`, *Extents and grants*; `docs/protocol.md`, *Heap space*).
//!
//! Its pace follows what it finds. While writes change the index, or extents wait to settle or
//! to come back, or a tentative slot is in the index, it passes every `collector_interval`
//! (25 ms by default). A pass that finds the index exactly as the pass before (same slots,
//! compared by a digest taken during the scan) and nothing waiting doubles the interval, up to
//! [`IDLE_STRETCH`] times the base: a node that only serves GETs (which the server never sees)
//! then spends a few passes a second on an index that cannot have moved. Anything that brings
//! work (a client asking for heap space, a connection ending) wakes it back to the base
//! interval at once; a write that needs no new space is found by the next pass, at most the
//! stretched interval later.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkv_common::layout::Slot;
use rdkv_fabric::lock;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::session::Shared;

/// How far an idle collector stretches its interval, as a multiple of the base (25 ms → 200 ms).
pub const IDLE_STRETCH: u32 = 8;

/// How long the collector rests after a pass, in multiples of the pass's own time: at most a
/// fifth of a core, however large the index (a 256 MiB one used a whole core while idle).
const REST_FACTOR: u32 = 4;

/// How often, at most, the collector warns that the heap is low.
const LOW_HEAP_WARNING_EVERY: Duration = Duration::from_secs(10);

/// The collector's pace: its base and current interval, its passes, and what wakes it.
#[derive(Debug)]
pub struct Pace {
    /// The interval while there is work (`collector_interval`).
    base: Duration,
    /// The longest interval, when idle.
    longest: Duration,
    /// The interval now, in microseconds (a gauge).
    interval_micros: AtomicU64,
    /// Passes since start.
    passes: AtomicU64,
    /// Brings the interval back to the base.
    wake: Notify,
    /// Committed tombstone slots (replicated deletes), by index offset and word, with when a
    /// pass first saw each: cleared once older than the quarantine.
    tombstones: std::sync::Mutex<HashMap<(u64, u64), Instant>>,
    /// Tombstone slots cleared since start.
    tombstones_cleared: AtomicU64,
}

impl Pace {
    /// A pace with `base` as its working interval.
    pub fn new(base: Duration) -> Self {
        Self {
            base,
            longest: base.saturating_mul(IDLE_STRETCH),
            interval_micros: AtomicU64::new(base.as_micros() as u64),
            passes: AtomicU64::new(0),
            wake: Notify::new(),
            tombstones: std::sync::Mutex::new(HashMap::new()),
            tombstones_cleared: AtomicU64::new(0),
        }
    }

    /// Work may be coming (a client wants heap space, a connection ended): the next pass comes
    /// at most the base interval after the last one.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// The interval now.
    pub fn interval(&self) -> Duration {
        Duration::from_micros(self.interval_micros.load(Ordering::Relaxed))
    }

    /// Passes made since start.
    pub fn passes(&self) -> u64 {
        self.passes.load(Ordering::Relaxed)
    }

    /// Tombstone slots cleared since start.
    pub fn tombstones_cleared(&self) -> u64 {
        self.tombstones_cleared.load(Ordering::Relaxed)
    }

    fn set_interval(&self, interval: Duration) {
        self.interval_micros
            .store(interval.as_micros() as u64, Ordering::Relaxed);
    }

    /// The interval after a pass: doubled (up to the longest) when the pass was quiet, the base
    /// otherwise.
    fn after_pass(&self, current: Duration, quiet: bool) -> Duration {
        if quiet {
            current.saturating_mul(2).clamp(self.base, self.longest)
        } else {
            self.base
        }
    }
}

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
fn clear_abandoned_tentatives(shared: &Shared, slots: &mut Vec<(u64, Slot)>) {
    slots.retain(|(index_offset, slot)| {
        if !slot.is_tentative() || !shared.heap.writer_gone(slot.offset()) {
            return true;
        }
        if !shared.table.empty_slot(*index_offset, *slot) {
            return true;
        }
        shared
            .heap
            .tentatives_cleared
            .fetch_add(1, Ordering::Relaxed);
        false
    });
}

/// Clears committed tombstone slots (a replicated delete's; `docs/protocol.md`, *Replication*)
/// that every pass has seen for longer than the quarantine: no operation that read the key
/// before the tombstone was there can still run, so none can take the empty slot for the
/// absence it saw then. Their blocks are then unreferenced and come back. The CAS expects the
/// exact word, so a tombstone replaced or locked meanwhile is left alone. Returns whether some
/// tombstone waits for a later pass.
fn clear_old_tombstones(shared: &Shared, slots: &mut Vec<(u64, Slot)>, now: Instant) -> bool {
    let pace = &shared.collector;
    let quarantine = shared.heap.quarantine();
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
        if !shared.table.empty_slot(*index_offset, *slot) {
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
fn pass(shared: &Shared, mut slots: Vec<(u64, Slot)>) -> (Vec<(u64, Slot)>, u64, PassActivity) {
    // Settle first: a chunk whose writers are done becomes a candidate in this scan.
    shared.heap.settle(&shared.announcements, Instant::now());
    slots.clear();
    let mut digest = 0u64;
    let mut tentative = false;
    shared.table.for_each_slot(|index_offset, slot| {
        digest = mix(digest, index_offset, slot);
        tentative |= slot.is_tentative();
        slots.push((index_offset, slot));
    });
    // After the scan: every operation that read a slot the scan found changed had announced
    // its start by now (docs/protocol.md, Heap space).
    let snapshot = shared.announcements.snapshot();
    let now = Instant::now();
    clear_abandoned_tentatives(shared, &mut slots);
    let tombstones_waiting = clear_old_tombstones(shared, &mut slots, now);
    let extra_copies_removed = shared.sweep.run(shared, &mut slots);
    let report = shared.heap.collect(
        slots
            .iter()
            .map(|(_, slot)| (slot.offset(), slot.block_length(), slot.is_committed())),
        &snapshot,
        &shared.announcements,
        now,
    );
    let moved = shared
        .compactor
        .compact(&shared.table, &shared.heap, &slots, Instant::now());
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
pub(crate) async fn collect_loop(shared: Arc<Shared>, shutdown: CancellationToken) {
    let pace = &shared.collector;
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
        let gate_pass = shared.gate.enter("collector".into());
        gate_pass.step("collection pass: index scan, reclaim, compaction");
        let slots = std::mem::take(&mut kept_slots);
        let passing = shared.clone();
        let outcome = tokio::task::spawn_blocking(move || {
            let _gate_pass = gate_pass;
            pass(&passing, slots)
        })
        .await;
        pace.passes.fetch_add(1, Ordering::Relaxed);
        let quiet = match outcome {
            Ok((slots, keys, activity)) => {
                kept_slots = slots;
                shared
                    .counters
                    .collector_keys
                    .store(keys, Ordering::Relaxed);
                let quiet = !activity.waiting && last_digest == Some(activity.digest);
                last_digest = Some(activity.digest);
                quiet
            }
            Err(_) => false,
        };
        if shared.heap.free_bytes() * 10 < shared.heap.size_bytes()
            && last_low_warning
                .is_none_or(|warned: Instant| warned.elapsed() >= LOW_HEAP_WARNING_EVERY)
        {
            last_low_warning = Some(Instant::now());
            tracing::warn!(
                free_bytes = shared.heap.free_bytes(),
                heap_bytes = shared.heap.size_bytes(),
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
    fn a_quiet_pass_doubles_the_interval_up_to_the_stretch_and_work_resets_it() {
        let base = Duration::from_millis(25);
        let pace = Pace::new(base);
        let mut interval = base;
        let mut seen = Vec::new();
        for _ in 0..5 {
            interval = pace.after_pass(interval, true);
            seen.push(interval.as_millis());
        }
        assert_eq!(seen, [50, 100, 200, 200, 200]);
        assert_eq!(pace.after_pass(interval, false), base);
    }

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
