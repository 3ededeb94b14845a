//! The verbs completion queue: a basic CQ (`ibv_create_cq`) polled with `ibv_poll_cq`, and a
//! completion channel whose fd a tokio task awaits with `AsyncFd`.
//!
//! The task's loop: arm (`ibv_req_notify_cq`), drain (`ibv_poll_cq` until empty), await the fd,
//! take and acknowledge every event (`ibv_get_cq_event`, `ibv_ack_cq_events`), repeat. Arming
//! before draining means a completion that lands between the two still raises an event.
//! Polling and dispatch run under one lock, so a queue pair sees its completions in CQ order
//! even when a synchronous drain polls alongside the task.

use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::null_mut;
use std::sync::{Arc, Mutex, Weak};

use dashmap::DashMap;
use rdma_mummy_sys::{
    ibv_ack_cq_events, ibv_cq, ibv_get_cq_event, ibv_poll_cq, ibv_req_notify_cq, ibv_wc,
};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, CompletionChannel, CompletionQueue as SidewayQueueTrait,
};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::Notify;

use crate::error::{Error, Result};
use crate::lock;
use crate::provider::verbs::context::VerbsContext;
use crate::provider::verbs::provider::deliver;
use crate::provider::verbs::status::status_from_raw;
use crate::queue_pair::QueuePairShared;

/// Completions taken per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

/// The completion channel's fd, for `AsyncFd`; holds the channel alive by `Arc` (never by
/// cloning the channel itself, whose `Drop` destroys it).
struct ChannelFd(Arc<CompletionChannel>);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// The part the polling task and the queue pairs share.
pub(crate) struct VerbsCompletionShared {
    /// The CQ; holds the channel and the device context alive.
    pub(crate) queue: Arc<BasicCompletionQueue>,
    /// The completion channel.
    channel: Arc<CompletionChannel>,
    /// Queue pairs whose completions land here, by QP number.
    queue_pairs: DashMap<u32, Weak<QueuePairShared>>,
    /// Serialises poll-and-dispatch.
    poll_lock: Mutex<()>,
    /// Wakes the task to stop.
    shutdown: Notify,
}

impl std::fmt::Debug for VerbsCompletionShared {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("VerbsCompletionShared")
            .field("queue_pairs", &self.queue_pairs.len())
            .finish_non_exhaustive()
    }
}

/// A verbs CQ with its polling task; stopping the task is tied to this handle's drop.
#[derive(Debug)]
pub(crate) struct VerbsCompletionQueue {
    pub(crate) shared: Arc<VerbsCompletionShared>,
}

impl VerbsCompletionQueue {
    /// Creates the channel, the CQ with `capacity` entries, and the polling task on the current
    /// tokio runtime.
    ///
    /// # Errors
    /// [`Error::VerbsCall`] when a verbs object cannot be created or no tokio runtime runs.
    pub(crate) fn create(
        context: &VerbsContext,
        capacity: usize,
        poll_spin: std::time::Duration,
    ) -> Result<Self> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|error| Error::VerbsCall {
            operation: "create a completion queue (it needs a tokio runtime for its poller)",
            qp_number: None,
            source: std::io::Error::other(error),
        })?;
        let call_failed = |operation: &'static str, message: String| Error::VerbsCall {
            operation,
            qp_number: None,
            source: std::io::Error::other(message),
        };
        let channel = context
            .context
            .create_comp_channel()
            .map_err(|error| call_failed("ibv_create_comp_channel", error.to_string()))?;
        channel
            .set_nonblocking(true)
            .map_err(|source| Error::VerbsCall {
                operation: "make the completion channel non-blocking",
                qp_number: None,
                source,
            })?;
        let queue = context
            .context
            .create_cq_builder()
            .setup_cqe(capacity.clamp(16, 65_536) as u32)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|error| call_failed("ibv_create_cq", error.to_string()))?;
        let shared = Arc::new(VerbsCompletionShared {
            queue,
            channel,
            queue_pairs: DashMap::new(),
            poll_lock: Mutex::new(()),
            shutdown: Notify::new(),
        });
        runtime.spawn(run_poller(shared.clone(), poll_spin));
        Ok(Self { shared })
    }
}

impl Drop for VerbsCompletionQueue {
    fn drop(&mut self) {
        // notify_one stores a permit, so the task stops even if it is not waiting right now.
        self.shared.shutdown.notify_one();
    }
}

impl VerbsCompletionShared {
    /// Routes this queue pair's completions to it.
    pub(crate) fn attach(&self, qp_number: u32, queue_pair: Weak<QueuePairShared>) {
        self.queue_pairs.insert(qp_number, queue_pair);
    }

    /// Stops routing completions to a destroyed queue pair.
    pub(crate) fn detach(&self, qp_number: u32) {
        self.queue_pairs.remove(&qp_number);
    }

    fn raw_queue(&self) -> *mut ibv_cq {
        // SAFETY: the pointer is only used while `self.queue` (an `Arc` field) keeps the CQ
        // alive.
        unsafe { self.queue.cq().as_ptr() }
    }

    /// Polls until the CQ is empty and hands every completion to its queue pair. Returns how
    /// many completions were taken.
    pub(crate) fn poll_and_dispatch(&self) -> usize {
        let _serialised = lock(&self.poll_lock);
        poll_completions(&self.queue, |completion| self.dispatch(completion))
    }

    fn dispatch(&self, completion: &ibv_wc) {
        let status = status_from_raw(completion.status);
        let queue_pair = self
            .queue_pairs
            .get(&completion.qp_num)
            .and_then(|entry| entry.upgrade());
        match queue_pair {
            Some(queue_pair) => deliver(&queue_pair, completion.wr_id, status),
            None => tracing::debug!(
                qp_number = completion.qp_num,
                work_request_id = completion.wr_id,
                %status,
                "completion for a destroyed queue pair"
            ),
        }
    }

    /// Arms the CQ for the next completion event.
    fn arm(&self) {
        // SAFETY: the CQ is alive (see `raw_queue`).
        let result = unsafe { ibv_req_notify_cq(self.raw_queue(), 0) };
        if result != 0 {
            tracing::error!(
                error = %std::io::Error::from_raw_os_error(result),
                "ibv_req_notify_cq failed; completions are found by synchronous polls only"
            );
        }
    }

    /// Takes and acknowledges every pending event; false when none was pending.
    fn take_events(&self) -> bool {
        let mut any = false;
        loop {
            let mut queue: *mut ibv_cq = null_mut();
            let mut context = null_mut();
            // SAFETY: the channel is alive (an `Arc` field) and non-blocking; the out-pointers
            // point at locals.
            let result = unsafe {
                ibv_get_cq_event(
                    self.channel.comp_channel().as_ptr(),
                    &mut queue,
                    &mut context,
                )
            };
            if result != 0 || queue.is_null() {
                return any;
            }
            // SAFETY: `queue` is the CQ the event came from, ours and alive; each event taken is
            // acknowledged exactly once, so destroying the CQ later does not block.
            unsafe { ibv_ack_cq_events(queue, 1) };
            any = true;
        }
    }
}

/// Takes completions with `ibv_poll_cq` until the CQ is empty, handing each to `visit`; returns
/// how many were taken. Callers serialise calls on one CQ when order matters.
pub(crate) fn poll_completions(
    queue: &BasicCompletionQueue,
    mut visit: impl FnMut(&ibv_wc),
) -> usize {
    // SAFETY: the pointer is used only inside this call, while `queue` borrows the live CQ.
    let raw = unsafe { queue.cq().as_ptr() };
    let mut taken = 0;
    loop {
        let mut completions = [MaybeUninit::<ibv_wc>::uninit(); POLL_BATCH];
        // SAFETY: the CQ is alive (borrowed); the array has room for POLL_BATCH entries, and
        // `ibv_poll_cq` writes at most that many.
        let count = unsafe {
            ibv_poll_cq(
                raw,
                POLL_BATCH as i32,
                completions.as_mut_ptr().cast::<ibv_wc>(),
            )
        };
        if count < 0 {
            tracing::error!(result = count, "ibv_poll_cq failed");
            return taken;
        }
        let count = count as usize;
        for completion in &completions[..count] {
            // SAFETY: `ibv_poll_cq` initialised the first `count` entries.
            visit(unsafe { completion.assume_init_ref() });
        }
        taken += count;
        if count < POLL_BATCH {
            return taken;
        }
    }
}

/// The polling task: (busy-poll while completions keep coming, up to `poll_spin` after the last
/// one, yielding between polls), arm, drain, wait for an event, repeat, until the CQ handle is
/// dropped.
async fn run_poller(shared: Arc<VerbsCompletionShared>, poll_spin: std::time::Duration) {
    // SAFETY: the fd belongs to the completion channel that `ChannelFd` holds by `Arc`; the
    // channel is destroyed only after the last `Arc` goes, so the fd stays open and the same
    // for the whole life of the `AsyncFd`, which owns that `ChannelFd`.
    let registered = unsafe {
        AsyncFd::register_with_interest(ChannelFd(shared.channel.clone()), Interest::READABLE)
    };
    let descriptor = match registered {
        Ok(descriptor) => descriptor,
        Err(error) => {
            tracing::error!(%error, "cannot watch the completion channel; completions are found by synchronous polls only");
            return;
        }
    };
    loop {
        if !poll_spin.is_zero() {
            let mut last = std::time::Instant::now();
            while last.elapsed() < poll_spin {
                tokio::task::yield_now().await;
                if shared.poll_and_dispatch() > 0 {
                    last = std::time::Instant::now();
                }
            }
        }
        shared.arm();
        shared.poll_and_dispatch();
        tokio::select! {
            _ = shared.shutdown.notified() => return,
            ready = descriptor.readable() => match ready {
                Ok(mut guard) => {
                    if !shared.take_events() {
                        guard.clear_ready();
                    }
                }
                Err(error) => {
                    tracing::error!(%error, "completion channel failed");
                    return;
                }
            },
        }
    }
}
