//! The heap: handed out in grants of contiguous 4 KiB extents, one grant per writing client at a
//! time, sealed when the client moves on or leaves, and reclaimed extent by extent as soon as no
//! operation can still touch it.
//!
//! Extent states: `Free` → `Owned` (one client writes blocks into its grant) → `Sealed` (no new
//! block; writers that placed one may still be running) → `Settled` (every writer finished: no
//! new reference into the extent can appear) → `Candidate` (a scan found no reference;
//! operations that read a slot before that scan may still read a block) → `Free`.
//!
//! **Grants are sized by demand.** A connection gets write space on its first write, not at
//! connect; its first grant is just what its block needs, and each later grant doubles, up to
//! `chunk_size`, and to an eighth of what is free: a client that writes once holds one extent, a
//! busy writer soon holds a whole chunk (one control round trip per chunk of writes), and a heap
//! of 10 chunks still serves 100 writers. A sealed grant's unused tail and its dead blocks come
//! back extent by extent, like everything else: a few long-lived blocks pin their extents, not
//! whole chunks.
//!
//! Why this is safe, without waiting for deadlines (`announce.rs` has the ordering argument):
//! - *Sealed → Settled* once the connection that wrote there has announced itself quiescent
//!   through the `started` count it sent with `AllocateChunk` (every operation that placed a
//!   block in the grant has a number up to it), or is gone (its queue pair drained). The grant's
//!   WRITE window is revoked then, before any extent of it can be reused.
//! - *Settled → Candidate* when a scan finds no slot into the extent; the announce words are
//!   snapshotted after the scan. An operation that read a slot into the extent read it before
//!   that slot changed, hence before the scan passed it: its start was announced by then.
//! - *Candidate → Free* once every connection of that snapshot is quiescent through what it had
//!   started (or gone). No operation that could hold a reference is left.
//!
//! Each step also completes after a quarantine (1.25 × the operation deadline) whatever the
//! announce words say, as before they existed: a client that stopped announcing (hung,
//! partitioned, its connection broken) delays reclamation by at most that, never forever.
//! Except where a WRITE of it may still land: an `shm` client stopped inside a request with a
//! sealed grant's window (found by the window's revocation, or by its teardown's drain) holds
//! that grant until it is out, however long (`held_bytes`; the heap fence bounds what it holds
//! under pressure).
//! Crashed clients need no special case: their grants are sealed at lease expiry and their
//! words released after their queue pair is drained.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkv_common::layout::TableGeometry;
use rdkv_fabric::{lock, MemoryWindow, RequesterInside};

use crate::announce::{Announcements, Snapshot};

mod free_map;
use free_map::FreeMap;

/// Bytes of one extent: the unit the heap hands out, seals and reclaims.
pub const EXTENT_SIZE: u64 = 4096;

/// The owner id of the server's own compaction grants (`crate::compactor`; client
/// connections start at 1): the heap keeps a reserve for it.
pub const COMPACTOR: u64 = 0;

/// The owner id of the grants a node loads its snapshot into before it serves
/// (`crate::snapshot::table_io`): a client's, as far as the heap's reserve goes (the loaded
/// keys leave the compactor its reserve), and no connection's (its writes are done when it
/// seals them).
pub const LOADER: u64 = u64::MAX;

/// How long a client refused heap space keeps the heap "under pressure" (`Heap::under_pressure`).
const PRESSURE_AFTER_REFUSAL: Duration = Duration::from_secs(1);

/// The heap is under pressure while less than this share of it is free.
const PRESSURE_FREE_SHARE: u64 = 4;

/// Each grant is at most this share of the extents free to clients (and at least what the block
/// asking for it needs), so that many writers share a small heap.
const GRANT_SHARE_OF_FREE: u64 = 8;

/// One extent's state.
#[derive(Debug, Clone)]
enum ExtentState {
    /// Available.
    Free,
    /// In the grant this connection writes into.
    Owned(u64),
    /// No new block since `since`; `writer` is the connection that wrote there and the
    /// `started` count its last placing operation is within (`None`: it is gone).
    /// `inside`: its window was revoked while a requester was stopped inside a request
    /// (`shm`); it settles only once that requester is out, whatever the announce words or the
    /// quarantine say.
    Sealed {
        since: Instant,
        writer: Option<(u64, u64)>,
        inside: Option<Arc<RequesterInside>>,
    },
    /// Every writer finished (since then).
    Settled { since: Instant },
    /// Unreferenced at a scan that ended at `since`; free once `snapshot` is quiescent.
    Candidate { since: Instant, snapshot: Snapshot },
}

/// The connection a sealed extent was written by and the `started` count its last placing
/// operation is within (`None`: it is gone).
type Writer = Option<(u64, u64)>;

/// A run of extents handed to one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// The first extent.
    pub first_extent: u64,
    /// Extents in the run.
    pub extents: u64,
}

impl Grant {
    /// The grant's heap offset.
    pub fn heap_offset(&self) -> u64 {
        self.first_extent * EXTENT_SIZE
    }

    /// The grant's bytes.
    pub fn length(&self) -> u64 {
        self.extents * EXTENT_SIZE
    }

    /// Whether `extent` lies in the grant.
    pub fn contains(&self, extent: u64) -> bool {
        (self.first_extent..self.first_extent + self.extents).contains(&extent)
    }
}

/// What one collection pass found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CollectionReport {
    /// Committed slots seen (keys).
    pub keys: u64,
    /// Extents returned to the free list.
    pub reclaimed: u64,
    /// Extents wait for a later pass: sealed (their writers may still be running) or
    /// candidates (unreferenced, waiting for the operations that might read them).
    pub awaiting: bool,
}

/// Every extent's state, the free count and each connection's current grant.
#[derive(Debug)]
struct Extents {
    /// Per-extent state.
    states: Vec<ExtentState>,
    /// Extents `Free` now.
    free: u64,
    /// Which extents are `Free`, one bit each: where a grant's run is searched.
    free_map: FreeMap,
    /// Where the next search for a free run starts (after the last grant).
    next_fit: usize,
    /// Each writing connection's current grant.
    owned: HashMap<u64, Grant>,
    /// Each connection's last grant size in extents (its next grant doubles it).
    last_grant: HashMap<u64, u64>,
}

/// The extent allocator and collector.
#[derive(Debug)]
pub struct Heap {
    /// The largest grant, in bytes (the cluster file's `chunk_size`).
    chunk_size: u64,
    /// Extents in the heap (fixed).
    extent_count: u64,
    /// Extent states and grants.
    extents: Mutex<Extents>,
    /// How long an extent stays unreferenced before reuse.
    quarantine: Duration,
    /// Grants handed out since start.
    pub allocations: AtomicU64,
    /// Extents reclaimed since start.
    pub reclaimed: AtomicU64,
    /// Live bytes per extent, from the last scan.
    live_bytes: Mutex<Vec<u64>>,
    /// The vector of the scan before, refilled by the next scan.
    spare_live_bytes: Mutex<Vec<u64>>,
    /// Blocks moved by compaction since start.
    pub blocks_relocated: AtomicU64,
    /// Abandoned tentative slots cleared by the collector since start.
    pub tentatives_cleared: AtomicU64,
    /// The WRITE windows of sealed grants (by first extent), revoked once the grant's writers
    /// are done.
    sealed_windows: Mutex<HashMap<u64, MemoryWindow>>,
    /// Milliseconds from an extent's last reference to its reuse, for the last extents freed.
    pub reuse_delays: Mutex<VecDeque<u64>>,
    /// When a client was last refused heap space (`None`: never): the heap is under pressure
    /// for a while after.
    last_refusal: Mutex<Option<Instant>>,
}

/// How many reuse delays [`Heap::reuse_delays`] keeps.
const REUSE_DELAYS_KEPT: usize = 1024;

impl Heap {
    /// How long after an operation's start nothing of it can touch the table any more (1.25 ×
    /// the operation deadline).
    pub fn quarantine(&self) -> Duration {
        self.quarantine
    }

    /// A heap of `geometry.heap_size / EXTENT_SIZE` free extents, granted at most
    /// `geometry.chunk_size` at a time.
    pub fn new(geometry: &TableGeometry, quarantine: Duration) -> Self {
        let count = geometry.heap_size / EXTENT_SIZE;
        Self {
            chunk_size: geometry.chunk_size,
            extent_count: count,
            extents: Mutex::new(Extents {
                states: vec![ExtentState::Free; count as usize],
                free: count,
                free_map: FreeMap::all_free(count as usize),
                next_fit: 0,
                owned: HashMap::new(),
                last_grant: HashMap::new(),
            }),
            quarantine,
            allocations: AtomicU64::new(0),
            reclaimed: AtomicU64::new(0),
            live_bytes: Mutex::new(vec![0; count as usize]),
            spare_live_bytes: Mutex::new(Vec::new()),
            blocks_relocated: AtomicU64::new(0),
            tentatives_cleared: AtomicU64::new(0),
            sealed_windows: Mutex::new(HashMap::new()),
            reuse_delays: Mutex::new(VecDeque::new()),
            last_refusal: Mutex::new(None),
        }
    }

    /// Whether the heap is under pressure at `now`: under a quarter of it is free, or a client
    /// was refused space in the last second. A connection that holds reuse back while silent
    /// is then fenced (`session/serve.rs`; `docs/protocol.md`, *Heap space*).
    pub fn under_pressure(&self, now: Instant) -> bool {
        let refused_lately = lock(&self.last_refusal)
            .is_some_and(|refused| now.saturating_duration_since(refused) < PRESSURE_AFTER_REFUSAL);
        refused_lately || lock(&self.extents).free * PRESSURE_FREE_SHARE < self.extent_count
    }

    /// Notes that a client was refused space now.
    fn note_refusal(&self) {
        *lock(&self.last_refusal) = Some(Instant::now());
    }

    /// Whether the block at heap `offset` lies in a settled extent: no operation that wrote a
    /// block there is still running, so a tentative slot pointing at it was abandoned (its
    /// inserter failed or passed its deadline) and will never be committed.
    pub fn writer_gone(&self, offset: u64) -> bool {
        let extent = (offset / EXTENT_SIZE) as usize;
        matches!(
            lock(&self.extents).states.get(extent),
            Some(ExtentState::Settled { .. } | ExtentState::Candidate { .. })
        )
    }

    /// The largest grant, in bytes.
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// Extents in one chunk (the largest grant).
    fn chunk_extents(&self) -> u64 {
        (self.chunk_size / EXTENT_SIZE).max(1)
    }

    /// The heap's segments (runs of one chunk's extents, aligned) that compaction may empty:
    /// no extent of theirs is owned or sealed (no writer is placing blocks there), some are
    /// settled with live bytes, and their live bytes (at the last scan) are under
    /// `max_live_share` of the segment. Each as (live bytes, first extent, extents holding live
    /// bytes), emptiest first.
    fn compactable_segments(
        states: &[ExtentState],
        live: &[u64],
        segment: usize,
        max_live_share: f64,
    ) -> Vec<(u64, usize, u64)> {
        let mut segments = Vec::new();
        for start in (0..states.len()).step_by(segment.max(1)) {
            let end = (start + segment).min(states.len());
            let mut live_bytes = 0u64;
            let mut occupied = 0u64;
            let mut movable = false;
            let mut writable = false;
            for (state, bytes) in states[start..end].iter().zip(&live[start..end]) {
                match state {
                    ExtentState::Free => continue,
                    ExtentState::Owned(_) | ExtentState::Sealed { .. } => {
                        writable = true;
                        break;
                    }
                    ExtentState::Settled { .. } => movable |= *bytes > 0,
                    ExtentState::Candidate { .. } => {}
                }
                occupied += u64::from(*bytes > 0);
                live_bytes += bytes;
            }
            let size = (end - start) as u64 * EXTENT_SIZE;
            if !writable && movable && (live_bytes as f64) < size as f64 * max_live_share {
                segments.push((live_bytes, start, occupied));
            }
        }
        segments.sort_unstable();
        segments
    }

    /// Extents to move live blocks out of, at most `limit`: those of the emptiest compactable
    /// segment first (a segment is one chunk's extents; see [`Self::compactable_segments`]),
    /// settled for at least `min_age`, with live bytes. Compaction empties whole segments, so
    /// that what it frees is contiguous: grants are runs of extents, and a heap whose free
    /// extents are scattered singles hands out one-extent grants (a control round trip every
    /// few writes), however much of it is free.
    pub fn compaction_candidates(
        &self,
        max_live_share: f64,
        min_age: Duration,
        now: Instant,
        limit: usize,
    ) -> Vec<u64> {
        let extents = lock(&self.extents);
        let live = lock(&self.live_bytes);
        let segment = self.chunk_extents() as usize;
        let mut candidates = Vec::new();
        for (_, start, _) in
            Self::compactable_segments(&extents.states, &live, segment, max_live_share)
        {
            let end = (start + segment).min(extents.states.len());
            let mut in_segment: Vec<(u64, u64)> = (start..end)
                .filter_map(|index| match extents.states[index] {
                    ExtentState::Settled { since }
                        if live[index] > 0 && now.duration_since(since) >= min_age =>
                    {
                        Some((live[index], index as u64))
                    }
                    _ => None,
                })
                .collect();
            in_segment.sort_unstable();
            for (_, index) in in_segment {
                if candidates.len() == limit {
                    return candidates;
                }
                candidates.push(index);
            }
        }
        candidates
    }

    /// Settled extents (for at least `min_age`) whose live bytes are more than zero and under
    /// `max_live_share` of an extent, sparsest first: what the compactor takes, wherever they
    /// are, once the heap is nearly full and no whole segment is sparse enough (any room is
    /// worth more than contiguous room then).
    pub fn sparse_extents(
        &self,
        max_live_share: f64,
        min_age: Duration,
        now: Instant,
        limit: usize,
    ) -> Vec<u64> {
        let extents = lock(&self.extents);
        let live = lock(&self.live_bytes);
        let threshold = (EXTENT_SIZE as f64 * max_live_share) as u64;
        let mut candidates: Vec<(u64, u64)> = extents
            .states
            .iter()
            .enumerate()
            .filter_map(|(index, state)| match state {
                ExtentState::Settled { since } if now.duration_since(*since) >= min_age => {
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

    /// Seals the grant `connection` writes into (its operations up to `started` may still be
    /// placing blocks there), then hands it a new one with room for at least `needed_bytes`:
    /// twice its last grant, at most a chunk and an eighth of what is free (the compactor asks
    /// for a chunk). When there is no
    /// room, nothing changes and the connection keeps its grant.
    ///
    /// The last chunk's worth of free extents is kept for the compactor (owner
    /// [`COMPACTOR`]), so that compaction can always make room even when clients have taken
    /// everything else.
    pub fn allocate(&self, connection: u64, started: u64, needed_bytes: u64) -> Option<Grant> {
        let grant = self.allocate_run(connection, started, needed_bytes);
        let fits_a_chunk = needed_bytes.div_ceil(EXTENT_SIZE) <= self.chunk_extents();
        if grant.is_none() && connection != COMPACTOR && fits_a_chunk {
            // No room: the heap is under pressure for a while.
            self.note_refusal();
        }
        grant
    }

    /// [`Self::allocate`], without noting a refusal.
    fn allocate_run(&self, connection: u64, started: u64, needed_bytes: u64) -> Option<Grant> {
        let chunk_extents = self.chunk_extents();
        let needed = needed_bytes.div_ceil(EXTENT_SIZE).max(1);
        if needed > chunk_extents {
            return None;
        }
        let mut extents = lock(&self.extents);
        let reserve = if connection == COMPACTOR {
            0
        } else {
            self.client_reserve()
        };
        let available = extents.free.saturating_sub(reserve);
        if available < needed {
            return None;
        }
        // The compactor asks for a whole chunk: it packs blocks across extent boundaries, and
        // the larger its destination, the less it loses at the end of each.
        let desired = if connection == COMPACTOR {
            chunk_extents
        } else {
            extents
                .last_grant
                .get(&connection)
                .map_or(needed, |last| last * 2)
                .min(chunk_extents)
                .min(available / GRANT_SHARE_OF_FREE)
                .max(needed)
        };
        let grant = extents
            .free_map
            .find_run(extents.next_fit, needed, desired)?;
        let now = Instant::now();
        if let Some(old) = extents.owned.insert(connection, grant) {
            Self::seal_grant(
                &mut extents.states,
                old,
                connection,
                now,
                Some((connection, started)),
            );
        }
        let first = grant.first_extent as usize;
        for state in &mut extents.states[first..first + grant.extents as usize] {
            *state = ExtentState::Owned(connection);
        }
        extents.free -= grant.extents;
        extents.free_map.take(grant);
        extents.next_fit = first + grant.extents as usize;
        extents.last_grant.insert(connection, grant.extents);
        self.allocations.fetch_add(1, Ordering::Relaxed);
        Some(grant)
    }

    /// Seals the grant `connection` owns after it is gone (left, its lease expired, or fenced):
    /// its queue pair is drained and its requester out of every request
    /// (`QueuePair::requester_out`), so it writes nothing more.
    pub fn seal_owned_by(&self, connection: u64) {
        let mut extents = lock(&self.extents);
        extents.last_grant.remove(&connection);
        if let Some(grant) = extents.owned.remove(&connection) {
            Self::seal_grant(&mut extents.states, grant, connection, Instant::now(), None);
        }
    }

    fn seal_grant(
        states: &mut [ExtentState],
        grant: Grant,
        connection: u64,
        since: Instant,
        writer: Option<(u64, u64)>,
    ) {
        let first = grant.first_extent as usize;
        for state in &mut states[first..first + grant.extents as usize] {
            if matches!(state, ExtentState::Owned(owner) if *owner == connection) {
                *state = ExtentState::Sealed {
                    since,
                    writer,
                    inside: None,
                };
            }
        }
    }

    /// Keeps the WRITE window of a sealed grant (by its first extent) until the grant's writers
    /// are done; then it is revoked, before any of its extents can be reused. Deposited under
    /// the extents lock while the grant is still `Sealed`: a collector pass that settled the
    /// grant between the seal (`allocate`) and this call finds no window to revoke, so the
    /// window is revoked here instead of kept live over extents that may be reused.
    pub fn keep_window(&self, first_extent: u64, window: MemoryWindow) {
        let stale = {
            let extents = lock(&self.extents);
            let sealed = matches!(
                extents.states.get(first_extent as usize),
                Some(ExtentState::Sealed { inside: None, .. })
            );
            if sealed {
                lock(&self.sealed_windows).insert(first_extent, window)
            } else {
                Some(window)
            }
        };
        // Revoked outside the lock: on `shm` a revocation waits for the window's requester.
        if let Some(stale) = stale {
            let _ = stale.invalidate();
        }
    }

    /// Moves sealed extents whose writers are done to `Settled`, revoking their grants' windows
    /// first; a grant whose window's revocation found its requester still inside a request
    /// (`shm`: a client process stopped there, fenced or not) stays `Sealed`, held until that
    /// requester is out, whatever the announce words or the quarantine say.
    pub fn settle(&self, announcements: &Announcements, now: Instant) {
        let eligible = self.settle_sealed(announcements, now);
        if eligible.is_empty() {
            return;
        }
        let mut held: HashMap<u64, Arc<RequesterInside>> = HashMap::new();
        loop {
            let windows: Vec<(u64, MemoryWindow)> = {
                let mut extents = lock(&self.extents);
                let mut windows = lock(&self.sealed_windows);
                let found: Vec<(u64, MemoryWindow)> = eligible
                    .iter()
                    .filter_map(|(extent, _)| Some((*extent, windows.remove(extent)?)))
                    .collect();
                if found.is_empty() {
                    // Every window is revoked; `keep_window` deposits none for these from now
                    // on (it takes this lock and finds them settled).
                    Self::mark_settled(&mut extents.states, &eligible, &held, now);
                    break;
                }
                found
            };
            // Outside the locks: on `shm` a revocation waits for the window's requester (up
            // to `retry_timeout` for one stopped inside a request, once: the fabric remembers
            // it), and a session that seals a grant takes the lock on an async worker.
            for (first, window) in windows {
                if let Some(inside) = window.invalidate() {
                    held.insert(first, Arc::new(inside));
                }
            }
        }
        for first in held.keys() {
            tracing::warn!(
                first_extent = first,
                "a requester stayed inside a request with a sealed grant's window past the retry timeout (an shm client stopped there): the grant is kept until it is out"
            );
        }
    }

    /// The last step of [`Self::settle`]: each eligible extent still `Sealed` becomes
    /// `Settled`, or stays `Sealed` with the requester its grant's revocation found inside
    /// (`held`, by the grant's first extent: the grant is the run of eligible extents from it
    /// with its writer).
    fn mark_settled(
        states: &mut [ExtentState],
        eligible: &[(u64, Option<(u64, u64)>)],
        held: &HashMap<u64, Arc<RequesterInside>>,
        now: Instant,
    ) {
        // The grant being walked: its last extent, its writer and its requester.
        let mut run: Option<(u64, Writer, Arc<RequesterInside>)> = None;
        for (extent, writer) in eligible {
            run = match (held.get(extent), run.take()) {
                (Some(inside), _) => Some((*extent, *writer, inside.clone())),
                (None, Some((last, run_writer, inside)))
                    if *extent == last + 1 && *writer == run_writer =>
                {
                    Some((*extent, run_writer, inside))
                }
                _ => None,
            };
            let state = &mut states[*extent as usize];
            if !matches!(state, ExtentState::Sealed { inside: None, .. }) {
                continue;
            }
            *state = match &run {
                Some((_, _, inside)) => ExtentState::Sealed {
                    since: now,
                    writer: *writer,
                    inside: Some(inside.clone()),
                },
                None => ExtentState::Settled { since: now },
            };
        }
    }

    /// The first step of [`Self::settle`]: settles the held extents whose requester is out
    /// (their windows are revoked already), and returns the sealed extents whose writers are
    /// done or whose quarantine passed, each with the writer it was sealed with, in order,
    /// still `Sealed`.
    fn settle_sealed(
        &self,
        announcements: &Announcements,
        now: Instant,
    ) -> Vec<(u64, Option<(u64, u64)>)> {
        let mut eligible = Vec::new();
        let mut extents = lock(&self.extents);
        // The extents of one grant share their writer: ask once per pass.
        let mut writers_done: HashMap<(u64, u64), (bool, bool)> = HashMap::new();
        let mut last_asked: Option<((u64, u64), (bool, bool))> = None;
        for (index, state) in extents.states.iter_mut().enumerate() {
            let ExtentState::Sealed {
                since,
                writer,
                inside,
            } = state
            else {
                continue;
            };
            if let Some(inside) = inside {
                // Its window is revoked already; its requester's late WRITE may still land.
                if inside.left() {
                    *state = ExtentState::Settled { since: now };
                }
                continue;
            }
            let writer = *writer;
            let (done, stopped_inside) = match writer {
                None => (true, false),
                // A grant's extents are neighbours: the writer asked last is most often this one
                // (a hash per sealed extent was most of the settling's cost).
                Some(key) => match last_asked {
                    Some((asked, answer)) if asked == key => answer,
                    _ => {
                        let (connection, started) = key;
                        let answer = *writers_done.entry(key).or_insert_with(|| {
                            (
                                announcements.quiescent_through(connection, started),
                                announcements.reads_fenced(connection),
                            )
                        });
                        last_asked = Some((key, answer));
                        answer
                    }
                },
            };
            // A writer stopped inside a request (torn down, not out) may still finish a WRITE
            // here: no quarantine for it; its grants settle once it is out. One stopped inside
            // while still connected is found by the window's revocation (`settle`).
            let quarantined = !stopped_inside && now.duration_since(*since) >= self.quarantine;
            if done || quarantined {
                eligible.push((index as u64, writer));
            }
        }
        eligible
    }

    /// Extents a client can expect to get without any client giving anything up: those free,
    /// and those sealed or quarantined that no slot referenced at the last scan, plus what
    /// compaction can win from the segments under `max_live_share` live (the extents holding
    /// their live bytes less what those bytes fill packed, less one for the packing, and only
    /// while a free extent is left or coming back to move them into), less the compactor's
    /// reserve. Zero means the heap is full of live data: a writer should
    /// fail `TableFull` now rather than wait for its deadline.
    pub fn reclaimable_extents(&self, max_live_share: f64) -> u64 {
        let extents = lock(&self.extents);
        let live = lock(&self.live_bytes);
        let unreferenced = extents
            .states
            .iter()
            .zip(live.iter())
            .filter(|(state, live)| {
                **live == 0
                    && matches!(
                        state,
                        ExtentState::Sealed { inside: None, .. }
                            | ExtentState::Settled { .. }
                            | ExtentState::Candidate { .. }
                    )
            })
            .count() as u64;
        // What emptying the compactable segments wins: their extents holding live bytes less
        // what those bytes fill when packed together (one more for the packing's loss at the
        // end of the compactor's destination).
        let segments = Self::compactable_segments(
            &extents.states,
            &live,
            self.chunk_extents() as usize,
            max_live_share,
        );
        let (live_bytes, occupied) = segments
            .iter()
            .fold((0u64, 0u64), |(bytes, extents), (live, _, occupied)| {
                (bytes + live, extents + occupied)
            });
        let segment_gain = occupied.saturating_sub(live_bytes.div_ceil(EXTENT_SIZE) + 1);
        // Or, extent by extent (what the compactor does when the heap is nearly full): the
        // dead bytes of the extents under the share, less one for the packing.
        let threshold = (EXTENT_SIZE as f64 * max_live_share) as u64;
        let dead_bytes: u64 = extents
            .states
            .iter()
            .zip(live.iter())
            .filter(|(state, live)| {
                matches!(state, ExtentState::Settled { .. }) && **live > 0 && **live < threshold
            })
            .map(|(_, live)| EXTENT_SIZE - live)
            .sum();
        let compaction_gain = segment_gain.max((dead_bytes / EXTENT_SIZE).saturating_sub(1));
        // Compaction needs room to move blocks into: with no extent free, none coming back and
        // no destination of its own open, nothing will move. (An open destination counts: the
        // compactor may have just taken the last free extents, and the extents it emptied show
        // as unreferenced only after the next scan.)
        let compactor_open = extents.owned.contains_key(&COMPACTOR);
        let compaction_gain = if extents.free == 0 && unreferenced == 0 && !compactor_open {
            0
        } else {
            compaction_gain
        };
        // A client gets nothing out of the last chunk's worth, the compactor's reserve.
        (extents.free + unreferenced + compaction_gain).saturating_sub(self.client_reserve())
    }

    /// Free extents clients may not take: one chunk's worth, the compactor's (none when the
    /// heap is a single chunk).
    fn client_reserve(&self) -> u64 {
        let chunk_extents = self.chunk_extents();
        if self.extent_count <= chunk_extents {
            0
        } else {
            chunk_extents
        }
    }

    /// Heap bytes not free.
    pub fn used_bytes(&self) -> u64 {
        (self.extent_count - lock(&self.extents).free) * EXTENT_SIZE
    }

    /// Heap bytes in sealed grants held for a requester stopped inside a request with their
    /// window (`ExtentState::Sealed` with `inside`).
    pub fn held_bytes(&self) -> u64 {
        let extents = lock(&self.extents);
        let held = extents
            .states
            .iter()
            .filter(|state| {
                matches!(
                    state,
                    ExtentState::Sealed {
                        inside: Some(_),
                        ..
                    }
                )
            })
            .count() as u64;
        held * EXTENT_SIZE
    }

    /// Heap bytes free now.
    pub fn free_bytes(&self) -> u64 {
        lock(&self.extents).free * EXTENT_SIZE
    }

    /// Heap bytes in all.
    pub fn size_bytes(&self) -> u64 {
        self.extent_count * EXTENT_SIZE
    }

    /// Over the kept reuse delays: median, 99th percentile and largest, in milliseconds (zeros
    /// before any extent was reclaimed).
    pub fn reuse_delay_summary(&self) -> [u64; 3] {
        let mut delays: Vec<u64> = lock(&self.reuse_delays).iter().copied().collect();
        if delays.is_empty() {
            return [0; 3];
        }
        delays.sort_unstable();
        let at = |share: f64| delays[((delays.len() - 1) as f64 * share).round() as usize];
        [at(0.5), at(0.99), at(1.0)]
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
        // The scan before last's vector is refilled (a fresh one per pass cost its page
        // faults), while sessions still read the last scan's (`reclaimable_extents`).
        let mut live = std::mem::take(&mut *lock(&self.spare_live_bytes));
        live.clear();
        live.resize(self.extent_count as usize, 0);
        let keys = Self::count_live_bytes(referenced_blocks, &mut live);
        let last = std::mem::replace(&mut *lock(&self.live_bytes), live);
        *lock(&self.spare_live_bytes) = last;
        let (freed, awaiting) = self.advance_states(snapshot, announcements, now);
        let reclaimed = freed.len() as u64;
        if reclaimed > 0 {
            let mut delays = lock(&self.reuse_delays);
            for unreferenced_since in &freed {
                if delays.len() == REUSE_DELAYS_KEPT {
                    delays.pop_front();
                }
                delays.push_back(now.duration_since(*unreferenced_since).as_millis() as u64);
            }
        }
        self.reclaimed.fetch_add(reclaimed, Ordering::Relaxed);
        CollectionReport {
            keys,
            reclaimed,
            awaiting,
        }
    }

    /// Adds each block's bytes to the extents it touches (a block may span extents: each holds
    /// its share) and returns the committed blocks counted. An extent is referenced exactly
    /// when its live bytes are above zero: every block counts at least one byte.
    fn count_live_bytes(blocks: impl Iterator<Item = (u64, u64, bool)>, live: &mut [u64]) -> u64 {
        let mut keys = 0u64;
        for (offset, length, committed) in blocks {
            keys += u64::from(committed);
            let length = length.max(1);
            let end = offset.saturating_add(length);
            let mut extent = offset / EXTENT_SIZE;
            if (end - 1) / EXTENT_SIZE == extent {
                // Most blocks lie in one extent.
                if let Some(bytes) = live.get_mut(extent as usize) {
                    *bytes += length;
                }
                continue;
            }
            while extent * EXTENT_SIZE < end {
                let Some(bytes) = live.get_mut(extent as usize) else {
                    break;
                };
                let extent_end = (extent + 1) * EXTENT_SIZE;
                *bytes += end.min(extent_end) - offset.max(extent * EXTENT_SIZE);
                extent += 1;
            }
        }
        keys
    }

    /// Moves each extent on by what the scan found (`live_bytes`, just set): settled and
    /// unreferenced to a candidate of `snapshot`, a referenced candidate back to settled, a
    /// candidate whose snapshot is quiescent (or whose quarantine passed) to free. Returns when
    /// each freed extent became unreferenced, and whether extents wait for a later pass.
    fn advance_states(
        &self,
        snapshot: &Snapshot,
        announcements: &Announcements,
        now: Instant,
    ) -> (Vec<Instant>, bool) {
        let mut freed = Vec::new();
        let mut awaiting = false;
        // Candidates of one scan share their snapshot: check each snapshot once per pass.
        let mut quiescent: HashMap<*const Vec<(u64, u64)>, bool> = HashMap::new();
        let mut snapshot_done = |snapshot: &Snapshot| {
            *quiescent
                .entry(Arc::as_ptr(snapshot))
                .or_insert_with(|| announcements.all_quiescent(snapshot))
        };
        let mut extents = lock(&self.extents);
        let live = lock(&self.live_bytes);
        let Extents {
            states,
            free_map,
            free,
            ..
        } = &mut *extents;
        for (index, state) in states.iter_mut().enumerate() {
            let next = match (&*state, live[index] > 0) {
                (ExtentState::Settled { .. }, false) => Some(ExtentState::Candidate {
                    since: now,
                    snapshot: snapshot.clone(),
                }),
                (ExtentState::Candidate { .. }, true) => Some(ExtentState::Settled { since: now }),
                (ExtentState::Candidate { since, snapshot }, false)
                    if now.duration_since(*since) >= self.quarantine || snapshot_done(snapshot) =>
                {
                    freed.push(*since);
                    free_map.set_free(index);
                    Some(ExtentState::Free)
                }
                _ => None,
            };
            if let Some(next) = next {
                *state = next;
            }
            awaiting |= matches!(
                state,
                ExtentState::Sealed { .. } | ExtentState::Candidate { .. }
            );
        }
        *free += freed.len() as u64;
        (freed, awaiting)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkv_fabric::{Device, DeviceConfig};

    /// A heap of `chunks` chunks of `chunk_size` bytes.
    fn heap_of(chunks: u64, chunk_size: u64) -> Heap {
        let geometry = TableGeometry {
            bucket_count: 4,
            heap_size: chunks * chunk_size,
            chunk_size,
            hash_seed: 0,
        };
        Heap::new(&geometry, Duration::from_secs(1))
    }

    /// A heap of `extents` one-extent chunks.
    fn heap(extents: u64) -> Heap {
        heap_of(extents, EXTENT_SIZE)
    }

    /// The first extent of `connection`'s new grant.
    fn grant(heap: &Heap, connection: u64, started: u64) -> Option<u64> {
        heap.allocate(connection, started, 100)
            .map(|grant| grant.first_extent)
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
                Announcements::allocate(&device.allocate_protection_domain(), 4, false)
                    .expect("words");
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
            let report = heap.collect(
                referenced.iter().copied(),
                &snapshot,
                &self.announcements,
                now,
            );
            assert_free_map_matches(heap);
            report
        }
    }

    /// The free map names exactly the `Free` extents, and the free count is theirs.
    fn assert_free_map_matches(heap: &Heap) {
        let extents = lock(&heap.extents);
        for (index, state) in extents.states.iter().enumerate() {
            assert_eq!(
                extents.free_map.is_free(index),
                matches!(state, ExtentState::Free),
                "extent {index}"
            );
        }
        let free = extents
            .states
            .iter()
            .filter(|state| matches!(state, ExtentState::Free))
            .count() as u64;
        assert_eq!(extents.free, free);
    }

    #[test]
    fn chunks_are_exclusive_and_the_last_one_is_kept_for_the_compactor() {
        let heap = heap(3);
        assert_eq!(grant(&heap, 1, 0), Some(0));
        assert_eq!(grant(&heap, 2, 0), Some(1));
        assert_eq!(
            grant(&heap, 3, 0),
            None,
            "the last free chunk is the compactor's"
        );
        assert_eq!(grant(&heap, COMPACTOR, 0), Some(2));
        assert_eq!(grant(&heap, COMPACTOR, 0), None, "no free chunk");
        assert_eq!(heap.used_bytes(), 3 * EXTENT_SIZE);
    }

    #[test]
    fn a_chunk_comes_back_as_soon_as_its_writers_and_readers_are_done() {
        let words = Words::new();
        let heap = heap(3);
        let now = Instant::now();
        words.announce(1, 5, 4);
        words.announce(2, 9, 9);
        assert_eq!(grant(&heap, 1, 5), Some(0));
        assert_eq!(
            grant(&heap, 1, 5),
            Some(1),
            "chunk 0 sealed; operation 5 may still write"
        );
        assert_eq!(words.tick(&heap, &[], now).reclaimed, 0, "writer 5 runs");
        assert_eq!(
            heap.compaction_candidates(0.5, Duration::ZERO, now, 8),
            Vec::<u64>::new()
        );
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
        assert_eq!(
            heap.free_bytes(),
            2 * EXTENT_SIZE,
            "extent 0 and the never-used extent 2"
        );
        assert_eq!(heap.reuse_delays.lock().expect("delays").len(), 1);
    }

    #[test]
    fn a_silent_connection_delays_reuse_by_a_quarantine_at_most() {
        let words = Words::new();
        let heap = heap(3);
        let start = Instant::now();
        let at = |seconds: f64| start + Duration::from_secs_f64(seconds);
        words.announce(1, 3, 2);
        grant(&heap, 1, 3);
        grant(&heap, 1, 3);
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
    fn a_writer_stopped_inside_a_request_gets_no_quarantine() {
        let words = Words::new();
        let heap = heap(3);
        let start = Instant::now();
        words.announce(1, 3, 2);
        grant(&heap, 1, 3);
        grant(&heap, 1, 3);
        words.announcements.fence_reads(1);
        words.tick(&heap, &[], start + Duration::from_secs(5));
        assert!(
            !heap.writer_gone(100),
            "its WRITE may still land: sealed past the quarantine"
        );
        words.announcements.release(1);
        words.tick(&heap, &[], start + Duration::from_secs(5));
        assert!(heap.writer_gone(100), "out: settled");
    }

    /// A connected client stopped inside a request with its sealed grant's window (never
    /// fenced: no heap pressure) is found by the window's revocation; the grant is held past
    /// the quarantine, since its WRITE may still land, and settles once it is out.
    #[test]
    fn a_grant_whose_window_revocation_found_its_requester_inside_is_held_until_it_is_out() {
        use std::sync::atomic::AtomicBool;
        let words = Words::new();
        let heap = heap(3);
        let start = Instant::now();
        words.announce(1, 3, 2);
        grant(&heap, 1, 3);
        grant(&heap, 1, 3);
        let past_quarantine = start + Duration::from_secs(5);
        let eligible = heap.settle_sealed(&words.announcements, past_quarantine);
        assert_eq!(eligible.len(), 1, "the sealed grant, by the quarantine");
        let out = Arc::new(AtomicBool::new(false));
        let probe = out.clone();
        let inside = RequesterInside::new(move || probe.load(Ordering::Acquire));
        let held = HashMap::from([(eligible[0].0, Arc::new(inside))]);
        Heap::mark_settled(
            &mut lock(&heap.extents).states,
            &eligible,
            &held,
            past_quarantine,
        );
        assert_eq!(heap.held_bytes(), EXTENT_SIZE);
        words.tick(&heap, &[], past_quarantine + Duration::from_secs(60));
        assert!(
            !heap.writer_gone(100),
            "its WRITE may still land: held past any quarantine"
        );
        out.store(true, Ordering::Release);
        words.tick(&heap, &[], past_quarantine + Duration::from_secs(60));
        assert!(heap.writer_gone(100), "out: settled");
        assert_eq!(heap.held_bytes(), 0);
    }

    #[test]
    fn a_reference_keeps_a_chunk_and_resets_its_candidacy() {
        let words = Words::new();
        let heap = heap(2);
        words.announce(1, 1, 0);
        grant(&heap, 1, 1);
        heap.seal_owned_by(1);
        let now = Instant::now();
        assert_eq!(words.tick(&heap, &[], now).reclaimed, 0, "a candidate");
        let report = words.tick(&heap, &[(128, 64, true)], now);
        assert_eq!(
            report,
            CollectionReport {
                keys: 1,
                reclaimed: 0,
                awaiting: false
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
        grant(&heap, 2, 0);
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
            grant(&heap, connection, 0);
            heap.seal_owned_by(connection);
        }
        // Extent 0: 3,500 bytes live (dense); extent 1: 100; extent 2: 800; extent 3: free.
        words.tick(
            &heap,
            &[
                (0, 3500, true),
                (EXTENT_SIZE, 100, true),
                (2 * EXTENT_SIZE, 800, true),
            ],
            Instant::now(),
        );
        let later = Instant::now() + Duration::from_secs(1);
        assert_eq!(
            heap.compaction_candidates(0.5, Duration::ZERO, later, 8),
            vec![1, 2]
        );
        assert_eq!(
            heap.compaction_candidates(0.5, Duration::ZERO, later, 1),
            vec![1]
        );
        assert_eq!(
            heap.compaction_candidates(0.5, Duration::from_secs(2), later, 8),
            Vec::<u64>::new(),
            "settled too recently: their blocks may be about to die anyway"
        );
    }

    #[test]
    fn compaction_empties_whole_segments_emptiest_first_and_skips_written_ones() {
        let words = Words::new();
        // Three segments (chunks) of four extents.
        let heap = heap_of(3, 4 * EXTENT_SIZE);
        let first = heap.allocate(1, 0, 4 * EXTENT_SIZE).expect("segment 0");
        let second = heap.allocate(2, 0, 4 * EXTENT_SIZE).expect("segment 1");
        assert_eq!((first.first_extent, second.first_extent), (0, 4));
        heap.seal_owned_by(1);
        let now = Instant::now();
        let blocks = [
            // Segment 0: 40% live over all four extents (each extent alone is dense enough
            // to be left alone by a per-extent rule).
            (0, 1700, true),
            (EXTENT_SIZE, 1700, true),
            (2 * EXTENT_SIZE, 1700, true),
            (3 * EXTENT_SIZE, 1450, true),
            // Segment 1: 10% live, in one extent.
            (5 * EXTENT_SIZE, 1600, true),
        ];
        words.tick(&heap, &blocks, now);
        let later = now + Duration::from_secs(1);
        assert_eq!(
            heap.compaction_candidates(0.5, Duration::ZERO, later, 8),
            vec![3, 0, 1, 2],
            "segment 1 is still written into: left alone"
        );
        heap.seal_owned_by(2);
        words.tick(&heap, &blocks, now);
        assert_eq!(
            heap.compaction_candidates(0.5, Duration::ZERO, later, 8),
            vec![5, 3, 0, 1, 2],
            "the emptiest segment first, then the next, sparsest extent first within each"
        );
        assert_eq!(
            heap.compaction_candidates(0.3, Duration::ZERO, later, 8),
            vec![5]
        );
        assert_eq!(
            heap.compaction_candidates(0.5, Duration::ZERO, later, 2),
            vec![5, 3]
        );
        // Free: segment 2 (the compactor's reserve, not the clients'); unreferenced: extents
        // 4, 6 and 7; compaction: the five extents with live bytes pack into two, less one
        // for the packing.
        assert_eq!(heap.reclaimable_extents(0.5), 3 + 2);
    }

    #[test]
    fn the_heap_is_under_pressure_when_a_quarter_is_free_or_a_client_was_refused() {
        let heap = heap(8);
        let now = Instant::now();
        assert!(!heap.under_pressure(now), "all free");
        for connection in 1..=6 {
            assert!(grant(&heap, connection, 0).is_some());
        }
        assert!(!heap.under_pressure(now), "a quarter free");
        assert!(grant(&heap, COMPACTOR, 0).is_some());
        assert!(heap.under_pressure(now), "an eighth free");
        // Four chunks of four extents; the last is the compactor's.
        let heap = heap_of(4, 4 * EXTENT_SIZE);
        assert!(heap.allocate(1, 0, 5 * EXTENT_SIZE).is_none());
        assert!(
            !heap.under_pressure(Instant::now()),
            "a block larger than a chunk is refused whatever is free"
        );
        for connection in 1..=3 {
            assert!(heap.allocate(connection, 0, 4 * EXTENT_SIZE).is_some());
        }
        assert!(!heap.under_pressure(Instant::now()), "a quarter free");
        assert!(heap.allocate(4, 0, 4 * EXTENT_SIZE).is_none(), "no room");
        assert!(heap.under_pressure(Instant::now()), "a client was refused");
        assert!(
            !heap.under_pressure(Instant::now() + PRESSURE_AFTER_REFUSAL),
            "a refusal a second ago no longer counts"
        );
    }

    #[test]
    fn owned_chunks_are_never_collected() {
        let words = Words::new();
        let heap = heap(1);
        let start = Instant::now();
        grant(&heap, 1, 0);
        for step in 1..5 {
            assert_eq!(
                words
                    .tick(&heap, &[], start + Duration::from_secs(step))
                    .reclaimed,
                0
            );
        }
    }

    #[test]
    fn grants_start_at_what_the_block_needs_and_double_up_to_a_chunk() {
        let heap = heap_of(64, 16 * EXTENT_SIZE);
        let sizes: Vec<u64> = (0..6)
            .map(|_| heap.allocate(1, 0, 1000).expect("room").extents)
            .collect();
        assert_eq!(sizes, vec![1, 2, 4, 8, 16, 16]);
        assert_eq!(
            heap.allocate(2, 0, 3 * EXTENT_SIZE + 1)
                .expect("room")
                .extents,
            4,
            "a first grant holds the block that asked for it"
        );
        assert!(
            heap.allocate(2, 0, 17 * EXTENT_SIZE).is_none(),
            "no block is larger than a chunk"
        );
    }

    #[test]
    fn a_hundred_writers_share_a_heap_of_ten_chunks() {
        let heap = heap_of(10, 16 * EXTENT_SIZE);
        let mut grants: Vec<Grant> = (1..=100)
            .map(|connection| heap.allocate(connection, 0, 1088).expect("room for each"))
            .collect();
        // Each writes on: later grants are cut to a share of what is free.
        for connection in 1..=100u64 {
            if let Some(grant) = heap.allocate(connection, 0, 1088) {
                grants.push(grant);
            }
        }
        let mut taken = std::collections::HashSet::new();
        for grant in &grants {
            for extent in grant.first_extent..grant.first_extent + grant.extents {
                assert!(taken.insert(extent), "extent {extent} granted twice");
            }
        }
        assert!(
            heap.free_bytes() >= 16 * EXTENT_SIZE,
            "a chunk stays the compactor's"
        );
    }

    #[test]
    fn a_sealed_grant_gives_back_its_unused_tail_and_dead_extents() {
        let words = Words::new();
        let heap = heap_of(64, 4 * EXTENT_SIZE);
        for _ in 0..3 {
            heap.allocate(1, 0, 100);
        }
        let grant = heap.allocate(1, 0, 100).expect("a full chunk");
        assert_eq!(grant.extents, 4);
        words.announcements.release(1);
        let now = Instant::now();
        words.tick(&heap, &[], now);
        assert_eq!(
            words.tick(&heap, &[], now).reclaimed,
            7,
            "the earlier grants"
        );
        let before = heap.free_bytes();
        heap.seal_owned_by(1);
        // One block spans the grant's first two extents; the other two were never written.
        let block = (grant.heap_offset() + EXTENT_SIZE - 100, 200, true);
        assert_eq!(words.tick(&heap, &[block], now).reclaimed, 0, "candidates");
        assert_eq!(words.tick(&heap, &[block], now).reclaimed, 2, "the tail");
        assert_eq!(heap.free_bytes(), before + 2 * EXTENT_SIZE);
        assert!(
            !heap.writer_gone(grant.heap_offset() + 3 * EXTENT_SIZE),
            "free again"
        );
        assert_eq!(words.tick(&heap, &[], now).reclaimed, 0);
        assert_eq!(words.tick(&heap, &[], now).reclaimed, 2, "the block died");
    }

    /// Attack (issue 39 item 6 review): `Session::allocate_chunk` (`session/serve.rs`) calls
    /// `heap.allocate`, which seals the old grant and drops the extents lock, and only then
    /// hands the old grant's WRITE window to `keep_window`. A collector pass that runs in
    /// between settles the grant (its writer is quiescent through `started`: the common case)
    /// and finds no window to revoke; the window then sits in `sealed_windows`, bound and
    /// valid, while its extents become candidates, free, and another connection's grant.
    #[test]
    fn a_window_kept_after_its_grant_settled_is_revoked_before_the_grant_is_reused() {
        let words = Words::new();
        let heap = heap(8);
        let device = Device::loopback(DeviceConfig::default());
        let window = device.allocate_protection_domain().allocate_memory_window();
        let now = Instant::now();
        assert_eq!(grant(&heap, 1, 0), Some(0));
        // AllocateChunk { started: 0 }: `heap.allocate` seals extent 0 ...
        assert_eq!(grant(&heap, 1, 0), Some(1));
        // ... the collector's pass runs (connection 1 is quiescent through 0: settled) ...
        words.tick(&heap, &[], now);
        // ... and only now does the session hand the sealed grant's window over.
        heap.keep_window(0, window);
        words.tick(&heap, &[], now);
        let mut regranted = false;
        for _ in 0..8 {
            if grant(&heap, 2, 0) == Some(0) {
                regranted = true;
                break;
            }
            words.tick(&heap, &[], now);
        }
        assert!(
            regranted,
            "extent 0 went back to the free list and to connection 2"
        );
        assert!(
            !lock(&heap.sealed_windows).contains_key(&0),
            "extent 0 is connection 2's grant while connection 1's WRITE window over it was never revoked"
        );
    }
}
