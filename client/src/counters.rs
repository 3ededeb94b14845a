//! Per-client counters: operations, round trips and verbs per operation, CAS failures and
//! checksum retries.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use rdkv_common::protocol::ClientCounters;

/// Live counters, shared by every connection of one client.
#[derive(Debug, Default)]
pub struct Counters {
    /// Operations ended, with any outcome (errors included).
    pub operations: AtomicU64,
    /// GETs (each key of a batch counts one; failed ones included).
    pub gets: AtomicU64,
    /// Mutations (put, insert, update, delete, compare-and-swap; failed ones included).
    pub mutations: AtomicU64,
    /// Operations that ended with an error.
    pub failures: AtomicU64,
    /// Posted lists that waited for completions: network round trips.
    pub round_trips: AtomicU64,
    /// Round trips spent by GETs.
    pub get_round_trips: AtomicU64,
    /// Work requests posted.
    pub verbs: AtomicU64,
    /// Slot CASes that lost a race.
    pub cas_failures: AtomicU64,
    /// Block reads retried after a checksum mismatch.
    pub checksum_retries: AtomicU64,
    /// Connections re-established after a failure.
    pub reconnects: AtomicU64,
    /// What was last reported to a server (each increment is reported once).
    reported: Mutex<ClientCounters>,
}

/// A copy of the counters: the one-sided work (the same figures clients report to servers,
/// with their per-operation ratios) plus reconnects.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CounterSnapshot {
    /// Operations, round trips, work requests, lost races, checksum retries.
    pub work: ClientCounters,
    /// Connections re-established after a failure.
    pub reconnects: u64,
}

impl std::ops::Deref for CounterSnapshot {
    type Target = ClientCounters;

    fn deref(&self) -> &ClientCounters {
        &self.work
    }
}

impl Counters {
    /// The increments since the last report, marking them reported.
    pub fn take_report(&self) -> ClientCounters {
        let now = self.snapshot().work;
        let mut reported = self
            .reported
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let report = ClientCounters {
            operations: now.operations - reported.operations,
            gets: now.gets - reported.gets,
            mutations: now.mutations - reported.mutations,
            failures: now.failures - reported.failures,
            round_trips: now.round_trips - reported.round_trips,
            get_round_trips: now.get_round_trips - reported.get_round_trips,
            verbs: now.verbs - reported.verbs,
            cas_failures: now.cas_failures - reported.cas_failures,
            checksum_retries: now.checksum_retries - reported.checksum_retries,
        };
        *reported = now;
        report
    }

    /// A snapshot.
    pub fn snapshot(&self) -> CounterSnapshot {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        CounterSnapshot {
            work: ClientCounters {
                operations: load(&self.operations),
                gets: load(&self.gets),
                mutations: load(&self.mutations),
                failures: load(&self.failures),
                round_trips: load(&self.round_trips),
                get_round_trips: load(&self.get_round_trips),
                verbs: load(&self.verbs),
                cas_failures: load(&self.cas_failures),
                checksum_retries: load(&self.checksum_retries),
            },
            reconnects: load(&self.reconnects),
        }
    }
}
