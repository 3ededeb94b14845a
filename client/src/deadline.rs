//! Operation deadlines without a timer per operation.
//!
//! `tokio::time::timeout` puts an entry in tokio's timer wheel for every operation that waits
//! once, reading the clock, and takes it out again when the operation ends: about 900
//! instructions of a GET's 16,000 (`docs/benchmarks.md`, *Sixth pass*). A client runs
//! thousands of operations a second, each far inside its deadline, so here one watchdog task
//! per client keeps a coarse clock in ticks and wakes the operations whose deadline has passed:
//! - an operation that waits takes an entry (its waker and its deadline tick) in its thread's
//!   shard of the watchdog's table, and gives it back when it ends; it reads no clock while
//!   the watchdog ticks, and the runtime's workers do not share a lock;
//! - the watchdog wakes every tick while entries exist, wakes those past their tick, and ends
//!   after [`IDLE_TICKS`] ticks without any (the next operation that waits starts a new one, on
//!   its own runtime: a client used from a runtime that has since shut down still times out);
//! - a deadline is never early: an operation gives up at the first poll that finds the clock
//!   past its tick, which is at least `deadline` after it first waited, and at most about two
//!   ticks later (more only when the runtime itself runs late, as with tokio's timer). A tick
//!   is a sixty-fourth of the client's deadline, so the overrun is about 3% of it, inside the
//!   quarter that the node's heap quarantine (1.25 × the deadline) allows; below 64 ms the
//!   tick is tokio's own granularity, 1 ms.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// Ticks without a waiting operation after which the watchdog task ends.
const IDLE_TICKS: u32 = 100;

/// The shortest and the longest tick.
const TICK_RANGE: (Duration, Duration) = (Duration::from_millis(1), Duration::from_millis(10));

/// The most shards (a shard per thread that waits, up to this).
const MAX_SHARDS: usize = 16;

/// The deadline passed with the operation still waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Elapsed;

/// One client's watchdog: its clock and its table of waiting operations.
#[derive(Debug)]
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    /// The clock's origin.
    origin: Instant,
    /// The tick's length.
    tick: Duration,
    /// Ticks since `origin`, as of the watchdog's last tick (or an operation's clock read while
    /// no watchdog ran).
    now: AtomicU64,
    /// Whether a watchdog task runs (or is about to).
    running: AtomicBool,
    /// The waiting operations, a shard per thread (modulo the count).
    shards: Box<[Shard]>,
}

/// One shard of the table, on a cache line of its own.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard(Mutex<Table>);

#[derive(Debug, Default)]
struct Table {
    /// Entries by index; `None` is free.
    entries: Vec<Option<Entry>>,
    /// Free indexes.
    free: Vec<usize>,
    /// Entries in use.
    used: usize,
}

#[derive(Debug)]
struct Entry {
    deadline: u64,
    waker: Waker,
}

/// This thread's shard number (before the modulo): threads take numbers in turn.
fn thread_shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    SHARD.with(|shard| *shard)
}

impl Watchdog {
    /// A watchdog whose tick suits `deadline` (a sixty-fourth of it, between 1 and 10 ms).
    pub(crate) fn new(deadline: Duration) -> Self {
        let tick = (deadline / 64).clamp(TICK_RANGE.0, TICK_RANGE.1);
        let shards = std::thread::available_parallelism()
            .map_or(1, std::num::NonZeroUsize::get)
            .clamp(1, MAX_SHARDS);
        Self {
            shared: Arc::new(Shared {
                origin: Instant::now(),
                tick,
                now: AtomicU64::new(0),
                running: AtomicBool::new(false),
                shards: (0..shards).map(|_| Shard::default()).collect(),
            }),
        }
    }

    /// Operations waiting now (tests).
    #[cfg(test)]
    fn waiting(&self) -> usize {
        (0..self.shared.shards.len())
            .map(|shard| self.shared.lock(shard).used)
            .sum()
    }

    /// Entries the table holds, used or free (tests).
    #[cfg(test)]
    fn capacity(&self) -> usize {
        (0..self.shared.shards.len())
            .map(|shard| self.shared.lock(shard).entries.len())
            .sum()
    }
}

impl Shared {
    fn lock(&self, shard: usize) -> MutexGuard<'_, Table> {
        self.shards[shard]
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Ticks since the origin, by the clock.
    fn read_clock(&self) -> u64 {
        let ticks = self.origin.elapsed().as_nanos() / self.tick.as_nanos().max(1);
        u64::try_from(ticks).unwrap_or(u64::MAX)
    }

    /// Advances the clock and wakes the entries past their tick; whether any entry is left.
    fn expire(&self) -> bool {
        let now = self.read_clock();
        self.now.fetch_max(now, Ordering::AcqRel);
        let mut expired = Vec::new();
        let mut busy = false;
        for shard in 0..self.shards.len() {
            let table = self.lock(shard);
            for entry in table.entries.iter().flatten() {
                if entry.deadline <= now {
                    expired.push(entry.waker.clone());
                }
            }
            busy |= table.used > 0;
        }
        // Woken outside the locks: a woken task may run at once on another worker and end.
        for waker in expired {
            waker.wake();
        }
        busy
    }

    /// Starts a watchdog task on the current runtime unless one runs.
    fn ensure_running(self: &Arc<Self>) {
        if !self.running.load(Ordering::SeqCst)
            && self
                .running
                .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            tokio::spawn(run(self.clone()));
        }
    }
}

/// The watchdog task: ticks while operations wait, ends after [`IDLE_TICKS`] idle ticks.
async fn run(shared: Arc<Shared>) {
    /// Marks the watchdog stopped however the task ends, its runtime's shutdown included.
    struct Stopped<'a>(&'a Shared);
    impl Drop for Stopped<'_> {
        fn drop(&mut self) {
            self.0.running.store(false, Ordering::SeqCst);
        }
    }
    let _stopped = Stopped(&shared);
    let mut idle = 0;
    loop {
        tokio::time::sleep(shared.tick).await;
        if shared.expire() {
            idle = 0;
            continue;
        }
        idle += 1;
        if idle < IDLE_TICKS {
            continue;
        }
        // Stop, then look again: an operation registers first and checks `running` second,
        // so either it sees the watchdog stopped and starts one, or this sees its entry.
        shared.running.store(false, Ordering::SeqCst);
        let waiting = (0..shared.shards.len()).any(|shard| shared.lock(shard).used > 0);
        if !waiting
            || shared
                .running
                .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
        {
            // Nobody waits, or a new watchdog already took over. (The guard's store is
            // harmless only when nobody took over: forget it in that case.)
            std::mem::forget(_stopped);
            return;
        }
        idle = 0;
    }
}

/// The entry an operation holds while it waits; gives it back when dropped.
struct Registration<'a> {
    shared: &'a Arc<Shared>,
    /// The entry's shard, index and deadline tick, and the waker it holds, once the operation
    /// waited.
    entry: Option<(usize, usize, u64, Waker)>,
}

impl Registration<'_> {
    /// Takes an entry in this thread's shard: `deadline` counts from now.
    fn register(&mut self, deadline: Duration, waker: &Waker) {
        let shared = self.shared;
        if !shared.running.load(Ordering::SeqCst) {
            // Nobody keeps the clock: read it.
            shared.now.fetch_max(shared.read_clock(), Ordering::AcqRel);
        }
        // +1: the clock may be up to a tick behind, and a deadline is never early.
        let ticks = deadline.as_nanos().div_ceil(shared.tick.as_nanos().max(1));
        let deadline = shared
            .now
            .load(Ordering::Acquire)
            .saturating_add(u64::try_from(ticks).unwrap_or(u64::MAX))
            .saturating_add(1);
        let shard = thread_shard() % shared.shards.len();
        let mut table = shared.lock(shard);
        let entry = Entry {
            deadline,
            waker: waker.clone(),
        };
        let index = match table.free.pop() {
            Some(index) => {
                table.entries[index] = Some(entry);
                index
            }
            None => {
                table.entries.push(Some(entry));
                table.entries.len() - 1
            }
        };
        table.used += 1;
        drop(table);
        self.entry = Some((shard, index, deadline, waker.clone()));
        shared.ensure_running();
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        if let Some((shard, index, _, _)) = self.entry.take() {
            let mut table = self.shared.lock(shard);
            if let Some(slot) = table.entries.get_mut(index) {
                if slot.take().is_some() {
                    table.used -= 1;
                    table.free.push(index);
                }
            }
        }
    }
}

impl Watchdog {
    /// Runs `work` for at most `deadline` from its first wait: `Err(Elapsed)` past it.
    pub(crate) fn timeout<F: Future>(&self, deadline: Duration, work: F) -> Timeout<'_, F> {
        Timeout {
            work,
            deadline,
            registration: Registration {
                shared: &self.shared,
                entry: None,
            },
        }
    }
}

pin_project_lite::pin_project! {
    /// The future [`Watchdog::timeout`] returns (a struct, not an `async fn`: the operation's
    /// future, often large, is moved once less).
    pub(crate) struct Timeout<'a, F> {
        #[pin]
        work: F,
        deadline: Duration,
        registration: Registration<'a>,
    }
}

impl<F: Future> Future for Timeout<'_, F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: std::pin::Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.work.poll(context) {
            return Poll::Ready(Ok(output));
        }
        let registration = this.registration;
        match &mut registration.entry {
            None => registration.register(*this.deadline, context.waker()),
            Some((shard, index, deadline, waker)) => {
                if registration.shared.now.load(Ordering::Acquire) >= *deadline {
                    return Poll::Ready(Err(Elapsed));
                }
                if !waker.will_wake(context.waker()) {
                    // The operation moved to another task: wake that one instead.
                    *waker = context.waker().clone();
                    let mut table = registration.shared.lock(*shard);
                    if let Some(Some(entry)) = table.entries.get_mut(*index) {
                        entry.waker = waker.clone();
                    }
                }
            }
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::{Elapsed, Watchdog};
    use std::time::{Duration, Instant};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_operation_that_never_ends_times_out_no_earlier_than_its_deadline() {
        let watchdog = Watchdog::new(Duration::from_millis(200));
        let started = Instant::now();
        let outcome = watchdog
            .timeout(Duration::from_millis(200), std::future::pending::<()>())
            .await;
        let waited = started.elapsed();
        assert_eq!(outcome, Err(Elapsed));
        assert!(waited >= Duration::from_millis(200), "early: {waited:?}");
        assert!(waited < Duration::from_millis(1_000), "late: {waited:?}");
        assert_eq!(watchdog.waiting(), 0, "the entry is given back");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn operations_that_end_in_time_give_their_entries_back() {
        let watchdog = std::sync::Arc::new(Watchdog::new(Duration::from_secs(2)));
        let mut tasks = tokio::task::JoinSet::new();
        for task in 0..64u64 {
            let watchdog = watchdog.clone();
            tasks.spawn(async move {
                for round in 0..20u64 {
                    let work = async move {
                        tokio::task::yield_now().await;
                        tokio::time::sleep(Duration::from_micros(100 * (task % 4))).await;
                        task * round
                    };
                    let outcome = watchdog.timeout(Duration::from_secs(2), work).await;
                    assert_eq!(outcome, Ok(task * round));
                }
            });
        }
        while let Some(joined) = tasks.join_next().await {
            joined.expect("task");
        }
        assert_eq!(watchdog.waiting(), 0);
        // Entries are reused: no shard ever held more than the tasks at once.
        assert!(watchdog.capacity() <= 64 * watchdog.shared.shards.len());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_ready_operation_takes_no_entry() {
        let watchdog = Watchdog::new(Duration::from_millis(50));
        assert_eq!(
            watchdog
                .timeout(Duration::from_millis(50), async { 7 })
                .await,
            Ok(7)
        );
        assert_eq!(watchdog.capacity(), 0);
        assert!(
            !watchdog
                .shared
                .running
                .load(std::sync::atomic::Ordering::SeqCst),
            "no watchdog task for it either"
        );
    }

    #[test]
    fn a_watchdog_whose_runtime_shut_down_is_started_again_on_the_next() {
        let watchdog = Watchdog::new(Duration::from_millis(50));
        for _ in 0..2 {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_time()
                .build()
                .expect("runtime");
            let outcome = runtime.block_on(
                watchdog.timeout(Duration::from_millis(50), std::future::pending::<()>()),
            );
            assert_eq!(outcome, Err(Elapsed));
            // Shutting the runtime down drops its watchdog task mid-tick.
            drop(runtime);
            assert!(!watchdog
                .shared
                .running
                .load(std::sync::atomic::Ordering::SeqCst));
        }
    }
}
