//! Every error says truthfully whether its operation may have applied.
//!
//! For every operation kind, and for the insert paths that withdraw other inserters' tentative
//! slots and their own, a dry run records the operation's steps; then, for every step and both
//! moments (before it is posted, after it ran), a fresh run fails exactly that step and the test
//! checks the answer against the store:
//!
//! - a failure before any CAS was posted is retried on a fresh connection and succeeds, once;
//! - a failure after a publishing CAS (commit, replace, remove) ran is an error that says "may
//!   have applied", and the effect is there;
//! - any other failure is an error that says "did not apply", and the effect is not there;
//! - afterwards the key works normally: no stray slot of the failed operation ever shows.

use std::sync::{Arc, Mutex};

use rdkv_client::fault::{FaultInjector, Injection, Moment, Step, StepKind};
use rdkv_client::{CasOutcome, Client, ClientConfig, Error, InsertOutcome};
use rdkv_fabric::{Backend, WorkCompletionStatus};
use rdkv_server::{RunningServer, ServerConfig};
use tokio::sync::{Notify, Semaphore};

const SECRET: &[u8] = b"outcomes-test-secret";

/// Holds an operation at its first step of one kind until the test releases it.
#[derive(Debug)]
struct Hold {
    /// The step to hold at.
    kind: StepKind,
    /// Before it is posted, or after it ran.
    moment: Moment,
    /// Told when the operation reaches it.
    reached: Arc<Notify>,
    /// Released by the test.
    gate: Arc<Semaphore>,
}

/// Records every step, fails the one at `fail_at` (counting both moments), and holds where told.
#[derive(Debug, Default)]
struct Script {
    /// Steps seen, in order.
    seen: Mutex<Vec<Step>>,
    /// The index in `seen` of the step to fail.
    fail_at: Option<usize>,
    /// Where to hold, once.
    hold: Mutex<Option<Hold>>,
}

impl FaultInjector for Script {
    fn inject(&self, step: &Step) -> Injection {
        let index = {
            let mut seen = self.seen.lock().expect("steps");
            seen.push(*step);
            seen.len() - 1
        };
        if self.fail_at == Some(index) {
            return Injection::Fail(WorkCompletionStatus::RetryExceededError);
        }
        let mut hold = self.hold.lock().expect("hold");
        if hold
            .as_ref()
            .is_some_and(|hold| hold.kind == step.kind && hold.moment == step.moment)
        {
            let hold = hold.take().expect("checked");
            hold.reached.notify_one();
            return Injection::WaitFor(hold.gate);
        }
        Injection::Proceed
    }
}

impl Script {
    fn steps(&self) -> Vec<Step> {
        self.seen.lock().expect("steps").clone()
    }
}

/// What the operation under test does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// put of an absent key.
    PutAbsent,
    /// put over a present key.
    PutPresent,
    /// insert of an absent key.
    InsertAbsent,
    /// update of a present key.
    Update,
    /// compare-and-swap whose expected value matches.
    CompareAndSwap,
    /// delete of a present key.
    Delete,
    /// insert of a key that has another inserter's abandoned tentative slot: withdraws it.
    InsertOverAbandoned,
    /// insert that finds another inserter's tentative slot committed when it tries to withdraw
    /// it: withdraws its own and reports the key present.
    InsertLosingToCommit,
}

const SCENARIOS: [Scenario; 8] = [
    Scenario::PutAbsent,
    Scenario::PutPresent,
    Scenario::InsertAbsent,
    Scenario::Update,
    Scenario::CompareAndSwap,
    Scenario::Delete,
    Scenario::InsertOverAbandoned,
    Scenario::InsertLosingToCommit,
];

/// The new value every mutation writes.
const NEW: &[u8] = b"new";
/// The value present before.
const OLD: &[u8] = b"old";

fn client_config(server: &RunningServer, script: Option<Arc<Script>>) -> ClientConfig {
    let mut config = ClientConfig::new(server.control_address(), Backend::Soft, SECRET);
    config.concurrency = 1;
    // One connection: a script counts the steps of one lane's operations, and a broken lane's
    // reconnect is what these tests watch (with a lane per worker, another lane could serve
    // instead).
    config.lanes = Some(1);
    config.fault_injector = script.map(|script| script as Arc<dyn FaultInjector>);
    config
}

/// The operation's result, reduced to whether it reported success.
async fn operate(scenario: Scenario, client: &Client, key: &[u8]) -> Result<bool, Error> {
    match scenario {
        Scenario::PutAbsent | Scenario::PutPresent => client.put(key, NEW).await.map(|()| true),
        Scenario::InsertAbsent | Scenario::InsertOverAbandoned | Scenario::InsertLosingToCommit => {
            client.insert(key, NEW).await
        }
        Scenario::Update => client.update(key, NEW).await,
        Scenario::CompareAndSwap => client
            .compare_and_swap(key, OLD, NEW)
            .await
            .map(|outcome| outcome == CasOutcome::Swapped),
        Scenario::Delete => client.delete(key).await,
    }
}

/// Whether the store shows the operation's effect.
async fn applied(scenario: Scenario, admin: &Client, key: &[u8]) -> bool {
    let value = admin.get(key).await.expect("get");
    match scenario {
        Scenario::Delete => value.is_none(),
        _ => value.as_deref() == Some(NEW),
    }
}

/// Runs `scenario` on `key` with `script` as the client's injector; returns its result.
async fn run_case(
    server: &RunningServer,
    admin: &Client,
    scenario: Scenario,
    key: &[u8],
    script: Arc<Script>,
) -> Result<bool, Error> {
    match scenario {
        Scenario::PutAbsent | Scenario::InsertAbsent => {}
        Scenario::PutPresent | Scenario::Update | Scenario::CompareAndSwap | Scenario::Delete => {
            admin.put(key, OLD).await.expect("set up the old value")
        }
        Scenario::InsertOverAbandoned => {
            // An inserter whose completion is lost right after it placed its tentative slot:
            // it reports "did not apply" and leaves the slot behind.
            let abandon = Arc::new(Script {
                fail_at: Some(3),
                ..Script::default()
            });
            let abandoning = Client::connect(client_config(server, Some(abandon.clone())))
                .await
                .expect("connect");
            let error = abandoning
                .insert(key, b"abandoned")
                .await
                .expect_err("the injected failure");
            assert_eq!(
                abandon.steps()[3].kind,
                StepKind::PlaceTentative,
                "{:?}",
                abandon.steps()
            );
            assert!(!error.may_have_applied(), "{error}");
            assert_eq!(
                admin.get(key).await.expect("get"),
                None,
                "tentative is invisible"
            );
        }
        Scenario::InsertLosingToCommit => {
            // The other inserter places its tentative slot and is held before its commit; ours
            // sees that slot and is held before withdrawing it; the other commits; ours then
            // finds the slot committed.
            let other_script = Arc::new(Script::default());
            let other_gate = Arc::new(Semaphore::new(0));
            let other_reached = Arc::new(Notify::new());
            *other_script.hold.lock().expect("hold") = Some(Hold {
                kind: StepKind::Commit,
                moment: Moment::Before,
                reached: other_reached.clone(),
                gate: other_gate.clone(),
            });
            let our_gate = Arc::new(Semaphore::new(0));
            let our_reached = Arc::new(Notify::new());
            *script.hold.lock().expect("hold") = Some(Hold {
                kind: StepKind::KillTentatives,
                moment: Moment::Before,
                reached: our_reached.clone(),
                gate: our_gate.clone(),
            });
            let other = Client::connect(client_config(server, Some(other_script)))
                .await
                .expect("connect");
            let ours = Client::connect(client_config(server, Some(script.clone())))
                .await
                .expect("connect");
            let other_key = key.to_vec();
            let other_insert =
                tokio::spawn(async move { other.insert(&other_key, b"other").await });
            other_reached.notified().await;
            let our_key = key.to_vec();
            let mut our_insert = tokio::spawn(async move {
                operate(Scenario::InsertLosingToCommit, &ours, &our_key).await
            });
            // Ours holds before withdrawing, or ended early (an injected failure).
            let ended_early = tokio::select! {
                _ = our_reached.notified() => None,
                result = &mut our_insert => Some(result.expect("our task")),
            };
            other_gate.add_permits(1);
            assert!(
                other_insert
                    .await
                    .expect("other task")
                    .expect("other insert"),
                "the other insert commits"
            );
            if let Some(result) = ended_early {
                return result;
            }
            our_gate.add_permits(1);
            return our_insert.await.expect("our task");
        }
    }
    let client = Client::connect(client_config(server, Some(script)))
        .await
        .expect("connect");
    let result = operate(scenario, &client, key).await;
    client.close().await;
    result
}

/// The expected answer for a failure injected at `index` of the dry run's `steps`.
#[derive(Debug, PartialEq, Eq)]
enum Expected {
    /// Retried transparently: the operation succeeds.
    Retried,
    /// An error that says "may have applied", with the effect present.
    MayHaveApplied,
    /// An error that says "did not apply", with the effect absent.
    DidNotApply,
}

fn expected(steps: &[Step], index: usize) -> Expected {
    let step = steps[index];
    let posted_before =
        |step: &Step| step.kind != StepKind::ReadBuckets && step.kind != StepKind::ReadBlocks;
    let cas_posted = steps[..index]
        .iter()
        .any(|earlier| earlier.moment == Moment::After && posted_before(earlier))
        || (step.moment == Moment::After && posted_before(&step));
    if step.moment == Moment::After && step.kind.publishes() {
        Expected::MayHaveApplied
    } else if cas_posted {
        Expected::DidNotApply
    } else {
        Expected::Retried
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failure_says_whether_its_operation_may_have_applied() {
    // Every case opens new connections, and each takes a heap chunk on its first write: 1,024
    // small chunks are more than the cases use. The collector stays off: it clears an abandoned
    // tentative slot as soon as its connection is torn down, and the InsertOverAbandoned cases
    // need that slot in place while their insert runs (the step lists must match the dry run).
    let mut config = ServerConfig::local(SECRET);
    config.chunk_size = 16 * 1024;
    config.heap_size = 16 * 1024 * 1024;
    config.collector_interval = std::time::Duration::from_secs(3600);
    config.operation_deadline = std::time::Duration::from_millis(500);
    let server = rdkv_server::start(config).await.expect("start server");
    let mut kinds_failed = std::collections::HashSet::new();
    let mut cases = 0;
    // Twice: with the admin's writes in the process's slot cache for the node (the operation
    // under test then guesses each key's block: `docs/protocol.md`, *Guessed blocks*), and with
    // an admin that caches nothing (it looks up from the buckets alone).
    for guessing in [false, true] {
        let mut admin_config = client_config(&server, None);
        if !guessing {
            admin_config.slot_cache_entries = 0;
        }
        let admin = Client::connect(admin_config).await.expect("connect");
        for scenario in SCENARIOS {
            let dry = Arc::new(Script::default());
            let key = format!("{scenario:?}-{guessing}-dry");
            let reported = run_case(&server, &admin, scenario, key.as_bytes(), dry.clone())
                .await
                .unwrap_or_else(|error| panic!("{scenario:?} without failures: {error}"));
            let steps = dry.steps();
            let succeeds = scenario != Scenario::InsertLosingToCommit;
            assert_eq!(reported, succeeds, "{scenario:?}: {steps:?}");
            assert_eq!(
                applied(scenario, &admin, key.as_bytes()).await,
                succeeds,
                "{scenario:?}"
            );
            for index in 0..steps.len() {
                let key = format!("{scenario:?}-{guessing}-{index}");
                let script = Arc::new(Script {
                    fail_at: Some(index),
                    ..Script::default()
                });
                let result = run_case(&server, &admin, scenario, key.as_bytes(), script).await;
                let effect = applied(scenario, &admin, key.as_bytes()).await;
                let want = if succeeds {
                    expected(&steps, index)
                } else {
                    // This insert never applies; a failure before any CAS is retried and finds the
                    // key present.
                    match expected(&steps, index) {
                        Expected::MayHaveApplied => unreachable!("it publishes nothing"),
                        other => other,
                    }
                };
                let context = format!(
                "{scenario:?} (guessing: {guessing}), failure at {:?}: {result:?}, effect {effect}",
                steps[index]
            );
                match want {
                    Expected::Retried => {
                        assert_eq!(result.as_ref().ok(), Some(&succeeds), "{context}");
                        assert_eq!(effect, succeeds, "{context}");
                    }
                    Expected::MayHaveApplied => {
                        let error = result.as_ref().expect_err(&context);
                        assert!(error.may_have_applied(), "{context}");
                        assert!(matches!(error, Error::Unresolved { .. }), "{context}");
                        assert!(effect, "{context}: a completed publishing CAS took effect");
                    }
                    Expected::DidNotApply => {
                        let error = result.as_ref().expect_err(&context);
                        assert!(!error.may_have_applied(), "{context}");
                        assert!(!effect, "{context}: reported as not applied");
                    }
                }
                kinds_failed.insert(steps[index].kind);
                cases += 1;
                // The key works normally afterwards: a stray slot of the failed operation would
                // show up here as a second value or a key that does not go away.
                admin
                    .put(key.as_bytes(), b"after")
                    .await
                    .expect("put after");
                assert_eq!(
                    admin.get(key.as_bytes()).await.expect("get").as_deref(),
                    Some(&b"after"[..]),
                    "{context}"
                );
                assert!(
                    admin.delete(key.as_bytes()).await.expect("delete"),
                    "{context}"
                );
                assert_eq!(
                    admin.get(key.as_bytes()).await.expect("get"),
                    None,
                    "{context}"
                );
            }
        }
    }
    for kind in StepKind::SINGLE_COPY {
        assert!(
            kinds_failed.contains(&kind),
            "no case failed a {kind:?} step: {kinds_failed:?}"
        );
    }
    eprintln!("{cases} injected failures checked");
}

/// An insert that loses to another inserter returns the winner's value, on both paths that
/// find the key present after placing a tentative slot: the re-read sees the winner's committed
/// slot, or the CAS that would withdraw the winner's tentative slot finds it committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_that_loses_returns_the_winners_value() {
    let server = rdkv_server::start(ServerConfig::local(SECRET))
        .await
        .expect("start server");
    let winner = Client::connect(client_config(&server, None))
        .await
        .expect("connect");
    let present = |value: &'static [u8]| InsertOutcome::Present(bytes::Bytes::from_static(value));

    // Ours found the key absent and is held before placing its tentative slot; the winner
    // inserts meanwhile; ours then sees it committed in the re-read.
    let script = Arc::new(Script::default());
    let gate = Arc::new(Semaphore::new(0));
    let reached = Arc::new(Notify::new());
    *script.hold.lock().expect("hold") = Some(Hold {
        kind: StepKind::PlaceTentative,
        moment: Moment::Before,
        reached: reached.clone(),
        gate: gate.clone(),
    });
    let ours = Arc::new(
        Client::connect(client_config(&server, Some(script)))
            .await
            .expect("connect"),
    );
    let racing = ours.clone();
    let our_insert = tokio::spawn(async move { racing.insert_or_get(b"re-read", b"ours").await });
    reached.notified().await;
    assert!(winner.insert(b"re-read", b"winner").await.expect("insert"));
    gate.add_permits(1);
    assert_eq!(
        our_insert.await.expect("our task").expect("our insert"),
        present(b"winner")
    );

    // The winner is held before its commit, with its tentative slot placed; ours sees that slot
    // and is held before withdrawing it; the winner commits; ours finds the slot committed.
    let winner_script = Arc::new(Script::default());
    let winner_gate = Arc::new(Semaphore::new(0));
    let winner_reached = Arc::new(Notify::new());
    *winner_script.hold.lock().expect("hold") = Some(Hold {
        kind: StepKind::Commit,
        moment: Moment::Before,
        reached: winner_reached.clone(),
        gate: winner_gate.clone(),
    });
    let held_winner = Client::connect(client_config(&server, Some(winner_script)))
        .await
        .expect("connect");
    let winner_insert =
        tokio::spawn(async move { held_winner.insert(b"withdraw", b"winner").await });
    winner_reached.notified().await;
    let script = Arc::new(Script::default());
    let gate = Arc::new(Semaphore::new(0));
    let reached = Arc::new(Notify::new());
    *script.hold.lock().expect("hold") = Some(Hold {
        kind: StepKind::KillTentatives,
        moment: Moment::Before,
        reached: reached.clone(),
        gate: gate.clone(),
    });
    let ours = Client::connect(client_config(&server, Some(script)))
        .await
        .expect("connect");
    let our_insert = tokio::spawn(async move {
        ours.compare_and_swap_expecting(b"withdraw", None, b"ours")
            .await
    });
    reached.notified().await;
    winner_gate.add_permits(1);
    assert!(winner_insert
        .await
        .expect("winner task")
        .expect("winner insert"));
    gate.add_permits(1);
    assert_eq!(
        our_insert.await.expect("our task").expect("our swap"),
        CasOutcome::Mismatch(Some(bytes::Bytes::from_static(b"winner"))),
        "a swap expecting absence loses the same way"
    );
    assert_eq!(
        winner.get(b"withdraw").await.expect("get").as_deref(),
        Some(&b"winner"[..])
    );
}

/// A tentative slot whose inserter failed is cleared by the server's collector once its chunk's
/// writers are done, so abandoned inserts do not use up index slots. The client stays open: the
/// failed operation retires its connection, whose teardown seals the chunk with no writer left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_collector_clears_an_abandoned_tentative_slot() {
    let mut config = ServerConfig::local(SECRET);
    config.operation_deadline = std::time::Duration::from_millis(200);
    config.collector_interval = std::time::Duration::from_millis(20);
    let server = rdkv_server::start(config).await.expect("start server");
    let abandon = Arc::new(Script {
        fail_at: Some(3),
        ..Script::default()
    });
    let abandoning = Client::connect(client_config(&server, Some(abandon.clone())))
        .await
        .expect("connect");
    let error = abandoning
        .insert(b"abandoned", b"value")
        .await
        .expect_err("the injected failure");
    assert_eq!(abandon.steps()[3].kind, StepKind::PlaceTentative);
    assert!(!error.may_have_applied(), "{error}");
    // The collector may already have cleared it (a 200 ms deadline passes quickly on a busy
    // machine): it is waited for, and counted once.
    let started = std::time::Instant::now();
    while server.stats().tentatives_cleared == 0 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "the collector did not clear the abandoned tentative slot"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(server.stats().tentatives_cleared, 1);
    let admin = Client::connect(client_config(&server, None))
        .await
        .expect("connect");
    assert_eq!(admin.get(b"abandoned").await.expect("get"), None);
    assert!(admin.insert(b"abandoned", b"fresh").await.expect("insert"));
    // The abandoning client itself goes on working, on a new connection.
    assert_eq!(
        abandoning.get(b"abandoned").await.expect("get").as_deref(),
        Some(&b"fresh"[..])
    );
}

/// A deadline says whether the operation may have applied: held (and never released) before
/// its publishing CAS, it did not; held after it, it did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_says_whether_the_operation_may_have_applied() {
    let server = rdkv_server::start(ServerConfig::local(SECRET))
        .await
        .expect("start server");
    let admin = Client::connect(client_config(&server, None))
        .await
        .expect("connect");
    let cases = [
        (Scenario::PutAbsent, StepKind::Commit),
        (Scenario::InsertAbsent, StepKind::Commit),
        (Scenario::Update, StepKind::Replace),
        (Scenario::Delete, StepKind::Remove),
    ];
    for (scenario, kind) in cases {
        for moment in [Moment::Before, Moment::After] {
            let key = format!("deadline-{scenario:?}-{moment:?}");
            if scenario == Scenario::Update || scenario == Scenario::Delete {
                admin.put(key.as_bytes(), OLD).await.expect("set up");
            }
            let script = Arc::new(Script::default());
            *script.hold.lock().expect("hold") = Some(Hold {
                kind,
                moment,
                reached: Arc::new(Notify::new()),
                // Never released: the deadline ends the operation.
                gate: Arc::new(Semaphore::new(0)),
            });
            let mut config = client_config(&server, Some(script));
            config.operation_deadline = Some(std::time::Duration::from_millis(300));
            let client = Client::connect(config).await.expect("connect");
            let error = operate(scenario, &client, key.as_bytes())
                .await
                .expect_err("the deadline");
            let context = format!("{scenario:?} held {moment:?} {kind:?}: {error}");
            assert!(matches!(error, Error::TimedOut { .. }), "{context}");
            let waited = match kind {
                StepKind::Commit => "waiting for the commit CAS",
                StepKind::Replace => "waiting for the CAS that replaces the value",
                _ => "waiting for the CAS that removes the key",
            };
            assert!(error.to_string().contains(waited), "{context}");
            let effect = applied(scenario, &admin, key.as_bytes()).await;
            assert_eq!(
                error.may_have_applied(),
                moment == Moment::After,
                "{context}"
            );
            assert_eq!(effect, moment == Moment::After, "{context}");
            client.close().await;
        }
    }
}

/// An insert that its caller cancels between place and commit (here: a `timeout` around the
/// call, while the operation is held after placing) retires its connection when its future is
/// dropped, so the server seals the chunk and clears the slot while the client stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_insert_does_not_leave_its_slot_while_the_client_lives() {
    let mut config = ServerConfig::local(SECRET);
    config.operation_deadline = std::time::Duration::from_millis(200);
    config.collector_interval = std::time::Duration::from_millis(20);
    let server = rdkv_server::start(config).await.expect("start server");
    let script = Arc::new(Script::default());
    *script.hold.lock().expect("hold") = Some(Hold {
        kind: StepKind::PlaceTentative,
        moment: Moment::After,
        reached: Arc::new(Notify::new()),
        gate: Arc::new(Semaphore::new(0)),
    });
    let client = Client::connect(client_config(&server, Some(script)))
        .await
        .expect("connect");
    let cancelled = tokio::time::timeout(
        std::time::Duration::from_millis(50),
        client.insert(b"k", b"v"),
    )
    .await;
    assert!(cancelled.is_err(), "the caller cancelled the insert");
    let started = std::time::Instant::now();
    while server.stats().tentatives_cleared == 0 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "the cancelled insert's tentative slot was not cleared while its client lives"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(client.insert(b"k", b"later").await.expect("insert"));
}

/// A connection attempt outlives the operation that started it: a client whose deadline is
/// shorter than a handshake still gets connected (the attempt runs in a task of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_attempt_outlives_a_cancelled_operation() {
    let server = rdkv_server::start(ServerConfig::local(SECRET))
        .await
        .expect("start server");
    // The first GET fails its first step (the connection breaks), and its retry's handshake
    // cannot finish within a 1 ms deadline.
    let script = Arc::new(Script {
        fail_at: Some(0),
        ..Script::default()
    });
    let mut config = client_config(&server, Some(script));
    config.operation_deadline = Some(std::time::Duration::from_millis(1));
    let client = Client::connect(config).await.expect("connect");
    if let Err(error) = client.get(b"k").await {
        assert!(!error.may_have_applied(), "{error}");
    }
    let started = std::time::Instant::now();
    while client.counters().reconnects == 0 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "the connection attempt was abandoned with its operation"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // Connected now: GETs fit even a 1 ms deadline (a few tries, for a loaded machine).
    let mut answered = false;
    for _ in 0..200 {
        if client.get(b"k").await.is_ok() {
            answered = true;
            break;
        }
    }
    assert!(
        answered,
        "a GET succeeded on the connection opened in the background"
    );
}
