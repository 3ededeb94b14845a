//! The `shm` provider: one-sided RDMA semantics between processes of one host, over shared
//! memory, as libfabric's `shm` provider keeps RMA and atomics within a node.
//!
//! - **A listening device offers its memory** on a Unix-domain socket (mode 0600). Memory it
//!   registers with remote rights must be shareable ([`PinnedMemory::allocate_shared`]: a
//!   memory file mapped `MAP_SHARED`, still pinned and checked as any block). Its keys and
//!   queue pairs are mirrored into a shared key state that only it writes (`state.rs`).
//! - **A requester attaches** a queue pair with one hello on that socket (`socket.rs`); the
//!   answer carries the key state (read-only), the epochs and the memory files (`SCM_RIGHTS`).
//! - **The requester does the NIC's work**: a post runs each request at once, in order, on the
//!   mapped memory, after the responder's checks in rxe's order on the shared keys, with the
//!   same atomic accesses as the emulated responder ([`engine::perform`]). Completions are
//!   reported before `post` returns: no system call, no thread hop.
//! - **Revocation and teardown keep the card's rule**: a request runs between two increments of
//!   its queue pair's epoch; a revoked key or a queue pair moved to ERROR is published first,
//!   and the device then waits until the epochs of the requesters that might still use it have
//!   moved on (at most `retry_timeout`, for a requester that died mid-request), before the
//!   model releases the memory.
//!
//! The kernel cannot revoke a mapping: a process that holds the memory files can reach all of
//! the device's shared memory. The keys are enforced by this library, not by hardware; see
//! *Trust* in `docs/fabric.md`.

mod direct;
mod socket;
mod state;

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::capabilities::Capabilities;
use crate::completion::CompletionQueueInner;
use crate::device::DeviceInner;
use crate::direct::DirectAccess;
use crate::error::{Error, Result};
use crate::memory::PinnedMemory;
use crate::protection::{KeyRights, ProtectionEntry};
use crate::provider::engine::{self, RemoteRequest};
use crate::queue_pair::{
    place_payload, InFlight, InlineFailure, InlineOutcome, QueuePairConfig, QueuePairShared,
};
use crate::revocation::RequesterInside;
use crate::seam::{DeviceProvider, KeyMirror, ProviderFuture, QueuePairProvider, Submission};
use crate::types::{
    AccessFlags, Backend, Opcode, QueuePairEndpoint, QueuePairState, ShmEndpoint, WorkCompletion,
    WorkCompletionStatus, WorkRequest,
};
use crate::{lock, read_lock, write_lock};

use socket::{Answer, AnswerStatus, Hello, HelloKind, HELLO_LENGTH, MAX_MEMORY_FILES};
use state::{EpochMarker, KeyView, QueuePairStatus, SharedState, SharedView};

/// How long a requester keeps trying to attach while the responder queue pair is not connected
/// yet (both sides connect at about the same time).
const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);
/// The most a connection to a device's socket may take for its whole 32-byte hello (at most
/// the device's `hello_deadline`): the accept thread serves one connection at a time, and a
/// requester on this host sends its hello at once.
const SHM_HELLO_DEADLINE: Duration = Duration::from_millis(500);
/// The longest Unix-domain socket path (`sun_path` holds 108 bytes with the terminating NUL).
const MAX_SOCKET_PATH: usize = 107;
/// An epoch slot value meaning "no requester attached".
const NO_EPOCH_SLOT: u32 = u32::MAX;

/// Where a device offers its memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Listen {
    /// Nowhere: the device only attaches to others.
    No,
    /// A socket in the temporary directory, named after the process and the device.
    Automatic,
    /// This socket path.
    At(PathBuf),
}

/// What shm states (`docs/fabric.md`, *Capabilities*): the requester runs its requests itself,
/// in order, on the node's memory files; a drain and a revocation wait for the requesters'
/// epochs (at most `retry_timeout`); the node takes an attach only from the queue pair it was
/// told of.
pub(crate) const CAPABILITIES: Capabilities = Capabilities {
    ordered_reads: true,
    binds_may_block: false,
    teardown_may_block: true,
    completes_inside_post: true,
    shares_memory: true,
    crosses_processes: true,
    responder_connects_first: true,
};

/// An `shm` device.
#[derive(Debug)]
pub(crate) struct ShmDevice {
    /// Where it listens.
    listen: Listen,
    /// A listening device's offer, once started.
    offer: OnceLock<Arc<Offer>>,
    /// The peers this device's queue pairs attached to, mapped once per peer.
    remotes: Arc<Mutex<HashMap<u64, Weak<RemoteDevice>>>>,
}

impl ShmDevice {
    pub(crate) fn new(listen: Listen) -> Self {
        Self {
            listen,
            offer: OnceLock::new(),
            remotes: Arc::default(),
        }
    }
}

impl DeviceProvider for ShmDevice {
    fn backend(&self) -> Backend {
        Backend::Shm
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn start(&self, device: &Arc<DeviceInner>) -> Result<()> {
        let path = match &self.listen {
            Listen::No => return Ok(()),
            Listen::Automatic => std::env::temp_dir().join(format!(
                "rdkv-shm-{}-{:016x}.sock",
                std::process::id(),
                device.id
            )),
            Listen::At(path) => path.clone(),
        };
        let offer = Offer::start(device, path)?;
        device.table.set_mirror(offer.clone());
        let _ = self.offer.set(offer);
        Ok(())
    }

    fn socket_path(&self) -> Option<PathBuf> {
        self.offer.get().map(|offer| offer.socket.clone())
    }

    fn create_queue_pair(
        &self,
        _device: &DeviceInner,
        _completion_queue: &CompletionQueueInner,
        _config: QueuePairConfig,
    ) -> Result<Box<dyn QueuePairProvider>> {
        Ok(Box::new(ShmQueuePair {
            offer: self.offer.get().cloned(),
            remotes: self.remotes.clone(),
            identity: OnceLock::new(),
            responder: Mutex::new(ResponderState::default()),
            epoch_slot: AtomicU32::new(NO_EPOCH_SLOT),
            requester: Mutex::new(None),
            stuck_epoch: Mutex::new(None),
            attachment: OnceLock::new(),
            pending: Mutex::new(VecDeque::new()),
            executor: Mutex::new(Executor::default()),
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for ShmDevice {
    fn drop(&mut self) {
        if let Some(offer) = self.offer.get() {
            offer.stop();
        }
    }
}

/// A listening device's side: its shared state, socket and memory files.
#[derive(Debug)]
pub(crate) struct Offer {
    /// The device (weak: the device owns the offer through its protection table).
    device: Weak<DeviceInner>,
    /// The device's id.
    device_id: u64,
    /// The key state and epochs.
    state: SharedState,
    /// A read-only descriptor of the key state, for peers.
    keys_read_only: OwnedFd,
    /// The socket path.
    socket: PathBuf,
    /// Shareable blocks with published keys, by id.
    memories: Mutex<HashMap<u64, Weak<PinnedMemory>>>,
    /// Set when the device is dropped.
    closing: AtomicBool,
    /// The accept thread.
    thread: Mutex<Option<JoinHandle<()>>>,
    /// How long a revocation waits for a requester that stopped inside a request.
    retry_timeout: Duration,
    /// How long a peer has for its hello.
    hello_deadline: Duration,
    /// Requesters found still inside a request when a wait for them passed its bound: epoch
    /// slot → the epoch they were inside. A later wait that finds the same slot in the same
    /// epoch answers at once instead of waiting `retry_timeout` again (one stopped client with
    /// several windows held the collector's thread 2 s per window). At most one entry per
    /// slot.
    stuck: Mutex<HashMap<u32, u64>>,
}

impl Offer {
    fn start(device: &Arc<DeviceInner>, socket: PathBuf) -> Result<Arc<Self>> {
        // Absolute: peers in other directories reach it by the path the endpoint carries.
        let socket = std::path::absolute(&socket).unwrap_or(socket);
        let socket_error = |operation, source| Error::ShmSocket {
            path: socket.clone(),
            operation,
            source,
        };
        let state = SharedState::create(device.id, device.config.max_message_size)?;
        let (descriptor, _) = state.keys.shared_descriptor().ok_or_else(|| {
            socket_error(
                "share the key state",
                std::io::Error::other("not shareable"),
            )
        })?;
        // A new, read-only open of the same memory file: a peer cannot map it writable.
        let keys_read_only = OwnedFd::from(
            std::fs::File::open(format!("/proc/self/fd/{}", descriptor.as_raw_fd()))
                .map_err(|source| socket_error("reopen the key state read-only", source))?,
        );
        let length = socket.as_os_str().len();
        if length > MAX_SOCKET_PATH {
            return Err(socket_error(
                "bind",
                std::io::Error::other(format!(
                    "the path is {length} bytes; a Unix-domain socket path holds at most {MAX_SOCKET_PATH}: choose a shorter shm_socket (or --shm-socket)"
                )),
            ));
        }
        remove_stale_socket(&socket).map_err(|source| socket_error("check the path of", source))?;
        // Bound under a random name, made 0600, then renamed into place: the socket is never
        // reachable by its path with another mode.
        let staging = socket.with_file_name(format!(
            ".{}.{:016x}",
            socket
                .file_name()
                .map_or_else(String::new, |name| name.to_string_lossy().into_owned()),
            crate::device::random_id()
        ));
        let staged = (|| {
            let listener = UnixListener::bind(&staging)?;
            std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o600))?;
            std::fs::rename(&staging, &socket)?;
            Ok(listener)
        })();
        let listener = staged.map_err(|source| {
            let _ = std::fs::remove_file(&staging);
            socket_error("bind (mode 0600)", source)
        })?;
        let offer = Arc::new(Self {
            device: Arc::downgrade(device),
            device_id: device.id,
            state,
            keys_read_only,
            socket: socket.clone(),
            memories: Mutex::new(HashMap::new()),
            closing: AtomicBool::new(false),
            thread: Mutex::new(None),
            retry_timeout: device.config.retry_timeout,
            hello_deadline: device.config.hello_deadline,
            stuck: Mutex::new(HashMap::new()),
        });
        let serving = offer.clone();
        let thread = std::thread::Builder::new()
            .name("rdkv-shm-accept".into())
            .spawn(move || serving.accept_loop(&listener))
            .map_err(|source| socket_error("start the accept thread for", source))?;
        *lock(&offer.thread) = Some(thread);
        tracing::info!(socket = %offer.socket.display(), "shm device offers its memory");
        Ok(offer)
    }

    /// Answers hellos, one at a time, until the device closes.
    fn accept_loop(&self, listener: &UnixListener) {
        for stream in listener.incoming() {
            if self.closing.load(Ordering::Acquire) {
                break;
            }
            let Ok(stream) = stream else {
                continue;
            };
            if let Err(error) = self.answer(&stream) {
                tracing::debug!(%error, "shm hello not answered");
            }
        }
    }

    /// Reads one hello and answers it.
    fn answer(&self, stream: &UnixStream) -> std::io::Result<()> {
        // One deadline for the whole hello, however it trickles in: a requester on this host
        // sends its 32 bytes at once, and the accept thread answers one connection at a time.
        let deadline = Instant::now() + self.hello_deadline.min(SHM_HELLO_DEADLINE);
        stream.set_write_timeout(Some(SHM_HELLO_DEADLINE))?;
        let mut bytes = [0u8; HELLO_LENGTH];
        let mut received = 0;
        while received < HELLO_LENGTH {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            stream.set_read_timeout(Some(left))?;
            match (&*stream).read(&mut bytes[received..]) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(read) => received += read,
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
        let refused = || Answer::bare(AnswerStatus::Refused);
        let Some(hello) =
            Hello::decode(&bytes).filter(|hello| hello.target_device == self.device_id)
        else {
            return socket::send_answer(stream, &refused(), &[]);
        };
        let Some(queue_pair) = self
            .device
            .upgrade()
            .and_then(|device| device.queue_pair(hello.target_qp))
        else {
            return socket::send_answer(stream, &refused(), &[]);
        };
        let Some(part) = queue_pair.provider.as_any().downcast_ref::<ShmQueuePair>() else {
            return socket::send_answer(stream, &refused(), &[]);
        };
        let epoch_slot = match part.accept_hello(&queue_pair, &hello, &self.state) {
            Ok(slot) => slot,
            Err(status) => return socket::send_answer(stream, &Answer::bare(status), &[]),
        };
        let memories = self.live_memories();
        let mut answer = Answer {
            status: AnswerStatus::Accepted,
            epoch_slot,
            keys_length: self.state.keys.len(),
            epochs_length: self.state.epochs.len(),
            memories: Vec::with_capacity(memories.len()),
        };
        let mut descriptors: Vec<BorrowedFd<'_>> = vec![
            self.keys_read_only.as_fd(),
            match self.state.epochs.shared_descriptor() {
                Some((descriptor, _)) => descriptor,
                None => return socket::send_answer(stream, &refused(), &[]),
            },
        ];
        for memory in &memories {
            if let Some((descriptor, id)) = memory.shared_descriptor() {
                answer.memories.push((id, memory.len()));
                descriptors.push(descriptor);
            }
        }
        socket::send_answer(stream, &answer, &descriptors)?;
        if hello.kind == HelloKind::Attach {
            *lock(&part.requester) = Some(stream.try_clone()?);
        }
        Ok(())
    }

    /// The shareable blocks that have published keys and are still alive (at most
    /// [`MAX_MEMORY_FILES`]).
    fn live_memories(&self) -> Vec<Arc<PinnedMemory>> {
        let mut memories = lock(&self.memories);
        memories.retain(|_, memory| memory.strong_count() > 0);
        let live: Vec<_> = memories.values().filter_map(Weak::upgrade).collect();
        if live.len() > MAX_MEMORY_FILES {
            tracing::warn!(
                blocks = live.len(),
                "more shared blocks than one shm answer carries; the rest are not reachable"
            );
        }
        live.into_iter().take(MAX_MEMORY_FILES).collect()
    }

    /// Waits until no attached requester can still be inside a request that saw the state
    /// before the caller's change: only `bound`'s requester, when the change is the revocation
    /// of a window bound to that queue pair (no other requester's request passes its key
    /// check), so that a requester stopped inside a request delays the revocation of its own
    /// windows only, not every client's.
    fn wait_for_requesters(&self, bound: Option<u32>) -> Option<RequesterInside> {
        let device = self.device.upgrade()?;
        let requesters: Vec<(Weak<QueuePairShared>, u32)> = device
            .queue_pairs
            .iter()
            .filter(|entry| bound.is_none_or(|bound| *entry.key() == bound))
            .filter_map(|entry| {
                let queue_pair = entry.value().upgrade()?;
                let part = queue_pair
                    .provider
                    .as_any()
                    .downcast_ref::<ShmQueuePair>()?;
                let slot = part.epoch_slot.load(Ordering::Acquire);
                (slot != NO_EPOCH_SLOT).then(|| (entry.value().clone(), slot))
            })
            .collect();
        let mut inside = Vec::new();
        for (queue_pair, slot) in requesters {
            if let Some(seen) = self.wait_quiet(slot) {
                inside.push(RequesterInside::new(move || {
                    // Gone with its queue pair (kept by the server while it is inside).
                    queue_pair.upgrade().is_none_or(|queue_pair| {
                        queue_pair
                            .provider
                            .as_any()
                            .downcast_ref::<ShmQueuePair>()
                            .is_none_or(|part| part.left_epoch(slot, seen))
                    })
                }));
            }
        }
        RequesterInside::all(inside)
    }

    /// Waits for the requester on epoch slot `slot`, bounded by the retry timeout; returns the
    /// epoch it is still inside when the bound passed.
    fn wait_quiet(&self, slot: u32) -> Option<u64> {
        let known = lock(&self.stuck).get(&slot).copied();
        if let Some(seen) = known {
            // Orders the caller's change before the epoch read, as `SharedState::wait_quiet`.
            fence(Ordering::SeqCst);
            if !self.state.left_epoch(slot, seen) {
                // Still inside the request an earlier wait gave up on: no new wait.
                return Some(seen);
            }
            lock(&self.stuck).remove(&slot);
        }
        let stuck = self.state.wait_quiet(slot, self.retry_timeout);
        if let Some(seen) = stuck {
            lock(&self.stuck).insert(slot, seen);
            tracing::warn!(
                epoch_slot = slot,
                waited = ?self.retry_timeout,
                "an shm requester stayed inside a request past the retry timeout (stopped or dead); going on"
            );
        }
        stuck
    }

    /// Closes the device: requesters see it closed, the accept thread ends, the socket goes.
    fn stop(&self) {
        self.state.close();
        self.closing.store(true, Ordering::Release);
        // Wakes the accept thread, which then sees `closing` and ends; not joined: it may be
        // reading a hello (at most SHM_HELLO_DEADLINE), and a stop never waits for a peer.
        let _ = UnixStream::connect(&self.socket);
        drop(lock(&self.thread).take());
        let _ = std::fs::remove_file(&self.socket);
    }
}

impl KeyMirror for Offer {
    fn publish(&self, key: u32, entry: &ProtectionEntry) -> Result<()> {
        let remote =
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
        if !entry.access.intersects(remote) {
            // A local buffer: no peer reaches it.
            return Ok(());
        }
        let Some((_, memory_id)) = entry.memory.shared_descriptor() else {
            return Err(Error::NotShareable {
                length: entry.memory.len(),
            });
        };
        lock(&self.memories).insert(memory_id, Arc::downgrade(&entry.memory));
        self.state.publish_key(
            key,
            &KeyView {
                rights: KeyRights {
                    protection_domain: entry.protection_domain,
                    bound_qp: entry.bound_qp,
                    access: entry.access,
                    address: entry.address,
                    length: entry.length,
                },
                memory_id,
                memory_base: entry.memory.base_address(),
            },
        )
    }

    fn revoke(&self, key: u32) -> Option<RequesterInside> {
        let bound = self.state.revoke_key(key)?;
        self.wait_for_requesters(bound)
    }
}

/// Removes a socket file left by a process that is gone (nobody accepts on it); refuses one
/// that is in use, and anything that is not a socket.
fn remove_stale_socket(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(error),
        Ok(metadata) if !metadata.file_type().is_socket() => Err(std::io::Error::other(
            "the path exists and is not a socket; choose another shm_socket",
        )),
        Ok(_) if UnixStream::connect(path).is_ok() => Err(std::io::Error::other(
            "another process accepts on this socket; choose another shm_socket or stop it",
        )),
        Ok(_) => std::fs::remove_file(path),
    }
}

/// A peer device this process attached to: its key state, epochs and memory files, mapped.
#[derive(Debug)]
struct RemoteDevice {
    /// Its id.
    device_id: u64,
    /// Its socket.
    socket: PathBuf,
    /// Its key state (read-only).
    keys: SharedView,
    /// Its epochs.
    epochs: PinnedMemory,
    /// Its shareable blocks, by id.
    memories: RwLock<HashMap<u64, Arc<PinnedMemory>>>,
}

impl RemoteDevice {
    /// Maps the memory files of an answer that are not mapped yet; with `complete`, forgets
    /// the blocks the answer no longer lists (the peer freed them).
    fn add_memories(
        &self,
        listed: &[(u64, u64)],
        descriptors: Vec<OwnedFd>,
        complete: bool,
    ) -> std::result::Result<(), String> {
        let mut memories = write_lock(&self.memories);
        if complete {
            memories.retain(|id, _| listed.iter().any(|(listed_id, _)| listed_id == id));
        }
        for ((id, length), descriptor) in listed.iter().zip(descriptors) {
            if memories.contains_key(id) {
                continue;
            }
            let memory = PinnedMemory::map_peer(descriptor, *length, true)
                .map_err(|error| format!("map a memory file: {error}"))?;
            memories.insert(*id, Arc::new(memory));
        }
        Ok(())
    }

    fn memory(&self, id: u64) -> Option<Arc<PinnedMemory>> {
        read_lock(&self.memories).get(&id).cloned()
    }
}

/// One hello and its answer over a new connection to `socket` (blocking, bounded).
/// One exchange's outcome: the answer, its descriptors, and the connection (an attached
/// requester keeps it: the responder holds its end while its queue pair lives, so its closing
/// says the responder is gone).
type Exchanged = (Answer, Vec<OwnedFd>, UnixStream);

fn exchange(socket: &Path, hello: &Hello) -> Result<Exchanged> {
    let socket_error = |operation, source| Error::ShmSocket {
        path: socket.to_path_buf(),
        operation,
        source,
    };
    let mut stream =
        UnixStream::connect(socket).map_err(|source| socket_error("connect to", source))?;
    // The device answers at once unless its accept thread is busy with another connection's
    // hello (at most SHM_HELLO_DEADLINE each).
    stream
        .set_read_timeout(Some(Duration::from_secs(1)))
        .and_then(|()| stream.set_write_timeout(Some(Duration::from_secs(1))))
        .map_err(|source| socket_error("set timeouts on", source))?;
    stream
        .write_all(&hello.encode())
        .map_err(|source| socket_error("send the hello to", source))?;
    let (answer, descriptors) =
        socket::receive_answer(&stream).map_err(|reason| Error::ShmRefused {
            path: socket.to_path_buf(),
            reason,
        })?;
    Ok((answer, descriptors, stream))
}

/// A requester queue pair's attachment to its responder.
#[derive(Debug)]
struct Attachment {
    /// The responder's device.
    remote: Arc<RemoteDevice>,
    /// The responder queue pair.
    responder_qp: u32,
    /// The epoch slot the responder gave this queue pair.
    epoch_slot: u32,
    /// The attach connection, which the responder keeps open while its queue pair lives (a
    /// dead responder process closes it).
    peer: UnixStream,
    /// The responder was found gone.
    peer_gone: AtomicBool,
    /// When the attach connection was made (the origin of `last_peek`).
    attached_at: Instant,
    /// Microseconds after `attached_at` of the last peek at the connection (0: never).
    last_peek: AtomicU64,
    /// Where the responder queue pair was last found in the responder's key state
    /// (`SharedView::queue_pair_hinted`; `u64::MAX`: not yet).
    responder_slot: AtomicU64,
}

/// How often, at most, a requester peeks at its attach connection to see whether the responder
/// process is still there: one system call per doorbell cost a quarter of a GET's CPU under
/// load, and a requester learns of a dead responder within this much of its death instead of
/// at the very next doorbell (requests in between run on memory the dead process no longer
/// reads, as if they had run just before it died).
pub const PEER_CHECK_EVERY: Duration = Duration::from_millis(1);

/// A requester inside its epoch, with the responder found receiving.
struct Inside<'a> {
    /// Marks the epoch until dropped.
    _marker: EpochMarker<'a>,
    /// The responder queue pair's protection domain.
    protection_domain: u32,
    /// The responder's key generation, read inside the epoch.
    key_generation: u64,
}

/// What a request needs before it can run.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    /// It ran, or failed with this status.
    Answered(WorkCompletionStatus),
    /// A READ that ran, its data copied straight into the local buffer.
    Placed(WorkCompletionStatus),
    /// The responder does not answer (its queue pair or device is gone).
    Unanswered,
    /// The responder's queue pair is in ERROR: this request, and every one after it, did not
    /// run (requests run here, in order).
    Stopped,
    /// Its key names a block this process has not mapped yet.
    Unmapped,
}

/// Keys a requester keeps resolved ([`Mapped`]); a full cache starts again empty.
const RESOLVED_KEYS: usize = 16;

/// What a requester's executor keeps of its responder between requests: the memory blocks it
/// has mapped, and the keys it resolved while no key was revoked (each READ looked its key up
/// in the shared key state: a quarter of a direct GET's instructions).
#[derive(Debug, Default)]
struct Mapped {
    /// The responder's memory blocks, by their id.
    blocks: Vec<(u64, Arc<PinnedMemory>)>,
    /// Keys resolved under `generation`, with what they grant.
    keys: Vec<(u32, KeyView)>,
    /// The responder's key generation `keys` were resolved under.
    generation: u64,
    /// The keys direct access resolved.
    direct: direct::DirectKeys,
}

impl Mapped {
    /// The live key `key`, from the cache while the key generation of the epoch `inside` is
    /// the cache's, else from the responder's key state.
    fn key(&mut self, remote: &RemoteDevice, inside: &Inside<'_>, key: u32) -> Option<KeyView> {
        if self.generation != inside.key_generation {
            self.keys.clear();
            self.generation = inside.key_generation;
        }
        if let Some((_, view)) = self.keys.iter().find(|(known, _)| *known == key) {
            return Some(*view);
        }
        let view = remote.keys.key(key)?;
        if self.keys.len() >= RESOLVED_KEYS {
            self.keys.clear();
        }
        self.keys.push((key, view));
        Some(view)
    }
}

/// Where a checked request lands in the responder's memory ([`Attachment::resolve_inside`]).
#[derive(Debug, Clone, Copy)]
struct Resolved {
    /// The block: its index in the requester's cache of mapped blocks.
    block: usize,
    /// The offset in the block.
    offset: u64,
    /// The request's length (not zero).
    length: u64,
    /// The key, as resolved.
    view: KeyView,
}

impl Attachment {
    /// Whether the responder still holds its end of the attach connection: a responder whose
    /// process died (its memory files stay mapped here) or whose queue pair was destroyed
    /// answers nothing more. One non-blocking peek per doorbell, at most one per
    /// [`PEER_CHECK_EVERY`].
    fn peer_alive(&self) -> bool {
        self.peer_alive_at(Instant::now())
    }

    /// [`Attachment::peer_alive`] with the clock read by the caller just before (a direct
    /// access's caller reads it anyway: one clock read less per direct GET).
    fn peer_alive_at(&self, now: Instant) -> bool {
        if self.peer_gone.load(Ordering::Acquire) {
            return false;
        }
        let now = (now.saturating_duration_since(self.attached_at).as_micros() as u64).max(1);
        let last = self.last_peek.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < PEER_CHECK_EVERY.as_micros() as u64 {
            return true;
        }
        self.last_peek.store(now, Ordering::Relaxed);
        let mut byte = [0u8; 1];
        let alive = match nix::sys::socket::recv(
            self.peer.as_raw_fd(),
            &mut byte,
            nix::sys::socket::MsgFlags::MSG_PEEK | nix::sys::socket::MsgFlags::MSG_DONTWAIT,
        ) {
            // End of stream: the responder closed it.
            Ok(0) => false,
            Ok(_) => true,
            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => true,
            Err(_) => false,
        };
        if !alive {
            self.peer_gone.store(true, Ordering::Release);
        }
        alive
    }

    /// When the next look at the peer is due: [`PEER_CHECK_EVERY`] after the last look made
    /// (by any caller of [`Attachment::peer_alive_at`]), not after the last call, which may
    /// have been answered by an earlier look.
    fn next_look_due(&self) -> Option<Instant> {
        let last = Duration::from_micros(self.last_peek.load(Ordering::Relaxed));
        self.attached_at
            .checked_add(last.checked_add(PEER_CHECK_EVERY)?)
    }

    /// Enters this requester's epoch and checks that the responder receives: requests run
    /// while the returned marker lives, and a drain or revocation on the responder's side
    /// waits for it (`state.rs`, `wait_quiet`). `Err`: what a request meets instead.
    fn enter(&self) -> std::result::Result<Inside<'_>, Outcome> {
        let remote = &self.remote;
        let marker = EpochMarker::enter(&remote.epochs, self.epoch_slot);
        if !remote.keys.is_open() {
            return Err(Outcome::Unanswered);
        }
        let Some(responder) = remote
            .keys
            .queue_pair_hinted(self.responder_qp, &self.responder_slot)
        else {
            return Err(Outcome::Unanswered);
        };
        if responder.status == QueuePairStatus::NotReceiving
            && responder.epoch_slot == self.epoch_slot
        {
            return Err(Outcome::Stopped);
        }
        if responder.status != QueuePairStatus::Receiving || responder.epoch_slot != self.epoch_slot
        {
            return Err(Outcome::Unanswered);
        }
        Ok(Inside {
            _marker: marker,
            protection_domain: responder.protection_domain,
            key_generation: remote.keys.key_generation(),
        })
    }

    /// Where `request` lands in the responder's memory, inside an epoch entered by
    /// [`Attachment::enter`]: the block (its index in `cache`, mapping it there first) and the
    /// offset and length in it, after the key, rights and length checks a NIC makes. `Ok(None)`:
    /// a zero-length request, which succeeds with nothing to do. `Err`: what the request meets
    /// instead.
    fn resolve_inside(
        &self,
        inside: &Inside<'_>,
        cache: &mut Mapped,
        request: &RemoteRequest,
    ) -> std::result::Result<Option<Resolved>, Outcome> {
        let remote = &self.remote;
        let length = match engine::request_length(request, remote.keys.max_message_size()) {
            Ok(0) => return Ok(None),
            Ok(length) => length,
            Err(status) => return Err(Outcome::Answered(status)),
        };
        let Some(key) = cache.key(remote, inside, request.remote_key) else {
            return Err(Outcome::Answered(WorkCompletionStatus::RemoteAccessError));
        };
        key.rights
            .check(
                inside.protection_domain,
                self.responder_qp,
                request.remote_address,
                length,
                request.opcode,
            )
            .map_err(Outcome::Answered)?;
        let blocks = &mut cache.blocks;
        let block = match blocks.iter().position(|(id, _)| *id == key.memory_id) {
            Some(index) => index,
            None => match remote.memory(key.memory_id) {
                Some(memory) => {
                    blocks.push((key.memory_id, memory));
                    blocks.len() - 1
                }
                None => return Err(Outcome::Unmapped),
            },
        };
        let Some(offset) = request.remote_address.checked_sub(key.memory_base) else {
            return Err(Outcome::Answered(
                WorkCompletionStatus::RemoteOperationError,
            ));
        };
        Ok(Some(Resolved {
            block,
            offset,
            length,
            view: key,
        }))
    }

    /// After a READ's copy: whether the responder queue pair still receives. A node moves it
    /// out of receiving before it releases or reuses anything this requester could read; its
    /// drain waits for a requester inside a request only up to `retry_timeout`, and one stopped
    /// there (SIGSTOP) may resume after the node gave up and reused the memory under the copy.
    /// So a READ is trusted only if the queue pair still received after the copy (the copy's
    /// loads are ordered before this look by the acquire fence; a copy that saw reused bytes
    /// ran after the node's change, which this look then sees); otherwise it did not run
    /// (`NotExecuted`), as a request after the change does not.
    fn still_receiving(&self) -> bool {
        fence(Ordering::Acquire);
        self.remote
            .keys
            .queue_pair_hinted(self.responder_qp, &self.responder_slot)
            .is_some_and(|responder| {
                responder.status == QueuePairStatus::Receiving
                    && responder.epoch_slot == self.epoch_slot
            })
    }

    /// [`Attachment::resolve_inside`] in the epoch `inside` ([`Attachment::enter`]: entered for
    /// one request alone, or once for a list run inside its post). A key that names a block
    /// registered after the attach maps the responder's current memory files once, out of the
    /// epoch, then enters it again; never `Outcome::Unmapped`.
    fn resolve_in<'a>(
        &'a self,
        inside: &mut std::result::Result<Inside<'a>, Outcome>,
        own_qp: u32,
        cache: &mut Mapped,
        request: &RemoteRequest,
    ) -> std::result::Result<Option<Resolved>, Outcome> {
        let mut refreshed = false;
        loop {
            let entered = match inside {
                Ok(entered) => entered,
                Err(outcome) => return Err(*outcome),
            };
            match self.resolve_inside(entered, cache, request) {
                Err(Outcome::Unmapped) if !refreshed => {
                    refreshed = true;
                    // Out of the epoch while the responder answers the refresh.
                    *inside = Err(Outcome::Unanswered);
                    if let Err(error) = self.refresh(own_qp) {
                        tracing::warn!(%error, "shm memory files not refreshed");
                    }
                    *inside = self.enter();
                }
                Err(Outcome::Unmapped) => {
                    return Err(Outcome::Answered(
                        WorkCompletionStatus::RemoteOperationError,
                    ))
                }
                resolved => return resolved,
            }
        }
    }

    /// Runs one request on the responder's memory, as the responder's NIC would, in the epoch
    /// `inside` ([`Attachment::resolve_in`]).
    #[allow(
        clippy::too_many_arguments,
        reason = "one request's parts and the list's buffers"
    )]
    fn execute_in<'a>(
        &'a self,
        inside: &mut std::result::Result<Inside<'a>, Outcome>,
        own_qp: u32,
        cache: &mut Mapped,
        request: &RemoteRequest,
        local: &LocalBuffer,
        write_payload: &[u8],
        response: &mut Vec<u8>,
    ) -> Outcome {
        response.clear();
        let resolved = match self.resolve_in(inside, own_qp, cache, request) {
            Ok(Some(resolved)) => resolved,
            Ok(None) => return Outcome::Answered(WorkCompletionStatus::Success),
            Err(outcome) => return outcome,
        };
        let memory = &cache.blocks[resolved.block].1;
        if let (Opcode::Read, Ok(Some(target))) = (request.opcode, local) {
            // Straight from the responder's memory into the requester's buffer: one copy.
            let copied = memory.copy_to(
                resolved.offset,
                &target.entry.memory,
                target.memory_offset,
                resolved.length,
            );
            if !self.still_receiving() {
                return Outcome::Stopped;
            }
            return Outcome::Placed(match copied {
                Ok(()) => WorkCompletionStatus::Success,
                Err(_) => WorkCompletionStatus::RemoteOperationError,
            });
        }
        // An atomic runs only while the queue pair still receives: a requester stopped inside
        // this list after its checks (SIGSTOP) and resumed after the node fenced it must not
        // swap a slot word whose block the node may have reused meanwhile, which the same
        // word could name again (the same key, length and offset: an ABA the slot word has no
        // generation against). A stop between this look and the atomic itself is a few
        // instructions wide.
        if request.opcode.is_atomic() && !self.still_receiving() {
            return Outcome::Stopped;
        }
        let status = engine::perform(
            memory,
            resolved.offset,
            request,
            resolved.length,
            write_payload,
            response,
        );
        if request.opcode == Opcode::Read && !self.still_receiving() {
            return Outcome::Stopped;
        }
        Outcome::Answered(status)
    }

    /// Fetches the responder's current memory files (a key named a block registered after the
    /// attach). Blocking: one local exchange.
    fn refresh(&self, own_qp: u32) -> std::result::Result<(), String> {
        let hello = Hello {
            kind: HelloKind::Refresh,
            target_qp: self.responder_qp,
            source_qp: own_qp,
            target_device: self.remote.device_id,
        };
        let (answer, descriptors, _) =
            exchange(&self.remote.socket, &hello).map_err(|error| error.to_string())?;
        if answer.status != AnswerStatus::Accepted || descriptors.len() < 2 {
            return Err("the responder refused to refresh".into());
        }
        let memories = descriptors.into_iter().skip(2).collect();
        self.remote.add_memories(&answer.memories, memories, true)
    }
}

/// A listening device's queue pair as a responder.
#[derive(Debug, Default)]
struct ResponderState {
    /// Connected (RTR or later) and not in ERROR.
    receiving: bool,
    /// The requester queue pair `connect` named.
    peer_qp: Option<u32>,
}

/// An `shm` queue pair: a responder on a listening device, a requester once attached.
#[derive(Debug)]
pub(crate) struct ShmQueuePair {
    /// The device's offer (a listening device).
    offer: Option<Arc<Offer>>,
    /// The device's mapped peers.
    remotes: Arc<Mutex<HashMap<u64, Weak<RemoteDevice>>>>,
    /// Its number and protection domain, once the model's queue pair exists.
    identity: OnceLock<(u32, u32)>,
    /// As a responder.
    responder: Mutex<ResponderState>,
    /// As a responder: the epoch slot of the attached requester.
    epoch_slot: AtomicU32,
    /// As a responder: its end of the attach connection, held while the queue pair lives (its
    /// closing tells the requester that nothing answers any more).
    requester: Mutex<Option<UnixStream>>,
    /// As a responder: the epoch its requester was still inside when the last drain's bound
    /// passed (stopped or dead inside a request); `None` when that drain found it out.
    stuck_epoch: Mutex<Option<u64>>,
    /// As a requester: the attachment, once connected to a listening peer.
    attachment: OnceLock<Attachment>,
    /// As a requester: requests posted and not yet run, in sequence order.
    pending: Mutex<VecDeque<Execution>>,
    /// As a requester: held by the thread running this queue pair's requests (the executor),
    /// with the blocks it used and its buffers.
    executor: Mutex<Executor>,
}

/// What the thread running a queue pair's requests keeps between doorbells: the blocks it
/// mapped, and buffers reused by every batch (a fresh batch queue, payload and response per
/// doorbell were three allocations per doorbell).
#[derive(Debug, Default)]
struct Executor {
    /// The responder's memory blocks this requester has mapped, and the keys it resolved.
    cache: Mapped,
    /// The batch being run, swapped with the queue pair's pending requests.
    batch: VecDeque<Execution>,
    /// A WRITE's payload.
    payload: Vec<u8>,
    /// A request's response.
    response: Vec<u8>,
    /// Before this instant direct access does not look at the peer again: [`PEER_CHECK_EVERY`]
    /// after the last look ([`Attachment::next_look_due`]), a comparison of instants instead
    /// of the conversion to microseconds in [`Attachment::peer_alive_at`].
    next_peer_check: Option<Instant>,
}

impl ShmQueuePair {
    /// Whether its requester, found inside epoch `seen` on epoch slot `slot`, has left that
    /// request since, or its process is gone.
    fn left_epoch(&self, slot: u32, seen: u64) -> bool {
        self.epoch_slot.load(Ordering::Acquire) != slot
            || self
                .offer
                .as_ref()
                .is_none_or(|offer| offer.state.left_epoch(slot, seen))
            || self.requester_gone()
    }

    /// Whether its requester's process is gone: the kernel closed its end of the attach
    /// connection (a non-blocking peek), or it never attached.
    fn requester_gone(&self) -> bool {
        lock(&self.requester).as_ref().is_none_or(|stream| {
            let mut byte = [0u8; 1];
            match nix::sys::socket::recv(
                stream.as_raw_fd(),
                &mut byte,
                nix::sys::socket::MsgFlags::MSG_PEEK | nix::sys::socket::MsgFlags::MSG_DONTWAIT,
            ) {
                Ok(0) => true,
                Ok(_) | Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => false,
                Err(_) => true,
            }
        })
    }

    /// Runs every queued request, in order: this post's, and those other tasks queued
    /// meanwhile (one executor per doorbell, as a NIC's engine drains its send queue), with the
    /// executor's lock held (`cache`). A post that finds another thread executing yields and
    /// tries again (`try_ring`) rather than wait; when its doorbell has rung, its requests have
    /// run, so its task needs no wake-up from another thread.
    fn run_pending(
        &self,
        queue_pair: &QueuePairShared,
        executor: &mut Executor,
        attachment: &Attachment,
    ) {
        if lock(&self.pending).is_empty() {
            return;
        }
        if !attachment.peer_alive() {
            // Nothing will answer: the oldest request completes RETRY_EXC_ERR, the rest flush.
            lock(&self.pending).clear();
            queue_pair.fail_unanswered();
            return;
        }
        let Executor {
            cache,
            batch,
            payload,
            response,
            ..
        } = executor;
        loop {
            std::mem::swap(batch, &mut *lock(&self.pending));
            if batch.is_empty() {
                break;
            }
            let ran = self.run_batch(queue_pair, attachment, cache, batch, payload, response);
            // A batch that stopped early leaves requests that were flushed with the queue pair.
            batch.clear();
            if !ran {
                // The queue pair is in ERROR: what is still queued was flushed.
                lock(&self.pending).clear();
                break;
            }
        }
    }

    /// Runs one batch in order; `false` once a request failed (the queue pair is in ERROR).
    fn run_batch(
        &self,
        queue_pair: &QueuePairShared,
        attachment: &Attachment,
        cache: &mut Mapped,
        batch: &mut VecDeque<Execution>,
        payload: &mut Vec<u8>,
        response: &mut Vec<u8>,
    ) -> bool {
        while let Some((sequence, request, local)) = batch.pop_front() {
            if queue_pair.state() != QueuePairState::ReadyToSend {
                // Moved to ERROR meanwhile (`modify_to_error`, a teardown): this request and
                // the rest were completed then, and do not run.
                return false;
            }
            payload.clear();
            if request.opcode == Opcode::Write {
                engine::append_write_payload(payload, &local);
            }
            let outcome = attachment.execute_in(
                &mut attachment.enter(),
                queue_pair.qp_number,
                cache,
                &request,
                &local,
                payload,
                response,
            );
            let status = match outcome {
                Outcome::Answered(status) => {
                    queue_pair.on_response(sequence, status, response);
                    status
                }
                Outcome::Placed(status) => {
                    queue_pair.on_response_placed(sequence, status);
                    status
                }
                Outcome::Stopped => {
                    queue_pair.responder_stopped();
                    return false;
                }
                Outcome::Unanswered | Outcome::Unmapped => {
                    queue_pair.fail_unanswered();
                    return false;
                }
            };
            if status != WorkCompletionStatus::Success {
                return false;
            }
        }
        true
    }

    /// Runs `list` on this thread, holding the executor, when nothing else of the queue pair
    /// is queued or running (`QueuePairProvider::run_inline`): the same requests, checks and
    /// outcomes as [`ShmQueuePair::run_batch`], without the in-flight queue.
    fn run_list_inline(
        &self,
        queue_pair: &QueuePairShared,
        list: &[WorkRequest],
    ) -> Option<InlineOutcome> {
        let attachment = self.attachment.get()?;
        // Held for the whole list: a post meanwhile queues behind it, and its doorbell finds
        // the executor busy and comes back after a yield (`try_ring`).
        let mut executor = self.executor.try_lock().ok()?;
        // A dead peer's failure is the ordinary path's to report (`run_pending`).
        if !queue_pair.idle_and_sendable()
            || !lock(&self.pending).is_empty()
            || !attachment.peer_alive()
        {
            return None;
        }
        let Executor {
            cache,
            payload,
            response,
            ..
        } = &mut *executor;
        let device = queue_pair.device();
        let domain = queue_pair.protection_domain.inner.id;
        // One epoch and one look at the responder for the whole list (a refresh leaves the
        // epoch and enters it again).
        let mut inside = attachment.enter();
        for (index, request) in list.iter().enumerate() {
            // Counted as the posted list's would be: the failed request's completion and one
            // for each request behind it (flushed or NotExecuted, signaled or not).
            let failed = |status| {
                queue_pair.count_inline_failure(list.len() - index);
                Some(Err(InlineFailure {
                    index,
                    completion: WorkCompletion {
                        work_request_id: request.id,
                        qp_number: queue_pair.qp_number,
                        opcode: request.opcode,
                        status,
                    },
                }))
            };
            if queue_pair.state() != QueuePairState::ReadyToSend {
                // Moved to ERROR meanwhile by another thread (`modify_to_error`): as in
                // `run_batch`, nothing more runs, and the rest flush.
                return failed(WorkCompletionStatus::WorkRequestFlushError);
            }
            let local = device.table.check_local(
                domain,
                &request.local,
                request.opcode,
                device.config.max_message_size,
            );
            if let Err(status) = local {
                queue_pair.enter_error();
                return failed(status);
            }
            payload.clear();
            if request.opcode == Opcode::Write {
                engine::append_write_payload(payload, &local);
            }
            let remote = engine::remote_request(request);
            let outcome = attachment.execute_in(
                &mut inside,
                queue_pair.qp_number,
                cache,
                &remote,
                &local,
                payload,
                response,
            );
            let status = match outcome {
                Outcome::Answered(status) => place_payload(status, request, &local, response),
                Outcome::Placed(status) => status,
                // Requests run in order: this one and the rest of the list did not run.
                Outcome::Stopped => {
                    queue_pair.responder_stopped();
                    return failed(WorkCompletionStatus::NotExecuted);
                }
                Outcome::Unanswered | Outcome::Unmapped => {
                    queue_pair.enter_error();
                    return failed(WorkCompletionStatus::RetryExceededError);
                }
            };
            if status != WorkCompletionStatus::Success {
                queue_pair.enter_error();
                return failed(status);
            }
            queue_pair.count_inline_completion(request, status);
        }
        Some(Ok(()))
    }

    /// As a responder, answers an attach or refresh hello; returns the epoch slot.
    fn accept_hello(
        &self,
        queue_pair: &QueuePairShared,
        hello: &Hello,
        state: &SharedState,
    ) -> std::result::Result<u32, AnswerStatus> {
        let responder = lock(&self.responder);
        let current = self.epoch_slot.load(Ordering::Acquire);
        match hello.kind {
            HelloKind::Refresh => {
                if current == NO_EPOCH_SLOT || responder.peer_qp != Some(hello.source_qp) {
                    return Err(AnswerStatus::Refused);
                }
                Ok(current)
            }
            HelloKind::Attach => {
                if current != NO_EPOCH_SLOT {
                    // One requester per queue pair, as an RC connection.
                    return Err(AnswerStatus::Refused);
                }
                if !responder.receiving {
                    return Err(AnswerStatus::NotReady);
                }
                if responder.peer_qp != Some(hello.source_qp) {
                    return Err(AnswerStatus::Refused);
                }
                let slot = state.take_epoch_slot().ok_or(AnswerStatus::Refused)?;
                if state
                    .publish_queue_pair(
                        queue_pair.qp_number,
                        QueuePairStatus::Receiving,
                        queue_pair.protection_domain.inner.id,
                        slot,
                    )
                    .is_err()
                {
                    state.give_back_epoch_slot(slot);
                    return Err(AnswerStatus::Refused);
                }
                self.epoch_slot.store(slot, Ordering::Release);
                Ok(slot)
            }
        }
    }

    /// Publishes this responder queue pair's status.
    fn publish(&self, status: QueuePairStatus) {
        let (Some(offer), Some((qp_number, protection_domain))) =
            (&self.offer, self.identity.get().copied())
        else {
            return;
        };
        if let Err(error) = offer.state.publish_queue_pair(
            qp_number,
            status,
            protection_domain,
            self.epoch_slot.load(Ordering::Acquire),
        ) {
            tracing::warn!(%error, qp_number, "shm queue pair not published");
        }
    }

    /// As a requester, attaches to the responder at `remote`.
    async fn attach(
        &self,
        queue_pair: &Arc<QueuePairShared>,
        remote: &ShmEndpoint,
        socket: &Path,
    ) -> Result<()> {
        let hello = Hello {
            kind: HelloKind::Attach,
            target_qp: remote.qp_number,
            source_qp: queue_pair.qp_number,
            target_device: remote.device_id,
        };
        let deadline = Instant::now() + ATTACH_TIMEOUT;
        let mut pause = Duration::from_micros(200);
        let (answer, descriptors, peer) = loop {
            let path = socket.to_path_buf();
            let attempt = tokio::task::spawn_blocking(move || exchange(&path, &hello))
                .await
                .map_err(|error| Error::ShmRefused {
                    path: socket.to_path_buf(),
                    reason: format!("the attach task failed: {error}"),
                })??;
            match attempt.0.status {
                AnswerStatus::Accepted => break attempt,
                AnswerStatus::NotReady if Instant::now() < deadline => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(20));
                }
                AnswerStatus::NotReady => {
                    return Err(Error::ShmRefused {
                        path: socket.to_path_buf(),
                        reason: format!(
                            "queue pair {} was not connected within {ATTACH_TIMEOUT:?}",
                            remote.qp_number
                        ),
                    })
                }
                AnswerStatus::Refused => {
                    return Err(Error::EndpointNotFound {
                        reason: format!(
                            "shm queue pair {} on device {:#x} at {} (refused)",
                            remote.qp_number,
                            remote.device_id,
                            socket.display()
                        ),
                    })
                }
            }
        };
        let refused = |reason: String| Error::ShmRefused {
            path: socket.to_path_buf(),
            reason,
        };
        let mut descriptors = descriptors.into_iter();
        let (Some(keys), Some(epochs)) = (descriptors.next(), descriptors.next()) else {
            return Err(refused("the answer carries no key state".into()));
        };
        let remote_device = self.remote_device(remote, socket, &answer, keys, epochs)?;
        remote_device
            .add_memories(&answer.memories, descriptors.collect(), false)
            .map_err(refused)?;
        let _ = self.attachment.set(Attachment {
            remote: remote_device,
            responder_qp: remote.qp_number,
            epoch_slot: answer.epoch_slot,
            peer,
            peer_gone: AtomicBool::new(false),
            attached_at: Instant::now(),
            last_peek: AtomicU64::new(0),
            responder_slot: AtomicU64::new(u64::MAX),
        });
        Ok(())
    }

    /// The mapped peer `remote`, mapping its key state and epochs on first use.
    fn remote_device(
        &self,
        remote: &ShmEndpoint,
        socket: &Path,
        answer: &Answer,
        keys: OwnedFd,
        epochs: OwnedFd,
    ) -> Result<Arc<RemoteDevice>> {
        let mut remotes = lock(&self.remotes);
        remotes.retain(|_, device| device.strong_count() > 0);
        if let Some(device) = remotes.get(&remote.device_id).and_then(Weak::upgrade) {
            return Ok(device);
        }
        let refused = |reason: String| Error::ShmRefused {
            path: socket.to_path_buf(),
            reason,
        };
        let keys = PinnedMemory::map_peer(keys, answer.keys_length, false)
            .map_err(|error| refused(format!("map the key state: {error}")))?;
        let epochs = PinnedMemory::map_peer(epochs, answer.epochs_length, true)
            .map_err(|error| refused(format!("map the epochs: {error}")))?;
        let device = Arc::new(RemoteDevice {
            device_id: remote.device_id,
            socket: socket.to_path_buf(),
            keys: SharedView::new(keys).map_err(refused)?,
            epochs,
            memories: RwLock::new(HashMap::new()),
        });
        remotes.insert(remote.device_id, Arc::downgrade(&device));
        Ok(device)
    }
}

/// A request's local buffer, as the requester resolved it.
type LocalBuffer =
    std::result::Result<Option<crate::protection::LocalTarget>, WorkCompletionStatus>;

/// One request to run: its sequence, its engine form and its local buffer.
type Execution = (u64, RemoteRequest, LocalBuffer);

impl QueuePairProvider for ShmQueuePair {
    fn attach(&self, queue_pair: &Arc<QueuePairShared>) {
        let _ = self
            .identity
            .set((queue_pair.qp_number, queue_pair.protection_domain.inner.id));
        self.publish(QueuePairStatus::NotReceiving);
    }

    fn detach(&self, _queue_pair: &QueuePairShared) {
        self.publish(QueuePairStatus::Removed);
        // The requester's next doorbell finds the connection closed.
        drop(lock(&self.requester).take());
        let slot = self.epoch_slot.swap(NO_EPOCH_SLOT, Ordering::AcqRel);
        if let (Some(offer), true) = (&self.offer, slot != NO_EPOCH_SLOT) {
            offer.state.give_back_epoch_slot(slot);
        }
    }

    fn endpoint(&self, queue_pair: &QueuePairShared) -> QueuePairEndpoint {
        QueuePairEndpoint::Shm(ShmEndpoint {
            device_id: queue_pair.device().id,
            socket: self.offer.as_ref().map(|offer| offer.socket.clone()),
            qp_number: queue_pair.qp_number,
        })
    }

    fn connect<'a>(
        &'a self,
        queue_pair: &'a Arc<QueuePairShared>,
        local: &'a QueuePairEndpoint,
        remote: &'a QueuePairEndpoint,
    ) -> ProviderFuture<'a, Result<()>> {
        Box::pin(async move {
            let QueuePairEndpoint::Shm(remote) = remote else {
                return Err(Error::BackendMismatch {
                    local: local.backend(),
                    remote: remote.backend(),
                });
            };
            if self.offer.is_some() {
                // As a responder: the named peer may attach from now on.
                {
                    let mut responder = lock(&self.responder);
                    responder.receiving = true;
                    responder.peer_qp = Some(remote.qp_number);
                }
                self.publish(QueuePairStatus::Receiving);
            }
            if let Some(socket) = &remote.socket {
                self.attach(queue_pair, remote, socket).await?;
            }
            Ok(())
        })
    }

    fn submit(
        &self,
        queue_pair: &QueuePairShared,
        entries: &mut dyn Iterator<Item = InFlight>,
    ) -> Submission {
        if self.attachment.get().is_none() {
            return Submission::NotConnected;
        }
        let sendable = {
            // Queued under the requester lock: `pending` is in sequence order.
            let mut enqueuer = queue_pair.enqueuer();
            let mut pending = lock(&self.pending);
            for entry in entries {
                if let Some(entry) = enqueuer.push(entry) {
                    pending.push_back((
                        entry.sequence,
                        engine::remote_request(&entry.request),
                        entry.local.clone(),
                    ));
                }
            }
            enqueuer.sendable
        };
        if !sendable {
            queue_pair.enter_error();
            return Submission::Complete;
        }
        // Run now, on the posting thread, when no other thread runs this queue pair's requests:
        // the list has completed when `post` returns, and its task neither yields nor waits
        // for a wake-up (a yield per list was two trips through the scheduler per GET). A task
        // that does nothing but one-sided operations still lets the others run: each post
        // spends a unit of tokio's cooperative budget (`QueuePairShared::post`).
        // When another thread is executing, ring after a yield (`try_ring`).
        if self.try_ring(queue_pair) {
            Submission::Rang
        } else {
            Submission::RingAfterYield
        }
    }

    fn run_inline(
        &self,
        queue_pair: &QueuePairShared,
        list: &[WorkRequest],
    ) -> Option<InlineOutcome> {
        self.run_list_inline(queue_pair, list)
    }

    fn run_direct(
        &self,
        queue_pair: &QueuePairShared,
        now: Instant,
        work: &mut dyn FnMut(&mut dyn DirectAccess),
    ) -> bool {
        self.run_direct_access(queue_pair, now, work)
    }

    fn ring(&self, queue_pair: &QueuePairShared) {
        if let Some(attachment) = self.attachment.get() {
            self.run_pending(queue_pair, &mut lock(&self.executor), attachment);
        }
    }

    fn try_ring(&self, queue_pair: &QueuePairShared) -> bool {
        let Some(attachment) = self.attachment.get() else {
            return true;
        };
        let mut executor = match self.executor.try_lock() {
            Ok(executor) => executor,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            // Another thread runs this queue pair's requests, ours included if they are queued
            // by now: come back after a yield rather than wait.
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        self.run_pending(queue_pair, &mut executor, attachment);
        true
    }

    fn after_ring(&self, queue_pair: &QueuePairShared) {
        // A local failure of this post is never queued for the executor: it completes here
        // once it reaches the head (an executor may have finished before it was queued).
        queue_pair.settle_local_failures();
    }

    fn modify_to_error(&self) {
        // As a requester: what is queued and not yet taken by an executor was completed
        // (flushed, or NotExecuted) with the move to ERROR, which happened before this call
        // under the requester lock (no later post queues anything here): it must never run.
        // Left queued, the next doorbell (the post that queued it, after its yield) ran it.
        lock(&self.pending).clear();
        lock(&self.responder).receiving = false;
        // The requester's next request sees it.
        self.publish(QueuePairStatus::NotReceiving);
    }

    fn drain(&self, _queue_pair: &QueuePairShared) {
        let slot = self.epoch_slot.load(Ordering::Acquire);
        if let (Some(offer), true) = (&self.offer, slot != NO_EPOCH_SLOT) {
            *lock(&self.stuck_epoch) = offer.wait_quiet(slot);
        }
    }

    /// Out once the requester left the request the drain found it inside (its epoch moved
    /// on: any request it enters now sees the queue pair not receiving), or its process is
    /// gone (the kernel closed its end of the attach connection, so nothing of it runs).
    fn requester_out(&self, _queue_pair: &QueuePairShared) -> bool {
        let Some(seen) = *lock(&self.stuck_epoch) else {
            return true;
        };
        let slot = self.epoch_slot.load(Ordering::Acquire);
        let left = match (&self.offer, slot != NO_EPOCH_SLOT) {
            (Some(offer), true) => offer.state.left_epoch(slot, seen),
            _ => true,
        };
        let gone = self.requester_gone();
        if left || gone {
            *lock(&self.stuck_epoch) = None;
        }
        left || gone
    }

    /// A responder with an attached requester: the drain waits for its epoch.
    fn drain_may_wait(&self, _queue_pair: &QueuePairShared) -> bool {
        self.offer.is_some() && self.epoch_slot.load(Ordering::Acquire) != NO_EPOCH_SLOT
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Device, DeviceConfig};
    use crate::queue_pair::{QueuePair, QueuePairConfig};

    fn queue_pair(device: &Device) -> QueuePair {
        let domain = device.allocate_protection_domain();
        let completion_queue = device
            .create_completion_queue(1024)
            .expect("completion queue");
        let queue_pair = domain
            .create_queue_pair(&completion_queue, QueuePairConfig::default())
            .expect("queue pair");
        queue_pair.modify_to_init().expect("INIT");
        queue_pair
    }

    fn live_queue_pairs(device: &Device) -> i64 {
        device.gauges().queue_pairs.iter().sum()
    }

    /// A responder and its attached requester on `socket`, with the responder's drain bounded
    /// by `retry_timeout`.
    async fn attached_pair(
        socket: &str,
        retry_timeout: Duration,
    ) -> (Device, Device, QueuePair, QueuePair) {
        let socket = std::env::temp_dir().join(format!("{socket}-{}.sock", std::process::id()));
        let config = DeviceConfig {
            retry_timeout,
            ..DeviceConfig::default()
        };
        let responder = Device::shm(Some(socket), config).expect("offering device");
        let requester = Device::shm(None, config).expect("attaching device");
        let responder_queue_pair = queue_pair(&responder);
        let requester_queue_pair = queue_pair(&requester);
        responder_queue_pair
            .connect(&requester_queue_pair.endpoint())
            .await
            .expect("the responder names its requester");
        requester_queue_pair
            .connect(&responder_queue_pair.endpoint())
            .await
            .expect("the requester attaches");
        (
            responder,
            requester,
            responder_queue_pair,
            requester_queue_pair,
        )
    }

    /// A requester stopped inside a request past the drain's bound is not out
    /// (`QueuePair::requester_out`): the node must not reuse what it may touch. It is out once
    /// it leaves that request, and a requester the drain found outside is out at once.
    #[tokio::test]
    async fn a_requester_stopped_inside_a_request_is_not_out_until_it_leaves() {
        let (_responder, _requester, responder_queue_pair, _requester_queue_pair) =
            attached_pair("rdkv-out", Duration::from_millis(20)).await;
        let part = responder_queue_pair
            .shared
            .provider
            .as_any()
            .downcast_ref::<ShmQueuePair>()
            .expect("an shm queue pair");
        let offer = part.offer.clone().expect("a listening device's offer");
        let slot = part.epoch_slot.load(Ordering::Acquire);
        let inside = EpochMarker::enter(&offer.state.epochs, slot);
        responder_queue_pair.modify_to_error();
        responder_queue_pair.drain();
        assert!(
            !responder_queue_pair.requester_out(),
            "still inside the request it stopped in"
        );
        drop(inside);
        assert!(responder_queue_pair.requester_out(), "it left the request");
        responder_queue_pair.drain();
        assert!(
            responder_queue_pair.requester_out(),
            "drained with the requester outside"
        );
    }

    /// A READ whose copy ran inside an epoch entered before the responder stopped receiving (a
    /// requester stopped there and resumed after the node's drain gave up) is not trusted: it
    /// completes as not executed. Entered and run before the stop, it succeeds.
    #[tokio::test]
    async fn a_read_that_finds_the_responder_stopped_after_its_copy_is_not_trusted() {
        let (_responder, _requester, responder_queue_pair, requester_queue_pair) =
            attached_pair("rdkv-read-check", Duration::from_millis(20)).await;
        let memory = Arc::new(
            PinnedMemory::allocate_shared(
                4096,
                crate::memory::HugepagePolicy::Off,
                crate::memory::PinLimits::default(),
            )
            .expect("shared memory"),
        );
        let region = responder_queue_pair
            .shared
            .protection_domain
            .register_all(&memory, AccessFlags::REMOTE_READ)
            .expect("region");
        let attachment = requester_queue_pair
            .shared
            .provider
            .as_any()
            .downcast_ref::<ShmQueuePair>()
            .and_then(|part| part.attachment.get())
            .expect("an attached requester");
        let read = RemoteRequest {
            opcode: Opcode::Read,
            remote_key: region.remote_key().key,
            remote_address: region.address(),
            length: 64,
            compare: 0,
            swap_or_add: 0,
        };
        let (mut cache, mut response) = (Mapped::default(), Vec::new());
        let own_qp = requester_queue_pair.shared.qp_number;
        let mut before = attachment.enter();
        // The first run maps the region (registered after the attach) into the cache.
        let outcome = attachment.execute_in(
            &mut before,
            own_qp,
            &mut cache,
            &read,
            &Ok(None),
            &[],
            &mut response,
        );
        assert!(
            matches!(outcome, Outcome::Answered(WorkCompletionStatus::Success)),
            "{outcome:?}"
        );
        assert!(
            before.is_ok(),
            "still inside the epoch entered before the stop"
        );
        responder_queue_pair.modify_to_error();
        let outcome = attachment.execute_in(
            &mut before,
            own_qp,
            &mut cache,
            &read,
            &Ok(None),
            &[],
            &mut response,
        );
        assert!(
            matches!(outcome, Outcome::Stopped),
            "entered before the stop, copied after it: {outcome:?}"
        );
    }

    /// Revoking a window waits only for the requester of the queue pair it is bound to: a
    /// requester stopped inside a request (its epoch odd) holds up its own windows' revocation,
    /// never another client's.
    #[tokio::test]
    async fn a_window_revocation_waits_only_for_its_own_requester() {
        let socket = std::env::temp_dir().join(format!("rdkv-revoke-{}.sock", std::process::id()));
        let config = DeviceConfig {
            retry_timeout: Duration::from_secs(30),
            ..DeviceConfig::default()
        };
        let responder = Device::shm(Some(socket), config).expect("offering device");
        let domain = responder.allocate_protection_domain();
        let completion_queue = responder
            .create_completion_queue(1024)
            .expect("completion queue");
        let mut attached = Vec::new();
        for _ in 0..2 {
            let responder_queue_pair = domain
                .create_queue_pair(&completion_queue, QueuePairConfig::default())
                .expect("queue pair");
            responder_queue_pair.modify_to_init().expect("INIT");
            let requester = Device::shm(None, config).expect("attaching device");
            let requester_queue_pair = queue_pair(&requester);
            responder_queue_pair
                .connect(&requester_queue_pair.endpoint())
                .await
                .expect("the responder names its requester");
            requester_queue_pair
                .connect(&responder_queue_pair.endpoint())
                .await
                .expect("the requester attaches");
            attached.push((responder_queue_pair, requester, requester_queue_pair));
        }
        let memory = Arc::new(
            PinnedMemory::allocate_shared(
                4096,
                crate::memory::HugepagePolicy::Off,
                crate::memory::PinLimits::default(),
            )
            .expect("shared memory"),
        );
        let region = domain
            .register_all(&memory, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)
            .expect("region");
        let window = domain.allocate_memory_window();
        let (own, _, _) = &attached[0];
        own.bind_memory_window(
            &window,
            &region,
            region.address(),
            4096,
            AccessFlags::REMOTE_WRITE,
        )
        .expect("bind");
        let (other, _, _) = &attached[1];
        let part = other
            .shared
            .provider
            .as_any()
            .downcast_ref::<ShmQueuePair>()
            .expect("an shm queue pair");
        let offer = part.offer.clone().expect("a listening device's offer");
        let stuck =
            EpochMarker::enter(&offer.state.epochs, part.epoch_slot.load(Ordering::Acquire));
        let revoking = std::thread::spawn(move || window.invalidate());
        let deadline = Instant::now() + Duration::from_secs(20);
        while !revoking.is_finished() {
            assert!(
                Instant::now() < deadline,
                "the revocation waited for another queue pair's requester (hang guard, not a speed bound)"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(stuck);
    }

    /// A responder dropped inside a runtime while its requester is inside a request (its epoch
    /// odd, as a stopped client's stays) returns before its drain ends: the drain, which waits
    /// for the requester, runs on a thread of its own. The queue pair leaves its device once
    /// the requester is out.
    #[tokio::test]
    async fn a_dropped_responder_drains_off_the_runtime_while_its_requester_is_inside() {
        let (responder, _requester, responder_queue_pair, _requester_queue_pair) =
            attached_pair("rdkv-drop", Duration::from_secs(30)).await;
        let part = responder_queue_pair
            .shared
            .provider
            .as_any()
            .downcast_ref::<ShmQueuePair>()
            .expect("an shm queue pair");
        let offer = part.offer.clone().expect("a listening device's offer");
        let slot = part.epoch_slot.load(Ordering::Acquire);
        assert_ne!(slot, NO_EPOCH_SLOT, "the requester is attached");
        let inside = EpochMarker::enter(&offer.state.epochs, slot);
        assert_eq!(live_queue_pairs(&responder), 1);
        drop(responder_queue_pair);
        // Drained in place, the drop would have waited for the requester (30 s) and removed the
        // queue pair before returning.
        assert_eq!(
            live_queue_pairs(&responder),
            1,
            "the drop returned while the drain waits for the requester"
        );
        drop(inside);
        let deadline = Instant::now() + Duration::from_secs(20);
        while live_queue_pairs(&responder) != 0 {
            assert!(
                Instant::now() < deadline,
                "the drain ended once the requester left its request"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}
