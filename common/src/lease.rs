//! The lease word and the reader's rule (`docs/protocol.md`, *Readers enforce the lease*).
//!
//! A one-sided READ needs no CPU on the node: a paused, swapping or frozen node's memory can
//! still be read (over `shm`, or by a NIC serving READs). So a client never trusts what it read
//! for being there: it returns a value only when it knows, by its own clock, that the node
//! held its lease when the read ran.
//!
//! - **The word.** Each node publishes one 8-byte word in its registered memory, readable by
//!   every data connection: [`LeaseWord`], "this node has served continuously, with a valid
//!   lease and a view that has it serving, from `since` until at least `until`", in
//!   milliseconds of the node's own clock ([`NodeClock`]). 0 means "not serving". The node
//!   rewrites it on every lease renewal and clears it the moment it stops serving; a paused
//!   node's word is frozen, and its `until` passes.
//! - **The read.** Every list a client posts ends with a READ of the word, executed after the
//!   list's other requests (in order on one queue pair; fenced on `verbs`). With `posted` the
//!   client's clock before the post and `completed` after the completion, the client accepts
//!   the list only if the node's `since` is no later than `posted` and its `until` is later
//!   than `completed` ([`ClockBound::covers`]): every request of the list ran inside one
//!   continuous serving interval of the node. Otherwise the node's memory may be stale (the
//!   view may have moved its keys): the client treats the node as unreachable and asks the
//!   other members for the view.
//! - **The clocks.** The node's milliseconds reach the client as a calibration: the node's
//!   clock in the `Welcome` and in every `HeartbeatAck`, bracketed by the client's clock at send
//!   and at receipt ([`ClockBound`]). Between calibrations the two clocks may drift apart by
//!   at most [`DRIFT_BOUND_PPM`]; on one host they are the same clock and do not drift.

use std::time::{Duration, Instant};

/// The assumed bound on how fast two hosts' monotonic clocks drift apart, in parts per
/// million: 1,000 (0.1%). Crystal oscillators agree within about 100 ppm, and NTP slews a
/// clock by at most 500 ppm. The client widens every conversion by this much per second since
/// its last calibration (heartbeats recalibrate every `lease_timeout / 3`).
pub const DRIFT_BOUND_PPM: u64 = 1_000;

/// Bits of `until`, in milliseconds of the node's clock (34 years).
const UNTIL_BITS: u32 = 40;
/// `until` for a node that needs no lease (a cluster of one or two nodes: no view without it
/// can be committed while it lives): serving until it says otherwise.
pub const UNTIL_FURTHER_NOTICE: u64 = (1 << UNTIL_BITS) - 1;
/// The longest `until - since` the word can say, in milliseconds (4.6 hours); a longer run
/// says this much, which is still true (it served from then on, too).
const MAX_SPAN_MILLISECONDS: u64 = (1 << (64 - UNTIL_BITS)) - 1;

/// A node's published serving interval, in milliseconds of its [`NodeClock`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseWord {
    /// Serving continuously since (rounded up).
    pub since_ms: u64,
    /// Serving at least until (rounded down), or [`UNTIL_FURTHER_NOTICE`].
    pub until_ms: u64,
}

impl LeaseWord {
    /// The word of a node that does not serve.
    pub const NOT_SERVING: u64 = 0;

    /// The 8-byte word: `until` in the low 40 bits, `until - since` (saturated, so `since`
    /// may read earlier than it was, never later) in the high 24.
    pub fn encode(self) -> u64 {
        let until = self.until_ms.clamp(1, UNTIL_FURTHER_NOTICE);
        let span = until
            .saturating_sub(self.since_ms)
            .min(MAX_SPAN_MILLISECONDS);
        (span << UNTIL_BITS) | until
    }

    /// The interval a word says; `None` for [`LeaseWord::NOT_SERVING`].
    pub fn decode(word: u64) -> Option<Self> {
        let until_ms = word & UNTIL_FURTHER_NOTICE;
        if until_ms == 0 {
            return None;
        }
        let span = word >> UNTIL_BITS;
        let since_ms = if span == MAX_SPAN_MILLISECONDS {
            0
        } else {
            until_ms - span.min(until_ms)
        };
        Some(Self { since_ms, until_ms })
    }
}

/// A node's clock: milliseconds since the node started (monotonic).
#[derive(Debug, Clone, Copy)]
pub struct NodeClock {
    /// The instant the milliseconds count from.
    origin: Instant,
}

impl Default for NodeClock {
    fn default() -> Self {
        Self::new()
    }
}

impl NodeClock {
    /// A clock counting from now.
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }

    /// Milliseconds now, rounded down (sent to clients to calibrate).
    pub fn now_ms(&self) -> u64 {
        self.floor_ms(Instant::now())
    }

    /// `instant` in milliseconds, rounded down (for an `until`).
    pub fn floor_ms(&self, instant: Instant) -> u64 {
        instant.saturating_duration_since(self.origin).as_millis() as u64
    }

    /// `instant` in milliseconds, rounded up (for a `since`).
    pub fn ceil_ms(&self, instant: Instant) -> u64 {
        let elapsed = instant.saturating_duration_since(self.origin);
        let floor = elapsed.as_millis() as u64;
        if elapsed > Duration::from_millis(floor) {
            floor + 1
        } else {
            floor
        }
    }
}

/// What a client knows of a node's clock: one calibration, the node's milliseconds `node_ms`
/// read at some instant between the client's `sent` and `received`.
#[derive(Debug, Clone, Copy)]
pub struct ClockBound {
    /// The client's clock before it asked.
    sent: Instant,
    /// The client's clock once the answer arrived.
    received: Instant,
    /// The node's clock, in milliseconds rounded down, when it answered.
    node_ms: u64,
    /// The instants a word that this calibration found covering covers
    /// ([`ClockBound::covers_remembered`]).
    window: Option<CoveredWindow>,
}

/// The client's instants that one lease word covers, by one calibration: every read posted
/// from `posted_from` (and no earlier than the calibration) and completed before
/// `completed_before` (`None`: any time, a node serving until further notice). Exactly what
/// [`ClockBound::covers`] accepts there, so a check against it costs two comparisons instead
/// of the conversions.
#[derive(Debug, Clone, Copy)]
struct CoveredWindow {
    /// The lease word.
    word: u64,
    /// The earliest post covered.
    posted_from: Instant,
    /// Every completion before this is covered.
    completed_before: Option<Instant>,
}

impl ClockBound {
    /// A calibration: the node said `node_ms` between `sent` and `received`.
    pub fn new(sent: Instant, received: Instant, node_ms: u64) -> Self {
        Self {
            sent,
            received: received.max(sent),
            node_ms,
            window: None,
        }
    }

    /// [`ClockBound::covers`], remembering the instants the last word found covering covers:
    /// while the node's word stays the same (it changes at each lease renewal), a read is
    /// checked with two comparisons of instants (a direct GET's lease check). What this
    /// accepts, [`ClockBound::covers`] accepts; what it refuses, it refuses.
    pub fn covers_remembered(&mut self, word: u64, posted: Instant, completed: Instant) -> bool {
        if let Some(window) = &self.window {
            if window.word == word
                && posted >= window.posted_from
                && window
                    .completed_before
                    .is_none_or(|before| completed < before)
            {
                return true;
            }
        }
        let covered = self.covers(word, posted, completed);
        if covered {
            self.window = self.window_of(word);
        }
        covered
    }

    /// The instants `word` covers by this calibration, for posts from the calibration on
    /// (`None` when it covers none, or an instant would overflow).
    fn window_of(&self, word: u64) -> Option<CoveredWindow> {
        let lease = LeaseWord::decode(word)?;
        // Covered from the first `e` µs after `received` where the node's earliest clock,
        // `node_ms` + e - drift(e), is later than `since`.
        let since_margin = (i128::from(lease.since_ms) - i128::from(self.node_ms)) * 1_000;
        let earliest = |elapsed: i128| elapsed - drift(elapsed);
        let ppm = i128::from(DRIFT_BOUND_PPM);
        // A first guess from the drift's rate, then a step or two to the exact instant.
        let mut from = if since_margin < 0 {
            0
        } else {
            (since_margin + 1) * 1_000_000 / (1_000_000 - ppm) + 1
        };
        while from > 0 && earliest(from - 1) > since_margin {
            from -= 1;
        }
        while earliest(from) <= since_margin {
            from += 1;
        }
        let posted_from = self.received.checked_add(micros(from)?)?;
        let completed_before = if lease.until_ms == UNTIL_FURTHER_NOTICE {
            None
        } else {
            // Up to the last `e` µs after `sent` where the node's latest clock,
            // `node_ms` + 1 ms + e + drift(e), is earlier than `until`.
            let until_margin = (i128::from(lease.until_ms) - i128::from(self.node_ms) - 1) * 1_000;
            let latest = |elapsed: i128| elapsed + drift(elapsed);
            if until_margin <= 0 {
                return None;
            }
            let mut last = until_margin * 1_000_000 / (1_000_000 + ppm);
            while latest(last + 1) < until_margin {
                last += 1;
            }
            while last >= 0 && latest(last) >= until_margin {
                last -= 1;
            }
            if last < 0 {
                return None;
            }
            Some(self.sent.checked_add(micros(last + 1)?)?)
        };
        Some(CoveredWindow {
            word,
            posted_from,
            completed_before,
        })
    }

    /// The client's clock when the calibration was taken (its end).
    pub fn taken(&self) -> Instant {
        self.received
    }

    /// Whether every request of a list posted at `posted` and completed at `completed` (the
    /// client's clock) ran while the node served under the lease `word`: the node's `since` is
    /// no later than the node's earliest possible clock at `posted`, and its `until` is later
    /// than the node's latest possible clock at `completed`.
    pub fn covers(&self, word: u64, posted: Instant, completed: Instant) -> bool {
        let Some(lease) = LeaseWord::decode(word) else {
            return false;
        };
        let since_us = i128::from(lease.since_ms) * 1_000;
        // Strictly before: a node that began serving at the very instant of the post may
        // have begun after it (the model check found this on equal clock readings).
        if since_us >= self.earliest_node_us(posted) {
            return false;
        }
        if lease.until_ms == UNTIL_FURTHER_NOTICE {
            return true;
        }
        i128::from(lease.until_ms) * 1_000 > self.latest_node_us(completed)
    }

    /// The earliest the node's clock can read at the client's `instant`, in microseconds.
    fn earliest_node_us(&self, instant: Instant) -> i128 {
        // The node read `node_ms` no later than `received`.
        let elapsed = signed_micros(self.received, instant);
        i128::from(self.node_ms) * 1_000 + elapsed - drift(elapsed)
    }

    /// The latest the node's clock can read at the client's `instant`, in microseconds.
    fn latest_node_us(&self, instant: Instant) -> i128 {
        // The node read `node_ms + 1` (rounded down) no earlier than `sent`.
        let elapsed = signed_micros(self.sent, instant);
        (i128::from(self.node_ms) + 1) * 1_000 + elapsed + drift(elapsed)
    }
}

/// `to - from` in microseconds, negative when `to` is earlier.
fn signed_micros(from: Instant, to: Instant) -> i128 {
    match to.checked_duration_since(from) {
        Some(elapsed) => elapsed.as_micros() as i128,
        None => -(from.duration_since(to).as_micros() as i128),
    }
}

/// `microseconds` as a duration (`None` when negative or past a `u64`).
fn micros(microseconds: i128) -> Option<Duration> {
    u64::try_from(microseconds).ok().map(Duration::from_micros)
}

/// How far two clocks may drift apart over `elapsed` microseconds (rounded up).
fn drift(elapsed: i128) -> i128 {
    let magnitude = elapsed.unsigned_abs();
    // In 64 bits below 2^53 µs (285 years), the same value: a 128-bit division is a call of
    // its own on every direct GET.
    if magnitude < 1 << 53 {
        return i128::from((magnitude as u64 * DRIFT_BOUND_PPM).div_ceil(1_000_000));
    }
    (magnitude as i128 * i128::from(DRIFT_BOUND_PPM) + 999_999) / 1_000_000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_word_says_its_interval_and_zero_says_not_serving() {
        let word = LeaseWord {
            since_ms: 1_000,
            until_ms: 5_000,
        };
        assert_eq!(LeaseWord::decode(word.encode()), Some(word));
        assert_eq!(LeaseWord::decode(LeaseWord::NOT_SERVING), None);
    }

    #[test]
    fn a_long_run_reads_as_serving_from_earlier_never_later() {
        let word = LeaseWord {
            since_ms: 10,
            until_ms: 100_000_000,
        };
        let decoded = LeaseWord::decode(word.encode()).expect("serving");
        assert_eq!(decoded.until_ms, word.until_ms);
        assert!(decoded.since_ms <= word.since_ms);
    }

    /// A calibration taken at `base`: the node read `node_ms` exactly then.
    fn calibration(base: Instant, node_ms: u64) -> ClockBound {
        ClockBound::new(base, base, node_ms)
    }

    fn word(since_ms: u64, until_ms: u64) -> u64 {
        LeaseWord { since_ms, until_ms }.encode()
    }

    #[test]
    fn a_list_inside_the_lease_is_covered() {
        let base = Instant::now();
        let clock = calibration(base, 1_000);
        let posted = base + Duration::from_millis(100);
        let completed = posted + Duration::from_micros(50);
        assert!(clock.covers(word(900, 1_500), posted, completed));
    }

    #[test]
    fn a_frozen_word_past_its_until_is_refused() {
        let base = Instant::now();
        let clock = calibration(base, 1_000);
        // The node paused at 1,000 with a lease until 1,900; the client reads at 2,500.
        let posted = base + Duration::from_millis(1_500);
        let completed = posted + Duration::from_micros(50);
        assert!(!clock.covers(word(900, 1_900), posted, completed));
    }

    #[test]
    fn a_list_posted_before_the_serving_interval_began_is_refused() {
        let base = Instant::now();
        let clock = calibration(base, 1_000);
        // Serving again since 1,200 (a new interval), but the list was posted at 1,100:
        // its first requests may have read memory from before the node was refilled.
        let posted = base + Duration::from_millis(100);
        let completed = base + Duration::from_millis(300);
        assert!(!clock.covers(word(1_200, 2_000), posted, completed));
    }

    #[test]
    fn a_not_serving_word_is_refused_and_until_further_notice_holds() {
        let base = Instant::now();
        let clock = calibration(base, 1_000);
        let later = base + Duration::from_secs(3_600);
        assert!(!clock.covers(LeaseWord::NOT_SERVING, base, base));
        assert!(clock.covers(word(0, UNTIL_FURTHER_NOTICE), later, later));
    }

    #[test]
    fn drift_narrows_the_lease_as_the_calibration_ages() {
        let base = Instant::now();
        let clock = calibration(base, 0);
        // 100 s after the calibration the node's clock may be 100 ms ahead: a lease 50 ms
        // ahead by the calibration alone is not trusted.
        let posted = base + Duration::from_secs(100);
        let until = 100_000 + 50;
        assert!(!clock.covers(word(0, until), posted, posted));
        assert!(clock.covers(word(0, until + 200), posted, posted));
    }

    #[test]
    fn a_slow_calibration_counts_its_whole_round_trip_against_the_lease() {
        let base = Instant::now();
        // The node answered 1,000 somewhere inside a 300 ms round trip.
        let clock = ClockBound::new(base, base + Duration::from_millis(300), 1_000);
        let at = base + Duration::from_millis(400);
        // The node's clock may read up to 1,401 at `at`: a lease until 1,350 is refused.
        assert!(!clock.covers(word(0, 1_350), at, at));
        assert!(clock.covers(word(0, 1_450), at, at));
    }

    /// The remembered check accepts exactly what `covers` accepts, at every instant around a
    /// word's edges (posts from the calibration on), over calibrations with and without a
    /// round trip, long after one (drift), and words with and without an `until`; and it
    /// forgets a word that changed.
    #[test]
    fn the_remembered_check_accepts_exactly_what_covers_accepts() {
        let base = Instant::now();
        // A small deterministic generator (xorshift): no dependency for one test.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let (mut accepted, mut refused, mut remembered) = (0, 0, 0);
        let mut next = move |below: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % below
        };
        for _ in 0..300 {
            let round_trip = Duration::from_micros(next(3) * next(400_000));
            let node_ms = 1_000 + next(1_000_000);
            let mut clock = ClockBound::new(base, base + round_trip, node_ms);
            let since = node_ms.saturating_sub(next(3_000)) + next(3_000);
            let until = if next(5) == 0 {
                UNTIL_FURTHER_NOTICE
            } else {
                since + 1 + next(2_000_000)
            };
            let lease = word(since, until);
            // Instants around the word's edges (and far after the calibration: drift).
            let edge = |milliseconds: u64| {
                base + Duration::from_millis(milliseconds.saturating_sub(node_ms).min(3_000_000))
            };
            let mut instants = vec![base + round_trip];
            for at in [edge(since), edge(until.min(node_ms + 3_000_000))] {
                for offset_us in [0u64, 1, 2, 999, 1_000, 1_001, 2_500, 700_000] {
                    instants.push(at + Duration::from_micros(offset_us));
                    if let Some(earlier) = at.checked_sub(Duration::from_micros(offset_us)) {
                        instants.push(earlier.max(base + round_trip));
                    }
                }
            }
            instants.push(base + round_trip + Duration::from_micros(next(4_000_000_000)));
            instants.sort();
            for (index, posted) in instants.iter().enumerate() {
                for completed in &instants[index..] {
                    let exact = clock.covers(lease, *posted, *completed);
                    if exact {
                        accepted += 1;
                    } else {
                        refused += 1;
                    }
                    remembered +=
                        usize::from(clock.window.is_some_and(|window| window.word == lease));
                    assert_eq!(
                        clock.covers_remembered(lease, *posted, *completed),
                        exact,
                        "{clock:?} {since}..{until} posted {:?} completed {:?} after the calibration",
                        *posted - base,
                        *completed - base
                    );
                }
            }
            // Another word: checked afresh, not by the window of this one.
            let other = word(since, since);
            assert_eq!(
                clock.covers_remembered(other, instants[0], instants[0]),
                clock.covers(other, instants[0], instants[0])
            );
        }
        assert!(
            accepted > 1_000 && refused > 1_000 && remembered > 1_000,
            "{accepted} {refused} {remembered}"
        );
    }
}
