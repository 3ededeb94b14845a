//! Attacks on direct access (`QueuePair::direct`, `shm`): what it must keep of a request's
//! outcomes.

#[allow(dead_code, unused_imports, missing_docs)]
#[path = "conformance/checks.rs"]
mod checks;

use rdkv_fabric::{Backend, QueuePairState, WorkCompletionStatus, WorkRequest};

/// A connected `shm` pair whose responder waits at most 200 ms for a requester stopped inside
/// a request (`retry_timeout`).
async fn shm_with_a_short_retry_timeout() -> checks::Connected {
    let config = rdkv_fabric::DeviceConfig {
        retry_timeout: std::time::Duration::from_millis(200),
        ..rdkv_fabric::DeviceConfig::default()
    };
    checks::connect_with(
        Backend::Shm,
        config,
        rdkv_fabric::QueuePairConfig::default(),
    )
    .await
}

/// A WRITE window over the responder's first 4 KiB, bound to its queue pair.
fn write_window(
    connected: &checks::Connected,
) -> (rdkv_fabric::MemoryWindow, rdkv_fabric::RemoteKey) {
    let window = connected.server_domain.allocate_memory_window();
    let key = connected
        .server_queue_pair
        .bind_memory_window(
            &window,
            &connected.remote,
            connected.remote.address(),
            4096,
            rdkv_fabric::AccessFlags::REMOTE_WRITE,
        )
        .expect("bind");
    (window, key)
}

/// A responder stopped (its queue pair moved to ERROR) between two direct calls. The first
/// call resolved the key; the second finds the responder stopped when it enters its epoch.
/// `docs/fabric.md` (and `fabric/src/direct.rs`) promise the same outcome as a list run inside
/// its post: the stop recorded, `NotExecuted` (nothing ran). A direct access whose key was
/// cached once got RETRY_EXC_ERR (it "may have run") and moved the requester to ERROR as if by
/// its own failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_access_after_the_responder_stopped_reports_not_executed() {
    // Reference: the list path.
    let listed = checks::connect(Backend::Shm).await;
    let mut word = [0u8; 8];
    let warm = listed
        .client_queue_pair
        .post_inline(&[WorkRequest::read(
            1,
            listed.local_at(0, 8),
            listed.remote_at(0),
        )])
        .expect("idle: inline")
        .expect("a valid list");
    assert!(warm.is_ok(), "a READ before the stop");
    listed.server_queue_pair.modify_to_error();
    let after = listed
        .client_queue_pair
        .post_inline(&[WorkRequest::read(
            2,
            listed.local_at(0, 8),
            listed.remote_at(0),
        )])
        .expect("idle: inline")
        .expect("a valid list")
        .expect_err("the responder stopped");
    assert_eq!(after.completion.status, WorkCompletionStatus::NotExecuted);

    // Direct access, with the key resolved by a first call.
    let connected = checks::connect(Backend::Shm).await;
    let first = connected
        .client_queue_pair
        .direct(|access| access.read(connected.remote_at(0), &mut word));
    assert_eq!(first, Some(Ok(())), "a READ before the stop");
    connected.server_queue_pair.modify_to_error();
    let second = connected
        .client_queue_pair
        .direct(|access| access.read(connected.remote_at(0), &mut word));
    assert_eq!(connected.client_queue_pair.state(), QueuePairState::Error);
    assert_eq!(
        second,
        Some(Err(WorkCompletionStatus::NotExecuted)),
        "a direct access behind a stopped responder did not run (as the list's)"
    );
}

/// The same, with a key the call resolves for the first time: the ordinary resolution path
/// reports the stop (this one holds; it shows that only the cached key differs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_direct_access_after_the_responder_stopped_reports_not_executed() {
    let connected = checks::connect(Backend::Shm).await;
    let mut word = [0u8; 8];
    connected.server_queue_pair.modify_to_error();
    let outcome = connected
        .client_queue_pair
        .direct(|access| access.read(connected.remote_at(0), &mut word));
    assert_eq!(outcome, Some(Err(WorkCompletionStatus::NotExecuted)));
}

/// A direct call's epoch spans the caller's own code (`work` runs between the accesses), so a
/// requester that is slow inside it (descheduled, stopped, paging) outlives the responder's
/// bounded wait for it (`retry_timeout`): the revocation goes on ("an shm requester stayed
/// inside a request past the retry timeout"), the responder may free or reuse the memory, and
/// the rest of the call still uses the revoked key from the requester's cache without
/// looking at the key state. A list cannot do this (no caller code runs inside its epoch).
///
/// Expected (`docs/fabric.md`: "a revoked key is refused at its next access"): the WRITE
/// after the revocation returned is refused (it landed before direct access read the key
/// generation again at every access).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_revoked_while_a_direct_call_stalls_is_refused_at_its_next_access() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    let connected = std::sync::Arc::new(shm_with_a_short_retry_timeout().await);
    let extra = connected
        .server_domain
        .register(
            connected.remote.memory(),
            0,
            4096,
            rdkv_fabric::AccessFlags::REMOTE_READ | rdkv_fabric::AccessFlags::REMOTE_WRITE,
        )
        .expect("register a second key");
    let key = extra.remote_key();
    let inside = Arc::new(AtomicBool::new(false));
    let revoked = Arc::new(AtomicBool::new(false));
    let requester = {
        let connected = connected.clone();
        let (inside, revoked) = (inside.clone(), revoked.clone());
        std::thread::spawn(move || {
            connected
                .client_queue_pair
                .direct(|access| {
                    access.write(key.at(0), &[1u8; 8])?;
                    inside.store(true, Ordering::Release);
                    // The caller's code, slow (a stand-in for a preempted or stopped thread).
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while !revoked.load(Ordering::Acquire) && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    access.write(key.at(8), &[2u8; 8])
                })
                .expect("idle: direct")
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !inside.load(Ordering::Acquire) {
        assert!(Instant::now() < deadline, "the direct call never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    let started = Instant::now();
    // Deregisters: revokes in the shared key state, waits for the requester at most
    // `retry_timeout`, gives up, and returns; the memory is the responder's again.
    drop(extra);
    let waited = started.elapsed();
    revoked.store(true, Ordering::Release);
    let outcome = requester.join().expect("the requester thread");
    let word = connected
        .remote
        .load_u64(8)
        .expect("read the responder's memory");
    assert_eq!(
        (outcome, word),
        (
            Err(WorkCompletionStatus::RemoteAccessError),
            0
        ),
        "a WRITE by a key whose revocation returned {waited:?} before ran on the responder's memory"
    );
}

/// A window revoked while its requester is stopped inside a request (`shm`: a client process
/// stopped mid-WRITE, here a direct call stalled between two accesses) cannot promise that
/// the request is over: `invalidate` returns once its bounded wait passed, with the requester
/// still inside ([`rdkv_fabric::RequesterInside`]), so that the responder keeps the memory
/// until it has left. Before, the revocation only logged a warning, and the server's heap
/// reused a stopped client's sealed grant while a WRITE of it could still land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_revoked_under_a_stopped_requester_says_it_is_still_inside() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    let connected = std::sync::Arc::new(shm_with_a_short_retry_timeout().await);
    let (window, key) = write_window(&connected);
    // Nobody inside: the revocation is clean.
    let (idle, _) = write_window(&connected);
    assert!(idle.invalidate().is_none(), "no requester inside");

    let inside = Arc::new(AtomicBool::new(false));
    let resume = Arc::new(AtomicBool::new(false));
    let requester = {
        let connected = connected.clone();
        let (inside, resume) = (inside.clone(), resume.clone());
        std::thread::spawn(move || {
            connected
                .client_queue_pair
                .direct(|access| {
                    access.write(key.at(0), &[1u8; 8])?;
                    inside.store(true, Ordering::Release);
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while !resume.load(Ordering::Acquire) && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Ok::<(), WorkCompletionStatus>(())
                })
                .expect("idle: direct")
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !inside.load(Ordering::Acquire) {
        assert!(Instant::now() < deadline, "the direct call never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    let still_inside = window
        .invalidate()
        .expect("the requester stayed inside past the retry timeout: the revocation says so");
    assert!(!still_inside.left(), "still stalled inside its request");
    resume.store(true, Ordering::Release);
    requester
        .join()
        .expect("the requester thread")
        .expect("its call");
    assert!(
        still_inside.left(),
        "out of the request: the memory may be reused"
    );
}

/// A direct compare-and-swap has a CAS request's outcomes: it returns the original word and
/// swaps only when it matched; misaligned, it fails as the request does and moves the queue
/// pair to ERROR; behind a stopped responder it does not run (`NotExecuted`) and the word
/// stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_compare_and_swap_has_a_cas_request_s_outcomes() {
    let connected = checks::connect(Backend::Shm).await;
    let queue_pair = &connected.client_queue_pair;
    let at = connected.remote_at(8);
    let original = queue_pair
        .direct(|access| access.read_u64(at))
        .expect("idle")
        .expect("read");
    let swapped = queue_pair.direct(|access| access.compare_and_swap(at, original, original + 7));
    assert_eq!(swapped, Some(Ok(original)), "matched: swapped");
    let missed = queue_pair.direct(|access| access.compare_and_swap(at, original, 1));
    assert_eq!(
        missed,
        Some(Ok(original + 7)),
        "not matched: the word it found"
    );
    let now = queue_pair.direct(|access| access.read_u64(at));
    assert_eq!(
        now,
        Some(Ok(original + 7)),
        "a failed compare leaves the word"
    );

    // Misaligned: the list's status, and ERROR.
    let listed = checks::connect(Backend::Shm).await;
    let by_list = listed
        .client_queue_pair
        .post_inline(&[WorkRequest::compare_and_swap(
            1,
            listed.local_at(0, 8),
            listed.remote_at(4),
            0,
            1,
        )])
        .expect("idle: inline")
        .expect("a valid list")
        .expect_err("misaligned");
    let misaligned =
        queue_pair.direct(|access| access.compare_and_swap(connected.remote_at(4), 0, 1));
    assert_eq!(misaligned, Some(Err(by_list.completion.status)));
    assert_eq!(queue_pair.state(), QueuePairState::Error);

    // Behind a stopped responder: not run, the word unchanged.
    let stopped = checks::connect(Backend::Shm).await;
    let queue_pair = &stopped.client_queue_pair;
    let at = stopped.remote_at(16);
    let before = queue_pair
        .direct(|access| access.read_u64(at))
        .expect("idle")
        .expect("read");
    stopped.server_queue_pair.modify_to_error();
    let outcome = queue_pair.direct(|access| access.compare_and_swap(at, before, before + 1));
    assert_eq!(outcome, Some(Err(WorkCompletionStatus::NotExecuted)));
    let word = stopped
        .remote
        .memory()
        .load_u64(16)
        .expect("the responder's word");
    assert_eq!(word, before, "the word stayed");
}
