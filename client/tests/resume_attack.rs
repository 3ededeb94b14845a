//! Attacks on the resume of fenced replicated writes (`replicated::resume`): cut writes at each
//! step, cut them again while they resume, cut thieves, and check that every outcome is honest
//! and the replicas agree at rest.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod support;

use bytes::Bytes;
use rdkv_client::fault::{FaultInjector, Injection, Moment, Step, StepKind};
use rdkv_client::{Client, ClientBuilder, ClusterConfig};
use rdkv_fabric::{Backend, WorkCompletionStatus};
use rdkv_server::RunningServer;
use tokio::sync::{Notify, Semaphore};

const SECRET: &[u8] = b"resume-attack-secret";
const CUT: WorkCompletionStatus = WorkCompletionStatus::RetryExceededError;

/// Three in-process nodes, ids 1 to 3.
async fn start_nodes() -> Vec<RunningServer> {
    support::replicas::start_three(SECRET).await
}

/// The cluster of the nodes, with 2 copies of each key.
fn cluster(nodes: &[RunningServer]) -> ClusterConfig {
    let addresses: Vec<SocketAddr> = nodes.iter().map(RunningServer::control_address).collect();
    let mut cluster = support::cluster("resume-attack", SECRET, Backend::Soft, &addresses);
    cluster.replicas = 2;
    cluster
}

/// A client of each node alone.
async fn direct_clients(nodes: &[RunningServer]) -> Vec<Client> {
    support::replicas::node_clients(nodes, SECRET).await
}

/// The ids of `key`'s 2 replicas, primary first.
fn replica_ids(key: &[u8]) -> Vec<u32> {
    support::replicas::replica_ids(key, 2)
}

/// Each node's copy of `key`, and whether it matches `wanted` on the replicas (None elsewhere).
async fn check_replicas(direct: &[Client], key: &[u8], wanted: Option<&[u8]>, what: &str) {
    let expected = replica_ids(key);
    for (index, client) in direct.iter().enumerate() {
        let id = index as u32 + 1;
        let value = client.get(key).await.expect("direct get");
        let want = if expected.contains(&id) {
            wanted.map(Bytes::copy_from_slice)
        } else {
            None
        };
        assert_eq!(value, want, "{what}: node {id} (replicas {expected:?})");
    }
}

/// One scripted rule: at the `skip`+1-th step of `kind` at `moment` (counted across the
/// client's operations), do `action` (once).
#[derive(Debug)]
struct Rule {
    kind: Option<StepKind>,
    moment: Moment,
    skip: u32,
    action: Injection,
    /// Told when the rule fires.
    fired: Arc<Notify>,
    done: bool,
}

#[derive(Debug, Default)]
struct Script {
    rules: Mutex<Vec<Rule>>,
    log: Mutex<Vec<String>>,
}

impl Script {
    fn rule(
        self: &Arc<Self>,
        kind: Option<StepKind>,
        moment: Moment,
        skip: u32,
        action: Injection,
    ) -> Arc<Notify> {
        let fired = Arc::new(Notify::new());
        self.rules.lock().expect("the script").push(Rule {
            kind,
            moment,
            skip,
            action,
            fired: fired.clone(),
            done: false,
        });
        fired
    }
    fn log(&self) -> Vec<String> {
        self.log.lock().expect("the script").clone()
    }
}

impl FaultInjector for Script {
    fn inject(&self, step: &Step) -> Injection {
        self.log.lock().expect("the script").push(format!(
            "{} {:?} {:?}",
            step.operation, step.kind, step.moment
        ));
        let mut rules = self.rules.lock().expect("the script");
        // Only the first pending rule is live (rules apply in order).
        let Some(rule) = rules.iter_mut().find(|rule| !rule.done) else {
            return Injection::Proceed;
        };
        let matches = rule.moment == step.moment && rule.kind.is_none_or(|kind| kind == step.kind);
        if !matches {
            return Injection::Proceed;
        }
        if rule.skip > 0 {
            rule.skip -= 1;
            return Injection::Proceed;
        }
        rule.done = true;
        rule.fired.notify_one();
        rule.action.clone()
    }
}

fn scripted(nodes: &[RunningServer], script: &Arc<Script>) -> Arc<Client> {
    Arc::new(
        ClientBuilder::cluster(&cluster(nodes))
            .fault_injector(script.clone())
            .build()
            .expect("a cluster client"),
    )
}

async fn fired(notify: &Notify, what: &str) {
    tokio::time::timeout(Duration::from_secs(5), notify.notified())
        .await
        .unwrap_or_else(|_| panic!("{what}: the rule never fired"));
}

/// A put of an absent key cut after the commit of the tombstone it places to lock (a tombstone
/// reads as absence, so nothing of the put shows): it should start again and succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absent_key_put_cut_after_its_tombstone_commit() {
    let nodes = start_nodes().await;
    let direct = direct_clients(&nodes).await;
    for (index, moment) in [Moment::After, Moment::Before].into_iter().enumerate() {
        let script = Arc::new(Script::default());
        script.rule(Some(StepKind::Commit), moment, 0, Injection::Fail(CUT));
        let client = scripted(&nodes, &script);
        let key = format!("absent-put-{index}");
        let key = key.as_bytes();
        let result = client.put(key, b"value").await;
        let value = direct[replica_ids(key)[0] as usize - 1]
            .get(key)
            .await
            .expect("get");
        assert!(
            result.is_ok(),
            "{moment:?}: put failed: {:?} (may_have_applied {}); primary holds {value:?}; steps {:?}",
            result,
            result.as_ref().err().is_some_and(|error| error.may_have_applied()),
            script.log()
        );
        check_replicas(&direct, key, Some(b"value"), "absent put").await;
    }
}

/// Deletes of present keys, inserts of absent keys (tombstone path) and updates, each cut once
/// after (and before) each of their steps: each completes, and the replicas agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_and_inserts_cut_at_each_step_complete_and_agree() {
    let nodes = start_nodes().await;
    let direct = direct_clients(&nodes).await;
    let plain = ClientBuilder::cluster(&cluster(&nodes))
        .build()
        .expect("a cluster client");
    let mut failures = Vec::new();
    let mut case = 0;
    for kind in [
        StepKind::Lock,
        StepKind::Backup,
        StepKind::Commit,
        StepKind::CheckLock,
        StepKind::ReadBuckets,
    ] {
        for moment in [Moment::After, Moment::Before] {
            for skip in 0..2u32 {
                case += 1;
                // Delete of a present key.
                let key = format!("del-{case}");
                let key = key.as_bytes();
                plain.put(key, b"old").await.expect("put");
                let script = Arc::new(Script::default());
                script.rule(Some(kind), moment, skip, Injection::Fail(CUT));
                let client = scripted(&nodes, &script);
                match client.delete(key).await {
                    Ok(true) => {}
                    other => failures.push(format!(
                        "delete cut {moment:?} {kind:?} #{skip}: {other:?} steps {:?}",
                        script.log()
                    )),
                }
                for (index, node) in direct.iter().enumerate() {
                    let value = node.get(key).await.expect("get");
                    if value.is_some() {
                        failures.push(format!(
                            "delete cut {moment:?} {kind:?} #{skip}: node {} still {value:?}",
                            index + 1
                        ));
                    }
                }
                // Insert of an absent key.
                let key = format!("ins-{case}");
                let key = key.as_bytes();
                let script = Arc::new(Script::default());
                script.rule(Some(kind), moment, skip, Injection::Fail(CUT));
                let client = scripted(&nodes, &script);
                match client.insert(key, b"new").await {
                    Ok(true) => {
                        let expected = replica_ids(key);
                        for (index, node) in direct.iter().enumerate() {
                            let id = index as u32 + 1;
                            let value = node.get(key).await.expect("get");
                            let want = expected.contains(&id).then(|| Bytes::from_static(b"new"));
                            if value != want {
                                failures.push(format!(
                                    "insert cut {moment:?} {kind:?} #{skip}: node {id} holds {value:?}"
                                ));
                            }
                        }
                    }
                    other => {
                        let may_have_applied =
                            other.as_ref().err().map(|error| error.may_have_applied());
                        let now = plain.get(key).await.expect("get");
                        failures.push(format!(
                            "insert cut {moment:?} {kind:?} #{skip}: {other:?} (may_have_applied {may_have_applied:?}, reads {now:?}) steps {:?}",
                            script.log()
                        ))
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A commit refused before it was posted (the connection already cut), whose lock another
/// writer then takes over: the write provably did not apply, so it should start again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_cut_before_posting_then_taken_over_starts_again() {
    let nodes = start_nodes().await;
    let direct = direct_clients(&nodes).await;
    let other = ClientBuilder::cluster(&cluster(&nodes))
        .build()
        .expect("a cluster client");
    let key = b"commit-never-posted";
    other.put(key, b"before").await.expect("put");
    let gate = Arc::new(Semaphore::new(0));
    let script = Arc::new(Script::default());
    script.rule(
        Some(StepKind::Commit),
        Moment::Before,
        0,
        Injection::Fail(CUT),
    );
    let held = script.rule(None, Moment::Before, 0, Injection::WaitFor(gate.clone()));
    let client = scripted(&nodes, &script);
    let writer = {
        let client = client.clone();
        tokio::spawn(async move { client.put(key, b"cut").await })
    };
    fired(&held, "held before the resume").await;
    other.put(key, b"thief").await.expect("put over the lock");
    assert_eq!(other.counters().locks_stolen, 1);
    gate.add_permits(1);
    let result = writer.await.expect("join");
    assert!(
        result.is_ok(),
        "the write never posted its commit, yet: {result:?}; steps {:?}",
        script.log()
    );
    check_replicas(&direct, key, Some(b"cut"), "after").await;
}

/// A resume whose own commit fails after it ran with a non-retryable status: the value is
/// visible, so the error must say it may have applied (the first attempt's path wraps it in
/// `Unresolved`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_commit_failing_non_retryably_is_honest() {
    let nodes = start_nodes().await;
    let direct = direct_clients(&nodes).await;
    let plain = ClientBuilder::cluster(&cluster(&nodes))
        .build()
        .expect("a cluster client");
    for (index, first_cut) in [StepKind::Backup, StepKind::Lock].into_iter().enumerate() {
        // Lock: the resume steals and starts again; its commit is then the mutate path's.
        let key = format!("resume-commit-fatal-{index}");
        let key = key.as_bytes();
        plain.put(key, b"before").await.expect("put");
        let script = Arc::new(Script::default());
        script.rule(Some(first_cut), Moment::After, 0, Injection::Fail(CUT));
        script.rule(
            Some(StepKind::Commit),
            Moment::After,
            0,
            Injection::Fail(WorkCompletionStatus::RemoteOperationError),
        );
        let client = scripted(&nodes, &script);
        let result = client.put(key, b"after").await;
        let now = plain.get(key).await.expect("get");
        if now.as_deref() == Some(b"after".as_slice()) {
            let error = result.as_ref().expect_err("the commit failed");
            assert!(
                error.may_have_applied(),
                "cut after {first_cut:?}: the value is visible but the error says it certainly did not apply: {error}"
            );
        }
        let _ = direct.len();
    }
}

/// A resume whose backup CAS fails after it ran with a non-retryable status: the backup holds
/// the value, which a failover would show, so the error must not say it certainly did not
/// apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_backup_failing_non_retryably_is_honest() {
    let nodes = start_nodes().await;
    let direct = direct_clients(&nodes).await;
    let plain = ClientBuilder::cluster(&cluster(&nodes))
        .build()
        .expect("a cluster client");
    let key = b"resume-backup-fatal";
    plain.put(key, b"before").await.expect("put");
    let script = Arc::new(Script::default());
    script.rule(
        Some(StepKind::Backup),
        Moment::After,
        0,
        Injection::Fail(CUT),
    );
    // The resume settles the backup: READ, CheckLock, Backup CAS (the value lands again).
    script.rule(
        Some(StepKind::Backup),
        Moment::After,
        0,
        Injection::Fail(WorkCompletionStatus::RemoteOperationError),
    );
    let client = scripted(&nodes, &script);
    let result = client.put(key, b"after").await;
    let backup = replica_ids(key)[1];
    let on_backup = direct[backup as usize - 1].get(key).await.expect("get");
    let error = result.expect_err("the backup failed");
    assert!(
        on_backup.as_deref() != Some(b"after".as_slice()) || error.may_have_applied(),
        "the backup holds the value but the error says it certainly did not apply: {error}"
    );
}

/// A resume cut again: after its check, after its backup, after its commit. It goes on and
/// succeeds, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_cut_again_resumes_again() {
    let nodes = start_nodes().await;
    let direct = direct_clients(&nodes).await;
    let plain = ClientBuilder::cluster(&cluster(&nodes))
        .build()
        .expect("a cluster client");
    let mut failures = Vec::new();
    for (index, second) in [
        StepKind::CheckLock,
        StepKind::Backup,
        StepKind::Commit,
        StepKind::ReadBuckets,
    ]
    .into_iter()
    .enumerate()
    {
        for moment in [Moment::After, Moment::Before] {
            let key = format!("resume-again-{index}-{moment:?}");
            let key = key.as_bytes();
            plain.put(key, b"before").await.expect("put");
            let script = Arc::new(Script::default());
            script.rule(
                Some(StepKind::Backup),
                Moment::After,
                0,
                Injection::Fail(CUT),
            );
            script.rule(Some(second), moment, 0, Injection::Fail(CUT));
            let client = scripted(&nodes, &script);
            let result = client.put(key, b"after").await;
            if result.is_err() {
                failures.push(format!(
                    "second cut {moment:?} {second:?}: {result:?} steps {:?}",
                    script.log()
                ));
                continue;
            }
            let expected = replica_ids(key);
            for (index, node) in direct.iter().enumerate() {
                let id = index as u32 + 1;
                let value = node.get(key).await.expect("get");
                let want = expected.contains(&id).then(|| Bytes::from_static(b"after"));
                if value != want {
                    failures.push(format!(
                        "second cut {moment:?} {second:?}: node {id} {value:?}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Writer A is cut after a lock CAS that lost to writer B's lock on the same block (the same
/// lock word): A's resume takes B's lock over, and both writes finish; the replicas agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_after_a_lock_that_lost_to_another_writers_identical_lock() {
    let nodes = start_nodes().await;
    let direct = direct_clients(&nodes).await;
    let plain = ClientBuilder::cluster(&cluster(&nodes))
        .build()
        .expect("a cluster client");
    let key = b"identical-locks";
    plain.put(key, b"before").await.expect("put");
    let gate_a = Arc::new(Semaphore::new(0));
    let first_script = Arc::new(Script::default());
    let first_held = first_script.rule(
        Some(StepKind::Lock),
        Moment::Before,
        0,
        Injection::WaitFor(gate_a.clone()),
    );
    first_script.rule(Some(StepKind::Lock), Moment::After, 0, Injection::Fail(CUT));
    let first = scripted(&nodes, &first_script);
    let gate_b = Arc::new(Semaphore::new(0));
    let second_script = Arc::new(Script::default());
    let second_held = second_script.rule(
        Some(StepKind::Lock),
        Moment::After,
        0,
        Injection::WaitFor(gate_b.clone()),
    );
    let second = scripted(&nodes, &second_script);
    let first_task = {
        let first = first.clone();
        tokio::spawn(async move { first.put(key, b"A").await })
    };
    fired(&first_held, "A before its lock").await;
    let second_task = {
        let second = second.clone();
        tokio::spawn(async move { second.put(key, b"B").await })
    };
    fired(&second_held, "B after its lock").await;
    gate_a.add_permits(1);
    let a_result = tokio::time::timeout(Duration::from_secs(5), first_task)
        .await
        .expect("A finishes while B holds")
        .expect("join");
    assert!(
        a_result.is_ok(),
        "A: {a_result:?}; {:?}",
        first_script.log()
    );
    assert_eq!(first.counters().locks_stolen, 1, "A took B's lock over");
    assert_eq!(
        plain.get(key).await.expect("get").as_deref(),
        Some(b"A".as_slice())
    );
    gate_b.add_permits(1);
    let b_result = second_task.await.expect("join");
    assert!(
        b_result.is_ok(),
        "B: {b_result:?}; {:?}",
        second_script.log()
    );
    check_replicas(&direct, key, Some(b"B"), "B last").await;
}

/// A thief cut after its takeover CAS, after its rollback of the backup, or after its unlock:
/// its own orphaned takeover lock is taken over in turn, and the stalled writer and the thief
/// both finish; the replicas agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thief_cut_during_its_takeover() {
    let nodes = start_nodes().await;
    let direct = direct_clients(&nodes).await;
    let plain = ClientBuilder::cluster(&cluster(&nodes))
        .build()
        .expect("a cluster client");
    let mut failures = Vec::new();
    for (index, kind) in [StepKind::Steal, StepKind::Backup, StepKind::Unlock]
        .into_iter()
        .enumerate()
    {
        for moment in [Moment::After, Moment::Before] {
            let key: &'static [u8] = Box::leak(
                format!("thief-cut-{index}-{moment:?}")
                    .into_bytes()
                    .into_boxed_slice(),
            );
            plain.put(key, b"before").await.expect("put");
            let gate = Arc::new(Semaphore::new(0));
            let s_script = Arc::new(Script::default());
            let s_held = s_script.rule(
                Some(StepKind::Lock),
                Moment::After,
                0,
                Injection::WaitFor(gate.clone()),
            );
            let stalled = scripted(&nodes, &s_script);
            let t_script = Arc::new(Script::default());
            t_script.rule(Some(kind), moment, 0, Injection::Fail(CUT));
            let thief = scripted(&nodes, &t_script);
            let s_task = {
                let stalled = stalled.clone();
                tokio::spawn(async move { stalled.put(key, b"stalled").await })
            };
            fired(&s_held, "stalled writer locked").await;
            let t_result = thief.put(key, b"thief").await;
            if t_result.is_err() {
                failures.push(format!(
                    "thief cut {moment:?} {kind:?}: {t_result:?} {:?}",
                    t_script.log()
                ));
            } else if plain.get(key).await.expect("get").as_deref() != Some(b"thief".as_slice()) {
                failures.push(format!(
                    "thief cut {moment:?} {kind:?}: thief's ack not visible"
                ));
            }
            gate.add_permits(1);
            let stalled_result = s_task.await.expect("join");
            if stalled_result.is_err() {
                failures.push(format!(
                    "stalled after thief cut {moment:?} {kind:?}: {stalled_result:?}"
                ));
                continue;
            }
            let expected = replica_ids(key);
            for (index, node) in direct.iter().enumerate() {
                let id = index as u32 + 1;
                let value = node.get(key).await.expect("get");
                let want = expected
                    .contains(&id)
                    .then(|| Bytes::from_static(b"stalled"));
                if value != want {
                    failures.push(format!(
                        "thief cut {moment:?} {kind:?}: node {id} {value:?}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A write cut after its commit ran, whose slot another writer overwrites before it looks
/// again: it applied, so `Unresolved` (never `Ok` that reverses, never a not-applied error).
/// And a write cut after a commit that lost (its lock taken over first): it may not claim it
/// certainly did not apply unless it knows, and must not report success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_cut_then_lock_or_value_replaced() {
    let nodes = start_nodes().await;
    let direct = direct_clients(&nodes).await;
    let other = ClientBuilder::cluster(&cluster(&nodes))
        .build()
        .expect("a cluster client");
    // (a) commit ran, then overwritten.
    let key = b"commit-ran-then-overwritten";
    other.put(key, b"before").await.expect("put");
    let gate = Arc::new(Semaphore::new(0));
    let script = Arc::new(Script::default());
    script.rule(
        Some(StepKind::Commit),
        Moment::After,
        0,
        Injection::Fail(CUT),
    );
    let held = script.rule(None, Moment::Before, 0, Injection::WaitFor(gate.clone()));
    let client = scripted(&nodes, &script);
    let writer = {
        let client = client.clone();
        tokio::spawn(async move { client.put(key, b"cut").await })
    };
    fired(&held, "held before the resume").await;
    other.put(key, b"later").await.expect("put after");
    gate.add_permits(1);
    let result = writer.await.expect("join");
    match &result {
        Err(error) => assert!(error.may_have_applied(), "{error}"),
        Ok(_) => panic!("reported success for a write that was overwritten before it checked: fine only if linearizable; {result:?}"),
    }
    check_replicas(&direct, key, Some(b"later"), "(a)").await;

    // (b) lock stolen while the writer stalls before its commit; the commit then runs (and
    // loses) and its completion is lost.
    let key = b"commit-lost-after-steal";
    other.put(key, b"before").await.expect("put");
    let gate = Arc::new(Semaphore::new(0));
    let script = Arc::new(Script::default());
    let held = script.rule(
        Some(StepKind::Commit),
        Moment::Before,
        0,
        Injection::WaitFor(gate.clone()),
    );
    script.rule(
        Some(StepKind::Commit),
        Moment::After,
        0,
        Injection::Fail(CUT),
    );
    let client = scripted(&nodes, &script);
    let writer = {
        let client = client.clone();
        tokio::spawn(async move { client.put(key, b"cut").await })
    };
    fired(&held, "held before the commit").await;
    other.put(key, b"thief").await.expect("put over the lock");
    gate.add_permits(1);
    let result = writer.await.expect("join");
    let now = other.get(key).await.expect("get");
    match &result {
        Ok(_) => assert_eq!(now.as_deref(), Some(b"cut".as_slice()), "reported success"),
        Err(error) => assert!(error.may_have_applied(), "{error}"),
    }
    eprintln!("(b) result {result:?}, value {now:?}");
    let expected = replica_ids(key);
    let mut copies = Vec::new();
    for (i, c) in direct.iter().enumerate() {
        if expected.contains(&(i as u32 + 1)) {
            copies.push(c.get(key).await.expect("get"));
        }
    }
    assert_eq!(copies[0], copies[1], "(b) replicas disagree at rest");
}
