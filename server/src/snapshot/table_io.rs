//! The table side of a snapshot: reading the committed keys and values out of the live table
//! while clients write, and writing a snapshot's keys into the empty table before the node
//! serves.
//!
//! **Reading a block safely.** A snapshot reads each readable slot's block with local loads,
//! as a client READs it, and keeps the key and value only if the slot still holds the same word
//! afterwards (one more atomic load). A heap extent is reused only after no slot referenced it
//! at a collector scan (`docs/protocol.md`, *Heap space*), so a block whose slot referenced it
//! before and after the copy was not reused in between; a slot word that came back to the same
//! value by way of a reuse (the same key, length and offset) still has to pass the block's
//! checksum, which a copy that mixed two blocks fails. A slot that changed is read again.

use rdkv_common::layout::{
    block_units, check_key_value, encode_block_with, KeyLocation, Slot, SlotPosition, BLOCK_UNIT,
    HASH_CHOICES, SLOTS_PER_COMBINED_BUCKET,
};

use crate::heap::{Grant, Heap, LOADER};
use crate::table::TableRegion;

/// Tries per slot before the scan gives up on a key that keeps changing (a hot key written
/// thousands of times a second): its last value is then whatever the next snapshot sees.
const READ_ATTEMPTS: u32 = 8;

/// What one scan of the table found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ScanCounts {
    /// Keys handed to the sink.
    pub keys: u64,
    /// Keys skipped because their slot changed on every try.
    pub skipped: u64,
}

/// Hands every committed (or locked: readers see its committed value) key that is not a
/// tombstone to `sink`, with its value and its block's version, in index order. Stops at the first error of the sink.
///
/// # Errors
/// The sink's.
pub fn scan_table<E>(
    table: &TableRegion,
    mut sink: impl FnMut(&[u8], &[u8], u64) -> Result<(), E>,
) -> Result<ScanCounts, E> {
    let mut counts = ScanCounts::default();
    let mut failure = None;
    let mut buffer = Vec::new();
    table.for_each_slot(|index_offset, first_seen| {
        if failure.is_some() {
            return;
        }
        let mut slot = first_seen;
        for _ in 0..READ_ATTEMPTS {
            if !slot.is_readable() || slot.is_tombstone() {
                return;
            }
            if let Some(block) = table.read_block(slot, &mut buffer) {
                let unchanged = table
                    .region
                    .load_u64(index_offset)
                    .is_ok_and(|now| now == slot.0);
                if unchanged {
                    if !block.tombstone {
                        if let Err(error) = sink(block.key, block.value, block.version) {
                            failure = Some(error);
                        }
                        counts.keys += 1;
                    }
                    return;
                }
            }
            match table.region.load_u64(index_offset) {
                Ok(word) => slot = Slot(word),
                Err(_) => return,
            }
        }
        counts.skipped += 1;
    });
    match failure {
        Some(error) => Err(error),
        None => Ok(counts),
    }
}

/// Writes keys into a table that no client writes: each block into heap space the loader
/// owns (synchronously, as the compactor writes), then its slot, committed. A key already in
/// the table is replaced when the new copy is newer by version, or as new: a snapshot written
/// while clients wrote may hold a key twice (deleted and inserted again into a slot the scan
/// had not reached), and the later copy is the newer (a file of the format before versions
/// gives every key version 0). [`Loader::keep_newest`] replaces only a strictly older copy, for
/// the newest-wins reconciliation of a whole-cluster start (`crate::reconcile`).
/// Drop it, or call [`Loader::finish`], to seal its last grant.
#[derive(Debug)]
pub struct Loader<'table> {
    table: &'table TableRegion,
    heap: &'table Heap,
    /// The grant being filled and the bytes used in it.
    place: Option<(Grant, u64)>,
    block: Vec<u8>,
    /// The blocks read to find a key already loaded.
    lookup: Vec<u8>,
    keys: u64,
}

/// Tries of a replacement whose slot changed under it (the compactor moved the block).
const REPLACE_ATTEMPTS: u32 = 8;

/// Which copy already in the table a new one leaves in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    /// A strictly newer one (a key a snapshot holds twice: the later copy wins a tie).
    Newer,
    /// One of the same version or newer (newest-wins reconciliation: a tie changes nothing).
    NewerOrEqual,
    /// None: the new copy replaces whatever is there.
    Nothing,
}

impl Keep {
    /// Whether a copy of version `existing` stays against one of version `new`.
    fn keeps(self, existing: u64, new: u64) -> bool {
        match self {
            Keep::Newer => existing > new,
            Keep::NewerOrEqual => existing >= new,
            Keep::Nothing => false,
        }
    }
}

/// The key's copy already in the table.
#[derive(Debug, Clone, Copy)]
struct Existing {
    /// Its slot's offset in the index.
    index_offset: u64,
    /// The slot's word.
    word: u64,
    /// Its block's version.
    version: u64,
}

impl<'table> Loader<'table> {
    /// A loader into `table`, whose heap is `heap`.
    pub fn new(table: &'table TableRegion, heap: &'table Heap) -> Self {
        Self {
            table,
            heap,
            place: None,
            block: Vec::new(),
            lookup: Vec::new(),
            keys: 0,
        }
    }

    /// Keys written so far into empty slots.
    pub fn keys(&self) -> u64 {
        self.keys
    }

    /// Writes one key of `version`, replacing a copy of the same version or older (a snapshot
    /// holds each key once, but may hold it twice).
    ///
    /// # Errors
    /// A line saying why: the key or value breaks the layout's limits, the heap or the key's
    /// buckets are full.
    pub fn insert(&mut self, key: &[u8], value: &[u8], version: u64) -> Result<(), String> {
        self.place(key, value, version, Keep::Newer).map(|_| ())
    }

    /// Writes one key of `version` unless the table holds a copy of that version or newer;
    /// whether it wrote it.
    ///
    /// # Errors
    /// As [`Loader::insert`].
    pub fn keep_newest(&mut self, key: &[u8], value: &[u8], version: u64) -> Result<bool, String> {
        self.place(key, value, version, Keep::NewerOrEqual)
    }

    /// Writes one key of `version` over whatever copy the table holds, newer or not: the
    /// reconciliation's replacement of a copy another node's decides over
    /// (`crate::reconcile`).
    ///
    /// # Errors
    /// As [`Loader::insert`].
    pub fn replace(&mut self, key: &[u8], value: &[u8], version: u64) -> Result<(), String> {
        self.place(key, value, version, Keep::Nothing).map(|_| ())
    }

    /// Empties the slot holding `key`, if any: its block is then unreferenced, and comes back
    /// as a deleted key's does. Whether a copy was removed.
    ///
    /// # Errors
    /// A line saying why: the slot changed under it every time.
    pub fn remove(&mut self, key: &[u8]) -> Result<bool, String> {
        let location = self.table.geometry.locate(key);
        for _ in 0..REPLACE_ATTEMPTS {
            let Some(existing) = self.find(key, location) else {
                return Ok(false);
            };
            if self
                .table
                .empty_slot(existing.index_offset, Slot(existing.word))
            {
                return Ok(true);
            }
        }
        Err(format!(
            "a key's slot changed {REPLACE_ATTEMPTS} times while it was being removed"
        ))
    }

    /// Writes the key's block and points a slot at it: the key's slot unless `keep` keeps the
    /// copy there, else an empty one; whether it did.
    fn place(
        &mut self,
        key: &[u8],
        value: &[u8],
        version: u64,
        keep: Keep,
    ) -> Result<bool, String> {
        check_key_value(key, value)
            .map_err(|error| format!("key {} of the snapshot: {error}", self.keys + 1))?;
        let location = self.table.geometry.locate(key);
        let mut written: Option<Slot> = None;
        for _ in 0..REPLACE_ATTEMPTS {
            let existing = self.find(key, location);
            if existing.is_some_and(|existing| keep.keeps(existing.version, version)) {
                return Ok(false);
            }
            let slot = match written {
                Some(slot) => slot,
                None => *written.insert(self.write_block(key, value, version, location)?),
            };
            match existing {
                Some(existing) => {
                    let swapped = self
                        .table
                        .region
                        .compare_exchange_u64(existing.index_offset, existing.word, slot.0)
                        .is_ok_and(|original| original == existing.word);
                    if swapped {
                        return Ok(true);
                    }
                }
                None => return self.place_in_empty_slot(location, slot).map(|()| true),
            }
        }
        Err(format!(
            "a key's slot changed {REPLACE_ATTEMPTS} times while it was being replaced"
        ))
    }

    /// Writes the block of `key`, `value` and `version` into the loader's heap space; its
    /// committed slot word.
    fn write_block(
        &mut self,
        key: &[u8],
        value: &[u8],
        version: u64,
        location: KeyLocation,
    ) -> Result<Slot, String> {
        let length = u64::from(block_units(key.len(), value.len())) * BLOCK_UNIT;
        let offset = self.reserve(length)?;
        let units = encode_block_with(key, value, false, version, &mut self.block);
        let heap_base = self.table.geometry.heap_offset();
        self.table
            .region
            .write(heap_base + offset, &self.block)
            .map_err(|error| format!("writing a block into the heap: {error}"))?;
        Ok(Slot::new(location.fingerprint, units, offset))
    }

    /// Points the first empty candidate slot of the key at `slot`'s block.
    fn place_in_empty_slot(&mut self, location: KeyLocation, slot: Slot) -> Result<(), String> {
        for choice in 0..HASH_CHOICES {
            for position in 0..SLOTS_PER_COMBINED_BUCKET {
                let index_offset = self.table.geometry.slot_offset(SlotPosition {
                    choice,
                    combined_bucket: location.combined_buckets[choice],
                    slot: position,
                });
                let placed = self
                    .table
                    .region
                    .compare_exchange_u64(index_offset, Slot::EMPTY.0, slot.0)
                    .is_ok_and(|original| original == Slot::EMPTY.0);
                if placed {
                    self.keys += 1;
                    return Ok(());
                }
            }
        }
        Err(format!(
            "both buckets of a key are full after {} keys: this node's index_size is too small for the snapshot; raise it (docs/operations.md, Sizing the heap)",
            self.keys
        ))
    }

    /// The committed (or locked) slot already holding `key`, with its block's version; a
    /// tombstone counts as a copy (of the key's absence).
    fn find(&mut self, key: &[u8], location: KeyLocation) -> Option<Existing> {
        for choice in 0..HASH_CHOICES {
            for position in 0..SLOTS_PER_COMBINED_BUCKET {
                let index_offset = self.table.geometry.slot_offset(SlotPosition {
                    choice,
                    combined_bucket: location.combined_buckets[choice],
                    slot: position,
                });
                let Ok(word) = self.table.region.load_u64(index_offset) else {
                    continue;
                };
                let found = Slot(word);
                if !found.is_readable() || found.fingerprint() != location.fingerprint {
                    continue;
                }
                let version = self
                    .table
                    .read_block(found, &mut self.lookup)
                    .filter(|block| block.key == key)
                    .map(|block| block.version);
                if let Some(version) = version {
                    return Some(Existing {
                        index_offset,
                        word,
                        version,
                    });
                }
            }
        }
        None
    }

    /// The heap offset of `length` free bytes in the loader's grant, taking a new one (a
    /// chunk) when it is full.
    fn reserve(&mut self, length: u64) -> Result<u64, String> {
        if let Some((grant, used)) = &mut self.place {
            if *used + length <= grant.length() {
                let offset = grant.heap_offset() + *used;
                *used += length;
                return Ok(offset);
            }
        }
        let Some(grant) = self.heap.allocate(LOADER, 0, length) else {
            return Err(format!(
                "the heap is full after {} keys ({} bytes used of {}): this node's heap_size is too small for the snapshot; raise it (docs/operations.md, Sizing the heap)",
                self.keys,
                self.heap.used_bytes(),
                self.heap.size_bytes()
            ));
        };
        self.place = Some((grant, length));
        Ok(grant.heap_offset())
    }

    /// Seals the last grant; returns the keys written.
    pub fn finish(self) -> u64 {
        self.keys
    }
}

impl Drop for Loader<'_> {
    fn drop(&mut self) {
        self.heap.seal_owned_by(LOADER);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::EXTENT_SIZE;
    use rdkv_common::layout::TableGeometry;
    use rdkv_fabric::memory::{HugepagePolicy, PinLimits};
    use rdkv_fabric::{Device, DeviceConfig};
    use std::time::Duration;

    fn table(bucket_count: u64, heap_extents: u64, seed: u64) -> (TableRegion, Heap) {
        let device = Device::loopback(DeviceConfig::default());
        let geometry = TableGeometry {
            bucket_count,
            heap_size: heap_extents * EXTENT_SIZE,
            chunk_size: 4 * EXTENT_SIZE,
            hash_seed: seed,
        };
        let table = TableRegion::allocate(
            &device,
            geometry,
            HugepagePolicy::Off,
            PinLimits::default(),
            false,
        )
        .expect("a table");
        (table, Heap::new(&geometry, Duration::from_secs(1)))
    }

    fn scanned(table: &TableRegion) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut found = Vec::new();
        let counts = scan_table(table, |key, value, _version| {
            found.push((key.to_vec(), value.to_vec()));
            Ok::<(), ()>(())
        })
        .expect("the sink never fails");
        assert_eq!(counts.keys, found.len() as u64);
        assert_eq!(counts.skipped, 0);
        found.sort();
        found
    }

    /// Keys loaded into one table (one hash seed) scan back whole, and load into a table of
    /// another seed and shape the same: a snapshot is keys and values, not positions.
    #[test]
    fn loaded_keys_scan_back_and_move_to_a_table_of_another_seed() {
        let (first, first_heap) = table(256, 128, 1);
        let mut expected: Vec<(Vec<u8>, Vec<u8>)> = (0..300u32)
            .map(|number| {
                let key = format!("key-{number}").into_bytes();
                let value = vec![number as u8; (number as usize * 7) % 2000];
                (key, value)
            })
            .collect();
        let mut loader = Loader::new(&first, &first_heap);
        for (key, value) in &expected {
            loader.insert(key, value, 1).expect("room for every key");
        }
        assert_eq!(loader.finish(), 300);
        expected.sort();
        let found = scanned(&first);
        assert_eq!(found, expected);

        let (second, second_heap) = table(512, 128, 99);
        let mut loader = Loader::new(&second, &second_heap);
        for (key, value) in &found {
            loader.insert(key, value, 1).expect("room for every key");
        }
        drop(loader);
        assert_eq!(scanned(&second), expected);
        assert_eq!(second.count_keys(), 300);
    }

    /// A key twice in a snapshot (moved between its buckets during the scan) loads once, with
    /// the later value.
    #[test]
    fn a_key_loaded_twice_keeps_the_later_value() {
        let (table, heap) = table(64, 16, 9);
        let mut loader = Loader::new(&table, &heap);
        loader.insert(b"twice", b"first", 0).expect("room");
        loader.insert(b"other", b"value", 0).expect("room");
        loader.insert(b"twice", b"second", 0).expect("room");
        drop(loader);
        assert_eq!(
            scanned(&table),
            vec![
                (b"other".to_vec(), b"value".to_vec()),
                (b"twice".to_vec(), b"second".to_vec())
            ]
        );
    }

    /// Versions decide between two copies of a key: a loaded copy replaces an older one, never
    /// a newer one; [`Loader::keep_newest`] also keeps a copy of the same version.
    #[test]
    fn the_newest_copy_of_a_key_wins() {
        let (table, heap) = table(64, 16, 4);
        let mut loader = Loader::new(&table, &heap);
        loader.insert(b"key", b"newer", 20).expect("room");
        loader.insert(b"key", b"older", 10).expect("room");
        assert!(!loader.keep_newest(b"key", b"same", 20).expect("room"));
        assert!(!loader.keep_newest(b"key", b"older", 19).expect("room"));
        assert!(loader.keep_newest(b"absent", b"first", 1).expect("room"));
        drop(loader);
        let mut found = Vec::new();
        scan_table(&table, |key, value, version| {
            found.push((key.to_vec(), value.to_vec(), version));
            Ok::<(), ()>(())
        })
        .expect("the sink never fails");
        found.sort();
        assert_eq!(
            found,
            vec![
                (b"absent".to_vec(), b"first".to_vec(), 1),
                (b"key".to_vec(), b"newer".to_vec(), 20)
            ]
        );
        let mut loader = Loader::new(&table, &heap);
        assert!(loader.keep_newest(b"key", b"newest", 21).expect("room"));
        drop(loader);
        assert_eq!(table.count_keys(), 2);
    }

    /// Tombstones and tentative slots are not keys; a locked slot's committed value is.
    #[test]
    fn the_scan_keeps_readable_values_only() {
        let (table, heap) = table(64, 16, 3);
        let mut loader = Loader::new(&table, &heap);
        for key in ["kept", "locked", "tombstone", "tentative"] {
            loader.insert(key.as_bytes(), b"value", 0).expect("room");
        }
        drop(loader);
        let mut words = Vec::new();
        table.for_each_slot(|offset, slot| words.push((offset, slot)));
        let mut buffer = Vec::new();
        for (offset, slot) in words {
            let key = table
                .read_block(slot, &mut buffer)
                .expect("intact")
                .key
                .to_vec();
            let replaced = match key.as_slice() {
                b"locked" => slot.locked(),
                b"tombstone" => slot.tombstone(),
                b"tentative" => slot.tentative(),
                _ => continue,
            };
            table
                .region
                .compare_exchange_u64(offset, slot.0, replaced.0)
                .expect("swap");
        }
        let keys: Vec<Vec<u8>> = scanned(&table).into_iter().map(|(key, _)| key).collect();
        assert_eq!(keys, vec![b"kept".to_vec(), b"locked".to_vec()]);
    }

    /// A snapshot bigger than the heap, or a key whose buckets are full, fails with the
    /// setting to raise.
    #[test]
    fn a_table_too_small_says_which_setting_to_raise() {
        let (small_heap, heap) = table(1024, 8, 5);
        let mut loader = Loader::new(&small_heap, &heap);
        let value = vec![7u8; 4000];
        let error = (0..100u32)
            .find_map(|number| loader.insert(&number.to_le_bytes(), &value, 0).err())
            .expect("8 extents cannot hold 100 blocks of 4 KB");
        assert!(error.contains("heap_size"), "{error}");

        let (small_index, heap) = table(2, 64, 5);
        let mut loader = Loader::new(&small_index, &heap);
        let error = (0..100u32)
            .find_map(|number| loader.insert(&number.to_le_bytes(), b"v", 0).err())
            .expect("one combined bucket holds 16 keys");
        assert!(error.contains("index_size"), "{error}");
        assert_eq!(loader.keys(), 16);
    }
}
