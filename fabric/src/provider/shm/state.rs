//! The shared state of a listening `shm` device: its keys and queue pairs, in a memory file that
//! only the device writes and its peers map read-only, and the in-flight epochs, one per
//! attached requester queue pair, which the requesters write.
//!
//! ```text
//! Key state (64-byte slots of eight little-endian words; read-only for peers)
//!   header   0 magic "RDKVSHM1"  1 key slots  2 queue pair slots  3 open (1) / closed (0)
//!            4 max_message_size  5 device id  6 key generation (incremented by every revocation)
//!   key slot 0 sequence (odd while written)  1 key | status << 32 (0 empty, 1 live, 2 revoked)
//!            2 protection domain | access << 32  3 bound queue pair (u64::MAX: none)
//!            4 address  5 length  6 memory id  7 memory base address
//!   qp slot  0 sequence  1 qp number | status << 32 (0 empty, 1 not receiving, 2 receiving,
//!            3 removed)  2 protection domain  3 epoch slot of its requester
//!
//! Epochs (one 64-byte line per slot; read-write for peers)
//!   word 0: incremented by the requester before and after each request (odd: in a request)
//! ```
//!
//! Slots are found by linear probing from a hash of the key or queue pair number; a lookup
//! stops at an empty slot, so revoked and removed slots stay as tombstones until reused. Each
//! slot is a sequence lock: the writer makes the sequence odd, writes the words and makes it
//! even again, all with release stores; a reader retries while the sequence is odd or changed
//! under it (acquire loads), so it never acts on half of an update.

use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::lock;
use crate::memory::PinnedMemory;
use crate::protection::KeyRights;
use crate::types::AccessFlags;

/// The key state's magic word.
const MAGIC: u64 = u64::from_le_bytes(*b"RDKVSHM2");
/// Offset of the header's key generation word.
const GENERATION_AT: u64 = 48;
/// Bytes of the header and of every slot.
const SLOT: u64 = 64;
/// A key slot's or queue pair slot's status: never used (a lookup stops here).
const EMPTY: u64 = 0;
/// A key slot's status: the key is valid.
const LIVE: u64 = 1;
/// A key slot's status: the key was revoked (a tombstone).
const REVOKED: u64 = 2;
/// A bound queue pair word meaning "not a window".
const UNBOUND: u64 = u64::MAX;
/// Keys a listening device can publish (1 MiB of key state).
pub(crate) const KEY_SLOTS: u64 = 16_384;
/// Queue pairs (and so epoch slots) a listening device can attach.
pub(crate) const QUEUE_PAIR_SLOTS: u64 = 4_096;
/// Reads of a slot that find it being written before a reader gives up (the writer died in
/// the middle of an update): the request then goes unanswered.
const READ_ATTEMPTS: u32 = 100_000;

/// A queue pair's status in the shared state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QueuePairStatus {
    /// Created, not connected: it does not answer yet.
    NotReceiving = 1,
    /// RTR or RTS: requests run.
    Receiving = 2,
    /// Destroyed (a tombstone).
    Removed = 3,
}

/// What a requester reads of a responder queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QueuePairView {
    /// Whether requests run.
    pub(crate) status: QueuePairStatus,
    /// Its protection domain.
    pub(crate) protection_domain: u32,
    /// The epoch slot of the requester attached to it (`u32::MAX`: none yet).
    pub(crate) epoch_slot: u32,
}

/// What a requester reads of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyView {
    /// What it grants.
    pub(crate) rights: KeyRights,
    /// The shared block it lies in.
    pub(crate) memory_id: u64,
    /// The responder's address of that block's first byte.
    pub(crate) memory_base: u64,
}

/// Offsets of the key state's slots.
#[derive(Debug, Clone, Copy)]
struct Layout {
    key_slots: u64,
    queue_pair_slots: u64,
}

impl Layout {
    fn length(self) -> u64 {
        (SLOT * (1 + self.key_slots + self.queue_pair_slots)).div_ceil(4096) * 4096
    }

    fn key_slot(self, index: u64) -> u64 {
        SLOT * (1 + index)
    }

    fn queue_pair_slot(self, index: u64) -> u64 {
        SLOT * (1 + self.key_slots + index)
    }
}

/// The probe start for `value` among `slots`.
fn home(value: u32, slots: u64) -> u64 {
    (u64::from(value).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) % slots
}

/// Reads the first `N` words of the slot at `offset` (its sequence word and `N - 1` after it)
/// consistently (a sequence lock read); `None` when the memory cannot be read (never, for a
/// validated layout). A queue pair's slot uses four of its eight words.
fn read_slot<const N: usize>(memory: &PinnedMemory, offset: u64) -> Option<[u64; N]> {
    for _ in 0..READ_ATTEMPTS {
        // The sequence first, then the other words (acquire loads, in order), then the
        // sequence again.
        let words = memory.load_words::<N>(offset).ok()?;
        if words[0] % 2 == 1 {
            std::hint::spin_loop();
            continue;
        }
        if memory.load_u64(offset).ok()? == words[0] {
            return Some(words);
        }
    }
    None
}

/// Writes words 1.. of the slot at `offset` under its sequence lock (the caller holds the
/// writer lock).
fn write_slot(memory: &PinnedMemory, offset: u64, words: &[u64]) -> Result<()> {
    let sequence = memory.load_u64(offset)?;
    memory.store_u64(offset, sequence | 1)?;
    for (index, word) in words.iter().enumerate() {
        memory.store_u64(offset + 8 * (index as u64 + 1), *word)?;
    }
    memory.store_u64(offset, (sequence | 1) + 1)
}

/// The writer's side: a listening device's key state and epochs.
#[derive(Debug)]
pub(crate) struct SharedState {
    /// The key state (a shareable block).
    pub(crate) keys: PinnedMemory,
    /// The epochs (a shareable block).
    pub(crate) epochs: PinnedMemory,
    layout: Layout,
    /// Serialises writers; free epoch slots.
    writer: Mutex<Vec<u32>>,
}

impl SharedState {
    /// Creates the key state and epochs of a device.
    ///
    /// # Errors
    /// When the machine lacks the RAM (as [`PinnedMemory::allocate`]) or the kernel refuses.
    pub(crate) fn create(device_id: u64, max_message_size: u32) -> Result<Self> {
        let layout = Layout {
            key_slots: KEY_SLOTS,
            queue_pair_slots: QUEUE_PAIR_SLOTS,
        };
        // Not registered with anything: not locked either (no memlock allowance spent).
        let keys = PinnedMemory::allocate_shared_unlocked(layout.length())?;
        let epochs = PinnedMemory::allocate_shared_unlocked(SLOT * QUEUE_PAIR_SLOTS)?;
        for (index, word) in [
            MAGIC,
            layout.key_slots,
            layout.queue_pair_slots,
            1,
            u64::from(max_message_size),
            device_id,
        ]
        .into_iter()
        .enumerate()
        {
            keys.store_u64(8 * index as u64, word)?;
        }
        Ok(Self {
            keys,
            epochs,
            layout,
            writer: Mutex::new((0..QUEUE_PAIR_SLOTS as u32).rev().collect()),
        })
    }

    /// Publishes a live key.
    ///
    /// # Errors
    /// [`Error::ShmKeyTableFull`] when every slot holds a live key.
    pub(crate) fn publish_key(&self, key: u32, view: &KeyView) -> Result<()> {
        let _writer = lock(&self.writer);
        let slots = self.layout.key_slots;
        let start = home(key, slots);
        for step in 0..slots {
            let offset = self.layout.key_slot((start + step) % slots);
            let status = self.keys.load_u64(offset + 8)? >> 32;
            if status == LIVE {
                continue;
            }
            let rights = &view.rights;
            return write_slot(
                &self.keys,
                offset,
                &[
                    u64::from(key) | (LIVE << 32),
                    u64::from(rights.protection_domain) | (u64::from(rights.access.bits()) << 32),
                    rights.bound_qp.map_or(UNBOUND, u64::from),
                    rights.address,
                    rights.length,
                    view.memory_id,
                    view.memory_base,
                ],
            );
        }
        Err(Error::ShmKeyTableFull { capacity: slots })
    }

    /// Revokes a key; returns `None` when it was not published, else the queue pair it was
    /// bound to (`Some(None)`: none, a region's key).
    pub(crate) fn revoke_key(&self, key: u32) -> Option<Option<u32>> {
        let _writer = lock(&self.writer);
        let slots = self.layout.key_slots;
        let start = home(key, slots);
        for step in 0..slots {
            let offset = self.layout.key_slot((start + step) % slots);
            let Ok(word) = self.keys.load_u64(offset + 8) else {
                return None;
            };
            match word >> 32 {
                EMPTY => return None,
                LIVE if word as u32 == key => {
                    let bound = self
                        .keys
                        .load_u64(offset + 24)
                        .ok()
                        .and_then(|bound| (bound != UNBOUND).then_some(bound as u32));
                    let revoked =
                        write_slot(&self.keys, offset, &[u64::from(key) | (REVOKED << 32)]).is_ok();
                    // Before the caller waits for the requesters' epochs (`wait_quiet`): one
                    // that enters after it sees the new generation, and forgets the keys it
                    // resolved before.
                    let _ = self.keys.fetch_add_u64(GENERATION_AT, 1);
                    return revoked.then_some(bound);
                }
                _ => {}
            }
        }
        None
    }

    /// Publishes a queue pair's status (and the epoch slot of its requester).
    ///
    /// # Errors
    /// [`Error::ShmKeyTableFull`] when every queue pair slot is taken.
    pub(crate) fn publish_queue_pair(
        &self,
        qp_number: u32,
        status: QueuePairStatus,
        protection_domain: u32,
        epoch_slot: u32,
    ) -> Result<()> {
        let _writer = lock(&self.writer);
        let slots = self.layout.queue_pair_slots;
        let start = home(qp_number, slots);
        let mut free = None;
        for step in 0..slots {
            let offset = self.layout.queue_pair_slot((start + step) % slots);
            let word = self.keys.load_u64(offset + 8)?;
            let (number, current) = (word as u32, word >> 32);
            if current == EMPTY || current == QueuePairStatus::Removed as u64 {
                free.get_or_insert(offset);
                if current == EMPTY {
                    break;
                }
                continue;
            }
            if number == qp_number {
                free = Some(offset);
                break;
            }
        }
        let Some(offset) = free else {
            return Err(Error::ShmKeyTableFull { capacity: slots });
        };
        write_slot(
            &self.keys,
            offset,
            &[
                u64::from(qp_number) | ((status as u64) << 32),
                u64::from(protection_domain),
                u64::from(epoch_slot),
            ],
        )
    }

    /// Takes a free epoch slot, zeroed.
    pub(crate) fn take_epoch_slot(&self) -> Option<u32> {
        let slot = lock(&self.writer).pop()?;
        let _ = self.epochs.store_u64(SLOT * u64::from(slot), 0);
        Some(slot)
    }

    /// Gives an epoch slot back.
    pub(crate) fn give_back_epoch_slot(&self, slot: u32) {
        lock(&self.writer).push(slot);
    }

    /// Waits until the requester of epoch slot `slot` is not inside a request that began before
    /// this call (its epoch is even, or moved on), for at most `limit`; returns `None` when it
    /// was, else the epoch it is still inside (see [`Self::left_epoch`]).
    pub(crate) fn wait_quiet(&self, slot: u32, limit: Duration) -> Option<u64> {
        // Orders the caller's revocation before the epoch read: a requester that enters after
        // it sees the revocation (it fences after its increment).
        fence(Ordering::SeqCst);
        let offset = SLOT * u64::from(slot);
        let Ok(seen) = self.epochs.load_u64(offset) else {
            return None;
        };
        if seen % 2 == 0 {
            return None;
        }
        let deadline = Instant::now() + limit;
        let mut spins = 0u32;
        while self.epochs.load_u64(offset).ok() == Some(seen) {
            if Instant::now() >= deadline {
                return Some(seen);
            }
            spins += 1;
            if spins < 1_000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        None
    }

    /// Whether the requester of epoch slot `slot`, found inside epoch `seen` by
    /// [`Self::wait_quiet`], has left that request since (its epoch moved on).
    pub(crate) fn left_epoch(&self, slot: u32, seen: u64) -> bool {
        self.epochs.load_u64(SLOT * u64::from(slot)).ok() != Some(seen)
    }

    /// Marks the device closed: every request from now on is unanswered.
    pub(crate) fn close(&self) {
        let _ = self.keys.store_u64(24, 0);
    }
}

/// The reader's side: a peer's key state, mapped read-only.
#[derive(Debug)]
pub(crate) struct SharedView {
    keys: PinnedMemory,
    layout: Layout,
    max_message_size: u32,
}

impl SharedView {
    /// Checks a mapped key state's header.
    ///
    /// # Errors
    /// [`Error::ShmRefused`]-style text in `Err(String)` when it is not a key state.
    pub(crate) fn new(keys: PinnedMemory) -> std::result::Result<Self, String> {
        let word = |index: u64| keys.load_u64(8 * index).unwrap_or(0);
        if word(0) != MAGIC {
            return Err("the key state has no rdkv magic".into());
        }
        let layout = Layout {
            key_slots: word(1),
            queue_pair_slots: word(2),
        };
        if layout.key_slots == 0
            || layout.queue_pair_slots == 0
            || layout.key_slots > 1 << 24
            || layout.queue_pair_slots > 1 << 24
            || layout.length() > keys.len()
        {
            return Err("the key state's slot counts do not fit its mapping".into());
        }
        let max_message_size = u32::try_from(word(4)).unwrap_or(u32::MAX);
        Ok(Self {
            keys,
            layout,
            max_message_size,
        })
    }

    /// Whether the device is still open.
    pub(crate) fn is_open(&self) -> bool {
        self.keys.load_u64(24).is_ok_and(|open| open == 1)
    }

    /// The key generation: it changes whenever a key is revoked, so a requester may keep what
    /// it resolved of its keys while it reads the same generation inside its epoch.
    pub(crate) fn key_generation(&self) -> u64 {
        self.keys.load_u64(GENERATION_AT).unwrap_or(u64::MAX)
    }

    /// The responder's largest READ or WRITE.
    pub(crate) fn max_message_size(&self) -> u32 {
        self.max_message_size
    }

    /// The live key `key`, if any.
    pub(crate) fn key(&self, key: u32) -> Option<KeyView> {
        let slots = self.layout.key_slots;
        let start = home(key, slots);
        for step in 0..slots {
            let words = read_slot::<8>(&self.keys, self.layout.key_slot((start + step) % slots))?;
            match words[1] >> 32 {
                EMPTY => return None,
                LIVE if words[1] as u32 == key => {
                    return Some(KeyView {
                        rights: KeyRights {
                            protection_domain: words[2] as u32,
                            access: AccessFlags::from_bits_truncate((words[2] >> 32) as u32),
                            bound_qp: (words[3] != UNBOUND).then_some(words[3] as u32),
                            address: words[4],
                            length: words[5],
                        },
                        memory_id: words[6],
                        memory_base: words[7],
                    });
                }
                _ => {}
            }
        }
        None
    }

    /// The queue pair `qp_number`, if it exists, looking first at the slot `hint` holds,
    /// where it was found last (a live queue pair keeps its slot), and keeping in `hint` where
    /// it was found.
    pub(crate) fn queue_pair_hinted(
        &self,
        qp_number: u32,
        hint: &AtomicU64,
    ) -> Option<QueuePairView> {
        let position = hint.load(Ordering::Relaxed);
        if position < self.layout.queue_pair_slots {
            let words = read_slot::<4>(&self.keys, self.layout.queue_pair_slot(position))?;
            if let Some(view) = live_queue_pair(words, qp_number) {
                return Some(view);
            }
        }
        let (position, view) = self.find_queue_pair(qp_number)?;
        hint.store(position, Ordering::Relaxed);
        Some(view)
    }

    /// The queue pair `qp_number` and its slot, if it exists.
    fn find_queue_pair(&self, qp_number: u32) -> Option<(u64, QueuePairView)> {
        let slots = self.layout.queue_pair_slots;
        let start = home(qp_number, slots);
        for step in 0..slots {
            let position = (start + step) % slots;
            let words = read_slot::<4>(&self.keys, self.layout.queue_pair_slot(position))?;
            if words[1] >> 32 == EMPTY {
                return None;
            }
            if let Some(view) = live_queue_pair(words, qp_number) {
                return Some((position, view));
            }
        }
        None
    }
}

/// The queue pair a slot's first four words describe, when it is `qp_number` and not removed
/// (an empty slot is none).
fn live_queue_pair(words: [u64; 4], qp_number: u32) -> Option<QueuePairView> {
    let status = words[1] >> 32;
    if status == EMPTY || words[1] as u32 != qp_number || status == QueuePairStatus::Removed as u64
    {
        return None;
    }
    let status = if status == QueuePairStatus::Receiving as u64 {
        QueuePairStatus::Receiving
    } else {
        QueuePairStatus::NotReceiving
    };
    Some(QueuePairView {
        status,
        protection_domain: words[2] as u32,
        epoch_slot: words[3] as u32,
    })
}

/// A requester's side of the epochs: marks its requests so the responder can wait for them.
#[derive(Debug)]
pub(crate) struct EpochMarker<'a> {
    epochs: &'a PinnedMemory,
    offset: u64,
}

impl<'a> EpochMarker<'a> {
    /// Enters a request on epoch slot `slot` (the epoch becomes odd); the request ends when the
    /// marker drops.
    pub(crate) fn enter(epochs: &'a PinnedMemory, slot: u32) -> Self {
        let offset = SLOT * u64::from(slot);
        let _ = epochs.fetch_add_u64(offset, 1);
        // Orders the increment before the reads of the key state (see `wait_quiet`).
        fence(Ordering::SeqCst);
        Self { epochs, offset }
    }
}

impl Drop for EpochMarker<'_> {
    fn drop(&mut self) {
        let _ = self.epochs.fetch_add_u64(self.offset, 1);
    }
}
