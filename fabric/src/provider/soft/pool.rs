//! The engine pool of a listening soft NIC: a fixed number of threads, each multiplexing its
//! share of the NIC's connections with epoll (`mio`), as a real NIC has a fixed number of
//! engines whatever the number of queue pairs.
//!
//! Why `mio` and not tokio on dedicated threads: an engine's work per event is synchronous
//! frame processing against registered memory, with nothing to await. `mio` gives
//! edge-triggered readiness and a slab of plain structs per thread; tokio would add a task, a
//! waker and a timer entry per connection for no gain (it is built on `mio` itself, so the
//! dependency is already in the tree).
//!
//! Each worker owns its connections outright (no locks on the read path). A connection is
//! either reading its hello (deadline-bound, see `listener.rs`) or attached to a queue pair
//! and served by its [`Engine`]. Fairness: a connection is read at most
//! [`READS_PER_TURN`] times per turn; one that still has data waits in the ready list for its
//! next turn, so one busy peer cannot starve the others on its worker. Backpressure: a
//! connection whose peer does not take its responses stops being read until its socket
//! drains (see [`Engine::output_blocked`]).

use std::collections::VecDeque;
use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};

use crate::device::DeviceInner;

use super::frames::{Engine, ENGINE_TICK, KEPT_READ_BUFFER};
use super::listener::{answer_hello, read_hello, PendingHellos};
use super::wire::HELLO_LENGTH;

/// The waker's token; connection tokens are slab indexes.
const WAKE: Token = Token(usize::MAX);
/// Reads of one connection per turn before the others get theirs.
const READS_PER_TURN: usize = 16;
/// Arrivals a worker's inbox holds; the accept thread waits when it is full.
const INBOX_CAPACITY: usize = 1024;
/// At most this many frames per turn count as light load, when spinning pays.
const LIGHT_LOAD_FRAMES: usize = 4;

/// Settings of one pool.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PoolSettings {
    /// Worker threads.
    pub(crate) threads: usize,
    /// How long a connection has for its whole hello.
    pub(crate) hello_deadline: Duration,
    /// How long a worker busy-polls after light load (zero never spins).
    pub(crate) poll_spin: Duration,
}

/// Something for a worker to take on.
pub(crate) enum Arrival {
    /// A new connection whose hello is to be read.
    Hello {
        /// The socket, non-blocking.
        stream: TcpStream,
        /// Its number among pending hellos.
        number: u64,
    },
    /// A connection attached to its queue pair (the queue pair connected after its hello).
    Engine {
        /// Its frame processing.
        engine: Engine,
        /// The read side, non-blocking.
        stream: TcpStream,
    },
}

/// One worker as the pool sees it.
#[derive(Debug)]
struct WorkerHandle {
    inbox: SyncSender<Arrival>,
    waker: Arc<Waker>,
    /// Connections it holds or is about to take: the pool gives new ones to the least loaded.
    load: Arc<AtomicUsize>,
}

/// A soft NIC's engine threads.
#[derive(Debug)]
pub(crate) struct EnginePool {
    workers: Vec<WorkerHandle>,
    stopping: Arc<AtomicBool>,
    /// The hellos pending on this NIC.
    pub(crate) pending: Arc<PendingHellos>,
}

impl EnginePool {
    /// Starts `settings.threads` workers (at least one) for `device`.
    pub(crate) fn start(
        settings: PoolSettings,
        max_pending_hellos: usize,
        port: u16,
        device: Weak<DeviceInner>,
    ) -> std::io::Result<Self> {
        let stopping = Arc::new(AtomicBool::new(false));
        let pending = Arc::new(PendingHellos::new(max_pending_hellos));
        let mut workers = Vec::new();
        for index in 0..settings.threads.max(1) {
            let poll = Poll::new()?;
            let waker = Arc::new(Waker::new(poll.registry(), WAKE)?);
            let (inbox, arrivals) = sync_channel(INBOX_CAPACITY);
            let load = Arc::new(AtomicUsize::new(0));
            let worker = Worker {
                poll,
                arrivals,
                slots: Vec::new(),
                free: Vec::new(),
                ready: VecDeque::new(),
                blocked: Vec::new(),
                device: device.clone(),
                pending: pending.clone(),
                settings,
                load: load.clone(),
                stopping: stopping.clone(),
            };
            std::thread::Builder::new()
                .name(format!("rdkv-soft-engine-{port}-{index}"))
                .spawn(move || worker.run())?;
            workers.push(WorkerHandle { inbox, waker, load });
        }
        Ok(Self {
            workers,
            stopping,
            pending,
        })
    }

    /// How many worker threads serve this NIC.
    pub(crate) fn threads(&self) -> usize {
        self.workers.len()
    }

    /// Gives `arrival` to the least loaded worker, waiting while its inbox is full. `Err`
    /// gives it back when the pool is stopping.
    pub(crate) fn adopt(&self, arrival: Arrival) -> Result<(), Box<Arrival>> {
        let Some(worker) = self
            .workers
            .iter()
            .min_by_key(|worker| worker.load.load(Ordering::Relaxed))
        else {
            return Err(Box::new(arrival));
        };
        worker.load.fetch_add(1, Ordering::Relaxed);
        let sent = match worker.inbox.try_send(arrival) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(arrival)) => {
                // Wake it so it drains, then wait for room.
                let _ = worker.waker.wake();
                worker
                    .inbox
                    .send(arrival)
                    .map_err(|error| Box::new(error.0))
            }
            Err(TrySendError::Disconnected(arrival)) => Err(Box::new(arrival)),
        };
        match sent {
            Ok(()) => {
                let _ = worker.waker.wake();
                Ok(())
            }
            Err(arrival) => {
                worker.load.fetch_sub(1, Ordering::Relaxed);
                Err(arrival)
            }
        }
    }
}

impl Drop for EnginePool {
    fn drop(&mut self) {
        // Not joined: the last reference to the device (and so this pool) can be dropped on a
        // worker thread itself, when its last connection ends.
        self.stopping.store(true, Ordering::Release);
        for worker in &self.workers {
            let _ = worker.waker.wake();
        }
    }
}

/// A connection reading its hello.
struct HelloSlot {
    stream: TcpStream,
    bytes: [u8; HELLO_LENGTH],
    filled: usize,
    deadline: Instant,
    number: u64,
}

/// A connection served by its engine.
struct AttachedSlot {
    stream: TcpStream,
    engine: Engine,
    /// In the worker's `blocked` list (at most once).
    blocked: bool,
}

enum Slot {
    Hello(HelloSlot),
    Attached(AttachedSlot),
}

/// What a turn on one connection decided.
enum Turn {
    /// Nothing more to read now.
    Idle,
    /// More may be readable: it waits in the ready list for another turn.
    Ready,
    /// Its output is full: read again once its socket drains.
    Blocked,
    /// The connection ends, for this reason.
    End(String),
}

/// One engine thread and the connections it owns.
struct Worker {
    poll: Poll,
    arrivals: Receiver<Arrival>,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    /// Connections with data left after their last turn.
    ready: VecDeque<usize>,
    /// Connections waiting for their output to drain (each flagged in its slot, listed once).
    blocked: Vec<usize>,
    device: Weak<DeviceInner>,
    pending: Arc<PendingHellos>,
    settings: PoolSettings,
    load: Arc<AtomicUsize>,
    stopping: Arc<AtomicBool>,
}

impl Worker {
    fn run(mut self) {
        let mut events = Events::with_capacity(1024);
        let mut last_sweep = Instant::now();
        let mut spin_until: Option<Instant> = None;
        let mut spin_token: Option<SpinToken> = None;
        loop {
            let now = Instant::now();
            let timeout = if !self.ready.is_empty() || spin_until.is_some_and(|until| now < until) {
                Duration::ZERO
            } else {
                spin_token = None;
                spin_until = None;
                ENGINE_TICK.saturating_sub(now.duration_since(last_sweep))
            };
            if let Err(error) = self.poll.poll(&mut events, Some(timeout)) {
                if error.kind() != ErrorKind::Interrupted {
                    tracing::error!(%error, "soft NIC engine cannot poll; its connections end");
                    break;
                }
            }
            if self.stopping.load(Ordering::Acquire) {
                break;
            }
            let mut frames = 0;
            let mut woken = false;
            for event in events.iter() {
                if event.token() == WAKE {
                    woken = true;
                    continue;
                }
                let index = event.token().0;
                frames += self.turn(index, event.is_writable());
            }
            if woken {
                frames += self.take_arrivals();
            }
            // Connections left with data get one more turn each, in order.
            for _ in 0..self.ready.len() {
                if let Some(index) = self.ready.pop_front() {
                    frames += self.turn(index, false);
                }
            }
            if last_sweep.elapsed() >= ENGINE_TICK {
                self.sweep();
                last_sweep = Instant::now();
            }
            if frames > 0 && !self.settings.poll_spin.is_zero() {
                if frames <= LIGHT_LOAD_FRAMES {
                    if spin_token.is_none() {
                        spin_token = SpinToken::try_acquire(&self.device);
                    }
                    if spin_token.is_some() {
                        spin_until = Some(Instant::now() + self.settings.poll_spin);
                    }
                } else {
                    // Busy: events come without spinning; leave the cores to the work.
                    spin_token = None;
                    spin_until = None;
                }
            }
        }
        self.stop();
    }

    /// Takes every waiting arrival; returns frames handled on their first turns.
    fn take_arrivals(&mut self) -> usize {
        let mut frames = 0;
        while let Ok(arrival) = self.arrivals.try_recv() {
            let index = self.free.pop().unwrap_or_else(|| {
                self.slots.push(None);
                self.slots.len() - 1
            });
            let (descriptor, slot, interest) = match arrival {
                Arrival::Hello { stream, number } => (
                    stream.as_raw_fd(),
                    Slot::Hello(HelloSlot {
                        stream,
                        bytes: [0; HELLO_LENGTH],
                        filled: 0,
                        deadline: Instant::now() + self.settings.hello_deadline,
                        number,
                    }),
                    Interest::READABLE,
                ),
                Arrival::Engine { engine, stream } => (
                    stream.as_raw_fd(),
                    Slot::Attached(AttachedSlot {
                        stream,
                        engine,
                        blocked: false,
                    }),
                    Interest::READABLE | Interest::WRITABLE,
                ),
            };
            let registered =
                self.poll
                    .registry()
                    .register(&mut SourceFd(&descriptor), Token(index), interest);
            self.slots[index] = Some(slot);
            match registered {
                Ok(()) => {
                    if let Some(Slot::Attached(attached)) = &self.slots[index] {
                        // Anything posted before the attach goes out now.
                        attached.engine.connection.flush();
                    }
                    frames += self.turn(index, false);
                }
                Err(error) => self.end(index, &format!("register with epoll: {error}")),
            }
        }
        frames
    }

    /// One turn on connection `index`; returns frames handled.
    fn turn(&mut self, index: usize, writable: bool) -> usize {
        let Some(slot) = self.slots.get_mut(index).and_then(Option::as_mut) else {
            return 0;
        };
        let (outcome, frames) = match slot {
            Slot::Hello(hello) => {
                match read_hello(&hello.stream, &mut hello.bytes, &mut hello.filled) {
                    Ok(true) => return self.hello_complete(index),
                    Ok(false) => (Turn::Idle, 0),
                    Err(error) => (Turn::End(format!("read hello: {error}")), 0),
                }
            }
            Slot::Attached(attached) => {
                if writable {
                    attached.engine.connection.flush();
                }
                serve(attached)
            }
        };
        match outcome {
            Turn::Idle => {}
            Turn::Ready => self.ready.push_back(index),
            Turn::Blocked => {
                if let Some(Some(Slot::Attached(attached))) = self.slots.get_mut(index) {
                    if attached.blocked {
                        return frames;
                    }
                    attached.blocked = true;
                    self.blocked.push(index);
                    if let Some(device) = self.device.upgrade() {
                        device.gauges.output_stalls.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Turn::End(reason) => self.end(index, &reason),
        }
        frames
    }

    /// A hello arrived whole: answer it, and serve the connection here if its queue pair is
    /// connected.
    fn hello_complete(&mut self, index: usize) -> usize {
        let Some(Some(Slot::Hello(hello))) = self.slots.get_mut(index).map(Option::take) else {
            return 0;
        };
        // No longer pending before it can serve a queue pair: an eviction must never close a
        // connection that serves one.
        self.pending.finish(hello.number);
        let _ = self
            .poll
            .registry()
            .deregister(&mut SourceFd(&hello.stream.as_raw_fd()));
        match answer_hello(&hello.bytes, hello.stream, &self.device) {
            Ok(Some((engine, stream))) => {
                let registered = self.poll.registry().register(
                    &mut SourceFd(&stream.as_raw_fd()),
                    Token(index),
                    Interest::READABLE | Interest::WRITABLE,
                );
                self.slots[index] = Some(Slot::Attached(AttachedSlot {
                    stream,
                    engine,
                    blocked: false,
                }));
                if let Err(error) = registered {
                    self.end(index, &format!("register with epoll: {error}"));
                    return 0;
                }
                if let Some(Slot::Attached(attached)) = &self.slots[index] {
                    attached.engine.connection.flush();
                }
                self.turn(index, false)
            }
            Ok(None) => {
                // Parked in its queue pair until `connect` hands it back to the pool.
                self.release(index);
                0
            }
            Err(reason) => {
                tracing::debug!(%reason, "soft NIC refused a connection");
                self.release(index);
                0
            }
        }
    }

    /// Ends connection `index`: a hello is dropped, an engine finishes (its outstanding
    /// requests fail as on a broken link).
    fn end(&mut self, index: usize, reason: &str) {
        let Some(slot) = self.slots.get_mut(index).and_then(Option::take) else {
            return;
        };
        match slot {
            Slot::Hello(hello) => {
                self.pending.finish(hello.number);
                let _ = self
                    .poll
                    .registry()
                    .deregister(&mut SourceFd(&hello.stream.as_raw_fd()));
                tracing::debug!(%reason, "soft NIC dropped a connection before its hello");
            }
            Slot::Attached(attached) => {
                let _ = self
                    .poll
                    .registry()
                    .deregister(&mut SourceFd(&attached.stream.as_raw_fd()));
                attached.engine.finish(reason);
            }
        }
        self.release(index);
    }

    /// Frees slot `index` (already emptied or taken).
    fn release(&mut self, index: usize) {
        if let Some(slot) = self.slots.get_mut(index) {
            *slot = None;
            self.free.push(index);
            self.load.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The periodic pass: hellos past their deadline end, engines check the retry timeout and
    /// a local close, and connections whose output drained (written by another thread) are
    /// read again.
    fn sweep(&mut self) {
        let now = Instant::now();
        let mut ending = Vec::new();
        for (index, slot) in self.slots.iter().enumerate() {
            match slot {
                Some(Slot::Hello(hello)) if now >= hello.deadline => {
                    if let Some(device) = self.device.upgrade() {
                        device
                            .gauges
                            .hellos_timed_out
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    ending.push((
                        index,
                        format!(
                            "the whole hello must arrive within {:?}",
                            self.settings.hello_deadline
                        ),
                    ));
                }
                Some(Slot::Attached(attached)) => {
                    if let Err(reason) = attached.engine.idle_check() {
                        ending.push((index, reason));
                    }
                }
                _ => {}
            }
        }
        for (index, reason) in ending {
            self.end(index, &reason);
        }
        // An index whose connection ended (or whose slot now holds another) is dropped here.
        let blocked = std::mem::take(&mut self.blocked);
        for index in blocked {
            let Some(Some(Slot::Attached(attached))) = self.slots.get_mut(index) else {
                continue;
            };
            if !attached.blocked {
                continue;
            }
            if attached.engine.output_blocked() {
                self.blocked.push(index);
            } else {
                attached.blocked = false;
                self.turn(index, false);
            }
        }
    }

    /// The pool is stopping (its device is gone): every connection ends.
    fn stop(mut self) {
        for index in 0..self.slots.len() {
            self.end(index, "the soft NIC is shutting down");
        }
        while let Ok(arrival) = self.arrivals.try_recv() {
            match arrival {
                Arrival::Hello { number, .. } => self.pending.finish(number),
                Arrival::Engine { engine, .. } => engine.finish("the soft NIC is shutting down"),
            }
        }
    }
}

/// Serves an attached connection for one turn: processes what it has and reads more, up to
/// [`READS_PER_TURN`] reads; returns what the turn decided and the frames it handled.
fn serve(attached: &mut AttachedSlot) -> (Turn, usize) {
    let engine = &mut attached.engine;
    let mut frames = 0;
    for _ in 0..READS_PER_TURN {
        if let Err(reason) = engine.process() {
            return (Turn::End(reason), frames);
        }
        frames += engine.last_batch_frames;
        if engine.output_blocked() {
            return (Turn::Blocked, frames);
        }
        let space = engine.space();
        let room = space.len();
        match (&attached.stream).read(space) {
            Ok(0) => return (Turn::End("end of stream".into()), frames),
            Ok(read) if read < room => {
                // A short read drained the socket: anything that arrives later raises a new
                // edge, so this turn ends here without a read that would only say EAGAIN.
                engine.end += read;
                if let Err(reason) = engine.process() {
                    return (Turn::End(reason), frames);
                }
                frames += engine.last_batch_frames;
                let turn = if engine.output_blocked() {
                    Turn::Blocked
                } else {
                    Turn::Idle
                };
                return (turn, frames);
            }
            Ok(read) => {
                engine.end += read;
                engine.grow_read_buffer(KEPT_READ_BUFFER);
            }
            Err(error) if error.kind() == ErrorKind::WouldBlock => return (Turn::Idle, frames),
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) => return (Turn::End(format!("read: {error}")), frames),
        }
    }
    if let Err(reason) = engine.process() {
        return (Turn::End(reason), frames);
    }
    frames += engine.last_batch_frames;
    if engine.output_blocked() {
        (Turn::Blocked, frames)
    } else {
        (Turn::Ready, frames)
    }
}

/// The right to busy-poll: one engine thread per device holds it at a time, so spinning never
/// takes the cores that busy connections need.
struct SpinToken(Arc<DeviceInner>);

impl SpinToken {
    fn try_acquire(device: &Weak<DeviceInner>) -> Option<Self> {
        let device = device.upgrade()?;
        let spinning = &device
            .provider
            .as_any()
            .downcast_ref::<super::SoftDevice>()?
            .spinning;
        spinning
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()?;
        Some(Self(device))
    }
}

impl Drop for SpinToken {
    fn drop(&mut self) {
        if let Some(soft) = self.0.provider.as_any().downcast_ref::<super::SoftDevice>() {
            soft.spinning.store(false, Ordering::Release);
        }
    }
}
