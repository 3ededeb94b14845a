//! Attacks on issue 39 item 6, "a frozen client cannot hold everyone's heap"
//! (`docs/protocol.md`, *A connection that holds the heap*, *A requester stopped inside a
//! request*). A raw client speaks the control protocol and posts fabric requests by hand, so
//! that it can say in its announce word what no library client would.
//!
//! Each test is bounded: every loop has a count and a time limit; the child process of the
//! `shm` test is resumed, killed and reaped when dropped.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use rdkv_common::protocol::{
    read_frame, write_frame, ClientMessage, ConnectionKeys, ServerMessage,
};
use rdkv_fabric::memory::{HugepagePolicy, PinLimits, PinnedMemory};
use rdkv_fabric::{
    AccessFlags, CompletionQueue, Device, DeviceConfig, MemoryRegion, QueuePair, QueuePairConfig,
    RemoteKey, WorkCompletionStatus, WorkRequest,
};
use rdkv_server::{RunningServer, ServerConfig};
use tokio::net::TcpStream;

mod support;

const SECRET: &[u8] = b"heap-hold-attack-secret";
/// Bytes of the raw client's local buffer.
const LOCAL: u64 = 128 * 1024;

struct RawClient {
    stream: TcpStream,
    keys: ConnectionKeys,
    queue_pair: QueuePair,
    local: MemoryRegion,
    _completion_queue: CompletionQueue,
    _device: Device,
}

impl RawClient {
    async fn connect(control: SocketAddr, over_shm: bool) -> Self {
        let mut stream = TcpStream::connect(control).await.expect("connect");
        let ServerMessage::Welcome(welcome) =
            support::authenticate(&mut stream, SECRET, over_shm, "raw").await
        else {
            panic!("no welcome");
        };
        let backend = welcome.server_endpoint.backend();
        let device = Device::open(
            backend,
            None,
            &rdkv_fabric::VerbsOptions::default(),
            DeviceConfig::default(),
        )
        .expect("device");
        let domain = device.allocate_protection_domain();
        let completion_queue = device
            .create_completion_queue(256)
            .expect("create completion queue");
        let queue_pair = domain
            .create_queue_pair(&completion_queue, QueuePairConfig::default())
            .expect("queue pair");
        let memory = Arc::new(
            PinnedMemory::allocate(LOCAL, HugepagePolicy::Off, PinLimits::default()).expect("pin"),
        );
        let local = domain
            .register_all(&memory, AccessFlags::LOCAL_WRITE)
            .expect("register");
        write_frame(
            &mut stream,
            &ClientMessage::ConnectQueuePair {
                endpoint: queue_pair.endpoint(),
            },
        )
        .await
        .expect("send endpoint");
        queue_pair
            .connect(&welcome.server_endpoint)
            .await
            .expect("connect queue pair");
        let keys = match read_frame::<_, ServerMessage>(&mut stream)
            .await
            .expect("ready")
        {
            ServerMessage::QueuePairReady(keys) => keys,
            other => panic!("expected QueuePairReady, got {other:?}"),
        };
        Self {
            stream,
            keys,
            queue_pair,
            local,
            _completion_queue: completion_queue,
            _device: device,
        }
    }

    /// `AllocateChunk { started, needed }`: `Some((heap offset, key))`, or `None` when refused.
    async fn allocate(&mut self, started: u64, needed: u64) -> Option<(u64, RemoteKey)> {
        write_frame(
            &mut self.stream,
            &ClientMessage::AllocateChunk { started, needed },
        )
        .await
        .ok()?;
        match read_frame(&mut self.stream).await.ok()? {
            ServerMessage::Chunk { heap_offset, key } => Some((heap_offset, key)),
            _ => None,
        }
    }

    /// WRITEs the announce word (`started`, `quiescent`).
    async fn announce(&self, started: u64, quiescent: u64) -> WorkCompletionStatus {
        let mut word = [0u8; 16];
        word[..8].copy_from_slice(&started.to_le_bytes());
        word[8..].copy_from_slice(&quiescent.to_le_bytes());
        self.local.write(0, &word).expect("local word");
        let completions = self
            .queue_pair
            .execute(vec![WorkRequest::write(
                1,
                self.local.segment(0, 16),
                self.keys.announce_key.at(0),
            )])
            .await
            .expect("post");
        completions[0].status
    }

    /// Fills `length` bytes of the local buffer with `byte` and WRITEs them `times` times, in
    /// one list, at `key`'s start: a list run inside its post enters its epoch once.
    async fn write_list(
        &self,
        key: RemoteKey,
        byte: u8,
        length: u64,
        times: usize,
    ) -> WorkCompletionStatus {
        self.local
            .write(0, &vec![byte; length as usize])
            .expect("local bytes");
        let list = (0..times)
            .map(|index| {
                WorkRequest::write(
                    index as u64,
                    self.local.segment(0, length as u32),
                    key.at(0),
                )
                .with_signaled(index + 1 == times)
            })
            .collect();
        match self.queue_pair.execute(list).await {
            Ok(completions) => completions
                .iter()
                .map(|completion| completion.status)
                .find(|status| *status != WorkCompletionStatus::Success)
                .unwrap_or(WorkCompletionStatus::Success),
            Err(_) => WorkCompletionStatus::WorkRequestFlushError,
        }
    }

    /// READs `length` bytes of the heap at `heap_offset` `times` times in one list (a list run
    /// inside its post enters its epoch once); the status of the first that failed, and the
    /// bytes the last READ placed.
    async fn read_list(
        &self,
        heap_offset: u64,
        length: u64,
        times: usize,
    ) -> (WorkCompletionStatus, Vec<u8>) {
        self.local
            .write(0, &vec![0u8; length as usize])
            .expect("local bytes");
        let list = (0..times)
            .map(|index| {
                WorkRequest::read(
                    index as u64,
                    self.local.segment(0, length as u32),
                    self.keys.heap_key.at(heap_offset),
                )
                .with_signaled(index + 1 == times)
            })
            .collect();
        let status = match self.queue_pair.execute(list).await {
            Ok(completions) => completions
                .iter()
                .map(|completion| completion.status)
                .find(|status| *status != WorkCompletionStatus::Success)
                .unwrap_or(WorkCompletionStatus::Success),
            Err(_) => WorkCompletionStatus::WorkRequestFlushError,
        };
        let mut bytes = vec![0u8; length as usize];
        self.local.read(0, &mut bytes).expect("local read");
        (status, bytes)
    }

    /// READs `length` bytes of the heap at `heap_offset` through the heap READ window.
    async fn read_heap(&self, heap_offset: u64, length: u64) -> Vec<u8> {
        let completions = self
            .queue_pair
            .execute(vec![WorkRequest::read(
                1,
                self.local.segment(0, length as u32),
                self.keys.heap_key.at(heap_offset),
            )])
            .await
            .expect("post");
        assert_eq!(completions[0].status, WorkCompletionStatus::Success);
        let mut bytes = vec![0u8; length as usize];
        self.local.read(0, &mut bytes).expect("local read");
        bytes
    }
}

/// A node with a small heap (256 extents of 4 KiB, grants of up to 16 KiB).
async fn small_heap_server(
    shm: bool,
    operation_deadline: Duration,
    lease: Duration,
) -> RunningServer {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let mut config = ServerConfig::local(SECRET);
    config.heap_size = 1024 * 1024;
    config.chunk_size = 16 * 1024;
    config.operation_deadline = operation_deadline;
    config.lease_timeout = lease;
    if shm {
        config.shm_socket = Some(std::env::temp_dir().join(format!(
            "rdkv-heap-hold-attack-{}-{}.sock",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        )));
    }
    rdkv_server::start(config).await.expect("start")
}

/// Takes grants on `client` (announcing `started`) until the node refuses one: the heap is then
/// under pressure (`Heap::under_pressure`) for a second. At most 1,000 requests.
async fn fill_heap(client: &mut RawClient, started: u64) {
    for _ in 0..1000 {
        if client.allocate(started, 16 * 1024).await.is_none() {
            return;
        }
    }
    panic!("the heap never refused a grant");
}

/// Control for the attack below: a client whose word stays at "operation 1 in flight" is fenced
/// once the heap is under pressure (the fence as built).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_whose_word_is_frozen_mid_operation_is_fenced_under_pressure() {
    let server = small_heap_server(false, Duration::from_secs(2), Duration::from_secs(30)).await;
    let mut frozen = RawClient::connect(server.control_address(), false).await;
    assert_eq!(frozen.announce(1, 0).await, WorkCompletionStatus::Success);
    fill_heap(&mut frozen, 1).await;
    let start = Instant::now();
    let mut fenced = false;
    // Keep the heap refused (pressure) while the word stays, at most 5 s.
    while start.elapsed() < Duration::from_secs(5) {
        let _ = frozen.allocate(1, 16 * 1024).await;
        if server.stats().heap_fences > 0 {
            fenced = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        fenced,
        "a frozen word under pressure was not fenced within 5 s"
    );
}

/// Attack: the fence keys on the whole word changing (`HoldWatch::check`,
/// `session/heap_hold.rs`: `self.word != Some(word)` restarts `since`). A client that keeps
/// starting operations while one never finishes (`started` moves, `quiescent` stays: a thread
/// stuck inside an `shm` request while the process's other threads go on, or a client that
/// simply writes such a word) is never "silent", so it is never fenced, and every extent
/// found unreferenced waits the full quarantine (1.25 × operation deadline) on it, under
/// pressure, for as long as it likes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_starts_operations_but_never_finishes_one_is_fenced_under_pressure() {
    let server = small_heap_server(false, Duration::from_secs(2), Duration::from_secs(30)).await;
    let mut holder = RawClient::connect(server.control_address(), false).await;
    let mut started = 1;
    assert_eq!(
        holder.announce(started, 0).await,
        WorkCompletionStatus::Success
    );
    fill_heap(&mut holder, started).await;
    let start = Instant::now();
    let mut fenced = false;
    while start.elapsed() < Duration::from_secs(5) {
        started += 1;
        if holder.announce(started, 0).await != WorkCompletionStatus::Success {
            fenced = true;
            break;
        }
        // Keeps the heap refused: under pressure all along.
        let _ = holder.allocate(started, 16 * 1024).await;
        if server.stats().heap_fences > 0 {
            fenced = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        fenced,
        "operation 1 in flight for 5 s with the heap under pressure, {} operations started since: not fenced (heap_hold_limit {:?})",
        started - 1,
        Duration::from_secs(1)
    );
}

/// The environment variable that makes `stopped_shm_writer_process` the child, naming the
/// node's control address.
const CHILD_ADDRESS: &str = "RDKV_HEAP_HOLD_ATTACK_CHILD";
/// How many sealed grants the child leaves behind before its write loop.
const CHILD_GRANTS: &str = "RDKV_HEAP_HOLD_ATTACK_GRANTS";
/// `read`: the child READs its sealed grant in a loop instead of writing it.
const CHILD_MODE: &str = "RDKV_HEAP_HOLD_ATTACK_MODE";

/// The child of `a_late_shm_write_never_lands_in_reused_heap`: an `shm` client with operation 1
/// in flight (its word says so, as a real client's does while a write runs) that took grant G,
/// moved on to a new grant (G sealed with `started` 1), and WRITEs into G in a loop (the
/// block WRITE of its operation 1, repeated so that a SIGSTOP lands inside one) until a WRITE
/// fails or 60 s pass.
#[test]
fn stopped_shm_writer_process() {
    let Ok(address) = std::env::var(CHILD_ADDRESS) else {
        return;
    };
    let address: SocketAddr = address.parse().expect("a control address");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let mut client = RawClient::connect(address, true).await;
        assert_eq!(client.announce(1, 0).await, WorkCompletionStatus::Success);
        let (sealed_offset, sealed_key) = client.allocate(1, 16 * 1024).await.expect("grant G");
        // More grants, each sealed by the next (`CHILD_GRANTS`, default 1 sealed grant).
        let sealed: usize = std::env::var(CHILD_GRANTS)
            .ok()
            .and_then(|count| count.parse().ok())
            .unwrap_or(1);
        for _ in 0..sealed.clamp(1, 16) {
            let _ = client
                .allocate(1, 16 * 1024)
                .await
                .expect("a new grant: the last one sealed");
        }
        assert_eq!(
            client.write_list(sealed_key, 0xCC, 16 * 1024, 64).await,
            WorkCompletionStatus::Success
        );
        println!("ready {sealed_offset}");
        let _ = std::io::stdout().flush();
        let start = Instant::now();
        if std::env::var(CHILD_MODE).is_ok_and(|mode| mode == "read") {
            // READs of G through the heap READ window (an operation's block READ), until one
            // list sees the other client's bytes.
            while start.elapsed() < Duration::from_secs(60) {
                let began = Instant::now();
                let (status, bytes) = client.read_list(sealed_offset, 16 * 1024, 64).await;
                let reused = bytes.contains(&0x55);
                if reused || status != WorkCompletionStatus::Success {
                    println!(
                        "read list: {} ms, {status:?}, reused bytes returned: {reused}",
                        began.elapsed().as_millis()
                    );
                    break;
                }
            }
            return;
        }
        let mut lists = 0u64;
        while start.elapsed() < Duration::from_secs(60) {
            let status = client.write_list(sealed_key, 0xCC, 16 * 1024, 64).await;
            lists += 1;
            if status != WorkCompletionStatus::Success {
                println!("stopped writing after {lists} lists: {status:?}");
                break;
            }
        }
    });
}

struct ChildWriter {
    child: Child,
}

impl Drop for ChildWriter {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawns the child writer on `control` with `sealed` sealed grants; returns it, its output,
/// and the heap offset of its first sealed grant once it is writing there.
fn spawn_child(
    control: SocketAddr,
    sealed: usize,
) -> (ChildWriter, BufReader<std::process::ChildStdout>, u64) {
    spawn_child_in(control, sealed, "write")
}

/// [`spawn_child`] in `mode` (`write` or `read`).
fn spawn_child_in(
    control: SocketAddr,
    sealed: usize,
    mode: &str,
) -> (ChildWriter, BufReader<std::process::ChildStdout>, u64) {
    let mut child = ChildWriter {
        child: Command::new(std::env::current_exe().expect("the test binary"))
            .args(["--exact", "stopped_shm_writer_process", "--nocapture"])
            .args(["--test-threads", "1"])
            .env(CHILD_ADDRESS, control.to_string())
            .env(CHILD_GRANTS, sealed.to_string())
            .env(CHILD_MODE, mode)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the child"),
    };
    let mut output = BufReader::new(child.child.stdout.take().expect("piped stdout"));
    let mut line = String::new();
    let sealed_offset: u64 = loop {
        line.clear();
        let read = output.read_line(&mut line).expect("the child's output");
        assert!(read > 0, "the child ended before it was ready");
        if let Some(offset) = line.trim_end().split("ready ").nth(1) {
            break offset.parse().expect("an offset");
        }
    };
    (child, output, sealed_offset)
}

/// Attack (the known hazard, confirmed): an `shm` client stopped inside a request while the
/// heap is NOT under pressure is not fenced, so nothing marks its requester as inside
/// (`Announcements::fence_reads` is only called from a teardown). Its sealed grant G settles by
/// the quarantine (`Heap::settle`: `quarantined = !stopped_inside && ...`), the revocation of
/// G's window waits `retry_timeout` for the stuck requester and goes on
/// (`Offer::wait_quiet`), G becomes a candidate and is freed by the quarantine again (the
/// stopped word is in every snapshot), and another client is granted G. When the stopped client
/// resumes, the rest of the list it was inside runs on its cached key
/// (`Mapped::key`: cached under the epoch's key generation) and lands in the other client's
/// grant.
///
/// Whether the SIGSTOP lands inside a list is chance (the child spends most of its time in
/// 1 MiB lists); the test tries up to three times and fails on the first overwrite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_shm_write_never_lands_in_reused_heap() {
    late_shm_write(false).await;
}

/// Attack: the same under heap pressure, where the node does fence the stopped client. The
/// teardown marks it (`fence_reads`, which is what exempts its sealed grants from the
/// quarantine in `Heap::settle`) only after the drain gave up on it: `teardown.rs` calls
/// `queue_pair.drain()` first, which waits `retry_timeout` (2 s) for the requester. So it is
/// marked at stop + heap_hold_limit + retry_timeout at the earliest (stop + 1 s + 2 s with the
/// defaults), while a grant sealed before the stop is settled by the quarantine at
/// seal + 1.25 × operation deadline (seal + 2.5 s): always first. The sealed grants the doc
/// says are kept ("no quarantine for them") are exactly the ones a stopped WRITE can be
/// inside, and they are not kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_shm_write_of_a_fenced_client_never_lands_in_reused_heap() {
    late_shm_write(true).await;
}

/// Stops the `shm` child inside its WRITE list into its sealed grant G, waits until the node
/// grants G to another client (with the heap under pressure all along when `pressure`), lets
/// that client write G, resumes the child, and checks that the other client's bytes are intact.
async fn late_shm_write(pressure: bool) {
    let run_start = Instant::now();
    for attempt in 0..3 {
        if run_start.elapsed() > Duration::from_secs(100) {
            break;
        }
        // Quarantine 1.25 s; lease 60 s (no lease teardown); heap_hold_limit 0.5 s.
        let server = small_heap_server(true, Duration::from_secs(1), Duration::from_secs(60)).await;
        let (mut child, mut output, sealed_offset) = spawn_child(server.control_address(), 1);
        let mut line = String::new();
        tokio::time::sleep(Duration::from_millis(150)).await;
        let pid = Pid::from_raw(child.child.id() as i32);
        kill(pid, Signal::SIGSTOP).expect("stop the child");

        let mut other = RawClient::connect(server.control_address(), false).await;
        if pressure {
            fill_heap(&mut other, 0).await;
        } else {
            // Settle by quarantine (1.25 s), the revocation's wait (2 s), free by quarantine.
            tokio::time::sleep(Duration::from_millis(5000)).await;
        }
        let mut regranted = None;
        let wait = Instant::now();
        for _ in 0..400 {
            if wait.elapsed() > Duration::from_secs(20) {
                break;
            }
            if let Some((offset, key)) = other.allocate(0, 16 * 1024).await {
                if offset == sealed_offset {
                    regranted = Some(key);
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let fences = server.stats().heap_fences;
        // Under pressure past heap_hold_limit; without, past the operation deadline (1 s here).
        assert!(fences > 0, "heap fences: {fences}");
        let Some(key) = regranted else {
            // What a fixed node does while the child is stopped inside: G stays out of reach.
            eprintln!("attempt {attempt}: G (heap offset {sealed_offset}) was not granted again within 20 s; heap fences {fences}");
            // Held, and said so: the torn-down connection (fenced) or the sealed grant (not).
            let stats = server.stats();
            assert!(
                stats.connections_held + stats.heap_held_bytes > 0,
                "G is kept for the stopped child: a gauge says so ({} connections held, {} heap bytes held)",
                stats.connections_held,
                stats.heap_held_bytes
            );
            // Resumed (it then fails its next request and exits), or gone: nothing stays held.
            kill(pid, Signal::SIGCONT).expect("resume the child");
            let resumed = Instant::now();
            while resumed.elapsed() < Duration::from_secs(10) {
                let stats = server.stats();
                if stats.connections_held == 0 && stats.heap_held_bytes == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let stats = server.stats();
            assert_eq!(
                (stats.connections_held, stats.heap_held_bytes),
                (0, 0),
                "released once the child is out"
            );
            drop(other);
            drop(child);
            server.shutdown().await;
            return;
        };
        assert_eq!(
            other.write_list(key, 0x55, 16 * 1024, 1).await,
            WorkCompletionStatus::Success
        );
        assert!(other
            .read_heap(sealed_offset, 16 * 1024)
            .await
            .iter()
            .all(|byte| *byte == 0x55));

        kill(pid, Signal::SIGCONT).expect("resume the child");
        let resumed = Instant::now();
        while resumed.elapsed() < Duration::from_secs(10) {
            if child
                .child
                .try_wait()
                .expect("the child's status")
                .is_some()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut rest = String::new();
        while output.read_line(&mut line).unwrap_or(0) > 0 {
            rest.push_str(&line);
            line.clear();
        }
        let after = other.read_heap(sealed_offset, 16 * 1024).await;
        let overwritten = after.iter().filter(|byte| **byte == 0xCC).count();
        eprintln!(
            "attempt {attempt}: child: {}; {overwritten} bytes of the other client's grant overwritten; heap fences {fences}",
            rest.trim(),
        );
        assert_eq!(
            overwritten, 0,
            "the stopped client's late WRITE landed in extents the node had granted to another client"
        );
        drop(other);
        drop(child);
        server.shutdown().await;
    }
}

/// Attack: `Heap::settle` revokes every window of the grants it settled, one after another,
/// on the collector's thread (`heap.rs`, after the extents lock), and on `shm` each revocation
/// bound to a requester stopped inside a request waits the full `retry_timeout` (2 s,
/// `Offer::wait_quiet`; nothing remembers that the same requester was already found stuck). A
/// client stopped inside a request, not fenced (no pressure), with five sealed grants settled
/// by the quarantine in one pass stops the node's collector (every reclamation, compaction and
/// tentative-slot cleanup of every client) for 5 × 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_shm_client_does_not_stall_the_collector() {
    const SEALED: usize = 5;
    let server = small_heap_server(true, Duration::from_secs(1), Duration::from_secs(60)).await;
    let (child, _output, _) = spawn_child(server.control_address(), SEALED);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let pid = Pid::from_raw(child.child.id() as i32);
    kill(pid, Signal::SIGSTOP).expect("stop the child");
    // A live writer keeps the collector busy (its AllocateChunk wakes it to the base pace).
    let mut other = RawClient::connect(server.control_address(), false).await;
    let start = Instant::now();
    let mut last_passes = server.stats().collector_passes;
    let mut last_change = Instant::now();
    let mut longest = Duration::ZERO;
    while start.elapsed() < Duration::from_secs(16) {
        let _ = other.allocate(0, 4096).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let passes = server.stats().collector_passes;
        if passes != last_passes {
            last_passes = passes;
            last_change = Instant::now();
        }
        longest = longest.max(last_change.elapsed());
    }
    drop(child);
    assert!(
        longest < Duration::from_secs(3),
        "the collector made no pass for {longest:?} (a stopped shm client with {SEALED} sealed grants)"
    );
}

/// Attack (the READ half of the hazard): an `shm` client stopped inside a list of block READs,
/// not fenced (no pressure), resumes after the node freed and regranted the extent by the
/// quarantine. `still_receiving` (`fabric/src/provider/shm/mod.rs`) is the only check after the
/// copy, and an unfenced queue pair still receives: the READs after the resume return the new
/// owner's bytes as a success. (A GET that read a slot before the extent was freed would take
/// them for its block: the doc's own example is a newer, unpublished value of the same key.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_shm_read_never_returns_reused_bytes() {
    let run_start = Instant::now();
    for attempt in 0..3 {
        if run_start.elapsed() > Duration::from_secs(100) {
            break;
        }
        let server = small_heap_server(true, Duration::from_secs(1), Duration::from_secs(60)).await;
        let (mut child, mut output, sealed_offset) =
            spawn_child_in(server.control_address(), 1, "read");
        tokio::time::sleep(Duration::from_millis(150)).await;
        let pid = Pid::from_raw(child.child.id() as i32);
        kill(pid, Signal::SIGSTOP).expect("stop the child");
        tokio::time::sleep(Duration::from_millis(5000)).await;
        let mut other = RawClient::connect(server.control_address(), false).await;
        let mut regranted = None;
        let wait = Instant::now();
        for _ in 0..400 {
            if wait.elapsed() > Duration::from_secs(20) {
                break;
            }
            if let Some((offset, key)) = other.allocate(0, 16 * 1024).await {
                if offset == sealed_offset {
                    regranted = Some(key);
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let Some(key) = regranted else {
            // What a fixed node does while the child is stopped inside: G stays out of reach
            // (its window's revocation found the reader inside, so the grant is held).
            eprintln!("attempt {attempt}: G (heap offset {sealed_offset}) was not granted again within 20 s: held");
            drop(other);
            drop(child);
            server.shutdown().await;
            return;
        };
        assert_eq!(
            other.write_list(key, 0x55, 16 * 1024, 1).await,
            WorkCompletionStatus::Success
        );
        kill(pid, Signal::SIGCONT).expect("resume the child");
        let resumed = Instant::now();
        while resumed.elapsed() < Duration::from_secs(10) {
            if child
                .child
                .try_wait()
                .expect("the child's status")
                .is_some()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut report = String::new();
        let mut line = String::new();
        while output.read_line(&mut line).unwrap_or(0) > 0 {
            report.push_str(&line);
            line.clear();
        }
        eprintln!("attempt {attempt}: child: {}", report.trim());
        let stopped_inside = report
            .split("read list: ")
            .nth(1)
            .and_then(|rest| rest.split(" ms").next())
            .and_then(|millis| millis.trim().parse::<u64>().ok())
            .is_some_and(|millis| millis > 1000);
        if stopped_inside {
            assert!(
                !report.contains("Success, reused bytes returned: true"),
                "a READ list the client was stopped inside returned the new owner's bytes as a success"
            );
            return;
        }
        drop(other);
        drop(child);
        server.shutdown().await;
    }
    eprintln!("no attempt stopped the child inside a READ list; nothing shown");
}
