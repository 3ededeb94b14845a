//! Operation deadlines without a timer per operation.
//!
//! `tokio::time::timeout` puts an entry in tokio's timer wheel for every operation that waits
//! once and takes it out again when the operation ends: about 900 instructions of a GET's
//! 16,000 (`docs/history/benchmarks-passes.md`, *Sixth pass*). Operations end far inside their
//! deadlines, so here one watchdog thread per process wakes those whose deadline has passed:
//! - an operation reads the clock at its first poll, and if it waits, takes an entry (its
//!   waker and its deadline) in its thread's shard of the watchdog's table; it gives the entry
//!   back when it ends;
//! - the watchdog thread wakes every [`TICK`] while entries exist, wakes the entries past their
//!   deadline (once each), and ends after [`IDLE_TICKS`] ticks without any; the next
//!   operation that waits starts it again. A thread, not a task: it belongs to no runtime, so
//!   a client used from several runtimes, or from one that was shut down or is not being
//!   driven, still times out;
//! - an entry is woken once; an operation woken and never polled again does not keep the
//!   thread ticking, and a shard with nothing in use keeps no entries to walk. A waker that
//!   panics (another executor's) is caught and logged;
//! - if the thread cannot be started (out of threads), every waiting operation is woken, tries
//!   again, and falls back to its runtime's timer;
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
    /// Times the thread could not be started (each woke every waiting operation early).
    spawn_failures: AtomicUsize,
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
    /// Entries in use that were woken for their deadline: nothing left to do for them (an
    /// operation that is never polled again does not keep the thread ticking).
    fired: usize,
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
            spawn_failures: AtomicUsize::new(0),
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

    /// Wakes the entries past their deadline (`all`: every entry), once each; whether an
    /// entry is left that was not woken.
    fn expire(&self, all: bool) -> bool {
        let now = if all { u64::MAX } else { self.clock() };
        let mut expired = Vec::new();
        let mut busy = false;
        for shard in 0..self.shards.len() {
            let mut table = self.lock(shard);
            let mut fired = 0;
            for entry in table.entries.iter_mut().flatten() {
                if entry.deadline != u64::MAX && (all || entry.deadline <= now) {
                    entry.deadline = u64::MAX;
                    fired += 1;
                    expired.push(entry.waker.clone());
                }
            }
            table.fired += fired;
            busy |= table.used > table.fired;
        }
        // Woken outside the locks: a woken task may run at once on another thread and end. A
        // waker that panics (another executor's) neither stops the others nor this thread.
        for waker in expired {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| waker.wake())).is_err() {
                tracing::warn!("a waker panicked when its operation's deadline passed");
            }
        }
        busy
    }

    /// Starts the watchdog thread unless it runs; false when it cannot be started.
    fn ensure_running(&'static self) -> bool {
        if self.running.load(Ordering::SeqCst)
            || self
                .running
                .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
        {
            return true;
        }
        let spawned = std::thread::Builder::new()
            .name("rdkv-deadlines".into())
            .spawn(move || self.run());
        match spawned {
            Ok(_) => true,
            Err(error) => {
                // Out of threads. Operations that registered meanwhile saw `running` and
                // counted on this thread: wake them all, so that each polls again, tries again,
                // and falls back to a timer of its runtime if it fails too.
                self.running.store(false, Ordering::SeqCst);
                self.spawn_failures.fetch_add(1, Ordering::SeqCst);
                static WARNED: AtomicBool = AtomicBool::new(false);
                if !WARNED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        %error,
                        "cannot start the deadline watchdog thread; operations use their runtime's timer until it starts"
                    );
                }
                self.expire(true);
                false
            }
        }
    }

    /// The watchdog thread: ticks while operations wait, ends after [`IDLE_TICKS`] idle ticks.
    fn run(&self) {
        /// Marks the watchdog stopped if the thread unwinds (its own exits say so themselves).
        struct Unwinding<'a>(&'a AtomicBool);
        impl Drop for Unwinding<'_> {
            fn drop(&mut self) {
                if std::thread::panicking() {
                    self.0.store(false, Ordering::SeqCst);
                }
            }
        }
        let _unwinding = Unwinding(&self.running);
        let mut idle = 0;
        loop {
            std::thread::sleep(TICK);
            if self.expire(false) {
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
            let waiting = (0..self.shards.len()).any(|shard| {
                let table = self.lock(shard);
                table.used > table.fired
            });
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
    /// Takes an entry in this thread's shard; false when no watchdog thread can run.
    fn register(&mut self, deadline: u64, waker: &Waker) -> bool {
        let watchdog = watchdog();
        let shard = thread_shard() % watchdog.shards.len();
        let entry = Entry {
            deadline,
            waker: waker.clone(),
        };
        let held = waker.clone();
        let mut table = watchdog.lock(shard);
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
        self.entry = Some((shard, index, held));
        watchdog.ensure_running()
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
        let mut replacement = Some(waker.clone());
        let mut table = watchdog().lock(*shard);
        let old = table
            .entries
            .get_mut(*index)
            .and_then(Option::as_mut)
            .and_then(|entry| {
                replacement
                    .take()
                    .map(|waker| std::mem::replace(&mut entry.waker, waker))
            });
        drop(table);
        // Wakers are dropped outside the lock (a drop may run a task's code).
        drop(old);
        drop(replacement);
    }

    /// Arms the entry again for `deadline` if it was woken early (when the watchdog thread
    /// could not be started).
    fn rearm(&mut self, deadline: u64) {
        let Some((shard, index, _)) = &self.entry else {
            return;
        };
        let mut table = watchdog().lock(*shard);
        let mut rearmed = false;
        if let Some(Some(entry)) = table.entries.get_mut(*index) {
            if entry.deadline == u64::MAX {
                entry.deadline = deadline;
                rearmed = true;
            }
        }
        if rearmed {
            table.fired -= 1;
        }
    }

    /// Gives the entry back.
    fn release(&mut self) {
        let Some((shard, index, _)) = self.entry.take() else {
            return;
        };
        let mut table = watchdog().lock(shard);
        let taken = table.entries.get_mut(index).and_then(Option::take);
        if let Some(entry) = &taken {
            table.used -= 1;
            if entry.deadline == u64::MAX {
                table.fired -= 1;
            }
            table.free.push(index);
            if table.used == 0 {
                // After a burst, the thread's scan walks only what is in use.
                table.entries.clear();
                table.free.clear();
            }
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
        fallback: None,
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
        // The runtime's timer, only when no watchdog thread could be started.
        fallback: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
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
            if this.registration.register(until, context.waker()) {
                return Poll::Pending;
            }
        } else {
            // The waker first, the clock second: a watchdog pass that fires the entry between
            // the two found the clock past `until` already, so this read does too.
            this.registration.rewake(context.waker());
            if watchdog.clock() >= until {
                this.registration.release();
                return Poll::Ready(Err(Elapsed));
            }
            if this.fallback.is_none() {
                if watchdog.spawn_failures.load(Ordering::Relaxed) != 0 {
                    this.registration.rearm(until);
                }
                if watchdog.running.load(Ordering::SeqCst) || watchdog.ensure_running() {
                    return Poll::Pending;
                }
            }
        }
        // No watchdog thread (none could be started): the runtime's timer (on a runtime built
        // without timers this panics, as `tokio::time::timeout` did).
        if this.fallback.is_none() {
            let left = Duration::from_nanos(until.saturating_sub(watchdog.clock()));
            if tokio::runtime::Handle::try_current().is_ok() {
                *this.fallback = Some(Box::pin(tokio::time::sleep(left)));
            }
        }
        if let Some(sleep) = this.fallback.as_mut() {
            if sleep.as_mut().poll(context).is_ready() {
                this.registration.release();
                return Poll::Ready(Err(Elapsed));
            }
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

    /// Runs an operation that never ends under `deadline` on a new current-thread runtime:
    /// its outcome and how long it took.
    fn never_ending_on_a_new_runtime(deadline: Duration) -> (Result<(), Elapsed>, Duration) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let started = Instant::now();
        let outcome = runtime.block_on(timeout(deadline, std::future::pending::<()>()));
        (outcome, started.elapsed())
    }

    /// Keeps the watchdog thread ticking: one operation waiting for `span`.
    fn keep_ticking(span: Duration) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let (outcome, _) = never_ending_on_a_new_runtime(span);
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
        // Aborted operations give theirs back too: each is aborted once its first poll (which
        // registers it) has begun.
        for _ in 0..16 {
            let (started, begun) = tokio::sync::oneshot::channel();
            let task = tokio::spawn(timeout(Duration::from_secs(60), async move {
                let _ = started.send(());
                std::future::pending::<()>().await;
            }));
            begun.await.expect("the operation began");
            task.abort();
            assert!(task.await.expect_err("aborted").is_cancelled());
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
            // An empty shard keeps no entries for the thread to walk (other tests may be
            // waiting again by now: only shards with nothing in use are checked).
            let table = watchdog.lock(shard);
            assert!(table.used > 0 || table.entries.is_empty());
        }
    }

    /// A waker that counts its wakes, and panics on them if asked to.
    struct Counting {
        wakes: std::sync::atomic::AtomicUsize,
        panics: bool,
    }

    impl std::task::Wake for Counting {
        fn wake(self: std::sync::Arc<Self>) {
            self.wake_by_ref();
        }

        fn wake_by_ref(self: &std::sync::Arc<Self>) {
            self.wakes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            assert!(!self.panics, "a waker that panics");
        }
    }

    /// Polls an operation that never ends once with a counting waker, then waits `span`.
    fn woken_after(span: Duration, panics: bool) -> usize {
        let counting = std::sync::Arc::new(Counting {
            wakes: std::sync::atomic::AtomicUsize::new(0),
            panics,
        });
        let waker = std::task::Waker::from(counting.clone());
        let mut context = std::task::Context::from_waker(&waker);
        let mut future = Box::pin(timeout(
            Duration::from_millis(20),
            std::future::pending::<()>(),
        ));
        assert!(future.as_mut().poll(&mut context).is_pending());
        std::thread::sleep(span);
        counting.wakes.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[test]
    fn a_passed_deadline_wakes_its_operation_once() {
        // The entry stays (the future is alive and not polled again), and is woken only once.
        assert_eq!(woken_after(Duration::from_millis(150), false), 1);
    }

    #[test]
    fn a_waker_that_panics_does_not_stop_the_deadlines_of_others() {
        assert_eq!(woken_after(Duration::from_millis(100), true), 1);
        let (outcome, took) = never_ending_on_a_new_runtime(Duration::from_millis(30));
        assert_eq!(outcome, Err(Elapsed));
        assert!(took < Duration::from_secs(2));
    }

    #[test]
    fn the_thread_ends_when_idle_and_starts_again_for_the_next_wait() {
        let watchdog = watchdog();
        // Other tests of this binary wait too: give them time to end.
        let started = Instant::now();
        while watchdog.running.load(std::sync::atomic::Ordering::SeqCst) {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the thread never ended"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let (outcome, _) = never_ending_on_a_new_runtime(Duration::from_millis(30));
        assert_eq!(outcome, Err(Elapsed));
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
    fn operations_time_out_after_a_runtime_with_a_waiting_operation_was_shut_down() {
        // A current-thread runtime's operation registers and is left waiting, then that
        // runtime is dropped; operations on two new runtimes, one after the other, still time
        // out.
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
            let (outcome, took) = never_ending_on_a_new_runtime(Duration::from_millis(50));
            assert_eq!(outcome, Err(Elapsed));
            assert!(took < Duration::from_secs(2));
        }
    }
}
