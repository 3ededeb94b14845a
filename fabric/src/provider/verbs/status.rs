//! Work completion statuses: a raw `ibv_wc_status` mapped to rdkv's typed status, never
//! through sideway's panicking `From<u32>`.

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
