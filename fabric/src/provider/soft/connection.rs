//! One soft connection's outgoing side: the TCP stream that two connected queue pairs share,
//! and the buffer that posts and responses append frames to.
//!
//! Posts from any thread append encoded frames to one buffer; whichever thread finds no write
//! in progress writes everything queued so far, so concurrent posts coalesce into few writes,
//! as a NIC's doorbell batching would. How a write waits for a full socket depends on who
//! serves the connection:
//! - on a listening NIC ([`FlushMode::Pooled`]) nothing blocks: what the socket does not take
//!   stays queued, and the engine pool writes it on the socket's next writable event (a pool
//!   thread serves many connections and must never wait on one);
//! - on a dialing-only NIC ([`FlushMode::Blocking`]) the writer waits in poll(2) until the
//!   socket takes everything.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::device::DeviceInner;
use crate::lock;

/// The most reads of 16 KiB a stopping connection makes to clear what its peer sent (1 MiB).
const STOP_DISCARD_READS: usize = 64;
/// The capacity an outgoing buffer keeps between bursts.
const KEPT_CAPACITY: usize = 64 * 1024;

/// How a flush waits when the socket is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FlushMode {
    /// Leave the rest queued for the engine pool's next writable event.
    Pooled,
    /// Wait in poll(2) until the socket takes everything.
    Blocking,
}

/// The outgoing side of a connection.
#[derive(Debug, Default)]
struct Outgoing {
    /// Bytes queued for the next write, oldest first.
    bytes: Vec<u8>,
    /// A drained buffer kept to avoid reallocating.
    spare: Vec<u8>,
    /// Whether some thread is writing now.
    flushing: bool,
    /// Set by a flush that found another one writing: the writer tries again before it stops,
    /// so a writable event that arrives mid-write is never lost.
    again: bool,
    /// A post queued frames that no write has taken yet, and its poster will ring: the
    /// number of the thread it posted from ([`thread_number`]). Posts from that thread that
    /// queue behind it leave the ring to it ([`SoftConnection::append_post`]). Cleared
    /// whenever a write takes the queued bytes.
    ring_due: Option<u64>,
}

/// This thread's number, unique for the life of the process (thread ids of exited threads are
/// never reused here).
fn thread_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    thread_local! {
        static NUMBER: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    NUMBER.with(|number| *number)
}

impl Outgoing {
    /// Takes every queued byte for a write (leaving the spare buffer in its place); the ring
    /// that was due is done by this write.
    fn take(&mut self) -> Vec<u8> {
        self.ring_due = None;
        let spare = std::mem::take(&mut self.spare);
        std::mem::replace(&mut self.bytes, spare)
    }
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
    /// Set when the local queue pair moved to ERROR: the engine sends the stop frame after
    /// the answers of every request it ran, then closes (`wire.rs`, *Stop frame*).
    stopping: AtomicBool,
    /// How a flush waits for a full socket.
    mode: FlushMode,
    /// The device, for its transport counters.
    pub(crate) device: Arc<DeviceInner>,
}

impl SoftConnection {
    pub(crate) fn new(device: Arc<DeviceInner>, mode: FlushMode) -> Self {
        Self {
            stream: OnceLock::new(),
            outgoing: Mutex::new(Outgoing::default()),
            closed: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            mode,
            device,
        }
    }

    /// How this connection's flushes wait.
    pub(crate) fn mode(&self) -> FlushMode {
        self.mode
    }

    /// Whether the TCP stream is attached.
    pub(crate) fn has_stream(&self) -> bool {
        self.stream.get().is_some()
    }

    /// Sets the write side; false when it was already set.
    pub(crate) fn set_stream(&self, stream: TcpStream) -> bool {
        self.stream.set(stream).is_ok()
    }

    /// Appends frames to the outgoing buffer; `encode` returns how many it wrote. Call
    /// [`SoftConnection::flush`] after.
    pub(crate) fn append(&self, encode: impl FnOnce(&mut Vec<u8>) -> usize) {
        let frames = encode(&mut lock(&self.outgoing).bytes);
        self.count_frames(frames);
    }

    /// Counts frames queued for sending.
    fn count_frames(&self, frames: usize) {
        self.device
            .gauges
            .frames_sent
            .fetch_add(frames as i64, Ordering::Relaxed);
    }

    /// Appends a post's frames, as [`SoftConnection::append`]; true when the poster must ring
    /// (call [`SoftConnection::flush`], after a yield that lets other posts join). False when
    /// a post from this same thread queued frames before and will ring (after its yield, or
    /// when its future is dropped): that ring writes these frames too. Also false when
    /// `encode` wrote none. A post from another thread rings for itself, so that no post
    /// waits on another thread's scheduling.
    ///
    /// One ring per batch of posts, however the runtime orders their tasks: with a yield and
    /// a ring per post, one tokio worker wrote 0.9 times per GET
    /// (`docs/history/benchmarks-passes.md`, *Seventh pass*).
    pub(crate) fn append_post(&self, encode: impl FnOnce(&mut Vec<u8>) -> usize) -> bool {
        let mut outgoing = lock(&self.outgoing);
        let frames = encode(&mut outgoing.bytes);
        let thread = thread_number();
        let ring = frames > 0 && outgoing.ring_due != Some(thread);
        if ring && outgoing.ring_due.is_none() {
            outgoing.ring_due = Some(thread);
        }
        drop(outgoing);
        self.count_frames(frames);
        ring
    }

    /// Bytes queued and not yet taken by the socket.
    pub(crate) fn backlog(&self) -> usize {
        lock(&self.outgoing).bytes.len()
    }

    /// Writes queued frames unless another thread is already writing (it will take ours too).
    /// In [`FlushMode::Pooled`] it writes what the socket takes now and leaves the rest for
    /// the next writable event.
    pub(crate) fn flush(&self) {
        let Some(stream) = self.stream.get() else {
            return;
        };
        let mut outgoing = lock(&self.outgoing);
        if outgoing.flushing {
            outgoing.again = true;
            return;
        }
        outgoing.flushing = true;
        loop {
            outgoing.again = false;
            if outgoing.bytes.is_empty() || self.closed.load(Ordering::Acquire) {
                outgoing.flushing = false;
                outgoing.ring_due = None;
                outgoing.bytes.clear();
                return;
            }
            let mut batch = outgoing.take();
            drop(outgoing);
            let written = match self.mode {
                FlushMode::Blocking => write_all_waiting(stream, &batch).map(|()| batch.len()),
                FlushMode::Pooled => write_available(stream, &batch),
            };
            self.device
                .gauges
                .transport_writes
                .fetch_add(1, Ordering::Relaxed);
            outgoing = lock(&self.outgoing);
            match written {
                Ok(written) if written == batch.len() => {
                    batch.clear();
                    // One burst of large answers must not keep megabytes per idle connection:
                    // the buffers that alternate here keep at most `KEPT_CAPACITY` between
                    // bursts.
                    batch.shrink_to(KEPT_CAPACITY);
                    outgoing.spare = batch;
                    if outgoing.bytes.is_empty() {
                        outgoing.bytes.shrink_to(KEPT_CAPACITY);
                    }
                }
                Ok(written) => {
                    // The socket is full: keep the rest first in line, ahead of anything
                    // appended meanwhile.
                    batch.drain(..written);
                    batch.extend_from_slice(&outgoing.bytes);
                    let appended = std::mem::replace(&mut outgoing.bytes, batch);
                    if outgoing.spare.capacity() < appended.capacity() {
                        outgoing.spare = appended;
                        outgoing.spare.clear();
                    }
                    if !outgoing.again {
                        outgoing.flushing = false;
                        return;
                    }
                }
                Err(error) => {
                    tracing::debug!(%error, "soft NIC write failed; closing the connection");
                    outgoing.flushing = false;
                    outgoing.ring_due = None;
                    outgoing.bytes.clear();
                    drop(outgoing);
                    self.close();
                    return;
                }
            }
        }
    }

    /// Whether the connection is closed (locally, or because the peer went away).
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// The local queue pair moved to ERROR: its engine answers nothing more, sees end of
    /// stream (the read side is shut now), sends the stop frame and closes. Without a stream
    /// yet, it just closes.
    ///
    /// Only a listening NIC's connections ([`FlushMode::Pooled`]: a server's) stop this way; a
    /// dialer's engine runs on its caller's runtime, where the stop frame's write could wait
    /// on a peer that does not read, and its peer (a server) has nothing outstanding on it.
    pub(crate) fn stop(&self) {
        if self.mode == FlushMode::Blocking {
            self.close();
            return;
        }
        self.stopping.store(true, Ordering::Release);
        match self.stream.get() {
            Some(stream) if !self.is_closed() => {
                let _ = stream.shutdown(Shutdown::Read);
            }
            _ => self.close(),
        }
    }

    /// Sends the stop frame (after everything queued), and reads away what the peer sent
    /// that nobody will read, so that closing does not reset the connection (a reset can make
    /// the peer drop the answers and the stop frame still unread). Best effort, without
    /// waiting, and at most [`STOP_DISCARD_READS`] reads: a peer that keeps sending must not
    /// hold an engine thread here.
    pub(crate) fn send_stop(&self) {
        self.append(|outgoing| {
            super::wire::encode_stop(outgoing);
            1
        });
        self.flush();
        if let Some(stream) = self.stream.get() {
            let _ = stream.shutdown(Shutdown::Write);
            if stream.set_nonblocking(true).is_ok() {
                let mut discard = [0u8; 16 * 1024];
                for _ in 0..STOP_DISCARD_READS {
                    match (&*stream).read(&mut discard) {
                        Ok(read) if read > 0 => {}
                        _ => break,
                    }
                }
            }
        }
    }

    /// Whether the local queue pair moved to ERROR ([`SoftConnection::stop`]).
    pub(crate) fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Closes the connection; the engines on both ends see end of stream.
    pub(crate) fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(stream) = self.stream.get() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

/// Writes as much of `bytes` as the non-blocking socket takes now; returns how much.
fn write_available(stream: &TcpStream, bytes: &[u8]) -> std::io::Result<usize> {
    let mut written = 0;
    while written < bytes.len() {
        match (&*stream).write(&bytes[written..]) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(count) => written += count,
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if error.kind() == ErrorKind::WouldBlock => break,
            Err(error) => return Err(error),
        }
    }
    Ok(written)
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
