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

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::{Error, Result};
use crate::fabric::device::DeviceInner;
use crate::fabric::lock;
use crate::fabric::queue_pair::{append_write_payload, remote_request, InFlight, QueuePairShared, Transport};
use crate::fabric::types::{Opcode, QueuePairEndpoint, WorkCompletionStatus};
use crate::fabric::wire::{self, Frame, Hello, HelloStatus, HELLO_ACK_LENGTH, HELLO_LENGTH};

/// How long a dialer or listener waits for the other side's hello or acknowledgement.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// How often an idle engine thread wakes to check the retry timeout and shutdown.
const ENGINE_TICK: Duration = Duration::from_millis(50);

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

fn accept_loop(listener: TcpListener, device: Weak<DeviceInner>, stopping: Arc<AtomicBool>) {
    for incoming in listener.incoming() {
        if stopping.load(Ordering::Acquire) {
            break;
        }
        let Ok(stream) = incoming else { continue };
        let device = device.clone();
        let spawned = std::thread::Builder::new()
            .name("rdkv-soft-hello".into())
            .spawn(move || {
                if let Err(reason) = accept_hello(stream, &device) {
                    tracing::debug!(%reason, "soft NIC refused a connection");
                }
            });
        if spawned.is_err() {
            tracing::warn!("soft NIC could not start a hello thread; connection dropped");
        }
    }
}

/// Reads a dialer's hello, answers it, and attaches the stream to the queue pair it names.
fn accept_hello(mut stream: TcpStream, device: &Weak<DeviceInner>) -> std::result::Result<(), String> {
    stream
        .set_read_timeout(Some(HELLO_TIMEOUT))
        .map_err(|error| error.to_string())?;
    let mut bytes = [0u8; HELLO_LENGTH];
    stream.read_exact(&mut bytes).map_err(|error| format!("read hello: {error}"))?;
    let answer = |stream: &mut TcpStream, status: HelloStatus| {
        stream
            .write_all(&status.encode())
            .map_err(|error| format!("answer hello: {error}"))
    };
    let Some(hello) = Hello::decode(&bytes) else {
        answer(&mut stream, HelloStatus::BadHello)?;
        return Err("bad hello magic or version".into());
    };
    let Some(device) = device.upgrade() else {
        return Err("device is gone".into());
    };
    if hello.target_device_id != device.id {
        answer(&mut stream, HelloStatus::WrongDevice)?;
        return Err(format!("hello for device {:#x}", hello.target_device_id));
    }
    let Some(queue_pair) = device.queue_pair(hello.target_qp_number) else {
        answer(&mut stream, HelloStatus::UnknownQueuePair)?;
        return Err(format!("hello for unknown queue pair {}", hello.target_qp_number));
    };
    answer(&mut stream, HelloStatus::Accepted)?;
    stream.set_read_timeout(None).map_err(|error| error.to_string())?;
    let _ = stream.set_nodelay(true);
    let mut pending = lock(&queue_pair.pending_stream);
    match queue_pair.transport.get() {
        Some(Transport::Soft(connection)) => {
            let connection = connection.clone();
            drop(pending);
            connection.attach(stream, queue_pair.clone());
        }
        _ => *pending = Some(stream),
    }
    Ok(())
}

/// Whether the local side dials: a side without a listener always dials; otherwise the lower
/// (device id, queue pair number) dials.
fn local_dials(local: &QueuePairEndpoint, remote: &QueuePairEndpoint) -> bool {
    match (local.address, remote.address) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some(_), Some(_)) => (local.device_id, local.qp_number) < (remote.device_id, remote.qp_number),
    }
}

/// Connects a soft queue pair: dials, or waits passively for the peer's dial.
pub(crate) async fn connect(
    queue_pair: &Arc<QueuePairShared>,
    local: &QueuePairEndpoint,
    remote: &QueuePairEndpoint,
) -> Result<()> {
    let connection = Arc::new(SoftConnection::new());
    if !local_dials(local, remote) {
        let parked = {
            let mut pending = lock(&queue_pair.pending_stream);
            let _ = queue_pair.transport.set(Transport::Soft(connection.clone()));
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
    let mut stream = tokio::time::timeout(HELLO_TIMEOUT, tokio::net::TcpStream::connect(address))
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
    stream.write_all(&hello.encode()).await.map_err(connect_error)?;
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
    let _ = queue_pair.transport.set(Transport::Soft(connection.clone()));
    connection.attach(stream, queue_pair.clone());
    Ok(())
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
}

impl SoftConnection {
    fn new() -> Self {
        Self {
            stream: OnceLock::new(),
            outgoing: Mutex::new(Outgoing::default()),
            closed: AtomicBool::new(false),
        }
    }

    /// Appends frames to the outgoing buffer (call [`SoftConnection::flush`] after).
    pub(crate) fn append(&self, encode: impl FnOnce(&mut Vec<u8>)) {
        encode(&mut lock(&self.outgoing).bytes);
    }

    /// Writes queued frames unless another thread is already writing (it will take ours too).
    pub(crate) fn flush(&self) {
        let Some(stream) = self.stream.get() else { return };
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
            let written = (&*stream).write_all(&batch);
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
    fn attach(self: &Arc<Self>, stream: TcpStream, queue_pair: Arc<QueuePairShared>) {
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
        let connection = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("rdkv-soft-engine-qp{}", queue_pair.qp_number))
            .spawn(move || run_engine(queue_pair, connection, reader));
        if let Err(error) = spawned {
            tracing::warn!(%error, "soft NIC could not start an engine thread");
            self.close();
            return;
        }
        self.flush();
    }
}

/// Encodes one in-flight request (and its WRITE payload) onto the outgoing buffer.
pub(crate) fn encode_request(buffer: &mut Vec<u8>, entry: &InFlight) {
    let request = remote_request(&entry.request);
    let payload_length = if entry.request.opcode == Opcode::Write {
        entry.request.local.length
    } else {
        0
    };
    wire::encode_request_header(buffer, entry.sequence, &request, payload_length);
    if payload_length > 0 {
        let start = buffer.len();
        append_write_payload(buffer, &entry.local);
        // A zero-length or unresolved local buffer cannot reach here (it failed locally), but
        // keep the frame well formed whatever happens.
        buffer.resize(start + payload_length as usize, 0);
    }
}

/// The engine thread of one connection.
fn run_engine(queue_pair: Arc<QueuePairShared>, connection: Arc<SoftConnection>, mut stream: TcpStream) {
    let max_payload = queue_pair.max_message_size();
    let retry_timeout = queue_pair.retry_timeout();
    let _ = stream.set_read_timeout(Some(ENGINE_TICK));
    let mut buffer = vec![0u8; max_payload as usize * 2 + 4096];
    let (mut start, mut end) = (0usize, 0usize);
    let mut responses: Vec<u8> = Vec::with_capacity(64 * 1024);
    let mut responder_failed = false;
    let reason = 'connection: loop {
        loop {
            match wire::decode_frame(&buffer[start..end], max_payload) {
                Ok(Some((frame, used))) => {
                    start += used;
                    match frame {
                        Frame::Request {
                            sequence,
                            request,
                            payload,
                        } => {
                            if responder_failed {
                                continue;
                            }
                            let position = wire::reserve_response_header(&mut responses);
                            match queue_pair.serve(&request, payload, &mut responses) {
                                Some(status) => {
                                    wire::finish_response_header(&mut responses, position, sequence, status);
                                    responder_failed = status != WorkCompletionStatus::Success;
                                }
                                None => responses.truncate(position),
                            }
                        }
                        Frame::Response {
                            sequence,
                            status,
                            payload,
                        } => queue_pair.on_response(sequence, status, payload),
                    }
                }
                Ok(None) => break,
                Err(error) => break 'connection format!("protocol violation: {error}"),
            }
        }
        if !responses.is_empty() {
            connection.append(|outgoing| outgoing.extend_from_slice(&responses));
            responses.clear();
            connection.flush();
        }
        if responder_failed {
            // As on rxe, a responder that NAKs a request moves its queue pair to ERROR, after
            // the error response is on its way.
            queue_pair.enter_error();
            break 'connection "responder error".to_string();
        }
        if start == end {
            start = 0;
            end = 0;
        } else if end == buffer.len() {
            buffer.copy_within(start..end, 0);
            end -= start;
            start = 0;
        }
        match stream.read(&mut buffer[end..]) {
            Ok(0) => break 'connection "end of stream".to_string(),
            Ok(read) => end += read,
            Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if connection.closed.load(Ordering::Acquire) {
                    break 'connection "closed locally".to_string();
                }
                if queue_pair
                    .oldest_outstanding_age()
                    .is_some_and(|age| age > retry_timeout)
                {
                    break 'connection format!("no response within the retry timeout {retry_timeout:?}");
                }
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) => break 'connection format!("read: {error}"),
        }
    };
    tracing::debug!(qp_number = queue_pair.qp_number, %reason, "soft connection ended");
    connection.close();
    queue_pair.fail_unanswered();
}
