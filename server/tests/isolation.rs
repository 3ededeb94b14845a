//! Isolation: keys are per connection and die with it. A raw client speaks the control protocol
//! and posts fabric requests by hand, with keys that are not its own.

use std::sync::Arc;

use rdkv_common::protocol::{
    read_frame, write_frame, ClientMessage, ConnectionKeys, ServerMessage,
};
use rdkv_common::ControlError;
use rdkv_fabric::memory::{HugepagePolicy, PinLimits, PinnedMemory};
use rdkv_fabric::{
    AccessFlags, Backend, CompletionQueue, Device, DeviceConfig, MemoryRegion, QueuePair,
    QueuePairConfig, RemoteKey, WorkCompletionStatus, WorkRequest,
};
use rdkv_server::{RunningServer, ServerConfig};
use tokio::net::TcpStream;

mod support;

const SECRET: &[u8] = b"isolation-secret";

struct RawClient {
    stream: TcpStream,
    keys: ConnectionKeys,
    queue_pair: QueuePair,
    local: MemoryRegion,
    _completion_queue: CompletionQueue,
    _device: Device,
}

impl RawClient {
    /// A raw client over the server's main fabric (soft), or over its shm fabric.
    async fn connect(server: &RunningServer) -> Self {
        Self::connect_over(server, server.offers_shm()).await
    }

    async fn connect_over(server: &RunningServer, over_shm: bool) -> Self {
        let mut stream = TcpStream::connect(server.control_address())
            .await
            .expect("connect");
        let ServerMessage::Welcome(welcome) =
            support::authenticate(&mut stream, SECRET, over_shm, "raw").await
        else {
            panic!("no welcome");
        };
        let backend = welcome.server_endpoint.backend();
        assert_eq!(
            backend.capabilities().shares_memory,
            over_shm,
            "the node's fabric for this client"
        );
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
            PinnedMemory::allocate(8192, HugepagePolicy::Off, PinLimits::default()).expect("pin"),
        );
        let local = domain
            .register_all(&memory, AccessFlags::LOCAL_WRITE)
            .expect("register");
        // An shm responder takes the attach only once its queue pair knows ours: name it first
        // (as the client library does).
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

    async fn chunk(&mut self) -> RemoteKey {
        write_frame(
            &mut self.stream,
            &ClientMessage::AllocateChunk {
                started: 0,
                needed: 1024,
            },
        )
        .await
        .expect("request chunk");
        match read_frame(&mut self.stream).await.expect("chunk") {
            ServerMessage::Chunk { key, .. } => key,
            other => panic!("no chunk: {other:?}"),
        }
    }

    async fn read(&self, key: RemoteKey) -> WorkCompletionStatus {
        let completions = self
            .queue_pair
            .execute(vec![WorkRequest::read(
                1,
                self.local.segment(0, 64),
                key.at(0),
            )])
            .await
            .expect("post");
        completions[0].status
    }

    async fn write(&self, key: RemoteKey) -> WorkCompletionStatus {
        let completions = self
            .queue_pair
            .execute(vec![WorkRequest::write(
                1,
                self.local.segment(0, key.length.min(64) as u32),
                key.at(0),
            )])
            .await
            .expect("post");
        completions[0].status
    }

    /// Says goodbye and waits until the server closes the connection, which it does only after
    /// the teardown revoked this client's keys.
    async fn disconnect(mut self) -> ConnectionKeys {
        write_frame(&mut self.stream, &ClientMessage::Goodbye)
            .await
            .expect("goodbye");
        let closed = read_frame::<_, ServerMessage>(&mut self.stream).await;
        assert!(matches!(closed, Err(ControlError::Closed)), "{closed:?}");
        self.keys
    }
}

async fn server() -> RunningServer {
    let mut config = ServerConfig::local(SECRET);
    config.fabric = Backend::Soft;
    rdkv_server::start(config).await.expect("start")
}

/// A server that also offers its shm fabric, on a socket of its own.
async fn shm_server() -> RunningServer {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let mut config = ServerConfig::local(SECRET);
    config.fabric = Backend::Soft;
    config.shm_socket = Some(std::env::temp_dir().join(format!(
        "rdkv-isolation-{}-{}.sock",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )));
    rdkv_server::start(config).await.expect("start")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_clients_chunk_cannot_be_written() {
    another_clients_chunk_cannot_be_written_on(server().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_clients_chunk_cannot_be_written_over_shm() {
    another_clients_chunk_cannot_be_written_on(shm_server().await).await;
}

async fn another_clients_chunk_cannot_be_written_on(server: RunningServer) {
    let mut owner = RawClient::connect(&server).await;
    let intruder = RawClient::connect(&server).await;
    let owner_chunk = owner.chunk().await;
    assert_eq!(
        owner.write(owner_chunk).await,
        WorkCompletionStatus::Success,
        "the owner may write"
    );
    assert_eq!(
        intruder.write(owner_chunk).await,
        WorkCompletionStatus::RemoteAccessError,
        "the chunk's key is bound to its owner's queue pair"
    );
    assert_eq!(
        intruder.read(owner.keys.index_key).await,
        WorkCompletionStatus::WorkRequestFlushError,
        "the intruder's queue pair is in ERROR after its violation"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_die_with_their_connection() {
    keys_die_with_their_connection_on(server().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_die_with_their_connection_over_shm() {
    keys_die_with_their_connection_on(shm_server().await).await;
}

async fn keys_die_with_their_connection_on(server: RunningServer) {
    let mut leaving = RawClient::connect(&server).await;
    let chunk = leaving.chunk().await;
    assert_eq!(
        leaving.read(leaving.keys.index_key).await,
        WorkCompletionStatus::Success
    );
    assert_eq!(leaving.write(chunk).await, WorkCompletionStatus::Success);
    assert_eq!(
        leaving.write(leaving.keys.announce_key).await,
        WorkCompletionStatus::Success
    );
    let windows_before = server.stats().live_memory_windows;
    let old_keys = leaving.disconnect().await;
    assert_eq!(
        server.stats().live_memory_windows,
        windows_before - 5,
        "index, heap, announce, lease word and chunk windows are gone"
    );

    for (name, key, write) in [
        ("index", old_keys.index_key, false),
        ("heap", old_keys.heap_key, false),
        ("chunk", chunk, true),
        ("announce", old_keys.announce_key, true),
        ("lease word", old_keys.lease_key, false),
    ] {
        let other = RawClient::connect(&server).await;
        let status = if write {
            other.write(key).await
        } else {
            other.read(key).await
        };
        assert_eq!(
            status,
            WorkCompletionStatus::RemoteAccessError,
            "stale {name} key"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_gets_no_keys() {
    let server = server().await;
    let mut stream = TcpStream::connect(server.control_address())
        .await
        .expect("connect");
    let reply = support::authenticate(&mut stream, b"not the secret", false, "intruder").await;
    assert!(
        matches!(reply, ServerMessage::Refused { ref reason } if reason.contains("secret")),
        "{reply:?}"
    );
    assert!(matches!(
        read_frame::<_, ServerMessage>(&mut stream).await,
        Err(ControlError::Closed)
    ));
    let stats = server.stats();
    assert_eq!(
        stats.queue_pairs.iter().sum::<i64>(),
        0,
        "no queue pair for an unauthenticated peer"
    );
    assert_eq!(
        stats.live_memory_windows, 0,
        "no key for an unauthenticated peer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_close_only_their_connection() {
    use tokio::io::AsyncWriteExt;
    let server = server().await;
    let healthy = RawClient::connect(&server).await;
    let mut bad = TcpStream::connect(server.control_address())
        .await
        .expect("connect");
    let _challenge: ServerMessage = read_frame(&mut bad).await.expect("challenge");
    bad.write_all(&u32::MAX.to_le_bytes())
        .await
        .expect("oversize length");
    assert!(matches!(
        read_frame::<_, ServerMessage>(&mut bad).await,
        Err(ControlError::Closed)
    ));
    let mut garbage = TcpStream::connect(server.control_address())
        .await
        .expect("connect");
    let _challenge: ServerMessage = read_frame(&mut garbage).await.expect("challenge");
    garbage
        .write_all(&[4, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF])
        .await
        .expect("garbage");
    assert!(matches!(
        read_frame::<_, ServerMessage>(&mut garbage).await,
        Err(ControlError::Closed)
    ));
    assert_eq!(
        healthy.read(healthy.keys.index_key).await,
        WorkCompletionStatus::Success
    );
}
