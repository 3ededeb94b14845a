//! A queue pair's free send-queue slots: a counter that a post takes slots from and a
//! completion gives them back to.
//!
//! Every completion gives a slot back, three or more per operation, so giving back must be
//! cheap: one atomic add, and a wake-up only while some post waits. (tokio's `Semaphore` takes
//! its waiter list's mutex on every release, waiting or not: a tenth of a completion's
//! instructions.) A post that finds too few slots waits for the next give-back and tries again;
//! the send queue is rarely full (an operation's list is a few requests, the queue hundreds), so
//! waiters are not queued in order: while the queue stays full, a post of several requests can
//! wait behind a stream of single ones (tokio's semaphore served them first come, first served).

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// Free send-queue slots.
#[derive(Debug)]
pub(crate) struct SendSlots {
    /// Slots free now.
    free: AtomicUsize,
    /// Posts waiting for slots.
    waiting: AtomicUsize,
    /// Wakes the waiting posts.
    given_back: Notify,
}

impl SendSlots {
    /// `count` free slots.
    pub(crate) fn new(count: usize) -> Self {
        Self {
            free: AtomicUsize::new(count),
            waiting: AtomicUsize::new(0),
            given_back: Notify::new(),
        }
    }

    /// Slots free now.
    pub(crate) fn available(&self) -> usize {
        self.free.load(Ordering::Acquire)
    }

    /// Takes `count` slots if that many are free. Sequentially consistent with
    /// [`SendSlots::give_back`], so a waiter's second look and a give-back's look at the
    /// waiters cannot both miss each other.
    pub(crate) fn try_take(&self, count: usize) -> bool {
        let mut free = self.free.load(Ordering::SeqCst);
        loop {
            if free < count {
                return false;
            }
            match self.free.compare_exchange_weak(
                free,
                free - count,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return true,
                Err(now) => free = now,
            }
        }
    }

    /// Takes `count` slots, waiting until that many are free. `count` must not exceed the
    /// queue's depth (the caller checks), or this waits for ever.
    pub(crate) async fn take(&self, count: usize) {
        loop {
            if self.try_take(count) {
                return;
            }
            // Registered before the count of waiters rises and the slots are looked at again:
            // a give-back after that look sees the waiter and wakes this future, one before it
            // left slots this look finds.
            let notified = self.given_back.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Counted out again when this wait ends, also when the post is cancelled here (a
            // deadline): a count left behind would make every later give-back take Notify's
            // lock.
            let _waiting = Waiting::start(&self.waiting);
            if self.try_take(count) {
                return;
            }
            notified.await;
        }
    }

    /// Takes one slot if one is free, until the returned guard is dropped.
    #[allow(
        dead_code,
        reason = "the seam for NIC providers (verbs: a window bind); a build without one has no caller"
    )]
    pub(crate) fn try_hold(&self) -> Option<HeldSlot<'_>> {
        // Not `then_some`: a guard built for a refused take would give back a slot never taken.
        if self.try_take(1) {
            Some(HeldSlot { slots: self })
        } else {
            None
        }
    }

    /// Gives `count` slots back, waking the waiting posts if there are any.
    pub(crate) fn give_back(&self, count: usize) {
        self.free.fetch_add(count, Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.given_back.notify_waiters();
        }
    }
}

/// One post counted among the waiting ones, until dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn start(waiting: &'a AtomicUsize) -> Self {
        waiting.fetch_add(1, Ordering::SeqCst);
        Self(waiting)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One slot taken by [`SendSlots::try_hold`], given back when dropped.
#[derive(Debug)]
pub(crate) struct HeldSlot<'a> {
    slots: &'a SendSlots,
}

impl Drop for HeldSlot<'_> {
    fn drop(&mut self) {
        self.slots.give_back(1);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::SendSlots;

    #[test]
    fn slots_are_taken_only_when_free_and_come_back() {
        let slots = SendSlots::new(4);
        assert!(slots.try_take(3));
        assert!(!slots.try_take(2));
        assert_eq!(slots.available(), 1);
        slots.give_back(3);
        assert!(slots.try_take(4));
        assert_eq!(slots.available(), 0);
        assert!(slots.try_hold().is_none());
        slots.give_back(1);
        let held = slots.try_hold().expect("one slot is free");
        assert_eq!(slots.available(), 0);
        drop(held);
        assert_eq!(slots.available(), 1);
    }

    /// A post cancelled while it waits (an operation's deadline) is no longer counted as
    /// waiting.
    #[tokio::test]
    async fn a_cancelled_wait_is_counted_out() {
        let slots = SendSlots::new(1);
        assert!(slots.try_take(1));
        let waited = tokio::time::timeout(Duration::from_millis(20), slots.take(1)).await;
        assert!(waited.is_err(), "no slot was free");
        assert_eq!(slots.waiting.load(std::sync::atomic::Ordering::SeqCst), 0);
        slots.give_back(1);
        slots.take(1).await;
    }

    /// Many posts waiting for slots on two workers, each giving its slots back after it got
    /// them: every one completes (no lost wake-up), and the count ends where it began.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiting_posts_all_get_their_slots() {
        let slots = Arc::new(SendSlots::new(3));
        let mut tasks = tokio::task::JoinSet::new();
        for task in 0..64usize {
            let slots = slots.clone();
            tasks.spawn(async move {
                for _ in 0..200 {
                    let count = 1 + task % 3;
                    slots.take(count).await;
                    tokio::task::yield_now().await;
                    slots.give_back(count);
                }
            });
        }
        let all = async {
            while let Some(joined) = tasks.join_next().await {
                joined.expect("task");
            }
        };
        tokio::time::timeout(Duration::from_secs(60), all)
            .await
            .expect("every waiting post got its slots");
        assert_eq!(slots.available(), 3);
    }
}
