//! Completion queues and the per-list completion hand-off.
//!
//! A [`CompletionQueue`] counts every completion its queue pairs generate. Completions are
//! handed to the future that posted their list ([`PostedList`]); when that future was dropped,
//! they land in the queue's bounded backlog, where [`CompletionQueue::poll`] finds them, as a
//! verbs CQ would hold them.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use crate::device::DeviceInner;
use crate::lock;
use crate::seam::ProviderObject;
use crate::types::WorkCompletion;

/// The shared part of a completion queue.
#[derive(Debug)]
pub(crate) struct CompletionQueueInner {
    /// The device, kept alive by the queue.
    _device: Arc<DeviceInner>,
    /// Completions generated so far.
    generated: AtomicU64,
    /// Completions whose posting future was dropped, oldest first.
    backlog: Mutex<VecDeque<WorkCompletion>>,
    /// The backlog's bound.
    capacity: usize,
    /// Completions dropped because the backlog was full (a verbs CQ overrun).
    overruns: AtomicU64,
    /// The NIC's CQ (and its poller), when the provider's NIC has one.
    #[allow(
        dead_code,
        reason = "the seam for NIC providers (verbs); a build without one has no caller"
    )]
    pub(crate) provider: Option<ProviderObject>,
    /// Entries promised to the send queues of the queue pairs on this CQ.
    committed: Mutex<usize>,
    /// List completions whose list completed and whose [`PostedList`] was dropped, for the
    /// next lists posted on this CQ (one allocation per list saved; at most
    /// [`SPARE_LIST_COMPLETIONS`]).
    spare_lists: Mutex<Vec<Arc<ListCompletion>>>,
}

/// The most list completions a completion queue keeps for reuse: as many lists as a client's
/// tasks keep in flight on one lane, commonly.
const SPARE_LIST_COMPLETIONS: usize = 64;

impl CompletionQueueInner {
    /// Promises `depth` entries to a new queue pair, or refuses when the CQ could overrun (on a
    /// NIC an overrun breaks every queue pair on the CQ; every backend enforces it alike).
    pub(crate) fn commit(&self, depth: u32) -> crate::Result<()> {
        let mut committed = lock(&self.committed);
        if *committed + depth as usize > self.capacity {
            return Err(crate::Error::CompletionQueueFull {
                capacity: self.capacity,
                committed: *committed,
                requested: depth,
            });
        }
        *committed += depth as usize;
        Ok(())
    }

    /// Returns a destroyed queue pair's entries.
    pub(crate) fn release(&self, depth: u32) {
        let mut committed = lock(&self.committed);
        *committed = committed.saturating_sub(depth as usize);
    }
}

impl CompletionQueueInner {
    /// Records completions that nobody awaits any more.
    pub(crate) fn push_unclaimed(&self, completions: impl IntoIterator<Item = WorkCompletion>) {
        let mut backlog = lock(&self.backlog);
        for completion in completions {
            if backlog.len() >= self.capacity {
                backlog.pop_front();
                self.overruns.fetch_add(1, Ordering::Relaxed);
            }
            backlog.push_back(completion);
        }
    }

    /// Counts one generated completion.
    pub(crate) fn count(&self) {
        self.count_many(1);
    }

    /// Counts `completions` generated completions.
    pub(crate) fn count_many(&self, completions: u64) {
        self.generated.fetch_add(completions, Ordering::Relaxed);
    }
}

/// A completion queue.
#[derive(Debug, Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CompletionQueueInner>,
}

impl CompletionQueue {
    pub(crate) fn new(device: Arc<DeviceInner>, capacity: usize) -> crate::Result<Self> {
        let provider = device
            .provider
            .create_completion_queue(capacity, &device.config)?;
        Ok(Self {
            inner: Arc::new(CompletionQueueInner {
                _device: device,
                generated: AtomicU64::new(0),
                backlog: Mutex::new(VecDeque::new()),
                capacity: capacity.max(1),
                overruns: AtomicU64::new(0),
                provider,
                committed: Mutex::new(0),
                spare_lists: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Completions generated so far by the queue pairs on this queue.
    pub fn completions_generated(&self) -> u64 {
        self.inner.generated.load(Ordering::Relaxed)
    }

    /// Takes up to `max` completions whose posting future was dropped.
    pub fn poll(&self, max: usize) -> Vec<WorkCompletion> {
        let mut backlog = lock(&self.inner.backlog);
        let take = max.min(backlog.len());
        backlog.drain(..take).collect()
    }

    /// Completions lost because the backlog was full.
    pub fn overruns(&self) -> u64 {
        self.inner.overruns.load(Ordering::Relaxed)
    }
}

/// The completions a posted list resolves with. Usually one (only signaled requests and failed
/// or flushed ones produce completions, and a list signals its tail): room for two inline, so
/// gathering them allocates nothing.
pub type Completions = smallvec::SmallVec<[WorkCompletion; 2]>;

/// The completions of one posted list, gathered until its last request completes, shared by
/// the list's in-flight requests and its [`PostedList`]: one allocation and one lock per list
/// (a oneshot channel beside it was two more allocations and a second lock).
#[derive(Debug)]
pub(crate) struct ListCompletion {
    /// The list's state.
    state: Mutex<ListState>,
}

/// What a [`ListCompletion`] holds.
#[derive(Debug, Default)]
struct ListState {
    /// Completions so far.
    completions: Completions,
    /// The tail completed: `completions` is the whole list's.
    complete: bool,
    /// The [`PostedList`] was dropped: the completions go to the queue's backlog.
    abandoned: bool,
    /// The task awaiting the [`PostedList`].
    waker: Option<Waker>,
}

impl ListCompletion {
    /// The completion of a list: a record this queue kept from a completed list, or a new one
    /// (room for two completions inline: one for an ordinary list, which signals its tail).
    pub(crate) fn new(queue: Arc<CompletionQueueInner>) -> (Arc<Self>, PostedList) {
        let spare = lock(&queue.spare_lists).pop();
        let list = match spare {
            // Reset when it was put back: nothing else holds it.
            Some(list) => list,
            None => Arc::new(Self {
                state: Mutex::new(ListState::default()),
            }),
        };
        (list.clone(), PostedList { list, queue })
    }

    fn state(&self) -> MutexGuard<'_, ListState> {
        lock(&self.state)
    }

    /// Adds one completion; when it is the list's tail, hands the list to its future, or to the
    /// queue's backlog when the future is gone.
    pub(crate) fn add(
        &self,
        completion: WorkCompletion,
        is_tail: bool,
        queue: &CompletionQueueInner,
    ) {
        let mut state = self.state();
        if state.abandoned {
            queue.push_unclaimed([completion]);
            return;
        }
        state.completions.push(completion);
        if !is_tail {
            return;
        }
        state.complete = true;
        let waker = state.waker.take();
        drop(state);
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// The future of a posted list: resolves, with the list's completions, when its last request
/// completes. Only signaled requests and failed or flushed ones produce completions.
///
/// Dropping it is safe at any time: the buffers its requests use stay referenced until their
/// completions are polled by the NIC side, and the completions go to the completion queue —
/// also when the list had completed but its future was never awaited.
#[derive(Debug)]
pub struct PostedList {
    /// The list's completions, shared with its requests in flight.
    list: Arc<ListCompletion>,
    /// Where completions that nobody awaited go.
    queue: Arc<CompletionQueueInner>,
}

impl Drop for PostedList {
    fn drop(&mut self) {
        // Refuse completions from now on (they go to the backlog instead), and move those that
        // arrived but were never awaited there too.
        // Under the list's lock, so a completion arriving meanwhile lands in the backlog after
        // these, in order (the backlog's lock is never held while taking a list's).
        let mut state = self.list.state();
        state.abandoned = true;
        state.waker = None;
        let unclaimed = std::mem::take(&mut state.completions);
        if !unclaimed.is_empty() {
            self.queue.push_unclaimed(unclaimed);
        }
        let complete = state.complete;
        drop(state);
        // Kept for the next list when its requests are all done (none holds it any more, and
        // nothing can clone it again: only this future and the requests ever held it).
        if complete {
            if let Some(list) = Arc::get_mut(&mut self.list) {
                *list
                    .state
                    .get_mut()
                    .unwrap_or_else(|poisoned| poisoned.into_inner()) = ListState::default();
                let mut spare = lock(&self.queue.spare_lists);
                if spare.len() < SPARE_LIST_COMPLETIONS {
                    spare.push(self.list.clone());
                }
            }
        }
    }
}

impl Future for PostedList {
    type Output = Completions;

    fn poll(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.list.state();
        if state.complete {
            // Taken once: polled again after it resolved, it resolves with no completions.
            return Poll::Ready(std::mem::take(&mut state.completions));
        }
        match &mut state.waker {
            Some(waker) if waker.will_wake(context.waker()) => {}
            slot => *slot = Some(context.waker().clone()),
        }
        Poll::Pending
    }
}
