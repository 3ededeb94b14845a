//! Heap chunks: handed to one client at a time, sealed when the client moves on or leaves, and
//! reclaimed by the collector once no slot references them for a whole quarantine.
//!
//! Chunk states: `Free` → `Owned` (one client writes blocks into it) → `Sealed` (no writer) →
//! `Candidate` (a scan found no reference after the seal was older than the quarantine) → `Free`
//! (a later scan, a quarantine after the first, still found none). A reference found in any
//! scan sends a candidate back to `Sealed`.
//!
//! Why this is safe: a client writes a block, then CASes its slot within one operation deadline;
//! a reader that read a slot reads the block within one deadline. The quarantine is 1.25 times
//! the deadline, and a chunk is freed only after two of them (the first from the seal to an
//! unreferenced scan, the second from that scan to a confirming one), so by then no operation
//! that saw a slot into it (or wrote a block into it) is still running. Crashed clients need no special case: their chunks are
//! sealed at lease expiry and reclaimed like any other.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use rdkv_fabric::lock;
use std::time::{Duration, Instant};

use rdkv_common::layout::TableGeometry;

/// One chunk's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    /// Available.
    Free,
    /// Written by this connection.
    Owned(u64),
    /// No writer since this instant.
    Sealed(Instant),
    /// Unreferenced in a scan at this instant.
    Candidate(Instant),
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
}

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
        }
    }

    /// Whether the block at heap `offset` lies in a chunk sealed at least a quarantine ago: no
    /// operation that wrote a block there is still running, so a tentative slot pointing at it
    /// was abandoned (its inserter failed or passed its deadline) and will never be committed.
    pub fn writer_gone(&self, offset: u64, now: Instant) -> bool {
        let chunk = (offset / self.chunk_size) as usize;
        matches!(
            lock(&self.chunks).get(chunk),
            Some(ChunkState::Sealed(since)) if now.duration_since(*since) >= self.quarantine
        )
    }

    /// Chunk bytes.
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// Sealed chunks, sealed at least `min_age` ago, whose live bytes (at the last scan) are more
    /// than zero and less than `max_live_share` of the chunk: worth compacting. Sparsest first.
    pub fn compaction_candidates(
        &self,
        now: Instant,
        min_age: Duration,
        max_live_share: f64,
        limit: usize,
    ) -> Vec<u64> {
        let chunks = lock(&self.chunks);
        let live = lock(&self.live_bytes);
        let threshold = (self.chunk_size as f64 * max_live_share) as u64;
        let mut candidates: Vec<(u64, u64)> = chunks
            .iter()
            .enumerate()
            .filter_map(|(index, state)| match state {
                ChunkState::Sealed(since) if now.duration_since(*since) >= min_age => {
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

    /// Seals every chunk `connection` owns, then hands it a free one.
    /// When none is free, nothing changes and the connection keeps its chunk.
    ///
    /// The last free chunk is kept for the compactor (owner
    /// [`COMPACTOR`](crate::compactor::COMPACTOR)), so that compaction can always make room even
    /// when clients have taken everything else.
    pub fn allocate(&self, connection: u64) -> Option<u64> {
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
        self.seal_owned_by(connection);
        lock(&self.chunks)[chunk as usize] = ChunkState::Owned(connection);
        self.allocations.fetch_add(1, Ordering::Relaxed);
        Some(chunk)
    }

    /// Seals every chunk `connection` owns (it moved on, left, or its lease expired).
    pub fn seal_owned_by(&self, connection: u64) {
        let now = Instant::now();
        for state in lock(&self.chunks).iter_mut() {
            if *state == ChunkState::Owned(connection) {
                *state = ChunkState::Sealed(now);
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
                matches!(state, ChunkState::Sealed(_) | ChunkState::Candidate(_))
                    && **live < threshold
            })
            .count() as u64
    }

    /// Heap bytes not free.
    pub fn used_bytes(&self) -> u64 {
        let chunks = lock(&self.chunks);
        chunks
            .iter()
            .filter(|state| **state != ChunkState::Free)
            .count() as u64
            * self.chunk_size
    }

    /// One collection pass over every referencing slot's (heap offset, block length, whether it
    /// is committed); committed slots are counted as keys.
    pub fn collect(
        &self,
        referenced_blocks: impl Iterator<Item = (u64, u64, bool)>,
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
        {
            let mut chunks = lock(&self.chunks);
            for (index, state) in chunks.iter_mut().enumerate() {
                *state = match (*state, referenced[index]) {
                    (ChunkState::Sealed(since), false)
                        if now.duration_since(since) >= self.quarantine =>
                    {
                        ChunkState::Candidate(now)
                    }
                    (ChunkState::Candidate(_), true) => ChunkState::Sealed(now),
                    (ChunkState::Candidate(since), false)
                        if now.duration_since(since) >= self.quarantine =>
                    {
                        freed.push(index as u64);
                        ChunkState::Free
                    }
                    (unchanged, _) => unchanged,
                };
            }
        }
        let reclaimed = freed.len() as u64;
        lock(&self.free).extend(freed);
        self.reclaimed.fetch_add(reclaimed, Ordering::Relaxed);
        self.keys_estimate.store(keys, Ordering::Relaxed);
        CollectionReport { keys, reclaimed }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heap(chunks: u64) -> Heap {
        let geometry = TableGeometry {
            bucket_count: 4,
            heap_size: chunks * 65536,
            chunk_size: 65536,
            hash_seed: 0,
        };
        Heap::new(&geometry, Duration::from_secs(1))
    }

    #[test]
    fn chunks_are_exclusive_and_the_last_one_is_kept_for_the_compactor() {
        let heap = heap(3);
        assert_eq!(heap.allocate(1), Some(0));
        assert_eq!(heap.allocate(2), Some(1));
        assert_eq!(
            heap.allocate(3),
            None,
            "the last free chunk is the compactor's"
        );
        assert_eq!(heap.allocate(crate::compactor::COMPACTOR), Some(2));
        assert_eq!(
            heap.allocate(crate::compactor::COMPACTOR),
            None,
            "no free chunk"
        );
        assert_eq!(heap.used_bytes(), 3 * 65536);
    }

    #[test]
    fn unreferenced_sealed_chunk_is_freed_after_two_quarantines() {
        let heap = heap(3);
        assert_eq!(heap.allocate(1), Some(0));
        assert_eq!(
            heap.allocate(1),
            Some(1),
            "the second request seals chunk 0"
        );
        let start = Instant::now();
        let second = Duration::from_secs(1);
        assert_eq!(
            heap.collect(std::iter::empty(), start).reclaimed,
            0,
            "sealed too recently"
        );
        assert_eq!(
            heap.collect(std::iter::empty(), start + second).reclaimed,
            0,
            "now a candidate"
        );
        assert_eq!(
            heap.collect(std::iter::empty(), start + second * 2)
                .reclaimed,
            1
        );
        assert_eq!(
            heap.used_bytes(),
            65536,
            "chunk 0 is free again; only chunk 1 is in use"
        );
    }

    #[test]
    fn a_reference_keeps_a_chunk_and_resets_its_candidacy() {
        let heap = heap(2);
        heap.allocate(1);
        heap.seal_owned_by(1);
        let start = Instant::now();
        let second = Duration::from_secs(1);
        heap.collect(std::iter::empty(), start + second);
        let report = heap.collect([(128u64, 64u64, true)].into_iter(), start + second * 2);
        assert_eq!(
            report,
            CollectionReport {
                keys: 1,
                reclaimed: 0
            }
        );
        assert_eq!(
            heap.collect(std::iter::empty(), start + second * 3)
                .reclaimed,
            0,
            "candidacy restarted"
        );
        assert_eq!(
            heap.collect(std::iter::empty(), start + second * 4)
                .reclaimed,
            1
        );
    }

    #[test]
    fn sparse_sealed_chunks_are_compaction_candidates_sparsest_first() {
        let heap = heap(4);
        for connection in 1..=3 {
            heap.allocate(connection);
            heap.seal_owned_by(connection);
        }
        let later = Instant::now() + Duration::from_secs(2);
        // Chunk 0: 60 KiB live (dense); chunk 1: 1 KiB; chunk 2: 8 KiB; chunk 3: free.
        heap.collect(
            [
                (0, 60 * 1024, true),
                (65536, 1024, true),
                (2 * 65536, 8 * 1024, true),
            ]
            .into_iter(),
            Instant::now(),
        );
        assert_eq!(
            heap.compaction_candidates(later, Duration::from_secs(1), 0.5, 8),
            vec![1, 2]
        );
        assert_eq!(
            heap.compaction_candidates(later, Duration::from_secs(1), 0.5, 1),
            vec![1]
        );
        assert!(
            heap.compaction_candidates(Instant::now(), Duration::from_secs(1), 0.5, 8)
                .is_empty(),
            "too recently sealed"
        );
    }

    #[test]
    fn owned_chunks_are_never_collected() {
        let heap = heap(1);
        let start = Instant::now();
        heap.allocate(1);
        for step in 1..5 {
            assert_eq!(
                heap.collect(std::iter::empty(), start + Duration::from_secs(step))
                    .reclaimed,
                0
            );
        }
    }
}
