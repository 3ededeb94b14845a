//! One client connection: the HMAC handshake, the client's queue pair and memory windows, heap
//! chunks, heartbeats, and teardown in the order the design fixes.
//!
//! Teardown (disconnect, lease expiry, queue pair ERROR, server shutdown, or any control error):
//!
//! 1. move the queue pair to ERROR;
//! 2. drain it, so no request of this client is executing;
//! 3. invalidate its memory windows (its rkeys now fail with REM_ACCESS_ERR);
//! 4. destroy the queue pair;
//! 5. seal its chunks, which the collector reclaims once nothing references them.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::RngCore;
use rdkv_common::protocol::{
    read_frame, verify_proof, write_frame, ClientMessage, ConnectionKeys, Purpose, ServerMessage,
    Welcome, PROOF_LENGTH, PROTOCOL_VERSION,
};
use rdkv_common::ControlError;
use rdkv_fabric::{
    AccessFlags, CompletionQueue, MemoryWindow, QueuePair, QueuePairConfig, QueuePairState,
};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::config::ServerConfig;
use crate::heap::Heap;
use crate::stats::Counters;
use crate::table::TableRegion;

/// The send queue depth of a server queue pair: the server posts only window binds, one at a
/// time, on it (clients post their one-sided requests on their own queue pairs).
pub(crate) const SEND_QUEUE_DEPTH: u32 = 4;

/// How long a client has for each handshake step.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a connection checks its lease and its queue pair.
const CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// What every connection shares.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The configuration.
    pub(crate) config: ServerConfig,
    /// The registered table.
    pub(crate) table: TableRegion,
    /// Heap chunks.
    pub(crate) heap: Heap,
    /// Counters.
    pub(crate) counters: Counters,
    /// The completion queue of every client queue pair (the server posts nothing on them).
    pub(crate) completion_queue: CompletionQueue,
    /// The next connection id.
    pub(crate) next_connection: AtomicU64,
    /// Moves live blocks out of sparse chunks.
    pub(crate) compactor: crate::compactor::Compactor,
}

/// Serves one control connection until it ends, then tears its resources down.
pub(crate) async fn serve(
    shared: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    shutdown: CancellationToken,
) {
    let connection_id = shared.next_connection.fetch_add(1, Ordering::Relaxed);
    let span = tracing::info_span!("connection", node = shared.config.node_id, connection = connection_id, %peer);
    async move {
        shared.counters.connections.fetch_add(1, Ordering::Relaxed);
        let _ = stream.set_nodelay(true);
        let mut session = Session {
            shared: shared.clone(),
            connection_id,
            queue_pair: None,
            windows: Vec::new(),
            chunk_window: None,
            retired_chunk_windows: VecDeque::new(),
        };
        let reason = session.run(stream, shutdown).await;
        shared.counters.connections.fetch_sub(1, Ordering::Relaxed);
        tracing::info!(%reason, "connection closed");
    }
    .instrument(span)
    .await;
}

/// One connection's server-side resources.
struct Session {
    /// Everything shared.
    shared: Arc<Shared>,
    /// This connection's id.
    connection_id: u64,
    /// The client's queue pair, created only after authentication.
    queue_pair: Option<QueuePair>,
    /// Index and heap READ windows, bound to the queue pair.
    windows: Vec<MemoryWindow>,
    /// The WRITE window over the client's current chunk.
    chunk_window: Option<MemoryWindow>,
    /// WRITE windows of sealed chunks, kept for one operation deadline so that writes the
    /// client placed before the seal can land; revoked after that, long before the collector
    /// may reuse the chunk (it waits at least two quarantines of 1.25 deadlines after the seal).
    retired_chunk_windows: VecDeque<(MemoryWindow, Instant)>,
}

/// Reads frames on its own task, so the session's select loop stays cancellation-safe.
async fn read_messages(
    mut reader: OwnedReadHalf,
    messages: mpsc::Sender<Result<ClientMessage, ControlError>>,
) {
    loop {
        let message = read_frame::<_, ClientMessage>(&mut reader).await;
        let stop = message.is_err();
        if messages.send(message).await.is_err() || stop {
            return;
        }
    }
}

impl Session {
    async fn run(&mut self, stream: TcpStream, shutdown: CancellationToken) -> String {
        let (reader, mut writer) = stream.into_split();
        let (sender, mut messages) = mpsc::channel(16);
        let reader_task = tokio::spawn(read_messages(reader, sender));
        let reason = match self.handshake(&mut writer, &mut messages).await {
            Ok(()) => {
                self.serve_requests(&mut writer, &mut messages, &shutdown)
                    .await
            }
            Err(reason) => reason,
        };
        // Tear down before the socket closes, so a client that sees the close knows its keys
        // are already revoked.
        self.teardown();
        reader_task.abort();
        let _ = reader_task.await;
        drop(writer);
        reason
    }

    async fn next_message(
        messages: &mut mpsc::Receiver<Result<ClientMessage, ControlError>>,
    ) -> Result<ClientMessage, String> {
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, messages.recv()).await {
            Err(_) => Err("handshake timed out".into()),
            Ok(None) => Err("client disconnected".into()),
            Ok(Some(Err(error))) => Err(format!("bad frame: {error}")),
            Ok(Some(Ok(message))) => Ok(message),
        }
    }

    async fn send(writer: &mut OwnedWriteHalf, message: &ServerMessage) -> Result<(), String> {
        write_frame(writer, message)
            .await
            .map_err(|error| format!("send: {error}"))
    }

    /// Tells the client why it is refused (best effort) and returns the reason for the log.
    async fn refuse(writer: &mut OwnedWriteHalf, reason: String) -> String {
        let _ = Self::send(
            writer,
            &ServerMessage::Refused {
                reason: reason.clone(),
            },
        )
        .await;
        reason
    }

    async fn handshake(
        &mut self,
        writer: &mut OwnedWriteHalf,
        messages: &mut mpsc::Receiver<Result<ClientMessage, ControlError>>,
    ) -> Result<(), String> {
        let shared = self.shared.clone();
        let mut nonce = [0u8; PROOF_LENGTH];
        rand::thread_rng().fill_bytes(&mut nonce);
        Self::send(
            writer,
            &ServerMessage::Challenge {
                protocol_version: PROTOCOL_VERSION,
                nonce,
                node_id: shared.config.node_id,
            },
        )
        .await?;
        let ClientMessage::Authenticate {
            protocol_version,
            purpose,
            proof,
            client_name,
        } = Self::next_message(messages).await?
        else {
            return Err("the first message was not Authenticate".into());
        };
        if protocol_version != PROTOCOL_VERSION {
            let reason = format!(
                "protocol version mismatch: the server speaks {PROTOCOL_VERSION}, the client {protocol_version}; upgrade the older side"
            );
            return Err(Self::refuse(writer, reason).await);
        }
        if !verify_proof(&shared.config.secret, &nonce, &proof) {
            shared
                .counters
                .authentication_failures
                .fetch_add(1, Ordering::Relaxed);
            let reason =
                "authentication failed: the client's secret does not match this cluster's secret"
                    .to_string();
            return Err(Self::refuse(writer, reason).await);
        }
        tracing::info!(%client_name, ?purpose, "client authenticated");
        if purpose == Purpose::Monitor {
            return Self::send(
                writer,
                &ServerMessage::MonitorReady {
                    node_id: shared.config.node_id,
                },
            )
            .await;
        }

        // Only an authenticated client gets a queue pair and keys.
        let table = &shared.table;
        let queue_pair = table
            .domain
            .create_queue_pair(
                &shared.completion_queue,
                QueuePairConfig {
                    max_send_wr: SEND_QUEUE_DEPTH,
                },
            )
            .map_err(|error| format!("create queue pair: {error}"))?;
        queue_pair
            .modify_to_init()
            .map_err(|error| format!("init queue pair: {error}"))?;
        let welcome = Welcome {
            connection_id: self.connection_id,
            geometry: table.geometry,
            server_endpoint: queue_pair.endpoint(),
            lease_timeout_ms: shared.config.lease_timeout.as_millis() as u64,
            operation_deadline_ms: shared.config.operation_deadline.as_millis() as u64,
        };
        self.queue_pair = Some(queue_pair);
        Self::send(writer, &ServerMessage::Welcome(Box::new(welcome))).await?;

        let ClientMessage::ConnectQueuePair { endpoint } = Self::next_message(messages).await?
        else {
            return Err("expected ConnectQueuePair after Welcome".into());
        };
        let Some(queue_pair) = &self.queue_pair else {
            return Err("queue pair vanished".into());
        };
        queue_pair
            .connect(&endpoint)
            .await
            .map_err(|error| format!("connect queue pair: {error}"))?;
        // Bind in RTS: a type-2 bind is a work request on the send queue.
        let bind = |access: AccessFlags, address: u64, length: u64| {
            let window = table.domain.allocate_memory_window();
            queue_pair
                .bind_memory_window(&window, &table.region, address, length, access)
                .map(|key| (window, key))
                .map_err(|error| format!("bind memory window: {error}"))
        };
        let (index_window, index_key) = bind(
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
            table.index_address(),
            table.geometry.index_size(),
        )?;
        let (heap_window, heap_key) = bind(
            AccessFlags::REMOTE_READ,
            table.heap_address(),
            table.geometry.heap_size,
        )?;
        self.windows = vec![index_window, heap_window];
        tracing::debug!(
            index_key = index_key.key,
            heap_key = heap_key.key,
            qp_number = queue_pair.qp_number(),
            "keys issued"
        );
        Self::send(
            writer,
            &ServerMessage::QueuePairReady(ConnectionKeys {
                index_key,
                heap_key,
            }),
        )
        .await
    }

    async fn serve_requests(
        &mut self,
        writer: &mut OwnedWriteHalf,
        messages: &mut mpsc::Receiver<Result<ClientMessage, ControlError>>,
        shutdown: &CancellationToken,
    ) -> String {
        let shared = self.shared.clone();
        let lease = shared.config.lease_timeout;
        let mut last_heard = Instant::now();
        let mut checks = tokio::time::interval(CHECK_INTERVAL);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return "server shutting down".into(),
                _ = checks.tick() => {
                    self.revoke_retired_windows();
                    if last_heard.elapsed() > lease {
                        return format!("lease expired (nothing heard for {lease:?})");
                    }
                    if self.queue_pair.as_ref().is_some_and(|queue_pair| queue_pair.state() == QueuePairState::Error) {
                        return "queue pair entered ERROR".into();
                    }
                }
                message = messages.recv() => {
                    let message = match message {
                        None | Some(Err(ControlError::Closed)) => return "client disconnected".into(),
                        Some(Err(error)) => return format!("bad frame: {error}"),
                        Some(Ok(message)) => message,
                    };
                    last_heard = Instant::now();
                    shared.counters.control_messages.fetch_add(1, Ordering::Relaxed);
                    let reply = match message {
                        ClientMessage::AllocateChunk if self.queue_pair.is_some() => self.allocate_chunk(),
                        ClientMessage::Heartbeat { counters } => {
                            shared.counters.add_client_report(&counters);
                            ServerMessage::HeartbeatAck
                        }
                        ClientMessage::Stats => ServerMessage::Stats(shared.counters.snapshot(
                            shared.config.node_id,
                            &shared.table,
                            &shared.heap,
                        )),
                        ClientMessage::Goodbye => return "client said goodbye".into(),
                        other => {
                            let reason = format!("unexpected message after the handshake: {other:?}");
                            return Self::refuse(writer, reason).await;
                        }
                    };
                    if let Err(reason) = Self::send(writer, &reply).await {
                        return reason;
                    }
                }
            }
        }
    }

    fn allocate_chunk(&mut self) -> ServerMessage {
        if let Some(window) = self.chunk_window.take() {
            self.retired_chunk_windows
                .push_back((window, Instant::now()));
        }
        self.revoke_retired_windows();
        let shared = &self.shared;
        let Some(queue_pair) = &self.queue_pair else {
            return ServerMessage::Refused {
                reason: "no queue pair".into(),
            };
        };
        let geometry = &shared.table.geometry;
        let Some(chunk) = shared.heap.allocate(self.connection_id) else {
            return ServerMessage::ChunkUnavailable {
                reclaimable: shared.heap.reclaimable_chunks(crate::compactor::MAX_LIVE_SHARE),
                reason: format!(
                    "heap full: all {} chunks of {} bytes are in use or quarantined; raise heap_size",
                    geometry.chunk_count(),
                    geometry.chunk_size
                ),
            };
        };
        let heap_offset = chunk * geometry.chunk_size;
        let window = shared.table.domain.allocate_memory_window();
        match queue_pair.bind_memory_window(
            &window,
            &shared.table.region,
            shared.table.heap_address() + heap_offset,
            geometry.chunk_size,
            AccessFlags::REMOTE_WRITE,
        ) {
            Ok(key) => {
                self.chunk_window = Some(window);
                ServerMessage::Chunk {
                    chunk,
                    heap_offset,
                    key,
                }
            }
            Err(error) => ServerMessage::Refused {
                reason: format!("bind chunk window: {error}"),
            },
        }
    }

    /// Revokes the WRITE windows of chunks sealed more than one operation deadline ago.
    fn revoke_retired_windows(&mut self) {
        let deadline = self.shared.config.operation_deadline;
        while let Some((window, sealed_at)) = self.retired_chunk_windows.front() {
            if sealed_at.elapsed() < deadline {
                break;
            }
            window.invalidate();
            self.retired_chunk_windows.pop_front();
        }
    }

    /// The ordered teardown described in the module docs.
    fn teardown(&mut self) {
        if let Some(queue_pair) = &self.queue_pair {
            queue_pair.modify_to_error();
            queue_pair.drain();
        }
        for window in self.windows.drain(..) {
            window.invalidate();
        }
        if let Some(window) = self.chunk_window.take() {
            window.invalidate();
        }
        for (window, _) in self.retired_chunk_windows.drain(..) {
            window.invalidate();
        }
        self.queue_pair = None;
        self.shared.heap.seal_owned_by(self.connection_id);
    }
}
