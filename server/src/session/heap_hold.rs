//! The heap-hold fence: a connection that holds the heap's reuse back while it announces
//! nothing (a stopped or hung client) is fenced once the heap is under pressure, so that one
//! frozen process cannot hold every writer's space for its whole lease (`docs/protocol.md`,
//! *Heap space*).
//!
//! A connection holds reuse back while its announce word says an operation is in flight
//! (`started > quiescent`): every extent found unreferenced since then waits for it. Each
//! session samples its own word at every check ([`super::CHECK_INTERVAL`]); a word that has
//! not changed for [`crate::ServerConfig::heap_hold_limit`], with an operation in flight, while
//! [`crate::heap::Heap::under_pressure`] holds, ends the session. The session's ordinary
//! teardown then moves its queue pair to ERROR, drains it, revokes its windows, and only then
//! releases the word (`teardown.rs`): no extent is reused before the client's requests can no
//! longer run.

use std::time::{Duration, Instant};

use crate::node::Node;

/// What one session last saw of its own announce word.
#[derive(Debug)]
pub(super) struct HoldWatch {
    /// The word (`started`, `quiescent`) at the last change seen; `None` before the first
    /// sample.
    word: Option<(u64, u64)>,
    /// When that word was first seen.
    since: Instant,
}

/// Why a connection is fenced for holding the heap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Hold {
    /// Operations the connection had started.
    pub(super) started: u64,
    /// Operations finished through this number.
    pub(super) quiescent: u64,
    /// How long its word had not changed.
    pub(super) silent_for: Duration,
}

impl HoldWatch {
    /// A watch that has seen nothing yet.
    pub(super) fn new(now: Instant) -> Self {
        Self {
            word: None,
            since: now,
        }
    }

    /// Samples `connection`'s word at `now`: `Some` when the connection has held reuse back,
    /// silent, for at least `limit` and the heap is under pressure.
    pub(super) fn check(
        &mut self,
        node: &Node,
        connection: u64,
        limit: Duration,
        now: Instant,
    ) -> Option<Hold> {
        let word = node.announcements.word_of(connection)?;
        if self.word != Some(word) {
            self.word = Some(word);
            self.since = now;
            return None;
        }
        let (started, quiescent) = word;
        let silent_for = now.saturating_duration_since(self.since);
        let holds = started > quiescent && silent_for >= limit;
        (holds && node.heap.under_pressure(now)).then_some(Hold {
            started,
            quiescent,
            silent_for,
        })
    }
}
