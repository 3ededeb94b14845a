//! The verbs provider's seam implementations: [`VerbsDevice`] (the opened RDMA device) and
//! [`NicQueuePair`] (the NIC's queue pair behind a model queue pair: doorbell batching, flush
//! completions, window binds and the drain).

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::capabilities::Capabilities;
use crate::completion::CompletionQueueInner;
use crate::device::{random_id, DeviceConfig, DeviceInner, VerbsOptions};
use crate::error::{Error, Result};
use crate::lock;
use crate::memory::PinnedMemory;
use crate::protection::{MemoryRegion, MemoryWindow};
use crate::provider::verbs::completion::{VerbsCompletionQueue, VerbsCompletionShared};
use crate::provider::verbs::context::VerbsContext;
use crate::provider::verbs::memory::{VerbsRegion, VerbsWindow};
use crate::provider::verbs::queue_pair::VerbsQueuePair;
use crate::queue_pair::{InFlight, QueuePairConfig, QueuePairShared};
use crate::seam::{
    DeviceProvider, NicRegion, ProviderFuture, ProviderObject, QueuePairProvider, Submission,
};
use crate::types::{
    AccessFlags, Backend, QueuePairEndpoint, QueuePairState, RemoteKey, WorkCompletionStatus,
};

/// Work request ids with this bit are memory window binds, not entries of the in-flight queue.
const BIND_REQUEST_FLAG: u64 = 1 << 63;

/// An opened RDMA device.
#[derive(Debug)]
pub(crate) struct VerbsDevice {
    /// The device, its port, GID and its one protection domain.
    context: Arc<VerbsContext>,
}

impl VerbsDevice {
    /// Opens (or shares) the device `options` names; see [`crate::Device::verbs`].
    ///
    /// # Errors
    /// [`Error::VerbsDevice`] naming what is missing and the fix.
    pub(crate) fn open(options: &VerbsOptions) -> Result<Box<Self>> {
        Ok(Box::new(Self {
            context: VerbsContext::shared(options)?,
        }))
    }
}

impl DeviceProvider for VerbsDevice {
    fn backend(&self) -> Backend {
        Backend::Verbs
    }

    fn capabilities(&self) -> Capabilities {
        super::CAPABILITIES
    }

    fn create_completion_queue(
        &self,
        capacity: usize,
        config: &DeviceConfig,
    ) -> Result<Option<ProviderObject>> {
        let queue = VerbsCompletionQueue::create(&self.context, capacity, config.poll_spin)?;
        Ok(Some(Box::new(queue)))
    }

    fn register(
        &self,
        memory: &Arc<PinnedMemory>,
        offset: u64,
        length: u64,
        access: AccessFlags,
    ) -> Result<Option<NicRegion>> {
        let registered = VerbsRegion::register(
            &self.context.protection_domain,
            memory,
            offset,
            length,
            access,
        )?;
        Ok(Some(NicRegion {
            local_key: registered.local_key(),
            remote_key: registered.remote_key(),
            registration: Box::new(registered),
        }))
    }

    fn create_queue_pair(
        &self,
        _device: &DeviceInner,
        completion_queue: &CompletionQueueInner,
        config: QueuePairConfig,
    ) -> Result<Box<dyn QueuePairProvider>> {
        let completion = completion_queue
            .provider
            .as_ref()
            .and_then(|queue| queue.downcast_ref::<VerbsCompletionQueue>())
            .ok_or_else(|| Error::ObjectMismatch {
                reason: "a verbs queue pair needs a completion queue of a verbs device".into(),
            })?
            .shared
            .clone();
        let nic = VerbsQueuePair::create(
            &self.context,
            completion.queue.clone(),
            config.max_send_wr,
            random_id() as u32,
        )?;
        Ok(Box::new(NicQueuePair {
            nic,
            completion,
            binds: Mutex::new(HashMap::new()),
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The NIC's queue pair behind a model queue pair, with its send queue's entries promised on
/// the CQ.
#[derive(Debug)]
pub(crate) struct NicQueuePair {
    /// The NIC's queue pair.
    nic: VerbsQueuePair,
    /// The CQ its completions land on, and its poller.
    completion: Arc<VerbsCompletionShared>,
    /// Completed memory window binds by work request id, until their binder takes them.
    binds: Mutex<HashMap<u64, WorkCompletionStatus>>,
}

/// Hands one polled completion to its queue pair: a window bind's outcome is recorded for its
/// binder; anything else retires the in-flight entries up to the one it names.
pub(crate) fn deliver(
    queue_pair: &QueuePairShared,
    work_request_id: u64,
    status: WorkCompletionStatus,
) {
    if work_request_id & BIND_REQUEST_FLAG == 0 {
        queue_pair.complete_through(work_request_id, status);
        return;
    }
    if let Some(nic) = queue_pair.provider.as_any().downcast_ref::<NicQueuePair>() {
        lock(&nic.binds).insert(work_request_id, status);
    }
    if status != WorkCompletionStatus::Success {
        queue_pair.mark_error();
    }
}

impl NicQueuePair {
    /// Polls the NIC's CQ from this thread until `done` holds or `limit` passes; true when it
    /// held. On a multi-threaded tokio runtime the wait runs through `block_in_place`, so the
    /// worker's other tasks move to other workers meanwhile (the server also runs its drains on
    /// the blocking pool, and its binds through `block_in_place`).
    fn poll_until(&self, limit: Duration, done: impl FnMut() -> bool) -> bool {
        let flavor = tokio::runtime::Handle::try_current().map(|handle| handle.runtime_flavor());
        match flavor {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {
                tokio::task::block_in_place(|| self.poll_blocking(limit, done))
            }
            _ => self.poll_blocking(limit, done),
        }
    }

    fn poll_blocking(&self, limit: Duration, mut done: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if done() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            if self.completion.poll_and_dispatch() == 0 {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

impl QueuePairProvider for NicQueuePair {
    fn qp_number(&self) -> Option<u32> {
        Some(self.nic.qp_number)
    }

    fn attach(&self, queue_pair: &Arc<QueuePairShared>) {
        self.completion
            .attach(queue_pair.qp_number, Arc::downgrade(queue_pair));
    }

    fn detach(&self, queue_pair: &QueuePairShared) {
        self.completion.detach(queue_pair.qp_number);
    }

    fn endpoint(&self, queue_pair: &QueuePairShared) -> QueuePairEndpoint {
        QueuePairEndpoint::Verbs {
            qp_number: queue_pair.qp_number,
            address: self.nic.address(),
        }
    }

    fn modify_to_init(&self) -> Result<()> {
        self.nic.modify_to_init()
    }

    fn connect<'a>(
        &'a self,
        queue_pair: &'a Arc<QueuePairShared>,
        local: &'a QueuePairEndpoint,
        remote: &'a QueuePairEndpoint,
    ) -> ProviderFuture<'a, Result<()>> {
        Box::pin(async move {
            let QueuePairEndpoint::Verbs { qp_number, address } = remote else {
                return Err(Error::BackendMismatch {
                    local: local.backend(),
                    remote: remote.backend(),
                });
            };
            self.nic
                .connect(*qp_number, address, queue_pair.retry_timeout())
        })
    }

    fn checks_local_buffers(&self) -> bool {
        true
    }

    /// Queues a list for the NIC; the model rings the doorbell after letting the other ready
    /// tasks of this worker queue theirs, so one `ibv_wr_complete` carries all of them (a
    /// system call on rxe, an MMIO write on a hardware NIC). In ERROR nothing reaches the NIC:
    /// every request flushes at once.
    fn submit(
        &self,
        queue_pair: &QueuePairShared,
        entries: &mut dyn Iterator<Item = InFlight>,
    ) -> Submission {
        let mut enqueuer = queue_pair.enqueuer();
        if !enqueuer.sendable {
            drop(enqueuer);
            for entry in entries {
                queue_pair.finish(entry, WorkCompletionStatus::WorkRequestFlushError);
            }
            return Submission::Complete;
        }
        for entry in entries {
            enqueuer.push_for_doorbell(entry);
        }
        Submission::RingAfterYield
    }

    /// Hands every queued entry to the NIC in one list. If the NIC refuses the list (it should
    /// not: the send queue depth bounds what is outstanding), nothing of it was posted: its
    /// first request completes LOC_QP_OP_ERR, the rest flush, and the queue pair moves to
    /// ERROR.
    fn ring(&self, queue_pair: &QueuePairShared) {
        let mut requester = lock(&queue_pair.requester);
        if requester.unposted == 0 {
            return;
        }
        let refused = if requester.state == QueuePairState::ReadyToSend {
            let first = requester.in_flight.len() - requester.unposted;
            let posted = self.nic.post(
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
                        qp_number = queue_pair.qp_number,
                        "the NIC refused posted requests; the queue pair moves to ERROR"
                    );
                    queue_pair.set_state_locked(&mut requester, QueuePairState::Error);
                    Some(WorkCompletionStatus::LocalQueuePairOperationError)
                }
            }
        } else {
            None
        };
        let never_posted = requester.take_unposted();
        drop(requester);
        if refused.is_some() {
            self.nic.modify_to_error();
        }
        for (index, entry) in never_posted.into_iter().enumerate() {
            let status = match refused {
                Some(status) if index == 0 => status,
                _ => WorkCompletionStatus::WorkRequestFlushError,
            };
            queue_pair.finish(entry, status);
        }
    }

    fn completes_flushes(&self) -> bool {
        true
    }

    fn modify_to_error(&self) {
        self.nic.modify_to_error();
    }

    fn nic_in_error(&self) -> bool {
        self.nic.query_state() == Some(QueuePairState::Error)
    }

    /// Binds a fresh NIC window (any earlier one is deallocated, which revokes its key) and
    /// waits for the bind's completion, polling the CQ for at most 2 × `retry_timeout`.
    fn bind_memory_window(
        &self,
        queue_pair: &QueuePairShared,
        window: &MemoryWindow,
        region: &MemoryRegion,
        (address, length): (u64, u64),
        access: AccessFlags,
    ) -> Option<Result<RemoteKey>> {
        Some(self.bind(queue_pair, window, region, address, length, access))
    }

    /// The NIC flushes what is outstanding; polls until every entry has its completion, for
    /// at most `retry_timeout` + 1 s, then completes what is left as flushed.
    fn drain(&self, queue_pair: &QueuePairShared) {
        let limit = queue_pair.retry_timeout() + Duration::from_secs(1);
        let drained = self.poll_until(limit, || lock(&queue_pair.requester).in_flight.is_empty());
        if !drained {
            let outstanding = queue_pair.flush_outstanding();
            tracing::warn!(
                qp_number = queue_pair.qp_number,
                outstanding,
                "the NIC did not flush every request within {limit:?}; completed them as flushed"
            );
        }
    }

    /// Requests the NIC has not completed yet: the drain polls for their flushes.
    fn drain_may_wait(&self, queue_pair: &QueuePairShared) -> bool {
        !lock(&queue_pair.requester).in_flight.is_empty()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl NicQueuePair {
    /// See [`QueuePairProvider::bind_memory_window`].
    fn bind(
        &self,
        queue_pair: &QueuePairShared,
        window: &MemoryWindow,
        region: &MemoryRegion,
        address: u64,
        length: u64,
        access: AccessFlags,
    ) -> Result<RemoteKey> {
        static NEXT_BIND: AtomicU64 = AtomicU64::new(0);

        let registered = region
            .registration()
            .and_then(|registration| registration.downcast_ref::<VerbsRegion>())
            .ok_or_else(|| Error::ObjectMismatch {
                reason: "the region is not registered with the NIC of this queue pair".into(),
            })?;
        // A bind takes a send queue slot like any work request, until its completion.
        let _slot = queue_pair
            .permits
            .try_hold()
            .ok_or_else(|| Error::InvalidWorkRequest {
                qp_number: queue_pair.qp_number,
                reason: "the send queue is full: a window bind needs a free slot".into(),
            })?;
        let mut binding = lock(&window.binding);
        drop(binding.take());
        let nic_window = VerbsWindow::allocate(&self.nic.context.protection_domain)?;
        let work_request_id = BIND_REQUEST_FLAG | NEXT_BIND.fetch_add(1, Ordering::Relaxed);
        let key = self.nic.post_bind(
            work_request_id,
            &nic_window,
            registered,
            address,
            length,
            access,
        )?;
        let limit = queue_pair.retry_timeout() * 2;
        let mut status = None;
        self.poll_until(limit, || {
            status = lock(&self.binds).remove(&work_request_id);
            status.is_some()
        });
        match status {
            Some(WorkCompletionStatus::Success) => {
                // The window keeps its region registered while it may be used.
                *binding = Some(Box::new((nic_window, region.clone())));
                window.set_key(key);
                tracing::debug!(
                    remote_key = key,
                    address,
                    length,
                    qp_number = queue_pair.qp_number,
                    "bound memory window"
                );
                Ok(RemoteKey {
                    key,
                    address,
                    length,
                })
            }
            Some(status) => Err(Error::WorkCompletion {
                qp_number: queue_pair.qp_number,
                work_request_id,
                status,
            }),
            None => Err(Error::VerbsCall {
                operation: "bind a memory window",
                qp_number: Some(queue_pair.qp_number),
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no completion for the bind within {limit:?}"),
                ),
            }),
        }
    }
}
