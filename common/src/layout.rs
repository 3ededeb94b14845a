//! The table layout shared by server and client: index buckets and slots, combined buckets with
//! two hash choices, and KV blocks in the heap. `docs/layout.md` draws it with byte offsets.
//!
//! ```text
//! region = [ index: bucket_count × 64 B | heap: heap_size B ]      (one mmap, registered once)
//! bucket = 8 slots × 8 B
//! combined bucket c = buckets 2c and 2c+1 (128 B, one READ)
//! slot   = fingerprint (bits 56..64) | length in 64 B units (48..56) | heap offset (6..48)
//!          | tombstone (bit 2) | committed (bit 1) | tentative (bit 0); both state bits: locked
//!          (a replicated write in progress); offsets are multiples of 64, so bits 0..6 are free
//! block  = key_length u16 | flags u16 | value_length u32 | version u64 | checksum u64 | key
//!          | value | pad to 64 B (flags bit 0: a tombstone, a replicated delete; the version
//!          orders a key's copies on different nodes: the newest wins)
//! ```

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Bytes per bucket.
pub const BUCKET_SIZE: u64 = 64;
/// Slots per bucket.
pub const SLOTS_PER_BUCKET: usize = 8;
/// Bytes per combined bucket (two buckets, fetched with one READ).
pub const COMBINED_BUCKET_SIZE: u64 = 2 * BUCKET_SIZE;
/// Slots per combined bucket.
pub const SLOTS_PER_COMBINED_BUCKET: usize = 2 * SLOTS_PER_BUCKET;
/// Hash choices per key.
pub const HASH_CHOICES: usize = 2;
/// Candidate slots per key.
pub const CANDIDATE_SLOTS: usize = HASH_CHOICES * SLOTS_PER_COMBINED_BUCKET;
/// Heap blocks are aligned to, and sized in, this many bytes.
pub const BLOCK_UNIT: u64 = 64;
/// The largest block: 255 units (the slot's length field is 8 bits).
pub const MAX_BLOCK_SIZE: u64 = 255 * BLOCK_UNIT;
/// The smallest heap, in chunks: one is kept for the compactor and one is its destination, so a
/// smaller heap leaves writers nothing once dead blocks share extents with live ones (a heap of
/// one chunk locked up for good with 10 KB live in 64 KiB).
pub const MIN_HEAP_CHUNKS: u64 = 4;
/// Bytes of a block header: the header word, the version and the checksum.
pub const BLOCK_HEADER_SIZE: usize = 24;
/// Where a block's version starts: the version and then the checksum are its last 16 header
/// bytes, which a replicated writer WRITEs again once it knows the version ([`block_stamp`]).
pub const BLOCK_STAMP_AT: usize = 8;
/// Bytes of a block's stamp: its version and its checksum.
pub const BLOCK_STAMP_SIZE: usize = 16;
/// The longest key, in bytes.
pub const MAX_KEY_LENGTH: usize = 256;
/// The longest value, in bytes, for any key length.
pub const MAX_VALUE_LENGTH: usize = MAX_BLOCK_SIZE as usize - BLOCK_HEADER_SIZE - MAX_KEY_LENGTH;
/// The largest heap a 48-bit slot offset can address.
pub const MAX_HEAP_SIZE: u64 = 1 << 48;

/// The table's shape, fixed at server start and sent to every client in the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableGeometry {
    /// Index buckets; a power of two, at least 2.
    pub bucket_count: u64,
    /// Heap bytes.
    pub heap_size: u64,
    /// Bytes per heap chunk handed to one client.
    pub chunk_size: u64,
    /// The seed of the key hash.
    pub hash_seed: u64,
}

impl TableGeometry {
    /// Index bytes.
    pub fn index_size(&self) -> u64 {
        self.bucket_count * BUCKET_SIZE
    }

    /// Combined buckets.
    pub fn combined_bucket_count(&self) -> u64 {
        self.bucket_count / 2
    }

    /// Offset of the heap inside the region (the index rounded up to a page).
    pub fn heap_offset(&self) -> u64 {
        self.index_size().div_ceil(4096) * 4096
    }

    /// Bytes of the whole region.
    pub fn region_size(&self) -> u64 {
        self.heap_offset() + self.heap_size
    }

    /// Heap chunks.
    pub fn chunk_count(&self) -> u64 {
        self.heap_size / self.chunk_size
    }

    /// Where a key may live.
    pub fn locate(&self, key: &[u8]) -> KeyLocation {
        // One hash of the key; the second choice is that hash mixed again (a bijection, so
        // two keys share it only when they share the first 64 bits), not a second hash of the
        // key.
        let first = xxh3_64_with_seed(key, self.hash_seed);
        let second = second_choice(first);
        let count = self.combined_bucket_count().max(1);
        KeyLocation {
            fingerprint: (first >> 56) as u8,
            combined_buckets: [first % count, second % count],
        }
    }

    /// Offset in the index of a combined bucket.
    pub fn combined_bucket_offset(&self, combined_bucket: u64) -> u64 {
        combined_bucket * COMBINED_BUCKET_SIZE
    }

    /// Offset in the index of one slot.
    pub fn slot_offset(&self, position: SlotPosition) -> u64 {
        self.combined_bucket_offset(position.combined_bucket) + position.slot as u64 * 8
    }
}

/// The hash of a key's second bucket choice, from its first: the first hash, offset and mixed
/// by splitmix64's finalizer (a bijection of 64-bit words whose every output bit depends on
/// every input bit).
fn second_choice(first: u64) -> u64 {
    let mut mixed = first ^ 0x9E37_79B9_7F4A_7C15;
    mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    mixed ^ (mixed >> 31)
}

/// The two combined buckets and the fingerprint of one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyLocation {
    /// The 8-bit fingerprint stored in the key's slot.
    pub fingerprint: u8,
    /// The combined buckets of the first and second hash choice (may be equal).
    pub combined_buckets: [u64; HASH_CHOICES],
}

impl KeyLocation {
    /// The distinct combined buckets, in choice order.
    pub fn distinct_buckets(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.combined_buckets
            .iter()
            .copied()
            .enumerate()
            .filter(|(choice, bucket)| *choice == 0 || *bucket != self.combined_buckets[0])
    }
}

/// A slot's place: which combined bucket and which of its 16 slots. Positions are ordered first
/// choice before second, lower slot first: an insert takes the first empty one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotPosition {
    /// 0 for the first hash choice, 1 for the second.
    pub choice: usize,
    /// The combined bucket.
    pub combined_bucket: u64,
    /// The slot, 0..16.
    pub slot: usize,
}

/// An index slot: fingerprint | length units | heap offset | state bits. Zero is empty.
///
/// Heap offsets are multiples of 64, so the offset field's low six bits are free for the state:
/// bit 1 marks a **committed** slot (visible to readers), bit 0 a **tentative** one (an insert's
/// reservation, published before its re-read, invisible until the inserter CASes it to
/// committed), and both bits a **locked** one: a committed slot that a replicated write holds
/// while it writes the backups (readers still read its block; `docs/protocol.md`,
/// *Replication*). A non-empty word with neither bit, or with a zero length, is no word anyone
/// wrote: it is a **torn** read (a NIC may READ an 8-byte word byte by byte against a
/// concurrent CAS), and the reader reads again. Two bits, not one, so that a READ tearing the low
/// byte of a tentative word it races (placed or withdrawn) can never look committed. See
/// `docs/protocol.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Slot(pub u64);

impl Slot {
    /// The empty slot.
    pub const EMPTY: Slot = Slot(0);

    /// The bit that marks a tentative slot.
    pub const TENTATIVE_BIT: u64 = 1;

    /// The bit that marks a committed slot.
    pub const COMMITTED_BIT: u64 = 2;

    /// The two state bits.
    const STATE_BITS: u64 = Self::TENTATIVE_BIT | Self::COMMITTED_BIT;

    /// The bit that marks a tombstone's slot (a replicated delete; its block is flagged too),
    /// so the collector finds tombstones to clear without reading blocks. It lives in the low
    /// byte with the state bits: a torn read takes both from the same word.
    pub const TOMBSTONE_BIT: u64 = 4;

    /// A committed slot pointing at a block of `units` 64-byte units at heap offset `offset`.
    pub fn new(fingerprint: u8, units: u8, offset: u64) -> Self {
        debug_assert!(units > 0 && offset < MAX_HEAP_SIZE && offset % BLOCK_UNIT == 0);
        Slot(
            (u64::from(fingerprint) << 56)
                | (u64::from(units) << 48)
                | (offset & (MAX_HEAP_SIZE - 1) & !(BLOCK_UNIT - 1))
                | Self::COMMITTED_BIT,
        )
    }

    /// Whether the slot is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Whether the slot is an insert's reservation that readers ignore.
    pub fn is_tentative(self) -> bool {
        self.0 & Self::STATE_BITS == Self::TENTATIVE_BIT && self.units() > 0
    }

    /// Whether the slot holds a committed (visible) block.
    pub fn is_committed(self) -> bool {
        self.0 & Self::STATE_BITS == Self::COMMITTED_BIT && self.units() > 0
    }

    /// Whether the slot is a committed block that a replicated write has locked: readers read
    /// its block as committed.
    pub fn is_locked(self) -> bool {
        self.0 & Self::STATE_BITS == Self::STATE_BITS && self.units() > 0
    }

    /// Whether readers read the slot's block: committed or locked.
    pub fn is_readable(self) -> bool {
        self.is_committed() || self.is_locked()
    }

    /// Whether the word is none of empty, tentative, committed or locked: a torn read.
    pub fn is_torn(self) -> bool {
        !self.is_empty() && !self.is_tentative() && !self.is_readable()
    }

    /// The same block, locked.
    pub fn locked(self) -> Slot {
        Slot(self.0 | Self::STATE_BITS)
    }

    /// The same word, marked as a tombstone's.
    pub fn tombstone(self) -> Slot {
        Slot(self.0 | Self::TOMBSTONE_BIT)
    }

    /// Whether the word is a tombstone's.
    pub fn is_tombstone(self) -> bool {
        self.0 & Self::TOMBSTONE_BIT != 0
    }

    /// The same block, marked tentative.
    pub fn tentative(self) -> Slot {
        Slot((self.0 & !Self::STATE_BITS) | Self::TENTATIVE_BIT)
    }

    /// The same block, committed.
    pub fn committed(self) -> Slot {
        Slot((self.0 & !Self::STATE_BITS) | Self::COMMITTED_BIT)
    }

    /// The fingerprint.
    pub fn fingerprint(self) -> u8 {
        (self.0 >> 56) as u8
    }

    /// The block length in 64-byte units.
    pub fn units(self) -> u8 {
        (self.0 >> 48) as u8
    }

    /// The block length in bytes.
    pub fn block_length(self) -> u64 {
        u64::from(self.units()) * BLOCK_UNIT
    }

    /// The block's heap offset.
    pub fn offset(self) -> u64 {
        self.0 & (MAX_HEAP_SIZE - 1) & !(BLOCK_UNIT - 1)
    }

    /// Decodes a slot from the 8 bytes a READ returned (little-endian, as the NIC stores it).
    pub fn from_bytes(bytes: [u8; 8]) -> Self {
        Slot(u64::from_le_bytes(bytes))
    }
}

/// Reads the 16 slots of a combined bucket from the bytes a READ returned.
pub fn parse_combined_bucket(bytes: &[u8]) -> [Slot; SLOTS_PER_COMBINED_BUCKET] {
    let mut slots = [Slot::EMPTY; SLOTS_PER_COMBINED_BUCKET];
    for (slot, chunk) in slots.iter_mut().zip(bytes.chunks_exact(8)) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        *slot = Slot::from_bytes(word);
    }
    slots
}

/// Why a key or value cannot be stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The key is empty or longer than [`MAX_KEY_LENGTH`].
    #[error("key of {length} bytes: keys must be 1 to {MAX_KEY_LENGTH} bytes")]
    KeyLength {
        /// The key's length.
        length: usize,
    },
    /// The value is longer than [`MAX_VALUE_LENGTH`].
    #[error("value of {length} bytes exceeds the limit of {MAX_VALUE_LENGTH} bytes")]
    ValueTooLarge {
        /// The value's length.
        length: usize,
    },
}

/// Checks a key and value against the limits.
///
/// # Errors
/// [`LayoutError`] naming the limit.
pub fn check_key_value(key: &[u8], value: &[u8]) -> Result<(), LayoutError> {
    if key.is_empty() || key.len() > MAX_KEY_LENGTH {
        return Err(LayoutError::KeyLength { length: key.len() });
    }
    if value.len() > MAX_VALUE_LENGTH {
        return Err(LayoutError::ValueTooLarge {
            length: value.len(),
        });
    }
    Ok(())
}

/// The block size, in 64-byte units, for a key and value.
pub fn block_units(key_length: usize, value_length: usize) -> u8 {
    let bytes = (BLOCK_HEADER_SIZE + key_length + value_length) as u64;
    bytes.div_ceil(BLOCK_UNIT).min(255) as u8
}

/// The seed of a block's checksum, before the header word is mixed in.
const CHECKSUM_SEED: u64 = 0x5244_4B56;

/// A block's checksum without its version: one-shot xxh3_64 of the value, seeded with the
/// one-shot xxh3_64 of the key, itself seeded with the header word. Every byte of the header
/// word, key and value counts, and the key and value need not be contiguous in memory: a
/// reader can copy the value alone out of registered memory and keep it (`BlockHeader`), and
/// one-shot hashing takes well under half the instructions of a streaming hasher for a 1 KiB
/// value.
fn unversioned_checksum(header: &[u8; 8], key: &[u8], value: &[u8]) -> u64 {
    let key_sum = xxh3_64_with_seed(key, CHECKSUM_SEED ^ u64::from_le_bytes(*header));
    xxh3_64_with_seed(value, key_sum)
}

/// The stored checksum of a block whose checksum without version is `unversioned`: the version
/// mixed in by a bijective finalizer (splitmix64's), so that a writer that learns the version
/// late stamps it without hashing the value again, and any one version bit flipped changes the
/// checksum.
fn versioned_checksum(unversioned: u64, version: u64) -> u64 {
    let mut mixed = version.wrapping_add(0x9E37_79B9_7F4A_7C15);
    mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    unversioned ^ mixed ^ (mixed >> 31)
}

/// A block's [`BLOCK_STAMP_SIZE`] bytes at [`BLOCK_STAMP_AT`]: its version, then its checksum
/// (of `unversioned`, the checksum without version, with the version mixed in).
pub fn block_stamp(unversioned: u64, version: u64) -> [u8; BLOCK_STAMP_SIZE] {
    let mut stamp = [0u8; BLOCK_STAMP_SIZE];
    stamp[..8].copy_from_slice(&version.to_le_bytes());
    stamp[8..].copy_from_slice(&versioned_checksum(unversioned, version).to_le_bytes());
    stamp
}

/// The block flag of a tombstone: a replicated delete's block, which readers take for absence.
const TOMBSTONE_FLAG: u16 = 1;

/// Encodes a block of version 0 into `out` (cleared first); returns its length in units. The
/// caller checked the limits with [`check_key_value`].
pub fn encode_block(key: &[u8], value: &[u8], out: &mut Vec<u8>) -> u8 {
    encode_block_with(key, value, false, 0, out)
}

/// Encodes a block of `version`, a tombstone if `tombstone` (then `value` should be empty),
/// into `out`; returns its length in units.
pub fn encode_block_with(
    key: &[u8],
    value: &[u8],
    tombstone: bool,
    version: u64,
    out: &mut Vec<u8>,
) -> u8 {
    out.clear();
    let head = block_head(key, value, tombstone);
    // The whole block at once: extending piecemeal reallocated (and copied) a 1 KiB value.
    out.reserve_exact(usize::from(head.units) * BLOCK_UNIT as usize);
    out.extend_from_slice(&head.bytes(version));
    out.extend_from_slice(key);
    out.extend_from_slice(value);
    out.resize(usize::from(head.units) * BLOCK_UNIT as usize, 0);
    head.units
}

/// What [`encode_block_with`] puts ahead of the key and the value, for a writer that places the
/// parts itself (straight into a registered buffer, with no copy of the value in between), and
/// may learn the version only later ([`BlockHead::bytes`], [`block_stamp`]). The rest of the
/// block is the key, the value, and zeros up to the units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHead {
    /// The header word: key length, flags, value length.
    pub word: [u8; 8],
    /// The checksum without the version.
    pub unversioned: u64,
    /// The block's length in 64-byte units.
    pub units: u8,
}

impl BlockHead {
    /// The first [`BLOCK_HEADER_SIZE`] bytes of the block, of `version`.
    pub fn bytes(&self, version: u64) -> [u8; BLOCK_HEADER_SIZE] {
        let mut head = [0u8; BLOCK_HEADER_SIZE];
        head[..BLOCK_STAMP_AT].copy_from_slice(&self.word);
        head[BLOCK_STAMP_AT..].copy_from_slice(&block_stamp(self.unversioned, version));
        head
    }
}

/// The head of the block of `key` and `value`, a tombstone if `tombstone`.
pub fn block_head(key: &[u8], value: &[u8], tombstone: bool) -> BlockHead {
    let mut word = [0u8; 8];
    word[0..2].copy_from_slice(&(key.len() as u16).to_le_bytes());
    let flags = if tombstone { TOMBSTONE_FLAG } else { 0 };
    word[2..4].copy_from_slice(&flags.to_le_bytes());
    word[4..8].copy_from_slice(&(value.len() as u32).to_le_bytes());
    BlockHead {
        word,
        unversioned: unversioned_checksum(&word, key, value),
        units: block_units(key.len(), value.len()),
    }
}

/// Why a block read from the heap is not a valid block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// Lengths that do not fit the bytes read.
    #[error("block lengths do not fit the {read} bytes read")]
    Malformed {
        /// Bytes read.
        read: usize,
    },
    /// The checksum does not match: a torn or reused block.
    #[error("block checksum mismatch")]
    Checksum,
}

/// A decoded block, borrowing from the bytes read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block<'a> {
    /// The key.
    pub key: &'a [u8],
    /// The value.
    pub value: &'a [u8],
    /// Whether the block is a tombstone (a replicated delete): the key is absent.
    pub tombstone: bool,
    /// The block's version: of two copies of a key, the higher is the newer.
    pub version: u64,
}

/// A block's header, parsed: what a reader needs to copy the key and the value out of the block
/// separately, and to verify them ([`BlockHeader::verify`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    /// The key's length (1..=256).
    pub key_length: usize,
    /// The value's length.
    pub value_length: usize,
    /// Whether the block is a tombstone (a replicated delete): the key is absent.
    pub tombstone: bool,
    /// The block's version: of two copies of a key, the higher is the newer.
    pub version: u64,
    /// Bytes 0..8, as stored.
    word: [u8; 8],
    /// The stored checksum.
    stored: u64,
}

impl BlockHeader {
    /// Parses the first [`BLOCK_HEADER_SIZE`] bytes of a block of which `available` bytes were
    /// read.
    ///
    /// # Errors
    /// [`BlockError::Malformed`] when the lengths do not fit `available` bytes, or the key is
    /// empty.
    pub fn parse(bytes: &[u8; BLOCK_HEADER_SIZE], available: usize) -> Result<Self, BlockError> {
        let malformed = BlockError::Malformed { read: available };
        let key_length = usize::from(u16::from_le_bytes([bytes[0], bytes[1]]));
        let value_length = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]) as usize;
        let end = BLOCK_HEADER_SIZE
            .checked_add(key_length)
            .and_then(|end| end.checked_add(value_length))
            .ok_or(malformed)?;
        if end > available || key_length == 0 {
            return Err(malformed);
        }
        let mut word = [0u8; 8];
        word.copy_from_slice(&bytes[0..8]);
        let mut version = [0u8; 8];
        version.copy_from_slice(&bytes[8..16]);
        let mut stored = [0u8; 8];
        stored.copy_from_slice(&bytes[16..24]);
        let flags = u16::from_le_bytes([bytes[2], bytes[3]]);
        Ok(Self {
            key_length,
            value_length,
            tombstone: flags & TOMBSTONE_FLAG != 0,
            version: u64::from_le_bytes(version),
            word,
            stored: u64::from_le_bytes(stored),
        })
    }

    /// The key's offset in the block.
    pub fn key_offset(&self) -> usize {
        BLOCK_HEADER_SIZE
    }

    /// The value's offset in the block.
    pub fn value_offset(&self) -> usize {
        BLOCK_HEADER_SIZE + self.key_length
    }

    /// Checks the key and value read (of the lengths this header gives) against the checksum.
    ///
    /// # Errors
    /// [`BlockError::Checksum`] when they do not match it: a torn or reused block.
    pub fn verify(&self, key: &[u8], value: &[u8]) -> Result<(), BlockError> {
        if key.len() != self.key_length
            || value.len() != self.value_length
            || versioned_checksum(unversioned_checksum(&self.word, key, value), self.version)
                != self.stored
        {
            return Err(BlockError::Checksum);
        }
        Ok(())
    }
}

/// Decodes and verifies a block.
///
/// # Errors
/// [`BlockError`] when the bytes are not a whole, intact block.
pub fn decode_block(bytes: &[u8]) -> Result<Block<'_>, BlockError> {
    let Some(header_bytes) = bytes.first_chunk::<BLOCK_HEADER_SIZE>() else {
        return Err(BlockError::Malformed { read: bytes.len() });
    };
    let header = BlockHeader::parse(header_bytes, bytes.len())?;
    let key = &bytes[header.key_offset()..header.value_offset()];
    let value = &bytes[header.value_offset()..header.value_offset() + header.value_length];
    header.verify(key, value)?;
    Ok(Block {
        key,
        value,
        tombstone: header.tombstone,
        version: header.version,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> TableGeometry {
        TableGeometry {
            bucket_count: 1024,
            heap_size: 1 << 20,
            chunk_size: 64 * 1024,
            hash_seed: 7,
        }
    }

    #[test]
    fn slot_fields_round_trip() {
        let slot = Slot::new(0xAB, 3, 0x1234_5678_9AC0);
        assert_eq!(slot.fingerprint(), 0xAB);
        assert_eq!(slot.units(), 3);
        assert_eq!(slot.block_length(), 192);
        assert_eq!(slot.offset(), 0x1234_5678_9AC0);
        assert!(!slot.is_empty());
        assert_eq!(Slot::from_bytes(slot.0.to_le_bytes()), slot);
        assert!(Slot::EMPTY.is_empty());
        assert!(slot.is_committed() && !slot.is_tentative() && !slot.is_torn());
        let tentative = slot.tentative();
        assert!(tentative.is_tentative() && !tentative.is_committed() && !tentative.is_empty());
        assert_eq!(tentative.offset(), slot.offset());
        assert_eq!(tentative.fingerprint(), 0xAB);
        assert_eq!(tentative.units(), 3);
        assert_eq!(tentative.committed(), slot);
        // A READ that tears the low byte of a tentative word it races (empty ↔ tentative) sees
        // neither state bit, or only the low byte: never a committed word.
        for torn in [
            tentative.0 & !0xFF,
            tentative.0 & 0xFF,
            tentative.0 & 0xFFFF_FFFF,
            tentative.0 & !0xFFFF,
        ] {
            let torn = Slot(torn);
            assert!(!torn.is_committed(), "{torn:?}");
        }
        assert!(Slot(slot.0 & !0xFF).is_torn());
        assert!(Slot(slot.0 & 0xFF).is_torn());
        // Locking sets both state bits and keeps the block: readers read it; a tear of the
        // lock (or of its commit) reads the same block committed or locked, never torn.
        let locked = slot.locked();
        assert!(locked.is_locked() && locked.is_readable() && !locked.is_committed());
        assert!(!locked.is_tentative() && !locked.is_torn());
        assert_eq!(
            (locked.offset(), locked.units()),
            (slot.offset(), slot.units())
        );
        assert_eq!(locked.committed(), slot);
        assert!(Slot(locked.0 & !0xFF).is_torn());
        // The tombstone bit changes neither the block nor the state.
        let tombstone = slot.tombstone();
        assert!(tombstone.is_tombstone() && tombstone.is_committed() && !slot.is_tombstone());
        assert_eq!(tombstone.offset(), slot.offset());
        assert!(tombstone.locked().is_tombstone() && tombstone.tentative().is_tombstone());
    }

    #[test]
    fn block_round_trips_and_detects_damage() {
        let mut bytes = Vec::new();
        let units = encode_block(b"user42", b"hello world", &mut bytes);
        assert_eq!(units, 1);
        assert_eq!(bytes.len(), 64);
        let block = decode_block(&bytes).expect("valid");
        assert_eq!(block.key, b"user42");
        assert_eq!(block.value, b"hello world");
        assert!(!block.tombstone);
        let mut tombstone = Vec::new();
        encode_block_with(b"user42", b"", true, 7, &mut tombstone);
        let decoded = decode_block(&tombstone).expect("valid");
        assert!(decoded.tombstone && decoded.value.is_empty() && decoded.key == b"user42");
        assert_eq!(decoded.version, 7);
        // The flag is under the checksum.
        tombstone[2] ^= 1;
        assert_eq!(decode_block(&tombstone), Err(BlockError::Checksum));
        bytes[28] ^= 1;
        assert_eq!(decode_block(&bytes), Err(BlockError::Checksum));
        assert!(matches!(
            decode_block(&bytes[..10]),
            Err(BlockError::Malformed { .. })
        ));
        let zeros = [0u8; 64];
        assert!(
            decode_block(&zeros).is_err(),
            "an all-zero (never written) block is refused"
        );
    }

    /// A writer that places the head, key, value and padding itself writes the very bytes
    /// `encode_block` builds.
    #[test]
    fn a_block_written_in_parts_is_the_encoded_block() {
        for (key, value) in [
            (&b"k"[..], &b""[..]),
            (b"user42", &[0x5A; 47][..]),
            (b"user7", &[0xA5; 1000][..]),
        ] {
            let mut encoded = Vec::new();
            let units = encode_block_with(key, value, false, 42, &mut encoded);
            let head = block_head(key, value, false);
            let mut parts = [&head.bytes(0)[..], key, value].concat();
            parts.resize(usize::from(head.units) * BLOCK_UNIT as usize, 0);
            assert_eq!(head.units, units);
            // A block written with version 0 and stamped later is the block of its version.
            parts[BLOCK_STAMP_AT..BLOCK_HEADER_SIZE]
                .copy_from_slice(&block_stamp(head.unversioned, 42));
            assert_eq!(&parts, &encoded);
            assert_eq!(decode_block(&parts).map(|block| block.version), Ok(42));
        }
    }

    /// Any one byte of the header, the key or the value flipped is caught; the padding is not
    /// covered. The header read alone verifies the key and value read apart.
    #[test]
    fn every_covered_byte_is_under_the_checksum() {
        let mut bytes = Vec::new();
        encode_block(b"user7", &[0xA5; 1000], &mut bytes);
        let covered = BLOCK_HEADER_SIZE + 5 + 1000;
        for index in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[index] ^= 0x10;
            assert_eq!(
                decode_block(&damaged).is_err(),
                index < covered,
                "byte {index}"
            );
        }
        let header_bytes = bytes.first_chunk::<BLOCK_HEADER_SIZE>().expect("header");
        let header = BlockHeader::parse(header_bytes, bytes.len()).expect("header");
        assert_eq!((header.key_length, header.value_length), (5, 1000));
        let (key, value) = (&bytes[24..29], &bytes[29..1029]);
        assert_eq!(header.verify(key, value), Ok(()));
        assert_eq!(header.verify(key, &value[..999]), Err(BlockError::Checksum));
        assert!(matches!(
            BlockHeader::parse(header_bytes, 1020),
            Err(BlockError::Malformed { read: 1020 })
        ));
    }

    #[test]
    fn limits_are_exact() {
        let key = vec![1u8; MAX_KEY_LENGTH];
        let value = vec![2u8; MAX_VALUE_LENGTH];
        check_key_value(&key, &value).expect("maximum fits");
        assert_eq!(block_units(key.len(), value.len()), 255);
        assert_eq!(
            check_key_value(&key, &vec![0u8; MAX_VALUE_LENGTH + 1]),
            Err(LayoutError::ValueTooLarge {
                length: MAX_VALUE_LENGTH + 1
            })
        );
        assert!(check_key_value(b"", b"").is_err());
        assert!(check_key_value(&vec![0u8; MAX_KEY_LENGTH + 1], b"").is_err());
        assert!(LayoutError::ValueTooLarge { length: 1 }
            .to_string()
            .contains("16040"));
    }

    #[test]
    fn locations_are_deterministic_and_in_range() {
        let geometry = geometry();
        let first = geometry.locate(b"alpha");
        assert_eq!(first, geometry.locate(b"alpha"));
        assert!(first.combined_buckets.iter().all(|bucket| *bucket < 512));
        let other_seed = TableGeometry {
            hash_seed: 8,
            ..geometry
        };
        assert_ne!(
            other_seed.locate(b"alpha"),
            first,
            "the seed changes placement"
        );
        assert_eq!(geometry.heap_offset(), 64 * 1024);
        assert_eq!(geometry.region_size(), 64 * 1024 + (1 << 20));
    }
}
