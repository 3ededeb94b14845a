//! The connection's announce word: what this client tells the node, with one-sided WRITEs,
//! about the operations it has in flight, so the node can reuse heap space as soon as no
//! operation can still touch it (`docs/protocol.md`, *Heap space*; the server's side is
//! `server/src/announce.rs`).
//!
//! Every operation gets a number when it takes its scratch buffer. The word is `started` (the
//! highest number given) and `quiescent` (every operation numbered up to it has finished), and
//! its source is 16 registered bytes the fabric reads when it sends the WRITE, so a WRITE
//! always carries the values of the instant it leaves, and values only grow along the queue
//! pair. Each operation's first list starts with the WRITE (before any READ or CAS of it), and
//! when operations finish with none starting after them, a flusher task sends one more, so an
//! idle connection never holds reclamation back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rdkv_common::protocol::ANNOUNCE_SIZE;
use rdkv_fabric::{lock, MemoryRegion, RemoteKey, RemoteSegment, WorkRequest};
use tokio::sync::Notify;

use super::NodeConnection;

/// How long the flusher waits after an operation finishes before it announces, so that a
/// burst of finishes costs one WRITE (and an operation starting meanwhile carries it instead).
/// Small against the node's collector interval (25 ms by default).
const FLUSH_DELAY: Duration = Duration::from_millis(5);

/// The work request id of announce WRITEs.
const ANNOUNCE_REQUEST_ID: u64 = u64::MAX;

/// Operation numbers given and still running.
#[derive(Debug, Default)]
struct Numbers {
    /// The next number.
    next: u64,
    /// Numbers of operations still running, oldest first (numbers are given in increasing
    /// order; a connection runs at most its scratch buffer count at once, so this stays short).
    running: Vec<u64>,
}

impl Numbers {
    /// The highest number given (0 before the first operation).
    fn started(&self) -> u64 {
        self.next.saturating_sub(1)
    }

    /// Every operation numbered up to this has finished.
    fn quiescent(&self) -> u64 {
        match self.running.first() {
            Some(oldest) => oldest - 1,
            None => self.started(),
        }
    }

    /// Operation `number` is no longer running.
    fn remove(&mut self, number: u64) {
        // Usually the newest (a direct operation runs alone on its thread).
        if self.running.last() == Some(&number) {
            self.running.pop();
        } else if let Some(position) = self.running.iter().position(|running| *running == number) {
            self.running.remove(position);
        }
    }
}

/// Where `started` lies in the announce word (and its source bytes).
pub(crate) const STARTED_OFFSET: u64 = 0;
/// Where `quiescent` lies in the announce word (and its source bytes).
pub(crate) const QUIESCENT_OFFSET: u64 = 8;

/// One connection's announce word, its source bytes and its flusher's state.
#[derive(Debug)]
pub(crate) struct Announcer {
    /// Numbers given and running.
    numbers: Mutex<Numbers>,
    /// The registered region holding the source bytes.
    region: MemoryRegion,
    /// The source bytes' offset in `region`.
    source_offset: u64,
    /// The connection's word on the node.
    remote: RemoteKey,
    /// An operation finished after the last start: only a flush will carry it. (A start's
    /// WRITE leaves after the start, so it carries every finish before it; a start that never
    /// posts finishes, which sets this again.)
    dirty: AtomicBool,
    /// Wakes the flusher (after a finish, and when the connection is dropped).
    finished: Arc<Notify>,
}

impl Announcer {
    /// An announcer writing `remote` from `ANNOUNCE_SIZE` bytes of `region` at `source_offset`.
    pub(crate) fn new(region: MemoryRegion, source_offset: u64, remote: RemoteKey) -> Self {
        let announcer = Self {
            numbers: Mutex::new(Numbers {
                next: 1,
                running: Vec::new(),
            }),
            region,
            source_offset,
            remote,
            dirty: AtomicBool::new(false),
            finished: Arc::new(Notify::new()),
        };
        announcer.publish(&lock(&announcer.numbers));
        announcer
    }

    /// Numbers a new operation; its first list must begin with [`Announcer::request`].
    pub(crate) fn start(&self) -> u64 {
        let mut numbers = lock(&self.numbers);
        let number = numbers.next;
        numbers.next += 1;
        numbers.running.push(number);
        self.publish(&numbers);
        // The list's WRITE of the source bytes leaves after this: it carries every finish
        // before it.
        self.dirty.store(false, Ordering::Release);
        number
    }

    /// Operation `number` is over: every list it posted has completed.
    pub(crate) fn finish(&self, number: u64) {
        let _ = self.end(number, true);
        self.finished.notify_one();
    }

    /// Numbers a new operation, as [`Announcer::start`], for an operation that announces
    /// itself by direct access (`direct_get.rs`, `direct_update.rs`): its number and the new
    /// `started`, the only half of the word a start changes (`quiescent` stays: the oldest
    /// operation running is still the oldest, or with none running it stays the last
    /// `started`). The operation stores it at [`STARTED_OFFSET`] of the remote word before
    /// any other access of it, holding the queue pair's executor (so that words only grow
    /// along it). The remote `quiescent` may still lag a finish that no WRITE carried: the
    /// flush stays due for it.
    pub(crate) fn start_direct(&self) -> (u64, u64) {
        let mut numbers = lock(&self.numbers);
        let number = numbers.next;
        numbers.next += 1;
        numbers.running.push(number);
        let started = numbers.started();
        // The offset is inside the region and 8-aligned by construction
        // (`NodeConnection::open`).
        let _ = self.region.store_u64(self.source_offset, started.to_le());
        (number, started)
    }

    /// Direct operation `number` is over: the new `quiescent`, to store at
    /// [`QUIESCENT_OFFSET`] of the remote word after the operation's last access, holding the
    /// executor (a finish leaves `started` as it is). It carries every finish so far, so no
    /// flush is due until the next finish. (Leaving the finish to the next start or the
    /// flusher saved about 120 instructions a GET, but an idle connection then showed an
    /// operation running until the flusher task ran, and a client whose runtime ran no task for
    /// the node's operation deadline, a `block_on` per call, was cut off: found by a review.)
    pub(crate) fn finish_direct(&self, number: u64) -> u64 {
        let mut numbers = lock(&self.numbers);
        numbers.remove(number);
        let quiescent = numbers.quiescent();
        let _ = self
            .region
            .store_u64(self.source_offset + QUIESCENT_OFFSET, quiescent.to_le());
        self.dirty.store(false, Ordering::Release);
        quiescent
    }

    /// Ends operation `number` (marking a flush due when `flush_due`): the word after it.
    fn end(&self, number: u64, flush_due: bool) -> [u8; ANNOUNCE_SIZE as usize] {
        let mut numbers = lock(&self.numbers);
        numbers.remove(number);
        let word = self.publish(&numbers);
        if flush_due {
            self.dirty.store(true, Ordering::Release);
        }
        word
    }

    /// What wakes the flusher: given to it at start, and notified when the connection goes.
    pub(crate) fn wakeups(&self) -> Arc<Notify> {
        self.finished.clone()
    }

    /// The highest operation number given: every operation that places a block in the current
    /// chunk has a number up to it.
    pub(crate) fn started(&self) -> u64 {
        lock(&self.numbers).started()
    }

    /// The word now, for a WRITE of it by direct access made holding the queue pair's
    /// executor (so that, as for the WRITE of the source bytes, words only grow along it).
    fn current(&self) -> [u8; ANNOUNCE_SIZE as usize] {
        word(&lock(&self.numbers))
    }

    /// The WRITE of the word, unsignaled (the caller's list ends with a signaled request).
    pub(crate) fn request(&self) -> WorkRequest {
        WorkRequest::write(
            ANNOUNCE_REQUEST_ID,
            self.region
                .segment(self.source_offset, ANNOUNCE_SIZE as u32),
            RemoteSegment {
                address: self.remote.address,
                remote_key: self.remote.key,
            },
        )
        .with_signaled(false)
    }

    /// Writes the source bytes (under the numbers lock, so they only grow): the word of
    /// `numbers`, which it returns. Two aligned stores, `started` first: a WRITE that leaves
    /// between them carries the new `started` with the old `quiescent`, which only
    /// understates what finished.
    fn publish(&self, numbers: &Numbers) -> [u8; ANNOUNCE_SIZE as usize] {
        // The offset is inside the region and 8-aligned by construction
        // (`NodeConnection::open`).
        let _ = self.region.store_u64(
            self.source_offset + STARTED_OFFSET,
            numbers.started().to_le(),
        );
        let _ = self.region.store_u64(
            self.source_offset + QUIESCENT_OFFSET,
            numbers.quiescent().to_le(),
        );
        word(numbers)
    }
}

/// The announce word of `numbers`: `started`, then `quiescent`, little-endian.
fn word(numbers: &Numbers) -> [u8; ANNOUNCE_SIZE as usize] {
    let mut bytes = [0u8; ANNOUNCE_SIZE as usize];
    bytes[..8].copy_from_slice(&numbers.started().to_le_bytes());
    bytes[8..].copy_from_slice(&numbers.quiescent().to_le_bytes());
    bytes
}

/// Announces finishes that no later start carried: after a finish, waits [`FLUSH_DELAY`] (a
/// burst of finishes costs one WRITE, and a start meanwhile carries them instead) and WRITEs the
/// word if it is still dirty. Between flushes it holds only `wakeups` and a weak reference, so
/// it keeps nothing of the connection alive; the connection's drop wakes it, and it ends.
pub(crate) async fn flusher(connection: Weak<NodeConnection>, wakeups: Arc<Notify>) {
    loop {
        wakeups.notified().await;
        tokio::time::sleep(FLUSH_DELAY).await;
        let Some(connection) = connection.upgrade() else {
            return;
        };
        let announcer = &connection.announcer;
        if connection.is_broken() || !announcer.dirty.swap(false, Ordering::AcqRel) {
            continue;
        }
        connection.counters.verbs.add(1);
        connection.counters.announce_flushes.add(1);
        // By direct access where the fabric has it (a store, no list, no allocation: a flush
        // every few milliseconds among direct GETs that allocate nothing), else posted.
        let remote = RemoteSegment {
            address: announcer.remote.address,
            remote_key: announcer.remote.key,
        };
        match connection
            .queue_pair
            .direct(|access| access.write(remote, &announcer.current()))
        {
            Some(Ok(())) => continue,
            // The queue pair is in ERROR: the connection is retired.
            Some(Err(_status)) => {
                connection.mark_broken();
                continue;
            }
            None => {}
        }
        let write = announcer.request().with_signaled(true);
        if let Ok(posted) = connection.queue_pair.post(vec![write]).await {
            posted.await;
        }
    }
}
