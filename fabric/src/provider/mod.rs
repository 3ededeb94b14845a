//! The providers behind the seam ([`crate::seam`]), and the one place that dispatches to them:
//! the [`Device`] constructors, which pick a provider by [`Backend`].
//!
//! - [`engine`]: the emulated responder (key checks in rxe's order, atomic access to registered
//!   memory) that `soft` and `loopback` share.
//! - [`loopback`]: the model in one process.
//! - [`soft`]: a user-space RNIC over TCP: listener, connections, and the wire format.
//! - `verbs` (cargo feature `verbs`): real ibverbs through `sideway`; only its capabilities
//!   are built without the feature.
//!
//! Adding a provider is one module here and one arm in [`Device::open`] and in
//! [`Backend::capabilities`] (see "Adding a provider" in `docs/architecture.md`).

pub(crate) mod engine;
pub(crate) mod loopback;
pub(crate) mod shm;
pub(crate) mod soft;
pub(crate) mod verbs;

use std::net::SocketAddr;

use crate::capabilities::Capabilities;
use crate::device::{Device, DeviceConfig, VerbsOptions};
use crate::error::Result;
use crate::types::Backend;

impl Backend {
    /// What the provider states about itself (its module's `CAPABILITIES`; an open device
    /// answers the same through [`Device::capabilities`]), known without opening a device:
    /// for checking a configuration, or for a peer's endpoint. Verbs answers in a build
    /// without the feature too.
    pub fn capabilities(self) -> Capabilities {
        match self {
            Backend::Soft => soft::CAPABILITIES,
            Backend::Loopback => loopback::CAPABILITIES,
            Backend::Shm => shm::CAPABILITIES,
            Backend::Verbs => verbs::CAPABILITIES,
        }
    }
}

impl Device {
    /// Opens a device of `backend`: soft listening on `listen` (when given), loopback, verbs
    /// with `verbs`, or shm (offering its memory on a socket in the temporary directory when
    /// `listen` is given; [`Device::shm`] names the socket). The one dispatch on the backend.
    ///
    /// # Errors
    /// As [`Device::soft`] and [`Device::verbs`].
    pub fn open(
        backend: Backend,
        listen: Option<SocketAddr>,
        verbs: &VerbsOptions,
        config: DeviceConfig,
    ) -> Result<Self> {
        match backend {
            Backend::Soft => Self::build(config, Box::new(soft::SoftDevice::new(listen))),
            Backend::Loopback => Self::build(config, Box::<loopback::LoopbackDevice>::default()),
            Backend::Shm => {
                let listen = match listen {
                    Some(_) => shm::Listen::Automatic,
                    None => shm::Listen::No,
                };
                Self::build(config, Box::new(shm::ShmDevice::new(listen)))
            }
            #[cfg(feature = "verbs")]
            Backend::Verbs => Self::build(config, verbs::VerbsDevice::open(verbs)?),
            #[cfg(not(feature = "verbs"))]
            Backend::Verbs => {
                let _ = verbs;
                Err(crate::Error::VerbsNotBuilt)
            }
        }
    }

    /// A real RDMA device through ibverbs (the cargo feature `verbs`): opens the device
    /// `options` names, checks its port and picks its GID, and checks with one FETCH_ADD
    /// between two of its queue pairs that its atomics work on host-order words (rdkv's table
    /// words). The opened device and its one protection domain are shared process-wide: every
    /// `Device::verbs` with the same options while one is alive, and every
    /// `allocate_protection_domain` of it, use the same PD.
    ///
    /// # Errors
    /// [`crate::Error::VerbsNotBuilt`] in a build without the feature;
    /// [`crate::Error::VerbsDevice`] naming what is missing (library, device, port, GID) and
    /// the fix.
    pub fn verbs(options: &VerbsOptions, config: DeviceConfig) -> Result<Self> {
        Self::open(Backend::Verbs, None, options, config)
    }

    /// Whether this build has the verbs backend.
    pub fn verbs_built() -> bool {
        cfg!(feature = "verbs")
    }

    /// An in-process device: queue pairs connect only to loopback queue pairs of this process.
    pub fn loopback(config: DeviceConfig) -> Self {
        match Self::open(Backend::Loopback, None, &VerbsOptions::default(), config) {
            Ok(device) => device,
            // Starting a loopback device only registers it in a map.
            Err(error) => unreachable!("a loopback device cannot fail to start: {error}"),
        }
    }

    /// A shared-memory device. With `socket`, it offers its memory to queue pairs of other
    /// processes of this host on that Unix-domain socket (mode 0600; a stale socket file is
    /// replaced); without it, its queue pairs can only attach to devices that offer theirs.
    ///
    /// # Errors
    /// [`crate::Error::ShmSocket`] when the socket cannot be bound, or the shared key state
    /// cannot be allocated (as [`crate::memory::PinnedMemory::allocate_shared`]).
    pub fn shm(socket: Option<std::path::PathBuf>, config: DeviceConfig) -> Result<Self> {
        let listen = match socket {
            Some(path) => shm::Listen::At(path),
            None => shm::Listen::No,
        };
        Self::build(config, Box::new(shm::ShmDevice::new(listen)))
    }

    /// A software RNIC. With `listen`, it accepts queue pair connections on that TCP address
    /// (port 0 picks one) and its engine threads serve remote requests against its memory;
    /// without it, its queue pairs can only dial peers that listen.
    ///
    /// # Errors
    /// [`crate::Error::BindListener`] when the address cannot be bound.
    pub fn soft(listen: Option<SocketAddr>, config: DeviceConfig) -> Result<Self> {
        Self::open(Backend::Soft, listen, &VerbsOptions::default(), config)
    }
}
