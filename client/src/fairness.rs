//! Fairness between the tasks of one runtime worker.
//!
//! Over a provider that runs requests on the posting thread (`shm` when its executor is free,
//! `loopback`), an operation can complete without ever returning `Pending`: a task that does
//! nothing but operations would then run until tokio's cooperative budget stops it, dozens of
//! operations at a time, while the other tasks of its worker wait (a READ p99 of 6.7 ms in
//! YCSB-C over `shm`, `docs/benchmarks.md`). An operation that never waited therefore yields
//! once before it returns: one trip through the scheduler per operation, where a yield per
//! posted list cost two.

use std::cell::Cell;
use std::future::Future;

/// Operations done by direct access (`connection/direct_get.rs`: no list, no completion, no
/// scheduler trip) that a worker thread runs between two yields. A yield per operation cost
/// about a third of a direct GET's instructions; a yield every [`DIRECT_RUN`] keeps the other
/// tasks' wait to that many operations of each task ahead of them (a few microseconds each),
/// where tokio's cooperative budget alone let a task run 128.
pub(crate) const DIRECT_RUN: u32 = 8;

thread_local! {
    /// Direct operations this worker ran since its last yield for them.
    static DIRECT_SINCE_YIELD: Cell<u32> = const { Cell::new(0) };
}

/// Called after each operation done by direct access: yields once every [`DIRECT_RUN`] of
/// them on this thread (whichever tasks ran them), so tasks that only do such operations take
/// turns.
pub(crate) async fn after_direct_operation() {
    let due = DIRECT_SINCE_YIELD.with(|count| {
        let next = count.get() + 1;
        let due = next >= DIRECT_RUN;
        count.set(if due { 0 } else { next });
        due
    });
    if due {
        tokio::task::yield_now().await;
    }
}

/// Runs `work`; when it completed without ever waiting, yields once to the runtime before
/// returning its output.
pub(crate) async fn yield_if_never_waited<F: Future>(work: F) -> F::Output {
    let mut work = std::pin::pin!(work);
    let mut waited = false;
    let output = std::future::poll_fn(|context| {
        let poll = work.as_mut().poll(context);
        if poll.is_pending() {
            waited = true;
        }
        poll
    })
    .await;
    if !waited {
        tokio::task::yield_now().await;
    }
    output
}

#[cfg(test)]
mod tests {
    use super::yield_if_never_waited;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[tokio::test(flavor = "current_thread")]
    async fn an_operation_that_never_waited_lets_another_task_run_before_it_returns() {
        let other_ran = Arc::new(AtomicBool::new(false));
        let flag = other_ran.clone();
        let other = tokio::spawn(async move { flag.store(true, Ordering::Release) });
        // Ready at once: without the yield, the spawned task could not have run yet.
        let output = yield_if_never_waited(async { 7 }).await;
        assert_eq!(output, 7);
        assert!(
            other_ran.load(Ordering::Acquire),
            "the other task did not run"
        );
        other.await.expect("the other task");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_operation_that_waited_returns_without_another_yield() {
        let other_ran = Arc::new(AtomicBool::new(false));
        let output = yield_if_never_waited(async {
            tokio::task::yield_now().await;
            // The yield above let nothing else run yet: spawn only now.
            let flag = other_ran.clone();
            tokio::spawn(async move { flag.store(true, Ordering::Release) });
            8
        })
        .await;
        assert_eq!(output, 8);
        // It waited once, so it returns at once: the task spawned during it has not run.
        assert!(
            !other_ran.load(Ordering::Acquire),
            "an extra yield let it run"
        );
    }
}
