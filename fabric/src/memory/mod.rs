//! Registered memory: page-aligned, pinned blocks that the fabric registers.
//!
//! - [`limits`] checks RLIMIT_MEMLOCK, MemAvailable and free hugepages before anything is pinned,
//!   and names the fix when a check fails.
//! - [`pinned`] maps, advises (`MADV_DONTFORK`, THP), locks and releases the memory, and is the
//!   only code that touches it: every access is an atomic load, store, compare-exchange or
//!   fetch-add, so a READ that races a CAS is defined behaviour and never tears an aligned
//!   8-byte word; the exception is [`bulk_copy`].
//! - [`bulk_copy`] copies a value's bytes out at once (SSE2 or AVX on x86-64): the one access
//!   that may see a concurrent write in part, as a NIC's READ may; its callers check what they
//!   copied.
//!
//! # Thread safety
//! [`PinnedMemory`] is `Send` and `Sync`: it owns its mapping exclusively (nothing else unmaps
//! it), and every access after construction goes through `&AtomicU8` / `&AtomicU64` views or
//! [`bulk_copy`]'s machine loads (not Rust accesses), so shared access from any number of
//! threads is data-race free by Rust's memory model.

mod bulk_copy;
pub mod limits;
pub mod pinned;

pub use limits::{HugepagePolicy, PinLimits};
pub use pinned::{pinned_bytes, PageBacking, PinnedMemory};
