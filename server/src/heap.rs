//! Heap chunks: handed to one client at a time, sealed when the client moves on or leaves, and
//! reclaimed as soon as no operation can still touch them.
//!
//! Chunk states: `Free` → `Owned` (one client writes blocks into it) → `Sealed` (no new block;
//! writers that placed one may still be running) → `Settled` (every writer finished: no new
//! reference into the chunk can appear) → `Candidate` (a scan found no reference; operations
//! that read a slot before that scan may still read a block) → `Free`.
//!
//! Why this is safe, without waiting for deadlines (`announce.rs` has the ordering argument):
//! - *Sealed → Settled* once the connection that wrote there has announced itself quiescent
//!   through the `started` count it sent with `AllocateChunk` (every operation that placed a
//!   block in the chunk has a number up to it), or is gone (its queue pair drained).
//! - *Settled → Candidate* when a scan finds no slot into the chunk; the announce words are
//!   snapshotted after the scan. An operation that read a slot into the chunk read it before
//!   that slot changed, hence before the scan passed it: its start was announced by then.
//! - *Candidate → Free* once every connection of that snapshot is quiescent through what it had
//!   started (or gone). No operation that could hold a reference is left.
//!
//! Each step also completes after a quarantine (1.25 × the operation deadline) whatever the
//! announce words say, as before they existed: a client that stopped announcing (hung,
//! partitioned, its connection broken) delays reclamation by at most that, never forever.
//! Crashed clients need no special case: their chunks are sealed at lease expiry and their
//! words released after their queue pair is drained.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkv_common::layout::TableGeometry;
use rdkv_fabric::{lock, MemoryWindow};

use crate::announce::{Announcements, Snapshot};

/// One chunk's state.
#[derive(Debug, Clone)]
enum ChunkState {
    /// Available.
    Free,
    /// Written by this connection.
    Owned(u64),
    /// No new block since `since`; `writer` is the connection that wrote there and the
    /// `started` count its last placing operation is within (`None`: it is gone).
    Sealed {
        since: Instant,
        writer: Option<(u64, u64)>,
    },
    /// Every writer finished.
    Settled,
    /// Unreferenced at a scan that ended at `since`; free once `snapshot` is quiescent.
    Candidate { since: Instant, snapshot: Snapshot },
}

/// What one collection pass found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CollectionReport {
    /// Committed slots seen (keys).
    pub keys: u64,
    /// Chunks returned to the free list.
    pub reclaimed: u64,
}

/// The chunk allocator and collector.
#[derive(Debug)]
pub struct Heap {
    /// Chunk bytes.
    chunk_size: u64,
    /// Chunks in the heap (fixed).
    chunk_count: usize,
    /// Per-chunk state.
    chunks: Mutex<Vec<ChunkState>>,
    /// Free chunks, reused oldest-freed first.
    free: Mutex<VecDeque<u64>>,
    /// How long a chunk stays unreferenced before reuse.
    quarantine: Duration,
    /// Chunks handed out since start.
    pub allocations: AtomicU64,
    /// Chunks reclaimed since start.
    pub reclaimed: AtomicU64,
    /// Keys seen by the last scan.
    pub keys_estimate: AtomicU64,
    /// Live bytes per chunk, from the last scan.
    live_bytes: Mutex<Vec<u64>>,
    /// Blocks moved by compaction since start.
    pub blocks_relocated: AtomicU64,
    /// Abandoned tentative slots cleared by the collector since start.
    pub tentatives_cleared: AtomicU64,
    /// The WRITE windows of sealed chunks, revoked once the chunk's writers are done.
    sealed_windows: Mutex<HashMap<u64, MemoryWindow>>,
    /// Milliseconds from a chunk's last reference to its reuse, for the last chunks freed.
    pub reuse_delays: Mutex<VecDeque<u64>>,
}

/// How many reuse delays [`Heap::reuse_delays`] keeps.
const REUSE_DELAYS_KEPT: usize = 1024;

impl Heap {
    /// A heap of `geometry.chunk_count()` free chunks.
    pub fn new(geometry: &TableGeometry, quarantine: Duration) -> Self {
        let count = geometry.chunk_count();
        Self {
            chunk_size: geometry.chunk_size,
            chunk_count: count as usize,
            chunks: Mutex::new(vec![ChunkState::Free; count as usize]),
            free: Mutex::new((0..count).collect()),
            quarantine,
            allocations: AtomicU64::new(0),
            reclaimed: AtomicU64::new(0),
            keys_estimate: AtomicU64::new(0),
            live_bytes: Mutex::new(vec![0; count as usize]),
            blocks_relocated: AtomicU64::new(0),
            tentatives_cleared: AtomicU64::new(0),
            sealed_windows: Mutex::new(HashMap::new()),
            reuse_delays: Mutex::new(VecDeque::new()),
        }
    }

    /// Whether the block at heap `offset` lies in a settled chunk: no operation that wrote a
    /// block there is still running, so a tentative slot pointing at it was abandoned (its
    /// inserter failed or passed its deadline) and will never be committed.
    pub fn writer_gone(&self, offset: u64) -> bool {
        let chunk = (offset / self.chunk_size) as usize;
        matches!(
            lock(&self.chunks).get(chunk),
            Some(ChunkState::Settled | ChunkState::Candidate { .. })
        )
    }

    /// Chunk bytes.
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// Settled chunks (no writer is still placing a block there) whose live bytes (at the
    /// last scan) are more than zero and less than `max_live_share` of the chunk: worth
    /// compacting. Sparsest first.
    pub fn compaction_candidates(&self, max_live_share: f64, limit: usize) -> Vec<u64> {
        let chunks = lock(&self.chunks);
        let live = lock(&self.live_bytes);
        let threshold = (self.chunk_size as f64 * max_live_share) as u64;
        let mut candidates: Vec<(u64, u64)> = chunks
            .iter()
            .enumerate()
            .filter_map(|(index, state)| match state {
                ChunkState::Settled => {
                    let bytes = live[index];
                    (bytes > 0 && bytes < threshold).then_some((bytes, index as u64))
                }
                _ => None,
            })
            .collect();
        candidates.sort_unstable();
        candidates
            .into_iter()
            .take(limit)
            .map(|(_, index)| index)
            .collect()
    }

    /// Seals every chunk `connection` owns (its operations up to `started` may still be
    /// placing blocks there), then hands it a free one. When none is free, nothing changes and
    /// the connection keeps its chunk.
    ///
    /// The last free chunk is kept for the compactor (owner
    /// [`COMPACTOR`](crate::compactor::COMPACTOR)), so that compaction can always make room even
    /// when clients have taken everything else.
    pub fn allocate(&self, connection: u64, started: u64) -> Option<u64> {
        let chunk = {
            let mut free = lock(&self.free);
            let reserve = if connection == crate::compactor::COMPACTOR {
                0
            } else {
                1
            };
            if free.len() <= reserve && self.chunk_count > 1 {
                return None;
            }
            free.pop_front()?
        };
        self.seal(connection, Some((connection, started)));
        lock(&self.chunks)[chunk as usize] = ChunkState::Owned(connection);
        self.allocations.fetch_add(1, Ordering::Relaxed);
        Some(chunk)
    }

    /// Seals every chunk `connection` owns after it is gone (left, or its lease expired): its
    /// queue pair is drained, so it writes nothing more.
    pub fn seal_owned_by(&self, connection: u64) {
        self.seal(connection, None);
    }

    fn seal(&self, connection: u64, writer: Option<(u64, u64)>) {
        let now = Instant::now();
        for state in lock(&self.chunks).iter_mut() {
            if matches!(state, ChunkState::Owned(owner) if *owner == connection) {
                *state = ChunkState::Sealed { since: now, writer };
            }
        }
    }

    /// Keeps the WRITE window of a sealed chunk until the chunk's writers are done; then it is
    /// revoked, before the chunk can be reused.
    pub fn keep_window(&self, chunk: u64, window: MemoryWindow) {
        if let Some(previous) = lock(&self.sealed_windows).insert(chunk, window) {
            previous.invalidate();
        }
    }

    /// Moves sealed chunks whose writers are done to `Settled`, and revokes their windows.
    pub fn settle(&self, announcements: &Announcements, now: Instant) {
        let mut settled = Vec::new();
        {
            let mut chunks = lock(&self.chunks);
            for (index, state) in chunks.iter_mut().enumerate() {
                let ChunkState::Sealed { since, writer } = state else {
                    continue;
                };
                let done = match writer {
                    None => true,
                    Some((connection, started)) => {
                        announcements.quiescent_through(*connection, *started)
                    }
                };
                if done || now.duration_since(*since) >= self.quarantine {
                    *state = ChunkState::Settled;
                    settled.push(index as u64);
                }
            }
        }
        let mut windows = lock(&self.sealed_windows);
        for chunk in settled {
            if let Some(window) = windows.remove(&chunk) {
                window.invalidate();
            }
        }
    }

    /// Chunks sealed or quarantined: neither owned nor free, coming back once unreferenced.
    ///
    /// Only chunks that will really come back count: unreferenced ones, and sparse ones that
    /// compaction will empty (live bytes under `max_live_share` of a chunk at the last scan).
    pub fn reclaimable_chunks(&self, max_live_share: f64) -> u64 {
        let chunks = lock(&self.chunks);
        let live = lock(&self.live_bytes);
        let threshold = (self.chunk_size as f64 * max_live_share) as u64;
        chunks
            .iter()
            .zip(live.iter())
            .filter(|(state, live)| {
                matches!(
                    state,
                    ChunkState::Sealed { .. } | ChunkState::Settled | ChunkState::Candidate { .. }
                ) && **live < threshold
            })
            .count() as u64
    }

    /// Heap bytes not free.
    pub fn used_bytes(&self) -> u64 {
        let chunks = lock(&self.chunks);
        chunks
            .iter()
            .filter(|state| !matches!(state, ChunkState::Free))
            .count() as u64
            * self.chunk_size
    }

    /// Over the kept reuse delays: median, 99th percentile and largest, in milliseconds (zeros
    /// before any chunk was reclaimed).
    pub fn reuse_delay_summary(&self) -> [u64; 3] {
        let mut delays: Vec<u64> = lock(&self.reuse_delays).iter().copied().collect();
        if delays.is_empty() {
            return [0; 3];
        }
        delays.sort_unstable();
        let at = |share: f64| delays[((delays.len() - 1) as f64 * share).round() as usize];
        [at(0.5), at(0.99), at(1.0)]
    }

    /// Chunks free now.
    pub fn free_chunks(&self) -> u64 {
        lock(&self.free).len() as u64
    }

    /// Chunks in the heap.
    pub fn chunk_count(&self) -> u64 {
        self.chunk_count as u64
    }

    /// One collection pass over every referencing slot's (heap offset, block length, whether it
    /// is committed); committed slots are counted as keys. `snapshot` is the announce words'
    /// `started`, read after the scan that produced `referenced_blocks` ended.
    pub fn collect(
        &self,
        referenced_blocks: impl Iterator<Item = (u64, u64, bool)>,
        snapshot: &Snapshot,
        announcements: &Announcements,
        now: Instant,
    ) -> CollectionReport {
        let count = self.chunk_count;
        let mut referenced = vec![false; count];
        let mut live = vec![0u64; count];
        let mut keys = 0u64;
        for (offset, length, committed) in referenced_blocks {
            keys += u64::from(committed);
            let chunk = (offset / self.chunk_size) as usize;
            if let Some(flag) = referenced.get_mut(chunk) {
                *flag = true;
                live[chunk] += length;
            }
        }
        *lock(&self.live_bytes) = live;
        let mut freed = Vec::new();
        // Candidates of one scan share their snapshot: check each snapshot once per pass.
        let mut quiescent: HashMap<*const Vec<(u64, u64)>, bool> = HashMap::new();
        let mut snapshot_done = |snapshot: &Snapshot| {
            *quiescent
                .entry(Arc::as_ptr(snapshot))
                .or_insert_with(|| announcements.all_quiescent(snapshot))
        };
        {
            let mut chunks = lock(&self.chunks);
            for (index, state) in chunks.iter_mut().enumerate() {
                let next = match (&*state, referenced[index]) {
                    (ChunkState::Settled, false) => Some(ChunkState::Candidate {
                        since: now,
                        snapshot: snapshot.clone(),
                    }),
                    (ChunkState::Candidate { .. }, true) => Some(ChunkState::Settled),
                    (ChunkState::Candidate { since, snapshot }, false)
                        if now.duration_since(*since) >= self.quarantine
                            || snapshot_done(snapshot) =>
                    {
                        freed.push((index as u64, *since));
                        Some(ChunkState::Free)
                    }
                    _ => None,
                };
                if let Some(next) = next {
                    *state = next;
                }
            }
        }
        let reclaimed = freed.len() as u64;
        if reclaimed > 0 {
            let mut delays = lock(&self.reuse_delays);
            for (_, unreferenced_since) in &freed {
                if delays.len() == REUSE_DELAYS_KEPT {
                    delays.pop_front();
                }
                delays.push_back(now.duration_since(*unreferenced_since).as_millis() as u64);
            }
        }
        lock(&self.free).extend(freed.into_iter().map(|(chunk, _)| chunk));
        self.reclaimed.fetch_add(reclaimed, Ordering::Relaxed);
        self.keys_estimate.store(keys, Ordering::Relaxed);
        CollectionReport { keys, reclaimed }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkv_fabric::{Device, DeviceConfig};

    fn heap(chunks: u64) -> Heap {
        let geometry = TableGeometry {
            bucket_count: 4,
            heap_size: chunks * 65536,
            chunk_size: 65536,
            hash_seed: 0,
        };
        Heap::new(&geometry, Duration::from_secs(1))
    }

    /// Announce words for connections 1 and 2, written through the returned setter.
    struct Words {
        announcements: Announcements,
        addresses: HashMap<u64, u64>,
    }

    impl Words {
        fn new() -> Self {
            let device = Device::loopback(DeviceConfig::default());
            let announcements =
                Announcements::allocate(&device.allocate_protection_domain(), 4).expect("words");
            let addresses = [1u64, 2]
                .into_iter()
                .map(|connection| (connection, announcements.claim(connection).expect("a word")))
                .collect();
            Self {
                announcements,
                addresses,
            }
        }

        fn announce(&self, connection: u64, started: u64, quiescent: u64) {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&started.to_le_bytes());
            bytes[8..].copy_from_slice(&quiescent.to_le_bytes());
            let region = self.announcements.region();
            region
                .write(self.addresses[&connection] - region.address(), &bytes)
                .expect("write a word");
        }

        /// One collector tick: settle, scan (`referenced`), snapshot, collect.
        fn tick(
            &self,
            heap: &Heap,
            referenced: &[(u64, u64, bool)],
            now: Instant,
        ) -> CollectionReport {
            heap.settle(&self.announcements, now);
            let snapshot = self.announcements.snapshot();
            heap.collect(
                referenced.iter().copied(),
                &snapshot,
                &self.announcements,
                now,
            )
        }
    }

    #[test]
    fn chunks_are_exclusive_and_the_last_one_is_kept_for_the_compactor() {
        let heap = heap(3);
        assert_eq!(heap.allocate(1, 0), Some(0));
        assert_eq!(heap.allocate(2, 0), Some(1));
        assert_eq!(
            heap.allocate(3, 0),
            None,
            "the last free chunk is the compactor's"
        );
        assert_eq!(heap.allocate(crate::compactor::COMPACTOR, 0), Some(2));
        assert_eq!(
            heap.allocate(crate::compactor::COMPACTOR, 0),
            None,
            "no free chunk"
        );
        assert_eq!(heap.used_bytes(), 3 * 65536);
    }

    #[test]
    fn a_chunk_comes_back_as_soon_as_its_writers_and_readers_are_done() {
        let words = Words::new();
        let heap = heap(3);
        let now = Instant::now();
        words.announce(1, 5, 4);
        words.announce(2, 9, 9);
        assert_eq!(heap.allocate(1, 5), Some(0));
        assert_eq!(
            heap.allocate(1, 5),
            Some(1),
            "chunk 0 sealed; operation 5 may still write"
        );
        assert_eq!(words.tick(&heap, &[], now).reclaimed, 0, "writer 5 runs");
        assert_eq!(heap.compaction_candidates(0.5, 8), Vec::<u64>::new());
        words.announce(1, 6, 5);
        assert_eq!(
            words.tick(&heap, &[], now).reclaimed,
            0,
            "settled and unreferenced: a candidate, waiting for operations 6 of connection 1"
        );
        assert_eq!(words.tick(&heap, &[], now).reclaimed, 0, "operation 6 runs");
        words.announce(1, 6, 6);
        assert_eq!(
            words.tick(&heap, &[], now).reclaimed,
            1,
            "nothing left that saw it"
        );
        assert_eq!(heap.free_chunks(), 2, "chunk 0 and the never-used chunk 2");
        assert_eq!(heap.reuse_delays.lock().expect("delays").len(), 1);
    }

    #[test]
    fn a_silent_connection_delays_reuse_by_a_quarantine_at_most() {
        let words = Words::new();
        let heap = heap(3);
        let start = Instant::now();
        let at = |seconds: f64| start + Duration::from_secs_f64(seconds);
        words.announce(1, 3, 2);
        heap.allocate(1, 3);
        heap.allocate(1, 3);
        assert_eq!(
            words.tick(&heap, &[], at(0.5)).reclaimed,
            0,
            "writer 3 runs"
        );
        assert_eq!(
            words.tick(&heap, &[], at(1.5)).reclaimed,
            0,
            "settled by time, and a candidate"
        );
        assert_eq!(words.tick(&heap, &[], at(2.0)).reclaimed, 0, "3 still runs");
        assert_eq!(
            words.tick(&heap, &[], at(2.6)).reclaimed,
            1,
            "freed by time"
        );
    }

    #[test]
    fn a_reference_keeps_a_chunk_and_resets_its_candidacy() {
        let words = Words::new();
        let heap = heap(2);
        words.announce(1, 1, 0);
        heap.allocate(1, 1);
        heap.seal_owned_by(1);
        let now = Instant::now();
        assert_eq!(words.tick(&heap, &[], now).reclaimed, 0, "a candidate");
        let report = words.tick(&heap, &[(128, 64, true)], now);
        assert_eq!(
            report,
            CollectionReport {
                keys: 1,
                reclaimed: 0
            },
            "referenced again (a slot the scan had not reached): settled"
        );
        words.announce(1, 1, 1);
        assert_eq!(
            words.tick(&heap, &[], now).reclaimed,
            0,
            "candidacy restarted"
        );
        assert_eq!(words.tick(&heap, &[], now).reclaimed, 1);
    }

    #[test]
    fn a_gone_writer_settles_at_once_and_its_window_is_revoked() {
        let words = Words::new();
        let heap = heap(2);
        let device = Device::loopback(DeviceConfig::default());
        let window = device.allocate_protection_domain().allocate_memory_window();
        heap.allocate(2, 0);
        heap.keep_window(0, window);
        heap.seal_owned_by(2);
        words.announcements.release(2);
        heap.settle(&words.announcements, Instant::now());
        assert!(heap.writer_gone(100), "settled");
        assert!(
            lock(&heap.sealed_windows).is_empty(),
            "its window was revoked"
        );
    }

    #[test]
    fn sparse_settled_chunks_are_compaction_candidates_sparsest_first() {
        let words = Words::new();
        let heap = heap(4);
        for connection in 1..=3 {
            heap.allocate(connection, 0);
            heap.seal_owned_by(connection);
        }
        // Chunk 0: 60 KiB live (dense); chunk 1: 1 KiB; chunk 2: 8 KiB; chunk 3: free.
        words.tick(
            &heap,
            &[
                (0, 60 * 1024, true),
                (65536, 1024, true),
                (2 * 65536, 8 * 1024, true),
            ],
            Instant::now(),
        );
        assert_eq!(heap.compaction_candidates(0.5, 8), vec![1, 2]);
        assert_eq!(heap.compaction_candidates(0.5, 1), vec![1]);
    }

    #[test]
    fn owned_chunks_are_never_collected() {
        let words = Words::new();
        let heap = heap(1);
        let start = Instant::now();
        heap.allocate(1, 0);
        for step in 1..5 {
            assert_eq!(
                words
                    .tick(&heap, &[], start + Duration::from_secs(step))
                    .reclaimed,
                0
            );
        }
    }
}
