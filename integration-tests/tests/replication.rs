//! Surviving a node loss with `replicas = 2` (the example cluster): 10,000 keys written, a node
//! SIGKILLed, every acknowledged write still readable from the survivors after the failover,
//! writes going on meanwhile, the node restarted, refilled from its peers (`filling`, then
//! `serving`) and holding its keys again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rdkv_client::{Client, ClientConfig};
use rdkv_common::protocol::MemberState;
use rdkv_common::sharding;
use rdkv_integration_tests::view::{
    cluster_command, pid_of, signal, state_of, up_settled, wait_for_view, wait_torn_down,
    FAILURE_TIMEOUT,
};

const KEYS: u32 = 10_000;

/// Puts `key-N` = `prefix-N` for every N of `numbers`, from 16 tasks.
async fn write_all(client: &Arc<Client>, numbers: Vec<u32>, prefix: &'static str) {
    let numbers = Arc::new(numbers);
    let mut tasks = Vec::new();
    for task in 0..16usize {
        let client = client.clone();
        let numbers = numbers.clone();
        tasks.push(tokio::spawn(async move {
            for number in numbers.iter().skip(task).step_by(16) {
                client
                    .put(
                        format!("key-{number}").as_bytes(),
                        format!("{prefix}-{number}").as_bytes(),
                    )
                    .await
                    .unwrap_or_else(|error| panic!("put key-{number}: {error}"));
            }
        }));
    }
    for task in tasks {
        task.await.expect("writer task");
    }
}

/// Reads every key and checks it holds `expected(N)`.
async fn read_all(client: &Client, expected: impl Fn(u32) -> String) {
    for number in 0..KEYS {
        let key = format!("key-{number}");
        let value = client
            .get(key.as_bytes())
            .await
            .unwrap_or_else(|error| panic!("get {key}: {error}"));
        assert_eq!(value.as_deref(), Some(expected(number).as_bytes()), "{key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_loses_no_acknowledged_write_and_comes_back_refilled() {
    let settled = up_settled("replication-refill", 3).await;
    let victim = settled.follower();
    let (cluster, nodes, secret, ids, _, leader) = settled.parts();
    let config = rdkv_cluster_config::load(&cluster.file).expect("the cluster file");
    assert_eq!(config.replicas, 2);
    let client = Arc::new(Client::from_file(&cluster.file).expect("client"));
    write_all(&client, (0..KEYS).collect(), "first").await;

    // SIGKILL a node: every key is still there, the dead node's from their second copy.
    let pid = pid_of(&cluster, victim);
    let killed_at = signal(&cluster, victim, Signal::SIGKILL);
    wait_torn_down(pid, Duration::from_secs(10));
    let started = Instant::now();
    let first_of_victim = (0..KEYS)
        .find(|number| client.node_of(format!("key-{number}").as_bytes()) == victim)
        .expect("the victim is some key's primary");
    let value = client
        .get(format!("key-{first_of_victim}").as_bytes())
        .await
        .expect("a read of the dead primary's key waits for the failover");
    let failover = started.elapsed();
    eprintln!(
        "first read of a dead primary's key, from the process's end: {failover:?} (failure_timeout {FAILURE_TIMEOUT:?})"
    );
    assert_eq!(
        value.as_deref(),
        Some(format!("first-{first_of_victim}").as_bytes())
    );
    assert!(
        failover <= FAILURE_TIMEOUT + Duration::from_secs(1),
        "{failover:?}"
    );
    read_all(&client, |number| format!("first-{number}")).await;
    eprintln!(
        "all {KEYS} keys read after the kill in {:?}",
        killed_at.elapsed()
    );

    // Writes go on while the node is away: half the keys get a second value.
    write_all(&client, (0..KEYS).step_by(2).collect(), "second").await;

    // Restart it: it joins filling, copies its keys from its peers, and serves again.
    let restart = cluster_command(&cluster, "restart", Some(victim));
    assert!(
        restart.status.success(),
        "{}",
        String::from_utf8_lossy(&restart.stderr)
    );
    let (serving, _) = wait_for_view(&nodes, &secret, leader, Duration::from_secs(60), |view| {
        state_of(view, victim) == Some(MemberState::Serving)
            && view
                .members
                .iter()
                .all(|member| member.state == MemberState::Serving)
    })
    .await
    .unwrap_or_else(|last| panic!("node {victim} never served again; last view {last:?}"));
    eprintln!("node {victim} serves again at epoch {}", serving.epoch);
    let stats = client
        .cluster_stats()
        .await
        .into_iter()
        .find(|(id, _)| *id == victim)
        .and_then(|(_, stats)| stats.ok())
        .expect("the restarted node's stats");
    eprintln!(
        "refill: {} keys copied, {} of {} buckets scanned",
        stats.refill_keys_copied, stats.refill_buckets_scanned, stats.refill_buckets_total
    );
    assert!(stats.refill_keys_copied > 1_000, "{stats:?}");
    assert_eq!(stats.refill_buckets_scanned, stats.refill_buckets_total);
    let latest = |number: u32| {
        if number % 2 == 0 {
            format!("second-{number}")
        } else {
            format!("first-{number}")
        }
    };
    read_all(&client, latest).await;

    // The restarted node holds every key it is a replica of, itself.
    let node = config
        .nodes
        .iter()
        .find(|node| node.id == victim)
        .expect("the node");
    let mut direct = ClientConfig::new(node.control_address, config.fabric, &config.secret);
    direct.node.id = Some(victim);
    let direct = Client::connect(direct)
        .await
        .expect("a client of the node alone");
    let mut held = 0;
    for number in 0..KEYS {
        let key = format!("key-{number}");
        let replicas: Vec<u32> = sharding::replicas(key.as_bytes(), &ids, config.replicas)
            .into_iter()
            .map(|index| ids[index])
            .collect();
        if !replicas.contains(&victim) {
            continue;
        }
        let value = direct.get(key.as_bytes()).await.expect("direct get");
        assert_eq!(
            value.as_deref(),
            Some(latest(number).as_bytes()),
            "{key} on node {victim}"
        );
        held += 1;
    }
    eprintln!("node {victim} holds its {held} keys");
    assert!(held > KEYS / 2);
    let counters = client.counters();
    eprintln!(
        "client: {} operations, {} failures, {} view refreshes, {} reconnects",
        counters.operations, counters.failures, counters.view_refreshes, counters.reconnects
    );
    assert_eq!(counters.failures, 0);
}

/// A node paused (SIGSTOP) long enough to be committed down comes back with its memory: keys
/// deleted or replaced meanwhile must not come back with it. It rejoins filling, forgets what
/// it held, copies the keys again, and serves the current values. Over soft (a client on
/// another host) and shm (one on the nodes' host).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_back_from_down_with_its_memory_serves_no_stale_or_deleted_value() {
    paused_node_comes_back_clean(
        "replication-paused-soft",
        rdkv_client::FabricChoice::Cluster(rdkv_client::Backend::Soft),
    )
    .await;
}

/// As above, with the client over shm. Every lane of the client to the other nodes is fenced
/// at the view change; the client learns it from each lane's control stream at once (before,
/// it learned it from a failed attempt per lane, each followed by a view fetch that waited
/// 500 ms for the paused node, and the deletes ran out of their 2 s deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_back_from_down_with_its_memory_serves_no_stale_or_deleted_value_over_shm() {
    paused_node_comes_back_clean("replication-paused-shm", rdkv_client::FabricChoice::Shm).await;
}

async fn paused_node_comes_back_clean(tag: &str, fabric: rdkv_client::FabricChoice) {
    let settled = up_settled(tag, 3).await;
    let victim = settled.follower();
    let (cluster, nodes, secret, ids, _, leader) = settled.parts();
    let config = rdkv_cluster_config::load(&cluster.file).expect("the cluster file");
    let client = Arc::new(Client::from_file_with(&cluster.file, fabric).expect("client"));
    // Keys whose primary is the victim.
    let mine: Vec<u32> = (0..2_000)
        .filter(|number| client.node_of(format!("key-{number}").as_bytes()) == victim)
        .take(200)
        .collect();
    write_all(&client, mine.clone(), "first").await;
    let pid = pid_of(&cluster, victim);
    let _resume = rdkv_integration_tests::view::Resume(pid);
    signal(&cluster, victim, Signal::SIGSTOP);
    wait_for_view(&nodes, &secret, leader, Duration::from_secs(10), |view| {
        state_of(view, victim) == Some(MemberState::Down)
    })
    .await
    .expect("the paused node is committed down");
    // While it is away: delete half its keys, replace the other half.
    for (index, number) in mine.iter().enumerate() {
        let key = format!("key-{number}");
        if index % 2 == 0 {
            assert!(
                client.delete(key.as_bytes()).await.expect("delete"),
                "{key}"
            );
        } else {
            client
                .put(key.as_bytes(), format!("second-{number}").as_bytes())
                .await
                .expect("put");
        }
    }
    signal(&cluster, victim, Signal::SIGCONT);
    wait_for_view(&nodes, &secret, leader, Duration::from_secs(30), |view| {
        view.members
            .iter()
            .all(|member| member.state == MemberState::Serving)
    })
    .await
    .expect("the node serves again");
    let expected = |index: usize, number: u32| (index % 2 == 1).then(|| format!("second-{number}"));
    for (index, number) in mine.iter().enumerate() {
        let key = format!("key-{number}");
        let value = client.get(key.as_bytes()).await.expect("get");
        assert_eq!(
            value.as_deref(),
            expected(index, *number).as_deref().map(str::as_bytes),
            "{key} through the cluster"
        );
    }
    // And on the node itself, which is these keys' primary again.
    let node = config
        .nodes
        .iter()
        .find(|node| node.id == victim)
        .expect("the node");
    let mut direct = ClientConfig::new(node.control_address, config.fabric, &config.secret);
    direct.node.id = Some(victim);
    let direct = Client::connect(direct)
        .await
        .expect("a client of the node alone");
    for (index, number) in mine.iter().enumerate() {
        let key = format!("key-{number}");
        assert_eq!(
            direct
                .get(key.as_bytes())
                .await
                .expect("direct get")
                .as_deref(),
            expected(index, *number).as_deref().map(str::as_bytes),
            "{key} on node {victim}"
        );
    }
    let _ = ids;
}
