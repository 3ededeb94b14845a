//! Per-client counters: operations, round trips and verbs per operation, CAS failures and
//! checksum retries.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use rdkv_common::protocol::ClientCounters;

/// The READs a direct GET makes when its guess holds: the slot word twice, the block's head,
/// its value and the lease word (counted as verbs, as the list's requests would be).
pub(crate) const DIRECT_GET_ACCESSES: u64 = 5;

/// Shards per counter. Each thread adds to its own shard (threads take shards in turn), so the
/// workers of a runtime do not meet on one cache line at every operation: seven shared atomic
/// adds per GET were part of what two workers cost each other
/// (`docs/history/benchmarks-passes.md`, *Two workers on one queue pair*).
const SHARDS: usize = 8;

/// One shard, alone on its cache lines (128 bytes: adjacent-line prefetch pairs 64-byte lines).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard(AtomicU64);

/// A counter that threads add to without sharing a cache line; read as the sum of its shards.
#[derive(Debug, Default)]
pub struct ShardedCounter {
    shards: [Shard; SHARDS],
}

impl ShardedCounter {
    /// Adds `amount` to the calling thread's shard.
    pub fn add(&self, amount: u64) {
        self.shards[shard_index()]
            .0
            .fetch_add(amount, Ordering::Relaxed);
    }

    /// The total. Each shard only grows, so a total read after another is never smaller.
    pub fn total(&self) -> u64 {
        self.shards
            .iter()
            .map(|shard| shard.0.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }
}

/// The calling thread's shard, given in turn on its first use.
fn shard_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static INDEX: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    INDEX.with(|index| *index)
}

/// Live counters, shared by every connection of one client.
#[derive(Debug, Default)]
pub struct Counters {
    /// Operations ended, with any outcome (errors included).
    pub operations: ShardedCounter,
    /// GETs (each key of a batch counts one; failed ones included).
    pub gets: ShardedCounter,
    /// Mutations (put, insert, update, delete, compare-and-swap; failed ones included).
    pub mutations: ShardedCounter,
    /// Operations that ended with an error.
    pub failures: ShardedCounter,
    /// Posted lists that waited for completions: network round trips.
    pub round_trips: ShardedCounter,
    /// Round trips spent by GETs.
    pub get_round_trips: ShardedCounter,
    /// Work requests posted.
    pub verbs: ShardedCounter,
    /// Slot CASes that lost a race.
    pub cas_failures: ShardedCounter,
    /// Block reads retried after a checksum mismatch.
    pub checksum_retries: ShardedCounter,
    /// Connections re-established after a failure (each lane's counts: `crate::lanes`).
    pub reconnects: ShardedCounter,
    /// Round trips of replicated operations that ran alongside another of the same operation
    /// (the replicas' lookups, the backups' first CASes): `round_trips` less these is what the
    /// operations waited for in sequence.
    pub overlapped_round_trips: ShardedCounter,
    /// Other writers' locks taken over after they outlived the patience (replicated writes).
    pub locks_stolen: ShardedCounter,
    /// Times the client fetched the cluster view after a failure or a newer epoch.
    pub view_refreshes: ShardedCounter,
    /// Guessed blocks READ (the slot cache), with the buckets or with the guessed slot's word.
    pub slot_guesses: ShardedCounter,
    /// Guesses the slot word or the block proved stale (a narrow one is then chased once, or the
    /// lookup reads the buckets).
    pub slot_guess_misses: ShardedCounter,
    /// Operations that waited for a scratch buffer because the connection had its configured
    /// concurrency (`ClientConfig::concurrency`) in flight: many mean the application runs more
    /// operations at once than the client allows.
    pub scratch_waits: ShardedCounter,
    /// Lists whose results the client threw away because the node's lease word did not cover
    /// them (`rdkv_common::lease`): the node was paused, cut off, or not serving.
    pub lease_refusals: ShardedCounter,
    /// Announce WRITEs the flusher made alone (by direct access, or posted), after operations finished with none starting
    /// (`connection/announce.rs`; also counted under `verbs`): they belong to no operation.
    pub announce_flushes: ShardedCounter,
    /// GETs done by direct access to the node's memory (`connection/direct_get.rs`). A direct
    /// GET adds only here: [`Counters::snapshot`] counts each under `operations`, `gets`, `slot_guesses`,
    /// `round_trips` and `get_round_trips` once, and under `verbs` its
    /// [`DIRECT_GET_ACCESSES`] (six adds spared on the leanest path).
    pub direct_gets: ShardedCounter,
    /// Updates done by direct access (`connection/direct_update.rs`).
    pub direct_updates: ShardedCounter,
    /// The newest cluster-view epoch a node reported in a heartbeat's answer (0: none yet).
    pub view_epoch: std::sync::atomic::AtomicU64,
    /// What was last reported to a server (each increment is reported once).
    reported: Mutex<ClientCounters>,
    /// A node's own client (its refill and reconciliation scans): its work is not a client's,
    /// and reporting it would count a scan's thousands of round trips as clients' operations
    /// in `rdkv stats`.
    unreported: bool,
}

/// A copy of the counters: the one-sided work (the same figures clients report to servers,
/// with their per-operation ratios) plus reconnects.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CounterSnapshot {
    /// Operations, round trips, work requests, lost races, checksum retries.
    pub work: ClientCounters,
    /// Connections re-established after a failure (each lane's counts: `crate::lanes`).
    pub reconnects: u64,
    /// Round trips that overlapped others of the same replicated operation.
    pub overlapped_round_trips: u64,
    /// Stalled writers' locks taken over.
    pub locks_stolen: u64,
    /// Cluster-view fetches after a failure or a newer epoch.
    pub view_refreshes: u64,
    /// Guessed blocks READ (the slot cache): with the buckets (a wide guess), or with the guessed
    /// slot's word alone (a narrow one; a GET that chases a stale word counts two).
    pub slot_guesses: u64,
    /// Guesses found stale (a chased GET may count two).
    pub slot_guess_misses: u64,
    /// Operations that waited for a scratch buffer ([`Counters::scratch_waits`]).
    pub scratch_waits: u64,
    /// Lists refused because the node's lease word did not cover them
    /// ([`Counters::lease_refusals`]).
    pub lease_refusals: u64,
    /// Announce WRITEs the flusher made alone ([`Counters::announce_flushes`]).
    pub announce_flushes: u64,
    /// GETs done by direct access ([`Counters::direct_gets`]).
    pub direct_gets: u64,
    /// Updates done by direct access ([`Counters::direct_updates`]).
    pub direct_updates: u64,
}

impl std::ops::Deref for CounterSnapshot {
    type Target = ClientCounters;

    fn deref(&self) -> &ClientCounters {
        &self.work
    }
}

impl Counters {
    /// Counters whose reports are always empty (a node's own client for its scans).
    pub(crate) fn unreported() -> Self {
        Self {
            unreported: true,
            ..Self::default()
        }
    }

    /// The increments since the last report, marking them reported (none for a node's own
    /// client).
    pub fn take_report(&self) -> ClientCounters {
        if self.unreported {
            return ClientCounters::default();
        }
        // The snapshot is taken under the lock: two connections' heartbeats report at once,
        // and a snapshot taken before the other's report was stored could be older than it
        // (an underflow, found by the membership test's 60 s run).
        let mut reported = self
            .reported
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = self.snapshot().work;
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
        let load = ShardedCounter::total;
        // Each direct GET is one GET, one guess, one round trip and its accesses.
        let direct_gets = load(&self.direct_gets);
        CounterSnapshot {
            work: ClientCounters {
                operations: load(&self.operations).wrapping_add(direct_gets),
                gets: load(&self.gets).wrapping_add(direct_gets),
                mutations: load(&self.mutations),
                failures: load(&self.failures),
                round_trips: load(&self.round_trips).wrapping_add(direct_gets),
                get_round_trips: load(&self.get_round_trips).wrapping_add(direct_gets),
                verbs: load(&self.verbs)
                    .wrapping_add(direct_gets.wrapping_mul(DIRECT_GET_ACCESSES)),
                cas_failures: load(&self.cas_failures),
                checksum_retries: load(&self.checksum_retries),
            },
            reconnects: load(&self.reconnects),
            overlapped_round_trips: load(&self.overlapped_round_trips),
            locks_stolen: load(&self.locks_stolen),
            view_refreshes: load(&self.view_refreshes),
            slot_guesses: load(&self.slot_guesses).wrapping_add(direct_gets),
            slot_guess_misses: load(&self.slot_guess_misses),
            scratch_waits: load(&self.scratch_waits),
            lease_refusals: load(&self.lease_refusals),
            announce_flushes: load(&self.announce_flushes),
            direct_gets,
            direct_updates: load(&self.direct_updates),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Counters, ShardedCounter, SHARDS};

    #[test]
    fn a_node_s_own_client_reports_nothing_and_others_report_each_increment_once() {
        let counters = Counters::default();
        counters.round_trips.add(3);
        assert_eq!(counters.take_report().round_trips, 3);
        assert_eq!(counters.take_report().round_trips, 0);
        let scans = Counters::unreported();
        scans.round_trips.add(1_153);
        assert_eq!(scans.take_report().round_trips, 0);
        assert_eq!(scans.snapshot().round_trips, 1_153, "still counted locally");
    }

    #[test]
    fn adds_from_many_threads_sum_exactly() {
        let counter = ShardedCounter::default();
        std::thread::scope(|scope| {
            for _ in 0..SHARDS + 3 {
                scope.spawn(|| {
                    for _ in 0..1_000 {
                        counter.add(2);
                    }
                });
            }
        });
        assert_eq!(counter.total(), (SHARDS as u64 + 3) * 2_000);
    }
}
