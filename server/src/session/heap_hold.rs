//! The heap-hold fence: a connection that holds the heap's reuse back while it announces
//! nothing (a stopped or hung client) is fenced once the heap is under pressure, so that one
//! frozen process cannot hold every writer's space for its whole lease (`docs/protocol.md`,
//! *Heap space*).
//!
//! A connection holds reuse back while its announce word says an operation is in flight
//! (`started > quiescent`): every extent found unreferenced since then waits for it. Each
//! session samples its own word at every check ([`super::CHECK_INTERVAL`]); a `quiescent` that
//! has not moved for [`crate::ServerConfig::heap_hold_limit`], with an operation in flight,
//! while [`crate::heap::Heap::under_pressure`] holds, ends the session. Only `quiescent`
//! counts: a client that keeps starting operations while its oldest never finishes (one
//! thread stopped inside an `shm` request while the others go on) holds reuse back as surely
//! as a silent one. The session's ordinary
//! teardown then moves its queue pair to ERROR, drains it, revokes its windows, and only then
//! releases the word (`teardown.rs`): no extent is reused before the client's requests can no
//! longer run.

use std::time::{Duration, Instant};

use crate::node::Node;

/// What one session last saw of its own announce word.
#[derive(Debug)]
pub(super) struct HoldWatch {
    /// `quiescent` at the last change seen; `None` before the first sample.
    quiescent: Option<u64>,
    /// When that value was first seen.
    since: Instant,
}

/// Why a connection is fenced for holding the heap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Hold {
    /// Operations the connection had started.
    pub(super) started: u64,
    /// Operations finished through this number.
    pub(super) quiescent: u64,
    /// How long its `quiescent` had not moved (its oldest operation in flight ran).
    pub(super) silent_for: Duration,
}

impl HoldWatch {
    /// A watch that has seen nothing yet.
    pub(super) fn new(now: Instant) -> Self {
        Self {
            quiescent: None,
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
        let (started, quiescent) = node.announcements.word_of(connection)?;
        if self.quiescent != Some(quiescent) {
            self.quiescent = Some(quiescent);
            self.since = now;
            return None;
        }
        let silent_for = now.saturating_duration_since(self.since);
        // Without pressure only past the whole operation deadline, which every client
        // deadline is within: the operation has failed at its client already, and a
        // requester stopped inside it (`shm`) must be fenced before the quarantine (1.25
        // deadlines) can free what it read, or its late CAS could find the slot word it
        // expects naming a reused block.
        let holds = started > quiescent
            && ((silent_for >= limit && node.heap.under_pressure(now))
                || silent_for >= node.config.operation_deadline);
        holds.then_some(Hold {
            started,
            quiescent,
            silent_for,
        })
    }
}
