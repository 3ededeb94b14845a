//! Announce words: how a node learns, without a message, which of a client's operations are
//! still running (`docs/protocol.md`, *Heap space*).
//!
//! Every data connection owns one [`ANNOUNCE_SIZE`]-byte word in a small registered region, with
//! a WRITE window bound to its queue pair: `started` (how many operations the connection has
//! begun) then `quiescent` (every operation numbered up to it has finished). A client WRITEs the
//! word at the head of each operation's first list, and once more when it goes idle. On one
//! queue pair the responder executes in order, so:
//!
//! - an operation's announce lands before any READ or CAS of that operation: if it read a slot
//!   before some instant, its number is in `started` at that instant;
//! - an announce that says `quiescent ≥ n` lands after every request of operations `1..=n`:
//!   none of them touches the table again.
//!
//! The heap uses two checks built on this (see `heap.rs`): a sealed chunk's writers are done once
//! its connection is quiescent through the `started` it sent with `AllocateChunk`; an
//! unreferenced chunk is free once every connection is quiescent through the `started` it had
//! when the scan that found the chunk unreferenced ended. A connection that is gone (torn down:
//! its queue pair drained) has nothing in flight.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use rdkv_common::protocol::ANNOUNCE_SIZE;
use rdkv_fabric::lock;
use rdkv_fabric::memory::{HugepagePolicy, PinLimits, PinnedMemory};
use rdkv_fabric::{AccessFlags, MemoryRegion, ProtectionDomain};

use crate::error::Result;

/// What one connection had started when a snapshot was taken.
pub type Snapshot = Arc<Vec<(u64, u64)>>;

/// The announce words of one node.
#[derive(Debug)]
pub struct Announcements {
    /// The registered words, one per connection slot.
    region: MemoryRegion,
    /// Free word indexes, and the word of each live connection.
    slots: Mutex<Slots>,
}

#[derive(Debug)]
struct Slots {
    /// Free word indexes.
    free: Vec<u64>,
    /// The word of each connection that has one.
    live: HashMap<u64, u64>,
    /// Torn-down connections whose requester stopped inside a request (`shm`): their words stay
    /// (a WRITE of theirs may still land), but what they read can no longer be trusted by them
    /// (a READ after the fence is discarded), so they hold no snapshot back.
    reads_fenced: HashSet<u64>,
}

impl Announcements {
    /// Words for `connections` connections, pinned and registered in `domain` (so windows of
    /// the connections' queue pairs can be bound over them); `shareable`: as a memory file, for
    /// the node's `shm` fabric.
    ///
    /// # Errors
    /// The memory layer's errors (memlock), and registration errors.
    pub fn allocate(
        domain: &ProtectionDomain,
        connections: usize,
        shareable: bool,
    ) -> Result<Self> {
        let count = connections.max(1) as u64;
        // One more word at the end: the node's lease word (`rdkv_common::lease`).
        let allocate = if shareable {
            PinnedMemory::allocate_shared
        } else {
            PinnedMemory::allocate
        };
        let memory = Arc::new(allocate(
            (count + 1) * ANNOUNCE_SIZE,
            HugepagePolicy::Off,
            PinLimits::default(),
        )?);
        let region =
            domain.register_all(&memory, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?;
        Ok(Self {
            region,
            slots: Mutex::new(Slots {
                free: (0..count).rev().collect(),
                live: HashMap::new(),
                reads_fenced: HashSet::new(),
            }),
        })
    }

    /// The region (windows are bound over parts of it).
    pub fn region(&self) -> &MemoryRegion {
        &self.region
    }

    /// The same words registered in another domain (the node's `shm` fabric), for windows
    /// bound there.
    ///
    /// # Errors
    /// Registration errors.
    pub fn register_in(&self, domain: &ProtectionDomain) -> Result<MemoryRegion> {
        Ok(domain.register_all(
            self.region.memory(),
            AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
        )?)
    }

    /// The address of the node's lease word (8 bytes after the last connection's word),
    /// which every data connection may READ.
    pub fn lease_word_address(&self) -> u64 {
        self.region.address() + self.lease_word_offset()
    }

    /// Where the node writes its lease word.
    pub fn lease_sink(&self) -> LeaseSink {
        LeaseSink {
            memory: self.region.memory().clone(),
            offset: self.lease_word_offset(),
        }
    }

    fn lease_word_offset(&self) -> u64 {
        self.region.length() - ANNOUNCE_SIZE
    }

    /// Gives `connection` a zeroed word; returns its virtual address, or `None` when every
    /// word is taken (the caller refuses the connection).
    pub fn claim(&self, connection: u64) -> Option<u64> {
        let index = {
            let mut slots = lock(&self.slots);
            let index = slots.free.pop()?;
            slots.live.insert(connection, index);
            index
        };
        let offset = index * ANNOUNCE_SIZE;
        // The word is ours until released; zero it before the client can write it.
        let _ = self.region.write(offset, &[0u8; ANNOUNCE_SIZE as usize]);
        Some(self.region.address() + offset)
    }

    /// Releases `connection`'s word, once its queue pair is drained: it has nothing in flight.
    pub fn release(&self, connection: u64) {
        let mut slots = lock(&self.slots);
        slots.reads_fenced.remove(&connection);
        if let Some(index) = slots.live.remove(&connection) {
            slots.free.push(index);
        }
    }

    /// Keeps `connection`'s word, but no longer waits for it in snapshots: its queue pair is
    /// no longer receiving and its requester checks, after each READ, that it still was (`shm`:
    /// a READ after the fence is discarded), while a WRITE it was inside may still land (its
    /// grant and word stay until [`Self::release`]).
    pub fn fence_reads(&self, connection: u64) {
        lock(&self.slots).reads_fenced.insert(connection);
    }

    /// Whether `connection`'s reads are fenced ([`Self::fence_reads`]): a requester stopped
    /// inside a request, whose WRITE may still land.
    pub fn reads_fenced(&self, connection: u64) -> bool {
        lock(&self.slots).reads_fenced.contains(&connection)
    }

    /// `started` of every live connection now.
    pub fn snapshot(&self) -> Snapshot {
        let slots = lock(&self.slots);
        Arc::new(
            slots
                .live
                .iter()
                .map(|(connection, index)| (*connection, self.word(*index, 0)))
                .collect(),
        )
    }

    /// Whether `connection` has finished every operation numbered up to `started` (true when
    /// it is gone).
    pub fn quiescent_through(&self, connection: u64, started: u64) -> bool {
        let index = lock(&self.slots).live.get(&connection).copied();
        match index {
            None => true,
            Some(index) => self.word(index, 8) >= started,
        }
    }

    /// `connection`'s word now, as (`started`, `quiescent`); `None` when it has none.
    pub fn word_of(&self, connection: u64) -> Option<(u64, u64)> {
        let index = lock(&self.slots).live.get(&connection).copied()?;
        Some((self.word(index, 0), self.word(index, 8)))
    }

    /// Whether every connection of `snapshot` has finished what it had started then (or can no
    /// longer trust what it reads: [`Self::fence_reads`]).
    pub fn all_quiescent(&self, snapshot: &Snapshot) -> bool {
        let slots = lock(&self.slots);
        snapshot.iter().all(|(connection, started)| {
            slots.reads_fenced.contains(connection)
                || match slots.live.get(connection) {
                    None => true,
                    Some(index) => self.word(*index, 8) >= *started,
                }
        })
    }

    /// One half of a word (the client writes both little-endian; an aligned 8-byte load sees
    /// either the old or the new value).
    fn word(&self, index: u64, half: u64) -> u64 {
        self.region
            .load_u64(index * ANNOUNCE_SIZE + half)
            .map(u64::from_le)
            .unwrap_or(0)
    }
}

/// Where the node writes its lease word: one aligned 8-byte store, so a READ sees the old
/// word or the new one, never a mix.
#[derive(Debug, Clone)]
pub struct LeaseSink {
    /// The announce words' memory.
    memory: Arc<PinnedMemory>,
    /// The lease word's offset in it.
    offset: u64,
}

impl LeaseSink {
    /// Publishes `word` (little-endian, as clients read it).
    pub fn store(&self, word: u64) {
        // The offset is inside the memory and aligned by construction (`Announcements`).
        let _ = self.memory.store_u64(self.offset, word.to_le());
    }

    /// The word published now.
    pub fn load(&self) -> u64 {
        self.memory
            .load_u64(self.offset)
            .map(u64::from_le)
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkv_fabric::{Device, DeviceConfig};

    fn announcements(connections: usize) -> Announcements {
        let device = Device::loopback(DeviceConfig::default());
        Announcements::allocate(&device.allocate_protection_domain(), connections, false)
            .expect("allocate announce words")
    }

    fn write(announcements: &Announcements, address: u64, started: u64, quiescent: u64) {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&started.to_le_bytes());
        bytes[8..].copy_from_slice(&quiescent.to_le_bytes());
        let offset = address - announcements.region().address();
        announcements
            .region()
            .write(offset, &bytes)
            .expect("write a word");
    }

    #[test]
    fn a_snapshot_waits_for_what_was_started_and_a_gone_connection_is_quiescent() {
        let words = announcements(2);
        let first = words.claim(1).expect("a word");
        let second = words.claim(2).expect("a word");
        assert!(words.claim(3).is_none(), "only two words");
        write(&words, first, 10, 7);
        write(&words, second, 3, 3);
        let snapshot = words.snapshot();
        assert!(!words.all_quiescent(&snapshot), "connection 1 runs 8..=10");
        write(&words, first, 12, 10);
        assert!(words.all_quiescent(&snapshot), "8..=10 finished");
        let later = words.snapshot();
        assert!(!words.all_quiescent(&later), "11 and 12 run");
        words.release(1);
        assert!(
            words.all_quiescent(&later),
            "a gone connection has nothing in flight"
        );
        let third = words.snapshot();
        words.fence_reads(2);
        write(&words, second, 9, 3);
        assert!(
            words.all_quiescent(&words.snapshot()),
            "a connection whose reads are fenced holds no snapshot back"
        );
        assert!(
            !words.quiescent_through(2, 9),
            "but its writes are still waited for"
        );
        assert!(words.all_quiescent(&third));
        let reused = words.claim(3).expect("the released word");
        assert_eq!(reused, first);
        assert!(words.quiescent_through(3, 0), "a fresh word is zero");
    }
}
