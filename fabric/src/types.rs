//! The plain data of the verbs model: access flags, opcodes, work requests, work completions,
//! statuses, queue pair states and endpoints.

use std::fmt;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

bitflags::bitflags! {
    /// Access rights of a memory region or window, as `ibv_access_flags`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
    pub struct AccessFlags: u32 {
        /// The local NIC may write into the memory (READ destinations, atomic results).
        const LOCAL_WRITE = 1;
        /// Remote peers may WRITE.
        const REMOTE_WRITE = 1 << 1;
        /// Remote peers may READ.
        const REMOTE_READ = 1 << 2;
        /// Remote peers may CAS and FETCH_ADD.
        const REMOTE_ATOMIC = 1 << 3;
        /// Memory windows may be bound over this region.
        const MW_BIND = 1 << 4;
    }
}

/// Which implementation of the verbs model an object belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The software RNIC over TCP.
    Soft,
    /// The in-process model with no network.
    Loopback,
    /// Real ibverbs (any RDMA NIC, or Soft-RoCE), built with the cargo feature `verbs`.
    Verbs,
    /// One-sided over shared memory, between processes of one host: the requester does the
    /// NIC's work on the responder's memory files.
    Shm,
}

impl Backend {
    /// Every provider, in the order the docs list them.
    pub const ALL: [Backend; 4] = [
        Backend::Soft,
        Backend::Loopback,
        Backend::Verbs,
        Backend::Shm,
    ];

    /// The name used in configuration files and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Soft => "soft",
            Self::Loopback => "loopback",
            Self::Verbs => "verbs",
            Self::Shm => "shm",
        }
    }

    /// Whether nodes in other processes can reach a device of this provider: its
    /// [`Capabilities::crosses_processes`](crate::Capabilities::crosses_processes).
    pub fn crosses_processes(self) -> bool {
        self.capabilities().crosses_processes
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.name())
    }
}

/// A fabric name that is not one of [`Backend::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown fabric `{name}`: expected soft, loopback, verbs or shm")]
pub struct UnknownBackend {
    /// The name given.
    pub name: String,
}

impl std::str::FromStr for Backend {
    type Err = UnknownBackend;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Backend::ALL
            .into_iter()
            .find(|backend| backend.name() == name)
            .ok_or_else(|| UnknownBackend {
                name: name.to_string(),
            })
    }
}

/// A one-sided operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// RDMA READ: remote bytes into the local buffer.
    Read = 0,
    /// RDMA WRITE: local bytes into remote memory.
    Write = 1,
    /// 8-byte compare-and-swap; the original value lands in the local buffer.
    CompareAndSwap = 2,
    /// 8-byte fetch-and-add; the original value lands in the local buffer.
    FetchAndAdd = 3,
}

impl Opcode {
    /// Decodes a wire opcode.
    pub fn from_wire(byte: u8) -> Option<Self> {
        match byte {
            0 => Some(Self::Read),
            1 => Some(Self::Write),
            2 => Some(Self::CompareAndSwap),
            3 => Some(Self::FetchAndAdd),
            _ => None,
        }
    }

    /// Whether the opcode is an 8-byte atomic.
    pub fn is_atomic(self) -> bool {
        matches!(self, Self::CompareAndSwap | Self::FetchAndAdd)
    }

    /// The remote access right the responder requires.
    pub fn required_remote_access(self) -> AccessFlags {
        match self {
            Self::Read => AccessFlags::REMOTE_READ,
            Self::Write => AccessFlags::REMOTE_WRITE,
            Self::CompareAndSwap | Self::FetchAndAdd => AccessFlags::REMOTE_ATOMIC,
        }
    }

    /// Whether the local buffer is written by the local NIC (and so needs LOCAL_WRITE).
    pub fn writes_local_buffer(self) -> bool {
        !matches!(self, Self::Write)
    }
}

/// A scatter/gather element: a local buffer inside a registered memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalSegment {
    /// Virtual address of the first byte.
    pub address: u64,
    /// Length in bytes.
    pub length: u32,
    /// The local key of the memory region holding the buffer.
    pub local_key: u32,
}

/// The remote side of a one-sided operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteSegment {
    /// Remote virtual address.
    pub address: u64,
    /// The remote key of the region or window.
    pub remote_key: u32,
}

/// One work request of a posted list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkRequest {
    /// The caller's id, echoed in the completion.
    pub id: u64,
    /// What to do.
    pub opcode: Opcode,
    /// The local buffer (data source for WRITE, destination otherwise; 8 bytes for atomics).
    pub local: LocalSegment,
    /// The remote memory.
    pub remote: RemoteSegment,
    /// CAS: the expected value.
    pub compare: u64,
    /// CAS: the new value; FETCH_ADD: the addend.
    pub swap_or_add: u64,
    /// Whether a successful completion is reported.
    pub signaled: bool,
    /// Whether the request waits until every earlier READ and atomic of its queue pair has
    /// completed (`IBV_SEND_FENCE`). The emulated providers run a queue pair's requests one
    /// after another, so it changes nothing there; on a NIC, a READ without it may fetch its
    /// data before an earlier READ's.
    pub fenced: bool,
}

impl WorkRequest {
    /// An RDMA READ of `local.length` bytes.
    pub fn read(id: u64, local: LocalSegment, remote: RemoteSegment) -> Self {
        Self::new(id, Opcode::Read, local, remote, 0, 0)
    }

    /// An RDMA WRITE of `local.length` bytes.
    pub fn write(id: u64, local: LocalSegment, remote: RemoteSegment) -> Self {
        Self::new(id, Opcode::Write, local, remote, 0, 0)
    }

    /// A compare-and-swap; `local` must be 8 bytes.
    pub fn compare_and_swap(
        id: u64,
        local: LocalSegment,
        remote: RemoteSegment,
        compare: u64,
        swap: u64,
    ) -> Self {
        Self::new(id, Opcode::CompareAndSwap, local, remote, compare, swap)
    }

    /// A fetch-and-add; `local` must be 8 bytes.
    pub fn fetch_and_add(id: u64, local: LocalSegment, remote: RemoteSegment, add: u64) -> Self {
        Self::new(id, Opcode::FetchAndAdd, local, remote, 0, add)
    }

    fn new(
        id: u64,
        opcode: Opcode,
        local: LocalSegment,
        remote: RemoteSegment,
        compare: u64,
        swap_or_add: u64,
    ) -> Self {
        Self {
            id,
            opcode,
            local,
            remote,
            compare,
            swap_or_add,
            signaled: true,
            fenced: false,
        }
    }

    /// The same request, signaled or not.
    pub fn with_signaled(mut self, signaled: bool) -> Self {
        self.signaled = signaled;
        self
    }

    /// The same request, fenced: it runs only after every earlier READ and atomic of its
    /// queue pair has completed.
    pub fn with_fence(mut self) -> Self {
        self.fenced = true;
        self
    }
}

/// The ibverbs work-completion statuses rdkv distinguishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum WorkCompletionStatus {
    /// IBV_WC_SUCCESS.
    Success = 0,
    /// IBV_WC_LOC_LEN_ERR: a local length is over the maximum message size or wrong for an
    /// atomic.
    LocalLengthError = 1,
    /// IBV_WC_LOC_PROT_ERR: the local buffer is not inside a valid local memory region with the
    /// needed rights.
    LocalProtectionError = 2,
    /// IBV_WC_WR_FLUSH_ERR: the queue pair was in ERROR when the request would have run.
    WorkRequestFlushError = 3,
    /// IBV_WC_REM_INV_REQ_ERR: the responder found the request invalid (a misaligned atomic).
    RemoteInvalidRequestError = 4,
    /// IBV_WC_REM_ACCESS_ERR: bad rkey, wrong PD or QP, out of range, or a missing access right.
    RemoteAccessError = 5,
    /// IBV_WC_REM_OP_ERR: the responder could not carry out a valid request.
    RemoteOperationError = 6,
    /// IBV_WC_RETRY_EXC_ERR: the responder did not answer (lost connection or timeout).
    RetryExceededError = 7,
    /// IBV_WC_LOC_QP_OP_ERR: the local NIC found the request inconsistent with the queue pair
    /// (verbs only; for example a length over the port's limits).
    LocalQueuePairOperationError = 8,
    /// IBV_WC_MW_BIND_ERR: a memory window bind failed (verbs only).
    MemoryWindowBindError = 9,
    /// Any other ibverbs status (RNR retry, bad response, fatal, vendor-specific): the raw value
    /// is logged when it is seen.
    OtherError = 10,
    /// Not an ibverbs status: the responder's queue pair moved to ERROR before this request
    /// ran, and said so after answering every request it did run (`soft`, `shm` and
    /// `loopback`; `docs/fabric.md`, *Stopping*). The request had no effect. On `verbs` a
    /// request cut by the peer's ERROR ends RETRY_EXC_ERR or WR_FLUSH_ERR, which say nothing
    /// of whether it ran.
    NotExecuted = 11,
}

impl WorkCompletionStatus {
    /// Decodes a wire status byte; unknown values become `RemoteOperationError`, never a panic.
    pub fn from_wire(byte: u8) -> Self {
        match byte {
            0 => Self::Success,
            1 => Self::LocalLengthError,
            2 => Self::LocalProtectionError,
            3 => Self::WorkRequestFlushError,
            4 => Self::RemoteInvalidRequestError,
            5 => Self::RemoteAccessError,
            7 => Self::RetryExceededError,
            8 => Self::LocalQueuePairOperationError,
            9 => Self::MemoryWindowBindError,
            10 => Self::OtherError,
            11 => Self::NotExecuted,
            _ => Self::RemoteOperationError,
        }
    }

    /// The ibverbs name.
    pub fn verbs_name(self) -> &'static str {
        match self {
            Self::Success => "IBV_WC_SUCCESS",
            Self::LocalLengthError => "IBV_WC_LOC_LEN_ERR",
            Self::LocalProtectionError => "IBV_WC_LOC_PROT_ERR",
            Self::WorkRequestFlushError => "IBV_WC_WR_FLUSH_ERR",
            Self::RemoteInvalidRequestError => "IBV_WC_REM_INV_REQ_ERR",
            Self::RemoteAccessError => "IBV_WC_REM_ACCESS_ERR",
            Self::RemoteOperationError => "IBV_WC_REM_OP_ERR",
            Self::RetryExceededError => "IBV_WC_RETRY_EXC_ERR",
            Self::LocalQueuePairOperationError => "IBV_WC_LOC_QP_OP_ERR",
            Self::MemoryWindowBindError => "IBV_WC_MW_BIND_ERR",
            Self::OtherError => "another ibverbs error status",
            Self::NotExecuted => "not executed (the responder stopped first)",
        }
    }

    /// Whether a new queue pair may succeed where this one failed.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            Self::WorkRequestFlushError | Self::RetryExceededError | Self::NotExecuted
        )
    }
}

impl fmt::Display for WorkCompletionStatus {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.verbs_name())
    }
}

/// One work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's id.
    pub work_request_id: u64,
    /// The queue pair it ran on.
    pub qp_number: u32,
    /// The operation.
    pub opcode: Opcode,
    /// How it ended.
    pub status: WorkCompletionStatus,
}

/// The RC queue pair state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum QueuePairState {
    /// Just created; nothing can be posted.
    Reset,
    /// Initialised with a PD and access rights; not connected.
    Init,
    /// Ready to receive: the remote endpoint is known; the responder side serves requests.
    ReadyToReceive,
    /// Ready to send: requests may be posted.
    ReadyToSend,
    /// Failed or torn down: every outstanding and later request completes WR_FLUSH_ERR.
    Error,
}

impl QueuePairState {
    /// All states, in gauge order.
    pub const ALL: [QueuePairState; 5] = [
        Self::Reset,
        Self::Init,
        Self::ReadyToReceive,
        Self::ReadyToSend,
        Self::Error,
    ];

    /// Index into gauge arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The short verbs name (RESET, INIT, RTR, RTS, ERR).
    pub fn verbs_name(self) -> &'static str {
        match self {
            Self::Reset => "RESET",
            Self::Init => "INIT",
            Self::ReadyToReceive => "RTR",
            Self::ReadyToSend => "RTS",
            Self::Error => "ERR",
        }
    }
}

/// What a peer needs to connect its queue pair to ours, one variant per provider, so that a
/// mismatched address (a verbs endpoint without a GID, a soft one with one) cannot be built.
/// Sent over the control plane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum QueuePairEndpoint {
    /// A queue pair of a loopback device in this process.
    Loopback {
        /// The device's id (random per device instance).
        device_id: u64,
        /// The queue pair number.
        qp_number: u32,
    },
    /// A queue pair of a soft NIC.
    Soft(SoftEndpoint),
    /// A queue pair of an `shm` device on this host.
    Shm(ShmEndpoint),
    /// An ibverbs RC queue pair.
    Verbs {
        /// The queue pair number.
        qp_number: u32,
        /// The port address and starting packet sequence number.
        address: VerbsAddress,
    },
}

/// Where a soft queue pair is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SoftEndpoint {
    /// The NIC's id (random per device instance).
    pub device_id: u64,
    /// The NIC's listening address, if it listens.
    pub address: Option<SocketAddr>,
    /// The queue pair number.
    pub qp_number: u32,
}

/// Where an `shm` queue pair is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmEndpoint {
    /// The device's id (random per device instance).
    pub device_id: u64,
    /// The device's Unix-domain socket, if it offers its memory (a listening device).
    pub socket: Option<std::path::PathBuf>,
    /// The queue pair number.
    pub qp_number: u32,
}

impl QueuePairEndpoint {
    /// The provider of the queue pair.
    pub fn backend(&self) -> Backend {
        match self {
            Self::Loopback { .. } => Backend::Loopback,
            Self::Soft(_) => Backend::Soft,
            Self::Verbs { .. } => Backend::Verbs,
            Self::Shm(_) => Backend::Shm,
        }
    }

    /// The queue pair number.
    pub fn qp_number(&self) -> u32 {
        match self {
            Self::Loopback { qp_number, .. } | Self::Verbs { qp_number, .. } => *qp_number,
            Self::Soft(soft) => soft.qp_number,
            Self::Shm(shm) => shm.qp_number,
        }
    }
}

/// What an ibverbs RC queue pair needs to reach its peer (exchanged over the control socket,
/// as `ibv_rc_pingpong` exchanges it): the GID (RoCE, or IB with a GRH), the LID (IB), the
/// starting PSN and the port's active MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct VerbsAddress {
    /// The port GID at the configured GID index.
    pub gid: [u8; 16],
    /// The port LID (0 on RoCE).
    pub lid: u16,
    /// The starting packet sequence number of the sender (24 bits).
    pub psn: u32,
    /// The port's active MTU as an `ibv_mtu` value (1 = 256 B … 5 = 4096 B).
    pub mtu: u32,
}

/// A remote key and the range it covers: what a server hands a client for one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteKey {
    /// The rkey.
    pub key: u32,
    /// Remote virtual address of the first byte.
    pub address: u64,
    /// Length in bytes.
    pub length: u64,
}

impl RemoteKey {
    /// A remote segment at `offset` bytes into the range.
    pub fn at(&self, offset: u64) -> RemoteSegment {
        RemoteSegment {
            address: self.address + offset,
            remote_key: self.key,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_names_round_trip() {
        for backend in Backend::ALL {
            assert_eq!(backend.to_string().parse::<Backend>(), Ok(backend));
        }
        assert_eq!(
            "rdma".parse::<Backend>().map_err(|error| error.to_string()),
            Err("unknown fabric `rdma`: expected soft, loopback, verbs or shm".to_string())
        );
        assert!(!Backend::Loopback.crosses_processes());
    }
}
