//! The slot cache: where this process last saw each key's committed slot on a node, and the
//! slot word it held. A lookup that has a guess READs the guessed block in the same list as the
//! buckets, after them, so a key whose slot did not change since is found in one round trip
//! instead of two (`docs/protocol.md`, *Guessed blocks*). It is two-way set-associative, so
//! two keys that hash alike do not evict each other.
//!
//! A guess is only a hint. The lookup uses it only when the bucket READ of the same list shows
//! the guessed slot holding exactly the guessed word, and the block READ after it holds the key
//! with a valid checksum; anything else, a stale or a torn entry included, falls back to the
//! ordinary lookup from the buckets already read. So the cache needs no locking: an entry is
//! three relaxed words, and a reader that catches an entry being rewritten gets a hint that fails
//! its check, or one that passes it (and is then true).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use rdkv_fabric::lock;

use super::NodeConnection;

use rdkv_common::layout::{KeyLocation, Slot, SlotPosition, BLOCK_UNIT, SLOTS_PER_COMBINED_BUCKET};

/// Entries of the process's slot cache unless [`crate::ClientConfig::slot_cache_entries`] says
/// otherwise: 24 bytes each, 6 MiB for the whole process, whatever the nodes and clients.
pub const DEFAULT_SLOT_CACHE_ENTRIES: usize = 1 << 18;

/// The most entries a slot cache may have (384 MiB).
pub const MAX_SLOT_CACHE_ENTRIES: usize = 1 << 24;

/// The entries `RDKV_SLOT_CACHE_ENTRIES` asks for (0 turns guessing off), else
/// [`DEFAULT_SLOT_CACHE_ENTRIES`]. A value that is not a number is ignored with a warning; one
/// above [`MAX_SLOT_CACHE_ENTRIES`] is cut to it.
pub fn slot_cache_entries_from_environment() -> usize {
    const VARIABLE: &str = "RDKV_SLOT_CACHE_ENTRIES";
    let Ok(text) = std::env::var(VARIABLE) else {
        return DEFAULT_SLOT_CACHE_ENTRIES;
    };
    match text.trim().parse::<usize>() {
        Ok(entries) if entries > MAX_SLOT_CACHE_ENTRIES => {
            tracing::warn!(variable = VARIABLE, value = %text, limit = MAX_SLOT_CACHE_ENTRIES, "slot cache entries cut to the limit");
            MAX_SLOT_CACHE_ENTRIES
        }
        Ok(entries) => entries,
        Err(_) => {
            tracing::warn!(variable = VARIABLE, value = %text, "ignoring a value that is not a number of entries");
            DEFAULT_SLOT_CACHE_ENTRIES
        }
    }
}

/// Entries a key may use: the cache is two-way set-associative.
const WAYS: usize = 2;

/// Bits of a packed position that hold the slot (0..16) and the hash choice.
const SLOT_BITS: u32 = 4;
const CHOICE_BIT: u64 = 1 << SLOT_BITS;
const BUCKET_SHIFT: u32 = SLOT_BITS + 1;

/// One entry: the key's tag (0: empty), its slot's packed position, and the word it held.
#[derive(Debug, Default)]
struct Entry {
    tag: AtomicU64,
    position: AtomicU64,
    word: AtomicU64,
}

/// A guess at a key's committed slot: its position and word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Guess {
    /// Where the slot is.
    pub(crate) position: SlotPosition,
    /// The committed word it held when this process last saw it.
    pub(crate) slot: Slot,
}

impl Guess {
    /// This guess, if it can be one for the key at `location` on a node whose heap is
    /// `heap_size` bytes: a readable word (a non-zero length) of the key's fingerprint, for a
    /// block inside the heap, at a slot of one of the key's combined buckets.
    pub(crate) fn plausible(self, location: &KeyLocation, heap_size: u64) -> Option<Guess> {
        let Guess { position, slot } = self;
        let plausible = slot.is_readable()
            && slot.fingerprint() == location.fingerprint
            && slot
                .offset()
                .checked_add(slot.block_length())
                .is_some_and(|end| end <= heap_size)
            && position.slot < SLOTS_PER_COMBINED_BUCKET
            && position.choice < location.combined_buckets.len()
            && location.combined_buckets[position.choice] == position.combined_bucket;
        plausible.then_some(self)
    }
}

/// The process's slot cache entries of one size, two-way set-associative, shared by every
/// node and every `Client` of the process (a thousand clients of one node share one cache, not
/// a thousand; a client of a hundred nodes holds one, not a hundred). Allocated on the first
/// key remembered, so a client that only connects holds none.
#[derive(Debug)]
struct Entries {
    /// Entries, a power of two (0: off).
    capacity: usize,
    entries: OnceLock<Box<[Entry]>>,
}

/// One node's view of the process's slot cache: the entries, and the node's salt, mixed into
/// every key's hash so that the nodes' keys spread over the entries independently.
#[derive(Debug)]
pub(crate) struct SlotCache {
    entries: Arc<Entries>,
    salt: u64,
    /// How many of the next GETs with a guess read the buckets with it instead of only the
    /// guessed slot's word: a stale narrow guess adds [`STALE_NARROW_PENALTY`], each guess that
    /// held takes one off (see [`SlotCache::narrow`]).
    narrow_penalty: AtomicU32,
}

/// GETs that read the buckets with their guess after a narrow guess proved stale: a stale
/// narrow guess costs a round trip, a stale wide one nothing, so narrow guesses are used only
/// while fewer than about one in this many guesses goes stale.
const STALE_NARROW_PENALTY: u32 = 8;
/// The most GETs a run of stale guesses can send wide before narrow ones are tried again.
const MAX_NARROW_PENALTY: u32 = 64;

/// The process's slot cache for the node at `address`, with `entries` entries in all: every
/// node of one size shares the entries. A node that restarted or changed is still right to
/// share them: every guess is checked against the node's table.
pub(crate) fn shared(address: SocketAddr, entries: usize) -> Arc<SlotCache> {
    static CACHES: OnceLock<Mutex<HashMap<usize, Weak<Entries>>>> = OnceLock::new();
    let shared = {
        let mut caches = lock(CACHES.get_or_init(Mutex::default));
        match caches.get(&entries).and_then(Weak::upgrade) {
            Some(shared) => shared,
            None => {
                caches.retain(|_, cache| cache.strong_count() > 0);
                let shared = Arc::new(Entries::new(entries));
                caches.insert(entries, Arc::downgrade(&shared));
                shared
            }
        }
    };
    let mut hasher = std::hash::DefaultHasher::new();
    address.hash(&mut hasher);
    Arc::new(SlotCache {
        entries: shared,
        salt: hasher.finish(),
        narrow_penalty: AtomicU32::new(0),
    })
}

impl Entries {
    /// `entries` entries, rounded up to a power of two; 0 caches nothing.
    fn new(entries: usize) -> Self {
        let capacity = if entries == 0 {
            0
        } else {
            entries
                .min(MAX_SLOT_CACHE_ENTRIES)
                .next_power_of_two()
                .max(WAYS)
        };
        Self {
            capacity,
            entries: OnceLock::new(),
        }
    }
}

impl SlotCache {
    /// A cache of its own with `entries` entries (tests).
    #[cfg(test)]
    fn new(entries: usize) -> Self {
        Self {
            entries: Arc::new(Entries::new(entries)),
            salt: 0,
            narrow_penalty: AtomicU32::new(0),
        }
    }

    /// The key's set (two entries, the key may be in either) and its tag (never 0), or `None`
    /// when the cache is off.
    fn set(&self, location: &KeyLocation, allocate: bool) -> Option<(&[Entry], u64)> {
        let shared = &self.entries;
        if shared.capacity == 0 {
            return None;
        }
        let entries = if allocate {
            shared
                .entries
                .get_or_init(|| (0..shared.capacity).map(|_| Entry::default()).collect())
        } else {
            shared.entries.get()?
        };
        let hash = location.combined_buckets[0]
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(23)
            ^ location.combined_buckets[1].wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
            ^ u64::from(location.fingerprint)
            ^ self.salt;
        let first = (hash as usize) & (entries.len() - 1) & !(WAYS - 1);
        Some((&entries[first..first + WAYS], hash | 1))
    }

    /// The key's entry, if it has one.
    fn entry(&self, location: &KeyLocation) -> Option<(&Entry, u64)> {
        let (set, tag) = self.set(location, false)?;
        set.iter()
            .find(|entry| entry.tag.load(Ordering::Relaxed) == tag)
            .map(|entry| (entry, tag))
    }

    /// The key's last seen committed slot, if the cache has one that could be the key's: a
    /// readable word with the key's fingerprint, in one of its buckets, whose block lies inside
    /// a heap of `heap_size` bytes (a node that restarted at the same address with a smaller
    /// heap would refuse a READ past its end and break the connection).
    pub(crate) fn guess(&self, location: &KeyLocation, heap_size: u64) -> Option<Guess> {
        let (entry, _) = self.entry(location)?;
        let packed = entry.position.load(Ordering::Relaxed);
        let slot = Slot(entry.word.load(Ordering::Relaxed));
        let choice = usize::from(packed & CHOICE_BIT != 0);
        let position = SlotPosition {
            choice,
            combined_bucket: packed >> BUCKET_SHIFT,
            slot: (packed & ((1 << SLOT_BITS) - 1)) as usize,
        };
        Guess { position, slot }.plausible(location, heap_size)
    }

    /// Whether a GET with a guess READs only the guessed slot's word (one 8-byte READ instead of
    /// both combined buckets, and one answer less): while guesses hold, that is cheaper for
    /// both ends; a stale one then costs a round trip to read the buckets.
    pub(crate) fn narrow(&self) -> bool {
        self.narrow_penalty.load(Ordering::Relaxed) == 0
    }

    /// Counts a guess's outcome towards [`SlotCache::narrow`]: a stale narrow guess sends the
    /// next GETs wide, and every guess that held brings narrow ones closer. Stores nothing
    /// while narrow guesses hold (no shared-line write per GET).
    pub(crate) fn guess_outcome(&self, narrow: bool, held: bool) {
        if held {
            if self.narrow_penalty.load(Ordering::Relaxed) > 0 {
                let _ = self.narrow_penalty.fetch_update(
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                    |penalty| penalty.checked_sub(1),
                );
            }
        } else if narrow {
            let _ =
                self.narrow_penalty
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |penalty| {
                        Some((penalty + STALE_NARROW_PENALTY).min(MAX_NARROW_PENALTY))
                    });
        }
    }

    /// Remembers the key's committed slot: in its own entry, else an empty one of its set,
    /// else in place of one of the two (chosen by the word's low offset bits, which vary from
    /// block to block).
    pub(crate) fn remember(&self, location: &KeyLocation, position: SlotPosition, slot: Slot) {
        let Some((set, tag)) = self.set(location, true) else {
            return;
        };
        let entry = set
            .iter()
            .find(|entry| entry.tag.load(Ordering::Relaxed) == tag)
            .or_else(|| {
                set.iter()
                    .find(|entry| entry.tag.load(Ordering::Relaxed) == 0)
            })
            .unwrap_or(&set[((slot.offset() / BLOCK_UNIT) as usize) % WAYS]);
        let packed = (position.combined_bucket << BUCKET_SHIFT)
            | if position.choice == 1 { CHOICE_BIT } else { 0 }
            | position.slot as u64;
        if entry.tag.load(Ordering::Relaxed) == tag
            && entry.position.load(Ordering::Relaxed) == packed
            && entry.word.load(Ordering::Relaxed) == slot.0
        {
            // Already so (every GET whose guess held): no store, so readers of a hot key on
            // other cores keep the line shared.
            return;
        }
        entry.position.store(packed, Ordering::Relaxed);
        entry.word.store(slot.0, Ordering::Relaxed);
        entry.tag.store(tag, Ordering::Relaxed);
    }

    /// Forgets the key (it is absent): a guess would only cost a wasted block READ.
    pub(crate) fn forget(&self, location: &KeyLocation) {
        if let Some((entry, _)) = self.entry(location) {
            entry.tag.store(0, Ordering::Relaxed);
        }
    }

    /// Bytes the cache holds.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.entries
            .entries
            .get()
            .map_or(0, |entries| entries.len())
            * std::mem::size_of::<Entry>()
    }
}

impl NodeConnection {
    /// The slot cache's guess for the key at `location`, checked against this node's heap; none
    /// over a provider whose READs may return out of order (verbs: a NIC may fetch a later
    /// READ's data before an earlier one's; `Capabilities::ordered_reads`), which the guess
    /// relies on.
    pub(crate) fn guess(&self, location: &KeyLocation) -> Option<Guess> {
        if !self
            .welcome
            .server_endpoint
            .backend()
            .capabilities()
            .ordered_reads
        {
            return None;
        }
        self.slot_cache
            .guess(location, self.welcome.geometry.heap_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl SlotCache {
        /// A guess with no heap bound.
        fn guess_any(&self, location: &KeyLocation) -> Option<Guess> {
            self.guess(location, u64::MAX)
        }
    }

    #[test]
    fn a_block_past_the_heap_is_no_guess() {
        let cache = SlotCache::new(16);
        let key = location([1, 2], 0x21);
        let position = SlotPosition {
            choice: 0,
            combined_bucket: 1,
            slot: 3,
        };
        let slot = Slot::new(0x21, 2, 64 * 100);
        cache.remember(&key, position, slot);
        assert!(cache.guess(&key, 64 * 102).is_some());
        assert_eq!(cache.guess(&key, 64 * 101), None);
    }

    fn location(buckets: [u64; 2], fingerprint: u8) -> KeyLocation {
        KeyLocation {
            fingerprint,
            combined_buckets: buckets,
        }
    }

    #[test]
    fn remembers_and_forgets_a_key() {
        let cache = SlotCache::new(1000);
        assert_eq!(cache.bytes(), 0, "nothing allocated before the first key");
        let key = location([7, 90], 0x5a);
        assert_eq!(cache.guess_any(&key), None);
        let position = SlotPosition {
            choice: 1,
            combined_bucket: 90,
            slot: 15,
        };
        let slot = Slot::new(0x5a, 3, 64 * 1000).committed();
        cache.remember(&key, position, slot);
        assert_eq!(cache.bytes(), 1024 * 24);
        assert_eq!(cache.guess_any(&key), Some(Guess { position, slot }));
        cache.forget(&key);
        assert_eq!(cache.guess_any(&key), None);
    }

    #[test]
    fn two_keys_of_one_set_are_both_kept() {
        // A cache of two entries: one set, which every key maps to.
        let cache = SlotCache::new(2);
        let first = location([1, 2], 0x01);
        let second = location([3, 4], 0x02);
        let at = |bucket| SlotPosition {
            choice: 0,
            combined_bucket: bucket,
            slot: 0,
        };
        cache.remember(&first, at(1), Slot::new(0x01, 1, 64).committed());
        cache.remember(&second, at(3), Slot::new(0x02, 1, 128).committed());
        assert!(cache.guess_any(&first).is_some() && cache.guess_any(&second).is_some());
        // A third evicts one of them, never itself.
        let third = location([5, 6], 0x03);
        cache.remember(&third, at(5), Slot::new(0x03, 1, 192).committed());
        assert!(cache.guess_any(&third).is_some());
        assert!(cache.guess_any(&first).is_some() != cache.guess_any(&second).is_some());
    }

    #[test]
    fn an_implausible_entry_is_no_guess() {
        let cache = SlotCache::new(16);
        let key = location([3, 4], 0x11);
        let position = SlotPosition {
            choice: 0,
            combined_bucket: 3,
            slot: 2,
        };
        // Another fingerprint, a tentative word, a bucket that is not the key's.
        cache.remember(&key, position, Slot::new(0x12, 1, 64).committed());
        assert_eq!(cache.guess_any(&key), None);
        cache.remember(&key, position, Slot::new(0x11, 1, 64).tentative());
        assert_eq!(cache.guess_any(&key), None);
        let elsewhere = SlotPosition {
            combined_bucket: 5,
            ..position
        };
        cache.remember(&key, elsewhere, Slot::new(0x11, 1, 64).committed());
        assert_eq!(cache.guess_any(&key), None);
    }

    #[test]
    fn the_process_shares_one_cache_of_each_size() {
        let node: SocketAddr = "127.0.0.1:7400".parse().expect("address");
        let other: SocketAddr = "127.0.0.1:7410".parse().expect("address");
        let first = shared(node, 64);
        let again = shared(node, 64);
        assert!(Arc::ptr_eq(&first.entries, &again.entries));
        assert_eq!(
            first.salt, again.salt,
            "clients of one node find each other's keys"
        );
        let elsewhere = shared(other, 64);
        assert!(Arc::ptr_eq(&first.entries, &elsewhere.entries));
        assert_ne!(first.salt, elsewhere.salt);
        assert!(!Arc::ptr_eq(&first.entries, &shared(node, 0).entries));
        // A key remembered for one node is no guess for another (unless their sets collide,
        // when it is a guess that fails its check against the other node's table).
        let key = location([9, 10], 0x33);
        let position = SlotPosition {
            choice: 0,
            combined_bucket: 9,
            slot: 1,
        };
        first.remember(&key, position, Slot::new(0x33, 1, 64));
        assert!(again.guess_any(&key).is_some());
        assert!(elsewhere.guess_any(&key).is_none());
    }

    #[test]
    fn a_disabled_cache_guesses_nothing() {
        let cache = SlotCache::new(0);
        let key = location([1, 2], 3);
        let position = SlotPosition {
            choice: 0,
            combined_bucket: 1,
            slot: 0,
        };
        cache.remember(&key, position, Slot::new(3, 1, 64).committed());
        assert_eq!(cache.guess_any(&key), None);
        assert_eq!(cache.bytes(), 0);
    }

    #[test]
    fn narrow_guesses_stop_while_they_go_stale_and_resume_as_guesses_hold() {
        let cache = SlotCache::new(16);
        assert!(cache.narrow(), "a fresh cache guesses narrow");
        // A stale wide guess costs nothing more: it does not stop narrow guesses.
        cache.guess_outcome(false, false);
        assert!(cache.narrow());
        cache.guess_outcome(true, false);
        assert!(
            !cache.narrow(),
            "a stale narrow guess sends the next GETs wide"
        );
        for _ in 0..STALE_NARROW_PENALTY - 1 {
            cache.guess_outcome(false, true);
            assert!(!cache.narrow());
        }
        cache.guess_outcome(false, true);
        assert!(cache.narrow(), "guesses that held bring narrow ones back");
        // A long run of stale narrow guesses is bounded: at most MAX_NARROW_PENALTY holds.
        for _ in 0..100 {
            cache.guess_outcome(true, false);
        }
        for _ in 0..MAX_NARROW_PENALTY {
            cache.guess_outcome(false, true);
        }
        assert!(cache.narrow());
    }
}
