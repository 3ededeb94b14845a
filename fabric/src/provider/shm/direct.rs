//! Direct access over `shm` (`crate::direct`): a requester maps its responder's memory, so a
//! READ is a copy out of that memory and a WRITE a copy into it, on the calling thread. The
//! accesses of one call run in one epoch, holding the queue pair's executor, exactly as a list
//! run inside its post does ([`ShmQueuePair::run_list_inline`]): the same idle check, the same
//! key, rights and bounds checks ([`Attachment::resolve_in`]), and the same failures (the queue
//! pair to ERROR, the responder's stop as `NotExecuted`).

use std::sync::atomic::{fence, Ordering};
use std::time::Instant;

use crate::direct::DirectAccess;
use crate::lock;
use crate::memory::PinnedMemory;
use crate::provider::engine::RemoteRequest;
use crate::queue_pair::QueuePairShared;
use crate::types::{Opcode, RemoteSegment, WorkCompletionStatus};

use super::state::KeyView;
use super::{Attachment, Inside, Mapped, Outcome, ShmQueuePair};

impl ShmQueuePair {
    /// Runs `work` with direct access (`QueuePairProvider::run_direct`): `false` when the queue
    /// pair is not attached, another thread runs its requests, some are queued, it is not RTS,
    /// or the peer is gone (the ordinary path reports that; `now`, the caller's clock read just
    /// before, paces the look at the peer).
    pub(super) fn run_direct_access(
        &self,
        queue_pair: &QueuePairShared,
        now: Instant,
        work: &mut dyn FnMut(&mut dyn DirectAccess),
    ) -> bool {
        let Some(attachment) = self.attachment.get() else {
            return false;
        };
        // Held for every access: a post meanwhile queues behind them, as behind an inline list.
        let Ok(mut executor) = self.executor.try_lock() else {
            return false;
        };
        if !queue_pair.idle_and_sendable() || !lock(&self.pending).is_empty() {
            return false;
        }
        let looked_lately = executor.next_peer_check.is_some_and(|next| now < next)
            && !attachment.peer_gone.load(Ordering::Acquire);
        if !looked_lately {
            if !attachment.peer_alive_at(now) {
                return false;
            }
            executor.next_peer_check = attachment.next_look_due();
        }
        let inside = attachment.enter();
        if let Ok(inside) = &inside {
            executor.cache.direct.forget_unless(inside.key_generation);
        }
        let mut access = ShmDirect {
            queue_pair,
            attachment,
            inside,
            cache: &mut executor.cache,
            failed: false,
            max_message_size: attachment.remote.keys.max_message_size(),
        };
        work(&mut access);
        true
    }
}

/// The accesses of one direct call: one epoch, the executor's cache of mapped blocks.
struct ShmDirect<'a> {
    /// The requester queue pair.
    queue_pair: &'a QueuePairShared,
    /// Its attachment to the responder.
    attachment: &'a Attachment,
    /// The epoch the accesses run in (left and entered again by a refresh).
    inside: std::result::Result<Inside<'a>, Outcome>,
    /// The executor's mapped blocks.
    cache: &'a mut Mapped,
    /// An access failed: every later one flushes, as the rest of a list would.
    failed: bool,
    /// The responder's largest READ or WRITE.
    max_message_size: u32,
}

/// Keys direct access keeps resolved between calls (a GET uses four: the index, the heap, the
/// announce word and the lease word; an update a fifth, its heap chunk's); a seventh takes
/// the place of one of them.
const DIRECT_KEYS: usize = 6;

/// A key direct access resolved: what it grants, the block it lies in, and the checks of its
/// rights that do not depend on the address ([`crate::protection::KeyRights::permits`]), made once for a READ
/// and a WRITE by this queue pair in the protection domain they were made for.
#[derive(Debug, Clone, Copy)]
struct DirectKey {
    /// The key.
    key: u32,
    /// What it grants.
    view: KeyView,
    /// Its block: the index in the executor's cache of mapped blocks.
    block: usize,
    /// The responder queue pair's protection domain `read` and `write` were found for.
    protection_domain: u32,
    /// [`crate::protection::KeyRights::permits`] for a READ.
    read: Result<(), WorkCompletionStatus>,
    /// [`crate::protection::KeyRights::permits`] for a WRITE.
    write: Result<(), WorkCompletionStatus>,
}

impl DirectKey {
    /// Checks an access of `opcode` by queue pair `responder_qp` in `protection_domain` as
    /// [`crate::protection::KeyRights::check`] would, and returns its block and its offset in it.
    fn check(
        &self,
        protection_domain: u32,
        responder_qp: u32,
        opcode: Opcode,
        remote: RemoteSegment,
        length: u32,
    ) -> Result<(usize, u64), WorkCompletionStatus> {
        let rights = &self.view.rights;
        let permits = match opcode {
            Opcode::Read if self.protection_domain == protection_domain => self.read,
            Opcode::Write if self.protection_domain == protection_domain => self.write,
            _ => rights.permits(protection_domain, responder_qp, opcode),
        };
        permits?;
        rights.check_range(remote.address, u64::from(length), opcode)?;
        match remote.address.checked_sub(self.view.memory_base) {
            Some(offset) => Ok((self.block, offset)),
            None => Err(WorkCompletionStatus::RemoteOperationError),
        }
    }
}

/// The keys direct access resolved, with the block each lies in, valid while the responder's
/// key generation stays the one they were resolved under (no key was revoked since: a
/// revocation changes it before it waits for the requesters' epochs, `state.rs`).
#[derive(Debug, Default)]
pub(super) struct DirectKeys {
    /// The key generation they were resolved under.
    generation: u64,
    /// The keys.
    keys: [Option<DirectKey>; DIRECT_KEYS],
}

impl DirectKeys {
    /// Forgets every key unless `generation` is the one they were resolved under.
    fn forget_unless(&mut self, generation: u64) {
        if self.generation != generation {
            self.keys = [None; DIRECT_KEYS];
            self.generation = generation;
        }
    }

    /// The key `key`, if resolved.
    fn known(&self, key: u32) -> Option<&DirectKey> {
        self.keys
            .iter()
            .find_map(|known| known.as_ref().filter(|known| known.key == key))
    }

    /// Where the key `key` is kept, if resolved.
    fn place(&self, key: u32) -> Option<usize> {
        self.keys
            .iter()
            .position(|known| known.as_ref().is_some_and(|known| known.key == key))
    }

    /// Remembers `known`, resolved under `generation`.
    fn remember(&mut self, generation: u64, known: DirectKey) {
        self.forget_unless(generation);
        let place = self
            .keys
            .iter()
            .position(Option::is_none)
            .unwrap_or(known.key as usize % DIRECT_KEYS);
        self.keys[place] = Some(known);
    }
}

impl ShmDirect<'_> {
    /// Checks one access as its request would be checked, and returns its memory and offset
    /// (`None` for a zero-length access). A key's first access resolves it
    /// ([`Attachment::resolve_in`]); later ones, in this call or a later one under the same key
    /// generation ([`DirectKeys`]), check their range and rights against what it resolved. A
    /// failure has the effect of that request's failed completion: the queue pair moves to
    /// ERROR (or learns the responder stopped), and it is counted on the completion queue.
    /// Inlined into each access, with the rare cases out of line.
    #[inline(always)]
    fn resolve(
        &mut self,
        opcode: Opcode,
        remote: RemoteSegment,
        length: usize,
    ) -> Result<Option<(&PinnedMemory, u64)>, WorkCompletionStatus> {
        if let Some((block, offset)) = self.resolve_known(opcode, remote, length) {
            return Ok(Some((&self.cache.blocks[block].1, offset)));
        }
        self.resolve_checked(opcode, remote, length)
    }

    /// The common case of [`ShmDirect::resolve`], in a few comparisons: a READ or WRITE
    /// by a key resolved under the responder's current key generation, in this epoch's
    /// protection domain, within its range and the largest message. `None` for anything else
    /// (an atomic, a failure before, a zero length, a key not resolved yet or revoked since,
    /// a check that fails), which [`ShmDirect::resolve_checked`] then decides: this accepts
    /// only what it accepts, with the same block and offset.
    #[inline(always)]
    fn resolve_known(
        &self,
        opcode: Opcode,
        remote: RemoteSegment,
        length: usize,
    ) -> Option<(usize, u64)> {
        let Ok(inside) = &self.inside else {
            return None;
        };
        if self.failed
            || length == 0
            || length > self.max_message_size as usize
            || self.attachment.remote.keys.key_generation() != inside.key_generation
            || self.cache.direct.generation != inside.key_generation
        {
            return None;
        }
        let known = self.cache.direct.known(remote.remote_key)?;
        let permitted = match opcode {
            Opcode::Read => known.read.is_ok(),
            Opcode::Write => known.write.is_ok(),
            _ => false,
        };
        if !permitted || known.protection_domain != inside.protection_domain {
            return None;
        }
        let rights = &known.view.rights;
        let end = remote.address.checked_add(length as u64)?;
        if remote.address < rights.address || end > rights.address.checked_add(rights.length)? {
            return None;
        }
        let offset = remote.address.checked_sub(known.view.memory_base)?;
        (known.block < self.cache.blocks.len()).then_some((known.block, offset))
    }

    /// [`ShmDirect::resolve`] with every check and its failure.
    #[cold]
    #[inline(never)]
    fn resolve_checked(
        &mut self,
        opcode: Opcode,
        remote: RemoteSegment,
        length: usize,
    ) -> Result<Option<(&PinnedMemory, u64)>, WorkCompletionStatus> {
        if self.failed {
            // After a failure nothing more runs.
            return Err(self.fail(WorkCompletionStatus::WorkRequestFlushError));
        }
        let Ok(length) = u32::try_from(length) else {
            return Err(self.fail(WorkCompletionStatus::LocalLengthError));
        };
        if length == 0 {
            return Ok(None);
        }
        self.follow_revocations();
        let (block, offset) = match self.cache.direct.place(remote.remote_key) {
            Some(place) => self.check_known(opcode, remote, length, place)?,
            None => self.resolve_first(opcode, remote, length)?,
        };
        Ok(Some((&self.cache.blocks[block].1, offset)))
    }

    /// Reads the responder's key generation again, before each access: a key revoked while
    /// this call is inside its epoch (a thread stalled here past the revoker's wait, which
    /// gives up after `retry_timeout`) is forgotten, and looked up again, at the next access.
    fn follow_revocations(&mut self) {
        let Ok(inside) = &mut self.inside else {
            return;
        };
        let generation = self.attachment.remote.keys.key_generation();
        if generation != inside.key_generation {
            inside.key_generation = generation;
            self.cache.direct.forget_unless(generation);
        }
    }

    /// The failure of an access that meets `outcome` instead of the responder's memory: a
    /// stopped responder ran neither it nor any later one (`NotExecuted`); one that does not
    /// answer is `RetryExceededError`.
    fn unreachable(&mut self, outcome: Outcome) -> WorkCompletionStatus {
        match outcome {
            Outcome::Answered(status) | Outcome::Placed(status) => self.fail(status),
            // Requests run in order: this one and every later one did not run.
            Outcome::Stopped => {
                self.queue_pair.responder_stopped();
                self.fail(WorkCompletionStatus::NotExecuted)
            }
            Outcome::Unanswered | Outcome::Unmapped => {
                self.fail(WorkCompletionStatus::RetryExceededError)
            }
        }
    }

    /// Checks an access by a key resolved already under this generation: length, rights and
    /// range, as [`Attachment::resolve_inside`] checks them (the rights that do not depend on
    /// the address as found when the key was resolved, while the protection domain is the
    /// same).
    fn check_known(
        &mut self,
        opcode: Opcode,
        remote: RemoteSegment,
        length: u32,
        place: usize,
    ) -> Result<(usize, u64), WorkCompletionStatus> {
        let protection_domain = match &self.inside {
            Ok(inside) => inside.protection_domain,
            Err(outcome) => {
                let outcome = *outcome;
                return Err(self.unreachable(outcome));
            }
        };
        if length > self.max_message_size {
            return Err(self.fail(WorkCompletionStatus::RemoteInvalidRequestError));
        }
        let responder_qp = self.attachment.responder_qp;
        let checked = match &self.cache.direct.keys[place] {
            Some(known) => known.check(protection_domain, responder_qp, opcode, remote, length),
            // `place` holds a key (`DirectKeys::place`): not reached.
            None => Err(WorkCompletionStatus::RemoteOperationError),
        };
        checked.map_err(|status| self.fail(status))
    }

    /// Resolves a key at its first access, and remembers it for the later ones.
    fn resolve_first(
        &mut self,
        opcode: Opcode,
        remote: RemoteSegment,
        length: u32,
    ) -> Result<(usize, u64), WorkCompletionStatus> {
        let request = RemoteRequest {
            opcode,
            remote_key: remote.remote_key,
            remote_address: remote.address,
            length,
            compare: 0,
            swap_or_add: 0,
        };
        let own_qp = self.queue_pair.qp_number;
        match self
            .attachment
            .resolve_in(&mut self.inside, own_qp, self.cache, &request)
        {
            Ok(Some(resolved)) => {
                // Under the generation of the epoch it was resolved in (a refresh enters a
                // new one).
                if let Ok(inside) = &self.inside {
                    let rights = &resolved.view.rights;
                    let (protection_domain, responder_qp) =
                        (inside.protection_domain, self.attachment.responder_qp);
                    let known = DirectKey {
                        key: remote.remote_key,
                        view: resolved.view,
                        block: resolved.block,
                        protection_domain,
                        read: rights.permits(protection_domain, responder_qp, Opcode::Read),
                        write: rights.permits(protection_domain, responder_qp, Opcode::Write),
                    };
                    self.cache.direct.remember(inside.key_generation, known);
                }
                Ok((resolved.block, resolved.offset))
            }
            // Not zero-length (checked by the caller): not reached.
            Ok(None) => Err(self.fail(WorkCompletionStatus::RemoteInvalidRequestError)),
            Err(outcome) => Err(self.unreachable(outcome)),
        }
    }

    /// Records a failed access with `status`: the queue pair enters ERROR (unless the
    /// responder stopped, `NotExecuted`, or it is in ERROR already) and the failure's
    /// completion is counted.
    fn fail(&mut self, status: WorkCompletionStatus) -> WorkCompletionStatus {
        if !self.failed {
            self.failed = true;
            if status != WorkCompletionStatus::NotExecuted
                && status != WorkCompletionStatus::WorkRequestFlushError
            {
                self.queue_pair.enter_error();
            }
        }
        self.queue_pair.count_inline_failure(1);
        status
    }

    /// A memory copy that failed on a range the checks let through: the responder's error.
    fn copied(&mut self, outcome: crate::error::Result<()>) -> Result<(), WorkCompletionStatus> {
        outcome.map_err(|_| self.fail(WorkCompletionStatus::RemoteOperationError))
    }
}

impl DirectAccess for ShmDirect<'_> {
    fn read(&mut self, remote: RemoteSegment, into: &mut [u8]) -> Result<(), WorkCompletionStatus> {
        let outcome = match self.resolve(Opcode::Read, remote, into.len())? {
            Some((memory, offset)) => memory.read_into(offset, into),
            None => Ok(()),
        };
        self.copied(outcome)
    }

    fn read_u64(&mut self, remote: RemoteSegment) -> Result<u64, WorkCompletionStatus> {
        let outcome = match self.resolve(Opcode::Read, remote, 8)? {
            Some((memory, offset)) if offset % 8 == 0 => memory.load_u64(offset),
            Some((memory, offset)) => {
                let mut bytes = [0u8; 8];
                memory
                    .read_into(offset, &mut bytes)
                    .map(|()| u64::from_le_bytes(bytes))
            }
            // Eight bytes are not zero: not reached.
            None => Ok(0),
        };
        outcome.map_err(|_| self.fail(WorkCompletionStatus::RemoteOperationError))
    }

    fn read_append(
        &mut self,
        remote: RemoteSegment,
        length: usize,
        into: &mut Vec<u8>,
    ) -> Result<(), WorkCompletionStatus> {
        let outcome = match self.resolve(Opcode::Read, remote, length)? {
            Some((memory, offset)) => memory.read_append(offset, length, into),
            None => Ok(()),
        };
        self.copied(outcome)
    }

    fn confirm(&mut self) -> Result<(), WorkCompletionStatus> {
        if self.failed {
            return Err(self.fail(WorkCompletionStatus::WorkRequestFlushError));
        }
        if self.attachment.still_receiving() {
            return Ok(());
        }
        self.queue_pair.responder_stopped();
        Err(self.fail(WorkCompletionStatus::NotExecuted))
    }

    fn write(&mut self, remote: RemoteSegment, from: &[u8]) -> Result<(), WorkCompletionStatus> {
        let outcome = match self.resolve(Opcode::Write, remote, from.len())? {
            Some((memory, offset)) => memory.write_from(offset, from),
            None => Ok(()),
        };
        // Accesses run in order, as a queue pair's requests do: the stores land before any
        // later load of the call (a store may otherwise wait in this core's store buffer past
        // a later load of another word: an announce would land after the slot READ it must
        // precede).
        fence(Ordering::SeqCst);
        self.copied(outcome)
    }

    fn write_u64(&mut self, remote: RemoteSegment, value: u64) -> Result<(), WorkCompletionStatus> {
        let outcome = match self.resolve(Opcode::Write, remote, 8)? {
            Some((memory, offset)) if offset % 8 == 0 => memory.store_u64(offset, value.to_le()),
            Some((memory, offset)) => memory.write_from(offset, &value.to_le_bytes()),
            // Eight bytes are not zero: not reached.
            None => Ok(()),
        };
        // As `write`: the store lands before any later load of the call.
        fence(Ordering::SeqCst);
        self.copied(outcome)
    }

    fn write_gathered(
        &mut self,
        remote: RemoteSegment,
        parts: &[&[u8]],
    ) -> Result<(), WorkCompletionStatus> {
        let length: usize = parts.iter().map(|part| part.len()).sum();
        let outcome = match self.resolve(Opcode::Write, remote, length)? {
            Some((memory, offset)) => {
                let mut at = offset;
                parts.iter().try_for_each(|part| {
                    let written = memory.write_from(at, part);
                    at += part.len() as u64;
                    written
                })
            }
            None => Ok(()),
        };
        // As `write`: the stores land before any later load of the call.
        fence(Ordering::SeqCst);
        self.copied(outcome)
    }

    fn compare_and_swap(
        &mut self,
        remote: RemoteSegment,
        expected: u64,
        new: u64,
    ) -> Result<u64, WorkCompletionStatus> {
        let attachment = self.attachment;
        // `None`: the responder stopped serving the queue pair before the atomic (as
        // `Attachment::execute_in` looks before a list's atomic).
        let outcome = match self.resolve(Opcode::CompareAndSwap, remote, 8)? {
            Some((memory, offset)) => attachment
                .still_receiving()
                .then(|| memory.compare_exchange_u64(offset, expected, new).ok()),
            // Eight bytes are not zero: not reached.
            None => Some(None),
        };
        match outcome {
            Some(Some(original)) => Ok(original),
            Some(None) => Err(self.fail(WorkCompletionStatus::RemoteOperationError)),
            None => {
                self.queue_pair.responder_stopped();
                Err(self.fail(WorkCompletionStatus::NotExecuted))
            }
        }
    }
}
