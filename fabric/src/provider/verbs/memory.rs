//! Memory regions over caller-owned pinned memory, and type-2 memory windows.
//!
//! A region registers memory that an `Arc<PinnedMemory>` owns; rdkv's region object holds that
//! `Arc` and drops the registration first, so the NIC never maps freed memory. A window is
//! allocated with `ibv_alloc_mw(IBV_MW_TYPE_2)` when it is first bound, and deallocated (which
//! revokes its rkey at once, whatever state its queue pair is in) when it is invalidated.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys::{ibv_alloc_mw, ibv_dealloc_mw, ibv_mw, ibv_mw_type};
use sideway::ibverbs::memory_region::MemoryRegion as SidewayRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain as SidewayDomain;
use sideway::ibverbs::AccessFlags as SidewayAccess;

use crate::error::{Error, Result};
use crate::memory::PinnedMemory;
use crate::types::AccessFlags;

/// rdkv access flags as sideway's.
pub(crate) fn sideway_access(access: AccessFlags) -> SidewayAccess {
    let pairs = [
        (AccessFlags::LOCAL_WRITE, SidewayAccess::LocalWrite),
        (AccessFlags::REMOTE_WRITE, SidewayAccess::RemoteWrite),
        (AccessFlags::REMOTE_READ, SidewayAccess::RemoteRead),
        (AccessFlags::REMOTE_ATOMIC, SidewayAccess::RemoteAtomic),
        (AccessFlags::MW_BIND, SidewayAccess::MemoryWindowBind),
    ];
    pairs
        .into_iter()
        .filter(|(ours, _)| access.contains(*ours))
        .fold(SidewayAccess::none(), |flags, (_, theirs)| flags | theirs)
}

/// A registration with the NIC.
#[derive(Debug)]
pub(crate) struct VerbsRegion {
    /// The sideway region; deregisters on drop.
    pub(crate) region: Arc<SidewayRegion>,
}

impl VerbsRegion {
    /// Registers `length` bytes of `memory` from `offset`.
    ///
    /// # Errors
    /// [`Error::VerbsCall`] when `ibv_reg_mr` fails (most often RLIMIT_MEMLOCK for a user
    /// without CAP_IPC_LOCK, or the NIC's MR limits).
    pub(crate) fn register(
        domain: &Arc<SidewayDomain>,
        memory: &Arc<PinnedMemory>,
        offset: u64,
        length: u64,
        access: AccessFlags,
    ) -> Result<Self> {
        let address = memory.base_address() + offset;
        // SAFETY: [address, address + length) lies inside `memory` (the caller checked the
        // range), which is mapped and pinned for as long as the `Arc<PinnedMemory>` lives. The
        // rdkv region that owns this registration also holds that `Arc` and drops the
        // registration before it, so the NIC never maps memory after it is unmapped. All CPU
        // access to registered memory goes through atomics (see `crate::memory`), so NIC writes
        // never race with Rust references.
        let region =
            unsafe { domain.reg_mr(address as usize, length as usize, sideway_access(access)) }
                .map_err(|error| Error::VerbsCall {
                    operation: "ibv_reg_mr",
                    qp_number: None,
                    source: std::io::Error::other(format!(
                        "{error}: {}; if it is ENOMEM or EPERM, raise RLIMIT_MEMLOCK (`ulimit -l \
                 unlimited`)",
                        std::error::Error::source(&error)
                            .map(ToString::to_string)
                            .unwrap_or_default()
                    )),
                })?;
        Ok(Self { region })
    }

    /// The local key.
    pub(crate) fn local_key(&self) -> u32 {
        self.region.lkey()
    }

    /// The remote key.
    pub(crate) fn remote_key(&self) -> u32 {
        self.region.rkey()
    }
}

/// A type-2 memory window.
#[derive(Debug)]
pub(crate) struct VerbsWindow {
    /// The window; deallocated on drop.
    window: NonNull<ibv_mw>,
    /// The domain it was allocated in; outlives it.
    _domain: Arc<SidewayDomain>,
}

// SAFETY: an `ibv_mw` is a plain handle; libibverbs calls on it are thread-safe, and the only
// mutation (dealloc) happens once, in `Drop`, with exclusive access.
unsafe impl Send for VerbsWindow {}
// SAFETY: shared access only reads the handle and its rkey.
unsafe impl Sync for VerbsWindow {}

impl VerbsWindow {
    /// Allocates an unbound type-2 window.
    ///
    /// # Errors
    /// [`Error::VerbsCall`] when the device has no memory windows or the limit is reached.
    pub(crate) fn allocate(domain: &Arc<SidewayDomain>) -> Result<Self> {
        // SAFETY: the PD pointer comes from a live sideway domain, kept alive by `_domain` for
        // as long as the window exists.
        let window = unsafe { ibv_alloc_mw(domain.pd().as_ptr(), ibv_mw_type::IBV_MW_TYPE_2) };
        let window = NonNull::new(window).ok_or_else(|| Error::VerbsCall {
            operation: "ibv_alloc_mw (type 2)",
            qp_number: None,
            source: std::io::Error::last_os_error(),
        })?;
        Ok(Self {
            window,
            _domain: domain.clone(),
        })
    }

    /// The window handle, for a bind work request.
    pub(crate) fn as_ptr(&self) -> *mut ibv_mw {
        self.window.as_ptr()
    }

    /// The window's current rkey (the key of its last bind, or its initial key).
    pub(crate) fn current_key(&self) -> u32 {
        // SAFETY: the window is live (deallocated only in Drop); `rkey` is a plain field that
        // only a bind completion changes, and the bind path reads it after that completion.
        unsafe { self.window.as_ref().rkey }
    }
}

impl Drop for VerbsWindow {
    fn drop(&mut self) {
        // SAFETY: the window was allocated by `ibv_alloc_mw` and is deallocated exactly once,
        // here; its domain is still alive (`_domain` drops after this body).
        let result = unsafe { ibv_dealloc_mw(self.window.as_ptr()) };
        if result != 0 {
            tracing::warn!(
                error = %std::io::Error::from_raw_os_error(result),
                "ibv_dealloc_mw failed; the window's key may stay valid until the device closes"
            );
        }
    }
}
