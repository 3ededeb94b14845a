//! A paused node must not answer reads from its frozen memory (issue 41, `docs/protocol.md`,
//! *Readers enforce the lease*).
//!
//! Three nodes with `replicas = 2` and `failure_timeout = 1s`. Writer clients run get, put,
//! delete and compare-and-swap on 24 keys; besides them, one **poller** client per key, each a
//! `Client` of its own that reads its one key every 2 ms, as an application watching a
//! configuration key or a flag does. One node is SIGSTOPped past `failure_timeout` (the view
//! commits it down and the writers move its keys to their backups), then SIGCONTed. A poller
//! of a key whose primary was the paused node is connected to that node alone; over `shm` it
//! runs its READs itself against the node's memory, which a stopped process cannot fence.
//! Before readers checked the node's lease word, those pollers read the value of the moment
//! of the pause hundreds of times while the writers moved on. The history must be
//! linearizable.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rand::{Rng, SeedableRng};
use rdkv_client::{Client, ClientBuilder, FabricChoice};
use rdkv_common::protocol::MemberState;
use rdkv_common::sharding;
use rdkv_integration_tests::linearizability::{check, Event, Operation, Outcome, Verdict};
use rdkv_integration_tests::view::{pid_of, up_settled, wait_for_view, Nodes, FAILURE_TIMEOUT};
use rdkv_integration_tests::workload::{decode, random_operation, Mix};

const WRITERS: u64 = 8;
const KEYS: u64 = 24;
/// How often a poller reads its key.
const POLL_INTERVAL: Duration = Duration::from_millis(2);
/// How long the node stays stopped: well past `failure_timeout`, so the view moves its keys
/// and the writers write their backups for a while.
const PAUSE: Duration = Duration::from_secs(4);

/// One real cluster at a time: two at once on this 2-core machine would time each other out.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Which node is paused.
#[derive(Clone, Copy, Debug)]
enum Victim {
    Follower,
    Leader,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pollers_of_a_paused_follower_over_shm_read_no_stale_value() {
    paused_history("paused-follower", Victim::Follower, FabricChoice::Auto).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pollers_of_a_paused_leader_over_shm_read_no_stale_value() {
    paused_history("paused-leader", Victim::Leader, FabricChoice::Auto).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pollers_of_a_paused_follower_over_soft_read_no_stale_value() {
    paused_history(
        "paused-follower-soft",
        Victim::Follower,
        FabricChoice::Cluster(rdkv_fabric::Backend::Soft),
    )
    .await;
}

/// Continues a stopped process however the test ends: a failed assertion must not leave a
/// node stopped.
struct ContinueOnDrop(nix::unistd::Pid);

impl Drop for ContinueOnDrop {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(self.0, Signal::SIGCONT);
    }
}

/// What the clients saw: events, and how many lists the pollers refused by the lease word.
#[derive(Default)]
struct Seen {
    events: Vec<Event>,
    lease_refusals: u64,
    failed: u64,
}

async fn paused_history(tag: &str, victim: Victim, fabric: FabricChoice) {
    let _serial = SERIAL.lock().await;
    let settled = up_settled(tag, 3).await;
    let victim = match victim {
        Victim::Follower => settled.follower(),
        Victim::Leader => settled.leader,
    };
    let (cluster, nodes, secret, ids, _, _) = settled.parts();
    let observer = *ids.iter().find(|id| **id != victim).expect("another node");
    let primary_was_victim: Vec<bool> = (0..KEYS)
        .map(|key| {
            let replicas = sharding::replicas(format!("key-{key}").as_bytes(), &ids, 2);
            ids[replicas[0]] == victim
        })
        .collect();
    assert!(primary_was_victim.iter().any(|was| *was));
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for writer in 0..WRITERS {
        let client = ClientBuilder::cluster_file(&cluster.file)
            .fabric(fabric)
            .build()
            .expect("client");
        client.connect_all().await.expect("connect");
        tasks.push(tokio::spawn(write_loop(
            client,
            writer,
            start,
            stop.clone(),
        )));
    }
    for key in 0..KEYS {
        let client = ClientBuilder::cluster_file(&cluster.file)
            .fabric(fabric)
            .build()
            .expect("client");
        tasks.push(tokio::spawn(poll_loop(client, key, start, stop.clone())));
    }

    tokio::time::sleep(Duration::from_secs(2)).await;
    let pid = pid_of(&cluster, victim);
    let _continue = ContinueOnDrop(pid);
    nix::sys::signal::kill(pid, Signal::SIGSTOP).expect("SIGSTOP the node");
    let paused = Instant::now();
    wait_for(&nodes, &secret, observer, victim, MemberState::Down).await;
    let down_after = paused.elapsed();
    tokio::time::sleep(PAUSE.saturating_sub(paused.elapsed())).await;
    nix::sys::signal::kill(pid, Signal::SIGCONT).expect("SIGCONT the node");
    let pause_window = (
        paused.duration_since(start).as_nanos() as u64,
        start.elapsed().as_nanos() as u64,
    );
    wait_for(&nodes, &secret, observer, victim, MemberState::Serving).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);

    let mut seen = Seen::default();
    for task in tasks {
        let part = task.await.expect("client task");
        seen.events.extend(part.events);
        seen.lease_refusals += part.lease_refusals;
        seen.failed += part.failed;
    }
    let polls_of_victim_keys = seen
        .events
        .iter()
        .filter(|event| primary_was_victim[event.key as usize] && event.operation == Operation::Get)
        .count();
    eprintln!(
        "{} operations in {:?}: node {victim} stopped, down in the view after {down_after:?}; {} lists refused by the lease word, {} operations failed, {polls_of_victim_keys} GETs of its keys",
        seen.events.len(),
        start.elapsed(),
        seen.lease_refusals,
        seen.failed,
    );
    // Operations on keys the paused node holds no copy of should not wait for it (the view
    // fetch returns once a majority answered): printed, not asserted (speed is for benchmarks).
    let slowest_elsewhere = seen
        .events
        .iter()
        .filter(|event| {
            let replicas = sharding::replicas(format!("key-{}", event.key).as_bytes(), &ids, 2);
            !replicas.iter().any(|index| ids[*index] == victim) && event.ret != u64::MAX
        })
        .map(|event| Duration::from_nanos(event.ret - event.call))
        .max()
        .unwrap_or_default();
    eprintln!(
        "the slowest operation on a key with no copy on node {victim}: {slowest_elsewhere:?}"
    );
    // The check must cover the pause: reads of the paused node's keys, and writes, that ran
    // while it was stopped (how many is a matter of speed, which a loaded machine sets).
    let within_pause = |event: &&Event| event.call >= pause_window.0 && event.ret <= pause_window.1;
    let victim_reads_in_pause = seen
        .events
        .iter()
        .filter(within_pause)
        .filter(|event| primary_was_victim[event.key as usize] && event.operation == Operation::Get)
        .count();
    let writes_in_pause = seen
        .events
        .iter()
        .filter(within_pause)
        .filter(|event| event.operation != Operation::Get)
        .count();
    eprintln!(
        "during the pause: {victim_reads_in_pause} GETs of its keys, {writes_in_pause} writes"
    );
    assert!(
        victim_reads_in_pause > 0 && writes_in_pause > 0,
        "the history has no read of the paused node's keys ({victim_reads_in_pause}) or no write \
         ({writes_in_pause}) while it was stopped: nothing was checked"
    );
    assert!(
        down_after > FAILURE_TIMEOUT / 2,
        "the view moved the node's keys after {down_after:?}"
    );
    let verdict = check(&seen.events);
    if let Verdict::Violation { key, .. } = verdict {
        dump_key(tag, key, &seen.events);
    }
    assert_eq!(verdict, Verdict::Linearizable);
}

/// Writes a violating key's history, in call order, to a file under the temporary directory
/// (named in the failure's output) for a reader to find the stale operation.
fn dump_key(tag: &str, key: u64, events: &[Event]) {
    let mut of_key: Vec<&Event> = events.iter().filter(|event| event.key == key).collect();
    of_key.sort_by_key(|event| event.call);
    let text: String = of_key
        .iter()
        .map(|event| {
            format!(
                "{:>12.6} {:>12.6} {:?} -> {:?}\n",
                event.call as f64 / 1e9,
                event.ret as f64 / 1e9,
                event.operation,
                event.outcome
            )
        })
        .collect();
    let path = std::env::temp_dir().join(format!("rdkv-{tag}-violation-key-{key}.txt"));
    let _ = std::fs::write(&path, text);
    eprintln!("the history of key {key}: {}", path.display());
}

/// Waits (30 s at most: a loaded machine) until node `observer`'s view has `victim` in `state`.
async fn wait_for(nodes: &Nodes, secret: &[u8], observer: u32, victim: u32, state: MemberState) {
    wait_for_view(nodes, secret, observer, Duration::from_secs(30), |view| {
        rdkv_integration_tests::view::state_of(view, victim) == Some(state)
    })
    .await
    .unwrap_or_else(|last| panic!("node {observer} never saw node {victim} {state}: {last:?}"));
}

/// One poller: its own client reads one key every [`POLL_INTERVAL`].
async fn poll_loop(client: Client, key: u64, start: Instant, stop: Arc<AtomicBool>) -> Seen {
    let mut seen = Seen::default();
    let key_bytes = format!("key-{key}");
    while !stop.load(Ordering::Relaxed) {
        let call = start.elapsed().as_nanos() as u64;
        let result = client.get(key_bytes.as_bytes()).await;
        let ret = start.elapsed().as_nanos() as u64;
        match result {
            Ok(value) => seen.events.push(Event {
                key,
                operation: Operation::Get,
                outcome: Outcome::Value(decode(value)),
                call,
                ret,
            }),
            Err(_) => seen.failed += 1,
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
    seen.lease_refusals = client.counters().lease_refusals;
    client.close().await;
    seen
}

/// One writer: get, put, delete and compare-and-swap on random keys.
async fn write_loop(client: Client, writer: u64, start: Instant, stop: Arc<AtomicBool>) -> Seen {
    let mut random = rand::rngs::StdRng::seed_from_u64(writer);
    let mut seen = Seen::default();
    let mut counter = 0u64;
    let mix = Mix {
        gets: 30,
        puts: 45,
        deletes: 10,
    };
    while !stop.load(Ordering::Relaxed) {
        counter += 1;
        let key = random.gen_range(0..KEYS);
        let unique = ((writer + 1) << 32) | counter;
        let call = start.elapsed().as_nanos() as u64;
        let (operation, result) =
            random_operation(&client, &mut random, key, unique, &seen.events, mix).await;
        let ret = start.elapsed().as_nanos() as u64;
        match result {
            Ok(outcome) => seen.events.push(Event {
                key,
                operation,
                outcome,
                call,
                ret,
            }),
            Err(error) => {
                seen.failed += 1;
                if error.may_have_applied() {
                    seen.events.push(Event {
                        key,
                        operation,
                        outcome: Outcome::Unknown,
                        call,
                        ret: u64::MAX,
                    });
                }
            }
        }
    }
    client.close().await;
    seen
}

/// With one copy of each key (no backup to move to), a client over `shm` updates a key of a
/// node paused past its lease. Its update would be direct (`docs/protocol.md`, *Direct
/// updates*): it reads the node's lease word before its CAS, finds that the lease no longer
/// covers it, and publishes nothing; the ordinary write is refused by the lease too, so the
/// update fails saying it did not apply, and once the node resumes the key holds the value
/// before it. (An `Ok` would acknowledge a write the view had moved away from; a CAS into the
/// frozen memory would make it appear when the node resumes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_update_of_a_paused_single_copy_node_publishes_nothing() {
    let _serial = SERIAL.lock().await;
    let settled = rdkv_integration_tests::view::up_settled_edited("paused-direct", 3, |text| {
        text.replace("replicas = 2", "replicas = 1")
    })
    .await;
    let victim = settled.follower();
    let (cluster, _nodes, _secret, ids, _, _) = settled.parts();
    let key = (0..)
        .map(|index| format!("paused-direct-{index}").into_bytes())
        .find(|key| sharding::owner(key, &ids).map(|index| ids[index]) == Some(victim))
        .expect("a key of the victim");
    let client = ClientBuilder::cluster_file(&cluster.file)
        .fabric(FabricChoice::Auto)
        .build()
        .expect("client");
    client.put(&key, b"0").await.expect("insert");
    client.get(&key).await.expect("get");
    let before = client.counters();
    client.put(&key, b"1").await.expect("update");
    assert_eq!(
        client.counters().direct_updates,
        before.direct_updates + 1,
        "the update was direct"
    );

    let pid = pid_of(&cluster, victim);
    let _continue = ContinueOnDrop(pid);
    nix::sys::signal::kill(pid, Signal::SIGSTOP).expect("SIGSTOP the node");
    // Past the node's lease (0.9 × failure_timeout), well before the connection's heartbeat
    // gives up on the node.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let before = client.counters();
    let outcome = client.put(&key, b"2").await;
    let after = client.counters();
    nix::sys::signal::kill(pid, Signal::SIGCONT).expect("SIGCONT the node");
    let error = outcome.expect_err("an update of a paused node's key is not acknowledged");
    assert!(!error.may_have_applied(), "{error}");
    assert_eq!(after.direct_updates, before.direct_updates);
    assert!(after.lease_refusals > before.lease_refusals);
    // Resumed and serving again, the node holds the value before the refused update.
    let started = std::time::Instant::now();
    let read = loop {
        match client.get(&key).await {
            Ok(read) => break read,
            Err(error) if started.elapsed() < Duration::from_secs(60) => {
                eprintln!("get after SIGCONT: {error}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => panic!("the key is not readable 60 s after SIGCONT: {error}"),
        }
    };
    assert_eq!(read.as_deref(), Some(&b"1"[..]));
    client.close().await;
}
