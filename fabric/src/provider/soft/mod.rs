//! The `soft` backend: a user-space RNIC over TCP.
//!
//! - [`SoftListener`]: the NIC's listening socket. An accept thread takes each incoming
//!   connection, reads its hello on a short-lived thread, and attaches it to the named queue
//!   pair.
//! - [`SoftConnection`]: one TCP connection per connected queue pair pair. Posts from any
//!   thread append encoded requests to one outgoing buffer; whichever thread finds no flush in
//!   progress writes everything queued so far with one `write_all`, so concurrent posts
//!   coalesce into few writes, as a NIC's doorbell batching would.
//! - The engine thread ([`run_engine`]), one per connection, reads frames: requests run through
//!   the responder engine (server application code never sees them) and their responses are
//!   queued and written once the read buffer is empty; responses complete our own requests in
//!   order. End of stream, a read error, a protocol violation, or an outstanding request older
//!   than the retry timeout completes the oldest request RETRY_EXC_ERR and flushes the rest.

use std::any::Any;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::completion::CompletionQueueInner;
use crate::device::DeviceInner;
use crate::error::{Error, Result};
use crate::lock;
use crate::provider::engine;
use crate::queue_pair::{InFlight, QueuePairConfig, QueuePairShared};
use crate::seam::{DeviceProvider, ProviderFuture, QueuePairProvider, Submission};
use crate::types::{Backend, Opcode, QueuePairEndpoint, SoftEndpoint, WorkCompletionStatus};
pub(crate) mod wire;

use wire::{Frame, Hello, HelloStatus, HELLO_ACK_LENGTH, HELLO_LENGTH};

/// How long a dialer or listener waits for the other side's hello or acknowledgement.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// The most response bytes an engine holds before it writes them out: a peer that pipelines
/// thousands of small requests for large READs gets its answers at the pace it reads them,
/// not a buffer of all of them.
const RESPONSE_BUFFER_BOUND: usize = 4 << 20;
/// How often an idle engine thread wakes to check the retry timeout and shutdown.
const ENGINE_TICK: Duration = Duration::from_millis(50);

/// A soft NIC: listens (when given an address) and serves its queue pairs' connections.
#[derive(Debug)]
pub(crate) struct SoftDevice {
    /// Where to listen, if anywhere.
    listen: Option<SocketAddr>,
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
            listener: OnceLock::new(),
            spinning: AtomicBool::new(false),
        }
    }
}

impl DeviceProvider for SoftDevice {
    fn backend(&self) -> Backend {
        Backend::Soft
    }

    fn start(&self, device: &Arc<DeviceInner>) -> Result<()> {
        if let Some(address) = self.listen {
            let listener = SoftListener::start(address, Arc::downgrade(device))?;
            // Started once: the cell is empty.
            let _ = self.listener.set(listener);
        }
        Ok(())
    }

    fn listen_address(&self) -> Option<SocketAddr> {
        self.listener.get().map(SoftListener::address)
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
    /// A connection that arrived before `connect` (passive side).
    pending_stream: Mutex<Option<TcpStream>>,
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
        connection.append(|buffer| {
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
        Submission::RingAfterYield
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
            connection.close();
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The NIC's listening socket and its accept thread.
#[derive(Debug)]
pub(crate) struct SoftListener {
    /// The bound address.
    address: SocketAddr,
    /// Tells the accept thread to stop.
    stopping: Arc<AtomicBool>,
}

impl SoftListener {
    /// Binds `address` and starts the accept thread.
    pub(crate) fn start(address: SocketAddr, device: Weak<DeviceInner>) -> Result<Self> {
        let listener =
            TcpListener::bind(address).map_err(|source| Error::BindListener { address, source })?;
        let bound = listener
            .local_addr()
            .map_err(|source| Error::BindListener { address, source })?;
        let stopping = Arc::new(AtomicBool::new(false));
        let accept_stopping = stopping.clone();
        std::thread::Builder::new()
            .name(format!("rdkv-soft-accept-{}", bound.port()))
            .spawn(move || accept_loop(listener, device, accept_stopping))
            .map_err(|source| Error::BindListener { address, source })?;
        tracing::debug!(address = %bound, "soft NIC listening");
        Ok(Self {
            address: bound,
            stopping,
        })
    }

    /// The bound address.
    pub(crate) fn address(&self) -> SocketAddr {
        self.address
    }
}

impl Drop for SoftListener {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Release);
        // Wake the blocking accept so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.address, Duration::from_millis(200));
    }
}

/// Hellos read at once. Each holds a thread for at most [`HELLO_TIMEOUT`]. A connection
/// beyond this evicts the oldest pending one (closing it), so a flood of idle connections
/// costs a bounded number of threads and still cannot keep a legitimate dialer out: a dialer
/// sends its 40 bytes at once and is done in microseconds, long before 64 newer connections
/// push it out.
pub(crate) const MAX_PENDING_HELLOS: usize = 64;

/// The connections whose hello is being read, oldest first.
#[derive(Default)]
struct PendingHellos {
    /// Each hello's number and a handle on its socket, to close it on eviction.
    streams: Mutex<std::collections::VecDeque<(u64, TcpStream)>>,
    /// The next hello's number.
    next: std::sync::atomic::AtomicU64,
}

impl PendingHellos {
    /// Admits a connection, evicting (closing) the oldest pending one when full; returns its
    /// number and how many were evicted.
    fn admit(&self, stream: &TcpStream) -> (u64, usize) {
        let number = self.next.fetch_add(1, Ordering::Relaxed);
        let mut streams = lock(&self.streams);
        let mut evicted = 0;
        while streams.len() >= MAX_PENDING_HELLOS {
            if let Some((_, oldest)) = streams.pop_front() {
                // Its thread's read fails at once and the thread ends.
                let _ = oldest.shutdown(Shutdown::Both);
                evicted += 1;
            }
        }
        if let Ok(handle) = stream.try_clone() {
            streams.push_back((number, handle));
        }
        (number, evicted)
    }

    /// A hello ended (answered, refused, evicted or timed out).
    fn finish(&self, number: u64) {
        lock(&self.streams).retain(|(pending, _)| *pending != number);
    }
}

fn accept_loop(listener: TcpListener, device: Weak<DeviceInner>, stopping: Arc<AtomicBool>) {
    let pending = Arc::new(PendingHellos::default());
    for incoming in listener.incoming() {
        if stopping.load(Ordering::Acquire) {
            break;
        }
        let stream = match incoming {
            Ok(stream) => stream,
            Err(_) => {
                // Out of file descriptors: back off rather than spin.
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let (number, evicted) = pending.admit(&stream);
        if evicted > 0 {
            if let Some(device) = device.upgrade() {
                device
                    .gauges
                    .hellos_refused
                    .fetch_add(evicted as i64, Ordering::Relaxed);
            }
            tracing::debug!(
                evicted,
                "soft NIC: too many hellos pending; the oldest closed"
            );
        }
        let device = device.clone();
        let finished = pending.clone();
        let spawned = std::thread::Builder::new()
            .name("rdkv-soft-hello".into())
            .spawn(move || {
                if let Err(reason) = accept_hello(stream, &device, || finished.finish(number)) {
                    tracing::debug!(%reason, "soft NIC refused a connection");
                }
            });
        if spawned.is_err() {
            pending.finish(number);
            tracing::warn!("soft NIC could not start a hello thread; connection dropped");
        }
    }
}

/// Reads a dialer's hello, answers it, and attaches the stream to the queue pair it names.
fn accept_hello(
    mut stream: TcpStream,
    device: &Weak<DeviceInner>,
    hello_read: impl FnOnce(),
) -> std::result::Result<(), String> {
    let mut bytes = [0u8; HELLO_LENGTH];
    let read = read_within(&mut stream, &mut bytes, HELLO_TIMEOUT);
    // No longer pending, before the stream can be attached: an eviction must never close a
    // connection that serves a queue pair.
    hello_read();
    read.map_err(|error| format!("read hello: {error}"))?;
    let answer = |stream: &mut TcpStream, status: HelloStatus| {
        stream
            .write_all(&status.encode())
            .map_err(|error| format!("answer hello: {error}"))
    };
    // One refusal for every wrong field: the answer must not tell a guesser which was right.
    let Some(hello) = Hello::decode(&bytes) else {
        answer(&mut stream, HelloStatus::Refused)?;
        return Err("bad hello magic or version".into());
    };
    let Some(device) = device.upgrade() else {
        return Err("device is gone".into());
    };
    if hello.target_device_id != device.id {
        answer(&mut stream, HelloStatus::Refused)?;
        return Err(format!("hello for device {:#x}", hello.target_device_id));
    }
    let Some(queue_pair) = device.queue_pair(hello.target_qp_number) else {
        answer(&mut stream, HelloStatus::Refused)?;
        return Err(format!(
            "hello for unknown queue pair {}",
            hello.target_qp_number
        ));
    };
    answer(&mut stream, HelloStatus::Accepted)?;
    stream
        .set_read_timeout(None)
        .map_err(|error| error.to_string())?;
    let _ = stream.set_nodelay(true);
    let Some(soft) = queue_pair.provider.as_any().downcast_ref::<SoftQueuePair>() else {
        return Err(format!(
            "queue pair {} is not a soft queue pair",
            hello.target_qp_number
        ));
    };
    let mut pending = lock(&soft.pending_stream);
    match soft.connection.get() {
        Some(connection) => {
            let connection = connection.clone();
            drop(pending);
            connection.attach(stream, queue_pair.clone());
        }
        _ => *pending = Some(stream),
    }
    Ok(())
}

/// Fills `buffer` from `stream` within `deadline` in all: a peer that trickles bytes (one
/// every few seconds) is cut off when the deadline passes, not reprieved by each byte.
fn read_within(
    stream: &mut TcpStream,
    buffer: &mut [u8],
    deadline: Duration,
) -> std::io::Result<()> {
    let started = std::time::Instant::now();
    let mut filled = 0;
    while filled < buffer.len() {
        let left = deadline.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(std::io::Error::new(
                ErrorKind::TimedOut,
                format!("the whole hello must arrive within {deadline:?}"),
            ));
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buffer[filled..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(read) => filled += read,
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
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
        let connection = Arc::new(SoftConnection::new(
            queue_pair.protection_domain.inner.device.clone(),
        ));
        if !local_dials(local, remote) {
            let parked = {
                let mut pending = lock(&self.pending_stream);
                let _ = self.connection.set(connection.clone());
                pending.take()
            };
            if let Some(stream) = parked {
                connection.attach(stream, queue_pair.clone());
            }
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
        let mut stream =
            tokio::time::timeout(HELLO_TIMEOUT, tokio::net::TcpStream::connect(address))
                .await
                .map_err(|_| connect_error(ErrorKind::TimedOut.into()))?
                .map_err(connect_error)?;
        stream.set_nodelay(true).map_err(connect_error)?;
        let hello = Hello {
            target_qp_number: remote.qp_number,
            source_qp_number: local.qp_number,
            source_device_id: local.device_id,
            target_device_id: remote.device_id,
        };
        stream
            .write_all(&hello.encode())
            .await
            .map_err(connect_error)?;
        let mut ack = [0u8; HELLO_ACK_LENGTH];
        tokio::time::timeout(HELLO_TIMEOUT, stream.read_exact(&mut ack))
            .await
            .map_err(|_| connect_error(ErrorKind::TimedOut.into()))?
            .map_err(connect_error)?;
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
        stream.set_nonblocking(false).map_err(connect_error)?;
        let _ = self.connection.set(connection.clone());
        connection.attach(stream, queue_pair.clone());
        Ok(())
    }
}

/// The outgoing side of a connection.
#[derive(Debug, Default)]
struct Outgoing {
    /// Bytes queued for the next write.
    bytes: Vec<u8>,
    /// A drained buffer kept to avoid reallocating.
    spare: Vec<u8>,
    /// Whether some thread is writing now.
    flushing: bool,
}

/// One soft connection between two queue pairs.
#[derive(Debug)]
pub(crate) struct SoftConnection {
    /// The write side, set when the TCP connection exists.
    stream: OnceLock<TcpStream>,
    /// Queued outgoing frames.
    outgoing: Mutex<Outgoing>,
    /// Set once the connection is closed.
    closed: AtomicBool,
    /// The device, for its transport counters.
    device: Arc<DeviceInner>,
}

impl SoftConnection {
    fn new(device: Arc<DeviceInner>) -> Self {
        Self {
            stream: OnceLock::new(),
            outgoing: Mutex::new(Outgoing::default()),
            closed: AtomicBool::new(false),
            device,
        }
    }

    /// Appends frames to the outgoing buffer; `encode` returns how many it wrote. Call
    /// [`SoftConnection::flush`] after.
    pub(crate) fn append(&self, encode: impl FnOnce(&mut Vec<u8>) -> usize) {
        let frames = encode(&mut lock(&self.outgoing).bytes);
        self.device
            .gauges
            .frames_sent
            .fetch_add(frames as i64, Ordering::Relaxed);
    }

    /// Writes queued frames unless another thread is already writing (it will take ours too).
    pub(crate) fn flush(&self) {
        let Some(stream) = self.stream.get() else {
            return;
        };
        let mut outgoing = lock(&self.outgoing);
        if outgoing.flushing {
            return;
        }
        outgoing.flushing = true;
        loop {
            if outgoing.bytes.is_empty() || self.closed.load(Ordering::Acquire) {
                outgoing.flushing = false;
                outgoing.bytes.clear();
                return;
            }
            let spare = std::mem::take(&mut outgoing.spare);
            let mut batch = std::mem::replace(&mut outgoing.bytes, spare);
            drop(outgoing);
            let written = write_all_waiting(stream, &batch);
            self.device
                .gauges
                .transport_writes
                .fetch_add(1, Ordering::Relaxed);
            batch.clear();
            outgoing = lock(&self.outgoing);
            outgoing.spare = batch;
            if let Err(error) = written {
                tracing::debug!(%error, "soft NIC write failed; closing the connection");
                outgoing.flushing = false;
                drop(outgoing);
                self.close();
                return;
            }
        }
    }

    /// Whether the connection is closed (locally, or because the peer went away).
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Closes the connection; the engine threads on both ends see end of stream.
    pub(crate) fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(stream) = self.stream.get() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// Attaches the TCP stream, starts the engine thread and sends anything queued.
    ///
    /// A listening NIC serves the connection from an engine thread; a dialing-only NIC from a
    /// task on the current tokio runtime.
    fn attach(self: &Arc<Self>, stream: TcpStream, queue_pair: Arc<QueuePairShared>) {
        let on_runtime = queue_pair.device().provider.listen_address().is_none();
        if on_runtime && stream.set_nonblocking(true).is_err() {
            queue_pair.fail_unanswered();
            return;
        }
        let reader = match stream.try_clone() {
            Ok(reader) => reader,
            Err(error) => {
                tracing::warn!(%error, "soft NIC could not clone a stream");
                queue_pair.fail_unanswered();
                return;
            }
        };
        if self.stream.set(stream).is_err() {
            return;
        }
        if self.closed.load(Ordering::Acquire) {
            let _ = reader.shutdown(Shutdown::Both);
        }
        let engine = Engine::new(queue_pair.clone(), self.clone());
        let spawned = if on_runtime {
            match (
                tokio::runtime::Handle::try_current(),
                tokio::net::TcpStream::from_std(reader),
            ) {
                (Ok(runtime), Ok(reader)) => {
                    runtime.spawn(run_engine_task(engine, reader));
                    Ok(())
                }
                _ => Err(std::io::Error::other(
                    "no tokio runtime to run the engine task",
                )),
            }
        } else {
            std::thread::Builder::new()
                .name(format!("rdkv-soft-engine-qp{}", queue_pair.qp_number))
                .spawn(move || run_engine_thread(engine, reader))
                .map(drop)
        };
        if let Err(error) = spawned {
            tracing::warn!(%error, "soft NIC could not start an engine thread");
            self.close();
            return;
        }
        self.flush();
    }
}

/// At most this many frames per read count as light load, when spinning pays.
const LIGHT_LOAD_FRAMES: usize = 4;

/// The right to busy-poll: one engine thread per device holds it at a time.
struct SpinToken<'a>(&'a AtomicBool);

impl<'a> SpinToken<'a> {
    fn try_acquire(device: &'a DeviceInner) -> Option<Self> {
        let spinning = &device
            .provider
            .as_any()
            .downcast_ref::<SoftDevice>()?
            .spinning;
        spinning
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| Self(spinning))
    }
}

impl Drop for SpinToken<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Writes all of `bytes`, waiting in poll(2) whenever a non-blocking socket is full.
fn write_all_waiting(stream: &TcpStream, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        match (&*stream).write(bytes) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(written) => bytes = &bytes[written..],
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if error.kind() == ErrorKind::WouldBlock => {
                let mut descriptor = libc::pollfd {
                    fd: std::os::fd::AsRawFd::as_raw_fd(stream),
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: one valid pollfd for a socket that `stream` keeps open; a timeout
                // bounds the wait.
                unsafe { libc::poll(&mut descriptor, 1, 1000) };
            }
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// Busy-polls the socket for up to `budget` with non-blocking reads, as an RDMA application
/// polls its completion queue. `Some(n)` is a read that returned `n` (0 at end of stream);
/// `None` means nothing arrived in time (or an error to be seen by the blocking read).
fn spin_read(stream: &TcpStream, buffer: &mut [u8], budget: Duration) -> Option<usize> {
    if budget.is_zero() {
        return None;
    }
    let started = std::time::Instant::now();
    let descriptor = std::os::fd::AsRawFd::as_raw_fd(stream);
    loop {
        // SAFETY: `descriptor` is the open socket borrowed through `stream` for this call, and
        // `buffer` is a valid, exclusively borrowed byte slice of the given length.
        let received = unsafe {
            libc::recv(
                descriptor,
                buffer.as_mut_ptr().cast(),
                buffer.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if received >= 0 {
            return Some(received as usize);
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != ErrorKind::WouldBlock && error.kind() != ErrorKind::Interrupted {
            return None;
        }
        if started.elapsed() >= budget {
            return None;
        }
        std::hint::spin_loop();
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

/// The frame processing of one connection, shared by the engine thread and the engine task.
struct Engine {
    /// The local queue pair.
    queue_pair: Arc<QueuePairShared>,
    /// The connection's outgoing side.
    connection: Arc<SoftConnection>,
    /// Received bytes; frames are parsed from `start..end`.
    buffer: Vec<u8>,
    /// First unparsed byte.
    start: usize,
    /// End of received bytes.
    end: usize,
    /// Encoded responses not yet queued for sending.
    responses: Vec<u8>,
    /// How many responses `responses` holds.
    response_count: usize,
    /// The responder refused a request: it serves nothing more on this connection.
    responder_failed: bool,
    /// The largest payload accepted.
    max_payload: u32,
    /// Frames handled by the last call of `process`: a measure of load for adaptive spinning.
    last_batch_frames: usize,
}

impl Engine {
    fn new(queue_pair: Arc<QueuePairShared>, connection: Arc<SoftConnection>) -> Self {
        let max_payload = queue_pair.max_message_size();
        Self {
            queue_pair,
            connection,
            buffer: vec![0u8; max_payload as usize * 2 + 4096],
            start: 0,
            end: 0,
            responses: Vec::with_capacity(64 * 1024),
            response_count: 0,
            responder_failed: false,
            max_payload,
            last_batch_frames: 0,
        }
    }

    /// Handles every complete frame received so far and sends the responses; `Err` ends the
    /// connection with its reason.
    fn process(&mut self) -> std::result::Result<(), String> {
        self.last_batch_frames = 0;
        loop {
            match wire::decode_frame(&self.buffer[self.start..self.end], self.max_payload) {
                Ok(Some((frame, used))) => {
                    match frame {
                        Frame::Request {
                            sequence,
                            request,
                            payload,
                        } => {
                            if !self.responder_failed {
                                let position = wire::reserve_response_header(&mut self.responses);
                                match engine::serve(
                                    &self.queue_pair,
                                    &request,
                                    payload,
                                    &mut self.responses,
                                ) {
                                    Some(status) => {
                                        wire::finish_response_header(
                                            &mut self.responses,
                                            position,
                                            sequence,
                                            status,
                                        );
                                        self.response_count += 1;
                                        self.responder_failed =
                                            status != WorkCompletionStatus::Success;
                                    }
                                    None => self.responses.truncate(position),
                                }
                            }
                        }
                        Frame::Response {
                            sequence,
                            status,
                            payload,
                        } => self.queue_pair.on_response(sequence, status, payload),
                    }
                    self.start += used;
                    self.last_batch_frames += 1;
                    // A batch of small requests for large READs must not pile up its answers:
                    // past the bound, send them (waiting for the peer to take them) before
                    // serving more. Responses wait in at most this much memory.
                    if self.responses.len() >= RESPONSE_BUFFER_BOUND {
                        self.send_responses();
                    }
                }
                Ok(None) => break,
                Err(error) => return Err(format!("protocol violation: {error}")),
            }
        }
        self.send_responses();
        if self.responder_failed {
            // As on rxe, a responder that NAKs a request moves its queue pair to ERROR, after
            // the error response is on its way.
            self.queue_pair.enter_error();
            return Err("responder error".into());
        }
        Ok(())
    }

    /// Queues the responses served so far and writes them out (blocking while the peer does
    /// not read: backpressure, as a NIC's responder stalls when its peer stops acknowledging).
    fn send_responses(&mut self) {
        if self.responses.is_empty() {
            return;
        }
        let count = self.response_count;
        let responses = &self.responses;
        self.connection.append(|outgoing| {
            outgoing.extend_from_slice(responses);
            count
        });
        self.responses.clear();
        self.response_count = 0;
        self.connection.flush();
    }

    /// Free space to read into, after compacting parsed bytes away.
    fn space(&mut self) -> &mut [u8] {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.buffer.len() {
            self.buffer.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        &mut self.buffer[self.end..]
    }

    /// Whether to give up while idle: the connection was closed locally, or the oldest
    /// outstanding request waited past the retry timeout.
    fn idle_check(&self) -> std::result::Result<(), String> {
        if self.connection.closed.load(Ordering::Acquire) {
            return Err("closed locally".into());
        }
        let retry_timeout = self.queue_pair.retry_timeout();
        if self
            .queue_pair
            .oldest_outstanding_age()
            .is_some_and(|age| age > retry_timeout)
        {
            return Err(format!(
                "no response within the retry timeout {retry_timeout:?}"
            ));
        }
        Ok(())
    }

    /// Ends the connection: outstanding requests complete RETRY_EXC_ERR, then flush.
    fn finish(self, reason: &str) {
        tracing::debug!(qp_number = self.queue_pair.qp_number, %reason, "soft connection ended");
        self.connection.close();
        self.queue_pair.fail_unanswered();
    }
}

/// The engine thread of one connection on a listening NIC.
fn run_engine_thread(mut engine: Engine, mut stream: TcpStream) {
    let spin = engine.queue_pair.poll_spin();
    let connection = engine.connection.clone();
    let _ = stream.set_read_timeout(Some(ENGINE_TICK));
    let reason = loop {
        if let Err(reason) = engine.process() {
            break reason;
        }
        // Spin only while lightly loaded (a busy connection never waits long for its next
        // frames) and only one engine thread per device at a time, so spinning never takes
        // the cores that the busy connections need.
        let spin_token = (!spin.is_zero() && engine.last_batch_frames <= LIGHT_LOAD_FRAMES)
            .then(|| SpinToken::try_acquire(&connection.device))
            .flatten();
        let budget = if spin_token.is_some() {
            spin
        } else {
            Duration::ZERO
        };
        let space = engine.space();
        let outcome = match spin_read(&stream, space, budget) {
            Some(read) => Ok(read),
            None => {
                drop(spin_token);
                stream.read(space)
            }
        };
        match outcome {
            Ok(0) => break "end of stream".to_string(),
            Ok(read) => engine.end += read,
            Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if let Err(reason) = engine.idle_check() {
                    break reason;
                }
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) => break format!("read: {error}"),
        }
    };
    engine.finish(&reason);
}

/// The engine task of one connection on a dialing-only NIC: it runs on the caller's tokio
/// runtime, so a response wakes the awaiting task without a hop through another thread.
async fn run_engine_task(mut engine: Engine, stream: tokio::net::TcpStream) {
    let reason = loop {
        if let Err(reason) = engine.process() {
            break reason;
        }
        match stream.try_read(engine.space()) {
            Ok(0) => break "end of stream".to_string(),
            Ok(read) => engine.end += read,
            Err(error) if error.kind() == ErrorKind::WouldBlock => {
                match tokio::time::timeout(ENGINE_TICK, stream.readable()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => break format!("wait for readability: {error}"),
                    Err(_) => {
                        if let Err(reason) = engine.idle_check() {
                            break reason;
                        }
                    }
                }
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) => break format!("read: {error}"),
        }
    };
    engine.finish(&reason);
}
