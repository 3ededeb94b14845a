//! One client connection to one node: the handshake, the queue pair, the registered scratch
//! buffers, the heap chunk cursor, and the control task (requests and heartbeats).
//!
//! Scratch buffers are sub-allocated from one registered block. A [`Scratch`] stays out of the
//! pool until every list posted through it has completed, even when the operation that used it
//! is cancelled: its drop hands the outstanding completion to a task that returns the buffer
//! afterwards.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkv_common::protocol::{
    compute_proof, read_frame, write_frame, ClientMessage, ConnectionKeys, Purpose, ServerMessage,
    ServerStats, Welcome, PROTOCOL_VERSION,
};
use rdkv_common::ControlError;
use rdkv_fabric::lock;
use rdkv_fabric::memory::{HugepagePolicy, PinLimits, PinnedMemory};
use rdkv_fabric::{
    AccessFlags, Backend, Device, DeviceConfig, MemoryRegion, PostedList, QueuePair,
    QueuePairConfig, RemoteKey, VerbsOptions, WorkCompletion, WorkCompletionStatus, WorkRequest,
};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::counters::Counters;
use crate::error::{Error, Result};
use crate::fault::{FaultInjector, Injection, Moment, Step, StepKind};
use crate::progress::Progress;

/// Bytes of one scratch buffer.
pub(crate) const SCRATCH_SIZE: u64 = 64 * 1024;
/// Offset of the bucket area in a scratch buffer (two combined buckets).
pub(crate) const BUCKETS_AT: u64 = 0;
/// Offset of the 8-byte CAS results (up to 32 of them).
pub(crate) const CAS_RESULTS_AT: u64 = 256;
/// Offset of the block to write.
pub(crate) const WRITE_BLOCK_AT: u64 = 512;
/// Offset of the area candidate blocks are read into.
pub(crate) const READ_BLOCKS_AT: u64 = WRITE_BLOCK_AT + 16 * 1024;
/// Bytes of the candidate block area.
pub(crate) const READ_BLOCKS_SIZE: u64 = SCRATCH_SIZE - READ_BLOCKS_AT;
/// How long to wait before asking again for a chunk when the heap's free chunks are all
/// waiting to be reclaimed.
const CHUNK_RETRY_INTERVAL: Duration = Duration::from_millis(10);
/// Operations in flight per connection unless configured otherwise.
pub const DEFAULT_CONCURRENCY: usize = 16;
/// How long connecting and each handshake step may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How a client reaches one node.
#[derive(Debug, Clone)]
pub struct NodeAddress {
    /// The control-plane address.
    pub control_address: SocketAddr,
    /// The fabric the node runs.
    pub fabric: Backend,
}

/// Settings of a client.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The node.
    pub node: NodeAddress,
    /// The cluster secret.
    pub secret: Vec<u8>,
    /// This client's RDMA device, port and GID index (verbs only); by default the
    /// `RDKV_RDMA_DEVICE`, `RDKV_RDMA_PORT` and `RDKV_GID_INDEX` environment variables, else the
    /// first device and an automatic GID.
    pub verbs: VerbsOptions,
    /// How long the client's completion poller busy-polls before it sleeps (verbs; a soft
    /// client's engine task does not spin); zero never spins.
    pub poll_spin: Duration,
    /// A name for the server's logs.
    pub name: String,
    /// Operations in flight at once per connection (each holds one 64 KiB scratch buffer).
    pub concurrency: usize,
    /// The per-operation deadline; the server's when absent. [`crate::Client::connect`] caps it
    /// at the server's, which the server's heap reuse and its clearing of abandoned tentative
    /// slots rely on (a cluster's clients take the cluster file's, which is the nodes' too).
    pub operation_deadline: Option<Duration>,
    /// Stalls or fails chosen steps of operations (tests and chaos experiments; see
    /// [`crate::fault`]). None in production.
    pub fault_injector: Option<Arc<dyn FaultInjector>>,
}

impl ClientConfig {
    /// A configuration for one node.
    pub fn new(control_address: SocketAddr, fabric: Backend, secret: &[u8]) -> Self {
        Self {
            node: NodeAddress {
                control_address,
                fabric,
            },
            secret: secret.to_vec(),
            verbs: VerbsOptions::from_environment(),
            poll_spin: Duration::ZERO,
            name: format!("rdkv-client-{}", std::process::id()),
            concurrency: DEFAULT_CONCURRENCY,
            operation_deadline: None,
            fault_injector: None,
        }
    }
}

/// A request to the control task.
struct ControlRequest {
    /// What to send.
    message: ClientMessage,
    /// Where the reply goes.
    reply: oneshot::Sender<Result<ServerMessage, ControlError>>,
}

/// A chunk the client writes blocks into.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkCursor {
    /// The WRITE key over the chunk.
    pub(crate) key: RemoteKey,
    /// The chunk's offset in the heap.
    pub(crate) heap_offset: u64,
    /// Bytes used.
    pub(crate) used: u64,
}

/// Heap space for one block.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockPlace {
    /// Where to WRITE it.
    pub(crate) remote: RemoteKey,
    /// Offset inside the chunk key's range.
    pub(crate) offset_in_chunk: u64,
    /// The block's heap offset (for the slot).
    pub(crate) heap_offset: u64,
}

/// Stripes of the per-key writer turns (see `NodeConnection::writer_turn`).
const WRITER_STRIPES: usize = 1024;

/// One live connection to a node.
pub(crate) struct NodeConnection {
    /// The node's address.
    pub(crate) address: SocketAddr,
    /// What the server sent after authentication.
    pub(crate) welcome: Welcome,
    /// The keys bound to this connection's server queue pair.
    pub(crate) keys: ConnectionKeys,
    /// The client's queue pair.
    pub(crate) queue_pair: QueuePair,
    /// The registered scratch buffers.
    pub(crate) scratch_region: MemoryRegion,
    /// Free scratch buffers.
    scratch_free: Arc<Mutex<Vec<u64>>>,
    /// Counts free scratch buffers; bounds operations in flight.
    scratch_permits: Arc<Semaphore>,
    /// The current chunk.
    chunk: Mutex<Option<ChunkCursor>>,
    /// One refill at a time: operations that find the chunk full wait for the refill in
    /// progress instead of each asking for a chunk.
    refill: Semaphore,
    /// Writers of one key (by stripe) in this process take turns: they would otherwise only
    /// lose CAS races to each other. Taken before a scratch buffer, never while holding one.
    writer_stripes: Box<[tokio::sync::Mutex<()>]>,
    /// Requests to the control task.
    control: mpsc::Sender<ControlRequest>,
    /// Set when the connection failed; the client then reconnects.
    broken: AtomicBool,
    /// Counters.
    pub(crate) counters: Arc<Counters>,
    /// The configured fault injector (tests only).
    fault_injector: Option<Arc<dyn FaultInjector>>,
    /// The device, kept for the connection's lifetime.
    _device: Device,
}

impl std::fmt::Debug for NodeConnection {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("NodeConnection")
            .field("address", &self.address)
            .field("connection_id", &self.welcome.connection_id)
            .finish()
    }
}

/// Reads one handshake reply, bounded in time.
async fn read_reply(stream: &mut TcpStream) -> Result<ServerMessage, ControlError> {
    tokio::time::timeout(CONNECT_TIMEOUT, read_frame::<_, ServerMessage>(stream))
        .await
        .unwrap_or(Err(ControlError::Unexpected(
            "handshake step timed out".into(),
        )))
}

impl NodeConnection {
    /// Connects, authenticates, connects the queue pair and starts the control task.
    pub(crate) async fn open(config: &ClientConfig, counters: Arc<Counters>) -> Result<Arc<Self>> {
        let address = config.node.control_address;
        let unreachable = |reason: String| Error::NodeUnreachable { address, reason };
        let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address))
            .await
            .map_err(|_| unreachable(format!("no answer within {CONNECT_TIMEOUT:?}")))?
            .map_err(|error| unreachable(error.to_string()))?;
        let _ = stream.set_nodelay(true);
        let step = |message: Result<ServerMessage, ControlError>| -> Result<ServerMessage> {
            message.map_err(|error| unreachable(format!("handshake: {error}")))
        };
        let ServerMessage::Challenge {
            protocol_version,
            nonce,
            ..
        } = step(read_reply(&mut stream).await)?
        else {
            return Err(unreachable(
                "the server did not start with a challenge".into(),
            ));
        };
        if protocol_version != PROTOCOL_VERSION {
            return Err(Error::AuthenticationFailed {
                address,
                reason: format!(
                    "protocol version mismatch: the server speaks {protocol_version}, this client {PROTOCOL_VERSION}"
                ),
            });
        }
        write_frame(
            &mut stream,
            &ClientMessage::Authenticate {
                protocol_version: PROTOCOL_VERSION,
                purpose: Purpose::Data,
                proof: compute_proof(&config.secret, &nonce),
                client_name: config.name.clone(),
            },
        )
        .await?;
        let welcome = match read_reply(&mut stream).await {
            Ok(ServerMessage::Welcome(welcome)) => *welcome,
            Ok(ServerMessage::Refused { reason }) => {
                return Err(Error::AuthenticationFailed { address, reason })
            }
            Ok(other) => return Err(unreachable(format!("unexpected handshake reply {other:?}"))),
            Err(ControlError::Closed) => {
                return Err(Error::AuthenticationFailed {
                    address,
                    reason: "the server closed the connection during authentication".into(),
                })
            }
            Err(error) => return Err(unreachable(format!("handshake: {error}"))),
        };

        let device = Device::open(
            config.node.fabric,
            None,
            &config.verbs,
            DeviceConfig {
                poll_spin: config.poll_spin,
                ..DeviceConfig::default()
            },
        )?;
        let domain = device.allocate_protection_domain();
        let completion_queue = device.create_completion_queue(1024)?;
        let queue_pair = domain.create_queue_pair(&completion_queue, QueuePairConfig::default())?;
        let slots = config.concurrency.max(1) as u64;
        let memory = Arc::new(PinnedMemory::allocate(
            slots * SCRATCH_SIZE,
            HugepagePolicy::Off,
            PinLimits::default(),
        )?);
        let scratch_region = domain.register_all(&memory, AccessFlags::LOCAL_WRITE)?;
        queue_pair.connect(&welcome.server_endpoint).await?;
        write_frame(
            &mut stream,
            &ClientMessage::ConnectQueuePair {
                endpoint: queue_pair.endpoint(),
            },
        )
        .await?;
        let keys = match read_reply(&mut stream).await {
            Ok(ServerMessage::QueuePairReady(keys)) => keys,
            Ok(ServerMessage::Refused { reason }) => return Err(Error::Refused { reason }),
            other => return Err(unreachable(format!("queue pair not ready: {other:?}"))),
        };

        let (control, requests) = mpsc::channel(16);
        let heartbeat =
            Duration::from_millis(welcome.lease_timeout_ms / 3).max(Duration::from_millis(10));
        tokio::spawn(control_task(stream, requests, heartbeat, counters.clone()));
        Ok(Arc::new(Self {
            address,
            welcome,
            keys,
            queue_pair,
            scratch_region,
            scratch_free: Arc::new(Mutex::new((0..slots).collect())),
            scratch_permits: Arc::new(Semaphore::new(slots as usize)),
            chunk: Mutex::new(None),
            refill: Semaphore::new(1),
            writer_stripes: (0..WRITER_STRIPES)
                .map(|_| tokio::sync::Mutex::new(()))
                .collect(),
            control,
            broken: AtomicBool::new(false),
            counters,
            fault_injector: config.fault_injector.clone(),
            _device: device,
        }))
    }

    /// Whether the connection failed.
    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Marks the connection failed.
    pub(crate) fn mark_broken(&self) {
        self.broken.store(true, Ordering::Release);
    }

    /// Sends a control request and waits for its reply.
    pub(crate) async fn control(&self, message: ClientMessage) -> Result<ServerMessage> {
        let (reply, answer) = oneshot::channel();
        let lost = || Error::NodeUnreachable {
            address: self.address,
            reason: "the control connection is closed".into(),
        };
        if self
            .control
            .send(ControlRequest { message, reply })
            .await
            .is_err()
        {
            self.mark_broken();
            return Err(lost());
        }
        match answer.await {
            Ok(Ok(message)) => Ok(message),
            Ok(Err(error)) => {
                self.mark_broken();
                Err(Error::NodeUnreachable {
                    address: self.address,
                    reason: error.to_string(),
                })
            }
            Err(_) => {
                self.mark_broken();
                Err(lost())
            }
        }
    }

    /// The server's counters.
    pub(crate) async fn stats(&self) -> Result<ServerStats> {
        match self.control(ClientMessage::Stats).await? {
            ServerMessage::Stats(stats) => Ok(stats),
            ServerMessage::Refused { reason } => Err(Error::Refused { reason }),
            other => Err(Error::Refused {
                reason: format!("unexpected reply {other:?}"),
            }),
        }
    }

    /// Waits for this process's turn to write the key at `location`: writers of one key (and
    /// of the few keys sharing its stripe) go one at a time, so a hot key's writers do not
    /// spend their round trips losing CAS races to each other. Writers in other processes
    /// still race, and lose with a back-off. Take it before [`NodeConnection::scratch`].
    pub(crate) async fn writer_turn(
        &self,
        location: &rdkv_common::layout::KeyLocation,
    ) -> tokio::sync::MutexGuard<'_, ()> {
        let stripe = (location.combined_buckets[0]
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(u64::from(location.fingerprint))
            % self.writer_stripes.len() as u64) as usize;
        self.writer_stripes[stripe].lock().await
    }

    /// Takes a scratch buffer, waiting while all are in use.
    pub(crate) async fn scratch(self: &Arc<Self>, progress: Arc<Progress>) -> Scratch {
        let permit = self
            .scratch_permits
            .clone()
            .acquire_owned()
            .await
            .expect("the scratch semaphore is never closed");
        permit.forget();
        let index = lock(&self.scratch_free)
            .pop()
            .expect("a permit guarantees a free scratch buffer");
        Scratch {
            connection: self.clone(),
            base: index * SCRATCH_SIZE,
            outstanding: None,
            round_trips: 0,
            progress,
        }
    }

    /// Reserves heap space for a block of `length` bytes in the current chunk, asking the
    /// server for a new chunk when it is full.
    pub(crate) async fn place_block(&self, length: u64) -> Result<BlockPlace> {
        loop {
            if let Some(place) = self.take_from_chunk(length) {
                return Ok(place);
            }
            let _refilling = self
                .refill
                .acquire()
                .await
                .expect("the refill semaphore is never closed");
            // Another operation may have refilled while this one waited.
            if let Some(place) = self.take_from_chunk(length) {
                return Ok(place);
            }
            match self.control(ClientMessage::AllocateChunk).await? {
                ServerMessage::Chunk {
                    heap_offset, key, ..
                } => {
                    *lock(&self.chunk) = Some(ChunkCursor {
                        key,
                        heap_offset,
                        used: 0,
                    });
                }
                ServerMessage::ChunkUnavailable {
                    reclaimable,
                    reason,
                } => {
                    if reclaimable == 0 {
                        return Err(Error::TableFull { reason });
                    }
                    // Chunks are on their way back; wait for the collector (the operation's
                    // deadline bounds the wait).
                    tokio::time::sleep(CHUNK_RETRY_INTERVAL).await;
                }
                ServerMessage::Refused { reason } => return Err(Error::Refused { reason }),
                other => {
                    return Err(Error::Refused {
                        reason: format!("unexpected reply to AllocateChunk: {other:?}"),
                    })
                }
            }
        }
    }

    fn take_from_chunk(&self, length: u64) -> Option<BlockPlace> {
        let mut chunk = lock(&self.chunk);
        let cursor = chunk.as_mut()?;
        if cursor.used + length > cursor.key.length {
            return None;
        }
        let place = BlockPlace {
            remote: cursor.key,
            offset_in_chunk: cursor.used,
            heap_offset: cursor.heap_offset + cursor.used,
        };
        cursor.used += length;
        Some(place)
    }

    /// Says goodbye; the server tears the connection down in order.
    pub(crate) async fn close(&self) {
        let (reply, answer) = oneshot::channel();
        let sent = self
            .control
            .send(ControlRequest {
                message: ClientMessage::Goodbye,
                reply,
            })
            .await;
        if sent.is_ok() {
            // The control task answers once the last counters and the goodbye are written.
            let _ = tokio::time::timeout(CONNECT_TIMEOUT, answer).await;
        }
        self.mark_broken();
    }
}

/// Owns the control stream: forwards requests in order and heartbeats while idle.
async fn control_task(
    mut stream: TcpStream,
    mut requests: mpsc::Receiver<ControlRequest>,
    heartbeat: Duration,
    counters: Arc<Counters>,
) {
    let mut ticks = tokio::time::interval(heartbeat);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let (message, reply) = tokio::select! {
            request = requests.recv() => match request {
                Some(request) => (request.message, Some(request.reply)),
                None => return,
            },
            _ = ticks.tick() => (ClientMessage::Heartbeat { counters: counters.take_report() }, None),
        };
        let goodbye = message == ClientMessage::Goodbye;
        if goodbye {
            // Report the last counters before leaving.
            let report = ClientMessage::Heartbeat {
                counters: counters.take_report(),
            };
            if write_frame(&mut stream, &report).await.is_ok() {
                let _ = tokio::time::timeout(
                    CONNECT_TIMEOUT,
                    read_frame::<_, ServerMessage>(&mut stream),
                )
                .await;
            }
        }
        let outcome = match write_frame(&mut stream, &message).await {
            Ok(()) if goodbye => {
                if let Some(reply) = reply {
                    let _ = reply.send(Ok(ServerMessage::HeartbeatAck));
                }
                return;
            }
            Ok(()) => {
                tokio::time::timeout(CONNECT_TIMEOUT, read_frame::<_, ServerMessage>(&mut stream))
                    .await
                    .unwrap_or(Err(ControlError::Unexpected(
                        "no reply within the timeout".into(),
                    )))
            }
            Err(error) => Err(error),
        };
        let failed = outcome.is_err();
        if let Some(reply) = reply {
            let _ = reply.send(outcome);
        }
        if failed {
            return;
        }
    }
}

/// A scratch buffer and the posting of lists through it.
pub(crate) struct Scratch {
    /// The connection.
    connection: Arc<NodeConnection>,
    /// Offset of this buffer in the scratch region.
    pub(crate) base: u64,
    /// A posted list not yet completed (set only while awaiting).
    outstanding: Option<PostedList>,
    /// Round trips made through this buffer by the current operation.
    pub(crate) round_trips: u64,
    /// What the current operation has posted (read by the client after a failure or deadline).
    progress: Arc<Progress>,
}

impl Scratch {
    /// The connection.
    pub(crate) fn connection(&self) -> &Arc<NodeConnection> {
        &self.connection
    }

    /// The region.
    pub(crate) fn region(&self) -> &MemoryRegion {
        &self.connection.scratch_region
    }

    /// Posts a list (one step of `operation`) and waits for its completions; counts one round
    /// trip. Any failed status marks the connection broken and is returned as the first failed
    /// status. The connection's fault injector, if any, may stall or fail the step before it is
    /// posted or after it ran.
    pub(crate) async fn execute(
        &mut self,
        operation: &'static str,
        kind: StepKind,
        list: Vec<WorkRequest>,
    ) -> Result<Vec<WorkCompletion>, ExecuteError> {
        let number = self.round_trips as u32;
        let injecting = self.connection.fault_injector.is_some();
        if injecting {
            self.inject(operation, kind, number, Moment::Before).await?;
        }
        let counters = &self.connection.counters;
        counters.round_trips.fetch_add(1, Ordering::Relaxed);
        self.round_trips += 1;
        counters
            .verbs
            .fetch_add(list.len() as u64, Ordering::Relaxed);
        self.progress.posting(kind);
        let posted = match self.connection.queue_pair.post(list).await {
            Ok(posted) => posted,
            Err(error) => {
                self.progress.not_posted(kind);
                return Err(ExecuteError::Post(error));
            }
        };
        self.outstanding = Some(posted);
        let completions = match self.outstanding.as_mut() {
            Some(posted) => posted.await,
            None => Vec::new(),
        };
        self.outstanding = None;
        if let Some(failed) = completions
            .iter()
            .find(|completion| completion.status != WorkCompletionStatus::Success)
        {
            self.connection.mark_broken();
            return Err(ExecuteError::Completion(failed.status));
        }
        if injecting {
            self.inject(operation, kind, number, Moment::After).await?;
        }
        Ok(completions)
    }

    /// The operation's tentative slot is gone (committed, withdrawn, or never placed).
    pub(crate) fn tentative_resolved(&self) {
        self.progress.tentative_resolved();
    }

    /// A CAS of `kind` completed without swapping: count the lost race, and if it was a
    /// publishing CAS, record that it had no effect.
    pub(crate) fn lost_race(&self, kind: StepKind) {
        self.connection
            .counters
            .cas_failures
            .fetch_add(1, Ordering::Relaxed);
        if kind.publishes() {
            self.progress.lost();
        }
    }

    /// Asks the fault injector about one step; an injected failure breaks the connection as a
    /// real one would.
    async fn inject(
        &self,
        operation: &'static str,
        kind: StepKind,
        number: u32,
        moment: Moment,
    ) -> Result<(), ExecuteError> {
        let Some(injector) = &self.connection.fault_injector else {
            return Ok(());
        };
        let step = Step {
            operation,
            kind,
            number,
            moment,
        };
        match injector.inject(&step) {
            Injection::Proceed => Ok(()),
            Injection::Stall(pause) => {
                tokio::time::sleep(pause).await;
                Ok(())
            }
            Injection::WaitFor(gate) => {
                if let Ok(permit) = gate.acquire().await {
                    permit.forget();
                }
                Ok(())
            }
            Injection::Fail(status) => {
                self.connection.mark_broken();
                Err(ExecuteError::Completion(status))
            }
        }
    }
}

/// Why a posted list failed.
#[derive(Debug)]
pub(crate) enum ExecuteError {
    /// The post itself was refused (queue pair not RTS, bad list).
    Post(rdkv_fabric::Error),
    /// A request completed with this status.
    Completion(WorkCompletionStatus),
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let free = self.connection.scratch_free.clone();
        let permits = self.connection.scratch_permits.clone();
        let base = self.base;
        let give_back = move || {
            lock(&free).push(base / SCRATCH_SIZE);
            permits.add_permits(1);
        };
        match self.outstanding.take() {
            None => give_back(),
            // Cancelled while a list was in flight: the NIC may still write into this buffer,
            // so it goes back only after the list completes.
            Some(posted) => match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(async move {
                        posted.await;
                        give_back();
                    });
                }
                Err(_) => std::mem::forget(posted),
            },
        }
    }
}
