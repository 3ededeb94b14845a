//! An update by direct access to the node's memory (`rdkv_fabric::DirectAccess`), where the
//! fabric shares it (`shm`): the lean path of a single-copy write of a key the slot cache
//! holds (`docs/protocol.md`, *Direct updates*). The steps of a narrow replace
//! ([`crate::operations::mutate`]) as calls instead of lists, all inside one direct call
//! (holding the queue pair's executor): reserve the new block's place and number the operation,
//! announce it, WRITE the new block into the connection's heap chunk, READ the guessed slot's
//! word and the head (header and key) of the block it names, READ the node's lease word and
//! stop unless it and the clock still cover the call, CAS the slot from that word to the new
//! block's, READ the lease word again, announce the finish. No scratch buffer, no list, no
//! completion, no wake-up, no allocation, and one copy of the value (into the node's heap).
//!
//! It does not read the old block's value or check its checksum: a replace needs only that
//! the slot word names a block of this key. Blocks are immutable once published and the
//! announce keeps the old one from reuse, so the key compared in its head stays the key of
//! every block that word can name until the operation ends; the CAS that finds the same word
//! swaps the key's block for the new one, its linearization point (as a list's replace). The
//! new block carries its checksum: readers over `soft` and `verbs`, the node's scans and its
//! snapshots check it.

use std::time::Instant;

use rdkv_common::layout::{KeyLocation, Slot, BLOCK_HEADER_SIZE, BLOCK_UNIT, MAX_KEY_LENGTH};
use rdkv_fabric::{lock, DirectAccess, WorkCompletionStatus};

use super::announce::{Announcer, QUIESCENT_OFFSET, STARTED_OFFSET};
use super::direct_get::ReadStands;
use super::slot_cache::Guess;
use super::{BlockPlace, NodeConnection};
use crate::block::Block;
use crate::error::Error;

/// The accesses of a direct update whose CAS swapped, counted as the requests of its lists
/// would be: the block WRITE, the slot word, the old block's head, the CAS and the lease word
/// (read before and after the CAS).
const DIRECT_UPDATE_ACCESSES: u64 = 6;

/// What a direct update did.
#[derive(Debug)]
pub(crate) enum DirectWrite {
    /// The CAS swapped, and the node's lease covered it: applied.
    Applied,
    /// Not done this way, and nothing published: no guess, a stale one, a lost race, no room
    /// left in the heap chunk, a provider without direct access, the queue pair busy, or a
    /// failed access (the connection is then marked broken). The caller runs the ordinary
    /// write; a block written here is dead, and the node reclaims it.
    NotHere,
    /// The CAS swapped, but the node's lease did not cover it (or its READ failed): the write
    /// may be hidden in memory the cluster no longer reads. It may have applied.
    Unresolved(Error),
}

/// What the accesses found.
enum Swap {
    /// The CAS swapped; then the lease word's READ.
    Swapped(Result<u64, WorkCompletionStatus>),
    /// The guessed slot no longer names a block of the key.
    Stale,
    /// The slot changed between its READ and the CAS.
    Lost,
    /// Before the CAS, the node's lease did not cover the accesses so far: nothing published.
    LeaseLapsed,
    /// Before the CAS, the accesses had taken the node's operation deadline or longer (the
    /// thread was stopped or preempted in the middle): nothing published.
    Late,
}

/// The new block, and where it goes.
struct NewBlock<'a> {
    /// Its parts.
    block: Block<'a>,
    /// Its place in the connection's chunk.
    place: BlockPlace,
    /// The committed slot word that names it.
    slot: Slot,
}

/// What one direct call did.
enum Attempt {
    /// No room left in the connection's heap chunk: nothing ran (the ordinary write asks for
    /// the next chunk).
    NoRoom,
    /// The accesses ran, for the new block's slot word.
    Ran {
        /// What they found.
        swap: Result<Swap, WorkCompletionStatus>,
        /// The committed word of the new block.
        new_slot: Slot,
    },
}

impl NodeConnection {
    /// Replaces `key`'s value with `value` by direct access when the connection can and the
    /// slot cache has a guess for the key ([`DirectWrite`]). It takes this process's writer
    /// turn for the key only when it is free: a writer by lists holding it (between its lists)
    /// is not overtaken, and this write takes the lists, behind it.
    pub(crate) fn update_direct(
        &self,
        operation: &'static str,
        key: &[u8],
        value: &[u8],
        location: &KeyLocation,
    ) -> DirectWrite {
        if self.fault_injector.is_some() || key.len() > MAX_KEY_LENGTH {
            return DirectWrite::NotHere;
        }
        let Some(guess) = self.guess(location) else {
            return DirectWrite::NotHere;
        };
        let Some(_turn) = self.try_writer_turn(location) else {
            return DirectWrite::NotHere;
        };
        let posted_at = Instant::now();
        // Everything inside the call, holding the queue pair's executor: the place and the
        // operation's number are taken there (so the announce words this connection writes
        // only grow: a number taken outside and written later could carry an older `started`
        // than a list's WRITE in between), and a provider without direct access (`soft`,
        // `loopback`) or a busy queue pair costs nothing, not a reserved place.
        let attempt = self.queue_pair.direct_at(posted_at, |access| {
            let block = Block::new(key, value, false, crate::version::next_version(0));
            let shape = block.shape();
            let Some((place, (number, started))) =
                self.reserve_in_chunk(shape.length(), Announcer::start_direct)
            else {
                return Attempt::NoRoom;
            };
            let new = NewBlock {
                block,
                place,
                slot: shape.slot(location.fingerprint, place.heap_offset),
            };
            Attempt::Ran {
                swap: self.direct_replace(
                    access,
                    (number, started),
                    location,
                    guess,
                    &new,
                    posted_at,
                ),
                new_slot: new.slot,
            }
        });
        match attempt {
            Some(Attempt::Ran { swap, new_slot }) => {
                self.after_replace(operation, swap, location, guess, new_slot, posted_at)
            }
            Some(Attempt::NoRoom) | None => DirectWrite::NotHere,
        }
    }

    /// What the accesses' outcome `swap` means, counted.
    fn after_replace(
        &self,
        operation: &'static str,
        swap: Result<Swap, WorkCompletionStatus>,
        location: &KeyLocation,
        guess: Guess,
        new_slot: Slot,
        posted_at: Instant,
    ) -> DirectWrite {
        let counters = &self.counters;
        let lease_word = match swap {
            Ok(Swap::Swapped(lease_word)) => lease_word,
            Ok(Swap::Stale) => {
                counters.slot_guesses.add(1);
                counters.slot_guess_misses.add(1);
                self.slot_cache.forget(location);
                return DirectWrite::NotHere;
            }
            Ok(Swap::Lost) => {
                counters.cas_failures.add(1);
                return DirectWrite::NotHere;
            }
            Ok(Swap::LeaseLapsed) => {
                // As a list the lease refuses: the connection is retired, and the ordinary
                // write asks for the view.
                self.mark_broken();
                counters.lease_refusals.add(1);
                return DirectWrite::NotHere;
            }
            Ok(Swap::Late) => return DirectWrite::NotHere,
            Err(_status) => {
                // Before the CAS, or the CAS itself, which then did not run.
                self.mark_broken();
                return DirectWrite::NotHere;
            }
        };
        counters.slot_guesses.add(1);
        counters.round_trips.add(1);
        counters.verbs.add(DIRECT_UPDATE_ACCESSES);
        self.slot_cache.remember(location, guess.position, new_slot);
        let covered = lease_word.is_ok_and(|lease_word| {
            lock(&self.lease_clock).covers_remembered(lease_word, posted_at, Instant::now())
        });
        if covered {
            counters.direct_updates.add(1);
            return DirectWrite::Applied;
        }
        self.mark_broken();
        counters.lease_refusals.add(1);
        DirectWrite::Unresolved(Error::Unresolved {
            operation,
            source: Box::new(Error::NodeUnreachable {
                address: self.address,
                reason: format!(
                    "{operation}: the node's lease did not cover the update (the node is paused, cut off from the cluster, or not serving), so it may be hidden in memory the cluster no longer reads; asking the cluster for the view"
                ),
            }),
        })
    }

    /// The accesses of a direct update, announced (operation `number`, its `started`) from
    /// first to last: the block's WRITE, then the guessed slot, the lease word and the time
    /// (both must still cover what was done before the CAS publishes anything), the CAS, and
    /// the lease word again.
    fn direct_replace(
        &self,
        access: &mut dyn DirectAccess,
        (number, started): (u64, u64),
        location: &KeyLocation,
        guess: Guess,
        new: &NewBlock<'_>,
        posted_at: Instant,
    ) -> Result<Swap, WorkCompletionStatus> {
        let announce = &self.keys.announce_key;
        let lease_at = self.keys.lease_key.at(0);
        let swap = access
            .write_u64(announce.at(STARTED_OFFSET), started)
            .and_then(|()| {
                write_block(access, new)?;
                let Some(current) =
                    self.read_guessed_head(access, new.block.key(), location, guess)?
                else {
                    return Ok(Swap::Stale);
                };
                let lease_word = access.read_u64(lease_at)?;
                match self.direct_read_stands(lease_word, posted_at, Instant::now()) {
                    ReadStands::Yes => {}
                    ReadStands::PastDeadline => return Ok(Swap::Late),
                    ReadStands::LeaseLapsed => return Ok(Swap::LeaseLapsed),
                }
                let slot_at = self
                    .keys
                    .index_key
                    .at(self.welcome.geometry.slot_offset(guess.position));
                if access.compare_and_swap(slot_at, current.0, new.slot.0)? != current.0 {
                    return Ok(Swap::Lost);
                }
                Ok(Swap::Swapped(access.read_u64(lease_at)))
            });
        let quiescent = self.announcer.finish_direct(number);
        // Not needed for what was done: it lets the node reclaim sooner, and shows the
        // connection idle. A failure leaves the queue pair in ERROR, and the connection is
        // retired.
        if access
            .write_u64(announce.at(QUIESCENT_OFFSET), quiescent)
            .is_err()
        {
            self.mark_broken();
        }
        swap
    }

    /// READs the guessed slot's word and the head of the block it names: the word, when it
    /// is a committed word naming a block of `key` (the guessed one, or the key's newer block
    /// after a write in place).
    fn read_guessed_head(
        &self,
        access: &mut dyn DirectAccess,
        key: &[u8],
        location: &KeyLocation,
        guess: Guess,
    ) -> Result<Option<Slot>, WorkCompletionStatus> {
        let geometry = &self.welcome.geometry;
        let slot =
            Slot(access.read_u64(self.keys.index_key.at(geometry.slot_offset(guess.position)))?);
        let Some(target) = (Guess {
            position: guess.position,
            slot,
        })
        .plausible(location, geometry.heap_size)
        .filter(|target| target.slot.is_committed() && !target.slot.is_tombstone()) else {
            return Ok(None);
        };
        let length = target.slot.block_length() as usize;
        let head_length = BLOCK_HEADER_SIZE + key.len();
        if length < head_length {
            return Ok(None);
        }
        let mut head = [0u8; BLOCK_HEADER_SIZE + MAX_KEY_LENGTH];
        access.read(
            self.keys.heap_key.at(target.slot.offset()),
            &mut head[..head_length],
        )?;
        let mut header_bytes = [0u8; BLOCK_HEADER_SIZE];
        header_bytes.copy_from_slice(&head[..BLOCK_HEADER_SIZE]);
        let Ok(header) = rdkv_common::layout::BlockHeader::parse(&header_bytes, length) else {
            return Ok(None);
        };
        let same_key = header.key_length == key.len()
            && !header.tombstone
            && head[header.key_offset()..head_length] == *key;
        Ok(same_key.then_some(target.slot))
    }
}

/// WRITEs the new block into its place: its head and key, its value from the caller's slice,
/// and zeros up to its units, as one gathered WRITE.
fn write_block(
    access: &mut dyn DirectAccess,
    new: &NewBlock<'_>,
) -> Result<(), WorkCompletionStatus> {
    let key = new.block.key();
    let value = new.block.value();
    let mut head = [0u8; BLOCK_HEADER_SIZE + MAX_KEY_LENGTH];
    head[..BLOCK_HEADER_SIZE].copy_from_slice(&new.block.head_bytes());
    head[BLOCK_HEADER_SIZE..BLOCK_HEADER_SIZE + key.len()].copy_from_slice(key);
    let used = (BLOCK_HEADER_SIZE + key.len() + value.len()) as u64;
    let padding = [0u8; BLOCK_UNIT as usize];
    let pad = new
        .block
        .shape()
        .length()
        .saturating_sub(used)
        .min(BLOCK_UNIT) as usize;
    access.write_gathered(
        new.place.remote.at(new.place.offset_in_chunk),
        &[
            &head[..BLOCK_HEADER_SIZE + key.len()],
            value,
            &padding[..pad],
        ],
    )
}
