//! Attacks on replicated writes, refill and routing (`replicas = 2`, the example cluster with
//! `failure_timeout = "1s"`): a node that was cut off (SIGSTOP) comes back with stale memory,
//! brand-new clients while a node fills. Each test runs its own real cluster, one at a time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rdkv_client::{Client, ClientBuilder};
use rdkv_common::protocol::MemberState;
use rdkv_common::sharding;
use rdkv_integration_tests::view::*;

/// One cluster at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The id of `key`'s primary when every node of `ids` serves.
fn primary_of_all(key: &str, ids: &[u32]) -> u32 {
    ids[sharding::replicas(key.as_bytes(), ids, 2)[0]]
}

/// A node SIGSTOPped past `failure_timeout` is marked down; keys deleted meanwhile get their
/// tombstones on the other replicas only. When it resumes it joins `filling` with its stale
/// memory, refills (the scan skips tombstones), and is promoted: the keys it is primary of
/// must still read as deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_made_while_a_node_was_stopped_stays_deleted_after_it_returns() {
    let _serial = SERIAL.lock().await;
    let settled = up_settled("ra-stop-delete", 3).await;
    let (cluster, nodes, secret, ids, _, leader) = settled.parts();
    // Not the cluster file's first node: a stopped first node stalls every client's view
    // fetch (see `a_stopped_first_node_does_not_stall_every_operation`).
    let victim = *ids[1..]
        .iter()
        .find(|id| **id != leader)
        .expect("a follower after the first");
    let client = Client::from_file(&cluster.file).expect("client");
    let keys: Vec<String> = (0..200).map(|number| format!("key-{number}")).collect();
    for key in &keys {
        client.put(key.as_bytes(), b"before").await.expect("put");
    }
    let stopped = signal(&cluster, victim, Signal::SIGSTOP);
    let _resume = Resume(pid_of(&cluster, victim));
    wait_for_state(&nodes, &secret, leader, victim, MemberState::Down).await;
    eprintln!("node {victim} down after {:?}", stopped.elapsed());
    let started = Instant::now();
    let mut failures = Vec::new();
    for key in &keys {
        loop {
            match client.delete(key.as_bytes()).await {
                Ok(deleted) => {
                    assert!(deleted, "{key}");
                    break;
                }
                Err(error) => {
                    assert!(failures.len() < 20, "{failures:?}");
                    failures.push(format!("{:?} {key}: {error}", started.elapsed()));
                }
            }
        }
    }
    eprintln!(
        "200 deletes in {:?}; {} failed first: {failures:?}",
        started.elapsed(),
        failures.len()
    );
    signal(&cluster, victim, Signal::SIGCONT);
    wait_for_view(
        &nodes,
        &secret,
        leader,
        Duration::from_secs(20),
        rdkv_integration_tests::view::all_serving,
    )
    .await
    .expect("the node serves again");
    // Every client routes by the newest view once it hears of it; give this one a read first.
    let _ = client.get(b"warm-up").await;
    let fresh = Client::from_file(&cluster.file).expect("client");
    fresh.connect_all().await.expect("connect");
    let _ = fresh.get(b"warm-up").await;
    let mut resurrected = Vec::new();
    for key in &keys {
        if let Some(value) = client.get(key.as_bytes()).await.expect("get") {
            resurrected.push((key.clone(), primary_of_all(key, &ids), value));
        }
    }
    eprintln!(
        "{} of {} deleted keys read back after node {victim} returned; first: {:?}",
        resurrected.len(),
        keys.len(),
        resurrected.first()
    );
    assert!(resurrected.is_empty());
}

/// While a restarted node fills, a brand-new client (its routing starts from the cluster
/// file, every node serving, epoch 0) must not read the filling node as a primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_client_does_not_read_a_filling_node() {
    let _serial = SERIAL.lock().await;
    let settled = up_settled("ra-fresh-filling", 3).await;
    let victim = settled.follower();
    let (cluster, nodes, secret, ids, _, leader) = settled.parts();
    let writer = Arc::new(Client::from_file(&cluster.file).expect("client"));
    const KEYS: u32 = 6_000;
    let mut tasks = Vec::new();
    for task in 0..8u32 {
        let writer = writer.clone();
        tasks.push(tokio::spawn(async move {
            for number in (task..KEYS).step_by(8) {
                writer
                    .put(format!("key-{number}").as_bytes(), b"present")
                    .await
                    .expect("put");
            }
        }));
    }
    for task in tasks {
        task.await.expect("writer");
    }
    let victims_keys: Vec<String> = (0..KEYS)
        .map(|number| format!("key-{number}"))
        .filter(|key| primary_of_all(key, &ids) == victim)
        .collect();
    let pid = pid_of(&cluster, victim);
    signal(&cluster, victim, Signal::SIGKILL);
    wait_torn_down(pid, Duration::from_secs(10));
    wait_for_state(&nodes, &secret, leader, victim, MemberState::Down).await;
    let restart = cluster_command(&cluster, "restart", Some(victim));
    assert!(restart.status.success());
    wait_for_view(&nodes, &secret, leader, Duration::from_secs(20), |view| {
        state_of(view, victim) == Some(MemberState::Filling)
    })
    .await
    .expect("the node fills");
    let (mut reads, mut absent, mut errors) = (0, 0, 0);
    let started = Instant::now();
    for key in victims_keys.iter().take(200) {
        if started.elapsed() > Duration::from_secs(15) {
            break;
        }
        let still_filling = view_of(&nodes, &secret, leader)
            .await
            .is_some_and(|view| state_of(&view, victim) == Some(MemberState::Filling));
        if !still_filling {
            break;
        }
        let fresh = Client::from_file(&cluster.file).expect("client");
        match fresh.get(key.as_bytes()).await {
            Ok(Some(_)) => {}
            Ok(None) => absent += 1,
            Err(error) => {
                errors += 1;
                eprintln!("get {key}: {error}");
            }
        }
        reads += 1;
        fresh.close().await;
    }
    eprintln!(
        "{reads} first reads by new clients while node {victim} filled: {absent} read absent, {errors} failed"
    );
    assert!(reads > 0, "the refill ended before any read");
    assert_eq!(absent, 0);
}

/// The cluster file's first node SIGSTOPped (alive, silent: a hung process or a host cut
/// off). Once the view has it down, operations on keys it never held must succeed: the client
/// learns the new epoch from its heartbeats and fetches the view, asking the nodes in file
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "fails at 9068224: over shm the first put after the SIGSTOP times out (2 s) on a key the stopped node never held; at b9b8455 every put timed out (Client::view waited the deadline on the silent first node)"]
async fn a_stopped_first_node_does_not_stall_every_operation() {
    let _serial = SERIAL.lock().await;
    let (cluster, nodes, secret, ids, _, leader) = up_settled("ra-stop-first", 3).await.parts();
    let first = ids[0];
    let observer = *ids.iter().find(|id| **id != first).expect("another node");
    let client = Client::from_file(&cluster.file).expect("client");
    client.connect_all().await.expect("connect");
    // Keys whose two copies are on the other nodes, under every view.
    let others: Vec<String> = (0..400)
        .map(|number| format!("key-{number}"))
        .filter(|key| {
            sharding::replicas(key.as_bytes(), &ids, 2)
                .into_iter()
                .all(|index| ids[index] != first)
        })
        .take(20)
        .collect();
    for key in &others {
        client.put(key.as_bytes(), b"before").await.expect("put");
    }
    let stopped = signal(&cluster, first, Signal::SIGSTOP);
    let _resume = Resume(pid_of(&cluster, first));
    wait_for_state(&nodes, &secret, observer, first, MemberState::Down).await;
    eprintln!(
        "node {first} (the file's first; leader was {leader}) down after {:?}",
        stopped.elapsed()
    );
    // Let every connection's heartbeat report the new epoch (lease_timeout / 3 = 3.3 s).
    tokio::time::sleep(Duration::from_secs(4)).await;
    let started = Instant::now();
    let (mut done, mut failed) = (0, Vec::new());
    for key in others.iter().cycle().take(40) {
        if started.elapsed() > Duration::from_secs(12) {
            break;
        }
        match client.put(key.as_bytes(), b"after").await {
            Ok(()) => done += 1,
            Err(error) => failed.push(format!("{key}: {error}")),
        }
    }
    eprintln!(
        "while node {first} is stopped: {done} puts on keys it never held succeeded, {} failed in {:?}; first: {:?}",
        failed.len(),
        started.elapsed(),
        failed.first()
    );
    assert!(failed.is_empty());
}

/// What one writer task saw: per key, the last value acknowledged and the last one tried.
struct Written {
    acknowledged: Vec<Option<u64>>,
    tried: Vec<u64>,
    errors: Vec<String>,
}

/// Keys each writer task owns (one writer per key: the final value is easy to check).
const OWN_KEYS: usize = 32;

/// `tasks` writers, each with a client of its own, putting increasing numbers into its own
/// keys until `stop`.
fn start_writers(
    file: &std::path::Path,
    tasks: usize,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Written>> {
    (0..tasks)
        .map(|task| {
            let client = Client::from_file(file).expect("client");
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut written = Written {
                    acknowledged: vec![None; OWN_KEYS],
                    tried: vec![0; OWN_KEYS],
                    errors: Vec::new(),
                };
                let mut number = 0u64;
                let begun = Instant::now();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && number < 200_000 {
                    number += 1;
                    let index = (number as usize) % OWN_KEYS;
                    let key = format!("w{task}-{index}");
                    written.tried[index] = number;
                    match client.put(key.as_bytes(), &number.to_le_bytes()).await {
                        Ok(()) => written.acknowledged[index] = Some(number),
                        Err(error) => {
                            if written.errors.len() < 1_000 {
                                written
                                    .errors
                                    .push(format!("{:?} {key}: {error}", begun.elapsed()));
                            }
                        }
                    }
                }
                client.close().await;
                written
            })
        })
        .collect()
}

/// Checks every writer's keys with `reader`: each holds its last acknowledged value or one
/// tried later (a put that failed may have applied). Returns the violations.
async fn check_writers(reader: &Client, writers: Vec<Written>) -> (Vec<String>, Vec<String>) {
    let mut violations = Vec::new();
    let mut errors = Vec::new();
    for (task, written) in writers.into_iter().enumerate() {
        errors.extend(written.errors);
        for index in 0..OWN_KEYS {
            let key = format!("w{task}-{index}");
            let Some(acknowledged) = written.acknowledged[index] else {
                continue;
            };
            let value = reader.get(key.as_bytes()).await.map(|value| {
                value.map(|bytes| {
                    let mut word = [0u8; 8];
                    word.copy_from_slice(&bytes[..8]);
                    u64::from_le_bytes(word)
                })
            });
            match value {
                Ok(Some(value)) if value >= acknowledged && value <= written.tried[index] => {}
                other => violations.push(format!(
                    "{key}: read {other:?}, last acknowledged {acknowledged}, last tried {}",
                    written.tried[index]
                )),
            }
        }
    }
    (violations, errors)
}

/// Under writes from 6 clients: a follower killed, restarted, killed again while it fills
/// (its refill cut), restarted; then the leader killed and restarted. Every acknowledged write
/// must survive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kills_during_refill_and_of_the_leader_lose_no_acknowledged_write() {
    let _serial = SERIAL.lock().await;
    let (cluster, nodes, secret, ids, _, leader) = up_settled("ra-kill-refill", 3).await.parts();
    let follower = *ids.iter().find(|id| **id != leader).expect("a follower");
    let other = *ids
        .iter()
        .find(|id| **id != leader && **id != follower)
        .expect("a third node");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let started = Instant::now();
    let writers = start_writers(&cluster.file, 6, stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let kill = |id: u32| {
        let pid = pid_of(&cluster, id);
        signal(&cluster, id, Signal::SIGKILL);
        wait_torn_down(pid, Duration::from_secs(10));
    };
    let restart = |id: u32| {
        let output = cluster_command(&cluster, "restart", Some(id));
        assert!(
            output.status.success(),
            "restart {id}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    kill(follower);
    wait_for_state(&nodes, &secret, leader, follower, MemberState::Down).await;
    eprintln!("{:?}: node {follower} down", started.elapsed());
    restart(follower);
    wait_for_state(&nodes, &secret, leader, follower, MemberState::Filling).await;
    eprintln!(
        "{:?}: node {follower} filling; killed again",
        started.elapsed()
    );
    kill(follower);
    wait_for_state(&nodes, &secret, leader, follower, MemberState::Down).await;
    restart(follower);
    wait_for_state(&nodes, &secret, leader, follower, MemberState::Serving).await;
    eprintln!("{:?}: node {follower} serving", started.elapsed());
    kill(leader);
    wait_for_state(&nodes, &secret, other, leader, MemberState::Down).await;
    eprintln!("{:?}: old leader {leader} down", started.elapsed());
    restart(leader);
    wait_for_state(&nodes, &secret, other, leader, MemberState::Serving).await;
    eprintln!("{:?}: node {leader} serving", started.elapsed());
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut results = Vec::new();
    for writer in writers {
        results.push(writer.await.expect("writer"));
    }
    let acknowledged: usize = results
        .iter()
        .map(|written| written.acknowledged.iter().flatten().count())
        .sum();
    let reader = Client::from_file(&cluster.file).expect("client");
    let (violations, errors) = check_writers(&reader, results).await;
    eprintln!(
        "{:?}: {acknowledged} keys with an acknowledged write; {} put errors; {} violations",
        started.elapsed(),
        errors.len(),
        violations.len()
    );
    for error in errors.iter().take(8) {
        eprintln!("  error: {error}");
    }
    for violation in violations.iter().take(8) {
        eprintln!("  violation: {violation}");
    }
    assert!(violations.is_empty());
}

/// Counters on two hot keys: 12 clients each compare-and-swap `n` → `n + 1` in a loop for a
/// few seconds (contention: locks stolen from writers descheduled past the patience on a busy
/// machine). Each key's final value must equal its successful swaps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contended_counters_count_every_swap_once() {
    let _serial = SERIAL.lock().await;
    let (cluster, ..) = up_settled("ra-counters", 3).await.parts();
    let setup = Client::from_file(&cluster.file).expect("client");
    for key in ["hot-0", "hot-1"] {
        setup
            .put(key.as_bytes(), &0u64.to_le_bytes())
            .await
            .expect("put");
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for task in 0..12u64 {
        let client = Client::from_file(&cluster.file).expect("client");
        tasks.push(tokio::spawn(async move {
            let key = format!("hot-{}", task % 2);
            let (mut swapped, mut unknown, mut errors) = (0u64, 0u64, Vec::new());
            let mut expected = 0u64;
            let mut tries = 0;
            while started.elapsed() < Duration::from_secs(6) && tries < 20_000 {
                tries += 1;
                match client
                    .compare_and_swap(
                        key.as_bytes(),
                        &expected.to_le_bytes(),
                        &(expected + 1).to_le_bytes(),
                    )
                    .await
                {
                    Ok(rdkv_client::CasOutcome::Swapped) => {
                        swapped += 1;
                        expected += 1;
                    }
                    Ok(rdkv_client::CasOutcome::Mismatch(current)) => {
                        let bytes = current.expect("the counter exists");
                        let mut word = [0u8; 8];
                        word.copy_from_slice(&bytes[..8]);
                        expected = u64::from_le_bytes(word);
                    }
                    Err(error) => {
                        if error.may_have_applied() {
                            unknown += 1;
                        }
                        if errors.len() < 5 {
                            errors.push(error.to_string());
                        }
                    }
                }
            }
            let stolen = client.counters().locks_stolen;
            client.close().await;
            (task % 2, swapped, unknown, errors, stolen)
        }));
    }
    let mut swapped = [0u64; 2];
    let mut unknown = [0u64; 2];
    let mut stolen = 0;
    for task in tasks {
        let (key, done, maybe, errors, steals) = task.await.expect("task");
        swapped[key as usize] += done;
        unknown[key as usize] += maybe;
        stolen += steals;
        for error in errors {
            eprintln!("  error: {error}");
        }
    }
    for key in 0..2 {
        let value = setup
            .get(format!("hot-{key}").as_bytes())
            .await
            .expect("get")
            .expect("present");
        let mut word = [0u8; 8];
        word.copy_from_slice(&value[..8]);
        let value = u64::from_le_bytes(word);
        eprintln!(
            "hot-{key}: value {value}, {} swaps acknowledged, {} unknown; {stolen} locks stolen in all",
            swapped[key], unknown[key]
        );
        assert!(value >= swapped[key] && value <= swapped[key] + unknown[key]);
    }
}

/// `replicas = 3` on three nodes: a node killed under writes, restarted and refilled; every
/// acknowledged write survives, and writes go on while it is away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_lose_a_node_and_refill_it() {
    let _serial = SERIAL.lock().await;
    let cluster = rdkv_integration_tests::cluster::Cluster::up_with("ra-three", |text| {
        text.replace("failure_timeout = \"2s\"", "failure_timeout = \"1s\"")
            .replace("replicas = 2 ", "replicas = 3 ")
    });
    let config = rdkv_cluster_config::load(&cluster.file).expect("the cluster file");
    assert_eq!(config.replicas, 3);
    let nodes: Nodes = config
        .nodes
        .iter()
        .map(|node| (node.id, node.control_address))
        .collect();
    let ids: Vec<u32> = nodes.iter().map(|(id, _)| *id).collect();
    let view = wait_settled(&nodes, &config.secret, &ids, Duration::from_secs(20))
        .await
        .expect("settles");
    let leader = view.leader.expect("a leader");
    let victim = *ids.iter().find(|id| **id != leader).expect("a follower");
    let observer = leader;
    let secret = config.secret.clone();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let started = Instant::now();
    let writers = start_writers(&cluster.file, 4, stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = pid_of(&cluster, victim);
    signal(&cluster, victim, Signal::SIGKILL);
    wait_torn_down(pid, Duration::from_secs(10));
    wait_for_state(&nodes, &secret, observer, victim, MemberState::Down).await;
    eprintln!("{:?}: node {victim} down", started.elapsed());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let output = cluster_command(&cluster, "restart", Some(victim));
    assert!(output.status.success());
    wait_for_view(&nodes, &secret, observer, Duration::from_secs(20), |view| {
        state_of(view, victim) == Some(MemberState::Serving)
    })
    .await
    .expect("serving again");
    eprintln!("{:?}: node {victim} serving", started.elapsed());
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut results = Vec::new();
    for writer in writers {
        results.push(writer.await.expect("writer"));
    }
    let reader = Client::from_file(&cluster.file).expect("client");
    let (violations, errors) = check_writers(&reader, results).await;
    eprintln!(
        "{:?}: {} put errors, {} violations",
        started.elapsed(),
        errors.len(),
        violations.len()
    );
    for error in errors.iter().take(8) {
        eprintln!("  error: {error}");
    }
    for violation in violations.iter().take(8) {
        eprintln!("  violation: {violation}");
    }
    assert!(violations.is_empty());
    // The restarted node alone holds the latest values too (every key is on every node).
    let node = config
        .nodes
        .iter()
        .find(|node| node.id == victim)
        .expect("the node");
    let mut direct =
        rdkv_client::ClientConfig::new(node.control_address, config.fabric, &config.secret);
    direct.node.id = Some(victim);
    let direct = Client::connect(direct).await.expect("a client of the node");
    let (mut same, mut differ) = (0, Vec::new());
    for task in 0..4 {
        for index in 0..OWN_KEYS {
            let key = format!("w{task}-{index}");
            let there = direct.get(key.as_bytes()).await.expect("direct get");
            let latest = reader.get(key.as_bytes()).await.expect("get");
            if there == latest {
                same += 1;
            } else {
                let primary = ids[sharding::replicas(key.as_bytes(), &ids, 3)[0]];
                differ.push(format!(
                    "{key} (primary {primary}): {there:?} vs {latest:?}"
                ));
            }
        }
    }
    eprintln!(
        "node {victim} holds {same} keys as the primary does; differs on {}: {:?}",
        differ.len(),
        &differ[..differ.len().min(6)]
    );
    assert!(differ.is_empty());
}

/// A client with a 1 ms deadline cancels its writes at every step (locks left on primaries,
/// backups half written); afterwards a normal client writes and reads every key it touched,
/// without an error, within its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_millisecond_client_leaves_no_key_stuck() {
    let _serial = SERIAL.lock().await;
    let (cluster, ..) = up_settled("ra-one-ms", 3).await.parts();
    let mut config = rdkv_cluster_config::load(&cluster.file).expect("the cluster file");
    config.operation_deadline = Duration::from_millis(1);
    let hasty = Arc::new(
        ClientBuilder::cluster(&config)
            .build()
            .expect("a cluster client"),
    );
    let _ = hasty.connect_all().await;
    let mut tasks = Vec::new();
    for task in 0..4u64 {
        let hasty = hasty.clone();
        tasks.push(tokio::spawn(async move {
            let mut texts = std::collections::BTreeMap::<String, u64>::new();
            for number in 0..400u64 {
                let key = format!("hasty-{}", (number * 7 + task) % 16);
                let outcome = if number % 5 == 4 {
                    hasty.delete(key.as_bytes()).await.map(|_| ())
                } else {
                    hasty.put(key.as_bytes(), &number.to_le_bytes()).await
                };
                if let Err(error) = outcome {
                    *texts.entry(error.to_string()).or_default() += 1;
                }
            }
            texts
        }));
    }
    let mut texts = std::collections::BTreeMap::<String, u64>::new();
    for task in tasks {
        for (text, count) in task.await.expect("task") {
            *texts.entry(text).or_default() += count;
        }
    }
    for (text, count) in &texts {
        eprintln!("  {count} x {text}");
        assert!(!text.contains('\n'), "a multi-line error: {text}");
    }
    let normal = Client::from_file(&cluster.file).expect("client");
    let started = Instant::now();
    let mut failures = Vec::new();
    for key in 0..16 {
        let key = format!("hasty-{key}");
        if let Err(error) = normal.put(key.as_bytes(), b"final").await {
            failures.push(format!("put {key}: {error}"));
            continue;
        }
        match normal.get(key.as_bytes()).await {
            Ok(Some(value)) if value.as_ref() == b"final" => {}
            other => failures.push(format!("get {key}: {other:?}")),
        }
    }
    eprintln!(
        "16 keys rewritten after the hasty client in {:?}: {} failures {failures:?}; {} locks stolen",
        started.elapsed(),
        failures.len(),
        normal.counters().locks_stolen
    );
    assert!(failures.is_empty());
}

/// Deletes and re-puts of 1 KiB values on 4 MiB heaps: tombstones pile up and must be cleared
/// (and their blocks reclaimed) fast enough that the heap never fills. Each key is put and then
/// deleted, so none is read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_heavy_writes_do_not_fill_a_small_heap() {
    let _serial = SERIAL.lock().await;
    let (cluster, ..) = up_settled("ra-tombstones", 3).await.parts();
    let client = Arc::new(Client::from_file(&cluster.file).expect("client"));
    let started = Instant::now();
    let value = vec![7u8; 1_024];
    let mut tasks = Vec::new();
    for task in 0..4u64 {
        let client = client.clone();
        let value = value.clone();
        tasks.push(tokio::spawn(async move {
            let mut errors = Vec::new();
            let mut done = 0u64;
            for number in 0..15_000u64 {
                // Bounded in time (the run's length is not what is checked), but only ever
                // between a key's delete and the next put: a run cut after a put left that key
                // behind, and a loaded machine (fewer operations in the time) cut them at
                // random.
                if number % 2 == 0 && started.elapsed() > Duration::from_secs(20) {
                    break;
                }
                let key = format!("d{task}-{}-{}", (number / 2) % 200, number / 2_000);
                let outcome = if number % 2 == 0 {
                    client.put(key.as_bytes(), &value).await
                } else {
                    client.delete(key.as_bytes()).await.map(|_| ())
                };
                match outcome {
                    Ok(()) => done += 1,
                    Err(error) if errors.len() < 5 => errors.push(error.to_string()),
                    Err(_) => {}
                }
            }
            (done, errors)
        }));
    }
    let mut done = 0;
    let mut errors = Vec::new();
    for task in tasks {
        let (count, texts) = task.await.expect("task");
        done += count;
        errors.extend(texts);
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let all = client.cluster_stats().await;
    for (id, stats) in &all {
        match stats {
            Ok(stats) => eprintln!(
                "node {id}: {} tombstones cleared, {} keys",
                stats.tombstones_cleared, stats.keys
            ),
            Err(error) => eprintln!("node {id}: stats failed: {error}"),
        }
    }
    let cleared: u64 = all
        .into_iter()
        .filter_map(|(_, stats)| stats.ok())
        .map(|stats| stats.tombstones_cleared)
        .sum();
    // Every key was deleted last.
    let mut back = Vec::new();
    for task in 0..4 {
        for index in 0..200 {
            for generation in 0..8 {
                let key = format!("d{task}-{index}-{generation}");
                if let Some(value) = client.get(key.as_bytes()).await.expect("get") {
                    back.push((key, value.len()));
                }
            }
        }
    }
    eprintln!(
        "{done} puts and deletes of 1 KiB in {:?}; {cleared} tombstones cleared; errors: {errors:?}; {} deleted keys read back, first {:?}",
        started.elapsed(),
        back.len(),
        back.first()
    );
    assert!(errors.is_empty(), "{errors:?}");
    assert!(back.is_empty(), "deleted keys read back: {back:?}");
}

/// The example cluster (real processes, clients over shm): 100 keys put and deleted leave 200
/// tombstones, which the collectors clear a quarantine (2.5 s) later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tombstones_are_cleared_on_real_nodes() {
    let _serial = SERIAL.lock().await;
    let (cluster, ..) = up_settled("ra-tombstones-idle", 3).await.parts();
    let client = Client::from_file(&cluster.file).expect("client");
    for index in 0..100u32 {
        client
            .put(format!("gone-{index}").as_bytes(), b"value")
            .await
            .expect("put");
    }
    for index in 0..100u32 {
        assert!(client
            .delete(format!("gone-{index}").as_bytes())
            .await
            .expect("delete"));
    }
    let started = Instant::now();
    let mut last = Vec::new();
    while started.elapsed() < Duration::from_secs(12) {
        last = client
            .cluster_stats()
            .await
            .into_iter()
            .map(|(id, stats)| {
                stats.map_or((id, u64::MAX, u64::MAX), |stats| {
                    (id, stats.tombstones_cleared, stats.keys)
                })
            })
            .collect();
        if last.iter().map(|(_, cleared, _)| *cleared).sum::<u64>() >= 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "after {:?}: (node, tombstones cleared, keys) {last:?}",
        started.elapsed()
    );
    assert!(last.iter().map(|(_, cleared, _)| *cleared).sum::<u64>() >= 200);
}

/// An idle client (its connections made before a view change), over shm and over soft: a
/// follower is killed and the view has it down; the client's next puts, on keys the dead node
/// never held, succeed promptly (the fence of its connections must fail, not hang, an access).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_client_writes_promptly_after_a_view_change() {
    let _serial = SERIAL.lock().await;
    let (cluster, nodes, secret, ids, _, leader) = up_settled("ra-idle-fence", 3).await.parts();
    let victim = *ids.iter().find(|id| **id != leader).expect("a follower");
    let keys: Vec<String> = (0..400)
        .map(|number| format!("key-{number}"))
        .filter(|key| {
            sharding::replicas(key.as_bytes(), &ids, 2)
                .into_iter()
                .all(|index| ids[index] != victim)
        })
        .take(10)
        .collect();
    let mut clients = Vec::new();
    for choice in [
        rdkv_client::FabricChoice::Auto,
        rdkv_client::FabricChoice::Cluster(rdkv_fabric::Backend::Soft),
    ] {
        let client = ClientBuilder::cluster_file(&cluster.file)
            .fabric(choice)
            .build()
            .expect("client");
        client.connect_all().await.expect("connect");
        for key in &keys {
            client.put(key.as_bytes(), b"before").await.expect("put");
        }
        clients.push((format!("{choice:?}"), client));
    }
    let pid = pid_of(&cluster, victim);
    signal(&cluster, victim, Signal::SIGKILL);
    wait_torn_down(pid, Duration::from_secs(10));
    wait_for_state(&nodes, &secret, leader, victim, MemberState::Down).await;
    let mut slow = Vec::new();
    for (name, client) in &clients {
        for key in &keys {
            let started = Instant::now();
            let outcome = client.put(key.as_bytes(), b"after").await;
            let took = started.elapsed();
            if outcome.is_err() || took > Duration::from_millis(500) {
                slow.push(format!("{name} {key}: {took:?} {outcome:?}"));
            }
        }
    }
    eprintln!("slow or failed puts after node {victim} went down: {slow:?}");
    assert!(slow.is_empty());
}
