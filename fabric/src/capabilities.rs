//! What a provider states about itself, so that callers ask for a property instead of testing
//! a provider's name (as libfabric's providers state theirs in `fi_info`, ordering flags such
//! as `FI_ORDER_RAR` among them).
//!
//! Each provider states its own, as a constant in its module under `provider/`; an open device
//! answers [`crate::Device::capabilities`], and a provider's name answers
//! [`crate::Backend::capabilities`] where no device is open yet (a configuration being checked,
//! a server's endpoint in a welcome). `docs/fabric.md`, *Capabilities*, has the table.

/// The properties of one provider that its callers depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Whether the READs of one queue pair return their data in posting order, without a
    /// fence: the emulated providers run a queue pair's requests one after another, while a
    /// NIC may fetch a later READ's data before an earlier one's (`WorkRequest::fenced`). A
    /// client's guessed block (`client/src/connection/slot_cache.rs`) relies on it.
    pub ordered_reads: bool,
    /// Whether a memory window bind waits for a completion from a NIC, and so may block its
    /// thread (verbs: up to twice the device's `retry_timeout`). An async caller moves such
    /// a call off its worker; one that cannot block runs directly.
    pub binds_may_block: bool,
    /// Whether a queue pair's drain, or a window's revocation, may wait: for the NIC's flush
    /// completions (verbs: up to `retry_timeout` + 1 s), or for a requester in another process
    /// to leave the request it is inside (shm: up to `retry_timeout`). A teardown on such a
    /// provider runs on a blocking thread, never on an async worker.
    pub teardown_may_block: bool,
    /// Whether a post's requests are executed by a posting thread, before `post` returns,
    /// with no transport, engine thread or NIC in between (loopback; shm, where the thread
    /// that finds the queue pair's executor free runs every request queued on it).
    pub completes_inside_post: bool,
    /// Whether a device offers its registered memory to processes of its host as memory
    /// files, which they map (shm): what it registers with remote rights must then be
    /// allocated shareable, and only authenticated clients of the same host may use it.
    pub shares_memory: bool,
    /// Whether queue pairs in other processes can reach a device (`loopback` lives in one
    /// process: it serves tests and the fabric benchmark, never a node).
    pub crosses_processes: bool,
    /// Whether a requester's connect needs the responder's queue pair connected to it first
    /// (shm: the node takes an attach only from the queue pair it was told of), so a client
    /// names its endpoint before it connects; elsewhere it connects first and the node's
    /// connect finds (soft: waits for) the client's.
    pub responder_connects_first: bool,
}
