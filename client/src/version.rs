//! The versions this process gives the blocks it writes: a hybrid clock. A version is the
//! wall clock in microseconds since the Unix epoch, unless that is not above what the caller
//! must exceed (the versions its write read on the key's replicas) or above the last version
//! this process gave: then one more than the larger. So a replicated write's version exceeds
//! every version it read (the write before it, on every copy), and a key deleted, its
//! tombstone cleared and the key written again still gets a version above the deleted one
//! (clocks are not that far apart), where a count restarted from the empty slot would lose to
//! an older copy. `docs/protocol.md`, *Versions*.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The last version this process gave.
static LAST_GIVEN: AtomicU64 = AtomicU64::new(0);

/// A version above `at_least - 1` (at least `at_least`), above every version this process gave
/// before, and at least the wall clock's microseconds.
pub(crate) fn next_version(at_least: u64) -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_micros() as u64);
    let floor = now.max(at_least);
    let previous = LAST_GIVEN
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
            Some(floor.max(last.saturating_add(1)))
        })
        .unwrap_or_else(|last| last);
    floor.max(previous.saturating_add(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_rise_and_exceed_what_they_must() {
        let first = next_version(0);
        let second = next_version(0);
        assert!(second > first);
        let far = first + 1_000_000_000_000;
        assert_eq!(next_version(far), far);
        assert!(next_version(0) > far);
    }
}
