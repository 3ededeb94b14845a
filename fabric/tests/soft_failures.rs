//! Failure behaviour of the soft RNIC against a scripted peer: a lost connection and a silent
//! peer complete outstanding requests RETRY_EXC_ERR within a bounded time, and a buffer used by
//! a posted request outlives the future that posted it until its completion is polled.
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
            let (mut stream, _) = listener.accept().expect("accept");
            let mut hello = [0u8; 40];
            stream.read_exact(&mut hello).expect("hello");
            assert_eq!(&hello[0..8], b"RDKVSOFT");
            stream.write_all(&[0u8; 8]).expect("ack");
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
            endpoint: QueuePairEndpoint::Soft(SoftEndpoint {
                device_id: 0x5151,
                address: Some(address),
                qp_number: 1,
            }),
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

struct Client {
    _device: Device,
    queue_pair: QueuePair,
    queue: rdkv_fabric::CompletionQueue,
    domain: rdkv_fabric::ProtectionDomain,
}

async fn client_of(peer: &SilentPeer, retry_timeout: Duration) -> Client {
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
        .connect(&peer.endpoint)
        .await
        .expect("connect to the scripted peer");
    Client {
        _device: device,
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
    let peer = SilentPeer::start();
    let client = client_of(&peer, Duration::from_secs(30)).await;
    let region = client
        .domain
        .register_all(&pinned(), AccessFlags::LOCAL_WRITE)
        .expect("register");
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
async fn silent_peer_times_out_with_retry_exceeded() {
    let peer = SilentPeer::start();
    let retry_timeout = Duration::from_millis(300);
    let client = client_of(&peer, retry_timeout).await;
    let region = client
        .domain
        .register_all(&pinned(), AccessFlags::LOCAL_WRITE)
        .expect("register");
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

#[tokio::test]
async fn send_queue_never_exceeds_its_depth() {
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
    assert!(error.to_string().contains("no such queue pair"), "{error}");
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
