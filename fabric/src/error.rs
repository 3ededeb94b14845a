//! The one error enum of `rdkv-fabric`.
//!
//! Every variant carries the context a caller needs to act (sizes, limits, keys, queue pair
//! numbers) and, for memory and limit failures, the message names the fix. A work completion
//! that failed is the typed variant [`Error::WorkCompletion`], never a flattened I/O error.

use std::io;
use std::net::SocketAddr;

use crate::{Backend, QueuePairState, WorkCompletionStatus};

/// The result type of `rdkv-fabric`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can fail in the fabric and memory layers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Pinning would pass RLIMIT_MEMLOCK even after raising the soft limit to the hard limit.
    #[error(
        "cannot pin {requested_bytes} bytes: RLIMIT_MEMLOCK allows {limit_bytes} bytes and \
         {locked_bytes} are already locked by this process. Raise the limit: `ulimit -l unlimited` \
         in the launching shell, or a `memlock` line in /etc/security/limits.conf (for example \
         `* - memlock unlimited`), or LimitMEMLOCK= in a systemd unit. Note that this machine's \
         default is 8 MiB (ulimit -l 8192)"
    )]
    MemlockLimit {
        /// Bytes this allocation wanted to pin.
        requested_bytes: u64,
        /// The effective limit after trying to raise the soft limit.
        limit_bytes: u64,
        /// Bytes the process had locked already (VmLck).
        locked_bytes: u64,
    },

    /// Pinning would take more of the machine's RAM than the configured share allows.
    #[error(
        "cannot pin {requested_bytes} bytes: MemAvailable is {available_bytes} bytes and at most \
         {max_share_percent}% of it may be pinned ({allowed_bytes} bytes). Use a smaller index or \
         heap size, free memory, or raise the pin share (max_pinned_share)"
    )]
    InsufficientMemory {
        /// Bytes this allocation wanted to pin.
        requested_bytes: u64,
        /// MemAvailable from /proc/meminfo.
        available_bytes: u64,
        /// The configured maximum share of MemAvailable, in percent.
        max_share_percent: u32,
        /// `available_bytes` times the share.
        allowed_bytes: u64,
    },

    /// The hugepage policy is `require` but not enough 2 MiB hugepages are free.
    #[error(
        "hugepages are required but only {free_pages} of the {needed_pages} needed 2 MiB pages are \
         free: reserve more with `echo N > /proc/sys/vm/nr_hugepages` (or vm.nr_hugepages in \
         /etc/sysctl.conf), or set the hugepage policy to `auto`"
    )]
    HugepagesUnavailable {
        /// 2 MiB pages the allocation needs.
        needed_pages: u64,
        /// HugePages_Free from /proc/meminfo.
        free_pages: u64,
    },

    /// A memory size is zero or not representable.
    #[error("invalid memory size {length} bytes: {reason}")]
    InvalidMemorySize {
        /// The size that was asked for.
        length: u64,
        /// Why it is refused.
        reason: &'static str,
    },

    /// A store into a peer's read-only mapping (the `shm` provider's key state).
    #[error("a store into a read-only mapping of a peer's memory")]
    ReadOnlyMemory,

    /// `mmap` failed.
    #[error("map {length} bytes ({backing})")]
    MapMemory {
        /// Bytes asked for.
        length: u64,
        /// Which page backing was attempted.
        backing: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// `mlock` or `madvise` failed after the checks passed.
    #[error("{operation} {length} bytes")]
    PinMemory {
        /// The call that failed, as a verb phrase (`mlock`, `madvise DONTFORK`).
        operation: &'static str,
        /// Bytes concerned.
        length: u64,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// An access to pinned memory fell outside it.
    #[error("range [{offset}, {offset}+{length}) lies outside the {size}-byte memory block")]
    MemoryOutOfBounds {
        /// Start of the access.
        offset: u64,
        /// Length of the access.
        length: u64,
        /// Size of the block.
        size: u64,
    },

    /// An 8-byte atomic access is not 8-byte aligned.
    #[error("atomic access at offset {offset} is not 8-byte aligned")]
    MisalignedAtomic {
        /// The offset of the access.
        offset: u64,
    },

    /// A queue pair was asked to do something its state does not allow.
    #[error("queue pair {qp_number} is in state {state:?} and cannot {operation}")]
    InvalidQueuePairState {
        /// The queue pair number.
        qp_number: u32,
        /// Its current state.
        state: QueuePairState,
        /// What was attempted, as a verb phrase.
        operation: &'static str,
    },

    /// A posted list or a single work request is malformed before it reaches the NIC.
    #[error("invalid work request list on queue pair {qp_number}: {reason}")]
    InvalidWorkRequest {
        /// The queue pair number.
        qp_number: u32,
        /// What is wrong.
        reason: String,
    },

    /// A work request completed with an error status.
    #[error("work request {work_request_id} on queue pair {qp_number} completed with {status}")]
    WorkCompletion {
        /// The queue pair number.
        qp_number: u32,
        /// The caller's work request id.
        work_request_id: u64,
        /// The ibverbs status.
        status: WorkCompletionStatus,
    },

    /// A memory window bind or registration names memory outside its parent.
    #[error("bind or register [{address:#x}, +{length}) outside the parent range [{parent_address:#x}, +{parent_length})")]
    RangeOutsideParent {
        /// Start asked for.
        address: u64,
        /// Length asked for.
        length: u64,
        /// Start of the parent.
        parent_address: u64,
        /// Length of the parent.
        parent_length: u64,
    },

    /// Objects from different devices, protection domains or backends were combined.
    #[error("cannot combine fabric objects: {reason}")]
    ObjectMismatch {
        /// What does not match.
        reason: String,
    },

    /// Two endpoints use different backends.
    #[error("cannot connect a {local:?} queue pair to a {remote:?} endpoint")]
    BackendMismatch {
        /// This side's backend.
        local: Backend,
        /// The remote endpoint's backend.
        remote: Backend,
    },

    /// A remote endpoint names a device or queue pair that does not exist.
    #[error("remote endpoint not found: {reason}")]
    EndpointNotFound {
        /// What was not found.
        reason: String,
    },

    /// An `shm` device could not offer its memory on its Unix-domain socket.
    #[error("shm socket {path}: {operation}")]
    ShmSocket {
        /// The socket's path.
        path: std::path::PathBuf,
        /// What failed, as a verb phrase.
        operation: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// An `shm` peer refused to attach a queue pair, or answered something that is not the
    /// `shm` protocol.
    #[error("shm attach to {path} refused: {reason}")]
    ShmRefused {
        /// The peer's socket.
        path: std::path::PathBuf,
        /// Why.
        reason: String,
    },

    /// An `shm` device's shared key table is full.
    #[error(
        "the shm key table is full ({capacity} keys); deregister memory or unbind windows first"
    )]
    ShmKeyTableFull {
        /// Keys it holds.
        capacity: u64,
    },

    /// Memory registered with remote rights on a listening `shm` device must be shareable.
    #[error("memory of {length} bytes registered with remote rights on an shm device is not shareable; allocate it with PinnedMemory::allocate_shared")]
    NotShareable {
        /// The block's length.
        length: u64,
    },

    /// The soft NIC could not bind its listener.
    #[error("bind soft NIC listener on {address}")]
    BindListener {
        /// The address asked for.
        address: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// The soft NIC could not reach a peer NIC.
    #[error("connect soft NIC to {address} for queue pair {qp_number}")]
    ConnectPeer {
        /// The peer NIC's address.
        address: SocketAddr,
        /// The local queue pair number.
        qp_number: u32,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// A verbs completion queue has no room for another send queue: a CQ overrun on a NIC
    /// breaks every queue pair on it, so the sum of their depths must fit.
    #[error(
        "completion queue full: {committed} of its {capacity} entries are already promised to \
         queue pairs, and one with max_send_wr = {requested} does not fit; create the CQ larger \
         or the queue pair shallower"
    )]
    CompletionQueueFull {
        /// The CQ's entries.
        capacity: usize,
        /// Entries promised to the queue pairs already on it.
        committed: usize,
        /// The new queue pair's depth.
        requested: u32,
    },

    /// The verbs backend was asked for but this binary was built without it.
    #[error("the verbs backend is not in this build: {}", VERBS_BUILD_HINT)]
    VerbsNotBuilt,

    /// No usable RDMA device: the library, the device, the port or the GID is missing.
    #[error("RDMA device unavailable: {reason}")]
    VerbsDevice {
        /// What is missing, with the fix.
        reason: String,
    },

    /// An ibverbs call failed.
    #[error("ibverbs {operation} failed{}", qp_context(*qp_number))]
    VerbsCall {
        /// The call, as a verb phrase (`ibv_reg_mr`, `modify QP to RTR`).
        operation: &'static str,
        /// The queue pair concerned, if any.
        qp_number: Option<u32>,
        /// The OS error the call returned.
        #[source]
        source: io::Error,
    },
}

fn qp_context(qp_number: Option<u32>) -> String {
    qp_number
        .map(|number| format!(" on queue pair {number}"))
        .unwrap_or_default()
}

/// What to install and how to rebuild for the verbs backend.
pub const VERBS_BUILD_HINT: &str = "rebuild with `cargo build --release --features verbs` after \
     `apt-get install cmake clang libclang-dev` (libibverbs1 and the NIC's provider, e.g. \
     ibverbs-providers, are needed at run time)";

impl Error {
    /// Whether retrying the same call on a new queue pair may succeed: lost connections and
    /// flushed requests are retryable, protection and argument errors are not.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::WorkCompletion { status, .. } => status.is_retryable(),
            Error::ConnectPeer { .. } => true,
            _ => false,
        }
    }
}
