//! The fabric conformance suite: every backend must pass every check here with the same
//! assertions.
//!
//! Each check takes a [`Backend`] and builds what it needs: a "server" device that listens and
//! owns the remote memory, a "client" device that posts, and connected queue pairs between
//! them. `main.rs` instantiates every check for every backend with one macro.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use rdkv_fabric::memory::{HugepagePolicy, PinLimits, PinnedMemory};
use rdkv_fabric::{
    AccessFlags, Backend, CompletionQueue, Device, DeviceConfig, MemoryRegion, ProtectionDomain,
    QueuePair, QueuePairConfig, QueuePairState, RemoteSegment, VerbsOptions, WorkCompletion,
    WorkCompletionStatus, WorkRequest, DEFAULT_MAX_SEND_WR,
};

const MIB: u64 = 1024 * 1024;
/// Size of the server's registered block: 1 MiB for the largest transfer plus room.
const REMOTE_SIZE: u64 = MIB + 64 * 1024;
/// Entries of each side's completion queue: room for 16 queue pairs of the default depth (the
/// concurrency checks connect 8).
const COMPLETION_QUEUE_SIZE: usize = 16 * DEFAULT_MAX_SEND_WR as usize;
/// Size of the client's local block.
const LOCAL_SIZE: u64 = MIB + 64 * 1024;

/// Creates the server and client devices of a backend.
pub fn devices(fabric: Backend) -> (Device, Device) {
    devices_with(fabric, DeviceConfig::default())
}

/// Creates the server and client devices of a backend with a device configuration.
pub fn devices_with(fabric: Backend, config: DeviceConfig) -> (Device, Device) {
    devices_configured(fabric, config, config)
}

/// Creates the server and client devices of a backend, each with its own configuration.
pub fn devices_configured(
    fabric: Backend,
    server: DeviceConfig,
    client: DeviceConfig,
) -> (Device, Device) {
    // The server side listens where its provider can (soft: loopback, port 0); the client side
    // only dials. Verbs takes its device from RDKV_RDMA_DEVICE and friends.
    let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let options = VerbsOptions::from_environment();
    (
        Device::open(fabric, Some(listen), &options, server)
            .unwrap_or_else(|error| panic!("open the {fabric} server device: {error}")),
        Device::open(fabric, None, &options, client)
            .unwrap_or_else(|error| panic!("open the {fabric} client device: {error}")),
    )
}

/// Allocates and pins a block, shareable so that every provider can register it (an `shm`
/// device offers only shareable memory; the others take either kind).
pub fn pinned(length: u64) -> Arc<PinnedMemory> {
    Arc::new(
        PinnedMemory::allocate_shared(length, HugepagePolicy::Off, PinLimits::default())
            .expect("pin test memory"),
    )
}

/// One connected pair of queue pairs with registered memory on both sides.
pub struct Connected {
    /// The server device (listens, owns remote memory).
    pub server_device: Device,
    /// The client device (posts); held so that it lives as long as the pair (no check reads
    /// it).
    pub _client_device: Device,
    /// The server's domain.
    pub server_domain: ProtectionDomain,
    /// The client's domain.
    pub client_domain: ProtectionDomain,
    /// The server's queue pair.
    pub server_queue_pair: QueuePair,
    /// The client's queue pair.
    pub client_queue_pair: QueuePair,
    /// The client's completion queue.
    pub client_completion_queue: CompletionQueue,
    /// The server's completion queue.
    pub server_completion_queue: CompletionQueue,
    /// Server memory with every remote right.
    pub remote: MemoryRegion,
    /// Client memory with LOCAL_WRITE.
    pub local: MemoryRegion,
}

impl Connected {
    /// A local segment in the client region.
    pub fn local_at(&self, offset: u64, length: u32) -> rdkv_fabric::LocalSegment {
        self.local.segment(offset, length)
    }

    /// A remote segment in the server region.
    pub fn remote_at(&self, offset: u64) -> RemoteSegment {
        self.remote.remote_key().at(offset)
    }

    /// Another client queue pair connected to a new server queue pair, on the same devices.
    pub async fn another_pair(&self) -> (QueuePair, QueuePair) {
        connect_queue_pairs(
            &self.server_domain,
            &self.server_completion_queue,
            &self.client_domain,
            &self.client_completion_queue,
            QueuePairConfig::default(),
        )
        .await
    }
}

/// Creates and connects a server and a client queue pair.
pub async fn connect_queue_pairs(
    server_domain: &ProtectionDomain,
    server_completion_queue: &CompletionQueue,
    client_domain: &ProtectionDomain,
    client_completion_queue: &CompletionQueue,
    config: QueuePairConfig,
) -> (QueuePair, QueuePair) {
    let server = server_domain
        .create_queue_pair(server_completion_queue, config)
        .expect("create server queue pair");
    let client = client_domain
        .create_queue_pair(client_completion_queue, config)
        .expect("create client queue pair");
    let (server_endpoint, client_endpoint) = (server.endpoint(), client.endpoint());
    let (server_result, client_result) = tokio::join!(
        server.connect(&client_endpoint),
        client.connect(&server_endpoint)
    );
    server_result.expect("connect server queue pair");
    client_result.expect("connect client queue pair");
    (server, client)
}

/// Builds a connected pair on `fabric`.
pub async fn connect(fabric: Backend) -> Connected {
    connect_with(fabric, DeviceConfig::default(), QueuePairConfig::default()).await
}

/// Builds a connected pair with explicit configurations.
pub async fn connect_with(
    fabric: Backend,
    device_config: DeviceConfig,
    config: QueuePairConfig,
) -> Connected {
    connect_devices(devices_with(fabric, device_config), config).await
}

/// Builds a connected pair on two given devices (server, client).
pub async fn connect_devices(devices: (Device, Device), config: QueuePairConfig) -> Connected {
    let (server_device, client_device) = devices;
    let server_domain = server_device.allocate_protection_domain();
    let client_domain = client_device.allocate_protection_domain();
    let server_completion_queue = server_device
        .create_completion_queue(COMPLETION_QUEUE_SIZE)
        .expect("create completion queue");
    let client_completion_queue = client_device
        .create_completion_queue(COMPLETION_QUEUE_SIZE)
        .expect("create completion queue");
    let remote = server_domain
        .register_all(
            &pinned(REMOTE_SIZE),
            AccessFlags::LOCAL_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_ATOMIC
                | AccessFlags::MW_BIND,
        )
        .expect("register remote memory");
    let local = client_domain
        .register_all(&pinned(LOCAL_SIZE), AccessFlags::LOCAL_WRITE)
        .expect("register local memory");
    let (server_queue_pair, client_queue_pair) = connect_queue_pairs(
        &server_domain,
        &server_completion_queue,
        &client_domain,
        &client_completion_queue,
        config,
    )
    .await;
    Connected {
        server_device,
        _client_device: client_device,
        server_domain,
        client_domain,
        server_queue_pair,
        client_queue_pair,
        client_completion_queue,
        server_completion_queue,
        remote,
        local,
    }
}

/// The statuses of `completions`, in order.
pub fn statuses(completions: &[WorkCompletion]) -> Vec<WorkCompletionStatus> {
    completions
        .iter()
        .map(|completion| completion.status)
        .collect()
}

fn pattern(length: usize, seed: u8) -> Vec<u8> {
    (0..length)
        .map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Queue pairs walk RESET → INIT → RTR → RTS, and the gauges count them.
pub async fn queue_pair_states_and_gauges(fabric: Backend) {
    let (device, _) = devices(fabric);
    let domain = device.allocate_protection_domain();
    let queue = device
        .create_completion_queue(DEFAULT_MAX_SEND_WR as usize)
        .expect("create completion queue");
    let queue_pair = domain
        .create_queue_pair(&queue, QueuePairConfig::default())
        .expect("create");
    assert_eq!(queue_pair.state(), QueuePairState::Reset);
    assert_eq!(device.gauges().queue_pairs_in(QueuePairState::Reset), 1);
    queue_pair.modify_to_init().expect("init");
    assert_eq!(queue_pair.state(), QueuePairState::Init);
    assert!(
        queue_pair.modify_to_init().is_err(),
        "INIT → INIT is refused"
    );
    queue_pair.modify_to_error();
    assert_eq!(queue_pair.state(), QueuePairState::Error);
    assert_eq!(device.gauges().queue_pairs_in(QueuePairState::Error), 1);
    drop(queue_pair);
    assert_eq!(device.gauges().queue_pairs_in(QueuePairState::Error), 0);

    let connected = connect(fabric).await;
    assert_eq!(
        connected.client_queue_pair.state(),
        QueuePairState::ReadyToSend
    );
    assert_eq!(
        connected.server_queue_pair.state(),
        QueuePairState::ReadyToSend
    );
    let gauges = connected.server_device.gauges();
    assert_eq!(gauges.live_memory_regions, 1);
    assert_eq!(gauges.registered_bytes as u64, REMOTE_SIZE);
    assert!(gauges.pinned_bytes >= REMOTE_SIZE);
    let window = connected.server_domain.allocate_memory_window();
    assert_eq!(connected.server_device.gauges().live_memory_windows, 1);
    drop(window);
    assert_eq!(connected.server_device.gauges().live_memory_windows, 0);
}

/// A completion queue takes queue pairs only while their send queues fit in it (an overrun
/// would break every queue pair on a NIC's CQ); a destroyed queue pair gives its room back.
pub async fn completion_queue_capacity_bounds_its_send_queues(fabric: Backend) {
    let (device, _) = devices(fabric);
    let domain = device.allocate_protection_domain();
    let queue = device
        .create_completion_queue(300)
        .expect("create completion queue");
    let first = domain
        .create_queue_pair(&queue, QueuePairConfig { max_send_wr: 256 })
        .expect("256 of 300 fit");
    let refused = domain.create_queue_pair(&queue, QueuePairConfig { max_send_wr: 64 });
    assert!(
        matches!(
            refused,
            Err(rdkv_fabric::Error::CompletionQueueFull {
                capacity: 300,
                committed: 256,
                requested: 64
            })
        ),
        "{refused:?}"
    );
    let small = domain
        .create_queue_pair(&queue, QueuePairConfig { max_send_wr: 44 })
        .expect("256 + 44 = 300 fit");
    drop(first);
    domain
        .create_queue_pair(&queue, QueuePairConfig { max_send_wr: 256 })
        .expect("the destroyed queue pair's room is free again");
    drop(small);
}

/// READ and WRITE round trips at 8 B, 64 B, 4 KiB and 1 MiB.
pub async fn read_write_round_trips(fabric: Backend) {
    let connected = connect(fabric).await;
    for (index, length) in [8usize, 64, 4096, MIB as usize].into_iter().enumerate() {
        let data = pattern(length, index as u8 + 1);
        connected.local.write(0, &data).expect("fill local");
        let completions = connected
            .client_queue_pair
            .execute(vec![WorkRequest::write(
                1,
                connected.local_at(0, length as u32),
                connected.remote_at(8),
            )])
            .await
            .expect("post write");
        assert_eq!(
            statuses(&completions),
            [WorkCompletionStatus::Success],
            "WRITE {length}"
        );
        let mut on_server = vec![0u8; length];
        connected
            .remote
            .read(8, &mut on_server)
            .expect("server view");
        assert_eq!(on_server, data, "server memory after WRITE {length}");

        let back_offset = 32 * 1024;
        connected
            .local
            .write(back_offset, &vec![0u8; length.min(32 * 1024)])
            .expect("clear");
        let completions = connected
            .client_queue_pair
            .execute(vec![WorkRequest::read(
                2,
                connected.local_at(back_offset, length as u32),
                connected.remote_at(8),
            )])
            .await
            .expect("post read");
        assert_eq!(
            statuses(&completions),
            [WorkCompletionStatus::Success],
            "READ {length}"
        );
        assert_eq!(completions[0].work_request_id, 2);
        let mut read_back = vec![0u8; length];
        connected
            .local
            .read(back_offset, &mut read_back)
            .expect("local view");
        assert_eq!(read_back, data, "READ {length} returns what WRITE stored");
    }
}

/// CAS success and failure both return the original value.
pub async fn compare_and_swap_returns_original(fabric: Backend) {
    let connected = connect(fabric).await;
    connected
        .local
        .write(0, &41u64.to_le_bytes())
        .expect("fill");
    connected
        .client_queue_pair
        .execute(vec![WorkRequest::write(
            1,
            connected.local_at(0, 8),
            connected.remote_at(64),
        )])
        .await
        .expect("seed");
    let swap = |id, compare, swap| {
        WorkRequest::compare_and_swap(
            id,
            connected.local_at(8, 8),
            connected.remote_at(64),
            compare,
            swap,
        )
    };
    let completions = connected
        .client_queue_pair
        .execute(vec![swap(2, 41, 42)])
        .await
        .expect("cas");
    assert_eq!(statuses(&completions), [WorkCompletionStatus::Success]);
    assert_eq!(
        connected.local.load_u64(8).expect("original"),
        41,
        "successful CAS returns the original"
    );
    assert_eq!(connected.remote.load_u64(64).expect("remote"), 42);

    let completions = connected
        .client_queue_pair
        .execute(vec![swap(3, 41, 99)])
        .await
        .expect("cas");
    assert_eq!(statuses(&completions), [WorkCompletionStatus::Success]);
    assert_eq!(
        connected.local.load_u64(8).expect("original"),
        42,
        "failed CAS returns the current value"
    );
    assert_eq!(
        connected.remote.load_u64(64).expect("remote"),
        42,
        "failed CAS leaves memory alone"
    );
}

/// Requests of one list execute in order at the responder: a READ posted after a CAS in the same
/// list sees the CAS's result, and a READ after a failed CAS sees the memory unchanged. The slot
/// protocol relies on it: an insert places its tentative slot and re-reads the buckets in one
/// list (`docs/protocol.md`).
pub async fn read_after_compare_and_swap_in_one_list_sees_it(fabric: Backend) {
    let connected = connect(fabric).await;
    for round in 0..64u64 {
        let current = connected.remote.load_u64(128).expect("remote");
        let (expected, new) = if round % 3 == 2 {
            (current.wrapping_add(1), 7_000 + round)
        } else {
            (current, 1_000 + round)
        };
        let list = vec![
            WorkRequest::compare_and_swap(
                1,
                connected.local_at(0, 8),
                connected.remote_at(128),
                expected,
                new,
            )
            .with_signaled(false),
            WorkRequest::read(2, connected.local_at(64, 64), connected.remote_at(128)),
        ];
        let completions = connected
            .client_queue_pair
            .execute(list)
            .await
            .expect("cas then read");
        assert_eq!(statuses(&completions), [WorkCompletionStatus::Success]);
        let original = connected.local.load_u64(0).expect("original");
        let read = connected.local.load_u64(64).expect("read");
        assert_eq!(
            original, current,
            "round {round}: the CAS returns the original"
        );
        let want = if original == expected { new } else { current };
        assert_eq!(
            read, want,
            "round {round}: the READ after the CAS sees its result"
        );
    }
}

/// FETCH_ADD returns the original and adds, wrapping.
pub async fn fetch_and_add_returns_original(fabric: Backend) {
    let connected = connect(fabric).await;
    let add = |id, addend| {
        WorkRequest::fetch_and_add(
            id,
            connected.local_at(0, 8),
            connected.remote_at(128),
            addend,
        )
    };
    for (id, expected_original) in [(1u64, 0u64), (2, 5), (3, 10)] {
        let completions = connected
            .client_queue_pair
            .execute(vec![add(id, 5)])
            .await
            .expect("faa");
        assert_eq!(statuses(&completions), [WorkCompletionStatus::Success]);
        assert_eq!(
            connected.local.load_u64(0).expect("original"),
            expected_original
        );
    }
    connected
        .client_queue_pair
        .execute(vec![add(4, u64::MAX)])
        .await
        .expect("faa");
    assert_eq!(
        connected.remote.load_u64(128).expect("remote"),
        14,
        "FETCH_ADD wraps"
    );
}

/// 16 requests posted at once with only the last signaled give exactly one completion.
pub async fn batch_with_only_last_signaled_gives_one_completion(fabric: Backend) {
    let connected = connect(fabric).await;
    let before = connected.client_completion_queue.completions_generated();
    let list: Vec<WorkRequest> = (0..16u64)
        .map(|index| {
            WorkRequest::fetch_and_add(
                index,
                connected.local_at(index * 8, 8),
                connected.remote_at(256),
                1,
            )
            .with_signaled(index == 15)
        })
        .collect();
    let completions = connected
        .client_queue_pair
        .execute(list)
        .await
        .expect("post");
    assert_eq!(completions.len(), 1);
    assert_eq!(completions[0].work_request_id, 15);
    assert_eq!(completions[0].status, WorkCompletionStatus::Success);
    assert_eq!(
        connected.client_completion_queue.completions_generated() - before,
        1
    );
    assert_eq!(
        connected.remote.load_u64(256).expect("counter"),
        16,
        "all 16 ran"
    );
    assert_eq!(
        connected.client_queue_pair.free_send_slots(),
        connected.client_queue_pair.max_send_wr() as usize
    );
}

/// Posts `bad` followed by two valid requests, and checks the error, the flushes, the ERROR
/// state and that later posts flush too.
async fn expect_error_then_flush(
    connected: &Connected,
    bad: WorkRequest,
    expected: WorkCompletionStatus,
) {
    let good = |id| WorkRequest::read(id, connected.local_at(4096, 64), connected.remote_at(0));
    let completions = connected
        .client_queue_pair
        .execute(vec![bad, good(101).with_signaled(false), good(102)])
        .await
        .expect("post");
    assert_eq!(
        statuses(&completions),
        [
            expected,
            WorkCompletionStatus::WorkRequestFlushError,
            WorkCompletionStatus::WorkRequestFlushError
        ],
        "the bad request fails with its status and the ones behind it flush"
    );
    assert_eq!(completions[0].work_request_id, bad.id);
    assert_eq!(connected.client_queue_pair.state(), QueuePairState::Error);
    let later = connected
        .client_queue_pair
        .execute(vec![good(103)])
        .await
        .expect("post in ERROR");
    assert_eq!(
        statuses(&later),
        [WorkCompletionStatus::WorkRequestFlushError],
        "later requests flush"
    );
    assert_eq!(connected.client_queue_pair.outstanding(), 0);
}

/// A READ past the end of the region fails REM_ACCESS_ERR.
pub async fn out_of_bounds_is_remote_access_error(fabric: Backend) {
    let connected = connect(fabric).await;
    let bad = WorkRequest::read(
        7,
        connected.local_at(0, 64),
        connected.remote_at(REMOTE_SIZE - 32),
    );
    expect_error_then_flush(&connected, bad, WorkCompletionStatus::RemoteAccessError).await;
}

/// An rkey that was never issued fails REM_ACCESS_ERR.
pub async fn unknown_rkey_is_remote_access_error(fabric: Backend) {
    let connected = connect(fabric).await;
    let mut remote = connected.remote_at(0);
    remote.remote_key ^= 0x00F0_0F00;
    let bad = WorkRequest::read(7, connected.local_at(0, 64), remote);
    expect_error_then_flush(&connected, bad, WorkCompletionStatus::RemoteAccessError).await;
}

/// A WRITE into a region registered REMOTE_READ only fails REM_ACCESS_ERR.
pub async fn write_to_read_only_region_is_remote_access_error(fabric: Backend) {
    let connected = connect(fabric).await;
    let read_only = connected
        .server_domain
        .register(connected.remote.memory(), 0, 4096, AccessFlags::REMOTE_READ)
        .expect("register read-only");
    let bad = WorkRequest::write(7, connected.local_at(0, 64), read_only.remote_key().at(0));
    expect_error_then_flush(&connected, bad, WorkCompletionStatus::RemoteAccessError).await;
    assert_eq!(
        connected.remote.load_u64(0).expect("untouched"),
        0,
        "the refused WRITE changed nothing"
    );
}

/// A CAS at an address that is not 8-byte aligned fails REM_INV_REQ_ERR.
pub async fn misaligned_atomic_is_remote_invalid_request(fabric: Backend) {
    let connected = connect(fabric).await;
    let bad =
        WorkRequest::compare_and_swap(7, connected.local_at(0, 8), connected.remote_at(4), 0, 1);
    expect_error_then_flush(
        &connected,
        bad,
        WorkCompletionStatus::RemoteInvalidRequestError,
    )
    .await;
}

/// A local buffer outside any registered region fails, and nothing is sent: LOC_PROT_ERR, except
/// a WRITE source with an unknown lkey, which rxe reports as LOC_QP_OP_ERR (docs/fabric.md).
pub async fn unregistered_local_buffer_is_local_protection_error(fabric: Backend) {
    let outside = |connected: &Connected| {
        let mut local = connected.local_at(0, 64);
        local.address = connected.local.address() + LOCAL_SIZE + 4096;
        local
    };
    let connected = connect(fabric).await;
    let bad = WorkRequest::read(7, outside(&connected), connected.remote_at(0));
    expect_error_then_flush(&connected, bad, WorkCompletionStatus::LocalProtectionError).await;
    let mut unknown_key = connected.local_at(0, 64);
    unknown_key.local_key ^= 0x0F00_F000;
    let second = connect(fabric).await;
    let bad = WorkRequest::write(8, unknown_key, second.remote_at(0));
    expect_error_then_flush(
        &second,
        bad,
        WorkCompletionStatus::LocalQueuePairOperationError,
    )
    .await;
    let third = connect(fabric).await;
    let bad = WorkRequest::write(9, outside(&third), third.remote_at(0));
    expect_error_then_flush(&third, bad, WorkCompletionStatus::LocalProtectionError).await;
}

/// A deregistered region's rkey is rejected.
pub async fn deregistered_region_rkey_is_rejected(fabric: Backend) {
    let connected = connect(fabric).await;
    let extra = connected
        .server_domain
        .register(connected.remote.memory(), 0, 4096, AccessFlags::REMOTE_READ)
        .expect("register second key over the same memory");
    let key = extra.remote_key();
    assert_ne!(
        key.key,
        connected.remote.remote_key().key,
        "two registrations, two keys"
    );
    let completions = connected
        .client_queue_pair
        .execute(vec![WorkRequest::read(
            1,
            connected.local_at(0, 64),
            key.at(0),
        )])
        .await
        .expect("post");
    assert_eq!(
        statuses(&completions),
        [WorkCompletionStatus::Success],
        "valid while registered"
    );
    drop(extra);
    let completions = connected
        .client_queue_pair
        .execute(vec![WorkRequest::read(
            2,
            connected.local_at(0, 64),
            connected.remote_at(0),
        )])
        .await
        .expect("post");
    assert_eq!(
        statuses(&completions),
        [WorkCompletionStatus::Success],
        "dropping one key leaves the other"
    );
    let bad = WorkRequest::read(3, connected.local_at(0, 64), key.at(0));
    expect_error_then_flush(&connected, bad, WorkCompletionStatus::RemoteAccessError).await;
}

/// A memory window binds only on an RTS queue pair; its rkey works on that queue pair, fails on
/// another, and dies with the window.
pub async fn memory_window_is_bound_to_one_queue_pair(fabric: Backend) {
    let connected = connect(fabric).await;
    let window = connected.server_domain.allocate_memory_window();
    let unconnected = connected
        .server_domain
        .create_queue_pair(
            &connected.server_completion_queue,
            QueuePairConfig::default(),
        )
        .expect("create");
    unconnected.modify_to_init().expect("init");
    assert!(
        unconnected
            .bind_memory_window(
                &window,
                &connected.remote,
                connected.remote.address(),
                4096,
                AccessFlags::REMOTE_READ,
            )
            .is_err(),
        "a bind before RTS is refused"
    );
    drop(unconnected);
    let window_key = connected
        .server_queue_pair
        .bind_memory_window(
            &window,
            &connected.remote,
            connected.remote.address() + 4096,
            4096,
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
        )
        .expect("bind");
    let completions = connected
        .client_queue_pair
        .execute(vec![WorkRequest::read(
            1,
            connected.local_at(0, 64),
            window_key.at(0),
        )])
        .await
        .expect("post");
    assert_eq!(
        statuses(&completions),
        [WorkCompletionStatus::Success],
        "valid on its own queue pair"
    );

    let (_other_server, other_client) = connected.another_pair().await;
    let completions = other_client
        .execute(vec![WorkRequest::read(
            2,
            connected.local_at(0, 64),
            window_key.at(0),
        )])
        .await
        .expect("post");
    assert_eq!(
        statuses(&completions),
        [WorkCompletionStatus::RemoteAccessError],
        "a window bound to queue pair 1 is refused on queue pair 2"
    );

    let no_write = WorkRequest::write(3, connected.local_at(0, 64), window_key.at(0));
    let completions = connected
        .client_queue_pair
        .execute(vec![no_write])
        .await
        .expect("post");
    assert_eq!(
        statuses(&completions),
        [WorkCompletionStatus::RemoteAccessError],
        "the window grants only the rights it was bound with"
    );
}

/// A deallocated memory window's rkey is rejected.
pub async fn deallocated_window_rkey_is_rejected(fabric: Backend) {
    let connected = connect(fabric).await;
    let window = connected.server_domain.allocate_memory_window();
    let window_key = connected
        .server_queue_pair
        .bind_memory_window(
            &window,
            &connected.remote,
            connected.remote.address(),
            4096,
            AccessFlags::REMOTE_READ,
        )
        .expect("bind");
    let completions = connected
        .client_queue_pair
        .execute(vec![WorkRequest::read(
            1,
            connected.local_at(0, 64),
            window_key.at(0),
        )])
        .await
        .expect("post");
    assert_eq!(statuses(&completions), [WorkCompletionStatus::Success]);
    drop(window);
    let bad = WorkRequest::read(2, connected.local_at(0, 64), window_key.at(0));
    expect_error_then_flush(&connected, bad, WorkCompletionStatus::RemoteAccessError).await;
}

/// When the responder's queue pair is destroyed, the requester notices only when it next sends,
/// as a real NIC does: that request completes RETRY_EXC_ERR (verbs: after the NIC's retries,
/// about `retry_timeout`), the rest flush, and the queue pair is in ERROR. On `soft` the
/// destroyed queue pair's stop frame says that nothing more runs there, so the requester moves
/// to ERROR at once and both requests complete NOT_EXECUTED (a peer that vanishes without a
/// stop frame still gives RETRY_EXC_ERR: `soft_failures.rs`).
pub async fn vanished_peer_is_retry_exceeded(fabric: Backend) {
    let config = DeviceConfig {
        retry_timeout: std::time::Duration::from_millis(300),
        ..DeviceConfig::default()
    };
    let Connected {
        server_queue_pair,
        client_queue_pair,
        local,
        remote,
        ..
    } = connect_with(fabric, config, QueuePairConfig::default()).await;
    let read = |id| WorkRequest::read(id, local.segment(0, 64), remote.remote_key().at(0));
    let completions = client_queue_pair
        .execute(vec![read(1)])
        .await
        .expect("post");
    assert_eq!(statuses(&completions), [WorkCompletionStatus::Success]);
    drop(server_queue_pair);
    // Not a readiness wait: it lets a soft NIC see the closed connection while nothing is
    // outstanding, the case where soft used to differ from verbs (it went to ERROR at once, so
    // the next requests flushed instead of reporting the vanished peer).
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    let posted = client_queue_pair
        .post(vec![read(2), read(3)])
        .await
        .expect("post");
    let Ok(completions) = tokio::time::timeout(std::time::Duration::from_secs(20), posted).await
    else {
        panic!(
            "no completion within 20 s: queue pair {:?}, {} outstanding",
            client_queue_pair.state(),
            client_queue_pair.outstanding()
        );
    };
    if fabric == Backend::Soft {
        assert_eq!(
            statuses(&completions),
            [
                WorkCompletionStatus::NotExecuted,
                WorkCompletionStatus::NotExecuted
            ],
            "after the peer's stop frame, nothing runs"
        );
    } else {
        assert_eq!(
            statuses(&completions),
            [
                WorkCompletionStatus::RetryExceededError,
                WorkCompletionStatus::WorkRequestFlushError
            ],
            "the oldest request is unanswered, the rest flush"
        );
    }
    assert!(
        started.elapsed() < std::time::Duration::from_secs(30),
        "bounded by the retry timeout ({:?})",
        started.elapsed()
    );
    assert_eq!(client_queue_pair.state(), QueuePairState::Error);
}

/// A post whose future is dropped after its first poll (soft and verbs queue the list and yield
/// before ringing the doorbell) still reaches the NIC: the WRITE lands, and its completion goes
/// to the completion queue's backlog, as a verbs CQ would hold it.
pub async fn a_post_dropped_before_its_doorbell_still_runs(fabric: Backend) {
    let connected = connect(fabric).await;
    let data = pattern(64, 77);
    connected.local.write(0, &data).expect("fill local");
    let mut post = Box::pin(connected.client_queue_pair.post(vec![WorkRequest::write(
        41,
        connected.local_at(0, 64),
        connected.remote_at(512),
    )]));
    tokio::select! {
        biased;
        posted = &mut post => drop(posted.expect("post")),
        () = std::future::ready(()) => {}
    }
    drop(post);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut backlog = Vec::new();
    while backlog.is_empty() && std::time::Instant::now() < deadline {
        backlog = connected.client_completion_queue.poll(8);
        tokio::task::yield_now().await;
    }
    assert_eq!(
        backlog
            .iter()
            .map(|completion| (completion.work_request_id, completion.status))
            .collect::<Vec<_>>(),
        [(41, WorkCompletionStatus::Success)],
        "the dropped post's completion is in the backlog"
    );
    let mut on_server = vec![0u8; 64];
    connected.remote.read(512, &mut on_server).expect("read");
    assert_eq!(on_server, data, "the WRITE landed");
    assert_eq!(connected.client_queue_pair.outstanding(), 0);
}

/// Moving a queue pair to ERROR with requests in flight completes every one of them exactly
/// once, as success (already answered) or WR_FLUSH_ERR, and nothing stays outstanding.
pub async fn error_with_requests_in_flight_flushes_them(fabric: Backend) {
    let connected = connect(fabric).await;
    let mut lists = Vec::new();
    for list_index in 0..8u64 {
        let list: Vec<WorkRequest> = (0..16u64)
            .map(|index| {
                let id = list_index * 16 + index;
                WorkRequest::read(
                    id,
                    connected.local_at((index % 8) * 65536, 65536),
                    connected.remote_at(0),
                )
            })
            .collect();
        lists.push(connected.client_queue_pair.post(list).await.expect("post"));
    }
    connected.client_queue_pair.modify_to_error();
    let mut seen = std::collections::BTreeSet::new();
    let mut flushed = 0;
    for list in lists {
        for completion in list.await {
            assert!(
                seen.insert(completion.work_request_id),
                "one completion per request"
            );
            match completion.status {
                WorkCompletionStatus::Success => {}
                WorkCompletionStatus::WorkRequestFlushError => flushed += 1,
                other => panic!("unexpected status {other}"),
            }
        }
    }
    assert_eq!(seen.len(), 128, "every request completed");
    assert_eq!(connected.client_queue_pair.outstanding(), 0);
    connected.client_queue_pair.drain();
    if fabric == Backend::Soft {
        assert!(
            flushed > 0,
            "8 MiB of READs cannot all be answered before the flush"
        );
    }
}

/// 8 requesters × 10,000 FETCH_ADDs on one counter end at exactly 80,000.
pub async fn concurrent_fetch_add_is_exact(fabric: Backend) {
    let connected = Arc::new(connect(fabric).await);
    let mut tasks = Vec::new();
    for requester in 0..8u64 {
        let connected = connected.clone();
        tasks.push(tokio::spawn(async move {
            let (_server, client) = connected.another_pair().await;
            let base = requester * 4096;
            for round in 0..(10_000 / 16) {
                let list: Vec<WorkRequest> = (0..16u64)
                    .map(|index| {
                        WorkRequest::fetch_and_add(
                            round * 16 + index,
                            connected.local_at(base + index * 8, 8),
                            connected.remote_at(512),
                            1,
                        )
                        .with_signaled(index == 15)
                    })
                    .collect();
                let completions = client.execute(list).await.expect("post");
                assert_eq!(statuses(&completions), [WorkCompletionStatus::Success]);
            }
        }));
    }
    for task in tasks {
        task.await.expect("requester");
    }
    assert_eq!(connected.remote.load_u64(512).expect("counter"), 80_000);
}

/// Concurrent CAS increments (read, CAS, retry on a lost race) are exact.
pub async fn concurrent_compare_and_swap_increments_are_exact(fabric: Backend) {
    let connected = Arc::new(connect(fabric).await);
    let mut tasks = Vec::new();
    for requester in 0..4u64 {
        let connected = connected.clone();
        tasks.push(tokio::spawn(async move {
            let (_server, client) = connected.another_pair().await;
            let slot = connected.local_at(requester * 4096, 8);
            let mut guess = 0u64;
            let mut done = 0;
            let mut id = 0;
            while done < 500 {
                id += 1;
                let completions = client
                    .execute(vec![WorkRequest::compare_and_swap(
                        id,
                        slot,
                        connected.remote_at(1024),
                        guess,
                        guess + 1,
                    )])
                    .await
                    .expect("post");
                assert_eq!(statuses(&completions), [WorkCompletionStatus::Success]);
                let original = connected
                    .local
                    .load_u64(requester * 4096)
                    .expect("original");
                if original == guess {
                    done += 1;
                    guess += 1;
                } else {
                    guess = original;
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("requester");
    }
    assert_eq!(connected.remote.load_u64(1024).expect("counter"), 2_000);
}

/// READs racing CASes on one word never see a torn value — on soft and loopback, whose engine
/// copies with aligned 8-byte atomics. Verbs makes no such promise (the IB spec gives none, and
/// rxe copies READ data with `memcpy`: in the TCG guest it was seen to tear), so on verbs the
/// torn reads are counted and reported, not failed; rdkv's store does not rely on the property
/// (a slot whose block belongs elsewhere is re-read, docs/protocol.md).
pub async fn reads_racing_compare_and_swap_never_tear(fabric: Backend) {
    let connected = Arc::new(connect(fabric).await);
    let word_offset = 2048u64;
    let writer = {
        let connected = connected.clone();
        tokio::spawn(async move {
            let (_server, client) = connected.another_pair().await;
            let mut current = 0u64;
            for round in 1..=2_000u64 {
                let next = u64::from_le_bytes([(round % 251) as u8 + 1; 8]);
                let completions = client
                    .execute(vec![WorkRequest::compare_and_swap(
                        round,
                        connected.local_at(8192, 8),
                        connected.remote_at(word_offset),
                        current,
                        next,
                    )])
                    .await
                    .expect("post");
                assert_eq!(statuses(&completions), [WorkCompletionStatus::Success]);
                current = next;
            }
        })
    };
    let reader = {
        let connected = connected.clone();
        tokio::spawn(async move {
            let (_server, client) = connected.another_pair().await;
            let mut torn = 0u32;
            for round in 0..2_000u64 {
                let completions = client
                    .execute(vec![WorkRequest::read(
                        round,
                        connected.local_at(16384, 64),
                        connected.remote_at(word_offset - 24),
                    )])
                    .await
                    .expect("post");
                assert_eq!(statuses(&completions), [WorkCompletionStatus::Success]);
                let mut bytes = [0u8; 8];
                connected.local.read(16384 + 24, &mut bytes).expect("local");
                if bytes.iter().any(|byte| *byte != bytes[0]) {
                    assert_eq!(fabric, Backend::Verbs, "torn word {bytes:?}");
                    torn += 1;
                }
            }
            if torn > 0 {
                eprintln!("verbs: {torn} of 2,000 READs racing CAS returned a torn word");
            }
        })
    };
    writer.await.expect("writer");
    reader.await.expect("reader");
}

/// A list longer than max_send_wr is refused, and outstanding requests never exceed it.
pub async fn send_queue_depth_is_enforced(fabric: Backend) {
    let config = QueuePairConfig { max_send_wr: 4 };
    let connected = connect_with(fabric, DeviceConfig::default(), config).await;
    let read = |id| WorkRequest::read(id, connected.local_at(0, 64), connected.remote_at(0));
    let error = connected
        .client_queue_pair
        .post((0..5).map(read).collect())
        .await
        .expect_err("5 > max_send_wr 4");
    assert!(error.to_string().contains("max_send_wr = 4"), "{error}");
    let mut lists = Vec::new();
    for round in 0..50u64 {
        lists.push(
            connected
                .client_queue_pair
                .post(vec![
                    read(round * 2).with_signaled(false),
                    read(round * 2 + 1),
                ])
                .await
                .expect("post"),
        );
        assert!(connected.client_queue_pair.outstanding() <= 4);
    }
    for list in lists {
        assert_eq!(statuses(&list.await), [WorkCompletionStatus::Success]);
    }
}

/// Longer than `max_message_size`: the requester refuses it LOC_LEN_ERR before it leaves, and
/// a responder whose limit is below its requester's (a peer that ignores its own) answers
/// REM_INV_REQ_ERR, as rxe NAKs a length it cannot accept, with no data read or written.
/// Emulated providers only (`docs/fabric.md`, *Conformance*): on verbs both limits are the NIC
/// port's `max_msg_sz`, which `DeviceConfig` cannot lower.
pub async fn a_message_longer_than_the_limit_is_refused(fabric: Backend) {
    let connected = connect(fabric).await;
    let too_long = WorkRequest::read(
        7,
        connected.local_at(0, (MIB + 4096) as u32),
        connected.remote_at(0),
    );
    expect_error_then_flush(&connected, too_long, WorkCompletionStatus::LocalLengthError).await;

    let small = DeviceConfig {
        max_message_size: 4096,
        ..DeviceConfig::default()
    };
    let connected = connect_devices(
        devices_configured(fabric, small, DeviceConfig::default()),
        QueuePairConfig::default(),
    )
    .await;
    connected
        .remote
        .memory()
        .write_from(0, &pattern(8192, 3))
        .expect("fill remote");
    connected
        .local
        .memory()
        .write_from(0, &[0u8; 8192])
        .expect("clear local");
    let read = WorkRequest::read(8, connected.local_at(0, 8192), connected.remote_at(0));
    let completions = connected
        .client_queue_pair
        .execute(vec![read])
        .await
        .expect("post");
    assert_eq!(
        statuses(&completions),
        [WorkCompletionStatus::RemoteInvalidRequestError],
        "an 8 KiB READ from a responder whose limit is 4 KiB"
    );
    let mut landed = vec![0u8; 8192];
    connected
        .local
        .memory()
        .read_into(0, &mut landed)
        .expect("read local");
    assert!(landed.iter().all(|byte| *byte == 0), "no data was sent");

    let (_server, client) = connected.another_pair().await;
    connected
        .local
        .memory()
        .write_from(0, &pattern(8192, 9))
        .expect("fill local");
    let write = WorkRequest::write(9, connected.local_at(0, 8192), connected.remote_at(0));
    let completions = client.execute(vec![write]).await.expect("post");
    assert_eq!(
        statuses(&completions),
        [WorkCompletionStatus::RemoteInvalidRequestError],
        "an 8 KiB WRITE to a responder whose limit is 4 KiB"
    );
    let mut remote = vec![0u8; 8192];
    connected
        .remote
        .memory()
        .read_into(0, &mut remote)
        .expect("read remote");
    assert_eq!(remote, pattern(8192, 3), "nothing was written");
}

/// Emulated providers: a responder moved to ERROR (a server's fence) answers every request it
/// ran and reports the rest NOT_EXECUTED, which had no effect: pipelined FETCH_ADDs of 1 raise
/// a counter by at least the number that succeeded and at most that plus the ones left unknown
/// (RETRY_EXC_ERR, WR_FLUSH_ERR). A request posted after the responder stopped runs nowhere:
/// on `shm` and `loopback`, which run requests inside the post, it completes NOT_EXECUTED.
pub async fn a_stopped_responder_reports_what_it_did_not_run(fabric: Backend) {
    let connected = connect(fabric).await;
    let add = |id: u64| {
        WorkRequest::fetch_and_add(
            id,
            connected.local_at((id % 64) * 8, 8),
            connected.remote_at(256),
            1,
        )
    };
    let mut lists = Vec::new();
    for list_index in 0..8u64 {
        let list: Vec<WorkRequest> = (0..16u64)
            .map(|index| add(list_index * 16 + index))
            .collect();
        lists.push(connected.client_queue_pair.post(list).await.expect("post"));
    }
    connected.server_queue_pair.modify_to_error();
    let late = connected.client_queue_pair.post(vec![add(1_000)]).await;
    let mut completions = Vec::new();
    for list in lists {
        completions.extend(list.await);
    }
    let late = match late {
        Ok(posted) => posted.await,
        Err(_) => rdkv_fabric::Completions::new(),
    };
    let count = |wanted: &[WorkCompletionStatus]| {
        completions
            .iter()
            .chain(&late)
            .filter(|completion| wanted.contains(&completion.status))
            .count() as u64
    };
    let succeeded = count(&[WorkCompletionStatus::Success]);
    let unknown = count(&[
        WorkCompletionStatus::RetryExceededError,
        WorkCompletionStatus::WorkRequestFlushError,
    ]);
    let not_executed = count(&[WorkCompletionStatus::NotExecuted]);
    assert_eq!(
        succeeded + unknown + not_executed,
        completions.len() as u64 + late.len() as u64,
        "no other status: {:?}",
        statuses(&completions)
    );
    let counter = connected.remote.load_u64(256).expect("counter");
    assert!(
        (succeeded..=succeeded + unknown).contains(&counter),
        "counter {counter}: {succeeded} succeeded, {unknown} unknown, {not_executed} not executed"
    );
    if fabric != Backend::Soft {
        assert_eq!(
            statuses(&late),
            [WorkCompletionStatus::NotExecuted],
            "a request posted after the responder stopped"
        );
    }
    // Once the requester knows the responder stopped (its queue pair moved to ERROR with it;
    // on `soft`, at the stop frame, even with nothing outstanding then), every later request
    // completes NOT_EXECUTED: it certainly did not run (it used to be RETRY_EXC_ERR on `soft`).
    let known = async {
        while connected.client_queue_pair.state() != QueuePairState::Error {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), known)
        .await
        .expect("the requester learns that the responder stopped");
    let later = match connected.client_queue_pair.post(vec![add(2_000)]).await {
        Ok(posted) => posted.await,
        Err(error) => panic!("post after the stop: {error}"),
    };
    // A requester that gave up on its own first (RETRY_EXC_ERR: its retry timeout passed
    // before the stop frame came, as on a loaded machine) is in ERROR for its own reason, and
    // flushes later requests, as verbs does.
    let gave_up_first = completions
        .iter()
        .any(|completion| completion.status == WorkCompletionStatus::RetryExceededError);
    let expected: &[WorkCompletionStatus] = if gave_up_first {
        &[
            WorkCompletionStatus::NotExecuted,
            WorkCompletionStatus::WorkRequestFlushError,
        ]
    } else {
        &[WorkCompletionStatus::NotExecuted]
    };
    assert!(
        later.len() == 1 && expected.contains(&later[0].status),
        "a request posted after the requester learned that the responder stopped: {:?} ({:?} before)",
        statuses(&later),
        statuses(&completions)
    );
    assert_eq!(
        connected.remote.load_u64(256).expect("counter"),
        counter,
        "it did not run"
    );
}

/// `post_inline` runs a list inside the call only where the provider completes inside a post
/// (`shm` always does while the queue pair is idle), with the outcome the posted list would
/// have had: data in place, a CAS's original in the local buffer, and a failure that names
/// its request and moves the queue pair to ERROR, after which later lists flush. (Every other
/// check runs through `execute`, which takes the same path where it can.)
pub async fn a_list_runs_inside_its_post_only_where_the_provider_completes_there(fabric: Backend) {
    let connected = connect(fabric).await;
    let queue_pair = &connected.client_queue_pair;
    let data = pattern(64, 9);
    connected.local.write(0, &data).expect("fill");
    let write = [WorkRequest::write(
        1,
        connected.local_at(0, 64),
        connected.remote_at(128),
    )];
    let outcome = queue_pair.post_inline(&write);
    if !connected.server_device.capabilities().completes_inside_post {
        assert!(
            outcome.is_none(),
            "{fabric:?} cannot run a list inside a post"
        );
        return;
    }
    let Some(outcome) = outcome else {
        assert_ne!(
            fabric,
            Backend::Shm,
            "an idle shm queue pair runs the list inline"
        );
        return;
    };
    assert_eq!(outcome.expect("a valid list"), Ok(()));
    let mut on_server = vec![0u8; 64];
    connected.remote.read(128, &mut on_server).expect("server");
    assert_eq!(on_server, data);

    let read_and_swap = [
        WorkRequest::read(2, connected.local_at(4096, 64), connected.remote_at(128))
            .with_signaled(false),
        WorkRequest::compare_and_swap(3, connected.local_at(8192, 8), connected.remote_at(0), 0, 7),
    ];
    let outcome = queue_pair
        .post_inline(&read_and_swap)
        .expect("idle: inline");
    assert_eq!(outcome.expect("a valid list"), Ok(()));
    let mut read_back = vec![0u8; 64];
    connected.local.read(4096, &mut read_back).expect("local");
    assert_eq!(read_back, data);
    assert_eq!(connected.local.load_u64(8192).expect("original"), 0);
    assert_eq!(connected.remote.load_u64(0).expect("swapped"), 7);

    let mut unknown = connected.remote_at(0);
    unknown.remote_key ^= 0x00F0_0F00;
    let failing = [
        WorkRequest::read(4, connected.local_at(0, 8), connected.remote_at(0)).with_signaled(false),
        WorkRequest::read(5, connected.local_at(0, 8), unknown),
        WorkRequest::read(6, connected.local_at(0, 8), connected.remote_at(0)),
    ];
    let failure = queue_pair
        .post_inline(&failing)
        .expect("idle: inline")
        .expect("a valid list")
        .expect_err("an unknown rkey fails");
    assert_eq!(failure.index, 1);
    assert_eq!(failure.completion.work_request_id, 5);
    assert_eq!(
        failure.completion.status,
        WorkCompletionStatus::RemoteAccessError
    );
    assert_eq!(queue_pair.state(), QueuePairState::Error);
    assert!(
        queue_pair.post_inline(&write).is_none(),
        "in ERROR, a list goes the ordinary way"
    );
    let later = queue_pair
        .execute(write.to_vec())
        .await
        .expect("post in ERROR");
    assert_eq!(
        statuses(&later),
        [WorkCompletionStatus::WorkRequestFlushError]
    );
    let empty = queue_pair.post_inline(&[]).expect("refused at once");
    assert!(empty.is_err(), "an empty list is refused, as by post");
}

/// Direct access (`QueuePair::direct`) runs only where the provider's requester shares the
/// responder's memory (`shm`), with a request's checks and outcomes: data in place both ways,
/// a revoked key refused even after it was used (the requester keeps resolved keys only while
/// no key is revoked), a range outside the key refused, a failure moving the queue pair to
/// ERROR, and every later access of the same call flushed.
pub async fn direct_access_runs_only_where_memory_is_shared(fabric: Backend) {
    let connected = connect(fabric).await;
    let queue_pair = &connected.client_queue_pair;
    let data = pattern(64, 11);
    let written = queue_pair.direct(|access| access.write(connected.remote_at(128), &data));
    if !connected.server_device.capabilities().shares_memory {
        assert!(written.is_none(), "{fabric:?} does not share its memory");
        return;
    }
    assert_eq!(written, Some(Ok(())), "an idle shm queue pair runs it");
    let mut on_server = vec![0u8; 64];
    connected.remote.read(128, &mut on_server).expect("server");
    assert_eq!(on_server, data);
    let read_back = queue_pair
        .direct(|access| {
            let mut into = vec![0u8; 64];
            access.read(connected.remote_at(128), &mut into)?;
            let copied = access.read_to_vec(connected.remote_at(128), 64)?;
            access.confirm()?;
            Ok::<_, WorkCompletionStatus>((into, copied))
        })
        .expect("idle: direct")
        .expect("both READs");
    assert_eq!(read_back, (data.clone(), data.clone()));

    let extra = connected
        .server_domain
        .register(connected.remote.memory(), 0, 4096, AccessFlags::REMOTE_READ)
        .expect("register a second key over the same memory");
    let key = extra.remote_key();
    let mut word = [0u8; 8];
    let valid = queue_pair.direct(|access| access.read(key.at(128), &mut word));
    assert_eq!(valid, Some(Ok(())), "valid while registered");
    let refused = queue_pair.direct(|access| access.write(key.at(128), &data));
    assert_eq!(
        refused,
        Some(Err(WorkCompletionStatus::RemoteAccessError)),
        "a READ-only key refuses a WRITE"
    );
    assert_eq!(queue_pair.state(), QueuePairState::Error);
    assert!(
        queue_pair.direct(|_| ()).is_none(),
        "in ERROR, nothing runs directly"
    );

    let (_server, client) = connected.another_pair().await;
    let valid = client.direct(|access| access.read(key.at(0), &mut word));
    assert_eq!(valid, Some(Ok(())), "resolved once more on a new pair");
    drop(extra);
    let outcomes = client
        .direct(|access| {
            let revoked = access.read(key.at(0), &mut word);
            let after = access.read(connected.remote_at(0), &mut word);
            (revoked, after)
        })
        .expect("RTS until the revoked key fails");
    assert_eq!(
        outcomes,
        (
            Err(WorkCompletionStatus::RemoteAccessError),
            Err(WorkCompletionStatus::WorkRequestFlushError)
        ),
        "a revoked key fails and the rest of the call flushes"
    );
    assert_eq!(client.state(), QueuePairState::Error);

    let (_server, client) = connected.another_pair().await;
    let outside =
        client.direct(|access| access.read(connected.remote_at(REMOTE_SIZE - 4), &mut word));
    assert_eq!(
        outside,
        Some(Err(WorkCompletionStatus::RemoteAccessError)),
        "a range that leaves the key"
    );
}
