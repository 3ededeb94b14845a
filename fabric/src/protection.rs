//! Protection: the memory protection table keyed by lkey/rkey, protection domains, memory
//! regions and type-2 memory windows, and the key checks a NIC makes.
//!
//! A memory region's key serves as both its lkey and its rkey (as on rxe). A memory window's key
//! is an rkey only, valid on the one queue pair it is bound to. Every entry holds an `Arc` of
//! the pinned memory it covers, so memory named by a live key is never unmapped.

use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use dashmap::DashMap;

use crate::device::DeviceInner;
use crate::error::{Error, Result};
use crate::lock;
use crate::memory::PinnedMemory;
use crate::revocation::RequesterInside;
use crate::seam::{KeyMirror, ProviderObject};
use crate::types::{AccessFlags, LocalSegment, Opcode, RemoteKey, WorkCompletionStatus};

/// One key's entry: the memory it covers and the rights it grants.
#[derive(Debug)]
pub(crate) struct ProtectionEntry {
    /// The protection domain the key belongs to.
    pub(crate) protection_domain: u32,
    /// The pinned block under the range; kept alive by the entry.
    pub(crate) memory: Arc<PinnedMemory>,
    /// Virtual address of the first covered byte.
    pub(crate) address: u64,
    /// Covered length.
    pub(crate) length: u64,
    /// Rights granted.
    pub(crate) access: AccessFlags,
    /// For a memory window: the queue pair it is bound to.
    pub(crate) bound_qp: Option<u32>,
}

impl ProtectionEntry {
    /// The offset into `memory` of `address`, if [address, address+length) is covered.
    pub(crate) fn memory_offset(&self, address: u64, length: u64) -> Option<u64> {
        let end = address.checked_add(length)?;
        if address < self.address || end > self.address + self.length {
            return None;
        }
        Some(address - self.memory.base_address())
    }
}

/// A resolved local buffer: the entry (which keeps the memory alive) and the offset into it.
#[derive(Debug, Clone)]
pub(crate) struct LocalTarget {
    /// The region's entry.
    pub(crate) entry: Arc<ProtectionEntry>,
    /// Offset of the buffer inside `entry.memory`.
    pub(crate) memory_offset: u64,
    /// Buffer length.
    pub(crate) length: u32,
}

/// The hasher of the protection table's keys: one multiplication by the golden ratio. Keys are
/// handed out by the table itself (a counter), never chosen by a peer, so no peer can make them
/// collide; a peer's unknown key is only looked up. SipHash cost a tenth of a post's
/// instructions (three key lookups per GET).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct KeyHasher(u64);

/// 2^64 divided by the golden ratio: consecutive keys land far apart, in every bit.
const KEY_MULTIPLIER: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*byte)).wrapping_mul(KEY_MULTIPLIER);
        }
    }

    fn write_u32(&mut self, key: u32) {
        self.0 = (self.0 ^ u64::from(key)).wrapping_mul(KEY_MULTIPLIER);
    }
}

/// The memory protection table of one device.
#[derive(Debug)]
pub(crate) struct ProtectionTable {
    /// Live keys.
    entries: DashMap<u32, Arc<ProtectionEntry>, BuildHasherDefault<KeyHasher>>,
    /// The next key; keys are never reused while the counter does not wrap.
    next_key: AtomicU32,
    /// A provider's copy of the keys, where its requesters read them (`shm`).
    mirror: OnceLock<Arc<dyn KeyMirror>>,
}

impl ProtectionTable {
    pub(crate) fn new(first_key: u32) -> Self {
        Self {
            entries: DashMap::with_hasher(BuildHasherDefault::default()),
            next_key: AtomicU32::new(first_key.max(1)),
            mirror: OnceLock::new(),
        }
    }

    /// Keeps `mirror` in step with every model-chosen key from now on.
    pub(crate) fn set_mirror(&self, mirror: Arc<dyn KeyMirror>) {
        let _ = self.mirror.set(mirror);
    }

    fn insert(&self, entry: ProtectionEntry) -> Result<u32> {
        loop {
            let key = self.next_key.fetch_add(1, Ordering::Relaxed);
            if key == 0 || self.entries.contains_key(&key) {
                continue;
            }
            let entry = Arc::new(entry);
            if let Some(mirror) = self.mirror.get() {
                mirror.publish(key, &entry)?;
            }
            self.entries.insert(key, entry);
            return Ok(key);
        }
    }

    /// Inserts an entry under a key the NIC chose (so in-flight requests can keep their memory
    /// alive by key).
    fn insert_with_key(&self, key: u32, entry: ProtectionEntry) {
        self.entries.insert(key, Arc::new(entry));
    }

    /// Removes a key: first out of the mirror (which waits until no requester can still be
    /// using it, or returns the one stopped inside a request), then the memory may go.
    fn remove(&self, key: u32) -> Option<RequesterInside> {
        let inside = self.mirror.get().and_then(|mirror| mirror.revoke(key));
        self.entries.remove(&key);
        inside
    }

    pub(crate) fn lookup(&self, key: u32) -> Option<Arc<ProtectionEntry>> {
        self.entries.get(&key).map(|entry| entry.clone())
    }

    /// The requester's check of a local buffer: lkey valid, same PD, a region (not a window),
    /// in range, and LOCAL_WRITE when the NIC writes into it.
    ///
    /// The statuses follow rxe (the reference the conformance suite runs against): a bad buffer
    /// fails LOC_PROT_ERR, except a WRITE source whose lkey is unknown (the requester cannot
    /// even look the region up while building the packet), which fails LOC_QP_OP_ERR.
    pub(crate) fn check_local(
        &self,
        protection_domain: u32,
        segment: &LocalSegment,
        opcode: Opcode,
        max_message_size: u32,
    ) -> std::result::Result<Option<LocalTarget>, WorkCompletionStatus> {
        Self::check_local_with(
            protection_domain,
            segment,
            opcode,
            max_message_size,
            |key| self.lookup(key),
        )
    }

    /// [`ProtectionTable::check_local`] for the requests of one post: the key is looked up
    /// only when it is not the one the post's previous request named (`last`), as a list's
    /// requests mostly name one buffer. The post's checks then see the table as it was at its
    /// first lookup of that key, as if they all ran at that instant.
    pub(crate) fn check_local_in_post(
        &self,
        protection_domain: u32,
        segment: &LocalSegment,
        opcode: Opcode,
        max_message_size: u32,
        last: &mut Option<(u32, Arc<ProtectionEntry>)>,
    ) -> std::result::Result<Option<LocalTarget>, WorkCompletionStatus> {
        Self::check_local_with(
            protection_domain,
            segment,
            opcode,
            max_message_size,
            |key| match last {
                Some((last_key, entry)) if *last_key == key => Some(entry.clone()),
                _ => {
                    let entry = self.lookup(key)?;
                    *last = Some((key, entry.clone()));
                    Some(entry)
                }
            },
        )
    }

    /// The checks of [`ProtectionTable::check_local`], with `lookup` finding a key's entry.
    fn check_local_with(
        protection_domain: u32,
        segment: &LocalSegment,
        opcode: Opcode,
        max_message_size: u32,
        lookup: impl FnOnce(u32) -> Option<Arc<ProtectionEntry>>,
    ) -> std::result::Result<Option<LocalTarget>, WorkCompletionStatus> {
        if opcode.is_atomic() && segment.length != 8 {
            return Err(WorkCompletionStatus::LocalLengthError);
        }
        if segment.length > max_message_size {
            return Err(WorkCompletionStatus::LocalLengthError);
        }
        if segment.length == 0 {
            return Ok(None);
        }
        let unknown_key = if opcode == Opcode::Write {
            WorkCompletionStatus::LocalQueuePairOperationError
        } else {
            WorkCompletionStatus::LocalProtectionError
        };
        let entry = lookup(segment.local_key).ok_or(unknown_key)?;
        if entry.protection_domain != protection_domain || entry.bound_qp.is_some() {
            return Err(unknown_key);
        }
        if opcode.writes_local_buffer() && !entry.access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(WorkCompletionStatus::LocalProtectionError);
        }
        let memory_offset = entry
            .memory_offset(segment.address, u64::from(segment.length))
            .ok_or(WorkCompletionStatus::LocalProtectionError)?;
        Ok(Some(LocalTarget {
            entry,
            memory_offset,
            length: segment.length,
        }))
    }

    /// The responder's check of a remote access: rkey valid, same PD, bound to this QP when it
    /// is a window, the right for the opcode, in range, and 8-byte alignment for atomics.
    /// Returns the entry and the offset into its memory.
    pub(crate) fn check_remote(
        &self,
        protection_domain: u32,
        qp_number: u32,
        remote_key: u32,
        address: u64,
        length: u64,
        opcode: Opcode,
    ) -> std::result::Result<(Arc<ProtectionEntry>, u64), WorkCompletionStatus> {
        let entry = self
            .lookup(remote_key)
            .ok_or(WorkCompletionStatus::RemoteAccessError)?;
        let rights = KeyRights {
            protection_domain: entry.protection_domain,
            bound_qp: entry.bound_qp,
            access: entry.access,
            address: entry.address,
            length: entry.length,
        };
        rights.check(protection_domain, qp_number, address, length, opcode)?;
        Ok((entry.clone(), address - entry.memory.base_address()))
    }
}

/// What a key grants, as a responder checks it (the model's table and the `shm` provider's
/// shared copy check the same way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyRights {
    /// The key's protection domain.
    pub(crate) protection_domain: u32,
    /// For a window: the queue pair it is bound to.
    pub(crate) bound_qp: Option<u32>,
    /// Rights granted.
    pub(crate) access: AccessFlags,
    /// Virtual address of the first covered byte.
    pub(crate) address: u64,
    /// Covered length.
    pub(crate) length: u64,
}

impl KeyRights {
    /// The responder's checks of one access, in rxe's order: same PD, bound to this QP when
    /// a window, the right for the opcode, in range, and 8-byte alignment for atomics.
    pub(crate) fn check(
        &self,
        protection_domain: u32,
        qp_number: u32,
        address: u64,
        length: u64,
        opcode: Opcode,
    ) -> std::result::Result<(), WorkCompletionStatus> {
        self.permits(protection_domain, qp_number, opcode)?;
        self.check_range(address, length, opcode)
    }

    /// The checks of [`KeyRights::check`] that do not depend on the address: the same for
    /// every access of `opcode` by queue pair `qp_number` in `protection_domain` (the `shm`
    /// provider's direct access makes them once per key and generation).
    pub(crate) fn permits(
        &self,
        protection_domain: u32,
        qp_number: u32,
        opcode: Opcode,
    ) -> std::result::Result<(), WorkCompletionStatus> {
        if self.protection_domain != protection_domain {
            return Err(WorkCompletionStatus::RemoteAccessError);
        }
        if self.bound_qp.is_some_and(|bound| bound != qp_number) {
            return Err(WorkCompletionStatus::RemoteAccessError);
        }
        if !self.access.contains(opcode.required_remote_access()) {
            return Err(WorkCompletionStatus::RemoteAccessError);
        }
        Ok(())
    }

    /// The rest of [`KeyRights::check`], after [`KeyRights::permits`]: in range, and 8-byte
    /// alignment for atomics.
    pub(crate) fn check_range(
        &self,
        address: u64,
        length: u64,
        opcode: Opcode,
    ) -> std::result::Result<(), WorkCompletionStatus> {
        let inside = address
            .checked_add(length)
            .is_some_and(|end| address >= self.address && end <= self.address + self.length);
        if !inside {
            return Err(WorkCompletionStatus::RemoteAccessError);
        }
        if opcode.is_atomic() && address % 8 != 0 {
            return Err(WorkCompletionStatus::RemoteInvalidRequestError);
        }
        Ok(())
    }
}

/// The shared part of a protection domain.
#[derive(Debug)]
pub(crate) struct ProtectionDomainInner {
    /// The device; kept alive by the domain.
    pub(crate) device: Arc<DeviceInner>,
    /// The domain's id within the device.
    pub(crate) id: u32,
}

/// A protection domain: regions, windows and queue pairs of one domain may be used together.
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<ProtectionDomainInner>,
}

impl ProtectionDomain {
    pub(crate) fn new(device: Arc<DeviceInner>) -> Self {
        let id = device.allocate_protection_domain_id();
        Self {
            inner: Arc::new(ProtectionDomainInner { device, id }),
        }
    }

    /// Registers `length` bytes of `memory` from `offset` with `access`. Registering the same
    /// memory twice gives two independent keys.
    ///
    /// # Errors
    /// [`Error::RangeOutsideParent`] when the range leaves the block.
    pub fn register(
        &self,
        memory: &Arc<PinnedMemory>,
        offset: u64,
        length: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        let address = memory.base_address() + offset;
        if offset
            .checked_add(length)
            .is_none_or(|end| end > memory.len())
            || length == 0
        {
            return Err(Error::RangeOutsideParent {
                address,
                length,
                parent_address: memory.base_address(),
                parent_length: memory.len(),
            });
        }
        let device = &self.inner.device;
        let entry = ProtectionEntry {
            protection_domain: self.inner.id,
            memory: memory.clone(),
            address,
            length,
            access,
            bound_qp: None,
        };
        let (key, remote_key, registration) =
            match device.provider.register(memory, offset, length, access)? {
                Some(registered) => {
                    device.table.insert_with_key(registered.local_key, entry);
                    (
                        registered.local_key,
                        registered.remote_key,
                        Some(registered.registration),
                    )
                }
                None => {
                    let key = device.table.insert(entry)?;
                    (key, key, None)
                }
            };
        device
            .gauges
            .live_memory_regions
            .fetch_add(1, Ordering::Relaxed);
        device
            .gauges
            .registered_bytes
            .fetch_add(length as i64, Ordering::Relaxed);
        tracing::debug!(
            local_key = key,
            remote_key,
            address,
            length,
            ?access,
            "registered memory region"
        );
        Ok(MemoryRegion {
            inner: Arc::new(MemoryRegionInner {
                protection_domain: self.clone(),
                key,
                remote_key,
                registration,
                memory: memory.clone(),
                offset,
                address,
                length,
                access,
            }),
        })
    }

    /// Registers the whole block.
    ///
    /// # Errors
    /// As [`ProtectionDomain::register`].
    pub fn register_all(
        &self,
        memory: &Arc<PinnedMemory>,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        self.register(memory, 0, memory.len(), access)
    }

    /// Allocates an unbound type-2 memory window; bind it with
    /// [`crate::QueuePair::bind_memory_window`].
    pub fn allocate_memory_window(&self) -> MemoryWindow {
        self.inner
            .device
            .gauges
            .live_memory_windows
            .fetch_add(1, Ordering::Relaxed);
        MemoryWindow {
            protection_domain: self.clone(),
            key: Mutex::new(None),
            binding: Mutex::new(None),
        }
    }

    /// The domain's id within its device.
    pub fn id(&self) -> u32 {
        self.inner.id
    }

    pub(crate) fn same_as(&self, other: &ProtectionDomain) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// The shared part of a memory region; dropping the last handle deregisters it.
#[derive(Debug)]
struct MemoryRegionInner {
    /// The parent domain, kept alive by the region.
    protection_domain: ProtectionDomain,
    /// lkey (and rkey, unless the NIC chose two keys).
    key: u32,
    /// rkey.
    remote_key: u32,
    /// The NIC's registration, when the NIC keeps its own keys; declared before `memory` so
    /// it is deregistered before the memory can be unmapped.
    #[allow(
        dead_code,
        reason = "the seam for NIC providers (verbs); a build without one has no caller"
    )]
    registration: Option<ProviderObject>,
    /// The pinned block.
    memory: Arc<PinnedMemory>,
    /// Offset of the region inside the block.
    offset: u64,
    /// Virtual address of the first byte.
    address: u64,
    /// Length.
    length: u64,
    /// Rights.
    access: AccessFlags,
}

impl Drop for MemoryRegionInner {
    fn drop(&mut self) {
        let device = &self.protection_domain.inner.device;
        let _ = device.table.remove(self.key);
        device
            .gauges
            .live_memory_regions
            .fetch_sub(1, Ordering::Relaxed);
        device
            .gauges
            .registered_bytes
            .fetch_sub(self.length as i64, Ordering::Relaxed);
        tracing::debug!(key = self.key, "deregistered memory region");
    }
}

/// A registered memory region. Clones share one registration; the last drop deregisters it,
/// after which its key fails with REM_ACCESS_ERR (remote) or LOC_PROT_ERR (local).
#[derive(Debug, Clone)]
pub struct MemoryRegion {
    inner: Arc<MemoryRegionInner>,
}

impl MemoryRegion {
    /// The local key.
    pub fn local_key(&self) -> u32 {
        self.inner.key
    }

    /// The remote key with the range it covers.
    pub fn remote_key(&self) -> RemoteKey {
        RemoteKey {
            key: self.inner.remote_key,
            address: self.inner.address,
            length: self.inner.length,
        }
    }

    /// Virtual address of the first byte.
    pub fn address(&self) -> u64 {
        self.inner.address
    }

    /// Length in bytes.
    pub fn length(&self) -> u64 {
        self.inner.length
    }

    /// Access rights.
    pub fn access(&self) -> AccessFlags {
        self.inner.access
    }

    /// The domain.
    pub fn protection_domain(&self) -> &ProtectionDomain {
        &self.inner.protection_domain
    }

    /// The NIC's registration, when the NIC keeps its own keys.
    #[allow(
        dead_code,
        reason = "the seam for NIC providers (verbs); a build without one has no caller"
    )]
    pub(crate) fn registration(&self) -> Option<&ProviderObject> {
        self.inner.registration.as_ref()
    }

    /// The pinned block under the region.
    pub fn memory(&self) -> &Arc<PinnedMemory> {
        &self.inner.memory
    }

    /// A local segment of `length` bytes at `offset` into the region (not range-checked here:
    /// the NIC checks it and fails the request with LOC_PROT_ERR).
    pub fn segment(&self, offset: u64, length: u32) -> LocalSegment {
        LocalSegment {
            address: self.inner.address + offset,
            length,
            local_key: self.inner.key,
        }
    }

    /// Calls `visit(line_offset, words)` for each 64-byte line of `[offset, offset + length)`
    /// (offsets in the region) that holds a non-zero word, with its eight words, each read with
    /// one atomic load.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] when the range leaves the region, [`Error::MisalignedAtomic`]
    /// when `offset` is not 8-byte aligned in the memory or `length` not a multiple of 64.
    pub fn visit_nonzero_lines(
        &self,
        offset: u64,
        length: u64,
        mut visit: impl FnMut(u64, [u64; 8]),
    ) -> Result<()> {
        self.check(offset, length)?;
        let base = self.inner.offset;
        self.inner
            .memory
            .visit_nonzero_lines(base + offset, length, |line_offset, words| {
                visit(line_offset - base, words)
            })
    }

    /// Copies bytes out of the region, starting `offset` bytes in.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] when the range leaves the region.
    pub fn read(&self, offset: u64, destination: &mut [u8]) -> Result<()> {
        self.check(offset, destination.len() as u64)?;
        self.inner
            .memory
            .read_into(self.inner.offset + offset, destination)
    }

    /// Copies `length` bytes, starting `offset` bytes in, into a new vector (not zeroed
    /// first).
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] when the range leaves the region.
    pub fn read_to_vec(&self, offset: u64, length: usize) -> Result<Vec<u8>> {
        self.check(offset, length as u64)?;
        self.inner
            .memory
            .read_to_vec(self.inner.offset + offset, length)
    }

    /// Appends `length` bytes, starting `offset` bytes in, to `destination` (not zeroed
    /// first); a vector with the room allocates nothing.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] when the range leaves the region (nothing is appended).
    pub fn read_append(&self, offset: u64, length: usize, destination: &mut Vec<u8>) -> Result<()> {
        self.check(offset, length as u64)?;
        self.inner
            .memory
            .read_append(self.inner.offset + offset, length, destination)
    }

    /// Copies bytes into the region, starting `offset` bytes in.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] when the range leaves the region.
    pub fn write(&self, offset: u64, source: &[u8]) -> Result<()> {
        self.check(offset, source.len() as u64)?;
        self.inner
            .memory
            .write_from(self.inner.offset + offset, source)
    }

    /// Loads the aligned word `offset` bytes in.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] or [`Error::MisalignedAtomic`].
    pub fn load_u64(&self, offset: u64) -> Result<u64> {
        self.check(offset, 8)?;
        self.inner.memory.load_u64(self.inner.offset + offset)
    }

    /// Stores `value` in the aligned word `offset` bytes in (one atomic store).
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`], [`Error::MisalignedAtomic`] or [`Error::ReadOnlyMemory`].
    pub fn store_u64(&self, offset: u64, value: u64) -> Result<()> {
        self.check(offset, 8)?;
        self.inner
            .memory
            .store_u64(self.inner.offset + offset, value)
    }

    /// Compares the aligned word `offset` bytes in with `expected` and, if equal, stores `new`;
    /// returns the original value, as an RDMA CAS does.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] or [`Error::MisalignedAtomic`].
    pub fn compare_exchange_u64(&self, offset: u64, expected: u64, new: u64) -> Result<u64> {
        self.check(offset, 8)?;
        self.inner
            .memory
            .compare_exchange_u64(self.inner.offset + offset, expected, new)
    }

    fn check(&self, offset: u64, length: u64) -> Result<()> {
        match offset.checked_add(length) {
            Some(end) if end <= self.inner.length => Ok(()),
            _ => Err(Error::MemoryOutOfBounds {
                offset,
                length,
                size: self.inner.length,
            }),
        }
    }
}

/// A type-2 memory window. Bound to one queue pair, its rkey is valid only on that queue pair;
/// invalidating or dropping it revokes the rkey at once.
#[derive(Debug)]
pub struct MemoryWindow {
    /// The parent domain.
    protection_domain: ProtectionDomain,
    /// The rkey of the current binding, if bound.
    key: Mutex<Option<u32>>,
    /// When the NIC binds windows itself: its binding (the NIC's window, and whatever must stay
    /// registered while the window may be used). Dropped on invalidation, which revokes it.
    pub(crate) binding: Mutex<Option<ProviderObject>>,
}

impl MemoryWindow {
    /// The domain.
    pub fn protection_domain(&self) -> &ProtectionDomain {
        &self.protection_domain
    }

    /// Checks a bind: the range lies inside the region, which allows MW_BIND.
    pub(crate) fn check_bind(
        &self,
        region: &MemoryRegion,
        address: u64,
        length: u64,
    ) -> Result<()> {
        let parent = region.remote_key();
        if address < parent.address
            || address
                .checked_add(length)
                .is_none_or(|end| end > parent.address + parent.length)
        {
            return Err(Error::RangeOutsideParent {
                address,
                length,
                parent_address: parent.address,
                parent_length: parent.length,
            });
        }
        if !region.access().contains(AccessFlags::MW_BIND) {
            return Err(Error::ObjectMismatch {
                reason: format!(
                    "memory region {} was not registered with MW_BIND",
                    region.local_key()
                ),
            });
        }
        Ok(())
    }

    /// Records the key of a binding made by the NIC, replacing any earlier one.
    #[allow(
        dead_code,
        reason = "the seam for NIC providers (verbs); a build without one has no caller"
    )]
    pub(crate) fn set_key(&self, key: u32) {
        *lock(&self.key) = Some(key);
    }

    /// Binds the window in the device's protection table (emulated providers; replacing any
    /// earlier binding, whose key dies) and returns the new key. The caller has checked the
    /// bind ([`MemoryWindow::check_bind`]).
    pub(crate) fn bind(
        &self,
        region: &MemoryRegion,
        address: u64,
        length: u64,
        access: AccessFlags,
        qp_number: u32,
    ) -> Result<RemoteKey> {
        let granted = access
            & (AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC);
        let device = &self.protection_domain.inner.device;
        let key = device.table.insert(ProtectionEntry {
            protection_domain: self.protection_domain.inner.id,
            memory: region.memory().clone(),
            address,
            length,
            access: granted,
            bound_qp: Some(qp_number),
        })?;
        let previous = lock(&self.key).replace(key);
        if let Some(previous) = previous {
            let _ = device.table.remove(previous);
        }
        tracing::debug!(
            remote_key = key,
            address,
            length,
            qp_number,
            "bound memory window"
        );
        Ok(RemoteKey {
            key,
            address,
            length,
        })
    }

    /// Revokes the current binding, if any: its rkey fails from now on. Returns the requester
    /// that was still inside a request with it past the retry timeout (`shm`: a client
    /// process stopped there), which may still finish that request: the memory it covers
    /// must not be reused before [`RequesterInside::left`].
    pub fn invalidate(&self) -> Option<RequesterInside> {
        let previous = lock(&self.key).take();
        // Dropping the NIC's binding (deallocating its window) revokes its key whatever its
        // queue pair's state.
        let binding = lock(&self.binding).take();
        drop(binding);
        let key = previous?;
        let inside = self.protection_domain.inner.device.table.remove(key);
        tracing::debug!(
            remote_key = key,
            requester_inside = inside.is_some(),
            "invalidated memory window"
        );
        inside
    }

    /// The current rkey, if bound.
    pub fn remote_key(&self) -> Option<u32> {
        *lock(&self.key)
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        self.invalidate();
        self.protection_domain
            .inner
            .device
            .gauges
            .live_memory_windows
            .fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::hash::Hasher;

    use super::KeyHasher;

    fn hash(key: u32) -> u64 {
        let mut hasher = KeyHasher::default();
        hasher.write_u32(key);
        hasher.finish()
    }

    /// Consecutive keys (as the table hands them out) spread over the bits a hash table uses:
    /// the low bits pick the bucket, the top 7 the control byte, the bits below them the shard.
    #[test]
    fn consecutive_keys_spread_over_every_part_of_the_hash() {
        let hashes: Vec<u64> = (1..=4096).map(hash).collect();
        let distinct = |part: &dyn Fn(u64) -> u64| -> usize {
            hashes
                .iter()
                .map(|hash| part(*hash))
                .collect::<HashSet<_>>()
                .len()
        };
        assert_eq!(distinct(&|hash| hash), 4096);
        assert!(distinct(&|hash| hash & 0xFFF) > 2500, "low bits");
        assert_eq!(distinct(&|hash| hash >> 57), 128, "control byte");
        assert_eq!(distinct(&|hash| (hash << 7) >> 59), 32, "shard (32 shards)");
    }
}
