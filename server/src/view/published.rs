//! The lease word this node publishes for one-sided readers (`rdkv_common::lease`,
//! `docs/protocol.md`, *Readers enforce the lease*).
//!
//! The word says "serving continuously from `since` until at least `until`". What makes it
//! true:
//! - **`until`** is the lease's end (a follower's grant runs out before the leader can commit
//!   it down). A leader's lease can end early, when it votes for a newer leader, and a new
//!   leader counts the old one's silence from `election_timeout_max` before its election; so a
//!   leader publishes its lease less that much, which runs out before any leader it voted for
//!   can commit it down even if it is paused the instant after it voted.
//! - **`since`** restarts whenever the interval may have broken: the node stopped serving
//!   (it wrote 0), the last published `until` had passed (a paused process, a lapse), or the
//!   lease was dropped (the node stopped leading). A view has the node down only after its
//!   lease ran out or after it wrote 0 to leave, so a change of its own record (its first
//!   join, a promotion) is no break, and does not restart it: restarting there refused the
//!   lists in flight at a fresh cluster's joins, and a write among them ended unresolved. So a
//!   reader that accepts a word knows that no break happened between its post and its READ of
//!   the word.
//! - **0** is written the moment the node finds it may not serve (every 20 ms, on every lease
//!   renewal, and when it steps down).

use std::time::Instant;

use rdkv_common::lease::{LeaseWord, UNTIL_FURTHER_NOTICE};
use rdkv_fabric::lock;

use super::ViewService;
use crate::announce::LeaseSink;

/// What the node last published.
#[derive(Debug, Default)]
pub(super) struct Published {
    /// Where the word goes (set once the announce words are allocated).
    sink: Option<LeaseSink>,
    /// The start of the current serving interval (`None`: not serving).
    since: Option<Instant>,
    /// The `until` last published: `None` for further notice.
    until: Option<Instant>,
    /// The lease generation the interval was published under ([`ViewService::lease_drops`]).
    lease_generation: u64,
}

/// The end of a published interval.
enum Until {
    /// The lease runs out then.
    At(Instant),
    /// No lease is needed (one or two nodes): serving until the word says otherwise.
    FurtherNotice,
}

impl ViewService {
    /// Sets where the lease word goes, and publishes it.
    pub fn set_lease_sink(&self, sink: LeaseSink) {
        self.published_lock().sink = Some(sink);
        self.publish_lease();
    }

    /// The node's clock, in which the lease word counts (sent to clients to calibrate).
    pub fn clock(&self) -> rdkv_common::lease::NodeClock {
        self.clock
    }

    /// Works out whether the node serves now and until when, and writes the word.
    pub(super) fn publish_lease(&self) {
        // Worked out and written under one lock: a word worked out before the node stopped
        // serving (a clean leave, a view without it) must not land after the 0 that says so.
        let mut published = self.published_lock();
        let serving = self.evaluate_serving().is_ok();
        let until = if serving {
            self.publishable_until()
        } else {
            None
        };
        let lease_generation = self.lease_drops.load(std::sync::atomic::Ordering::Acquire);
        let now = Instant::now();
        let Some(until) = until else {
            published.since = None;
            published.until = None;
            if let Some(sink) = &published.sink {
                sink.store(LeaseWord::NOT_SERVING);
            }
            return;
        };
        // The node's own record changing (its first join, a promotion) is no break: it served
        // throughout. Every change that follows a break comes after one of the above (a view
        // has it down only once its lease ran out, or once it published 0 to leave).
        let continues = published.since.is_some()
            && published.until.is_none_or(|last| last > now)
            && published.lease_generation == lease_generation;
        if !continues {
            published.since = Some(now);
        }
        published.lease_generation = lease_generation;
        let since = published.since.unwrap_or(now);
        let (until_instant, until_ms) = match until {
            Until::At(instant) => (Some(instant), self.clock.floor_ms(instant)),
            Until::FurtherNotice => (None, UNTIL_FURTHER_NOTICE),
        };
        published.until = until_instant;
        let word = LeaseWord {
            since_ms: self.clock.ceil_ms(since),
            until_ms,
        };
        if let Some(sink) = &published.sink {
            sink.store(word.encode());
        }
    }

    /// The `until` this node may publish now: `None` when it holds no lease.
    fn publishable_until(&self) -> Option<Until> {
        if self.raft.is_none() || !self.needs_lease() {
            return Some(Until::FurtherNotice);
        }
        let lease_until = (*lock(&self.lease_until))?;
        let until = if self
            .lease_as_leader
            .load(std::sync::atomic::Ordering::Acquire)
        {
            lease_until.checked_sub(Self::old_leader_lease_floor())?
        } else {
            lease_until
        };
        (until > Instant::now()).then_some(Until::At(until))
    }

    fn published_lock(&self) -> std::sync::MutexGuard<'_, Published> {
        lock(&self.published)
    }

    /// The word published now (tests and stats).
    pub fn published_lease_word(&self) -> u64 {
        self.published_lock()
            .sink
            .as_ref()
            .map_or(LeaseWord::NOT_SERVING, LeaseSink::load)
    }
}
