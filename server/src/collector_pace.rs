//! The heap collector's pace, and what it remembers from pass to pass: the node holds it
//! (`crate::node`), so that sessions can wake the collector and the stats can read its
//! figures; the collector's passes (`crate::collector`) set it.
//!
//! While there is work the collector passes every `collector_interval`; a pass that finds
//! nothing new doubles the interval, up to [`IDLE_STRETCH`] times the base, and anything that
//! brings work wakes it back to the base (the collector's module docs say why).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// How far an idle collector stretches its interval, as a multiple of the base (25 ms → 200 ms).
pub const IDLE_STRETCH: u32 = 8;

/// The collector's pace: its base and current interval, its passes, and what wakes it.
#[derive(Debug)]
pub struct Pace {
    /// The interval while there is work (`collector_interval`).
    pub(crate) base: Duration,
    /// The longest interval, when idle.
    longest: Duration,
    /// The interval now, in microseconds (a gauge).
    interval_micros: AtomicU64,
    /// Passes since start.
    pub(crate) passes: AtomicU64,
    /// Brings the interval back to the base.
    pub(crate) wake: Notify,
    /// Committed tombstone slots (replicated deletes), by index offset and word, with when a
    /// pass first saw each: cleared once older than the quarantine.
    pub(crate) tombstones: std::sync::Mutex<HashMap<(u64, u64), Instant>>,
    /// Tombstone slots cleared since start.
    pub(crate) tombstones_cleared: AtomicU64,
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

    /// Records the interval now (a gauge).
    pub(crate) fn set_interval(&self, interval: Duration) {
        self.interval_micros
            .store(interval.as_micros() as u64, Ordering::Relaxed);
    }

    /// The interval after a pass: doubled (up to the longest) when the pass was quiet, the base
    /// otherwise.
    pub(crate) fn after_pass(&self, current: Duration, quiet: bool) -> Duration {
        if quiet {
            current.saturating_mul(2).clamp(self.base, self.longest)
        } else {
            self.base
        }
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
}
