//! Attacks on lists run inside their post (`QueuePair::post_inline`, `shm`): what they must
//! keep of the ordinary post path.

#[allow(dead_code, unused_imports, missing_docs)]
#[path = "conformance/checks.rs"]
mod checks;

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use checks::statuses;
use rdkv_fabric::{AccessFlags, Backend, QueuePairState, WorkCompletionStatus, WorkRequest};

/// A block registered after the attach, and a silent connection queued at the responder's
/// accept thread: a READ of the block makes the requester fetch the memory files (a refresh)
/// from that thread, behind it, so the post that READs it holds its queue pair's executor for
/// up to the silent connection's 500 ms hello deadline. (Not longer: the requester gives up on
/// a refresh after 1 s.)
fn late_block_behind_a_busy_accept_thread(
    connected: &checks::Connected,
) -> (rdkv_fabric::MemoryRegion, UnixStream) {
    let late = connected
        .server_domain
        .register_all(
            &checks::pinned(4096),
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
        )
        .expect("register a block after the attach");
    let socket = connected.server_device.shm_socket().expect("an shm socket");
    let stall = UnixStream::connect(&socket).expect("occupy the accept thread");
    (late, stall)
}

/// A list posted (the ordinary way) by another thread while a list runs inside its post, and
/// queued behind it, flushes when the inline list fails, and never runs: a request reported
/// WR_FLUSH_ERR behind an error must not execute (`docs/fabric.md`: "requests behind an error:
/// WR_FLUSH_ERR, never executed"), and nothing may run once the requester is in ERROR.
///
/// The inline list is held inside its post, executor held, by its first request: a READ of a
/// block registered after the attach, whose memory file the requester fetches (a refresh)
/// from the responder's accept thread, kept busy meanwhile by connections that never send
/// their hello (`late_block_behind_a_busy_accept_thread`). Its second request fails REM_ACCESS_ERR (an unknown rkey).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_queued_behind_a_failing_inline_list_flushes_and_never_runs() {
    let connected = Arc::new(checks::connect(Backend::Shm).await);
    let (late, _stall) = late_block_behind_a_busy_accept_thread(&connected);

    let mut unknown = connected.remote_at(0);
    unknown.remote_key ^= 0x00F0_0F00;
    let first = [
        WorkRequest::read(1, connected.local_at(0, 64), late.remote_key().at(0))
            .with_signaled(false),
        WorkRequest::read(2, connected.local_at(64, 8), unknown),
    ];
    let inline = {
        let connected = connected.clone();
        std::thread::spawn(move || loop {
            if let Some(outcome) = connected.client_queue_pair.post_inline(&first) {
                return outcome;
            }
            std::thread::yield_now();
        })
    };
    // Wait until the inline list holds the executor: a harmless probe then is refused (`None`).
    let probe = [WorkRequest::read(
        9,
        connected.local_at(8192, 8),
        connected.remote_at(0),
    )];
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < deadline, "the inline list never started");
        if connected.client_queue_pair.post_inline(&probe).is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    let data = vec![0xA5u8; 64];
    connected.local.write(4096, &data).expect("fill");
    let behind = connected
        .client_queue_pair
        .post(vec![WorkRequest::write(
            3,
            connected.local_at(4096, 64),
            connected.remote_at(512),
        )])
        .await
        .expect("post behind the inline list")
        .await;

    let outcome = inline
        .join()
        .expect("the inline thread")
        .expect("a valid list");
    let failure = outcome.expect_err("the unknown rkey fails");
    assert_eq!(failure.index, 1, "the refreshed READ ran: {failure:?}");
    assert_eq!(
        failure.completion.status,
        WorkCompletionStatus::RemoteAccessError
    );
    assert_eq!(connected.client_queue_pair.state(), QueuePairState::Error);
    assert_eq!(
        statuses(&behind),
        [WorkCompletionStatus::WorkRequestFlushError],
        "the list behind the failed one flushes"
    );
    let mut on_server = vec![0u8; 64];
    connected
        .remote
        .read(512, &mut on_server)
        .expect("read the server's memory");
    assert_eq!(
        on_server,
        vec![0u8; 64],
        "a WRITE that completed WR_FLUSH_ERR, behind an error, ran on the responder"
    );
}

/// A loop of `QueuePair::execute` over `shm` lets the other tasks of its worker run, and a
/// timeout around it fires, as a loop of `post` does (`post` spends a unit of tokio's
/// cooperative budget per list; a list run inside its post must too).
#[tokio::test(flavor = "current_thread")]
async fn a_loop_of_execute_yields_to_other_tasks_and_deadlines() {
    let connected = checks::connect(Backend::Shm).await;
    let read = || {
        vec![WorkRequest::read(
            1,
            connected.local_at(0, 64),
            connected.remote_at(0),
        )]
    };
    let ran = Arc::new(AtomicBool::new(false));
    let flag = ran.clone();
    tokio::spawn(async move { flag.store(true, Ordering::Release) });
    let started = Instant::now();
    let mut lists = 0u64;
    while !ran.load(Ordering::Acquire) && started.elapsed() < Duration::from_secs(2) {
        let completions = connected
            .client_queue_pair
            .execute(read())
            .await
            .expect("execute");
        assert_eq!(statuses(&completions), [WorkCompletionStatus::Success]);
        lists += 1;
    }
    assert!(
        ran.load(Ordering::Acquire),
        "another task of this worker never ran during {lists} lists ({:?})",
        started.elapsed()
    );

    let looped = tokio::time::timeout(Duration::from_millis(20), async {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(2) {
            connected
                .client_queue_pair
                .execute(read())
                .await
                .expect("execute");
        }
    })
    .await;
    assert!(
        looped.is_err(),
        "a 20 ms timeout around a loop of execute did not fire in 2 s"
    );
}

/// A failed list counts on its completion queue the completions it produces, inline or
/// posted: the failed request's and one per request behind it (flushed, signaled or not), as
/// `CompletionQueue::completions_generated` documents ("completions generated so far") and as
/// `execute` returns them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_inline_list_counts_the_completions_a_posted_one_generates() {
    for local_failure in [false, true] {
        let mut generated = Vec::new();
        for inline in [false, true] {
            let connected = checks::connect(Backend::Shm).await;
            let mut bad_remote = connected.remote_at(0);
            let mut bad_local = connected.local_at(0, 8);
            if local_failure {
                bad_local.local_key ^= 0x00F0_0F00;
            } else {
                bad_remote.remote_key ^= 0x00F0_0F00;
            }
            let good =
                |id| WorkRequest::read(id, connected.local_at(64, 8), connected.remote_at(0));
            let list = vec![
                good(1).with_signaled(false),
                WorkRequest::read(2, bad_local, bad_remote).with_signaled(false),
                good(3).with_signaled(false),
                good(4),
            ];
            let queue = &connected.client_completion_queue;
            let before = queue.completions_generated();
            let completions = if inline {
                connected
                    .client_queue_pair
                    .execute(list)
                    .await
                    .expect("execute")
            } else {
                connected
                    .client_queue_pair
                    .post(list)
                    .await
                    .expect("post")
                    .await
            };
            generated.push((
                inline,
                statuses(&completions),
                queue.completions_generated() - before,
            ));
        }
        let (_, posted_statuses, posted_count) = &generated[0];
        let (_, inline_statuses, inline_count) = &generated[1];
        assert_eq!(
            posted_statuses, inline_statuses,
            "local failure: {local_failure}"
        );
        assert_eq!(*posted_count, posted_statuses.len() as u64);
        assert_eq!(
            inline_count, posted_count,
            "completions counted on the CQ, inline vs posted (local failure: {local_failure}): {generated:?}"
        );
    }
}

/// (The ordinary path, before this change too.) A list queued behind another thread's
/// executor when the requester is moved to ERROR (`modify_to_error`: a connection's teardown)
/// flushes and never runs: once the queue pair is in ERROR, nothing of it that had not started
/// may run on the responder. The executor is held inside a post as in
/// [`a_list_queued_behind_a_failing_inline_list_flushes_and_never_runs`], by an ordinary `post`
/// on its own thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_queued_behind_the_executor_never_runs_after_modify_to_error() {
    let connected = Arc::new(checks::connect(Backend::Shm).await);
    let (late, _stall) = late_block_behind_a_busy_accept_thread(&connected);
    let first = vec![WorkRequest::read(
        1,
        connected.local_at(0, 64),
        late.remote_key().at(0),
    )];
    let executor = {
        let connected = connected.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async {
                connected
                    .client_queue_pair
                    .post(first)
                    .await
                    .expect("post")
                    .await
            })
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while connected.client_queue_pair.outstanding() == 0 {
        assert!(Instant::now() < deadline, "the first list was never posted");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Its post runs it at once (its doorbell finds the executor free): give it a moment to
    // take the executor, well inside the accept thread's 500 ms.
    tokio::time::sleep(Duration::from_millis(50)).await;

    let data = vec![0x5Au8; 64];
    connected.local.write(4096, &data).expect("fill");
    let behind = {
        let connected = connected.clone();
        tokio::spawn(async move {
            connected
                .client_queue_pair
                .post(vec![WorkRequest::write(
                    3,
                    connected.local_at(4096, 64),
                    connected.remote_at(512),
                )])
                .await
                .expect("post behind the executor")
                .await
        })
    };
    while connected.client_queue_pair.outstanding() < 2 {
        assert!(
            Instant::now() < deadline,
            "the second list was never queued"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    connected.client_queue_pair.modify_to_error();
    let behind = behind.await.expect("the task");
    let _ = executor.join().expect("the executor thread");
    assert_eq!(
        statuses(&behind),
        [WorkCompletionStatus::WorkRequestFlushError]
    );
    let mut on_server = vec![0u8; 64];
    connected
        .remote
        .read(512, &mut on_server)
        .expect("read the server's memory");
    assert_eq!(
        on_server,
        vec![0u8; 64],
        "a WRITE queued (not started) when its queue pair moved to ERROR ran afterwards"
    );
}

/// Runs lists of 16 FETCH_ADDs of 1 on `target` inside their post, on a thread of its own,
/// until the queue pair leaves RTS or `stop` is set; returns how many lists succeeded.
fn add_inline_until_error(
    connected: Arc<checks::Connected>,
    target: rdkv_fabric::RemoteSegment,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let list: Vec<WorkRequest> = (0..16u64)
            .map(|index| {
                WorkRequest::fetch_and_add(index, connected.local_at(index * 8, 8), target, 1)
                    .with_signaled(index == 15)
            })
            .collect();
        let mut succeeded = 0;
        while !stop.load(Ordering::Acquire)
            && connected.client_queue_pair.state() == QueuePairState::ReadyToSend
        {
            if let Some(outcome) = connected.client_queue_pair.post_inline(&list) {
                if outcome.expect("a valid list").is_ok() {
                    succeeded += 1;
                }
            }
        }
        succeeded
    })
}

/// Sound: a revocation waits for a list inside its post (one epoch for the list) and not past
/// it: once the region's drop returns, no request of any list runs on its memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_waits_for_the_inline_list_and_nothing_runs_after_it() {
    let connected = Arc::new(checks::connect(Backend::Shm).await);
    let memory = checks::pinned(4096);
    let region = connected
        .server_domain
        .register_all(
            &memory,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC | AccessFlags::REMOTE_READ,
        )
        .expect("register");
    let stop = Arc::new(AtomicBool::new(false));
    let adder = add_inline_until_error(connected.clone(), region.remote_key().at(0), stop.clone());
    let deadline = Instant::now() + Duration::from_secs(20);
    while memory.load_u64(0).expect("counter") < 16 * 50 {
        assert!(Instant::now() < deadline, "the lists never ran");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let revoking = Instant::now();
    drop(region);
    let took = revoking.elapsed();
    let at_revocation = memory.load_u64(0).expect("counter");
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Ordering::Release);
    let succeeded = adder.join().expect("the adder");
    assert_eq!(
        memory.load_u64(0).expect("counter"),
        at_revocation,
        "a request ran on the region's memory after its revocation returned"
    );
    assert!(
        at_revocation >= succeeded * 16 && at_revocation < (succeeded + 1) * 16,
        "whole lists only, apart from the one the revocation cut: {at_revocation} adds, {succeeded} lists"
    );
    // How long is a matter of speed (a test asserts none); past the retry timeout (2 s) the
    // revocation would have given up on the requester instead of waiting for it.
    eprintln!("the revocation waited {took:?}");
}

/// Sound: the responder's ERROR and drain wait for a list inside its post and not past it:
/// once the drain returns nothing runs on the responder's memory, and later lists complete
/// NOT_EXECUTED. The list the ERROR meets runs whole or up to an atomic: an atomic runs only
/// while the queue pair still receives (a requester stopped inside a list and resumed after
/// a fence must not CAS a slot word on reused memory), as a NIC's ERROR flushes the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_waits_for_the_inline_list_and_nothing_runs_after_it() {
    let connected = Arc::new(checks::connect(Backend::Shm).await);
    let stop = Arc::new(AtomicBool::new(false));
    let adder = add_inline_until_error(connected.clone(), connected.remote_at(256), stop.clone());
    let deadline = Instant::now() + Duration::from_secs(20);
    while connected.remote.load_u64(256).expect("counter") < 16 * 50 {
        assert!(Instant::now() < deadline, "the lists never ran");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let draining = Instant::now();
    connected.server_queue_pair.modify_to_error();
    connected.server_queue_pair.drain();
    let took = draining.elapsed();
    let at_drain = connected.remote.load_u64(256).expect("counter");
    let succeeded = adder.join().expect("the adder");
    let later = connected
        .client_queue_pair
        .execute(vec![WorkRequest::fetch_and_add(
            99,
            connected.local_at(0, 8),
            connected.remote_at(256),
            1,
        )])
        .await
        .expect("execute");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        connected.remote.load_u64(256).expect("counter"),
        at_drain,
        "a request ran after the drain returned"
    );
    assert!(
        at_drain >= succeeded * 16 && at_drain < (succeeded + 1) * 16,
        "whole lists, apart from the one the ERROR cut at an atomic: {at_drain} adds, {succeeded} lists"
    );
    assert_eq!(statuses(&later), [WorkCompletionStatus::NotExecuted]);
    eprintln!("the drain waited {took:?}");
}
