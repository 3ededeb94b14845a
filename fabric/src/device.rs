//! The NIC: [`Device`] owns the memory protection table, the queue pair table, the gauges and
//! its provider (see [`crate::seam`]). Its constructors, which pick the provider, are the
//! dispatch point in `provider/mod.rs`.

use rand::RngCore;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use dashmap::DashMap;
use serde::{Deserialize, Serialize};

use crate::capabilities::Capabilities;
use crate::completion::CompletionQueue;
use crate::error::Result;
use crate::memory::pinned_bytes;
use crate::protection::{ProtectionDomain, ProtectionTable};
use crate::queue_pair::QueuePairShared;
use crate::seam::DeviceProvider;
use crate::types::{Backend, QueuePairState};

/// Limits of one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceConfig {
    /// The largest READ or WRITE, in bytes. Longer requests complete IBV_WC_LOC_LEN_ERR.
    pub max_message_size: u32,
    /// How long the oldest outstanding request may wait for its response before it completes
    /// IBV_WC_RETRY_EXC_ERR (the product of a real NIC's timeout and retry count).
    pub retry_timeout: Duration,
    /// How long a soft engine thread busy-polls its socket after its last frame, or a verbs
    /// CQ's poller task its CQ after its last completion, before it sleeps in the kernel. Zero
    /// never spins (lowest CPU use); a few tens of microseconds cuts the latency of a lightly
    /// loaded queue pair by the cost of a thread wake-up.
    pub poll_spin: Duration,
    /// A listening soft NIC's engine threads, which serve all its connections; zero means one
    /// per core. Not used by other providers.
    pub engine_threads: usize,
    /// How long a connection to a listening soft NIC has for its whole hello.
    pub hello_deadline: Duration,
    /// The most hellos a listening soft NIC reads at once; a connection beyond this closes
    /// the oldest pending one.
    pub max_pending_hellos: usize,
    /// The most response bytes one soft connection holds before writing them, and the most
    /// it leaves queued unsent: a listening NIC stops reading a connection whose peer does
    /// not take its answers until they drain (backpressure, not growth).
    pub response_buffer: usize,
}

/// Which RDMA device the verbs backend opens, and how it addresses peers.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerbsOptions {
    /// The device name as `ibv_devices` lists it (`mlx5_0`, `rxe0`); `None` opens the first.
    #[serde(default)]
    pub device: Option<String>,
    /// The port number (from 1); `None` means port 1.
    #[serde(default)]
    pub port: Option<u8>,
    /// The GID index (`show_gids` lists them); `None` picks the first RoCE v2 IPv4 GID, else
    /// index 0.
    #[serde(default)]
    pub gid_index: Option<u32>,
}

impl VerbsOptions {
    /// The options in `RDKV_RDMA_DEVICE`, `RDKV_RDMA_PORT` and `RDKV_GID_INDEX` (unset or empty:
    /// the defaults; a number that does not parse is ignored with a warning). Clients, the
    /// conformance suite and the fabric benchmark take their device from here.
    pub fn from_environment() -> Self {
        fn number<T: std::str::FromStr>(name: &str) -> Option<T> {
            let text = std::env::var(name).ok()?;
            let parsed = text.trim().parse().ok();
            if parsed.is_none() {
                tracing::warn!(variable = name, value = %text, "ignoring a value that is not a number");
            }
            parsed
        }
        Self {
            device: std::env::var("RDKV_RDMA_DEVICE")
                .ok()
                .filter(|name| !name.is_empty()),
            port: number("RDKV_RDMA_PORT"),
            gid_index: number("RDKV_GID_INDEX"),
        }
    }
}

/// The default deadline on a whole soft hello.
pub const DEFAULT_HELLO_DEADLINE: Duration = Duration::from_secs(5);
/// The default bound on one soft connection's response bytes: 4 MiB.
pub const DEFAULT_RESPONSE_BUFFER: usize = 4 << 20;
/// The default bound on soft hellos pending at once.
pub const DEFAULT_MAX_PENDING_HELLOS: usize = 64;

/// The default maximum message size: 1 MiB.
pub const DEFAULT_MAX_MESSAGE_SIZE: u32 = 1 << 20;

impl Default for DeviceConfig {
    fn default() -> Self {
        Self {
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            retry_timeout: Duration::from_secs(2),
            poll_spin: Duration::ZERO,
            engine_threads: 0,
            hello_deadline: DEFAULT_HELLO_DEADLINE,
            max_pending_hellos: DEFAULT_MAX_PENDING_HELLOS,
            response_buffer: DEFAULT_RESPONSE_BUFFER,
        }
    }
}

/// Live gauges of one device.
#[derive(Debug, Default)]
pub struct FabricGauges {
    /// Registered memory regions alive now.
    pub(crate) live_memory_regions: AtomicI64,
    /// Allocated memory windows alive now.
    pub(crate) live_memory_windows: AtomicI64,
    /// Bytes covered by live memory regions.
    pub(crate) registered_bytes: AtomicI64,
    /// Queue pairs per state, indexed by [`QueuePairState::index`].
    pub(crate) queue_pairs: [AtomicI64; 5],
    /// Frames (requests and responses) the soft NIC queued for sending.
    pub(crate) frames_sent: AtomicI64,
    /// `write` calls the soft NIC made; frames per write shows how well posts coalesce.
    pub(crate) transport_writes: AtomicI64,
    /// Connections the soft NIC closed before their hello: evicted by newer ones.
    pub(crate) hellos_refused: AtomicI64,
    /// Connections the soft NIC closed because their hello missed the deadline.
    pub(crate) hellos_timed_out: AtomicI64,
    /// Soft connections being served now (attached to a queue pair).
    pub(crate) soft_connections: AtomicI64,
    /// Times a soft connection stopped being read because its peer did not take its answers.
    pub(crate) output_stalls: AtomicI64,
    /// Soft connections whose responder refused a request (longer than `max_message_size`,
    /// malformed, or outside its key's rights), which moved their queue pair to ERROR.
    pub(crate) responder_errors: AtomicI64,
}

/// A copy of a device's gauges at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GaugeSnapshot {
    /// Registered memory regions alive now.
    pub live_memory_regions: i64,
    /// Allocated memory windows alive now.
    pub live_memory_windows: i64,
    /// Bytes covered by live memory regions.
    pub registered_bytes: i64,
    /// Bytes pinned by this process (all devices).
    pub pinned_bytes: u64,
    /// Queue pairs per state, indexed by [`QueuePairState::index`].
    pub queue_pairs: [i64; 5],
    /// Frames (requests and responses) the soft NIC queued for sending.
    pub frames_sent: i64,
    /// `write` calls the soft NIC made.
    pub transport_writes: i64,
    /// Connections the soft NIC closed before their hello: evicted by newer ones.
    pub hellos_refused: i64,
    /// Connections the soft NIC closed because their hello missed the deadline.
    pub hellos_timed_out: i64,
    /// Hellos pending on the soft NIC's listener now.
    pub hellos_pending: i64,
    /// Soft connections being served now.
    pub soft_connections: i64,
    /// The soft NIC's engine threads (zero when it does not listen).
    pub engine_threads: i64,
    /// Times a soft connection stopped being read because its peer did not take its answers.
    pub output_stalls: i64,
    /// Soft connections whose responder refused a request, moving their queue pair to ERROR.
    pub responder_errors: i64,
}

impl GaugeSnapshot {
    /// Queue pairs in `state`.
    pub fn queue_pairs_in(&self, state: QueuePairState) -> i64 {
        self.queue_pairs[state.index()]
    }
}

impl FabricGauges {
    /// Moves one queue pair from `from` (if any) to `to` (if any).
    pub(crate) fn move_queue_pair(&self, from: Option<QueuePairState>, to: Option<QueuePairState>) {
        if let Some(from) = from {
            self.queue_pairs[from.index()].fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(to) = to {
            self.queue_pairs[to.index()].fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The shared state of a device; every fabric object holds an `Arc` of it, directly or through
/// its parent.
#[derive(Debug)]
pub(crate) struct DeviceInner {
    /// Random per instance: tells endpoints of different devices apart.
    pub(crate) id: u64,
    /// Which backend this device is.
    pub(crate) backend: Backend,
    /// Limits.
    pub(crate) config: DeviceConfig,
    /// Memory protection table: key → region or window.
    pub(crate) table: ProtectionTable,
    /// Queue pairs by number, so an incoming soft connection or loopback peer can find its QP.
    pub(crate) queue_pairs: DashMap<u32, Weak<QueuePairShared>>,
    /// Gauges.
    pub(crate) gauges: FabricGauges,
    /// The next protection domain id.
    next_protection_domain: AtomicU32,
    /// The provider: the NIC behind the model.
    pub(crate) provider: Box<dyn DeviceProvider>,
}

impl DeviceInner {
    pub(crate) fn allocate_protection_domain_id(&self) -> u32 {
        self.next_protection_domain.fetch_add(1, Ordering::Relaxed)
    }

    /// A queue pair number drawn from the operating system's CSPRNG (24 bits, as on a real
    /// NIC, from 0x10), reserved in the device's map until the queue pair takes it: a dialer
    /// cannot guess another client's queue pair from its own.
    pub(crate) fn allocate_qp_number(&self) -> u32 {
        loop {
            let candidate = rand::rngs::OsRng.next_u32() & 0x00FF_FFFF;
            if candidate < 0x10 {
                continue;
            }
            if let dashmap::mapref::entry::Entry::Vacant(vacant) = self.queue_pairs.entry(candidate)
            {
                vacant.insert(std::sync::Weak::new());
                return candidate;
            }
        }
    }

    /// The queue pair with this number, if it is alive.
    pub(crate) fn queue_pair(&self, qp_number: u32) -> Option<Arc<QueuePairShared>> {
        self.queue_pairs.get(&qp_number)?.upgrade()
    }
}

/// A 64-bit id from the operating system's CSPRNG (device ids travel in soft endpoints: a
/// guessable one would help a dialer aim at another client's queue pair).
pub(crate) fn random_id() -> u64 {
    rand::rngs::OsRng.next_u64()
}

/// A NIC of one backend. Cheap to clone; every child object keeps it alive.
#[derive(Debug, Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

impl Device {
    /// A device of `provider`, started (see [`DeviceProvider::start`]).
    pub(crate) fn build(config: DeviceConfig, provider: Box<dyn DeviceProvider>) -> Result<Self> {
        let id = random_id();
        let inner = Arc::new(DeviceInner {
            id,
            backend: provider.backend(),
            config,
            table: ProtectionTable::new((id as u32) | 1),
            queue_pairs: DashMap::new(),
            gauges: FabricGauges::default(),
            next_protection_domain: AtomicU32::new(1),
            provider,
        });
        inner.provider.start(&inner)?;
        Ok(Self { inner })
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    /// What the device's provider states about itself: ask for a property here, never test
    /// [`Device::backend`].
    pub fn capabilities(&self) -> Capabilities {
        self.inner.provider.capabilities()
    }

    /// The device's random id.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The limits.
    pub fn config(&self) -> DeviceConfig {
        self.inner.config
    }

    /// The soft NIC's listening address, if it listens.
    pub fn listen_address(&self) -> Option<SocketAddr> {
        self.inner.provider.listen_address()
    }

    /// The Unix-domain socket an `shm` device offers its memory on, if it does.
    pub fn shm_socket(&self) -> Option<std::path::PathBuf> {
        self.inner.provider.socket_path()
    }

    /// Allocates a protection domain.
    pub fn allocate_protection_domain(&self) -> ProtectionDomain {
        ProtectionDomain::new(self.inner.clone())
    }

    /// Creates a completion queue that keeps at most `capacity` unclaimed completions (and,
    /// on verbs, a CQ of `capacity` entries polled by a task on the current tokio runtime).
    ///
    /// # Errors
    /// On verbs, [`crate::Error::VerbsCall`] when the CQ cannot be created or no tokio runtime
    /// runs; never on soft or loopback.
    pub fn create_completion_queue(&self, capacity: usize) -> Result<CompletionQueue> {
        CompletionQueue::new(self.inner.clone(), capacity)
    }

    /// The gauges now.
    pub fn gauges(&self) -> GaugeSnapshot {
        let gauges = &self.inner.gauges;
        let mut queue_pairs = [0i64; 5];
        for (slot, gauge) in queue_pairs.iter_mut().zip(&gauges.queue_pairs) {
            *slot = gauge.load(Ordering::Relaxed);
        }
        GaugeSnapshot {
            live_memory_regions: gauges.live_memory_regions.load(Ordering::Relaxed),
            live_memory_windows: gauges.live_memory_windows.load(Ordering::Relaxed),
            registered_bytes: gauges.registered_bytes.load(Ordering::Relaxed),
            pinned_bytes: pinned_bytes(),
            queue_pairs,
            frames_sent: gauges.frames_sent.load(Ordering::Relaxed),
            transport_writes: gauges.transport_writes.load(Ordering::Relaxed),
            hellos_refused: gauges.hellos_refused.load(Ordering::Relaxed),
            hellos_timed_out: gauges.hellos_timed_out.load(Ordering::Relaxed),
            hellos_pending: self.inner.provider.hellos_pending() as i64,
            soft_connections: gauges.soft_connections.load(Ordering::Relaxed),
            engine_threads: self.inner.provider.engine_threads() as i64,
            output_stalls: gauges.output_stalls.load(Ordering::Relaxed),
            responder_errors: gauges.responder_errors.load(Ordering::Relaxed),
        }
    }
}
