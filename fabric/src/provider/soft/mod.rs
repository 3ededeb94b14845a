//! The `soft` backend: a user-space RNIC over TCP.
//!
//! - `listener.rs`: the NIC's listening socket. An accept thread hands each incoming
//!   connection to the engine pool, which reads its hello (deadline-bound, with a bounded
//!   number pending) and attaches it to the named queue pair.
//! - `pool.rs`: a listening NIC's fixed pool of engine threads (`DeviceConfig::engine_threads`,
//!   default one per core), each multiplexing its connections with epoll. No thread per
//!   connection.
//! - `connection.rs`: one TCP connection per connected queue pair pair, and its outgoing
//!   buffer, which concurrent posts coalesce into.
//! - `frames.rs`: the frame processing of one connection: requests run through the responder
//!   engine (server application code never sees them), responses complete our own requests in
//!   order. A dialing-only NIC runs it as a task on the caller's tokio runtime.
//! - `wire.rs`: the wire format.

use std::any::Any;
use std::io::ErrorKind;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::capabilities::Capabilities;
use crate::completion::CompletionQueueInner;
use crate::device::DeviceInner;
use crate::error::{Error, Result};
use crate::lock;
use crate::provider::engine;
use crate::queue_pair::{InFlight, QueuePairConfig, QueuePairShared};
use crate::seam::{DeviceProvider, ProviderFuture, QueuePairProvider, Submission};
use crate::types::{Backend, Opcode, QueuePairEndpoint, SoftEndpoint};

mod connection;
mod frames;
mod listener;
mod pool;
pub(crate) mod wire;

use connection::{FlushMode, SoftConnection};
use frames::{run_engine_task, Engine};
use listener::SoftListener;
use pool::{Arrival, EnginePool, PoolSettings};
use wire::{Hello, HelloStatus, HELLO_ACK_LENGTH};

/// How long a dialer waits to connect and for the listener's acknowledgement.
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Dials of one queue pair when the listener closes before its acknowledgement.
const DIAL_ATTEMPTS: u32 = 3;

/// What soft states (`docs/fabric.md`, *Capabilities*): a queue pair's requests travel on one
/// TCP connection and the peer's engine runs them one after another, so READs come back in
/// order; binds and drains are the model's table and its responder gate, at once.
pub(crate) const CAPABILITIES: Capabilities = Capabilities {
    ordered_reads: true,
    binds_may_block: false,
    teardown_may_block: false,
    completes_inside_post: false,
    shares_memory: false,
    crosses_processes: true,
    responder_connects_first: false,
};

/// A soft NIC: listens (when given an address) and serves its queue pairs' connections.
#[derive(Debug)]
pub(crate) struct SoftDevice {
    /// Where to listen, if anywhere.
    listen: Option<SocketAddr>,
    /// The engine pool, once started (listening NICs only).
    pool: OnceLock<Arc<EnginePool>>,
    /// The listener, once started.
    listener: OnceLock<SoftListener>,
    /// Set while one of the device's engine threads busy-polls (see `DeviceConfig::poll_spin`).
    spinning: AtomicBool,
}

impl SoftDevice {
    /// A soft NIC that listens on `listen` once started (port 0 picks one), or only dials.
    pub(crate) fn new(listen: Option<SocketAddr>) -> Self {
        Self {
            listen,
            pool: OnceLock::new(),
            listener: OnceLock::new(),
            spinning: AtomicBool::new(false),
        }
    }
}

impl DeviceProvider for SoftDevice {
    fn backend(&self) -> Backend {
        Backend::Soft
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn start(&self, device: &Arc<DeviceInner>) -> Result<()> {
        if let Some(address) = self.listen {
            let config = device.config;
            let threads = if config.engine_threads == 0 {
                std::thread::available_parallelism().map_or(1, usize::from)
            } else {
                config.engine_threads
            };
            let settings = PoolSettings {
                threads,
                hello_deadline: config.hello_deadline,
                poll_spin: config.poll_spin,
            };
            let pool = EnginePool::start(
                settings,
                config.max_pending_hellos,
                address.port(),
                Arc::downgrade(device),
            )
            .map(Arc::new)
            .map_err(|source| Error::BindListener { address, source })?;
            let listener = SoftListener::start(address, Arc::downgrade(device), pool.clone())?;
            // Started once: the cells are empty.
            let _ = self.pool.set(pool);
            let _ = self.listener.set(listener);
        }
        Ok(())
    }

    fn listen_address(&self) -> Option<SocketAddr> {
        self.listener.get().map(SoftListener::address)
    }

    fn engine_threads(&self) -> usize {
        self.pool.get().map_or(0, |pool| pool.threads())
    }

    fn hellos_pending(&self) -> usize {
        self.pool.get().map_or(0, |pool| pool.pending.count())
    }

    fn create_queue_pair(
        &self,
        _device: &DeviceInner,
        _completion_queue: &CompletionQueueInner,
        _config: QueuePairConfig,
    ) -> Result<Box<dyn QueuePairProvider>> {
        Ok(Box::new(SoftQueuePair::default()))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The soft part of one queue pair: its connection, once connected.
#[derive(Debug, Default)]
pub(crate) struct SoftQueuePair {
    /// Set once when the queue pair connects.
    connection: OnceLock<Arc<SoftConnection>>,
    /// A connection that arrived before `connect` (passive side), with the source its hello
    /// named (device id, queue pair number).
    pending_stream: Mutex<Option<ParkedStream>>,
    /// The peer `connect` named: a hello from any other source is refused.
    remote: OnceLock<SoftEndpoint>,
}

/// A stream whose hello arrived before its queue pair's `connect`.
#[derive(Debug)]
pub(crate) struct ParkedStream {
    /// The stream, non-blocking.
    pub(crate) stream: TcpStream,
    /// The device id its hello named as its source.
    pub(crate) source_device_id: u64,
    /// The queue pair number its hello named as its source.
    pub(crate) source_qp_number: u32,
}

impl SoftQueuePair {
    /// Whether a hello from (`device_id`, `qp_number`) may attach to this queue pair now:
    /// from the peer `connect` named (when it has been called), and only while the queue
    /// pair has no stream yet. A second hello for a live queue pair is refused like any
    /// other wrong hello, so hellos cannot be used to find live queue pairs.
    pub(crate) fn accepts_hello(
        &self,
        pending: &Option<ParkedStream>,
        device_id: u64,
        qp_number: u32,
    ) -> bool {
        let from_the_peer = self
            .remote
            .get()
            .is_none_or(|remote| remote.device_id == device_id && remote.qp_number == qp_number);
        let free = pending.is_none()
            && self
                .connection
                .get()
                .is_none_or(|connection| !connection.has_stream());
        from_the_peer && free
    }
}

impl QueuePairProvider for SoftQueuePair {
    fn endpoint(&self, queue_pair: &QueuePairShared) -> QueuePairEndpoint {
        let device = queue_pair.device();
        QueuePairEndpoint::Soft(SoftEndpoint {
            device_id: device.id,
            address: device.provider.listen_address(),
            qp_number: queue_pair.qp_number,
        })
    }

    fn connect<'a>(
        &'a self,
        queue_pair: &'a Arc<QueuePairShared>,
        local: &'a QueuePairEndpoint,
        remote: &'a QueuePairEndpoint,
    ) -> ProviderFuture<'a, Result<()>> {
        Box::pin(async move {
            match (local, remote) {
                (QueuePairEndpoint::Soft(local), QueuePairEndpoint::Soft(remote)) => {
                    self.connect_soft(queue_pair, local, remote).await
                }
                _ => Err(Error::BackendMismatch {
                    local: local.backend(),
                    remote: remote.backend(),
                }),
            }
        })
    }

    fn submit(
        &self,
        queue_pair: &QueuePairShared,
        entries: &mut dyn Iterator<Item = InFlight>,
    ) -> Submission {
        let Some(connection) = self.connection.get() else {
            return Submission::NotConnected;
        };
        let mut enqueuer = queue_pair.enqueuer();
        let sendable = enqueuer.sendable;
        let ring = connection.append_post(|buffer| {
            let mut frames = 0;
            for entry in entries {
                if let Some(entry) = enqueuer.push(entry) {
                    encode_request(buffer, entry);
                    frames += 1;
                }
            }
            frames
        });
        drop(enqueuer);
        if !sendable {
            queue_pair.enter_error();
            return Submission::Complete;
        }
        if ring {
            Submission::RingAfterYield
        } else {
            // An earlier post's ring is still to come and writes these frames too (or none
            // were queued: local failures only, which `after_ring` settles).
            Submission::Rang
        }
    }

    fn ring(&self, _queue_pair: &QueuePairShared) {
        if let Some(connection) = self.connection.get() {
            connection.flush();
        }
    }

    fn after_ring(&self, queue_pair: &QueuePairShared) {
        queue_pair.settle_local_failures();
        if self
            .connection
            .get()
            .is_some_and(|connection| connection.is_closed())
        {
            // The peer is gone (or the queue pair is closing): nothing will answer.
            queue_pair.fail_unanswered();
        }
    }

    fn modify_to_error(&self) {
        if let Some(connection) = self.connection.get() {
            connection.stop();
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Whether the local side dials: a side without a listener always dials; otherwise the lower
/// (device id, queue pair number) dials.
fn local_dials(local: &SoftEndpoint, remote: &SoftEndpoint) -> bool {
    match (local.address, remote.address) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some(_), Some(_)) => {
            (local.device_id, local.qp_number) < (remote.device_id, remote.qp_number)
        }
    }
}

impl SoftQueuePair {
    /// Connects a soft queue pair: dials, or waits passively for the peer's dial.
    async fn connect_soft(
        &self,
        queue_pair: &Arc<QueuePairShared>,
        local: &SoftEndpoint,
        remote: &SoftEndpoint,
    ) -> Result<()> {
        let connection = new_connection(queue_pair);
        let _ = self.remote.set(*remote);
        if !local_dials(local, remote) {
            self.await_dial(&connection, queue_pair, local, remote);
            return Ok(());
        }
        let Some(address) = remote.address else {
            return Err(Error::EndpointNotFound {
                reason: format!(
                    "neither queue pair {} nor {} listens: one soft device needs a listen address",
                    local.qp_number, remote.qp_number
                ),
            });
        };
        let connect_error = |source: std::io::Error| Error::ConnectPeer {
            address,
            qp_number: local.qp_number,
            source,
        };
        let hello = Hello {
            target_qp_number: remote.qp_number,
            source_qp_number: local.qp_number,
            source_device_id: local.device_id,
            target_device_id: remote.device_id,
        };
        let (stream, ack) = dial(address, &hello).await.map_err(connect_error)?;
        let status = HelloStatus::decode(&ack);
        if status != HelloStatus::Accepted {
            return Err(Error::EndpointNotFound {
                reason: format!(
                    "soft NIC at {address} refused queue pair {}: {}",
                    remote.qp_number,
                    status.describe()
                ),
            });
        }
        let stream = stream.into_std().map_err(connect_error)?;
        let _ = self.connection.set(connection.clone());
        attach(&connection, stream, queue_pair.clone());
        Ok(())
    }

    /// The passive side: publishes `connection` for the peer's dial to attach to, or attaches
    /// the dial that arrived before this connect, if it came from `remote`.
    fn await_dial(
        &self,
        connection: &Arc<SoftConnection>,
        queue_pair: &Arc<QueuePairShared>,
        local: &SoftEndpoint,
        remote: &SoftEndpoint,
    ) {
        let parked = {
            let mut pending = lock(&self.pending_stream);
            let _ = self.connection.set(connection.clone());
            pending.take()
        };
        if let Some(parked) = parked {
            if parked.source_device_id == remote.device_id
                && parked.source_qp_number == remote.qp_number
            {
                attach(connection, parked.stream, queue_pair.clone());
            } else {
                // It arrived first but is not the peer named here: the peer still dials.
                tracing::debug!(
                    qp_number = local.qp_number,
                    "soft NIC dropped an early connection from another source"
                );
            }
        }
    }
}

/// A queue pair's connection, before it has a stream. A listening NIC serves its connections
/// from its engine pool, which never blocks; a dialing-only NIC from tasks on the caller's
/// runtime.
fn new_connection(queue_pair: &QueuePairShared) -> Arc<SoftConnection> {
    let pooled = queue_pair
        .device()
        .provider
        .as_any()
        .downcast_ref::<SoftDevice>()
        .is_some_and(|soft| soft.pool.get().is_some());
    Arc::new(SoftConnection::new(
        queue_pair.protection_domain.inner.device.clone(),
        if pooled {
            FlushMode::Pooled
        } else {
            FlushMode::Blocking
        },
    ))
}

/// Dials the listener at `address` with `hello`, and reads its acknowledgement. A listener
/// flooded with idle connections may close ours before it reads the hello (it evicts the
/// oldest pending ones): end of stream before the acknowledgement is worth another dial or two
/// ([`DIAL_ATTEMPTS`] in all), not a failed connect.
async fn dial(
    address: SocketAddr,
    hello: &Hello,
) -> std::io::Result<(tokio::net::TcpStream, [u8; HELLO_ACK_LENGTH])> {
    let mut attempts = 0;
    loop {
        attempts += 1;
        match dial_once(address, hello).await {
            Ok(dialed) => return Ok(dialed),
            Err(error)
                if attempts < DIAL_ATTEMPTS
                    && matches!(
                        error.kind(),
                        ErrorKind::UnexpectedEof
                            | ErrorKind::ConnectionReset
                            | ErrorKind::BrokenPipe
                    ) =>
            {
                tracing::debug!(%error, attempts, "soft NIC dial closed before its acknowledgement; dialing again");
            }
            Err(error) => return Err(error),
        }
    }
}

/// One dial of [`dial`]: connects, sends the hello and reads the acknowledgement, each within
/// [`DIAL_TIMEOUT`].
async fn dial_once(
    address: SocketAddr,
    hello: &Hello,
) -> std::io::Result<(tokio::net::TcpStream, [u8; HELLO_ACK_LENGTH])> {
    let mut stream = tokio::time::timeout(DIAL_TIMEOUT, tokio::net::TcpStream::connect(address))
        .await
        .map_err(|_| std::io::Error::from(ErrorKind::TimedOut))??;
    stream.set_nodelay(true)?;
    stream.write_all(&hello.encode()).await?;
    let mut ack = [0u8; HELLO_ACK_LENGTH];
    tokio::time::timeout(DIAL_TIMEOUT, stream.read_exact(&mut ack))
        .await
        .map_err(|_| std::io::Error::from(ErrorKind::TimedOut))??;
    Ok((stream, ack))
}

/// Attaches a connection's stream to it: sets the write side and builds the engine that will
/// read it. `None` when the connection already has a stream.
pub(crate) fn prepare_engine(
    connection: &Arc<SoftConnection>,
    stream: TcpStream,
    queue_pair: Arc<QueuePairShared>,
) -> Option<(Engine, TcpStream)> {
    let reader = match stream.try_clone() {
        Ok(reader) => reader,
        Err(error) => {
            tracing::warn!(%error, "soft NIC could not clone a stream");
            queue_pair.fail_unanswered();
            return None;
        }
    };
    if !connection.set_stream(stream) {
        return None;
    }
    if connection.is_closed() {
        let _ = reader.shutdown(Shutdown::Both);
    }
    Some((Engine::new(queue_pair, connection.clone()), reader))
}

/// Attaches the TCP stream, starts serving it and sends anything queued: on a listening NIC
/// its engine pool serves it, on a dialing-only NIC a task on the current tokio runtime.
fn attach(connection: &Arc<SoftConnection>, stream: TcpStream, queue_pair: Arc<QueuePairShared>) {
    if stream.set_nonblocking(true).is_err() {
        queue_pair.fail_unanswered();
        return;
    }
    let pool = queue_pair
        .device()
        .provider
        .as_any()
        .downcast_ref::<SoftDevice>()
        .and_then(|soft| soft.pool.get().cloned());
    let Some((engine, reader)) = prepare_engine(connection, stream, queue_pair) else {
        return;
    };
    let started = match (connection.mode(), pool) {
        (FlushMode::Pooled, Some(pool)) => pool
            .adopt(Arrival::Engine {
                engine,
                stream: reader,
            })
            .map_err(|arrival| {
                if let Arrival::Engine { engine, .. } = *arrival {
                    engine.finish("the soft NIC is shutting down");
                }
                "the engine pool is stopping".to_string()
            }),
        (FlushMode::Blocking, _) => match (
            tokio::runtime::Handle::try_current(),
            tokio::net::TcpStream::from_std(reader),
        ) {
            (Ok(runtime), Ok(reader)) => {
                runtime.spawn(run_engine_task(engine, reader));
                Ok(())
            }
            _ => {
                engine.finish("no tokio runtime to run the engine task");
                Err("no tokio runtime to run the engine task".to_string())
            }
        },
        (FlushMode::Pooled, None) => {
            engine.finish("no engine pool");
            Err("no engine pool".to_string())
        }
    };
    match started {
        // The pool flushes what was queued once it has registered the stream.
        Ok(()) if connection.mode() == FlushMode::Blocking => connection.flush(),
        Ok(()) => {}
        Err(reason) => {
            tracing::warn!(%reason, "soft NIC could not serve a connection");
            connection.close();
        }
    }
}

/// Encodes one in-flight request (and its WRITE payload) onto the outgoing buffer.
fn encode_request(buffer: &mut Vec<u8>, entry: &InFlight) {
    let request = engine::remote_request(&entry.request);
    let payload_length = if entry.request.opcode == Opcode::Write {
        entry.request.local.length
    } else {
        0
    };
    wire::encode_request_header(buffer, entry.sequence, &request, payload_length);
    if payload_length > 0 {
        let start = buffer.len();
        engine::append_write_payload(buffer, &entry.local);
        // A zero-length or unresolved local buffer cannot reach here (it failed locally), but
        // keep the frame well formed whatever happens.
        buffer.resize(start + payload_length as usize, 0);
    }
}
