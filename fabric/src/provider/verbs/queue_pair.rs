//! Extended RC queue pairs on the NIC: creation with the one-sided operations in the send-ops
//! flags, the RESET → INIT → RTR → RTS walk from an exchanged (QPN, GID, LID, PSN, MTU),
//! posting lists through sideway's `PostSendGuard`, type-2 window binds, ERROR, and the state
//! read back with `ibv_query_qp`.

use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdma_mummy_sys::{
    ibv_mw_bind_info, ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_init_attr, ibv_qp_to_qp_ex,
    ibv_query_qp, ibv_send_flags, ibv_wr_abort, ibv_wr_bind_mw, ibv_wr_complete, ibv_wr_start,
};
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, PostSendGuard, QueuePair as SidewayQueuePair, QueuePairAttribute,
    QueuePairState as SidewayState, QueuePairType, SendOperationFlags, SetScatterGatherEntry,
    WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags as SidewayAccess;

use crate::error::{Error, Result};
use crate::lock;
use crate::provider::verbs::context::VerbsContext;
use crate::provider::verbs::memory::{sideway_access, VerbsRegion, VerbsWindow};
use crate::types::{AccessFlags, Opcode, QueuePairState, VerbsAddress, WorkRequest};

/// Retries a requester makes before RETRY_EXC_ERR. Not 7: rxe treats a retry count of 7 as
/// "retry forever" (as the spec does only for the RNR retry count), so a vanished peer would
/// never be reported; found by the conformance check `vanished_peer_is_retry_exceeded`.
const RETRY_COUNT: u8 = 6;
/// RNR retries (7 = forever; RNR NAKs do not arise with one-sided traffic).
const RNR_RETRY_COUNT: u8 = 7;
/// The RNR NAK timer code 12 (0.64 ms); irrelevant to one-sided traffic, but it must be valid.
const MIN_RNR_TIMER: u8 = 12;

/// A queue pair on the NIC.
pub(crate) struct VerbsQueuePair {
    /// The sideway queue pair (posting needs `&mut`).
    queue_pair: Mutex<ExtendedQueuePair>,
    /// Its number.
    pub(crate) qp_number: u32,
    /// Its starting send PSN.
    psn: u32,
    /// The device.
    pub(crate) context: Arc<VerbsContext>,
}

impl std::fmt::Debug for VerbsQueuePair {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("VerbsQueuePair")
            .field("qp_number", &self.qp_number)
            .field("psn", &self.psn)
            .finish_non_exhaustive()
    }
}

fn modify_failed(operation: &'static str, qp_number: u32, error: impl std::fmt::Display) -> Error {
    Error::VerbsCall {
        operation,
        qp_number: Some(qp_number),
        source: std::io::Error::other(error.to_string()),
    }
}

/// The IB timeout exponent (4.096 µs × 2^t per try) whose retries add up to about `total`.
pub(crate) fn timeout_exponent(total: Duration) -> u8 {
    let per_try_micros = (total.as_secs_f64() * 1e6 / f64::from(RETRY_COUNT + 1)).max(4.096);
    ((per_try_micros / 4.096).log2().floor() as i64).clamp(1, 31) as u8
}

impl VerbsQueuePair {
    /// Creates an RC queue pair whose send and receive completions go to `completion_queue`.
    ///
    /// # Errors
    /// [`Error::VerbsCall`] when the NIC refuses (for example `max_send_wr` over its limit).
    pub(crate) fn create(
        context: &Arc<VerbsContext>,
        queue: Arc<BasicCompletionQueue>,
        max_send_wr: u32,
        psn: u32,
    ) -> Result<Self> {
        let queue_pair = context
            .protection_domain
            .create_qp_builder()
            .setup_qp_type(QueuePairType::ReliableConnection)
            .setup_max_send_wr(max_send_wr)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_send_cq(queue.clone())
            .setup_recv_cq(queue)
            .setup_send_ops_flags(
                SendOperationFlags::Read
                    | SendOperationFlags::Write
                    | SendOperationFlags::AtomicCompareAndSwap
                    | SendOperationFlags::AtomicFetchAndAdd
                    | SendOperationFlags::BindMemoryWindow,
            )
            .build_ex()
            .map_err(|error| Error::VerbsCall {
                operation: "ibv_create_qp_ex",
                qp_number: None,
                source: std::io::Error::other(format!(
                    "{error}: {}",
                    std::error::Error::source(&error)
                        .map(ToString::to_string)
                        .unwrap_or_default()
                )),
            })?;
        let qp_number = queue_pair.qp_number();
        Ok(Self {
            queue_pair: Mutex::new(queue_pair),
            qp_number,
            psn: psn & 0x00FF_FFFF,
            context: context.clone(),
        })
    }

    /// This queue pair's address for the peer.
    pub(crate) fn address(&self) -> VerbsAddress {
        self.context.address(self.psn)
    }

    fn modify(&self, operation: &'static str, attribute: &QueuePairAttribute) -> Result<()> {
        lock(&self.queue_pair).modify(attribute).map_err(|error| {
            let detail = std::error::Error::source(&error)
                .map(|source| format!("{error}: {source}"))
                .unwrap_or_else(|| error.to_string());
            modify_failed(operation, self.qp_number, detail)
        })
    }

    /// RESET → INIT with remote READ, WRITE and atomic rights (the keys decide the rest).
    pub(crate) fn modify_to_init(&self) -> Result<()> {
        let mut attribute = QueuePairAttribute::new();
        attribute
            .setup_state(SidewayState::Init)
            .setup_pkey_index(0)
            .setup_port(self.context.port)
            .setup_access_flags(
                SidewayAccess::RemoteRead
                    | SidewayAccess::RemoteWrite
                    | SidewayAccess::RemoteAtomic,
            );
        self.modify("modify QP to INIT", &attribute)
    }

    /// INIT → RTR → RTS towards `remote`.
    pub(crate) fn connect(
        &self,
        remote_qp_number: u32,
        remote: &VerbsAddress,
        retry_timeout: Duration,
    ) -> Result<()> {
        let context = &self.context;
        let mtu = self.context.mtu.min(remote.mtu).clamp(1, 5);
        let mut address = AddressHandleAttribute::new();
        address
            .setup_dest_lid(remote.lid)
            .setup_service_level(0)
            .setup_port(context.port);
        if remote.gid != [0u8; 16] {
            address
                .setup_grh_dest_gid(&Gid { raw: remote.gid })
                .setup_grh_src_gid_index(context.gid_index as u8)
                .setup_grh_hop_limit(64);
        }
        let mut ready_to_receive = QueuePairAttribute::new();
        ready_to_receive
            .setup_state(SidewayState::ReadyToReceive)
            .setup_path_mtu(Mtu::from(mtu))
            .setup_dest_qp_num(remote_qp_number)
            .setup_rq_psn(remote.psn & 0x00FF_FFFF)
            .setup_max_dest_read_atomic(context.max_dest_read_atomic)
            .setup_min_rnr_timer(MIN_RNR_TIMER)
            .setup_address_vector(&address);
        self.modify("modify QP to RTR", &ready_to_receive)?;
        let mut ready_to_send = QueuePairAttribute::new();
        ready_to_send
            .setup_state(SidewayState::ReadyToSend)
            .setup_sq_psn(self.psn)
            .setup_timeout(timeout_exponent(retry_timeout))
            .setup_retry_cnt(RETRY_COUNT)
            .setup_rnr_retry(RNR_RETRY_COUNT)
            .setup_max_read_atomic(context.max_read_atomic);
        self.modify("modify QP to RTS", &ready_to_send)
    }

    /// Moves the NIC's queue pair to ERROR: it flushes everything outstanding.
    pub(crate) fn modify_to_error(&self) {
        let mut attribute = QueuePairAttribute::new();
        attribute.setup_state(SidewayState::Error);
        if let Err(error) = self.modify("modify QP to ERROR", &attribute) {
            tracing::warn!(%error, "the queue pair did not move to ERROR");
        }
    }

    /// The state the NIC reports (`ibv_query_qp`; sideway's `state()` is a cached field).
    pub(crate) fn query_state(&self) -> Option<QueuePairState> {
        let queue_pair = lock(&self.queue_pair);
        let mut attribute = MaybeUninit::<ibv_qp_attr>::zeroed();
        let mut initial = MaybeUninit::<ibv_qp_init_attr>::zeroed();
        // SAFETY: the QP is alive (the guard borrows it); both out-structs are zeroed plain C
        // structs that `ibv_query_qp` fills.
        let result = unsafe {
            ibv_query_qp(
                queue_pair.qp().as_ptr(),
                attribute.as_mut_ptr(),
                ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
                initial.as_mut_ptr(),
            )
        };
        if result != 0 {
            return None;
        }
        // SAFETY: zero-initialised and filled by a successful query.
        let raw_state = unsafe { attribute.assume_init() }.qp_state;
        Some(match raw_state {
            0 => QueuePairState::Reset,
            1 => QueuePairState::Init,
            2 => QueuePairState::ReadyToReceive,
            3 | 4 => QueuePairState::ReadyToSend,
            _ => QueuePairState::Error,
        })
    }

    /// Posts `requests` (with their work request ids) as one list (one doorbell).
    ///
    /// The caller keeps every local buffer alive until its completion is polled (its in-flight
    /// entry holds the region's memory).
    ///
    /// # Errors
    /// [`Error::VerbsCall`] when the NIC refuses the list (`ibv_wr_complete` fails); nothing of
    /// the list was posted then.
    pub(crate) fn post<'a>(
        &self,
        requests: impl Iterator<Item = (u64, &'a WorkRequest)>,
    ) -> Result<()> {
        let mut queue_pair = lock(&self.queue_pair);
        let mut guard = queue_pair.start_post_send();
        for (work_request_id, request) in requests {
            let mut flags = if request.signaled {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            if request.fenced {
                flags |= WorkRequestFlags::Fence;
            }
            let handle = guard.construct_wr(work_request_id, flags);
            let remote = request.remote;
            let buffer = match request.opcode {
                Opcode::Read => handle.setup_read(remote.remote_key, remote.address),
                Opcode::Write => handle.setup_write(remote.remote_key, remote.address),
                Opcode::CompareAndSwap => handle.setup_atomic_compare_swap(
                    remote.remote_key,
                    remote.address,
                    request.compare,
                    request.swap_or_add,
                ),
                Opcode::FetchAndAdd => handle.setup_atomic_fetch_add(
                    remote.remote_key,
                    remote.address,
                    request.swap_or_add,
                ),
            };
            let local = request.local;
            // SAFETY: the NIC validates the lkey and range itself (a bad one completes
            // LOC_PROT_ERR without touching memory); a valid one names registered memory that
            // the request's in-flight entry keeps mapped until its completion is polled.
            unsafe { buffer.setup_sge(local.local_key, local.address, local.length) };
        }
        guard.post().map_err(|error| Error::VerbsCall {
            operation: "post send (ibv_wr_complete)",
            qp_number: Some(self.qp_number),
            source: std::io::Error::other(error.to_string()),
        })
    }

    /// Posts a signaled type-2 bind of `window` over [address, address+length) of `region` with
    /// `access`, and returns the key the window will have once the bind completes.
    ///
    /// # Errors
    /// [`Error::VerbsCall`] when the provider cannot bind windows through the extended QP API
    /// or refuses the request.
    pub(crate) fn post_bind(
        &self,
        work_request_id: u64,
        window: &VerbsWindow,
        region: &VerbsRegion,
        address: u64,
        length: u64,
        access: AccessFlags,
    ) -> Result<u32> {
        let queue_pair = lock(&self.queue_pair);
        let new_key = next_window_key(window.current_key());
        let bind = ibv_mw_bind_info {
            // SAFETY: only the pointer is copied; the region stays registered for the window's
            // life (rdkv's window keeps its region).
            mr: unsafe { region.region.mr().as_ptr() },
            addr: address,
            length,
            mw_access_flags: sideway_access(access).bits() as u32,
        };
        // SAFETY: the QP is alive and exclusively ours while the guard is held; the extended
        // QP was created with BIND_MW in its send-ops flags, and the function pointer is
        // checked before it is called; `bind` outlives the calls; start/complete (or abort)
        // bracket the work request as the ibv_wr API requires.
        let result = unsafe {
            let extended = ibv_qp_to_qp_ex(queue_pair.qp().as_ptr());
            if extended.is_null() || (*extended).wr_bind_mw.is_none() {
                None
            } else {
                ibv_wr_start(extended);
                (*extended).wr_id = work_request_id;
                (*extended).wr_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
                ibv_wr_bind_mw(extended, window.as_ptr(), new_key, &bind);
                let result = ibv_wr_complete(extended);
                if result != 0 {
                    ibv_wr_abort(extended);
                }
                Some(result)
            }
        };
        match result {
            None => Err(Error::VerbsCall {
                operation: "bind a memory window",
                qp_number: Some(self.qp_number),
                source: std::io::Error::other(
                    "the provider has no ibv_wr_bind_mw for this queue pair",
                ),
            }),
            Some(0) => Ok(new_key),
            Some(code) => Err(Error::VerbsCall {
                operation: "bind a memory window",
                qp_number: Some(self.qp_number),
                source: std::io::Error::from_raw_os_error(code),
            }),
        }
    }
}

/// The next key of a type-2 window: the same index with the low 8 bits (the tag) advanced, as
/// `ibv_inc_rkey` does.
fn next_window_key(key: u32) -> u32 {
    (key & !0xFF) | ((key.wrapping_add(1)) & 0xFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_keys_advance_the_tag_only() {
        assert_eq!(next_window_key(0x1234_5600), 0x1234_5601);
        assert_eq!(next_window_key(0x1234_56FF), 0x1234_5600);
    }

    #[test]
    fn timeout_exponent_spreads_the_retry_timeout_over_the_retries() {
        // 2 s over 7 tries = 286 ms per try: 4.096 µs × 2^16 = 268 ms, 2^17 = 537 ms.
        assert_eq!(timeout_exponent(Duration::from_secs(2)), 16);
        assert_eq!(timeout_exponent(Duration::ZERO), 1);
        assert_eq!(timeout_exponent(Duration::from_secs(1_000_000)), 31);
    }
}
