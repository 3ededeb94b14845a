//! Operation deadlines without a timer per operation.
//!
//! `tokio::time::timeout` puts an entry in tokio's timer wheel for every operation that waits
//! once and takes it out again when the operation ends: about 900 instructions of a GET's
//! 16,000 (`docs/benchmarks.md`, *Sixth pass*). Operations end far inside their deadlines, so
//! here one watchdog thread per process wakes those whose deadline has passed:
//! - an operation reads the clock at its first poll, and if it waits, takes an entry (its
//!   waker and its deadline) in its thread's shard of the watchdog's table; it gives the entry
//!   back when it ends;
//! - the watchdog thread wakes every [`TICK`] while entries exist, wakes the entries past their
//!   deadline (once each), and ends after [`IDLE_TICKS`] ticks without any; the next
//!   operation that waits starts it again. A thread, not a task: it belongs to no runtime, so
//!   a client used from several runtimes, or from one that was shut down or is not being
//!   driven, still times out;
//! - a deadline is never early: an operation gives up only when a poll reads the clock past
//!   its deadline (which counts from its first poll, as `tokio::time::timeout`'s counts from
//!   its creation); and it is late by at most about a tick and the thread's wake-up (about
//!   1–2 ms, as tokio's timer's millisecond granularity), inside the quarter of the deadline
//!   that the node's heap quarantine (1.25 × the deadline) allows, for deadlines from 10 ms.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// How often the watchdog thread looks at the table while entries exist.
pub(crate) const TICK: Duration = Duration::from_millis(1);

/// Ticks without a waiting operation after which the watchdog thread ends.
const IDLE_TICKS: u32 = 200;

/// Shards per CPU: threads take shard numbers in turn, so a few spare shards keep two workers
/// off one shard (the main thread and blocking threads take numbers too).
const SHARDS_PER_CPU: usize = 4;

/// The most shards.
const MAX_SHARDS: usize = 64;

/// The deadline passed with the operation still waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Elapsed;

/// The process's watchdog: whether its thread runs, and the table of waiting operations.
#[derive(Debug)]
struct Watchdog {
    /// The clock's origin.
    origin: Instant,
    /// Whether the watchdog thread runs (or is about to).
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
    /// Nanoseconds since the origin; `u64::MAX` once woken for it.
    deadline: u64,
    waker: Waker,
}

/// The process's watchdog.
fn watchdog() -> &'static Watchdog {
    static WATCHDOG: OnceLock<Watchdog> = OnceLock::new();
    WATCHDOG.get_or_init(|| {
        let shards = std::thread::available_parallelism()
            .map_or(1, std::num::NonZeroUsize::get)
            .saturating_mul(SHARDS_PER_CPU)
            .clamp(1, MAX_SHARDS);
        Watchdog {
            origin: Instant::now(),
            running: AtomicBool::new(false),
            shards: (0..shards).map(|_| Shard::default()).collect(),
        }
    })
}

/// This thread's shard number (before the modulo): threads take numbers in turn.
fn thread_shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    SHARD.try_with(|shard| *shard).unwrap_or(0)
}

impl Watchdog {
    fn lock(&self, shard: usize) -> MutexGuard<'_, Table> {
        self.shards[shard]
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Nanoseconds since the origin.
    fn clock(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Wakes the entries past their deadline, once each; whether any entry is left.
    fn expire(&self) -> bool {
        let now = self.clock();
        let mut expired = Vec::new();
        let mut busy = false;
        for shard in 0..self.shards.len() {
            let mut table = self.lock(shard);
            for entry in table.entries.iter_mut().flatten() {
                if entry.deadline <= now {
                    entry.deadline = u64::MAX;
                    expired.push(entry.waker.clone());
                }
            }
            busy |= table.used > 0;
        }
        // Woken outside the locks: a woken task may run at once on another thread and end.
        for waker in expired {
            waker.wake();
        }
        busy
    }

    /// Starts the watchdog thread unless it runs.
    fn ensure_running(&'static self) {
        if self.running.load(Ordering::SeqCst)
            || self
                .running
                .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
        {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("rdkv-deadlines".into())
            .spawn(move || self.run());
        if let Err(error) = spawned {
            // Out of threads: the next operation that waits tries again.
            self.running.store(false, Ordering::SeqCst);
            tracing::warn!(%error, "cannot start the deadline watchdog thread");
        }
    }

    /// The watchdog thread: ticks while operations wait, ends after [`IDLE_TICKS`] idle ticks.
    fn run(&self) {
        let mut idle = 0;
        loop {
            std::thread::sleep(TICK);
            if self.expire() {
                idle = 0;
                continue;
            }
            idle += 1;
            if idle < IDLE_TICKS {
                continue;
            }
            // Stop, then look again: an operation registers first and checks `running` second,
            // so either it sees the watchdog stopped and starts one, or this sees its entry.
            self.running.store(false, Ordering::SeqCst);
            let waiting = (0..self.shards.len()).any(|shard| self.lock(shard).used > 0);
            if !waiting
                || self
                    .running
                    .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                    .is_err()
            {
                // Nobody waits, or a new watchdog thread took over.
                return;
            }
            idle = 0;
        }
    }
}

/// The entry an operation holds while it waits; gives it back when dropped.
#[derive(Debug, Default)]
struct Registration {
    /// The entry's shard and index, and the waker it holds, once the operation waited.
    entry: Option<(usize, usize, Waker)>,
}

impl Registration {
    /// Takes an entry in this thread's shard.
    fn register(&mut self, deadline: u64, waker: &Waker) {
        let watchdog = watchdog();
        let shard = thread_shard() % watchdog.shards.len();
        let mut table = watchdog.lock(shard);
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
        self.entry = Some((shard, index, waker.clone()));
        watchdog.ensure_running();
    }

    /// Points the entry at `waker` (the operation moved to another task).
    fn rewake(&mut self, waker: &Waker) {
        let Some((shard, index, held)) = &mut self.entry else {
            return;
        };
        if held.will_wake(waker) {
            return;
        }
        *held = waker.clone();
        let mut table = watchdog().lock(*shard);
        let old = table
            .entries
            .get_mut(*index)
            .and_then(Option::as_mut)
            .map(|entry| std::mem::replace(&mut entry.waker, waker.clone()));
        drop(table);
        // The old waker is dropped outside the lock (its drop may run a task's code).
        drop(old);
    }

    /// Gives the entry back.
    fn release(&mut self) {
        let Some((shard, index, _)) = self.entry.take() else {
            return;
        };
        let mut table = watchdog().lock(shard);
        let taken = table.entries.get_mut(index).and_then(Option::take);
        if taken.is_some() {
            table.used -= 1;
            table.free.push(index);
        }
        drop(table);
        drop(taken);
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.release();
    }
}

/// Runs `work` for at most `deadline` from its first poll: `Err(Elapsed)` past it.
pub(crate) fn timeout<F: Future>(deadline: Duration, work: F) -> Timeout<F> {
    Timeout {
        work,
        deadline,
        until: None,
        registration: Registration::default(),
    }
}

pin_project_lite::pin_project! {
    /// The future [`timeout`] returns (a struct, not an `async fn`: the operation's future,
    /// often large, is moved once less).
    pub(crate) struct Timeout<F> {
        #[pin]
        work: F,
        deadline: Duration,
        // Nanoseconds since the watchdog's origin, from the first poll.
        until: Option<u64>,
        registration: Registration,
    }
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: std::pin::Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let watchdog = watchdog();
        let until = *this.until.get_or_insert_with(|| {
            let nanos = u64::try_from(this.deadline.as_nanos()).unwrap_or(u64::MAX);
            watchdog.clock().saturating_add(nanos)
        });
        if let Poll::Ready(output) = this.work.poll(context) {
            this.registration.release();
            return Poll::Ready(Ok(output));
        }
        if this.registration.entry.is_none() {
            this.registration.register(until, context.waker());
        } else if watchdog.clock() >= until {
            this.registration.release();
            return Poll::Ready(Err(Elapsed));
        } else {
            this.registration.rewake(context.waker());
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::{timeout, watchdog, Elapsed};
    use std::future::Future;
    use std::time::{Duration, Instant};

    /// Entries in use, all shards.
    fn waiting() -> usize {
        let watchdog = watchdog();
        (0..watchdog.shards.len())
            .map(|shard| watchdog.lock(shard).used)
            .sum()
    }

    /// Keeps the watchdog thread ticking: one operation waiting for `span`.
    fn keep_ticking(span: Duration) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime");
            let outcome = runtime.block_on(timeout(span, std::future::pending::<()>()));
            assert_eq!(outcome, Err(Elapsed));
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_operation_that_never_ends_times_out_no_earlier_than_its_deadline() {
        let started = Instant::now();
        let outcome = timeout(Duration::from_millis(200), std::future::pending::<()>()).await;
        let waited = started.elapsed();
        assert_eq!(outcome, Err(Elapsed));
        assert!(waited >= Duration::from_millis(200), "early: {waited:?}");
        assert!(waited < Duration::from_millis(1_000), "late: {waited:?}");
    }

    #[test]
    fn deadlines_are_never_early_while_the_watchdog_already_ticks() {
        // The review's case: a watchdog that ticks already (its clock coarse and behind) must
        // not shorten a deadline that starts between two of its ticks.
        let ticking = keep_ticking(Duration::from_millis(800));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .expect("runtime");
        for round in 0..60u64 {
            // Start between ticks at varied phases.
            std::thread::sleep(Duration::from_micros(137 * (round % 7)));
            let deadline = Duration::from_millis(5 + round % 6);
            let started = Instant::now();
            let outcome = runtime.block_on(timeout(deadline, std::future::pending::<()>()));
            let waited = started.elapsed();
            assert_eq!(outcome, Err(Elapsed));
            assert!(
                waited >= deadline,
                "{deadline:?} deadline ended after {waited:?}"
            );
            assert!(
                waited < deadline + Duration::from_millis(250),
                "{deadline:?} deadline ended only after {waited:?}"
            );
        }
        ticking.join().expect("ticking thread");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn operations_that_end_in_time_give_their_entries_back() {
        let mut tasks = tokio::task::JoinSet::new();
        for task in 0..64u64 {
            tasks.spawn(async move {
                for round in 0..20u64 {
                    let work = async move {
                        tokio::task::yield_now().await;
                        tokio::time::sleep(Duration::from_micros(100 * (task % 4))).await;
                        task * round
                    };
                    let outcome = timeout(Duration::from_secs(2), work).await;
                    assert_eq!(outcome, Ok(task * round));
                }
            });
        }
        // Aborted operations give theirs back too.
        for _ in 0..16 {
            let task = tokio::spawn(timeout(
                Duration::from_secs(60),
                std::future::pending::<()>(),
            ));
            tokio::task::yield_now().await;
            task.abort();
        }
        while let Some(joined) = tasks.join_next().await {
            joined.expect("task");
        }
        // Other tests in this binary may be waiting too: wait for the count to drain.
        let started = Instant::now();
        while waiting() > 0 {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "entries left: {}",
                waiting()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let watchdog = watchdog();
        for shard in 0..watchdog.shards.len() {
            // Entries are reused: a shard never holds many more than its tasks at once.
            assert!(watchdog.lock(shard).entries.len() <= 64 + 16 + 64);
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_ready_operation_takes_no_entry() {
        let mut registration_before = None;
        let outcome = {
            let future = timeout(Duration::from_millis(50), async { 7 });
            tokio::pin!(future);
            let output = std::future::poll_fn(|context| {
                let poll = future.as_mut().poll(context);
                registration_before = Some(future.registration.entry.is_some());
                poll
            })
            .await;
            output
        };
        assert_eq!(outcome, Ok(7));
        assert_eq!(registration_before, Some(false));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_operation_polled_by_another_task_wakes_that_task() {
        let mut future = Box::pin(timeout(
            Duration::from_millis(50),
            std::future::pending::<()>(),
        ));
        // First polled (and registered) with a waker that wakes nothing.
        let mut context = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(future.as_mut().poll(&mut context).is_pending());
        // Then awaited by another task: the deadline must wake that one.
        let outcome = tokio::spawn(future).await.expect("task");
        assert_eq!(outcome, Err(Elapsed));
    }

    #[test]
    fn operations_time_out_on_a_runtime_that_is_not_driven_or_was_shut_down() {
        // A current-thread runtime's waiting operation, then that runtime dropped with its
        // tasks unpolled; then an operation on a second runtime, and one outside the first's
        // driving (a block_on that ended early): each still times out.
        let first = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let abandoned = first.spawn(timeout(
            Duration::from_secs(60),
            std::future::pending::<()>(),
        ));
        // The spawned operation runs (and registers) while this yields, then is left waiting.
        first.block_on(tokio::task::yield_now());
        drop(abandoned);
        drop(first);
        for _ in 0..2 {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime");
            let started = Instant::now();
            let outcome = runtime.block_on(timeout(
                Duration::from_millis(50),
                std::future::pending::<()>(),
            ));
            assert_eq!(outcome, Err(Elapsed));
            assert!(started.elapsed() < Duration::from_secs(2));
        }
    }
}
