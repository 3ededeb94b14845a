//! One client connection to one node, a file per role:
//!
//! - [`config`]: how a client reaches a node ([`ClientConfig`], [`NodeAddress`]);
//! - `handshake`: connect, authenticate, connect the queue pair, start the control task;
//! - `control`: the control task (requests in order, heartbeats while idle) and the requests
//!   that go through it;
//! - `pool`: the process's shared device, protection domain and scratch buffer pool;
//! - `scratch`: a scratch buffer per operation and the posting of lists through it;
//! - `step_list`: one step's requests, with room for the two that posting adds;
//! - `writer_stripes`: the per-key writer turns of this process;
//! - `slot_cache`: the process's cache of where it last saw each key's committed slot;
//! - here: the connection itself and its heap chunk cursor.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkv_common::protocol::{ClientMessage, ConnectionKeys, ServerMessage, Welcome};
use rdkv_fabric::lock;
use rdkv_fabric::{MemoryRegion, QueuePair, RemoteKey};
use tokio::sync::{mpsc, Semaphore};

use crate::counters::Counters;
use crate::error::{Error, Result};
use crate::fault::FaultInjector;
use crate::progress::{Progress, Waiting};

mod announce;
mod config;
mod control;
mod direct_get;
mod direct_update;
pub(crate) use direct_update::DirectWrite;
mod handshake;
pub(crate) use handshake::NOT_SERVING;
mod pool;
mod scratch;
mod slot_cache;
mod step_list;
mod writer_stripes;

use announce::Announcer;
pub use config::{
    ClientConfig, FabricChoice, NodeAddress, SharedMemory, DEFAULT_CONCURRENCY, MAX_CONCURRENCY,
};
use control::{control_task, ControlRequest};
use handshake::CONNECT_TIMEOUT;
use pool::ClientFabric;
pub(crate) use scratch::{
    ExecuteError, Scratch, BUCKETS_AT, CAS_RESULTS_AT, READ_BLOCKS_AT, READ_BLOCKS_SIZE,
    WRITE_BLOCK_AT,
};
pub(crate) use slot_cache::slot_cache_entries_from_environment;
pub(crate) use slot_cache::{shared as shared_slot_cache, Guess, SlotCache};
pub use slot_cache::{DEFAULT_SLOT_CACHE_ENTRIES, MAX_SLOT_CACHE_ENTRIES};
pub(crate) use step_list::StepList;
pub(crate) use writer_stripes::WriterStripes;

/// How long to wait before asking again for a chunk when the heap's free chunks are all
/// waiting to be reclaimed.
const CHUNK_RETRY_INTERVAL: Duration = Duration::from_millis(10);

/// How long to wait before asking again when the node says nothing will come back: two of its
/// collector passes (25 ms by default), so that its answer reflects the latest writes.
const TABLE_FULL_CONFIRM_DELAY: Duration = Duration::from_millis(60);

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
    /// Scratch buffers that may still be written by a queued list (an operation cancelled
    /// inside its post): kept until the queue pair above is gone (fields drop in order).
    retired_buffers: Mutex<Vec<MemoryRegion>>,
    /// The announce word: which operations are in flight, for the node's reclamation.
    announcer: Arc<Announcer>,
    /// Bounds this connection's operations in flight (`ClientConfig::concurrency`).
    scratch_permits: Arc<Semaphore>,
    /// The current chunk.
    chunk: Mutex<Option<ChunkCursor>>,
    /// One refill at a time: operations that find the chunk full wait for the refill in
    /// progress instead of each asking for a chunk.
    refill: Semaphore,
    /// The last time a refill concluded that the node's heap is full, and the node's reason:
    /// operations that were waiting for that refill fail with it at once, instead of each
    /// asking again in turn (48 tasks on a full heap took up to the whole deadline to fail).
    heap_full: Mutex<Option<(std::time::Instant, String)>>,
    /// Writers of one key (by stripe) in this process take turns: they would otherwise only
    /// lose CAS races to each other. Taken before a scratch buffer, never while holding one.
    /// Shared by every lane's connection to the node.
    writer_stripes: Arc<WriterStripes>,
    /// The node's view of the process's slot cache (where this process last saw each key's
    /// committed slot): a lookup with a guess READs its block with the buckets.
    pub(crate) slot_cache: Arc<SlotCache>,
    /// Requests to the control task.
    control: mpsc::Sender<ControlRequest>,
    /// Set when the connection failed; the client then reconnects. Shared with the control
    /// task, which sets it the moment the node ends the session (a fence, a stop, a close).
    broken: Arc<AtomicBool>,
    /// What the client knows of the node's clock, for reading its lease word (recalibrated by
    /// every heartbeat's answer).
    lease_clock: Arc<Mutex<rdkv_common::lease::ClockBound>>,
    /// Counters.
    pub(crate) counters: Arc<Counters>,
    /// The configured fault injector (tests only).
    fault_injector: Option<Arc<dyn FaultInjector>>,
    /// The process's device, domain and scratch pool.
    fabric: Arc<ClientFabric>,
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

impl Drop for NodeConnection {
    fn drop(&mut self) {
        // The announce flusher waits for a wake-up; this one finds the connection gone.
        self.announcer.wakeups().notify_one();
    }
}

impl NodeConnection {
    /// Whether the connection failed.
    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Whether the node's fabric on this connection may offer direct access to its memory
    /// (`shm`): never over `soft` or `verbs`, where the direct paths are not worth trying.
    pub(crate) fn offers_direct_access(&self) -> bool {
        self.welcome
            .server_endpoint
            .backend()
            .capabilities()
            .shares_memory
    }

    /// Marks the connection failed.
    pub(crate) fn mark_broken(&self) {
        self.broken.store(true, Ordering::Release);
    }

    /// Reserves heap space for a block of `length` bytes in the current chunk, asking the
    /// server for a new chunk when it is full. Returns the place and the operation's new number
    /// in the announce word, given under the chunk lock with the reservation (see
    /// [`Scratch::place_block`], which parks the operation's old number first).
    pub(crate) async fn place_block(
        &self,
        length: u64,
        progress: &Progress,
    ) -> Result<(BlockPlace, u64)> {
        let mut confirmed_full = false;
        loop {
            progress.wait_for(Waiting::HeapChunk);
            if let Some(place) = self.take_from_chunk(length) {
                return Ok(place);
            }
            let waiting_since = std::time::Instant::now();
            let refilling = self
                .refill
                .acquire()
                .await
                .expect("the refill semaphore is never closed");
            // Another operation may have refilled while this one waited.
            if let Some(place) = self.take_from_chunk(length) {
                return Ok(place);
            }
            // Or found the heap full while this one waited: the same answer, now.
            if let Some((_, reason)) = lock(&self.heap_full)
                .as_ref()
                .filter(|(concluded, _)| *concluded >= waiting_since)
            {
                return Err(Error::TableFull {
                    reason: reason.clone(),
                });
            }
            // No block goes into the current chunk from now on, so every operation that placed
            // one there has a number up to `started` (the node waits for them before it reuses
            // the chunk).
            let started = {
                let mut chunk = lock(&self.chunk);
                chunk.take();
                self.announcer.started()
            };
            match self
                .control(ClientMessage::AllocateChunk {
                    started,
                    needed: length,
                })
                .await?
            {
                ServerMessage::Chunk { heap_offset, key } => {
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
                        // The node judges from its last scan, which may predate deletes or
                        // replacements that just happened: ask once more after the next ones.
                        if confirmed_full {
                            *lock(&self.heap_full) =
                                Some((std::time::Instant::now(), reason.clone()));
                            return Err(Error::TableFull { reason });
                        }
                        confirmed_full = true;
                        // Others may ask meanwhile (each confirms for itself, in parallel).
                        drop(refilling);
                        progress.wait_for(Waiting::HeapReclaim);
                        tokio::time::sleep(TABLE_FULL_CONFIRM_DELAY).await;
                        continue;
                    }
                    // Chunks are on their way back; wait for the collector (the operation's
                    // deadline bounds the wait).
                    progress.wait_for(Waiting::HeapReclaim);
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

    /// Reserves space in the current chunk and numbers the operation, under the chunk lock: a
    /// refill takes the chunk and reads `started` under the same lock, so its `started` covers
    /// every operation that reserved space in the chunk it seals.
    fn take_from_chunk(&self, length: u64) -> Option<(BlockPlace, u64)> {
        self.reserve_in_chunk(length, Announcer::start)
    }

    /// Reserves space in the current chunk and starts the operation with `start`, under the
    /// chunk lock ([`NodeConnection::take_from_chunk`]).
    fn reserve_in_chunk<Started>(
        &self,
        length: u64,
        start: impl FnOnce(&Announcer) -> Started,
    ) -> Option<(BlockPlace, Started)> {
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
        Some((place, start(&self.announcer)))
    }
}
