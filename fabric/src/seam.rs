//! The provider seam: what a provider implements, and all the model knows of one.
//!
//! The model (device, protection, completion queue, queue pair) keeps everything every
//! provider shares: the protection table, the queue pair state machine, the ordered in-flight
//! queue that keeps buffers alive until their completion, per-list futures, gauges. A provider
//! adds the transport. The model holds a provider only as a [`DeviceProvider`] or a
//! [`QueuePairProvider`] trait object, or as an opaque [`ProviderObject`] (a NIC's CQ, region or
//! window binding), and never imports a provider module. Providers import the model. The one
//! place that names every provider is `provider/mod.rs` (`Device::open`).
//!
//! A trait object, not an enum of per-provider objects: an enum would make the model name
//! every provider's type (and carry a `cfg` per verbs arm), which is the import the seam
//! exists to remove. The cost is one indirect call per post, against a list's allocation and a
//! system call or a NIC doorbell; `docs/architecture.md` argues it with rdma-core's
//! `verbs_context_ops` and libfabric's provider ops tables, which make the same choice.

use std::any::Any;
use std::fmt::Debug;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use crate::capabilities::Capabilities;
use crate::completion::CompletionQueueInner;
use crate::device::{DeviceConfig, DeviceInner};
use crate::direct::DirectAccess;
use crate::error::Result;
use crate::memory::PinnedMemory;
use crate::protection::{MemoryRegion, MemoryWindow, ProtectionEntry};
use crate::queue_pair::{InFlight, InlineOutcome, QueuePairConfig, QueuePairShared};
use crate::revocation::RequesterInside;
use crate::types::{AccessFlags, Backend, QueuePairEndpoint, RemoteKey, WorkRequest};

/// A provider's own object behind a model object (a NIC's CQ, a region's registration, a
/// window's binding). The model only keeps it alive and drops it; its provider downcasts it.
pub(crate) type ProviderObject = Box<dyn Any + Send + Sync>;

/// A boxed future, for the rare asynchronous provider calls (connect).
pub(crate) type ProviderFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A region registered with a NIC that chooses its own keys.
pub(crate) struct NicRegion {
    /// The lkey.
    pub(crate) local_key: u32,
    /// The rkey.
    pub(crate) remote_key: u32,
    /// The registration; dropped (deregistered) before the model releases the memory.
    pub(crate) registration: ProviderObject,
}

/// A provider's copy of a device's model-chosen keys, kept in step by the protection table
/// (the `shm` provider's shared key state, which requesters in other processes read).
pub(crate) trait KeyMirror: Send + Sync + Debug {
    /// A key was created.
    ///
    /// # Errors
    /// The provider's, e.g. a full shared key table or memory that cannot be shared.
    fn publish(&self, key: u32, entry: &ProtectionEntry) -> Result<()>;

    /// A key is revoked: returns once no requester can still be using it, or, past the
    /// retry timeout, with the requester still inside a request that may use it
    /// ([`RequesterInside`]).
    fn revoke(&self, key: u32) -> Option<RequesterInside>;
}

/// What a post's requests need after [`QueuePairProvider::submit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Submission {
    /// Everything is done: the requests ran, or were handed to the transport.
    Complete,
    /// Queued for the doorbell: the model yields once so that other ready tasks of the worker
    /// queue theirs, then calls [`QueuePairProvider::ring`] (also when the post's future is
    /// dropped during the yield) and [`QueuePairProvider::after_ring`].
    RingAfterYield,
    /// The doorbell rang inside `submit` (the provider ran the requests on the posting thread),
    /// or a ring already due will carry these requests (an earlier post of the same batch
    /// yields to ring it): the model calls [`QueuePairProvider::after_ring`] and does not
    /// yield.
    Rang,
    /// The queue pair has no connection: nothing was taken from the iterator.
    NotConnected,
}

/// One device's provider: a NIC of one backend.
pub(crate) trait DeviceProvider: Send + Sync + Debug + 'static {
    /// Which backend it is.
    fn backend(&self) -> Backend;

    /// What the provider states about itself (its module's `CAPABILITIES`, which
    /// `Backend::capabilities` also answers): no default, so every provider states its own.
    fn capabilities(&self) -> Capabilities;

    /// Called once the device's shared state exists (a soft NIC starts listening here).
    ///
    /// # Errors
    /// The provider's, e.g. [`crate::Error::BindListener`].
    fn start(&self, _device: &Arc<DeviceInner>) -> Result<()> {
        Ok(())
    }

    /// The address the NIC accepts connections on, if it listens.
    fn listen_address(&self) -> Option<SocketAddr> {
        None
    }

    /// The Unix-domain socket an `shm` device offers its memory on, if it does.
    fn socket_path(&self) -> Option<std::path::PathBuf> {
        None
    }

    /// The NIC's engine threads serving incoming connections (zero where the NIC has none of
    /// its own, or the kernel's driver does the work).
    fn engine_threads(&self) -> usize {
        0
    }

    /// Incoming connections whose hello the NIC is reading now.
    fn hellos_pending(&self) -> usize {
        0
    }

    /// The NIC's completion queue behind a model CQ of `capacity` entries, if the NIC has one.
    ///
    /// # Errors
    /// The NIC's, e.g. [`crate::Error::VerbsCall`].
    fn create_completion_queue(
        &self,
        _capacity: usize,
        _config: &DeviceConfig,
    ) -> Result<Option<ProviderObject>> {
        Ok(None)
    }

    /// Registers memory with the NIC when the NIC keeps its own keys; `None` when the model's
    /// protection table is the NIC's (emulated providers).
    ///
    /// # Errors
    /// The NIC's, e.g. [`crate::Error::VerbsCall`].
    fn register(
        &self,
        _memory: &Arc<PinnedMemory>,
        _offset: u64,
        _length: u64,
        _access: AccessFlags,
    ) -> Result<Option<NicRegion>> {
        Ok(None)
    }

    /// The provider's part of a new queue pair whose completions go to `completion_queue`.
    ///
    /// # Errors
    /// The provider's, e.g. [`crate::Error::ObjectMismatch`] for a CQ of another NIC.
    fn create_queue_pair(
        &self,
        device: &DeviceInner,
        completion_queue: &CompletionQueueInner,
        config: QueuePairConfig,
    ) -> Result<Box<dyn QueuePairProvider>>;

    /// For the provider's own downcasts (its listener finding its queue pairs' parts).
    fn as_any(&self) -> &dyn Any;
}

/// One queue pair's provider part: how its requests reach the responder.
///
/// Every method gets the model's queue pair, whose requester bookkeeping a provider calls back
/// into (`queue_pair.rs`). The contract of a post:
///
/// 1. [`QueuePairProvider::submit`] queues every entry it takes through
///    `QueuePairShared::enqueuer()`: `Enqueuer::push` gives the entry its sequence number, puts
///    it on the in-flight queue (which keeps its buffer alive) and returns it when it is to be
///    sent now; `push_for_doorbell` instead leaves it for [`QueuePairProvider::ring`] (the
///    unposted tail). If `Enqueuer::sendable` is false the queue pair is not RTS: push the
///    entries anyway and call `enter_error`, which flushes them.
/// 2. Each request then completes exactly once, from the in-flight queue, in order:
///    `on_response(sequence, status, payload)` for an emulated responder's answer (it writes
///    READ data and atomic originals into the local buffer), or `complete_through(sequence,
///    status)` for a NIC's completion (it retires the unsignaled entries before it too).
///    After a successful response, `settle_local_failures` completes a queued local failure
///    that reached the head. Never call `finish` on an entry that is on the in-flight queue:
///    it reports a completion without dequeuing it.
/// 3. A lost peer is `fail_unanswered` (the oldest request completes RETRY_EXC_ERR, the rest
///    flush); any other transport failure is `enter_error`.
///
/// Entries left in the iterator by `submit` are dropped unposted: their send queue slots are
/// not returned and their list's future never resolves. Take them all (or return
/// [`Submission::NotConnected`] before taking any).
pub(crate) trait QueuePairProvider: Send + Sync + Debug + 'static {
    /// The queue pair number when the NIC assigns it; `None` lets the model number it.
    fn qp_number(&self) -> Option<u32> {
        None
    }

    /// Called once after the model's queue pair exists (a NIC routes its completions here).
    fn attach(&self, _queue_pair: &Arc<QueuePairShared>) {}

    /// Called when the queue pair is destroyed, after its drain.
    fn detach(&self, _queue_pair: &QueuePairShared) {}

    /// What a peer needs to connect to this queue pair.
    fn endpoint(&self, queue_pair: &QueuePairShared) -> QueuePairEndpoint;

    /// RESET → INIT on the NIC, if it has a state of its own.
    ///
    /// # Errors
    /// The NIC's.
    fn modify_to_init(&self) -> Result<()> {
        Ok(())
    }

    /// Connects to `remote` (the model has checked that it is this provider's endpoint kind
    /// and moved the queue pair to RTR).
    fn connect<'a>(
        &'a self,
        queue_pair: &'a Arc<QueuePairShared>,
        local: &'a QueuePairEndpoint,
        remote: &'a QueuePairEndpoint,
    ) -> ProviderFuture<'a, Result<()>>;

    /// Whether the NIC checks local buffers itself (the model then only keeps valid buffers
    /// alive and never fails a request locally).
    fn checks_local_buffers(&self) -> bool {
        false
    }

    /// Takes the entries of one post (their sequence numbers are not assigned yet) and sends
    /// them, runs them, or queues them for [`QueuePairProvider::ring`].
    fn submit(
        &self,
        queue_pair: &QueuePairShared,
        entries: &mut dyn Iterator<Item = InFlight>,
    ) -> Submission;

    /// Rings the doorbell: hands what [`QueuePairProvider::submit`] queued to the transport.
    fn ring(&self, _queue_pair: &QueuePairShared) {}

    /// Runs a whole checked list on the posting thread, when the provider completes inside
    /// the post and nothing of this queue pair is queued or running, so that the list is the
    /// queue pair's next: no in-flight entries, no completion entries, no wake-up
    /// (`QueuePair::post_inline`). A failed request moves the queue pair to ERROR as its
    /// completion would (`enter_error`, `responder_stopped`) and ends the list. `None`: not
    /// now (another thread runs this queue pair's requests, some are queued, the peer is
    /// gone); the caller posts the list the ordinary way.
    fn run_inline(
        &self,
        _queue_pair: &QueuePairShared,
        _list: &[WorkRequest],
    ) -> Option<InlineOutcome> {
        None
    }

    /// Runs `work` with direct access to the responder's memory, when the provider's requester
    /// shares it and nothing of this queue pair is queued or running (`QueuePair::direct`,
    /// `direct.rs`). `false`: not now (or never, for this provider); `work` was not called.
    /// `now`: the caller's clock, read just before.
    fn run_direct(
        &self,
        _queue_pair: &QueuePairShared,
        _now: std::time::Instant,
        _work: &mut dyn FnMut(&mut dyn DirectAccess),
    ) -> bool {
        false
    }

    /// Rings the doorbell unless that would wait for another thread; `false`: not rung, the
    /// post yields once more and tries again (what it queued may have been handed on by that
    /// other thread meanwhile).
    fn try_ring(&self, queue_pair: &QueuePairShared) -> bool {
        self.ring(queue_pair);
        true
    }

    /// After the doorbell of a post rang.
    fn after_ring(&self, _queue_pair: &QueuePairShared) {}

    /// Whether the NIC completes every request handed to it, also on ERROR (flush
    /// completions): the model then retires only entries never handed to it.
    fn completes_flushes(&self) -> bool {
        false
    }

    /// The queue pair moved to ERROR: stop the transport (close a connection, move the NIC's
    /// queue pair to ERROR).
    fn modify_to_error(&self) {}

    /// Whether the NIC moved the queue pair to ERROR on its own.
    fn nic_in_error(&self) -> bool {
        false
    }

    /// Binds `window` over part of `region` when the NIC binds windows itself; `None` lets
    /// the model bind it in the protection table.
    fn bind_memory_window(
        &self,
        _queue_pair: &QueuePairShared,
        _window: &MemoryWindow,
        _region: &MemoryRegion,
        _range: (u64, u64),
        _access: AccessFlags,
    ) -> Option<Result<RemoteKey>> {
        None
    }

    /// After ERROR: waits until the NIC has completed every request handed to it (the model
    /// then waits for the responder side). Blocking, bounded by the provider.
    fn drain(&self, _queue_pair: &QueuePairShared) {}

    /// After [`QueuePairProvider::drain`]: whether no request of this queue pair can still run.
    /// Only a provider whose requester runs requests itself, in another process, can say no:
    /// a requester stopped inside a request past the drain's bound may resume and finish it.
    fn requester_out(&self, _queue_pair: &QueuePairShared) -> bool {
        true
    }

    /// Whether [`QueuePairProvider::drain`] could wait now (requests outstanding on a NIC, a
    /// requester in another process that may be inside a request): a queue pair dropped inside
    /// a tokio runtime is then drained on a thread of its own (`Drop for QueuePair`).
    fn drain_may_wait(&self, _queue_pair: &QueuePairShared) -> bool {
        false
    }

    /// For the provider's own downcasts.
    fn as_any(&self) -> &dyn Any;
}
