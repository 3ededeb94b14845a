//! The `verbs` backend: real ibverbs through the `sideway` crate (cargo feature `verbs`).
//!
//! rdkv's fabric objects keep their model-level bookkeeping (gauges, the ordered in-flight
//! queue that keeps local buffers alive until their completion is polled, per-list futures);
//! behind the seam ([`provider`]) the NIC objects do the work: the NIC checks keys, moves the
//! bytes and reports statuses.
//!
//! * [`provider`]: the seam's implementations ([`VerbsDevice`], `NicQueuePair`): doorbell
//!   batching, flush completions, window binds and the drain.
//! * [`context`]: opening a device by name, the port, the GID, and the one shared PD.
//! * [`memory`]: memory regions over caller-owned pinned memory and type-2 memory windows.
//! * [`completion`]: a basic CQ polled with `ibv_poll_cq`, armed through a completion channel
//!   whose fd is awaited with `tokio::io::unix::AsyncFd`.
//! * [`probe`]: the self-test at open that the NIC's atomics work on host-order words.
//! * [`queue_pair`]: extended RC queue pairs (READ, WRITE, CAS, FETCH_ADD and BIND_MW in the
//!   send-ops flags), connected by exchanging (QPN, GID, LID, PSN, MTU).
//! * [`status`]: raw work completion statuses mapped to typed ones.
//!
//! Only [`CAPABILITIES`] is built without the feature: a client or a configuration check asks
//! what verbs states even in a build that cannot open a verbs device.
//!
//! Sideway traps avoided on purpose (see `docs/fabric.md`): the completion channel is shared
//! by `Arc` only (the struct is `Clone` and destroys itself on drop); the extended CQ poller is
//! never used (rdma-core 44's rxe yields fake completions from it); the QP state comes from
//! `ibv_query_qp`, not the cached `qp.state()`; every status and state is mapped from its raw
//! value here, never through sideway's panicking `From<u32>`; QPs are destroyed only after
//! ERROR and a drain, and CQ events are acknowledged at once, so sideway's asserting `Drop`s
//! succeed.

#[cfg(feature = "verbs")]
pub(crate) mod completion;
#[cfg(feature = "verbs")]
pub(crate) mod context;
#[cfg(feature = "verbs")]
pub(crate) mod memory;
#[cfg(feature = "verbs")]
pub(crate) mod probe;
#[cfg(feature = "verbs")]
pub(crate) mod provider;
#[cfg(feature = "verbs")]
pub(crate) mod queue_pair;
#[cfg(feature = "verbs")]
pub(crate) mod status;

#[cfg(feature = "verbs")]
pub(crate) use provider::VerbsDevice;

use crate::capabilities::Capabilities;

/// What verbs states (`docs/fabric.md`, *Capabilities*): the NIC may fetch a later READ's data
/// before an earlier one's unless it is fenced; a window bind and a drain poll the NIC's
/// completion queue, bounded by the device's `retry_timeout`.
pub(crate) const CAPABILITIES: Capabilities = Capabilities {
    ordered_reads: false,
    binds_may_block: true,
    teardown_may_block: true,
    completes_inside_post: false,
    shares_memory: false,
    crosses_processes: true,
    responder_connects_first: false,
};
