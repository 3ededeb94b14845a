//! The table region: one pinned block holding the index and the heap, registered once before the
//! first client is accepted.
//!
//! The region's own memory region carries no remote rights at all (`LOCAL_WRITE | MW_BIND`):
//! every remote access goes through memory windows bound to one client's queue pair, so every
//! rkey a client ever holds is its own and dies with its connection.

use std::sync::Arc;

use rdkv_common::layout::{decode_block, Block, Slot, TableGeometry};
use rdkv_fabric::memory::{HugepagePolicy, PinLimits, PinnedMemory};
use rdkv_fabric::{AccessFlags, Device, MemoryRegion, ProtectionDomain};

use crate::error::Result;

/// The registered table.
#[derive(Debug)]
pub struct TableRegion {
    /// The shape.
    pub geometry: TableGeometry,
    /// The registration (no remote rights; windows are bound over it).
    pub region: MemoryRegion,
    /// The protection domain of the region and of every client queue pair.
    pub domain: ProtectionDomain,
    /// The device.
    pub device: Device,
}

impl TableRegion {
    /// Allocates, pins and registers the region; `shareable`: as a memory file, so an `shm`
    /// device can offer it to processes on this host.
    ///
    /// # Errors
    /// The memory layer's errors (memlock, RAM share, hugepages), each naming its fix.
    pub fn allocate(
        device: &Device,
        geometry: TableGeometry,
        hugepages: HugepagePolicy,
        limits: PinLimits,
        shareable: bool,
    ) -> Result<Self> {
        let allocate = if shareable {
            PinnedMemory::allocate_shared
        } else {
            PinnedMemory::allocate
        };
        let memory = Arc::new(allocate(geometry.region_size(), hugepages, limits)?);
        Self::register(device, geometry, &memory)
    }

    /// The same table registered on another device too (the node's `shm` fabric next to its
    /// main one): one memory, one registration per device, windows bound on either.
    ///
    /// # Errors
    /// Registration errors ([`rdkv_fabric::Error::NotShareable`] unless the table was
    /// allocated shareable).
    pub fn also_on(&self, device: &Device) -> Result<Self> {
        Self::register(device, self.geometry, self.region.memory())
    }

    fn register(
        device: &Device,
        geometry: TableGeometry,
        memory: &Arc<PinnedMemory>,
    ) -> Result<Self> {
        let memory = memory.clone();
        let domain = device.allocate_protection_domain();
        let region = domain.register(
            &memory,
            0,
            geometry.region_size(),
            AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
        )?;
        // One line per fabric the table is registered on (a node with an shm fabric beside
        // its main one logs two, one memory).
        tracing::info!(
            fabric = %device.backend(),
            buckets = geometry.bucket_count,
            heap_bytes = geometry.heap_size,
            chunk_bytes = geometry.chunk_size,
            region_bytes = geometry.region_size(),
            backing = memory.backing().name(),
            "table registered"
        );
        Ok(Self {
            geometry,
            region,
            domain,
            device: device.clone(),
        })
    }

    /// Virtual address of the index.
    pub fn index_address(&self) -> u64 {
        self.region.address()
    }

    /// Virtual address of the heap.
    pub fn heap_address(&self) -> u64 {
        self.region.address() + self.geometry.heap_offset()
    }

    /// Visits every non-empty slot with its offset in the index (atomic loads; the control
    /// plane's view, never the data path).
    pub fn for_each_slot(&self, visit: impl FnMut(u64, Slot)) {
        self.visit_slots(visit);
    }

    /// Empties the slot at `index_offset` if it still holds exactly `slot` (one CAS): a word
    /// that a writer replaced, locked or moved meanwhile stays. Whether it emptied it.
    pub fn empty_slot(&self, index_offset: u64, slot: Slot) -> bool {
        self.region
            .compare_exchange_u64(index_offset, slot.0, Slot::EMPTY.0)
            .is_ok_and(|original| original == slot.0)
    }

    /// Reads the block `slot` points at into `buffer` and decodes it; `None` when it is not an
    /// intact block (the slot changed since it was read, and the block was reused).
    pub fn read_block<'buffer>(
        &self,
        slot: Slot,
        buffer: &'buffer mut Vec<u8>,
    ) -> Option<Block<'buffer>> {
        buffer.resize(slot.block_length() as usize, 0);
        self.region
            .read(self.geometry.heap_offset() + slot.offset(), buffer)
            .ok()?;
        decode_block(buffer).ok()
    }

    /// Empties every slot that holds what it held when the scan read it (a CAS per slot): a
    /// node that comes back with its memory (it was cut off, or paused) forgets what it held,
    /// which may be stale, before its refill copies the keys again; a slot a writer changed
    /// meanwhile holds a fresh value and stays. Returns the slots emptied.
    pub fn clear_slots(&self) -> u64 {
        let mut cleared = 0;
        self.visit_slots(|index_offset, slot: Slot| {
            cleared += u64::from(self.empty_slot(index_offset, slot));
        });
        cleared
    }

    /// Committed keys now, by a scan of the index: exact when no write is in flight.
    pub fn count_keys(&self) -> u64 {
        let mut keys = 0;
        self.visit_slots(|_, slot: Slot| keys += u64::from(slot.is_readable()));
        keys
    }

    fn visit_slots(&self, mut visit: impl FnMut(u64, Slot)) {
        // Each 8-byte word is read with one atomic load (a slot is never torn). Most of an
        // index is empty (it is sized at 64 bytes a key), so a bucket's eight words are tested
        // together before any is looked at alone, straight from the memory (no copy).
        self.region
            .visit_nonzero_lines(0, self.geometry.index_size(), |bucket_offset, words| {
                let mut slot_offset = bucket_offset;
                for value in &words {
                    if *value != 0 {
                        visit(slot_offset, Slot(*value));
                    }
                    slot_offset += 8;
                }
            })
            // Never skipped: a slot the collector missed would let its block's extent be reused.
            .expect("the index is whole 64-byte buckets of aligned words at the region's start");
    }
}
