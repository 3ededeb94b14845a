//! RC queue pairs: the state machine, posting with doorbell batching and a send-queue depth
//! bound, in-order completion, flush on error, and teardown. Provider-neutral: the transport is
//! the queue pair's [`QueuePairProvider`].
//!
//! The requester side keeps every posted request in an ordered in-flight queue until it
//! completes. The entry holds the local buffer's protection entry, and with it the pinned
//! memory, so a buffer stays alive until its completion is polled even if the future that
//! posted it is dropped. A signaled completion retires the unsignaled requests before it, as
//! on a real send queue. The first error moves the queue pair to ERROR; every outstanding and
//! later request then completes IBV_WC_WR_FLUSH_ERR.
//!
//! The responder side ([`QueuePairShared::respond`]) runs an emulated responder under a read
//! lock of the responder gate; [`QueuePair::drain`] takes the write lock once after the state
//! is ERROR, so when it returns no request is executing and none will start.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use crate::completion::{CompletionQueue, Completions, ListCompletion, PostedList};
use crate::device::DeviceInner;
use crate::direct::DirectAccess;
use crate::error::{Error, Result};
use crate::protection::{
    LocalTarget, MemoryRegion, MemoryWindow, ProtectionDomain, ProtectionTable,
};
use crate::seam::{QueuePairProvider, Submission};
use crate::send_slots::SendSlots;
use crate::types::{
    AccessFlags, QueuePairEndpoint, QueuePairState, RemoteKey, WorkCompletion,
    WorkCompletionStatus, WorkRequest,
};
use crate::{lock, read_lock, write_lock};

/// Settings of one queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueuePairConfig {
    /// The send queue depth: at most this many requests are outstanding at once; `post` waits
    /// for room.
    pub max_send_wr: u32,
}

/// The default send queue depth.
pub const DEFAULT_MAX_SEND_WR: u32 = 256;

impl Default for QueuePairConfig {
    fn default() -> Self {
        Self {
            max_send_wr: DEFAULT_MAX_SEND_WR,
        }
    }
}

/// How a list run inside its post ended ([`QueuePair::post_inline`]): every request
/// succeeded, or the first did not (the queue pair is then in ERROR, and the list's later
/// requests did not run).
pub type InlineOutcome = std::result::Result<(), InlineFailure>;

/// The first request of a list run inside its post that did not succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InlineFailure {
    /// Its position in the list.
    pub index: usize,
    /// Its completion.
    pub completion: WorkCompletion,
}

/// One posted request, from post until completion.
#[derive(Debug)]
pub(crate) struct InFlight {
    /// Position in the send queue.
    pub(crate) sequence: u64,
    /// The request as posted.
    pub(crate) request: WorkRequest,
    /// The resolved local buffer, or the local error it completes with.
    pub(crate) local: std::result::Result<Option<LocalTarget>, WorkCompletionStatus>,
    /// The list it belongs to.
    list: Arc<ListCompletion>,
    /// Whether it is the list's last request.
    is_tail: bool,
    /// When it was posted, for the retry timeout.
    posted_at: Instant,
}

/// The requester's mutable state.
#[derive(Debug)]
pub(crate) struct RequesterState {
    /// The queue pair state.
    pub(crate) state: QueuePairState,
    /// The next sequence number.
    next_sequence: u64,
    /// Outstanding requests, oldest first.
    pub(crate) in_flight: VecDeque<InFlight>,
    /// A request that failed its local check is queued: later requests are not sent.
    poisoned: bool,
    /// How many entries at the tail of `in_flight` wait for a doorbell that has not rung yet
    /// (queued by [`Enqueuer::push_for_doorbell`], not yet handed to the transport).
    pub(crate) unposted: usize,
    /// The responder said it stopped ([`QueuePairShared::responder_stopped`]): no request
    /// posted from then on runs, so each completes `NotExecuted`, not flushed.
    peer_stopped: bool,
}

impl RequesterState {
    /// Takes the entries that were queued for the doorbell but not handed to the transport.
    pub(crate) fn take_unposted(&mut self) -> Vec<InFlight> {
        let first = self.in_flight.len() - self.unposted;
        self.unposted = 0;
        self.in_flight.drain(first..).collect()
    }
}

/// The shared part of a queue pair, referenced by its handle, its device's table, and its
/// provider's threads, tasks and peers.
#[derive(Debug)]
pub(crate) struct QueuePairShared {
    /// The domain, kept alive by the queue pair.
    pub(crate) protection_domain: ProtectionDomain,
    /// The completion queue, kept alive by the queue pair.
    completion_queue: CompletionQueue,
    /// The queue pair number.
    pub(crate) qp_number: u32,
    /// Settings.
    config: QueuePairConfig,
    /// Requester state.
    pub(crate) requester: Mutex<RequesterState>,
    /// The state, readable without the requester lock.
    state_mirror: AtomicU8,
    /// Free send queue slots.
    pub(crate) permits: SendSlots,
    /// Held shared while an emulated responder executes a request for this queue pair.
    responder_gate: RwLock<()>,
    /// Set once [`QueuePairShared::drain`] has returned: nothing of this queue pair executes,
    /// and none will (it stays in ERROR). A drop then needs no drain of its own.
    drained: AtomicBool,
    /// The transport.
    pub(crate) provider: Box<dyn QueuePairProvider>,
}

impl QueuePairShared {
    /// The device.
    pub(crate) fn device(&self) -> &DeviceInner {
        &self.protection_domain.inner.device
    }

    /// The current state.
    pub(crate) fn state(&self) -> QueuePairState {
        QueuePairState::ALL[usize::from(self.state_mirror.load(Ordering::Acquire))]
    }

    /// The device's retry timeout.
    pub(crate) fn retry_timeout(&self) -> Duration {
        self.device().config.retry_timeout
    }

    /// The device's maximum message size.
    pub(crate) fn max_message_size(&self) -> u32 {
        self.device().config.max_message_size
    }

    /// Sets the state with the requester lock held.
    pub(crate) fn set_state_locked(&self, requester: &mut RequesterState, state: QueuePairState) {
        if requester.state == state {
            return;
        }
        self.device()
            .gauges
            .move_queue_pair(Some(requester.state), Some(state));
        requester.state = state;
        self.state_mirror.store(state as u8, Ordering::Release);
    }

    /// Records that the NIC moved the queue pair to ERROR (its flush completions follow).
    pub(crate) fn mark_error(&self) {
        let mut requester = lock(&self.requester);
        self.set_state_locked(&mut requester, QueuePairState::Error);
    }

    fn transition(
        &self,
        from: &[QueuePairState],
        to: QueuePairState,
        operation: &'static str,
    ) -> Result<()> {
        let mut requester = lock(&self.requester);
        if !from.contains(&requester.state) {
            return Err(Error::InvalidQueuePairState {
                qp_number: self.qp_number,
                state: requester.state,
                operation,
            });
        }
        self.set_state_locked(&mut requester, to);
        Ok(())
    }

    /// Runs an emulated responder's `execute` for one incoming request under the responder
    /// gate, with the device's protection table, this queue pair's domain id and its number.
    /// `None` means the request is not answered (the queue pair cannot receive), as a real
    /// responder drops it.
    pub(crate) fn respond<R>(
        &self,
        execute: impl FnOnce(&ProtectionTable, u32, u32) -> R,
    ) -> Option<R> {
        let _gate = read_lock(&self.responder_gate);
        if !matches!(
            self.state(),
            QueuePairState::ReadyToReceive | QueuePairState::ReadyToSend
        ) {
            return None;
        }
        Some(execute(
            &self.device().table,
            self.protection_domain.inner.id,
            self.qp_number,
        ))
    }

    /// Starts queuing the entries of one post: sequence numbers, in order, under the requester
    /// lock.
    pub(crate) fn enqueuer(&self) -> Enqueuer<'_> {
        let requester = lock(&self.requester);
        Enqueuer {
            sendable: requester.state == QueuePairState::ReadyToSend,
            requester,
        }
    }

    /// Completes the oldest outstanding request with a responder's answer. Answers for requests
    /// that were already flushed are ignored.
    pub(crate) fn on_response(&self, sequence: u64, status: WorkCompletionStatus, payload: &[u8]) {
        self.answer(sequence, status, Some(payload));
    }

    /// As [`QueuePairShared::on_response`] for a responder that placed a READ's data in the
    /// local buffer itself (the `shm` requester copies from the responder's memory straight
    /// into it).
    pub(crate) fn on_response_placed(&self, sequence: u64, status: WorkCompletionStatus) {
        self.answer(sequence, status, None);
    }

    /// Completes the oldest outstanding request; `payload`: the data to write into its local
    /// buffer, `None` when it is there already. The lock that takes the answered request also
    /// looks whether a local failure waits behind it (no second lock to settle none).
    fn answer(&self, sequence: u64, status: WorkCompletionStatus, payload: Option<&[u8]>) {
        let (entry, failure_behind) = loop {
            let mut requester = lock(&self.requester);
            let implied = match requester.in_flight.front() {
                Some(front) if front.sequence == sequence && front.local.is_ok() => false,
                // An answer acknowledges the WRITEs sent before the request it answers, as an
                // RC responder's coalesced ACK does (the soft responder answers a WRITE only
                // when no later request of its batch is answered).
                Some(front)
                    if front.sequence < sequence
                        && front.local.is_ok()
                        && !front.request.opcode.writes_local_buffer() =>
                {
                    true
                }
                _ => return,
            };
            let Some(entry) = requester.in_flight.pop_front() else {
                return;
            };
            if !implied {
                let failure_behind = requester
                    .in_flight
                    .front()
                    .is_some_and(|next| next.local.is_err());
                break (entry, failure_behind);
            }
            drop(requester);
            self.finish(entry, WorkCompletionStatus::Success);
        };
        let mut status = status;
        if let Some(payload) = payload {
            status = place_payload(status, &entry.request, &entry.local, payload);
        }
        self.finish(entry, status);
        if status != WorkCompletionStatus::Success {
            self.enter_error();
        } else if failure_behind {
            // Entries join at the back only: a local failure queued after this look is
            // settled by its own post (`after_ring`).
            self.settle_local_failures();
        }
    }

    /// A completion the NIC reported: retires every entry up to the one it names (the ones
    /// before it were unsignaled and succeeded).
    #[allow(
        dead_code,
        reason = "the seam for NIC providers (verbs); a build without one has no caller"
    )]
    pub(crate) fn complete_through(&self, sequence: u64, status: WorkCompletionStatus) {
        let failed = status != WorkCompletionStatus::Success;
        let mut retired = Vec::new();
        {
            let mut requester = lock(&self.requester);
            while requester
                .in_flight
                .front()
                .is_some_and(|front| front.sequence <= sequence)
            {
                let Some(entry) = requester.in_flight.pop_front() else {
                    break;
                };
                let entry_status = if entry.sequence == sequence {
                    status
                } else {
                    WorkCompletionStatus::Success
                };
                retired.push((entry, entry_status));
            }
            if failed {
                self.set_state_locked(&mut requester, QueuePairState::Error);
            }
        }
        for (entry, entry_status) in retired {
            self.finish(entry, entry_status);
        }
    }

    /// Counts a completion of a list run inside its post (`post_inline`), as `finish` counts
    /// a queued one: `request`'s, when it produces one.
    pub(crate) fn count_inline_completion(
        &self,
        request: &WorkRequest,
        status: WorkCompletionStatus,
    ) {
        if request.signaled || status != WorkCompletionStatus::Success {
            self.completion_queue.inner.count();
        }
    }

    /// Counts the completions of a list run inside its post that failed: the failed
    /// request's, and one for each of the `failed_and_behind - 1` requests behind it, as the
    /// posted list's flushed (or `NotExecuted`) requests each produce one, signaled or not.
    pub(crate) fn count_inline_failure(&self, failed_and_behind: usize) {
        self.completion_queue
            .inner
            .count_many(failed_and_behind as u64);
    }

    /// Whether a list may run inside its post now: the queue pair is RTS and nothing of it is
    /// outstanding (so the list would be its next, and no failure is queued before it).
    pub(crate) fn idle_and_sendable(&self) -> bool {
        let requester = lock(&self.requester);
        requester.state == QueuePairState::ReadyToSend
            && requester.in_flight.is_empty()
            && !requester.poisoned
    }

    /// Reports one request's completion, if it produces one, and frees its send queue slot.
    #[inline]
    pub(crate) fn finish(&self, entry: InFlight, status: WorkCompletionStatus) {
        // Free the slot first: whoever the completion wakes may post again at once.
        self.permits.give_back(1);
        if entry.request.signaled || status != WorkCompletionStatus::Success {
            let queue = &self.completion_queue.inner;
            queue.count();
            entry.list.add(
                WorkCompletion {
                    work_request_id: entry.request.id,
                    qp_number: self.qp_number,
                    opcode: entry.request.opcode,
                    status,
                },
                entry.is_tail,
                queue,
            );
        }
    }

    /// Completes every outstanding request as flushed (a NIC that did not flush in time).
    #[allow(
        dead_code,
        reason = "the seam for NIC providers (verbs); a build without one has no caller"
    )]
    pub(crate) fn flush_outstanding(&self) -> usize {
        let left = std::mem::take(&mut lock(&self.requester).in_flight);
        let count = left.len();
        for entry in left {
            self.finish(entry, WorkCompletionStatus::WorkRequestFlushError);
        }
        count
    }

    /// Completes queued local failures that reached the head of the queue.
    pub(crate) fn settle_local_failures(&self) {
        let failed = {
            let mut requester = lock(&self.requester);
            match requester.in_flight.front() {
                Some(front) if front.local.is_err() => requester.in_flight.pop_front(),
                _ => None,
            }
        };
        if let Some(entry) = failed {
            let status = entry
                .local
                .as_ref()
                .err()
                .copied()
                .unwrap_or(WorkCompletionStatus::LocalProtectionError);
            self.finish(entry, status);
            self.enter_error();
        }
    }

    /// Moves to ERROR, flushes every outstanding request and stops the transport. When the
    /// provider's NIC completes flushes itself, only entries never handed to it are retired
    /// here; the rest are retired by their flush completions, never before, so their buffers
    /// outlive the NIC's use.
    pub(crate) fn enter_error(&self) {
        let (flushed, status) = {
            let mut requester = lock(&self.requester);
            self.set_state_locked(&mut requester, QueuePairState::Error);
            requester.poisoned = false;
            // After the responder's stop, everything outstanding was posted after it (what was
            // outstanding at the stop completed then): none of it ran.
            let status = if requester.peer_stopped {
                WorkCompletionStatus::NotExecuted
            } else {
                WorkCompletionStatus::WorkRequestFlushError
            };
            let flushed: Vec<InFlight> = if self.provider.completes_flushes() {
                requester.take_unposted()
            } else {
                requester.unposted = 0;
                std::mem::take(&mut requester.in_flight).into()
            };
            (flushed, status)
        };
        for entry in flushed {
            self.finish(entry, status);
        }
        self.provider.modify_to_error();
    }

    /// The responder stopped (its queue pair moved to ERROR) after answering every request it
    /// ran: every outstanding request completes [`WorkCompletionStatus::NotExecuted`], the queue
    /// pair moves to ERROR, and every request posted later completes `NotExecuted` too. Only a
    /// provider that knows this calls it (a soft peer's stop frame; an `shm` requester, which
    /// runs its requests itself).
    ///
    /// Before, with nothing outstanding it did nothing, as a NIC notices a stopped peer only
    /// when it next sends: the next request then met the closed connection and completed
    /// `RETRY_EXC_ERR` (ran or not, unknown), though the stop frame had said it could not run.
    /// A fenced write's commit posted in that gap ended `Unresolved` (found by the failover
    /// history test over `soft`, one run in about eight).
    pub(crate) fn responder_stopped(&self) {
        let left = {
            let mut requester = lock(&self.requester);
            if requester.state == QueuePairState::Error {
                // In ERROR already, for its own reason (a failed request): later requests
                // flush, as behind any error.
                Vec::new()
            } else {
                requester.peer_stopped = true;
                self.set_state_locked(&mut requester, QueuePairState::Error);
                requester.poisoned = false;
                requester.unposted = 0;
                std::mem::take(&mut requester.in_flight).into()
            }
        };
        for entry in left {
            self.finish(entry, WorkCompletionStatus::NotExecuted);
        }
        self.provider.modify_to_error();
    }

    /// The responder never answered: the oldest request completes RETRY_EXC_ERR, the rest flush.
    /// Already in ERROR, everything outstanding simply flushes (a request posted after the
    /// error must not be reported as unanswered). With nothing outstanding nothing happens, as
    /// on a real NIC, which notices a vanished peer only when it next sends: the connection is
    /// closed by then, so the next post comes back here with a request to fail.
    pub(crate) fn fail_unanswered(&self) {
        let oldest = {
            let mut requester = lock(&self.requester);
            if requester.state == QueuePairState::Error {
                None
            } else if requester.in_flight.is_empty() {
                return;
            } else {
                requester.in_flight.pop_front()
            }
        };
        if let Some(entry) = oldest {
            self.finish(entry, WorkCompletionStatus::RetryExceededError);
        }
        self.enter_error();
    }

    /// How long the oldest outstanding request has waited.
    pub(crate) fn oldest_outstanding_age(&self) -> Option<Duration> {
        lock(&self.requester)
            .in_flight
            .front()
            .map(|entry| entry.posted_at.elapsed())
    }

    /// The rules every posted list keeps: not empty, its last request signaled, no deeper
    /// than the send queue.
    fn check_list(&self, list: &[WorkRequest]) -> Result<()> {
        let invalid = |reason: String| Error::InvalidWorkRequest {
            qp_number: self.qp_number,
            reason,
        };
        let Some(tail) = list.last() else {
            return Err(invalid("the list is empty".into()));
        };
        if !tail.signaled {
            return Err(invalid(
                "the last request of a list must be signaled, or its completion could never be awaited"
                    .into(),
            ));
        }
        if list.len() > self.config.max_send_wr as usize {
            return Err(invalid(format!(
                "{} requests exceed the send queue depth max_send_wr = {}",
                list.len(),
                self.config.max_send_wr
            )));
        }
        Ok(())
    }

    /// Runs a list inside the call; see [`QueuePair::post_inline`].
    fn post_inline(&self, list: &[WorkRequest]) -> Option<Result<InlineOutcome>> {
        if let Err(error) = self.check_list(list) {
            return Some(Err(error));
        }
        self.provider.run_inline(self, list).map(Ok)
    }

    /// Posts a list, taking its requests out of `list` (left empty, its capacity kept, once
    /// posted); see [`QueuePair::post`].
    async fn post(&self, list: &mut Vec<WorkRequest>, posted_at: Instant) -> Result<PostedList> {
        // One unit of tokio's cooperative budget per post (the semaphore this counter replaced
        // spent it): a task that only posts to a provider that completes inline (`shm`,
        // `loopback`) still yields now and then, and a timeout around it can fire.
        tokio::task::consume_budget().await;
        self.post_spent(list, posted_at).await
    }

    /// As [`QueuePairShared::post`], the caller having spent the post's unit of budget.
    /// `posted_at`: the post's instant, for the retry timeout (every request of a list is
    /// posted at once).
    async fn post_spent(
        &self,
        list: &mut Vec<WorkRequest>,
        posted_at: Instant,
    ) -> Result<PostedList> {
        self.check_list(list)?;
        let state = self.state();
        if !matches!(state, QueuePairState::ReadyToSend | QueuePairState::Error) {
            return Err(Error::InvalidQueuePairState {
                qp_number: self.qp_number,
                state,
                operation: "post send requests (it must be RTS)",
            });
        }
        self.permits.take(list.len()).await;

        let (list_completion, posted) = ListCompletion::new(self.completion_queue.inner.clone());
        let device = self.device();
        let domain = self.protection_domain.inner.id;
        let count = list.len();
        // The NIC checks local buffers itself: the entry only keeps valid ones alive.
        let nic_checks = self.provider.checks_local_buffers();
        let mut last_entry = None;
        let mut entries = list.drain(..).enumerate().map(|(index, request)| InFlight {
            sequence: 0,
            local: if nic_checks {
                Ok(device
                    .table
                    .check_local_in_post(
                        domain,
                        &request.local,
                        request.opcode,
                        u32::MAX,
                        &mut last_entry,
                    )
                    .ok()
                    .flatten())
            } else {
                device.table.check_local_in_post(
                    domain,
                    &request.local,
                    request.opcode,
                    device.config.max_message_size,
                    &mut last_entry,
                )
            },
            request,
            list: list_completion.clone(),
            is_tail: index + 1 == count,
            posted_at,
        });
        match self.provider.submit(self, &mut entries) {
            Submission::Complete => {}
            Submission::Rang => self.provider.after_ring(self),
            Submission::RingAfterYield => {
                // Ring after letting the other ready tasks of this worker post too, so one
                // doorbell carries all of them. A provider whose doorbell is busy on another
                // thread (shm: an executor running this queue pair's requests) gets another
                // yield instead of a wait. The guard rings even if this future is dropped
                // during a yield.
                let mut doorbell = Doorbell {
                    queue_pair: self,
                    rung: false,
                };
                loop {
                    tokio::task::yield_now().await;
                    if self.provider.try_ring(self) {
                        doorbell.rung = true;
                        break;
                    }
                }
                drop(doorbell);
                self.provider.after_ring(self);
            }
            Submission::NotConnected => {
                self.permits.give_back(count);
                return Err(Error::InvalidQueuePairState {
                    qp_number: self.qp_number,
                    state: self.state(),
                    operation: "post without a connection",
                });
            }
        }
        Ok(posted)
    }
}

/// Rings the provider's doorbell when dropped unless the post rang it: when that post's future
/// is dropped during its yield.
struct Doorbell<'a> {
    queue_pair: &'a QueuePairShared,
    /// The post rang it.
    rung: bool,
}

impl Drop for Doorbell<'_> {
    fn drop(&mut self) {
        if !self.rung {
            self.queue_pair.provider.ring(self.queue_pair);
        }
    }
}

/// The completions a list run inside its post produced, as its queued completions would have
/// been: each signaled request that succeeded, then the failed one, then every later request
/// of the list, which did not run: `NotExecuted` behind a stopped responder (as
/// `QueuePairShared::responder_stopped` completes them), flushed behind any other failure.
fn inline_completions(list: &[WorkRequest], qp_number: u32, outcome: InlineOutcome) -> Completions {
    let completion = |request: &WorkRequest, status| WorkCompletion {
        work_request_id: request.id,
        qp_number,
        opcode: request.opcode,
        status,
    };
    let failed_at = outcome.map_or_else(|failure| failure.index, |()| list.len());
    let mut completions: Completions = list[..failed_at]
        .iter()
        .filter(|request| request.signaled)
        .map(|request| completion(request, WorkCompletionStatus::Success))
        .collect();
    if let Err(failure) = outcome {
        completions.push(failure.completion);
        let behind = if failure.completion.status == WorkCompletionStatus::NotExecuted {
            WorkCompletionStatus::NotExecuted
        } else {
            WorkCompletionStatus::WorkRequestFlushError
        };
        completions.extend(
            list.iter()
                .skip(failed_at + 1)
                .map(|request| completion(request, behind)),
        );
    }
    completions
}

/// The status of a request that completed with `status`, once the responder's `payload` (READ
/// data, an atomic's original) is in its local buffer: a payload that does not fit, or cannot
/// be written there, fails it REM_OP_ERR.
pub(crate) fn place_payload(
    status: WorkCompletionStatus,
    request: &WorkRequest,
    local: &std::result::Result<Option<LocalTarget>, WorkCompletionStatus>,
    payload: &[u8],
) -> WorkCompletionStatus {
    if status != WorkCompletionStatus::Success || !request.opcode.writes_local_buffer() {
        return status;
    }
    match local {
        Ok(Some(target))
            if payload.len() != target.length as usize
                || target
                    .entry
                    .memory
                    .write_from(target.memory_offset, payload)
                    .is_err() =>
        {
            WorkCompletionStatus::RemoteOperationError
        }
        _ => status,
    }
}

/// Queues the entries of one post under the requester lock (see
/// [`QueuePairShared::enqueuer`]).
pub(crate) struct Enqueuer<'a> {
    requester: MutexGuard<'a, RequesterState>,
    /// Whether the queue pair is RTS: entries may be sent. Otherwise the provider flushes
    /// them (it enters ERROR).
    pub(crate) sendable: bool,
}

impl Enqueuer<'_> {
    /// Gives `entry` its sequence number and queues it; returns it when it is to be sent now
    /// (it is sendable and no local failure is queued before it).
    #[inline]
    pub(crate) fn push(&mut self, mut entry: InFlight) -> Option<&InFlight> {
        let requester = &mut *self.requester;
        entry.sequence = requester.next_sequence;
        requester.next_sequence += 1;
        let send = if entry.local.is_err() {
            requester.poisoned = true;
            false
        } else {
            self.sendable && !requester.poisoned
        };
        requester.in_flight.push_back(entry);
        if send {
            requester.in_flight.back()
        } else {
            None
        }
    }

    /// Gives `entry` its sequence number and queues it for the doorbell (the provider's
    /// `ring` hands the unposted tail to the NIC).
    #[allow(
        dead_code,
        reason = "the seam for NIC providers (verbs); a build without one has no caller"
    )]
    pub(crate) fn push_for_doorbell(&mut self, mut entry: InFlight) {
        let requester = &mut *self.requester;
        entry.sequence = requester.next_sequence;
        requester.next_sequence += 1;
        requester.in_flight.push_back(entry);
        requester.unposted += 1;
    }
}

/// A reliable-connected queue pair. Dropping it destroys it: ERROR, flush, drain, then release.
#[derive(Debug)]
pub struct QueuePair {
    pub(crate) shared: Arc<QueuePairShared>,
}

impl ProtectionDomain {
    /// Creates a queue pair in RESET whose completions go to `completion_queue`.
    ///
    /// # Errors
    /// [`Error::ObjectMismatch`] when the completion queue belongs to another device.
    pub fn create_queue_pair(
        &self,
        completion_queue: &CompletionQueue,
        config: QueuePairConfig,
    ) -> Result<QueuePair> {
        let device = self.inner.device.clone();
        if config.max_send_wr == 0 {
            return Err(Error::ObjectMismatch {
                reason: "max_send_wr must be at least 1".into(),
            });
        }
        completion_queue.inner.commit(config.max_send_wr)?;
        let provider = device
            .provider
            .create_queue_pair(&device, &completion_queue.inner, config)
            .inspect_err(|_| completion_queue.inner.release(config.max_send_wr))?;
        let qp_number = provider
            .qp_number()
            .unwrap_or_else(|| device.allocate_qp_number());
        let shared = Arc::new(QueuePairShared {
            protection_domain: self.clone(),
            completion_queue: completion_queue.clone(),
            qp_number,
            config,
            requester: Mutex::new(RequesterState {
                state: QueuePairState::Reset,
                next_sequence: 0,
                in_flight: VecDeque::new(),
                poisoned: false,
                unposted: 0,
                peer_stopped: false,
            }),
            state_mirror: AtomicU8::new(QueuePairState::Reset as u8),
            permits: SendSlots::new(config.max_send_wr as usize),
            responder_gate: RwLock::new(()),
            drained: AtomicBool::new(false),
            provider,
        });
        shared.provider.attach(&shared);
        device
            .gauges
            .move_queue_pair(None, Some(QueuePairState::Reset));
        device
            .queue_pairs
            .insert(qp_number, Arc::downgrade(&shared));
        Ok(QueuePair { shared })
    }
}

impl QueuePair {
    /// The queue pair number.
    pub fn qp_number(&self) -> u32 {
        self.shared.qp_number
    }

    /// The current state. On a NIC it is read from the NIC (`ibv_query_qp` on verbs), which
    /// may have moved the queue pair to ERROR on its own.
    pub fn state(&self) -> QueuePairState {
        if self.shared.provider.nic_in_error() {
            self.shared.mark_error();
        }
        self.shared.state()
    }

    /// The send queue depth.
    pub fn max_send_wr(&self) -> u32 {
        self.shared.config.max_send_wr
    }

    /// Send queue slots free now.
    pub fn free_send_slots(&self) -> usize {
        self.shared.permits.available()
    }

    /// What a peer needs to connect to this queue pair.
    pub fn endpoint(&self) -> QueuePairEndpoint {
        self.shared.provider.endpoint(&self.shared)
    }

    /// RESET → INIT.
    ///
    /// # Errors
    /// [`Error::InvalidQueuePairState`] unless the queue pair is in RESET.
    pub fn modify_to_init(&self) -> Result<()> {
        let state = self.shared.state();
        if state != QueuePairState::Reset {
            return Err(Error::InvalidQueuePairState {
                qp_number: self.shared.qp_number,
                state,
                operation: "move to INIT",
            });
        }
        self.shared.provider.modify_to_init()?;
        self.shared.transition(
            &[QueuePairState::Reset],
            QueuePairState::Init,
            "move to INIT",
        )
    }

    /// Connects to a remote queue pair and walks RESET/INIT → RTR → RTS. For the soft backend
    /// one side dials the other's NIC (the side without a listener, else the lower
    /// (device id, QP number)); the other side's connection is attached when it arrives.
    ///
    /// # Errors
    /// [`Error::BackendMismatch`], [`Error::EndpointNotFound`], [`Error::ConnectPeer`], or
    /// [`Error::InvalidQueuePairState`] when the queue pair is past INIT.
    pub async fn connect(&self, remote: &QueuePairEndpoint) -> Result<()> {
        let shared = &self.shared;
        let local = self.endpoint();
        if local.backend() != remote.backend() {
            return Err(Error::BackendMismatch {
                local: local.backend(),
                remote: remote.backend(),
            });
        }
        if shared.state() == QueuePairState::Reset {
            self.modify_to_init()?;
        }
        shared.transition(
            &[QueuePairState::Init],
            QueuePairState::ReadyToReceive,
            "move to RTR",
        )?;
        if let Err(error) = shared.provider.connect(shared, &local, remote).await {
            shared.enter_error();
            return Err(error);
        }
        shared.transition(
            &[QueuePairState::ReadyToReceive],
            QueuePairState::ReadyToSend,
            "move to RTS",
        )?;
        tracing::debug!(qp_number = shared.qp_number, remote = ?remote, "queue pair connected");
        Ok(())
    }

    /// Posts a list of work requests at once (one doorbell). Waits while the send queue lacks
    /// room for the whole list. Only signaled requests produce completions, unless they fail;
    /// the last request must be signaled. In ERROR, every request completes WR_FLUSH_ERR.
    ///
    /// # Errors
    /// [`Error::InvalidWorkRequest`] for an empty list, an unsignaled tail or a list longer than
    /// `max_send_wr`; [`Error::InvalidQueuePairState`] before RTS.
    pub async fn post(&self, mut list: Vec<WorkRequest>) -> Result<PostedList> {
        self.shared.post(&mut list, Instant::now()).await
    }

    /// As [`QueuePair::post`], taking the requests out of `list`: it is left empty with its
    /// capacity, for the caller's next list (no allocation per list), posted or not (a list
    /// refused before it is checked, an invalid one, is left as it was).
    ///
    /// # Errors
    /// As [`QueuePair::post`].
    pub async fn post_from(&self, list: &mut Vec<WorkRequest>) -> Result<PostedList> {
        self.shared.post(list, Instant::now()).await
    }

    /// As [`QueuePair::post_from`], with `now` the caller's clock read just before the call
    /// (a caller that reads it anyway spares the post a clock read; the retry timeout counts
    /// from it).
    ///
    /// # Errors
    /// As [`QueuePair::post`].
    pub async fn post_from_at(
        &self,
        list: &mut Vec<WorkRequest>,
        now: Instant,
    ) -> Result<PostedList> {
        self.shared.post(list, now).await
    }

    /// Runs `list` inside this call, without queuing it, when the provider completes inside
    /// the post (`shm`: the requester runs its requests on the responder's memory itself) and
    /// nothing of this queue pair is queued or running: `Some` with how the list ended, as its
    /// completions would have told (the first failed request's completion; the queue pair is
    /// then in ERROR, and the list's later requests did not run). Its completions are counted
    /// on the completion queue as the posted list's would be (signaled ones, the failed one,
    /// one per request behind it) but not queued: nothing waits for them. It spends none of
    /// tokio's cooperative budget: a caller that loops on it spends a unit per list, as `post`
    /// does ([`QueuePair::execute`] does). `None`:
    /// not now (another thread runs this queue pair's requests, some are queued, it is not
    /// RTS, the peer is gone, or the provider never completes inside a post); post the list
    /// with [`QueuePair::post`]. A list that breaks `post`'s rules is `Some(Err)`, as `post`
    /// refuses it. Same semantics as `post` then awaiting the list, for the cost of a function
    /// call per request: no in-flight entry, no send queue slot, no completion entry, no
    /// wake-up.
    ///
    /// # Errors
    /// [`Error::InvalidWorkRequest`] for a list `post` would refuse.
    pub fn post_inline(&self, list: &[WorkRequest]) -> Option<Result<InlineOutcome>> {
        self.shared.post_inline(list)
    }

    /// Runs `work` with direct access to the responder's memory (`DirectAccess`: READs and
    /// WRITEs as calls, with the checks and outcomes of a list run inside its post), where the
    /// provider's requester shares that memory and nothing of this queue pair is queued or
    /// running. `None`: not now (busy, not RTS, the peer gone) or never (a provider that does
    /// not share memory: `soft`, `verbs`, `loopback`); `work` was not called, and the caller
    /// posts lists instead. It spends none of tokio's cooperative budget.
    pub fn direct<Output>(
        &self,
        work: impl FnOnce(&mut dyn DirectAccess) -> Output,
    ) -> Option<Output> {
        self.direct_at(std::time::Instant::now(), work)
    }

    /// [`QueuePair::direct`], with `now` the caller's clock read just before the call (a
    /// caller that reads it anyway spares the provider a clock read).
    pub fn direct_at<Output>(
        &self,
        now: std::time::Instant,
        work: impl FnOnce(&mut dyn DirectAccess) -> Output,
    ) -> Option<Output> {
        let mut work = Some(work);
        let mut output = None;
        let ran = self
            .shared
            .provider
            .run_direct(&self.shared, now, &mut |access| {
                if let Some(work) = work.take() {
                    output = Some(work(access));
                }
            });
        if ran {
            output
        } else {
            None
        }
    }

    /// Posts a list and waits for its completions: run inside the call where the provider can
    /// ([`QueuePair::post_inline`]), with the completions the list would have produced, else
    /// posted and awaited.
    ///
    /// # Errors
    /// As [`QueuePair::post`]. Failed completions are returned, not turned into errors.
    pub async fn execute(&self, mut list: Vec<WorkRequest>) -> Result<Completions> {
        // The unit of tokio's cooperative budget `post` spends: a loop of lists run inside
        // their post never yields otherwise, and starves its worker's other tasks and any
        // timeout around it.
        tokio::task::consume_budget().await;
        if let Some(outcome) = self.post_inline(&list) {
            return outcome
                .map(|outcome| inline_completions(&list, self.shared.qp_number, outcome));
        }
        Ok(self
            .shared
            .post_spent(&mut list, Instant::now())
            .await?
            .await)
    }

    /// Binds a type-2 memory window to this queue pair over part of `region`; the returned rkey
    /// is valid only for requests arriving on this queue pair.
    ///
    /// # Errors
    /// [`Error::ObjectMismatch`] when the window, region and queue pair are in different
    /// domains or the region lacks MW_BIND; [`Error::RangeOutsideParent`] when the range leaves
    /// the region; [`Error::InvalidQueuePairState`] unless the queue pair is RTS (as on real
    /// verbs, where the bind is posted on the send queue).
    pub fn bind_memory_window(
        &self,
        window: &MemoryWindow,
        region: &MemoryRegion,
        address: u64,
        length: u64,
        access: AccessFlags,
    ) -> Result<RemoteKey> {
        let domain = &self.shared.protection_domain;
        if !domain.same_as(window.protection_domain())
            || !domain.same_as(region.protection_domain())
        {
            return Err(Error::ObjectMismatch {
                reason:
                    "the window, the region and the queue pair must share one protection domain"
                        .into(),
            });
        }
        let state = self.state();
        if state != QueuePairState::ReadyToSend {
            return Err(Error::InvalidQueuePairState {
                qp_number: self.shared.qp_number,
                state,
                operation: "bind a memory window (a type-2 bind is a send-queue work request: \
                            connect the queue pair first, it must be RTS)",
            });
        }
        window.check_bind(region, address, length)?;
        match self.shared.provider.bind_memory_window(
            &self.shared,
            window,
            region,
            (address, length),
            access,
        ) {
            Some(bound) => bound,
            None => window.bind(region, address, length, access, self.shared.qp_number),
        }
    }

    /// Moves the queue pair to ERROR: outstanding requests flush, later ones flush at once, and
    /// the responder side stops serving.
    pub fn modify_to_error(&self) {
        self.shared.enter_error();
    }

    /// After [`QueuePair::modify_to_error`]: waits until every request has its completion and
    /// no request of this queue pair is executing on the responder side, so the caller may
    /// revoke keys and deregister memory. Blocking: emulated providers flush synchronously
    /// and wait only for a request being executed; a NIC's flush completions are polled for at
    /// most `retry_timeout` + 1 s. Call it from a blocking context (the server's teardown runs
    /// it on tokio's blocking pool).
    pub fn drain(&self) {
        self.shared.drain();
    }

    /// After [`QueuePair::drain`]: whether no request of this queue pair can still run on the
    /// responder's memory. False only where the requester runs its requests itself (`shm`)
    /// and stopped inside one past the drain's bound, with its process still there: it may
    /// resume and finish that request, so what it could touch must not be reused yet. Ask
    /// again later (cheap: a load and a non-blocking peek); it turns true once the requester
    /// leaves the request or its process is gone.
    pub fn requester_out(&self) -> bool {
        self.shared.provider.requester_out(&self.shared)
    }

    /// Requests still outstanding (zero after [`QueuePair::drain`]).
    pub fn outstanding(&self) -> usize {
        lock(&self.shared.requester).in_flight.len()
    }
}

/// Dropping a queue pair drains it (as [`QueuePair::drain`], unless that already ran) and
/// destroys it, and never blocks an async worker on the way.
///
/// A drain that may wait (the provider says so for this queue pair now: a NIC with requests
/// outstanding polls for their flushes, up to `retry_timeout` + 1 s; an `shm` responder waits
/// for its requester to leave a request, up to `retry_timeout`) is handed, with the rest of
/// the destruction, to a thread of its own (at most [`MAX_DRAIN_THREADS`] at once) when the drop
/// runs inside a tokio runtime, where it would stall every task of the worker (all of them, on
/// a current-thread runtime). That is
/// safe because the thread owns the queue pair's shared state: the in-flight entries keep
/// their buffers alive until their completions, and the queue pair leaves its device's table
/// and gauges only once drained, as on any drop. Every other drain is bounded by one request
/// that an engine thread is executing for this queue pair (CPU work on registered memory, no
/// I/O), so it runs in place; so does any drain outside a runtime, whose thread may block.
/// Drain threads running at once, at most [`MAX_DRAIN_THREADS`]: connections closed in a burst
/// (a client's churn, a node's restart) cannot make a process start threads without a bound;
/// past it, a drop drains in place (each drain is bounded by `retry_timeout` + 1 s).
static DRAIN_THREADS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The most drain threads at once (see [`DRAIN_THREADS`]).
const MAX_DRAIN_THREADS: usize = 64;

impl Drop for QueuePair {
    fn drop(&mut self) {
        let shared = &self.shared;
        let drained = shared.drained.load(Ordering::Acquire) && self.outstanding() == 0;
        if !drained
            && shared.provider.drain_may_wait(shared)
            && tokio::runtime::Handle::try_current().is_ok()
        {
            let owned = shared.clone();
            let handed = if DRAIN_THREADS.fetch_add(1, Ordering::AcqRel) < MAX_DRAIN_THREADS {
                std::thread::Builder::new()
                    .name("rdkv-drain".into())
                    .spawn(move || {
                        owned.destroy(true);
                        DRAIN_THREADS.fetch_sub(1, Ordering::AcqRel);
                    })
            } else {
                Err(std::io::Error::other(format!(
                    "{MAX_DRAIN_THREADS} drain threads are running"
                )))
            };
            match handed {
                Ok(_) => return,
                Err(error) => {
                    DRAIN_THREADS.fetch_sub(1, Ordering::AcqRel);
                    tracing::warn!(
                    qp_number = shared.qp_number,
                    %error,
                    "no thread to drain a dropped queue pair on: draining it here"
                    );
                }
            }
        }
        shared.destroy(!drained);
    }
}

impl QueuePairShared {
    /// See [`QueuePair::drain`].
    fn drain(&self) {
        if self.provider.nic_in_error() {
            self.mark_error();
        }
        if self.state() != QueuePairState::Error {
            self.enter_error();
        }
        self.provider.drain(self);
        let _gate = write_lock(&self.responder_gate);
        self.drained.store(true, Ordering::Release);
    }

    /// The end of a dropped queue pair: drained (when `drain`), detached from its provider,
    /// its completion queue entries given back, out of its device's table and gauges.
    fn destroy(&self, drain: bool) {
        if drain {
            self.drain();
        }
        self.provider.detach(self);
        self.completion_queue.inner.release(self.config.max_send_wr);
        let device = self.device();
        device.queue_pairs.remove(&self.qp_number);
        device.gauges.move_queue_pair(Some(self.state()), None);
    }
}
