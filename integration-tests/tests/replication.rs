//! Surviving a node loss with `replicas = 2` (the example cluster): 10,000 keys written, a node
//! SIGKILLed, every acknowledged write still readable from the survivors after the failover,
//! writes going on meanwhile, the node restarted, refilled from its peers (`filling`, then
//! `serving`) and holding its keys again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rdkv_client::{Client, ClientBuilder, ClientConfig};
use rdkv_common::protocol::MemberState;
use rdkv_common::sharding;
use rdkv_integration_tests::view::{
    all_serving, cluster_command, pid_of, signal, state_of, up_settled, up_settled_edited,
    wait_for_view, wait_torn_down, FAILURE_TIMEOUT,
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

/// Checks that node `victim`'s refill scanned all of its peers' index and copied more than
/// `copied` keys.
async fn assert_refilled(client: &Client, victim: u32, copied: u64) {
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
    assert!(stats.refill_keys_copied > copied, "{stats:?}");
    assert_eq!(stats.refill_buckets_scanned, stats.refill_buckets_total);
}

/// Reads every key and checks it holds `expected(N)`.
async fn read_all(client: &Client, expected: impl Fn(u32) -> String) {
    read_all_of(client, KEYS, |number| Some(expected(number))).await;
}

/// Checks `expected` (key, value or none) on node `victim` itself, through a client of that
/// node alone. Under heavy load (seen at a load average of 3.5) a node that has just come back
/// can miss heartbeats again, be committed down and fill once more, and a client of the node
/// alone is refused while it fills. So every read waits for a view with every member serving,
/// and a read that fails (never one that returns a wrong value) waits for that again and
/// reconnects, for up to 60 s in all.
async fn check_on_the_node(
    config: &rdkv_cluster_config::ClusterConfig,
    nodes: &rdkv_integration_tests::view::Nodes,
    secret: &[u8],
    leader: u32,
    victim: u32,
    expected: &[(String, Option<String>)],
) {
    let node = config
        .nodes
        .iter()
        .find(|node| node.id == victim)
        .expect("the node");
    let started = Instant::now();
    let limit = Duration::from_secs(60);
    let mut direct: Option<Client> = None;
    let mut index = 0;
    while index < expected.len() {
        let (key, value) = &expected[index];
        let outcome = match &direct {
            Some(client) => client
                .get(key.as_bytes())
                .await
                .map_err(|error| error.to_string()),
            None => Err("not connected".to_string()),
        };
        match outcome {
            Ok(found) => {
                assert_eq!(
                    found.as_deref(),
                    value.as_deref().map(str::as_bytes),
                    "{key} on node {victim}"
                );
                index += 1;
            }
            Err(error) => {
                assert!(
                    started.elapsed() < limit,
                    "{key} on node {victim}: still failing after {limit:?}: {error}"
                );
                if direct.is_some() {
                    eprintln!("{key} on node {victim}: {error}; waiting for it to serve again");
                }
                wait_for_view(nodes, secret, leader, limit, all_serving)
                    .await
                    .expect("every node serves");
                let mut alone =
                    ClientConfig::new(node.control_address, config.fabric, &config.secret);
                alone.node.id = Some(victim);
                direct = match Client::connect(alone).await {
                    Ok(client) => Some(client),
                    Err(error) => {
                        eprintln!("a client of node {victim} alone: {error}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        None
                    }
                };
            }
        }
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
    // The bound ends a hang: a debug build's refill of some 6,700 keys, with both cores busy,
    // took over a minute.
    let restarted = Instant::now();
    let (serving, _) = wait_for_view(&nodes, &secret, leader, Duration::from_secs(180), |view| {
        state_of(view, victim) == Some(MemberState::Serving) && all_serving(view)
    })
    .await
    .unwrap_or_else(|last| panic!("node {victim} never served again; last view {last:?}"));
    eprintln!(
        "node {victim} serves again at epoch {}, {:?} after its restart",
        serving.epoch,
        restarted.elapsed()
    );
    assert_refilled(&client, victim, 1_000).await;
    let latest = |number: u32| {
        if number % 2 == 0 {
            format!("second-{number}")
        } else {
            format!("first-{number}")
        }
    };
    read_all(&client, latest).await;

    // The restarted node holds every key it is a replica of, itself.
    let mine: Vec<(String, Option<String>)> = (0..KEYS)
        .filter(|number| {
            sharding::replicas(format!("key-{number}").as_bytes(), &ids, config.replicas)
                .into_iter()
                .any(|index| ids[index] == victim)
        })
        .map(|number| (format!("key-{number}"), Some(latest(number))))
        .collect();
    let held = mine.len() as u32;
    check_on_the_node(&config, &nodes, &secret, leader, victim, &mine).await;
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
    let client = Arc::new(
        ClientBuilder::cluster_file(&cluster.file)
            .fabric(fabric)
            .build()
            .expect("client"),
    );
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
    wait_for_view(
        &nodes,
        &secret,
        leader,
        Duration::from_secs(30),
        all_serving,
    )
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
    let expected: Vec<(String, Option<String>)> = mine
        .iter()
        .enumerate()
        .map(|(index, number)| (format!("key-{number}"), expected(index, *number)))
        .collect();
    check_on_the_node(&config, &nodes, &secret, leader, victim, &expected).await;
    let _ = ids;
}

/// The per-node `keys` figures and sweep counters of every node, in id order.
async fn copies_per_node(client: &Client) -> Vec<(u32, u64, u64)> {
    client
        .cluster_stats()
        .await
        .into_iter()
        .map(|(id, stats)| {
            stats.map_or((id, u64::MAX, 0), |stats| {
                (id, stats.keys, stats.extra_copies_removed)
            })
        })
        .collect()
}

/// Waits up to `limit` for the nodes' `keys` to add up to `wanted`; returns the last figures.
async fn wait_for_copies(
    client: &Client,
    wanted: u64,
    limit: Duration,
) -> Result<Vec<(u32, u64, u64)>, Vec<(u32, u64, u64)>> {
    let started = Instant::now();
    loop {
        let figures = copies_per_node(client).await;
        if figures.iter().map(|(_, keys, _)| *keys).sum::<u64>() == wanted {
            return Ok(figures);
        }
        if started.elapsed() > limit {
            return Err(figures);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// While a node is away and while it fills, the writes of its keys also go to the nodes that
/// stand in for it. Once it serves again, those copies are extra: the collectors sweep them,
/// so the nodes hold exactly `replicas` copies of each key again, and deleting every key
/// leaves nothing behind (before the sweep: 21 keys were 55 copies, not 42, and 13 stayed
/// after every key was deleted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refill_leaves_no_extra_copies_behind() {
    const COUNT: u32 = 300;
    let settled = up_settled("replication-sweep", 3).await;
    let victim = settled.follower();
    let (cluster, nodes, secret, _, _, leader) = settled.parts();
    let config = rdkv_cluster_config::load(&cluster.file).expect("the cluster file");
    let replicas = config.replicas as u64;
    let client = Arc::new(Client::from_file(&cluster.file).expect("client"));
    write_all(&client, (0..COUNT).collect(), "first").await;
    let pid = pid_of(&cluster, victim);
    signal(&cluster, victim, Signal::SIGKILL);
    wait_torn_down(pid, Duration::from_secs(10));
    wait_for_view(&nodes, &secret, leader, Duration::from_secs(10), |view| {
        state_of(view, victim) == Some(MemberState::Down)
    })
    .await
    .expect("the killed node is committed down");
    // Written while it is away: its keys go to their stand-ins.
    write_all(&client, (0..COUNT).collect(), "second").await;
    let restart = cluster_command(&cluster, "restart", Some(victim));
    assert!(
        restart.status.success(),
        "{}",
        String::from_utf8_lossy(&restart.stderr)
    );
    wait_for_view(
        &nodes,
        &secret,
        leader,
        Duration::from_secs(60),
        all_serving,
    )
    .await
    .expect("the node serves again");
    let wanted = u64::from(COUNT) * replicas;
    let swept = wait_for_copies(&client, wanted, Duration::from_secs(30))
        .await
        .unwrap_or_else(|last| {
            panic!("the nodes never held exactly {wanted} copies; (node, keys, removed) {last:?}")
        });
    eprintln!("after the refill: (node, keys, extra copies removed) {swept:?}");
    let removed: u64 = swept.iter().map(|(_, _, removed)| *removed).sum();
    assert!(removed > 0, "nothing was swept: {swept:?}");
    read_all_of(&client, COUNT, |number| Some(format!("second-{number}"))).await;
    for number in 0..COUNT {
        assert!(client
            .delete(format!("key-{number}").as_bytes())
            .await
            .expect("delete"));
    }
    // Tombstones count as keys until the collectors clear them, a quarantine later.
    let emptied = wait_for_copies(&client, 0, Duration::from_secs(30))
        .await
        .unwrap_or_else(|last| {
            panic!("keys stayed after every key was deleted; (node, keys, removed) {last:?}")
        });
    eprintln!("after deleting every key: {emptied:?}");
    read_all_of(&client, COUNT, |_| None).await;
}

/// Reads `key-0` to `key-(count - 1)` and checks each holds `expected(N)`.
async fn read_all_of(client: &Client, count: u32, expected: impl Fn(u32) -> Option<String>) {
    for number in 0..count {
        let key = format!("key-{number}");
        let value = client
            .get(key.as_bytes())
            .await
            .unwrap_or_else(|error| panic!("get {key}: {error}"));
        assert_eq!(
            value.as_deref(),
            expected(number).as_deref().map(str::as_bytes),
            "{key}"
        );
    }
}

/// A refill whose scan finds more small blocks in one step than a queue pair's send queue
/// holds (an index of 128 KiB: 8 scan steps of 128 combined buckets, some 340 keys each on a
/// node of 4,000 keys with two copies; a 64-byte block each). A step's block READs went in one
/// list whatever their count, the send queue (256) refused it whole, and the refill started
/// over forever (`restart` never ended). They go in lists of at most 128 now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_refills_a_dense_index_of_small_keys() {
    const SMALL_KEYS: u32 = 4_000;
    let settled = up_settled_edited("replication-dense", 3, |text| {
        assert!(
            text.contains("index_size = \"1M\""),
            "the example's index size"
        );
        text.replace("index_size = \"1M\"", "index_size = \"128K\"")
    })
    .await;
    let victim = settled.follower();
    let (cluster, nodes, secret, _, _, leader) = settled.parts();
    let client = Arc::new(Client::from_file(&cluster.file).expect("client"));
    write_all(&client, (0..SMALL_KEYS).collect(), "small").await;
    let restart = cluster_command(&cluster, "restart", Some(victim));
    assert!(
        restart.status.success(),
        "{}",
        String::from_utf8_lossy(&restart.stderr)
    );
    wait_for_view(&nodes, &secret, leader, Duration::from_secs(120), |view| {
        state_of(view, victim) == Some(MemberState::Serving) && all_serving(view)
    })
    .await
    .unwrap_or_else(|last| panic!("node {victim} never served again; last view {last:?}"));
    assert_refilled(&client, victim, 2_000).await;
    read_all_of(&client, SMALL_KEYS, |number| {
        Some(format!("small-{number}"))
    })
    .await;
}
