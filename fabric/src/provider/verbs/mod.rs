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
//!
//! Sideway traps avoided on purpose (see `docs/fabric.md`): the completion channel is shared
//! by `Arc` only (the struct is `Clone` and destroys itself on drop); the extended CQ poller is
//! never used (rdma-core 44's rxe yields fake completions from it); the QP state comes from
//! `ibv_query_qp`, not the cached `qp.state()`; every status and state is mapped from its raw
//! value here, never through sideway's panicking `From<u32>`; QPs are destroyed only after
//! ERROR and a drain, and CQ events are acknowledged at once, so sideway's asserting `Drop`s
//! succeed.

pub(crate) mod completion;
pub(crate) mod context;
pub(crate) mod memory;
pub(crate) mod probe;
pub(crate) mod provider;
pub(crate) mod queue_pair;

pub(crate) use provider::VerbsDevice;

use rdma_mummy_sys::ibv_wc_status;

use crate::types::WorkCompletionStatus;

/// Maps a raw `ibv_wc_status` to rdkv's typed status; unknown values become
/// [`WorkCompletionStatus::OtherError`] and are logged, never a panic.
pub(crate) fn status_from_raw(raw: u32) -> WorkCompletionStatus {
    match raw {
        ibv_wc_status::IBV_WC_SUCCESS => WorkCompletionStatus::Success,
        ibv_wc_status::IBV_WC_LOC_LEN_ERR => WorkCompletionStatus::LocalLengthError,
        ibv_wc_status::IBV_WC_LOC_QP_OP_ERR => WorkCompletionStatus::LocalQueuePairOperationError,
        ibv_wc_status::IBV_WC_LOC_PROT_ERR | ibv_wc_status::IBV_WC_LOC_ACCESS_ERR => {
            WorkCompletionStatus::LocalProtectionError
        }
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR => WorkCompletionStatus::WorkRequestFlushError,
        ibv_wc_status::IBV_WC_MW_BIND_ERR => WorkCompletionStatus::MemoryWindowBindError,
        ibv_wc_status::IBV_WC_REM_INV_REQ_ERR => WorkCompletionStatus::RemoteInvalidRequestError,
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR => WorkCompletionStatus::RemoteAccessError,
        ibv_wc_status::IBV_WC_REM_OP_ERR => WorkCompletionStatus::RemoteOperationError,
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR => WorkCompletionStatus::RetryExceededError,
        other => {
            tracing::warn!(
                raw_status = other,
                "work completion with an unmapped ibverbs status"
            );
            WorkCompletionStatus::OtherError
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_raw_status_maps_without_panicking() {
        assert_eq!(status_from_raw(0), WorkCompletionStatus::Success);
        assert_eq!(
            status_from_raw(ibv_wc_status::IBV_WC_REM_ACCESS_ERR),
            WorkCompletionStatus::RemoteAccessError
        );
        assert_eq!(
            status_from_raw(ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR),
            WorkCompletionStatus::OtherError
        );
        assert_eq!(status_from_raw(u32::MAX), WorkCompletionStatus::OtherError);
    }
}
