//! Direct access to a responder's memory, for a provider whose requester shares it (`shm`):
//! READs and WRITEs as calls that return when they are done, without a work request, a list
//! or a completion. A lean caller (a client's GET) spends a function call per access where a
//! list costs its requests' building, checking and counting.
//!
//! Each access has the semantics of one unsignaled request of a list run inside its post
//! ([`crate::QueuePair::post_inline`]): the same key, rights, bounds and queue pair state
//! checks, in order with the queue pair's other requests (an access runs only while nothing
//! of the queue pair is queued or running, and holds its executor), and a failure moves the
//! queue pair to ERROR as that request's completion would. After a failure every later access
//! of the same [`crate::QueuePair::direct`] call fails `WorkRequestFlushError`, as the rest of
//! a list would flush. A READ of an aligned 8-byte word is one atomic load: it cannot tear
//! against a concurrent CAS (`docs/fabric.md`, *Direct access*).

use crate::types::{RemoteSegment, WorkCompletionStatus};

/// The accesses of one [`crate::QueuePair::direct`] call, in order.
pub trait DirectAccess {
    /// READs `into.len()` bytes at `remote` into `into`.
    ///
    /// # Errors
    /// The status its request would have completed with.
    fn read(&mut self, remote: RemoteSegment, into: &mut [u8]) -> Result<(), WorkCompletionStatus>;

    /// READs the 8 bytes at `remote` as a little-endian word: one atomic load where `remote`
    /// is 8-byte aligned (a slot word, the lease word), so it cannot tear.
    ///
    /// # Errors
    /// The status its request would have completed with.
    fn read_u64(&mut self, remote: RemoteSegment) -> Result<u64, WorkCompletionStatus> {
        let mut bytes = [0u8; 8];
        self.read(remote, &mut bytes)?;
        Ok(u64::from_le_bytes(bytes))
    }

    /// READs `length` bytes at `remote` into a new vector, filled as it is read (never
    /// zeroed first).
    ///
    /// # Errors
    /// The status its request would have completed with.
    fn read_to_vec(
        &mut self,
        remote: RemoteSegment,
        length: usize,
    ) -> Result<Vec<u8>, WorkCompletionStatus> {
        let mut into = Vec::with_capacity(length);
        self.read_append(remote, length, &mut into)?;
        Ok(into)
    }

    /// READs `length` bytes at `remote` onto the end of `into`, filled as they are read (a
    /// vector with the room allocates nothing). Like a NIC's READ, it may see a concurrent
    /// write in part (over `shm`, 64 or 128 bytes go at a time): the caller checks what
    /// it read.
    ///
    /// # Errors
    /// The status its request would have completed with (nothing is appended).
    fn read_append(
        &mut self,
        remote: RemoteSegment,
        length: usize,
        into: &mut Vec<u8>,
    ) -> Result<(), WorkCompletionStatus>;

    /// Confirms the READs of this call so far: whether the responder still served this queue
    /// pair after them. A responder stops serving a queue pair before it releases or reuses
    /// what its requester could read, but waits for a requester inside a call only up to
    /// `retry_timeout`: a thread stopped inside the call may have copied reused memory. A
    /// caller trusts what it read only after this returns `Ok`.
    ///
    /// # Errors
    /// `NotExecuted` (the responder stopped: the READs count as not run), or the status of an
    /// earlier failure of the call (`WorkRequestFlushError`).
    fn confirm(&mut self) -> Result<(), WorkCompletionStatus>;

    /// WRITEs `from` at `remote`.
    ///
    /// # Errors
    /// The status its request would have completed with.
    fn write(&mut self, remote: RemoteSegment, from: &[u8]) -> Result<(), WorkCompletionStatus>;

    /// WRITEs the 8 bytes of `value`, little-endian, at `remote`: one atomic store where
    /// `remote` is 8-byte aligned (an announce word's half), so a READ of it cannot tear.
    ///
    /// # Errors
    /// The status its request would have completed with.
    fn write_u64(&mut self, remote: RemoteSegment, value: u64) -> Result<(), WorkCompletionStatus> {
        self.write(remote, &value.to_le_bytes())
    }

    /// WRITEs the concatenation of `parts` at `remote`: one WRITE request whose payload is
    /// gathered from several buffers, as a work request's scatter-gather list does (a block's
    /// header and key, its value, and its padding, each where it already is).
    ///
    /// # Errors
    /// The status its request would have completed with.
    fn write_gathered(
        &mut self,
        remote: RemoteSegment,
        parts: &[&[u8]],
    ) -> Result<(), WorkCompletionStatus> {
        let mut address = remote.address;
        for part in parts {
            self.write(
                RemoteSegment {
                    address,
                    remote_key: remote.remote_key,
                },
                part,
            )?;
            address += part.len() as u64;
        }
        Ok(())
    }

    /// Compares the 8-byte word at `remote` (aligned) with `expected` and, when they are
    /// equal, swaps in `new`, atomically: the word's original value (it swapped when that is
    /// `expected`). As a CAS request run inside its post, it runs only while the responder
    /// still serves this queue pair, looked at just before the atomic (a requester stopped in
    /// the call and resumed after a fence must not swap a word whose block was reused).
    ///
    /// # Errors
    /// The status its request would have completed with; `NotExecuted` when the responder
    /// stopped serving the queue pair (the word is unchanged).
    fn compare_and_swap(
        &mut self,
        remote: RemoteSegment,
        expected: u64,
        new: u64,
    ) -> Result<u64, WorkCompletionStatus>;
}
