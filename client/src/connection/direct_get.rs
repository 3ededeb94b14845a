//! A GET by direct access to the node's memory (`rdkv_fabric::DirectAccess`), where the
//! fabric shares it (`shm`): the lean path of `docs/protocol.md`, *Direct GETs*. The same
//! steps as a narrow guess ([`crate::operations`]), as calls instead of a list: announce the
//! operation, READ the guessed slot's word, READ the block it names, READ the word again, READ
//! the node's lease word, announce the finish. No scratch buffer, no list, no completion, no
//! wake-up, and no allocation but the value's (none
//! into a caller's vector with the room: `Client::get_into`).
//!
//! Where a narrow guess verifies the block with its checksum, this path verifies it by the slot
//! word read before and after the block: a READ of an aligned word here is one atomic load,
//! which cannot tear, and a block is written whole before the CAS that publishes it, so a
//! block named by the same committed word before and after the copy was whole and unchanged
//! throughout (the announce keeps it from reuse). A NIC can tear a READ, so `soft` and `verbs`
//! keep the checksum.

use std::time::{Duration, Instant};

use rdkv_common::layout::{BlockHeader, KeyLocation, Slot, BLOCK_HEADER_SIZE, MAX_KEY_LENGTH};
use rdkv_fabric::{lock, DirectAccess, WorkCompletionStatus};

use super::announce::{QUIESCENT_OFFSET, STARTED_OFFSET};
use super::slot_cache::Guess;
use super::NodeConnection;

/// Keys up to this long have their block's head read into a buffer on the stack that costs no
/// `memset` to zero.
const SHORT_KEY_LENGTH: usize = 40;

/// What the guessed slot held.
enum Found {
    /// The key's block, whole, named by `slot` before and after it was read (its value is in
    /// the caller's vector).
    Key {
        /// The slot word that named it.
        slot: Slot,
        /// Whether the block is a tombstone (a replicated delete: the key is absent).
        tombstone: bool,
    },
    /// Not the key's block any more (or the slot moved while it was read): the ordinary
    /// lookup reads the buckets.
    Stale,
}

/// Whether a direct GET's read stands ([`NodeConnection::direct_read_stands`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReadStands {
    /// It does.
    Yes,
    /// It took the node's operation deadline or longer: read again the ordinary way.
    PastDeadline,
    /// The node's lease did not cover it: perhaps stale.
    LeaseLapsed,
}

impl NodeConnection {
    /// GETs `key` by direct access when the connection can and the slot cache has a guess for
    /// it: `Some(true)` with the value in `value` (which it empties first), `Some(false)` when
    /// the key is absent. `None`: not here (no guess, a stale one, a provider without direct
    /// access, the queue pair busy, a failed access, or the node's lease not covering the
    /// READs), with `value` empty; the caller runs the ordinary GET, which decides what such a
    /// failure means. A failed access or an uncovered lease marks the connection broken first,
    /// as the ordinary path would.
    pub(crate) fn get_direct(
        &self,
        key: &[u8],
        location: &KeyLocation,
        value: &mut Vec<u8>,
    ) -> Option<bool> {
        let found = self.get_direct_found(key, location, value);
        if found.is_none() {
            value.clear();
        }
        found
    }

    /// [`NodeConnection::get_direct`], leaving `value` as the attempt left it.
    fn get_direct_found(
        &self,
        key: &[u8],
        location: &KeyLocation,
        value: &mut Vec<u8>,
    ) -> Option<bool> {
        value.clear();
        if self.fault_injector.is_some() {
            return None;
        }
        let guess = self.guess(location)?;
        let posted_at = Instant::now();
        let outcome = self.queue_pair.direct_at(posted_at, |access| {
            self.direct_lookup(access, key, location, guess, value)
        })?;
        let (found, lease_word) = match outcome {
            Ok(read) => read,
            Err(_status) => {
                self.mark_broken();
                return None;
            }
        };
        match self.direct_read_stands(lease_word, posted_at, Instant::now()) {
            ReadStands::Yes => {}
            ReadStands::PastDeadline => return None,
            ReadStands::LeaseLapsed => {
                // Read while the node did not serve under its lease: perhaps stale.
                self.mark_broken();
                self.counters.lease_refusals.add(1);
                return None;
            }
        }
        let counters = &self.counters;
        let Found::Key { slot, tombstone } = found else {
            counters.slot_guesses.add(1);
            counters.slot_guess_misses.add(1);
            self.slot_cache.forget(location);
            return None;
        };
        if slot != guess.slot {
            self.slot_cache.remember(location, guess.position, slot);
        }
        // Also a GET, a guess, a round trip and its accesses (`Counters::snapshot`).
        counters.direct_gets.add(1);
        // A tombstone (replicated delete) is an absent key.
        Some(!tombstone)
    }

    /// Whether what a direct GET read from `posted_at` to `completed` stands. Not when it took
    /// the node's operation deadline or longer (the thread was stopped or preempted in the
    /// middle): the node reuses heap space after a quarantine of 1.25 times that deadline
    /// whatever the announce word says, and a slot word may repeat on a reused block, so the
    /// words read before and after no longer prove the block whole; the ordinary GET, whose
    /// deadline is capped by the node's, reads again. Not when the node's lease word does not
    /// cover the whole read (*Readers enforce the lease*).
    pub(super) fn direct_read_stands(
        &self,
        lease_word: u64,
        posted_at: Instant,
        completed: Instant,
    ) -> ReadStands {
        let deadline = Duration::from_millis(self.welcome.operation_deadline_ms);
        if self.welcome.operation_deadline_ms == 0
            || posted_at
                .checked_add(deadline)
                .is_none_or(|late| completed >= late)
        {
            return ReadStands::PastDeadline;
        }
        if lock(&self.lease_clock).covers_remembered(lease_word, posted_at, completed) {
            ReadStands::Yes
        } else {
            ReadStands::LeaseLapsed
        }
    }

    /// The accesses of a direct GET, announced from first to last: what the guessed slot
    /// held, and the node's lease word read after it.
    fn direct_lookup(
        &self,
        access: &mut dyn DirectAccess,
        key: &[u8],
        location: &KeyLocation,
        guess: Guess,
        value: &mut Vec<u8>,
    ) -> Result<(Found, u64), WorkCompletionStatus> {
        let announce = &self.keys.announce_key;
        let (number, started) = self.announcer.start_direct();
        let read = access
            .write_u64(announce.at(STARTED_OFFSET), started)
            .and_then(|()| {
                let found = self.read_guessed(access, key, location, guess, value)?;
                let lease = access.read_u64(self.keys.lease_key.at(0))?;
                Ok((found, lease))
            });
        let quiescent = self.announcer.finish_direct(number);
        if read.is_ok() {
            // Not needed for what was read: it lets the node reclaim sooner, and shows the
            // connection idle. (After a failed access nothing more runs: the queue pair is in
            // ERROR, and the connection is retired.)
            access.write_u64(announce.at(QUIESCENT_OFFSET), quiescent)?;
        }
        read
    }

    /// READs the guessed slot's word and, when it still names a block of the key (the guessed
    /// one, or the key's new block after an update in place), that block (its value onto
    /// `value`), then the word again.
    fn read_guessed(
        &self,
        access: &mut dyn DirectAccess,
        key: &[u8],
        location: &KeyLocation,
        guess: Guess,
        value: &mut Vec<u8>,
    ) -> Result<Found, WorkCompletionStatus> {
        let geometry = &self.welcome.geometry;
        let slot_at = self.keys.index_key.at(geometry.slot_offset(guess.position));
        let slot = Slot(access.read_u64(slot_at)?);
        let Some(target) = (Guess {
            position: guess.position,
            slot,
        })
        .plausible(location, geometry.heap_size) else {
            return Ok(Found::Stale);
        };
        let length = target.slot.block_length() as usize;
        let head_length = BLOCK_HEADER_SIZE + key.len();
        if length < head_length || key.len() > MAX_KEY_LENGTH {
            return Ok(Found::Stale);
        }
        let block_at = target.slot.offset();
        // A short key's head in a small buffer (zeroing the longest key's cost a `memset` per
        // GET).
        let mut short_head = [0u8; BLOCK_HEADER_SIZE + SHORT_KEY_LENGTH];
        let mut long_head;
        let head: &mut [u8] = if head_length <= short_head.len() {
            &mut short_head[..head_length]
        } else {
            long_head = [0u8; BLOCK_HEADER_SIZE + MAX_KEY_LENGTH];
            &mut long_head[..head_length]
        };
        access.read(self.keys.heap_key.at(block_at), head)?;
        let mut header_bytes = [0u8; BLOCK_HEADER_SIZE];
        header_bytes.copy_from_slice(&head[..BLOCK_HEADER_SIZE]);
        let Ok(header) = BlockHeader::parse(&header_bytes, length) else {
            return Ok(Found::Stale);
        };
        if header.key_length != key.len() || head[header.key_offset()..head_length] != *key {
            return Ok(Found::Stale);
        }
        access.read_append(
            self.keys
                .heap_key
                .at(block_at + header.value_offset() as u64),
            header.value_length,
            value,
        )?;
        if Slot(access.read_u64(slot_at)?) != target.slot {
            return Ok(Found::Stale);
        }
        // The node still served this connection after the copy (it may have given up waiting
        // for a thread stopped here, and reused the block).
        access.confirm()?;
        Ok(Found::Key {
            slot: target.slot,
            tombstone: header.tombstone,
        })
    }
}

/// Attack (branch `attack` only): a direct GET whose thread stalls in the middle of the value
/// copy (preempted, stopped with SIGSTOP / Ctrl-Z, paging) for longer than the node's
/// quarantine (1.25 × the operation deadline, `docs/protocol.md`, *An extent's way back*).
/// The node then reuses the block's extent although the GET's announce says it runs, and a
/// direct GET has no deadline and no checksum: when the key's slot comes back to the same word
/// (the key rewritten at the same offset with the same length: a small, busy heap), the GET
/// returns half of the old value and half of the new one.
///
/// The stall is modelled by a wrapper around the real `DirectAccess` that splits the value's
/// READ in two and waits between the halves: exactly what a preemption inside
/// `PinnedMemory::read_append`'s copy loop does.
#[cfg(test)]
mod stall_attack {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use rdkv_common::layout::Slot;
    use rdkv_fabric::{lock, Backend, DirectAccess, RemoteSegment, WorkCompletionStatus};

    use super::Found;
    use crate::{Client, ClientConfig, SharedMemory};

    const SECRET: &[u8] = b"direct-get-stall-attack";
    const KEY: &[u8] = b"k";
    /// Two blocks per 16 KiB chunk.
    const LENGTH: usize = 8000;

    /// Splits the value READ (`read_append`) in two and runs `stall` between the halves.
    struct Stalling<'a, F: FnOnce()> {
        inner: &'a mut dyn DirectAccess,
        stall: Option<F>,
    }

    impl<F: FnOnce()> DirectAccess for Stalling<'_, F> {
        fn read(
            &mut self,
            remote: RemoteSegment,
            into: &mut [u8],
        ) -> Result<(), WorkCompletionStatus> {
            self.inner.read(remote, into)
        }

        fn read_append(
            &mut self,
            remote: RemoteSegment,
            length: usize,
            into: &mut Vec<u8>,
        ) -> Result<(), WorkCompletionStatus> {
            let half = (length / 2) & !7;
            self.inner.read_append(remote, half, into)?;
            if let Some(stall) = self.stall.take() {
                stall();
            }
            self.inner.read_append(
                RemoteSegment {
                    address: remote.address + half as u64,
                    remote_key: remote.remote_key,
                },
                length - half,
                into,
            )
        }

        fn confirm(&mut self) -> Result<(), WorkCompletionStatus> {
            self.inner.confirm()
        }

        fn write(
            &mut self,
            remote: RemoteSegment,
            from: &[u8],
        ) -> Result<(), WorkCompletionStatus> {
            self.inner.write(remote, from)
        }

        fn compare_and_swap(
            &mut self,
            remote: RemoteSegment,
            expected: u64,
            new: u64,
        ) -> Result<u64, WorkCompletionStatus> {
            self.inner.compare_and_swap(remote, expected, new)
        }
    }

    fn shm_socket_path() -> std::path::PathBuf {
        std::env::temp_dir().join(format!("rdkv-direct-stall-{}.sock", std::process::id()))
    }

    async fn client(address: std::net::SocketAddr, entries: usize) -> Client {
        let mut config = ClientConfig::new(address, Backend::Soft, SECRET);
        config.node.shared_memory = SharedMemory::Require;
        config.slot_cache_entries = entries;
        Client::connect(config).await.expect("connect")
    }

    /// A direct GET stalled mid-copy (its thread preempted or stopped) while the key is
    /// rewritten until its slot holds the same word again (a small heap): the words read
    /// before and after the block match, and the lease still covers it, but its value is
    /// torn. Found by attacking the direct path; such a read now does not stand.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_direct_get_stalled_past_the_quarantine_does_not_stand() {
        let mut config = rdkv_server::ServerConfig::local(SECRET);
        config.fabric = Backend::Soft;
        config.shm_socket = Some(shm_socket_path());
        config.chunk_size = 16 * 1024;
        config.heap_size = 8 * 16 * 1024;
        config.collector_interval = Duration::from_millis(5);
        config.operation_deadline = Duration::from_millis(200);
        let server = rdkv_server::start(config).await.expect("start");
        // A node older than the lease check's drift margin over the stall (a node that just
        // started has `since` = 0 within that margin of the post, and the check refuses).
        tokio::time::sleep(Duration::from_secs(2)).await;
        let address = server.control_address();
        let reader = client(address, 5001).await;
        let writer = Arc::new(client(address, 5002).await);

        writer
            .put(KEY, &vec![b'a'; LENGTH])
            .await
            .expect("first put");
        assert_eq!(
            reader.get(KEY).await.expect("warm get").map(|v| v.to_vec()),
            Some(vec![b'a'; LENGTH])
        );
        let node = reader.node_for(KEY).clone();
        let connection = node.connection().await.expect("reader connection");
        let location = connection.welcome.geometry.locate(KEY);
        let guess = connection.guess(&location).expect("a warm guess");
        let slot_offset = connection.welcome.geometry.slot_offset(guess.position);

        // The writer: updates the key with a new byte each time until the slot holds the
        // guessed word again (the block rewritten at the same offset), bounded.
        let puts = Arc::new(AtomicUsize::new(0));
        let aba = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writing = {
            let (writer, puts, aba) = (writer.clone(), puts.clone(), aba.clone());
            let original = guess.slot;
            async move {
                let node = writer.node_for(KEY).clone();
                let started = Instant::now();
                for round in 1..=400u32 {
                    if started.elapsed() > Duration::from_secs(150) {
                        break;
                    }
                    let byte = b'b' + (round % 20) as u8;
                    if writer.put(KEY, &vec![byte; LENGTH]).await.is_err() {
                        continue;
                    }
                    puts.fetch_add(1, Ordering::Relaxed);
                    let Ok(connection) = node.connection().await else {
                        continue;
                    };
                    let mut word = None;
                    for _ in 0..1000 {
                        word = connection.queue_pair.direct(|access| {
                            let mut bytes = [0u8; 8];
                            access
                                .read(connection.keys.index_key.at(slot_offset), &mut bytes)
                                .map(|()| Slot::from_bytes(bytes))
                        });
                        if word.is_some() {
                            break;
                        }
                        tokio::task::yield_now().await;
                    }
                    if word == Some(Ok(original)) {
                        aba.store(true, Ordering::Release);
                        return;
                    }
                }
            }
        };
        let handle = tokio::runtime::Handle::current();

        let posted_at = Instant::now();
        let mut value = Vec::new();
        let outcome = connection
            .queue_pair
            .direct(|access| {
                let stall = || {
                    // This worker is held here, as a preempted thread would be; the other
                    // worker runs the writer.
                    let done = handle.spawn(writing);
                    let deadline = Instant::now() + Duration::from_secs(160);
                    while !done.is_finished() && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                };
                let mut stalling = Stalling {
                    inner: access,
                    stall: Some(stall),
                };
                connection.direct_lookup(&mut stalling, KEY, &location, guess, &mut value)
            })
            .expect("idle: direct");
        let completed = Instant::now();
        let (found, lease_word) = match outcome {
            Ok(read) => read,
            Err(status) => {
                // The node stopped serving the stalled connection (it held the heap back):
                // the read does not stand either.
                eprintln!("the stalled accesses failed: {status:?}");
                return;
            }
        };
        let stands = connection.direct_read_stands(lease_word, posted_at, completed);
        let covered = lock(&connection.lease_clock).covers(lease_word, posted_at, completed);
        eprintln!(
            "lease word {:?}, clock {:?}, posted {:?} before completion",
            rdkv_common::lease::LeaseWord::decode(lease_word),
            *lock(&connection.lease_clock),
            completed - posted_at
        );
        eprintln!(
            "puts {}, slot word back: {}, lease covers: {covered}, took {:?}",
            puts.load(Ordering::Relaxed),
            aba.load(Ordering::Acquire),
            completed - posted_at
        );
        eprintln!("the read stands: {stands:?}");
        // What `get_direct` would return: only a read that stands.
        if let (Found::Key { .. }, super::ReadStands::Yes) = (&found, stands) {
            let first = value.first().copied();
            assert!(
                value.iter().all(|byte| Some(*byte) == first),
                "a direct GET returned a torn value: {} bytes of {:?} then {:?}",
                value
                    .iter()
                    .take_while(|byte| Some(**byte) == first)
                    .count(),
                first.map(char::from),
                value.last().copied().map(char::from)
            );
        }
        drop(server);
    }
}
