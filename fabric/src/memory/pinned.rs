//! [`PinnedMemory`]: one page-aligned mapping, advised `MADV_DONTFORK`, locked with `mlock`,
//! and accessed only through aligned 8-byte atomics.
//!
//! Every access but one is a load, store, compare-exchange or fetch-add on an aligned
//! `AtomicU64`; the exception, a value's bulk copy out ([`PinnedMemory::read_append`]), reads
//! 64 or 128 bytes at a time (SSE2, AVX) on x86-64 and may see a concurrent write in part
//! (`super::bulk_copy`). Copies that start or end inside a word merge their bytes into that word
//! with a compare-exchange loop, so no two accesses of different sizes ever overlap and a reader
//! can never observe half of an 8-byte word that a CAS wrote.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::memory::limits::{
    decide_available_memory, decide_hugepages, decide_memlock, raise_memlock_soft_limit,
    read_meminfo, read_memlock_figures, HugepagePolicy, MemlockDecision, PinLimits, HUGEPAGE_SIZE,
};

/// The size of a standard page.
const PAGE_SIZE: u64 = 4096;
/// Bytes locked per `mlock` call (a multiple of every page size).
const PIN_PIECE: u64 = 64 << 20;

/// Bytes pinned by every live [`PinnedMemory`] in this process.
static PINNED_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes currently pinned by this process through [`PinnedMemory`].
pub fn pinned_bytes() -> u64 {
    PINNED_BYTES.load(Ordering::Relaxed)
}

/// Which pages back a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageBacking {
    /// 2 MiB hugetlb pages (MAP_HUGETLB).
    Hugetlb,
    /// 4 KiB pages advised MADV_HUGEPAGE, which the kernel may back with transparent hugepages.
    TransparentHugepages,
    /// Plain 4 KiB pages.
    StandardPages,
}

impl PageBacking {
    /// A short name for logs.
    pub fn name(self) -> &'static str {
        match self {
            PageBacking::Hugetlb => "2 MiB hugetlb pages",
            PageBacking::TransparentHugepages => "transparent hugepages (madvise)",
            PageBacking::StandardPages => "4 KiB pages",
        }
    }
}

/// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` (empty when it cannot be read).
fn read_shmem_hugepage_setting() -> String {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").unwrap_or_default()
}

/// Whether a memory file advised MADV_HUGEPAGE can get transparent hugepages under this
/// `shmem_enabled` setting (the selected value is in brackets): not under `never` or `deny`.
fn shmem_hugepages_possible(setting: &str) -> bool {
    ["[always]", "[within_size]", "[advise]", "[force]"]
        .iter()
        .any(|selected| setting.contains(selected))
}

/// A pinned, page-aligned block of memory that the fabric can register.
#[derive(Debug)]
pub struct PinnedMemory {
    /// Start of the mapping; page-aligned, so every multiple of 8 from here is 8-byte aligned.
    base: NonNull<u8>,
    /// Length of the mapping in bytes; a multiple of the page size.
    length: u64,
    /// How the mapping is backed, for logs and tests.
    backing: PageBacking,
    /// Whether this process locked the mapping (and counts it in [`pinned_bytes`]); a peer's
    /// mapping of shared memory is pinned by its owner.
    locked: bool,
    /// Whether stores are allowed (a peer's read-only mapping refuses them before they fault).
    writable: bool,
    /// The memory file behind a shareable mapping ([`PinnedMemory::allocate_shared`]).
    shared: Option<SharedFile>,
}

/// The memory file of a shareable block: a peer process maps the same pages through it.
#[derive(Debug)]
struct SharedFile {
    /// The memfd.
    descriptor: OwnedFd,
    /// A process-unique number, never reused: a peer tells the blocks it mapped apart by it.
    id: u64,
}

/// The next shared block's id.
static NEXT_SHARED_ID: AtomicU64 = AtomicU64::new(1);

// SAFETY: the mapping is owned exclusively by this value (only `Drop` unmaps it) and every
// access goes through atomic views, so moving it to or sharing it with other threads cannot
// create a data race; see the module docs of `memory`.
unsafe impl Send for PinnedMemory {}
// SAFETY: as for `Send`: all shared access is atomic.
unsafe impl Sync for PinnedMemory {}

impl PinnedMemory {
    /// Maps, advises and pins at least `length` bytes, after checking memlock, RAM and hugepages.
    ///
    /// # Errors
    /// [`Error::MemlockLimit`], [`Error::InsufficientMemory`] or [`Error::HugepagesUnavailable`]
    /// when a check fails (each names the fix); [`Error::MapMemory`] or [`Error::PinMemory`]
    /// when the kernel refuses. Nothing stays mapped or locked after an error.
    pub fn allocate(length: u64, policy: HugepagePolicy, limits: PinLimits) -> Result<Self> {
        Self::allocate_backed(length, policy, limits, false)
    }

    /// As [`PinnedMemory::allocate`], but the block is a memory file (`memfd`, with
    /// `MFD_HUGETLB` when hugetlb pages are used) mapped `MAP_SHARED`, so the `shm` provider can
    /// hand it to a peer process on this host ([`PinnedMemory::shared_descriptor`]). The same
    /// checks run, with the same errors.
    ///
    /// # Errors
    /// As [`PinnedMemory::allocate`].
    pub fn allocate_shared(length: u64, policy: HugepagePolicy, limits: PinLimits) -> Result<Self> {
        Self::allocate_backed(length, policy, limits, true)
    }

    /// A shareable block that no NIC registers (the `shm` provider's key state and epochs):
    /// checked against RAM as any block, but not locked, so it costs no memlock allowance.
    ///
    /// # Errors
    /// As [`PinnedMemory::allocate`], except the memlock checks.
    pub(crate) fn allocate_shared_unlocked(length: u64) -> Result<Self> {
        let rounded = length.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let (available, _) = read_meminfo();
        decide_available_memory(rounded, available, PinLimits::default())?;
        let (base, length, backing, file) = Self::map(rounded, false, true)?;
        Ok(PinnedMemory {
            base,
            length,
            backing,
            locked: false,
            writable: true,
            shared: file.map(|descriptor| SharedFile {
                descriptor,
                id: NEXT_SHARED_ID.fetch_add(1, Ordering::Relaxed),
            }),
        })
    }

    /// Maps `length` bytes of a peer's shareable block from its memory file, read-only unless
    /// `writable`. The owner pins the pages; this mapping is not locked or counted.
    ///
    /// # Errors
    /// [`Error::MapMemory`] when the kernel refuses (a length past the file's end included).
    pub fn map_peer(descriptor: OwnedFd, length: u64, writable: bool) -> Result<Self> {
        if length == 0 || length % PAGE_SIZE != 0 {
            return Err(Error::InvalidMemorySize {
                length,
                reason: "a peer's block is a whole number of pages",
            });
        }
        let file_length =
            std::fs::File::from(descriptor.try_clone().map_err(|source| Error::MapMemory {
                length,
                backing: "a peer's memory file",
                source,
            })?)
            .metadata()
            .map(|metadata| metadata.len())
            .unwrap_or(0);
        if file_length < length {
            return Err(Error::MapMemory {
                length,
                backing: "a peer's memory file",
                source: io::Error::other(format!("the file holds only {file_length} bytes")),
            });
        }
        let protection = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a new shared mapping of a file we hold, with a null hint: it touches no
        // existing memory, and the file is at least `length` bytes long (checked above), so no
        // access inside the mapping can fault with SIGBUS.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                length as usize,
                protection,
                libc::MAP_SHARED,
                descriptor.as_raw_fd(),
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(Error::MapMemory {
                length,
                backing: "a peer's memory file",
                source: io::Error::last_os_error(),
            });
        }
        let base = NonNull::new(address.cast::<u8>()).ok_or_else(|| Error::MapMemory {
            length,
            backing: "a peer's memory file",
            source: io::Error::other("mmap returned null"),
        })?;
        Ok(PinnedMemory {
            base,
            length,
            backing: PageBacking::StandardPages,
            locked: false,
            writable,
            shared: None,
        })
    }

    /// The memory file of a shareable block and its id, for handing to a peer; `None` for a
    /// private block.
    pub fn shared_descriptor(&self) -> Option<(BorrowedFd<'_>, u64)> {
        self.shared
            .as_ref()
            .map(|shared| (shared.descriptor.as_fd(), shared.id))
    }

    fn allocate_backed(
        length: u64,
        policy: HugepagePolicy,
        limits: PinLimits,
        shared: bool,
    ) -> Result<Self> {
        if length == 0 {
            return Err(Error::InvalidMemorySize {
                length,
                reason: "a pinned block must hold at least one byte",
            });
        }
        if length > (1 << 46) {
            return Err(Error::InvalidMemorySize {
                length,
                reason: "larger than the 64 TiB a 48-bit heap offset can address",
            });
        }
        let (available, free_hugepages) = read_meminfo();
        let use_hugetlb = match policy {
            HugepagePolicy::Require => {
                decide_hugepages(length, free_hugepages)?;
                true
            }
            HugepagePolicy::Auto => decide_hugepages(length, free_hugepages).is_ok(),
            HugepagePolicy::Off => false,
        };
        let rounded = if use_hugetlb {
            length.div_ceil(HUGEPAGE_SIZE) * HUGEPAGE_SIZE
        } else {
            length.div_ceil(PAGE_SIZE) * PAGE_SIZE
        };
        decide_available_memory(rounded, available, limits)?;
        if decide_memlock(rounded, read_memlock_figures())? == MemlockDecision::RaiseSoftToHard {
            raise_memlock_soft_limit().map_err(|source| Error::PinMemory {
                operation: "raise RLIMIT_MEMLOCK soft limit to the hard limit",
                length: rounded,
                source,
            })?;
            tracing::info!("raised RLIMIT_MEMLOCK soft limit to the hard limit");
        }

        let (base, length, backing, file) = match Self::map(rounded, use_hugetlb, shared) {
            Ok(mapped) => mapped,
            Err(error) if use_hugetlb && policy == HugepagePolicy::Auto => {
                tracing::info!(%error, "hugetlb mapping failed; falling back to 4 KiB pages");
                let fallback = length.div_ceil(PAGE_SIZE) * PAGE_SIZE;
                Self::map(fallback, false, shared)?
            }
            Err(error) => return Err(error),
        };
        // A memory file (shared) gets transparent hugepages only where the kernel's shmem
        // setting allows them; the advice succeeds either way, so say so only when it can work.
        let backing = if backing == PageBacking::StandardPages
            && policy == HugepagePolicy::Auto
            && length >= HUGEPAGE_SIZE
            && Self::advise(base, length, libc::MADV_HUGEPAGE).is_ok()
            && (file.is_none() || shmem_hugepages_possible(&read_shmem_hugepage_setting()))
        {
            PageBacking::TransparentHugepages
        } else {
            backing
        };
        // From here on the value owns the mapping, so an error below unmaps it in `Drop`.
        let memory = PinnedMemory {
            base,
            length,
            backing,
            locked: false,
            writable: true,
            shared: file.map(|descriptor| SharedFile {
                descriptor,
                id: NEXT_SHARED_ID.fetch_add(1, Ordering::Relaxed),
            }),
        };
        Self::advise(base, length, libc::MADV_DONTFORK).map_err(|source| Error::PinMemory {
            operation: "madvise MADV_DONTFORK",
            length,
            source,
        })?;
        if let Err(source) = Self::lock_in_pieces(base, length) {
            // Not counted in PINNED_BYTES yet: forget the lock state before Drop runs.
            let memory = std::mem::ManuallyDrop::new(memory);
            // SAFETY: the mapping is ours and nothing references it; it is unmapped exactly once.
            unsafe { libc::munmap(memory.base.as_ptr().cast(), memory.length as usize) };
            if source.raw_os_error() == Some(libc::ENOMEM)
                || source.raw_os_error() == Some(libc::EPERM)
            {
                let figures = read_memlock_figures();
                return Err(Error::MemlockLimit {
                    requested_bytes: length,
                    limit_bytes: figures.soft_limit,
                    locked_bytes: figures.locked_bytes,
                });
            }
            return Err(Error::PinMemory {
                operation: "mlock",
                length,
                source,
            });
        }
        let mut memory = memory;
        memory.locked = true;
        PINNED_BYTES.fetch_add(length, Ordering::Relaxed);
        tracing::info!(
            bytes = length,
            backing = backing.name(),
            "pinned memory block"
        );
        Ok(memory)
    }

    /// `mlock`s the mapping [`PIN_PIECE`] bytes at a time. One `mlock` of a large table faults
    /// every page in while it holds the process's address-space lock, which stalls every
    /// thread that maps memory (an allocator growing, a log line) for seconds; in pieces, the
    /// lock is released between them, so a signal during start-up is handled at once.
    fn lock_in_pieces(base: NonNull<u8>, length: u64) -> io::Result<()> {
        let mut offset = 0;
        while offset < length {
            let piece = PIN_PIECE.min(length - offset);
            // SAFETY: [base+offset, base+offset+piece) lies inside [base, base+length), a live
            // mapping owned by the caller's `PinnedMemory`.
            if unsafe { libc::mlock(base.as_ptr().add(offset as usize).cast(), piece as usize) }
                != 0
            {
                return Err(io::Error::last_os_error());
            }
            offset += piece;
        }
        Ok(())
    }

    /// Maps `length` anonymous bytes, with MAP_HUGETLB when asked; `shared`: a memory file of
    /// that length mapped MAP_SHARED instead, returned with the mapping.
    fn map(
        length: u64,
        hugetlb: bool,
        shared: bool,
    ) -> Result<(NonNull<u8>, u64, PageBacking, Option<OwnedFd>)> {
        let backing = if hugetlb {
            PageBacking::Hugetlb
        } else {
            PageBacking::StandardPages
        };
        let map_error = |source| Error::MapMemory {
            length,
            backing: backing.name(),
            source,
        };
        let file = if shared {
            Some(Self::memory_file(length, hugetlb).map_err(map_error)?)
        } else {
            None
        };
        let (mut flags, descriptor) = match &file {
            Some(file) => (libc::MAP_SHARED, file.as_raw_fd()),
            None => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1),
        };
        if hugetlb && file.is_none() {
            flags |= libc::MAP_HUGETLB | libc::MAP_HUGE_2MB;
        }
        // SAFETY: a new mapping with a null hint touches no existing memory; a memory file is
        // `length` bytes long, so no access inside the mapping can fault with SIGBUS.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                length as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                descriptor,
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(Error::MapMemory {
                length,
                backing: backing.name(),
                source: io::Error::last_os_error(),
            });
        }
        let base = NonNull::new(address.cast::<u8>()).ok_or_else(|| Error::MapMemory {
            length,
            backing: backing.name(),
            source: io::Error::other("mmap returned null"),
        })?;
        Ok((base, length, backing, file))
    }

    /// A new memory file of `length` bytes (`MFD_HUGETLB` for hugetlb pages).
    fn memory_file(length: u64, hugetlb: bool) -> io::Result<OwnedFd> {
        let mut flags = libc::MFD_CLOEXEC;
        if hugetlb {
            flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_2MB;
        }
        // SAFETY: the name is a NUL-terminated literal; memfd_create reads nothing else.
        let raw = unsafe { libc::memfd_create(c"rdkv-shm".as_ptr(), flags) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: memfd_create just returned this descriptor; nothing else owns it.
        let descriptor = unsafe { OwnedFd::from_raw_fd(raw) };
        std::fs::File::from(descriptor.try_clone()?).set_len(length)?;
        Ok(descriptor)
    }

    /// Applies one madvise advice to the whole mapping.
    fn advise(base: NonNull<u8>, length: u64, advice: libc::c_int) -> io::Result<()> {
        // SAFETY: [base, base+length) is a live mapping of ours; madvise does not move it.
        if unsafe { libc::madvise(base.as_ptr().cast(), length as usize, advice) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The virtual address of the first byte (what verbs calls the region's address).
    pub fn base_address(&self) -> u64 {
        self.base.as_ptr() as u64
    }

    /// The mapping's length in bytes.
    pub fn len(&self) -> u64 {
        self.length
    }

    /// Whether the block is empty (never true: allocation refuses zero).
    pub fn is_empty(&self) -> bool {
        self.length == 0
    }

    /// How the block is backed.
    pub fn backing(&self) -> PageBacking {
        self.backing
    }

    /// Checks that [offset, offset+length) lies inside the block.
    fn check_range(&self, offset: u64, length: u64) -> Result<()> {
        match offset.checked_add(length) {
            Some(end) if end <= self.length => Ok(()),
            _ => Err(Error::MemoryOutOfBounds {
                offset,
                length,
                size: self.length,
            }),
        }
    }

    /// The atomic word at `offset`, which must be 8-byte aligned and in range.
    fn word(&self, offset: u64) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= self.length);
        // SAFETY: offset is 8-aligned and inside the mapping (checked by every caller), the base
        // is page-aligned, so the pointer is aligned for AtomicU64 and valid for the lifetime of
        // `&self`; all accesses to this memory are atomic, so sharing the reference is sound.
        unsafe { &*(self.base.as_ptr().add(offset as usize).cast::<AtomicU64>()) }
    }

    /// The `count` atomic words from `offset`, which must be 8-byte aligned with the whole
    /// range inside the block (checked by every caller).
    fn words(&self, offset: u64, count: usize) -> &[AtomicU64] {
        debug_assert!(offset % 8 == 0 && offset + 8 * count as u64 <= self.length);
        // SAFETY: as for `word`: the range is 8-aligned and inside the mapping (checked by the
        // caller), valid for the lifetime of `&self`, and only ever accessed atomically.
        unsafe {
            std::slice::from_raw_parts(
                self.base.as_ptr().add(offset as usize).cast::<AtomicU64>(),
                count,
            )
        }
    }

    /// Refuses a store into a read-only peer mapping (which would otherwise fault).
    fn check_writable(&self) -> Result<()> {
        if self.writable {
            Ok(())
        } else {
            Err(Error::ReadOnlyMemory)
        }
    }

    /// Checks an 8-byte atomic target.
    fn check_atomic(&self, offset: u64) -> Result<()> {
        self.check_range(offset, 8)?;
        if offset % 8 != 0 {
            return Err(Error::MisalignedAtomic { offset });
        }
        Ok(())
    }

    /// Calls `visit(line_offset, words)` for each 64-byte line of `[offset, offset + length)`
    /// (eight words from `offset` on) that holds a non-zero word, with its eight words, each read with one atomic load (a word
    /// is never torn); lines of zeros cost their loads and one test. A scan of a mostly empty
    /// index reads it so, with no copy.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] when the range leaves the block, [`Error::MisalignedAtomic`]
    /// when `offset` is not 8-byte aligned or `length` not a multiple of 64.
    pub fn visit_nonzero_lines(
        &self,
        offset: u64,
        length: u64,
        mut visit: impl FnMut(u64, [u64; 8]),
    ) -> Result<()> {
        self.check_range(offset, length)?;
        if offset % 8 != 0 || length % 64 != 0 {
            return Err(Error::MisalignedAtomic { offset });
        }
        let words = self.words(offset, (length / 8) as usize);
        let mut line_offset = offset;
        for line in words.chunks_exact(8) {
            // Spelled out: eight loads and seven ORs a line, no loop.
            let load = |index: usize| line[index].load(Ordering::Acquire);
            let values = [
                load(0),
                load(1),
                load(2),
                load(3),
                load(4),
                load(5),
                load(6),
                load(7),
            ];
            let any = values[0]
                | values[1]
                | values[2]
                | values[3]
                | values[4]
                | values[5]
                | values[6]
                | values[7];
            if any != 0 {
                visit(line_offset, values);
            }
            line_offset += 64;
        }
        Ok(())
    }

    /// Copies `destination.len()` bytes starting at `offset` out of the block.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] when the range leaves the block.
    pub fn read_into(&self, offset: u64, destination: &mut [u8]) -> Result<()> {
        self.check_range(offset, destination.len() as u64)?;
        // An unaligned head, whole words, an unaligned tail: the middle copies 8 bytes per
        // atomic load with a fixed-size store (no `memcpy` call per word).
        let head = (((8 - (offset % 8)) % 8) as usize).min(destination.len());
        let (head_bytes, rest) = destination.split_at_mut(head);
        self.read_partial(offset, head_bytes);
        let mut position = offset + head as u64;
        let mut words = rest.chunks_exact_mut(8);
        for chunk in &mut words {
            chunk.copy_from_slice(&self.word(position).load(Ordering::Acquire).to_le_bytes());
            position += 8;
        }
        self.read_partial(position, words.into_remainder());
        Ok(())
    }

    /// Copies `length` bytes starting at `offset` out of the block into a new vector, which is
    /// filled as it is read, never zeroed first (a GET's value: [`PinnedMemory::read_into`] a
    /// zeroed vector spent as much again on the zeroing as on the copy).
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] when the range leaves the block.
    pub fn read_to_vec(&self, offset: u64, length: usize) -> Result<Vec<u8>> {
        let mut destination = Vec::with_capacity(length);
        self.read_append(offset, length, &mut destination)?;
        Ok(destination)
    }

    /// Appends `length` bytes starting at `offset` to `destination`, filled as they are read
    /// (never zeroed first); a vector with the room already allocates nothing. From 64 bytes
    /// on x86-64 it copies 64 or 128 bytes at a time, which may see a concurrent write of a word in
    /// part (`super::bulk_copy`, *Atomicity*): a caller checks what it read, as a direct GET
    /// does by the slot word before and after.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] when the range leaves the block (nothing is appended).
    pub fn read_append(&self, offset: u64, length: usize, destination: &mut Vec<u8>) -> Result<()> {
        self.check_range(offset, length as u64)?;
        destination.reserve(length);
        let start = destination.len();
        let spare = &mut destination.spare_capacity_mut()[..length];
        // SAFETY: the `length` bytes at `offset` lie inside the mapping (`check_range`), valid
        // for the lifetime of `&self`; `spare` is `length` bytes of `destination`'s spare
        // capacity, borrowed mutably here, outside the mapping.
        let copied = unsafe {
            super::bulk_copy::copy_bytes_out(
                self.base.as_ptr().add(offset as usize),
                length,
                spare.as_mut_ptr().cast::<u8>(),
            )
        };
        if !copied {
            self.read_words_into(offset, spare);
        }
        // SAFETY: the bulk copy or `read_words_into` wrote each of the first `length` bytes of
        // the spare capacity, which `reserve(length)` made at least `length` long, so the
        // first `start + length` bytes are initialized.
        unsafe { destination.set_len(start + length) };
        Ok(())
    }

    /// Fills `spare` with the bytes at `offset` (in range: checked by the caller) one atomic
    /// word at a time: an unaligned head, whole words, an unaligned tail.
    fn read_words_into(&self, offset: u64, spare: &mut [std::mem::MaybeUninit<u8>]) {
        let length = spare.len();
        let head = (((8 - (offset % 8)) % 8) as usize).min(length);
        let (head_part, rest) = spare.split_at_mut(head);
        let mut partial = [0u8; 8];
        self.read_partial(offset, &mut partial[..head]);
        for (slot, byte) in head_part.iter_mut().zip(partial) {
            slot.write(byte);
        }
        let mut position = offset + head as u64;
        let words = rest.len() / 8;
        let target = rest.as_mut_ptr().cast::<u8>();
        // `position` is 8-aligned whenever a whole word follows the head.
        let source: &[AtomicU64] = if words == 0 {
            &[]
        } else {
            self.words(position, words)
        };
        for (index, word) in source.iter().enumerate() {
            let value = word.load(Ordering::Acquire);
            // SAFETY: `index < words`, so the 8 bytes at `8 * index` lie inside `rest`
            // (`words * 8 <= rest.len()`), which this function borrows mutably; the store is
            // unaligned, and writing initializes those bytes.
            unsafe {
                target
                    .add(8 * index)
                    .cast::<u64>()
                    .write_unaligned(value.to_le());
            }
        }
        position += 8 * words as u64;
        let tail_part = &mut rest[words * 8..];
        self.read_partial(position, &mut partial[..tail_part.len()]);
        for (slot, byte) in tail_part.iter_mut().zip(partial) {
            slot.write(byte);
        }
    }

    /// Copies `length` bytes at `offset` of this block to `destination_offset` of another
    /// block (a READ placed straight into the requester's buffer by the `shm` provider): one
    /// atomic load and store per word when both ranges are word-aligned, else through a small
    /// bounce buffer.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] when either range leaves its block;
    /// [`Error::ReadOnlyMemory`] when the destination is a read-only mapping.
    pub fn copy_to(
        &self,
        offset: u64,
        destination: &PinnedMemory,
        destination_offset: u64,
        length: u64,
    ) -> Result<()> {
        self.check_range(offset, length)?;
        destination.check_range(destination_offset, length)?;
        destination.check_writable()?;
        if offset % 8 == 0 && destination_offset % 8 == 0 && length % 8 == 0 {
            let mut position = 0;
            while position < length {
                let value = self.word(offset + position).load(Ordering::Acquire);
                destination
                    .word(destination_offset + position)
                    .store(value, Ordering::Release);
                position += 8;
            }
            return Ok(());
        }
        let mut bounce = [0u8; 512];
        let mut position = 0;
        while position < length {
            let piece = (length - position).min(bounce.len() as u64) as usize;
            self.read_into(offset + position, &mut bounce[..piece])?;
            destination.write_from(destination_offset + position, &bounce[..piece])?;
            position += piece as u64;
        }
        Ok(())
    }

    /// Copies fewer than 8 bytes that lie within one word (checked by the caller).
    fn read_partial(&self, offset: u64, destination: &mut [u8]) {
        if destination.is_empty() {
            return;
        }
        let word_start = offset & !7;
        let within = (offset - word_start) as usize;
        let bytes = self.word(word_start).load(Ordering::Acquire).to_le_bytes();
        destination.copy_from_slice(&bytes[within..within + destination.len()]);
    }

    /// Copies `source` into the block starting at `offset`.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] when the range leaves the block.
    pub fn write_from(&self, offset: u64, source: &[u8]) -> Result<()> {
        self.check_range(offset, source.len() as u64)?;
        self.check_writable()?;
        if offset % 8 == 0 && source.len() % 8 == 0 {
            // Whole words only (an announce word, a slot): no head or tail to merge.
            for (index, chunk) in source.chunks_exact(8).enumerate() {
                let mut bytes = [0u8; 8];
                bytes.copy_from_slice(chunk);
                self.word(offset + 8 * index as u64)
                    .store(u64::from_le_bytes(bytes), Ordering::Release);
            }
            return Ok(());
        }
        // An unaligned head, whole words (one atomic store each), an unaligned tail.
        let head = (((8 - (offset % 8)) % 8) as usize).min(source.len());
        let (head_bytes, rest) = source.split_at(head);
        self.write_partial(offset, head_bytes);
        let mut position = offset + head as u64;
        let mut words = rest.chunks_exact(8);
        for chunk in &mut words {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(chunk);
            self.word(position)
                .store(u64::from_le_bytes(bytes), Ordering::Release);
            position += 8;
        }
        self.write_partial(position, words.remainder());
        Ok(())
    }

    /// Writes fewer than 8 bytes that lie within one word (checked by the caller), keeping the
    /// word's other bytes (a CAS loop: a concurrent writer of those bytes is not undone).
    fn write_partial(&self, offset: u64, source: &[u8]) {
        if source.is_empty() {
            return;
        }
        let word_start = offset & !7;
        let within = (offset - word_start) as usize;
        let word = self.word(word_start);
        let mut current = word.load(Ordering::Acquire);
        loop {
            let mut bytes = current.to_le_bytes();
            bytes[within..within + source.len()].copy_from_slice(source);
            match word.compare_exchange_weak(
                current,
                u64::from_le_bytes(bytes),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(observed) => current = observed,
            }
        }
    }

    /// Loads the `N` aligned 8-byte words from `offset`, in order, each one atomic load (the
    /// range checked once: a slot of the `shm` key state is eight of them).
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] or [`Error::MisalignedAtomic`].
    pub(crate) fn load_words<const N: usize>(&self, offset: u64) -> Result<[u64; N]> {
        self.check_range(offset, 8 * N as u64)?;
        if offset % 8 != 0 {
            return Err(Error::MisalignedAtomic { offset });
        }
        let mut words = [0u64; N];
        for (index, word) in words.iter_mut().enumerate() {
            *word = self.word(offset + 8 * index as u64).load(Ordering::Acquire);
        }
        Ok(words)
    }

    /// Loads the aligned 8-byte word at `offset`.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] or [`Error::MisalignedAtomic`].
    pub fn load_u64(&self, offset: u64) -> Result<u64> {
        self.check_atomic(offset)?;
        Ok(self.word(offset).load(Ordering::Acquire))
    }

    /// Stores the aligned 8-byte word at `offset`.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] or [`Error::MisalignedAtomic`].
    pub fn store_u64(&self, offset: u64, value: u64) -> Result<()> {
        self.check_atomic(offset)?;
        self.check_writable()?;
        self.word(offset).store(value, Ordering::Release);
        Ok(())
    }

    /// Compares the word at `offset` with `expected` and, if equal, replaces it with `new`.
    /// Returns the original value either way, as an RDMA CAS does.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] or [`Error::MisalignedAtomic`].
    pub fn compare_exchange_u64(&self, offset: u64, expected: u64, new: u64) -> Result<u64> {
        self.check_atomic(offset)?;
        self.check_writable()?;
        Ok(
            match self.word(offset).compare_exchange(
                expected,
                new,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(original) | Err(original) => original,
            },
        )
    }

    /// Adds `addend` (wrapping) to the word at `offset` and returns the original value.
    ///
    /// # Errors
    /// [`Error::MemoryOutOfBounds`] or [`Error::MisalignedAtomic`].
    pub fn fetch_add_u64(&self, offset: u64, addend: u64) -> Result<u64> {
        self.check_atomic(offset)?;
        self.check_writable()?;
        Ok(self.word(offset).fetch_add(addend, Ordering::SeqCst))
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping is ours; munlock and munmap release it exactly once, and no
        // reference into it outlives `self` (every view borrows `self`).
        unsafe {
            if self.locked {
                libc::munlock(self.base.as_ptr().cast(), self.length as usize);
            }
            libc::munmap(self.base.as_ptr().cast(), self.length as usize);
        }
        if self.locked {
            PINNED_BYTES.fetch_sub(self.length, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn shmem_hugepages_follow_the_selected_setting() {
        assert!(!shmem_hugepages_possible(
            "always within_size advise [never] deny force\n"
        ));
        assert!(!shmem_hugepages_possible(
            "always within_size advise never [deny] force\n"
        ));
        assert!(shmem_hugepages_possible(
            "always within_size [advise] never deny force\n"
        ));
        assert!(shmem_hugepages_possible(
            "[always] within_size advise never deny force"
        ));
        assert!(!shmem_hugepages_possible(""));
    }
    use super::*;

    fn small() -> PinnedMemory {
        PinnedMemory::allocate(8192, HugepagePolicy::Off, PinLimits::default()).expect("allocate")
    }

    #[test]
    fn allocation_is_page_aligned_rounded_and_counted() {
        let before = pinned_bytes();
        let memory = PinnedMemory::allocate(100, HugepagePolicy::Auto, PinLimits::default())
            .expect("allocate");
        assert_eq!(memory.base_address() % PAGE_SIZE, 0);
        assert_eq!(memory.len(), PAGE_SIZE);
        assert!(pinned_bytes() >= before + PAGE_SIZE);
        drop(memory);
    }

    #[test]
    fn read_to_vec_reads_what_read_into_reads_at_any_alignment() {
        let memory = small();
        let pattern: Vec<u8> = (0..200u32).map(|byte| (byte * 7 + 3) as u8).collect();
        memory.write_from(0, &pattern).expect("write");
        for offset in 0..9u64 {
            for length in [0usize, 1, 5, 8, 9, 16, 63, 100, 190] {
                let mut expected = vec![0u8; length];
                memory.read_into(offset, &mut expected).expect("read_into");
                assert_eq!(
                    memory.read_to_vec(offset, length).expect("read_to_vec"),
                    expected,
                    "offset {offset}, length {length}"
                );
            }
        }
        assert!(matches!(
            memory.read_to_vec(8190, 4),
            Err(Error::MemoryOutOfBounds { .. })
        ));
    }

    #[test]
    fn visit_nonzero_lines_sees_every_non_zero_word_and_only_those_lines() {
        let memory = small();
        for (offset, value) in [(8u64, 5u64), (64 + 56, 7), (256, 9), (264, 11)] {
            memory.store_u64(offset, value).expect("store");
        }
        let mut seen = Vec::new();
        memory
            .visit_nonzero_lines(0, 512, |line, words| seen.push((line, words)))
            .expect("visit");
        let lines: Vec<u64> = seen.iter().map(|(line, _)| *line).collect();
        assert_eq!(lines, vec![0, 64, 256]);
        assert_eq!(seen[0].1, [0, 5, 0, 0, 0, 0, 0, 0]);
        assert_eq!(seen[1].1[7], 7);
        assert_eq!(seen[2].1[..2], [9, 11]);
        assert!(matches!(
            memory.visit_nonzero_lines(4, 64, |_, _| {}),
            Err(Error::MisalignedAtomic { .. })
        ));
        assert!(matches!(
            memory.visit_nonzero_lines(0, 60, |_, _| {}),
            Err(Error::MisalignedAtomic { .. })
        ));
        assert!(matches!(
            memory.visit_nonzero_lines(0, memory.len() + 64, |_, _| {}),
            Err(Error::MemoryOutOfBounds { .. })
        ));
    }

    #[test]
    fn zero_length_is_refused() {
        let error =
            PinnedMemory::allocate(0, HugepagePolicy::Off, PinLimits::default()).unwrap_err();
        assert!(matches!(error, Error::InvalidMemorySize { length: 0, .. }));
    }

    #[test]
    fn pinning_more_than_the_ram_share_fails_before_mapping() {
        let limits = PinLimits {
            max_pinned_share: 0.000_001,
        };
        let error = PinnedMemory::allocate(1 << 30, HugepagePolicy::Off, limits).unwrap_err();
        assert!(matches!(error, Error::InsufficientMemory { .. }), "{error}");
    }

    #[test]
    fn unaligned_copies_round_trip() {
        let memory = small();
        let pattern: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        for offset in [0u64, 1, 3, 7, 8, 13] {
            memory.write_from(offset, &pattern).expect("write");
            let mut back = vec![0u8; pattern.len()];
            memory.read_into(offset, &mut back).expect("read");
            assert_eq!(back, pattern, "offset {offset}");
        }
    }

    #[test]
    fn every_offset_and_short_length_reads_what_was_written() {
        let memory = small();
        let pattern: Vec<u8> = (0..64u8).map(|byte| byte.wrapping_mul(37)).collect();
        memory.write_from(0, &pattern).expect("write");
        for offset in 0..24usize {
            for length in 0..=(40 - offset.min(16)) {
                let mut back = vec![0xEEu8; length];
                memory.read_into(offset as u64, &mut back).expect("read");
                assert_eq!(
                    back,
                    &pattern[offset..offset + length],
                    "offset {offset} length {length}"
                );
            }
        }
    }

    #[test]
    fn every_offset_and_short_length_writes_only_its_bytes() {
        let memory = small();
        for offset in 0..24usize {
            for length in 0..=(40 - offset.min(16)) {
                memory.write_from(0, &[0xAAu8; 64]).expect("fill");
                let source: Vec<u8> = (0..length as u8).collect();
                memory.write_from(offset as u64, &source).expect("write");
                let mut back = vec![0u8; 64];
                memory.read_into(0, &mut back).expect("read");
                let mut expected = vec![0xAAu8; 64];
                expected[offset..offset + length].copy_from_slice(&source);
                assert_eq!(back, expected, "offset {offset} length {length}");
            }
        }
    }

    #[test]
    fn unaligned_write_keeps_neighbouring_bytes() {
        let memory = small();
        memory.store_u64(0, u64::MAX).expect("store");
        memory.write_from(3, &[0, 0]).expect("write");
        assert_eq!(
            memory.load_u64(0).expect("load").to_le_bytes(),
            [255, 255, 255, 0, 0, 255, 255, 255]
        );
    }

    #[test]
    fn atomics_return_the_original_value() {
        let memory = small();
        memory.store_u64(64, 5).expect("store");
        assert_eq!(memory.compare_exchange_u64(64, 5, 9).expect("cas"), 5);
        assert_eq!(memory.compare_exchange_u64(64, 5, 11).expect("cas"), 9);
        assert_eq!(memory.fetch_add_u64(64, 3).expect("faa"), 9);
        assert_eq!(memory.load_u64(64).expect("load"), 12);
    }

    #[test]
    fn bounds_and_alignment_are_checked() {
        let memory = small();
        assert!(matches!(
            memory.load_u64(4),
            Err(Error::MisalignedAtomic { offset: 4 })
        ));
        assert!(matches!(
            memory.read_into(8190, &mut [0u8; 4]),
            Err(Error::MemoryOutOfBounds { .. })
        ));
        assert!(matches!(
            memory.write_from(u64::MAX, &[1]),
            Err(Error::MemoryOutOfBounds { .. })
        ));
    }
}
