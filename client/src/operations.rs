//! The one-sided algorithms (RACE-style, out of place, with tentative inserts).
//! `docs/protocol.md` states them with their round trips and linearization points; in short:
//!
//! - **Lookup** (every operation): READ both combined buckets in one list; READ the blocks of
//!   the fingerprint matches in one list; verify key and checksum. Readers see only committed
//!   slots; a torn or reused block re-reads the buckets, a bounded number of times, and then
//!   fails [`Error::Corrupt`] the same way for every operation.
//! - **GET**: the lookup; linearized at the READ of the committed slot it returns.
//! - **Key present** (put, update, compare-and-swap): CAS the committed slot from the block read
//!   to the new block (written into the client's own chunk in the lookup's first list);
//!   linearized at that CAS. A lost race looks up again.
//! - **Key absent** (put, insert): CAS the first empty slot to a *tentative* slot and READ the
//!   buckets again in the same list; if another committed slot holds the key, withdraw the
//!   tentative slot (the key is present); else CAS every other tentative slot of the key to
//!   empty, then CAS the own tentative slot to committed: the linearization point. At most one
//!   slot per key is ever committed, so no duplicate is ever visible and no late resolution
//!   writes over a newer value.
//! - **DELETE**: CAS the key's committed slot to empty; linearized there.
//!
//! Every step goes through [`Scratch::execute`], which records in the operation's
//! [`Progress`] what was posted: the client never retries an operation once a CAS of it was
//! posted, and a failure after a publishing CAS is reported as "may have applied".

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdkv_common::layout::{
    check_key_value, parse_combined_bucket, KeyLocation, LayoutError, Slot, SlotPosition,
    COMBINED_BUCKET_SIZE, MAX_KEY_LENGTH, MAX_VALUE_LENGTH,
};
use rdkv_fabric::WorkRequest;
use smallvec::{smallvec, SmallVec};

use crate::block::{block_reads, blocks_that_fit, Block, BlockShape};
use crate::connection::{
    BlockPlace, ExecuteError, Guess, NodeConnection, Scratch, StepList, BUCKETS_AT, CAS_RESULTS_AT,
    READ_BLOCKS_AT, WRITE_BLOCK_AT,
};
use crate::error::{Error, Result};
use crate::fault::StepKind;
use crate::progress::{Progress, Waiting};
use crate::value::Value;

/// Attempts after lost CAS races before giving up.
pub(crate) const RACE_ATTEMPTS: u32 = 64;

/// The requests a lookup's first list adds to what it starts with: the READs of the key's two
/// combined buckets and of a guessed block.
pub(crate) const LOOKUP_REQUESTS: usize = 3;

/// Reads of the buckets in one lookup that may meet a torn slot or a block that fails its
/// checksum before the lookup gives up with [`Error::Corrupt`].
const LOOKUP_ATTEMPTS: u32 = 4;

/// Waits before the next attempt after a lost race: a few yields at first (the winner is often a
/// task of this process), then a random pause of up to 50 µs × 2^(attempt − 4), capped at 3.2 ms,
/// so writers of one hot key spread out. The operation deadline bounds the whole loop.
pub(crate) async fn back_off(attempt: u32) {
    if attempt < 4 {
        for _ in 0..(1u32 << attempt) {
            tokio::task::yield_now().await;
        }
        return;
    }
    let ceiling_micros = 50u64 << (attempt - 4).min(6);
    let pause = rand::random::<u64>() % ceiling_micros;
    tokio::time::sleep(std::time::Duration::from_micros(pause)).await;
}

/// The outcome of a compare-and-swap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CasOutcome {
    /// The value equalled `expected` (or the key was absent, when absence was expected) and is
    /// now `new`.
    Swapped,
    /// The value differed; here is what it was (`None`: the key is absent).
    Mismatch(Option<Bytes>),
}

/// The outcome of [`Client::insert_or_get`](crate::Client::insert_or_get).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InsertOutcome {
    /// The key was absent and now holds the value.
    Inserted,
    /// The key was present; nothing changed. Here is the value it held.
    Present(Bytes),
}

/// What a mutation should do.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mutation<'a> {
    /// Insert or replace.
    Upsert,
    /// Insert only if absent.
    Insert,
    /// Replace only if present.
    Update,
    /// Replace only if the current value equals `expected`.
    CompareAndSwap {
        /// The value required.
        expected: &'a [u8],
    },
}

/// What a mutation did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum MutationOutcome {
    /// The new value is in place.
    Applied,
    /// Update: the key was absent.
    Absent,
    /// Insert: the key was present, with this value.
    Present(Bytes),
    /// Compare-and-swap: the value differed.
    Mismatch(Option<Bytes>),
}

/// A slot holding the key.
#[derive(Debug, Clone)]
pub(crate) struct Match {
    /// Where.
    pub(crate) position: SlotPosition,
    /// Its value in the index.
    pub(crate) slot: Slot,
    /// The value in its block.
    pub(crate) value: Value,
    /// Whether the block is a tombstone (a replicated delete: the key is absent).
    pub(crate) tombstone: bool,
    /// The block's version.
    pub(crate) version: u64,
}

/// What one lookup of a key found. A narrow guess's view (one slot, one match: most GETs)
/// lives inline, without an allocation.
#[derive(Debug)]
pub(crate) struct View {
    /// Every slot read, with its position, in position order.
    pub(crate) slots: SmallVec<[(SlotPosition, Slot); 1]>,
    /// Committed (or locked) slots holding the key, in position order. At most one is
    /// committed at any instant; a lookup that reads the buckets while the key moves can see
    /// two.
    pub(crate) committed: SmallVec<[Match; 1]>,
    /// Other writers' tentative slots holding the key (only when asked for).
    pub(crate) tentative: Vec<Match>,
}

/// Which slots a lookup reads blocks for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Candidates {
    /// Committed (and locked) slots only (readers, and writers before they place a tentative
    /// slot).
    Committed,
    /// Committed and tentative slots, except the caller's own tentative slot.
    AllBut(SlotPosition),
}

/// The next list of a lookup: its kind, and requests that go before the bucket READs.
pub(crate) struct FirstList {
    /// The step's kind.
    pub(crate) kind: StepKind,
    /// Requests posted ahead of the bucket READs in the same list.
    pub(crate) before: StepList,
    /// A guess at the key's committed slot (the slot cache): its block is READ after the
    /// buckets in the same list. Only for lookups of committed slots.
    pub(crate) guess: Option<Guess>,
}

impl FirstList {
    /// A first list of `kind` with `before` ahead of the bucket READs, and no guess.
    pub(crate) fn new(kind: StepKind, before: StepList) -> Self {
        Self {
            kind,
            before,
            guess: None,
        }
    }
}

pub(crate) fn layout_error(error: LayoutError) -> Error {
    match error {
        LayoutError::KeyLength { length } => Error::InvalidKey {
            length,
            limit: MAX_KEY_LENGTH,
        },
        LayoutError::ValueTooLarge { length } => Error::ValueTooLarge {
            length,
            limit: MAX_VALUE_LENGTH,
        },
    }
}

/// Maps a failed list. Whether the operation may have applied is the client's call (from the
/// operation's [`Progress`]), not this error's.
pub(crate) fn step_failure(operation: &'static str) -> impl Fn(ExecuteError) -> Error {
    move |error| {
        match error {
        ExecuteError::Post(error) => Error::Fabric(error),
        ExecuteError::Completion(status) => Error::WorkCompletion { operation, status },
        ExecuteError::LeaseLapsed { address } => Error::NodeUnreachable {
            address,
            reason: format!(
                "{operation}: the node's lease did not cover the request (the node is paused, cut off from the cluster, or not serving), so its memory may be stale; asking the cluster for the view"
            ),
        },
    }
    }
}

/// Appends the READs of a key's combined buckets (into the scratch bucket area) to `list`.
fn push_bucket_reads(scratch: &Scratch, location: &KeyLocation, list: &mut StepList) {
    let connection = scratch.connection();
    let geometry = &connection.welcome.geometry;
    list.extend(
        location
            .distinct_buckets()
            .enumerate()
            .map(|(index, (_, bucket))| {
                WorkRequest::read(
                    index as u64,
                    scratch.region().segment(
                        scratch.base + BUCKETS_AT + index as u64 * COMBINED_BUCKET_SIZE,
                        COMBINED_BUCKET_SIZE as u32,
                    ),
                    connection
                        .keys
                        .index_key
                        .at(geometry.combined_bucket_offset(bucket)),
                )
            }),
    );
}

/// The slots read by [`push_bucket_reads`], with their positions, in position order.
fn read_slots(scratch: &Scratch, location: &KeyLocation) -> Result<Vec<(SlotPosition, Slot)>> {
    let mut bytes = [0u8; 2 * COMBINED_BUCKET_SIZE as usize];
    scratch
        .region()
        .read(scratch.base + BUCKETS_AT, &mut bytes)?;
    let mut slots = Vec::with_capacity(32);
    for (index, (choice, bucket)) in location.distinct_buckets().enumerate() {
        let start = index * COMBINED_BUCKET_SIZE as usize;
        let parsed = parse_combined_bucket(&bytes[start..start + COMBINED_BUCKET_SIZE as usize]);
        for (slot_index, slot) in parsed.into_iter().enumerate() {
            slots.push((
                SlotPosition {
                    choice,
                    combined_bucket: bucket,
                    slot: slot_index,
                },
                slot,
            ));
        }
    }
    Ok(slots)
}

/// A block failed its checksum or was pointed at by a torn slot: read the buckets again.
struct Reread;

/// The one lookup routine: READ the buckets (after `first.before`, in one list), READ the
/// blocks of the fingerprint matches among `candidates`, and sort the slots that hold `key`
/// into committed and tentative. A torn slot word (no valid state bits), a slot pointing at a
/// block of a key that cannot live there, or a block that fails its checksum reads the buckets
/// again, at most [`LOOKUP_ATTEMPTS`] times in all, then fails [`Error::Corrupt`].
pub(crate) async fn lookup(
    scratch: &mut Scratch,
    operation: &'static str,
    key: &[u8],
    location: &KeyLocation,
    first: FirstList,
    candidates: Candidates,
) -> Result<View> {
    debug_assert!(
        first.guess.is_none() || matches!(candidates, Candidates::Committed),
        "a guess answers only a lookup of committed slots"
    );
    let mut next = Some(first);
    for _ in 0..LOOKUP_ATTEMPTS {
        let (kind, mut list, guess) = match next.take() {
            Some(first) => (first.kind, first.before, first.guess),
            None => (StepKind::ReadBuckets, StepList::new(), None),
        };
        list.reserve(LOOKUP_REQUESTS);
        push_bucket_reads(scratch, location, &mut list);
        if let Some(guess) = guess {
            list.push(WorkRequest::read(
                GUESS_READ_ID,
                scratch.region().segment(
                    scratch.base + READ_BLOCKS_AT,
                    guess.slot.block_length() as u32,
                ),
                scratch.connection().keys.heap_key.at(guess.slot.offset()),
            ));
        }
        scratch
            .execute(operation, kind, list)
            .await
            .map_err(step_failure(operation))?;
        let slots = read_slots(scratch, location)?;
        if let Some(guess) = guess {
            let counters = &scratch.connection().counters;
            counters.slot_guesses.add(1);
            let found = guessed_match(scratch, key, &slots, guess)?;
            if found.is_none() {
                counters.slot_guess_misses.add(1);
            }
            scratch
                .connection()
                .slot_cache
                .guess_outcome(false, found.is_some());
            if let Some(found) = found {
                return Ok(View {
                    slots: SmallVec::from_vec(slots),
                    committed: smallvec![found],
                    tentative: Vec::new(),
                });
            }
        }
        let outcome = if slots.iter().any(|(_, slot)| slot.is_torn()) {
            // A word no writer wrote: the READ tore it against a concurrent CAS.
            Err(Reread)
        } else {
            read_candidates(scratch, operation, key, location, &slots, candidates).await?
        };
        match outcome {
            Ok((committed, tentative)) => {
                return Ok(View {
                    slots: SmallVec::from_vec(slots),
                    committed: SmallVec::from_vec(committed),
                    tentative,
                })
            }
            Err(Reread) => {
                scratch.connection().counters.checksum_retries.add(1);
            }
        }
    }
    Err(Error::Corrupt {
        operation,
        attempts: LOOKUP_ATTEMPTS,
    })
}

/// A plain lookup of the committed slots holding `key` (readers and deletes), READing the
/// guessed block with the buckets when there is a guess.
async fn lookup_committed(
    scratch: &mut Scratch,
    operation: &'static str,
    key: &[u8],
    location: &KeyLocation,
    guess: Option<Guess>,
) -> Result<View> {
    let first = FirstList {
        kind: StepKind::ReadBuckets,
        before: StepList::new(),
        guess,
    };
    lookup(
        scratch,
        operation,
        key,
        location,
        first,
        Candidates::Committed,
    )
    .await
}

/// The work request id of a guessed block's READ (ids only label requests in a list).
const GUESS_READ_ID: u64 = 2;

/// The work request id of a narrow guess's READ of the guessed slot's word.
const GUESS_SLOT_READ_ID: u64 = 3;

/// A GET's narrow guess: one list READs the guessed slot's word alone, then the guessed block
/// (after the announce WRITE). The view holds just that slot when the word is exactly the
/// guessed one and the block holds the key, unbroken: the same argument as a wide guess
/// ([`guessed_match`]), which needs no other slot of the buckets. `None`: the guess was
/// stale, with the word the slot held: the caller may chase it or read the buckets (a round
/// trip more than a wide guess would have cost, which is why
/// [`SlotCache::narrow`](crate::connection::SlotCache::narrow) stops narrow guesses while
/// they keep going stale).
async fn narrow_guess(
    scratch: &mut Scratch,
    operation: &'static str,
    key: &[u8],
    guess: Guess,
    before: StepList,
) -> Result<std::result::Result<View, Slot>> {
    let connection = scratch.connection().clone();
    let slot_offset = connection.welcome.geometry.slot_offset(guess.position);
    let mut list = before;
    // The slot word's READ and the block's READ.
    list.reserve(2);
    list.extend([
        WorkRequest::read(
            GUESS_SLOT_READ_ID,
            scratch.region().segment(scratch.base + BUCKETS_AT, 8),
            connection.keys.index_key.at(slot_offset),
        ),
        WorkRequest::read(
            GUESS_READ_ID,
            scratch.region().segment(
                scratch.base + READ_BLOCKS_AT,
                guess.slot.block_length() as u32,
            ),
            connection.keys.heap_key.at(guess.slot.offset()),
        ),
    ]);
    scratch
        .execute(operation, StepKind::ReadBuckets, list)
        .await
        .map_err(step_failure(operation))?;
    let mut word = [0u8; 8];
    scratch
        .region()
        .read(scratch.base + BUCKETS_AT, &mut word)?;
    let seen = [(guess.position, Slot::from_bytes(word))];
    let found = guessed_match(scratch, key, &seen, guess)?;
    connection.counters.slot_guesses.add(1);
    Ok(match found {
        Some(found) => Ok(View {
            slots: SmallVec::from_buf(seen),
            committed: smallvec![found],
            tentative: Vec::new(),
        }),
        None => {
            connection.counters.slot_guess_misses.add(1);
            Err(seen[0].1)
        }
    })
}

/// A lookup by narrow guesses ([`narrow_guess`]), the first list starting with `before`: the
/// view of the key's one committed slot, or `None` when the guess and its chase were stale
/// (the caller reads the buckets; `before` went out with the first list either way).
///
/// A stale guess usually means the key was updated in place: its slot now holds the new
/// block's word, which the narrow READ brought back. Chasing it once costs the round trip a
/// wide guess would have spent on the block after the buckets.
async fn narrow_lookup(
    scratch: &mut Scratch,
    operation: &'static str,
    key: &[u8],
    location: &KeyLocation,
    guess: Guess,
    before: StepList,
) -> Result<Option<View>> {
    let connection = scratch.connection().clone();
    let mut next = Some(guess);
    let mut before = before;
    let mut chased = false;
    let mut found = None;
    while let Some(current) = next.take() {
        match narrow_guess(
            scratch,
            operation,
            key,
            current,
            std::mem::take(&mut before),
        )
        .await?
        {
            Ok(view) => {
                found = Some(view);
                break;
            }
            // The word held but its block is another key's, or the slot's new word: only a
            // new word is worth a second look.
            Err(seen) if !chased && seen != current.slot => {
                chased = true;
                next = Guess {
                    position: current.position,
                    slot: seen,
                }
                .plausible(location, connection.welcome.geometry.heap_size);
            }
            Err(_) => {}
        }
    }
    connection.slot_cache.guess_outcome(true, found.is_some());
    Ok(found)
}

/// The committed slot holding `key`, if the guess proved true: the bucket READ found the
/// guessed slot holding exactly the guessed word, and the block READ after it (same list, so
/// executed after it, and announced, so not reclaimed in between) holds the key, unbroken. At
/// most one slot per key is committed at any instant, so this is the key's slot at the bucket
/// READ, as the ordinary lookup would have found it (`docs/protocol.md`, *Guessed blocks*).
fn guessed_match(
    scratch: &Scratch,
    key: &[u8],
    slots: &[(SlotPosition, Slot)],
    guess: Guess,
) -> Result<Option<Match>> {
    if !slots.contains(&(guess.position, guess.slot)) {
        return Ok(None);
    }
    Ok(
        match read_block(
            scratch,
            scratch.base + READ_BLOCKS_AT,
            guess.slot.block_length(),
            key,
        )? {
            BlockRead::Key {
                value,
                tombstone,
                version,
            } => Some(Match {
                position: guess.position,
                slot: guess.slot,
                value,
                tombstone,
                version,
            }),
            BlockRead::Other { .. } | BlockRead::Broken => None,
        },
    )
}

/// A block read into the scratch buffer, as found there.
enum BlockRead {
    /// The key's block, intact: its value, copied out once, and whether it is a tombstone.
    Key {
        /// The value.
        value: Value,
        /// Whether the block is a tombstone (a replicated delete).
        tombstone: bool,
        /// The block's version.
        version: u64,
    },
    /// Another key's block, intact.
    Other {
        /// That key.
        key: Vec<u8>,
    },
    /// Not a whole, intact block (torn, reused, or never written).
    Broken,
}

/// Decodes the block of `length` bytes read to `at` in the scratch buffer, and verifies it. The
/// header and key are copied out onto the stack, and the value into the vector the returned
/// [`Bytes`] keeps: one copy of the value, where copying the block out and then its value was
/// two.
fn read_block(scratch: &Scratch, at: u64, length: u64, key: &[u8]) -> Result<BlockRead> {
    let region = scratch.region();
    let Some(header) = crate::block::parse_header(scratch, at, length)? else {
        return Ok(BlockRead::Broken);
    };
    let mut key_bytes = [0u8; MAX_KEY_LENGTH];
    let Some(stored_key) = key_bytes.get_mut(..header.key_length) else {
        return Ok(BlockRead::Broken);
    };
    region.read(at + header.key_offset() as u64, stored_key)?;
    let mut value = Value::with_room(header.value_length);
    region.read_append(
        at + header.value_offset() as u64,
        header.value_length,
        value.vector(),
    )?;
    if header.verify(stored_key, &value).is_err() {
        return Ok(BlockRead::Broken);
    }
    Ok(if *stored_key == *key {
        BlockRead::Key {
            value,
            tombstone: header.tombstone,
            version: header.version,
        }
    } else {
        BlockRead::Other {
            key: stored_key.to_vec(),
        }
    })
}

/// Reads the blocks of the fingerprint matches among `candidates` and returns the committed and
/// the tentative slots holding `key`, each in position order. A block that fails its checksum,
/// or that holds a key which could not live in the slot that pointed to it (a torn slot read),
/// asks the caller to read the buckets again.
async fn read_candidates(
    scratch: &mut Scratch,
    operation: &'static str,
    key: &[u8],
    location: &KeyLocation,
    slots: &[(SlotPosition, Slot)],
    candidates: Candidates,
) -> Result<std::result::Result<(Vec<Match>, Vec<Match>), Reread>> {
    let wanted: Vec<(SlotPosition, Slot)> = slots
        .iter()
        .copied()
        .filter(|(position, slot)| {
            !slot.is_empty()
                && slot.fingerprint() == location.fingerprint
                && match candidates {
                    Candidates::Committed => slot.is_readable(),
                    Candidates::AllBut(mine) => *position != mine,
                }
        })
        .collect();
    let mut committed = Vec::new();
    let mut tentative = Vec::new();
    let mut remaining = wanted.as_slice();
    while !remaining.is_empty() {
        // As many candidates as fit the read area go in one list.
        let count = blocks_that_fit(remaining.iter().map(|(_, slot)| *slot));
        let (round, rest) = remaining.split_at(count);
        remaining = rest;
        let list = block_reads(scratch, round.iter().map(|(_, slot)| *slot));
        scratch
            .execute(operation, StepKind::ReadBlocks, list)
            .await
            .map_err(step_failure(operation))?;
        let mut at = 0u64;
        for (position, slot) in round.iter().copied() {
            let block = read_block(
                scratch,
                scratch.base + READ_BLOCKS_AT + at,
                slot.block_length(),
                key,
            )?;
            at += slot.block_length();
            match block {
                BlockRead::Key {
                    value,
                    tombstone,
                    version,
                } => {
                    let found = Match {
                        position,
                        slot,
                        value,
                        tombstone,
                        version,
                    };
                    if slot.is_tentative() {
                        tentative.push(found);
                    } else {
                        committed.push(found);
                    }
                }
                BlockRead::Other { key: other_key } => {
                    // Another key's block: a fingerprint collision if that key really lives
                    // here. If it could not (other fingerprint or buckets), the slot word was
                    // read torn — a NIC need not READ an 8-byte word atomically against a
                    // concurrent CAS, and rxe does not — so the buckets are read again.
                    let other = scratch.connection().welcome.geometry.locate(&other_key);
                    if other.fingerprint != slot.fingerprint()
                        || !other.combined_buckets.contains(&position.combined_bucket)
                    {
                        return Ok(Err(Reread));
                    }
                }
                BlockRead::Broken => return Ok(Err(Reread)),
            }
        }
    }
    committed.sort_by_key(|found| found.position);
    tentative.sort_by_key(|found| found.position);
    Ok(Ok((committed, tentative)))
}

/// The CAS of one slot from `expected` to `new`, as a request whose result lands in CAS result
/// `index` of the scratch buffer.
pub(crate) fn slot_cas(
    scratch: &Scratch,
    index: u64,
    position: SlotPosition,
    expected: Slot,
    new: Slot,
) -> WorkRequest {
    let connection = scratch.connection();
    WorkRequest::compare_and_swap(
        index,
        scratch
            .region()
            .segment(scratch.base + CAS_RESULTS_AT + index * 8, 8),
        connection
            .keys
            .index_key
            .at(connection.welcome.geometry.slot_offset(position)),
        expected.0,
        new.0,
    )
}

/// The original value returned by CAS `index` of the last list.
pub(crate) fn cas_original(scratch: &Scratch, index: u64) -> Result<Slot> {
    Ok(Slot(
        scratch
            .region()
            .load_u64(scratch.base + CAS_RESULTS_AT + index * 8)?,
    ))
}

/// One CAS of one slot as its own step; `Ok(true)` when it swapped. A publishing CAS that lost
/// is recorded as having had no effect.
pub(crate) async fn cas_step(
    scratch: &mut Scratch,
    operation: &'static str,
    kind: StepKind,
    position: SlotPosition,
    expected: Slot,
    new: Slot,
) -> Result<bool> {
    let request = slot_cas(scratch, 0, position, expected, new);
    scratch
        .execute(operation, kind, StepList::of(request))
        .await
        .map_err(step_failure(operation))?;
    let swapped = cas_original(scratch, 0)? == expected;
    if !swapped {
        scratch.lost_race(kind);
    }
    Ok(swapped)
}

/// Records what a lookup found in the slot cache: the key's one committed slot, or nothing
/// (absent, or read while it moved).
fn remember_view(connection: &NodeConnection, location: &KeyLocation, view: &View) {
    match view.committed.as_slice() {
        [found] => connection
            .slot_cache
            .remember(location, found.position, found.slot),
        _ => connection.slot_cache.forget(location),
    }
}

/// GET: one round trip when the slot cache's guess holds, else two when the key has a
/// fingerprint match, one when it has none.
pub(crate) async fn get(
    connection: &Arc<NodeConnection>,
    progress: Arc<Progress>,
    key: &[u8],
) -> Result<Option<Value>> {
    check_key_value(key, &[]).map_err(layout_error)?;
    let location = connection.welcome.geometry.locate(key);
    let begun = Instant::now();
    progress.wait_for(Waiting::ScratchBuffer);
    let mut scratch = connection.scratch(progress).await?;
    let guess = connection.guess(&location);
    let narrow_first = guess.filter(|_| connection.slot_cache.narrow());
    let narrow = match narrow_first {
        Some(guess) => {
            narrow_lookup(&mut scratch, "get", key, &location, guess, StepList::new()).await?
        }
        None => None,
    };
    let view = match narrow {
        Some(view) => view,
        // No narrow guess, or a stale one (its round trip is spent): the buckets, and a wide
        // guess unless the narrow one just proved stale.
        None => {
            let wide = guess.filter(|_| narrow_first.is_none());
            lookup_committed(&mut scratch, "get", key, &location, wide).await?
        }
    };
    // A lookup that ran for the node's operation deadline or longer (its thread stopped in the
    // middle of a READ: on `shm` the client copies itself) may have copied a block from an
    // extent the node reused after its quarantine (1.25 deadlines), whatever the announce
    // word said: not returned, as a direct GET's (`direct_read_stands`).
    let node_deadline = Duration::from_millis(connection.welcome.operation_deadline_ms);
    if !node_deadline.is_zero() && begun.elapsed() >= node_deadline {
        return Err(Error::TimedOut {
            operation: "get",
            deadline: node_deadline,
            waiting_for: "the node's memory (a READ that outlasted the node's operation deadline is not trusted)",
            unanswered: None,
            may_have_applied: false,
        });
    }
    remember_view(connection, &location, &view);
    let counters = &connection.counters;
    counters.gets.add(1);
    counters.get_round_trips.add(scratch.round_trips);
    // A tombstone (replicated delete) is an absent key.
    Ok(view
        .committed
        .into_iter()
        .next()
        .filter(|found| !found.tombstone)
        .map(|found| found.value))
}

/// Every mutation but delete: the block is written into the scratch buffer and placed in the
/// heap first, its WRITE rides in the first lookup's list, and each pass decides from what the
/// lookup found ([`SingleWrite::once`]).
pub(crate) async fn mutate(
    connection: &Arc<NodeConnection>,
    progress: Arc<Progress>,
    operation: &'static str,
    key: &[u8],
    value: &[u8],
    mutation: Mutation<'_>,
) -> Result<MutationOutcome> {
    check_key_value(key, value).map_err(layout_error)?;
    let location = connection.welcome.geometry.locate(key);
    progress.wait_for(Waiting::WriterTurn);
    let _turn = connection.writer_turn(&location).await;
    progress.wait_for(Waiting::ScratchBuffer);
    let mut scratch = connection.scratch(progress.clone()).await?;
    let block = Block::new(key, value, false, crate::version::next_version(0));
    block.write(&scratch, scratch.base + WRITE_BLOCK_AT)?;
    let block = block.shape();
    progress.wait_for(Waiting::HeapChunk);
    let place = scratch.place_block(block.length()).await?;
    let write = SingleWrite {
        connection,
        operation,
        key,
        location: &location,
        mutation,
        new_slot: block.slot(location.fingerprint, place.heap_offset),
    };
    // The block WRITE rides in the same list as the first bucket READs.
    let mut block_write = Some(block_write_request(&scratch, block, place));
    // A cached key's first attempt looks by narrow guess, the block WRITE in its first list:
    // a replace then needs the key's slot and word only, which a held guess gives.
    let guess = connection.guess(&location);
    let narrow_first = guess.filter(|_| connection.slot_cache.narrow());
    let mut narrow = match narrow_first {
        Some(guess) => {
            let before = StepList::starting_with(block_write.take(), LOOKUP_REQUESTS);
            narrow_lookup(&mut scratch, operation, key, &location, guess, before).await?
        }
        None => None,
    };
    for attempt in 0..RACE_ATTEMPTS {
        let view = match narrow.take() {
            Some(view) => view,
            None => {
                let first = FirstList {
                    kind: StepKind::ReadBuckets,
                    before: StepList::starting_with(block_write.take(), LOOKUP_REQUESTS),
                    // A wide guess unless a narrow one already went stale.
                    guess: guess.filter(|_| attempt == 0 && narrow_first.is_none()),
                };
                lookup(
                    &mut scratch,
                    operation,
                    key,
                    &location,
                    first,
                    Candidates::Committed,
                )
                .await?
            }
        };
        remember_view(connection, &location, &view);
        if let Some(outcome) = write.once(&mut scratch, &view, attempt).await? {
            return Ok(outcome);
        }
        back_off(attempt).await;
    }
    Err(Error::Contention {
        operation,
        attempts: RACE_ATTEMPTS,
    })
}

/// The WRITE of `block`, written at the scratch buffer's write area, to its `place` in the
/// node's heap (unsignaled: it rides ahead of requests that report).
pub(crate) fn block_write_request(
    scratch: &Scratch,
    block: BlockShape,
    place: BlockPlace,
) -> WorkRequest {
    WorkRequest::write(
        u64::MAX,
        scratch
            .region()
            .segment(scratch.base + WRITE_BLOCK_AT, block.length() as u32),
        place.remote.at(place.offset_in_chunk),
    )
    .with_signaled(false)
}

/// A single-copy write whose block is placed: what each pass of [`mutate`] decides by.
struct SingleWrite<'a> {
    /// The key's node.
    connection: &'a NodeConnection,
    /// The operation's name, for errors.
    operation: &'static str,
    /// The key.
    key: &'a [u8],
    /// The key's buckets and fingerprint.
    location: &'a KeyLocation,
    /// What the write does.
    mutation: Mutation<'a>,
    /// The committed slot word of the placed block.
    new_slot: Slot,
}

impl SingleWrite<'_> {
    /// One pass on what the lookup found in `view`: the outcome, or `None` to look again after
    /// a back-off (a lost race, a read while the key moved, or every candidate slot held by
    /// inserts in progress).
    async fn once(
        &self,
        scratch: &mut Scratch,
        view: &View,
        attempt: u32,
    ) -> Result<Option<MutationOutcome>> {
        if view.committed.len() > 1 {
            // Read while the key moved (deleted here, inserted there): look again.
            return Ok(None);
        }
        // A tombstone (a replicated delete, left by the writes of a membership change: a
        // cluster of one copy writes through the replicated path then) is an absent key, whose
        // slot a write replaces.
        if let Some(tombstone) = view.committed.first().filter(|found| found.tombstone) {
            return Ok(match self.mutation {
                Mutation::Update => Some(MutationOutcome::Absent),
                Mutation::CompareAndSwap { .. } => Some(MutationOutcome::Mismatch(None)),
                Mutation::Upsert | Mutation::Insert => self.replace(scratch, tombstone).await?,
            });
        }
        Ok(match (self.mutation, view.committed.first()) {
            (Mutation::Insert, Some(current)) => {
                Some(MutationOutcome::Present(current.value.to_bytes()))
            }
            (Mutation::Update, None) => Some(MutationOutcome::Absent),
            (Mutation::CompareAndSwap { .. }, None) => Some(MutationOutcome::Mismatch(None)),
            (Mutation::CompareAndSwap { expected }, Some(current))
                if *current.value != *expected =>
            {
                Some(MutationOutcome::Mismatch(Some(current.value.to_bytes())))
            }
            (_, Some(current)) => self.replace(scratch, current).await?,
            (Mutation::Upsert | Mutation::Insert, None) => {
                self.insert(scratch, view, attempt).await?
            }
        })
    }

    /// Replaces the key's committed slot `current` with the new block; `None`: the race was
    /// lost.
    async fn replace(
        &self,
        scratch: &mut Scratch,
        current: &Match,
    ) -> Result<Option<MutationOutcome>> {
        let swapped = cas_step(
            scratch,
            self.operation,
            StepKind::Replace,
            current.position,
            current.slot,
            self.new_slot,
        )
        .await?;
        Ok(swapped.then(|| {
            self.connection
                .slot_cache
                .remember(self.location, current.position, self.new_slot);
            MutationOutcome::Applied
        }))
    }

    /// Inserts the absent key into the first empty candidate slot of `view`; `None`: no slot
    /// was free, the race was lost, or an upsert found the key present (it replaces it on the
    /// next pass).
    async fn insert(
        &self,
        scratch: &mut Scratch,
        view: &View,
        attempt: u32,
    ) -> Result<Option<MutationOutcome>> {
        let Some(empty) = empty_slot(view, self.connection, attempt)? else {
            // Inserts in progress hold every candidate slot: wait for one.
            return Ok(None);
        };
        let inserted = insert_absent(
            scratch,
            self.operation,
            self.key,
            self.location,
            empty,
            self.new_slot,
            StepList::new(),
        )
        .await?;
        Ok(match inserted {
            Inserted::Committed => {
                self.connection
                    .slot_cache
                    .remember(self.location, empty, self.new_slot);
                Some(MutationOutcome::Applied)
            }
            Inserted::Present(present) if matches!(self.mutation, Mutation::Insert) => {
                Some(MutationOutcome::Present(present))
            }
            Inserted::Present(_) | Inserted::Lost => None,
        })
    }
}

/// The first empty candidate slot of the key in `view`; `None` when every one is taken but
/// some by inserts in progress (or abandoned ones the collector clears within a quarantine):
/// the caller waits for one, within its deadline.
///
/// # Errors
/// [`Error::TableFull`] when every candidate slot is taken and none is tentative, or on the
/// last attempt.
pub(crate) fn empty_slot(
    view: &View,
    connection: &NodeConnection,
    attempt: u32,
) -> Result<Option<SlotPosition>> {
    if let Some((empty, _)) = view.slots.iter().find(|(_, slot)| slot.is_empty()) {
        return Ok(Some(*empty));
    }
    let tentative = view
        .slots
        .iter()
        .filter(|(_, slot)| slot.is_tentative())
        .count();
    if tentative > 0 && attempt + 1 < RACE_ATTEMPTS {
        return Ok(None);
    }
    Err(Error::TableFull {
        reason: format!(
            "all {} candidate slots of this key are taken ({tentative} of them by inserts in progress or abandoned, cleared within a quarantine); the index has {} buckets: raise index_size (`rdkv-cluster resize FILE --node N --index-size SIZE`)",
            view.slots.len(),
            connection.welcome.geometry.bucket_count
        ),
    })
}

/// How an insert of an absent key ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Inserted {
    /// The tentative slot was committed: the insert happened.
    Committed,
    /// Another slot holds the key, committed, with this value; the tentative slot was
    /// withdrawn.
    Present(Bytes),
    /// The empty slot was taken first, or another inserter withdrew the tentative slot: try
    /// again from the lookup.
    Lost,
}

/// Inserts `new_slot` into the empty slot at `empty`: place it tentative (readers ignore it) and
/// re-read the buckets in one list; withdraw if the key is committed elsewhere; withdraw the
/// other inserters' tentative slots of the key; commit. Why this never leaves two committed
/// slots of one key: `docs/protocol.md`, *Insert (key absent)*. `before` goes ahead of the
/// place CAS in its list (a WRITE of the block, when it is not written yet).
pub(crate) async fn insert_absent(
    scratch: &mut Scratch,
    operation: &'static str,
    key: &[u8],
    location: &KeyLocation,
    empty: SlotPosition,
    new_slot: Slot,
    mut before: StepList,
) -> Result<Inserted> {
    let tentative = new_slot.tentative();
    before.reserve(1 + LOOKUP_REQUESTS);
    before.push(slot_cas(scratch, 0, empty, Slot::EMPTY, tentative));
    let mut next = FirstList::new(StepKind::PlaceTentative, before);
    for round in 0..RACE_ATTEMPTS {
        let placing = round == 0;
        let view = lookup(
            scratch,
            operation,
            key,
            location,
            std::mem::replace(
                &mut next,
                FirstList::new(StepKind::ReadBuckets, StepList::new()),
            ),
            Candidates::AllBut(empty),
        )
        .await?;
        if placing && cas_original(scratch, 0)? != Slot::EMPTY {
            scratch.lost_race(StepKind::PlaceTentative);
            scratch.tentative_resolved();
            return Ok(Inserted::Lost);
        }
        if let Some(present) = view.committed.first() {
            withdraw(scratch, operation, empty, tentative).await?;
            return Ok(Inserted::Present(present.value.to_bytes()));
        }
        match withdraw_others(scratch, operation, &view.tentative).await? {
            Others::Withdrawn => {}
            Others::Committed(value) => {
                withdraw(scratch, operation, empty, tentative).await?;
                return Ok(Inserted::Present(value));
            }
            // A slot changed under us (committed and then moved, or reused): read again
            // before deciding.
            Others::Changed => continue,
        }
        let committed = cas_step(
            scratch,
            operation,
            StepKind::Commit,
            empty,
            tentative,
            new_slot,
        )
        .await?;
        // Committed, or withdrawn by another inserter: either way no longer tentative.
        scratch.tentative_resolved();
        return Ok(if committed {
            Inserted::Committed
        } else {
            Inserted::Lost
        });
    }
    withdraw(scratch, operation, empty, tentative).await?;
    Ok(Inserted::Lost)
}

/// What became of other inserters' tentative slots of the key.
enum Others {
    /// None is left (or there were none).
    Withdrawn,
    /// One's inserter committed first: the key is present, with the value of the block read
    /// (committing changes the slot's state, not its block).
    Committed(Bytes),
    /// A slot changed under us, or more remain than one list withdraws: read again.
    Changed,
}

/// Withdraws the other inserters' tentative slots `others` of the key (CAS each to empty, at
/// most 32 in one list).
async fn withdraw_others(
    scratch: &mut Scratch,
    operation: &'static str,
    others: &[Match],
) -> Result<Others> {
    if others.is_empty() {
        return Ok(Others::Withdrawn);
    }
    let count = others.len().min(32);
    let mut kills = StepList::with_room_for(count);
    kills.extend(others.iter().take(count).enumerate().map(|(index, other)| {
        slot_cas(
            scratch,
            index as u64,
            other.position,
            other.slot,
            Slot::EMPTY,
        )
        .with_signaled(index + 1 == count)
    }));
    scratch
        .execute(operation, StepKind::KillTentatives, kills)
        .await
        .map_err(step_failure(operation))?;
    let mut all_withdrawn = true;
    for (index, other) in others.iter().take(count).enumerate() {
        let original = cas_original(scratch, index as u64)?;
        if original == other.slot.committed() {
            return Ok(Others::Committed(other.value.to_bytes()));
        }
        all_withdrawn &= original == other.slot;
    }
    Ok(if all_withdrawn && others.len() == count {
        Others::Withdrawn
    } else {
        Others::Changed
    })
}

/// Withdraws the operation's own tentative slot (it may already have been withdrawn by another
/// inserter, which is as good).
async fn withdraw(
    scratch: &mut Scratch,
    operation: &'static str,
    position: SlotPosition,
    tentative: Slot,
) -> Result<()> {
    cas_step(
        scratch,
        operation,
        StepKind::AbortTentative,
        position,
        tentative,
        Slot::EMPTY,
    )
    .await?;
    scratch.tentative_resolved();
    Ok(())
}

/// DELETE: CAS the key's committed slot to empty. `Ok(false)` when the key was absent.
pub(crate) async fn delete(
    connection: &Arc<NodeConnection>,
    progress: Arc<Progress>,
    key: &[u8],
) -> Result<bool> {
    check_key_value(key, &[]).map_err(layout_error)?;
    let location = connection.welcome.geometry.locate(key);
    progress.wait_for(Waiting::WriterTurn);
    let _turn = connection.writer_turn(&location).await;
    progress.wait_for(Waiting::ScratchBuffer);
    let mut scratch = connection.scratch(progress).await?;
    for attempt in 0..RACE_ATTEMPTS {
        let guess = if attempt == 0 {
            connection.guess(&location)
        } else {
            None
        };
        let view = lookup_committed(&mut scratch, "delete", key, &location, guess).await?;
        match view.committed.as_slice() {
            [] => return Ok(false),
            // A tombstone (a replicated delete) is an absent key.
            [current] if current.tombstone => return Ok(false),
            [current]
                if cas_step(
                    &mut scratch,
                    "delete",
                    StepKind::Remove,
                    current.position,
                    current.slot,
                    Slot::EMPTY,
                )
                .await? =>
            {
                connection.slot_cache.forget(&location);
                return Ok(true);
            }
            // Lost the race, or read while the key moved: look again.
            _ => {}
        }
        back_off(attempt).await;
    }
    Err(Error::Contention {
        operation: "delete",
        attempts: RACE_ATTEMPTS,
    })
}
