//! Lanes: a client keeps up to one connection per runtime worker thread to each node, and an
//! operation uses the lane of the thread it runs on. Two workers posting to one queue pair
//! meet on its requester lock, its pending queue, its completion queue and its announce word,
//! and READ data lands in one worker's buffers from the other core: with two tokio workers
//! that doubled the client's CPU per GET over `shm` (`docs/history/benchmarks-passes.md`, *Two
//! workers on one queue pair*). A lane opens on its first operation, so a thread that never uses
//! the client costs the node nothing.
//!
//! Only the first lane opens on an operation's path. An operation whose lane is not connected
//! while another is uses that one, and its own lane opens in the background: a node at
//! `max_connections` holds a new connection for the whole handshake timeout, and an operation
//! must not wait for that (a failed attempt is retried after [`LANE_RETRY_INTERVAL`], doubling
//! with each failure in a row up to [`LANE_RETRY_MOST`]).
//!
//! Every fabric gets a lane per worker. Over `soft` that pays only because one doorbell carries
//! a batch: with a write per post, two connections from one client halve the node engine's
//! batches and raise its CPU per operation by 40%; with batching, a lane per worker gives
//! YCSB-C +17–27% on two workers and leaves the node's CPU per operation unchanged
//! (`docs/history/benchmarks-passes.md`, *Lanes*, *Seventh pass*, *Eighth pass*).
//! `ClientConfig::lanes` caps them.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::connection::NodeConnection;

/// How long a lane that failed to open in the background waits before the next attempt; each
/// failure in a row doubles it, up to [`LANE_RETRY_MOST`].
pub const LANE_RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// The longest wait between a lane's background attempts. A node more than half full refuses
/// extra lanes for as long as it stays so: at one attempt a second, the lanes of a few
/// clients cost it about 60 handshakes (and refusals) a second.
pub const LANE_RETRY_MOST: Duration = Duration::from_secs(30);

/// The first pause after a lane failed to connect; each failure in a row doubles it, up to
/// [`RECONNECT_BACKOFF_MOST`]. Without it, operations against a node that was down each tried a
/// connect of their own: about 29,000 refused connects a second from one load generator.
pub const RECONNECT_BACKOFF_FIRST: Duration = Duration::from_millis(1);

/// The longest pause between a lane's connection attempts on the operations' path: short, so
/// a node that comes back is used within a tenth of a second.
pub const RECONNECT_BACKOFF_MOST: Duration = Duration::from_millis(100);

/// The most lanes per node, whatever the runtime's worker count: each is a connection, with
/// its queue pair, keys and heap chunk on the node, counted by its `max_connections`.
pub const MAX_LANES: usize = 8;

/// The lanes for a client made on this thread: the current tokio runtime's worker count (one
/// on a current-thread runtime), else the machine's parallelism; at most [`MAX_LANES`].
pub(crate) fn default_lanes() -> usize {
    let workers = match tokio::runtime::Handle::try_current() {
        Ok(handle) => handle.metrics().num_workers(),
        Err(_) => std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
    };
    workers.clamp(1, MAX_LANES)
}

/// The lanes for a client that asks for `requested` (`ClientConfig::lanes`): that many, from 1
/// to [`MAX_LANES`], or [`default_lanes`] when it asks for none.
pub(crate) fn lanes_for(requested: Option<usize>) -> usize {
    requested.map_or_else(default_lanes, |lanes| lanes.clamp(1, MAX_LANES))
}

/// The lane this thread uses out of `lanes`: threads are numbered in the order they first use
/// any client, so the workers of one runtime get different lanes (until there are more
/// threads than lanes).
pub(crate) fn current_lane(lanes: usize) -> usize {
    /// The next thread's number.
    static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static THREAD_NUMBER: usize = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
    }
    THREAD_NUMBER.with(|number| number % lanes.max(1))
}

/// One lane to a node: its connection, opened lazily and replaced when it breaks.
#[derive(Debug)]
pub(crate) struct Lane {
    /// The live connection. The task that opens a connection stores it even if the operation
    /// that asked is cancelled.
    pub(crate) connection: Mutex<Option<Arc<NodeConnection>>>,
    /// One connection attempt at a time: concurrent operations on the lane wait for it instead
    /// of each opening (and pinning buffers for) a connection of their own.
    pub(crate) connecting: Arc<tokio::sync::Semaphore>,
    /// Set when the lane's connection was retired: the next one counts as a reconnect.
    pub(crate) retired: AtomicBool,
    /// A background attempt to open the lane is in flight.
    opening: AtomicBool,
    /// When the last background attempt failed, and how long the next waits (from
    /// [`LANE_RETRY_INTERVAL`], doubling to [`LANE_RETRY_MOST`]).
    failed_at: Mutex<Option<(Instant, Duration)>>,
    /// The failures in a row of the lane's connection attempts, and the pause they earn.
    backoff: Mutex<Option<Backoff>>,
}

/// A lane's connection attempts failing in a row.
#[derive(Debug)]
struct Backoff {
    /// When the last one failed.
    failed_at: Instant,
    /// How long after it the next may start.
    pause: Duration,
    /// Why it failed.
    reason: String,
    /// Whether the node refused the connection (full) rather than being unreachable.
    refused: bool,
}

impl Lane {
    /// An empty lane.
    pub(crate) fn new() -> Self {
        Self {
            connection: Mutex::new(None),
            connecting: Arc::new(tokio::sync::Semaphore::new(1)),
            retired: AtomicBool::new(false),
            opening: AtomicBool::new(false),
            failed_at: Mutex::new(None),
            backoff: Mutex::new(None),
        }
    }

    /// While the lane's last connection attempt failed less than its pause ago: why (and
    /// whether the node refused it), how long ago, and the time left before the next may
    /// start.
    pub(crate) fn backing_off(&self) -> Option<(String, bool, Duration, Duration)> {
        let backoff = rdkv_fabric::lock(&self.backoff);
        let backoff = backoff.as_ref()?;
        let ago = backoff.failed_at.elapsed();
        (ago < backoff.pause).then(|| {
            (
                backoff.reason.clone(),
                backoff.refused,
                ago,
                backoff.pause - ago,
            )
        })
    }

    /// A connection attempt of the lane failed (`refused`: the node said no, as a full node
    /// does): the next waits twice as long as after the last failure, from
    /// [`RECONNECT_BACKOFF_FIRST`] to [`RECONNECT_BACKOFF_MOST`].
    pub(crate) fn connect_failed(&self, reason: String, refused: bool) {
        let mut backoff = rdkv_fabric::lock(&self.backoff);
        let pause = backoff.as_ref().map_or(RECONNECT_BACKOFF_FIRST, |last| {
            (last.pause * 2).min(RECONNECT_BACKOFF_MOST)
        });
        *backoff = Some(Backoff {
            failed_at: Instant::now(),
            pause,
            reason,
            refused,
        });
    }

    /// A connection attempt of the lane succeeded: no pause before the next.
    pub(crate) fn connect_succeeded(&self) {
        *rdkv_fabric::lock(&self.backoff) = None;
    }

    /// Claims the lane's background opening: false while one is in flight, or within the
    /// retry interval of a failed one.
    pub(crate) fn claim_background_attempt(&self) -> bool {
        if rdkv_fabric::lock(&self.failed_at).is_some_and(|(failed, wait)| failed.elapsed() < wait)
        {
            return false;
        }
        !self.opening.swap(true, Ordering::AcqRel)
    }

    /// Ends the background opening claimed with [`Lane::claim_background_attempt`]: a failure
    /// doubles the wait before the next (from [`LANE_RETRY_INTERVAL`] to [`LANE_RETRY_MOST`]).
    pub(crate) fn end_background_attempt(&self, succeeded: bool) {
        let mut failed_at = rdkv_fabric::lock(&self.failed_at);
        *failed_at = if succeeded {
            None
        } else {
            let wait = failed_at.map_or(LANE_RETRY_INTERVAL, |(_, wait)| {
                (wait * 2).min(LANE_RETRY_MOST)
            });
            Some((Instant::now(), wait))
        };
        drop(failed_at);
        self.opening.store(false, Ordering::Release);
    }

    /// The lane's live connection, if it has one that has not failed.
    pub(crate) fn healthy_connection(&self) -> Option<Arc<NodeConnection>> {
        rdkv_fabric::lock(&self.connection)
            .clone()
            .filter(|connection| !connection.is_broken())
    }

    /// Empties the lane if it holds `connection`; whether it did.
    pub(crate) fn remove(&self, connection: &Arc<NodeConnection>) -> bool {
        let mut current = rdkv_fabric::lock(&self.connection);
        if current
            .as_ref()
            .is_some_and(|live| Arc::ptr_eq(live, connection))
        {
            *current = None;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_background_attempts_wait_longer_each_time() {
        let lane = Lane::new();
        let mut waits = Vec::new();
        for _ in 0..8 {
            assert!(lane.claim_background_attempt(), "no attempt in flight");
            lane.end_background_attempt(false);
            assert!(!lane.claim_background_attempt(), "within its wait");
            let (_, wait) = rdkv_fabric::lock(&lane.failed_at).expect("failed");
            waits.push(wait.as_secs());
            // As if the wait had passed.
            *rdkv_fabric::lock(&lane.failed_at) = Some((Instant::now() - wait, wait));
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert!(lane.claim_background_attempt());
        lane.end_background_attempt(true);
        assert!(lane.claim_background_attempt(), "a success clears the wait");
    }

    #[test]
    fn failed_connection_attempts_back_off_doubling_up_to_the_most() {
        let lane = Lane::new();
        assert!(lane.backing_off().is_none());
        lane.connect_failed("connection refused".into(), false);
        let (reason, refused, _, left) = lane.backing_off().expect("backing off");
        assert!(!refused);
        assert_eq!(reason, "connection refused");
        assert!(left <= RECONNECT_BACKOFF_FIRST);
        for _ in 0..20 {
            lane.connect_failed("connection refused".into(), false);
        }
        let pause = rdkv_fabric::lock(&lane.backoff)
            .as_ref()
            .map(|backoff| backoff.pause);
        assert_eq!(pause, Some(RECONNECT_BACKOFF_MOST));
        lane.connect_succeeded();
        assert!(lane.backing_off().is_none());
    }

    #[test]
    fn a_thread_keeps_its_lane_and_threads_spread_over_the_lanes() {
        let here = current_lane(2);
        assert_eq!(current_lane(2), here, "a thread's lane is stable");
        assert_eq!(current_lane(1), 0);
        // Threads are numbered in turn as they first ask: sixteen threads in a row use both
        // lanes (other tests' threads may take numbers in between, never all the odd ones).
        let lanes: std::collections::BTreeSet<usize> = (0..16)
            .map(|_| {
                std::thread::spawn(|| current_lane(2))
                    .join()
                    .expect("the thread ran")
            })
            .collect();
        assert_eq!(lanes, [0, 1].into_iter().collect());
    }

    #[test]
    fn lanes_follow_the_runtime_workers() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(3)
            .build()
            .expect("a runtime");
        assert_eq!(runtime.block_on(async { default_lanes() }), 3);
        let single = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        assert_eq!(single.block_on(async { default_lanes() }), 1);
    }
}
