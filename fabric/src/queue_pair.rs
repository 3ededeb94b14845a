//! RC queue pairs: the state machine, posting with doorbell batching and a send-queue depth
//! bound, in-order completion, flush on error, and teardown.
//!
//! The requester side keeps every posted request in an ordered in-flight queue until it
//! completes. The entry holds the local buffer's protection entry, and with it the pinned
//! memory, so a buffer stays alive until its completion is polled even if the future that
//! posted it is dropped. A signaled completion retires the unsignaled requests before it, as
//! on a real send queue. The first error moves the queue pair to ERROR; every outstanding and
//! later request then completes IBV_WC_WR_FLUSH_ERR.
//!
//! The responder side ([`QueuePairShared::serve`]) runs the [`engine`](super::engine) under a
//! read lock of the responder gate; [`QueuePair::drain`] takes the write lock once after the
//! state is ERROR, so when it returns no request is executing and none will start.

use std::collections::VecDeque;
use std::net::TcpStream;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::completion::{CompletionQueue, ListCompletion, PostedList};
use crate::device::find_loopback_device;
use crate::error::{Error, Result};
use crate::lock;
use crate::protection::{LocalTarget, MemoryRegion, MemoryWindow, ProtectionDomain};
use crate::provider::engine::{self, RemoteRequest, ResponderContext};
use crate::provider::soft::{self, SoftConnection};
use crate::types::{
    AccessFlags, Backend, Opcode, QueuePairEndpoint, QueuePairState, RemoteKey, SoftEndpoint,
    VerbsAddress, WorkCompletion, WorkCompletionStatus, WorkRequest,
};

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

/// How requests reach the responder.
#[derive(Debug)]
pub(crate) enum Transport {
    /// In-process: the remote queue pair's engine runs in the poster's thread.
    Loopback(Weak<QueuePairShared>),
    /// The software RNIC's TCP connection.
    Soft(Arc<SoftConnection>),
    /// The NIC (the queue pair's `verbs` part does the work).
    #[cfg(feature = "verbs")]
    Verbs,
}

/// Work request ids with this bit are memory window binds, not entries of the in-flight queue.
#[cfg(feature = "verbs")]
const BIND_REQUEST_FLAG: u64 = 1 << 63;

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
struct RequesterState {
    /// The queue pair state.
    state: QueuePairState,
    /// The next sequence number.
    next_sequence: u64,
    /// Outstanding requests, oldest first.
    in_flight: VecDeque<InFlight>,
    /// A request that failed its local check is queued: later requests are not sent.
    poisoned: bool,
    /// Verbs: how many entries at the tail of `in_flight` wait for the doorbell (queued by
    /// posts of this instant, not yet handed to the NIC).
    #[cfg(feature = "verbs")]
    unposted: usize,
}

/// The shared part of a queue pair, referenced by its handle, its device's table, its soft
/// engine thread and its loopback peer (weakly).
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
    requester: Mutex<RequesterState>,
    /// The state, readable without the requester lock.
    state_mirror: AtomicU8,
    /// Free send queue slots.
    permits: Semaphore,
    /// Held shared while the engine executes a request for this queue pair.
    responder_gate: RwLock<()>,
    /// Set once when the queue pair connects.
    pub(crate) transport: OnceLock<Transport>,
    /// Serialises loopback posts so requests execute in posting order.
    loopback_order: Mutex<()>,
    /// A soft connection that arrived before `connect` (passive side).
    pub(crate) pending_stream: Mutex<Option<TcpStream>>,
    /// The NIC's queue pair, on a verbs device.
    #[cfg(feature = "verbs")]
    pub(crate) verbs: Option<crate::provider::verbs::queue_pair::VerbsQueuePair>,
    /// Completed memory window binds by work request id, until their binder takes them.
    #[cfg(feature = "verbs")]
    verbs_binds: Mutex<std::collections::HashMap<u64, WorkCompletionStatus>>,
}

impl QueuePairShared {
    fn device(&self) -> &crate::device::DeviceInner {
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

    /// Whether this queue pair's device listens (and so serves connections from threads).
    pub(crate) fn listens(&self) -> bool {
        self.device().soft_listener.get().is_some()
    }

    /// How long an engine thread busy-polls before it blocks.
    pub(crate) fn poll_spin(&self) -> Duration {
        self.device().config.poll_spin
    }

    /// The device's maximum message size.
    pub(crate) fn max_message_size(&self) -> u32 {
        self.device().config.max_message_size
    }

    fn set_state_locked(&self, requester: &mut RequesterState, state: QueuePairState) {
        if requester.state == state {
            return;
        }
        self.device()
            .gauges
            .move_queue_pair(Some(requester.state), Some(state));
        requester.state = state;
        self.state_mirror.store(state as u8, Ordering::Release);
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

    /// Executes one incoming request for this (responder) queue pair. `None` means the request
    /// is not answered (the queue pair cannot receive), as a real responder drops it.
    pub(crate) fn serve(
        &self,
        request: &RemoteRequest,
        write_payload: &[u8],
        response: &mut Vec<u8>,
    ) -> Option<WorkCompletionStatus> {
        let _gate = self
            .responder_gate
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if !matches!(
            self.state(),
            QueuePairState::ReadyToReceive | QueuePairState::ReadyToSend
        ) {
            return None;
        }
        let context = ResponderContext {
            protection_domain: self.protection_domain.inner.id,
            qp_number: self.qp_number,
        };
        Some(engine::execute(
            &self.device().table,
            context,
            request,
            write_payload,
            response,
        ))
    }

    /// Completes the oldest outstanding request with a responder's answer. Answers for requests
    /// that were already flushed are ignored.
    pub(crate) fn on_response(&self, sequence: u64, status: WorkCompletionStatus, payload: &[u8]) {
        let entry = {
            let mut requester = lock(&self.requester);
            match requester.in_flight.front() {
                Some(front) if front.sequence == sequence && front.local.is_ok() => {}
                _ => return,
            }
            match requester.in_flight.pop_front() {
                Some(entry) => entry,
                None => return,
            }
        };
        let mut status = status;
        if status == WorkCompletionStatus::Success && entry.request.opcode.writes_local_buffer() {
            if let Ok(Some(target)) = &entry.local {
                if payload.len() != target.length as usize
                    || target
                        .entry
                        .memory
                        .write_from(target.memory_offset, payload)
                        .is_err()
                {
                    status = WorkCompletionStatus::RemoteOperationError;
                }
            }
        }
        self.finish(entry, status);
        if status == WorkCompletionStatus::Success {
            self.settle_local_failures();
        } else {
            self.enter_error();
        }
    }

    /// Reports one request's completion, if it produces one, and frees its send queue slot.
    fn finish(&self, entry: InFlight, status: WorkCompletionStatus) {
        // Free the slot first: whoever the completion wakes may post again at once.
        self.permits.add_permits(1);
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

    /// Completes queued local failures that reached the head of the queue.
    fn settle_local_failures(&self) {
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

    /// Moves to ERROR, flushes every outstanding request and closes the transport. On verbs the
    /// NIC's queue pair moves to ERROR and the NIC flushes: outstanding entries are retired by
    /// their flush completions, never before, so their buffers outlive the NIC's use.
    pub(crate) fn enter_error(&self) {
        #[cfg(feature = "verbs")]
        if let Some(verbs) = &self.verbs {
            let never_posted = {
                let mut requester = lock(&self.requester);
                self.set_state_locked(&mut requester, QueuePairState::Error);
                take_unposted(&mut requester)
            };
            verbs.modify_to_error();
            for entry in never_posted {
                self.finish(entry, WorkCompletionStatus::WorkRequestFlushError);
            }
            return;
        }
        let flushed = {
            let mut requester = lock(&self.requester);
            self.set_state_locked(&mut requester, QueuePairState::Error);
            requester.poisoned = false;
            std::mem::take(&mut requester.in_flight)
        };
        for entry in flushed {
            self.finish(entry, WorkCompletionStatus::WorkRequestFlushError);
        }
        if let Some(Transport::Soft(connection)) = self.transport.get() {
            connection.close();
        }
    }

    /// A completion polled from the NIC's CQ: retires every entry up to the one it names (the
    /// ones before it were unsignaled and succeeded), or records a window bind's outcome.
    #[cfg(feature = "verbs")]
    pub(crate) fn on_verbs_completion(&self, work_request_id: u64, status: WorkCompletionStatus) {
        let failed = status != WorkCompletionStatus::Success;
        if work_request_id & BIND_REQUEST_FLAG != 0 {
            lock(&self.verbs_binds).insert(work_request_id, status);
            if failed {
                let mut requester = lock(&self.requester);
                self.set_state_locked(&mut requester, QueuePairState::Error);
            }
            return;
        }
        let mut retired = Vec::new();
        {
            let mut requester = lock(&self.requester);
            while requester
                .in_flight
                .front()
                .is_some_and(|front| front.sequence <= work_request_id)
            {
                let Some(entry) = requester.in_flight.pop_front() else {
                    break;
                };
                let entry_status = if entry.sequence == work_request_id {
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

    /// Polls the NIC's CQ from this thread until `done` holds or `limit` passes; true when it
    /// held.
    #[cfg(feature = "verbs")]
    fn poll_until(&self, limit: Duration, mut done: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if done() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            match &self.completion_queue.inner.verbs {
                Some(queue) => {
                    if queue.shared.poll_and_dispatch() == 0 {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
                None => return done(),
            }
        }
    }

    /// Queues a list for the NIC and rings the doorbell after letting the other ready tasks of
    /// this worker queue theirs, so one `ibv_wr_complete` carries all of them (a system call
    /// on rxe, an MMIO write on a hardware NIC). The guard rings even if this future is dropped
    /// during the yield. In ERROR nothing reaches the NIC: every request flushes at once.
    #[cfg(feature = "verbs")]
    async fn post_verbs(
        &self,
        verbs: &crate::provider::verbs::queue_pair::VerbsQueuePair,
        entries: impl Iterator<Item = InFlight>,
    ) {
        {
            let mut requester = lock(&self.requester);
            if requester.state != QueuePairState::ReadyToSend {
                drop(requester);
                for entry in entries {
                    self.finish(entry, WorkCompletionStatus::WorkRequestFlushError);
                }
                return;
            }
            for mut entry in entries {
                entry.sequence = requester.next_sequence;
                requester.next_sequence += 1;
                requester.in_flight.push_back(entry);
                requester.unposted += 1;
            }
        }
        let doorbell = VerbsDoorbell {
            queue_pair: self,
            verbs,
        };
        tokio::task::yield_now().await;
        drop(doorbell);
    }

    /// Hands every queued entry to the NIC in one list. If the NIC refuses the list (it should
    /// not: the send queue depth bounds what is outstanding), nothing of it was posted: its
    /// first request completes LOC_QP_OP_ERR, the rest flush, and the queue pair moves to ERROR.
    #[cfg(feature = "verbs")]
    fn ring_verbs(&self, verbs: &crate::provider::verbs::queue_pair::VerbsQueuePair) {
        let mut requester = lock(&self.requester);
        if requester.unposted == 0 {
            return;
        }
        let refused = if requester.state == QueuePairState::ReadyToSend {
            let first = requester.in_flight.len() - requester.unposted;
            let posted = verbs.post(
                requester
                    .in_flight
                    .range(first..)
                    .map(|entry| (entry.sequence, &entry.request)),
            );
            match posted {
                Ok(()) => {
                    requester.unposted = 0;
                    return;
                }
                Err(error) => {
                    tracing::error!(
                        %error,
                        qp_number = self.qp_number,
                        "the NIC refused posted requests; the queue pair moves to ERROR"
                    );
                    self.set_state_locked(&mut requester, QueuePairState::Error);
                    Some(WorkCompletionStatus::LocalQueuePairOperationError)
                }
            }
        } else {
            None
        };
        let never_posted = take_unposted(&mut requester);
        drop(requester);
        if refused.is_some() {
            verbs.modify_to_error();
        }
        for (index, entry) in never_posted.into_iter().enumerate() {
            let status = match refused {
                Some(status) if index == 0 => status,
                _ => WorkCompletionStatus::WorkRequestFlushError,
            };
            self.finish(entry, status);
        }
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

    /// Posts a list; see [`QueuePair::post`].
    async fn post(&self, list: Vec<WorkRequest>) -> Result<PostedList> {
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
        let state = self.state();
        if !matches!(state, QueuePairState::ReadyToSend | QueuePairState::Error) {
            return Err(Error::InvalidQueuePairState {
                qp_number: self.qp_number,
                state,
                operation: "post send requests (it must be RTS)",
            });
        }
        let permits = self
            .permits
            .acquire_many(list.len() as u32)
            .await
            .map_err(|_| invalid("the queue pair is destroyed".into()))?;
        permits.forget();

        let (list_completion, posted) = ListCompletion::new(self.completion_queue.inner.clone());
        let device = self.device();
        let domain = self.protection_domain.inner.id;
        let count = list.len();
        // One timestamp per list: every request of a list is posted at the same instant.
        let posted_at = Instant::now();
        let entries = list
            .into_iter()
            .enumerate()
            .map(|(index, request)| InFlight {
                sequence: 0,
                local: match self.transport.get() {
                    // The NIC checks local buffers; the entry only keeps valid ones alive.
                    #[cfg(feature = "verbs")]
                    Some(Transport::Verbs) => Ok(device
                        .table
                        .check_local(domain, &request.local, request.opcode, u32::MAX)
                        .ok()
                        .flatten()),
                    _ => device.table.check_local(
                        domain,
                        &request.local,
                        request.opcode,
                        device.config.max_message_size,
                    ),
                },
                request,
                list: list_completion.clone(),
                is_tail: index + 1 == count,
                posted_at,
            });

        match self.transport.get() {
            #[cfg(feature = "verbs")]
            Some(Transport::Verbs) => {
                // `connect` sets this transport only when the NIC queue pair exists.
                let Some(verbs) = &self.verbs else {
                    self.permits.add_permits(count);
                    return Err(invalid("a verbs transport without a NIC queue pair".into()));
                };
                self.post_verbs(verbs, entries).await;
            }
            Some(Transport::Soft(connection)) => {
                {
                    let mut requester = lock(&self.requester);
                    let sendable = requester.state == QueuePairState::ReadyToSend;
                    connection.append(|buffer| {
                        let mut frames = 0;
                        for mut entry in entries {
                            entry.sequence = requester.next_sequence;
                            requester.next_sequence += 1;
                            if entry.local.is_err() {
                                requester.poisoned = true;
                            } else if sendable && !requester.poisoned {
                                soft::encode_request(buffer, &entry);
                                frames += 1;
                            }
                            requester.in_flight.push_back(entry);
                        }
                        frames
                    });
                    if !sendable {
                        drop(requester);
                        self.enter_error();
                        return Ok(posted);
                    }
                }
                // Ring the doorbell after letting the other ready tasks of this worker post
                // too, so one write carries all of them. The guard rings it even if this
                // future is dropped during the yield.
                let doorbell = soft::Doorbell::new(connection.clone());
                tokio::task::yield_now().await;
                drop(doorbell);
                self.settle_local_failures();
                if connection.is_closed() {
                    // The peer is gone (or the queue pair is closing): nothing will answer.
                    self.fail_unanswered();
                }
            }
            Some(Transport::Loopback(remote)) => {
                let _order = lock(&self.loopback_order);
                let mut to_execute = Vec::with_capacity(count);
                let sendable = {
                    let mut requester = lock(&self.requester);
                    let sendable = requester.state == QueuePairState::ReadyToSend;
                    for mut entry in entries {
                        entry.sequence = requester.next_sequence;
                        requester.next_sequence += 1;
                        if entry.local.is_err() {
                            requester.poisoned = true;
                        } else if sendable && !requester.poisoned {
                            to_execute.push((
                                entry.sequence,
                                remote_request(&entry.request),
                                entry.local.clone(),
                            ));
                        }
                        requester.in_flight.push_back(entry);
                    }
                    sendable
                };
                if !sendable {
                    self.enter_error();
                    return Ok(posted);
                }
                self.execute_loopback(remote, to_execute);
                self.settle_local_failures();
            }
            None => {
                return Err(Error::InvalidQueuePairState {
                    qp_number: self.qp_number,
                    state: self.state(),
                    operation: "post without a connection",
                })
            }
        }
        Ok(posted)
    }

    /// Runs requests against the loopback peer's engine, in order, and completes them.
    fn execute_loopback(
        &self,
        remote: &Weak<QueuePairShared>,
        requests: Vec<(
            u64,
            RemoteRequest,
            std::result::Result<Option<LocalTarget>, WorkCompletionStatus>,
        )>,
    ) {
        let mut payload = Vec::new();
        let mut response = Vec::new();
        for (sequence, request, local) in requests {
            let Some(peer) = remote.upgrade() else {
                self.fail_unanswered();
                return;
            };
            payload.clear();
            if request.opcode == Opcode::Write {
                if let Ok(Some(target)) = &local {
                    payload.resize(target.length as usize, 0);
                    if target
                        .entry
                        .memory
                        .read_into(target.memory_offset, &mut payload)
                        .is_err()
                    {
                        payload.clear();
                    }
                }
            }
            response.clear();
            match peer.serve(&request, &payload, &mut response) {
                Some(status) => {
                    self.on_response(sequence, status, &response);
                    if status != WorkCompletionStatus::Success {
                        peer.enter_error();
                        return;
                    }
                }
                None => {
                    self.fail_unanswered();
                    return;
                }
            }
        }
    }
}

/// Takes the entries that were queued for the NIC but not handed to it.
#[cfg(feature = "verbs")]
fn take_unposted(requester: &mut RequesterState) -> Vec<InFlight> {
    let first = requester.in_flight.len() - requester.unposted;
    requester.unposted = 0;
    requester.in_flight.drain(first..).collect()
}

/// Rings the verbs doorbell when dropped: after the yield of the post that queued it, or when
/// that post's future is dropped during the yield.
#[cfg(feature = "verbs")]
struct VerbsDoorbell<'a> {
    queue_pair: &'a QueuePairShared,
    verbs: &'a crate::provider::verbs::queue_pair::VerbsQueuePair,
}

#[cfg(feature = "verbs")]
impl Drop for VerbsDoorbell<'_> {
    fn drop(&mut self) {
        self.queue_pair.ring_verbs(self.verbs);
    }
}

/// The wire/engine form of a work request.
pub(crate) fn remote_request(request: &WorkRequest) -> RemoteRequest {
    RemoteRequest {
        opcode: request.opcode,
        remote_key: request.remote.remote_key,
        remote_address: request.remote.address,
        length: request.local.length,
        compare: request.compare,
        swap_or_add: request.swap_or_add,
    }
}

/// Reads the WRITE payload of an in-flight entry into `buffer`.
pub(crate) fn append_write_payload(
    buffer: &mut Vec<u8>,
    local: &std::result::Result<Option<LocalTarget>, WorkCompletionStatus>,
) {
    if let Ok(Some(target)) = local {
        let start = buffer.len();
        buffer.resize(start + target.length as usize, 0);
        if target
            .entry
            .memory
            .read_into(target.memory_offset, &mut buffer[start..])
            .is_err()
        {
            buffer.truncate(start);
        }
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
        #[cfg(feature = "verbs")]
        let verbs = create_verbs_queue_pair(&device, completion_queue, config)
            .inspect_err(|_| completion_queue.inner.release(config.max_send_wr))?;
        #[cfg(feature = "verbs")]
        let qp_number = match &verbs {
            Some(verbs) => verbs.qp_number,
            None => device.allocate_qp_number(),
        };
        #[cfg(not(feature = "verbs"))]
        let qp_number = device.allocate_qp_number();
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
                #[cfg(feature = "verbs")]
                unposted: 0,
            }),
            state_mirror: AtomicU8::new(QueuePairState::Reset as u8),
            permits: Semaphore::new(config.max_send_wr as usize),
            responder_gate: RwLock::new(()),
            transport: OnceLock::new(),
            loopback_order: Mutex::new(()),
            pending_stream: Mutex::new(None),
            #[cfg(feature = "verbs")]
            verbs,
            #[cfg(feature = "verbs")]
            verbs_binds: Mutex::new(std::collections::HashMap::new()),
        });
        #[cfg(feature = "verbs")]
        if let Some(queue) = &completion_queue.inner.verbs {
            queue.shared.attach(qp_number, Arc::downgrade(&shared));
        }
        device
            .gauges
            .move_queue_pair(None, Some(QueuePairState::Reset));
        device
            .queue_pairs
            .insert(qp_number, Arc::downgrade(&shared));
        Ok(QueuePair { shared })
    }
}

/// On a verbs device: the NIC's queue pair, with its send queue's entries promised on the CQ.
#[cfg(feature = "verbs")]
fn create_verbs_queue_pair(
    device: &crate::device::DeviceInner,
    completion_queue: &CompletionQueue,
    config: QueuePairConfig,
) -> Result<Option<crate::provider::verbs::queue_pair::VerbsQueuePair>> {
    let Some(context) = &device.verbs else {
        return Ok(None);
    };
    let queue = completion_queue
        .inner
        .verbs
        .as_ref()
        .ok_or_else(|| Error::ObjectMismatch {
            reason: "a verbs queue pair needs a completion queue of a verbs device".into(),
        })?;
    crate::provider::verbs::queue_pair::VerbsQueuePair::create(
        context,
        queue.shared.queue.clone(),
        config.max_send_wr,
        crate::device::random_id() as u32,
    )
    .map(Some)
}

impl QueuePair {
    /// The queue pair number.
    pub fn qp_number(&self) -> u32 {
        self.shared.qp_number
    }

    /// The current state. On verbs it is read from the NIC (`ibv_query_qp`), which may have
    /// moved the queue pair to ERROR on its own.
    pub fn state(&self) -> QueuePairState {
        #[cfg(feature = "verbs")]
        if let Some(verbs) = &self.shared.verbs {
            if verbs.query_state() == Some(QueuePairState::Error) {
                let mut requester = lock(&self.shared.requester);
                self.shared
                    .set_state_locked(&mut requester, QueuePairState::Error);
            }
        }
        self.shared.state()
    }

    /// The send queue depth.
    pub fn max_send_wr(&self) -> u32 {
        self.shared.config.max_send_wr
    }

    /// Send queue slots free now.
    pub fn free_send_slots(&self) -> usize {
        self.shared.permits.available_permits()
    }

    /// What a peer needs to connect to this queue pair.
    pub fn endpoint(&self) -> QueuePairEndpoint {
        let device = self.shared.device();
        let qp_number = self.shared.qp_number;
        match device.backend {
            Backend::Loopback => QueuePairEndpoint::Loopback {
                device_id: device.id,
                qp_number,
            },
            Backend::Soft => QueuePairEndpoint::Soft(SoftEndpoint {
                device_id: device.id,
                address: device.soft_listener.get().map(soft::SoftListener::address),
                qp_number,
            }),
            Backend::Verbs => QueuePairEndpoint::Verbs {
                qp_number,
                #[cfg(feature = "verbs")]
                address: self
                    .shared
                    .verbs
                    .as_ref()
                    .map(|verbs| verbs.address())
                    .unwrap_or_default(),
                #[cfg(not(feature = "verbs"))]
                address: VerbsAddress::default(),
            },
        }
    }

    /// RESET → INIT.
    ///
    /// # Errors
    /// [`Error::InvalidQueuePairState`] unless the queue pair is in RESET.
    pub fn modify_to_init(&self) -> Result<()> {
        #[cfg(feature = "verbs")]
        if let Some(verbs) = &self.shared.verbs {
            let state = self.shared.state();
            if state != QueuePairState::Reset {
                return Err(Error::InvalidQueuePairState {
                    qp_number: self.shared.qp_number,
                    state,
                    operation: "move to INIT",
                });
            }
            verbs.modify_to_init()?;
        }
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
        let connected = match (&local, remote) {
            (
                QueuePairEndpoint::Loopback { .. },
                QueuePairEndpoint::Loopback {
                    device_id,
                    qp_number,
                },
            ) => {
                let peer = find_loopback_device(*device_id)
                    .and_then(|device| device.queue_pair(*qp_number))
                    .ok_or_else(|| Error::EndpointNotFound {
                        reason: format!("loopback queue pair {qp_number} on device {device_id:#x}"),
                    })?;
                let _ = shared
                    .transport
                    .set(Transport::Loopback(Arc::downgrade(&peer)));
                Ok(())
            }
            (QueuePairEndpoint::Soft(local), QueuePairEndpoint::Soft(remote)) => {
                soft::connect(shared, local, remote).await
            }
            (QueuePairEndpoint::Verbs { .. }, QueuePairEndpoint::Verbs { qp_number, address }) => {
                self.connect_verbs(*qp_number, address)
            }
            _ => Err(Error::BackendMismatch {
                local: local.backend(),
                remote: remote.backend(),
            }),
        };
        if let Err(error) = connected {
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

    /// INIT → RTR → RTS on the NIC towards the remote queue pair `remote_qp_number` at
    /// `address`.
    fn connect_verbs(&self, remote_qp_number: u32, address: &VerbsAddress) -> Result<()> {
        #[cfg(feature = "verbs")]
        if let Some(verbs) = &self.shared.verbs {
            verbs.connect(remote_qp_number, address, self.shared.retry_timeout())?;
            let _ = self.shared.transport.set(Transport::Verbs);
            return Ok(());
        }
        let _ = (remote_qp_number, address);
        Err(Error::VerbsNotBuilt)
    }

    /// Posts a list of work requests at once (one doorbell). Waits while the send queue lacks
    /// room for the whole list. Only signaled requests produce completions, unless they fail;
    /// the last request must be signaled. In ERROR, every request completes WR_FLUSH_ERR.
    ///
    /// # Errors
    /// [`Error::InvalidWorkRequest`] for an empty list, an unsignaled tail or a list longer than
    /// `max_send_wr`; [`Error::InvalidQueuePairState`] before RTS.
    pub async fn post(&self, list: Vec<WorkRequest>) -> Result<PostedList> {
        self.shared.post(list).await
    }

    /// Posts a list and waits for its completions.
    ///
    /// # Errors
    /// As [`QueuePair::post`]. Failed completions are returned, not turned into errors.
    pub async fn execute(&self, list: Vec<WorkRequest>) -> Result<Vec<WorkCompletion>> {
        Ok(self.post(list).await?.await)
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
        #[cfg(feature = "verbs")]
        if let Some(verbs) = &self.shared.verbs {
            return self.bind_verbs_window(verbs, window, region, address, length, access);
        }
        window.bind(region, address, length, access, self.shared.qp_number)
    }

    /// Binds a fresh NIC window (any earlier one is deallocated, which revokes its key) and
    /// waits for the bind's completion.
    #[cfg(feature = "verbs")]
    fn bind_verbs_window(
        &self,
        verbs: &crate::provider::verbs::queue_pair::VerbsQueuePair,
        window: &MemoryWindow,
        region: &MemoryRegion,
        address: u64,
        length: u64,
        access: AccessFlags,
    ) -> Result<RemoteKey> {
        use std::sync::atomic::AtomicU64;
        static NEXT_BIND: AtomicU64 = AtomicU64::new(0);

        window.check_bind(region, address, length)?;
        let registered = region.verbs_region().ok_or_else(|| Error::ObjectMismatch {
            reason: "the region is not registered with the NIC of this queue pair".into(),
        })?;
        // A bind takes a send queue slot like any work request, until its completion.
        let _slot = self
            .shared
            .permits
            .try_acquire()
            .map_err(|_| Error::InvalidWorkRequest {
                qp_number: self.shared.qp_number,
                reason: "the send queue is full: a window bind needs a free slot".into(),
            })?;
        let mut binding = lock(&window.verbs);
        drop(binding.take());
        let nic_window = crate::provider::verbs::memory::VerbsWindow::allocate(
            &verbs.context.protection_domain,
        )?;
        let work_request_id = BIND_REQUEST_FLAG | NEXT_BIND.fetch_add(1, Ordering::Relaxed);
        let key = verbs.post_bind(
            work_request_id,
            &nic_window,
            registered,
            address,
            length,
            access,
        )?;
        let shared = &self.shared;
        let limit = shared.retry_timeout() * 2;
        let mut status = None;
        shared.poll_until(limit, || {
            status = lock(&shared.verbs_binds).remove(&work_request_id);
            status.is_some()
        });
        match status {
            Some(WorkCompletionStatus::Success) => {
                *binding = Some((nic_window, region.clone()));
                window.set_key(key);
                tracing::debug!(
                    remote_key = key,
                    address,
                    length,
                    qp_number = shared.qp_number,
                    "bound memory window"
                );
                Ok(RemoteKey {
                    key,
                    address,
                    length,
                })
            }
            Some(status) => Err(Error::WorkCompletion {
                qp_number: shared.qp_number,
                work_request_id,
                status,
            }),
            None => Err(Error::VerbsCall {
                operation: "bind a memory window",
                qp_number: Some(shared.qp_number),
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no completion for the bind within {limit:?}"),
                ),
            }),
        }
    }

    /// Moves the queue pair to ERROR: outstanding requests flush, later ones flush at once, and
    /// the responder side stops serving.
    pub fn modify_to_error(&self) {
        self.shared.enter_error();
    }

    /// After [`QueuePair::modify_to_error`]: waits until no request of this queue pair is
    /// executing on the responder side. Every requester request has completed by then (they
    /// flush synchronously), so the caller may revoke keys and deregister memory.
    pub fn drain(&self) {
        if self.state() != QueuePairState::Error {
            self.modify_to_error();
        }
        #[cfg(feature = "verbs")]
        if self.shared.verbs.is_some() {
            // The NIC flushes what is outstanding; poll until every entry has its completion.
            let shared = &self.shared;
            let limit = shared.retry_timeout() + Duration::from_secs(1);
            let drained = shared.poll_until(limit, || lock(&shared.requester).in_flight.is_empty());
            if !drained {
                let left = std::mem::take(&mut lock(&shared.requester).in_flight);
                tracing::warn!(
                    qp_number = shared.qp_number,
                    outstanding = left.len(),
                    "the NIC did not flush every request within {limit:?}; completing them as flushed"
                );
                for entry in left {
                    shared.finish(entry, WorkCompletionStatus::WorkRequestFlushError);
                }
            }
            return;
        }
        let _gate = self
            .shared
            .responder_gate
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
    }

    /// Requests still outstanding (zero after [`QueuePair::drain`]).
    pub fn outstanding(&self) -> usize {
        lock(&self.shared.requester).in_flight.len()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.drain();
        #[cfg(feature = "verbs")]
        if let Some(queue) = &self.shared.completion_queue.inner.verbs {
            queue.shared.detach(self.shared.qp_number);
        }
        self.shared
            .completion_queue
            .inner
            .release(self.shared.config.max_send_wr);
        let device = self.shared.device();
        device.queue_pairs.remove(&self.shared.qp_number);
        device
            .gauges
            .move_queue_pair(Some(self.shared.state()), None);
    }
}
