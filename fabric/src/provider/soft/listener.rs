//! The NIC's listening socket: an accept thread hands each incoming connection to the engine
//! pool (see `pool.rs`), which reads its hello without blocking and attaches it to the queue
//! pair it names.
//!
//! Hellos are bounded three ways: the whole hello must arrive within the hello deadline (a
//! peer that trickles bytes is not reprieved by each one), at most `max_pending_hellos` are
//! pending at once (a new connection beyond that closes the oldest pending one), and a failed
//! hello gets one refusal whatever field was wrong.

use std::collections::VecDeque;
use std::io::{ErrorKind, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::device::DeviceInner;
use crate::error::{Error, Result};
use crate::lock;

use super::frames::Engine;
use super::pool::{Arrival, EnginePool};
use super::wire::{Hello, HelloStatus, HELLO_LENGTH};
use super::{prepare_engine, ParkedStream, SoftQueuePair};

/// The NIC's listening socket and its accept thread.
#[derive(Debug)]
pub(crate) struct SoftListener {
    /// The bound address.
    address: SocketAddr,
    /// Tells the accept thread to stop.
    stopping: Arc<AtomicBool>,
}

impl SoftListener {
    /// Binds `address` and starts the accept thread, which hands connections to `pool`.
    pub(crate) fn start(
        address: SocketAddr,
        device: Weak<DeviceInner>,
        pool: Arc<EnginePool>,
    ) -> Result<Self> {
        let listener =
            TcpListener::bind(address).map_err(|source| Error::BindListener { address, source })?;
        let bound = listener
            .local_addr()
            .map_err(|source| Error::BindListener { address, source })?;
        let stopping = Arc::new(AtomicBool::new(false));
        let accept_stopping = stopping.clone();
        std::thread::Builder::new()
            .name(format!("rdkv-soft-accept-{}", bound.port()))
            .spawn(move || accept_loop(listener, device, pool, accept_stopping))
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

/// The connections whose hello is being read, oldest first. A dialer sends its 40 bytes at
/// once, so evicting the oldest connection whose hello has not fully arrived keeps a flood of
/// idle connections from holding any resource for long without keeping a legitimate dialer
/// out, even when the flood outruns the engines that read the hellos.
#[derive(Debug)]
pub(crate) struct PendingHellos {
    /// Each hello's number and a handle on its socket, to close it on eviction.
    streams: Mutex<VecDeque<(u64, TcpStream)>>,
    /// The next hello's number.
    next: AtomicU64,
    /// The most pending at once.
    limit: usize,
}

impl PendingHellos {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            streams: Mutex::new(VecDeque::new()),
            next: AtomicU64::new(0),
            limit: limit.max(1),
        }
    }

    /// Admits a connection, evicting (closing) the oldest pending ones when full; returns its
    /// number and how many were evicted.
    fn admit(&self, stream: &TcpStream) -> (u64, usize) {
        let number = self.next.fetch_add(1, Ordering::Relaxed);
        let mut streams = lock(&self.streams);
        let mut evicted = 0;
        while streams.len() >= self.limit {
            // The oldest whose hello has not fully arrived; only if every one has, the oldest.
            // A dialer whose 40 bytes wait for an engine to read them is never the victim of
            // a flood that outruns the engines.
            let victim = streams
                .iter()
                .position(|(_, pending)| !hello_waiting(pending))
                .unwrap_or(0);
            if let Some((_, victim)) = streams.remove(victim) {
                // Its engine sees end of stream at once and drops it.
                let _ = victim.shutdown(Shutdown::Both);
                evicted += 1;
            }
        }
        if let Ok(handle) = stream.try_clone() {
            streams.push_back((number, handle));
        }
        (number, evicted)
    }

    /// A hello ended (read, evicted, failed or timed out).
    pub(crate) fn finish(&self, number: u64) {
        lock(&self.streams).retain(|(pending, _)| *pending != number);
    }

    /// Hellos pending now.
    pub(crate) fn count(&self) -> usize {
        lock(&self.streams).len()
    }
}

/// Whether a whole hello waits unread in `stream` (non-blocking).
fn hello_waiting(stream: &TcpStream) -> bool {
    let mut bytes = [0u8; HELLO_LENGTH];
    matches!(stream.peek(&mut bytes), Ok(read) if read == HELLO_LENGTH)
}

fn accept_loop(
    listener: TcpListener,
    device: Weak<DeviceInner>,
    pool: Arc<EnginePool>,
    stopping: Arc<AtomicBool>,
) {
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
        if stream.set_nonblocking(true).is_err() {
            continue;
        }
        let (number, evicted) = pool.pending.admit(&stream);
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
        if pool.adopt(Arrival::Hello { stream, number }).is_err() {
            pool.pending.finish(number);
            tracing::debug!("soft NIC engine pool is stopping; connection dropped");
        }
    }
}

/// Answers a complete hello and attaches the stream to the queue pair it names: returns the
/// engine to serve it with, or `None` when the queue pair has not connected yet (the stream
/// waits in it for `connect`). `Err` is why the hello was refused.
pub(crate) fn answer_hello(
    bytes: &[u8; HELLO_LENGTH],
    mut stream: TcpStream,
    device: &Weak<DeviceInner>,
) -> std::result::Result<Option<(Engine, TcpStream)>, String> {
    let answer = |stream: &mut TcpStream, status: HelloStatus| {
        // Eight bytes into a fresh socket's empty send buffer: a full buffer here means the
        // peer is not a dialer.
        stream
            .write_all(&status.encode())
            .map_err(|error| format!("answer hello: {error}"))
    };
    // One refusal for every wrong field: the answer must not tell a guesser which was right.
    let Some(hello) = Hello::decode(bytes) else {
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
    let Some(soft) = queue_pair.provider.as_any().downcast_ref::<SoftQueuePair>() else {
        answer(&mut stream, HelloStatus::Refused)?;
        return Err(format!(
            "queue pair {} is not a soft queue pair",
            hello.target_qp_number
        ));
    };
    let mut pending = lock(&soft.pending_stream);
    if !soft.accepts_hello(&pending, hello.source_device_id, hello.source_qp_number) {
        drop(pending);
        answer(&mut stream, HelloStatus::Refused)?;
        return Err(format!(
            "hello for queue pair {} from device {:#x} queue pair {}: not its peer, or already connected",
            hello.target_qp_number, hello.source_device_id, hello.source_qp_number
        ));
    }
    answer(&mut stream, HelloStatus::Accepted)?;
    let _ = stream.set_nodelay(true);
    match soft.connection.get() {
        Some(connection) => {
            let connection = connection.clone();
            drop(pending);
            Ok(prepare_engine(&connection, stream, queue_pair.clone()))
        }
        None => {
            *pending = Some(ParkedStream {
                stream,
                source_device_id: hello.source_device_id,
                source_qp_number: hello.source_qp_number,
            });
            Ok(None)
        }
    }
}

/// Reads what has arrived of a hello into `bytes[*filled..]` without blocking: `Ok(true)` once
/// it is complete, `Ok(false)` while more is to come.
pub(crate) fn read_hello(
    stream: &TcpStream,
    bytes: &mut [u8; HELLO_LENGTH],
    filled: &mut usize,
) -> std::io::Result<bool> {
    use std::io::Read;
    while *filled < HELLO_LENGTH {
        match (&*stream).read(&mut bytes[*filled..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(read) => *filled += read,
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if error.kind() == ErrorKind::WouldBlock => return Ok(false),
            Err(error) => return Err(error),
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    #[test]
    fn eviction_spares_a_connection_whose_whole_hello_waits() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let pending = PendingHellos::new(2);
        let mut dialers = Vec::new();
        let mut accepted = Vec::new();
        for index in 0..3 {
            let mut dialer = TcpStream::connect(address).expect("connect");
            let (stream, _) = listener.accept().expect("accept");
            stream.set_nonblocking(true).expect("non-blocking");
            if index == 0 {
                // The oldest has sent its whole hello; no engine has read it yet.
                dialer.write_all(&[7u8; HELLO_LENGTH]).expect("hello");
                while !hello_waiting(&stream) {
                    std::thread::yield_now();
                }
            }
            let (_, evicted) = pending.admit(&stream);
            assert_eq!(evicted, usize::from(index == 2));
            dialers.push(dialer);
            accepted.push(stream);
        }
        assert_eq!(pending.count(), 2);
        let numbers: Vec<u64> = lock(&pending.streams)
            .iter()
            .map(|(number, _)| *number)
            .collect();
        assert_eq!(
            numbers,
            [0, 2],
            "the silent one in the middle went, not the oldest"
        );
    }
}
