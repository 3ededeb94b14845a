//! The one-sided algorithms (RACE-style, out of place). `docs/protocol.md` states them with
//! their round trips; in short:
//!
//! - **GET**: READ both combined buckets in one list (round trip 1); READ every block whose slot
//!   has the key's fingerprint, in one list (round trip 2); verify key and checksum; the match
//!   at the lowest slot position wins. A checksum mismatch re-reads, a bounded number of times.
//! - **Mutations**: WRITE the new block into the client's own chunk in the same list as the
//!   bucket READs; READ the candidate blocks; CAS the winning slot from its old value to the new
//!   one (an insert CASes the first empty slot, then re-reads to resolve duplicate inserts: the
//!   lowest position wins, a losing upsert overwrites the winner and removes its own slot, a
//!   losing insert removes its slot and reports the key present). A lost CAS race re-reads.
//! - **DELETE**: CAS every slot holding the key to empty, duplicates first and the winner last,
//!   in one list.
//!
//! Failures before the final CAS are safe to retry on a new connection; a CAS whose completion
//! failed is reported as [`Error::Unresolved`], never retried.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use rdkv_common::fabric::WorkRequest;
use rdkv_common::layout::{
    check_key_value, decode_block, encode_block, parse_combined_bucket, BlockError, KeyLocation,
    LayoutError, Slot, SlotPosition, COMBINED_BUCKET_SIZE, MAX_KEY_LENGTH, MAX_VALUE_LENGTH,
};

use crate::connection::{
    ExecuteError, NodeConnection, Scratch, BUCKETS_AT, CAS_RESULTS_AT, READ_BLOCKS_AT,
    READ_BLOCKS_SIZE, WRITE_BLOCK_AT,
};
use crate::error::{Error, Result};
use crate::fault::StepKind;

/// Attempts after lost CAS races before giving up.
const RACE_ATTEMPTS: u32 = 64;

/// Attempts after checksum mismatches before giving up.
const CHECKSUM_ATTEMPTS: u32 = 4;

/// Waits before the next attempt after a lost race: a few yields at first (the winner is often a
/// task of this process), then a random pause of up to 50 µs × 2^(attempt − 4), capped at 3.2 ms,
/// so writers of one hot key spread out. The operation deadline bounds the whole loop.
async fn back_off(attempt: u32) {
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
    /// The value equalled `expected` and is now `new`.
    Swapped,
    /// The value differed; here is what it was (`None`: the key is absent).
    Mismatch(Option<Bytes>),
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
    /// Insert: the key was present.
    Present,
    /// Compare-and-swap: the value differed.
    Mismatch(Option<Bytes>),
}

/// A slot holding the key.
#[derive(Debug, Clone)]
struct Match {
    /// Where.
    position: SlotPosition,
    /// Its value in the index.
    slot: Slot,
    /// The value in its block.
    value: Bytes,
}

/// A block failed its checksum: re-read.
struct ChecksumMismatch;

fn layout_error(error: LayoutError) -> Error {
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

/// Maps a failure before the final CAS: safe to retry on a new connection.
fn read_failure(operation: &'static str) -> impl Fn(ExecuteError) -> Error {
    move |error| match error {
        ExecuteError::Post(error) => Error::Fabric(error),
        ExecuteError::Completion(status) => Error::WorkCompletion { operation, status },
    }
}

/// Maps a failure of the final CAS: the outcome is unknown.
fn cas_failure(operation: &'static str) -> impl Fn(ExecuteError) -> Error {
    move |error| match error {
        ExecuteError::Post(error) => Error::Fabric(error),
        ExecuteError::Completion(status) => Error::Unresolved { operation, status },
    }
}

/// The READs of a key's combined buckets into the scratch bucket area.
fn bucket_reads(scratch: &Scratch, location: &KeyLocation) -> Vec<WorkRequest> {
    let connection = scratch.connection();
    let geometry = &connection.welcome.geometry;
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
        })
        .collect()
}

/// The slots read by [`bucket_reads`], with their positions, in position order.
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

/// Reads the blocks of the fingerprint matches and returns those holding `key`, lowest
/// position first. A block that fails its checksum, or that holds a key which could not live in
/// the slot that pointed to it (a torn slot read), asks the caller to read the buckets again.
async fn find_matches(
    scratch: &mut Scratch,
    operation: &'static str,
    key: &[u8],
    location: &KeyLocation,
    slots: &[(SlotPosition, Slot)],
) -> Result<std::result::Result<Vec<Match>, ChecksumMismatch>> {
    let candidates: Vec<(SlotPosition, Slot)> = slots
        .iter()
        .copied()
        .filter(|(_, slot)| !slot.is_empty() && slot.fingerprint() == location.fingerprint)
        .collect();
    let mut matches = Vec::new();
    let heap_key = scratch.connection().keys.heap_key;
    let mut remaining = candidates.as_slice();
    while !remaining.is_empty() {
        // As many candidates as fit the read area go in one list.
        let mut used = 0u64;
        let mut round = Vec::new();
        for (position, slot) in remaining {
            let length = slot.block_length();
            if used + length > READ_BLOCKS_SIZE && !round.is_empty() {
                break;
            }
            round.push((*position, *slot, used));
            used += length;
        }
        remaining = &remaining[round.len()..];
        let list: Vec<WorkRequest> = round
            .iter()
            .enumerate()
            .map(|(index, (_, slot, at))| {
                WorkRequest::read(
                    index as u64,
                    scratch.region().segment(
                        scratch.base + READ_BLOCKS_AT + at,
                        slot.block_length() as u32,
                    ),
                    heap_key.at(slot.offset()),
                )
                .with_signaled(index + 1 == round.len())
            })
            .collect();
        scratch
            .execute(operation, StepKind::ReadBlocks, list)
            .await
            .map_err(read_failure(operation))?;
        for (position, slot, at) in round {
            let mut bytes = vec![0u8; slot.block_length() as usize];
            scratch
                .region()
                .read(scratch.base + READ_BLOCKS_AT + at, &mut bytes)?;
            match decode_block(&bytes) {
                Ok(block) if block.key == key => {
                    // The value is a slice of the block just read: no further copy.
                    let start = block.value.as_ptr() as usize - bytes.as_ptr() as usize;
                    let end = start + block.value.len();
                    matches.push(Match {
                        position,
                        slot,
                        value: Bytes::from(bytes).slice(start..end),
                    })
                }
                Ok(block) => {
                    // Another key's block: a fingerprint collision if that key really lives
                    // here. If it could not (other fingerprint or buckets), the slot word was
                    // read torn — a NIC need not READ an 8-byte word atomically against a
                    // concurrent CAS, and rxe does not — so the buckets are read again.
                    let other = scratch.connection().welcome.geometry.locate(block.key);
                    if other.fingerprint != slot.fingerprint()
                        || !other.combined_buckets.contains(&position.combined_bucket)
                    {
                        return Ok(Err(ChecksumMismatch));
                    }
                }
                Err(BlockError::Checksum | BlockError::Malformed { .. }) => {
                    return Ok(Err(ChecksumMismatch))
                }
            }
        }
    }
    matches.sort_by_key(|found| found.position);
    Ok(Ok(matches))
}

/// One CAS of a slot; `Ok(true)` when it swapped.
async fn compare_and_swap_slot(
    scratch: &mut Scratch,
    operation: &'static str,
    position: SlotPosition,
    expected: Slot,
    new: Slot,
) -> Result<bool> {
    let connection = scratch.connection().clone();
    let geometry = &connection.welcome.geometry;
    let request = WorkRequest::compare_and_swap(
        0,
        scratch.region().segment(scratch.base + CAS_RESULTS_AT, 8),
        connection.keys.index_key.at(geometry.slot_offset(position)),
        expected.0,
        new.0,
    );
    scratch
        .execute(operation, StepKind::Replace, vec![request])
        .await
        .map_err(cas_failure(operation))?;
    let original = scratch.region().load_u64(scratch.base + CAS_RESULTS_AT)?;
    let swapped = original == expected.0;
    if !swapped {
        connection
            .counters
            .cas_failures
            .fetch_add(1, Ordering::Relaxed);
    }
    Ok(swapped)
}

fn checksum_retry(connection: &NodeConnection) {
    connection
        .counters
        .checksum_retries
        .fetch_add(1, Ordering::Relaxed);
}

/// GET: two round trips when the key has a fingerprint match, one when it has none.
pub(crate) async fn get(connection: &Arc<NodeConnection>, key: &[u8]) -> Result<Option<Bytes>> {
    check_key_value(key, &[]).map_err(layout_error)?;
    let location = connection.welcome.geometry.locate(key);
    let mut scratch = connection.scratch().await;
    for _ in 0..CHECKSUM_ATTEMPTS {
        scratch
            .execute(
                "get",
                StepKind::ReadBuckets,
                bucket_reads(&scratch, &location),
            )
            .await
            .map_err(read_failure("get"))?;
        let slots = read_slots(&scratch, &location)?;
        match find_matches(&mut scratch, "get", key, &location, &slots).await? {
            Ok(matches) => {
                let counters = &connection.counters;
                counters.gets.fetch_add(1, Ordering::Relaxed);
                counters
                    .get_round_trips
                    .fetch_add(scratch.round_trips, Ordering::Relaxed);
                return Ok(matches.into_iter().next().map(|found| found.value));
            }
            Err(ChecksumMismatch) => checksum_retry(connection),
        }
    }
    Err(Error::Corrupt {
        operation: "get",
        attempts: CHECKSUM_ATTEMPTS,
    })
}

/// Every mutation but delete.
pub(crate) async fn mutate(
    connection: &Arc<NodeConnection>,
    operation: &'static str,
    key: &[u8],
    value: &[u8],
    mutation: Mutation<'_>,
) -> Result<MutationOutcome> {
    check_key_value(key, value).map_err(layout_error)?;
    let location = connection.welcome.geometry.locate(key);
    let _turn = connection.writer_turn(&location).await;
    let mut scratch = connection.scratch().await;
    let mut block = Vec::with_capacity(value.len() + key.len() + 64);
    let units = encode_block(key, value, &mut block);
    scratch
        .region()
        .write(scratch.base + WRITE_BLOCK_AT, &block)?;
    let place = connection.place_block(block.len() as u64).await?;
    let new_slot = Slot::new(location.fingerprint, units, place.heap_offset);
    let mut block_write = Some(
        WorkRequest::write(
            u64::MAX,
            scratch
                .region()
                .segment(scratch.base + WRITE_BLOCK_AT, block.len() as u32),
            place.remote.at(place.offset_in_chunk),
        )
        .with_signaled(false),
    );
    let mut checksum_failures = 0;
    for attempt in 0..RACE_ATTEMPTS {
        // The block WRITE rides in the same list as the first bucket READs.
        let mut list: Vec<WorkRequest> = block_write.take().into_iter().collect();
        list.extend(bucket_reads(&scratch, &location));
        scratch
            .execute(operation, StepKind::ReadBuckets, list)
            .await
            .map_err(read_failure(operation))?;
        let slots = read_slots(&scratch, &location)?;
        let matches = match find_matches(&mut scratch, operation, key, &location, &slots).await? {
            Ok(matches) => matches,
            Err(ChecksumMismatch) => {
                checksum_retry(connection);
                checksum_failures += 1;
                if checksum_failures >= CHECKSUM_ATTEMPTS {
                    return Err(Error::Corrupt {
                        operation,
                        attempts: checksum_failures,
                    });
                }
                continue;
            }
        };
        match (mutation, matches.first()) {
            (Mutation::Insert, Some(_)) => return Ok(MutationOutcome::Present),
            (Mutation::Update, None) => return Ok(MutationOutcome::Absent),
            (Mutation::CompareAndSwap { .. }, None) => return Ok(MutationOutcome::Mismatch(None)),
            (Mutation::CompareAndSwap { expected }, Some(winner))
                if winner.value.as_ref() != expected =>
            {
                return Ok(MutationOutcome::Mismatch(Some(winner.value.clone())))
            }
            (_, Some(winner)) => {
                if compare_and_swap_slot(
                    &mut scratch,
                    operation,
                    winner.position,
                    winner.slot,
                    new_slot,
                )
                .await?
                {
                    return Ok(MutationOutcome::Applied);
                }
            }
            (Mutation::Upsert | Mutation::Insert, None) => {
                let Some((empty, _)) = slots.iter().find(|(_, slot)| slot.is_empty()) else {
                    return Err(Error::TableFull {
                        reason: format!(
                            "all {} candidate slots of this key are taken; the index has {} buckets: raise index_size",
                            slots.len(),
                            connection.welcome.geometry.bucket_count
                        ),
                    });
                };
                if compare_and_swap_slot(&mut scratch, operation, *empty, Slot::EMPTY, new_slot)
                    .await?
                {
                    return resolve_duplicates(
                        &mut scratch,
                        operation,
                        key,
                        &location,
                        *empty,
                        new_slot,
                        mutation,
                    )
                    .await;
                }
            }
        }
        back_off(attempt).await;
    }
    Err(Error::Contention {
        operation,
        attempts: RACE_ATTEMPTS,
    })
}

/// After an insert's CAS: re-read; if another slot holds the key at a lower position, that slot
/// wins. A losing insert removes its slot and reports the key present; a losing upsert writes its
/// block into the winner and then removes its own slot.
async fn resolve_duplicates(
    scratch: &mut Scratch,
    operation: &'static str,
    key: &[u8],
    location: &KeyLocation,
    mine: SlotPosition,
    new_slot: Slot,
    mutation: Mutation<'_>,
) -> Result<MutationOutcome> {
    for attempt in 0..RACE_ATTEMPTS {
        scratch
            .execute(
                operation,
                StepKind::ReadBuckets,
                bucket_reads(scratch, location),
            )
            .await
            .map_err(read_failure(operation))?;
        let slots = read_slots(scratch, location)?;
        let matches = match find_matches(scratch, operation, key, location, &slots).await? {
            Ok(matches) => matches,
            Err(ChecksumMismatch) => {
                checksum_retry(scratch.connection());
                continue;
            }
        };
        let Some(winner) = matches.first() else {
            // Deleted by someone else after our insert: our insert happened.
            return Ok(MutationOutcome::Applied);
        };
        if winner.position == mine {
            return Ok(MutationOutcome::Applied);
        }
        match mutation {
            Mutation::Insert => {
                compare_and_swap_slot(scratch, operation, mine, new_slot, Slot::EMPTY).await?;
                return Ok(MutationOutcome::Present);
            }
            _ => {
                if compare_and_swap_slot(scratch, operation, winner.position, winner.slot, new_slot)
                    .await?
                {
                    compare_and_swap_slot(scratch, operation, mine, new_slot, Slot::EMPTY).await?;
                    return Ok(MutationOutcome::Applied);
                }
            }
        }
        back_off(attempt).await;
    }
    Err(Error::Contention {
        operation,
        attempts: RACE_ATTEMPTS,
    })
}

/// DELETE: every slot holding the key goes empty in one list, duplicates first, winner last.
/// `Ok(false)` when the key was absent.
pub(crate) async fn delete(connection: &Arc<NodeConnection>, key: &[u8]) -> Result<bool> {
    check_key_value(key, &[]).map_err(layout_error)?;
    let location = connection.welcome.geometry.locate(key);
    let geometry = connection.welcome.geometry;
    let _turn = connection.writer_turn(&location).await;
    let mut scratch = connection.scratch().await;
    for attempt in 0..RACE_ATTEMPTS {
        scratch
            .execute(
                "delete",
                StepKind::ReadBuckets,
                bucket_reads(&scratch, &location),
            )
            .await
            .map_err(read_failure("delete"))?;
        let slots = read_slots(&scratch, &location)?;
        let matches = match find_matches(&mut scratch, "delete", key, &location, &slots).await? {
            Ok(matches) => matches,
            Err(ChecksumMismatch) => {
                checksum_retry(connection);
                continue;
            }
        };
        if matches.is_empty() {
            return Ok(false);
        }
        let ordered: Vec<&Match> = matches.iter().rev().take(32).collect();
        let list: Vec<WorkRequest> = ordered
            .iter()
            .enumerate()
            .map(|(index, found)| {
                WorkRequest::compare_and_swap(
                    index as u64,
                    scratch
                        .region()
                        .segment(scratch.base + CAS_RESULTS_AT + index as u64 * 8, 8),
                    connection
                        .keys
                        .index_key
                        .at(geometry.slot_offset(found.position)),
                    found.slot.0,
                    0,
                )
                .with_signaled(index + 1 == ordered.len())
            })
            .collect();
        let winner_index = ordered.len() as u64 - 1;
        scratch
            .execute("delete", StepKind::Remove, list)
            .await
            .map_err(cas_failure("delete"))?;
        let original = scratch
            .region()
            .load_u64(scratch.base + CAS_RESULTS_AT + winner_index * 8)?;
        if original == matches[0].slot.0 {
            return Ok(true);
        }
        connection
            .counters
            .cas_failures
            .fetch_add(1, Ordering::Relaxed);
        back_off(attempt).await;
    }
    Err(Error::Contention {
        operation: "delete",
        attempts: RACE_ATTEMPTS,
    })
}
