//! rdkv-fabric: the verbs model, registered memory, and the providers behind one seam.
//!
//! - The model: [`Device`], [`ProtectionDomain`], [`MemoryRegion`], [`MemoryWindow`],
//!   [`QueuePair`], [`CompletionQueue`], and the work requests and completions of
//!   [`types`](crate::WorkRequest).
//! - [`memory`]: page-aligned, pinned memory that the fabric registers, with the memlock, RAM
//!   and hugepage checks done before anything is pinned.
//! - `provider/`: `soft` (a user-space RNIC over TCP), `loopback` (the same model in one
//!   process), the responder engine they share, and `verbs` (real ibverbs, cargo feature
//!   `verbs`).
//! - `seam`: the traits a provider implements; the model holds providers only through them
//!   and imports no provider. `provider/mod.rs` ([`Device::open`]) is the one dispatch point.
//! - [`Capabilities`]: what each provider states about itself (ordered reads, calls that may
//!   block, shared memory, …), asked of a [`Device`] or a [`Backend`]; callers ask for a
//!   property, never test a provider's name.
//! - [`error`]: the crate's error enum.
//! - `sync`: taking a lock that a panic may have poisoned, the workspace's one definition.
//!
//! `unsafe` code lives only in this crate; each block carries a `// SAFETY:` argument.
//!
//! Objects and their parents (each child holds an `Arc` of its parent, so teardown order is
//! structural): [`Device`] ← [`ProtectionDomain`] ← [`MemoryRegion`], [`MemoryWindow`],
//! [`QueuePair`] (which also holds its [`CompletionQueue`]).
//!
//! Operations are one-sided READ, WRITE, CAS and FETCH_ADD, posted as lists
//! ([`QueuePair::post`]) whose future resolves when the list's last (signaled) request
//! completes. Completions carry ibverbs statuses ([`WorkCompletionStatus`]).
//!
//! Backends: `soft` ([`Device::soft`], a user-space RNIC over TCP), `loopback`
//! ([`Device::loopback`], the same model in one process) and, with the cargo feature `verbs`,
//! `verbs` ([`Device::verbs`], real ibverbs through `sideway`). Soft and loopback run the same
//! responder engine and the same requester bookkeeping; only the transport differs. Verbs keeps
//! the requester bookkeeping (in-flight entries keep buffers alive, per-list futures) and lets
//! the NIC do the rest. `docs/fabric.md` describes
//! the model, the wire format and when each status arises.
//!
//! # Thread safety
//! Every object is `Send + Sync`. Shared mutable state sits behind `Mutex`, `RwLock`, atomics
//! or `DashMap`; registered memory is only touched through atomics (see [`crate::memory`]). No
//! lock is held across an `.await`.

mod capabilities;
mod completion;
mod device;
mod direct;
pub mod error;
pub mod memory;
mod protection;
mod provider;
mod queue_pair;
mod revocation;
mod seam;
mod send_slots;
mod sync;
mod types;

pub use capabilities::Capabilities;
pub use completion::{CompletionQueue, Completions, PostedList};
pub use device::{
    Device, DeviceConfig, GaugeSnapshot, VerbsOptions, DEFAULT_HELLO_DEADLINE,
    DEFAULT_MAX_MESSAGE_SIZE, DEFAULT_MAX_PENDING_HELLOS, DEFAULT_RESPONSE_BUFFER,
};
pub use direct::DirectAccess;
pub use error::{Error, Result, VERBS_BUILD_HINT};
pub use protection::{MemoryRegion, MemoryWindow, ProtectionDomain};
pub use provider::shm::PEER_CHECK_EVERY as SHM_PEER_CHECK_EVERY;
pub use queue_pair::{
    InlineFailure, InlineOutcome, QueuePair, QueuePairConfig, DEFAULT_MAX_SEND_WR,
};
pub use revocation::RequesterInside;
pub use sync::{lock, read_lock, write_lock};
pub use types::{
    AccessFlags, Backend, LocalSegment, Opcode, QueuePairEndpoint, QueuePairState, RemoteKey,
    RemoteSegment, ShmEndpoint, SoftEndpoint, UnknownBackend, VerbsAddress, WorkCompletion,
    WorkCompletionStatus, WorkRequest,
};
