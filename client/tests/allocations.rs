//! Heap allocations on the steady GET path: a GET done by direct access over `shm`
//! (`docs/protocol.md`, *Direct GETs*) into a caller's vector with the room allocates nothing.
//!
//! A counting global allocator counts, per thread, the allocations made while the thread's
//! counting flag is up. The client runs alone on a thread of its own with a current-thread
//! runtime (the node runs on the test's runtime, on other threads), so what is counted is the
//! client's work and its own background tasks, never the node's.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Duration;

use rdkv_client::{Client, ClientConfig, SharedMemory};
use rdkv_fabric::Backend;
use rdkv_server::ServerConfig;

const SECRET: &[u8] = b"allocations-test-secret";

/// GETs counted.
const COUNTED_GETS: u64 = 1_000;

/// The system allocator, counting the allocations of a thread while its flag is up.
struct Counting;

thread_local! {
    /// Whether this thread's allocations are counted.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    /// This thread's allocations while counting.
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

/// Counts an allocation of the calling thread, if it counts. `try_with`: a thread being torn
/// down has no locals left, and allocates uncounted.
fn count_allocation() {
    let _ = COUNTING.try_with(|counting| {
        if counting.get() {
            let _ = ALLOCATIONS.try_with(|allocations| allocations.set(allocations.get() + 1));
        }
    });
}

// SAFETY: every method forwards to the system allocator with the caller's arguments; the
// counting touches only const-initialized thread locals, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_allocation();
        // SAFETY: the caller's contract for `alloc` is the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count_allocation();
        // SAFETY: as `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_allocation();
        // SAFETY: `pointer` and `layout` came from this allocator, which is the system's.
        unsafe { System.realloc(pointer, layout, new_size) }
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        // SAFETY: `pointer` and `layout` came from this allocator, which is the system's.
        unsafe { System.dealloc(pointer, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Starts counting this thread's allocations from zero.
fn start_counting() {
    ALLOCATIONS.with(|allocations| allocations.set(0));
    COUNTING.with(|counting| counting.set(true));
}

/// Stops counting: this thread's allocations since [`start_counting`].
fn stop_counting() -> u64 {
    COUNTING.with(|counting| counting.set(false));
    ALLOCATIONS.with(Cell::get)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_get_into_a_vector_with_room_allocates_nothing() {
    let mut config = ServerConfig::local(SECRET);
    config.fabric = Backend::Soft;
    let socket = std::env::temp_dir().join(format!("rdkv-allocations-{}.sock", std::process::id()));
    config.shm_socket = Some(socket);
    let server = rdkv_server::start(config).await.expect("start server");
    let address = server.control_address();
    let client_thread = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("client runtime");
        runtime.block_on(async move {
            let mut config = ClientConfig::new(address, Backend::Soft, SECRET);
            config.node.shared_memory = SharedMemory::Require;
            config.lanes = Some(1);
            let client = Client::connect(config).await.expect("connect");
            let value = vec![b'v'; 1_000];
            client.put(b"steady", &value).await.expect("put");
            let mut into = Vec::with_capacity(value.len());
            // Warm: the first GET reads the buckets and teaches the slot cache; the later ones
            // are direct. Then the announce flusher of the warm-up's posted lists settles.
            for _ in 0..16 {
                assert!(client.get_into(b"steady", &mut into).await.expect("get"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            let before = client.counters().direct_gets;
            let mut present = 0u64;
            // Counted while awaited on this thread: the loop's yields (one every few direct
            // GETs) find nothing else ready, and come straight back.
            start_counting();
            for _ in 0..COUNTED_GETS {
                if client.get_into(b"steady", &mut into).await.expect("get") {
                    present += 1;
                }
            }
            let allocations = stop_counting();
            let direct = client.counters().direct_gets - before;
            assert_eq!(present, COUNTED_GETS);
            assert_eq!(into, value);
            client.close().await;
            (direct, allocations)
        })
    });
    let (direct, allocations) = client_thread.join().expect("client thread");
    assert_eq!(
        direct, COUNTED_GETS,
        "every counted GET was direct (else the count says nothing)"
    );
    assert_eq!(
        allocations, 0,
        "{allocations} allocations in {COUNTED_GETS} direct GETs into a vector with room"
    );
    server.shutdown().await;
}
