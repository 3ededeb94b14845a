//! Failure behaviour of the soft RNIC against a scripted peer: a lost connection and a silent
//! peer complete outstanding requests RETRY_EXC_ERR within a bounded time, and a buffer used by
//! a posted request outlives the future that posted it until its completion is polled; and
//! posts queued behind a doorbell that is due on their thread leave the ring (one write) to the
//! post that queued first.
//!
//! The scripted peer speaks the documented hello (docs/fabric.md) and then reads requests
//! without ever answering.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkv_fabric::memory::{HugepagePolicy, PinLimits, PinnedMemory};
use rdkv_fabric::{
    AccessFlags, Device, DeviceConfig, QueuePair, QueuePairConfig, QueuePairEndpoint,
    QueuePairState, RemoteSegment, SoftEndpoint, WorkCompletionStatus, WorkRequest,
};

/// A peer that accepts one queue pair connection and never answers a request.
struct SilentPeer {
    endpoint: QueuePairEndpoint,
    close: SyncSender<()>,
    thread: Option<JoinHandle<usize>>,
}

impl SilentPeer {
    fn start() -> Self {
        let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).expect("bind");
        let address = listener.local_addr().expect("address");
        let (close, closed) = sync_channel::<()>(1);
        let thread = std::thread::spawn(move || {
            let mut stream = accept_hello(&listener);
            stream
                .set_read_timeout(Some(Duration::from_millis(20)))
                .expect("timeout");
            let mut received = 0usize;
            let mut buffer = [0u8; 4096];
            let deadline = Instant::now() + Duration::from_secs(20);
            while closed.try_recv().is_err() && Instant::now() < deadline {
                match stream.read(&mut buffer) {
                    Ok(0) => return received,
                    Ok(read) => received += read,
                    Err(_) => {}
                }
            }
            // Told to close: first take what is already on its way, until the socket stays
            // idle for one read timeout (the close request can overtake bytes the client
            // already wrote; seen as a CI flake on a loaded machine).
            while Instant::now() < deadline {
                match stream.read(&mut buffer) {
                    Ok(0) | Err(_) => break,
                    Ok(read) => received += read,
                }
            }
            received
        });
        Self {
            endpoint: scripted_endpoint(address),
            close,
            thread: Some(thread),
        }
    }

    /// Closes the connection; returns how many request bytes the peer received.
    fn close(mut self) -> usize {
        let _ = self.close.send(());
        self.thread
            .take()
            .map(|thread| thread.join().expect("peer thread"))
            .unwrap_or(0)
    }
}

/// Accepts one connection and its hello, and acknowledges it.
fn accept_hello(listener: &TcpListener) -> std::net::TcpStream {
    let (mut stream, _) = listener.accept().expect("accept");
    let mut hello = [0u8; 40];
    stream.read_exact(&mut hello).expect("hello");
    assert_eq!(&hello[0..8], b"RDKVSOFT");
    stream.write_all(&[0u8; 8]).expect("ack");
    stream
}

/// The endpoint of a scripted peer listening at `address`.
fn scripted_endpoint(address: SocketAddr) -> QueuePairEndpoint {
    QueuePairEndpoint::Soft(SoftEndpoint {
        device_id: 0x5151,
        address: Some(address),
        qp_number: 1,
    })
}

struct Client {
    device: Device,
    queue_pair: QueuePair,
    queue: rdkv_fabric::CompletionQueue,
    domain: rdkv_fabric::ProtectionDomain,
}

impl Client {
    /// A fresh pinned page registered for local writes (where READs land).
    fn scratch(&self) -> rdkv_fabric::MemoryRegion {
        self.domain
            .register_all(&pinned(), AccessFlags::LOCAL_WRITE)
            .expect("register")
    }
}

async fn client_of(peer: &SilentPeer, retry_timeout: Duration) -> Client {
    client_to(&peer.endpoint, retry_timeout).await
}

async fn client_to(endpoint: &QueuePairEndpoint, retry_timeout: Duration) -> Client {
    let device = Device::soft(
        None,
        DeviceConfig {
            retry_timeout,
            ..DeviceConfig::default()
        },
    )
    .expect("device");
    let domain = device.allocate_protection_domain();
    let queue = device
        .create_completion_queue(256)
        .expect("create completion queue");
    let queue_pair = domain
        .create_queue_pair(&queue, QueuePairConfig::default())
        .expect("queue pair");
    queue_pair
        .connect(endpoint)
        .await
        .expect("connect to the scripted peer");
    Client {
        device,
        queue_pair,
        queue,
        domain,
    }
}

fn pinned() -> Arc<PinnedMemory> {
    Arc::new(PinnedMemory::allocate(4096, HugepagePolicy::Off, PinLimits::default()).expect("pin"))
}

const REMOTE: RemoteSegment = RemoteSegment {
    address: 0x1000,
    remote_key: 9,
};

#[tokio::test]
async fn lost_connection_completes_outstanding_with_retry_exceeded() {
    let _measuring = MEASURING.lock().await;
    let peer = SilentPeer::start();
    let client = client_of(&peer, Duration::from_secs(30)).await;
    let region = client.scratch();
    let list = vec![
        WorkRequest::read(1, region.segment(0, 64), REMOTE).with_signaled(false),
        WorkRequest::read(2, region.segment(64, 64), REMOTE).with_signaled(false),
        WorkRequest::read(3, region.segment(128, 64), REMOTE),
    ];
    let posted = client.queue_pair.post(list).await.expect("post");
    let started = Instant::now();
    assert!(
        peer.close() >= 3 * 48,
        "the peer received the three requests"
    );
    let completions = tokio::time::timeout(Duration::from_secs(5), posted)
        .await
        .expect("bounded");
    let statuses: Vec<_> = completions
        .iter()
        .map(|completion| completion.status)
        .collect();
    assert_eq!(
        statuses,
        [
            WorkCompletionStatus::RetryExceededError,
            WorkCompletionStatus::WorkRequestFlushError,
            WorkCompletionStatus::WorkRequestFlushError
        ]
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(client.queue_pair.state(), QueuePairState::Error);
}

#[tokio::test]
async fn an_answer_acknowledges_the_writes_before_it() {
    let _measuring = MEASURING.lock().await;
    // A responder that answers only the READ of a WRITE + READ list, as the soft responder
    // (and an RC responder's coalesced ACK) does: the signaled WRITE completes, successfully,
    // before the READ.
    let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).expect("bind");
    let endpoint = scripted_endpoint(listener.local_addr().expect("address"));
    let responder = std::thread::spawn(move || {
        let mut stream = accept_hello(&listener);
        let mut requests = [0u8; 48 + 8 + 48];
        stream
            .read_exact(&mut requests)
            .expect("the WRITE and the READ");
        assert_eq!((requests[0], requests[1]), (1, 1), "a WRITE first");
        assert_eq!((requests[56], requests[57]), (1, 0), "then a READ");
        let mut answer = vec![2u8, 0, 0, 0, 8, 0, 0, 0];
        answer.extend_from_slice(&requests[56 + 8..56 + 16]); // the READ's sequence
        answer.extend_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
        stream.write_all(&answer).expect("the one answer");
        let mut end = [0u8; 1];
        let _ = stream.read(&mut end);
    });
    let client = client_to(&endpoint, Duration::from_secs(10)).await;
    let region = client.scratch();
    let completions = tokio::time::timeout(
        Duration::from_secs(10),
        client.queue_pair.execute(vec![
            WorkRequest::write(1, region.segment(0, 8), REMOTE),
            WorkRequest::read(2, region.segment(64, 8), REMOTE),
        ]),
    )
    .await
    .expect("bounded")
    .expect("post");
    let seen: Vec<_> = completions
        .iter()
        .map(|completion| (completion.work_request_id, completion.status))
        .collect();
    assert_eq!(
        seen,
        [
            (1, WorkCompletionStatus::Success),
            (2, WorkCompletionStatus::Success)
        ]
    );
    let mut read = [0u8; 8];
    region.memory().read_into(64, &mut read).expect("read back");
    assert_eq!(u64::from_le_bytes(read), 0x1122_3344_5566_7788);
    assert_eq!(client.queue_pair.state(), QueuePairState::ReadyToSend);
    drop(client);
    responder.join().expect("the responder");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_responder_answers_a_write_only_when_nothing_later_acknowledges_it() {
    let _measuring = MEASURING.lock().await;
    let mut peer = raw_peer().await;
    let memory = Arc::new(
        PinnedMemory::allocate(4096, HugepagePolicy::Off, PinLimits::default()).expect("pinned"),
    );
    let region = peer
        .domain
        .register_all(
            &memory,
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
        )
        .expect("register");
    let rkey = region.remote_key();
    let stream = &mut peer.stream;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    // A WRITE then a READ of what it wrote, in one segment: one answer, the READ's, with the
    // data the WRITE put there.
    let mut batch = write_request(0, &rkey, 0, &0xABCD_u64.to_le_bytes()).to_vec();
    batch.extend_from_slice(&read_request(1, &rkey, 0, 8));
    stream.write_all(&batch).expect("the requests");
    let mut answer = [0u8; 16 + 8];
    stream.read_exact(&mut answer).expect("an answer");
    assert_eq!((answer[0], answer[1]), (2, 0), "a successful response");
    assert_eq!(u64::from_le_bytes(answer[8..16].try_into().expect("8")), 1);
    assert_eq!(
        u64::from_le_bytes(answer[16..24].try_into().expect("8")),
        0xABCD
    );
    // A WRITE alone is answered, without data.
    stream
        .write_all(&write_request(2, &rkey, 8, &[7u8; 8]))
        .expect("the WRITE");
    let mut answer = [0u8; 16];
    stream.read_exact(&mut answer).expect("an answer");
    assert_eq!((answer[0], answer[1]), (2, 0), "a successful response");
    assert_eq!(u32::from_le_bytes(answer[4..8].try_into().expect("4")), 0);
    assert_eq!(u64::from_le_bytes(answer[8..16].try_into().expect("8")), 2);
    let mut written = [0u8; 8];
    memory.read_into(8, &mut written).expect("read back");
    assert_eq!(written, [7u8; 8]);
}

#[tokio::test]
async fn silent_peer_times_out_with_retry_exceeded() {
    let _measuring = MEASURING.lock().await;
    let peer = SilentPeer::start();
    let retry_timeout = Duration::from_millis(300);
    let client = client_of(&peer, retry_timeout).await;
    let region = client.scratch();
    let started = Instant::now();
    let completions = tokio::time::timeout(
        Duration::from_secs(10),
        client
            .queue_pair
            .execute(vec![WorkRequest::read(1, region.segment(0, 64), REMOTE)]),
    )
    .await
    .expect("bounded")
    .expect("post");
    let waited = started.elapsed();
    assert_eq!(
        completions[0].status,
        WorkCompletionStatus::RetryExceededError
    );
    assert!(waited >= retry_timeout, "waited {waited:?}");
    assert!(
        waited < retry_timeout + Duration::from_secs(2),
        "waited {waited:?}"
    );
    peer.close();
}

#[tokio::test]
async fn buffer_outlives_a_dropped_future_until_its_completion() {
    let _measuring = MEASURING.lock().await;
    let peer = SilentPeer::start();
    let client = client_of(&peer, Duration::from_secs(30)).await;
    let memory = pinned();
    let watched = Arc::downgrade(&memory);
    let region = client
        .domain
        .register_all(&memory, AccessFlags::LOCAL_WRITE)
        .expect("register");
    let posted = client
        .queue_pair
        .post(vec![WorkRequest::read(41, region.segment(0, 64), REMOTE)])
        .await
        .expect("post");
    drop(posted);
    drop(region);
    drop(memory);
    assert!(
        watched.upgrade().is_some(),
        "the NIC may still write into the buffer: it must stay mapped"
    );

    let other = client
        .domain
        .register_all(&pinned(), AccessFlags::LOCAL_WRITE)
        .expect("register");
    let second = client
        .queue_pair
        .post(vec![WorkRequest::read(42, other.segment(0, 64), REMOTE)])
        .await
        .expect("post");
    peer.close();
    let completions = tokio::time::timeout(Duration::from_secs(5), second)
        .await
        .expect("bounded");
    assert_eq!(completions[0].work_request_id, 42);
    assert!(
        watched.upgrade().is_none(),
        "released once its completion was polled"
    );
    let orphaned = client.queue.poll(16);
    assert_eq!(
        orphaned.len(),
        1,
        "the dropped future's completion lands in the completion queue"
    );
    assert_eq!(orphaned[0].work_request_id, 41);
    assert_eq!(orphaned[0].status, WorkCompletionStatus::RetryExceededError);
}

/// The READ frame of a list of one READ: its header, no payload.
const READ_FRAME_BYTES: usize = 48;

/// Polls `post` once, by hand: `Some` with its result when it finished without yielding.
fn poll_once<F: std::future::Future>(post: std::pin::Pin<&mut F>) -> Option<F::Output> {
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    match post.poll(&mut context) {
        std::task::Poll::Ready(output) => Some(output),
        std::task::Poll::Pending => None,
    }
}

#[tokio::test(flavor = "current_thread")]
async fn posts_behind_a_due_doorbell_of_their_thread_neither_yield_nor_write_and_its_ring_carries_them(
) {
    let _measuring = MEASURING.lock().await;
    let peer = SilentPeer::start();
    let client = client_of(&peer, Duration::from_secs(30)).await;
    let region = client.scratch();
    let read = |id: u64| vec![WorkRequest::read(id, region.segment(id * 8, 8), REMOTE)];
    let gauges = || client.device.gauges();
    let mut posted = Vec::new();
    // Twice: the ring rung by the first post of the batch once it resumes, then by its future
    // dropped during the yield (the doorbell guard).
    for (round, dropped) in [(0u64, false), (1, true)] {
        let before = gauges();
        let mut owner = Box::pin(client.queue_pair.post(read(round * 100)));
        assert!(
            poll_once(owner.as_mut()).is_none(),
            "the first post of a batch queues its frame and yields before it rings"
        );
        for id in 1..16 {
            let behind = std::pin::pin!(client.queue_pair.post(read(round * 100 + id)));
            let result = poll_once(behind)
                .unwrap_or_else(|| panic!("post {id} yielded behind a doorbell already due"));
            posted.push(result.expect("posted"));
        }
        assert_eq!(
            gauges().transport_writes,
            before.transport_writes,
            "nothing is written before the doorbell rings"
        );
        if dropped {
            drop(owner);
        } else {
            posted.push(owner.await.expect("posted"));
        }
        let after = gauges();
        assert_eq!(after.frames_sent - before.frames_sent, 16);
        assert_eq!(
            after.transport_writes - before.transport_writes,
            1,
            "one write carries the batch"
        );
    }
    // A post from another thread does not wait for this thread's ring: it rings itself, and
    // its write carries the frame queued here too.
    let before = gauges();
    let mut owner = Box::pin(client.queue_pair.post(read(200)));
    assert!(poll_once(owner.as_mut()).is_none());
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .expect("a runtime");
                runtime.block_on(client.queue_pair.post(read(201)))
            })
            .join()
            .expect("the other thread")
            .expect("posted")
    });
    assert_eq!(
        gauges().transport_writes - before.transport_writes,
        1,
        "the other thread's post rang for itself, and for the frame queued here"
    );
    posted.push(owner.await.expect("posted"));
    assert_eq!(gauges().transport_writes - before.transport_writes, 1);
    let received = peer.close();
    assert_eq!(received, 34 * READ_FRAME_BYTES, "the peer got every frame");
    drop(posted);
}

#[tokio::test]
async fn send_queue_never_exceeds_its_depth() {
    let _measuring = MEASURING.lock().await;
    let peer = SilentPeer::start();
    let device = Device::soft(None, DeviceConfig::default()).expect("device");
    let domain = device.allocate_protection_domain();
    let queue = device
        .create_completion_queue(256)
        .expect("create completion queue");
    let queue_pair = domain
        .create_queue_pair(&queue, QueuePairConfig { max_send_wr: 4 })
        .expect("queue pair");
    queue_pair.connect(&peer.endpoint).await.expect("connect");
    let region = domain
        .register_all(&pinned(), AccessFlags::LOCAL_WRITE)
        .expect("register");
    let read = |id| WorkRequest::read(id, region.segment(0, 64), REMOTE);
    let first = queue_pair
        .post((0..4).map(read).collect())
        .await
        .expect("four fit");
    assert_eq!(queue_pair.outstanding(), 4);
    assert_eq!(queue_pair.free_send_slots(), 0);
    let fifth =
        tokio::time::timeout(Duration::from_millis(200), queue_pair.post(vec![read(5)])).await;
    assert!(
        fifth.is_err(),
        "a fifth request waits for room instead of exceeding max_send_wr"
    );
    assert_eq!(queue_pair.outstanding(), 4);
    queue_pair.modify_to_error();
    assert_eq!(first.await.len(), 4, "all four flushed");
    peer.close();
}

#[tokio::test]
async fn connecting_to_a_missing_queue_pair_names_it() {
    let _measuring = MEASURING.lock().await;
    let listening = Device::soft(
        Some(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))),
        DeviceConfig::default(),
    )
    .expect("listening device");
    let dialing = Device::soft(None, DeviceConfig::default()).expect("dialing device");
    let domain = dialing.allocate_protection_domain();
    let queue = dialing
        .create_completion_queue(256)
        .expect("create completion queue");
    let queue_pair = domain
        .create_queue_pair(&queue, QueuePairConfig::default())
        .expect("queue pair");
    let soft = SoftEndpoint {
        device_id: listening.id(),
        address: listening.listen_address(),
        qp_number: 999_999,
    };
    let error = queue_pair
        .connect(&QueuePairEndpoint::Soft(soft))
        .await
        .expect_err("no such queue pair");
    assert!(error.to_string().contains("queue pair 999999"), "{error}");
    assert!(
        error.to_string().contains("no such device or queue pair"),
        "{error}"
    );
    let loopback = Device::loopback(DeviceConfig::default());
    let loopback_queue = loopback
        .create_completion_queue(256)
        .expect("create completion queue");
    let loopback_pair = loopback
        .allocate_protection_domain()
        .create_queue_pair(&loopback_queue, QueuePairConfig::default())
        .expect("queue pair");
    drop(queue_pair);
    // A loopback queue pair cannot connect to a soft endpoint: the address says which provider
    // it belongs to.
    let mismatch = loopback_pair
        .connect(&QueuePairEndpoint::Soft(soft))
        .await
        .expect_err("backends differ");
    assert!(mismatch.to_string().contains("Loopback"), "{mismatch}");
}

/// A hello to a listening soft NIC, as docs/fabric.md lays it out.
fn hello_bytes(target_qp_number: u32, target_device_id: u64) -> [u8; 40] {
    let mut bytes = [0u8; 40];
    bytes[0..8].copy_from_slice(b"RDKVSOFT");
    // The wire version (docs/fabric.md).
    bytes[8..10].copy_from_slice(&3u16.to_le_bytes());
    bytes[12..16].copy_from_slice(&target_qp_number.to_le_bytes());
    bytes[16..20].copy_from_slice(&0x77u32.to_le_bytes());
    bytes[24..32].copy_from_slice(&0x1234u64.to_le_bytes());
    bytes[32..40].copy_from_slice(&target_device_id.to_le_bytes());
    bytes
}

/// A queue pair of its own protection domain and completion queue on `device`.
fn new_queue_pair(device: &Device) -> QueuePair {
    device
        .allocate_protection_domain()
        .create_queue_pair(
            &device.create_completion_queue(256).expect("cq"),
            QueuePairConfig::default(),
        )
        .expect("queue pair")
}

/// A listening soft NIC with one queue pair: the NIC, its address and the queue pair's
/// endpoint (kept alive by the returned queue pair).
fn listening_queue_pair() -> (Device, SocketAddr, SoftEndpoint, QueuePair) {
    listening_queue_pair_with(DeviceConfig::default())
}

fn listening_queue_pair_with(
    config: DeviceConfig,
) -> (Device, SocketAddr, SoftEndpoint, QueuePair) {
    let device = Device::soft(Some(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))), config)
        .expect("soft device");
    let address = device.listen_address().expect("listening");
    let queue_pair = new_queue_pair(&device);
    let QueuePairEndpoint::Soft(endpoint) = queue_pair.endpoint() else {
        panic!("a soft endpoint");
    };
    (device, address, endpoint, queue_pair)
}

#[test]
fn a_refused_hello_does_not_say_which_field_was_wrong() {
    let _measuring = MEASURING.blocking_lock();
    let (_device, address, endpoint, _queue_pair) = listening_queue_pair();
    let answer = |hello: [u8; 40]| {
        let mut stream = std::net::TcpStream::connect(address).expect("connect");
        stream.write_all(&hello).expect("hello");
        let mut ack = [0u8; 8];
        stream.read_exact(&mut ack).expect("an answer");
        ack
    };
    let wrong_queue_pair = answer(hello_bytes(endpoint.qp_number ^ 0x5A5A, endpoint.device_id));
    let wrong_device = answer(hello_bytes(endpoint.qp_number, endpoint.device_id ^ 1));
    let mut bad_magic = hello_bytes(endpoint.qp_number, endpoint.device_id);
    bad_magic[0] = b'X';
    let bad_magic = answer(bad_magic);
    assert_eq!(wrong_queue_pair, [1, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(wrong_device, wrong_queue_pair);
    assert_eq!(bad_magic, wrong_queue_pair);
}

#[test]
fn queue_pair_numbers_and_device_ids_are_not_guessable() {
    let _measuring = MEASURING.blocking_lock();
    let (device, _address, first, _queue_pair) = listening_queue_pair();
    let (_other, _other_address, other, _other_queue_pair) = listening_queue_pair();
    assert_ne!(first.device_id, other.device_id);
    let domain = device.allocate_protection_domain();
    let completion_queue = device.create_completion_queue(4096).expect("cq");
    let queue_pairs: Vec<QueuePair> = (0..100)
        .map(|_| {
            domain
                .create_queue_pair(&completion_queue, QueuePairConfig { max_send_wr: 4 })
                .expect("queue pair")
        })
        .collect();
    let numbers: Vec<u32> = queue_pairs.iter().map(QueuePair::qp_number).collect();
    let distinct: std::collections::HashSet<u32> = numbers.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        numbers.len(),
        "queue pair numbers are unique"
    );
    assert!(numbers
        .iter()
        .all(|number| (0x10..=0x00FF_FFFF).contains(number)));
    // Sequential numbers would let a client guess its neighbours' from its own.
    let neighbours = numbers
        .windows(2)
        .filter(|pair| pair[1].wrapping_sub(pair[0]) == 1)
        .count();
    assert!(
        neighbours < 3,
        "{neighbours} of 99 numbers follow their predecessor"
    );
}

#[test]
fn a_hello_trickled_a_byte_at_a_time_is_cut_off_at_the_deadline() {
    let _measuring = MEASURING.blocking_lock();
    // The deadline is a device setting (the cluster file's `fabric_hello_deadline`).
    let (device, address, endpoint, _queue_pair) = listening_queue_pair_with(DeviceConfig {
        hello_deadline: Duration::from_secs(2),
        ..DeviceConfig::default()
    });
    let hello = hello_bytes(endpoint.qp_number, endpoint.device_id);
    let mut stream = std::net::TcpStream::connect(address).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_millis(50)))
        .expect("timeout");
    let started = Instant::now();
    // One byte every 250 ms: the 40-byte hello would take 10 s; the deadline is 2 s in all.
    let mut cut_off = None;
    for byte in hello.iter().take(39) {
        if stream.write_all(&[*byte]).is_err() {
            cut_off = Some(started.elapsed());
            break;
        }
        let mut probe = [0u8; 8];
        match stream.read(&mut probe) {
            Ok(0) => {
                cut_off = Some(started.elapsed());
                break;
            }
            Ok(_) => panic!("an answer to a partial hello"),
            Err(_) => {}
        }
        std::thread::sleep(Duration::from_millis(250));
        assert!(started.elapsed() < Duration::from_secs(9), "never cut off");
    }
    let cut_off = cut_off.expect("cut off before the hello was complete");
    assert!(
        cut_off >= Duration::from_millis(1_900) && cut_off < Duration::from_millis(3_500),
        "cut off after {cut_off:?}"
    );
    assert_eq!(device.gauges().hellos_timed_out, 1, "counted");
}

/// A listening soft NIC whose queue pair is connected to a raw peer (a plain TCP stream that
/// speaks the wire format itself), and a 4 MiB region readable by that queue pair.
struct RawPeer {
    stream: std::net::TcpStream,
    rkey: rdkv_fabric::RemoteKey,
    _queue_pair: QueuePair,
    _region: rdkv_fabric::MemoryRegion,
    domain: rdkv_fabric::ProtectionDomain,
    device: Device,
}

const REGION_LENGTH: u64 = 4 << 20;

async fn raw_peer() -> RawPeer {
    raw_peer_with(DeviceConfig::default()).await
}

async fn raw_peer_with(config: DeviceConfig) -> RawPeer {
    let device = Device::soft(Some(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))), config)
        .expect("soft device");
    let domain = device.allocate_protection_domain();
    let memory = Arc::new(
        PinnedMemory::allocate(REGION_LENGTH, HugepagePolicy::Off, PinLimits::default())
            .expect("pinned"),
    );
    let region = domain
        .register_all(&memory, AccessFlags::REMOTE_READ)
        .expect("register");
    let rkey = region.remote_key();
    let (queue_pair, stream) = raw_connection(&device, &domain).await;
    RawPeer {
        stream,
        rkey,
        _queue_pair: queue_pair,
        _region: region,
        domain,
        device,
    }
}

/// A queue pair of `domain` on `device` (a listening NIC), connected to a plain TCP stream
/// that has said its hello.
async fn raw_connection(
    device: &Device,
    domain: &rdkv_fabric::ProtectionDomain,
) -> (QueuePair, std::net::TcpStream) {
    let address = device.listen_address().expect("listening");
    let queue_pair = domain
        .create_queue_pair(
            &device.create_completion_queue(256).expect("cq"),
            QueuePairConfig::default(),
        )
        .expect("queue pair");
    let QueuePairEndpoint::Soft(endpoint) = queue_pair.endpoint() else {
        panic!("a soft endpoint");
    };
    let peer = std::thread::spawn(move || {
        let mut stream = std::net::TcpStream::connect(address).expect("connect");
        stream
            .write_all(&hello_bytes(endpoint.qp_number, endpoint.device_id))
            .expect("hello");
        let mut ack = [0u8; 8];
        stream.read_exact(&mut ack).expect("ack");
        assert_eq!(ack[0], 0, "hello accepted");
        stream
    });
    let peer_endpoint = QueuePairEndpoint::Soft(SoftEndpoint {
        device_id: 0x1234,
        address: None,
        qp_number: 0x77,
    });
    queue_pair
        .connect(&peer_endpoint)
        .await
        .expect("connect the responder");
    (queue_pair, peer.join().expect("the peer"))
}

/// `count` READ request frames of 1 MiB each, sequences from 0, over the first 3 MiB.
fn megabyte_reads(rkey: &rdkv_fabric::RemoteKey, count: u64) -> Vec<u8> {
    let mut batch = Vec::new();
    for sequence in 0..count {
        batch.extend_from_slice(&read_request(sequence, rkey, (sequence % 3) << 20, 1 << 20));
    }
    batch
}

/// Reads the `count` successful answers to [`megabyte_reads`], in order.
fn read_megabyte_answers(stream: &mut std::net::TcpStream, count: u64) {
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut payload = vec![0u8; 1 << 20];
    for sequence in 0..count {
        let mut header = [0u8; 16];
        stream.read_exact(&mut header).expect("a response");
        assert_eq!((header[0], header[1]), (2, 0), "a successful response");
        assert_eq!(
            u64::from_le_bytes(header[8..16].try_into().expect("8 bytes")),
            sequence
        );
        stream.read_exact(&mut payload).expect("the data");
    }
}

/// A WRITE request frame with its payload (docs/fabric.md).
fn write_request(
    sequence: u64,
    rkey: &rdkv_fabric::RemoteKey,
    offset: u64,
    payload: &[u8],
) -> Vec<u8> {
    let mut request = read_request(sequence, rkey, offset, payload.len() as u32).to_vec();
    request[1] = 1; // WRITE
    request[28..32].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    request.extend_from_slice(payload);
    request
}

/// A READ request frame (docs/fabric.md).
fn read_request(
    sequence: u64,
    rkey: &rdkv_fabric::RemoteKey,
    offset: u64,
    length: u32,
) -> [u8; 48] {
    let mut request = [0u8; 48];
    request[0] = 1; // a request
    request[1] = 0; // READ
    request[4..8].copy_from_slice(&rkey.key.to_le_bytes());
    request[8..16].copy_from_slice(&sequence.to_le_bytes());
    request[16..24].copy_from_slice(&(rkey.address + offset).to_le_bytes());
    request[24..28].copy_from_slice(&length.to_le_bytes());
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_longer_than_a_message_gets_an_invalid_request_not_memory() {
    let _measuring = MEASURING.lock().await;
    // A 4 MiB window, four times the device's 1 MiB max_message_size, read at once by a peer
    // that ignores its own limit.
    let mut peer = raw_peer().await;
    let rkey = peer.rkey;
    let stream = &mut peer.stream;
    stream
        .write_all(&read_request(1, &rkey, 0, REGION_LENGTH as u32))
        .expect("the READ");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut header = [0u8; 16];
    stream.read_exact(&mut header).expect("a response");
    assert_eq!(header[0], 2, "a response frame");
    assert_eq!(header[1], 4, "REM_INV_REQ_ERR (status byte {})", header[1]);
    assert_eq!(
        u32::from_le_bytes([header[4], header[5], header[6], header[7]]),
        0,
        "no payload: nothing of the region was copied"
    );
    assert_eq!(
        u64::from_le_bytes(header[8..16].try_into().expect("8 bytes")),
        1
    );
}

/// Requests no conforming requester sends get REM_INV_REQ_ERR, as rxe answers a malformed
/// packet, and run nothing: an atomic whose length is not 8 (the soft responder took a length
/// of 4 as 8 before), a READ that carries a payload (it was read, and the payload ignored),
/// and a WRITE whose payload is not its length (refused before its key's checks, so whatever
/// region it names).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_an_invalid_request() {
    let _measuring = MEASURING.lock().await;
    // As on rxe, the responder's queue pair goes to ERROR after a NAK: one peer per request.
    for malformed in [
        "a CAS of 4 bytes",
        "a READ with a payload",
        "a WRITE whose payload is shorter than its length",
    ] {
        let mut peer = raw_peer().await;
        let rkey = peer.rkey;
        let stream = &mut peer.stream;
        let request = if malformed == "a CAS of 4 bytes" {
            let mut request = read_request(1, &rkey, 0, 4).to_vec();
            request[1] = 2; // CAS
            request
        } else if malformed == "a READ with a payload" {
            let mut request = read_request(1, &rkey, 0, 8).to_vec();
            request[28..32].copy_from_slice(&8u32.to_le_bytes());
            request.extend_from_slice(&[0xAB; 8]);
            request
        } else {
            // Of a READ-only region: refused as malformed, before its key's rights.
            let mut request = write_request(1, &rkey, 0, &[0xAB; 8]);
            request[24..28].copy_from_slice(&16u32.to_le_bytes());
            request
        };
        stream.write_all(&request).expect("the request");
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut header = [0u8; 16];
        stream.read_exact(&mut header).expect("a response");
        assert_eq!(header[0], 2, "{malformed}: a response frame ({header:?})");
        assert_eq!(
            header[1], 4,
            "{malformed}: REM_INV_REQ_ERR (status byte {})",
            header[1]
        );
        assert_eq!(
            u32::from_le_bytes([header[4], header[5], header[6], header[7]]),
            0,
            "{malformed}: no payload"
        );
    }
}

/// This process's threads that the fabric started, now: named `rdkv-…` (the NIC's accept and
/// engine threads, and any thread they spawn unnamed, which inherits the name). The soft NIC
/// uses no tokio thread of its own. Other threads are left out: the test harness starts one per
/// test, and the next test's tokio runtime starts its workers while this one runs.
fn process_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|task| task.ok())
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter(|name| name.starts_with("rdkv"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_to_the_fabric_port_hold_no_threads_and_let_dialers_in() {
    let _measuring = MEASURING.lock().await;
    const IDLE: usize = 3_000;
    // Both ends of 3,000 connections live in this process: lift the soft open-files limit to
    // the hard one (a default soft limit of 1,024 would fail the test, not the node).
    let (_, hard) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .expect("getrlimit");
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard)
        .expect("setrlimit");
    assert!(
        hard >= 2 * IDLE as u64 + 512,
        "the test needs {} open files; the hard limit is {hard}",
        2 * IDLE + 512
    );
    let (device, address, _endpoint, server_queue_pair) = listening_queue_pair();
    let pool = device.gauges().engine_threads;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    assert_eq!(
        pool as usize, cores,
        "the default pool is one engine per core"
    );
    // A new thread carries its name only once it runs: wait (bounded) until the pool's engines
    // and the accept thread are all named, or a busy machine counts them as flood threads.
    let started = Instant::now();
    while process_threads() < pool as usize + 1 && started.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let before = process_threads();
    // 3,000 connections that never say hello (bounded: they close when the test ends).
    let mut idle = Vec::with_capacity(IDLE);
    let mut most_threads = before;
    for index in 0..IDLE {
        let stream = std::net::TcpStream::connect(address).unwrap_or_else(|error| {
            panic!("connection {index} of {IDLE}: {error} (raise `ulimit -n` above 3,200)")
        });
        idle.push(stream);
        if index % 100 == 0 {
            most_threads = most_threads.max(process_threads());
        }
    }
    // The accept thread takes them all within a moment, each past the 64th evicting the
    // oldest pending one; wait until it has (bounded).
    let started = Instant::now();
    while device.gauges().hellos_refused < (IDLE - 64) as i64 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "evicted {} of the excess",
            device.gauges().hellos_refused
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    most_threads = most_threads.max(process_threads());
    // No thread per connection: the engine pool and the accept thread existed before the
    // flood, and nothing was added for it. Under `cargo test` the other tests of this binary run
    // as threads of the same process and start soft devices of their own meanwhile (their
    // engines carry the same truncated name, so they cannot be told apart), so the bound is
    // the "pool + a small constant": a few threads, never one per connection.
    const OTHER_TESTS: usize = 8;
    assert!(
        most_threads <= before + OTHER_TESTS,
        "{most_threads} threads with {IDLE} idle connections, {before} before (pool {pool})"
    );
    assert!(
        device.gauges().hellos_pending <= 64,
        "pending hellos are bounded"
    );
    // A legitimate dialer still gets in: it is the newest pending hello while it says hello.
    let dialing = Device::soft(None, DeviceConfig::default()).expect("dialing device");
    let client_queue_pair = new_queue_pair(&dialing);
    let (server_end, client_end) = (server_queue_pair.endpoint(), client_queue_pair.endpoint());
    let (server, client) = tokio::join!(
        server_queue_pair.connect(&client_end),
        client_queue_pair.connect(&server_end)
    );
    server.expect("the server side connects during the flood");
    client.expect("the client side connects during the flood");
    assert_eq!(client_queue_pair.state(), QueuePairState::ReadyToSend);
    assert!(
        process_threads() <= before,
        "serving the dialer took no thread"
    );
    drop(idle);
}

/// Held by every test of this file: some measure this process's resident memory or threads,
/// and the others start threads (a scripted peer, a listening device's engine pool) and hold
/// answers in flight; `cargo test` runs a binary's tests as threads of one process, so they take
/// turns.
static MEASURING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// This process's resident memory, in bytes.
fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .expect("/proc/self/status")
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| {
            value
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .expect("a VmRSS line")
        * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_wait_for_a_peer_that_does_not_read_in_bounded_memory() {
    let _measuring = MEASURING.lock().await;
    let mut peer = raw_peer().await;
    let rkey = peer.rkey;
    let stream = &mut peer.stream;
    // 512 small requests for 1 MiB each, in one write, and then not a byte read: 512 MiB of
    // answers, which the responder must not hold.
    const REQUESTS: u64 = 512;
    let before = resident_bytes();
    stream
        .write_all(&megabyte_reads(&rkey, REQUESTS))
        .expect("the requests");
    let mut peak = before;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(1) {
        peak = peak.max(resident_bytes());
        std::thread::sleep(Duration::from_millis(20));
    }
    let growth = peak.saturating_sub(before);
    assert!(
        growth < 128 << 20,
        "resident memory grew {} MiB while the peer did not read",
        growth >> 20
    );
    // Every answer still comes, once the peer reads.
    read_megabyte_answers(stream, REQUESTS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_does_not_read_does_not_stall_the_others_on_its_engine() {
    let _measuring = MEASURING.lock().await;
    // One engine thread, so both connections share it; a 256 KiB response bound (the
    // cluster file's `fabric_response_buffer`).
    let mut stalled = raw_peer_with(DeviceConfig {
        engine_threads: 1,
        response_buffer: 256 * 1024,
        ..DeviceConfig::default()
    })
    .await;
    assert_eq!(stalled.device.gauges().engine_threads, 1);
    let rkey = stalled.rkey;
    // 256 MiB of answers asked for, and none read: the engine stops reading this connection
    // once its output is full, and goes on serving the others.
    stalled
        .stream
        .write_all(&megabyte_reads(&rkey, 256))
        .expect("the requests");
    let (_queue_pair, mut other) = raw_connection(&stalled.device, &stalled.domain).await;
    other
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let started = Instant::now();
    for sequence in 0..100u64 {
        other
            .write_all(&read_request(sequence, &rkey, sequence * 64, 64))
            .expect("a READ");
        let mut response = [0u8; 16 + 64];
        other
            .read_exact(&mut response)
            .expect("an answer while the other peer is stalled");
        assert_eq!((response[0], response[1]), (2, 0), "a successful response");
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "100 READs took {:?} beside a stalled peer",
        started.elapsed()
    );
    assert_eq!(stalled.device.gauges().soft_connections, 2);
    assert!(
        stalled.device.gauges().output_stalls >= 1,
        "the stall is counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twelve_pipelined_64_mib_reads_get_the_status_not_memory() {
    let _measuring = MEASURING.lock().await;
    // The measurement on main before the cap: twelve pipelined 64 MiB READs of a window grew
    // the responder's RSS from 112 to 1,648 MiB. Now each is longer than max_message_size
    // (1 MiB) and is refused before any memory is touched.
    let mut peer = raw_peer().await;
    let rkey = peer.rkey;
    let before = resident_bytes();
    let mut batch = Vec::new();
    for sequence in 0..12u64 {
        batch.extend_from_slice(&read_request(sequence, &rkey, 0, 64 << 20));
    }
    peer.stream.write_all(&batch).expect("the READs");
    peer.stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut header = [0u8; 16];
    peer.stream.read_exact(&mut header).expect("a response");
    assert_eq!(
        (header[0], header[1]),
        (2, 4),
        "REM_INV_REQ_ERR for the first READ"
    );
    assert_eq!(
        u32::from_le_bytes([header[4], header[5], header[6], header[7]]),
        0,
        "no data"
    );
    // The responder's queue pair is in ERROR after a NAK, as on rxe: nothing more is served;
    // the stop frame says so (the other eleven did not run), and the connection closes.
    let mut rest = Vec::new();
    let _ = peer.stream.read_to_end(&mut rest);
    let mut stop = [0u8; 16];
    stop[0] = 3;
    assert_eq!(rest, stop, "only the stop frame after the refusal");
    assert_eq!(peer.device.gauges().responder_errors, 1, "counted");
    let growth = resident_bytes().saturating_sub(before);
    assert!(
        growth < 64 << 20,
        "resident memory grew {} MiB",
        growth >> 20
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_hello_for_a_connected_queue_pair_is_refused_like_any_other() {
    let _measuring = MEASURING.lock().await;
    let peer = raw_peer().await;
    let QueuePairEndpoint::Soft(endpoint) = peer._queue_pair.endpoint() else {
        panic!("a soft endpoint");
    };
    let address = peer.device.listen_address().expect("listening");
    // The same hello again (same source), and one from another source: both refused with
    // the one refusal every wrong hello gets, so hellos cannot find live queue pairs.
    for source_device in [0x1234u64, 0x9999] {
        let mut hello = hello_bytes(endpoint.qp_number, endpoint.device_id);
        hello[24..32].copy_from_slice(&source_device.to_le_bytes());
        let mut stream = std::net::TcpStream::connect(address).expect("connect");
        stream.write_all(&hello).expect("hello");
        let mut ack = [0u8; 8];
        stream.read_exact(&mut ack).expect("an answer");
        assert_eq!(ack[0], 1, "refused (source device {source_device:#x})");
    }
    // The first connection's engine may start after its acknowledgement (a busy machine):
    // wait for it, bounded; a refused hello never starts one.
    let waited = std::time::Instant::now();
    while peer.device.gauges().soft_connections != 1
        && waited.elapsed() < std::time::Duration::from_secs(10)
    {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(
        peer.device.gauges().soft_connections,
        1,
        "the first one still serves, and no refused one does"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_large_reads_leaves_no_megabytes_behind() {
    let _measuring = MEASURING.lock().await;
    // Four connections each read 64 × 1 MiB and then sit idle: the buffers a burst grew
    // (responses, outgoing) go back to their kept size. Measured before: about 11 MiB kept
    // per idle connection until it closed.
    let mut peers = Vec::new();
    for _ in 0..4 {
        peers.push(raw_peer().await);
    }
    let before = resident_bytes();
    for peer in &mut peers {
        peer.stream
            .write_all(&megabyte_reads(&peer.rkey, 64))
            .expect("the READs");
        read_megabyte_answers(&mut peer.stream, 64);
    }
    let kept = resident_bytes().saturating_sub(before);
    assert!(
        kept < 16 << 20,
        "{} MiB kept by 4 idle connections after their bursts",
        kept >> 20
    );
}
